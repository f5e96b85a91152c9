"""gguf-cpp's Vulkan variant without compiling it: its patch still applies to the sdist of
the llama-cpp-python localrt installs, what its build needs is checked up front, which
machines run it, which variant an install picks (issue 35 items 2 and 4), and the probe's
and the server's view of a Vulkan build. tests/test_vulkan_live.py compiles it.
"""

from __future__ import annotations

import os
import shutil
import tarfile
from importlib import metadata

import pytest
from support import REPO
from support.apps import call
from support.variants import SOURCES, newest_sdist, variant

from localrt import settings as settings_mod
from localrt.app import create_app
from localrt.bootstrap import RPC_SDIST
from localrt.engines import builds, catalog
from localrt.engines.hardware import (Gpus, Hardware, recommended, runnable,
                                      vulkan_environment)
from localrt.engines.probe import gguf_variant

AVX512 = frozenset({"avx", "avx2", "avx512f", "fma"})
LAVAPIPE = {"id": "0", "name": "llvmpipe (LLVM 15.0.6, 256 bits)", "backend": "vulkan",
            "type": "cpu", "total": 2 << 30, "free": 2 << 30}
RADEON = {"id": "1", "name": "AMD Radeon RX 7600 (RADV NAVI33)", "backend": "vulkan",
          "type": "discrete", "total": 8 << 30, "free": 7 << 30}
# an NVIDIA GPU the Vulkan loader lists too, as localrt.engines.gpus.merged gives it
NVIDIA = {"id": "0", "name": "NVIDIA GeForce RTX 4090", "backend": "cuda",
          "type": "discrete", "total": 24 << 30, "free": 23 << 30,
          "vulkan": {"id": "0", "name": "NVIDIA GeForce RTX 4090", "backend": "vulkan",
                     "type": "discrete", "total": 24 << 30, "free": 22 << 30,
                     "maxBuffer": 4 << 30}}


def machine(*gpus, cuda=None) -> Hardware:
    """This kind of CPU with these GPUs (as localrt.engines.gpus lists them)."""
    return Hardware("linux", "amd64", "test cpu", AVX512, cuda,
                    gpus=Gpus(detect=lambda: [dict(g) for g in gpus]))


# --- the patch ----------------------------------------------------------------------


def test_the_patch_still_applies_to_the_installed_versions_sdist(tmp_path):
    version = metadata.version("llama-cpp-python")
    sdist = SOURCES / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        if os.environ.get("CI"):
            raise AssertionError(f"{sdist} is missing: python3 -m localrt.bootstrap --test "
                                 f"downloads it ({RPC_SDIST})")
        pytest.skip(f"{sdist} is missing; python3 -m localrt.bootstrap --test downloads it")
    if shutil.which("patch") is None:
        raise AssertionError("the patch command (Debian's patch, a dependency of "
                             "build-essential) is missing")
    patch, = builds.patch_files(catalog.VULKAN_PATCHES)
    top = f"llama_cpp_python-{version}/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name == top + "vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp"]
        assert members, f"{sdist.name} has no ggml-vulkan.cpp"
        tar.extractall(tmp_path, members=members, filter="data")
    source = tmp_path / top / "vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp"
    before = source.read_text()
    assert "vk::LayerSettingEXT" in before  # still what Debian 12's headers lack
    assert builds.apply_patch(patch, tmp_path / top, dry_run=True) == ""
    assert source.read_text() == before  # a dry run changes nothing
    assert builds.apply_patch(patch, tmp_path / top) == ""
    after = source.read_text()
    assert after.count("#ifdef VK_EXT_layer_settings") == 2
    # Applied already: a second time fails and says so, changing nothing.
    assert "Reversed (or previously applied) patch detected" in \
        builds.apply_patch(patch, tmp_path / top)
    assert source.read_text() == after


