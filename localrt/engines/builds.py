"""Engine variants compiled from source: a distribution's sdist, built by pip into a wheel.

A variant with CMake options (localrt.engines.catalog.Variant.cmake: gguf-cpp's +rpc ones,
-DGGML_RPC=ON, and its Vulkan one, -DGGML_VULKAN=ON) that the package index has no
wheel of is built here, inside its install task (localrt.engines.installs): the task
downloads the sdist from the index like a wheel (sha256 checked, resumable,
cancellable), then `Build.run` runs

    python -m pip wheel --no-deps --no-cache-dir -v --index-url INDEX -w OUT SDIST

with CMAKE_ARGS the variant's options (after any the server's environment has, and the
include that leaves llama.cpp's unused common library out:
localrt.bootstrap.lean_cmake_args) and CFLAGS/CXXFLAGS those of localrt's own build
(localrt.bootstrap.build_env: on x86-64 no AMX, which GCC 12 miscompiles), at low
priority (nice 10) so that models keep answering. pip takes the build requirements (scikit-build-core; cmake and ninja where
the machine lacks them) from the same index, and the Config's proxy, never the
environment's. The task's `build` field says how far it is: {"stage", "step",
"steps", "line"}, from pip's and scikit-build-core's stages and ninja's [step/steps]
lines, published as DownloadUpdated events at most once a second. A cancel ends pip
and its compilers (their process group); a failed build fails the task with the end
of its output.

A CUDA variant (localrt.engines.cuda) first installs its toolkit from the same index
into the build's scratch folder (the stage "toolkit"), builds for this machine's GPUs'
compute capabilities, and gets the CUDA runtime libraries added to its wheel.

A variant with patches (Variant.patches: files in localrt/engines/patches/, such as the
Vulkan variant's guard for Debian 12's older Vulkan headers) has its sdist unpacked
first, each patch applied with `patch -p1`, and pip builds that folder instead.
What a CMake option needs besides a compiler (the Vulkan headers and glslc for
-DGGML_VULKAN=ON: `BUILD_NEEDS`) is checked before the task starts
(`check_can_build`), and a 400 names the Debian packages that are missing.

The wheel is kept in `<engines>/.builds/<variant>/<version>/<key>/`, key a hash of the
sdist's sha256, the flags (the include by its contents, not its path), the patches and
this Python's tag, so installing the variant again (after
an uninstall) unpacks it without compiling (`cached_wheel`). Removing `.builds` frees
the space.
"""

from __future__ import annotations

import collections
import glob
import hashlib
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
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence
from urllib.parse import quote, urlsplit, urlunsplit

from localrt.engines import cuda, wheels
from localrt.bootstrap import NO_COMMON, build_env, lean_cmake_args
from localrt.errors import BadRequest
from localrt.downloads.fetch import Cancelled, DownloadFailed, Task

log = logging.getLogger(__name__)

BUILDS_DIR = ".builds"   # under the engines folder
NICE = 10                # the build's priority below the server's
PUBLISH_EVERY = 1.0      # seconds between progress events
TAIL_LINES = 15          # lines of a failed build's output quoted in the task's error
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")

# pip's and scikit-build-core's lines that start a stage of the build.
STAGES = (("Installing build dependencies", "requirements"),
          ("Getting requirements to build wheel", "requirements"),
          ("Preparing metadata", "metadata"),
          ("*** Configuring CMake", "configure"),
          ("*** Building project", "compile"),
          ("*** Installing project", "install"),
          ("*** Making wheel", "wheel"))
STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]\s*(.*)")  # ninja's "[12/197] command"
OUTPUT = re.compile(r"\s-o\s+(\S+)")
PATCHES = Path(__file__).resolve().parent / "patches"  # Variant.patches name files here

