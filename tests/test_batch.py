"""Continuous batching and the prompt cache, on real llama.cpp (localrt.engines.llama.batch).

The models are tests/emulators/ggufgen.py's tiny random llama (conftest's `quantized`, and an F16
one here). Their vocabulary is fixed, so a logit bias of +100 on one ordinary token
makes a reply that token over and over: token 262 is "e", 263 "t", 264 "a", 265 "o".
Greedy replies are checked against the same request served alone: llama.cpp computes a
quantized model's sequences bit for bit the same whatever else shares the batch, so a
sequence that read another's KV cache, or sampled with another's chain, would differ.

Streams are driven through the WSGI app one event at a time (`Events`), as the server
does, so a test decides exactly when each request reads its next token.
"""

from __future__ import annotations

import io
import json
import threading
import time
from wsgiref.util import setup_testing_defaults
from wsgiref.validate import validator

import pytest
from emulators.ggufgen import write_gguf
from support.models import NO_EOS, add_model
from support.waiting import wait_for

from localrt.engines.llama.batch import Batcher, Entry, Sequence
from localrt.engines.llama.media import whole_images
from localrt.errors import InvalidField

LETTERS = "etao"  # tokens 262.. of the tiny vocabulary
PROMPTS = ["hello", "how are you", "tell me a story", "what is two plus two"]


def forced(i: int) -> dict:
    """A logit bias that makes every token of the reply LETTERS[i]."""
    return {**NO_EOS, str(262 + i): 100}


def user(text: str) -> list:
    return [{"role": "user", "content": text}]


def body(model="tiny", **extra) -> dict:
    return {"model": model, "messages": user("hello"), "max_tokens": 8, "temperature": 0,
            "logit_bias": NO_EOS, **extra}


@pytest.fixture
def tiny_start():
    """conftest's `tiny`, running on one thread with the default slots."""
    return {}


@pytest.fixture(scope="session")
def tiny_f16(tmp_path_factory):
    root = tmp_path_factory.mktemp("f16")
    return write_gguf(root / "tiny-f16.gguf", n_embd=256, n_ff=512, context_length=256,
                      file_type="F16")


class Events:
    """A streamed chat through the WSGI app, read one Server-Sent Event at a time.

    Making one sends the request: it waits (as the server's thread would) while the
    model has no free slot.
    """

    def __init__(self, app, request: dict):
        data = json.dumps({**request, "stream": True}).encode()
        environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/v1/chat/completions",
                   "SCRIPT_NAME": "", "QUERY_STRING": "", "CONTENT_TYPE": "application/json",
                   "CONTENT_LENGTH": str(len(data)), "wsgi.input": io.BytesIO(data)}
        setup_testing_defaults(environ)
        self.status = None

        def start_response(status, headers, exc_info=None):
            self.status = int(status.split()[0])
            return lambda _: None

        self._result = validator(app)(environ, start_response)
        self._events = iter(self._result)
        self.text, self.finish, self.done, self.error, self.usage = "", None, False, None, None

    def next(self):
        """The next event's data (a dict, or "[DONE]"), noted in text/finish/error."""
        raw = next(self._events)
        data = raw.decode()[6:].strip()
        if data == "[DONE]":
            self.done = True
            return data
        event = json.loads(data)
        if event.get("usage"):
            self.usage = event["usage"]
        if "error" in event:
            self.error = event["error"]
        elif event["choices"]:
            choice = event["choices"][0]
            self.text += choice["delta"].get("content") or ""
            self.finish = choice["finish_reason"] or self.finish
        return event

    def content(self) -> str:
        """Read up to the next event with text; that text."""
        while True:
            event = self.next()
            if event == "[DONE]":
                raise AssertionError(f"the stream ended: {self.text!r} {self.error}")
            piece = event["choices"][0]["delta"].get("content") if event.get("choices") else ""
            if piece:
                return piece

    def finish_reading(self) -> "Events":
        while not self.done:
            self.next()
        self.close()
        return self

    def close(self) -> None:
        """What the server does when the reply ends or the client hangs up."""
        self._result.close()


