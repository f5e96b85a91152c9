"""The gguf-cpp variants the live tests compile from llama-cpp-python's sdist through
localrt's own install task, and the wheels they keep so that a later run installs
instead of compiling: tests/.rpc-build/built (the +rpc variant, tests/test_rpc_live.py)
and tests/.vulkan-build/built (the Vulkan one, built once a run by `vulkan_engine`,
which tests/test_vulkan_live.py and tests/test_gpu_offload.py share).

A wheel is kept as `<built>/<key>/<name>`, key the one localrt's own build cache uses
(localrt.engines.builds.cache_folder: a hash of the sdist's sha256, the build's flags,
the variant's patches and this Python's tag), so a wheel built from another sdist, with
other flags or another patch, is never taken for this one: the tests compile again.
`python3 -m localrt.bootstrap --test` keeps these folders between runs on one machine
(outside the checkout: LOCALRT_TEST_CACHE); a fresh machine compiles both (the Vulkan
one where lavapipe and the Vulkan build packages are: 4-6 minutes on two quiet cores,
llama.cpp's common library left out as in every build localrt makes).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from emulators.pkgindex import PackageIndex
from support import REPO
from support.apps import call

from localrt import settings as settings_mod
from localrt.app import create_app
from localrt.engines import builds
from localrt.engines.catalog import CATALOG, VULKAN, Variant
from localrt.engines.hardware import Hardware, detect_hardware, vulkan_devices

SOURCES = REPO / "tests" / ".rpc-build" / "sources"  # the sdist and its build wheels
VULKAN_BUILT = REPO / "tests" / ".vulkan-build" / "built"
VULKAN_BUILD_TIMEOUT = 45 * 60  # seconds; a compile takes 4-15 minutes on two cores


def newest_sdist() -> Path | None:
    """The newest llama-cpp-python sdist in tests/.rpc-build/sources."""
    found = sorted(SOURCES.glob("llama_cpp_python-*.tar.gz"),
                   key=lambda p: [int(x) for x in sdist_version(p).split(".")])
    return found[-1] if found else None


def sdist_version(sdist: Path) -> str:
    """0.3.36 of llama_cpp_python-0.3.36.tar.gz."""
    return sdist.name[len("llama_cpp_python-"):-len(".tar.gz")]


def labelled(wheel_name: str, version: str, local: str) -> str:
    """A wheel's file name with a variant's local label: 0.3.36 -> 0.3.36+avx2.rpc."""
    name, rest = wheel_name.split("-", 1)
    return f"{name}-{version}+{local}-{rest.split('-', 1)[1]}"


def variant(hw: Hardware, name: str) -> Variant:
    """gguf-cpp's variant `name` in localrt's catalog."""
    found, = [v for v in CATALOG["gguf-cpp"].variants(hw) if v.name == name]
    return found


def key(chosen: Variant, sdist: Path) -> str:
    """The key of the wheel `chosen` compiles from `sdist` here: the name of the folder
    localrt's own build keeps it in (localrt.engines.builds.cache_folder)."""
    digest = hashlib.sha256()
    with open(sdist, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return builds.cache_folder(Path(), chosen.name, sdist_version(sdist), digest.hexdigest(),
                               builds.build_flags(chosen.cmake),
                               builds.patch_files(chosen.patches)).name


def kept_wheel(built: Path, wheel_key: str, version: str, local: str) -> Path | None:
    """The wheel kept under `wheel_key` for this version and local label, if any."""
    return next(iter(sorted((built / wheel_key).glob(
        f"llama_cpp_python-{version}+{local}-*.whl"))), None)


def keep_wheel(built: Path, wheel_key: str, wheel: Path, name: str, local: str) -> Path:
    """Copy `wheel` to `<built>/<wheel_key>/<name>` (atomically), and remove the wheels of
    the same local label kept under other keys (or none): they can never be taken."""
    target = built / wheel_key / name
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.parent / f".partial-{os.getpid()}-{name}"
    shutil.copy2(wheel, partial)
    os.replace(partial, target)
    for stale in list(built.glob(f"**/llama_cpp_python-*+{local}-*.whl")):
        if stale != target:
            stale.unlink()
            if stale.parent != built and not any(stale.parent.iterdir()):
                stale.parent.rmdir()
    return target


def unavailable(why: str, what: str):
    """Skip, except under CI, where the tests of `what` must run."""
    if os.environ.get("CI"):
        raise RuntimeError(f"CI must run the {what} tests: {why}")
    pytest.skip(why)


def scratch_caches(tmp_path_factory) -> Path:
    """The session's folder for ccache's and Mesa's caches (`install_variant`)."""
    return tmp_path_factory.getbasetemp() / "build-caches"


def install_variant(name: str, version: str, index_dir: Path, home: Path, timeout: float,
                    caches: Path) -> SimpleNamespace:
    """Install gguf-cpp's variant `name` into the localrt home `home` through the API,
    from a package index of `index_dir`; the install's reply, its task, the build's
    progress snapshots, the engine's rows, and the wheel a build made (None if none).

    The build (llama.cpp's CMake uses ccache where there is one) and the probe's child
    (Mesa keeps a shader cache) inherit this process's environment, whose HOME is the
    real one: their caches go to `caches` instead (the session's, so that a second
    install's probe finds the shaders the first compiled)."""
    settings = settings_mod.load(environ={"HOME": str(home)})
    snapshots = []
    with pytest.MonkeyPatch.context() as env, PackageIndex(index_dir) as index:
        for var, folder in (("CCACHE_DIR", "ccache"),
                            ("MESA_SHADER_CACHE_DIR", "mesa-shader-cache")):
            (caches / folder).mkdir(parents=True, exist_ok=True)  # Mesa makes none
            env.setenv(var, str(caches / folder))
        settings.update({"engineIndexUrl": index.url})
        app = create_app(settings)
        try:
            api = lambda *a, **k: call(app, *a, **k)  # noqa: E731
            started = time.monotonic()
            reply = api("POST", "/v1/engines/gguf-cpp/install",
                        {"variant": name, "version": version})
            assert reply.status == 200, reply.body
            task_id = reply.json["task"]["id"]
            deadline = started + timeout
            while time.monotonic() < deadline:
                task = {t["id"]: t for t in api("GET", "/v1/models/pull").json["data"]}[task_id]
                if task.get("build") and task["build"] not in snapshots:
                    snapshots.append(task["build"])
                if task["status"] not in ("Pending", "Downloading"):
                    break
                time.sleep(0.5)
            else:
                raise AssertionError(f"the {name} install took over {timeout} s")
            seconds = time.monotonic() - started
            print(f"gguf-cpp {name} {version}: {task['status']} in {seconds:.0f} s "
                  f"({'compiled' if snapshots else 'a wheel built before'})")
            assert task["status"] == "Success", task
            rows = api("GET", "/v1/engines/gguf-cpp").json
            entry = api("GET", "/v1/engines").json["data"]
        finally:
            app.close()
    built = sorted((settings.data_dir / "engines" / builds.BUILDS_DIR).rglob("*.whl"))
    return SimpleNamespace(settings=settings, reply=reply.json, task=task,
                           snapshots=snapshots, seconds=seconds, rows=rows, entry=entry,
                           built=built[0] if built else None,
                           folder=settings.data_dir / "engines" / "gguf-cpp" / name / version)


@pytest.fixture(scope="session")
def vulkan_engine(tmp_path_factory):
    """A localrt home whose active gguf-cpp variant is linux-amd64-vulkan, installed
    through the API from the tests' package index: compiled from the sdist (once a run,
    for every module that uses it), unless a wheel kept under its key, or
    LOCALRT_TEST_VULKAN_WHEEL, is there. `wheel` is the wheel it installed."""
    hw = detect_hardware()
    if not vulkan_devices(hw):
        unavailable("the Vulkan loader finds no device; install libvulkan1 and "
                    "mesa-vulkan-drivers (lavapipe), as python3 -m localrt.bootstrap "
                    "--test does", "Vulkan")
    sdist = newest_sdist()
    if sdist is None:
        unavailable(f"{SOURCES} has no llama-cpp-python sdist; run python3 -m "
                    f"localrt.bootstrap --test", "Vulkan")
    version = sdist_version(sdist)
    chosen = variant(hw, f"{hw.platform}-{VULKAN}")
    wheel_key = key(chosen, sdist)
    index_dir = tmp_path_factory.mktemp("vulkan-index")
    for source in SOURCES.iterdir():
        (index_dir / source.name).symlink_to(source)
    given = os.environ.get("LOCALRT_TEST_VULKAN_WHEEL")
    cached = Path(given) if given else kept_wheel(VULKAN_BUILT, wheel_key, version, VULKAN)
    if cached:
        (index_dir / labelled(cached.name, version, VULKAN)).symlink_to(cached.resolve())
    else:
        lacking = builds.missing_build_needs(chosen.cmake)
        if lacking or shutil.which("c++") is None:
            unavailable(f"cannot compile the Vulkan variant: it needs "
                        f"{', '.join(p for _, p in lacking) or 'a C++ compiler'}", "Vulkan")
    home = tmp_path_factory.mktemp("vulkan-home")
    done = install_variant(chosen.name, version, index_dir, home, VULKAN_BUILD_TIMEOUT,
                           scratch_caches(tmp_path_factory))
    wheel = cached
    if done.built is not None and not cached:  # kept: later runs install it
        assert done.built.parent.name == wheel_key  # the key is localrt's own
        wheel = keep_wheel(VULKAN_BUILT, wheel_key, done.built,
                           labelled(done.built.name, version, VULKAN), VULKAN)
    probes = json.loads((done.settings.data_dir / "engines" / "probes.json").read_text())
    return SimpleNamespace(home=home, settings=done.settings, variant=chosen.name,
                           version=version, reply=done.reply, task=done.task,
                           snapshots=done.snapshots, compiled=not cached, rows=done.rows,
                           entry=done.entry, folder=done.folder, seconds=done.seconds,
                           probes=probes, hw=hw, wheel=wheel, key=wheel_key)
