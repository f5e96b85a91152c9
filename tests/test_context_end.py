"""A reply that reaches the end of the context, in every dialect, through the WSGI app
on real llama.cpp.

Agents send long prompts and often no max_tokens: the reply must then end where the
context does, as a reply cut at max_tokens ends (OpenAI's finish_reason "length",
Anthropic's stop_reason "max_tokens", Ollama's done_reason "length", a Response
"incomplete" for max_output_tokens), streamed or not, and never with an error or a
hang; a prompt that fills the context is a 400 naming ctx_len before anything streams.

The model is generated (tests/emulators/ggufgen.py) and scripted to write " eta" over and over,
whatever the prompt and the sampling: it never ends a reply by itself, so only the
context ends it. Its vocabulary makes each "e " of a prompt one token, so a prompt of
n of them is as long as the tests want.
"""

from __future__ import annotations

import json
import threading

import pytest
from emulators.ggufgen import write_gguf

pytestmark = pytest.mark.live

# The model's ctx_len: each slot holds that many tokens. llama.cpp pads a context to
# 256 tokens, so with 256 a slot's KV cache is exactly full when its reply ends.
CTX = 256
ROOM = 5  # the tokens the tests' prompts leave for the reply


@pytest.fixture(scope="module")
def loop_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("ctx") / "loop.gguf", context_length=256,
                      script=["▁e", "t", "a"], loop=True)


@pytest.fixture
def loop(api, loop_gguf):
    """The looping model, running with a context of CTX tokens in 2 slots."""
    r = api("POST", "/v1/models/import", {"path": str(loop_gguf), "id": "loop"})
    assert r.status == 200, r.body
    r = api("POST", "/v1/models/loop/start", {"ctx_len": CTX, "n_parallel": 2,
                                              "cpu_threads": 1})
    assert r.status == 200, r.body
    return "loop"


def words(n: int) -> str:
    """A text of n tokens (each "e" is the token "▁e")."""
    return " ".join(["e"] * n)


@pytest.fixture
def overhead(api, loop):
    """The chat template's tokens around one user message of n words."""
    r = api("POST", "/v1/chat/completions", {"model": loop, "max_tokens": 1, "messages": [
        {"role": "user", "content": words(10)}]})
    assert r.status == 200, r.body
    return r.json["usage"]["prompt_tokens"] - 10


def sse(r) -> list:
    """The data of each Server-Sent Event (`event:` lines aside), [DONE] left out."""
    assert r.status == 200, r.body
    out = []
    for block in r.body.decode().split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def ndjson(r) -> list:
    assert r.status == 200, r.body
    return [json.loads(line) for line in r.body.decode().splitlines()]


# Each dialect: its path, its request for a user message, and how its reply (or
# stream) reads: (the finish as the dialect names it, prompt tokens, reply tokens, text).


def openai_chat(content, stream):
    return "/v1/chat/completions", {
        "model": "loop", "messages": [{"role": "user", "content": content}],
        "stream": stream, "stream_options": {"include_usage": True} if stream else None}


def read_openai_chat(r, stream):
    if not stream:
        assert r.status == 200, r.body
        choice, usage = r.json["choices"][0], r.json["usage"]
        return (choice["finish_reason"], usage["prompt_tokens"],
                usage["completion_tokens"], choice["message"]["content"])
    chunks = sse(r)
    usage = chunks[-1]["usage"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] and not any(finish[:-1])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"])
    return finish[-1], usage["prompt_tokens"], usage["completion_tokens"], text


def anthropic(content, stream):
    return "/v1/messages", {"model": "loop", "max_tokens": 4096, "stream": stream,
                            "messages": [{"role": "user", "content": content}]}


def read_anthropic(r, stream):
    if not stream:
        assert r.status == 200, r.body
        usage = r.json["usage"]
        return (r.json["stop_reason"], anthropic_prompt(usage), usage["output_tokens"],
                "".join(b["text"] for b in r.json["content"]))
    events = sse(r)
    assert events[-1]["type"] == "message_stop"
    start = next(e for e in events if e["type"] == "message_start")
    delta = next(e for e in events if e["type"] == "message_delta")
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    # message_start counts the whole prompt; message_delta splits it by the prompt cache.
    assert start["message"]["usage"]["input_tokens"] == anthropic_prompt(delta["usage"])
    return (delta["delta"]["stop_reason"], anthropic_prompt(delta["usage"]),
            delta["usage"]["output_tokens"], text)


def anthropic_prompt(usage: dict) -> int:
    """The prompt's tokens in an Anthropic usage: read afresh and from the cache."""
    return usage["input_tokens"] + usage["cache_read_input_tokens"] + \
        usage["cache_creation_input_tokens"]


def ollama_chat(content, stream):
    return "/api/chat", {"model": "loop", "stream": stream,
                         "messages": [{"role": "user", "content": content}]}


def ollama_generate(content, stream):
    return "/api/generate", {"model": "loop", "stream": stream, "prompt": content}


def read_ollama(r, stream):
    key = "message" if b'"message"' in r.body else "response"

    def text(obj):
        return obj["message"]["content"] if key == "message" else obj["response"]

    if not stream:
        assert r.status == 200, r.body
        body = r.json
        return body["done_reason"], body["prompt_eval_count"], body["eval_count"], text(body)
    *pieces, last = ndjson(r)
    assert last["done"] and not any(p["done"] for p in pieces)
    return (last["done_reason"], last["prompt_eval_count"], last["eval_count"],
            "".join(text(p) for p in pieces + [last]))


