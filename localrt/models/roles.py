"""Model files by role: what each file of a model is for, and what localrt does with
each kind, in one table (ROLES).

A model has its weights (the file an engine loads as the model: a GGUF, a split GGUF's
first part, an ONNX folder's model) and may have files beside them, each in one role:
today the projector (through which llama.cpp's mtmd reads images and audio) and the
adapters. For each role, its row says how such a file is
  * stored:   `key`, the field of the record (and model.json) that names the file in
              the model's folder; the same name is the field of an import body and of
              a PATCH that give one (schemas/model-import.json, model-yml.json), the
              start option the engine finds its absolute path under (`Engine.load`,
              localrt.engines.contract; `beside` gives them), and the CLI's flag
              (localrt.cli.parser, which sees only the API);
  * found:    `prefix`: a GGUF whose name starts with it is this role's and never the
              weights (`role_of`: a pull's candidates, the registry's weights and
              new_definition's header skip it);
  * pulled:   `pick`, which of a hub revision's files comes along with the model
              (localrt.models.pulls; its reply's message names it by `label`);
  * imported and updated: `check`, of the file an import or a PATCH gives under `key`,
              against the model's weights (a 400 naming `key`); it is linked in, or
              copied with an import's copy, under a name `prefix` finds (`file_name`),
              by localrt.models.imports; a PATCH may give one for a GGUF model at any
              time, and a running model keeps the one it started with (`running_note`,
              the update's message);
  * deleted:  with the model's folder; the one a PATCH replaces is deleted at once
              (Registry.set_file; a link's target never is);
  * shown:    the record's `key` field and its `capability` in the record's
              capabilities (`capabilities_of` reads them from the file itself: a
              projector adds "vision", "audio" or both, by its header); in ps (GET /v1/models/status) its bytes count in the
              running model's memory (the engine's memory(), gguf-cpp's counts them),
              and the row names no file, as it names none of the weights either.
Every role beside the weights goes with GGUF weights (llama.cpp's files); an ONNX
folder takes none.

The weights have a row too, without a key: they are the files no other role claims
(`role_of`); a pull chooses them among the repo's candidates (localrt.models.pulls), an
import checks them (localrt.models.imports, with `check_file`), and only a pull or an
import sets them (FIXED_FIELDS' files, localrt.models.registry).

A role may hold several files: the adapters (LoRA adapter GGUFs, `many`), a list
under `lora` of {"path", "scale"}: each file's name in the folder (or, in an import or a
PATCH, its absolute path) and the scale llama.cpp applies it with when the model starts
(1.0 when left out). A PATCH's list replaces the model's whole list (an empty one drops
them all); an adapter it keeps (its name, or its path in the folder) is not brought in
again. The engine gets them as options["lora"], each with its absolute path, in the
list's order: a request's `lora: [{"id", "scale"}]` names them by their index there
(localrt.engines.llama.adapters). They are never pulled.

A role to come is one more row: a draft model for speculative decoding, with its own
pick (the smallest GGUF of a draft repo) and check (the same vocabulary as the weights).
The CLI's flag, the schemas' fields and the engine's use of the option are what such a
row needs besides.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from localrt.engines import ggufcheck, ggufinfo
from localrt.errors import InvalidField
from localrt.models.ids import quantization

if TYPE_CHECKING:
    from localrt.models.hub import HubFile

@dataclass(frozen=True)
class Role:
    """One role a model's file has: how it is stored, found, pulled, checked and shown."""

    name: str                        # "weights", "projector"
    key: Optional[str]               # the record's field naming its file; None: the weights
    label: str                       # how a message names such a file: "projector"
    noun: str                        # and for short: "projector"
    prefix: Optional[str] = None     # <prefix>*.gguf is this role's file, never the weights
    capability: Optional[str] = None  # what it adds to a record's capabilities
    # What a file of this role adds, by its contents (path -> capabilities); where it
    # is None, `capability` is what any such file adds.
    capabilities_of: Optional[Callable[[Path], tuple]] = None
    # Which of a hub revision's files comes along with the model, or None.
    pick: Optional[Callable[[list], Optional["HubFile"]]] = None
    # The file at a path given for this role, checked against the model's weights
    # (path, weights) -> Path; an InvalidField naming `key` says why not (a role of
    # `many` takes field=, the entry's own field, lora[1].path, for its errors).
    check: Optional[Callable[[str, Path], Path]] = None
    many: bool = False  # a list of {"path", "scale"} under `key`, not one file's name

    def claims(self, path: str) -> bool:
        """Whether a file's name says it is this role's (mmproj*.gguf a projector's)."""
        if self.prefix is None:
            return False
        name = path.lower().rsplit("/", 1)[-1]
        return name.startswith(self.prefix) and name.endswith(".gguf")

    def capabilities(self, record: dict) -> tuple:
        """What the file of this role a record names adds to its capabilities (by the
        file's contents where the role reads them and the record has its folder)."""
        if not self.key or not record.get(self.key):
            return ()
        if self.capabilities_of is not None and record.get("path"):
            return self.capabilities_of(self.path(record))
        return (self.capability,) if self.capability else ()

    def path(self, record: dict) -> Path | None:
        """The file of this role a model record names, or None (the first, for a role
        of `many`)."""
        names = self.names(record)
        return Path(record["path"]) / names[0] if names else None

    def names(self, record: dict) -> list[str]:
        """The names, in the model's folder, of the files of this role a record (or a
        definition) names, in order."""
        value = record.get(self.key) if self.key else None
        if not value:
            return []
        if self.many:
            return [e["path"] for e in value if isinstance(e, dict) and e.get("path")]
        return [value]

    def file_name(self, src: Path, taken: set) -> str:
        """The name a file of this role gets in a model's folder: one that `claims`
        knows (so it is never taken for the weights), and no other file there has."""
        name = src.name if self.claims(src.name) else f"{self.prefix}-{src.name}"
        if not name.lower().endswith(".gguf"):
            name += ".gguf"
        candidate, n = name, 1
        while candidate in taken:
            candidate, n = f"{self.prefix}-{n}-{name}", n + 1
        return candidate

    def invalid(self, reason: str, field: str | None = None) -> InvalidField:
        """A 400 naming this role's field (or `field`, one of its list's: lora[1].path)."""
        field = field or self.key
        return InvalidField(f"Invalid field '{field}': {reason}", param=field)

    @property
    def running_note(self) -> str:
        """What an update that gives a running model a new file of this role adds."""
        these = "these" if self.many else "this one"
        return (f"; it is running with the {self.noun} it started with, and loads {these} "
                f"when it is started again")


