"""This machine's GPUs: NVIDIA ones through NVML, and every Vulkan device through the
Vulkan loader, read in a child process.

A GPU driver is native code that localrt did not build: a broken one can hang or crash
the process that asks it. So `detect()` runs this module as a child (`python -m
localrt.engines.gpus`, bounded by DETECT_TIMEOUT), which loads `libnvidia-ml.so.1` and
`libvulkan.so.1` through ctypes and prints one JSON line: the GPUs it found. A child
that fails, hangs or finds no library means no GPUs, never an error.

NVML gives each NVIDIA GPU's name, total and free memory, the driver's version and the
CUDA version it supports, the compute capability and the UUID. The Vulkan loader gives
each device's name, type (discrete, integrated, virtual, cpu or other), its memory heaps
(free memory where the driver has VK_EXT_memory_budget, else the device-local total),
its Vulkan API version, driver and device UUID (vkGetPhysicalDeviceProperties2 with
VkPhysicalDeviceIDProperties). An NVIDIA GPU both list (the same UUID) is listed once,
as NVML gives it, with the backend `cuda`, and the loader's entry of it kept inside it
as its `vulkan` twin (`merged`): what /v1/hardware shows is the one row, and a Vulkan
build, which runs on that GPU too, sees it through `backend_devices`.

Which devices the Vulkan loader sees is the loader's business: VK_ICD_FILENAMES (or
VK_DRIVER_FILES) in the server's environment reach the child unchanged. Each GPU is a
plain dict: id (its index in its backend's order, as llama.cpp numbers CUDA0 and
Vulkan0), name, backend (cuda, vulkan), type, total and free (bytes), version (the CUDA
version, or the Vulkan API version), driver, computeCap, uuid, and a Vulkan device's
heaps and maxBuffer: the most bytes one tensor may have on it (`max_buffer`, from its
limits as ggml's Vulkan backend reads them; 128 MiB on Debian 12's lavapipe), which
localrt.engines.memory keeps every offloaded layer's tensors under. A CUDA device has
no maxBuffer: ggml's CUDA backend allocates a buffer of any size the free memory holds
and its kernels index 64-bit, so there is no per-tensor limit worth modelling there.
An NVIDIA GPU the Vulkan loader lists too has the loader's dict of it as `vulkan`.
localrt.engines.hardware owns the list the server shows.

This module imports only the standard library, so the child starts fast.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

NVML_LIBRARY = "libnvidia-ml.so.1"
VULKAN_LIBRARY = "libvulkan.so.1"
DETECT_TIMEOUT = 20.0  # seconds; a real driver's first instance takes one or two

# --- NVML ---------------------------------------------------------------------------

NVML_SUCCESS = 0
NVML_BUFFER = 96  # NVML_DEVICE_NAME_V2_BUFFER_SIZE, and enough for a UUID and a version


class NvmlMemory(ctypes.Structure):
    """nvmlMemory_t: bytes of a device's memory."""

    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


def cuda_version(value: int) -> str:
    """NVML's CUDA driver version (12040) as "12.4"."""
    return f"{value // 1000}.{value % 1000 // 10}" if value > 0 else ""


def nvidia_gpu(index: int, name, memory: NvmlMemory, major: ctypes.c_int,
               minor: ctypes.c_int, uuid, driver, cuda: ctypes.c_int) -> dict:
    """One NVIDIA GPU from what NVML filled in: its name, UUID and the driver's version
    (string buffers), its memory, compute capability and the CUDA version (ints)."""
    return {"id": str(index), "name": name.value.decode("utf-8", "replace"),
            "backend": "cuda", "type": "discrete", "total": int(memory.total),
            "free": int(memory.free), "version": cuda_version(cuda.value),
            "driver": driver.value.decode("utf-8", "replace"),
            "computeCap": f"{major.value}.{minor.value}" if major.value > 0 else "",
            "uuid": uuid.value.decode("utf-8", "replace")}


