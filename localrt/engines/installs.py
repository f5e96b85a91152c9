"""Installing, uninstalling and choosing engine variants, and engines.json that records them.

An install replies at once and runs as a download task of type Engine (localrt.downloads.tasks):
the engine's wheel for this Python and the requirements this environment lacks, from
the package index (localrt.engines.wheels; what the index has is localrt.engines.releases). Once
every wheel is checked they are unpacked beside
`<dataFolderPath>/engines/<engine>/<variant>/<version>/`, renamed into it, and only
then listed in engines.json, written atomically: a folder not in the file does not
count, so a cancelled or killed install leaves nothing half installed. An install
whose wheels would not fit unpacked fails before it unpacks (errorCode disk_full),
and one whose disk fills up while it unpacks takes its staging folder away: either
way the engine stays as it was. Nothing is ever pip-installed. A variant with CMake
options (gguf-cpp's +rpc ones) that the index has no wheel of is compiled from the
index's sdist inside the same task (localrt.engines.builds), or taken from the wheel
built here before.

Installing a variant that is installed already fetches nothing: its task checks
each installed file against the RECORD of its wheel, with the events of any install,
and makes it the active variant. The build of gguf-cpp that ships with localrt is
such a variant: uninstalling it only deactivates it (it leaves the installed list,
its files stay), and installing it again checks llama-cpp-python's files against
pip's RECORD and turns it back on.

`EngineState` owns engines.json; `Installs` changes it, and localrt.engines.catalog reads it.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import shutil
import threading
import time
import zipfile
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterator, Mapping
from urllib.parse import unquote, urlsplit

from localrt.engines import builds, cuda, plugins, wheels
from localrt.downloads.tasks import DownloadFailed, Downloads, Item, NoSpace, Task
from localrt.engines.catalog import (CATALOG, EngineNotInstalled, EngineSpec, Engines, Variant,
                             display_version, key)
from localrt.errors import BadRequest, Conflict, HTTPError
from localrt.fsutil import (MOVE_DATA, NO_SPACE, fsync_dir, human_size, no_inodes, private_dir,
                            read_json, remove_stale_temps, space_short, storage_error,
                            write_json)
from localrt.engines.hardware import Hardware, gpu_build, recommended, runnable
from localrt.engines.releases import LATEST, Releases, bare_version, wanted_version

log = logging.getLogger(__name__)

REGISTRY_FILE = "engines.json"
DOWNLOADS_DIR = ".downloads"   # wheels while they download, under the engines folder
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*\Z")  # engine, variant and version


class EngineState:
    """engines.json: each engine's installed variants, its active one, custom engines.

    `_lock` guards the file, and `_data` from the copy `edit()` hands out until that
    copy is written. `_data` is replaced, never changed, so what `read()` returns is a
    consistent snapshot without the lock.
    """

    def __init__(self, root: Path):
        self._file = root / REGISTRY_FILE
        self._lock = threading.Lock()
        remove_stale_temps(self._file)  # a kill mid-write left them
        self._data = read_json(self._file, {"engines": {}})

    def read(self) -> dict:
        """The content of engines.json; never change it (`edit` does)."""
        return self._data

    def entry(self, name: str) -> dict:
        """One engine's record ({} for none)."""
        return self._data["engines"].get(name, {})

    @contextmanager
    def edit(self) -> Iterator[dict]:
        """A copy to change in a `with` block, written atomically and adopted at its end.

        An exception in the block changes nothing, and neither does a failed write.
        """
        with self._lock:
            data = copy.deepcopy(self._data)
            yield data
            try:
                write_json(self._file, data)
            except OSError as exc:  # the old file stays, whole
                raise storage_error(exc, self._file.parent, f"write {self._file.name}",
                                    MOVE_DATA) from None
            self._data = data