# What compiling with a CMake option needs besides a C/C++ compiler: (what it is, the
# Debian package that brings it, a command on PATH or file patterns, any of which will
# do). localrt(1), INSTALLATION, names the same packages, and localrt.bootstrap
# installs them for the tests: change the three together.
BUILD_NEEDS = {
    "-DGGML_VULKAN=ON": (
        ("the Vulkan headers", "libvulkan-dev", ("/usr/include/vulkan/vulkan.h",
                                                 "/usr/local/include/vulkan/vulkan.h")),
        ("the Vulkan loader's development library", "libvulkan-dev",
         ("/usr/lib/*/libvulkan.so", "/usr/lib/libvulkan.so", "/usr/lib64/libvulkan.so",
          "/usr/local/lib/libvulkan.so")),
        ("the GLSL compiler glslc", "glslc", "glslc"),
        ("the SPIR-V headers", "spirv-headers",
         ("/usr/share/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake",
          "/usr/lib/*/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake",
          "/usr/local/share/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake")),
    ),
}


def missing_build_needs(cmake: Sequence[str], which: Callable[[str], str | None] = shutil.which,
                        found: Callable[[str], bool] = lambda p: bool(glob.glob(p))
                        ) -> list[tuple[str, str]]:
    """(what, Debian package) of each thing compiling with the CMake options `cmake`
    needs and this machine lacks (`BUILD_NEEDS`)."""
    missing = []
    for option in cmake:
        for what, package, look in BUILD_NEEDS.get(option, ()):
            there = which(look) if isinstance(look, str) else any(map(found, look))
            if not there and (what, package) not in missing:
                missing.append((what, package))
    return missing


def check_can_build(what: str, cmake: Sequence[str] = (), patches: Sequence[str] = ()
                    ) -> None:
    """A 400 when this machine cannot compile `what` with the CMake options `cmake` and
    `patches`: no C/C++ compiler, no pip, no `patch`, or what `BUILD_NEEDS` names."""
    lacking = missing_build_needs(cmake)
    if patches and shutil.which("patch") is None:
        lacking.append(("the patch command", "patch"))
    if lacking:
        packages = list(dict.fromkeys(package for _, package in lacking))
        raise BadRequest(f"Compiling {what} needs {_listed([w for w, _ in lacking])}, "
                         f"which this machine lacks: install the Debian "
                         f"{'package' if len(packages) == 1 else 'packages'} "
                         f"{' '.join(packages)} (apt-get install {' '.join(packages)}), "
                         f"then install it again", param="variant")
    missing = [tool for tool in ("cc", "c++") if shutil.which(tool) is None]
    if missing:
        raise BadRequest(f"The package index has no wheel of {what}, and localrt would "
                         f"compile it from source, but this machine has no "
                         f"{' or '.join(missing)} (install a C/C++ compiler, such as "
                         f"Debian's build-essential, or put a wheel of it in the index)",
                         param="variant")
    if importlib.util.find_spec("pip") is None:
        raise BadRequest(f"The package index has no wheel of {what}, and localrt would "
                         f"compile it from source with pip, which its Python lacks",
                         param="variant")