def nvidia_gpus(library: str = NVML_LIBRARY) -> list[dict]:
    """The NVIDIA GPUs NVML knows ([] without the library or a driver)."""
    try:
        nvml = ctypes.CDLL(library)
    except OSError:
        return []
    if nvml.nvmlInit_v2() != NVML_SUCCESS:
        return []
    try:
        driver = ctypes.create_string_buffer(NVML_BUFFER)
        nvml.nvmlSystemGetDriverVersion(driver, NVML_BUFFER)
        cuda = ctypes.c_int(0)
        nvml.nvmlSystemGetCudaDriverVersion(ctypes.byref(cuda))
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != NVML_SUCCESS:
            return []
        gpus = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index),
                                                  ctypes.byref(handle)) != NVML_SUCCESS:
                continue  # a GPU this user may not open, or one that fell off the bus
            name = ctypes.create_string_buffer(NVML_BUFFER)
            uuid = ctypes.create_string_buffer(NVML_BUFFER)
            memory = NvmlMemory()
            major, minor = ctypes.c_int(0), ctypes.c_int(0)
            nvml.nvmlDeviceGetName(handle, name, NVML_BUFFER)
            nvml.nvmlDeviceGetUUID(handle, uuid, NVML_BUFFER)
            nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory))
            nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major),
                                                    ctypes.byref(minor))
            gpus.append(nvidia_gpu(index, name, memory, major, minor, uuid, driver, cuda))
        return gpus
    finally:
        nvml.nvmlShutdown()


# --- Vulkan -------------------------------------------------------------------------

VK_SUCCESS, VK_INCOMPLETE = 0, 5
# VkStructureType values (vulkan_core.h)
VK_APPLICATION_INFO = 0
VK_INSTANCE_CREATE_INFO = 1
VK_PHYSICAL_DEVICE_PROPERTIES_2 = 1000059001
VK_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2 = 1000059006
VK_PHYSICAL_DEVICE_ID_PROPERTIES = 1000071004
VK_PHYSICAL_DEVICE_DRIVER_PROPERTIES = 1000196000
VK_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES = 1000168000
VK_PHYSICAL_DEVICE_MAINTENANCE_4_PROPERTIES = 1000413001
VK_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES = 1000237000
VK_MEMORY_HEAP_DEVICE_LOCAL = 0x1
VK_MAX_MEMORY_HEAPS = 16
VK_API_1_1 = (1 << 22) | (1 << 12)
VK_API_1_2 = (1 << 22) | (2 << 12)
# VkPhysicalDeviceType -> the type /v1/hardware shows
DEVICE_TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}


class VkApplicationInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p),
                ("pApplicationName", ctypes.c_char_p), ("applicationVersion", ctypes.c_uint32),
                ("pEngineName", ctypes.c_char_p), ("engineVersion", ctypes.c_uint32),
                ("apiVersion", ctypes.c_uint32)]


class VkInstanceCreateInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32),
                ("pApplicationInfo", ctypes.POINTER(VkApplicationInfo)),
                ("enabledLayerCount", ctypes.c_uint32), ("ppEnabledLayerNames", ctypes.c_void_p),
                ("enabledExtensionCount", ctypes.c_uint32),
                ("ppEnabledExtensionNames", ctypes.c_void_p)]


class VkPhysicalDeviceLimitsHead(ctypes.Structure):
    """The first fields of VkPhysicalDeviceLimits, up to maxStorageBufferRange."""

    _fields_ = [(name, ctypes.c_uint32) for name in (
        "maxImageDimension1D", "maxImageDimension2D", "maxImageDimension3D",
        "maxImageDimensionCube", "maxImageArrayLayers", "maxTexelBufferElements",
        "maxUniformBufferRange", "maxStorageBufferRange")]


class VkPhysicalDeviceProperties(ctypes.Structure):
    """VkPhysicalDeviceProperties as far as it is read; the rest of its limits and its
    sparse properties (824 bytes in all on 64-bit) are room the driver writes."""

    _fields_ = [("apiVersion", ctypes.c_uint32), ("driverVersion", ctypes.c_uint32),
                ("vendorID", ctypes.c_uint32), ("deviceID", ctypes.c_uint32),
                ("deviceType", ctypes.c_int), ("deviceName", ctypes.c_char * 256),
                ("pipelineCacheUUID", ctypes.c_ubyte * 16),
                ("limitsAlignment", ctypes.c_uint32),  # the limits hold 64-bit fields
                ("limits", VkPhysicalDeviceLimitsHead),
                ("limitsRestAndSparse", ctypes.c_ubyte * 1024)]


