"""The registry of downloaded, imported and remote models, and their definitions.

Each such model has a folder under `<dataFolderPath>/models` holding its files and a
definition file, `model.json` (schemas/model.json), written atomically and only once
every file is complete and checked. `new_definition()` builds one from the files: its
`engine` is model.yml's, else the engine catalog's (localrt.engines.catalog) for the
files, and its defaults come from model.yml and the GGUF header. A record's `status`
says whether its files are as they were registered (a stat per file: "downloaded",
else "missing" or "damaged", with `status_message` saying which file and what to do),
or a GGUF of it failed the header check (localrt.engines.ggufcheck) when it was last
started: "invalid", until the file changes. `check_files` is that check, before an
engine loads the files. A remote model
(localrt.remote.remotes) has a definition with no files and its `upstreams`, under
`<dataFolderPath>/models/remote/`; their api keys are secrets, which a record never
shows (`api_key_set` says whether one is stored).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from localrt import schemas
from localrt.downloads.tasks import fsync_dir
from localrt.engines.catalog import engine_alias, engine_for_files, weights_file
from localrt.errors import (Conflict, HTTPError, InvalidField, InvalidModelFile,
                            ModelFileMissing, NotFound)
from localrt.fsutil import MOVE_DATA, atomic_write, remove_stale_temps, storage_error
from localrt.engines import ggufcheck, ggufinfo, reasoning
from localrt.engines.onnx import chat_template_of
from localrt.models import roles

log = logging.getLogger(__name__)

DEFINITION = "model.json"
ONNX_CONFIG = "genai_config.json"  # what makes a folder an ONNX model (onnxruntime-genai)
ONNX_TOKENIZER_CONFIG = "tokenizer_config.json"  # its chat template (onnx-runtime reads it)
MAX_TOKENIZER_CONFIG = 16 << 20  # bytes; a larger one is left unread
DEFAULT_CTX_LEN = 4096  # a default ctx_len never above this, whatever the model was trained on
LIST_OMITS = ("chat_template",)  # metadata too big for every row of GET /v1/models
DEFAULT_VERSION = "1"  # a record's version when model.yml gave none, as cortex's model.yml has
# What only a pull or an import sets: a PATCH may repeat the value a model has, and
# any other is a 409 saying what changes it.
FIXED_FIELDS = {"files": "a pull or an import", "engine": "a pull, an import or an engine install",
                "created": "a pull or an import", "owned_by": "a pull or an import",
                "size": "a pull or an import",
                "vetting": "a start (the first load of its files in a child)"}
# A record's status when its files are not as registered, or failed the header check:
# what GET /v1/models and `localrt models list` show instead of "downloaded".
BROKEN = ("missing", "damaged", "invalid")


class ModelNotFound(NotFound):
    code = "model_not_found"


@functools.lru_cache(maxsize=None)  # the schema file does not change while localrt runs
def parameter_names() -> tuple[str, ...]:
    """The stored parameters a model can have: the properties of schemas/model-update.json,
    less the id and a remote model's upstreams (localrt.remote.remotes sets those)."""
    return tuple(k for k in schemas.load("model-update.json")["properties"]
                 if k not in ("id", "upstreams"))


@functools.lru_cache(maxsize=None)
def kept_names() -> tuple[str, ...]:
    """cortex's model.yml fields a definition keeps, typed, without localrt using them:
    the properties of schemas/model-yml.json, less those only localrt sets."""
    return tuple(k for k in schemas.load("model-yml.json")["properties"]
                 if k not in RECORD_FIELDS)


