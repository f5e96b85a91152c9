"""POST /v1/completions through the WSGI app, on real llama.cpp.

The models are tests/emulators/ggufgen.py's tiny random llama (quantized by llama.cpp, the
`quantized` fixture) and the same llama with Qwen 2.5 Coder's fill-in-the-middle tokens
in its vocabulary. Their end-of-sequence token is id 2, so `"logit_bias": {"2": -100}`
makes a reply run to max_tokens. Random weights make gibberish: the tests check shapes,
counts, and that greedy decoding (and sampling with a seed) gives the same text every
time, so one request's text can be compared with another's.
"""

from __future__ import annotations

import pytest
from emulators.ggufgen import FIM_TOKENS, write_gguf
from support.apps import events
from support.models import NO_EOS, add_model, tokens_of

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def fim_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("fim") / "fim.gguf", added_tokens=FIM_TOKENS)


START = {"ctx_len": 256}


@pytest.fixture
def tiny_start():
    """conftest's `tiny`, running with a 256-token context."""
    return START


@pytest.fixture
def fim(api, fim_gguf):
    return add_model(api, fim_gguf, "fim", start=START)


def complete(api, **body):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "logit_bias": NO_EOS, **body}
    r = api("POST", "/v1/completions", body)
    assert r.status == 200, r.body
    return r.json


def test_a_completion_in_openai_shape(api, tiny, quantized):
    reply = complete(api)
    assert reply["object"] == "text_completion" and reply["id"].startswith("cmpl-")
    assert reply["model"] == "tiny" and isinstance(reply["created"], int)
    choice, = reply["choices"]
    assert (choice["index"], choice["logprobs"], choice["finish_reason"]) == (0, None, "length")
    assert choice["text"]
    prompt_tokens = len(tokens_of(quantized["Q8_0"], PROMPT))
    assert reply["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 8,
                              "total_tokens": prompt_tokens + 8}
    assert complete(api)["choices"][0]["text"] == choice["text"]  # greedy: the same


def test_max_tokens_defaults_to_16_as_openai(api, tiny):
    reply = complete(api, max_tokens=None)
    assert reply["usage"]["completion_tokens"] == 16
    assert reply["choices"][0]["finish_reason"] == "length"


def test_echo_puts_the_prompt_first(api, tiny):
    plain = complete(api)["choices"][0]["text"]
    assert complete(api, echo=True)["choices"][0]["text"] == PROMPT + plain