# --- the weights -------------------------------------------------------------------------


class BadSource(ValueError):
    """Why a path cannot be taken; localrt.models.imports words it for the request."""


def check_file(src: Path, path: str) -> None:
    """Raise BadSource unless `src` is an absolute path to a readable GGUF file (an
    import's ONNX folder is localrt.models.imports' to check)."""
    if not src.is_absolute():
        raise BadSource(f"{path} is not an absolute path")
    if not src.exists():
        raise BadSource(f"{path} is not a readable file: it does not exist")
    if not src.is_file() or not os.access(src, os.R_OK):
        raise BadSource(f"{path} is not a readable file")
    if not ggufinfo.is_gguf(src):
        raise BadSource(f"{path} is not a GGUF file: its header cannot be read")


# --- the projector ---------------------------------------------------------------------

# The projector a pull takes when a repo holds several (mmproj-F16.gguf, mmproj-Q8_0.gguf...):
# the first quantization here that one has; a projector is small, and one quantized
# harder costs more of what the model sees than it saves.
PROJECTOR_QUANTS = ("F16", "BF16", "Q8_0")


def pick_projector(files: list) -> HubFile | None:
    """The projector that comes with a model: the repo's only one; else the first of
    PROJECTOR_QUANTS it has (by name when two have it); else the largest (by name when two
    are as large), the least quantized, as the choice is then about precision too."""
    found = sorted((f for f in files if PROJECTOR.claims(f.path)), key=lambda f: f.path)
    if len(found) <= 1:
        return found[0] if found else None
    named = {"FP16": "F16"}
    for quant in PROJECTOR_QUANTS:
        preferred = [f for f in found
                     if named.get(quantization(f.path), quantization(f.path)) == quant]
        if preferred:
            return preferred[0]
    return min(found, key=lambda f: (-f.size, f.path))


