"""Inference engines: the catalog, each engine's status, and loading engines.

The built-in engines are the rows of `CATALOG`: each names its adapter (imported at
its first use), the files it loads, its installable variants and its names in
model.yml. Adding one is an adapter module (an Engine of localrt.engines.contract, as
localrt.engines.llama.model and localrt.engines.onnx are) and a row. localrt.models.registry
asks the catalog which engine loads a model's files; no module but the catalog and the
adapters compares engine names.

  gguf-cpp      llama.cpp through llama-cpp-python, a base dependency ("builtin"),
                so it is Ready on a fresh install once its probe passes.
  onnx-runtime  onnxruntime-genai, installed on request from the package index.
  remote        part of localrt: a remote model has no files, and its chats are
                forwarded to OpenAI-compatible servers (localrt.remote); nothing to
                install (`EngineSpec.forwards`).
Custom engines come from the `localrt.engines` entry-point group (localrt.engines.plugins).

Installed variants are listed in `<dataFolderPath>/engines/engines.json`, which
localrt.engines.installs writes (`EngineState`) and changes: installs, uninstalls and the
active variant (cortex's default, `Engines.default`). The shipped gguf-cpp build is
installed while engines.json does not mark it uninstalled (`builtinDeactivated`).
The machine is localrt.engines.hardware; the check of gguf-cpp builds and its cache are
localrt.engines.probe. Which models are loaded, and when they compute, is
localrt.inference.scheduler's business. llama_cpp and onnxruntime_genai are imported only
when a model loads.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import os
import sys
import threading
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable, Mapping

from localrt import __version__
from localrt.engines import contract, cuda, plugins
from localrt.errors import Conflict, HTTPError, NotFound, shown
from localrt.engines.hardware import (CPU_LEVELS, Hardware, detect_hardware, recommended,
                                     vulkan_environment)
from localrt.engines.probe import Probes, vulkan_build


class EngineNotFound(NotFound):
    code = "engine_not_found"


class EngineIncompatible(Conflict):
    code = "engine_incompatible"


class EngineNotInstalled(Conflict):
    code = "engine_not_installed"


# --- the catalog ----------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """An installable build of an engine, and what the machine needs to run it."""

    name: str
    distribution: str         # project name in the package index
    local: str | None = None  # the PEP 440 local label its wheels carry (+avx2)
    needs: str | None = None  # a CPU flag, "cuda-12", or "vulkan" (a Vulkan device)
    # CMake options of a variant localrt compiles from the distribution's sdist when
    # the index has no wheel of it (localrt.engines.builds); () for one only the index has.
    cmake: tuple[str, ...] = ()
    # Patch files (localrt/engines/patches/) applied to the unpacked sdist before that.
    patches: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineSpec:
    """A built-in engine: one row of the catalog."""

    name: str
    format: str                                  # these two equal its adapter's own
    description: str
    factory: str                                 # "module:attr" of its adapter class
    files: tuple[str, ...]                       # file names it loads (fnmatch, lower case)
    module: str                                  # what the adapter's `load` imports
    variants: Callable[[Hardware], list[Variant]]
    aliases: tuple[str, ...] = ()                # its other names in model.yml (cortex's)
    folder: bool = False                         # a model is a whole folder, not a file
    platforms: tuple[str, ...] = ()              # where builds exist ("" for any)
    min_python: tuple[int, int] = (3, 9)
    builtin: str | None = None                   # distribution shipped with localrt
    probed: bool = False                         # its builds run localrt.engines.probe first
    forwards: bool = False                       # its models are served elsewhere: part of
                                                 # localrt, it loads nothing (remote)
    settings: tuple[str, ...] = ()               # the engine settings its adapter is made
                                                 # with (keyword arguments; Engines' own)
    vetted: bool = False                         # the first load of each file with a build
                                                 # runs in a child (localrt.engines.vetting)

    def adapter(self, settings: Mapping[str, object] | None = None) -> contract.Engine:
        """A new adapter object, made with those of `settings` it takes (its defaults for
        the rest), its module imported now; a TypeError for one that is not an Engine of
        localrt.engines.contract."""
        module, _, attr = self.factory.partition(":")
        given = {name: settings[name] for name in self.settings
                 if settings is not None and name in settings}
        engine = getattr(importlib.import_module(module), attr)(**given)
        lacks = contract.missing(engine, contract.Engine)
        if lacks:
            raise TypeError(f"{self.factory}, the adapter of engine {self.name}, lacks "
                            f"{', '.join(lacks)}")
        return engine

    def loads(self, path: str) -> bool:
        """Whether this engine loads a file of this name (a path's last part counts)."""
        name = path.lower().rsplit("/", 1)[-1]
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.files)


