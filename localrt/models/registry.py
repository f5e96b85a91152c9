"""Models: what a model id means, pulling models from the hub, and the registry.

Id shapes, and what each pulls (README "Models" says the same for users):
  <name>, <org>/<name>        a built-in, the repo <org>/<name> (org: modelHubOrg): the
                              branch its main's metadata.yml names as `default`, else
                              its one branch besides main; registered as <name>:<branch>
  <name>:<branch>             that branch of the built-in (404 naming the others)
  <org>/<repo>                a hub repository's GGUF: its only one, else its Q4_K_M
                              one, else a 400 listing them; a repo with no GGUF but
                              ONNX files is pulled whole. Registered as <org>:<repo>:<file>
  <org>/<repo>:<x>            x is a file of the repo, a quantization (Q8_0, any case),
                              or a branch
  <org>:<repo>:<x>            the same: the id a pull registers, so it can be pulled again
  https://<hub>/<org>/<repo>[/tree/<rev>]  the repo (a built-in's branch for modelHubOrg)
  https://<hub>/<org>/<repo>/(blob|resolve)/<rev>/<file>  that file (a built-in's branch)
A split GGUF (-00001-of-00003.gguf) is one model: every part is pulled, the first
loaded. Projector files (mmproj*.gguf) are never the model; one comes along, recorded
as the model's `mmproj`. Ids are checked here before any I/O, so none can escape the
models folder.

Each downloaded or imported model has a folder under `<dataFolderPath>/models`
holding its files and a definition file, `model.json` (schemas/model.json),
written atomically and only once every file is complete and checked. Its `engine`
is model.yml's, else the engine catalog's (localrt.engines.catalog) for the files. A remote
model (localrt.inference.remote) has a definition with no files and its `upstreams`, under
`<dataFolderPath>/models/remote/`; their api keys are secrets, which a record never
shows (`api_key_set` says whether one is stored).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable
from urllib.parse import quote, unquote, urlsplit

from localrt import schemas
from localrt.models import ggufinfo
from localrt.downloads.tasks import (DownloadFailed, Downloads, Item, Task, check_disk_space,
                               fsync_dir)
from localrt.engines.catalog import engine_alias, engine_for_files, weights_file
from localrt.errors import (BadRequest, Conflict, HTTPError, InvalidField, NotFound,
                            UpstreamError)
from localrt.fsutil import atomic_write, private_dir
from localrt.models.hub import Hub, HubFile, NotOnHub, RevisionNotOnHub

log = logging.getLogger(__name__)

MAX_ID_BYTES = 255
# Ids that the fixed routes under /v1/models/ shadow (localrt.api.ROUTES): a model
# registered under one could not be read, started or deleted. If you add such a
# route, add its last path segment here.
RESERVED_IDS = ("pull", "import", "start", "stop", "status", "variants", "remote")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")  # hub org, repo and branch names
DEFAULT_QUANT = "Q4_K_M"  # what Ollama's hf.co/... and llama.cpp's -hf take by default
# A quantization in a GGUF file name: Q4_K_M, q8_0, IQ4_XS, TQ1_0, F16, BF16, F32.
_QUANT = re.compile(r"(?<![A-Za-z0-9])(?:[IT]?Q[0-9]+(?:_[A-Za-z0-9]+)*|BF16|F16|F32|FP16|FP32)"
                    r"(?![A-Za-z0-9])", re.IGNORECASE)
_SPLIT = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf\Z", re.IGNORECASE)


@dataclass(frozen=True)
class ModelRef:
    """Where a model id points on the hub, before the hub is asked."""

    repo: str               # "<org>/<repo>"
    revision: str | None    # a branch; None: the repo decides (metadata.yml, or main)
    file: str | None        # an exact file path in the repo
    builtin: bool
    pick: str | None = None  # <x> of <org>/<repo>:<x>: a file, a quantization or a branch

    @property
    def known_id(self) -> str | None:
        """The id a pull of this ref registers, when it is known without the hub."""
        org, name = self.repo.split("/")
        if self.builtin:
            return f"{name}:{self.revision}" if self.revision else None
        if self.file is not None and not _SPLIT.match(self.file):
            return f"{org}:{name}:{self.file}"
        return None


def check_id(model_id: str, param: str = "model") -> str:
    """Reject ids that are empty, too long, or could escape the models folder."""
    if not isinstance(model_id, str) or not model_id.strip():
        raise InvalidField(f"Invalid field '{param}': the model id is empty", param=param)
    if len(model_id.encode("utf-8")) > MAX_ID_BYTES:
        raise InvalidField(f"Invalid field '{param}': the model id is longer than "
                           f"{MAX_ID_BYTES} bytes", param=param)
    if any(ord(c) < 32 or ord(c) == 127 for c in model_id):
        raise InvalidField(f"Invalid field '{param}': the model id holds a control character",
                           param=param)
    if "\\" in model_id:
        raise InvalidField(f"Invalid field '{param}': the model id holds a backslash",
                           param=param)
    if not model_id.startswith(("http://", "https://")):
        if model_id.startswith("/") or model_id.startswith("~"):
            raise InvalidField(f"Invalid field '{param}': the model id is an absolute path",
                               param=param)
        if any(part in (".", "..") for part in re.split(r"[/:]", model_id)):
            raise InvalidField(f"Invalid field '{param}': the model id holds a '.' or '..' "
                               f"segment", param=param)
    return model_id


def check_new_id(model_id: str, param: str = "model") -> str:
    """check_id, and refuse the ids the API's fixed routes shadow, for a model to register."""
    check_id(model_id, param)
    if model_id in RESERVED_IDS:
        raise InvalidField(f"Invalid field '{param}': {model_id!r} cannot be a model id, "
                           f"because /v1/models/{model_id} is another endpoint; choose "
                           f"another id", param=param)
    return model_id