def test_the_patch_ships_in_the_package_and_counts_in_the_builds_cache_key(tmp_path):
    patch, = builds.patch_files(catalog.VULKAN_PATCHES)
    assert patch.is_file() and patch.parent.name == "patches"
    assert "localrt.engines = patches/*.patch" in (REPO / "setup.cfg").read_text()
    flags = {"CMAKE_ARGS": "-DGGML_VULKAN=ON"}
    plain = builds.cache_folder(tmp_path, "v", "1.0", "ab", flags)
    patched = builds.cache_folder(tmp_path, "v", "1.0", "ab", flags, [patch])
    other = tmp_path / "other.patch"
    other.write_text(patch.read_text() + "\n")
    assert len({plain, patched, builds.cache_folder(tmp_path, "v", "1.0", "ab", flags,
                                                     [other])}) == 3


# --- what its build needs -------------------------------------------------------------


def test_what_the_vulkan_build_lacks_is_named_with_its_debian_package():
    nothing = builds.missing_build_needs(catalog.VULKAN_CMAKE, which=lambda cmd: None,
                                         found=lambda pattern: False)
    assert [package for _, package in nothing] == ["libvulkan-dev", "libvulkan-dev", "glslc",
                                                   "spirv-headers"]
    only_glslc = builds.missing_build_needs(
        catalog.VULKAN_CMAKE, which=lambda cmd: None, found=lambda pattern: True)
    assert only_glslc == [("the GLSL compiler glslc", "glslc")]
    assert builds.missing_build_needs(("-DGGML_RPC=ON",), which=lambda cmd: None,
                                      found=lambda pattern: False) == []


def test_the_man_page_names_the_packages_the_build_needs():
    page = (REPO / "man" / "localrt.1").read_text()
    section = page.split(".SH INSTALLATION")[1].split(".SH ")[0]
    for needs in builds.BUILD_NEEDS.values():
        for _, package, _ in needs:
            assert package.replace("-", "\\-") in section, package


@pytest.fixture
def settings(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    return settings_mod.load(environ={"HOME": str(home)})


def install(settings, hw: Hardware, body: dict):
    app = create_app(settings, hardware=hw)
    try:
        return call(app, "POST", "/v1/engines/gguf-cpp/install", body)
    finally:
        app.close()


def test_an_install_without_a_vulkan_device_is_refused_naming_it(settings):
    r = install(settings, machine(), {"variant": "linux-amd64-vulkan"})
    assert r.status == 400 and r.json["error"]["param"] == "variant", r.body
    assert r.json["message"].startswith("Variant linux-amd64-vulkan cannot run here: it "
                                        "needs ")
    assert "Vulkan" in r.json["message"]


def test_an_install_naming_no_variant_keeps_the_shipped_build_where_no_gpu_is(settings):
    r = install(settings, machine(LAVAPIPE), {})
    assert r.status == 200, r.body
    assert r.json["task"]["id"].startswith("gguf-cpp:linux-amd64-")
    assert "vulkan" not in r.json["task"]["id"]


@pytest.mark.live  # it asks the tests' package index for the sdist
@pytest.mark.parametrize("body", [{"variant": "linux-amd64-vulkan"}, {}],
                         ids=["named", "picked for a Vulkan GPU"])
def test_an_install_without_glslc_is_refused_up_front_naming_the_package(settings, tmp_path,
                                                                          monkeypatch, body):
    from emulators.pkgindex import PackageIndex

    sdist = newest_sdist()
    if sdist is None:
        if os.environ.get("CI"):
            raise AssertionError(f"{SOURCES} has no sdist: python3 -m localrt.bootstrap "
                                 f"--test downloads it ({RPC_SDIST})")
        pytest.skip("no sdist in tests/.rpc-build/sources (python3 -m localrt.bootstrap --test)")
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    (index_dir / sdist.name).symlink_to(sdist)
    # A PATH with the compilers and patch, but no glslc.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("cc", "c++", "patch"):
        if shutil.which(tool):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(bin_dir))
    with PackageIndex(index_dir) as index:
        settings.update({"engineIndexUrl": index.url})
        # With no variant named, a machine with a Vulkan GPU (and no NVIDIA driver) picks
        # the Vulkan variant over the shipped CPU build.
        hw = machine(LAVAPIPE) if body else machine(RADEON)
        r = install(settings, hw, body)
    assert r.status == 400 and r.json["error"]["param"] == "variant", r.body
    assert r.json["message"].startswith("Compiling gguf-cpp linux-amd64-vulkan v")
    assert "needs the GLSL compiler glslc" in r.json["message"]
    assert "(apt-get install glslc)" in r.json["message"]
    assert not (settings.data_dir / "engines" / ".downloads").exists() or \
        not any((settings.data_dir / "engines" / ".downloads").iterdir())


