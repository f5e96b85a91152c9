"""Pulls: what a model id downloads from the hub, and the download itself.

A pull plans first (which repo, revision and files: a repo's GGUF candidates, its
quantizations, a split model's parts, the files that come along), then starts one
download task (localrt.downloads.tasks), which registers the model once every file is
checked, once a child process loaded it (`vet`: the scheduler's vet_new,
localrt.engines.vetting; a file it could not load is registered with that state and the
task ends in an error that says so). A split GGUF (-00001-of-00003.gguf) is one model:
every part is pulled, the first loaded. A file of another role than the weights (a projector, mmproj*.gguf:
localrt.models.roles) is never the model; the one its role picks comes along, recorded
under its role's key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from localrt.downloads.tasks import DownloadFailed, Downloads, Item, Task
from localrt.engines import ggufcheck
from localrt.engines.catalog import engine_for_files
from localrt.engines.vetting import invalid_file
from localrt.errors import (BadRequest, Conflict, HTTPError, InsufficientStorage, InvalidField,
                            InvalidModelFile, NotFound, UpstreamError)
from localrt.models import roles
from localrt.models.hub import Hub, HubFile, NotOnHub, RevisionNotOnHub
from localrt.models.ids import (SPLIT_GGUF, ModelRef, check_id, check_new_id, parse_id,
                                quantization, safe_relative)
from localrt.models.registry import Registry, new_definition, weights_path, yml_mapping

log = logging.getLogger(__name__)

DEFAULT_QUANT = "Q4_K_M"  # what Ollama's hf.co/... and llama.cpp's -hf take by default
SKIPPED_FILES = (".gitattributes",)  # repo files a pull leaves on the hub


@dataclass
class _Plan:
    """What a pull will fetch, and where it goes."""

    ref: ModelRef           # resolved: revision set, file set for a single model file
    local_id: str
    task_id: str
    folder: Path
    items: list
    # The files that come along beside the weights: role -> its path in the folder.
    beside: dict = field(default_factory=dict)
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


class Pulls:
    """Pulls models from the hub into the registry."""

    def __init__(self, settings, config, downloads: Downloads, registry: Registry,
                 vet: Callable[[dict], dict | None] = lambda record: None):
        self._settings = settings
        self._config = config
        self.downloads = downloads
        self.registry = registry
        self._vet = vet  # the vetting state of a model not yet registered (Scheduler.vet_new)

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
        # e.g. one file pulled as <org>/<repo> and by its URL (its own id: pulled again)
        if other not in (None, plan.local_id):
            return {"message": f"Model {plan.local_id} is already downloaded as {other}",
                    "model": other}
        # A gated repository lists its files to anyone and refuses their bytes: ask for one
        # byte of the largest now, so the answer is a clear 403 and not a failed task.
        largest = max(plan.items, key=lambda item: item.size)
        hub.check_access(plan.ref.repo, plan.ref.revision, largest.id)
        task = Task(plan.task_id, "Model", plan.items, hub_url=hub.url,
                    on_success=lambda task: self._register(plan))
        self.downloads.start(task)
        message = f"Model {plan.local_id} starts downloading"
        for role, path in plan.beside.items():  # the one picked when the repo has several
            message += f", with its {role.label} {path}"
            log.info("pull %s: %s %s", plan.task_id, role.label, path)
        return {"message": message, "model": plan.local_id, "task": task.to_dict()}

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
        # A model whose files are missing, damaged or invalid is pulled again.
        if self.registry.has(local_id) and not self.registry.broken(local_id):
            return {"message": f"Model {local_id} is already downloaded", "model": local_id}
        if self.downloads.running(task_id):
            raise Conflict(f"Model {local_id} is already downloading (taskId {task_id})",
                           extra={"taskId": task_id, "model": local_id})
        return None

    def _listing(self, repo: str, revision: str, hub: Hub) -> list[HubFile]:
        """A revision's files, less those a pull leaves on the hub; none with an unsafe path."""
        files = [f for f in hub.files(repo, revision) if f.path not in SKIPPED_FILES]
        for f in files:  # the file list is remote input: no path may leave the folder
            if not safe_relative(f.path):
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
        beside = _beside(files)
        wanted = list(chosen.parts) + list(beside.values())
        items = [Item(f.path, hub.file_url(ref.repo, revision, f.path),
                      folder / Path(f.path).name, f.size, f.sha256, f.git_oid) for f in wanted]
        return _Plan(resolved, f"{org}:{name}:{chosen.path}", _task_id(resolved), folder,
                     items, {role: Path(f.path).name for role, f in beside.items()})

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
        return _Plan(ref, local_id, _task_id(ref), folder, items,
                     {role: f.path for role, f in _beside(files).items()})

    def _default_branch(self, ref: ModelRef, hub: Hub, branches: list[str]) -> str | None:
        """The branch a built-in's metadata.yml names as default, or its only branch."""
        text = hub.text(ref.repo, "main", "metadata.yml")
        default = yml_mapping(text, f"{ref.repo}/metadata.yml").get("default")
        if default is not None and str(default) in branches:
            return str(default)
        if default is not None:
            log.warning("%s/metadata.yml names the default branch %r, which does not exist",
                        ref.repo, default)
        return branches[0] if len(branches) == 1 else None

    def _register(self, plan: _Plan) -> None:
        """Once every file is checked: check each GGUF's header whole (a task error
        naming the rule a file breaks, and nothing registered: its files stay, so a
        pull again checks them without downloading them), read the defaults, write the
        definition."""
        org = plan.ref.repo.split("/")[0]
        paths = [item.local_path for item in plan.items]
        for path in paths:
            if path.name.lower().endswith(".gguf"):
                try:
                    ggufcheck.check(path)
                except InvalidModelFile as exc:
                    raise DownloadFailed(f"{exc.message}; model {plan.local_id} was "
                                         f"downloaded but not registered") from None
        files = [{"path": str(item.local_path.relative_to(plan.folder)), "size": item.size,
                  "sha256": item.sha256} for item in plan.items]
        source = {"type": "hub", "url": self._settings["modelHubUrl"], "repo": plan.ref.repo,
                  "revision": plan.ref.revision, "file": plan.ref.file}
        try:
            definition = new_definition(plan.local_id, org, paths, files, source,
                                         self.registry.usable)
            for role, path in plan.beside.items():
                definition[role.key] = path
            if plan.name:
                definition["name"] = plan.name
            other = self.registry.at(plan.folder)
            if other not in (None, plan.local_id):
                raise Conflict(f"its folder already holds the model {other}")
            self.registry.check(definition)  # a bad definition never reaches a child
            state = self._vet({**definition, "path": str(plan.folder)})
            if state is not None:
                definition["vetting"] = state
            self.registry.add(plan.folder, definition)
            if state is not None and not state["ok"]:
                # Registered all the same, so `models list` shows which file is bad and
                # `models delete` frees its space; no start loads it.
                weights = weights_path({**definition, "path": str(plan.folder)})
                refused = invalid_file(plan.local_id, weights.name if weights else "",
                                       state["reason"])
                raise DownloadFailed(f"{refused.message} ({refused.code}); it is listed "
                                     f"with status invalid: `localrt models delete "
                                     f"{plan.local_id}` removes it")
        except ValueError as exc:
            raise DownloadFailed(str(exc)) from None
        except InsufficientStorage:  # model.json could not be written: the task says why
            raise
        except HTTPError as exc:  # another model took the id or folder meanwhile
            raise DownloadFailed(f"Model {plan.local_id} was downloaded but not registered: "
                                 f"{exc.message}") from None



