"""The CUDA variants of gguf-cpp without a GPU (issue 35, item 3): what can run in CI.

* A CUDA variant asked for on a machine with no NVIDIA driver is refused up front with
  400 nvidia_driver_missing naming the driver; the cuda-12 one on a machine with a
  driver, from an index without a wheel of it, with 400 missing_toolkit (the index's
  CUDA 12 packages have no nvcc: localrt.engines.cuda).
* The toolkit installs from a package index into a folder and CMake configures
  llama.cpp's CUDA backend with it, for one architecture (slow: the toolkit is about
  650 MB, which `python3 -m localrt.bootstrap --test` downloads into
  tests/.cuda-build/toolkit; without it the test skips, except under CI). Measured on
  2 shared cores: pip's install from a local index about 20 s, the configure about 7 s.
* The wheel a build made gets the CUDA runtime libraries, with their RECORD lines.

The build itself, and the variant running on a GPU, are tests/device/check_gpu.sh's.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import subprocess
import tarfile
import time
import zipfile

import pytest
from emulators.pkgindex import PackageIndex
from support import REPO
from support.apps import call
from support.variants import SOURCES, newest_sdist, unavailable

from localrt import settings as settings_mod
from localrt.app import create_app
from localrt.engines import cuda
from localrt.engines.hardware import Hardware

TOOLKIT = REPO / "tests" / ".cuda-build" / "toolkit"
H100 = {"backend": "cuda", "type": "discrete", "computeCap": "9.0", "name": "NVIDIA H100"}


def app_for(hardware: Hardware, home, index_url: str | None = None):
    settings = settings_mod.load(environ={"HOME": str(home)})
    if index_url:
        settings.update({"engineIndexUrl": index_url})
    return create_app(settings, hardware=hardware)


@pytest.mark.unit
def test_the_names_and_the_architectures():
    assert cuda.major("linux-amd64-cuda-13") == "13"
    assert cuda.major("linux-amd64-cuda-12") == "12"
    assert cuda.major("linux-amd64-avx2") is None
    assert cuda.architectures([H100, dict(H100, computeCap="8.9"), dict(H100)]) == "89;90"
    assert cuda.architectures([{"backend": "vulkan", "computeCap": ""}]) == "native"
    with pytest.raises(cuda.MissingToolkit) as refused:
        cuda.toolkit_packages("12")
    assert refused.value.code == "missing_toolkit" and "nvcc" in refused.value.message


@pytest.mark.live
def test_without_an_nvidia_driver_a_cuda_variant_is_refused_naming_it(tmp_path):
    app = app_for(Hardware("linux", "amd64", "", ("avx2",), cuda=None), tmp_path)
    try:
        for variant in ("linux-amd64-cuda-12", "linux-amd64-cuda-13"):
            r = call(app, "POST", "/v1/engines/gguf-cpp/install", {"variant": variant})
            assert r.status == 400, r.body
            error = r.json["error"]
            assert error["code"] == "nvidia_driver_missing" and error["param"] == "variant"
            assert "NVIDIA driver" in error["message"] and "libcuda" in error["message"]
        # nothing was started
        assert call(app, "GET", "/v1/models/pull").json["data"] == []
    finally:
        app.close()


@pytest.mark.live
def test_cuda_12_without_a_wheel_in_the_index_is_refused_naming_the_missing_nvcc(tmp_path):
    sdist = newest_sdist()
    if sdist is None:
        unavailable(f"{SOURCES} has no llama-cpp-python sdist (python3 -m "
                    f"localrt.bootstrap --test)", "CUDA toolkit")
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    (index_dir / sdist.name).symlink_to(sdist)
    with PackageIndex(index_dir) as index:
        app = app_for(Hardware("linux", "amd64", "", ("avx2",), cuda="12.4"),
                      tmp_path / "home", index.url)
        try:
            r = call(app, "POST", "/v1/engines/gguf-cpp/install",
                     {"variant": "linux-amd64-cuda-12"})
        finally:
            app.close()
    assert r.status == 400 and r.json["error"]["code"] == "missing_toolkit", r.body
    assert "cuda-13" in r.json["error"]["message"]


@pytest.mark.unit
def test_the_runtime_libraries_go_into_the_wheel_with_their_record(tmp_path):
    wheel = tmp_path / "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llama_cpp/lib/libggml-cuda.so", b"elf")
        z.writestr("llama_cpp_python-0.3.36.dist-info/RECORD",
                   "llama_cpp/lib/libggml-cuda.so,sha256=x,3\n"
                   "llama_cpp_python-0.3.36.dist-info/RECORD,,\n")
    lib = tmp_path / "libcudart.so.13"
    lib.write_bytes(b"\x7fELF runtime" * 1000)
    cuda.add_to_wheel(wheel, {"llama_cpp/lib/libcudart.so.13": lib})
    with zipfile.ZipFile(wheel) as z:
        assert z.read("llama_cpp/lib/libcudart.so.13") == lib.read_bytes()
        assert z.read("llama_cpp/lib/libggml-cuda.so") == b"elf"
        rows = list(csv.reader(io.StringIO(
            z.read("llama_cpp_python-0.3.36.dist-info/RECORD").decode())))
    digest = base64.urlsafe_b64encode(hashlib.sha256(lib.read_bytes()).digest()).rstrip(b"=")
    assert ["llama_cpp/lib/libcudart.so.13", f"sha256={digest.decode()}",
            str(lib.stat().st_size)] in rows
    assert rows[-1] == ["llama_cpp_python-0.3.36.dist-info/RECORD", "", ""]
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.live
@pytest.mark.slow
def test_the_toolkit_installs_from_the_index_and_cmake_configures_with_it(tmp_path):
    if not list(TOOLKIT.glob("nvidia_cuda_nvcc-13*.whl")):
        unavailable(f"{TOOLKIT} has no CUDA 13 toolkit; run python3 -m localrt.bootstrap "
                    f"--test, or python -m pip download --only-binary=:all: -d {TOOLKIT} "
                    f"{' '.join(cuda.TOOLKITS['13'])}", "CUDA toolkit")
    sdist = newest_sdist()
    if sdist is None:
        unavailable(f"{SOURCES} has no llama-cpp-python sdist", "CUDA toolkit")
    toolkit = cuda.Toolkit("13", [H100])
    assert toolkit.flags() == ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90")

    def run(cmd, env):  # at the lowest priority: the machine is shared
        return subprocess.call(["nice", "-n", "19", *cmd], env=dict(env),
                               stdout=subprocess.DEVNULL, timeout=cuda.TOOLKIT_TIMEOUT)

    started = time.monotonic()
    with PackageIndex(TOOLKIT) as index:
        root = toolkit.install(tmp_path, ["--index-url", index.url], os.environ, run)
    installed = time.monotonic() - started
    assert root == tmp_path / "cuda" / "nvidia" / "cu13"
    assert os.access(root / "bin" / "nvcc", os.X_OK)
    assert (root / "lib" / "libcudart.so").resolve().name.startswith("libcudart.so.13")
    assert (root / "lib" / "libcublas.so").exists()
    stub = subprocess.run(["objdump", "-p", str(root / "lib" / "stubs" / "libcuda.so")],
                          capture_output=True, text=True)
    assert stub.returncode != 0 or "SONAME               libcuda.so.1" in stub.stdout

    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "src", filter="data")
    source = next((tmp_path / "src").glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
    started = time.monotonic()
    configure = subprocess.run(
        ["nice", "-n", "19", "cmake", "-S", str(source), "-B", str(tmp_path / "build"),
         *toolkit.flags(), *toolkit.cmake_args(), "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_CURL=OFF"],
        capture_output=True, text=True, timeout=600)
    configured = time.monotonic() - started
    print(f"CUDA 13 toolkit installed from the index in {installed:.0f} s; CMake "
          f"configured in {configured:.0f} s")
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    out = configure.stdout
    assert "The CUDA compiler identification is NVIDIA 13." in out
    assert "Using CMAKE_CUDA_ARCHITECTURES=90" in out and "CUDA Toolkit found" in out