def check_projector(path: str, model: Path) -> Path:
    """The projector GGUF at `path`, once it is one for images or audio (or both) whose
    output size is the model GGUF's embedding size; else an InvalidField naming
    `mmproj` that says why.

    A projector whose header breaks a rule of localrt.engines.ggufcheck is a 400
    InvalidModelFile naming `mmproj`.
    The sizes are read from both headers, as llama.cpp's mtmd compares them when it
    loads the pair (clip_n_mmproj_embd against the model's input embedding size), for
    each encoder the projector has; a projector type whose output localrt cannot read
    is left to that check at start.
    """
    bad = PROJECTOR.invalid
    src = Path(path)
    if src.is_absolute() and src.is_dir():
        raise bad(f"{path} is a folder, not a projector GGUF file")
    try:
        check_file(src, path)
    except BadSource as exc:
        raise bad(str(exc)) from None
    try:
        found = ggufinfo.projector(src)
    except (OSError, ggufinfo.GGUFError):
        raise bad(f"{path} is not a projector GGUF (mmproj): it has no "
                  f"clip.projector_type") from None
    try:  # its header whole: llama.cpp's mtmd reads it in the server's process
        ggufcheck.check(src, param=PROJECTOR.key)
    except OSError as exc:
        raise bad(f"{path} cannot be read: {exc.strerror or exc}") from None
    if not found.vision and not found.audio:
        raise bad(f"{path} is a {found.type} projector without a vision or an audio "
                  f"encoder (clip.has_vision_encoder, clip.has_audio_encoder); localrt "
                  f"takes images and audio only")
    try:
        meta = ggufinfo.read_metadata(model)
    except (OSError, ggufinfo.GGUFError) as exc:
        raise bad(f"the model's GGUF header cannot be read: {exc}") from None
    wanted = ggufinfo.model_input_size(meta)
    for size, which in ((found.output_size, ""), (found.audio_output_size, "audio ")):
        if size is not None and wanted is not None and size != wanted:
            arch = meta.get("general.architecture", "")
            raise bad(f"the projector {path} gives {which}embeddings of size {size}, "
                      f"but the model {model.name} takes embeddings of size {wanted} "
                      f"({arch}.embedding_length); they are not a pair")
    return src


# Each projector file's header, read once while it stays the same file: (path, size,
# mtime) -> capabilities; a record's capabilities are asked for on every listing.
_SEEN: dict = {}


def projector_capabilities(path: Path) -> tuple:
    """What a projector adds to its model's capabilities, by its header: "vision" for
    an image encoder, "audio" for an audio one (clip.has_audio_encoder), both where it
    has both; "vision" where the header cannot be read (what a projector was before
    audio, left to the model's start to refuse)."""
    try:
        stat = path.stat()
    except OSError:
        return ("vision",)
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _SEEN:
        try:
            found = ggufinfo.projector(path)
            said = tuple(c for c, has in (("vision", found.vision), ("audio", found.audio))
                         if has) or ("vision",)
        except (OSError, ggufinfo.GGUFError):
            said = ("vision",)
        if len(_SEEN) > 256:  # a bound, not a cache policy: headers are cheap to read
            _SEEN.clear()
        _SEEN[key] = said
    return _SEEN[key]
# --- the adapters ----------------------------------------------------------------------

LORA_SCALE = 1.0  # an adapter's scale when an import or a PATCH gives none, as llama-server's


def check_adapter(path: str, model: Path, field: str = "lora") -> Path:
    """The LoRA adapter GGUF at `path`, once its header says it is one (general.type
    "adapter", adapter.type "lora") for the model GGUF's architecture, and each of its
    lora_a/lora_b pairs fits a tensor of the model as llama.cpp's loader demands (it
    refuses the adapter otherwise); else an InvalidField naming `lora` that says why.

    An adapter whose header breaks a rule of localrt.engines.ggufcheck is a 400
    InvalidModelFile naming `lora`. `field` is the one errors name (lora[0].path).
    """
    def bad(reason: str) -> InvalidField:
        return ADAPTER.invalid(reason, field)

    src = Path(path)
    if src.is_absolute() and src.is_dir():
        raise bad(f"{path} is a folder, not a LoRA adapter GGUF file")
    try:
        check_file(src, path)
    except BadSource as exc:
        raise bad(str(exc)) from None
    try:  # its header whole: llama.cpp reads it in the server's process
        ggufcheck.check(src, param=field)
        meta, tensors = ggufinfo.read_tensor_shapes(src)
    except OSError as exc:
        raise bad(f"{path} cannot be read: {exc.strerror or exc}") from None
    except ggufinfo.GGUFError as exc:
        raise bad(f"{path} cannot be read as GGUF: {exc}") from None
    kind, adapter = meta.get("general.type"), meta.get("adapter.type")
    if kind != "adapter" or adapter != "lora":
        said = f"general.type is {kind!r}" if kind != "adapter" else \
            f"adapter.type is {adapter!r}"
        raise bad(f"{path} is not a LoRA adapter GGUF ({said}; a LoRA adapter has "
                  f"general.type 'adapter' and adapter.type 'lora')")
    if not isinstance(meta.get("adapter.lora.alpha"), (int, float)):
        raise bad(f"{path} has no adapter.lora.alpha, which llama.cpp reads")
    try:
        model_meta, weights = ggufinfo.read_tensor_shapes(model)
    except (OSError, ggufinfo.GGUFError) as exc:
        raise bad(f"the model's GGUF header cannot be read: {exc}") from None
    arch, wanted = meta.get("general.architecture"), model_meta.get("general.architecture")
    if arch != wanted:
        raise bad(f"the adapter {path} is for the {arch} architecture, but the model "
                  f"{model.name} is {wanted} (general.architecture); they are not a pair")
    problem = _adapter_shapes(tensors, weights)
    if problem:
        raise bad(f"the adapter {path} does not fit the model {model.name}: {problem}")
    return src


