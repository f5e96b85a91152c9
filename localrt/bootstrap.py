"""Set localrt up from a checkout, before anything is installed: the README's two commands.

    python3 -m localrt.bootstrap           # install localrt into .venv, start the server
    python3 -m localrt.bootstrap --test    # install localrt[test] into .venv, run the suite

Each one installs the Debian or Ubuntu packages that are missing (through sudo when
not root), creates the virtual environment ``.venv`` in the checkout (or reuses it),
installs the checkout into it with pip, and then runs ``localrt start`` or
``python -m pytest``. Arguments after ``--`` go to that last command. ``--dry-run``
prints the commands without running them. ``.ci/run`` is ``--test`` on a clean clone.
``--test`` also downloads what the tests' package index serves: onnxruntime-genai's
wheels, and the llama-cpp-python sdist (with its build requirements) that the RPC
test compiles into the gguf-cpp +rpc variant, once, the way localrt itself does.

What the tests build or download once and keep in the checkout (`TEST_CACHES`: the
+rpc and Vulkan variants' wheels, the CUDA toolkit) would be built again in every
fresh clone, which is what CI runs (two llama.cpp compiles, 650 MB). So ``--test``
keeps them between runs on the same machine in a folder outside the checkout
(`cache_folder`: LOCALRT_TEST_CACHE, else $XDG_CACHE_HOME or ~/.cache, then
localrt-tests): it copies what the checkout lacks from there before the downloads, and
the folders back after pytest, each file atomically. The tests take a wheel only under
the key of its sdist, flags and patches (tests/support/variants.py), so a kept file
never stands in for a build of something else; a machine without the cache builds it all.

This module runs with the system's python3 before any dependency exists, so it uses
the standard library only and stays Python 3.9 compatible. Only localrt.engines.builds
imports it, for `build_env`: a variant localrt compiles later (gguf-cpp +rpc) gets
the same flags.

llama-cpp-python (the gguf-cpp engine) compiles from source for this CPU. GCC 12
miscompiles ggml's AMX kernels (SIGILL on the first quantized model), so on x86-64
the build leaves AMX out whenever the compiler knows the AMX flags (`build_env`), and
pip runs with ``--no-cache-dir`` so that it never reuses a wheel built without them.
Every llama-cpp-python build leaves out llama.cpp's common library, which
llama-cpp-python forces on and never loads (`lean_cmake_args`): a third of the compile.
pip takes its index from its own settings (PIP_INDEX_URL, PIP_FIND_LINKS,
PIP_NO_INDEX, pip.conf), which pass through untouched: that is how a site without
the internet builds against a mirror.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import platform
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, TextIO, Tuple

ROOT = Path(__file__).resolve().parent.parent

AMX_OFF = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")

# The real engine wheels the tests' package index serves. tests/conftest.py's
# index_dir names the same pin in its failure message: change both together.
ENGINE_WHEELS = ("onnxruntime-genai==0.18.0",)
WHEEL_DIR = Path("tests") / ".engine-wheels"
# What the RPC test's package index serves (tests/test_rpc_live.py): the sdist that
# localrt compiles into the gguf-cpp +rpc variant, and the wheels its build needs
# (cmake and ninja only where the machine lacks them, but they are small).
RPC_SDIST = "llama-cpp-python==0.3.36"
RPC_BUILD_WHEELS = ("scikit-build-core", "cmake", "ninja")
RPC_SOURCES = Path("tests") / ".rpc-build" / "sources"
# The CUDA toolkit tests/test_cuda.py installs through its package index and configures
# the CUDA variant's CMake with (localrt.engines.cuda.TOOLKITS["13"] and what they need:
# about 650 MB, once).
CUDA_TOOLKIT = ("nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-cublas", "nvidia-cuda-cccl")
CUDA_SOURCES = Path("tests") / ".cuda-build" / "toolkit"
# What --test keeps between runs outside the checkout (see the module docstring): the
# variants' wheels tests/test_rpc_live.py and tests/test_vulkan_live.py compile, and
# the toolkit above. The tests name the same folders: change them together.
TEST_CACHES = (Path("tests") / ".rpc-build" / "built", Path("tests") / ".vulkan-build" / "built",
               CUDA_SOURCES)
TEST_CACHE_VAR = "LOCALRT_TEST_CACHE"  # a folder, or "off"

# Commands the tests use when present, and the Debian packages that bring them.
# Without them test_man.py, test_cors_browser.py, the tinyproxy tests
# (tests/emulators/proxyfix.py) and the real agent clients' tests (npm installs Claude
# Code and Codex: tests/support/agents.py) skip, except under CI. glslc (and
# glslang-tools beside it) compiles the Vulkan variant's shaders (tests/test_vulkan.py).
TEST_TOOLS = {"groff": "groff-base", "chromium": "chromium", "chromedriver": "chromium-driver",
              "tinyproxy": "tinyproxy", "node": "nodejs", "npm": "npm", "glslc": "glslc",
              "glslangValidator": "glslang-tools"}
# Files the tests use when present (glob patterns), and the Debian packages that bring
# them: the Vulkan loader and Mesa's lavapipe, a Vulkan device that runs on the CPU,
# and the Vulkan and SPIR-V headers the gguf-cpp Vulkan variant compiles against
# (localrt.engines.builds.BUILD_NEEDS). Without them tests/test_hardware.py's and
# tests/test_vulkan.py's Vulkan tests skip, except under CI.
TEST_FILES = {"/usr/lib/*/libvulkan.so.1": "libvulkan1",
              "/usr/share/vulkan/icd.d/lvp_icd.*.json": "mesa-vulkan-drivers",
              "/usr/include/vulkan/vulkan.h": "libvulkan-dev",
              "/usr/share/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake": "spirv-headers"}


# --- the build flags --------------------------------------------------------------


def compiler_accepts(compiler: str, language: str, flags: Sequence[str]) -> bool:
    """Whether `compiler` (a CC or CXX value) accepts `flags` when compiling `language`."""
    try:
        proc = subprocess.run([*shlex.split(compiler), *flags, "-E", "-x", language, "-"],
                              input=b"", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        return False
    return proc.returncode == 0


# llama.cpp's common library, which llama-cpp-python builds and never loads, left out of
# every llama-cpp-python build (`lean_cmake_args`; the file says how).
NO_COMMON = Path(__file__).resolve().parent / "engines" / "patches" / \
    "llama-cpp-python-no-common.cmake"


def lean_cmake_args(environ: Dict[str, str]) -> Dict[str, str]:
    """CMAKE_ARGS for a llama-cpp-python build: `environ`'s own, then the include that
    leaves llama.cpp's common library out (NO_COMMON), a third of the compile. Other
    CMake projects ignore it: it names llama.cpp's project."""
    include = shlex.quote(f"-DCMAKE_PROJECT_llama.cpp_INCLUDE={NO_COMMON}")
    return {"CMAKE_ARGS": " ".join(filter(None, (environ.get("CMAKE_ARGS"), include)))}


