"""Imports: registering a local GGUF file or ONNX model folder, linked or copied in,
and a GGUF model's files beside its weights (a vision projector, LoRA adapters:
localrt.models.roles), given with the import or later.

An imported model's folder is `<dataFolderPath>/models/imported/<quoted id>`. A link
points at the file or folder as it is; a copy goes through a part file, is fsynced
and renamed, and records its sha256. The definition is written last, so a crash
part-way leaves no registered model with missing files. A copy that cannot fit is
refused before it starts (507 insufficient_storage); a write that fails part-way (the
disk filled meanwhile, a read-only models folder) is a 507 that names the folder,
and the import's folder goes with whatever it held. A file beside the weights is
brought in the same way, under a name its role knows (Role.file_name), once its role's
check passes (a projector's: a vision projector GGUF whose output fits the model's
embeddings; an adapter's: a LoRA GGUF whose tensors fit the model's). A PATCH's
adapters replace the model's list: the ones it has stay, without a second link.

Before a model is registered, a child process loads its files (`vet`: the scheduler's
vet_new, localrt.engines.vetting): a file the child could not load is refused with 400
invalid_model_file and nothing is registered; one it loaded is registered with that
state (`vetting`), so its first start costs no second child.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path

from typing import Callable

from localrt.downloads.tasks import Item, check_disk_space, fsync_dir
from localrt.engines import ggufcheck
from localrt.engines.vetting import invalid_file
from localrt.errors import Conflict, InvalidField, InvalidModelFile
from localrt.fsutil import MOVE_DATA, private_dir, storage_error
from localrt.models.ids import check_new_id, folder_name
from localrt.models.registry import ONNX_CONFIG, Registry, new_definition, weights_path
from localrt.models.roles import LORA_SCALE, BadSource, Role, check_file


class Imports:
    """Imports local files into the registry; `vet(record)` is the vetting state of a
    model not yet registered (Scheduler.vet_new), None when nothing says yet."""

    def __init__(self, registry: Registry,
                 vet: Callable[[dict], dict | None] = lambda record: None):
        self.registry = registry
        self._vet = vet
        self._lock = threading.Lock()  # guards _importing
        self._importing: set[str] = set()  # ids of imports under way

    def import_file(self, path: str, model_id: str | None = None, option: str = "symlink",
                    name: str | None = None, cortex: bool = False,
                    beside: dict[Role, str] | None = None) -> dict:
        """Register a local GGUF file or ONNX model folder, linked or copied in, with the
        files `beside` its weights (role -> path: a GGUF model's only, as roles.given
        reads them from the body), brought in the same way.

        The path is checked first (a GGUF's header whole: localrt.engines.ggufcheck, a
        400 invalid_model_file naming the rule it breaks), then the files beside it,
        then the id; a model of that id whose files are missing, damaged or invalid is
        replaced. With `cortex`,
        the request was cortex's {"model", "modelPath"}: errors name those fields, and a
        path that cannot be imported is worded as cortex words it ("Error importing
        model ...").
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
            if not src.is_dir():  # a GGUF: its header checked whole before anything else
                ggufcheck.check(src, param=path_field)
        except BadSource as exc:
            raise bad_path(str(exc)) from None
        except InvalidModelFile as exc:
            message = f"{exc.message}; nothing was imported"
            if cortex:
                message = (f"Error importing model path '{path}' with model_id "
                           f"'{model_id}': {message}")
            raise InvalidModelFile(message, param=path_field) from None
        except OSError as exc:
            raise bad_path(f"{path} cannot be read: {exc.strerror or exc}") from None
        checked = {}
        for role, given in (beside or {}).items():
            if src.is_dir():
                raise role.invalid(f"a {role.label} goes with a GGUF model file, not an "
                                   f"ONNX folder")
            if role.many:  # [(path, scale)]
                checked[role] = [(_check_entry(role, i, e["path"], src), e["scale"])
                                 for i, e in enumerate(given)]
            else:
                checked[role] = role.check(given, src)
        if model_id is None:
            model_id = src.name[:-5] if src.name.lower().endswith(".gguf") else src.name
        check_new_id(model_id, id_field)
        with self._lock:
            # A model whose files are missing, damaged or invalid may be imported again.
            if (self.registry.has(model_id) and not self.registry.broken(model_id)) \
                    or model_id in self._importing:
                raise Conflict(f"A model with id {model_id} already exists", param=id_field)
            self._importing.add(model_id)
        try:
            return self._import(src, model_id, option, name, checked)
        except BadSource as exc:
            raise bad_path(str(exc)) from None
        finally:
            with self._lock:
                self._importing.discard(model_id)

    def _import(self, src: Path, model_id: str, option: str, name: str | None,
                beside: dict[Role, Path]) -> dict:
        folder = self.registry.root / "imported" / folder_name(model_id)
        shutil.rmtree(folder, ignore_errors=True)  # what a crashed import left
        with _writing(folder, model_id):
            private_dir(folder)
        target = folder / src.name
        try:
            bring = _import_folder if src.is_dir() else _import_file
            files, paths = bring(src, target, model_id, option)
            source = {"type": "import", "path": str(src), "option": option}
            try:
                definition = new_definition(model_id, "local", paths, files, source,
                                             self.registry.usable)
            except ValueError as exc:
                raise BadSource(str(exc)) from None
            taken = {src.name}
            for role, given in beside.items():
                entries = []
                for path, scale in (given if role.many else [(given, None)]):
                    kept = role.file_name(path, taken)
                    taken.add(kept)
                    entry = _import_file(path, folder / kept, model_id, option)[0][0]
                    definition["files"].append({**entry, "path": kept})
                    entries.append((kept, path, scale))
                if role.many:
                    if entries:
                        definition[role.key] = [{"path": k, "scale": sc}
                                                for k, _, sc in entries]
                        definition["source"][role.key] = [str(p) for _, p, _ in entries]
                else:
                    definition[role.key] = entries[0][0]
                    definition["source"][role.key] = str(entries[0][1])
            if name:
                definition["name"] = name
            self.registry.check(definition)  # a bad definition never reaches a child
            state = self._vet({**definition, "path": str(folder)})
            if state is not None:
                if not state["ok"]:
                    raise invalid_file(model_id, src.name, state["reason"])
                definition["vetting"] = state
            return self.registry.add(folder, definition)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def set_files(self, model_id: str, beside: dict[Role, str], changes: dict) -> dict:
        """Give a registered GGUF model the files `beside` its weights (role -> path: a
        PATCH's, as roles.given reads them), each linked into its folder, replacing the
        one of its role it has, with the other `changes` of the PATCH (Registry.update):
        every file is checked before anything changes. A path that is the file the
        model has in that role (its name in the folder, or its path there) changes
        nothing.

        The model's engine loads these files when it starts: a running model keeps the
        ones it started with until it is started again.
        """
        record = self.registry.get(model_id)
        folder = Path(record["path"])
        checked = {}
        for role, given in beside.items():
            if role.many:
                # [(name it has, or None, path to check, scale)]; the list replaces its own
                have = set(role.names(record))
                wanted = [(_kept_name(e["path"], have, folder), e["path"], e["scale"])
                          for e in given]
                same = [(name, scale) for name, _, scale in wanted] == \
                    [(e["path"], e.get("scale", LORA_SCALE)) for e in record.get(role.key) or ()]
                if same:
                    continue
                if any(name is None for name, _, _ in wanted):
                    weights = self._gguf_weights(model_id, record, role)
                checked[role] = [(name, path if name is not None else
                                  _check_entry(role, i, path, weights), scale)
                                 for i, (name, path, scale) in enumerate(wanted)]
                continue
            current = role.path(record)
            if given == record.get(role.key) or (current is not None and given == str(current)):
                continue
            checked[role] = role.check(given, self._gguf_weights(model_id, record, role))
        if not checked:
            return self.registry.update(model_id, changes)
        if changes:
            self.registry.update(model_id, changes)
        # Never the old file's name either: its file goes only once the definition names
        # the new one, so a crash part-way leaves a whole model.
        taken = {f["path"] for f in record["files"]}
        for role, given in checked.items():
            entries, names = [], []
            for name, path, scale in (given if role.many else [(None, given, None)]):
                if name is None:
                    name = role.file_name(path, taken)
                    taken.add(name)
                    entry = _import_file(path, folder / name, model_id, "symlink")[0][0]
                    entries.append({**entry, "path": name})
                names.append({"path": name, "scale": scale})
            record = self.registry.set_file(model_id, role,
                                            names if role.many else names[0]["path"], entries)
        return record

    @staticmethod
    def _gguf_weights(model_id: str, record: dict, role: Role) -> Path:
        """The model's GGUF weights, which a file of `role` goes with; else a 400."""
        weights = weights_path(record)
        if weights is None or not weights.name.lower().endswith(".gguf"):
            raise role.invalid(f"model {model_id} has no GGUF weights; a {role.label} "
                               f"goes with a GGUF model")
        return weights


def _check_entry(role: Role, index: int, path: str, weights: Path) -> Path:
    """One file of a role of `many`'s list, checked: its errors name `key[index].path`."""
    return role.check(path, weights, field=f"{role.key}[{index}].path")


def _kept_name(path: str, have: set, folder: Path) -> str | None:
    """The name of the model's own file that `path` gives (its name in the folder, its
    path there, or the file a link of it points at), or None: a file to check and
    bring in."""
    for name in have:
        if path == name or path == str(folder / name):
            return name
    target = Path(path)
    if target.is_absolute():
        for name in sorted(have):
            link = folder / name
            if link.is_symlink() and os.path.realpath(link) == os.path.realpath(target):
                return name
    return None


def _check_source(src: Path, path: str) -> None:
    """Raise BadSource (roles) unless `src` is an absolute path to a readable GGUF file
    or an ONNX model folder: the weights an import takes."""
    if src.is_absolute() and src.is_dir():
        if not (src / ONNX_CONFIG).is_file():
            raise BadSource(f"{path} is a folder without {ONNX_CONFIG}, so not an ONNX model")
    else:
        check_file(src, path)


def _import_file(src: Path, target: Path, model_id: str, option: str) -> tuple[list, list]:
    """A GGUF file, linked or copied; (files, paths)."""
    with _writing(target.parent, model_id):
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
    with _writing(target.parent, model_id):
        if option == "copy":
            check_disk_space(model_id, [Item(str(n), "", target / n,
                                             (src / n).stat().st_size) for n in names])
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
    link.unlink(missing_ok=True)  # what a crash part-way left
    os.symlink(src.resolve(), link)
    os.replace(link, target)



@contextmanager
def _writing(folder: Path, model_id: str):
    """An OSError of a write in the models folder as the 507 that names the folder and
    says what to do (fsutil.storage_error); the caller removes what was written."""
    try:
        yield
    except OSError as exc:
        raise storage_error(exc, folder, f"import model {model_id}", MOVE_DATA) from None


def _copy(src: Path, target: Path) -> str:
    """Copy through a part file, fsync and rename; return the sha256. A failed read is
    the source's fault (BadSource), a failed write the models folder's (an OSError)."""
    part = target.with_name(".import.part")
    h = hashlib.sha256()
    try:
        fin = open(src, "rb")
    except OSError as exc:
        raise BadSource(f"cannot read {src}: {exc.strerror or exc}") from None
    with fin, open(part, "wb") as fout:
        while True:
            try:
                chunk = fin.read(1024 * 1024)
            except OSError as exc:
                raise BadSource(f"cannot read {src}: {exc.strerror or exc}") from None
            if not chunk:
                break
            h.update(chunk)
            fout.write(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    os.replace(part, target)
    fsync_dir(target.parent)
    return h.hexdigest()