def _task_id(ref: ModelRef) -> str:
    """A pull's three-part taskId: <org>:<repo>:<branch or file>."""
    return f"{ref.repo.replace('/', ':')}:{ref.file or ref.revision}"


def _host(hub: Hub) -> str:
    """The models folder's name for a hub: its host and port."""
    return urlsplit(hub.url).netloc.lower().replace(":", "_")


def _candidates(files: list[HubFile]) -> list[_Candidate]:
    """The GGUF models among a revision's files: a split model's parts make one, in part
    order (every part must be listed); files of other roles (projectors) are not models."""
    singles, splits = [], {}
    for f in sorted(files, key=lambda f: f.path):
        if not f.path.lower().endswith(".gguf") or roles.role_of(f.path) is not roles.WEIGHTS:
            continue
        m = SPLIT_GGUF.match(f.path)
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
    role = roles.role_of(path)
    if role is not roles.WEIGHTS:
        raise BadRequest(f"{path} is a {role.label} ({role.key}), not a model; choose the "
                         f"model file, and its {role.noun} comes along", param="file")
    if engine_for_files([path]) is None:
        raise BadRequest(f"{path} is not a GGUF or ONNX model file", param="file")
    return _Candidate((f,), quantization(path))


def _listed(candidates: list[_Candidate]) -> str:
    return ", ".join(c.path for c in candidates) or "none"


def _beside(files: list[HubFile]) -> dict:
    """The files that come along with a model from a revision's `files`: role -> the
    file its role picks, for each role that picks one (localrt.models.roles)."""
    picked = {role: role.pick(files) for role in roles.BESIDE if role.pick is not None}
    return {role: f for role, f in picked.items() if f is not None}