def build_env(environ: Dict[str, str], machine: str,
              accepts: Callable[[str, str, Sequence[str]], bool] = compiler_accepts
              ) -> Dict[str, str]:
    """The variables pip's build needs beyond `environ`: on x86-64, flags without AMX."""
    if machine.lower() not in ("x86_64", "amd64"):
        return {}
    extra = {}
    for flags_var, compiler_var, compiler, language in (("CFLAGS", "CC", "cc", "c"),
                                                        ("CXXFLAGS", "CXX", "c++", "c++")):
        # A compiler that does not know these flags cannot emit AMX code either.
        if accepts(environ.get(compiler_var) or compiler, language, AMX_OFF):
            extra[flags_var] = " ".join(filter(None, (environ.get(flags_var), *AMX_OFF)))
    return extra


# --- Debian packages --------------------------------------------------------------


def any_file(pattern: str) -> bool:
    """Whether a file matches the glob `pattern`."""
    return bool(glob.glob(pattern))


def missing_packages(test: bool, need_venv: bool,
                     which: Callable[[str], Optional[str]] = shutil.which,
                     find_spec: Callable[[str], object] = importlib.util.find_spec,
                     exists: Callable[[str], bool] = any_file
                     ) -> Tuple[List[str], List[str]]:
    """(needed, optional) Debian packages that are missing; setup stops without `needed`."""
    needed = []
    if need_venv and find_spec("ensurepip") is None:
        # Debian ships venv's pip apart from Python itself.
        needed.append("python3.%d-venv" % sys.version_info[1])
    if not (which("cc") and which("c++")):
        needed.append("build-essential")  # llama-cpp-python compiles C and C++
    optional = [pkg for cmd, pkg in TEST_TOOLS.items() if test and not which(cmd)]
    optional += [pkg for pattern, pkg in TEST_FILES.items() if test and not exists(pattern)]
    return needed, optional


