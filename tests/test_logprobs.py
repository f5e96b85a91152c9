"""Log probabilities on chat and text completions, on real llama.cpp (localrt.engines.logprobs).

The model is conftest's tiny random llama (Q8_0), started with the prompt cache off so
that the same request computes bit for bit the same logits every time: random weights
give a flat distribution (every logprob near -ln 320), so the tests check what holds
for any model (logprobs <= 0, alternatives sorted, greedy picks the top-1, the top-k
mass at most 1), that the numbers are the model's own before sampling settings, that
streamed and batched replies carry the same numbers as a lone whole reply, and they
compare with llama-cpp-python's own Llama.create_completion(logprobs=...). The real
openai SDK reads them from a live server. Its vocabulary: token 2 is </s>, 262 "e".
"""

from __future__ import annotations

import json
import math
import sys

import gguf
import openai
import pytest
from emulators.chattemplates import TEMPLATES, TOKENS
from emulators.enginepkg import write_echo_model
from emulators.ggufgen import write_gguf
from emulators.onnxgen import write_onnx_model
from emulators.pkgindex import PackageIndex
from support.apps import bind
from support.models import NO_EOS, add_model, tokens_of
from support.servers import send
from support.tasks import wait_task
from test_batch import Events

from localrt.app import create_app

USER = [{"role": "user", "content": "hello"}]
PROMPT = "Once upon a time"


START = {"ctx_len": 256, "caching_enabled": False}


@pytest.fixture
def tiny_start():
    """conftest's `tiny`, running with a 256-token context and no prompt cache."""
    return START


def chat(api, **body) -> dict:
    body = {"model": "tiny", "messages": USER, "max_tokens": 8, "temperature": 0, **body}
    r = api("POST", "/v1/chat/completions", body)
    assert r.status == 200, r.body
    return r.json


def complete(api, **body) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **body}
    r = api("POST", "/v1/completions", body)
    assert r.status == 200, r.body
    return r.json


def chunks_of(app, r, reply: str) -> list:
    """The chunks of a streamed reply, each checked against replies.json's `reply`."""
    assert r.status == 200, r.body
    blocks = [b[6:] for b in r.body.decode().split("\n\n") if b.startswith("data: ")]
    assert blocks[-1] == "[DONE]"
    chunks = [json.loads(b) for b in blocks[:-1]]
    for chunk in chunks:
        assert not app.validators.reply_errors(reply, chunk), chunk
    return chunks


def check_entry(entry: dict, top: int) -> None:
    """What holds for any token's entry of chat's logprobs.content."""
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert entry["logprob"] <= 0
    if not entry["token"].startswith("bytes:"):
        assert bytes(entry["bytes"]) == entry["token"].encode("utf-8")
    alternatives = entry["top_logprobs"]
    assert len(alternatives) == top
    values = [a["logprob"] for a in alternatives]
    assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    assert sum(math.exp(v) for v in values) <= 1 + 1e-9
    same = [a for a in alternatives if a["bytes"] == entry["bytes"]]
    if same:  # the chosen token among the alternatives: the same number
        assert same[0]["logprob"] == entry["logprob"]
    else:  # not among them: no likelier than the least of them
        assert not values or entry["logprob"] <= values[-1]


def text_of(entries: list) -> str:
    return b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", errors="replace")


# --- scoring ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [100, 320, 32000, 32001, 151936])
def test_score_is_a_log_softmax_and_its_top_tokens(n):
    """localrt.engines.logprobs.score against a plain float64 log-softmax and a full sort, ties
    (to the lower id, as a greedy sampler) and a flat row included."""
    import numpy as np

    from localrt.engines.logprobs import score

    rng = np.random.default_rng(n)
    rows = [rng.standard_normal(n).astype(np.float32) * scale for scale in (1, 8)]
    tied = rng.standard_normal(n).astype(np.float32)
    tied[rng.integers(0, n, 40)] = tied.max()
    rows += [tied, np.full(n, 0.25, dtype=np.float32)]
    for logits in rows:
        wide = logits.astype(np.float64)
        lse = wide.max() + math.log(np.exp(wide - wide.max()).sum())
        ranked = sorted(range(n), key=lambda t: (-wide[t], t))
        for top in (0, 1, 5, 20):
            got_lse, got = score(logits, top)
            assert got_lse == pytest.approx(lse, abs=1e-4)
            assert [t for t, _ in got] == ranked[:top]
            assert all(lp == float(logits[t]) - got_lse <= 0 for t, lp in got)


