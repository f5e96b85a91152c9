"""Imports: registering a local GGUF file or ONNX model folder, linked or copied in,
and a GGUF model's vision projector (mmproj), given with the import or later.

An imported model's folder is `<dataFolderPath>/models/imported/<quoted id>`. A link
points at the file or folder as it is; a copy goes through a part file, is fsynced
and renamed, and records its sha256. The definition is written last, so a crash
part-way leaves no registered model with missing files. A projector is brought in the
same way, under a name that starts with "mmproj" (registry.is_projector), and must be
a vision projector GGUF whose output fits the model's embeddings (check_projector).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path

from localrt.downloads.tasks import Item, check_disk_space, fsync_dir
from localrt.errors import Conflict, InvalidField
from localrt.fsutil import private_dir
from localrt.engines import ggufinfo
from localrt.models.ids import check_new_id, folder_name
from localrt.models.registry import (ONNX_CONFIG, Registry, is_projector, new_definition,
                                    projector_path, weights_path)


class Imports:
    """Imports local files into the registry."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self._lock = threading.Lock()  # guards _importing
        self._importing: set[str] = set()  # ids of imports under way

    def import_file(self, path: str, model_id: str | None = None, option: str = "symlink",
                    name: str | None = None, cortex: bool = False,
                    mmproj: str | None = None) -> dict:
        """Register a local GGUF file or ONNX model folder, linked or copied in, with the
        vision projector `mmproj` (a GGUF model's only), brought in the same way.

        The path is checked first, then the projector, then the id. With `cortex`, the
        request was cortex's {"model", "modelPath"}: errors name those fields, and a path
        that cannot be imported is worded as cortex words it ("Error importing model ...").
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
        projector = None
        if mmproj is not None:
            if src.is_dir():
                raise InvalidField("Invalid field 'mmproj': a vision projector goes with a "
                                   "GGUF model file, not an ONNX folder", param="mmproj")
            projector = check_projector(mmproj, src)
        if model_id is None:
            model_id = src.name[:-5] if src.name.lower().endswith(".gguf") else src.name
        check_new_id(model_id, id_field)
        with self._lock:
            if self.registry.has(model_id) or model_id in self._importing:
                raise Conflict(f"A model with id {model_id} already exists", param=id_field)
            self._importing.add(model_id)
        try:
            return self._import(src, model_id, option, name, projector)
        except _BadSource as exc:
            raise bad_path(str(exc)) from None
        finally:
            with self._lock:
                self._importing.discard(model_id)

    def _import(self, src: Path, model_id: str, option: str, name: str | None,
                projector: Path | None) -> dict:
        folder = self.registry.root / "imported" / folder_name(model_id)
        shutil.rmtree(folder, ignore_errors=True)  # what a crashed import left
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
                raise _BadSource(str(exc)) from None
            if projector is not None:
                mmproj = _projector_name(projector, {src.name})
                entry = _import_file(projector, folder / mmproj, model_id, option)[0][0]
                definition["files"].append({**entry, "path": mmproj})
                definition["mmproj"] = mmproj
                definition["source"]["mmproj"] = str(projector)
            if name:
                definition["name"] = name
            return self.registry.add(folder, definition)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def set_projector(self, model_id: str, path: str, changes: dict) -> dict:
        """Give a registered GGUF model the vision projector at `path` (PATCH's `mmproj`),
        linked into its folder, or replace the one it has, with the other `changes` of
        the PATCH (Registry.update): the projector is checked before anything changes.
        A `path` that is the projector the model has (its name in the folder, or its path
        there) changes nothing.

        The model's engine loads a projector when it starts: a running model keeps the
        one it started with until it is started again.
        """
        record = self.registry.get(model_id)
        current = projector_path(record)
        if path == record.get("mmproj") or (current is not None and path == str(current)):
            return self.registry.update(model_id, changes)
        weights = weights_path(record)
        if weights is None or not weights.name.lower().endswith(".gguf"):
            raise InvalidField(f"Invalid field 'mmproj': model {model_id} has no GGUF "
                               f"weights; a vision projector goes with a GGUF model",
                               param="mmproj")
        projector = check_projector(path, weights)
        if changes:
            self.registry.update(model_id, changes)
        folder = Path(record["path"])
        # Never the old projector's name either: its file goes only once the definition
        # names the new one, so a crash part-way leaves a whole model.
        taken = {f["path"] for f in record["files"]}
        mmproj = _projector_name(projector, taken)
        entry = _import_file(projector, folder / mmproj, model_id, "symlink")[0][0]
        return self.registry.set_projector(model_id, mmproj, {**entry, "path": mmproj})


def check_projector(path: str, model: Path) -> Path:
    """The projector GGUF at `path`, once it is one for images whose output size is the
    model GGUF's embedding size; else an InvalidField naming `mmproj` that says why.

    The sizes are read from both headers, as llama.cpp's mtmd compares them when it
    loads the pair (clip_n_mmproj_embd against the model's input embedding size); a
    projector type whose output localrt cannot read is left to that check at start.
    """
    def bad(reason: str) -> InvalidField:
        return InvalidField(f"Invalid field 'mmproj': {reason}", param="mmproj")

    src = Path(path)
    if src.is_absolute() and src.is_dir():
        raise bad(f"{path} is a folder, not a projector GGUF file")
    try:
        _check_source(src, path)
    except _BadSource as exc:
        raise bad(str(exc)) from None
    try:
        found = ggufinfo.projector(src)
    except (OSError, ggufinfo.GGUFError):
        raise bad(f"{path} is not a vision projector GGUF (mmproj): it has no "
                  f"clip.projector_type") from None
    if not found.vision:
        raise bad(f"{path} is a {found.type} projector without a vision encoder "
                  f"(clip.has_vision_encoder); localrt takes images only")
    try:
        meta = ggufinfo.read_metadata(model)
    except (OSError, ggufinfo.GGUFError) as exc:
        raise bad(f"the model's GGUF header cannot be read: {exc}") from None
    wanted = ggufinfo.model_input_size(meta)
    if found.output_size is not None and wanted is not None and found.output_size != wanted:
        arch = meta.get("general.architecture", "")
        raise bad(f"the projector {path} gives embeddings of size {found.output_size}, but "
                  f"the model {model.name} takes embeddings of size {wanted} "
                  f"({arch}.embedding_length); they are not a pair")
    return src


def _projector_name(src: Path, taken: set) -> str:
    """The name a projector gets in a model's folder: one that registry.is_projector
    knows (so it is never taken for the weights), and no other file of the model has."""
    name = src.name if is_projector(src.name) else f"mmproj-{src.name}"
    if not name.lower().endswith(".gguf"):
        name += ".gguf"
    candidate, n = name, 1
    while candidate in taken:
        candidate, n = f"mmproj-{n}-{name}", n + 1
    return candidate


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
    link.unlink(missing_ok=True)  # what a crash part-way left
    os.symlink(src.resolve(), link)
    os.replace(link, target)



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