RPC_SUFFIX = "+rpc"  # a gguf-cpp variant built with llama.cpp's RPC backend (localrt.engines.rpc)
# gguf-cpp's Vulkan variant: llama.cpp's Vulkan backend, for any GPU with a Vulkan driver
# (and Mesa's lavapipe, a Vulkan device on the CPU). Compiled from the sdist; the patch
# lets it build against Debian 12's Vulkan headers.
VULKAN = "vulkan"
VULKAN_CMAKE = ("-DGGML_VULKAN=ON",)
VULKAN_PATCHES = ("ggml-vulkan-layer-settings.patch",)


def _gguf_variants(hw: Hardware) -> list[Variant]:
    # The +rpc ones come last: an install that names no variant never picks one.
    # Which one it picks is localrt.engines.hardware.recommended's rule.
    found = [Variant(f"{hw.platform}-{level}", "llama-cpp-python", level, flag)
             for level, flag in CPU_LEVELS]
    # CUDA: a wheel of the index, else compiled with the index's toolkit (localrt.engines.cuda).
    found += [Variant(f"{hw.platform}-cuda-{major}", "llama-cpp-python", f"cu{major}",
                      f"cuda-{major}", cmake=cuda.CMAKE) for major in ("12", "13")]
    found.append(Variant(f"{hw.platform}-{VULKAN}", "llama-cpp-python", VULKAN, VULKAN,
                         cmake=VULKAN_CMAKE, patches=VULKAN_PATCHES))
    return found + [Variant(f"{hw.platform}-{level}{RPC_SUFFIX}", "llama-cpp-python",
                            f"{level}.rpc", flag, cmake=("-DGGML_RPC=ON",))
                    for level, flag in CPU_LEVELS]


def _onnx_variants(hw: Hardware) -> list[Variant]:
    return [Variant(hw.platform, "onnxruntime-genai"),
            Variant(f"{hw.platform}-cuda-12", "onnxruntime-genai-cuda", None, "cuda-12")]


REMOTE_ENGINE = "remote"  # the engine of remote models (localrt.remote.remotes writes it)

# In order of preference: a model with files of two engines is the first one's.
CATALOG = {spec.name: spec for spec in (
    EngineSpec("gguf-cpp", "GGUF", "llama.cpp through llama-cpp-python; runs GGUF models",
               "localrt.engines.llama.model:GgufEngine", ("*.gguf",), "llama_cpp",
               _gguf_variants,
               aliases=("llama-cpp", "llamacpp", "llama.cpp"),
               builtin="llama-cpp-python", probed=True, settings=("prompt_cache_bytes",),
               vetted=True),
    EngineSpec("onnx-runtime", "ONNX", "onnxruntime-genai; runs ONNX models",
               "localrt.engines.onnx:OnnxEngine", ("*.onnx", "genai_config.json"),
               "onnxruntime_genai", _onnx_variants, aliases=("onnxruntime", "onnx"),
               folder=True,
               # onnxruntime-genai publishes wheels for these platforms, CPython 3.10+.
               platforms=("linux-amd64", "linux-arm64", "windows-amd64", "mac-arm64"),
               min_python=(3, 10)),
    EngineSpec(REMOTE_ENGINE, "OpenAI API", "forwards chats to OpenAI-compatible servers "
               "(vLLM, llama-server, another localrt); ships with localrt",
               "localrt.remote.remotes:RemoteEngine", (), "localrt.remote.remotes",
               lambda hw: [],
               builtin="localrt", forwards=True),
)}