def _listed(items: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def patch_files(names: Sequence[str]) -> list[Path]:
    """The patch files a variant names (Variant.patches), in localrt/engines/patches/."""
    return [PATCHES / name for name in names]


def build_flags(cmake: tuple[str, ...], environ: Mapping[str, str] = os.environ
                ) -> dict[str, str]:
    """The variables a build adds to the environment: CMAKE_ARGS with `cmake`, and the
    compiler flags of localrt's own build."""
    flags = build_env(dict(environ), platform.machine())
    lean = lean_cmake_args(dict(environ))["CMAKE_ARGS"]  # with the environment's own
    flags["CMAKE_ARGS"] = " ".join(filter(None, [lean, *cmake]))
    return flags


def cache_folder(engines_root: Path, variant: str, version: str, sdist_sha256: str,
                 flags: Mapping[str, str], patches: Sequence[Path] = ()) -> Path:
    """Where the wheel of this sdist, built with these flags and patches for this Python,
    is kept."""
    applied = [hashlib.sha256(p.read_bytes()).hexdigest() for p in patches]
    # The include's contents, not its path (another checkout, another site-packages).
    include = hashlib.sha256(NO_COMMON.read_bytes()).hexdigest()
    flags = {name: value.replace(str(NO_COMMON), include) for name, value in flags.items()}
    key = json.dumps([sdist_sha256, sorted(flags.items()), wheels.supported_tags()[0]]
                     + ([applied] if applied else []))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return engines_root / BUILDS_DIR / variant / version / digest


def cached_wheel(folder: Path) -> Path | None:
    """The wheel built earlier into `folder`, if there is one."""
    return next(iter(sorted(folder.glob("*.whl"))), None)


@dataclass
class Plan:
    """How a variant that the index has no wheel of is installed (`plan`)."""

    version: str
    sdist: wheels.Dist | None = None  # to download and compile with `build`...
    build: "Build | None" = None
    wheel: Path | None = None         # ...or the wheel built from it before
    note: str = ""


def plan(engines_root: Path, engine: str, variant, version: str | None, config: Mapping,
         index_url: str, progress: Callable[[Task], None],
         gpus: Callable[[], list] = list) -> Plan:
    """The sdist of `version` (None: the newest final one) of a variant
    (localrt.engines.catalog.Variant with `cmake`) to compile, or its wheel built before;
    its Build says how far it is with `progress(task)` (Downloads.progress).

    A 400 when the index has no such sdist, an error when it gives no sha256."""
    try:
        sdists = wheels.project_sdists(config, index_url, variant.distribution)
    except wheels.NoSuchProject:
        sdists = []
    sdist = wheels.choose_sdist(sdists, version)
    if sdist is None:
        wanted = f"{variant.distribution} {version}" if version else variant.distribution
        raise BadRequest(f"The package index {index_url} has neither a {wanted} wheel for "
                         f"variant {variant.name} nor an sdist to build it from",
                         param="version" if version else "variant")
    if not sdist.sha256:
        raise wheels.PackageIndexError(f"The package index gives no sha256 for "
                                       f"{sdist.filename}; refusing an unchecked sdist")
    ver = sdist.version.public
    toolkit = None  # a CUDA variant's, from the index (localrt.engines.cuda)
    if cuda.major(variant.name):
        toolkit = cuda.Toolkit(cuda.major(variant.name), gpus())
    flags = build_flags(toolkit.flags() if toolkit else variant.cmake)
    patches = patch_files(variant.patches)
    folder = cache_folder(engines_root, variant.name, ver, sdist.sha256.lower(), flags,
                          patches)
    wheel = cached_wheel(folder)
    if wheel is not None:
        return Plan(ver, wheel=wheel, note=f"{wheel.name} was built here before from "
                                           f"{sdist.filename} with the same flags")
    what = f"{engine} {variant.name} v{ver}"
    return Plan(ver, sdist, Build(what, folder, flags, index_url, config, progress,
                                  toolkit, patches),
                note=f"the package index has no wheel of {variant.name}: localrt "
                     f"compiles {sdist.filename} (minutes; the task's `build` says how "
                     f"far it is)")


class Build:
    """One sdist compiled into a wheel in `folder` (see the module docstring)."""

    def __init__(self, what: str, folder: Path, flags: Mapping[str, str], index_url: str,
                 config: Mapping, progress: Callable[[Task], None], toolkit=None,
                 patches: Sequence[Path] = ()):
        self.what = what          # "gguf-cpp linux-amd64-avx2+rpc 0.3.36", for messages
        self.folder = folder      # cache_folder(...)
        self.flags = dict(flags)  # build_flags(...)
        self.index_url = index_url
        self.config = config
        self.progress = progress  # publishes a task's `build` (a DownloadUpdated event)
        self.toolkit = toolkit    # a CUDA variant's localrt.engines.cuda.Toolkit, or None
        self.patches = list(patches)  # patch_files(...), applied in order

    def run(self, task: Task, sdist: Path) -> Path:
        """Compile `sdist`; the wheel, in `folder`. Raises DownloadFailed if it fails."""
        scratch = self.folder.parent / f".{self.folder.name}.partial"
        shutil.rmtree(scratch, ignore_errors=True)
        (scratch / "tmp").mkdir(parents=True)
        tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
        task.build = {"stage": "start", "step": 0, "steps": 0, "line": ""}
        started = time.monotonic()
        log.info("building %s from %s", self.what, sdist.name)
        try:
            if self.toolkit is not None:
                self._toolkit(task, scratch, tail)
            source = self._patched(task, sdist, scratch) if self.patches else sdist
            code = self._pip(task, source, scratch, tail)
            if task.cancelled.is_set():
                raise Cancelled()
            built = sorted((scratch / "wheel").glob("*.whl"))
            if code != 0 or not built:
                raise DownloadFailed(f"Building {self.what} from {sdist.name} failed "
                                     f"(pip exit status {code}); its last lines:\n"
                                     + "\n".join(tail))
            if self.toolkit is not None:  # its runtime libraries go with it
                self.toolkit.bundle(built[0])
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder.mkdir(parents=True)
            wheel = self.folder / built[0].name
            os.replace(built[0], wheel)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        task.build = {**task.build, "stage": "done"}
        self.progress(task)
        log.info("built %s in %.0f s: %s", self.what, time.monotonic() - started, wheel.name)
        return wheel

    def _toolkit(self, task: Task, scratch: Path, tail) -> None:
        """Install the CUDA toolkit from the index into `scratch` and point CMake at it."""
        task.build = {**task.build, "stage": "toolkit",
                      "line": f"installing {', '.join(self.toolkit.packages)}"}
        self.progress(task)
        try:
            self.toolkit.install(scratch, self._index_args(), self._environ(scratch),
                                 lambda cmd, env: self._run(task, cmd, env, tail))
        except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
            if task.cancelled.is_set():
                raise Cancelled() from None
            raise DownloadFailed(f"Building {self.what}: {exc}; its last lines:\n"
                                 + "\n".join(tail)) from None
        self.flags["CMAKE_ARGS"] = " ".join([self.flags["CMAKE_ARGS"],
                                             *self.toolkit.cmake_args()])

    def _patched(self, task: Task, sdist: Path, scratch: Path) -> Path:
        """Unpack `sdist` into `scratch` and apply the patches; the folder pip builds."""
        # Every line of the stage names the patches: it may last under a second.
        applying = ", ".join(p.name for p in self.patches)
        task.build.update(stage="patch", line=f"unpacking {sdist.name} to apply {applying}")
        self.progress(task)
        with tarfile.open(sdist) as tar:
            unpack_sdist(tar, scratch / "source")
        tops = [p for p in (scratch / "source").iterdir() if p.is_dir()]
        if len(tops) != 1:
            raise DownloadFailed(f"{sdist.name} does not hold one top folder")
        for patch in self.patches:
            task.build.update(line=f"applying {patch.name}")
            self.progress(task)
            failed = apply_patch(patch, tops[0])
            if failed:
                raise DownloadFailed(f"Building {self.what}: {patch.name} does not apply "
                                     f"to {sdist.name}:\n{failed}")
        return tops[0]

    def _pip(self, task: Task, sdist: Path, scratch: Path, tail) -> int:
        """Run pip wheel, reading its output into the task's progress; its exit code."""
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-v",
               *self._index_args(), "-w", str(scratch / "wheel"), str(sdist)]
        return self._run(task, cmd, self._environ(scratch), tail)

    def _index_args(self) -> list[str]:
        """pip's options for the index: its URL, trusted when the Config verifies no
        certificates."""
        args = ["--index-url", self.index_url]
        if not self.config.get("verify_peer_ssl", True):
            args += ["--trusted-host", urlsplit(self.index_url).hostname or ""]
        return args

    def _run(self, task: Task, cmd: list[str], env: Mapping[str, str], tail) -> int:
        """Run `cmd` at low priority in its own session, reading its output into the
        task's progress (a cancel ends it); its exit code."""
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=dict(env),
                                start_new_session=True, text=True, errors="replace")
        try:
            os.setpriority(os.PRIO_PROCESS, proc.pid, NICE)  # compilers inherit it
        except OSError:
            pass
        stopper = threading.Thread(target=_stop_on_cancel, args=(task, proc), daemon=True,
                                   name=f"build {task.id}")
        stopper.start()
        last = 0.0
        for raw in proc.stdout:
            line = raw.rstrip()
            if not line:
                continue
            tail.append(line[:400])
            if _progress(task.build, line) and time.monotonic() - last >= PUBLISH_EVERY:
                last = time.monotonic()
                self.progress(task)
        code = proc.wait()
        stopper.join()
        return code

    def _environ(self, scratch: Path) -> dict[str, str]:
        """pip's environment: the flags, a private TMPDIR, and the Config's proxy only."""
        env = {k: v for k, v in os.environ.items() if k.lower() not in PROXY_VARIABLES}
        env.update(self.flags, TMPDIR=str(scratch / "tmp"), PYTHONUNBUFFERED="1",
                   PIP_DISABLE_PIP_VERSION_CHECK="1")
        proxy = self.config.get("proxy_url")
        if proxy:
            parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
            user = self.config.get("proxy_username")
            if user:
                login = quote(user, safe="") + ":" + quote(
                    self.config.get("proxy_password") or "", safe="")
                parts = parts._replace(netloc=f"{login}@{parts.netloc}")
            env["HTTP_PROXY"] = env["HTTPS_PROXY"] = urlunsplit(parts)
            env["NO_PROXY"] = self.config.get("no_proxy") or ""
        return env