def round_robin(streams: list) -> None:
    """Read one event from each unfinished stream in turn until all are done."""
    while not all(s.done for s in streams):
        for s in streams:
            if not s.done:
                s.next()
    for s in streams:
        s.close()


def counters(app, model_id="tiny") -> dict:
    return app.services.scheduler.loaded(model_id).counters()


def alone(api, request: dict) -> str:
    """The reply to a request served alone (not streamed)."""
    r = api("POST", "/v1/chat/completions", request)
    assert r.status == 200, r.body
    return r.json["choices"][0]["message"]["content"]


def restart(api, model_id="tiny", **start):
    """A fresh context: no sequence, no cached prompt."""
    assert api("POST", f"/v1/models/{model_id}/stop").status == 200
    assert api("POST", f"/v1/models/{model_id}/start", {"cpu_threads": 1, **start}).status == 200


# --- sharing steps ------------------------------------------------------------------------


def test_four_streams_share_each_step_and_keep_their_own_tokens(app, tiny):
    streams = [Events(app, body(max_tokens=8, logit_bias=forced(i))) for i in range(4)]
    before = counters(app)["decodes"]
    round_robin(streams)
    assert [s.text for s in streams] == [c * 8 for c in LETTERS]
    assert all(s.finish == "length" and s.error is None for s in streams)
    # One at a time would take 4 x 8 decodes; sharing, each step serves every stream
    # that has joined (the last one joins at the fourth).
    assert counters(app)["decodes"] - before <= 8 + 3


def test_concurrent_requests_on_server_threads_all_complete(app, tiny):
    tokens, results, errors = 48, {}, []
    barrier = threading.Barrier(4, timeout=30)

    def client(i):
        try:
            stream = Events(app, body(max_tokens=tokens, logit_bias=forced(i)))
            stream.content()  # each has its first token before any reads on
            barrier.wait()
            results[i] = stream.finish_reading()
        except BaseException as exc:  # reported below
            errors.append(exc)

    before = counters(app)["decodes"]
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert [results[i].text for i in range(4)] == [c * tokens for c in LETTERS]
    # Every step gives every joined sequence its next token.
    assert counters(app)["decodes"] - before <= tokens + 12


def test_batched_greedy_replies_are_the_replies_served_alone(api, app, tiny):
    requests = [body(messages=user(p), max_tokens=16) for p in PROMPTS]
    solo = [alone(api, r) for r in requests]
    assert len(set(solo)) == len(solo)  # distinct, so a crossed sequence would show
    restart(api)
    streams = [Events(app, r) for r in requests]
    round_robin(streams)
    assert [s.text for s in streams] == solo


def test_a_json_schema_request_and_a_free_one_share_a_batch(api, app, tiny):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    constrained = {k: v for k, v in body(max_tokens=64).items() if k != "logit_bias"}
    constrained["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": "a", "schema": schema}}
    free = body(messages=user(PROMPTS[2]), max_tokens=32)
    expected = alone(api, free)
    restart(api)
    before = counters(app)["decodes"]
    streams = [Events(app, constrained), Events(app, free)]
    round_robin(streams)
    assert json.loads(streams[0].text)["answer"] in ("yes", "no")
    assert streams[0].finish == "stop"
    assert streams[1].text == expected and streams[1].finish == "length"
    assert counters(app)["decodes"] - before < 32 + len(streams[0].text)  # they overlapped