def parse_id(model_id: str, hub_url: str, org: str, param: str = "model") -> ModelRef:
    """Turn a model id of any shape into a ModelRef, or raise InvalidField."""
    check_id(model_id, param)
    if model_id.startswith(("http://", "https://")):
        return _parse_url(model_id, hub_url, org, param)
    parts = model_id.split(":", 2)
    if len(parts) == 3 and "/" not in parts[0] + parts[1]:  # <org>:<repo>:<x>, as registered
        org_name, repo_name = _split_repo(f"{parts[0]}/{parts[1]}", param)
        return _repo_ref(org_name, repo_name, None, _pick(parts[2], param), org)
    head, sep, tail = model_id.partition(":")
    if sep and not tail:
        raise InvalidField(f"Invalid field '{param}': '{model_id}' is not a model id: nothing "
                           f"follows ':'", param=param)
    if "/" in head:
        org_name, repo_name = _split_repo(head, param)
        return _repo_ref(org_name, repo_name, None, _pick(tail, param) if sep else None, org)
    if not _NAME.match(head) or (sep and not _NAME.match(tail)):
        raise InvalidField(f"Invalid field '{param}': '{model_id}' is not a model id; use "
                           f"<name>, <name>:<branch>, <org>/<repo>, <org>/<repo>:<file> or "
                           f"<org>/<repo>:<quantization>", param=param)
    return ModelRef(f"{org}/{head}", tail if sep else None, None, builtin=True)


def _repo_ref(org_name: str, repo_name: str, revision: str | None, pick: str | None,
              builtin_org: str) -> ModelRef:
    """<org>/<repo>[:<pick>]; in the built-ins' org a pick that is no file is a branch."""
    if org_name.lower() == builtin_org.lower() and (pick is None or _NAME.match(pick)) \
            and not (pick or "").lower().endswith(".gguf"):
        return ModelRef(f"{builtin_org}/{repo_name}", pick or revision, None, builtin=True)
    return ModelRef(f"{org_name}/{repo_name}", revision, None, builtin=False, pick=pick)


def _pick(text: str, param: str) -> str:
    if not _safe_relative(text):
        raise InvalidField(f"Invalid field '{param}': {text!r} is not a file, quantization or "
                           f"branch name", param=param)
    return text


def _split_repo(repo: str, param: str) -> tuple[str, str]:
    parts = repo.split("/")
    if len(parts) != 2 or not all(_NAME.match(p) for p in parts):
        raise InvalidField(f"Invalid field '{param}': '{repo}' is not a hub repository "
                           f"shaped <org>/<repo>", param=param)
    return parts[0], parts[1]


def _parse_url(url: str, hub_url: str, builtin_org: str, param: str) -> ModelRef:
    parts, hub = urlsplit(url), urlsplit(hub_url)
    if (parts.scheme, parts.netloc) != (hub.scheme, hub.netloc):
        raise InvalidField(f"Invalid field '{param}': {parts.scheme}://{parts.netloc} is not "
                           f"the configured model hub ({hub_url})", param=param)
    segments = [unquote(s) for s in parts.path.strip("/").split("/")]
    shaped = len(segments) == 2 or (len(segments) == 4 and segments[2] == "tree") or \
        (len(segments) >= 5 and segments[2] in ("blob", "resolve"))
    if not shaped:
        raise InvalidField(f"Invalid field '{param}': expected a URL shaped "
                           f"{hub_url}/<org>/<repo>, {hub_url}/<org>/<repo>/tree/<branch> or "
                           f"{hub_url}/<org>/<repo>/resolve/<revision>/<file>", param=param)
    org_name, repo_name = _split_repo("/".join(segments[:2]), param)
    revision = segments[3] if len(segments) > 3 else None
    if revision is not None and not _safe_relative(revision):
        raise InvalidField(f"Invalid field '{param}': {revision!r} is not a revision",
                           param=param)
    is_builtin_org = org_name.lower() == builtin_org.lower()
    if len(segments) <= 4:  # the repo, or one branch of it
        return ModelRef(f"{org_name}/{repo_name}", revision, None, builtin=is_builtin_org)
    if is_builtin_org and revision != "main":  # a file of a built-in's branch: that branch
        return ModelRef(f"{org_name}/{repo_name}", revision, None, builtin=True)
    file = "/".join(segments[4:])
    check_id(file, param)
    return ModelRef(f"{org_name}/{repo_name}", revision, file, builtin=False)