class VkPhysicalDeviceProperties2(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p),
                ("properties", VkPhysicalDeviceProperties)]


class VkPhysicalDeviceIDProperties(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p),
                ("deviceUUID", ctypes.c_ubyte * 16), ("driverUUID", ctypes.c_ubyte * 16),
                ("deviceLUID", ctypes.c_ubyte * 8), ("deviceNodeMask", ctypes.c_uint32),
                ("deviceLUIDValid", ctypes.c_uint32)]


class VkPhysicalDeviceDriverProperties(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p),
                ("driverID", ctypes.c_int), ("driverName", ctypes.c_char * 256),
                ("driverInfo", ctypes.c_char * 256), ("conformanceVersion", ctypes.c_uint8 * 4)]


class VkPhysicalDeviceMaintenance3Properties(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p),
                ("maxPerSetDescriptors", ctypes.c_uint32),
                ("maxMemoryAllocationSize", ctypes.c_uint64)]


class VkPhysicalDeviceMaintenance4Properties(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p),
                ("maxBufferSize", ctypes.c_uint64)]


class VkMemoryType(ctypes.Structure):
    _fields_ = [("propertyFlags", ctypes.c_uint32), ("heapIndex", ctypes.c_uint32)]


class VkMemoryHeap(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint64), ("flags", ctypes.c_uint32)]


class VkPhysicalDeviceMemoryProperties(ctypes.Structure):
    _fields_ = [("memoryTypeCount", ctypes.c_uint32), ("memoryTypes", VkMemoryType * 32),
                ("memoryHeapCount", ctypes.c_uint32),
                ("memoryHeaps", VkMemoryHeap * VK_MAX_MEMORY_HEAPS)]


class VkPhysicalDeviceMemoryProperties2(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p),
                ("memoryProperties", VkPhysicalDeviceMemoryProperties)]


class VkPhysicalDeviceMemoryBudgetProperties(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p),
                ("heapBudget", ctypes.c_uint64 * VK_MAX_MEMORY_HEAPS),
                ("heapUsage", ctypes.c_uint64 * VK_MAX_MEMORY_HEAPS)]


class VkExtensionProperties(ctypes.Structure):
    _fields_ = [("extensionName", ctypes.c_char * 256), ("specVersion", ctypes.c_uint32)]


def vulkan_version(value: int) -> str:
    """A packed Vulkan version (VK_MAKE_API_VERSION) as "1.3.230"."""
    return f"{(value >> 22) & 0x7F}.{(value >> 12) & 0x3FF}.{value & 0xFFF}"


def uuid_text(raw) -> str:
    """16 UUID bytes as 8-4-4-4-12 hex digits, as vulkaninfo and NVML write them."""
    h = bytes(raw).hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def max_buffer(storage_range: int, allocation: int | None = None,
               buffer_size: int | None = None, env=None) -> int:
    """The most bytes one tensor may have on a Vulkan device for ggml's Vulkan backend,
    from its maxStorageBufferRange, maxMemoryAllocationSize (Vulkan 1.1's maintenance3;
    None: unknown) and maxBufferSize (VK_KHR_maintenance4; None: no such extension),
    as ggml-vulkan.cpp reads them (GGML_VK_FORCE_MAX_ALLOCATION_SIZE and
    GGML_VK_FORCE_MAX_BUFFER_SIZE in `env` override the last two, as there). A tensor
    over its buffer size or the storage range is an operation the backend does not
    take, which for the KV cache, allocated on the device, aborts the process; one over
    the allocation size fails to allocate. The storage range is not lifted where ggml
    would (VK_EXT_shader_64bit_indexing, which Debian's Vulkan headers predate)."""
    env = os.environ if env is None else env
    if env.get("GGML_VK_FORCE_MAX_ALLOCATION_SIZE", "").isdigit():
        allocation = int(env["GGML_VK_FORCE_MAX_ALLOCATION_SIZE"])
    elif allocation is not None and buffer_size is not None:
        allocation = min(allocation, buffer_size)
    if env.get("GGML_VK_FORCE_MAX_BUFFER_SIZE", "").isdigit():
        buffer_size = int(env["GGML_VK_FORCE_MAX_BUFFER_SIZE"])
    elif buffer_size is None:
        buffer_size = allocation
    return min(n for n in (storage_range, allocation, buffer_size) if n is not None)


