"""Inference engines: which exist, what this machine runs, installing and loading them.

Built-in engines (`CATALOG`):
  gguf-cpp      llama.cpp through llama-cpp-python, a base dependency ("builtin"),
                so it is Ready on a fresh install once its probe passes.
  onnx-runtime  onnxruntime-genai, installed on request from the package index.
Custom engines come from the `localrt.engines` entry-point group, either of
packages in this Python or of wheels installed with `POST /v1/engines/install`.

An engine object has `name`, `format`, `description` and `load(model_path, options)`;
localrt.adapters holds the built-in ones and says what a loaded model offers. Which
models are loaded, and when they compute, is localrt.scheduler's business.

Installed variants live in `<dataFolderPath>/engines/<engine>/<variant>/<version>/`
(unpacked wheels, never pip-installed) and are listed in `engines.json` there, which
is written atomically after the folder is complete: a folder not in the file does
not count. llama_cpp and onnxruntime_genai are imported only when a model loads.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Mapping
from urllib.parse import unquote, urlsplit

from localrt import wheels
from localrt.adapters import GGUF_ENGINE, ONNX_ENGINE, GgufEngine, OnnxEngine, generating
from localrt.downloads import DownloadFailed as DownloadFailedError
from localrt.downloads import Downloads, Item, Task
from localrt.errors import BadRequest, Conflict, HTTPError, NotFound
from localrt.fsutil import atomic_write, fsync_dir, private_dir

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "localrt.engines"
REGISTRY_FILE = "engines.json"
PROBES_FILE = "probes.json"
DOWNLOADS_DIR = ".downloads"   # wheels while they download, under the engines folder
PROBE_TIMEOUT = 300            # seconds; a probe loads and decodes two tiny models
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*\Z")  # engine, variant and version


class EngineNotFound(NotFound):
    code = "engine_not_found"


class EngineIncompatible(Conflict):
    code = "engine_incompatible"


class EngineNotInstalled(Conflict):
    code = "engine_not_installed"


# --- the machine ----------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """What variants depend on: OS, architecture, CPU flags and the CUDA driver."""

    os: str                 # linux, mac, windows
    arch: str               # amd64, arm64
    cpu_model: str = ""
    cpu_flags: frozenset = frozenset()
    cuda: str | None = None  # the driver's CUDA version, "12.4"

    @property
    def platform(self) -> str:
        return f"{self.os}-{self.arch}"

    def cpu_level(self) -> str | None:
        """The best of avx512, avx2 and avx this CPU has (None: none of them)."""
        for level, flag in CPU_LEVELS:
            if flag in self.cpu_flags:
                return level
        return None

    def status(self) -> dict:
        """What `localrt ps` shows about the machine: CPU, cores, memory and CUDA."""
        memory = _meminfo()
        return {"os": self.os, "arch": self.arch, "cpu": self.cpu_model,
                "cpuLevel": self.cpu_level() or "", "cores": available_cores(),
                "ramTotal": memory.get("MemTotal", 0),
                "ramAvailable": memory.get("MemAvailable", 0), "cuda": self.cuda or ""}

    def key(self) -> str:
        """Identifies the CPU for cached probe results."""
        text = self.cpu_model + " " + " ".join(sorted(self.cpu_flags))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


CPU_LEVELS = (("avx512", "avx512f"), ("avx2", "avx2"), ("avx", "avx"))
_OS_NAMES = {"linux": "linux", "darwin": "mac", "win32": "windows"}
_ARCH_NAMES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def detect_hardware(cpuinfo: Path = Path("/proc/cpuinfo")) -> Hardware:
    """Read this machine's OS, architecture, CPU flags and CUDA driver version."""
    os_name = _OS_NAMES.get(sys.platform, sys.platform)
    machine = platform.machine().lower()
    model, flags = "", frozenset()
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return Hardware(os_name, _ARCH_NAMES.get(machine, machine), model, flags,
                    _cuda_driver_version())


def available_cores() -> int:
    """The CPUs this process may run on (all of them where that cannot be asked)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _meminfo(path: Path = Path("/proc/meminfo")) -> dict:
    """/proc/meminfo in bytes ({} where there is none)."""
    out = {}
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _cuda_driver_version() -> str | None:
    """The CUDA version the NVIDIA driver supports, from libcuda or nvidia-smi."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value:
            return f"{version.value // 1000}.{version.value % 1000 // 10}"
    except (OSError, AttributeError):
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        found = re.search(r"CUDA Version:\s*(\d+\.\d+)", out)
        return found.group(1) if found else None
    return None


