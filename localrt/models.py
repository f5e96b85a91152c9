"""Models: what a model id means, pulling models from the hub, and the registry.

Id shapes (spec 2.4):
  <name>                  built-in repo <org>/<name>, branch main
  <name>:<variant>        built-in repo <org>/<name>, branch <variant>
  <org>/<repo>            a hub repository; the GGUF file is chosen later
  <org>/<repo>:<file>     a hub repository and one file in it
  https://<hub>/<org>/<repo>/(blob|resolve)/<rev>/<file>
Ids are checked here before any I/O, so none can escape the models folder.

Each downloaded or imported model has a folder under `<dataFolderPath>/models`
holding its files and a definition file, `model.json` (schemas/model.json),
written atomically and only once every file is complete and checked.
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

from localrt import ggufinfo, schemas
from localrt.adapters import GGUF_ENGINE, ONNX_ENGINE
from localrt.downloads import (DownloadFailed, Downloads, Item, Task, check_disk_space,
                               fsync_dir)
from localrt.errors import (BadRequest, Conflict, HTTPError, InvalidField, NotFound,
                            UpstreamError)
from localrt.fsutil import atomic_write, private_dir
from localrt.hub import Hub

log = logging.getLogger(__name__)

MAX_ID_BYTES = 255
# Ids that the fixed routes under /v1/models/ shadow (localrt.api.ROUTES): a model
# registered under one could not be read, started or deleted. If you add such a
# route, add its last path segment here.
RESERVED_IDS = ("pull", "import", "start", "stop", "status")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")  # hub org, repo and branch names


@dataclass(frozen=True)
class ModelRef:
    """Where a model id points on the hub."""

    repo: str              # "<org>/<repo>"
    revision: str          # a branch name
    file: str | None       # a file in the repo, or None when the repo decides (built-ins)
    builtin: bool

    @property
    def local_id(self) -> str:
        """The id the model is registered under once pulled."""
        org, name = self.repo.split("/")
        if self.builtin:
            return name if self.revision == "main" else f"{name}:{self.revision}"
        if self.file is None:
            return self.repo
        return f"{org}:{name}:{self.file}"


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
        return _parse_url(model_id, hub_url, param)
    head, sep, tail = model_id.partition(":")
    if "/" in head:
        org_name, repo_name = _split_repo(head, param)
        file = tail if sep else None
        if sep and not tail:
            raise InvalidField(f"Invalid field '{param}': empty file name after ':'",
                               param=param)
        return ModelRef(f"{org_name}/{repo_name}", "main", file, builtin=False)
    if not _NAME.match(head) or (sep and not _NAME.match(tail)):
        raise InvalidField(f"Invalid field '{param}': '{model_id}' is not a model id; use "
                           f"<name>, <name>:<variant>, <org>/<repo> or <org>/<repo>:<file>",
                           param=param)
    return ModelRef(f"{org}/{head}", tail if sep else "main", None, builtin=True)


def _split_repo(repo: str, param: str) -> tuple[str, str]:
    parts = repo.split("/")
    if len(parts) != 2 or not all(_NAME.match(p) for p in parts):
        raise InvalidField(f"Invalid field '{param}': '{repo}' is not a hub repository "
                           f"shaped <org>/<repo>", param=param)
    return parts[0], parts[1]


def _parse_url(url: str, hub_url: str, param: str) -> ModelRef:
    parts, hub = urlsplit(url), urlsplit(hub_url)
    if (parts.scheme, parts.netloc) != (hub.scheme, hub.netloc):
        raise InvalidField(f"Invalid field '{param}': {parts.scheme}://{parts.netloc} is not "
                           f"the configured model hub ({hub_url})", param=param)
    segments = [unquote(s) for s in parts.path.strip("/").split("/")]
    if len(segments) < 5 or segments[2] not in ("blob", "resolve"):
        raise InvalidField(f"Invalid field '{param}': expected a URL shaped "
                           f"{hub_url}/<org>/<repo>/resolve/<revision>/<file>", param=param)
    org_name, repo_name = _split_repo("/".join(segments[:2]), param)
    revision, file = segments[3], "/".join(segments[4:])
    check_id(file, param)
    return ModelRef(f"{org_name}/{repo_name}", revision, file, builtin=False)


# --- the registry ----------------------------------------------------------------

DEFINITION = "model.json"
ONNX_CONFIG = "genai_config.json"  # what makes a folder an ONNX model (onnxruntime-genai)
DEFAULT_CTX_LEN = 4096  # a default ctx_len never above this, whatever the model was trained on
SKIPPED_FILES = (".gitattributes",)  # repo files a pull leaves on the hub
# model.yml's engine names (cortex's) -> localrt's
YML_ENGINES = {"llama-cpp": GGUF_ENGINE, "llamacpp": GGUF_ENGINE, GGUF_ENGINE: GGUF_ENGINE,
               "onnxruntime": ONNX_ENGINE, "onnx": ONNX_ENGINE, ONNX_ENGINE: ONNX_ENGINE}
LIST_OMITS = ("chat_template",)  # metadata too big for every row of GET /v1/models


class ModelNotFound(NotFound):
    code = "model_not_found"


@functools.lru_cache(maxsize=None)  # the schema file does not change while localrt runs
def parameter_names() -> tuple[str, ...]:
    """The stored parameters a model can have: the properties of schemas/model-update.json."""
    return tuple(k for k in schemas.load("model-update.json")["properties"] if k != "id")


class Registry:
    """The downloaded models, one definition file each, indexed in memory.

    The index is built from the definition files on first use; after that the
    server is their only writer, so reads never touch the disk.
    """

    def __init__(self, root: Path, validators: schemas.Validators,
                 is_running: Callable[[str], bool] = lambda model_id: False):
        self.root = Path(root)
        self._validators = validators
        self.is_running = is_running  # the engines' answer, once models can run
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
        """Change stored parameters; the id itself cannot change."""
        if "id" in changes and changes["id"] != model_id:
            raise InvalidField("Invalid field 'id': a model's id cannot change", param="id")
        with self._lock:
            folder, d = self._find(model_id)
            updated = {**d, **{k: v for k, v in changes.items() if k != "id"}}
            self._write(folder, updated)
        return self._record(folder, updated)

    def remove(self, model_id: str) -> None:
        """Forget a model and delete its folder (an imported file's link, never the file)."""
        with self._lock:
            folder, _ = self._find(model_id)
            if self.is_running(model_id):
                raise Conflict(f"Model {model_id} is running; stop it first with "
                               f"`localrt models stop {model_id}`", param="model")
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
                  "owned_by": d["owned_by"]}
        record.update((k, v) for k, v in d.items() if k not in record)
        if brief and "metadata" in d:
            record["metadata"] = {k: v for k, v in d["metadata"].items()
                                  if k not in LIST_OMITS}
        record["size"] = sum(f["size"] for f in d["files"])
        record["path"] = str(folder)
        record["status"] = "running" if self.is_running(d["id"]) else "downloaded"
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