# --- the registry ----------------------------------------------------------------

DEFINITION = "model.json"
ONNX_CONFIG = "genai_config.json"  # what makes a folder an ONNX model (onnxruntime-genai)
DEFAULT_CTX_LEN = 4096  # a default ctx_len never above this, whatever the model was trained on
SKIPPED_FILES = (".gitattributes",)  # repo files a pull leaves on the hub
LIST_OMITS = ("chat_template",)  # metadata too big for every row of GET /v1/models
DEFAULT_VERSION = "1"  # a record's version when model.yml gave none, as cortex's model.yml has
# What only a pull or an import sets: a PATCH may repeat the value a model has, and
# any other is a 409 saying what changes it.
FIXED_FIELDS = {"files": "a pull or an import", "engine": "a pull, an import or an engine install",
                "created": "a pull or an import", "owned_by": "a pull or an import",
                "size": "a pull or an import"}


class ModelNotFound(NotFound):
    code = "model_not_found"


@functools.lru_cache(maxsize=None)  # the schema file does not change while localrt runs
def parameter_names() -> tuple[str, ...]:
    """The stored parameters a model can have: the properties of schemas/model-update.json,
    less the id and a remote model's upstreams (localrt.inference.remote sets those)."""
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
        self._lock = threading.RLock()  # guards _models and every definition file write
        self._models: dict[str, tuple[Path, dict]] | None = None  # id -> (folder, definition)

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
        keys): for localrt.inference.remote to use, never for a reply."""
        with self._lock:
            return json.loads(json.dumps(self._find(model_id)[1]))

    def has(self, model_id: str) -> bool:
        """Whether `model_id` is registered."""
        with self._lock:
            return model_id in self._index()

    def add(self, folder: Path, definition: dict) -> dict:
        """Register a model whose files are complete in `folder`."""
        self.check(definition)
        with self._lock:
            known = self._index().get(definition["id"])
            if known is not None and known[0] != folder:
                raise Conflict(f"A model with id {definition['id']} already exists",
                               param="id")
            self._write(folder, definition)
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
                                   f"never an update; it is {_shown(record[key])}",
                                   param=key)
            dropped = ("id", "model", "object", *FIXED_FIELDS)
            updated = {**d, **{k: v for k, v in changes.items() if k not in dropped}}
            self._write(folder, updated)
        return self._record(folder, updated)

    def remove(self, model_id: str) -> None:
        """Forget a model and delete its folder (an imported file's link, never the file).

        The scheduler refuses this for a running model (Scheduler.not_running)."""
        with self._lock:
            folder, _ = self._find(model_id)
            # The definition goes first: a crash part-way leaves stray files, never a
            # registered model with missing ones.
            (folder / DEFINITION).unlink(missing_ok=True)  # or deleted by hand
            if folder.is_dir():
                fsync_dir(folder)
            del self._models[model_id]
            if _inside(folder, self.root):
                shutil.rmtree(folder, ignore_errors=True)

    def at(self, folder: Path) -> str | None:
        """The id of the model kept in `folder`, if any."""
        with self._lock:
            return next((mid for mid, (f, _) in self._index().items() if f == folder), None)

    def folder_of(self, model_id: str) -> Path:
        """The folder holding a registered model's files."""
        with self._lock:
            return self._find(model_id)[0]

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
        atomic_write(folder / DEFINITION, data)
        self._index()[definition["id"]] = (folder, definition)

    def _index(self) -> dict[str, tuple[Path, dict]]:
        if self._models is None:
            self._models = self._scan()
        return self._models

    def _scan(self) -> dict[str, tuple[Path, dict]]:
        """Read every definition; skip (and log) any that is invalid or whose files are not."""
        models: dict[str, tuple[Path, dict]] = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            if DEFINITION not in filenames:
                continue
            dirnames[:] = []  # a model's folder holds no other model
            folder = Path(dirpath)
            try:
                d = json.loads((folder / DEFINITION).read_bytes())
                self.check(d)
            except (OSError, ValueError, HTTPError) as exc:
                log.warning("ignoring the model definition in %s: %s", folder, exc)
                continue
            problem = _incomplete(folder, d["files"])
            if problem:
                log.warning("ignoring model %s: %s", d["id"], problem)
            elif d["id"] in models:
                log.warning("ignoring model %s in %s: the id is also used in %s",
                            d["id"], folder, models[d["id"]][0])
            else:
                models[d["id"]] = (folder, d)
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
        if "upstreams" in d:  # an upstream's api_key is a secret: a record only says it is set
            record["upstreams"] = [{**{k: v for k, v in u.items() if k != "api_key"},
                                    "api_key_set": bool(u.get("api_key"))}
                                   for u in d["upstreams"]]
        return record


def _incomplete(folder: Path, files: Iterable[dict]) -> str | None:
    """Why a model's files are not all there, or None."""
    for f in files:
        path = folder / f["path"]
        try:
            size = path.stat().st_size
        except OSError:
            return f"{path} is missing"
        if size != f["size"]:
            return f"{path} has {size} bytes, not {f['size']}"
    return None


def _same(key: str, given, record: dict) -> bool:
    """Whether a PATCH's value of a FIXED_FIELDS field is the one the model has: files as
    localrt records them or as their paths (cortex's shape), cortex's engine names too."""
    if key == "files":
        paths = [f["path"] for f in record["files"]]
        return given in (record["files"], paths,
                         [str(Path(record["path"]) / p) for p in paths])
    if key == "engine" and isinstance(given, str):
        given = engine_alias(given) or given
    return given == record[key]


def _shown(value) -> str:
    """A record's value for a message: files by their paths."""
    if isinstance(value, list):
        return ", ".join(str(v.get("path", v) if isinstance(v, dict) else v) for v in value)
    return repr(value)


def _inside(folder: Path, root: Path) -> bool:
    folder, root = folder.resolve(), root.resolve()
    return folder != root and root in folder.parents


# --- pulling and importing --------------------------------------------------------


@dataclass
class _Plan:
    """What a pull will fetch, and where it goes."""

    ref: ModelRef           # resolved: revision set, file set for a single model file
    local_id: str
    task_id: str
    folder: Path
    items: list
    mmproj: str | None = None  # the projector's path in the folder, if one comes along
    name: str | None = None    # the display name the pull asked for


@dataclass(frozen=True)
class _Candidate:
    """One model among a repo's GGUF files: a file, or every part of a split one."""

    parts: tuple            # HubFile, in part order
    quant: str | None

    @property
    def path(self) -> str:
        return self.parts[0].path

    @property
    def size(self) -> int:
        return sum(f.size for f in self.parts)

    def choice(self, repo: str) -> dict:
        """How the API lists it when a choice is needed."""
        return {"id": f"{repo}:{self.path}", "file": self.path, "size": self.size,
                "quantization": self.quant, "parts": len(self.parts)}


class Models:
    """Pulls models from the hub and imports local files into the registry."""

    def __init__(self, settings, config, downloads: Downloads, registry: Registry):
        self._settings = settings
        self._config = config
        self.downloads = downloads
        self.registry = registry
        self._lock = threading.Lock()  # guards _importing
        self._importing: set[str] = set()  # ids of imports under way

    def pull(self, model_id: str, file: str | None = None, as_id: str | None = None,
             name: str | None = None) -> dict:
        """Start downloading a model; or say it is already downloaded.

        `as_id` and `name` (cortex's `id` and `name`) are the id to register it as,
        instead of the one `model_id` gives, and its display name.
        """
        ref = self._parse(model_id)
        if as_id is not None:
            check_new_id(as_id, "id")
        if file is not None:
            if ref.builtin or ref.file is not None or ref.pick is not None:
                raise InvalidField("Invalid field 'file': a file can only be chosen for an "
                                   "<org>/<repo> model", param="file")
            ref = ModelRef(ref.repo, ref.revision, check_id(file, "file"), builtin=False)
        if ref.builtin and ref.revision is None:  # "pull", "status": never worth a hub call
            check_new_id(ref.repo.split("/")[1])
        if ref.known_id is not None and as_id is None:  # known before asking the hub
            check_new_id(ref.known_id)
            done = self._already(ref.known_id, _task_id(ref))
            if done:
                return done
        hub = self._hub()
        plan = self._plan(ref, hub)
        if as_id is None:
            check_new_id(plan.local_id)  # the file name chosen on the hub is part of it
        else:
            plan.local_id = as_id
            if self.registry.has(as_id) and self.registry.at(plan.folder) != as_id:
                raise Conflict(f"A model with id {as_id} already exists; choose another id",
                               param="id")
        plan.name = name
        done = self._already(plan.local_id, plan.task_id)
        if done:
            return done
        other = self.registry.at(plan.folder)
        if other is not None:  # e.g. one file pulled as <org>/<repo> and by its URL
            return {"message": f"Model {plan.local_id} is already downloaded as {other}",
                    "model": other}
        # A gated repository lists its files to anyone and refuses their bytes: ask for one
        # byte of the largest now, so the answer is a clear 403 and not a failed task.
        largest = max(plan.items, key=lambda item: item.size)
        hub.check_access(plan.ref.repo, plan.ref.revision, largest.id)
        task = Task(plan.task_id, "Model", plan.items, hub_url=hub.url,
                    on_success=lambda task: self._register(plan))
        self.downloads.start(task)
        return {"message": f"Model {plan.local_id} starts downloading", "model": plan.local_id,
                "task": task.to_dict()}

    def variants(self, model_id: str) -> dict:
        """What a pull of `model_id` can choose from: a built-in's branches, or a repo's
        GGUF models, with sizes; `default` is what a pull without a choice takes."""
        ref = self._parse(model_id)
        hub = self._hub()
        org, name = ref.repo.split("/")
        if ref.builtin and ref.revision is None:
            branches = [b for b in hub.branches(ref.repo) if b != "main"]
            default = self._default_branch(ref, hub, branches)
            data = [{"id": f"{name}:{b}", "name": b, "default": b == default,
                     "size": sum(f.size for f in hub.files(ref.repo, b))} for b in branches]
            return {"object": "list", "model": model_id, "repo": ref.repo, "kind": "branches",
                    "default": default and f"{name}:{default}", "data": data}
        if ref.builtin or ref.file is not None or ref.pick is not None:
            raise InvalidField(f"Invalid field 'model': {model_id} names one model already; "
                               f"there is nothing to choose", param="model")
        revision = ref.revision or "main"
        candidates = _candidates(self._listing(ref.repo, revision, hub))
        chosen = _default_candidate(candidates)
        data = [{**c.choice(ref.repo), "name": c.path, "default": c is chosen}
                for c in candidates]
        return {"object": "list", "model": model_id, "repo": ref.repo, "kind": "files",
                "default": chosen and f"{ref.repo}:{chosen.path}", "data": data}

    def _parse(self, model_id: str) -> ModelRef:
        return parse_id(model_id, self._settings["modelHubUrl"], self._settings["modelHubOrg"])

    def _hub(self) -> Hub:
        return Hub(self._settings["modelHubUrl"], self._config.get())

    def _already(self, local_id: str, task_id: str) -> dict | None:
        if self.registry.has(local_id):
            return {"message": f"Model {local_id} is already downloaded", "model": local_id}
        if self.downloads.running(task_id):
            raise Conflict(f"Model {local_id} is already downloading (taskId {task_id})",
                           extra={"taskId": task_id, "model": local_id})
        return None

    def _listing(self, repo: str, revision: str, hub: Hub) -> list[HubFile]:
        """A revision's files, less those a pull leaves on the hub; none with an unsafe path."""
        files = [f for f in hub.files(repo, revision) if f.path not in SKIPPED_FILES]
        for f in files:  # the file list is remote input: no path may leave the folder
            if not _safe_relative(f.path):
                raise UpstreamError(f"The model hub listed a file with an unsafe path in "
                                    f"{repo}: {f.path!r}; nothing was downloaded")
        return files

    def _plan(self, ref: ModelRef, hub: Hub) -> _Plan:
        if ref.builtin:
            return self._plan_builtin(ref, hub)
        revision = ref.revision or "main"
        files = self._listing(ref.repo, revision, hub)
        candidates = _candidates(files)
        if ref.file is not None:
            chosen = _by_file(files, candidates, ref.file)
            if chosen is None:
                raise NotFound(f"No file {ref.file} in {ref.repo} at {revision}; its GGUF "
                               f"files: {_listed(candidates)}", param="file")
        elif ref.pick is not None:
            chosen = _by_file(files, candidates, ref.pick) or \
                _one(ref, [c for c in candidates if (c.quant or "").upper() == ref.pick.upper()])
            if chosen is None:
                if ref.pick in hub.branches(ref.repo):
                    return self._plan(ModelRef(ref.repo, ref.pick, None, False), hub)
                raise NotFound(f"No file {ref.pick} in {ref.repo}, nor a quantization or "
                               f"branch of that name; its GGUF files: {_listed(candidates)}",
                               param="file")
        elif not candidates:
            if engine_for_files((f.path for f in files), folder=True) is None:
                raise BadRequest(f"{ref.repo} at {revision} has no GGUF or ONNX model files, "
                                 f"so there is nothing localrt can run; nothing was "
                                 f"downloaded", param="model")
            return self._whole(ModelRef(ref.repo, revision, None, False), files, hub,
                               f"{ref.repo.replace('/', ':')}:{revision}")
        else:
            chosen = _default_candidate(candidates) or _one(ref, candidates)
        resolved = ModelRef(ref.repo, revision, chosen.path, builtin=False)
        org, name = ref.repo.split("/")
        folder = self.registry.root / _host(hub) / ref.repo / chosen.path.replace("/", "_")
        projector = _projector(files)
        wanted = list(chosen.parts) + ([projector] if projector else [])
        items = [Item(f.path, hub.file_url(ref.repo, revision, f.path),
                      folder / Path(f.path).name, f.size, f.sha256, f.git_oid) for f in wanted]
        return _Plan(resolved, f"{org}:{name}:{chosen.path}", _task_id(resolved), folder,
                     items, projector and Path(projector.path).name)

    def _plan_builtin(self, ref: ModelRef, hub: Hub) -> _Plan:
        name = ref.repo.split("/")[1]
        branch = ref.revision
        if branch is None:
            branches = [b for b in hub.branches(ref.repo) if b != "main"]
            branch = self._default_branch(ref, hub, branches)
            if branch is None and not branches:
                branch = "main"  # a repo that keeps one model on main
            elif branch is None:
                choices = [f"localrt pull {name}:{b}" for b in branches]
                raise BadRequest(f"{name} has {len(branches)} variants and no default; choose "
                                 f"one: {', '.join(f'`{c}`' for c in choices)}",
                                 param="model",
                                 extra={"branches": branches,
                                        "choices": [f"{name}:{b}" for b in branches]})
        try:
            files = self._listing(ref.repo, branch, hub)
        except RevisionNotOnHub:
            others = [b for b in hub.branches(ref.repo) if b != "main"]
            raise NotOnHub(f"No such model on the hub: {name} has no variant {branch}; its "
                           f"variants: {', '.join(others) or 'none'}", param="model",
                           extra={"branches": others}) from None
        candidates = _candidates(files)
        if len(candidates) > 1:  # main holds every quantization: never all of them
            raise BadRequest(f"{ref.repo} holds {len(candidates)} GGUF models on {branch}; "
                             f"pull a variant (`localrt pull {name}:<branch>`) or one file "
                             f"as {ref.repo}:<file>: {_listed(candidates)}", param="model",
                             extra={"files": [c.path for c in candidates]})
        if not candidates and engine_for_files(f.path for f in files) is None:
            raise BadRequest(f"{ref.repo} at {branch} has no GGUF or ONNX model files, so "
                             f"there is nothing localrt can run; nothing was downloaded",
                             param="model")
        return self._whole(ModelRef(ref.repo, branch, None, True), files, hub,
                           f"{name}:{branch}")

    def _whole(self, ref: ModelRef, files: list[HubFile], hub: Hub, local_id: str) -> _Plan:
        """A plan that fetches every file of a revision (a built-in's branch, an ONNX repo)."""
        folder = self.registry.root / _host(hub) / ref.repo / ref.revision
        items = [Item(f.path, hub.file_url(ref.repo, ref.revision, f.path), folder / f.path,
                      f.size, f.sha256, f.git_oid) for f in files]
        projector = _projector(files)
        return _Plan(ref, local_id, _task_id(ref), folder, items,
                     projector and projector.path)

    def _default_branch(self, ref: ModelRef, hub: Hub, branches: list[str]) -> str | None:
        """The branch a built-in's metadata.yml names as default, or its only branch."""
        text = hub.text(ref.repo, "main", "metadata.yml")
        default = _yml_mapping(text, f"{ref.repo}/metadata.yml").get("default")
        if default is not None and str(default) in branches:
            return str(default)
        if default is not None:
            log.warning("%s/metadata.yml names the default branch %r, which does not exist",
                        ref.repo, default)
        return branches[0] if len(branches) == 1 else None

    def _register(self, plan: _Plan) -> None:
        """Once every file is checked: read the defaults, write the definition."""
        org = plan.ref.repo.split("/")[0]
        paths = [item.local_path for item in plan.items]
        files = [{"path": str(item.local_path.relative_to(plan.folder)), "size": item.size,
                  "sha256": item.sha256} for item in plan.items]
        source = {"type": "hub", "url": self._settings["modelHubUrl"], "repo": plan.ref.repo,
                  "revision": plan.ref.revision, "file": plan.ref.file}
        try:
            definition = _definition(plan.local_id, org, paths, files, source,
                                     self.registry.usable)
            if plan.mmproj:
                definition["mmproj"] = plan.mmproj
            if plan.name:
                definition["name"] = plan.name
            other = self.registry.at(plan.folder)
            if other not in (None, plan.local_id):
                raise Conflict(f"its folder already holds the model {other}")
            self.registry.add(plan.folder, definition)
        except ValueError as exc:
            raise DownloadFailed(str(exc)) from None
        except HTTPError as exc:  # another model took the id or folder meanwhile
            raise DownloadFailed(f"Model {plan.local_id} was downloaded but not registered: "
                                 f"{exc.message}") from None

    def import_file(self, path: str, model_id: str | None = None, option: str = "symlink",
                    name: str | None = None, cortex: bool = False) -> dict:
        """Register a local GGUF file or ONNX model folder, linked or copied in.

        The path is checked first, then the id. With `cortex`, the request was
        cortex's {"model", "modelPath"}: errors name those fields, and a path that
        cannot be imported is worded as cortex words it ("Error importing model ...").
        """
        path_field, id_field = ("modelPath", "model") if cortex else ("path", "id")

        def bad_path(reason: str) -> InvalidField:
            if cortex:
                return InvalidField(f"Error importing model path '{path}' with model_id "
                                    f"'{model_id}': {reason}", param=path_field)
            return InvalidField(f"Invalid field '{path_field}': {reason}", param=path_field)

        src = Path(path)
        try:
            _check_source(src, path)
        except _BadSource as exc:
            raise bad_path(str(exc)) from None
        if model_id is None:
            model_id = src.name[:-5] if src.name.lower().endswith(".gguf") else src.name
        check_new_id(model_id, id_field)
        with self._lock:
            if self.registry.has(model_id) or model_id in self._importing:
                raise Conflict(f"A model with id {model_id} already exists", param=id_field)
            self._importing.add(model_id)
        try:
            return self._import(src, model_id, option, name)
        except _BadSource as exc:
            raise bad_path(str(exc)) from None
        finally:
            with self._lock:
                self._importing.discard(model_id)

    def _import(self, src: Path, model_id: str, option: str, name: str | None) -> dict:
        folder = self.registry.root / "imported" / folder_name(model_id)
        shutil.rmtree(folder, ignore_errors=True)  # what a crashed import left
        private_dir(folder)
        target = folder / src.name
        try:
            bring = _import_folder if src.is_dir() else _import_file
            files, paths = bring(src, target, model_id, option)
            source = {"type": "import", "path": str(src), "option": option}
            try:
                definition = _definition(model_id, "local", paths, files, source,
                                         self.registry.usable)
            except ValueError as exc:
                raise _BadSource(str(exc)) from None
            if name:
                definition["name"] = name
            return self.registry.add(folder, definition)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise


class _BadSource(ValueError):
    """Why a path cannot be imported; import_file words it for the request's shape."""


def _check_source(src: Path, path: str) -> None:
    """Raise _BadSource unless `src` is an absolute path to a readable GGUF file or an
    ONNX model folder."""
    if not src.is_absolute():
        raise _BadSource(f"{path} is not an absolute path")
    if src.is_dir():
        if not (src / ONNX_CONFIG).is_file():
            raise _BadSource(f"{path} is a folder without {ONNX_CONFIG}, so not an ONNX model")
    elif not src.exists():
        raise _BadSource(f"{path} is not a readable file: it does not exist")
    elif not src.is_file() or not os.access(src, os.R_OK):
        raise _BadSource(f"{path} is not a readable file")
    elif not ggufinfo.is_gguf(src):
        raise _BadSource(f"{path} is not a GGUF file: its header cannot be read")


def _import_file(src: Path, target: Path, model_id: str, option: str) -> tuple[list, list]:
    """A GGUF file, linked or copied; (files, paths)."""
    if option == "copy":
        check_disk_space(model_id, [Item(src.name, "", target, src.stat().st_size)])
        sha256 = _copy(src, target)
    else:
        _link(src, target)
        sha256 = None
    return [{"path": src.name, "size": target.stat().st_size, "sha256": sha256}], [target]


def _import_folder(src: Path, target: Path, model_id: str, option: str) -> tuple[list, list]:
    """An ONNX model folder, linked or copied file by file; (files, paths)."""
    names = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
    if option == "copy":
        check_disk_space(model_id, [Item(str(n), "", target / n, (src / n).stat().st_size)
                                    for n in names])
        sums = {}
        for n in names:
            private_dir((target / n).parent)
            sums[n] = _copy(src / n, target / n)
    else:
        _link(src, target)
        sums = dict.fromkeys(names)
    files = [{"path": f"{target.name}/{n}", "size": (target / n).stat().st_size,
              "sha256": sums[n]} for n in names]
    return files, [target / n for n in names]


def _link(src: Path, target: Path) -> None:
    """A symlink to `src` at `target`, made whole (via a temporary name and a rename)."""
    link = target.with_name(".import.link")
    os.symlink(src.resolve(), link)
    os.replace(link, target)


def _task_id(ref: ModelRef) -> str:
    """The spec's three-part taskId: <org>:<repo>:<branch or file>."""
    return f"{ref.repo.replace('/', ':')}:{ref.file or ref.revision}"


def folder_name(model_id: str) -> str:
    """A folder name for an imported or remote model: the quoted id, or a digest when that is long."""
    name = quote(model_id, safe="")
    if len(name) <= 120:
        return name
    return "id-" + hashlib.sha256(model_id.encode("utf-8")).hexdigest()[:40]


def _safe_relative(path: str) -> bool:
    """Whether a path from the hub stays inside the folder it is joined to."""
    parts = path.split("/")
    return bool(path) and len(path.encode("utf-8")) <= 1024 and "\\" not in path and \
        not path.startswith("/") and all(p not in ("", ".", "..") for p in parts) and \
        not any(ord(c) < 32 or ord(c) == 127 for c in path)


def _host(hub: Hub) -> str:
    """The models folder's name for a hub: its host and port."""
    return urlsplit(hub.url).netloc.lower().replace(":", "_")


def is_projector(path: str) -> bool:
    """Whether a GGUF file is a vision projector (mmproj*.gguf), never a model to load."""
    name = path.lower().rsplit("/", 1)[-1]
    return name.startswith("mmproj") and name.endswith(".gguf")


def quantization(path: str) -> str | None:
    """The quantization a GGUF file's name says (Q4_K_M, Q8_0, F16...), upper-cased."""
    stem = path.rsplit("/", 1)[-1]
    split = _SPLIT.match(stem)
    stem = split.group(1) if split else stem[:-5] if stem.lower().endswith(".gguf") else stem
    found = _QUANT.findall(stem)
    return found[-1].upper() if found else None


def _candidates(files: list[HubFile]) -> list[_Candidate]:
    """The GGUF models among a revision's files: a split model's parts make one, in part
    order (every part must be listed); projectors are not models."""
    singles, splits = [], {}
    for f in sorted(files, key=lambda f: f.path):
        if not f.path.lower().endswith(".gguf") or is_projector(f.path):
            continue
        m = _SPLIT.match(f.path)
        if m:
            splits.setdefault((m.group(1), m.group(3)), []).append(f)
        else:
            singles.append(_Candidate((f,), quantization(f.path)))
    for (_, total), parts in splits.items():
        if len(parts) != int(total):
            log.warning("%s: %d of %s parts are listed; it is left out", parts[0].path,
                        len(parts), total)
            continue
        singles.append(_Candidate(tuple(parts), quantization(parts[0].path)))
    return sorted(singles, key=lambda c: c.path)


def _default_candidate(candidates: list[_Candidate]) -> _Candidate | None:
    """The model a repo pull takes without a choice: the only one, else the only Q4_K_M."""
    if len(candidates) == 1:
        return candidates[0]
    preferred = [c for c in candidates if c.quant == DEFAULT_QUANT]
    return preferred[0] if len(preferred) == 1 else None


def _one(ref: ModelRef, candidates: list[_Candidate]) -> _Candidate | None:
    """The one candidate, None for none, and a 400 listing them when there are several."""
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    listing = [c.path for c in candidates]
    raise BadRequest(f"{ref.repo} holds {len(candidates)} GGUF models; choose one with "
                     f"\"file\" or as {ref.repo}:<file> or {ref.repo}:<quantization>: "
                     f"{', '.join(listing)}", param="file",
                     extra={"files": listing, "choices": [c.choice(ref.repo) for c in candidates]})


def _by_file(files: list[HubFile], candidates: list[_Candidate], path: str):
    """The candidate that is, or holds, the file `path`; None when no file has that path."""
    for c in candidates:
        if any(f.path == path for f in c.parts):
            return c
    f = next((f for f in files if f.path == path), None)
    if f is None:
        return None
    if is_projector(path):
        raise BadRequest(f"{path} is a vision projector (mmproj), not a model; choose the "
                         f"model file, and its projector comes along", param="file")
    if engine_for_files([path]) is None:
        raise BadRequest(f"{path} is not a GGUF or ONNX model file", param="file")
    return _Candidate((f,), quantization(path))


def _listed(candidates: list[_Candidate]) -> str:
    return ", ".join(c.path for c in candidates) or "none"


def _projector(files: list[HubFile]) -> HubFile | None:
    """The projector that comes with a model: the repo's only one, else its F16 one."""
    found = sorted((f for f in files if is_projector(f.path)), key=lambda f: f.path)
    f16 = [f for f in found if quantization(f.path) == "F16"]
    return (f16 or found or [None])[0]


def weights_path(record: dict) -> Path | None:
    """The file an engine loads for a model record: its GGUF (a split one's first part,
    never a projector), else its ONNX model file."""
    found = weights_file(f["path"] for f in record["files"] if not is_projector(f["path"]))
    return Path(record["path"]) / found if found is not None else None


# Record fields that model.yml cannot set: localrt's own, and those it derives
# (`model` is the id, as cortex calls it).
RECORD_FIELDS = ("id", "object", "created", "owned_by", "files", "source", "metadata",
                 "path", "size", "status", "engine", "mmproj", "model")


def _definition(model_id: str, owner: str, paths: list[Path], files: list[dict],
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
                    and not is_projector(p.name)), key=lambda p: p.name)
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
    names = parameter_names() + kept_names()
    definition.update(usable({k: v for k, v in yml.items() if k in names}))
    for key, value in yml.items():
        if key not in names and key not in RECORD_FIELDS and isinstance(key, str):
            try:  # YAML has dates and other types that JSON lacks: they become text
                definition[key] = json.loads(json.dumps(value, default=str))
            except ValueError:
                log.warning("ignoring the model.yml field %s: not JSON", key)
    return definition


def _read_model_yml(paths: list[Path]) -> dict:
    """The hub's model.yml (cortex's format), or {} when there is none or it is unusable."""
    if not paths:
        return {}
    try:
        text = paths[0].read_text(encoding="utf-8")
    except (OSError, UnicodeError) as exc:
        log.warning("ignoring %s: %s", paths[0], exc)
        return {}
    return _yml_mapping(text, str(paths[0]))


def _yml_mapping(text: str | None, where: str) -> dict:
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


def _copy(src: Path, target: Path) -> str:
    """Copy through a part file, fsync and rename; return the sha256."""
    part = target.with_name(".import.part")
    h = hashlib.sha256()
    with open(src, "rb") as fin, open(part, "wb") as fout:
        while chunk := fin.read(1024 * 1024):
            h.update(chunk)
            fout.write(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    os.replace(part, target)
    fsync_dir(target.parent)
    return h.hexdigest()
