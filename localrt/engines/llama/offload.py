"""Where llama.cpp put a model: the layers it offloaded and each buffer's bytes, on each
device, as llama.cpp itself accounts them (issue 35, items 5 and 8).

llama.cpp's C API does not say where a model's buffers went (its memory breakdown is a
C++ map), but it logs each one as it allocates it, with the size ggml gave it:

    load_tensors: offloaded 5/5 layers to GPU
    load_tensors:      Vulkan0 model buffer size =    12.25 MiB
    llama_kv_cache:    Vulkan0 KV buffer size =    64.00 MiB
    llama_context:     Vulkan0 compute buffer size =   20.02 MiB
    llama_context:         CPU  output buffer size =     0.12 MiB

So while a model and its context load (`capture`), this process's llama.cpp log
callback (`install`, which hands every line on to llama-cpp-python's own) keeps the
lines that the loading thread's llama.cpp writes, and `read` makes a Placement of them:
the layers offloaded and of how many (llama.cpp's count: the blocks and the output
layer), and each buffer's bytes (to 10 KiB: the log gives MiB to two decimals). A
buffer of the host (CPU, CPU_Mapped, CPU_REPACK, Vulkan_Host, CUDA_Host) is RAM;
another's name is its ggml device's (Vulkan0, CUDA0), shown as the device's own
description, the name /v1/hardware gives it ("llvmpipe (LLVM 15.0.6, 256 bits)").

A CPU build logs no "offloaded" line: no layer is on a device. A GPU build whose
backend found no device logs one but allocates no device buffer: that, too, is 0.
If a llama.cpp logs these lines differently, nothing is read, and the model's memory
falls back to the estimate in localrt.engines.llama.model.LlamaModel.memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import threading
from dataclasses import dataclass, field

OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers")
BUFFER = re.compile(r"(\S+)\s+(model|KV|compute|output) buffer size =\s*([\d.]+) MiB")
MIB = 1 << 20

_lock = threading.Lock()   # guards _callback: installed once per process
_callback = None           # ours, kept alive for as long as llama.cpp may call it
_forward = None            # the callback every line is handed on to (`install`)
_local = threading.local()  # .lines: the capturing thread's list, or None


@dataclass
class Placement:
    """A loaded model's layers on devices (`layers` of `of`, None when llama.cpp said
    nothing of them) and its buffers: (kind, buffer name, bytes), kind being model, KV,
    compute or output."""

    layers: int | None = None
    of: int | None = None
    buffers: list = field(default_factory=list)

    def host(self) -> int:
        """Bytes in the host's buffers: RAM."""
        return sum(b for _, name, b in self.buffers if is_host(name))

    def kv(self) -> int:
        """Bytes of the KV cache, wherever it is."""
        return sum(b for kind, _, b in self.buffers if kind == "KV")

    def devices(self) -> dict[str, int]:
        """{buffer name (Vulkan0, CUDA0): bytes} of the buffers on devices."""
        out: dict[str, int] = {}
        for _, name, size in self.buffers:
            if not is_host(name):
                out[name] = out.get(name, 0) + size
        return out

    def on_devices(self) -> int:
        """Layers really on devices: 0 where no device holds a buffer."""
        return (self.layers or 0) if self.devices() else 0


def is_host(name: str) -> bool:
    """Whether a buffer of this name is in RAM (the CPU's, or a GPU backend's pinned host
    memory)."""
    return name.startswith("CPU") or name.endswith("_Host")


def read(text: str) -> Placement:
    """The Placement llama.cpp's log `text` (a model's load) describes."""
    placement = Placement()
    for line in text.splitlines():
        found = OFFLOADED.search(line)
        if found:
            placement.layers, placement.of = int(found.group(1)), int(found.group(2))
            continue
        found = BUFFER.search(line)
        if found:
            placement.buffers.append((found.group(2), found.group(1),
                                      round(float(found.group(3)) * MIB)))
    return placement


def install(llama_cpp, forward=None) -> None:
    """Route llama.cpp's log through `_log` (once per process), which hands every line
    on to `forward` (a llama_log_callback: a vetting child's, GgufEngine.in_child), else
    to llama-cpp-python's own callback, as before."""
    global _callback, _forward
    with _lock:
        if forward is not None:
            _forward = forward
        if _callback is not None:
            return
        if _forward is None:
            from llama_cpp import _logger

            _forward = _logger.llama_log_callback

        @llama_cpp.llama_log_callback
        def log(level, text, user_data):
            lines = getattr(_local, "lines", None)
            if lines is not None and text:
                lines.append(text)
            _forward(level, text, user_data)

        _callback = log
        llama_cpp.llama_log_set(log, ctypes.c_void_p(0))


@contextlib.contextmanager
def capture(llama_cpp):
    """Keep what llama.cpp logs in this thread while the body runs; yields a list whose
    joined text is `read` afterwards."""
    install(llama_cpp)
    lines: list[bytes] = []
    _local.lines = lines
    try:
        yield lines
    finally:
        _local.lines = None


def text_of(lines: list[bytes]) -> str:
    """The captured log as text."""
    return b"".join(lines).decode("utf-8", "replace")


def describe(name: str) -> str:
    """The device a buffer name stands for, as its backend describes it ("Vulkan0" ->
    "llvmpipe (LLVM 15.0.6, 256 bits)"); the name itself where ggml has no such device."""
    from localrt.engines.ggmllib import libggml

    lib = libggml()
    dev = lib.ggml_backend_dev_by_name(name.encode())
    if not dev:
        return name
    said = lib.ggml_backend_dev_description(dev)
    return said.decode("utf-8", "replace") if said else name