# --- chat ------------------------------------------------------------------------------


def test_chat_logprobs_in_openai_shape_and_greedy_picks_the_top_one(api, tiny):
    reply = chat(api, max_tokens=12, logprobs=True, top_logprobs=5)
    choice, = reply["choices"]
    assert set(choice["logprobs"]) == {"content", "refusal"}
    assert choice["logprobs"]["refusal"] is None
    content = choice["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"] > 3
    for entry in content:
        check_entry(entry, 5)
        best = entry["top_logprobs"][0]  # temperature 0: the likeliest token each step
        assert (best["bytes"], best["logprob"]) == (entry["bytes"], entry["logprob"])
    assert text_of(content) == choice["message"]["content"]
    # Without logprobs the reply has none, and its text is the same.
    plain = chat(api, max_tokens=12)
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["message"]["content"] == choice["message"]["content"]


def test_top_logprobs_needs_logprobs_and_defaults_to_none(api, tiny):
    for body in ({"top_logprobs": 2}, {"top_logprobs": 0, "logprobs": False}):
        r = api("POST", "/v1/chat/completions", {"model": "tiny", "messages": USER, **body})
        assert r.status == 400 and r.json["error"]["param"] == "top_logprobs", r.body
        assert "logprobs" in r.json["error"]["message"]
    r = api("POST", "/v1/chat/completions", {"model": "tiny", "messages": USER,
                                             "logprobs": True, "top_logprobs": 21})
    assert r.status == 400 and r.json["error"]["param"] == "top_logprobs"
    reply = chat(api, logprobs=True, logit_bias=NO_EOS)
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == 8 and all(e["top_logprobs"] == [] for e in content)
    for entry in content:
        check_entry(entry, 0)


def test_logprobs_are_the_models_own_before_sampling(api, tiny):
    """Temperature, penalties, top-k/p and a logit bias change which token is picked,
    never the log-probabilities reported (llama-server's post_sampling_probs: false)."""
    first = chat(api, max_tokens=1, logprobs=True, top_logprobs=20)
    raw = first["choices"][0]["logprobs"]["content"][0]
    hot = chat(api, max_tokens=1, logprobs=True, top_logprobs=20, temperature=1.9, top_k=3,
               top_p=0.5, min_p=0.2, seed=11, repeat_penalty=1.5, presence_penalty=1.5,
               frequency_penalty=1.0)
    sampled = hot["choices"][0]["logprobs"]["content"][0]
    assert sampled["top_logprobs"] == raw["top_logprobs"]
    biased = chat(api, max_tokens=1, logprobs=True, top_logprobs=20, logit_bias={"262": 100})
    forced = biased["choices"][0]["logprobs"]["content"][0]
    assert forced["token"] == "e" and forced["top_logprobs"] == raw["top_logprobs"]
    # After a +100 bias "e" would be near certain (logprob ~0); the model's own is not.
    assert forced["logprob"] < -1
    listed = {a["token"]: a["logprob"] for a in raw["top_logprobs"]}
    if "e" in listed:
        assert forced["logprob"] == listed["e"]
    else:
        assert forced["logprob"] <= raw["top_logprobs"][-1]["logprob"]


