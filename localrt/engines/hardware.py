"""This machine: OS, architecture, CPU flags, cores, memory, the CUDA driver and GPUs.

`detect_hardware()` reads them once (localrt.app passes a `Hardware` in, so tests can
pretend to be another machine); its GPUs are read when first asked, by a child
process (localrt.engines.gpus), and again at most every GPU_REFRESH seconds (`Gpus`).
`Hardware.status()` is what `localrt ps` shows, `Hardware.cortex()` what GET
/v1/hardware gives (cortex's shape). `runnable` and `recommended` are the hardware
rules of engine variants: whether this machine runs a build, and which build to install
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
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

MIB = 1 << 20
GPU_REFRESH = 5.0  # seconds a GPU list (and its free memory) is shown before it is read again


class Gpus:
    """This machine's GPUs as localrt.engines.gpus reads them (`detect`: a child process
    each time), read when first asked and again once `refresh` seconds have passed, so
    that `ps`, GET /v1/hardware and a model's start never wait for more than one child
    at a time. `_lock` guards `_gpus` and `_read_at`, and is held while a child runs."""

    def __init__(self, detect: Callable[[], list] | None = None,
                 refresh: float = GPU_REFRESH):
        self._detect = detect
        self._refresh = refresh
        self._lock = threading.Lock()
        self._gpus: list[dict] | None = None
        self._read_at = 0.0

    def list(self) -> list[dict]:
        """The GPUs (localrt.engines.gpus' dicts); [] where there are none or none can
        be read."""
        with self._lock:
            now = time.monotonic()
            if self._gpus is None or now - self._read_at >= self._refresh:
                if self._detect is None:
                    from localrt.engines import gpus

                    self._gpus = gpus.detect()
                else:
                    self._gpus = list(self._detect())
                self._read_at = time.monotonic()
            return [dict(g) for g in self._gpus]


class CpuUsage:
    """How busy the CPUs were since the previous ask (since boot, the first time), from
    /proc/stat. `_lock` guards `_last`."""

    def __init__(self, stat: Path = Path("/proc/stat")):
        self._stat = stat
        self._lock = threading.Lock()
        self._last = (0, 0)  # (busy, total) jiffies

    def percent(self) -> float:
        """Percent of the CPUs' time spent busy since the previous call (0 without /proc)."""
        try:
            fields = self._stat.read_text().splitlines()[0].split()[1:]
            ticks = [int(x) for x in fields]
        except (OSError, IndexError, ValueError):
            return 0.0
        total = sum(ticks[:8])  # user nice system idle iowait irq softirq steal
        busy = total - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)
        with self._lock:
            last_busy, last_total = self._last
            self._last = (busy, total)
        spent = total - last_total
        return round(100.0 * (busy - last_busy) / spent, 1) if spent > 0 else 0.0