def vulkan_gpu(index: int, props: VkPhysicalDeviceProperties,
               memory: VkPhysicalDeviceMemoryProperties,
               ids: VkPhysicalDeviceIDProperties | None = None,
               driver: VkPhysicalDeviceDriverProperties | None = None,
               budget: VkPhysicalDeviceMemoryBudgetProperties | None = None,
               largest: int | None = None) -> dict:
    """One Vulkan device from what the loader filled in: `ids`, `driver` and `budget`
    where the device could say them (Vulkan 1.1, 1.2 and VK_EXT_memory_budget), and
    `largest`, its max_buffer (else its maxStorageBufferRange alone)."""
    heaps, total, free = [], 0, 0
    for i in range(min(memory.memoryHeapCount, VK_MAX_MEMORY_HEAPS)):
        heap = memory.memoryHeaps[i]
        local = bool(heap.flags & VK_MEMORY_HEAP_DEVICE_LOCAL)
        entry = {"size": int(heap.size), "deviceLocal": local}
        if budget is not None:
            entry["free"] = max(int(budget.heapBudget[i]) - int(budget.heapUsage[i]), 0)
        heaps.append(entry)
        if local:
            total += entry["size"]
            free += entry.get("free", entry["size"])
    return {"id": str(index), "name": props.deviceName.decode("utf-8", "replace"),
            "backend": "vulkan", "type": DEVICE_TYPES.get(props.deviceType, "other"),
            "total": total, "free": free, "version": vulkan_version(props.apiVersion),
            "driver": driver.driverInfo.decode("utf-8", "replace") if driver else "",
            "computeCap": "", "uuid": uuid_text(ids.deviceUUID) if ids else "",
            "vendorId": int(props.vendorID), "heaps": heaps,
            "maxBuffer": int(props.limits.maxStorageBufferRange) if largest is None
            else largest}


def _vulkan_library(library: str):
    """The loader with the argument types of the calls below."""
    vk = ctypes.CDLL(library)
    handle, p = ctypes.c_void_p, ctypes.POINTER
    vk.vkCreateInstance.argtypes = [p(VkInstanceCreateInfo), handle, p(handle)]
    vk.vkDestroyInstance.argtypes = [handle, handle]
    vk.vkDestroyInstance.restype = None
    vk.vkEnumeratePhysicalDevices.argtypes = [handle, p(ctypes.c_uint32), p(handle)]
    vk.vkGetPhysicalDeviceProperties.argtypes = [handle, p(VkPhysicalDeviceProperties)]
    vk.vkGetPhysicalDeviceProperties.restype = None
    vk.vkGetPhysicalDeviceMemoryProperties.argtypes = [handle,
                                                       p(VkPhysicalDeviceMemoryProperties)]
    vk.vkGetPhysicalDeviceMemoryProperties.restype = None
    vk.vkEnumerateDeviceExtensionProperties.argtypes = [handle, ctypes.c_char_p,
                                                        p(ctypes.c_uint32),
                                                        p(VkExtensionProperties)]
    for name, kind in (("vkGetPhysicalDeviceProperties2", VkPhysicalDeviceProperties2),
                       ("vkGetPhysicalDeviceMemoryProperties2",
                        VkPhysicalDeviceMemoryProperties2)):
        function = getattr(vk, name, None)  # a loader older than Vulkan 1.1 lacks them
        if function is not None:
            function.argtypes, function.restype = [handle, p(kind)], None
    return vk


def _instance_version(vk) -> int:
    """The loader's Vulkan version: 1.0 where it cannot say."""
    enumerate_version = getattr(vk, "vkEnumerateInstanceVersion", None)
    if enumerate_version is None:
        return 1 << 22
    version = ctypes.c_uint32(0)
    enumerate_version.argtypes = [ctypes.POINTER(ctypes.c_uint32)]
    return version.value if enumerate_version(ctypes.byref(version)) == VK_SUCCESS \
        else 1 << 22