def test_stop_strings_usage_and_seeds_hold_sequence_by_sequence(api, app, tiny):
    free = body(messages=user(PROMPTS[1]), max_tokens=24)
    full = alone(api, free)
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2)
                if full[i:i + 2].strip() and "\ufffd" not in full[i:i + 2])
    sampled = body(messages=user(PROMPTS[3]), max_tokens=16, temperature=1.0, top_k=0,
                   top_p=1.0, min_p=0.0, seed=1234, stream_options={"include_usage": True})
    restart(api)
    streams = [Events(app, {**free, "stop": stop}), Events(app, body(
        max_tokens=16, logit_bias=forced(1), stream_options={"include_usage": True})),
        Events(app, sampled), Events(app, sampled)]
    round_robin(streams)
    cut, forced_t, first, second = streams
    assert cut.text == full[:full.index(stop)] and cut.finish == "stop"
    assert forced_t.text == "t" * 16 and forced_t.finish == "length"
    assert forced_t.usage["completion_tokens"] == 16
    assert first.text == second.text  # each has its own chain, seeded alike
    assert first.usage == second.usage and first.usage["completion_tokens"] == 16
    other = Events(app, {**sampled, "seed": 99}).finish_reading()
    assert other.text != first.text


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "F16"])
def test_quantized_and_f16_models_batch(api, app, quantized, tiny_f16, kind):
    path = tiny_f16 if kind == "F16" else quantized[kind]
    add_model(api, path, "m", start={})
    requests = [body(model="m", messages=user(p), max_tokens=12) for p in PROMPTS[:2]]
    solo = [alone(api, r) for r in requests]
    restart(api, "m")
    streams = [Events(app, body(model="m", logit_bias=forced(i))) for i in range(2)]
    streams += [Events(app, r) for r in requests]
    round_robin(streams)
    assert [s.text for s in streams[:2]] == ["e" * 8, "t" * 8]
    assert all(s.error is None and s.finish == "length" for s in streams)
    if kind != "F16":  # F16 logits differ in the last bits with the batch's shape
        assert [s.text for s in streams[2:]] == solo


# --- queueing, hang-ups, stopping -------------------------------------------------------


def requests_of(api, model_id="tiny") -> int:
    return {m["id"]: m["requests"] for m in api("GET", "/v1/models/status").json["data"]}[
        model_id]


def turn_of(app, model_id="tiny"):
    """The model's turns (its FairLock, one slot a request), from a lease given back."""
    lease = app.services.scheduler.lease(model_id)
    lease.release()
    return lease.running.turn


def test_a_fifth_request_waits_for_a_slot_then_runs(api, app, tiny):
    turn = turn_of(app)
    streams = [Events(app, body(max_tokens=64, logit_bias=forced(i))) for i in range(4)]
    for s in streams:
        s.content()
    fifth = {}

    def client():
        fifth["stream"] = Events(app, body(max_tokens=8, logit_bias=forced(0)))
        fifth["stream"].finish_reading()

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    # In the queue, it found no free slot: only a reply that ends lets it out.
    wait_for(lambda: turn.waiting == 1, what="the fifth request queued for a slot")
    assert requests_of(api) == 5
    before = counters(app)["decodes"]
    while counters(app)["decodes"] < before + 2:  # the others go on: steps without it
        for s in streams[1:]:
            s.content()
    assert turn.waiting == 1 and "stream" not in fifth  # still waiting for a slot
    streams[0].finish_reading()  # its reply ends: the slot is free
    thread.join(30)
    assert fifth["stream"].text == "e" * 8 and fifth["stream"].finish == "length"
    round_robin(streams[1:])
    assert [s.text for s in streams] == [c * 64 for c in LETTERS]
    assert requests_of(api) == 0


def test_a_hang_up_frees_its_slot_for_a_queued_request_at_once(api, app, tiny):
    restart(api, n_parallel=2)
    hung, other = (Events(app, body(max_tokens=200, logit_bias=forced(i))) for i in range(2))
    hung.content()
    other.content()
    queued = {}

    def client():
        queued["stream"] = Events(app, body(max_tokens=8, logit_bias=forced(2)))
        queued["started"] = time.monotonic()
        queued["stream"].finish_reading()

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    wait_for(lambda: requests_of(api) == 3, what="the third request queued")
    hung.close()  # the client went away in the middle of its reply
    closed = time.monotonic()
    thread.join(30)
    assert queued["started"] - closed < 2.0
    assert queued["stream"].text == "a" * 8
    other.finish_reading()
    assert other.text == "t" * 200 and other.finish == "length"
    assert requests_of(api) == 0