class Registry:
    """The downloaded models, one definition file each, indexed in memory.

    The index is built from the definition files on first use; after that the
    server is their only writer, so reads never touch the disk. A definition holds
    localrt's parameters (schemas/model-update.json) and cortex's model.yml fields
    that localrt keeps without using them (schemas/model-yml.json); a record adds
    what cortex's clients read: `model` (the id again) and `version`.
    """

    def __init__(self, root: Path, validators: schemas.Validators):
        self.root = Path(root)
        self._validators = validators
        # guards _models, _invalid and every definition file write
        self._lock = threading.RLock()
        self._models: dict[str, tuple[Path, dict]] | None = None  # id -> (folder, definition)
        # id -> (its files' (path, size, mtime) when a GGUF of them failed the header
        # check, the check's message): its status is "invalid" while the files are so.
        self._invalid: dict[str, tuple[tuple, str]] = {}
        self._checked = ggufcheck.Checked()  # header checks, by file identity

    def list(self) -> list[dict]:
        """Every model, in the OpenAI list-item shape plus localrt's fields."""
        with self._lock:
            entries = sorted(self._index().items())
        return [self._record(folder, d, brief=True) for _, (folder, d) in entries]

    def get(self, model_id: str) -> dict:
        """One model's record, or ModelNotFound."""
        with self._lock:
            folder, d = self._find(model_id)
        return self._record(folder, d)

    def definition(self, model_id: str) -> dict:
        """A model's definition as stored, secrets included (a remote model's upstream
        keys): for localrt.remote.remotes to use, never for a reply."""
        with self._lock:
            return json.loads(json.dumps(self._find(model_id)[1]))

    def has(self, model_id: str) -> bool:
        """Whether `model_id` is registered."""
        with self._lock:
            return model_id in self._index()

    def broken(self, model_id: str) -> bool:
        """Whether a registered model's status is one of BROKEN: a pull or an import may
        then bring its files again, under the same id."""
        return self.get(model_id)["status"] in BROKEN

    def check_files(self, model_id: str) -> None:
        """Before an engine loads a model's files: a 409 ModelFileMissing when one is gone
        or its size is not the recorded one (deleted or truncated behind localrt's
        back), naming the file and saying to pull or import it again; a 400
        InvalidModelFile when a GGUF of it breaks a rule of localrt.engines.ggufcheck,
        after which its status is "invalid" until the file changes. Each GGUF's outcome
        is kept by its path, size and mtime, so a second start only stats the files."""
        with self._lock:
            folder, d = self._find(model_id)
        signature, _, problem = _files_now(folder, d["files"])
        if problem:
            raise ModelFileMissing(f"Model {model_id} cannot start: {problem}; "
                                   f"{_again(d)}", param="model")
        for f in d["files"]:
            path = folder / f["path"]
            if not f["path"].lower().endswith(".gguf"):
                continue
            try:
                self._checked.check(path, param="model")
            except InvalidModelFile as exc:
                self.mark_invalid(model_id, exc.message, signature)
                raise InvalidModelFile(f"{exc.message}; model {model_id} cannot start",
                                       param="model") from None
            except OSError as exc:
                raise ModelFileMissing(f"Model {model_id} cannot start: its file {path} "
                                       f"cannot be read ({exc.strerror or exc}); "
                                       f"{_again(d)}", param="model") from None

    def mark_invalid(self, model_id: str, message: str, signature: tuple | None = None) -> None:
        """Show `model_id` as "invalid", with `message` (which names the file and why),
        until its files change from `signature` (as they are now when None)."""
        with self._lock:
            folder, d = self._find(model_id)
            if signature is None:
                signature = _files_now(folder, d["files"])[0]
            self._invalid[model_id] = (signature, message)

    def add(self, folder: Path, definition: dict) -> dict:
        """Register a model whose files are complete in `folder`."""
        self.check(definition)
        with self._lock:
            known = self._index().get(definition["id"])
            if known is not None and known[0] != folder:
                raise Conflict(f"A model with id {definition['id']} already exists",
                               param="id")
            self._write(folder, definition)
            self._invalid.pop(definition["id"], None)
        return self._record(folder, definition)

    def update(self, model_id: str, changes: dict) -> dict:
        """Change stored parameters and kept model.yml fields (schemas/model-update.json).

        The id (`id`, or cortex's `model`) cannot change: another is a 400. FIXED_FIELDS
        change only through a pull or an import: another value is a 409.
        """
        for key in ("id", "model"):
            if key in changes and changes[key] != model_id:
                raise InvalidField(f"Invalid field '{key}': a model's id cannot change; "
                                   f"{changes[key]!r} is not {model_id!r}", param=key)
        with self._lock:
            folder, d = self._find(model_id)
            record = self._record(folder, d)
            for key, by in FIXED_FIELDS.items():
                if key in changes and not _same(key, changes[key], record):
                    raise Conflict(f"Model {model_id}'s {key} changes only through {by}, "
                                   f"never an update; it is "
                                   f"{_shown(record[key]) if key in record else 'not set'}",
                                   param=key)
            # A file beside the weights (roles.KEYS), a path to check and link in, is
            # Imports.set_files' to set.
            dropped = ("id", "model", "object", *roles.KEYS, *FIXED_FIELDS)
            updated = {**d, **{k: v for k, v in changes.items() if k not in dropped}}
            self._write(folder, updated)
        return self._record(folder, updated)

    def set_file(self, model_id: str, role: roles.Role, value, entries: list) -> dict:
        """Record `value` under the role's key: the name of a file now in the model's
        folder (its files entry in `entries`), or for a role of `many` the list of
        {"path", "scale"} (the new files' entries in `entries`; an empty list drops the
        key). The files of the ones it replaces are deleted from the folder (a link's
        target never is)."""
        with self._lock:
            folder, d = self._find(model_id)
            old = set(role.names(d))
            new = {e["path"] for e in value} if role.many else {value}
            added = {e["path"] for e in entries}
            files = [f for f in d["files"] if f["path"] not in old | added] + \
                [f for f in d["files"] if f["path"] in old & new - added] + entries
            updated = {**d, "files": files, role.key: value}
            if role.many and not value:
                del updated[role.key]
            self._write(folder, updated)
            # A definition's paths are relative (schemas/model.json); a hand-edited one
            # that leaves the folder is left alone.
            for gone in old - new:
                if not Path(gone).is_absolute() and ".." not in Path(gone).parts:
                    (folder / gone).unlink(missing_ok=True)
        return self._record(folder, updated)

    def set_vetting(self, model_id: str, state: dict) -> dict:
        """Record how the first load of the model's files in a child went
        (localrt.inference.scheduler): `vetting`, {"ok", "build", "reason"?}."""
        with self._lock:
            folder, d = self._find(model_id)
            updated = {**d, "vetting": state}
            self._write(folder, updated)
        return self._record(folder, updated)

    def remove(self, model_id: str) -> None:
        """Forget a model and delete its folder (an imported file's link, never the file).

        The scheduler refuses this for a running model (Scheduler.not_running)."""
        with self._lock:
            folder, _ = self._find(model_id)
            # The definition goes first: a crash part-way leaves stray files, never a
            # registered model with missing ones.
            try:
                (folder / DEFINITION).unlink(missing_ok=True)  # or deleted by hand
                if folder.is_dir():
                    fsync_dir(folder)
            except OSError as exc:  # a read-only models folder: the model stays
                raise storage_error(exc, folder, f"delete model {model_id}") from None
            del self._models[model_id]
            self._invalid.pop(model_id, None)
            if _inside(folder, self.root):
                shutil.rmtree(folder, ignore_errors=True)

    def at(self, folder: Path) -> str | None:
        """The id of the model kept in `folder`, if any."""
        with self._lock:
            return next((mid for mid, (f, _) in self._index().items() if f == folder), None)


    def check(self, definition: dict) -> None:
        """Raise InvalidField unless `definition` is a valid model definition."""
        self._validators.validate("model.json", definition)
        names = parameter_names()
        self._validators.validate("model-update.json",
                                  {k: v for k, v in definition.items() if k in names})

    def usable(self, parameters: dict) -> dict:
        """The parameters that pass schemas/model-update.json; the others are logged."""
        out = {}
        for name, value in parameters.items():
            try:
                self._validators.validate("model-update.json", {name: value})
            except InvalidField as exc:
                log.warning("ignoring the stored parameter %s: %s", name, exc.message)
            else:
                out[name] = value
        return out

    def _find(self, model_id: str) -> tuple[Path, dict]:
        found = self._index().get(model_id)
        if found is None:
            raise ModelNotFound(f"Model {model_id} not found; `localrt models list` shows the "
                                f"downloaded models", param="model")
        return found

    def _write(self, folder: Path, definition: dict) -> None:
        data = json.dumps(definition, indent=2, ensure_ascii=False).encode("utf-8") + b"\n"
        try:
            atomic_write(folder / DEFINITION, data)
        except OSError as exc:  # the old definition stays, whole
            raise storage_error(exc, folder, f"write the definition of model "
                                f"{definition['id']}", MOVE_DATA) from None
        self._index()[definition["id"]] = (folder, definition)

    def _index(self) -> dict[str, tuple[Path, dict]]:
        if self._models is None:
            self._models = self._scan()
        return self._models

    def _scan(self) -> dict[str, tuple[Path, dict]]:
        """Read every definition; skip (and log) any that is invalid. A model whose files
        are not as registered is kept (its status says so), unless another folder has the
        same id with its files whole."""
        models: dict[str, tuple[Path, dict]] = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            if DEFINITION not in filenames:
                continue
            dirnames[:] = []  # a model's folder holds no other model
            folder = Path(dirpath)
            remove_stale_temps(folder / DEFINITION)  # a kill mid-write left them
            try:
                d = json.loads((folder / DEFINITION).read_bytes())
                self.check(d)
            except (OSError, ValueError, HTTPError) as exc:
                log.warning("ignoring the model definition in %s: %s", folder, exc)
                continue
            problem = _files_now(folder, d["files"])[2]
            if problem:  # listed as missing or damaged (Registry._record), never dropped
                log.warning("model %s: %s; %s", d["id"], problem, _again(d))
            other = models.get(d["id"])
            if other is not None and (problem or not _files_now(other[0],
                                                                 other[1]["files"])[2]):
                log.warning("ignoring model %s in %s: the id is also used in %s",
                            d["id"], folder, other[0])
            else:
                models[d["id"]] = (folder, _with_embedding(folder, d))
        return models

    def _record(self, folder: Path, d: dict, brief: bool = False) -> dict:
        record = {"id": d["id"], "object": "model", "created": d["created"],
                  "owned_by": d["owned_by"], "model": d["id"]}  # cortex's name for the id
        record.update((k, v) for k, v in d.items() if k not in record)
        record.setdefault("version", DEFAULT_VERSION)
        if brief and "metadata" in d:
            record["metadata"] = {k: v for k, v in d["metadata"].items()
                                  if k not in LIST_OMITS}
        record["size"] = sum(f["size"] for f in d["files"])
        record["path"] = str(folder)
        # Read from the whole metadata: a listing's leaves out the chat template.
        record["capabilities"] = capabilities({**record, "metadata": d.get("metadata")})
        signature, status, problem = _files_now(folder, d["files"])
        with self._lock:
            invalid = self._invalid.get(d["id"])
        if status is None and invalid is not None and invalid[0] == signature:
            status, problem = "invalid", invalid[1]
        record["status"] = status or "downloaded"
        if problem:
            record["status_message"] = f"{problem}; {_again(d)}"
        if "upstreams" in d:  # an upstream's api_key is a secret: a record only says it is set
            record["upstreams"] = [{**{k: v for k, v in u.items() if k != "api_key"},
                                    "api_key_set": bool(u.get("api_key"))}
                                   for u in d["upstreams"]]
        return record


