"""Chat completions through a real server on a socket, as clients use it: the official
`openai` package, curl-style streams read line by line, clients that hang up in the
middle of a reply, requests that must not wait behind a generation, and requests that
queue for one model.

The server is `localrt start --foreground` in its own process, as users run it.
The models are tiny GGUF files quantized by llama.cpp; their random weights make
gibberish, so the tests check shapes, counts and timing, and that greedy decoding
(temperature 0) gives the same text every time.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import openai
import pytest
from support.models import NO_DRAFTS, NO_EOS, add_model
from support.servers import RawStream, run_foreground_server, send
from support.waiting import wait_for

pytestmark = pytest.mark.live

HELLO = [{"role": "user", "content": "Hello there"}]
LONG = 3000  # tokens of a reply that would take seconds


@pytest.fixture
def server(live_server):
    """`localrt start --foreground` on a free port, in its own process (conftest)."""
    return live_server


@pytest.fixture
def api(server):
    """Where conftest's `tiny` goes: the real server."""
    return server.url


@pytest.fixture
def tiny_start():
    """conftest's `tiny`, running with a 256-token context."""
    return {"ctx_len": 256}


def ask(url, method, path, body=None, timeout=30):
    """support.servers.send, with time for a reply from the slower model."""
    return send(url, method, path, body, timeout)


@pytest.fixture
def slow(server, slow_gguf):
    return add_model(server.url, slow_gguf, "slow", start={"ctx_len": 4096, **NO_DRAFTS})


@pytest.fixture
def slow_one_slot(server, slow_gguf):
    """The slow model serving one request at a time (n_parallel 1): the others queue."""
    return add_model(server.url, slow_gguf, "slow-1",
                     start={"ctx_len": 4096, "n_parallel": 1, **NO_DRAFTS})


def chat_body(model, max_tokens, stream=True, **extra):
    """A greedy chat request whose reply is exactly max_tokens long."""
    return {"model": model, "messages": HELLO, "max_tokens": max_tokens, "temperature": 0,
            "logit_bias": NO_EOS, "stream": stream, **extra}


def requests_of(url, model_id):
    """The model's requests in progress, as GET /v1/models/status counts them."""
    status, body = ask(url, "GET", "/v1/models/status")
    assert status == 200, body
    return {row["id"]: row["requests"] for row in body["data"]}[model_id]


# --- the openai package ------------------------------------------------------------


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=30) as client:
        yield client


def test_openai_chat_not_streamed(client, tiny):
    reply = client.chat.completions.create(model=tiny, messages=HELLO, max_tokens=12,
                                           temperature=0)
    assert reply.object == "chat.completion" and reply.model == tiny
    [choice] = reply.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens > 0 and 0 <= usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    banned = client.chat.completions.create(model=tiny, messages=HELLO, max_tokens=12,
                                            temperature=0, logit_bias=NO_EOS)
    assert banned.choices[0].finish_reason == "length"
    assert banned.usage.completion_tokens == 12
    assert banned.usage.prompt_tokens == usage.prompt_tokens
    again = client.chat.completions.create(model=tiny, messages=HELLO, max_tokens=12,
                                           temperature=0, extra_body={"logit_bias": NO_EOS})
    assert again.choices[0].message.content == banned.choices[0].message.content


def test_openai_chat_streamed_equals_not_streamed(client, tiny):
    whole = client.chat.completions.create(model=tiny, messages=HELLO, max_tokens=16,
                                           temperature=0, logit_bias=NO_EOS)
    chunks = list(client.chat.completions.create(
        model=tiny, messages=HELLO, max_tokens=16, temperature=0, logit_bias=NO_EOS,
        stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.model == tiny for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    *content, last = chunks
    assert last.choices == [] and all(c.usage is None for c in content)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) \
        == (whole.usage.prompt_tokens, 16, whole.usage.total_tokens)

    # Without include_usage no chunk carries usage.
    plain = list(client.chat.completions.create(model=tiny, messages=HELLO, max_tokens=16,
                                                temperature=0, logit_bias=NO_EOS,
                                                stream=True))
    assert all(c.usage is None and c.choices for c in plain)
    assert "".join(c.choices[0].delta.content or "" for c in plain) == text


@pytest.mark.parametrize("stream", [False, True])
def test_openai_unknown_model_is_not_found(client, tiny, stream):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nope", messages=HELLO, max_tokens=4,
                                       stream=stream)
    assert caught.value.status_code == 404
    assert "nope" in str(caught.value)