def test_stopping_the_model_mid_batch_ends_every_stream_cleanly(api, app, tiny):
    streams = [Events(app, body(max_tokens=200, logit_bias=forced(i))) for i in range(3)]
    for _ in range(3):
        for s in streams:
            s.content()
    stopped = {}
    thread = threading.Thread(target=lambda: stopped.update(
        r=api("POST", "/v1/models/tiny/stop")), daemon=True)
    thread.start()
    wait_for(lambda: not app.services.scheduler.is_running("tiny"), what="the stop began")
    for s in streams:
        s.finish_reading()
        assert s.error["code"] == "model_stopped" and s.done
        assert s.text == LETTERS[streams.index(s)] * len(s.text)
    thread.join(30)
    assert stopped["r"].status == 200
    assert api("GET", "/v1/models/status").json["data"] == []


# --- the prompt cache ---------------------------------------------------------------------


def test_a_second_turn_reads_only_its_new_tokens(api, app, tiny):
    first = api("POST", "/v1/chat/completions", body(messages=user("hello there")))
    reply = first.json["choices"][0]["message"]["content"]
    conversation = user("hello there") + [{"role": "assistant", "content": reply}] + \
        user("and then?")
    before = counters(app)
    second = api("POST", "/v1/chat/completions", body(messages=conversation))
    after = counters(app)
    total, earlier = second.json["usage"]["prompt_tokens"], first.json["usage"]["prompt_tokens"]
    read = after["prompt_read"] - before["prompt_read"]
    assert second.json["usage"]["prompt_tokens_details"]["cached_tokens"] == total - read
    # The first turn's prompt is in the cache, and so is some of the reply.
    assert 1 < read <= total - earlier
    assert after["prompt_evaluated"] - before["prompt_evaluated"] == read  # llama.cpp's count

    restart(api, caching_enabled=False)
    api("POST", "/v1/chat/completions", body(messages=user("hello there")))
    before = counters(app)
    api("POST", "/v1/chat/completions", body(messages=conversation))
    assert counters(app)["prompt_read"] - before["prompt_read"] == total


def generate(app, model_id, messages, params):
    """A generation through the scheduler, as chat does it: (text, usage)."""
    lease = app.services.scheduler.lease(model_id)
    try:
        generation = lease.generate(messages, {"temperature": 0, **params})
        try:
            return "".join(lease.steps(generation)), generation.usage
        finally:
            generation.close()
    finally:
        lease.release()


def test_cached_tokens_are_counted_per_generation(app, tiny):
    text, usage = generate(app, "tiny", user("hello there"), {"max_tokens": 4,
                                                              "logit_bias": NO_EOS})
    assert usage["cached_tokens"] == 0
    _, again = generate(app, "tiny", user("hello there"), {"max_tokens": 4})
    assert again["cached_tokens"] == usage["prompt_tokens"] - 1  # the last one gives logits
    longer = user("hello there") + [{"role": "assistant", "content": text}] + user("more")
    _, third = generate(app, "tiny", longer, {"max_tokens": 4})
    assert usage["prompt_tokens"] <= third["cached_tokens"] < third["prompt_tokens"]


def test_a_second_conversation_keeps_the_first_ones_slot(app, tiny):
    """A new prompt that shares only the start of the chat template takes a free slot,
    not the one holding another conversation."""
    long = user("tell me a story about " + "a lighthouse keeper and " * 8)
    generate(app, "tiny", long, {"max_tokens": 4})
    _, other = generate(app, "tiny", user("hello"), {"max_tokens": 4})
    assert other["cached_tokens"] == 0
    _, back = generate(app, "tiny", long, {"max_tokens": 4})
    assert back["cached_tokens"] == back["prompt_tokens"] - 1


# --- grammars, status -----------------------------------------------------------------