def test_streamed_logprobs_are_the_whole_replys(app, api, tiny):
    request = {"model": "tiny", "messages": USER, "max_tokens": 12, "temperature": 0,
               "logit_bias": NO_EOS, "logprobs": True, "top_logprobs": 3}
    whole = chat(api, **request)["choices"][0]["logprobs"]["content"]
    chunks = chunks_of(app, api("POST", "/v1/chat/completions", {**request, "stream": True}),
                       "chat-completion-chunk")
    streamed = []
    for chunk in chunks:
        choice, = chunk["choices"]
        logprobs = choice["logprobs"]
        if logprobs is None:
            assert not choice["delta"].get("content")  # the role's chunk, the last one
            continue
        assert logprobs["refusal"] is None and logprobs["content"]
        # Each chunk carries the tokens whose text it sends.
        assert text_of(logprobs["content"]) == choice["delta"]["content"]
        streamed += logprobs["content"]
    assert streamed == whole
    assert chunks[0]["choices"][0]["logprobs"] is None
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_stop_sequence_drops_the_tokens_that_made_it(api, tiny):
    # Only the letters e t a o (tokens 262 to 265): every token is one character.
    letters = {**NO_EOS, **{str(t): 100 for t in range(262, 266)}}
    request = {"max_tokens": 16, "logit_bias": letters, "logprobs": True, "top_logprobs": 2}
    whole = chat(api, **request)["choices"][0]
    text = whole["message"]["content"]
    assert len(text) == 16 and len(set(text)) > 1
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = chat(api, **request, stop=stop)["choices"][0]
    kept = cut["logprobs"]["content"]
    assert cut["message"]["content"] == text[:text.index(stop)]
    assert kept == whole["logprobs"]["content"][:len(kept)]
    assert text_of(kept) == cut["message"]["content"]


def test_batched_sequences_each_get_their_own_logprobs(app, api, tiny):
    requests = [
        {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 10,
         "temperature": 0, "logit_bias": NO_EOS, **extra}
        for text, extra in (("hello", {"logprobs": True, "top_logprobs": 4}),
                            ("tell me a story", {"logprobs": True, "top_logprobs": 1}),
                            ("what is two plus two", {}))]
    alone = [chat(api, **r)["choices"][0] for r in requests]
    before = app.services.scheduler.loaded("tiny").counters()["decodes"]
    streams = [Events(app, r) for r in requests]
    got: list = [[], [], None]
    while not all(s.done for s in streams):
        for i, s in enumerate(streams):
            if s.done:
                continue
            event = s.next()
            if isinstance(event, dict) and event.get("choices"):
                logprobs = event["choices"][0]["logprobs"]
                if got[i] is None:
                    assert logprobs is None  # the request that did not ask
                elif logprobs:
                    got[i] += logprobs["content"]
    for s in streams:
        s.close()
    steps = app.services.scheduler.loaded("tiny").counters()["decodes"] - before
    assert steps < 20  # the three shared their steps (alone: 11 each)
    for stream, one, mine in zip(streams, alone, got):
        assert stream.text == one["message"]["content"]
        if mine is not None:
            assert mine == one["logprobs"]["content"]
    assert got[0] != got[1]


@pytest.fixture(scope="module")
def qwen_gguf(tmp_path_factory):
    """A tiny llama carrying Qwen 2.5's template and tokens, for forced tool calls."""
    kinds = {"control": gguf.TokenType.CONTROL, "user": gguf.TokenType.USER_DEFINED}
    return write_gguf(tmp_path_factory.mktemp("qwen") / "qwen.gguf", name="qwen25",
                      vocab_size=400, context_length=4096, chat_template=TEMPLATES["qwen25"],
                      added_tokens=[(t, kinds[k]) for t, k in TOKENS["qwen25"]])


