"""The CUDA variants of gguf-cpp: compiled from llama-cpp-python's sdist with
-DGGML_CUDA=ON and a CUDA toolkit taken from the package index (issue 35, item 3).

The toolkit is pip's, not the system's: `Toolkit.install` runs

    python -m pip install --target <scratch>/cuda --index-url INDEX <TOOLKITS[major]>

from the index (and proxy) engines come from, then completes the folder as CMake's
FindCUDAToolkit wants it: unversioned links to the libraries (libcudart.so ->
libcudart.so.13) and lib/stubs/libcuda.so, an empty library whose soname is the
driver's (libcuda.so.1), which is what the toolkit's own stub is for: linking without a
driver; at run time the driver's libcuda.so.1 is the one loaded. `cmake_args` gives the
compiler, the toolkit's root and CMAKE_CUDA_ARCHITECTURES, the compute capabilities of
this machine's GPUs as NVML gives them (9.0 -> 90: one architecture, minutes of nvcc,
not an hour for all of them). After the build, `bundle` adds the CUDA runtime and cuBLAS
libraries the wheel's libggml-cuda.so needs to its llama_cpp/lib (found there through
the $ORIGIN RPATH llama-cpp-python sets), so the variant runs with only a driver.

Which CUDA: the index's CUDA 12 packages cannot compile. nvidia-cuda-nvcc-cu12 (every
version, 12.0.76 to 12.9.86, checked Dec 2026) holds ptxas, libnvvm and headers, but not
nvcc, cicc, cudafe++ or fatbinary. CUDA 13's packages hold a whole toolkit under
nvidia/cu13 (nvidia-cuda-nvcc 13 with its nvidia-nvvm and nvidia-cuda-crt), so the
`-cuda-13` variant is compiled here (its driver: 580 or newer), and the `-cuda-12` one
installs only from a wheel the index has; without one, its install is refused naming
this (`missing_toolkit`).

A variant of either is refused up front on a machine without an NVIDIA driver
(NvidiaDriverMissing, 400 nvidia_driver_missing), naming libcuda and NVML.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable, Mapping

from localrt.errors import BadRequest

CMAKE = ("-DGGML_CUDA=ON",)
# The packages of a toolkit that compiles, by CUDA major version (see the docstring;
# localrt.bootstrap.CUDA_TOOLKIT downloads the same for the tests: change both together):
# nvcc (with its nvvm and crt), the runtime, cuBLAS and CCCL (Thrust, CUB).
TOOLKITS: dict[str, tuple[str, ...] | None] = {
    "12": None,
    "13": ("nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-cublas", "nvidia-cuda-cccl"),
}
# The libraries a built libggml-cuda.so loads, bundled into the wheel (`bundle`).
RUNTIME = ("libcudart", "libcublas", "libcublasLt")
TOOLKIT_TIMEOUT = 30 * 60  # seconds for pip to fetch and unpack ~650 MB


class NvidiaDriverMissing(BadRequest):
    """A CUDA variant asked for on a machine without an NVIDIA driver."""

    code = "nvidia_driver_missing"


class MissingToolkit(BadRequest):
    """A CUDA variant the index has neither a wheel nor a compiler for."""

    code = "missing_toolkit"


def major(variant_name: str) -> str | None:
    """The CUDA major version of a variant's name (linux-amd64-cuda-13 -> "13")."""
    _, found, rest = variant_name.rpartition("-cuda-")
    return rest.split("+")[0] if found and rest[:2].isdigit() else None


def refuse_without_driver(variant_name: str, driver_cuda: str | None) -> None:
    """NvidiaDriverMissing for a CUDA variant when no NVIDIA driver was found (libcuda's
    cuDriverGetVersion, or nvidia-smi, gave no CUDA version)."""
    if major(variant_name) is not None and driver_cuda is None:
        raise NvidiaDriverMissing(
            f"Variant {variant_name} cannot run here: it needs an NVIDIA GPU and its "
            f"driver (libcuda.so.1 and NVML's libnvidia-ml.so.1), and this machine has no "
            f"NVIDIA driver; install the driver, or a Vulkan or CPU variant of gguf-cpp",
            param="variant")


def architectures(gpus: list[dict]) -> str:
    """CMAKE_CUDA_ARCHITECTURES for the NVIDIA GPUs of `gpus` (their compute
    capabilities, 8.9 -> 89); "native" (nvcc asks the GPU) where NVML said none."""
    caps = sorted({g["computeCap"].replace(".", "") for g in gpus
                   if g.get("backend") == "cuda" and g.get("computeCap")}, key=int)
    return ";".join(caps) or "native"