def unpack_sdist(tar: tarfile.TarFile, into: Path) -> None:
    """Unpack an sdist's files, refusing links and paths that leave `into`."""
    into.mkdir(parents=True, exist_ok=True)
    if hasattr(tarfile, "data_filter"):
        tar.extractall(into, filter="data")
        return
    root = into.resolve()
    for member in tar.getmembers():  # a Python without extraction filters
        target = (root / member.name).resolve()
        if not (member.isfile() or member.isdir()) or not target.is_relative_to(root):
            raise DownloadFailed(f"the sdist holds {member.name!r}, which localrt does "
                                 f"not unpack")
    tar.extractall(into)


def apply_patch(patch: Path, folder: Path, dry_run: bool = False) -> str:
    """Apply `patch` (a unified diff, -p1) to `folder`; "" when it applied, else what
    `patch` said. Nothing changes when it does not apply whole."""
    cmd = ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-d",
           str(folder), "-i", str(patch)]
    check = subprocess.run(cmd + ["--dry-run"], capture_output=True, text=True)
    if check.returncode != 0 or dry_run:
        return (check.stdout + check.stderr).strip() if check.returncode else ""
    done = subprocess.run(cmd, capture_output=True, text=True)
    return "" if done.returncode == 0 else (done.stdout + done.stderr).strip()


def _progress(progress: dict, line: str) -> bool:
    """Fold one line of pip's output into `progress`; whether it is worth publishing."""
    step = STEP.match(line)
    if step:
        output = OUTPUT.search(step.group(3))
        said = Path(output.group(1)).name if output else step.group(3)[:160]
        progress.update(stage="compile", step=int(step.group(1)), steps=int(step.group(2)),
                        line=f"[{step.group(1)}/{step.group(2)}] {said}")
        return True
    text = line.strip()
    for start, stage in STAGES:
        if text.startswith(start):
            progress.update(stage=stage, line=text[:160])
            return True
    return False


def _stop_on_cancel(task: Task, proc: subprocess.Popen, grace: float = 10.0) -> None:
    """End pip and everything it started when the task is cancelled, and wait (up to
    `grace` seconds) until they are gone, so none writes after the build is cleaned."""
    while proc.poll() is None:
        if task.cancelled.wait(0.5):
            break
    else:
        return
    deadline = time.monotonic() + grace
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: pip, cmake, ninja, cc
        while time.monotonic() < deadline:
            time.sleep(0.1)
            os.killpg(proc.pid, 0)  # ProcessLookupError once none is left
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