def _inside(folder: Path, root: Path) -> bool:
    folder, root = folder.resolve(), root.resolve()
    return folder != root and root in folder.parents


# --- pulling and importing --------------------------------------------------------


@dataclass
class _Plan:
    """What a pull will fetch, and where it goes."""

    ref: ModelRef
    local_id: str
    task_id: str
    folder: Path
    items: list


class Models:
    """Pulls models from the hub and imports local files into the registry."""

    def __init__(self, settings, config, downloads: Downloads, registry: Registry):
        self._settings = settings
        self._config = config
        self.downloads = downloads
        self.registry = registry
        self._lock = threading.Lock()  # guards _importing
        self._importing: set[str] = set()  # ids of imports under way

    def pull(self, model_id: str, file: str | None = None) -> dict:
        """Start downloading a model; or say it is already downloaded."""
        hub_url, org = self._settings["modelHubUrl"], self._settings["modelHubOrg"]
        ref = parse_id(model_id, hub_url, org)
        if file is not None:
            if ref.builtin or ref.file is not None:
                raise InvalidField("Invalid field 'file': a file can only be chosen for an "
                                   "<org>/<repo> model", param="file")
            ref = ModelRef(ref.repo, ref.revision, check_id(file, "file"), builtin=False)
        if ref.builtin or ref.file is not None:  # known before asking the hub
            check_new_id(ref.local_id)
            done = self._already(ref.local_id, _task_id(ref))
            if done:
                return done
        hub = Hub(hub_url, self._config.get())
        plan = self._plan(ref, hub)
        check_new_id(plan.local_id)  # the file name chosen on the hub is part of it
        done = self._already(plan.local_id, plan.task_id)
        if done:
            return done
        other = self.registry.at(plan.folder)
        if other is not None:  # e.g. built-in "x" and the repo "<org>/x" are one folder
            return {"message": f"Model {plan.local_id} is already downloaded as {other}",
                    "model": other}
        task = Task(plan.task_id, "Model", plan.items, hub_url=hub.url,
                    on_success=lambda task: self._register(plan))
        self.downloads.start(task)
        return {"message": f"Model {plan.local_id} starts downloading", "model": plan.local_id,
                "task": task.to_dict()}

    def _already(self, local_id: str, task_id: str) -> dict | None:
        if self.registry.has(local_id):
            return {"message": f"Model {local_id} is already downloaded", "model": local_id}
        if self.downloads.running(task_id):
            raise Conflict(f"Model {local_id} is already downloading (taskId {task_id})",
                           extra={"taskId": task_id, "model": local_id})
        return None

    def _plan(self, ref: ModelRef, hub: Hub) -> _Plan:
        files = [f for f in hub.files(ref.repo, ref.revision) if f.path not in SKIPPED_FILES]
        for f in files:  # the file list is remote input: no path may leave the folder
            if not _safe_relative(f.path):
                raise UpstreamError(f"The model hub listed a file with an unsafe path in "
                                    f"{ref.repo}: {f.path!r}; nothing was downloaded")
        if ref.builtin:
            chosen = files
        elif ref.file is not None:
            chosen = [f for f in files if f.path == ref.file]
            if not chosen:
                raise NotFound(f"No file {ref.file} in {ref.repo} at {ref.revision}; "
                               f"its GGUF files: {', '.join(_ggufs(files)) or 'none'}",
                               param="file")
        else:
            ggufs = _ggufs(files)
            if len(ggufs) == 1:
                return self._plan(ModelRef(ref.repo, ref.revision, ggufs[0], False), hub)
            if len(ggufs) > 1:
                raise BadRequest(f"{ref.repo} holds {len(ggufs)} GGUF files; choose one with "
                                 f"\"file\" or as {ref.repo}:<file>: {', '.join(ggufs)}",
                                 param="file", extra={"files": ggufs})
            chosen = files  # no GGUF: the whole repo, e.g. an ONNX model folder
        if not any(_engine_of(f.path) for f in chosen):
            raise NotFound(f"{ref.repo} at {ref.revision} has no GGUF or ONNX model files",
                           param="model")
        host = urlsplit(hub.url).netloc.lower().replace(":", "_")
        leaf = ref.file.replace("/", "_") if ref.file else ref.revision
        folder = self.registry.root / host / ref.repo / leaf
        items = [Item(f.path, hub.file_url(ref.repo, ref.revision, f.path),
                      folder / (Path(f.path).name if ref.file else f.path),
                      f.size, f.sha256, f.git_oid) for f in chosen]
        local_id = ref.local_id if ref.file or ref.builtin else \
            f"{ref.repo.replace('/', ':')}:{ref.revision}"
        return _Plan(ref, local_id, _task_id(ref), folder, items)

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
            other = self.registry.at(plan.folder)
            if other not in (None, plan.local_id):
                raise Conflict(f"its folder already holds the model {other}")
            self.registry.add(plan.folder, definition)
        except ValueError as exc:
            raise DownloadFailed(str(exc)) from None
        except HTTPError as exc:  # another model took the id or folder meanwhile
            raise DownloadFailed(f"Model {plan.local_id} was downloaded but not registered: "
                                 f"{exc.message}") from None

    def import_file(self, path: str, model_id: str | None = None,
                    option: str = "symlink") -> dict:
        """Register a local GGUF file or ONNX model folder, linked or copied in."""
        src = Path(path)
        if not src.is_absolute():
            raise InvalidField(f"Invalid field 'path': {path} is not an absolute path",
                               param="path")
        if src.is_dir():
            if not (src / ONNX_CONFIG).is_file():
                raise InvalidField(f"Invalid field 'path': {path} is a folder without "
                                   f"{ONNX_CONFIG}, so not an ONNX model", param="path")
        elif not src.is_file() or not os.access(src, os.R_OK):
            raise InvalidField(f"Invalid field 'path': {path} is not a readable file",
                               param="path")
        elif not ggufinfo.is_gguf(src):
            raise InvalidField(f"Invalid field 'path': {path} is not a GGUF file",
                               param="path")
        if model_id is None:
            model_id = src.name[:-5] if src.name.lower().endswith(".gguf") else src.name
        check_new_id(model_id, "id")
        with self._lock:
            if self.registry.has(model_id) or model_id in self._importing:
                raise Conflict(f"A model with id {model_id} already exists", param="id")
            self._importing.add(model_id)
        try:
            return self._import(src, model_id, option)
        finally:
            with self._lock:
                self._importing.discard(model_id)

    def _import(self, src: Path, model_id: str, option: str) -> dict:
        folder = self.registry.root / "imported" / _folder_name(model_id)
        shutil.rmtree(folder, ignore_errors=True)  # what a crashed import left
        private_dir(folder)
        target = folder / src.name
        try:
            bring = self._import_folder if src.is_dir() else self._import_file
            files, paths = bring(src, target, model_id, option)
            source = {"type": "import", "path": str(src), "option": option}
            try:
                definition = _definition(model_id, "local", paths, files, source,
                                         self.registry.usable)
            except ValueError as exc:
                raise InvalidField(f"Invalid field 'path': {exc}", param="path") from None
            return self.registry.add(folder, definition)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def _import_file(self, src: Path, target: Path, model_id: str,
                     option: str) -> tuple[list, list]:
        """A GGUF file, linked or copied; (files, paths)."""
        if option == "copy":
            check_disk_space(model_id, [Item(src.name, "", target, src.stat().st_size)])
            sha256 = _copy(src, target)
        else:
            _link(src, target)
            sha256 = None
        return [{"path": src.name, "size": target.stat().st_size, "sha256": sha256}], [target]

    def _import_folder(self, src: Path, target: Path, model_id: str,
                       option: str) -> tuple[list, list]:
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