def test_stop_cuts_the_text(api, tiny):
    text = complete(api, max_tokens=16)["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = complete(api, max_tokens=16, stop=[stop, "never there"])["choices"][0]
    assert cut["text"] == text[:text.index(stop)] and cut["finish_reason"] == "stop"
    assert complete(api, max_tokens=16, stop=stop)["choices"][0] == cut


def test_a_seed_makes_sampling_repeat(api, tiny):
    def sampled(seed):
        return complete(api, temperature=1.5, top_k=0, top_p=1, min_p=0, seed=seed,
                        max_tokens=12)["choices"][0]["text"]

    assert sampled(42) == sampled(42)
    assert len({sampled(seed) for seed in range(1, 6)}) > 1


def test_streamed_with_usage(api, tiny):
    whole = complete(api, echo=True)
    r = api("POST", "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
        "logit_bias": NO_EOS, "echo": True, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status == 200 and r.headers["content-type"] == "text/event-stream"
    data = events(r)
    assert data[-1] == "[DONE]"
    chunks, usage = data[:-2], data[-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert all(c["object"] == "text_completion" and c["id"] == usage["id"] for c in chunks)
    assert all(c["usage"] is None for c in chunks)
    assert chunks[0]["choices"][0]["text"] == PROMPT  # the echo comes first
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-2:] == [None, "length"]
    assert chunks[-1]["choices"][0]["text"] == ""


def test_streamed_without_usage_has_no_usage_field(api, tiny):
    r = api("POST", "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 3,
                                        "stream": True})
    data = events(r)
    assert data[-1] == "[DONE]" and all("usage" not in c for c in data[:-1])
    assert data[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_token_prompts_are_their_text(api, tiny, quantized):
    tokens = tokens_of(quantized["Q8_0"], PROMPT)
    by_text = complete(api)
    by_tokens = complete(api, prompt=tokens, echo=True)
    assert by_tokens["usage"] == by_text["usage"]
    assert by_tokens["choices"][0]["text"] == PROMPT + by_text["choices"][0]["text"]
    both = complete(api, prompt=[tokens, tokens[:3]])
    assert [c["index"] for c in both["choices"]] == [0, 1]
    assert both["choices"][0]["text"] == by_text["choices"][0]["text"]


def test_token_ids_written_as_floats_are_tokens(api, tiny, quantized):
    tokens = tokens_of(quantized["Q8_0"], PROMPT)
    as_floats = complete(api, prompt=[float(t) for t in tokens])  # JSON Schema: integers
    assert as_floats == {**complete(api, prompt=tokens), "id": as_floats["id"],
                         "created": as_floats["created"]}
    assert complete(api, prompt=[[float(t) for t in tokens]])["usage"] == as_floats["usage"]


def test_several_prompts_are_a_choice_each(api, tiny):
    prompts = [PROMPT, "Hello there"]
    alone = [complete(api, prompt=p) for p in prompts]
    both = complete(api, prompt=prompts)
    assert [c["text"] for c in both["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert both["usage"]["completion_tokens"] == 16
    assert both["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    r = api("POST", "/v1/completions", {"model": "tiny", "prompt": prompts, "max_tokens": 2,
                                        "temperature": 0, "logit_bias": NO_EOS,
                                        "stream": True})
    chunks = [c["choices"][0] for c in events(r)[:-1]]
    indexes = [c["index"] for c in chunks]
    assert indexes == sorted(indexes) and set(indexes) == {0, 1}  # one choice, then the next
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["length", "length"]
    for i in (0, 1):
        assert "".join(c["text"] for c in chunks if c["index"] == i) == \
            complete(api, prompt=prompts[i], max_tokens=2)["choices"][0]["text"]


@pytest.mark.live
def test_suffix_makes_a_fill_in_the_middle_prompt(api, fim, fim_gguf):
    reply = complete(api, model="fim", prompt="def add(a, b):", suffix="return c")
    pre, suf, mid = 261, 262, 263  # the added tokens follow the ChatML ones
    expected = [1, pre] + tokens_of(fim_gguf, "def add(a, b):", bos=False) + [suf] + \
        tokens_of(fim_gguf, "return c", bos=False) + [mid]
    assert reply["usage"]["prompt_tokens"] == len(expected)
    by_tokens = complete(api, model="fim", prompt=expected)
    assert by_tokens["choices"][0]["text"] == reply["choices"][0]["text"]


def test_suffix_needs_fim_tokens(api, tiny):
    r = api("POST", "/v1/completions", {"model": "tiny", "prompt": "a", "suffix": "b"})
    assert r.status == 400 and r.json["error"]["param"] == "suffix"
    assert "fill-in-the-middle" in r.json["message"]


@pytest.mark.parametrize("body, param", [
    ({"logprobs": 1, "echo": True, "suffix": "x"}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"n": 2}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"prompt": "word " * 300}, "prompt"),
    ({"prompt": [1, 999999]}, "prompt"),
    ({"prompt": [[1, 2], [1, 999999]]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [1, 2], "suffix": "x"}, "suffix"),
    ({"temperature": 3}, "temperature"),
    ({"echo": "yes"}, "echo"),
])
def test_what_cannot_be_served_is_a_400(api, tiny, body, param):
    r = api("POST", "/v1/completions", {"model": "tiny", "prompt": "a", **body})
    assert r.status == 400 and r.json["error"]["param"].startswith(param), r.body
    rows = api("GET", "/v1/models/status").json["data"]
    assert rows[0]["requests"] == 0  # the turn was given back


def test_the_model_is_started_on_first_use(api, quantized):
    r = api("POST", "/v1/models/import", {"path": str(quantized["Q8_0"]), "id": "cold"})
    assert r.status == 200
    reply = complete(api, model="cold", max_tokens=2)
    assert reply["usage"]["completion_tokens"] == 2
    assert api("GET", "/v1/models/cold").json["status"] == "running"
    assert api("POST", "/v1/completions", {"model": "nope", "prompt": "a"}).status == 404