def toolkit_packages(cuda_major: str) -> tuple[str, ...]:
    """The index's packages of the toolkit for `cuda_major`; a 400 missing_toolkit
    where the index has none that compiles."""
    packages = TOOLKITS.get(cuda_major)
    if not packages:
        raise MissingToolkit(
            f"The package index has no llama-cpp-python wheel for CUDA {cuda_major}, and "
            f"no CUDA {cuda_major} compiler to build one: nvidia-cuda-nvcc-cu{cuda_major} "
            f"holds ptxas and libnvvm but not nvcc. Install the cuda-13 variant (an "
            f"NVIDIA driver 580 or newer), put a CUDA {cuda_major} wheel in the index, or "
            f"use the Vulkan variant", param="variant")
    return packages


class Toolkit:
    """The CUDA toolkit one build compiles with: installed into the build's scratch
    folder (`install`), then the CMake options and the wheel's bundled libraries."""

    def __init__(self, cuda_major: str, gpus: list[dict]):
        self.packages = toolkit_packages(cuda_major)
        self.major = cuda_major
        self.archs = architectures(gpus)
        self.root: Path | None = None  # <scratch>/cuda/nvidia/cu<major>, once installed

    def flags(self) -> tuple[str, ...]:
        """The CMake options that say what is built (and so key its cached wheel)."""
        return (*CMAKE, f"-DCMAKE_CUDA_ARCHITECTURES={self.archs}")

    def cmake_args(self) -> list[str]:
        """The CMake options that point the build at this installed toolkit."""
        assert self.root is not None
        return [f"-DCMAKE_CUDA_COMPILER={self.root / 'bin' / 'nvcc'}",
                f"-DCUDAToolkit_ROOT={self.root}"]

    def install(self, scratch: Path, pip_args: list[str], environ: Mapping[str, str],
                run: Callable[[list[str], Mapping[str, str]], int]) -> Path:
        """pip-install the toolkit into `scratch`/cuda (`pip_args`: the index and trust
        options; `run(cmd, env)`: the build's runner, its exit code) and complete it
        (`complete`); its root. RuntimeError when pip fails."""
        target = scratch / "cuda"
        cmd = [sys.executable, "-m", "pip", "install", "--target", str(target),
               "--no-cache-dir", "--only-binary=:all:", *pip_args, *self.packages]
        code = run(cmd, environ)
        if code != 0:
            raise RuntimeError(f"pip could not install the CUDA {self.major} toolkit "
                               f"({', '.join(self.packages)}): exit status {code}")
        self.root = complete(target / "nvidia" / f"cu{self.major}")
        return self.root

    def bundle(self, wheel: Path) -> None:
        """Add the CUDA runtime libraries to the built wheel's llama_cpp/lib."""
        assert self.root is not None
        libs = [p for p in sorted((self.root / "lib").iterdir())
                if p.name.split(".so")[0] in RUNTIME and not p.is_symlink()
                and ".so." in p.name]
        add_to_wheel(wheel, {f"llama_cpp/lib/{p.name}": p for p in libs})


def complete(root: Path) -> Path:
    """Make the pip-installed toolkit at `root` one that FindCUDAToolkit takes: each
    lib/libX.so.N gets its libX.so, and lib/stubs/libcuda.so is an empty library with
    the driver's soname (compiled with cc). `root`; RuntimeError when it has no nvcc."""
    if not (root / "bin" / "nvcc").is_file():
        raise RuntimeError(f"the CUDA toolkit installed from the index has no nvcc "
                           f"({root / 'bin' / 'nvcc'})")
    lib = root / "lib"
    for versioned in sorted(lib.glob("lib*.so.*")):
        plain = lib / (versioned.name.split(".so")[0] + ".so")
        if not plain.exists():
            plain.symlink_to(versioned.name)
    stubs = lib / "stubs"
    stubs.mkdir(exist_ok=True)
    source = stubs / "libcuda.c"
    source.write_text("/* the driver's libcuda.so.1 is loaded at run time */\n")
    subprocess.run(["cc", "-shared", "-Wl,-soname,libcuda.so.1", "-o",
                    str(stubs / "libcuda.so"), str(source)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return root


def add_to_wheel(wheel: Path, files: Mapping[str, Path]) -> None:
    """Add `files` ({path in the wheel: file}) to `wheel`, with their RECORD lines, by
    writing a new wheel beside it and renaming it over the old one (compressed fast:
    the CUDA libraries are 600 MB)."""
    partial = wheel.with_name(wheel.name + ".partial")
    with zipfile.ZipFile(wheel) as old, \
            zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as new:
        record_name = next(n for n in old.namelist() if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(old.read(record_name).decode())))
        for info in old.infolist():
            if info.filename != record_name and info.filename not in files:
                new.writestr(info, old.read(info.filename))
        rows = [r for r in rows if r and r[0] not in files and r[0] != record_name]
        for name, path in files.items():
            digest, size = hashlib.sha256(), 0
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
                    size += len(chunk)
            new.write(path, name)
            rows.append([name, "sha256=" + base64.urlsafe_b64encode(
                digest.digest()).rstrip(b"=").decode(), str(size)])
        rows.append([record_name, "", ""])
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(rows)
        new.writestr(record_name, out.getvalue())
    os.replace(partial, wheel)
