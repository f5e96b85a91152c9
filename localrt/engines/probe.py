"""The gguf-cpp probe: does this llama.cpp build run quantized models on this CPU?

Run as a child process (`python -m localrt.engines.probe [ENGINE_DIR]`), never in the server:
a build that the compiler got wrong dies with SIGILL on its first quantized matmul,
and it must not take the server with it (see the engines issue and README.rst).

The child prints one JSON object per line on stdout, flushing after each, so the
parent knows how far it got even when the child is killed by a signal:

* ``{"stage": "info", "version", "system_info", "gpu_offload", "rpc", "backends",
  "devices"}`` once llama_cpp loads (rpc: built with llama.cpp's RPC backend; backends:
  ggml's, such as ["CPU", "Vulkan"]; devices: the GPUs those see, each {"name",
  "description", "type"});
* ``{"stage": "decode", "type": "Q8_0"}`` before each quantized model is run;
* ``{"stage": "offload", "device"}`` before a build with a GPU device (a Vulkan or CUDA
  build) runs the model with all its layers on that device, and its greedy reply is
  compared with the one the CPU gave (`OFFLOAD_TOKENS` tokens, the F32 model, whose
  arithmetic differs between the two by rounding only); a reply that differs fails the
  probe, as a crash does;
* ``{"stage": "done", "tokens_per_second": ...}`` when every type decoded.

A Vulkan build on a machine whose only Vulkan device is a CPU (Mesa's lavapipe) sees it
only when GGML_VK_VISIBLE_DEVICES names it (llama.cpp skips CPU devices otherwise): the
parent sets it for the child (localrt.engines.hardware.vulkan_environment) as
localrt.engines.catalog does for the server before it imports such a build.

The model is written here (a tiny random llama with a byte-level SentencePiece
vocabulary), then quantized with ``llama_cpp.llama_model_quantize`` to each type in
`QUANT_TYPES`. Everything lives in a temporary folder that is removed at the end.
numpy is imported here only: it comes with llama-cpp-python.

The parent's side is here too: `run_probe` starts the child and reads its lines into a
result (`{"variant", "version", "systemInfo", "seconds", "decodeTokensPerSecond"}`, or
a `reason` when the build failed), and `Probes` keeps the results per build and CPU in
`<dataFolderPath>/engines/probes.json`. This module imports only the standard library
and localrt.fsutil at the top, so the child starts fast.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import localrt
from localrt.fsutil import read_json, write_json

if TYPE_CHECKING:  # only for annotations: the child never imports it
    from localrt.engines.hardware import Hardware

log = logging.getLogger(__name__)

PROBES_FILE = "probes.json"
PROBE_TIMEOUT = 300  # seconds; a probe loads and decodes two tiny models

# ggml type names -> llama_ftype values (llama.h: LLAMA_FTYPE_MOSTLY_Q4_0 = 2, Q8_0 = 7).
QUANT_TYPES = {"Q8_0": 7, "Q4_0": 2}
DECODE_TOKENS = 4
OFFLOAD_TOKENS = 8  # greedy tokens compared between the CPU and a GPU device

# Sizes chosen so every weight row is a multiple of 256, the largest quantization block
# (k-quants), so llama.cpp uses its real quantized kernels and no fallback types.
N_EMBD, N_FF, N_HEAD, N_LAYER, N_CTX = 256, 512, 4, 1, 128

# GGUF value types (gguf.md in llama.cpp).
_U32, _I32, _F32, _BOOL, _STR, _ARR = 4, 5, 6, 7, 8, 9
_ALIGN = 32


def _emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _string(s: str) -> bytes:
    data = s.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _value(kind: int, value) -> bytes:
    if kind == _STR:
        return _string(value)
    if kind == _ARR:
        elem_kind, items = value
        return struct.pack("<IQ", elem_kind, len(items)) + b"".join(
            _value(elem_kind, item) for item in items)
    return struct.pack({_U32: "<I", _I32: "<i", _F32: "<f", _BOOL: "<?"}[kind], value)


def _vocab() -> tuple[list, list, list]:
    """Tokens, scores and types: <unk> <s> </s>, the 256 byte tokens, some pieces."""
    pieces = ["\u2581"] + list("etaoinshrdlu") + ["\u2581" + c for c in "etaoinshrdlu"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)  # unknown, control, byte, normal
    scores = [0.0] * 259 + [-100.0 + len(p) - i * 1e-3 for i, p in enumerate(pieces)]
    return tokens, scores, types


def write_model(path: Path, seed: int = 0) -> Path:
    """Write a tiny random-weight F32 llama GGUF file that llama.cpp loads."""
    import numpy as np

    tokens, scores, types = _vocab()
    head_dim = N_EMBD // N_HEAD
    kv = [
        ("general.architecture", _STR, "llama"),
        ("general.name", _STR, "localrt-probe"),
        ("general.file_type", _U32, 0),
        ("llama.context_length", _U32, N_CTX),
        ("llama.embedding_length", _U32, N_EMBD),
        ("llama.block_count", _U32, N_LAYER),
        ("llama.feed_forward_length", _U32, N_FF),
        ("llama.attention.head_count", _U32, N_HEAD),
        ("llama.attention.head_count_kv", _U32, N_HEAD),
        ("llama.rope.dimension_count", _U32, head_dim),
        ("llama.attention.layer_norm_rms_epsilon", _F32, 1e-5),
        ("tokenizer.ggml.model", _STR, "llama"),
        ("tokenizer.ggml.tokens", _ARR, (_STR, tokens)),
        ("tokenizer.ggml.scores", _ARR, (_F32, scores)),
        ("tokenizer.ggml.token_type", _ARR, (_I32, types)),
        ("tokenizer.ggml.unknown_token_id", _U32, 0),
        ("tokenizer.ggml.bos_token_id", _U32, 1),
        ("tokenizer.ggml.eos_token_id", _U32, 2),
    ]
    rng = np.random.default_rng(seed)
    n_vocab = len(tokens)

    def weight(rows, cols):  # numpy (rows, cols) is ggml ne = [cols, rows]
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02)

    tensors = [("token_embd.weight", weight(n_vocab, N_EMBD)),
               ("output_norm.weight", np.ones(N_EMBD, np.float32)),
               ("output.weight", weight(n_vocab, N_EMBD))]
    for b in range(N_LAYER):
        tensors += [(f"blk.{b}.attn_norm.weight", np.ones(N_EMBD, np.float32)),
                    (f"blk.{b}.attn_q.weight", weight(N_EMBD, N_EMBD)),
                    (f"blk.{b}.attn_k.weight", weight(N_EMBD, N_EMBD)),
                    (f"blk.{b}.attn_v.weight", weight(N_EMBD, N_EMBD)),
                    (f"blk.{b}.attn_output.weight", weight(N_EMBD, N_EMBD)),
                    (f"blk.{b}.ffn_norm.weight", np.ones(N_EMBD, np.float32)),
                    (f"blk.{b}.ffn_gate.weight", weight(N_FF, N_EMBD)),
                    (f"blk.{b}.ffn_up.weight", weight(N_FF, N_EMBD)),
                    (f"blk.{b}.ffn_down.weight", weight(N_EMBD, N_FF))]

    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)))
    for key, kind, value in kv:
        out += _string(key) + struct.pack("<I", kind) + _value(kind, value)
    offset = 0
    for name, array in tensors:
        dims = array.shape[::-1]
        out += _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, 0, offset)
        offset += -(-array.nbytes // _ALIGN) * _ALIGN
    with open(path, "wb") as f:
        f.write(out + b"\0" * (-len(out) % _ALIGN))
        for _, array in tensors:
            data = array.astype("<f4").tobytes()
            f.write(data + b"\0" * (-len(data) % _ALIGN))
    return path


# --- the child ---------------------------------------------------------------------


def _ggml_devices() -> tuple[list[str], list[dict]]:
    """ggml's backends, and the GPU devices they see, read from the build's libggml
    (localrt.engines.ggmllib); ([], []) where it cannot say."""
    from localrt.engines.ggmllib import DEVICE_GPU, DEVICE_IGPU, libggml

    kinds = {DEVICE_GPU: "gpu", DEVICE_IGPU: "igpu"}  # the devices layers go to
    try:
        ggml = libggml()
        backends = [ggml.ggml_backend_reg_name(ggml.ggml_backend_reg_get(i)).decode()
                    for i in range(ggml.ggml_backend_reg_count())]
        devices = []
        for i in range(ggml.ggml_backend_dev_count()):
            dev = ggml.ggml_backend_dev_get(i)
            kind = kinds.get(ggml.ggml_backend_dev_type(dev))
            if kind:
                devices.append({"name": ggml.ggml_backend_dev_name(dev).decode(),
                                "description": ggml.ggml_backend_dev_description(dev)
                                .decode("utf-8", "replace"), "type": kind})
        return backends, devices
    except (ImportError, OSError, AttributeError, UnicodeDecodeError):
        return [], []


def _greedy(llama_cpp, path: Path, gpu_layers: int) -> list[int]:
    """The tokens a model at `path` answers "hello" with, greedily, `gpu_layers` of its
    layers on the GPU (-1: all of them)."""
    llm = llama_cpp.Llama(str(path), n_ctx=N_CTX, n_threads=1, n_gpu_layers=gpu_layers,
                          seed=1, verbose=False)
    try:
        tokens = []
        for token in llm.generate(llm.tokenize(b"hello"), temp=0.0, top_k=1):
            tokens.append(token)
            if len(tokens) == OFFLOAD_TOKENS:
                break
        return tokens
    finally:
        llm.close()


def main(argv: list[str]) -> int:
    """Probe the llama_cpp importable here (ENGINE_DIR first on sys.path, if given)."""
    if argv:
        sys.path.insert(0, argv[0])
    import llama_cpp

    backends, devices = _ggml_devices()
    _emit(stage="info", version=llama_cpp.__version__,
          system_info=llama_cpp.llama_print_system_info().decode("utf-8", "replace"),
          gpu_offload=bool(llama_cpp.llama_supports_gpu_offload()),
          # older llama-cpp-python versions have no such function, nor RPC devices
          rpc=bool(getattr(llama_cpp, "llama_supports_rpc", lambda: False)()),
          backends=backends, devices=devices)
    rates = []
    with tempfile.TemporaryDirectory(prefix="localrt-probe-") as tmp:
        source = write_model(Path(tmp) / "probe-f32.gguf")
        if devices:
            _emit(stage="offload", device=devices[0]["description"])
            on_cpu, on_gpu = _greedy(llama_cpp, source, 0), _greedy(llama_cpp, source, -1)
            if on_cpu != on_gpu:
                _emit(stage="error", message=f"with all layers on {devices[0]['description']} "
                                             f"the build answers {on_gpu}, and on the CPU "
                                             f"{on_cpu}")
                return 1
        for name, ftype in QUANT_TYPES.items():
            target = Path(tmp) / f"probe-{name}.gguf"
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = ftype
            if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(),
                                              params) != 0:
                _emit(stage="error", message=f"llama.cpp could not quantize to {name}")
                return 1
            _emit(stage="decode", type=name)
            llm = llama_cpp.Llama(str(target), n_ctx=N_CTX, n_threads=1, n_gpu_layers=0,
                                  seed=1, verbose=False)
            started = time.perf_counter()
            out = llm.create_completion("hello", max_tokens=DECODE_TOKENS, temperature=0.0)
            rates.append(out["usage"]["completion_tokens"] / (time.perf_counter() - started))
            llm.close()
    _emit(stage="done", tokens_per_second=round(min(rates), 1))
    return 0



# --- the parent --------------------------------------------------------------------


def run_probe(path: str | None, hw: Hardware) -> dict:
    """Run this module as a child on a llama.cpp build (None: the one localrt ships with)."""
    cmd = [sys.executable, "-m", "localrt.engines.probe"] + ([path] if path else [])
    env = dict(os.environ)
    if path and vulkan_build(path):
        from localrt.engines.hardware import vulkan_environment

        env.update(vulkan_environment(hw, env))
    # The child must import this localrt, wherever it is installed or checked out.
    # (the folder that holds the localrt package, however deep this module sits in it)
    localrt_root = str(Path(localrt.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [localrt_root, env.get("PYTHONPATH")]))
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT,
                              env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"reason": f"the build's probe did not finish in {PROBE_TIMEOUT} s"}
    lines = []
    for line in proc.stdout.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            pass
    info = next((line for line in lines if line.get("stage") == "info"), {})
    result = {"variant": gguf_variant(info.get("system_info", ""),
                                      info.get("gpu_offload", False), hw,
                                      info.get("rpc", False), info.get("backends", ())),
              "version": info.get("version", ""), "systemInfo": info.get("system_info", ""),
              "seconds": round(time.monotonic() - started, 2)}
    if info.get("devices"):
        result["devices"] = info["devices"]
    last = lines[-1] if lines else {}
    if proc.returncode == 0 and last.get("stage") == "done":
        result["decodeTokensPerSecond"] = last.get("tokens_per_second")
        return result
    result["reason"] = _probe_failure(proc, last)
    return result


def vulkan_build(path: str) -> bool:
    """Whether the llama.cpp build in folder `path` has the Vulkan backend."""
    return (Path(path) / "llama_cpp" / "lib" / "libggml-vulkan.so").exists()


def _probe_failure(proc: subprocess.CompletedProcess, last: dict) -> str:
    where = {"decode": f"in a {last.get('type')} quantized model",
             "offload": f"with all layers on {last.get('device')}"}.get(last.get("stage"),
                                                                        "while loading")
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode)
        what = {signal.SIGILL: "illegal instruction", signal.SIGSEGV: "segmentation fault",
                signal.SIGBUS: "bus error", signal.SIGABRT: "abort"}.get(sig, sig.name)
        return f"the build crashes on this CPU: {what} ({sig.name}) {where}"
    if last.get("stage") == "error":
        return f"the build failed its probe: {last.get('message')}"
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return f"the build failed its probe {where} (exit {proc.returncode}): {tail[:300]}"


def gguf_variant(system_info: str, gpu_offload: bool, hw: Hardware,
                 rpc: bool = False, backends=()) -> str:
    """The variant name of a llama.cpp build, from llama_print_system_info() and ggml's
    backends (a Vulkan build is one with or without a device), with "+rpc" for one
    built with the RPC backend (llama_supports_rpc())."""
    if "Vulkan" in backends:
        return f"{hw.platform}-vulkan"
    return _gguf_base_variant(system_info, gpu_offload, hw) + ("+rpc" if rpc else "")


def _gguf_base_variant(system_info: str, gpu_offload: bool, hw: Hardware) -> str:
    features = set(re.findall(r"(\w+) = 1", system_info))
    if gpu_offload and "CUDA" in system_info:
        major = (hw.cuda or "12").split(".")[0]
        return f"{hw.platform}-cuda-{major}"
    if gpu_offload and "METAL" in system_info.upper():
        return f"{hw.platform}-metal"
    for level, feature in (("avx512", "AVX512"), ("avx2", "AVX2"), ("avx", "AVX")):
        if feature in features:
            return f"{hw.platform}-{level}"
    return hw.platform


def probe_key(path: str | None, version: str, hw: Hardware) -> str:
    """A build and this CPU: the llama_cpp folder, its libraries' sizes and times."""
    if path is None:
        found = importlib.util.find_spec("llama_cpp")
        folder = Path(list(found.submodule_search_locations)[0])
    else:
        folder = Path(path) / "llama_cpp"
    stamp = [str(folder), version]
    for lib in sorted((folder / "lib").glob("*.so")):
        st = lib.stat()
        stamp.append(f"{lib.name}:{st.st_size}:{st.st_mtime_ns}")
    digest = hashlib.sha256("\n".join(stamp).encode()).hexdigest()[:16]
    return f"{digest}-{hw.key()}"