def test_a_gbnf_grammar_goes_before_the_response_format(app, tiny):
    params = {"max_tokens": 16, "grammar": 'root ::= "ok" | "no"',
              "response_format": {"type": "json_object"}}
    text, _ = generate(app, "tiny", user("hello"), params)
    assert text in ("ok", "no")
    with pytest.raises(InvalidField) as caught:
        generate(app, "tiny", user("hello"), {"grammar": "root ::= ("})
    assert caught.value.param == "grammar"


def test_status_reports_slots_and_the_kv_cache(api, tiny):
    row, = api("GET", "/v1/models/status").json["data"]
    assert row["slots"] == 4 and row["options"]["n_parallel"] == 4
    assert 0 < row["kvCache"] < row["ram"]
    restart(api, n_parallel=2)
    two, = api("GET", "/v1/models/status").json["data"]
    assert two["slots"] == 2 and two["kvCache"] * 2 == row["kvCache"]
    r = api("POST", "/v1/models/tiny/start", {"n_parallel": 0})
    assert r.status == 400 and r.json["error"]["param"] == "n_parallel"
    assert api("PATCH", "/v1/models/tiny", {"n_parallel": 3}).status == 200


# --- the Batcher, with a pretend engine ---------------------------------------------------


class Engine:
    """Decodes nothing: each sampled token is 100 + the slot's id; token 0 ends."""

    def __init__(self):
        self.plans, self.trims, self.released = [], [], []

    def trim(self, slot, keep):
        self.trims.append((slot, keep))
        return True

    def decode(self, entries: list[Entry]) -> list[int]:
        self.plans.append([(e.seq, len(e.tokens), e.reading) for e in entries])
        return [100 + e.slot for e in entries if e.sample]

    def is_end(self, token):
        return token == 0

    def release(self, seq):
        self.released.append(seq)


def test_a_long_prompt_is_read_in_chunks_while_the_others_generate():
    engine = Engine()
    batcher = Batcher(2, 8, engine)
    talking, reading = Sequence([1, 2, 3], 50), Sequence(list(range(1, 21)), 50)
    batcher.join(talking)
    batcher.step()
    assert list(talking.ready) == [100]
    batcher.join(reading)
    for _ in range(3):
        batcher.step()
    steps = engine.plans[1:]
    assert all(sum(n for _, n, _ in plan) <= 8 for plan in steps)
    assert all(plan[0] == (talking, 1, False) for plan in steps)  # a token every step
    assert [n for plan in steps for seq, n, _ in plan if seq is reading] == [7, 7, 6]
    assert list(reading.ready) == [101] and len(talking.ready) == 4
    assert batcher.prompt_read == 3 + 20


def test_slots_are_chosen_by_the_longest_prefix_they_mostly_keep():
    engine = Engine()
    batcher = Batcher(3, 64, engine)

    def run(prompt):
        seq = Sequence(prompt, 2)
        batcher.join(seq)
        batcher.step()
        batcher.step()
        batcher.leave(seq)
        return seq

    a = run([1, 2, 3, 4, 5, 6, 7, 8])
    b = run([1, 2, 9, 9, 9, 9])  # shares 2 of a's 9 cached tokens: a free slot instead
    assert (a.slot.id, a.cached) == (0, 0) and (b.slot.id, b.cached) == (1, 0)
    c = run([1, 2, 3, 4, 5, 6, 7, 8, 100, 10])  # a's next turn
    assert (c.slot.id, c.cached) == (0, 9)
    d = run([1, 2, 3, 4, 5, 6, 7, 8, 100, 10])  # the same again: all but the last token
    assert (d.slot.id, d.cached) == (0, 9)
    assert engine.released == [a, b, c, d]
    nocache = Batcher(1, 64, Engine(), caching=False)
    e = Sequence([1, 2, 3], 2)
    nocache.join(e)
    nocache.step()
    assert e.cached == 0 and nocache.prompt_read == 3