def _with_embedding(folder: Path, d: dict) -> dict:
    """A definition written before pulls and imports recorded metadata.embedding (or, for
    an embedding model, metadata.rerank), with them read from its GGUF's header once
    (kept in memory, and in the file at its next write), so that listing never opens a
    model file."""
    meta = d.get("metadata")
    if not isinstance(meta, dict) or "embedding" in meta and (
            "rerank" in meta or meta["embedding"] is not True):
        return d  # only an embedding model can be a reranker
    weights = weights_path({**d, "path": str(folder)})
    if weights is None or not weights.name.lower().endswith(".gguf"):
        return d
    try:
        header = ggufinfo.read_metadata(weights)
    except (OSError, ggufinfo.GGUFError) as exc:
        log.warning("model %s: its GGUF header cannot be read: %s", d["id"], exc)
        return d
    return {**d, "metadata": {**meta, "embedding": ggufinfo.is_embedding(header),
                              "rerank": ggufinfo.is_rerank(header)}}


def _files_now(folder: Path, files: Iterable[dict]) -> tuple[tuple, str | None, str | None]:
    """(signature, status, problem) of a model's files as they are now, a stat each: the
    signature is each one's (path, size, mtime); the status None, or "missing" or
    "damaged" (a size not the recorded one) with the problem naming the file."""
    signature = []
    for f in files:
        path = folder / f["path"]
        try:
            st = path.stat()
        except OSError:
            return (), "missing", f"its file {path} is missing"
        if st.st_size != f["size"]:
            return (), "damaged", (f"its file {path} has {st.st_size} bytes, not the "
                                   f"{f['size']} it had when it was registered")
        signature.append((f["path"], st.st_size, st.st_mtime_ns))
    return tuple(signature), None, None