def _extensions(vk, device) -> set[bytes]:
    """The device's extensions' names."""
    count = ctypes.c_uint32(0)
    if vk.vkEnumerateDeviceExtensionProperties(device, None, ctypes.byref(count), None) \
            != VK_SUCCESS or not count.value:
        return set()
    found = (VkExtensionProperties * count.value)()
    if vk.vkEnumerateDeviceExtensionProperties(device, None, ctypes.byref(count), found) \
            not in (VK_SUCCESS, VK_INCOMPLETE):
        return set()
    return {found[i].extensionName for i in range(count.value)}


def vulkan_gpus(library: str = VULKAN_LIBRARY) -> list[dict]:
    """The Vulkan devices the loader knows ([] without a loader or a driver)."""
    try:
        vk = _vulkan_library(library)
    except (OSError, AttributeError):
        return []
    newer = _instance_version(vk) >= VK_API_1_1 and \
        hasattr(vk, "vkGetPhysicalDeviceProperties2")
    app = VkApplicationInfo(VK_APPLICATION_INFO, None, b"localrt", 1, b"localrt", 1,
                            VK_API_1_1 if newer else 1 << 22)
    info = VkInstanceCreateInfo(VK_INSTANCE_CREATE_INFO, None, 0, ctypes.pointer(app),
                                0, None, 0, None)
    instance = ctypes.c_void_p()
    if vk.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(instance)) != VK_SUCCESS:
        return []  # VK_ERROR_INCOMPATIBLE_DRIVER: no driver the loader could use
    try:
        count = ctypes.c_uint32(0)
        if vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None) != VK_SUCCESS:
            return []
        devices = (ctypes.c_void_p * count.value)()
        if vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), devices) \
                not in (VK_SUCCESS, VK_INCOMPLETE):
            return []
        return [_vulkan_device(vk, index, devices[index], newer)
                for index in range(count.value)]
    finally:
        vk.vkDestroyInstance(instance, None)


def _vulkan_device(vk, index: int, device, newer: bool) -> dict:
    """What the loader says of one physical device."""
    props = VkPhysicalDeviceProperties()
    vk.vkGetPhysicalDeviceProperties(device, ctypes.byref(props))
    ids = driver = budget = largest = None
    memory = VkPhysicalDeviceMemoryProperties()
    if newer and props.apiVersion >= VK_API_1_1:
        extensions = _extensions(vk, device)
        # The chain: ids -> maintenance3 (1.1) -> driver (1.2) -> maintenance4 (its
        # extension, which ggml asks for by name).
        ids = VkPhysicalDeviceIDProperties(VK_PHYSICAL_DEVICE_ID_PROPERTIES, None)
        third = VkPhysicalDeviceMaintenance3Properties(
            VK_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES, None)
        ids.pNext = ctypes.cast(ctypes.pointer(third), ctypes.c_void_p)
        tail = third
        if props.apiVersion >= VK_API_1_2:
            driver = VkPhysicalDeviceDriverProperties(VK_PHYSICAL_DEVICE_DRIVER_PROPERTIES,
                                                      None)
            tail.pNext = ctypes.cast(ctypes.pointer(driver), ctypes.c_void_p)
            tail = driver
        fourth = None
        if b"VK_KHR_maintenance4" in extensions:
            fourth = VkPhysicalDeviceMaintenance4Properties(
                VK_PHYSICAL_DEVICE_MAINTENANCE_4_PROPERTIES, None)
            tail.pNext = ctypes.cast(ctypes.pointer(fourth), ctypes.c_void_p)
        both = VkPhysicalDeviceProperties2(VK_PHYSICAL_DEVICE_PROPERTIES_2,
                                           ctypes.cast(ctypes.pointer(ids), ctypes.c_void_p))
        vk.vkGetPhysicalDeviceProperties2(device, ctypes.byref(both))
        props = both.properties
        largest = max_buffer(int(props.limits.maxStorageBufferRange),
                             int(third.maxMemoryAllocationSize) or None,
                             int(fourth.maxBufferSize) or None if fourth else None)
        if b"VK_EXT_memory_budget" in extensions:
            budget = VkPhysicalDeviceMemoryBudgetProperties(
                VK_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES, None)
            memory2 = VkPhysicalDeviceMemoryProperties2(
                VK_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2,
                ctypes.cast(ctypes.pointer(budget), ctypes.c_void_p))
            vk.vkGetPhysicalDeviceMemoryProperties2(device, ctypes.byref(memory2))
            memory = memory2.memoryProperties
    if budget is None:
        vk.vkGetPhysicalDeviceMemoryProperties(device, ctypes.byref(memory))
    return vulkan_gpu(index, props, memory, ids, driver, budget, largest)