def test_a_sequence_left_during_a_step_frees_its_slot_after_it():
    engine = Engine()
    batcher = Batcher(1, 64, engine)
    first, second = Sequence([1, 2], 10), Sequence([3, 4], 10)
    batcher.join(first)
    batcher.step()

    def decode_and_leave(entries):
        batcher.leave(first)  # the client hangs up while the step decodes
        assert engine.released == []
        return Engine.decode(engine, entries)

    engine.decode = decode_and_leave
    batcher.step()
    assert engine.released == [first] and batcher.slots[0].seq is None
    del engine.decode
    batcher.join(second)
    batcher.step()
    assert second.slot.id == 0 and list(second.ready) == [100]


def test_a_prompt_mostly_held_by_a_slot_takes_it_even_past_its_reply():
    """A long shared start (a system prompt, or a turn whose earlier reply the template
    rewrote) is reused though the slot caches much more after it."""
    batcher = Batcher(2, 64, Engine())
    long = Sequence(list(range(1, 21)), 2)
    batcher.join(long)
    batcher.step()
    batcher.leave(long)  # slot 0 caches 20 tokens
    short = Sequence(list(range(1, 9)) + [90, 91], 2)  # shares 8 of them
    batcher.join(short)
    batcher.step()
    assert (short.slot.id, short.cached) == (0, 8)


def test_a_model_that_cannot_cut_its_cache_reads_prompts_whole():
    """A recurrent model's memory cannot drop the end of a sequence: no cache reuse."""
    engine = Engine()
    engine.trim = lambda slot, keep: engine.trims.append((slot, keep)) or keep == 0
    batcher = Batcher(1, 64, engine)
    for _ in range(2):
        seq = Sequence([1, 2, 3, 4], 2)
        batcher.join(seq)
        batcher.step()
        batcher.leave(seq)
    assert seq.cached == 0 and batcher.prompt_read == 8
    assert engine.trims == [(0, 0), (0, 3), (0, 0)]


def test_a_step_lists_its_sequences_in_slot_order():
    """llama.cpp computes a run of consecutive sequence ids in one pass, so the batch
    goes in slot order whatever order the sequences came in."""
    engine = Engine()
    batcher = Batcher(3, 64, engine)
    a, b, c, d = (Sequence([i, i + 1], 8) for i in (10, 20, 30, 40))
    for seq in (a, b):
        batcher.join(seq)
    batcher.step()
    batcher.leave(a)  # slot 0 frees; c takes the never used slot 2, d then slot 0
    batcher.join(c)
    batcher.join(d)
    batcher.step()
    assert [s.slot.id for s in (b, c, d)] == [1, 2, 0]
    assert [seq for seq, _, _ in engine.plans[-1]] == [d, b, c]


def test_repeat_frequency_and_presence_penalties_steer_each_sequence(api, app, tiny):
    """The penalties reach llama.cpp's sampler (the prompt counts), sequence by sequence."""
    plain = body(messages=user(PROMPTS[0]), max_tokens=32)
    greedy = alone(api, plain)
    assert len(set(greedy)) < len(greedy)  # it repeats itself, so a penalty shows
    penalised = {**plain, "repeat_penalty": 10, "frequency_penalty": 2, "presence_penalty": 2}
    restart(api)
    streams = [Events(app, penalised), Events(app, plain)]
    round_robin(streams)
    assert streams[1].text == greedy
    assert streams[0].text != greedy and streams[0].finish == "length"
    assert alone(api, penalised) == streams[0].text


def _image(digest: str, n: int) -> list:
    """An image's positions in a prompt, as localrt.engines.llama.media writes them."""
    return [("image", digest, k) for k in range(n)]