def _again(d: dict) -> str:
    """What to do about a model whose files are missing, damaged or invalid."""
    source = d.get("source", {})
    if source.get("type") == "hub":
        return f"pull it again (`localrt pull {d['id']}`) or remove it"
    return (f"import it again (`localrt models import --path {source.get('path', 'PATH')} "
            f"--id {d['id']}`) or remove it")


def _same(key: str, given, record: dict) -> bool:
    """Whether a PATCH's value of a FIXED_FIELDS field is the one the model has: files as
    localrt records them or as their paths (cortex's shape), cortex's engine names too."""
    if key == "files":
        paths = [f["path"] for f in record["files"]]
        return given in (record["files"], paths,
                         [str(Path(record["path"]) / p) for p in paths])
    if key == "engine" and isinstance(given, str):
        given = engine_alias(given) or given
    return given == record.get(key)


def _shown(value) -> str:
    """A record's value for a message: files by their paths."""
    if isinstance(value, list):
        return ", ".join(str(v.get("path", v) if isinstance(v, dict) else v) for v in value)
    return repr(value)


def _inside(folder: Path, root: Path) -> bool:
    folder, root = folder.resolve(), root.resolve()
    return folder != root and root in folder.parents


def capabilities(record: dict) -> list[str]:
    """What a model can be asked for, as GET /v1/models and Ollama's /api/show say:
    ["rerank"] for a reranker (its GGUF pools by rank: metadata.rerank), ["embedding"]
    for another embedding model (its GGUF says so: metadata.embedding; a pull or an
    import records both), ["chat", "vision"] for a GGUF with an image projector,
    ["chat", "audio"] with an audio one, ["chat", "vision", "audio"] with one that has
    both encoders (the capabilities of each file it has beside its weights:
    localrt.models.roles), else ["chat"]; a chat model whose chat template thinks
    (localrt.engines.reasoning) has "reasoning" too, last."""
    meta = record.get("metadata") or {}
    if meta.get("rerank") is True:
        return ["rerank"]
    if meta.get("embedding") is True:
        return ["embedding"]
    out = ["chat"]
    added = [c for r in roles.BESIDE if record.get(r.key) for c in r.capabilities(record)]
    if added:  # files that go with GGUF weights, which llama.cpp loads beside them
        weights = _weights_name(record)
        if weights is not None and weights.lower().endswith(".gguf"):
            out += added
    template = meta.get("chat_template")
    if isinstance(template, str) and reasoning.markers_of(template) is not None:
        out.append("reasoning")
    return out