@dataclass(frozen=True)
class Hardware:
    """What variants depend on: OS, architecture, CPU flags and the CUDA driver."""

    os: str                 # linux, mac, windows
    arch: str               # amd64, arm64
    cpu_model: str = ""
    cpu_flags: frozenset = frozenset()
    cuda: str | None = None  # the driver's CUDA version, "12.4"
    gpus: Gpus = field(default_factory=Gpus, compare=False, repr=False)
    usage: CpuUsage = field(default_factory=CpuUsage, compare=False, repr=False)

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
        """What GET /v1/models/status shows about the machine: CPU, cores, memory and
        CUDA (no GPUs: reading them takes a child process; `cortex` has them)."""
        memory = _meminfo()
        return {"os": self.os, "arch": self.arch, "cpu": self.cpu_model,
                "cpuLevel": self.cpu_level() or "", "cores": available_cores(),
                "ramTotal": memory.get("MemTotal", 0),
                "ramAvailable": memory.get("MemAvailable", 0), "cuda": self.cuda or ""}

    def cortex(self, data_dir: Path) -> dict:
        """GET /v1/hardware, in cortex's shape: cpu, os, ram, storage (that of the
        folder `data_dir`, where models go) and gpus; memory and storage in MiB."""
        memory = _meminfo()
        while not data_dir.exists() and data_dir.parent != data_dir:
            data_dir = data_dir.parent  # not made yet: the file system it will be on
        try:
            disk = shutil.disk_usage(data_dir)
            storage = {"total": disk.total // MIB, "available": disk.free // MIB,
                       "type": storage_type(data_dir)}
        except OSError:
            storage = {"total": 0, "available": 0, "type": ""}
        return {"cpu": {"arch": self.arch, "cores": available_cores(),
                        "model": self.cpu_model, "usage": self.usage.percent(),
                        "instructions": sorted(self.cpu_flags)},
                "os": os_release(),
                "ram": {"total": memory.get("MemTotal", 0) // MIB,
                        "available": memory.get("MemAvailable", 0) // MIB, "type": ""},
                "storage": storage,
                "gpus": [cortex_gpu(g) for g in self.gpus.list()]}

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


def cortex_gpu(gpu: dict) -> dict:
    """One GPU as GET /v1/hardware gives it (cortex's fields, memory in MiB, and
    localrt's type and backend) from localrt.engines.gpus' dict."""
    return {"id": gpu["id"], "name": gpu["name"], "version": gpu["version"],
            "additional_information": {"driver_version": gpu.get("driver", ""),
                                       "compute_cap": gpu.get("computeCap", "")},
            "free_vram": gpu["free"] // MIB, "total_vram": gpu["total"] // MIB,
            "uuid": gpu.get("uuid", ""), "activated": True, "type": gpu["type"],
            "backend": gpu["backend"]}


def os_release(path: Path = Path("/etc/os-release")) -> dict:
    """This OS's name and version: /etc/os-release's NAME and VERSION_ID where it has one."""
    fields = {}
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition("=")
            fields[key.strip()] = value.strip().strip('"')
    except OSError:
        pass
    return {"name": fields.get("NAME") or platform.system(),
            "version": fields.get("VERSION_ID") or platform.release()}


def storage_type(path: Path) -> str:
    """"SSD" or "HDD" for the disk that holds `path` (Linux's rotational flag); "" where
    that cannot be said (a network or overlay file system)."""
    try:
        dev = os.stat(path).st_dev
        block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
        flag = block / "queue" / "rotational"
        if not flag.exists():  # a partition: its disk's queue
            flag = block.parent / "queue" / "rotational"
        return "HDD" if flag.read_text().strip() == "1" else "SSD"
    except (OSError, ValueError):
        return ""


def available_cores() -> int:
    """The CPUs this process may run on (all of them where that cannot be asked)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def free_ram() -> int | None:
    """Bytes of RAM a new allocation can have now without swapping (MemAvailable; None
    where /proc/meminfo cannot say)."""
    return _meminfo().get("MemAvailable")


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
    needs: str | None    # a CPU flag, "cuda-12", or "vulkan"


VULKAN_LOADER = "vulkan"  # libvulkan.so.1, Debian's libvulkan1


def vulkan_devices(hw: Hardware) -> list[dict]:
    """The GPUs llama.cpp's Vulkan backend may use: the Vulkan devices (lavapipe, of type
    cpu, too) and the NVIDIA GPUs the Vulkan loader lists, which are listed once, as
    CUDA's (localrt.engines.gpus.backend_devices)."""
    from localrt.engines.gpus import backend_devices

    return backend_devices(hw.gpus.list(), "vulkan")


VISIBLE_DEVICES = "GGML_VK_VISIBLE_DEVICES"  # llama.cpp's Vulkan device indices


def vulkan_environment(hw: Hardware, environ=os.environ) -> dict[str, str]:
    """What a process that loads a Vulkan build needs in its environment: where every
    Vulkan device is a CPU (lavapipe), GGML_VK_VISIBLE_DEVICES naming them, as llama.cpp
    uses CPU devices only when named; {} where GPUs exist or `environ` names devices."""
    if VISIBLE_DEVICES in environ:
        return {}
    found = vulkan_devices(hw)
    if not found or any(g.get("type") != "cpu" for g in found):
        return {}
    return {VISIBLE_DEVICES: ",".join(g["id"] for g in found)}


def runnable(variant: Build, hw: Hardware) -> str | None:
    """None when this machine can run `variant`, else the reason it cannot."""
    if not variant.name.startswith(hw.platform):
        return f"it is built for another platform; this machine is {hw.platform}"
    if variant.needs is None:
        return None
    if variant.needs == "vulkan":
        if vulkan_devices(hw):
            return None
        import ctypes.util

        if ctypes.util.find_library(VULKAN_LOADER) is None:
            return ("it needs the Vulkan loader (Debian's libvulkan1) and a Vulkan device, "
                    "and this machine has no Vulkan loader")
        return ("it needs a Vulkan device (a GPU with a Vulkan driver, or Mesa's lavapipe "
                "on the CPU: Debian's mesa-vulkan-drivers), and the Vulkan loader finds none")
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


def gpu_build(variant: Build) -> bool:
    """Whether `variant` offloads to a GPU (CUDA or Vulkan), not only the CPU."""
    return bool(variant.needs) and (variant.needs.startswith("cuda-")
                                    or variant.needs == "vulkan")


def recommended(variants: Sequence[Build], hw: Hardware):
    """The variant to install when none is asked for, as cortex picks: CUDA where an
    NVIDIA GPU and its driver are found, else Vulkan where a Vulkan GPU that is not a
    CPU device (lavapipe) is found, else the best CPU level (`variants` lists the CPU
    ones best first)."""
    usable = [v for v in variants if runnable(v, hw) is None]
    cuda = [v for v in usable if v.needs and v.needs.startswith("cuda")]
    vulkan = [v for v in usable if v.needs == "vulkan"
              and any(g.get("type") != "cpu" for g in vulkan_devices(hw))]
    cpu = [v for v in usable if not gpu_build(v)]
    return (cuda or vulkan or cpu or [None])[0]
