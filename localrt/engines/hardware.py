"""This machine: OS, architecture, CPU flags, cores, memory and the CUDA driver.

`detect_hardware()` reads them once (localrt.app passes a `Hardware` in, so tests can
pretend to be another machine). `runnable` and `recommended` are the hardware rules
of engine variants: whether this machine runs a build, and which build to install
when none is named. The variants themselves are listed in localrt.engines.catalog.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence


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


# CPU levels, best first, and the /proc/cpuinfo flag each needs.
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


# --- what a build needs ------------------------------------------------------------


class Build(Protocol):
    """What the rules below read of a variant (localrt.engines.catalog.Variant)."""

    name: str            # starts with the platform it is built for: linux-amd64-avx2
    needs: str | None    # a CPU flag, or "cuda-12"


def runnable(variant: Build, hw: Hardware) -> str | None:
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


def recommended(variants: Sequence[Build], hw: Hardware):
    """The variant to install when none is asked for: a GPU one, else the best CPU one."""
    usable = [v for v in variants if runnable(v, hw) is None]
    gpu = [v for v in usable if v.needs and v.needs.startswith("cuda")]
    return (gpu or usable or [None])[0]
