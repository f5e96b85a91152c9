"""The prompt cache in RAM (localrt.engines.llama.promptcache), on real llama.cpp: slot states
saved when a slot goes to another prompt, restored when their conversation comes back.
"""

from __future__ import annotations

import pytest
from emulators.ggufgen import _vocab, write_gguf
from support.models import quantize

from localrt.engines.llama.model import LlamaModel

pytestmark = pytest.mark.live

SCRIPT = [t for t in _vocab(400)[0][300:340]][:24]
SYSTEM = "You are a careful assistant. " * 6


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    source = write_gguf(root / "copy.gguf", vocab_size=400, script=SCRIPT, n_embd=128,
                        context_length=2048)
    return quantize(source, root / "copy-Q8_0.gguf", "Q8_0")


def load(path, cache: int) -> LlamaModel:
    return LlamaModel(str(path), {"ctx_len": 1024, "n_parallel": 4, "speculative": "off"},
                      prompt_cache_bytes=cache)


def turn(model, messages):
    gen = model.generate(messages, {"temperature": 0, "max_tokens": 12})
    text = "".join(gen)
    return text, gen.usage


def conversations(model, n=8, turns=3) -> list[list[dict]]:
    """`n` conversations, interleaved turn by turn: each turn's usage."""
    talks = [[{"role": "system", "content": SYSTEM},
              {"role": "user", "content": f"Conversation {i}: tell me about {i * 7}."}]
             for i in range(n)]
    usages = [[] for _ in range(n)]
    for t in range(turns):
        for i, talk in enumerate(talks):
            text, usage = turn(model, talk)
            usages[i].append(usage)
            talk += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"And then, turn {t + 2} of {i}?"}]
            if model._batcher.cache is not None:
                assert model._batcher.cache.bytes <= model._batcher.cache.limit
    return usages


def test_eight_conversations_on_four_slots_read_only_their_new_tokens(path):
    model = load(path, 4 << 20)
    try:
        usages = conversations(model)
        for talk in usages:
            for before, after in zip(talk, talk[1:]):
                # the whole of the last turn (prompt and reply) came from the cache
                assert after["cached_tokens"] >= \
                    before["prompt_tokens"] + before["completion_tokens"] - 1
        report = model.report()["promptCache"]
        assert report["hits"] >= 8 and 0 < report["bytes"] <= 4 << 20
        assert report["hitRate"] > 0
    finally:
        model.unload()


def test_without_the_ram_cache_conversations_lose_their_slots(path):
    model = load(path, 0)
    try:
        usages = conversations(model)
        lost = [after for talk in usages for before, after in zip(talk, talk[1:])
                if after["cached_tokens"] < before["prompt_tokens"]]
        assert lost  # only the shared system prompt, at best
        assert "promptCache" not in model.report()
    finally:
        model.unload()


def test_the_cache_keeps_to_its_limit_dropping_the_least_recently_used(path):
    probe = load(path, 4 << 20)
    try:
        conversations(probe, n=5, turns=1)
        one = max(s.size for s in probe._batcher.cache._states.values())
    finally:
        probe.unload()
    model = load(path, int(one * 2.5))  # room for two states
    try:
        conversations(model, n=8, turns=2)
        cache = model._batcher.cache
        assert len(cache) <= 2 and cache.bytes <= cache.limit
    finally:
        model.unload()
    assert cache.bytes == 0 and len(cache) == 0  # unloading dropped it


def test_the_status_row_reports_the_cache(app, api, path, settings):
    r = api("POST", "/v1/models/import", {"path": str(path), "id": "copy",
                                          "option": "symlink"})
    assert r.status == 200, r.body
    api("POST", "/v1/models/copy/start", {"n_parallel": 1})
    for i in range(3):
        r = api("POST", "/v1/chat/completions", {
            "model": "copy", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Number {i}"}]})
        assert r.status == 200, r.body
    row = api("GET", "/v1/models/status").json["data"][0]
    cache = row["promptCache"]
    assert cache["limit"] == 2048 << 20 and cache["states"] >= 1 and cache["lookups"] == 3


def test_a_state_with_an_image_is_restored_by_the_images_hash(tmp_path):
    from support.vision import png, write_vision_pair

    from localrt.engines.contract import Image

    model_path, mmproj = write_vision_pair(tmp_path)
    model = LlamaModel(str(model_path), {"ctx_len": 512, "n_parallel": 1,
                                         "mmproj": str(mmproj), "speculative": "off"},
                       prompt_cache_bytes=4 << 20)

    def ask(image: bytes, text: str):
        return [{"role": "user", "content": [
            {"type": "text", "text": text},
            {"type": "image", "image": Image(image, "messages[0].content[1]")}]}]

    try:
        a, b = png(64, 64, 1), png(64, 64, 2)
        first = turn(model, ask(a, "Look at this, please, and describe it."))[1]
        turn(model, ask(b, "And this other one, what does it show?"))  # takes the slot
        again = turn(model, ask(a, "Look at this, please, and describe it."))[1]
        assert again["cached_tokens"] == first["prompt_tokens"] - 1  # the image included
        other = turn(model, ask(png(64, 64, 3), "Look at this, please, and describe it."))
        assert other[1]["cached_tokens"] < first["prompt_tokens"] - 36  # not another image
    finally:
        model.unload()