# --- which machines run it, and which variant an install picks -------------------------


def test_a_vulkan_device_of_any_type_runs_the_vulkan_variant():
    for hw in (machine(LAVAPIPE), machine(RADEON), machine(NVIDIA, cuda="12.4")):
        assert runnable(variant(hw, "linux-amd64-vulkan"), hw) is None
    why = runnable(variant(machine(), "linux-amd64-vulkan"), machine())
    assert "Vulkan" in why
    # an NVIDIA driver without its Vulkan part: the loader lists no such device
    bare = machine({k: v for k, v in NVIDIA.items() if k != "vulkan"}, cuda="12.4")
    assert "Vulkan" in runnable(variant(bare, "linux-amd64-vulkan"), bare)


def test_an_install_picks_cuda_then_a_vulkan_gpu_then_the_best_cpu_level():
    def picked(hw):
        return recommended(catalog.CATALOG["gguf-cpp"].variants(hw), hw).name

    assert picked(machine(NVIDIA, RADEON, cuda="12.4")) == "linux-amd64-cuda-12"
    assert picked(machine(RADEON)) == "linux-amd64-vulkan"
    assert picked(machine(LAVAPIPE, RADEON)) == "linux-amd64-vulkan"
    # lavapipe runs on the CPU: the CPU build is the faster there.
    assert picked(machine(LAVAPIPE)) == "linux-amd64-avx512"
    assert picked(machine()) == "linux-amd64-avx512"
    # An NVIDIA GPU without a driver for CUDA 12 is still a Vulkan GPU.
    assert picked(machine(NVIDIA)) == "linux-amd64-vulkan"


def test_lavapipe_alone_is_named_to_llama_cpp_which_skips_cpu_devices():
    assert vulkan_environment(machine(LAVAPIPE), {}) == {"GGML_VK_VISIBLE_DEVICES": "0"}
    assert vulkan_environment(machine(LAVAPIPE, RADEON), {}) == {}
    assert vulkan_environment(machine(), {}) == {}
    # The user's own choice stands.
    assert vulkan_environment(machine(LAVAPIPE), {"GGML_VK_VISIBLE_DEVICES": ""}) == {}


def test_a_build_with_the_vulkan_backend_is_the_vulkan_variant():
    hw = machine(LAVAPIPE)
    info = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | "
    assert gguf_variant(info, True, hw, backends=["Vulkan", "CPU"]) == "linux-amd64-vulkan"
    assert gguf_variant(info, False, hw, backends=["Vulkan", "CPU"]) == "linux-amd64-vulkan"
    assert gguf_variant(info, False, hw, backends=["CPU"]) == "linux-amd64-avx512"


def test_the_builds_cache_key_takes_the_no_common_include_by_contents_not_path(
        tmp_path, monkeypatch):
    # Every compiled variant leaves llama.cpp's common library out through an include
    # named by its path, which differs between checkouts and installs: the key must not.
    flags = builds.build_flags(catalog.VULKAN_CMAKE, environ={})
    assert f"-DCMAKE_PROJECT_llama.cpp_INCLUDE={builds.NO_COMMON}" in flags["CMAKE_ARGS"]
    here = builds.cache_folder(tmp_path, "v", "1.0", "ab", flags)
    elsewhere = tmp_path / "elsewhere" / builds.NO_COMMON.name  # another checkout's copy
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(builds.NO_COMMON.read_bytes())
    moved = dict(flags, CMAKE_ARGS=flags["CMAKE_ARGS"].replace(str(builds.NO_COMMON),
                                                                str(elsewhere)))
    monkeypatch.setattr(builds, "NO_COMMON", elsewhere)
    assert moved != flags
    assert builds.cache_folder(tmp_path, "v", "1.0", "ab", moved) == here
    elsewhere.write_text(elsewhere.read_text() + "\n")  # other contents: another key
    assert builds.cache_folder(tmp_path, "v", "1.0", "ab", moved) != here