def engine_alias(name: str) -> str | None:
    """The built-in engine a model.yml `engine` names, in any case (None: none)."""
    wanted = name.lower()
    # A remote model is registered by POST /v1/models/remote only, never by a model.yml.
    return next((s.name for s in CATALOG.values()
                 if wanted in (s.name, *s.aliases) and not s.forwards), None)


def engine_for_files(paths: Iterable[str], folder: bool = False) -> str | None:
    """The first built-in engine, in catalog order, that loads one of these files.

    With `folder`, only an engine whose model is a whole folder (onnx-runtime's) counts.
    """
    paths = list(paths)
    return next((s.name for s in CATALOG.values()
                 if (s.folder or not folder) and any(map(s.loads, paths))), None)


def weights_file(paths: Iterable[str]) -> str | None:
    """The file an engine loads among a model's: the first by name of `engine_for_files`'s."""
    paths = sorted(paths)
    engine = engine_for_files(paths)
    return next((p for p in paths if CATALOG[engine].loads(p)), None) if engine else None


def display_version(version: str) -> str:
    """Versions are shown as v0.3.36."""
    return f"v{version}" if version and not version.startswith("v") else version


def key(v: dict) -> tuple[str, str]:
    """What identifies an installed variant (registry entries, `active`, API rows)."""
    return v["variant"], v["version"]


def builtin_on(entry: dict) -> bool:
    """Whether the shipped build is the one models load (when it is installed)."""
    return entry.get("active") is None and not entry.get("builtinDeactivated")


# --- the engines and their adapters ----------------------------------------------