def test_an_image_is_one_steps_work_beside_the_others_text():
    engine = Engine()
    batcher = Batcher(2, 64, engine)
    talking = Sequence([1, 2, 3], 50)
    batcher.join(talking)
    batcher.step()
    seeing = Sequence([1, 2] + _image("a", 4) + [3, 4], 50, images={2: "chunk-a"})
    batcher.join(seeing)
    for _ in range(3):
        batcher.step()
    steps = engine.plans[1:]
    assert all(plan[0] == (talking, 1, False) for plan in steps)  # a token every step
    mine = [[(n, e) for seq, n, e in plan if seq is seeing] for plan in steps]
    # the text before the image and the image (decoded in that order in one step), then
    # the text after it, whose last token samples, then its first generated token
    assert mine == [[(2, True), (4, True)], [(2, True)], [(1, False)]]
    assert list(seeing.ready) == [101, 101] and seeing.read == 8
    assert batcher.slots[1].tokens[:6] == [1, 2] + _image("a", 4)


def test_the_prompt_cache_keeps_an_image_whole_or_not_at_all():
    engine = Engine()
    batcher = Batcher(1, 64, engine)

    def run(prompt, images):
        seq = Sequence(prompt, 1, images=images)
        batcher.join(seq)
        while not seq.ended:
            batcher.step()
        batcher.leave(seq)
        return seq

    first = run([1, 2] + _image("a", 4) + [3, 4], {2: "a"})
    again = run([1, 2] + _image("a", 4) + [3, 4, 100, 5, 6], {2: "a"})  # the next turn
    assert (first.cached, again.cached) == (0, 8)  # the image's KV is reused
    other = run([1, 2] + _image("b", 4) + [3, 4], {2: "b"})  # another image, same place
    assert other.cached == 2
    # a cached prefix never ends inside an image
    assert whole_images([1, 2] + _image("c", 4) + [3], 4) == 2  # inside c: back to it
    assert whole_images([1, 2] + _image("c", 4) + [3], 6) == 6  # after it
    assert whole_images([1, 2] + _image("c", 4) + [3], 2) == 2  # at its start


def test_an_image_that_fails_ends_only_its_own_sequence():
    engine = Engine()
    batcher = Batcher(2, 64, engine)
    talking = Sequence([1, 2, 3], 50)
    seeing = Sequence([1] + _image("a", 2) + [3], 50, images={1: "a"})
    batcher.join(talking)
    batcher.join(seeing)

    def decode_failing_images(entries):
        for e in entries:
            if e.image is not None:
                e.failed = RuntimeError("encode failed")
        return Engine.decode(engine, entries)

    engine.decode = decode_failing_images
    batcher.step()
    batcher.step()
    assert isinstance(seeing.error, RuntimeError) and seeing.ended
    assert batcher.slots[1].tokens == [] and not talking.ended and len(talking.ready) == 2


class ThinkingEngine(Engine):
    """The pretend engine, with what a reasoning reply's sequence needs."""

    def __init__(self):
        super().__init__()
        self.fed, self.accepted = [], []

    def decode(self, entries: list[Entry]) -> list[int]:
        self.fed.append([(list(e.tokens), e.sample) for e in entries])
        return super().decode(entries)

    def accept(self, seq, tokens):
        self.accepted += tokens

    def constrain(self, seq):
        seq.sampler, seq.after_thinking = seq.after_thinking, None


def test_at_the_budget_the_end_of_thinking_is_fed_as_the_batch_has_room():
    from localrt.engines import reasoning

    texts = {100: "x", 7: "</th", 8: "ink>", 9: "\n"}
    engine = ThinkingEngine()
    batcher = Batcher(1, 1, engine)  # room for one token a step
    tracker = reasoning.Tracker(reasoning.SYNTAXES[-1], "thinking", 2,
                                lambda t: texts[t].encode(), lambda text: [7, 8, 9])
    seq = Sequence([1, 2], 20, sampler="free", thinking=tracker, after_thinking="grammar")
    batcher.join(seq)
    for _ in range(7):
        batcher.step()
    assert list(seq.ready) == [100, 100, 7, 8, 9, 100]
    assert engine.fed[2:] == [[([100], True)], [([100], False)], [([7], False)],
                              [([8], False)], [([9], True)]]
    assert engine.accepted == [7, 8, 9] and tracker.count == 2
    assert seq.sampler == "grammar" and seq.after_thinking is None