@pytest.mark.live
def test_a_tool_calls_logprobs_cover_every_generated_token(app, api, qwen_gguf):
    add_model(api, qwen_gguf, "qwen", start={**START, "ctx_len": 4096})
    tool = {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "required": ["zone"],
                                           "properties": {"zone": {"enum": ["CET", "UTC"]}}}}}
    request = {"model": "qwen", "messages": USER, "tools": [tool], "tool_choice": "required",
               "parallel_tool_calls": False, "max_tokens": 120, "temperature": 0,
               "logprobs": True, "top_logprobs": 2}
    reply = chat(api, **request)
    choice, = reply["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    content = choice["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"]
    for entry in content:
        check_entry(entry, 2)
    raw = text_of(content)  # the call as the model wrote it, syntax and all
    assert "<tool_call>" in raw and "get_time" in raw
    chunks = chunks_of(app, api("POST", "/v1/chat/completions", {**request, "stream": True}),
                       "chat-completion-chunk")
    streamed = [e for c in chunks for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert streamed == content


# --- text completions ---------------------------------------------------------------------


def check_legacy(logprobs: dict, alternatives: int) -> None:
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    n = len(logprobs["tokens"])
    assert n == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == \
        len(logprobs["text_offset"])
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                   logprobs["top_logprobs"]):
        if logprob is None:
            assert top is None
            continue
        assert logprob <= 0 and token in top and top[token] >= logprob
        assert len(top) <= alternatives + 1 and all(v <= 0 for v in top.values())
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_completion_logprobs_in_the_legacy_shape(api, tiny):
    reply = complete(api, logprobs=3, logit_bias=NO_EOS)
    choice, = reply["choices"]
    logprobs = choice["logprobs"]
    check_legacy(logprobs, 3)
    assert len(logprobs["tokens"]) == reply["usage"]["completion_tokens"] == 8
    # Offsets count from the start of the prompt, echoed or not, as OpenAI's do.
    text = PROMPT + choice["text"]
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"]):
        if not token.startswith("bytes:"):
            assert text[offset:].startswith(token)
    assert logprobs["text_offset"][0] == len(PROMPT)
    assert choice["text"] == complete(api, logit_bias=NO_EOS)["choices"][0]["text"]
    # logprobs 0: each position lists the chosen token only.
    zero = complete(api, logprobs=0, logit_bias=NO_EOS)["choices"][0]["logprobs"]
    assert zero["tokens"] == logprobs["tokens"]
    assert zero["top_logprobs"] == [{t: lp} for t, lp in zip(zero["tokens"],
                                                              zero["token_logprobs"])]


def test_echo_scores_the_prompt_too(app, api, tiny, quantized):
    reply = complete(api, logprobs=2, echo=True, max_tokens=4, logit_bias=NO_EOS)
    choice, = reply["choices"]
    logprobs = choice["logprobs"]
    check_legacy(logprobs, 2)
    usage = reply["usage"]
    assert len(logprobs["tokens"]) == usage["prompt_tokens"] + usage["completion_tokens"]
    assert logprobs["tokens"][0] == "<s>"  # BOS: nothing predicts it, so nulls
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp is not None for lp in logprobs["token_logprobs"][1:])
    text = choice["text"]
    assert text.startswith(PROMPT)
    for token, offset in zip(logprobs["tokens"][1:], logprobs["text_offset"][1:]):
        # SentencePiece's added space before the text is at offset 0 but not in it.
        assert text[offset:].startswith(token) or (offset == 0 and token == " ")
    # The completion's own part is what a request without echo gets.
    plain = complete(api, logprobs=2, max_tokens=4, logit_bias=NO_EOS)["choices"][0]
    n = len(plain["logprobs"]["tokens"])
    assert {k: v[-n:] for k, v in logprobs.items()} == plain["logprobs"]
    # A prompt token's logprob is the one the model gives it after the tokens before it:
    # the first k prompt tokens as a prompt, with the next one forced by a logit bias
    # (which does not change the number: it is the model's own), score it the same.
    ids = tokens_of(quantized["Q8_0"], PROMPT)
    for k in (1, 2, 5):
        r = api("POST", "/v1/completions", {"model": "tiny", "prompt": ids[:k],
                                            "max_tokens": 1, "temperature": 0, "logprobs": 0,
                                            "logit_bias": {str(ids[k]): 100}})
        assert r.status == 200, r.body
        next_one = r.json["choices"][0]["logprobs"]
        assert next_one["tokens"] == [logprobs["tokens"][k]]
        assert next_one["token_logprobs"][0] == pytest.approx(logprobs["token_logprobs"][k],
                                                              abs=1e-4)
    # Streamed: the echo's chunk carries the prompt's, then each piece its tokens'.
    r = api("POST", "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4,
                                        "temperature": 0, "logit_bias": NO_EOS,
                                        "logprobs": 2, "echo": True, "stream": True})
    chunks = chunks_of(app, r, "text-completion-chunk")
    assert chunks[0]["choices"][0]["text"] == PROMPT
    assert len(chunks[0]["choices"][0]["logprobs"]["tokens"]) == usage["prompt_tokens"]
    merged = {k: [] for k in logprobs}
    for chunk in chunks:
        part = chunk["choices"][0]["logprobs"]
        for key in merged:
            merged[key] += part[key] if part else []
    assert merged == logprobs