class Engines:
    """The engines this server knows, their status, and the adapters it made: one object
    per engine, made at its first use with the engine `settings` it takes (a built-in's
    row names them: gguf-cpp's `prompt_cache_bytes`, promptCacheMiB in bytes).

    `_lock` guards `_objects` (adapter objects made in this process), `_imported`
    (engine -> the folder its module was imported from, once a model may load with it)
    and `_builds` (engine -> the build that folder is, as `build` says it), and is
    never held while a build is probed or a model loads. engines.json is
    `state`'s, probe results are `probes`'. An uninstall is refused while the engine
    runs a model by the scheduler (Scheduler.engine_unused).
    """

    def __init__(self, root: Path, state, hardware: Hardware | None = None,
                 entry_points: Callable[[], list] | None = None,
                 run_probe: Callable[[str | None, Hardware], dict] | None = None,
                 rpc_trusted: Callable[[], list] = list,
                 settings: Mapping[str, object] | None = None):
        self.root = root
        self._settings = dict(settings or {})  # the adapters' settings, by keyword
        self._rpc_trusted = rpc_trusted  # rpcTrustedHosts, read per start
        self.state = state  # localrt.engines.installs.EngineState: engines.json
        self.hardware = hardware or detect_hardware()
        self.probes = Probes(root, self.hardware, run_probe)
        self._entry_points = entry_points or (
            lambda: list(metadata.entry_points(group=plugins.ENTRY_POINT_GROUP)))
        self._lock = threading.Lock()
        self._objects: dict[str, object] = {}
        self._imported: dict[str, str] = {}
        self._builds: dict[str, tuple[str, str | None]] = {}  # engine -> build(): its key

    # --- listing ---------------------------------------------------------------

    def names(self) -> list[str]:
        """Built-in engines first, then custom ones in name order."""
        custom = set(self._custom()) | {
            name for name, e in self.state.read()["engines"].items() if e.get("custom")}
        return list(CATALOG) + sorted(custom - set(CATALOG))

    def list(self) -> list[dict]:
        """The §2.2 entry of every engine."""
        return [self.entry(name) for name in self.names()]

    def entry(self, name: str) -> dict:
        """One engine's §2.2 entry: status Ready, Not Installed or Incompatible."""
        spec = CATALOG.get(name)
        if spec is None:
            return self._custom_entry(name)
        out = {"name": name, "productName": name, "description": spec.description,
               "format": spec.format, "status": "Not Installed", "variant": "",
               "version": ""}
        reason = self.platform_reason(spec)
        if reason:
            return {**out, "status": "Incompatible", "reason": reason}
        active = self.active(name)
        if active is None:
            return out
        problem = self.problem(name, active)
        if problem:
            return {**out, "status": "Incompatible", "reason": problem}
        out.update(status="Ready", variant=active["variant"],
                   version=display_version(active["version"]))
        if self.needs_restart(name, active):
            out["restartRequired"] = True
        return out

    def variants(self, name: str) -> list[dict]:
        """The §2.3 entries of an engine's installed variants."""
        self.require_known(name)
        installed = self.installed(name)
        active = self.active(name, installed)
        out = []
        for v in installed:
            status = "Installed"
            problem = self.problem(name, v)
            if problem:
                status = "Incompatible"
            elif active and key(v) == key(active):
                status = "Ready"
            row = {"engine": name, "name": v["variant"],
                   "version": display_version(v["version"]), "status": status}
            if problem:
                row["reason"] = problem
            if v.get("builtin"):
                row["builtin"] = True
            out.append(row)
        return out

    def default(self, name: str) -> dict:
        """cortex's default variant: the one models load, as {engine, variant, version}."""
        self.require_known(name)
        if name in CATALOG:
            active = self.active(name)
            found = active and (active["variant"], display_version(active["version"]))
        else:
            entry = self._custom_entry(name)
            found = entry["variant"] and (entry["variant"], entry["version"])
        if not found:
            raise EngineNotInstalled(f"Engine {name} is not installed, so it has no default "
                                     f"variant; install it with: localrt engines install "
                                     f"{name}", param="engine")
        return {"engine": name, "variant": found[0], "version": found[1]}

    def require_known(self, name: str) -> None:
        """Raise a 404 naming the known engines unless `name` is one."""
        if name not in self.names():
            raise EngineNotFound(f"Unknown engine {shown(name)}; known engines: "
                                 f"{', '.join(self.names())}", param="engine")

    def platform_reason(self, spec: EngineSpec) -> str | None:
        """Why no build of a built-in engine exists for this machine (None: one may)."""
        hw = self.hardware
        if spec.platforms and hw.platform not in spec.platforms:
            return f"{spec.name} has no build for {hw.platform}"
        if sys.version_info[:2] < spec.min_python:
            return (f"{spec.name} has no build for Python "
                    f"{'.'.join(map(str, sys.version_info[:2]))}")
        return None

    def installed(self, name: str) -> list[dict]:
        """Installed variants: the builtin one first (gguf-cpp), unless it was uninstalled,
        then the registry's."""
        out = []
        spec = CATALOG.get(name)
        if spec and spec.builtin and not self.state.entry(name).get("builtinDeactivated"):
            builtin = self.builtin(spec)
            if builtin:
                out.append(builtin)
        out += [dict(v, path=str(self.root / name / v["variant"] / v["version"]))
                for v in self.state.entry(name).get("installed", [])]
        return out

    def builtin(self, spec: EngineSpec) -> dict | None:
        """The variant that ships with localrt, or None if its package is missing."""
        if spec.forwards:  # localrt itself: nothing to find or probe
            return {"variant": self.hardware.platform, "version": __version__,
                    "builtin": True, "path": None, "distribution": spec.builtin}
        found = importlib.util.find_spec(spec.module)
        if found is None or not found.submodule_search_locations:
            return None
        try:
            version = metadata.version(spec.builtin)
        except metadata.PackageNotFoundError:
            return None
        info = self.probes.result(spec.name, None, version) if spec.probed else {}
        variant = info.get("variant") or self.hardware.platform
        return {"variant": variant, "version": version, "builtin": True, "path": None,
                "distribution": spec.builtin}

    def active(self, name: str, installed: list[dict] | None = None) -> dict | None:
        """The variant models of this engine load: the registry's choice, else builtin.

        `installed` is `installed(name)` when the caller has it already.
        """
        entry = self.state.entry(name)
        chosen = entry.get("active")
        for v in self.installed(name) if installed is None else installed:
            if v.get("builtin"):
                if builtin_on(entry):
                    return v
            elif chosen and key(v) == key(chosen):
                return v
        return None

    def problem(self, name: str, v: dict) -> str | None:
        """Why installed variant `v` cannot run here (None: it can); probes it if need be."""
        spec = CATALOG.get(name)
        if spec is not None and spec.probed:
            return self.probes.result(name, v.get("path"), v["version"]).get("reason")
        return None

    def needs_restart(self, name: str, variant: dict) -> bool:
        """Whether this process imported the engine from another variant's folder."""
        with self._lock:
            imported = self._imported.get(name)
        return imported is not None and imported != str(variant.get("path"))

    def forwards(self, name: str) -> bool:
        """Whether models of this engine are served elsewhere (remote ones): their chats
        go to localrt.remote.remotes, never to a loaded model."""
        spec = CATALOG.get(name)
        return spec is not None and spec.forwards

    def loaded(self, name: str) -> bool:
        """Whether this process has imported the engine already."""
        with self._lock:
            return name in self._imported

    def forget(self, name: str) -> None:
        """Drop a custom engine's adapter, so its next use loads the installed version."""
        with self._lock:
            self._objects.pop(name, None)

    # --- custom engines --------------------------------------------------------

    def _custom(self) -> dict[str, tuple[object, str | None]]:
        return plugins.find(self._entry_points(), self.state.read()["engines"], self.root,
                            CATALOG)

    def _custom_adapter(self, name: str):
        """Load a custom engine's entry point; raises EngineNotInstalled or Incompatible."""
        with self._lock:
            if name in self._objects:
                return self._objects[name]
            found = self._custom().get(name)
            if found is None:
                raise EngineNotInstalled(f"Engine {name} is not installed", param="engine")
            try:
                engine = plugins.load(name, *found)
            except plugins.PluginError as exc:
                raise EngineIncompatible(str(exc)) from None
            self._objects[name] = engine
            self._imported[name] = str(found[1])
            return engine

    def _custom_entry(self, name: str) -> dict:
        out = {"name": name, "productName": name, "description": "", "format": "",
               "status": "Not Installed", "variant": "", "version": ""}
        entry = self.state.entry(name)
        try:
            engine = self._custom_adapter(name)
        except EngineNotInstalled:
            return out
        except HTTPError as exc:
            return {**out, "status": "Incompatible", "reason": exc.message}
        active = entry.get("active") or {}
        version = active.get("version") or str(getattr(engine, "version", ""))
        return {**out, "description": str(engine.description), "format": str(engine.format),
                "status": "Ready", "variant": active.get("variant", self.hardware.platform),
                "version": display_version(version)}

    # --- loading ---------------------------------------------------------------

    def open(self, engine: str, model_path: str, options: dict) -> contract.Model:
        """Load a model file with an engine; raises 409 if the engine cannot run here.

        The model is always a contract.Model (contract.generating)."""
        return contract.generating(self.adapter(engine).load(model_path, dict(options)))

    def build(self, name: str) -> tuple[str, str | None] | None:
        """The build a model of engine `name` loads with, for the first load of its files
        in a child (localrt.engines.vetting): ("<engine>/<variant>/<version>", the folder
        it is imported from, None for the shipped one); None for an engine whose loads
        are not vetted. The 409s of a load when it cannot run here."""
        spec = CATALOG.get(name)
        if spec is None or not spec.vetted:
            return None
        with self._lock:
            if name in self._builds:
                return self._builds[name]
        self.adapter(name)  # installed and runnable, its folder on sys.path
        installed = self.installed(name)
        with self._lock:
            imported = self._imported.get(name)
        # The server loads with the build it imported, even once another is active.
        build = next((v for v in installed if str(v.get("path")) == imported), None) \
            or self.active(name, installed)
        found = f"{name}/{build['variant']}/{build['version']}", build.get("path")
        with self._lock:  # what this process imported does not change while it runs
            self._builds[name] = found
        return found

    def check_options(self, name: str, options: dict) -> list[tuple[str, str]]:
        """(option, why) for each start option the engine cannot take."""
        rules = self._rules(name)
        found = (list(rules.check_options(options))
                 if isinstance(rules, contract.ChecksOptions) else [])
        if options.get("rpc_servers") and "rpc_servers" not in dict(found):
            why = _rpc_problem(self, name, options["rpc_servers"], self._rpc_trusted())
            if why:
                found.append(("rpc_servers", why))
        return found

    def check_request(self, name: str, params: dict) -> None:
        """Raise InvalidField for a chat request the engine cannot serve."""
        rules = self._rules(name)
        if isinstance(rules, contract.ChecksRequests):
            rules.check_request(params)

    def _rules(self, name: str):
        """What holds an engine's own checks, installed or not: a built-in's adapter, or a
        custom engine's object (None when it cannot be loaded; its start says why)."""
        spec = CATALOG.get(name)
        if spec is not None:
            return self._made(spec)
        try:
            return self._custom_adapter(name)
        except HTTPError:
            return None

    def adapter(self, name: str):
        """The adapter object of a built-in or custom engine, made at its first use.

        Raises 404 for an unknown engine, 409 when it is not installed or cannot run here.
        """
        spec = CATALOG.get(name)
        if spec is None:
            self.require_known(name)
            return self._custom_adapter(name)
        with self._lock:
            ready = name in self._imported
        if not ready:
            self._ready(spec)
        return self._made(spec)

    def _ready(self, spec: EngineSpec) -> None:
        """Check that a built-in engine is installed and runs here (409s say why), and put
        its active variant's folder on sys.path, once, before its first load."""
        name = spec.name
        reason = self.platform_reason(spec)
        active = None if reason else self.active(name)  # probes a build here, unlocked
        if active is None:
            raise EngineNotInstalled(reason or f"Engine {name} is not installed; install it "
                                     f"with: localrt engines install {name}", param="engine")
        problem = self.problem(name, active)
        if problem:
            raise EngineIncompatible(f"Engine {name} {display_version(active['version'])} "
                                     f"({active['variant']}) cannot run on this machine: "
                                     f"{problem}", param="engine")
        with self._lock:
            if name not in self._imported:  # else another thread did it meanwhile
                if active.get("path"):
                    if vulkan_build(active["path"]):
                        # llama.cpp reads it in this process when its Vulkan backend
                        # first lists devices; the vetting children inherit it.
                        for var, value in vulkan_environment(self.hardware).items():
                            os.environ.setdefault(var, value)
                    plugins.on_sys_path(active["path"])
                self._imported[name] = str(active.get("path"))

    def _made(self, spec: EngineSpec):
        """A built-in engine's one adapter object, made with its settings at its first use
        (its checks may come before it is installed; its loads only after)."""
        with self._lock:
            if spec.name not in self._objects:
                self._objects[spec.name] = spec.adapter(self._settings)
            return self._objects[spec.name]