def apt_prefix(euid: int, which: Callable[[str], Optional[str]] = shutil.which
               ) -> Optional[List[str]]:
    """How apt-get runs here: [] as root, ["sudo"] through sudo, None not at all."""
    if not which("apt-get"):
        return None
    if euid == 0:
        return []
    return ["sudo"] if which("sudo") else None


def apt_candidate(package: str) -> bool:
    """Whether apt can install `package` (Ubuntu has no chromium deb, for one)."""
    proc = subprocess.run(["apt-cache", "policy", package], capture_output=True, text=True)
    return any(line.strip().startswith("Candidate:") and "(none)" not in line
               for line in proc.stdout.splitlines())


@dataclass
class Host:
    """What setup asks of this machine; tests pass their own answers."""

    arch: str = field(default_factory=platform.machine)
    euid: int = field(default_factory=os.geteuid)
    environ: Dict[str, str] = field(default_factory=lambda: dict(os.environ))
    which: Callable[[str], Optional[str]] = shutil.which
    find_spec: Callable[[str], object] = importlib.util.find_spec
    exists: Callable[[str], bool] = any_file
    accepts: Callable[[str, str, Sequence[str]], bool] = compiler_accepts
    candidate: Callable[[str], bool] = apt_candidate


# --- the test caches ---------------------------------------------------------------