def test_completion_logprobs_match_llama_cpp_pythons_own(api, tiny, quantized):
    """llama-cpp-python's high-level Llama scores a completion the same way."""
    import llama_cpp

    # flash attention on, as localrt's default (llama.cpp's auto) has it on a CPU: the
    # same kernels, so the same logits
    llm = llama_cpp.Llama(model_path=str(quantized["Q8_0"]), n_ctx=256, logits_all=True,
                          n_threads=1, flash_attn=True, verbose=False)
    try:
        theirs = llm.create_completion(PROMPT, max_tokens=8, temperature=0, logprobs=3)
    finally:
        llm.close()
    mine = complete(api, logprobs=3)["choices"][0]
    assert mine["text"] == theirs["choices"][0]["text"]
    ours, their = mine["logprobs"], theirs["choices"][0]["logprobs"]
    assert len(ours["tokens"]) >= 3
    assert ours["token_logprobs"] == pytest.approx(their["token_logprobs"], abs=1e-3)
    assert ours["text_offset"] == their["text_offset"]
    for a, b in zip(ours["top_logprobs"], their["top_logprobs"]):
        assert sorted(a.values()) == pytest.approx(sorted(b.values()), abs=1e-3)


def test_streamed_completion_logprobs_are_the_whole_replys(app, api, tiny):
    body = {"model": "tiny", "prompt": ["Once", "Hello there"], "max_tokens": 6,
            "temperature": 0, "logit_bias": NO_EOS, "logprobs": 1}
    whole = complete(api, **body)
    chunks = chunks_of(app, api("POST", "/v1/completions", {**body, "stream": True}),
                       "text-completion-chunk")
    for index, choice in enumerate(whole["choices"]):
        merged = {k: [] for k in choice["logprobs"]}
        for chunk in chunks:
            part, = chunk["choices"]
            if part["index"] != index or part["logprobs"] is None:
                continue
            assert part["text"]  # a chunk with tokens has their text
            for key in merged:
                merged[key] += part["logprobs"][key]
        assert merged == choice["logprobs"]


def test_completion_logprobs_refusals(api, tiny):
    r = api("POST", "/v1/completions", {"model": "tiny", "prompt": "a", "logprobs": 21})
    assert r.status == 400 and r.json["error"]["param"] == "logprobs"


# --- other engines ------------------------------------------------------------------------


@pytest.fixture
def engines_api(settings, index_dir):
    """The WSGI app with the package index emulator as its engine index; engine folders
    put on sys.path are taken off again."""
    before = list(sys.path)
    with PackageIndex(index_dir) as index:
        settings.update({"engineIndexUrl": index.url})
        app = create_app(settings)
        try:
            api = bind(app)

            api.app = app
            yield api
        finally:
            app.close()
            sys.path[:] = before


def install(api, path, body=None):
    r = api("POST", path, body)
    assert r.status == 200, r.body
    assert wait_task(api, r.json["task"]["id"], timeout=60.0)["status"] == "Success"