def _rpc_problem(engines: Engines, name: str, text: str, trusted: list) -> str | None:
    """Why a model of engine `name` cannot be split across the rpc-servers of `text`: an
    engine or an active build without llama.cpp's RPC backend, a malformed list, or a
    host that is neither loopback nor in rpcTrustedHosts (`trusted`; localrt.engines.rpc)."""
    from localrt.engines import rpc

    spec = CATALOG.get(name)
    with_rpc = [v for v in (spec.variants(engines.hardware) if spec else ())
                if v.name.endswith(RPC_SUFFIX)]
    if not with_rpc:
        return f"engine {name} cannot split a model across rpc-server hosts"
    try:
        servers = rpc.parse_servers(text)
    except ValueError as exc:
        return str(exc)
    untrusted = rpc.untrusted_host(servers, trusted)
    if untrusted:
        return untrusted[1]
    active = engines.active(name)
    if active is None or active["variant"].endswith(RPC_SUFFIX):
        return None  # not installed: its start says so
    wanted = active["variant"].split("+")[0] + RPC_SUFFIX
    if wanted not in [v.name for v in with_rpc]:  # a GPU build: the best CPU one
        best = recommended(with_rpc, engines.hardware)
        wanted = best.name if best else with_rpc[0].name
    return (f"the active {name} build ({active['variant']} "
            f"{display_version(active['version'])}) has no RPC backend; install the "
            f"variant {wanted} (localrt engines install {name} --variant {wanted}), "
            f"which localrt compiles from source when the package index has no wheel of "
            f"it, then start the model again")