# --- both, in a child -----------------------------------------------------------------


def merged(nvidia: list[dict], vulkan: list[dict]) -> list[dict]:
    """NVML's GPUs, then the Vulkan devices that are not one of them (by UUID); an NVIDIA
    GPU the loader lists too keeps the loader's (first) entry of it as `vulkan`."""
    twins: dict[str, dict] = {}
    for g in vulkan:
        if g["uuid"]:
            twins.setdefault(g["uuid"].lower(), g)
    out = []
    for g in nvidia:
        twin = twins.get(g["uuid"].lower().removeprefix("gpu-")) if g["uuid"] else None
        out.append({**g, "vulkan": twin} if twin else g)
    seen = {g["uuid"].lower().removeprefix("gpu-") for g in nvidia if g["uuid"]}
    return out + [g for g in vulkan if not g["uuid"] or g["uuid"].lower() not in seen]


def backend_devices(gpus: list[dict], backend: str) -> list[dict]:
    """The devices of `gpus` (`merged`'s list) that a build of `backend` (cuda, vulkan)
    can use, each as that backend sees it. A Vulkan build runs on an NVIDIA GPU too,
    where the loader lists it: that one comes as the loader's twin (its Vulkan id, the
    name ggml's Vulkan backend gives it, its maxBuffer) with NVML's free and total
    memory, which are exact where the loader's may be a heap's size."""
    if backend != "vulkan":
        return [g for g in gpus if g.get("backend") == backend]
    return [g for g in gpus if g.get("backend") == "vulkan"] + \
        [{**g["vulkan"], "free": g["free"], "total": g["total"]}
         for g in gpus if g.get("backend") == "cuda" and g.get("vulkan")]


def main(argv: list[str]) -> int:
    """Print the GPUs as one JSON line: {"gpus": [...]}; argv: the NVML and Vulkan
    libraries to load."""
    nvml, vulkan = (argv + [NVML_LIBRARY, VULKAN_LIBRARY][len(argv):])[:2]
    print(json.dumps({"gpus": merged(_guarded(nvidia_gpus, nvml),
                                     _guarded(vulkan_gpus, vulkan))}), flush=True)
    return 0


def _guarded(read, library: str) -> list[dict]:
    """`read(library)`, or [] when the library lacks a function it calls (an old
    driver): one library's failure never hides the other's GPUs."""
    try:
        return read(library)
    except (AttributeError, OSError, ValueError) as exc:
        print(f"{library}: {exc}", file=sys.stderr)
        return []


def detect(timeout: float = DETECT_TIMEOUT, nvml: str = NVML_LIBRARY,
           vulkan: str = VULKAN_LIBRARY) -> list[dict]:
    """The GPUs, read by a child process; [] when it fails or takes over `timeout` s."""
    import localrt

    env = dict(os.environ)
    # The child must import this localrt, wherever it is installed or checked out.
    root = str(Path(localrt.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "localrt.engines.gpus", nvml, vulkan],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        proc.communicate()
        log.warning("GPU detection did not finish in %.0f s; no GPUs are shown", timeout)
        return []
    except BaseException:  # the server is stopping: the child goes with it
        _kill(proc)
        proc.wait()
        raise
    try:
        gpus = json.loads(out.decode("utf-8", "replace").splitlines()[-1])["gpus"]
    except (ValueError, IndexError, KeyError, TypeError):
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:]
        log.warning("GPU detection failed (exit status %s)%s; no GPUs are shown",
                    proc.returncode, f": {tail[0]}" if tail else "")
        return []
    return gpus if isinstance(gpus, list) else []


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its session: anything a driver started too
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