def _folder_name(model_id: str) -> str:
    """A folder name for an imported model: the quoted id, or a digest when that is long."""
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


def _ggufs(files) -> list[str]:
    return sorted(f.path for f in files if f.path.lower().endswith(".gguf"))


def weights_path(record: dict) -> Path | None:
    """The file an engine loads for a model record: its GGUF, else its ONNX model file."""
    files = [f["path"] for f in record["files"]]
    for engine in (GGUF_ENGINE, ONNX_ENGINE):
        found = next((f for f in files if _engine_of(f) == engine), None)
        if found is not None:
            return Path(record["path"]) / found
    return None


def _engine_of(path: str) -> str | None:
    name = path.lower().rsplit("/", 1)[-1]
    if name.endswith(".gguf"):
        return GGUF_ENGINE
    if name.endswith(".onnx") or name == "genai_config.json":
        return ONNX_ENGINE
    return None


def _definition(model_id: str, owner: str, paths: list[Path], files: list[dict],
                source: dict, usable: Callable[[dict], dict]) -> dict:
    """A model definition: files and source, plus defaults from model.yml and the weights.

    Raises ValueError when the weights cannot be read.
    """
    yml = _read_model_yml([p for p in paths if p.name == "model.yml"])
    engines = {_engine_of(p.name) for p in paths} - {None}
    engine = YML_ENGINES.get(str(yml.get("engine", "")).lower()) or \
        (GGUF_ENGINE if GGUF_ENGINE in engines else ONNX_ENGINE)
    definition = {"id": model_id, "name": model_id, "engine": engine,
                  "created": int(time.time()), "owned_by": owner, "files": files,
                  "source": source}
    ggufs = sorted((p for p in paths if p.name.lower().endswith(".gguf")),
                   key=lambda p: p.stat().st_size)
    if ggufs:
        try:
            meta = ggufinfo.model_defaults(ggufs[-1])
        except (ggufinfo.GGUFError, OSError) as exc:
            raise ValueError(f"{ggufs[-1].name} cannot be read as GGUF: {exc}") from None
        definition["metadata"] = {k: v for k, v in meta.items() if k != "stop"}
        from_weights = {}
        if meta.get("name"):
            from_weights["name"] = meta["name"]
        if isinstance(meta.get("context_length"), int):
            from_weights["ctx_len"] = min(meta["context_length"], DEFAULT_CTX_LEN)
        if meta.get("stop"):
            from_weights["stop"] = meta["stop"]
        definition.update(usable(from_weights))  # the weights are outside input too
    names = parameter_names()
    definition.update(usable({k: v for k, v in yml.items() if k in names}))
    return definition


def _read_model_yml(paths: list[Path]) -> dict:
    """The hub's model.yml (cortex's format), or {} when there is none or it is unusable."""
    if not paths:
        return {}
    import yaml

    try:
        data = yaml.safe_load(paths[0].read_text(encoding="utf-8"))
    except (OSError, UnicodeError, yaml.YAMLError) as exc:
        log.warning("ignoring %s: %s", paths[0], exc)
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
