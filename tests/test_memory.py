"""No start the machine cannot hold (issue 35, item 6), and memory shown as the engine
accounts it (item 8, the CPU): a GGUF model's weights, KV cache and compute buffers are
counted from its headers before it loads (localrt.engines.memory), as llama.cpp itself
counts them, and a start that needs more than the free RAM is a 503
insufficient_memory naming the numbers, while the server and its other models go on;
GET /metrics gives each running model's bytes on the cpu."""

from __future__ import annotations

import re

import pytest
from emulators.ggufgen import write_gguf
from prometheus_client.parser import text_string_to_metric_families  # a test dependency
from support.models import add_model

from localrt.engines import memory
from localrt.engines.hardware import free_ram

pytestmark = pytest.mark.live

HUGE_CONTEXT = 1 << 24  # the most ctx_len a start takes (schemas/model-update.json)


@pytest.fixture(scope="module")
def huge(tmp_path_factory):
    """A tiny model trained, it says, on 16M tokens: its KV cache at that ctx_len and 4
    slots is 256 GiB (4 layers x 512 keys and values x 2 bytes x 64M cells)."""
    return write_gguf(tmp_path_factory.mktemp("huge") / "huge.gguf", name="huge",
                      n_embd=256, n_layer=4, n_head=4, context_length=HUGE_CONTEXT)


def test_the_estimate_is_what_llama_cpp_accounts(api, quantized):
    add_model(api, quantized["Q8_0"], "tiny", option="symlink",
              start={"ctx_len": 256, "n_parallel": 2})
    row = api("GET", "/v1/models/status").json["data"][0]
    needed = memory.need([quantized["Q8_0"]], [], {"ctx_len": 256, "n_parallel": 2})
    assert needed.kv == row["kvCache"] > 0  # llama.cpp's context: n_ctx cells
    assert needed.slots == 2 and needed.ctx_len == 256
    assert sum(needed.layers.values()) < needed.weights <= row["ram"]
    # a CPU build puts no layer on a device, whatever ngl says (its RAM holds them all)
    assert row["offload"] == {"ngl": "fit", "layers": 0, "of": len(needed.layers) + 1,
                              "devices": []} and row["vram"] == 0
    # the gauge is the status row's RAM, on the device cpu
    text = api("GET", "/metrics").body.decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "localrt_model_memory_bytes"]
    assert [(s.labels, s.value) for s in samples] == \
        [({"model": "tiny", "device": "cpu"}, row["ram"])]


