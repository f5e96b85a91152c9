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


def test_the_need_of_each_part(huge):
    md_layers, cells = 4, HUGE_CONTEXT * 4
    assert memory.kv_bytes({"general.architecture": "llama", "llama.block_count": md_layers,
                            "llama.embedding_length": 256, "llama.attention.head_count": 4},
                           cells) == md_layers * 512 * 2 * cells
    # per-layer KV heads (some layers without attention), explicit key and value lengths,
    # and a quantized cache
    md = {"general.architecture": "x", "x.block_count": 3, "x.embedding_length": 4096,
          "x.attention.head_count": 32, "x.attention.head_count_kv": [8, 0, 8],
          "x.attention.key_length": 128, "x.attention.value_length": 64}
    assert memory.kv_bytes(md, 1000, "q8_0") == int(16 * 192 * 1000 * 34 / 32)
    # no attention heads (Mamba, RWKV): nothing grows with the context
    assert memory.kv_bytes({"general.architecture": "mamba", "mamba.block_count": 8,
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