# --- the catalog ----------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """An installable build of an engine, and what the machine needs to run it."""

    name: str
    distribution: str         # project name in the package index
    local: str | None = None  # the PEP 440 local label its wheels carry (+avx2)
    needs: str | None = None  # a CPU flag, or "cuda-12"


@dataclass(frozen=True)
class EngineSpec:
    """A built-in engine."""

    name: str
    format: str
    description: str
    module: str                                  # what `load` imports
    variants: Callable[[Hardware], list[Variant]]
    platforms: tuple[str, ...] = ()              # where builds exist ("" for any)
    min_python: tuple[int, int] = (3, 9)
    builtin: str | None = None                   # distribution shipped with localrt


def _gguf_variants(hw: Hardware) -> list[Variant]:
    found = [Variant(f"{hw.platform}-{level}", "llama-cpp-python", level, flag)
             for level, flag in CPU_LEVELS]
    return found + [Variant(f"{hw.platform}-cuda-12", "llama-cpp-python", "cu12", "cuda-12")]


def _onnx_variants(hw: Hardware) -> list[Variant]:
    return [Variant(hw.platform, "onnxruntime-genai"),
            Variant(f"{hw.platform}-cuda-12", "onnxruntime-genai-cuda", None, "cuda-12")]


_ADAPTERS = {GGUF_ENGINE: GgufEngine, ONNX_ENGINE: OnnxEngine}  # TODO(merge): the row's factory
CATALOG = {
    GGUF_ENGINE: EngineSpec(
        GGUF_ENGINE, GgufEngine.format, GgufEngine.description,
        "llama_cpp", _gguf_variants, builtin="llama-cpp-python"),
    ONNX_ENGINE: EngineSpec(
        ONNX_ENGINE, OnnxEngine.format, OnnxEngine.description,
        "onnxruntime_genai", _onnx_variants,
        # onnxruntime-genai publishes wheels for these platforms, CPython 3.10 and newer.
        platforms=("linux-amd64", "linux-arm64", "windows-amd64", "mac-arm64"),
        min_python=(3, 10)),
}


def runnable(variant: Variant, hw: Hardware) -> str | None:
    """None when this machine can run `variant`, else the reason it cannot."""
    if not variant.name.startswith(hw.platform):
        return f"it is built for another platform; this machine is {hw.platform}"
    if variant.needs is None:
        return None
    if variant.needs.startswith("cuda-"):
        major = variant.needs.split("-")[1]
        if hw.cuda is None:
            return "it needs an NVIDIA GPU with a CUDA driver, and none was found"
        if hw.cuda.split(".")[0] != major:
            return f"it needs CUDA {major}; the driver supports CUDA {hw.cuda}"
        return None
    if variant.needs not in hw.cpu_flags:
        return f"it needs the {variant.needs} instruction set, which this CPU lacks"
    return None


def recommended(variants: list[Variant], hw: Hardware) -> Variant | None:
    """The variant to install when none is asked for: a GPU one, else the best CPU one."""
    usable = [v for v in variants if runnable(v, hw) is None]
    gpu = [v for v in usable if v.needs and v.needs.startswith("cuda")]
    return (gpu or usable or [None])[0]


def _key(v: dict) -> tuple[str, str]:
    """What identifies an installed variant (registry entries, `active`, API rows)."""
    return v["variant"], v["version"]


def display_version(version: str) -> str:
    """Versions are shown as v0.3.36."""
    return f"v{version}" if version and not version.startswith("v") else version


def _bare_version(version: str) -> str:
    return version[1:] if version.startswith("v") else version


# --- the engines and their loaded models -----------------------------------------