class Probes:
    """The probe result of each llama.cpp build on this CPU, kept in probes.json.

    `_lock` guards `_results` (probes.json's content) and `_running` (key -> an event
    set when that build's probe ends), and nothing else: it is never held while a
    child runs. A second caller for a build being probed waits for the first one's
    result; other builds are probed meanwhile. `run` is `run_probe`, or a stand-in
    (tests pass one that answers with a result they share).
    """

    def __init__(self, root: Path, hardware: Hardware,
                 run: Callable[[str | None, Hardware], dict] | None = None):
        self._file = root / PROBES_FILE
        self._hardware = hardware
        self._run = run or run_probe
        self._lock = threading.Lock()
        self._results: dict[str, dict] = read_json(self._file, {})
        self._running: dict[str, threading.Event] = {}

    def result(self, name: str, path: str | None, version: str) -> dict:
        """The cached probe result of engine `name`'s build at `path` (None: shipped)."""
        key = probe_key(path, version, self._hardware)
        while True:
            with self._lock:
                if key in self._results:
                    return self._results[key]
                running = self._running.get(key)
                if running is None:
                    done = self._running[key] = threading.Event()
                    break
            running.wait()  # then the result is cached, or that probe raised: run it here
        try:
            result = self._run(path, self._hardware)
            with self._lock:
                self._results[key] = result
                write_json(self._file, self._results)
        finally:
            with self._lock:
                del self._running[key]
            done.set()
        if result.get("reason"):
            log.warning("%s %s failed its probe: %s", name, version, result["reason"])
        return result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
