"""What a GGUF model needs in memory before it loads, and the refusal of a start this
machine cannot hold (issue 35).

A model whose weights, KV cache and compute buffers do not fit in memory is not
refused by llama.cpp: its allocations succeed on overcommitted memory, and the kernel's
out-of-memory killer ends the server later, with every other model in it. So before a
GGUF model loads (localrt.inference.scheduler), `need` counts, from its files' headers
alone (localrt.engines.ggufinfo: never the tensor data):

  * weights: each tensor's bytes in the GGUF's tensor table (its ggml type's block size
    times its blocks, localrt.engines.ggufcheck.tensor_nbytes), every part of a split
    file, plus the files loaded beside it (a projector) as they are on disk; `layers`
    keeps each block's (blk.N.*) share, for what offloads layer by layer;
  * the KV cache: keys and values of every layer for every token of every slot,
    ctx_len x n_parallel cells (one slot in llama.cpp's embedding mode; `kv_cells`
    rounds them up to 256 a slot, as llama.cpp does), each value of
    the cache_type's size (f16 by default). Per layer, its KV heads
    (`<arch>.attention.head_count_kv`, a number or one per layer) times
    `<arch>.attention.key_length` + `value_length` (n_embd / n_head when the header says
    none). Sliding-window layers count in full, as llama.cpp allocates them (its
    context's swa_full is on); a model without attention heads (Mamba, RWKV) has none;
  * the compute buffers, the allowance documented here and in localrt-api(7): without
    flash attention, llama.cpp reserves one batch's attention scores and mask, ctx_len
    x n_ubatch x (n_head + 1) floats; with it, an f16 mask of ctx_len x n_ubatch; plus
    one batch's logits (n_ubatch x n_vocab floats) and COMPUTE_BASE for the rest. This
    is what llama.cpp's `sched_reserve` logs on the CPU for the tiny test models, to a
    few MiB.

`fit` decides, for a GPU build started without `ngl`, how many layers its devices
hold: the output layer first and then the blocks from the last one down (llama.cpp's
order), each with its weights and its KV cache, while each device keeps the setting
gpuOverheadMiB free and room for a compute buffer (the allowance above); the rest stays
on the CPU, as Ollama's estimate does. A device of type cpu (lavapipe) counts here:
layers on it run through the GPU backend, in RAM.

No block goes to a device with a tensor over the most one buffer there may hold
(`oversize`; a Vulkan device's maxBuffer, from localrt.engines.gpus: 128 MiB on
Debian 12's lavapipe): a weight, or the layer's K or V cache tensor, which holds every
cell of every slot (ctx_len x n_parallel at the cache_type's size). ggml's Vulkan
backend cannot run an operation on such a tensor; a weight it would keep on the CPU,
but the KV cache is allocated on the device regardless, and the first graph aborts the
whole server ("pre-allocated tensor in a buffer that cannot run the operation"). So fit
stops before such a block, and `check_buffers` refuses an explicit ngl that reaches it
with a 400 naming the limit and the ngl or ctx_len that would do. The output layer has
no KV cache: a large vocabulary's output matrix over the limit stays in RAM, and the
blocks behind it still go. CUDA devices have no such limit.

The devices are those the build's backend sees (`offload_devices`,
localrt.engines.gpus.backend_devices): a Vulkan build on an NVIDIA GPU fits against
that GPU, with NVML's free memory and the Vulkan loader's maxBuffer.

`check` compares the sum with the RAM free now (/proc/meminfo's MemAvailable), plus the
free memory of the GPUs a GPU build offloads to (a device of type cpu, such as
lavapipe, adds nothing: its memory is the RAM), and refuses with 503
insufficient_memory, naming the numbers in MiB and what to change. A model started
with rpc_servers is not checked: its layers go to other machines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from localrt.engines import ggufinfo
from localrt.engines.ggufcheck import tensor_nbytes
from localrt.engines.gpus import backend_devices
from localrt.engines.llama.params import CACHE_TYPE_BYTES
from localrt.errors import BadRequest, InsufficientMemory

MIB = 1 << 20
COMPUTE_BASE = 64 * MIB  # activations and the graph's own bookkeeping, beyond the terms above
UBATCH = 512             # llama.cpp's most tokens in one micro-batch (localrt's n_ubatch)
CELL_PAD = 256           # llama.cpp rounds a context up to this many cells (llama_context)
_BLOCK = re.compile(r"blk\.(\d+)\.")
_SPLIT = re.compile(r"(.*)-00001-of-(\d{5})\.gguf", re.IGNORECASE)  # llama.cpp's split names


@dataclass(frozen=True)
class Need:
    """Bytes a model needs: its weights (`layers`: each block's part of them), its KV
    cache and its compute buffers, and what they were counted for."""

    weights: int
    kv: int
    compute: int
    ctx_len: int
    slots: int
    layers: dict = field(default_factory=dict)
    kv_layers: tuple = ()  # each block's part of `kv`, in order
    output: int = 0        # the output layer's weights (output.*, or a tied token_embd)
    largest: dict = field(default_factory=dict)  # block -> (its largest tensor, bytes)
    cache_type: str = "f16"

    @property
    def total(self) -> int:
        """All of it."""
        return self.weights + self.kv + self.compute


def tensor_bytes(path) -> tuple[dict, dict]:
    """(the GGUF's header key/values, {tensor name: bytes of its data})."""
    md, infos = ggufinfo.read_tensor_infos(path)
    sizes = {}
    for name, (dims, ggml_type) in infos.items():
        try:
            sizes[name] = tensor_nbytes(name, dims, ggml_type)
        except ValueError as exc:
            raise ggufinfo.GGUFError(f"{path}: {exc}") from None
    return md, sizes


def kv_tensors(md: dict, cells: int, cache_type: str = "f16") -> list[tuple[int, int]]:
    """Each block's K and V cache tensors' bytes for `cells` tokens: llama.cpp makes one
    of each a layer, for all the slots' cells (none without attention heads)."""
    arch = md.get("general.architecture", "")
    layers = _number(md.get(f"{arch}.block_count"))
    heads = md.get(f"{arch}.attention.head_count")
    head_count = max(heads) if isinstance(heads, list) and heads else _number(heads)
    if not layers or not head_count:
        return []  # no attention (Mamba, RWKV): its state does not grow with the context
    kv_heads = md.get(f"{arch}.attention.head_count_kv", heads)
    per_layer = kv_heads if isinstance(kv_heads, list) else [_number(kv_heads)] * layers
    head = _number(md.get(f"{arch}.embedding_length")) // head_count
    keys = _number(md.get(f"{arch}.attention.key_length"), head)
    values = _number(md.get(f"{arch}.attention.value_length"), head)
    value = CACHE_TYPE_BYTES.get(cache_type or "f16", 2)
    return [(int(_number(h) * keys * cells * value), int(_number(h) * values * cells * value))
            for h in per_layer[:layers]]


def kv_cells(ctx_len: int, slots: int) -> int:
    """The KV cells llama.cpp makes for `slots` sequences of ctx_len: it rounds the
    context (ctx_len x slots), then each sequence's share, up to 256 cells."""
    pad = CELL_PAD
    share = -(-(-(-ctx_len * slots // pad) * pad) // max(slots, 1)) if ctx_len else 0
    return -(-share // pad) * pad * slots


def compute_bytes(md: dict, ctx_len: int, slots: int, options: dict) -> int:
    """The compute buffers' allowance (see the module's docstring)."""
    arch = md.get("general.architecture", "")
    heads = md.get(f"{arch}.attention.head_count")
    head_count = max(heads) if isinstance(heads, list) and heads else _number(heads)
    ubatch = min(max(options.get("n_batch") or UBATCH, slots), UBATCH)
    scores = ctx_len * ubatch * (2 if options.get("flash_attn") else 4 * (head_count + 1))
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = tokens.count if isinstance(tokens, ggufinfo.ArrayInfo) else \
        len(tokens) if isinstance(tokens, list) else _number(md.get(f"{arch}.vocab_size"))
    return COMPUTE_BASE + scores + ubatch * vocab * 4


def parts_of(weights: Path) -> list[Path]:
    """The files of a GGUF model: a split one's parts (<name>-00001-of-0000N.gguf and the
    others beside it, as llama.cpp finds them), else the file alone."""
    found = _SPLIT.fullmatch(weights.name)
    if not found:
        return [weights]
    count = int(found.group(2))
    return [weights.with_name(f"{found.group(1)}-{i:05d}-of-{count:05d}.gguf")
            for i in range(1, count + 1)]


def need(parts: list[Path], beside: list[Path], options: dict) -> Need:
    """What a model whose weights are the GGUF `parts` (a split file's parts in order)
    and files `beside` them needs with the start `options`. GGUFError for a header it
    cannot read."""
    md, weights, layers, output, names, largest = {}, 0, {}, 0, {}, {}
    for i, part in enumerate(parts):
        part_md, sizes = tensor_bytes(part)
        if i == 0:
            md = part_md
        names.update(sizes)
        for name, size in sizes.items():
            weights += size
            found = _BLOCK.match(name)
            if found:
                block = int(found.group(1))
                layers[block] = layers.get(block, 0) + size
                largest[block] = max(largest.get(block, ("", 0)), (name, size),
                                     key=lambda t: t[1])
            elif name.startswith(("output.", "output_norm.")):
                output += size
    if "output.weight" not in names:  # tied: llama.cpp copies token_embd to the output's device
        output += names.get("token_embd.weight", 0)
    weights += sum(p.stat().st_size for p in beside)
    embedding = bool(options.get("embedding")) or ggufinfo.is_embedding(md)
    slots = 1 if embedding else max(int(options.get("n_parallel") or 1), 1)
    trained = _number(md.get(f"{md.get('general.architecture', '')}.context_length"))
    ctx_len = int(options.get("ctx_len") or trained or 0)
    cache_type = options.get("cache_type") or "f16"
    caches = kv_tensors(md, kv_cells(ctx_len, slots), cache_type)
    for block, (k, v) in enumerate(caches):
        largest[block] = max(largest.get(block, ("", 0)), ("K cache", k), ("V cache", v),
                             key=lambda t: t[1])
    kv = [k + v for k, v in caches]
    return Need(weights, sum(kv), compute_bytes(md, ctx_len, slots, options), ctx_len,
                slots, layers, tuple(kv), output, largest, cache_type)


def offload_devices(gpus: list[dict], backend: str) -> list[dict]:
    """The devices of `gpus` (localrt.engines.gpus' dicts) that a build of `backend`
    (cuda, vulkan) puts layers on, as ggml picks them and as that backend sees them
    (gpus.backend_devices: a Vulkan build's NVIDIA GPU with the Vulkan loader's name and
    maxBuffer, and NVML's free memory): its GPUs, or where it has none but CPU devices
    (lavapipe, which ggml's Vulkan backend takes only when told to), those."""
    mine = backend_devices(gpus, backend)
    real = [g for g in mine if g.get("type") != "cpu"]
    return real or mine


def buffer_limit(devices: list[dict]) -> int | None:
    """The most bytes one tensor may have on every one of `devices` (the smallest of
    their maxBuffer, localrt.engines.gpus); None where none has a limit (CUDA)."""
    limits = [int(d["maxBuffer"]) for d in devices if d.get("maxBuffer")]
    return min(limits) if limits else None


@dataclass(frozen=True)
class Oversize:
    """The first block, in llama.cpp's order of offloading, with a tensor over a
    device's buffer limit: `layer` ("block N"), its tensor (a weight's name, or
    "K cache" / "V cache") of `bytes`, and `fits`, the most layers (ngl) offloaded
    before it, the output layer's included."""

    layer: str
    tensor: str
    bytes: int
    limit: int
    fits: int


def blocks_of(needed: Need) -> int:
    """The model's blocks (llama.cpp's n_layer)."""
    return max(len(needed.kv_layers), max(needed.layers, default=-1) + 1)


def oversize(needed: Need, limit: int | None) -> Oversize | None:
    """The first block llama.cpp would offload (after the output layer, the blocks from
    the last one down) whose largest tensor, a weight or its K or V cache, is over
    `limit` bytes; None when none is (or there is no limit). ggml's Vulkan backend
    cannot run an operation on such a tensor: a weight it keeps on the CPU, but the KV
    cache is allocated on the device, and ggml aborts the process at the first graph.
    The output layer is never the one: it is weights alone, and an output matrix over
    the limit (a large vocabulary's) stays in RAM by llama.cpp's own choice (its loader
    asks the device's supports_op, which turns the tensor down), so it holds back no
    block behind it; ngl cannot skip the output layer, which llama.cpp offloads first."""
    if limit is None:
        return None
    order = [(f"block {i}", needed.largest.get(i, ("", 0)))
             for i in reversed(range(blocks_of(needed)))]
    for position, (layer, (tensor, size)) in enumerate(order, start=1):
        if size > limit:
            return Oversize(layer, tensor, size, limit, position)
    return None


@dataclass(frozen=True)
class Fit:
    """What `fit` decided: `ngl` layers of `of` (the blocks and the output layer, as
    llama.cpp counts them) on devices with `room` bytes for them, `needs` bytes for all,
    and `over`, the layer with a tensor over the devices' buffer limit that stopped it
    (None: memory alone decided)."""

    ngl: int
    of: int
    room: int
    needs: int
    over: Oversize | None = None


def fit(needed: Need, devices: list[dict], overhead: int) -> Fit:
    """As many of a model's layers as the `devices` (each with its `free` bytes) hold,
    leaving `overhead` bytes free on each, and a compute buffer on each (the allowance
    of `compute_bytes`). llama.cpp offloads the output layer first, then the blocks from
    the last one down; a block costs its weights and its part of the KV cache (the KV of
    an offloaded layer lives on its device, llama.cpp's offload_kqv). No block with a
    tensor over the devices' buffer limit (`oversize`) goes, nor any after it; the
    output layer is counted whole even where its matrix is over the limit and stays in
    RAM (where ggml indexes in 64 bits it may not: the device is never under-counted)."""
    blocks = blocks_of(needed)
    costs = [needed.output] + [needed.layers.get(i, 0) + (
        needed.kv_layers[i] if i < len(needed.kv_layers) else 0)
        for i in reversed(range(blocks))]
    room = sum(max(int(d.get("free") or 0) - overhead, 0) for d in devices)
    room -= needed.compute * len(devices)
    over = oversize(needed, buffer_limit(devices))
    left, ngl = room, 0
    for cost in costs[:over.fits if over else None]:
        if cost > left:
            break
        left -= cost
        ngl += 1
    return Fit(ngl, blocks + 1, max(room, 0), sum(costs) + needed.compute,
               over if over and ngl == over.fits else None)


def check_buffers(model_id: str, needed: Need, ngl: int, devices: list[dict]) -> None:
    """A 400 for a start whose `ngl` (-1: all) puts on `devices` a block with a tensor
    over their buffer limit (`oversize`), naming the limit in MiB and the ngl, ctx_len
    or both that would do; nothing for ngl 0 or 1 (the output layer alone) or devices
    without a limit."""
    over = oversize(needed, buffer_limit(devices))
    of = blocks_of(needed) + 1
    if over is None or not ngl or 0 <= ngl <= over.fits:
        return
    names = ", ".join(d["name"] for d in devices)
    lower = f"ngl {over.fits} or less"  # at least the output layer, never over the limit
    what = f"its tensor {over.tensor}"
    if over.tensor.endswith("cache"):
        # The K and V tensors grow with the cells, ctx_len x n_parallel, which llama.cpp
        # rounds up to 256 a sequence (kv_cells): a multiple of 256 is exact.
        cells = kv_cells(needed.ctx_len, needed.slots)
        ctx_len = over.limit * cells // over.bytes // needed.slots // CELL_PAD * CELL_PAD
        what = (f"its {over.tensor} (ctx_len {needed.ctx_len} x n_parallel {needed.slots}, "
                f"cache_type {needed.cache_type})")
        change = (f"start it with ctx_len {ctx_len} or less" if ctx_len else
                  "start it") + f", a smaller n_parallel, a quantized cache_type, or {lower}"
        param = "ctx_len"
    else:
        change, param = f"start it with {lower}", "ngl"
    shown = "all" if ngl < 0 or ngl >= of else ngl
    raise BadRequest(
        f"Model {model_id} cannot start with ngl {shown}: it puts the {over.layer} layer "
        f"on {names}, and {what} is {_mib(over.bytes)} MiB, over the {over.limit >> 20} "
        f"MiB that device allows one tensor (its largest buffer); {change}", param=param)


def check(model_id: str, needed: Need, ram_free: int, device_free: int = 0,
          devices: str = "") -> None:
    """Raise InsufficientMemory (503) unless `needed` fits in `ram_free` plus
    `device_free` (the free memory of the GPUs the build offloads to, named `devices`)."""
    free = ram_free + device_free
    if needed.total <= free:
        return
    where = f"{_mib(ram_free)} MiB of RAM free" + \
        (f" and {_mib(device_free)} MiB on {devices}" if device_free else "")
    raise InsufficientMemory(
        f"Model {model_id} needs about {_mib(needed.total)} MiB (weights "
        f"{_mib(needed.weights)} MiB, KV cache {_mib(needed.kv)} MiB for ctx_len "
        f"{needed.ctx_len} x n_parallel {needed.slots}, compute buffers "
        f"{_mib(needed.compute)} MiB), and this machine has {where}; start it with a "
        f"smaller ctx_len or n_parallel, use a smaller quantization of it, or stop "
        f"another model (localrt ps lists them)", param="model")


def _mib(n: int) -> int:
    return -(-n // MIB)


def _number(value, default: int = 0) -> int:
    """A header value as a count (`default` when it is missing or not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    return int(value)
