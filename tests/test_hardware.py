"""GPUs (issue 35, item 1): NVML's and the Vulkan loader's answers read into localrt's
dicts on the real ctypes structures, GET /v1/hardware in cortex's shape with no Vulkan
loader or driver (an empty list, never an error), and with Mesa's lavapipe, a real
Vulkan device that runs on the CPU, and `localrt ps` showing it.

NVML itself cannot run here (no NVIDIA driver): its parsing is tested on the
structures NVML fills (`nvidia_gpu`), and the absent library is the real no-GPU path.
The lavapipe tests need Debian's libvulkan1 and mesa-vulkan-drivers (python3 -m
localrt.bootstrap --test installs them); without them they skip, except under CI.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import subprocess

import pytest
from support.apps import call
from support.cli import run

from localrt.app import create_app
from localrt.cli import ExitCode
from localrt.engines import gpus
from localrt.engines.hardware import MIB, Gpus, Hardware, cortex_gpu

LAVAPIPE = "llvmpipe"


def require_lavapipe() -> None:
    """Skip the calling test when lavapipe or the Vulkan loader is missing; under CI,
    fail instead."""
    if glob.glob("/usr/lib/*/libvulkan.so.1") and \
            glob.glob("/usr/share/vulkan/icd.d/lvp_icd.*.json"):
        return
    if os.environ.get("CI"):
        raise RuntimeError("CI must install libvulkan1 and mesa-vulkan-drivers "
                           "(python3 -m localrt.bootstrap --test does)")
    pytest.skip("the Vulkan loader or lavapipe (mesa-vulkan-drivers) is not installed")


@pytest.fixture
def no_vulkan_driver(tmp_path, monkeypatch):
    """The Vulkan loader pointed at a driver list with no driver in it."""
    monkeypatch.setenv("VK_ICD_FILENAMES", str(tmp_path / "no-driver.json"))
    monkeypatch.setenv("VK_DRIVER_FILES", str(tmp_path / "no-driver.json"))


# --- the parsing, on the structures the libraries fill --------------------------------


def test_an_nvidia_gpu_is_read_from_what_nvml_fills_in():
    memory = gpus.NvmlMemory(total=81559 * MIB, free=80000 * MIB + 5, used=1559 * MIB)
    gpu = gpus.nvidia_gpu(0, ctypes.create_string_buffer(b"NVIDIA H100 80GB HBM3", 96),
                          memory, ctypes.c_int(9), ctypes.c_int(0),
                          ctypes.create_string_buffer(
                              b"GPU-5f3b9a2c-1d4e-4f60-8a7b-9c0d1e2f3a4b", 96),
                          ctypes.create_string_buffer(b"550.54.15", 80), ctypes.c_int(12040))
    assert gpu == {"id": "0", "name": "NVIDIA H100 80GB HBM3", "backend": "cuda",
                   "type": "discrete", "total": 81559 * MIB, "free": 80000 * MIB + 5,
                   "version": "12.4", "driver": "550.54.15", "computeCap": "9.0",
                   "uuid": "GPU-5f3b9a2c-1d4e-4f60-8a7b-9c0d1e2f3a4b"}
    assert cortex_gpu(gpu) == {
        "id": "0", "name": "NVIDIA H100 80GB HBM3", "version": "12.4",
        "additional_information": {"driver_version": "550.54.15", "compute_cap": "9.0"},
        "free_vram": 80000, "total_vram": 81559,
        "uuid": "GPU-5f3b9a2c-1d4e-4f60-8a7b-9c0d1e2f3a4b", "activated": True,
        "type": "discrete", "backend": "cuda"}
    assert [gpus.cuda_version(v) for v in (12040, 11080, 13000, 0)] == \
        ["12.4", "11.8", "13.0", ""]
    assert ctypes.sizeof(gpus.NvmlMemory) == 24  # nvmlMemory_t: three unsigned long longs


def test_a_vulkan_device_is_read_from_what_the_loader_fills_in():
    props = gpus.VkPhysicalDeviceProperties(apiVersion=(1 << 22) | (3 << 12) | 280,
                                            vendorID=0x10DE, deviceType=2,
                                            deviceName=b"NVIDIA GeForce RTX 4090")
    memory = gpus.VkPhysicalDeviceMemoryProperties(memoryHeapCount=2)
    memory.memoryHeaps[0] = gpus.VkMemoryHeap(24564 * MIB, gpus.VK_MEMORY_HEAP_DEVICE_LOCAL)
    memory.memoryHeaps[1] = gpus.VkMemoryHeap(32000 * MIB, 0)  # host memory it can see
    ids = gpus.VkPhysicalDeviceIDProperties()
    ids.deviceUUID[:] = list(bytes.fromhex("5f3b9a2c1d4e4f608a7b9c0d1e2f3a4b"))
    driver = gpus.VkPhysicalDeviceDriverProperties(driverInfo=b"550.54.15")
    budget = gpus.VkPhysicalDeviceMemoryBudgetProperties()
    budget.heapBudget[0], budget.heapUsage[0] = 24000 * MIB, 1000 * MIB
    budget.heapBudget[1], budget.heapUsage[1] = 30000 * MIB, 0
    props.limits.maxStorageBufferRange = (1 << 32) - 1
    gpu = gpus.vulkan_gpu(1, props, memory, ids, driver, budget, largest=1 << 32)
    assert gpu == {"id": "1", "name": "NVIDIA GeForce RTX 4090", "backend": "vulkan",
                   "type": "discrete", "total": 24564 * MIB, "free": 23000 * MIB,
                   "version": "1.3.280", "driver": "550.54.15", "computeCap": "",
                   "uuid": "5f3b9a2c-1d4e-4f60-8a7b-9c0d1e2f3a4b", "vendorId": 0x10DE,
                   "heaps": [{"size": 24564 * MIB, "deviceLocal": True, "free": 23000 * MIB},
                             {"size": 32000 * MIB, "deviceLocal": False,
                              "free": 30000 * MIB}],
                   "maxBuffer": 1 << 32}
    # without VK_EXT_memory_budget or Vulkan 1.1: the total is all it can say
    bare = gpus.vulkan_gpu(0, props, memory)
    assert bare["free"] == bare["total"] == 24564 * MIB and bare["uuid"] == ""
    assert bare["maxBuffer"] == (1 << 32) - 1  # no maintenance3/4: the storage range
    assert [gpus.DEVICE_TYPES[t] for t in range(5)] == \
        ["other", "integrated", "discrete", "virtual", "cpu"]
    # the fields read lie where vulkan_core.h puts them
    assert gpus.VkPhysicalDeviceProperties.deviceName.offset == 20
    assert gpus.VkPhysicalDeviceProperties2.properties.offset == 16
    assert gpus.VkPhysicalDeviceIDProperties.deviceUUID.offset == 16
    assert ctypes.sizeof(gpus.VkPhysicalDeviceMemoryProperties) == 520
    assert gpus.VkPhysicalDeviceProperties.limits.offset == 296  # 8-aligned after the UUID
    assert gpus.VkPhysicalDeviceLimitsHead.maxStorageBufferRange.offset == 28
    assert gpus.VkPhysicalDeviceMaintenance3Properties.maxMemoryAllocationSize.offset == 24
    assert gpus.VkPhysicalDeviceMaintenance4Properties.maxBufferSize.offset == 16
    assert ctypes.sizeof(gpus.VkPhysicalDeviceProperties) >= 824


def test_the_most_one_tensor_may_have_on_a_vulkan_device_is_ggml_s():
    """ggml-vulkan.cpp: a tensor over maxStorageBufferRange or the buffer size (the
    maintenance4 maxBufferSize, else the allocation size) is an operation it does not
    take; over the allocation size (maintenance3's, no more than maxBufferSize), a
    buffer it cannot allocate; its GGML_VK_FORCE_* variables override the two sizes."""
    mib = MIB
    # Debian 12's lavapipe: 128 MiB storage range, 2 GiB allocations, 4 GiB buffers
    assert gpus.max_buffer(128 * mib, 2048 * mib, (1 << 32) - 1, env={}) == 128 * mib
    # a device whose allocation or buffer size is the smaller
    assert gpus.max_buffer(4096 * mib, 1024 * mib, 2048 * mib, env={}) == 1024 * mib
    assert gpus.max_buffer(4096 * mib, 2048 * mib, 1024 * mib, env={}) == 1024 * mib
    # no maintenance4: the allocation size is the buffer size too
    assert gpus.max_buffer(4096 * mib, 3072 * mib, None, env={}) == 3072 * mib
    # nothing but the storage range (a Vulkan 1.0 device)
    assert gpus.max_buffer(256 * mib, env={}) == 256 * mib
    # the overrides, as ggml reads them from the server's environment
    assert gpus.max_buffer(4096 * mib, 2048 * mib, 4096 * mib,
                           env={"GGML_VK_FORCE_MAX_BUFFER_SIZE": str(64 * mib)}) == 64 * mib
    assert gpus.max_buffer(4096 * mib, 2048 * mib, 4096 * mib,
                           env={"GGML_VK_FORCE_MAX_ALLOCATION_SIZE": str(32 * mib)}) \
        == 32 * mib
    # a forced allocation size is not capped by maxBufferSize, as in ggml
    assert gpus.max_buffer(1 << 40, 2048 * mib, 1024 * mib,
                           env={"GGML_VK_FORCE_MAX_ALLOCATION_SIZE": str(3072 * mib)}) \
        == 1024 * mib


H100_NVML = {"id": "0", "name": "NVIDIA H100 80GB HBM3", "backend": "cuda",
             "type": "discrete", "total": 81559 * MIB, "free": 80000 * MIB,
             "version": "12.4", "driver": "550.54.15", "computeCap": "9.0",
             "uuid": "GPU-5f3b9a2c-1d4e-4f60-8a7b-9c0d1e2f3a4b"}
H100_VULKAN = {"id": "1", "name": "NVIDIA H100 80GB HBM3", "backend": "vulkan",
               "type": "discrete", "total": 81559 * MIB, "free": 79000 * MIB,
               "version": "1.3.280", "driver": "550.54.15", "computeCap": "",
               "uuid": "5f3b9a2c-1d4e-4f60-8a7b-9c0d1e2f3a4b", "vendorId": 0x10DE,
               "heaps": [], "maxBuffer": 1 << 32}
LLVMPIPE = {"id": "0", "name": "llvmpipe (LLVM 15.0.6, 256 bits)", "backend": "vulkan",
            "type": "cpu", "total": 2 << 30, "free": 2 << 30, "version": "1.3.230",
            "driver": "Mesa 22.3.6", "computeCap": "",
            "uuid": "6d657361-3232-2e33-2e36-000000000000", "vendorId": 0x10005,
            "heaps": [], "maxBuffer": 128 * MIB}


def test_an_nvidia_gpu_the_vulkan_loader_also_lists_is_shown_once_as_cuda():
    listed = gpus.merged([H100_NVML], [LLVMPIPE, H100_VULKAN])
    assert [(g["id"], g["backend"]) for g in listed] == [("0", "cuda"), ("0", "vulkan")]
    # the loader's entry of it is kept inside it, for a Vulkan build (its twin)
    assert listed[0] == {**H100_NVML, "vulkan": H100_VULKAN}
    assert gpus.merged([H100_NVML], [LLVMPIPE]) == [H100_NVML, LLVMPIPE]  # no twin
    # two Vulkan drivers of the one GPU (NVIDIA's and Mesa's NVK): neither is a row, the
    # loader's first is the twin
    nvk = dict(H100_VULKAN, id="2", driver="Mesa 25.0.7")
    assert gpus.merged([H100_NVML], [H100_VULKAN, LLVMPIPE, nvk]) == listed
    # /v1/hardware's row is NVML's, in cortex's fields alone
    assert cortex_gpu(listed[0]) == cortex_gpu(H100_NVML)


def test_a_vulkan_build_sees_the_nvidia_gpu_as_the_loader_does_with_nvml_s_memory():
    listed = gpus.merged([H100_NVML], [LLVMPIPE, H100_VULKAN])
    # the loader's id, name, type and maxBuffer, NVML's free and total
    assert gpus.backend_devices(listed, "vulkan") == \
        [LLVMPIPE, {**H100_VULKAN, "free": 80000 * MIB, "total": 81559 * MIB}]
    assert gpus.backend_devices(listed, "cuda") == [listed[0]]
    # a driver without its Vulkan part: the loader lists no twin, and a Vulkan build
    # has only lavapipe
    alone = gpus.merged([H100_NVML], [LLVMPIPE])
    assert gpus.backend_devices(alone, "vulkan") == [LLVMPIPE]
    assert gpus.backend_devices([], "vulkan") == []


def test_the_hardware_route_lists_an_nvidia_gpu_with_a_vulkan_twin_once(settings):
    listed = gpus.merged([H100_NVML], [LLVMPIPE, H100_VULKAN])
    hw = Hardware("linux", "amd64", "test cpu", frozenset({"avx2"}), "12.4",
                  gpus=Gpus(detect=lambda: listed))
    app = create_app(settings, hardware=hw)
    try:
        r = call(app, "GET", "/v1/hardware")  # checked against its reply schema too
    finally:
        app.close()
    assert r.status == 200, r.body
    assert [(g["name"], g["backend"]) for g in r.json["gpus"]] == \
        [("NVIDIA H100 80GB HBM3", "cuda"), ("llvmpipe (LLVM 15.0.6, 256 bits)", "vulkan")]
    assert r.json["gpus"][0] == cortex_gpu(H100_NVML)


# --- no GPU, no driver, no loader ------------------------------------------------------


def test_no_vulkan_loader_and_no_nvml_is_an_empty_list(tmp_path):
    missing = str(tmp_path / "libvulkan.so.1")
    assert gpus.detect(nvml=str(tmp_path / "libnvidia-ml.so.1"), vulkan=missing) == []
    assert gpus.vulkan_gpus(missing) == [] and gpus.nvidia_gpus(missing) == []


def test_a_child_that_does_not_answer_in_time_is_no_gpus(caplog):
    assert gpus.detect(timeout=0.001) == []
    assert "did not finish" in caplog.text


def test_the_hardware_route_without_a_vulkan_driver(api, no_vulkan_driver):
    r = api("GET", "/v1/hardware")
    assert r.status == 200, r.body  # support.apps checks it against its schema too
    body = r.json
    assert body["gpus"] == []
    assert body["cpu"]["cores"] >= 1 and body["cpu"]["arch"] in ("amd64", "arm64")
    assert isinstance(body["cpu"]["instructions"], list) and body["os"]["name"]
    assert 0 < body["ram"]["available"] <= body["ram"]["total"]  # MiB
    assert body["ram"]["total"] < 1 << 24  # MiB, not bytes
    assert 0 < body["storage"]["available"] <= body["storage"]["total"]
    assert 0 <= body["cpu"]["usage"] <= 100


# --- lavapipe ----------------------------------------------------------------------------


@pytest.mark.live
def test_lavapipe_is_a_vulkan_device_of_type_cpu(api):
    require_lavapipe()
    found = [g for g in api("GET", "/v1/hardware").json["gpus"] if LAVAPIPE in g["name"]]
    assert len(found) == 1, found
    gpu = found[0]
    assert re.fullmatch(r"llvmpipe \(LLVM [\d.]+, \d+ bits\)", gpu["name"])
    assert (gpu["type"], gpu["backend"], gpu["activated"]) == ("cpu", "vulkan", True)
    assert re.fullmatch(r"1\.\d+\.\d+", gpu["version"])  # its Vulkan API version
    assert re.fullmatch(r"[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}", gpu["uuid"])
    assert gpu["additional_information"]["compute_cap"] == ""
    assert gpu["additional_information"]["driver_version"].startswith("Mesa ")
    assert 0 < gpu["free_vram"] <= gpu["total_vram"]  # MiB: Debian 12's has a 2 GiB heap
    assert gpu["total_vram"] < 1 << 24
    # the child reads its buffer limit too: vulkaninfo's figures, where it is installed
    device = [g for g in gpus.detect() if LAVAPIPE in g["name"]][0]
    assert device["maxBuffer"] > 0 and device["maxBuffer"] % MIB == 0, device
    if shutil.which("vulkaninfo"):
        info = subprocess.run(["vulkaninfo"], capture_output=True, text=True,
                              timeout=60).stdout
        chunk = info[info.find(LAVAPIPE):]

        def limit(name):
            return int(re.search(rf"{name}\s*=\s*(\w+)", chunk).group(1), 0)

        assert device["maxBuffer"] == min(limit("maxStorageBufferRange"),
                                          limit("maxMemoryAllocationSize"),
                                          limit("maxBufferSize")), device


@pytest.mark.live
def test_a_broken_nvml_library_does_not_hide_the_vulkan_devices():
    require_lavapipe()
    # libc has none of NVML's functions: the child reads the Vulkan devices all the same
    found = gpus.detect(nvml="libc.so.6")
    assert [g["backend"] for g in found if LAVAPIPE in g["name"]] == ["vulkan"]


@pytest.mark.live
def test_ps_shows_the_gpus(thread_server):
    require_lavapipe()
    code, out, _ = run("ps")
    assert code == ExitCode.OK
    header = next(line for line in out.splitlines() if "| GPU" in line)
    assert [c.strip() for c in header.strip("|").split("|")] == \
        ["GPU", "Name", "Type", "Backend", "Version", "Free", "Total"]
    row = next(line for line in out.splitlines() if LAVAPIPE in line)
    assert [c.strip() for c in row.strip("|").split("|")][2:4] == ["cpu", "vulkan"]


@pytest.mark.live
def test_ps_without_a_vulkan_driver_says_no_gpu(thread_server, no_vulkan_driver):
    code, out, _ = run("ps")
    assert code == ExitCode.OK and "no GPU" in out and "| GPU" not in out