def test_openai_lists_models(client, tiny):
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny]
    assert models.data[0].object == "model" and models.data[0].owned_by
    assert client.models.retrieve(tiny).id == tiny


# --- curl-style streams ------------------------------------------------------------


def test_a_stream_read_line_by_line(server, tiny):
    req = urllib.request.Request(server.url + "/v1/chat/completions",
                                 data=json.dumps(chat_body(tiny, 24)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["Cache-Control"] == "no-cache"
        lines = [line.decode("utf-8") for line in resp]
    # Every event is one "data:" line and a blank line.
    assert all(line.startswith("data: ") for line in lines[::2]), lines
    assert all(line == "\n" for line in lines[1::2]), lines
    assert lines[-2] == "data: [DONE]\n"
    chunks = [json.loads(line[6:]) for line in lines[:-2:2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    pieces = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert len(pieces) > 1 and all(pieces)  # token by token, never empty
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + \
        ["length"]
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert all("usage" not in c for c in chunks)
    status, whole = ask(server.url, "POST", "/v1/chat/completions",
                        chat_body(tiny, 24, stream=False))
    assert status == 200 and whole["choices"][0]["message"]["content"] == "".join(pieces)


# --- hanging up, and not blocking others -------------------------------------------


def test_a_client_hanging_up_mid_stream_frees_the_model(server, slow):
    stream = RawStream(server.url, chat_body(slow, LONG))
    events = iter(stream)
    assert next(events)["choices"][0]["delta"]["role"] == "assistant"
    first = time.monotonic()
    for _ in range(100):
        assert next(events)["choices"][0]["delta"]["content"] is not None
    rate = 100 / (time.monotonic() - first)  # tokens a second, at the start of the reply
    assert requests_of(server.url, slow) == 1
    stream.close()

    freed = wait_for(lambda: requests_of(server.url, slow) == 0, 2, "the model is busy")
    started = time.monotonic()
    status, reply = ask(server.url, "POST", "/v1/chat/completions",
                        chat_body(slow, 8, stream=False))
    answered = time.monotonic() - started
    assert status == 200 and reply["usage"]["completion_tokens"] == 8
    # The rest of the reply would have taken much longer (later tokens are slower still).
    rest = (LONG - 100) / rate
    print(f"{rate:.0f} tokens/s; freed after {freed:.2f} s, next reply in {answered:.2f} s, "
          f"the rest would have taken {rest:.1f} s")
    assert freed + answered < rest / 2


def test_other_requests_are_answered_while_a_reply_generates(server, slow):
    stream = RawStream(server.url, chat_body(slow, LONG))
    try:
        events = iter(stream)
        for _ in range(5):
            next(events)
        for path in ("/healthz", "/v1/models", "/v1/models/status", "/v1/models/slow",
                     "/v1/configs"):
            status, _ = ask(server.url, "GET", path)
            assert status == 200, path
        # Answered while the reply generates, not after it: the model still holds it (an
        # event, where a time limit would fail on a busy machine).
        assert requests_of(server.url, slow) == 1
        assert next(events)["choices"][0]["finish_reason"] is None  # still generating
    finally:
        stream.close()


def test_concurrent_streams_queue_in_arrival_order_and_all_finish(server, slow_one_slot):
    """A long reply holds the model; four more requests queue behind it and run in order.

    One slot, so that each runs alone: with several, requests that join the same batch
    step finish in the same step too (tests/test_batch.py covers batches)."""
    slow = slow_one_slot
    blocker = RawStream(server.url, chat_body(slow, LONG))
    next(iter(blocker))
    results, order, lock = {}, [], threading.Lock()

    def streamed(n):
        stream = RawStream(server.url, chat_body(slow, 32, stream_options={
            "include_usage": True}))
        try:
            events = list(stream)
        finally:
            stream.close()
        with lock:
            order.append(n)
        results[n] = events

    threads = []
    for n in range(4):
        threads.append(threading.Thread(target=streamed, args=(n,), daemon=True))
        threads[-1].start()
        wait_for(lambda: requests_of(server.url, slow) == n + 2, 5, f"request {n} queued")
    blocker.close()
    for thread in threads:
        thread.join(30)
    assert order == [0, 1, 2, 3]
    texts = set()
    for n, events in results.items():
        assert events[-1] == "[DONE]", events[-3:]
        *chunks, usage, _ = events
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 32
        assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 32
        texts.add("".join(c["choices"][0]["delta"].get("content", "") for c in chunks))
    assert len(texts) == 1  # each greedy reply whole, none mixed with another
    assert requests_of(server.url, slow) == 0


def test_a_second_model_answers_while_the_first_generates(server, quantized, slow):
    other = add_model(server.url, quantized["Q4_0"], "tiny-q4", start={"ctx_len": 256})
    status, body = ask(server.url, "GET", "/v1/models/status")
    assert sorted(row["id"] for row in body["data"]) == [slow, other]  # maxRunningModels 2
    stream = RawStream(server.url, chat_body(slow, LONG))
    try:
        events = iter(stream)
        for _ in range(5):
            next(events)
        # Its tokens take turns with the long reply's in the compute lane: no waiting for it.
        status, reply = ask(server.url, "POST", "/v1/chat/completions",
                            chat_body(other, 16, stream=False))
        assert status == 200 and reply["model"] == other, reply
        assert reply["usage"]["completion_tokens"] == 16
        # It came while the long reply still generates, not after: the first model still
        # holds that request (an event, where a time limit fails on a busy machine).
        assert requests_of(server.url, slow) == 1
        assert next(events)["choices"][0]["finish_reason"] is None  # still generating
    finally:
        stream.close()


def test_a_busy_model_is_not_cut_short_to_make_room(home, slow_gguf, quantized):
    """Past maxRunningModels, a start waits for the least recently used model to finish
    its reply instead of cutting it."""
    (home / ".localrtrc").write_text("maxRunningModels: 1\n")
    srv = run_foreground_server(home)
    try:
        for model_id, path in (("slow", slow_gguf), ("tiny", quantized["Q8_0"])):
            status, reply = ask(srv.url, "POST", "/v1/models/import",
                                {"path": str(path), "id": model_id})
            assert status == 200, reply
        ask(srv.url, "POST", "/v1/models/slow/start", {"cpu_threads": 1})
        result = {}
        long_chat = threading.Thread(target=lambda: result.update(reply=ask(
            srv.url, "POST", "/v1/chat/completions",
            {"model": "slow", "messages": HELLO, "max_tokens": 600, "logit_bias": NO_EOS,
             "temperature": 0})))
        long_chat.start()
        deadline = time.monotonic() + 10
        while not any(m["requests"] for m in ask(srv.url, "GET", "/v1/models/status")[1]["data"]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        status, reply = ask(srv.url, "POST", "/v1/models/tiny/start", {"cpu_threads": 1})
        assert status == 200, reply
        long_chat.join(30)
        status, out = result["reply"]
        assert status == 200 and out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 600
        running = [m["id"] for m in ask(srv.url, "GET", "/v1/models/status")[1]["data"]]
        assert running == ["tiny"]
    finally:
        srv.stop()


def test_stopping_a_model_mid_reply_says_so(server, slow_gguf):
    ask(server.url, "POST", "/v1/models/import", {"path": str(slow_gguf), "id": "slow"})
    ask(server.url, "POST", "/v1/models/slow/start", {"cpu_threads": 1})
    conn = http.client.HTTPConnection("127.0.0.1", urlsplit(server.url).port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(
        {"model": "slow", "messages": HELLO, "max_tokens": LONG, "logit_bias": NO_EOS,
         "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.readline()  # the role chunk
    assert ask(server.url, "POST", "/v1/models/slow/stop")[0] == 200
    events = [line[6:] for line in resp.read().decode().splitlines()
              if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "model_stopped"
    conn.close()