def weights_path(record: dict) -> Path | None:
    """The file an engine loads for a model record: its GGUF (a split one's first part,
    never a file of another role, such as a projector), else its ONNX model file."""
    found = _weights_name(record)
    return Path(record["path"]) / found if found is not None else None


def _weights_name(definition: dict) -> str | None:
    """The path, in a model's folder, of the file an engine loads (weights_path)."""
    beside = {name for r in roles.BESIDE for name in r.names(definition)}
    return weights_file(f["path"] for f in definition.get("files", ())
                        if roles.role_of(f["path"]) is roles.WEIGHTS
                        and f["path"] not in beside)


# Record fields that model.yml cannot set: localrt's own, and those it derives
# (`model` is the id, as cortex calls it).
RECORD_FIELDS = ("id", "object", "created", "owned_by", "files", "source", "metadata",
                 "path", "size", "status", "engine", "model", "vetting", *roles.KEYS)


def new_definition(model_id: str, owner: str, paths: list[Path], files: list[dict],
                   source: dict, usable: Callable[[dict], dict]) -> dict:
    """A model definition: files and source, plus defaults from model.yml and the weights.

    model.yml's parameters (n_parallel among them), and the cortex fields localrt keeps
    (kept_names: version, mirostat...), are checked like any stored parameter; its
    other fields are kept as they are, so they show.
    Raises ValueError when the weights cannot be read.
    """
    yml = _read_model_yml([p for p in paths if p.name == "model.yml"])
    # When no file name says (a GGUF imported under a name without .gguf), the record
    # names the engine of ONNX folders, as it always has; such a model cannot start.
    engine = engine_alias(str(yml.get("engine", ""))) or \
        engine_for_files(p.name for p in paths) or engine_for_files([ONNX_CONFIG])
    definition = {"id": model_id, "name": model_id, "engine": engine,
                  "created": int(time.time()), "owned_by": owner, "files": files,
                  "source": source}
    ggufs = sorted((p for p in paths if p.name.lower().endswith(".gguf")
                    and roles.role_of(p.name) is roles.WEIGHTS), key=lambda p: p.name)
    if ggufs:  # a split model's metadata is in its first part
        try:
            meta = ggufinfo.model_defaults(ggufs[0])
        except (ggufinfo.GGUFError, OSError) as exc:
            raise ValueError(f"{ggufs[0].name} cannot be read as GGUF: {exc}") from None
        definition["metadata"] = {k: v for k, v in meta.items() if k != "stop"}
        from_weights = {}
        if meta.get("name"):
            from_weights["name"] = meta["name"]
        if isinstance(meta.get("context_length"), int):
            from_weights["ctx_len"] = min(meta["context_length"], DEFAULT_CTX_LEN)
        if meta.get("stop"):
            from_weights["stop"] = meta["stop"]
        definition.update(usable(from_weights))  # the weights are outside input too
    else:
        template = _onnx_template([p for p in paths if p.name == ONNX_TOKENIZER_CONFIG])
        if template:  # what onnx-runtime chats with: capabilities read it (reasoning)
            definition["metadata"] = {"chat_template": template}
    names = parameter_names() + kept_names()
    definition.update(usable({k: v for k, v in yml.items() if k in names}))
    for key, value in yml.items():
        if key not in names and key not in RECORD_FIELDS and isinstance(key, str):
            try:  # YAML has dates and other types that JSON lacks: they become text
                definition[key] = json.loads(json.dumps(value, default=str))
            except ValueError:
                log.warning("ignoring the model.yml field %s: not JSON", key)
    return definition


def _onnx_template(paths: list[Path]) -> str | None:
    """An ONNX folder's chat template (tokenizer_config.json's chat_template), or None
    when it has none, the file is larger than MAX_TOKENIZER_CONFIG or unreadable."""
    if not paths:
        return None
    try:
        if paths[0].stat().st_size > MAX_TOKENIZER_CONFIG:
            return None
        return chat_template_of(json.loads(paths[0].read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


def _read_model_yml(paths: list[Path]) -> dict:
    """The hub's model.yml (cortex's format), or {} when there is none or it is unusable."""
    if not paths:
        return {}
    try:
        text = paths[0].read_text(encoding="utf-8")
    except (OSError, UnicodeError) as exc:
        log.warning("ignoring %s: %s", paths[0], exc)
        return {}
    return yml_mapping(text, str(paths[0]))


def yml_mapping(text: str | None, where: str) -> dict:
    """A YAML file's top-level mapping (safe_load), or {} when it is missing or not one."""
    if not text:
        return {}
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        log.warning("ignoring %s: %s", where, exc)
        return {}
    return data if isinstance(data, dict) else {}