def cache_folder(environ: Dict[str, str]) -> Optional[Path]:
    """Where --test keeps `TEST_CACHES` between runs; None when LOCALRT_TEST_CACHE is off."""
    given = environ.get(TEST_CACHE_VAR)
    if given is not None:
        if given.strip().lower() in ("", "0", "off", "no", "false"):
            return None
        return Path(given).expanduser().absolute()
    base = environ.get("XDG_CACHE_HOME") or os.path.join(
        environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return Path(base) / "localrt-tests"


def _files(folder: Path) -> Dict[str, Path]:
    """The regular files under `folder` by their path relative to it (none if absent)."""
    found = {}
    for top, dirs, names in os.walk(str(folder)):
        dirs[:] = [d for d in dirs if not d.startswith(".partial-")]
        for name in names:
            path = Path(top) / name
            if path.is_file() and not path.is_symlink() and not name.startswith(".partial-"):
                found[str(path.relative_to(folder))] = path
    return found


def _same(a: Path, b: Path) -> bool:
    """Whether two files have the same size and modification time (copy2 keeps both)."""
    sa, sb = a.stat(), b.stat()
    return sa.st_size == sb.st_size and int(sa.st_mtime) == int(sb.st_mtime)


def copy_atomically(source: Path, target: Path) -> None:
    """Copy `source` to `target` under a temporary name in its folder, then rename it: a
    reader sees the old file or the whole new one, never a part."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.parent / f".partial-{os.getpid()}-{target.name}"
    try:
        shutil.copy2(str(source), str(partial))
        os.replace(str(partial), str(target))
    finally:
        if partial.exists():
            partial.unlink()


def sync_files(source: Path, target: Path, mirror: bool) -> List[str]:
    """Copy the files under `source` that `target` lacks (or, with `mirror`, has
    otherwise), each atomically; with `mirror`, remove those of `target` that `source`
    lacks. The relative paths copied. A file that vanishes meanwhile is left out."""
    have, want = _files(target), _files(source)
    copied = []
    for rel, path in sorted(want.items()):
        try:
            if rel in have and (not mirror or _same(path, have[rel])):
                continue
            copy_atomically(path, target / rel)
        except FileNotFoundError:  # another run's save removed it: that run's choice
            continue
        copied.append(rel)
    if mirror:
        for rel in sorted(set(have) - set(want)):
            have[rel].unlink()
        for top, dirs, names in os.walk(str(target), topdown=False):
            if top != str(target) and not os.listdir(top):
                os.rmdir(top)
    return copied


def restore_test_caches(cache: Path, root: Path, out: TextIO) -> None:
    """Copy into the checkout what `cache` keeps of `TEST_CACHES` and the checkout lacks."""
    for rel in TEST_CACHES:
        copied = sync_files(cache / rel, root / rel, mirror=False)
        if copied:
            print(f"  {rel}: {len(copied)} file(s) from {cache / rel}", file=out)


def save_test_caches(root: Path, cache: Path, out: TextIO) -> None:
    """Make `cache` hold what the checkout's `TEST_CACHES` hold now (those that exist)."""
    for rel in TEST_CACHES:
        if (root / rel).is_dir():
            copied = sync_files(root / rel, cache / rel, mirror=True)
            if copied:
                print(f"  {rel}: {len(copied)} file(s) kept in {cache / rel}", file=out)


# --- running the steps ------------------------------------------------------------


class Shell:
    """Echoes each command as `+ command`, then runs it from the checkout (unless dry_run)."""

    def __init__(self, out: TextIO, dry_run: bool, environ: Dict[str, str],
                 call: Callable[..., int] = subprocess.call):
        self.out = out
        self.dry_run = dry_run
        self.environ = environ
        self.call = call

    def __call__(self, argv: Sequence[object], extra_env: Optional[Dict[str, str]] = None) -> int:
        """Run `argv` with `extra_env` added to this process's environment; its exit code."""
        argv = [str(arg) for arg in argv]
        extra_env = extra_env or {}
        shown = [f"{name}={shlex.quote(value)}" for name, value in extra_env.items()]
        shown += [shlex.quote(arg) for arg in argv]
        print("+ " + " ".join(shown), file=self.out, flush=True)
        if self.dry_run:
            return 0
        return self.call(argv, cwd=str(ROOT), env={**self.environ, **extra_env})

    def step(self, shown: str, action: Callable[[], None], err: TextIO) -> None:
        """Echo `shown` as `+ shown`, then run `action` (unless dry_run). Its failure is
        a note, not the setup's: a cache only saves time."""
        print("+ " + shown, file=self.out, flush=True)
        if self.dry_run:
            return
        try:
            action()
        except OSError as exc:
            print(f"note: {shown} failed ({exc}); the tests build what they lack",
                  file=err)


def install_packages(shell: Shell, needed: List[str], optional: List[str],
                     prefix: Optional[List[str]], err: TextIO,
                     candidate: Callable[[str], bool] = apt_candidate) -> int:
    """apt-get install what is missing; non-zero when a needed package cannot be had."""
    if not needed and not optional:
        return 0
    if prefix is None:
        if needed:
            print(f"localrt needs the packages {' '.join(needed)}; install them as root "
                  f"(apt-get install {' '.join(needed + optional)}) and run this again.",
                  file=err)
            return 1
        print(f"note: {' '.join(optional)} cannot be installed here (no root, sudo or "
              f"apt-get); the tests that need them are skipped.", file=err)
        return 0
    rc = shell([*prefix, "apt-get", "update", "-q"])
    if rc:
        return rc
    # After the update, apt knows what this release has; a dry run cannot ask.
    available = [pkg for pkg in optional if shell.dry_run or candidate(pkg)]
    if len(available) < len(optional):
        absent = [pkg for pkg in optional if pkg not in available]
        print(f"note: apt has no {' '.join(absent)} here; the tests that need "
              f"{'it' if len(absent) == 1 else 'them'} are skipped.", file=err)
    if not needed and not available:
        return 0
    return shell([*prefix, "env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install",
                  "-y", "-q", "--no-install-recommends", *needed, *available])


def setup(args: argparse.Namespace, shell: Shell, host: Host, err: TextIO) -> int:
    """Install localrt (and with --test its test dependencies), then start it or test it."""
    venv = Path(args.venv).absolute()
    python = venv / "bin" / "python"
    needed, optional = missing_packages(args.test, not python.exists(), host.which,
                                        host.find_spec, host.exists)
    rc = install_packages(shell, needed, optional, apt_prefix(host.euid, host.which), err,
                          host.candidate)
    if rc:
        return rc
    steps: List[Tuple[List[object], Dict[str, str]]] = []
    if not python.exists():
        steps.append(([sys.executable, "-m", "venv", venv], {}))
    steps.append(([python, "-m", "pip", "install", "--upgrade", "pip"], {}))
    flags = {**build_env(host.environ, host.arch, host.accepts),
             **lean_cmake_args(host.environ)}
    steps.append(([python, "-m", "pip", "install", "--no-cache-dir",
                   ".[test]" if args.test else "."], flags))
    if not args.test:
        steps.append(([venv / "bin" / "localrt", "start", *args.rest], {}))
    rc = run_steps(shell, steps)
    if rc or not args.test:
        if not rc:
            print(f"\nThe localrt command is {venv / 'bin' / 'localrt'}. To type just "
                  f"`localrt`, put its folder on PATH:\n    export PATH=\"{venv / 'bin'}:$PATH\"",
                  file=shell.out)
        return rc
    cache = cache_folder(host.environ)
    if cache is not None:  # before the downloads: pip download keeps the files it finds
        shell.step(f"restore test caches from {cache}",
                   lambda: restore_test_caches(cache, ROOT, shell.out), err)
    rc = run_steps(shell, [
        ([python, "-m", "pip", "download", "--only-binary=:all:", "-d", WHEEL_DIR,
          *ENGINE_WHEELS], {}),
        ([python, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "-d",
          RPC_SOURCES, RPC_SDIST], {}),
        ([python, "-m", "pip", "download", "--only-binary=:all:", "-d", RPC_SOURCES,
          *RPC_BUILD_WHEELS], {}),
        ([python, "-m", "pip", "download", "--only-binary=:all:", "-d", CUDA_SOURCES,
          *CUDA_TOOLKIT], {})])
    if rc:
        return rc
    rc = shell([python, "-m", "pytest", *args.rest])
    if cache is not None:  # whatever pytest says: what a test built and kept is good
        shell.step(f"save test caches to {cache}",
                   lambda: save_test_caches(ROOT, cache, shell.out), err)
    return rc


def run_steps(shell: Shell, steps: Sequence[Tuple[List[object], Dict[str, str]]]) -> int:
    """Run each (argv, extra_env) in turn; the first non-zero exit code stops the rest."""
    for argv, extra_env in steps:
        rc = shell(argv, extra_env)
        if rc:
            return rc
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The bootstrap's options; what follows `--` goes to localrt start or pytest."""
    p = argparse.ArgumentParser(
        prog="python3 -m localrt.bootstrap",
        description="Install localrt from this checkout into a virtual environment and "
                    "start the server, or with --test install the test dependencies and "
                    "run the whole suite. Arguments after -- go to `localrt start` or pytest.")
    p.add_argument("--test", action="store_true",
                   help="install the test dependencies and run the whole suite")
    p.add_argument("--venv", default=str(ROOT / ".venv"),
                   help="the virtual environment to create or reuse (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the commands without running them")
    return p


def main(argv: Optional[List[str]] = None, stdout: TextIO = sys.stdout,
         stderr: TextIO = sys.stderr, call: Callable[..., int] = subprocess.call,
         host: Optional[Host] = None) -> int:
    """Run the bootstrap; the exit code of the step that failed, or pytest's."""
    argv = sys.argv[1:] if argv is None else list(argv)
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    args = build_parser().parse_args(own)
    args.rest = rest
    if sys.version_info < (3, 9):
        print("localrt needs Python 3.9 or newer.", file=stderr)
        return 1
    host = host or Host()
    return setup(args, Shell(stdout, args.dry_run, host.environ, call), host, stderr)


if __name__ == "__main__":
    sys.exit(main())