def _adapter_shapes(tensors: dict, weights: dict) -> str | None:
    """Why an adapter's tensors do not fit the model's, as llama.cpp's adapter loader
    checks them (llama_adapter_lora_init), or None: each tensor is a lora_a or lora_b
    (or a norm, which it skips), in pairs, of a tensor the model has, the pair's shapes
    those of that tensor (ggml order: a is {n_in, rank}, b {rank, n_out}; a token
    embedding's pair the other way round)."""
    pairs: dict[str, dict] = {}
    for name, dims in tensors.items():
        base, dot, part = name.rpartition(".")
        if part in ("lora_a", "lora_b"):
            pairs.setdefault(base, {})[part] = dims
        elif not name.endswith("_norm.weight"):
            return f"its tensor {name} is neither a lora_a nor a lora_b"
    if not pairs:
        return "it has no lora_a/lora_b tensors"
    for base, pair in sorted(pairs.items()):
        if len(pair) < 2:
            return f"{base} has only its {next(iter(pair))}"
        target = weights.get(base)
        if target is None:
            return f"the model has no tensor {base}"
        a, b = pair["lora_a"], pair["lora_b"]
        if len(a) < 2 or len(b) < 2 or len(target) < 2:
            return f"{base}'s lora_a and lora_b are not matrices"
        if base.endswith("token_embd.weight"):
            fits = target[0] == b[1] and target[1] == a[1]
        else:
            fits = target[0] == a[0] and target[1] == b[1] and a[1] == b[0]
        if not fits:
            return (f"{base} is {list(target)} in the model, and its lora_a {list(a)} and "
                    f"lora_b {list(b)} do not make that shape")
    return None


# --- the table -------------------------------------------------------------------------

WEIGHTS = Role("weights", key=None, label="model", noun="model")
PROJECTOR = Role("projector", key="mmproj", label="projector", noun="projector",
                 prefix="mmproj", capability="vision", pick=pick_projector,
                 check=check_projector, capabilities_of=projector_capabilities)
ADAPTER = Role("adapter", key="lora", label="LoRA adapter", noun="adapters", prefix="lora",
               check=check_adapter, many=True)
# If you add a row, give its key a field in schemas/model-import.json and
# model-yml.json, a flag in localrt.cli.parser, and its use to the engine.
ROLES = (WEIGHTS, PROJECTOR, ADAPTER)
BESIDE = tuple(r for r in ROLES if r.key is not None)  # the files beside the weights
KEYS = tuple(r.key for r in BESIDE)


def role_of(path: str) -> Role:
    """The role a file of a model's folder has by its name: the one that claims it, else
    the weights."""
    return next((r for r in BESIDE if r.claims(path)), WEIGHTS)


def given(body: dict) -> dict[Role, object]:
    """The files an import body or a PATCH gives beside the weights: role -> path (for a
    role of `many`, its list of {"path", "scale"}, each scale filled in: an empty list
    is given too, and drops the role's files)."""
    out = {}
    for r in BESIDE:
        value = body.get(r.key)
        if value is None:
            continue
        if r.many:
            value = [{"path": e["path"], "scale": float(e.get("scale", LORA_SCALE))}
                     for e in value]
        out[r] = value
    return out


def beside(record: dict) -> dict[str, object]:
    """The files a model record names beside its weights, as an engine's start options
    take them: key -> absolute path (for a role of `many`, a list of {"path", "scale"}
    with absolute paths, none when it has none)."""
    out: dict[str, object] = {}
    for r in BESIDE:
        if r.many:
            folder = Path(record["path"])
            entries = [{"path": str(folder / e["path"]),
                        "scale": float(e.get("scale", LORA_SCALE))}
                       for e in record.get(r.key) or () if isinstance(e, dict)]
            if entries:
                out[r.key] = entries
        elif r.path(record) is not None:
            out[r.key] = str(r.path(record))
    return out
