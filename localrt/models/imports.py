"""Imports: registering a local GGUF file or ONNX model folder, linked or copied in.

An imported model's folder is `<dataFolderPath>/models/imported/<quoted id>`. A link
points at the file or folder as it is; a copy goes through a part file, is fsynced
and renamed, and records its sha256. The definition is written last, so a crash
part-way leaves no registered model with missing files.
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
from localrt.models.registry import ONNX_CONFIG, Registry, new_definition


class Imports:
    """Imports local files into the registry."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self._lock = threading.Lock()  # guards _importing
        self._importing: set[str] = set()  # ids of imports under way

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
                definition = new_definition(model_id, "local", paths, files, source,
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