class Engines:
    """Owns the engines registry file, probe results, and loaded engines and models.

    `_lock` guards `_state` (the content of engines.json), `_probes`, `_objects`
    (engine objects created in this process) and `_imported` (engine -> the folder its
    module was imported from). Model loads happen outside it. An uninstall is refused
    while the engine runs a model by the scheduler (Scheduler.engine_unused).
    """

    def __init__(self, root: Path, config: Callable[[], Mapping], downloads: Downloads,
                 index_url: Callable[[], str], hardware: Hardware | None = None,
                 entry_points: Callable[[], list] | None = None):
        self.root = root
        self._config = config
        self._downloads = downloads
        self._index_url = index_url
        self.hardware = hardware or detect_hardware()
        self._entry_points = entry_points or (
            lambda: list(metadata.entry_points(group=ENTRY_POINT_GROUP)))
        self._lock = threading.RLock()
        self._state = self._read(REGISTRY_FILE, {"engines": {}})
        self._probes = self._read(PROBES_FILE, {})
        self._objects: dict[str, object] = {}
        self._imported: dict[str, str] = {}

    # --- listing ---------------------------------------------------------------

    def names(self) -> list[str]:
        """Built-in engines first, then custom ones in name order."""
        with self._lock:
            custom = set(self._custom_entry_points()) | {
                name for name, e in self._state["engines"].items() if e.get("custom")}
        return list(CATALOG) + sorted(custom - set(CATALOG))

    def list(self) -> list[dict]:
        """The §2.2 entry of every engine."""
        return [self.entry(name) for name in self.names()]

    def entry(self, name: str) -> dict:
        """One engine's §2.2 entry: status Ready, Not Installed or Incompatible."""
        with self._lock:
            spec = CATALOG.get(name)
            if spec is None:
                return self._custom_entry(name)
            out = {"name": name, "productName": name, "description": spec.description,
                   "format": spec.format, "status": "Not Installed", "variant": "",
                   "version": ""}
            reason = self._platform_reason(spec)
            if reason:
                return {**out, "status": "Incompatible", "reason": reason}
            active = self._active(name)
            if active is None:
                return out
            problem = self._check(name, active)
            if problem:
                return {**out, "status": "Incompatible", "reason": problem}
            out.update(status="Ready", variant=active["variant"],
                       version=display_version(active["version"]))
            if self._needs_restart(name, active):
                out["restartRequired"] = True
            return out

    def variants(self, name: str) -> list[dict]:
        """The §2.3 entries of an engine's installed variants."""
        with self._lock:
            self.require_known(name)
            installed = self._installed(name)
            active = self._active(name, installed)
            out = []
            for v in installed:
                status = "Installed"
                problem = self._check(name, v)
                if problem:
                    status = "Incompatible"
                elif active and _key(v) == _key(active):
                    status = "Ready"
                row = {"engine": name, "name": v["variant"],
                       "version": display_version(v["version"]), "status": status}
                if problem:
                    row["reason"] = problem
                if v.get("builtin"):
                    row["builtin"] = True
                out.append(row)
            return out

    def _platform_reason(self, spec: EngineSpec) -> str | None:
        hw = self.hardware
        if spec.platforms and hw.platform not in spec.platforms:
            return f"{spec.name} has no build for {hw.platform}"
        if sys.version_info[:2] < spec.min_python:
            return (f"{spec.name} has no build for Python "
                    f"{'.'.join(map(str, sys.version_info[:2]))}")
        return None

    def _installed(self, name: str) -> list[dict]:
        """Installed variants: the builtin one first (gguf-cpp), then the registry's."""
        out = []
        spec = CATALOG.get(name)
        if spec and spec.builtin:
            builtin = self._builtin(spec)
            if builtin:
                out.append(builtin)
        entry = self._state["engines"].get(name, {})
        out += [dict(v, path=str(self.root / name / v["variant"] / v["version"]))
                for v in entry.get("installed", [])]
        return out

    def _builtin(self, spec: EngineSpec) -> dict | None:
        """The variant that ships with localrt, or None if its package is missing."""
        found = importlib.util.find_spec(spec.module)
        if found is None or not found.submodule_search_locations:
            return None
        try:
            version = metadata.version(spec.builtin)
        except metadata.PackageNotFoundError:
            return None
        info = self._probe(spec.name, None, version)
        variant = info.get("variant") or self.hardware.platform
        return {"variant": variant, "version": version, "builtin": True, "path": None,
                "distribution": spec.builtin}

    def _active(self, name: str, installed: list[dict] | None = None) -> dict | None:
        """The variant models of this engine load: the registry's choice, else builtin.

        `installed` is `_installed(name)` when the caller has it already.
        """
        chosen = self._state["engines"].get(name, {}).get("active")
        for v in self._installed(name) if installed is None else installed:
            if v.get("builtin"):
                if self._builtin_on(name):
                    return v
            elif chosen and _key(v) == _key(chosen):
                return v
        return None

    def _builtin_on(self, name: str) -> bool:
        """Whether the shipped build is the one models load (when it is installed)."""
        entry = self._state["engines"].get(name, {})
        return entry.get("active") is None and not entry.get("builtinDeactivated")

    def require_known(self, name: str) -> None:
        """Raise a 404 naming the known engines unless `name` is one."""
        if name not in self.names():
            raise EngineNotFound(f"Unknown engine {name!r}; known engines: "
                                 f"{', '.join(self.names())}", param="engine")

    def _check(self, name: str, v: dict) -> str | None:
        """Why variant `v` cannot run here (None: it can). gguf-cpp builds are probed."""
        if name == GGUF_ENGINE:
            return self._probe(name, v.get("path"), v["version"]).get("reason")
        return None

    def _needs_restart(self, name: str, active: dict) -> bool:
        imported = self._imported.get(name)
        return imported is not None and imported != str(active.get("path"))

    # --- the gguf-cpp probe ----------------------------------------------------

    def _probe(self, name: str, path: str | None, version: str) -> dict:
        """The cached probe result of a llama.cpp build: variant, and reason if it fails."""
        key = self._probe_key(path, version)
        result = self._probes.get(key)
        if result is None:
            result = run_probe(path, self.hardware)
            self._probes[key] = result
            self._write(PROBES_FILE, self._probes)
            if result.get("reason"):
                log.warning("%s %s failed its probe: %s", name, version, result["reason"])
        return result

    def _probe_key(self, path: str | None, version: str) -> str:
        """A build and this CPU: the llama_cpp folder, its libraries' sizes and times."""
        if path is None:
            found = importlib.util.find_spec("llama_cpp")
            folder = Path(list(found.submodule_search_locations)[0])
        else:
            folder = Path(path) / "llama_cpp"
        stamp = [str(folder), version]
        for lib in sorted((folder / "lib").glob("*.so")):
            st = lib.stat()
            stamp.append(f"{lib.name}:{st.st_size}:{st.st_mtime_ns}")
        digest = hashlib.sha256("\n".join(stamp).encode()).hexdigest()[:16]
        return f"{digest}-{self.hardware.key()}"

    # --- custom engines --------------------------------------------------------

    def _custom_entry_points(self) -> dict[str, tuple[object, str | None]]:
        """Custom engine name -> (entry point, folder to put on sys.path or None)."""
        found = {ep.name: (ep, None) for ep in self._entry_points()
                 if ep.name not in CATALOG}
        for name, entry in self._state["engines"].items():
            if not entry.get("custom") or name in CATALOG:
                continue
            active = entry.get("active")
            if not active:
                continue
            folder = self.root / name / active["variant"] / active["version"]
            for dist in metadata.distributions(path=[str(folder)]):
                for ep in dist.entry_points.select(group=ENTRY_POINT_GROUP, name=name):
                    found[name] = (ep, str(folder))
        return found

    def _custom_object(self, name: str):
        """Load a custom engine's entry point; raises EngineNotInstalled or Incompatible."""
        if name in self._objects:
            return self._objects[name]
        eps = self._custom_entry_points()
        if name not in eps:
            raise EngineNotInstalled(f"Engine {name} is not installed", param="engine")
        ep, folder = eps[name]
        if folder:
            _on_sys_path(folder)
        try:
            engine = ep.load()
            if isinstance(engine, type):
                engine = engine()
        except Exception as exc:
            raise EngineIncompatible(f"Engine {name} failed to load: "
                                     f"{exc.__class__.__name__}: {exc}") from None
        missing = [a for a in ("name", "format", "description", "load")
                   if not hasattr(engine, a)]
        if missing:
            raise EngineIncompatible(f"Engine {name} ({ep.value}) lacks "
                                     f"{', '.join(missing)}")
        self._objects[name] = engine
        self._imported[name] = str(folder)
        return engine

    def _custom_entry(self, name: str) -> dict:
        out = {"name": name, "productName": name, "description": "", "format": "",
               "status": "Not Installed", "variant": "", "version": ""}
        entry = self._state["engines"].get(name, {})
        try:
            engine = self._custom_object(name)
        except EngineNotInstalled:
            return out
        except HTTPError as exc:
            return {**out, "status": "Incompatible", "reason": exc.message}
        active = entry.get("active") or {}
        version = active.get("version") or str(getattr(engine, "version", ""))
        return {**out, "description": str(engine.description), "format": str(engine.format),
                "status": "Ready", "variant": active.get("variant", self.hardware.platform),
                "version": display_version(version)}

    # --- install, uninstall, default ---------------------------------------------

    def install(self, name: str, version: str | None = None,
                variant: str | None = None) -> dict:
        """Start installing a variant of a built-in engine as a download task."""
        spec = self._builtin_spec(name)
        reason = self._platform_reason(spec)
        if reason:
            raise BadRequest(f"Cannot install {name}: {reason}", param="engine")
        chosen = self._choose_variant(spec, variant)
        with self._lock:
            builtin = self._builtin(spec) if spec.builtin else None
            if builtin and version is None and variant in (None, builtin["variant"]):
                return self._reactivate_builtin(name, builtin)
        index = self._index_url()
        dist = wheels.choose(wheels.project_files(self._config(), index, chosen.distribution),
                             f"=={_bare_version(version)}" if version else "", chosen.local)
        if dist is None:
            wanted = f"{chosen.distribution} {version}" if version else chosen.distribution
            raise BadRequest(f"The package index {index} has no {wanted} wheel for variant "
                             f"{chosen.name} that this Python runs "
                             f"({wheels.supported_tags()[0]})",
                             param="version" if version else "variant")
        ver = dist.version.public
        with self._lock:
            if any(_key(v) == (chosen.name, ver) for v in self._installed(name)):
                raise Conflict(f"Engine {name} {display_version(ver)} ({chosen.name}) is "
                               f"already installed", param="engine")
        task = self._install_task(name, chosen.name, ver, [self._item(dist)])
        self._downloads.start(task)
        reply = {"message": f"Engine {name} starts installing", "engine": name,
                 "task": task.to_dict()}
        with self._lock:
            if name in self._imported:
                reply["note"] = (f"{name} is already loaded in this server; restart the "
                                 f"server to use the new variant once it is installed")
        return reply

    def install_wheel(self, source: str) -> dict:
        """Start installing a custom engine from a wheel file path or URL."""
        if urlsplit(source).scheme in ("http", "https"):
            filename = unquote(urlsplit(source).path.rsplit("/", 1)[-1])
            if not filename.endswith(".whl") or not _SAFE_NAME.match(filename):
                raise BadRequest(f"{source} does not name a .whl file", param="wheel")
            size = wheels.content_length(self._config(), source)
            item = Item(filename, source, self.root / DOWNLOADS_DIR / filename, size)
            task = self._install_task(None, self.hardware.platform, None, [item])
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
        name, version = self._wheel_engine(path)
        task = self._install_task(name, self.hardware.platform, version, [], local=path)
        self._downloads.start(task)
        return {"message": f"Engine {name} starts installing", "engine": name,
                "task": task.to_dict()}

    def uninstall(self, name: str, version: str | None = None,
                  variant: str | None = None) -> dict:
        """Remove an installed variant (the builtin one is only deactivated)."""
        self.require_known(name)
        with self._lock:
            target = self._pick_installed(name, version, variant)
            state = self._edited_state()
            entry = state["engines"].setdefault(name, {})
            active = entry.get("active")
            if target.get("builtin"):
                entry["builtinDeactivated"] = True
            else:
                entry["installed"] = [v for v in entry.get("installed", [])
                                      if _key(v) != _key(target)]
                if active and _key(active) == _key(target):
                    rest = entry["installed"]
                    entry["active"] = ({"variant": rest[-1]["variant"],
                                        "version": rest[-1]["version"]} if rest else None)
                if not entry["installed"] and entry.get("custom"):
                    del state["engines"][name]
                    self._objects.pop(name, None)
            self._save(state)
        if not target.get("builtin"):
            shutil.rmtree(target["path"], ignore_errors=True)
        log.info("engine %s %s (%s) uninstalled", name, target["version"], target["variant"])
        return {"message": f"Engine {name} uninstalled successfully"}

    def set_default(self, name: str, variant: str, version: str) -> dict:
        """Make an installed variant the one models of this engine load."""
        self.require_known(name)
        with self._lock:
            target = self._pick_installed(name, version, variant)
            state = self._edited_state()
            entry = state["engines"].setdefault(name, {})
            if target.get("builtin"):
                entry["active"], entry["builtinDeactivated"] = None, False
            else:
                entry["active"] = {"variant": target["variant"], "version": target["version"]}
            self._save(state)
            message = (f"Engine {name} now uses {target['variant']} "
                       f"{display_version(target['version'])}")
            if self._needs_restart(name, target):
                message += "; it is already loaded, so restart the server to use it"
            return {"message": message}

    def _builtin_spec(self, name: str) -> EngineSpec:
        spec = CATALOG.get(name)
        if spec is not None:
            return spec
        self.require_known(name)
        raise BadRequest(f"{name} is a custom engine; install it from its wheel "
                         f"(localrt engines install PATH_OR_URL.whl)", param="engine")

    def _choose_variant(self, spec: EngineSpec, wanted: str | None) -> Variant:
        options = spec.variants(self.hardware)
        if wanted is None:
            chosen = recommended(options, self.hardware)
            if chosen is None:
                raise BadRequest(f"This machine runs no variant of {spec.name}",
                                 param="variant")
            return chosen
        for option in options:
            if option.name == wanted:
                reason = runnable(option, self.hardware)
                if reason:
                    raise BadRequest(f"Variant {wanted} cannot run here: {reason}",
                                     param="variant")
                return option
        if not _SAFE_NAME.match(wanted) or not wanted.startswith(self.hardware.platform):
            raise BadRequest(f"Variant {wanted!r} cannot run here: it is not built for "
                             f"this machine ({self.hardware.platform})", param="variant")
        raise BadRequest(f"Unknown variant {wanted!r} of {spec.name}; variants for this "
                         f"machine: {', '.join(o.name for o in options)}", param="variant")

    def _pick_installed(self, name: str, version: str | None, variant: str | None) -> dict:
        installed = self._installed(name)
        if version is None and variant is None:
            active = self._active(name, installed)
            if active is not None:
                return active
        matches = [v for v in installed
                   if (variant is None or v["variant"] == variant)
                   and (version is None or v["version"] == _bare_version(version))]
        if not matches:
            what = " ".join(filter(None, [variant, version and display_version(version)]))
            raise EngineNotInstalled(f"Engine {name} {what} is not installed".replace("  ", " "),
                                     param="variant" if variant else "engine")
        return matches[-1]

    def _reactivate_builtin(self, name: str, builtin: dict) -> dict:
        if self._builtin_on(name):
            raise Conflict(f"Engine {name} {display_version(builtin['version'])} "
                           f"({builtin['variant']}) is already installed", param="engine")
        state = self._edited_state()
        state["engines"].setdefault(name, {}).update(active=None, builtinDeactivated=False)
        self._save(state)
        return {"message": f"Engine {name} starts installing",
                "note": "the build that ships with localrt is active again"}

    def _item(self, dist: wheels.Dist) -> Item:
        if not dist.sha256:
            raise wheels.PackageIndexError(f"The package index gives no sha256 for "
                                           f"{dist.filename}; refusing an unchecked wheel")
        size = dist.size if dist.size is not None else \
            wheels.content_length(self._config(), dist.url)
        return Item(dist.filename, dist.url, self.root / DOWNLOADS_DIR / dist.filename,
                    size, sha256=dist.sha256.lower())

    def _wheel_engine(self, wheel: Path) -> tuple[str, str]:
        """The engine name and version a custom engine wheel declares; 400 if it is unfit."""
        try:
            eps = wheels.entry_points(wheel, ENTRY_POINT_GROUP)
            meta = wheels.read_metadata(wheel)
            tags = wheels.wheel_tags(wheel.name)
        except (ValueError, OSError, zipfile.BadZipFile) as exc:
            raise BadRequest(f"{wheel.name} is not a usable wheel: {exc}", param="wheel") \
                from None
        if len(eps) != 1:
            raise BadRequest(f"{wheel.name} must declare exactly one {ENTRY_POINT_GROUP} "
                             f"entry point; it declares {len(eps)}", param="wheel")
        name = next(iter(eps))
        if name in CATALOG or not _SAFE_NAME.match(name):
            raise BadRequest(f"{wheel.name} declares the engine name {name!r}, which is "
                             f"taken or unsafe", param="wheel")
        if not set(tags) & set(wheels.supported_tags()):
            raise BadRequest(f"{wheel.name} is built for {', '.join(sorted(tags))}, not for "
                             f"this Python", param="wheel")
        return name, str(meta["Version"])

    def _install_task(self, name: str | None, variant: str, version: str | None,
                      items: list[Item], local: Path | None = None) -> Task:
        """A download task whose items are the wheels; success unpacks and registers."""
        config, index = self._config(), self._index_url()
        planned: dict[str, str] = {}
        wheel_files: list[Path] = [local] if local else []
        found = {"name": name, "version": version}

        def queue_requirements(task: Task, wheel: Path) -> None:
            meta = wheels.read_metadata(wheel)
            planned[wheels.canonicalize_name(meta["Name"])] = str(meta["Version"])
            for req in wheels.missing_requirements(meta, planned):
                dist = wheels.choose(wheels.project_files(config, index, req.name),
                                     str(req.specifier))
                if dist is None:
                    raise DownloadFailedError(f"{meta['Name']} needs {req}, and the package "
                                              f"index {index} has no wheel of it for this "
                                              f"Python")
                planned[wheels.canonicalize_name(req.name)] = dist.version.public
                task.items.append(self._item(dist))

        def after_item(task: Task, item: Item) -> None:
            if found["name"] is None:  # a custom wheel from a URL: now its name is known
                try:
                    found["name"], found["version"] = self._wheel_engine(item.local_path)
                except HTTPError as exc:
                    raise DownloadFailedError(exc.message) from None
            queue_requirements(task, item.local_path)

        def on_success(task: Task) -> None:
            paths = wheel_files + [item.local_path for item in task.items]
            self._finish_install(found["name"], variant, found["version"], paths,
                                 custom=found["name"] not in CATALOG)
            for item in task.items:
                item.local_path.unlink(missing_ok=True)

        task_name = name or (items[0].id if items else "wheel")
        task = Task(f"{task_name}:{variant}:{version or 'latest'}", "Engine", items,
                    on_success=on_success, after_item=after_item)
        if local is not None:
            queue_requirements(task, local)
        return task

    def _finish_install(self, name: str, variant: str, version: str, paths: list[Path],
                        custom: bool) -> None:
        """Unpack the wheels beside their final folder, rename it in, then register it."""
        target = self.root / name / variant / version
        staging = target.with_name(f".{version}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        private_dir(staging)
        for wheel in paths:
            wheels.unpack(wheel, staging)
        shutil.rmtree(target, ignore_errors=True)  # an earlier install that never registered
        os.replace(staging, target)
        fsync_dir(target.parent)
        with self._lock:
            state = self._edited_state()
            entry = state["engines"].setdefault(name, {})
            entry["installed"] = [v for v in entry.get("installed", [])
                                  if _key(v) != (variant, version)]
            entry["installed"].append({"variant": variant, "version": version,
                                       "wheels": [p.name for p in paths],
                                       "installedAt": int(time.time())})
            entry["active"] = {"variant": variant, "version": version}
            if custom:
                entry["custom"] = True
                self._objects.pop(name, None)  # a new version loads afresh
            self._save(state)
            if name == GGUF_ENGINE:
                self._probe(name, str(target), version)  # a new build is probed at once
        log.info("engine %s %s (%s) installed in %s", name, version, variant, target)

    # --- loading models --------------------------------------------------------

    def open(self, engine: str, model_path: str, options: dict):
        """Load a model file with an engine; raises 409 if the engine cannot run here.

        The model always has generate() (see localrt.adapters)."""
        with self._lock:
            engine_object = self._engine_object(engine)
        return generating(engine_object.load(model_path, dict(options)))

    def check_options(self, name: str, options: dict) -> list[tuple[str, str]]:
        """(option, why) for each start option the engine cannot take."""
        check = getattr(self._rules(name), "check_options", None)
        return list(check(options)) if check else []

    def check_request(self, name: str, params: dict) -> None:
        """Raise InvalidField for a chat request the engine cannot serve."""
        check = getattr(self._rules(name), "check_request", None)
        if check:
            check(params)

    def _rules(self, name: str):
        """What holds an engine's own checks: a built-in's adapter class, or a custom
        engine's object (None when it cannot be loaded; its start says why)."""
        spec = CATALOG.get(name)
        if spec is not None:
            return _ADAPTERS[name]
        try:
            with self._lock:
                return self._custom_object(name)
        except HTTPError:
            return None

    def _engine_object(self, name: str):
        spec = CATALOG.get(name)
        if spec is None:
            self.require_known(name)
            return self._custom_object(name)
        if name in self._objects:
            return self._objects[name]
        reason = self._platform_reason(spec)
        active = None if reason else self._active(name)
        if active is None:
            raise EngineNotInstalled(reason or f"Engine {name} is not installed; install it "
                                     f"with: localrt engines install {name}", param="engine")
        problem = self._check(name, active)
        if problem:
            raise EngineIncompatible(f"Engine {name} {display_version(active['version'])} "
                                     f"({active['variant']}) cannot run on this machine: "
                                     f"{problem}", param="engine")
        if active.get("path"):
            _on_sys_path(active["path"])
        engine = GgufEngine() if name == GGUF_ENGINE else OnnxEngine()
        self._objects[name] = engine
        self._imported[name] = str(active.get("path"))
        return engine

    # --- registry file ---------------------------------------------------------

    def _edited_state(self) -> dict:
        """A copy of engines.json's content to change; `_save` makes it current."""
        return copy.deepcopy(self._state)

    def _save(self, state: dict) -> None:
        """Write the registry file, then adopt `state` (so a failed write changes nothing)."""
        self._write(REGISTRY_FILE, state)
        self._state = state

    def _read(self, name: str, default: dict) -> dict:
        try:
            data = json.loads((self.root / name).read_text())
            return data if isinstance(data, dict) else default
        except FileNotFoundError:
            return default
        except (OSError, ValueError) as exc:
            log.warning("ignoring %s: %s", self.root / name, exc)
            return default

    def _write(self, name: str, data: dict) -> None:
        private_dir(self.root)
        atomic_write(self.root / name, json.dumps(data, indent=2).encode())


def _on_sys_path(folder: str) -> None:
    if folder not in sys.path:
        sys.path.insert(0, folder)
        importlib.invalidate_caches()


# --- the probe, in a child process ------------------------------------------------


def run_probe(path: str | None, hw: Hardware) -> dict:
    """Run localrt.probe on a llama.cpp build; {"variant", "version", "reason"?, ...}."""
    cmd = [sys.executable, "-m", "localrt.probe"] + ([path] if path else [])
    env = dict(os.environ)
    # The child must import this localrt, wherever it is installed or checked out.
    localrt_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [localrt_root, env.get("PYTHONPATH")]))
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT,
                              env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"reason": f"the build's probe did not finish in {PROBE_TIMEOUT} s"}
    lines = []
    for line in proc.stdout.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            pass
    info = next((line for line in lines if line.get("stage") == "info"), {})
    result = {"variant": gguf_variant(info.get("system_info", ""),
                                      info.get("gpu_offload", False), hw),
              "version": info.get("version", ""), "systemInfo": info.get("system_info", ""),
              "seconds": round(time.monotonic() - started, 2)}
    last = lines[-1] if lines else {}
    if proc.returncode == 0 and last.get("stage") == "done":
        result["decodeTokensPerSecond"] = last.get("tokens_per_second")
        return result
    result["reason"] = _probe_failure(proc, last)
    return result