def responses(content, stream):
    return "/v1/responses", {"model": "loop", "input": content, "stream": stream}


def read_responses(r, stream):
    if stream:
        last = sse(r)[-1]
        assert last["type"] == "response.incomplete", last["type"]
        response = last["response"]
    else:
        assert r.status == 200, r.body
        response = r.json
    assert response["status"] == "incomplete"
    usage = response["usage"]
    text = "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])
    return (response["incomplete_details"]["reason"], usage["input_tokens"],
            usage["output_tokens"], text)


# name: (request, reader, the finish the dialect names a reply cut by the context)
DIALECTS = {"openai-chat": (openai_chat, read_openai_chat, "length"),
            "anthropic": (anthropic, read_anthropic, "max_tokens"),
            "ollama-chat": (ollama_chat, read_ollama, "length"),
            "ollama-generate": (ollama_generate, read_ollama, "length"),
            "responses": (responses, read_responses, "max_output_tokens")}


def ask(api, dialect, content, stream):
    request, read, _ = DIALECTS[dialect]
    return read(api("POST", *request(content, stream)), stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_a_reply_that_reaches_the_end_of_the_context_ends_with_length(
        api, overhead, dialect, stream):
    length = DIALECTS[dialect][2]
    finish, prompt, reply, text = ask(api, dialect, words(CTX - ROOM - overhead), stream)
    assert (finish, prompt, reply) == (length, CTX - ROOM, ROOM)
    assert text == " eta et"  # the script, 5 tokens of it
    # A prompt one token short of the context leaves room for one token.
    finish, prompt, reply, _ = ask(api, dialect, words(CTX - 1 - overhead), stream)
    assert (finish, prompt, reply) == (length, CTX - 1, 1)


def refusal(dialect, r) -> str:
    """The message of a 400 in the dialect's own error shape (each client reads only
    its own: Claude Code the Anthropic one, Codex the Responses one, ...)."""
    assert r.status == 400, r.body
    assert r.headers["content-type"] == "application/json"
    body = r.json
    if dialect.startswith("ollama"):
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        return body["error"]
    if dialect == "anthropic":
        assert body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"]
    field = "input" if dialect == "responses" else "messages"
    assert body["error"]["type"] == "invalid_request_error", body
    assert (body["error"]["code"], body["error"]["param"]) == ("invalid_field", field), body
    return body["error"]["message"]


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_a_prompt_that_fills_the_context_is_a_400_naming_ctx_len(api, overhead, dialect):
    """In the dialect's own shape, naming ctx_len and the prompt's size: counted when it
    is tokenized, or a bound on it when its text alone is too long (measured before)."""
    request, _, _ = DIALECTS[dialect]
    for stream in (False, True):  # refused before a stream starts
        message = refusal(dialect, api("POST", *request(words(CTX - overhead), stream)))
        assert f"the prompt is {CTX} tokens and the model's context (ctx_len) holds " \
               f"{CTX}" in message, message
        # 2 bytes a word: 80 bytes for each token of the context, more than any of the
        # vocabulary's pieces stands for (12 at most): refused before it is tokenized
        message = refusal(dialect, api("POST", *request(words(CTX * 40), stream)))
        assert "the prompt is at least " in message, message
        assert f"the model's context (ctx_len) holds {CTX}" in message, message
        assert "larger ctx_len" in message
    assert ask(api, dialect, words(CTX - 1 - overhead), False)[2] == 1  # still serves


def test_a_completion_without_max_tokens_ends_with_the_context(api, loop):
    """A completion's max_tokens defaults to 16, and the context cuts that shorter."""
    for stream in (False, True):
        r = api("POST", "/v1/completions", {"model": loop, "prompt": words(CTX - ROOM),
                                            "stream": stream})
        if stream:
            chunks = sse(r)
            finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        else:
            assert r.status == 200, r.body
            finish, text = [r.json["choices"][0]["finish_reason"]], r.json["choices"][0]["text"]
            # the prompt starts with BOS: CTX - ROOM + 1 tokens
            assert r.json["usage"] == {"prompt_tokens": CTX - ROOM + 1,
                                       "completion_tokens": ROOM - 1, "total_tokens": CTX}
        assert finish[-1] == "length" and not any(finish[:-1])
        assert text == "ta et"  # the script after "▁e", 4 tokens of it
    r = api("POST", "/v1/completions", {"model": loop, "prompt": list(range(3, CTX + 1)),
                                        "max_tokens": 1000})
    assert r.status == 200, r.body
    assert r.json["choices"][0]["finish_reason"] == "length"
    assert r.json["usage"]["completion_tokens"] == 2
    r = api("POST", "/v1/completions", {"model": loop, "prompt": words(CTX)})
    assert r.status == 400 and r.json["error"]["param"] == "prompt", r.body
    assert "ctx_len" in r.json["error"]["message"]


def test_each_slot_ends_at_its_own_context(api, overhead):
    """Two replies at once in the model's two slots, their prompts of different lengths:
    each runs until its own slot's context is full, then the next pair reuses them."""
    results, errors = {}, []

    def run(n):
        try:
            results[n] = ask(api, "openai-chat", words(CTX - n - overhead), n % 2 == 0)
        except Exception as exc:  # the assertion below names it
            errors.append(exc)

    for rooms in ((3, 20), (12, 7)):
        threads = [threading.Thread(target=run, args=(n,)) for n in rooms]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        for n in rooms:
            finish, prompt, reply, _ = results[n]
            assert (finish, prompt, reply) == ("length", CTX - n, n)