def test_a_start_the_machine_cannot_hold_is_refused_and_the_rest_goes_on(api, quantized,
                                                                          huge):
    add_model(api, quantized["Q8_0"], "tiny", option="symlink", start={"ctx_len": 128})
    add_model(api, huge, "huge", option="symlink")
    r = api("POST", "/v1/models/huge/start",
            {"ctx_len": HUGE_CONTEXT, "n_parallel": 4, "cpu_threads": 1})
    assert r.status == 503 and r.json["error"]["code"] == "insufficient_memory", r.body
    message = r.json["message"]
    needs = int(re.search(r"needs about (\d+) MiB", message).group(1))
    free = int(re.search(r"has (\d+) MiB of RAM free", message).group(1))
    assert needs > 256 * 1024 > free  # MiB: its KV cache alone is 256 GiB
    assert "KV cache 262144 MiB for ctx_len 16777216 x n_parallel 4" in message
    for advice in ("ctx_len", "n_parallel", "smaller quantization", "stop another model"):
        assert advice in message
    # nothing loaded, and the other model answers
    assert [m["id"] for m in api("GET", "/v1/models/status").json["data"]] == ["tiny"]
    r = api("POST", "/v1/chat/completions", {"model": "tiny", "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "hi"}]})
    assert r.status == 200 and r.json["usage"]["completion_tokens"] > 0
    assert api("GET", "/healthz").status == 200
    # a chat that would start it with such stored parameters is refused the same way
    assert api("PATCH", "/v1/models/huge", {"ctx_len": HUGE_CONTEXT, "n_parallel": 4}).status \
        == 200
    r = api("POST", "/v1/chat/completions", {"model": "huge", "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "hi"}]})
    assert r.status == 503 and r.json["error"]["code"] == "insufficient_memory"
    # and with a context it can hold, it starts
    r = api("POST", "/v1/models/huge/start", {"ctx_len": 256, "n_parallel": 1,
                                               "cpu_threads": 1})
    assert r.status == 200, r.body


def kv_bytes(md: dict, cells: int, cache_type: str = "f16") -> int:
    """The whole KV cache of `cells` tokens, as memory.need sums it."""
    return sum(k + v for k, v in memory.kv_tensors(md, cells, cache_type))


def test_the_need_of_each_part(huge):
    md_layers, cells = 4, HUGE_CONTEXT * 4
    assert kv_bytes({"general.architecture": "llama", "llama.block_count": md_layers,
                     "llama.embedding_length": 256, "llama.attention.head_count": 4},
                    cells) == md_layers * 512 * 2 * cells
    # per-layer KV heads (some layers without attention), explicit key and value lengths,
    # and a quantized cache
    md = {"general.architecture": "x", "x.block_count": 3, "x.embedding_length": 4096,
          "x.attention.head_count": 32, "x.attention.head_count_kv": [8, 0, 8],
          "x.attention.key_length": 128, "x.attention.value_length": 64}
    assert kv_bytes(md, 1000, "q8_0") == int(16 * 192 * 1000 * 34 / 32)
    # no attention heads (Mamba, RWKV): nothing grows with the context
    assert kv_bytes({"general.architecture": "mamba", "mamba.block_count": 8,
                     "mamba.attention.head_count": 0}, 10 ** 6) == 0
    # with flash attention the scores are never materialized, only an f16 mask
    need = memory.need([huge], [], {"ctx_len": 4096, "n_parallel": 1})
    fast = memory.need([huge], [], {"ctx_len": 4096, "n_parallel": 1, "flash_attn": True})
    assert need.compute - fast.compute == 4096 * 512 * (4 * 5 - 2)
    # an embedding start has one sequence
    assert memory.need([huge], [], {"ctx_len": 4096, "n_parallel": 4,
                                    "embedding": True}).slots == 1
    # a split model is read from every part
    assert memory.parts_of(huge.with_name("m-00001-of-00003.gguf")) == [
        huge.with_name(f"m-0000{i}-of-00003.gguf") for i in (1, 2, 3)]
    assert free_ram() > 0


# --- item 5: fit, and item 8: the bytes as llama.cpp accounts them ---------------------

LAVAPIPE = {"name": "llvmpipe (LLVM 15.0.6, 256 bits)", "backend": "vulkan", "type": "cpu",
            "free": 2048 * memory.MIB}


def test_the_per_layer_need_is_what_llama_cpp_allocates(quantized):
    """Each block's weights and KV, and the output layer, summed, are the bytes of the
    model and KV buffers llama.cpp logs as it loads the model (to the log's 0.01 MiB)."""
    import llama_cpp
    from llama_cpp import _internals

    from localrt.engines.llama import offload
    from localrt.engines.llama.params import context_params, model_params

    path = quantized["Q8_0"]
    options = {"ctx_len": 256, "n_parallel": 2}
    needed = memory.need([path], [], options)
    with offload.capture(llama_cpp) as lines:
        model = _internals.LlamaModel(path_model=str(path), verbose=False,
                                      params=model_params(llama_cpp, {}))
        ctx = llama_cpp.llama_init_from_model(
            model.model, context_params(llama_cpp, options, 512, 2))
    try:
        placement = offload.read(offload.text_of(lines))
        assert llama_cpp.llama_model_size(model.model) == needed.weights
        n_layer = llama_cpp.llama_model_n_layer(model.model)
    finally:
        llama_cpp.llama_free(ctx)
        model.close()
    model_bytes = sum(b for kind, _, b in placement.buffers if kind == "model")
    assert abs(model_bytes - needed.weights) <= 0.01 * memory.MIB, placement
    assert abs(placement.kv() - needed.kv) <= 0.01 * memory.MIB
    assert len(needed.kv_layers) == n_layer == len(needed.layers)
    assert sum(needed.kv_layers) == needed.kv and len(set(needed.kv_layers)) == 1
    # the output layer: output.weight (or a tied token_embd) and output_norm
    assert 0 < needed.output < needed.weights - sum(needed.layers.values())
    # a CPU build offloads nothing: no "offloaded" line, every buffer on the host
    assert placement.layers is None and placement.on_devices() == 0
    assert placement.devices() == {} and placement.host() > needed.weights


def test_fit_counts_layers_from_the_output_down(quantized):
    needed = memory.need([quantized["Q8_0"]], [], {"ctx_len": 256, "n_parallel": 2})
    n_layer = len(needed.kv_layers)
    per_block = [needed.layers[i] + needed.kv_layers[i] for i in range(n_layer)]
    everything = needed.output + sum(per_block) + needed.compute
    overhead = 512 * memory.MIB
    # room for all
    roomy = dict(LAVAPIPE, free=everything + overhead)
    assert memory.fit(needed, [roomy], overhead).ngl == n_layer + 1
    assert memory.fit(needed, [roomy], overhead).of == n_layer + 1
    # one byte short: the first block stays on the CPU
    short = dict(LAVAPIPE, free=everything + overhead - 1)
    assert memory.fit(needed, [short], overhead).ngl == n_layer
    # the compute buffer and the output layer only: 1 (llama.cpp's ngl 1 is the output)
    output_only = dict(LAVAPIPE, free=needed.compute + needed.output + overhead)
    assert memory.fit(needed, [output_only], overhead).ngl == 1
    # gpuOverheadMiB leaves too little: nothing
    assert memory.fit(needed, [roomy], everything + overhead).ngl == 0
    assert memory.fit(needed, [], overhead).ngl == 0
    # two devices: their room together, less a compute buffer on each
    half = dict(LAVAPIPE, free=(everything + needed.compute) // 2 + overhead + 1)
    assert memory.fit(needed, [half, half], overhead).ngl == n_layer + 1


def test_fit_takes_fewer_layers_when_the_kv_cache_needs_more_than_the_heap(huge):
    """Debian 12's lavapipe has a 2 GiB heap: at ctx_len 2**19 the tiny model's KV cache
    is 2 GiB (512 MiB a layer) and its compute buffer over 512 MiB, so the output layer
    and two blocks fit, not four."""
    needed = memory.need([huge], [], {"ctx_len": 1 << 19, "n_parallel": 1,
                                      "flash_attn": True})
    assert needed.kv_layers == (1 << 29,) * 4 and needed.compute > 1 << 29
    decided = memory.fit(needed, [LAVAPIPE], 0)
    assert decided.ngl == 3 and decided.of == 5
    # at a context the heap holds, all of them; with a gpuOverheadMiB that leaves room for
    # the compute buffer and the output layer only, 1; leaving less, none
    small = memory.need([huge], [], {"ctx_len": 4096, "n_parallel": 1, "flash_attn": True})
    assert memory.fit(small, [LAVAPIPE], 512 * memory.MIB).ngl == 5
    left = small.compute + small.output
    assert memory.fit(small, [LAVAPIPE], LAVAPIPE["free"] - left).ngl == 1
    assert memory.fit(small, [LAVAPIPE], LAVAPIPE["free"] - left + 1).ngl == 0


def test_the_devices_a_build_offloads_to():
    nvidia = {"id": "0", "name": "NVIDIA H100", "backend": "cuda", "type": "discrete",
              "free": 1}
    radeon = {"id": "1", "name": "AMD Radeon", "backend": "vulkan", "type": "discrete",
              "free": 1}
    assert memory.offload_devices([nvidia, LAVAPIPE], "vulkan") == [LAVAPIPE]
    assert memory.offload_devices([radeon, LAVAPIPE], "vulkan") == [radeon]
    assert memory.offload_devices([nvidia, LAVAPIPE], "cuda") == [nvidia]
    assert memory.offload_devices([LAVAPIPE], "cuda") == []
    # an NVIDIA GPU the Vulkan loader lists too (gpus.merged keeps that entry as its
    # twin): a Vulkan build's device, not lavapipe, with NVML's free memory
    twin = {"id": "1", "name": "NVIDIA H100 80GB HBM3", "backend": "vulkan",
            "type": "discrete", "free": 5, "total": 9, "maxBuffer": 1 << 32}
    both = dict(nvidia, vulkan=twin, total=8)
    assert memory.offload_devices([both, LAVAPIPE], "vulkan") == \
        [dict(twin, free=1, total=8)]
    assert memory.offload_devices([both, LAVAPIPE], "cuda") == [both]


def test_a_vulkan_build_on_an_nvidia_gpu_fits_against_it(huge):
    """The GPU /v1/hardware lists once, as cuda: a Vulkan build's fit gets its free
    memory from NVML and its buffer limit from the Vulkan loader (Fit's room), where
    before it fit against lavapipe's 2 GiB, or nothing."""
    from localrt.engines import gpus

    nvml = {"id": "0", "name": "NVIDIA H100 80GB HBM3", "backend": "cuda",
            "type": "discrete", "total": 80 << 30, "free": 70 << 30, "version": "12.4",
            "driver": "550.54.15", "computeCap": "9.0",
            "uuid": "GPU-5f3b9a2c-1d4e-4f60-8a7b-9c0d1e2f3a4b"}
    vulkan = {"id": "1", "name": "NVIDIA H100 80GB HBM3", "backend": "vulkan",
              "type": "discrete", "total": 80 << 30, "free": 60 << 30,
              "version": "1.3.280", "driver": "550.54.15", "computeCap": "",
              "uuid": "5f3b9a2c-1d4e-4f60-8a7b-9c0d1e2f3a4b", "maxBuffer": 128 * memory.MIB}
    lavapipe = dict(LAVAPIPE, id="0", uuid="6d657361-3232-2e33-2e36-000000000000",
                    total=LAVAPIPE["free"], maxBuffer=1 << 30)
    listed = gpus.merged([nvml], [lavapipe, vulkan])
    devices = memory.offload_devices(listed, "vulkan")
    assert [(d["name"], d["free"], d["maxBuffer"]) for d in devices] == \
        [("NVIDIA H100 80GB HBM3", 70 << 30, 128 * memory.MIB)]
    # 2**19 cells make each K and V tensor 256 MiB: over the GPU's 128 MiB as Vulkan
    # gives it, so the output layer alone, and the room is NVML's 70 GiB
    options = {"ctx_len": 1 << 19, "n_parallel": 1, "flash_attn": True}
    needed = memory.need([huge], [], options)
    decided = memory.fit(needed, devices, 512 * memory.MIB)
    assert decided.ngl == 1 and decided.over.tensor == "K cache"
    assert decided.room == (70 << 30) - 512 * memory.MIB - needed.compute
    # at 2**18 cells every layer fits under the limit and in the memory
    small = memory.need([huge], [], {**options, "ctx_len": 1 << 18})
    assert memory.fit(small, devices, 512 * memory.MIB).ngl == 5


def test_llama_cpp_s_log_read():
    from localrt.engines.llama import offload

    text = ("load_tensors: offloading output layer to GPU\n"
            "load_tensors: offloaded 3/5 layers to GPU\n"
            "load_tensors:   CPU_Mapped model buffer size =     4.25 MiB\n"
            "load_tensors:      Vulkan0 model buffer size =    12.50 MiB\n"
            "llama_kv_cache:        CPU KV buffer size =    16.00 MiB\n"
            "llama_kv_cache:    Vulkan0 KV buffer size =    48.00 MiB\n"
            "llama_context:        CPU  output buffer size =     0.12 MiB\n"
            "llama_context:    Vulkan0 compute buffer size =    20.02 MiB\n"
            "llama_context: Vulkan_Host compute buffer size =     1.00 MiB\n")
    placement = offload.read(text)
    assert (placement.layers, placement.of, placement.on_devices()) == (3, 5, 3)
    assert placement.devices() == {"Vulkan0": round((12.5 + 48 + 20.02) * memory.MIB)}
    assert placement.host() == round((4.25 + 16 + 0.12 + 1) * memory.MIB)
    assert placement.kv() == 64 * memory.MIB
    # a GPU build whose backend found no device says "offloaded" but has no device buffer
    assert offload.read("load_tensors: offloaded 5/5 layers to GPU\n"
                        "load_tensors: CPU model buffer size = 1.00 MiB\n").on_devices() == 0


# --- a tensor over a device's buffer limit (ggml's Vulkan backend aborts on one) ---------

LIMITED = dict(LAVAPIPE, maxBuffer=128 * memory.MIB)  # Debian 12's lavapipe


def test_fit_stops_before_a_layer_with_a_tensor_over_the_buffer_limit(huge):
    """At ctx_len 2**19 each of `huge`'s K and V tensors is 256 MiB (256 keys x 2 bytes
    x 2**19 cells), over lavapipe's 128 MiB: fit puts the output layer alone on it,
    though the heap would hold more; at 2**18 (128 MiB, the limit itself) as many as
    the heap holds."""
    options = {"ctx_len": 1 << 19, "n_parallel": 1, "flash_attn": True}
    needed = memory.need([huge], [], options)
    assert needed.largest[3] == ("K cache", 256 * memory.MIB)
    over = memory.oversize(needed, LIMITED["maxBuffer"])
    assert (over.layer, over.tensor, over.bytes, over.fits) == \
        ("block 3", "K cache", 256 * memory.MIB, 1)
    roomy = dict(LIMITED, free=64 << 30)
    decided = memory.fit(needed, [roomy], 0)
    assert decided.ngl == 1 and decided.over == over
    assert memory.fit(needed, [dict(roomy, maxBuffer=None)], 0).ngl == 5  # CUDA: no limit
    # the heap, not the limit, decides where it comes first
    assert memory.fit(needed, [dict(LIMITED, free=needed.compute)], 0) == \
        memory.Fit(0, 5, 0, decided.needs, None)
    # slots multiply the cells: 2**18 x 2 slots is as large as 2**19 x 1
    two = memory.need([huge], [], {**options, "ctx_len": 1 << 18, "n_parallel": 2})
    assert memory.fit(two, [roomy], 0).ngl == 1
    at_limit = memory.need([huge], [], {**options, "ctx_len": 1 << 18})
    assert memory.oversize(at_limit, LIMITED["maxBuffer"]) is None
    assert memory.fit(at_limit, [roomy], 0).ngl == 5
    # a quantized cache is smaller, q8_0's 34 bytes a 32 values, yet still over here
    q8 = memory.need([huge], [], {**options, "cache_type": "q8_0"})
    assert q8.largest[0] == ("K cache", 128 * memory.MIB * 34 // 32)
    assert memory.fit(q8, [roomy], 0).ngl == 1
    # llama.cpp rounds the context, then each slot's share, up to 256 cells
    assert [memory.kv_cells(c, n) for c, n in ((256, 1), (300, 1), (300, 3), (100, 4))] \
        == [256, 512, 1536, 1024]
    odd = memory.need([huge], [], {**options, "ctx_len": (1 << 18) - 100})
    assert odd.largest[0] == ("K cache", 128 * memory.MIB)
    assert memory.oversize(memory.need([huge], [], {**options, "ctx_len": (1 << 18) + 1}),
                           LIMITED["maxBuffer"]).bytes == 128 * memory.MIB + 256 * 512
    # several devices: the smallest limit holds
    assert memory.buffer_limit([roomy, dict(roomy, maxBuffer=1 << 30),
                                {"name": "cuda", "free": 1}]) == 128 * memory.MIB
    assert memory.buffer_limit([{"name": "cuda", "free": 1}]) is None


def test_an_output_matrix_over_the_buffer_limit_holds_back_no_block(tmp_path):
    """A wide vocabulary's output matrix (4096 x 256 floats, 4 MiB) over the limit stays
    in RAM (llama.cpp's loader keeps a weight the device turns down on the CPU) and has
    no KV cache: every block still goes, though llama.cpp offloads the output layer
    first. A block's weight over the limit stops fit at that block, as its K cache
    would."""
    from localrt.errors import BadRequest

    wide = write_gguf(tmp_path / "wide.gguf", name="wide", n_embd=256, n_layer=2,
                      n_head=4, n_ff=512, vocab_size=4096, context_length=4096)
    needed = memory.need([wide], [], {"ctx_len": 256, "n_parallel": 1})
    _, sizes = memory.tensor_bytes(wide)
    size = sizes.get("output.weight", sizes["token_embd.weight"])
    assert size == 4096 * 256 * 4 and size <= needed.output
    name, block = needed.largest[1]
    assert name.startswith("blk.1.") and block < size
    roomy = dict(LAVAPIPE, free=64 << 30)
    under_output = dict(roomy, maxBuffer=size - 1)
    assert memory.oversize(needed, size - 1) is None
    decided = memory.fit(needed, [under_output], 0)
    assert (decided.ngl, decided.of, decided.over) == (3, 3, None)
    memory.check_buffers("m", needed, -1, [under_output])  # all of it: no 400
    # the output layer still counts whole on the device (the safe side): one byte short
    # of it and the blocks keeps the first block on the CPU
    tight = dict(under_output, free=decided.needs - 1)
    assert memory.fit(needed, [tight], 0).ngl == 2
    # a block's weight over the limit: the output layer alone, and an ngl past it is a
    # 400 naming ngl (no ctx_len would help)
    under_block = dict(roomy, maxBuffer=block - 1)
    decided = memory.fit(needed, [under_block], 0)
    assert decided.ngl == 1
    assert (decided.over.layer, decided.over.tensor, decided.over.fits) == \
        ("block 1", name, 1)
    with pytest.raises(BadRequest) as caught:
        memory.check_buffers("m", needed, 2, [under_block])
    message = str(caught.value)
    assert caught.value.param == "ngl" and "ngl 1 or less" in message
    assert "the block 1 layer" in message and "ctx_len" not in message


def test_an_explicit_ngl_over_the_buffer_limit_is_a_400_naming_what_to_change(huge):
    from localrt.errors import BadRequest

    options = {"ctx_len": 1 << 19, "n_parallel": 1, "flash_attn": True}
    needed = memory.need([huge], [], options)
    for ngl in (0, 1):  # all on the CPU, or the output layer alone: nothing over it
        memory.check_buffers("m", needed, ngl, [LIMITED])
    memory.check_buffers("m", needed, -1, [dict(LIMITED, maxBuffer=None)])  # CUDA
    for ngl, shown in ((2, "2"), (-1, "all"), (99, "all")):
        with pytest.raises(BadRequest) as caught:
            memory.check_buffers("m", needed, ngl, [LIMITED])
        error = caught.value
        assert error.status == 400 and error.param == "ctx_len", error
        message = str(error)
        assert f"ngl {shown}" in message and "block 3" in message
        assert LAVAPIPE["name"] in message
        assert "K cache (ctx_len 524288 x n_parallel 1, cache_type f16) is 256 MiB" in message
        assert "over the 128 MiB" in message
        assert "ctx_len 262144 or less" in message and "ngl 1 or less" in message