def _probe_failure(proc: subprocess.CompletedProcess, last: dict) -> str:
    where = (f"in a {last['type']} quantized model" if last.get("stage") == "decode"
             else "while loading")
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode)
        what = {signal.SIGILL: "illegal instruction", signal.SIGSEGV: "segmentation fault",
                signal.SIGBUS: "bus error", signal.SIGABRT: "abort"}.get(sig, sig.name)
        return f"the build crashes on this CPU: {what} ({sig.name}) {where}"
    if last.get("stage") == "error":
        return f"the build failed its probe: {last.get('message')}"
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return f"the build failed its probe {where} (exit {proc.returncode}): {tail[:300]}"


def gguf_variant(system_info: str, gpu_offload: bool, hw: Hardware) -> str:
    """The variant name of a llama.cpp build, from llama_print_system_info()."""
    features = set(re.findall(r"(\w+) = 1", system_info))
    if gpu_offload and "CUDA" in system_info:
        major = (hw.cuda or "12").split(".")[0]
        return f"{hw.platform}-cuda-{major}"
    if gpu_offload and "METAL" in system_info.upper():
        return f"{hw.platform}-metal"
    for level, feature in (("avx512", "AVX512"), ("avx2", "AVX2"), ("avx", "AVX")):
        if feature in features:
            return f"{hw.platform}-{level}"
    return hw.platform