class Installs:
    """Install, uninstall and `use` (the default variant) for the engines of `engines`.

    It holds no lock of its own: engines.json is `state`'s, and no lock is held while
    a wheel downloads or a new build is probed.
    """

    def __init__(self, engines: Engines, state: EngineState, downloads: Downloads,
                 config: Callable[[], Mapping], index_url: Callable[[], str]):
        self._engines = engines
        self._state = state
        self._downloads = downloads
        self._config = config
        self._index_url = index_url
        self._releases = Releases(engines.hardware, config, index_url)
        self.root = engines.root

    def install(self, name: str, version: str | None = None,
                variant: str | None = None) -> dict:
        """Start installing a variant of a built-in engine as a download task.

        `version` None or "latest" is the newest the index has. `variant` None is this
        machine's pick (localrt.engines.hardware.recommended): the shipped build, unless
        the pick is a GPU variant. A variant installed already is not fetched again: its
        task checks its files (`_check`).
        """
        engines, hw = self._engines, self._engines.hardware
        spec = self._builtin_spec(name)
        reason = engines.platform_reason(spec)
        if reason:
            raise BadRequest(f"Cannot install {name}: {reason}", param="engine")
        version = wanted_version(version)
        builtin = engines.builtin(spec) if spec.builtin else None
        if variant is None and builtin:
            # The shipped build serves, unless this machine's pick is a GPU variant.
            pick = recommended(spec.variants(hw), hw)
            variant = pick.name if pick is not None and gpu_build(pick) else None
        if builtin and version in (None, builtin["version"]) and \
                variant in (None, builtin["variant"]):
            return self._check(name, builtin)
        chosen = choose_variant(spec, variant, hw)
        installed = {key(v): v for v in engines.installed(name)}
        if (chosen.name, version) in installed:  # the index is not needed
            return self._check(name, installed[chosen.name, version])
        files = self._releases.files(chosen.distribution)
        dist = wheels.choose(files, f"=={version}" if version else "", chosen.local)
        if dist is None and chosen.cmake:  # compiled from the sdist (localrt.engines.builds)
            return self._build(name, chosen, version, installed)
        if dist is None:
            raise self._releases.no_wheel(chosen, version, files, builtin)
        ver = dist.version.public
        if (chosen.name, ver) in installed:
            return self._check(name, installed[chosen.name, ver])
        task = self._install_task(name, chosen.name, ver, [self._item(dist)])
        self._downloads.start(task)
        reply = {"message": f"Engine {name} starts installing", "engine": name,
                 "task": task.to_dict()}
        if engines.loaded(name):
            reply["note"] = (f"{name} is already loaded in this server; restart the "
                             f"server to use the new variant once it is installed")
        return reply

    def _build(self, name: str, chosen: Variant, version: str | None,
               installed: dict) -> dict:
        """Install a variant the index has no wheel of from its sdist (localrt.engines.builds)."""
        plan = builds.plan(self.root, name, chosen, version, self._config(), self._index_url(),
                           self._downloads.progress, gpus=self._engines.hardware.gpus.list)
        if (chosen.name, plan.version) in installed:
            return self._check(name, installed[chosen.name, plan.version])
        if plan.build is not None:
            builds.check_can_build(plan.build.what, chosen.cmake, chosen.patches)
        items = [self._item(plan.sdist)] if plan.build else []
        task = self._install_task(name, chosen.name, plan.version, items, local=plan.wheel,
                                  build=plan.build)
        self._downloads.start(task)
        restart = "; restart the server to use it" if self._engines.loaded(name) else ""
        return {"message": f"Engine {name} starts installing", "engine": name,
                "task": task.to_dict(), "note": plan.note + restart}

    def install_wheel(self, source: str) -> dict:
        """Start installing a custom engine from a wheel file path or URL."""
        platform = self._engines.hardware.platform
        if urlsplit(source).scheme in ("http", "https"):
            filename = unquote(urlsplit(source).path.rsplit("/", 1)[-1])
            if not filename.endswith(".whl") or not SAFE_NAME.match(filename):
                raise BadRequest(f"{source} does not name a .whl file", param="wheel")
            size = wheels.content_length(self._config(), source)
            item = Item(filename, source, self.root / DOWNLOADS_DIR / filename, size)
            task = self._install_task(None, platform, None, [item])
            self._downloads.start(task)
            return {"message": f"Engine from {filename} starts installing",
                    "engine": None, "task": task.to_dict()}
        try:
            path = Path(source).expanduser()
        except RuntimeError:  # "~someone/x.whl" for a user this machine does not have
            raise BadRequest(f"Cannot find the home folder in {source!r}; give an absolute "
                             f"path", param="wheel") from None
        if not path.is_absolute():
            raise BadRequest("The wheel path must be absolute", param="wheel")
        if not path.is_file():
            raise BadRequest(f"No such file: {path}", param="wheel")
        name, version = wheel_engine(path)
        task = self._install_task(name, platform, version, [], local=path)
        self._downloads.start(task)
        return {"message": f"Engine {name} starts installing", "engine": name,
                "task": task.to_dict()}

    def uninstall(self, name: str, version: str | None = None,
                  variant: str | None = None) -> dict:
        """Remove an installed variant (the builtin one is only deactivated).

        The API refuses it while the engine runs a model (Scheduler.engine_unused)."""
        self._engines.require_known(name)
        if name in CATALOG:
            _refuse_part_of_localrt(CATALOG[name])
        target = self._pick_installed(name, version, variant)
        dropped = False
        with self._state.edit() as state:
            entry = state["engines"].setdefault(name, {})
            active = entry.get("active")
            if target.get("builtin"):
                entry["builtinDeactivated"] = True
            else:
                entry["installed"] = [v for v in entry.get("installed", [])
                                      if key(v) != key(target)]
                if active and key(active) == key(target):
                    rest = entry["installed"]
                    entry["active"] = ({"variant": rest[-1]["variant"],
                                        "version": rest[-1]["version"]} if rest else None)
                if not entry["installed"] and entry.get("custom"):
                    del state["engines"][name]
                    dropped = True
        if dropped:
            self._engines.forget(name)
        if not target.get("builtin"):
            shutil.rmtree(target["path"], ignore_errors=True)
        log.info("engine %s %s (%s) uninstalled", name, target["version"], target["variant"])
        return {"message": f"Engine {name} uninstalled successfully"}

    def set_default(self, name: str, variant: str, version: str) -> dict:
        """Make an installed variant the one models of this engine load."""
        self._engines.require_known(name)
        target = self._pick_installed(name, version, variant)
        self._activate(name, target)
        message = (f"Engine {name} now uses {target['variant']} "
                   f"{display_version(target['version'])}")
        if self._engines.needs_restart(name, target):
            message += "; it is already loaded, so restart the server to use it"
        return {"message": message}

    def releases(self, name: str) -> list[dict]:
        """cortex's releases of a built-in engine (localrt.engines.releases)."""
        return self._releases.releases(self._builtin_spec(name))

    def release(self, name: str, version: str) -> list[dict]:
        """cortex's variants of one release of a built-in engine (localrt.engines.releases)."""
        return self._releases.release(self._builtin_spec(name), version)

    def _builtin_spec(self, name: str) -> EngineSpec:
        spec = CATALOG.get(name)
        if spec is not None:
            _refuse_part_of_localrt(spec)
            return spec
        self._engines.require_known(name)
        raise BadRequest(f"{name} is a custom engine; install it from its wheel "
                         f"(localrt engines install PATH_OR_URL.whl)", param="engine")

    def _pick_installed(self, name: str, version: str | None, variant: str | None) -> dict:
        """The installed variant a body names (an uninstall's, a default's): the active one
        for none, else the last installed that matches; "latest" is any version."""
        installed = self._engines.installed(name)
        version = None if version == LATEST else version
        if version is None and variant is None:
            active = self._engines.active(name, installed)
            if active is not None:
                return active
        matches = [v for v in installed
                   if (variant is None or v["variant"] == variant)
                   and (version is None or v["version"] == bare_version(version))]
        if not matches:
            what = " ".join(filter(None, [variant, version and display_version(version)]))
            raise EngineNotInstalled(f"Engine {name} {what} is not installed".replace("  ", " "),
                                     param="variant" if variant else "engine")
        return matches[-1]

    def _activate(self, name: str, target: dict) -> None:
        """Make an installed variant (the builtin one too) the one models load."""
        with self._state.edit() as state:
            entry = state["engines"].setdefault(name, {})
            if target.get("builtin"):
                entry["active"], entry["builtinDeactivated"] = None, False
            else:
                entry["active"] = {"variant": target["variant"], "version": target["version"]}

    def _check(self, name: str, target: dict) -> dict:
        """Install what is installed: a task checks its files against the RECORD of each
        of its wheels (the builtin one: of its package), then makes it the active one.

        Nothing is downloaded; the task's events are an install's, so a client waiting
        for DownloadSuccess goes on. A file that differs fails the task and names it.
        """
        what = f"{name} {display_version(target['version'])} ({target['variant']})"
        builtin = target.get("builtin")
        items = []
        for wheel, dist_info in dist_infos(target):
            try:
                files = tuple(wheels.recorded_files(dist_info))
            except (OSError, ValueError) as exc:
                mend = (f"reinstall {target['distribution']} in localrt's environment"
                        if builtin else "uninstall it and install it again")
                raise Conflict(f"Engine {what} is damaged: {dist_info}/RECORD cannot be "
                               f"read ({getattr(exc, 'strerror', None) or exc}); {mend}",
                               param="engine") from None
            items.append(Item(wheel, dist_info.as_uri(), dist_info,
                              sum(size or 0 for _, _, size in files), files=files))
        task = Task(f"{name}:{target['variant']}:{target['version']}", "Engine", items,
                    on_success=lambda task: self._activate(name, target))
        self._downloads.start(task)
        reply = {"message": f"Engine {what} is already installed; checking its files",
                 "engine": name, "task": task.to_dict()}
        if builtin and self._state.entry(name).get("builtinDeactivated"):
            reply.update(message=f"Engine {name} starts installing",
                         note="the build that ships with localrt: its files are checked "
                              "against their RECORD, then it is active again")
        elif self._engines.needs_restart(name, target):
            reply["note"] = (f"{name} is already loaded in this server from another "
                             f"variant; restart the server to use this one")
        return reply

    def _item(self, dist: wheels.Dist) -> Item:
        """A wheel (or sdist) of the index as a task item, checked against its sha256."""
        if not dist.sha256:
            raise wheels.PackageIndexError(f"The package index gives no sha256 for "
                                           f"{dist.filename}; refusing an unchecked wheel")
        size = dist.size if dist.size is not None else \
            wheels.content_length(self._config(), dist.url)
        return Item(dist.filename, dist.url, self.root / DOWNLOADS_DIR / dist.filename,
                    size, sha256=dist.sha256.lower())

    def _install_task(self, name: str | None, variant: str, version: str | None,
                      items: list[Item], local: Path | None = None,
                      build: builds.Build | None = None) -> Task:
        """A download task whose items are the wheels (with `build`, the first is an sdist
        it compiles into one); success unpacks and registers."""
        config, index = self._config(), self._index_url()
        planned: dict[str, str] = {}
        wheel_files: list[Path] = [local] if local else []
        found = {"name": name, "version": version}
        sdist = items[0] if build is not None else None

        def queue_requirements(task: Task, wheel: Path) -> None:
            meta = wheels.read_metadata(wheel)
            planned[wheels.canonicalize_name(meta["Name"])] = str(meta["Version"])
            for req in wheels.missing_requirements(meta, planned):
                dist = wheels.choose(wheels.project_files(config, index, req.name),
                                     str(req.specifier))
                if dist is None:
                    raise DownloadFailed(f"{meta['Name']} needs {req}, and the package "
                                         f"index {index} has no wheel of it for this Python")
                planned[wheels.canonicalize_name(req.name)] = dist.version.public
                task.items.append(self._item(dist))

        def after_item(task: Task, item: Item) -> None:
            wheel = item.local_path
            if item is sdist:
                wheel = build.run(task, item.local_path)
                wheel_files.append(wheel)
            elif found["name"] is None:  # a custom wheel from a URL: now its name is known
                try:
                    found["name"], found["version"] = wheel_engine(item.local_path)
                except HTTPError as exc:
                    raise DownloadFailed(exc.message) from None
            queue_requirements(task, wheel)

        def on_success(task: Task) -> None:
            paths = wheel_files + [i.local_path for i in task.items if i is not sdist]
            self._finish_install(found["name"], variant, found["version"], paths)
            for item in task.items:
                item.local_path.unlink(missing_ok=True)

        task_name = name or (items[0].id if items else "wheel")
        task = Task(f"{task_name}:{variant}:{version or 'latest'}", "Engine", items,
                    on_success=on_success, after_item=after_item)
        if local is not None:
            queue_requirements(task, local)
        return task

    def _finish_install(self, name: str, variant: str, version: str,
                        paths: list[Path]) -> None:
        """Unpack the wheels beside their final folder, rename it in, then register it."""
        target = self.root / name / variant / version
        staging = target.with_name(f".{version}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        needed = sum(wheels.unpacked_size(wheel) for wheel in paths)
        short, free, margin = space_short(self.root, needed)
        if short:
            raise NoSpace(f"The disk is full: {name} {version} takes {human_size(needed)} "
                          f"unpacked, and {self.root} has {human_size(free)} free, with "
                          f"{human_size(margin)} kept free; free {human_size(short)} more "
                          f"there{MOVE_DATA}, then install it again")
        private_dir(staging)
        try:
            for wheel in paths:
                wheels.unpack(wheel, staging)
        except OSError as exc:  # the disk filled meanwhile, say: its space goes back
            why = " (it has no free inodes: too many files)" if no_inodes(staging) else ""
            shutil.rmtree(staging, ignore_errors=True)
            if exc.errno not in NO_SPACE:
                raise
            raise NoSpace(f"The disk is full: {name} {version} did not fit in {self.root} "
                          f"while it unpacked{why}; free some space there{MOVE_DATA}, "
                          f"then install it again") from None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        shutil.rmtree(target, ignore_errors=True)  # an earlier install that never registered
        os.replace(staging, target)
        fsync_dir(target.parent)
        custom = name not in CATALOG
        with self._state.edit() as state:
            entry = state["engines"].setdefault(name, {})
            entry["installed"] = [v for v in entry.get("installed", [])
                                  if key(v) != (variant, version)]
            entry["installed"].append({"variant": variant, "version": version,
                                       "wheels": [p.name for p in paths],
                                       "installedAt": int(time.time())})
            entry["active"] = {"variant": variant, "version": version}
            if custom:
                entry["custom"] = True
        if custom:
            self._engines.forget(name)  # a new version loads afresh
        else:
            # A new build is probed now (by engines that probe), not at its first use.
            self._engines.problem(name, {"path": str(target), "version": version})
        log.info("engine %s %s (%s) installed in %s", name, version, variant, target)


def dist_infos(target: dict) -> list[tuple[str, Path]]:
    """(name, .dist-info folder) of each distribution an installed variant is made of."""
    if target.get("builtin"):
        dist = metadata.distribution(target["distribution"])
        record = next((f for f in dist.files or () if f.name == "RECORD"
                       and f.parent.suffix == ".dist-info"), None)
        if record is None:
            raise Conflict(f"{target['distribution']} in localrt's environment has "
                           f"no RECORD to check it against; reinstall it there",
                           param="engine")
        folder = Path(dist.locate_file(record)).parent
        return [(folder.name, folder)]
    folder = Path(target["path"])
    return [(wheel, folder / ("-".join(wheel.split("-")[:2]) + ".dist-info"))
            for wheel in target.get("wheels", [])]


def _refuse_part_of_localrt(spec: EngineSpec) -> None:
    """A 400 for installing or uninstalling an engine that is part of localrt (remote)."""
    if spec.forwards:
        raise BadRequest(f"Engine {spec.name} is part of localrt: there is nothing to "
                         f"install or uninstall; `localrt models add-remote` adds a model "
                         f"it serves", param="engine")


def choose_variant(spec: EngineSpec, wanted: str | None, hw: Hardware) -> Variant:
    """The variant of `spec` to install: `wanted`, else the recommended one; 400 if none."""
    options = spec.variants(hw)
    if wanted is None:
        chosen = recommended(options, hw)
        if chosen is None:
            raise BadRequest(f"This machine runs no variant of {spec.name}", param="variant")
        return chosen
    for option in options:
        if option.name == wanted:
            cuda.refuse_without_driver(option.name, hw.cuda)  # 400 nvidia_driver_missing
            reason = runnable(option, hw)
            if reason:
                raise BadRequest(f"Variant {wanted} cannot run here: {reason}",
                                 param="variant")
            return option
    if not SAFE_NAME.match(wanted) or not wanted.startswith(hw.platform):
        raise BadRequest(f"Variant {wanted!r} cannot run here: it is not built for "
                         f"this machine ({hw.platform}); variants for this machine: "
                         f"{', '.join(o.name for o in options)}", param="variant")
    raise BadRequest(f"Unknown variant {wanted!r} of {spec.name}; variants for this "
                     f"machine: {', '.join(o.name for o in options)}", param="variant")


def wheel_engine(wheel: Path) -> tuple[str, str]:
    """The engine name and version a custom engine wheel declares; 400 if it is unfit."""
    group = plugins.ENTRY_POINT_GROUP
    try:
        eps = wheels.entry_points(wheel, group)
        meta = wheels.read_metadata(wheel)
        tags = wheels.wheel_tags(wheel.name)
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        raise BadRequest(f"{wheel.name} is not a usable wheel: {exc}", param="wheel") \
            from None
    if len(eps) != 1:
        raise BadRequest(f"{wheel.name} must declare exactly one {group} entry point; it "
                         f"declares {len(eps)}", param="wheel")
    name = next(iter(eps))
    if name in CATALOG or not SAFE_NAME.match(name):
        raise BadRequest(f"{wheel.name} declares the engine name {name!r}, which is "
                         f"taken or unsafe", param="wheel")
    if not set(tags) & set(wheels.supported_tags()):
        raise BadRequest(f"{wheel.name} is built for {', '.join(sorted(tags))}, not for "
                         f"this Python", param="wheel")
    return name, str(meta["Version"])