def test_onnx_runtime_gives_the_models_own_logprobs(engines_api, tmp_path):
    """onnxruntime-genai's logits for the next token, read before its search samples."""
    api = engines_api
    install(api, "/v1/engines/onnx-runtime/install")
    folder = write_onnx_model(tmp_path / "onnx-model")
    assert api("POST", "/v1/models/import", {"path": str(folder), "id": "onnx"}).status == 200
    assert api("POST", "/v1/models/onnx/start").status == 200
    request = {"model": "onnx", "messages": USER, "max_tokens": 6, "temperature": 0,
               "logprobs": True, "top_logprobs": 3}
    reply = chat(api, **request)
    choice, = reply["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"] == 6
    for entry in content:
        check_entry(entry, 3)
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    sampled = chat(api, **{**request, "temperature": 1.5, "seed": 3})["choices"][0]["logprobs"]
    assert sampled["content"][0]["top_logprobs"] == content[0]["top_logprobs"]
    r = api("POST", "/v1/chat/completions", {**request, "stream": True})
    streamed = [e for line in r.body.decode().split("\n\n") if line.startswith("data: {")
                for e in (json.loads(line[6:])["choices"][0]["logprobs"] or {}).get("content", [])]
    assert streamed == content
    legacy = complete(api, model="onnx", logprobs=2, max_tokens=4)["choices"][0]
    check_legacy(legacy["logprobs"], 2)
    assert "".join(legacy["logprobs"]["tokens"]) == legacy["text"]
    # It scores generated tokens only: an echoed prompt's logprobs are a 400.
    r = api("POST", "/v1/completions", {"model": "onnx", "prompt": "hi", "logprobs": 1,
                                        "echo": True})
    assert r.status == 400 and r.json["error"]["param"] == "logprobs", r.body


def test_an_engine_without_logprobs_gives_none(engines_api, index_dir, tmp_path):
    """A custom engine's model with only chat() gives text, no logprobs: its Generation
    has none, which Chats and Completions answer with a 400 naming logprobs."""
    from localrt.engines.contract import generating

    api = engines_api
    install(api, "/v1/engines/install",
            {"wheel": str(next(index_dir.glob("localrt_echo_engine-*.whl")))})
    model = write_echo_model(tmp_path / "echo.txt")
    loaded = generating(api.app.services.engines.open("echo", str(model), {}))
    generation = loaded.generate(USER, {"logprobs": 2})
    try:
        assert generation.logprobs is None
        assert "".join(generation) == "echo: hello"
    finally:
        generation.close()
        loaded.unload()


# --- the openai SDK ----------------------------------------------------------------------


def test_the_openai_sdk_reads_logprobs(live_server, quantized):
    status, body = send(live_server.url, "POST", "/v1/models/import",
                        {"path": str(quantized["Q8_0"]), "id": "tiny"})
    assert status == 200, body
    with openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        reply = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=6, temperature=0, logit_bias=NO_EOS,
            logprobs=True, top_logprobs=3)
        content = reply.choices[0].logprobs.content
        assert len(content) == 6
        for token in content:
            assert len(token.top_logprobs) == 3 and token.logprob <= 0
            assert token.top_logprobs[0].logprob >= token.top_logprobs[-1].logprob
            assert isinstance(token.bytes, list) and isinstance(token.token, str)
        stream = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=6, temperature=0, logit_bias=NO_EOS,
            logprobs=True, top_logprobs=3, stream=True)
        streamed = [t for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                    for t in chunk.choices[0].logprobs.content]
        assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=USER, top_logprobs=3)
        assert caught.value.body["param"] == "top_logprobs"
        completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5,
                                               temperature=0, logit_bias=NO_EOS, logprobs=2,
                                               echo=True)
        logprobs = completion.choices[0].logprobs
        assert len(logprobs.tokens) == completion.usage.total_tokens
        assert logprobs.token_logprobs[0] is None and logprobs.text_offset[0] == 0
        assert all(len(top) <= 3 for top in logprobs.top_logprobs[1:])
