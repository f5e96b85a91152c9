"""Hostile mix: the fuzzer's generated requests with issue 38's hostile requests mixed
in, against one running `localrt start`, timed (issue 38's "Done when").

Run it from the repository root (not collected by pytest):

    .venv/bin/python tests/bench/hostile_mix.py --seconds 60 [--seed 1] [--keep DIR]

One server runs throughout (`python -m localrt start --foreground --port 0`, its own
HOME, its log in the run's folder, loopback only). Its hub is the hub emulator and its
package index an empty loopback index, as in tests/test_fuzz.py, so nothing reaches the
internet whatever a request asks for. A tiny generated llama (with FIM tokens, its
ctx_len 64, its max_tokens 8) and a tiny BERT are imported, each on one CPU thread,
and the llama started, before the clock runs.

For --seconds, threads send requests at once:

- generated (--generators threads): schemathesis requests for every operation of the
  server's own GET /openapi.json, valid and invalid ones, as tests/test_fuzz.py makes
  them (the same operations: not DELETE /v1/system, not the endless GET /v1/events;
  POST /v1/models/remote invalid only, its upstream URLs moved to loopback so that no
  generated host name is looked up). The routes that run a model take their `model`
  fixed to the real one, as test_fuzz's second half does, and /v1/chat/completions
  with them; so that a generated chat stays cheap, a valid one asks for at most 8
  tokens and 2 choices (max_tokens, max_completion_tokens, max_output_tokens,
  num_predict, n, best_of). A PATCH /v1/configs is undone after it (the settings
  before the run are sent back), and a remote model a request registered is deleted;
  both, and the requests that go out to the hub or the index, hold one lock, so that
  a proxy setting of one request never makes another's pull a 502.
- hostile (--hostile threads), each kind in turn from a shuffled deck:
  grammar (json_schema, OpenAI and Anthropic tool schemas, Responses' and Ollama's
  formats asking for minItems/minLength/maxItems 100000000), long-id (a 60,000-
  character model id, in bodies and paths, in every dialect), nest-1000 and
  nest-100000 (a body nested that deep, on every route that reads a body, OpenAI's,
  Anthropic's, Ollama's and localrt's own, in turn, and on /api/chat and /v1/messages
  every time), prompt-10MiB (10 MiB of prompt on the chat routes; just under the 1 MiB
  body limit on completions and embeddings, and over it once), adversarial-1MB (1 MB
  strings built to make a backtracking regex take hours: as logit_bias keys, model
  ids, paths, proxy URLs, origins, keep_alive, a message; 200 KB in a Host or Origin
  header and in paths, under the server's header limit), hosts (no Host header, two
  Host headers, one Host with two values, an empty one), and queue (a burst of
  QUEUE_BURST chats at once, past the 16 in progress, half of them streamed, with GET
  /v1/models probed throughout; at most one burst every BURST_EVERY seconds).

Every request's status and latency is recorded. An answer is timed from the moment its
connection is opened to the moment its status line and headers have arrived: for a
stream, the start of the stream; for any other reply, its whole work, the generation of
a non-streamed chat included. Requests that wait their turn on the model by design are
the one exception, shown on rows of their own and not held to the second: a queue
burst's chats (the issue's queue, not a wall), and any request for the model, generated
or a 10 MiB prompt (which is measured with the model's template and vocabulary, in its
turn), that was in flight while a burst's chats were queued. What is held for them is
that each burst chat is answered (a 200: no 503, no 5xx), and every other request,
GET /v1/models during the bursts included, to the second. A request with no answer
within --timeout seconds (status 0) is a failure of its own; a burst stuck for STUCK
seconds has the server's admission counts (/metrics) and its threads' stacks (SIGUSR1,
faulthandler) written to the report and the server's log.

At the end it prints a table: the requests of each source and kind, their 5xx (target
0), the slowest answer and how many took over a second (target 0), those with no
answer (target 0), then each offending request. It exits 1 when a target is missed or
the server died. --seed orders the operations and picks the hostile requests;
hypothesis draws the generated ones afresh each run, as test_fuzz does.
"""

from __future__ import annotations

import argparse
import collections
import copy
import http.client
import json
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from support.fuzzing import GENERATES  # noqa: E402
from support.servers import LoggedServer  # noqa: E402

BOUND = 1.0  # seconds: the "no answer slower than a second"
MB = 1024 * 1024
HUGE = 100_000_000  # the minItems and minLength
MODEL, EMBEDDER = "mix-tiny", "mix-bert"  # ids no generated string is likely to hit
QUEUE_BURST = 40  # chats at once: 16 in progress (admission.LIMITS["chat"]), 24 waiting
# Seconds from one burst's end to the next one's start at the least: while a burst's
# chats queue, every request for the model waits behind them (not held to the bound),
# and the generated ones should mostly be held to it.
BURST_EVERY = 5.0
ASK = [{"role": "user", "content": "hi"}]
GENERATION_CAP = 8  # tokens a valid generated request may ask for
STUCK = 10.0  # seconds: a burst this long is stuck; the server's threads go to its log

# As tests/test_fuzz.py: DELETE /v1/system stops the server, GET /v1/events never ends.
NOT_FUZZED = {("DELETE", "/v1/system"), ("GET", "/v1/events")}
ONLY_NEGATIVE = {("POST", "/v1/models/remote")}
# The routes that run a model, their request schema and the model they get.
WITH_A_MODEL = {"/v1/chat/completions": ("chat-completion", MODEL),
                "/v1/completions": ("completion", MODEL),
                "/v1/embeddings": ("embedding", EMBEDDER),
                "/v1/responses": ("response-create", MODEL),
                "/v1/messages": ("anthropic-messages", MODEL),
                "/v1/messages/count_tokens": ("anthropic-count-tokens", MODEL),
                "/api/chat": ("ollama-chat", MODEL), "/api/generate": ("ollama-generate", MODEL),
                "/api/embed": ("ollama-embed", EMBEDDER)}
# Fields that make a generation long, and the most a valid generated request asks.
CAPS = {"max_tokens": GENERATION_CAP, "max_completion_tokens": GENERATION_CAP,
        "max_output_tokens": GENERATION_CAP, "n": 2, "best_of": 2}
# Operations whose effect reaches other requests (a proxy setting, a remote model that
# never answers) or that go out to the hub or the index: one at a time, under a lock.
SETTLING = {("PATCH", "/v1/configs"), ("POST", "/v1/models/remote")}
OUTBOUND = re.compile(r"pull|install|releases|variants")


@dataclass
class Answer:
    """One request: where it came from, what it was, and how it was answered."""

    source: str      # "generated", or the hostile kind
    what: str        # method, path and a word on the body
    status: int      # 0: no answer within the timeout, or the connection failed
    seconds: float   # to the status line and headers
    note: str = ""   # the reply's start, for a 5xx or a failure
    bounded: bool = True  # held to BOUND (a queued burst chat is not)
    at: float = 0.0  # when it was sent, in seconds since the run began
    model: bool = False  # sent to a route that runs a model


class Record:
    """Every answer, from every thread."""

    def __init__(self):
        self._lock = threading.Lock()  # guards answers and failures
        self.started = time.monotonic()
        self.answers: list[Answer] = []
        self.failures: list[str] = []  # a generator that failed to make a request
        self.bursts: list[tuple[float, float]] = []  # each queue burst's (start, end)

    def add(self, answer: Answer) -> None:
        """Keep one answer."""
        with self._lock:
            self.answers.append(answer)

    def failure(self, what: str) -> None:
        """Keep a failure to generate (schemathesis' or hypothesis's own)."""
        with self._lock:
            self.failures.append(what)

    def burst(self, start: float, end: float) -> None:
        """Keep the time a queue burst's chats were in flight."""
        with self._lock:
            self.bursts.append((start, end))

    def now(self) -> float:
        """Seconds since the record began."""
        return time.monotonic() - self.started


# --- the server -------------------------------------------------------------------


DUMPABLE = ("import faulthandler, runpy, signal, sys; "
            "faulthandler.register(signal.SIGUSR1, all_threads=True); "
            "sys.argv[0] = 'localrt'; runpy.run_module('localrt', run_name='__main__')")


class Server(LoggedServer):
    """The server, started with faulthandler on SIGUSR1 so that a stuck request's
    threads can be seen in its log (dump_threads)."""

    def __init__(self, folder: Path):
        super().__init__(folder, [sys.executable, "-c", DUMPABLE])

    def start(self, hub_url: str, index_url: str) -> None:
        """Point it at the emulators and start it."""
        super().start({"modelHubUrl": hub_url, "engineIndexUrl": index_url})

    def dump_threads(self) -> None:
        """Every server thread's stack, into its log."""
        if self.alive():
            self.process.send_signal(signal.SIGUSR1)


def exchange(port: int, method: str, path: str, body: bytes | None = None,
             headers: dict | None = None, hosts: list[str] | None = None,
             timeout: float = 30.0) -> tuple[int, float, bytes]:
    """One request on its own connection: (status, seconds to the status line and
    headers, the reply's body); status 0 when no reply came. `hosts` sends exactly
    these Host headers (none, one or several) instead of the usual one."""
    began = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_host=hosts is not None,
                        skip_accept_encoding=True)
        for host in hosts or ():
            conn.putheader("Host", host)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        took = time.perf_counter() - began
        return resp.status, took, resp.read()
    except (OSError, http.client.HTTPException) as exc:
        return 0, time.perf_counter() - began, repr(exc).encode()
    finally:
        conn.close()


def setup_models(srv: Server, folder: Path) -> None:
    """Import the tiny llama and BERT, start the llama. Each runs on one thread (two
    on a loaded two-core machine stall each other's decode), and the llama has a 64-token
    context and gives GENERATION_CAP tokens to a request that does not say how many, so
    that no generated request makes a long reply; a request for the model that stops
    it (keep_alive 0) starts it again with these."""
    from emulators.ggufgen import FIM_TOKENS, write_bert_gguf, write_gguf

    weights = folder / "weights"
    weights.mkdir(exist_ok=True)
    llama = write_gguf(weights / "tiny.gguf", added_tokens=FIM_TOKENS)
    bert = write_bert_gguf(weights / "bert.gguf")
    steps = [("POST", "/v1/models/import", {"path": str(llama), "id": MODEL}),
             ("POST", "/v1/models/import", {"path": str(bert), "id": EMBEDDER}),
             ("PATCH", f"/v1/models/{MODEL}", {"ctx_len": 64, "cpu_threads": 1,
                                               "max_tokens": GENERATION_CAP}),
             ("PATCH", f"/v1/models/{EMBEDDER}", {"cpu_threads": 1}),
             ("POST", f"/v1/models/{MODEL}/start", {"cpu_threads": 1})]
    for method, path, body in steps:
        status, _, reply = exchange(srv.port, method, path, json.dumps(body).encode(),
                                    timeout=120)
        if status != 200:
            raise SystemExit(f"{method} {path}: {status} {reply[:300]!r}")


# --- generated requests -------------------------------------------------------------


def documents(srv: Server) -> dict:
    """{mode: (the server's document, the same with each model route's `model` fixed)}
    as schemathesis schemas."""
    import schemathesis

    status, _, raw = exchange(srv.port, "GET", "/openapi.json")
    assert status == 200, raw[:300]
    served = json.loads(raw)
    out = {}
    for mode in ("positive", "negative"):
        doc = copy.deepcopy(served)
        components = doc["components"]["schemas"]
        for schema, model_id in WITH_A_MODEL.values():
            components[schema]["properties"]["model"] = {"const": model_id}
        if mode == "positive":
            for schema, field, shape in GENERATES:
                components[schema]["required"] = ["model", field]
                components[schema]["properties"][field] = {
                    **components[schema]["properties"][field], **shape}
            cap(doc)
        plain = schemathesis.openapi.from_dict(served)
        fixed = schemathesis.openapi.from_dict(doc)
        for schema in (plain, fixed):
            schema.config.update(base_url=srv.url)
        out[mode] = (plain, fixed)
    return out


def cap(doc: dict) -> None:
    """Valid requests ask for few tokens and choices (CAPS), wherever the fields are."""
    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in CAPS and isinstance(value, dict) and "maximum" in value:
                    value["maximum"] = CAPS[key]
                elif key == "num_predict" and isinstance(value, dict):
                    value["minimum"], value["maximum"] = 1, GENERATION_CAP
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc["components"]["schemas"])


def operations() -> list[tuple[str, str, str]]:
    """(method, path, mode) of every operation fuzzed, as test_fuzz's CASES."""
    from localrt.api import ROUTES
    from localrt.openapi import document_path

    ops = sorted({(r.method, document_path(r.pattern)) for r in ROUTES} - NOT_FUZZED)
    breakable = {(r.method, document_path(r.pattern)) for r in ROUTES if r.schema}
    return [(m, p, mode) for m, p in ops for mode in ("positive", "negative")
            if (mode == "positive" and (m, p) not in ONLY_NEGATIVE) or (m, p) in breakable]


class Generated:
    """One thread's generated requests: each operation in turn, `examples` at a time."""

    def __init__(self, srv: Server, docs: dict, cases: list, record: Record,
                 settle: threading.Lock, deadline: float, examples: int, timeout: float,
                 baseline: bytes):
        self.srv, self.docs, self.cases, self.record = srv, docs, cases, record
        self.baseline = baseline  # the settings before the run, as PATCH /v1/configs takes
        self.settle, self.deadline = settle, deadline
        self.examples, self.timeout = examples, timeout

    def run(self) -> None:
        """Until the deadline."""
        while time.monotonic() < self.deadline:
            for method, path, mode in self.cases:
                if time.monotonic() >= self.deadline:
                    return
                self.one_operation(method, path, mode)

    def one_operation(self, method: str, path: str, mode: str) -> None:
        """`examples` requests to one operation, generated in `mode`."""
        import schemathesis
        from hypothesis import HealthCheck, given, settings

        plain, fixed = self.docs[mode]
        operation = (fixed if path in WITH_A_MODEL else plain)[path][method]
        strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
        exclusive = (method, path) in SETTLING or OUTBOUND.search(path)

        @given(case=strategy)
        @settings(max_examples=self.examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            if time.monotonic() >= self.deadline:
                return
            if exclusive:
                with self.settle:
                    self.call(case, method, path, mode)
                    self.undo(method, path)
            else:
                self.call(case, method, path, mode)

        try:
            run()
        except Exception as exc:  # noqa: BLE001 - the generator's failure, not the server's
            lines = str(exc).strip().splitlines() or [""]
            self.record.failure(f"{method} {path} ({mode}): {type(exc).__name__}: "
                                f"{lines[-1][:200]}")

    def call(self, case, method: str, path: str, mode: str) -> None:
        """Send one case; record its status and its time to the headers."""
        if (method, path) == ("POST", "/v1/models/remote"):
            on_loopback(case.body)
        what = f"{method} {path} ({mode})"
        at = self.record.now()
        began = time.perf_counter()
        try:
            response = case.call(timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - a request with no answer is recorded
            self.record.add(Answer("generated", what, 0, time.perf_counter() - began,
                                   f"{exc!r}"[:300] + " " + curl(case), at=at,
                                   model=path in WITH_A_MODEL))
            return
        note = ""
        if response.status_code >= 500 or response.elapsed > BOUND:
            note = f"{response.content[:300]!r} {curl(case)}"
        self.record.add(Answer("generated", what, response.status_code, response.elapsed,
                               note, at=at, model=path in WITH_A_MODEL))

    def undo(self, method: str, path: str) -> None:
        """Put back what a settling operation changed (test_fuzz does the same)."""
        if (method, path) == ("PATCH", "/v1/configs"):
            exchange(self.srv.port, "PATCH", "/v1/configs", self.baseline)
        if (method, path) == ("POST", "/v1/models/remote"):
            status, _, raw = exchange(self.srv.port, "GET", "/v1/models")
            if status == 200:
                from urllib.parse import quote

                for model in json.loads(raw)["data"]:
                    if model.get("engine") == "remote":
                        exchange(self.srv.port, "DELETE",
                                 "/v1/models/" + quote(model["id"], safe=""))


def on_loopback(body) -> None:
    """An upstream URL a remote model's request names points at loopback, its scheme,
    port and path kept: a valid registration probes its upstreams, and a generated host
    name would be looked up in DNS (test_fuzz fuzzes only invalid bodies there)."""
    from urllib.parse import urlsplit, urlunsplit

    upstreams = body.get("upstreams") if isinstance(body, dict) else None
    for upstream in upstreams if isinstance(upstreams, list) else ():
        url = upstream.get("url") if isinstance(upstream, dict) else None
        if not isinstance(url, str):
            continue
        try:
            parts = urlsplit(url)
            port = f":{parts.port}" if parts.port else ""
        except ValueError:
            continue
        if parts.hostname:
            upstream["url"] = urlunsplit(parts._replace(netloc="127.0.0.1" + port))


def curl(case) -> str:
    """A case as a curl command, cut short: enough to tell it again."""
    try:
        return case.as_curl_command()[:600]
    except Exception:  # noqa: BLE001 - only a label
        return ""


# --- hostile requests -------------------------------------------------------------------


def array_of(count_key: str, count) -> dict:
    return {"type": "object", "properties": {"a": {
        "type": "array", "items": {"type": "integer"}, count_key: count}}}


def string_of(count_key: str, count) -> dict:
    return {"type": "object", "properties": {"a": {"type": "string", count_key: count}}}


def grammar_requests() -> list[tuple[str, str, dict]]:
    """(label, path, body): schemas whose grammar would be huge, in every dialect."""
    return [
        ("json_schema minItems", "/v1/chat/completions",
         {"model": MODEL, "messages": ASK, "response_format": {"type": "json_schema",
          "json_schema": {"name": "x", "schema": array_of("minItems", HUGE)}}}),
        ("json_schema minLength", "/v1/chat/completions",
         {"model": MODEL, "messages": ASK, "response_format": {"type": "json_schema",
          "json_schema": {"name": "x", "schema": string_of("minLength", HUGE)}}}),
        ("OpenAI tool minItems", "/v1/chat/completions",
         {"model": MODEL, "messages": ASK, "tool_choice": "required", "tools": [
             {"type": "function", "function": {"name": "f",
                                               "parameters": array_of("minItems", HUGE)}}]}),
        ("OpenAI tool minLength, streamed", "/v1/chat/completions",
         {"model": MODEL, "messages": ASK, "stream": True, "tool_choice": "required",
          "tools": [{"type": "function", "function": {
              "name": "f", "parameters": string_of("minLength", HUGE)}}]}),
        ("Anthropic input_schema minItems", "/v1/messages",
         {"model": MODEL, "max_tokens": 8, "messages": ASK, "tool_choice": {"type": "any"},
          "tools": [{"name": "f", "input_schema": array_of("minItems", HUGE)}]}),
        ("Anthropic input_schema minLength", "/v1/messages",
         {"model": MODEL, "max_tokens": 8, "messages": ASK, "tool_choice": {"type": "any"},
          "tools": [{"name": "f", "input_schema": string_of("minLength", HUGE)}]}),
        ("Anthropic output_config maxItems", "/v1/messages",
         {"model": MODEL, "max_tokens": 8, "messages": ASK, "output_config": {"format": {
             "type": "json_schema", "schema": array_of("maxItems", HUGE)}}}),
        ("Responses text.format maxLength", "/v1/responses",
         {"model": MODEL, "input": "hi", "text": {"format": {
             "type": "json_schema", "name": "x", "schema": string_of("maxLength", HUGE)}}}),
        ("Responses tool minItems", "/v1/responses",
         {"model": MODEL, "input": "hi", "tool_choice": "required", "tools": [
             {"type": "function", "name": "f", "parameters": array_of("minItems", HUGE)}]}),
        ("Ollama format minItems", "/api/chat",
         {"model": MODEL, "messages": ASK, "stream": False, "format": array_of("minItems", HUGE)}),
        ("Ollama tool minLength", "/api/chat",
         {"model": MODEL, "messages": ASK, "tools": [{"type": "function", "function": {
             "name": "f", "parameters": string_of("minLength", HUGE)}}],
          "format": string_of("minLength", HUGE)}),
        ("Ollama generate format minItems", "/api/generate",
         {"model": MODEL, "prompt": "hi", "stream": False, "format": array_of("minItems", HUGE)}),
    ]


def long_id_requests() -> list[tuple[str, str, str, dict | None]]:
    """(label, method, path, body): a 60,000-character model id, in bodies and paths."""
    long_id = "m" * 60_000
    return [
        ("chat", "POST", "/v1/chat/completions", {"model": long_id, "messages": ASK}),
        ("messages", "POST", "/v1/messages",
         {"model": long_id, "max_tokens": 1, "messages": ASK}),
        ("responses", "POST", "/v1/responses", {"model": long_id, "input": "hi"}),
        ("completions", "POST", "/v1/completions", {"model": long_id, "prompt": "hi"}),
        ("embeddings", "POST", "/v1/embeddings", {"model": long_id, "input": "hi"}),
        ("ollama chat", "POST", "/api/chat", {"model": long_id, "messages": ASK}),
        ("ollama show", "POST", "/api/show", {"model": long_id}),
        ("pull", "POST", "/v1/models/pull", {"model": long_id}),
        ("start", "POST", f"/v1/models/{long_id}/start", {}),
        ("get", "GET", f"/v1/models/{long_id}", None),
    ]


def body_routes() -> list[tuple[str, str]]:
    """(method, path) of every route that reads a body, its parameters filled."""
    from localrt.api import ROUTES

    return [(r.method, re.sub(r"\{\w+(:path)?\}", MODEL, r.pattern))
            for r in ROUTES if r.schema is not None]


# 1 MB built to make a backtracking regex take hours (test_hostile_requests' ADVERSARIAL).
ADVERSARIAL = ["1" * MB + "x", "1:" * (MB // 2) + "x", "1:1," * (MB // 4) + "x",
               "a" * MB + "!", "a." * (MB // 2) + "!", "1m" * (MB // 2) + "x",
               "1.1" * (MB // 3) + "x", "<" * MB, "[" * MB, "http://" + "a" * MB + " ",
               "Q1_" * (MB // 3) + "!", "-00001-of-" * (MB // 10), "a://" * (MB // 4),
               "http://user:pw@" * (MB // 15)]
BODY_TEXT = 1_000_000  # 1 MB, with room in the body limit (app.MAX_BODY, 1 MiB) for the rest
HEADER_SIZE = 200_000  # under waitress's 256 KiB limit on a request's headers


def adversarial_requests(rng: random.Random) -> list[tuple]:
    """(label, method, path, body, headers): 1 MB adversarial strings where a regex or
    an error message meets them."""
    text = rng.choice(ADVERSARIAL)[:BODY_TEXT]
    short = text[:HEADER_SIZE]
    path_safe = re.sub(r"[^A-Za-z0-9._~:-]", "-", short)
    return [
        ("logit_bias key", "POST", "/v1/chat/completions",
         {"model": MODEL, "messages": ASK, "logit_bias": {text: 1}}, {}),
        ("pull id", "POST", "/v1/models/pull", {"model": text}, {}),
        ("ollama pull id", "POST", "/api/pull", {"model": text}, {}),
        ("import id", "POST", "/v1/models/import", {"path": "/nonexistent", "id": text}, {}),
        ("proxy_url", "PATCH", "/v1/configs", {"proxy_url": text}, {}),
        ("allowed_origins", "PATCH", "/v1/configs", {"allowed_origins": [text]}, {}),
        ("keep_alive", "POST", "/api/chat",
         {"model": MODEL, "messages": ASK, "keep_alive": text}, {}),
        ("remote url", "POST", "/v1/models/remote",
         {"id": "r", "upstreams": [{"url": text}]}, {}),
        ("chat message", "POST", "/v1/chat/completions",
         {"model": MODEL + text[:1000], "messages": [{"role": "user", "content": text}]}, {}),
        ("Host header", "GET", "/healthz", None, {"Host": short}),
        ("Origin header", "POST", "/v1/models/pull", {"model": "a"},
         {"Origin": "http://" + short}),
        ("model path", "POST", f"/v1/models/{path_safe}/start", {}, {}),
        ("response path", "GET", f"/v1/responses/{path_safe}", None, {}),
        ("engine path", "GET", f"/v1/engines/{path_safe}", None, {}),
        ("web path", "GET", f"/web/{path_safe}", None, {}),
    ]


class Hostile:
    """One thread's hostile requests: each kind in turn, from a shuffled deck."""

    KINDS = ("grammar", "long-id", "nest-1000", "nest-100000", "prompt-10MiB",
             "adversarial-1MB", "hosts", "queue")

    def __init__(self, srv: Server, record: Record, deadline: float, seed: int,
                 timeout: float, burst: threading.Lock, settle: threading.Lock):
        self.srv, self.record, self.deadline = srv, record, deadline
        self.rng = random.Random(seed)
        self.timeout = timeout
        self.burst = burst  # one queue burst at a time
        # A generated PATCH /v1/configs may allow any origin for a moment; then the
        # 200 KB Origin comes back in Access-Control-Allow-Origin, a header line longer
        # than a client reads (http.client's limit is 64 KiB).
        self.settle = settle
        self.routes = body_routes()
        self.turn = collections.Counter()

    def run(self) -> None:
        """Until the deadline."""
        while time.monotonic() < self.deadline:
            deck = list(self.KINDS)
            self.rng.shuffle(deck)
            for kind in deck:
                if time.monotonic() >= self.deadline:
                    return
                getattr(self, "kind_" + kind.split("-")[0].replace("adversarial", "adv"))(kind)
                self.turn[kind] += 1

    def send(self, kind: str, label: str, method: str, path: str, body=None,
             headers=None, hosts=None, raw: bytes | None = None, bounded=True,
             model=False) -> int:
        """One hostile request, recorded; its status."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        at = self.record.now()
        status, took, reply = exchange(self.srv.port, method, path, data, headers, hosts,
                                       self.timeout)
        note = ""
        if status >= 500 or status == 0 or (bounded and took > BOUND):
            note = reply[:300].decode("utf-8", "replace")
        shown_path = path if len(path) < 80 else path[:60] + f"...({len(path)} chars)"
        self.record.add(Answer(kind, f"{method} {shown_path} [{label}]", status, took, note,
                               bounded, at=at, model=model))
        return status

    def stuck(self, kind: str) -> None:
        """Keep the server's admission counts and its threads' stacks (in its log)."""
        status, _, raw = exchange(self.srv.port, "GET", "/metrics")
        counts = [line for line in raw.decode("utf-8", "replace").splitlines()
                  if "kind=" in line and not line.startswith("#")]
        self.record.add(Answer(kind, "GET /metrics [a burst stuck]", status, 0.0,
                               " | ".join(counts), at=self.record.now()))
        self.srv.dump_threads()

    def pick(self, kind: str, items: list):
        """The next item of a kind's list, in turn."""
        return items[self.turn[kind] % len(items)]

    def kind_grammar(self, kind):
        for label, path, body in grammar_requests():
            self.send(kind, label, "POST", path, body)

    def kind_long(self, kind):
        for label, method, path, body in long_id_requests():
            self.send(kind, label, method, path, body)

    def kind_nest(self, kind):
        levels = int(kind.split("-")[1])
        raw = ('{"model": "' + MODEL + '", "messages": ' + "[" * levels + "]" * levels
               + "}").encode()
        for step in range(4):  # four routes a turn, every route in time
            method, path = self.routes[(self.turn[kind] * 4 + step) % len(self.routes)]
            self.send(kind, "body", method, path, raw=raw)
        for path in ("/api/chat", "/v1/messages"):  # Ollama's and Anthropic's, every turn
            self.send(kind, "body", "POST", path, raw=raw)

    def kind_prompt(self, kind):
        ten = 10 * MB
        # (label, path, body, whether it reaches the model): a prompt is measured with
        # the model's template and vocabulary, in its turn, so one sent during a queue
        # burst waits behind it, as any request for the model does; a body past the
        # route's limit (10 MiB of completion) is refused before any wait.
        requests_ = [
            ("chat", "/v1/chat/completions",
             {"model": MODEL, "messages": [{"role": "user", "content": "a " * (ten // 2)}]},
             True),
            ("messages", "/v1/messages",
             {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "b" * ten}]},
             True),
            ("ollama chat", "/api/chat",
             {"model": MODEL, "stream": False, "messages": [{"role": "user", "content": "c" * ten}]},
             True),
            ("responses", "/v1/responses", {"model": MODEL, "input": "d " * (ten // 2)}, True),
            ("completions, under 1 MiB", "/v1/completions",
             {"model": MODEL, "prompt": "e " * (MB // 2 - 64)}, True),
            ("embeddings, under 1 MiB", "/v1/embeddings",
             {"model": MODEL, "input": ["short", "f " * (MB // 2 - 64)]}, True),
            ("completions, 10 MiB", "/v1/completions", {"model": MODEL, "prompt": "g" * ten},
             False),
        ]
        label, path, body, reaches = self.pick(kind, requests_)
        self.send(kind, label, "POST", path, body, model=reaches)

    def kind_adv(self, kind):
        for label, method, path, body, headers in adversarial_requests(self.rng):
            if "Origin" in headers:
                with self.settle:
                    self.send(kind, label, method, path, body, headers)
            else:
                self.send(kind, label, method, path, body, headers)

    def kind_hosts(self, kind):
        own = f"127.0.0.1:{self.srv.port}"
        for label, hosts in (("no Host", []), ("two Host headers", [own, "evil.example"]),
                             ("one Host, two values", [f"{own}, evil.example"]),
                             ("empty Host", [""])):
            for method, path, body in (("GET", "/healthz", None),
                                       ("POST", "/v1/chat/completions",
                                        {"model": MODEL, "messages": ASK, "max_tokens": 1})):
                self.send(kind, label, method, path, body, hosts=hosts)

    def kind_queue(self, kind):
        """QUEUE_BURST chats at once on the one model, and GET /v1/models meanwhile;
        none while the last burst ended less than BURST_EVERY seconds ago."""
        with self.burst:
            if self.record.bursts and self.record.now() - self.record.bursts[-1][1] < BURST_EVERY:
                return
            go = threading.Barrier(QUEUE_BURST + 1)
            body = {"model": MODEL, "messages": ASK, "max_tokens": 2}

            def chat(n):
                go.wait()
                stream = bool(n % 2)
                self.send(kind, f"burst chat {n}{', streamed' if stream else ''}", "POST",
                          "/v1/chat/completions", dict(body, stream=stream), bounded=False)

            threads = [threading.Thread(target=chat, args=(n,), daemon=True)
                       for n in range(QUEUE_BURST)]
            for thread in threads:
                thread.start()
            go.wait()
            start, looked = self.record.now(), False
            while any(t.is_alive() for t in threads):
                self.send(kind, "GET /v1/models during the burst", "GET", "/v1/models")
                if not looked and self.record.now() - start > STUCK:
                    looked = True  # a burst this long is stuck: what the server says
                    self.stuck(kind)
                time.sleep(0.05)
            for thread in threads:
                thread.join()
            self.record.burst(start, self.record.now())


# --- the run and its table ---------------------------------------------------------------


def config_baseline(srv: Server) -> bytes:
    """The server's settings now, as a PATCH /v1/configs body that puts them back."""
    from localrt import schemas

    status, _, raw = exchange(srv.port, "GET", "/v1/configs")
    assert status == 200, raw[:300]
    fields = schemas.load("config-update.json")["properties"]
    return json.dumps({k: v for k, v in json.loads(raw).items() if k in fields}).encode()


def run(seconds: float, seed: int, folder: Path, generators: int, hostiles: int,
        examples: int, timeout: float) -> dict:
    """The mix; its record, summed."""
    from emulators.ggufgen import write_gguf
    from emulators.hubemu import HubEmulator
    from emulators.pkgindex import PackageIndex

    index_dir = folder / "index"
    index_dir.mkdir(parents=True, exist_ok=True)
    hub_file = write_gguf(folder / "hub-tiny.gguf", name="tiny")
    srv = Server(folder)
    record = Record()
    with HubEmulator() as hub, PackageIndex(index_dir) as index:
        hub.add_repo("org/tiny", {"tiny.gguf": hub_file})
        srv.start(hub.url, index.url)
        try:
            setup_models(srv, folder)
            cases = operations()
            random.Random(seed).shuffle(cases)
            settle, burst = threading.Lock(), threading.Lock()
            # Each thread its own schemas: hypothesis draws from a strategy in one thread.
            docs = [documents(srv) for _ in range(generators)]
            baseline = config_baseline(srv)
            started = record.started = time.monotonic()
            deadline = started + seconds
            workers = [Generated(srv, docs[i], cases[i::generators], record, settle,
                                 deadline, examples, timeout, baseline)
                       for i in range(generators)]
            workers += [Hostile(srv, record, deadline, seed + i, timeout, burst, settle)
                        for i in range(hostiles)]
            threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            elapsed = time.monotonic() - started
            alive = srv.alive()
        finally:
            srv.close()
    return summary(record, elapsed, alive, seed)


def summary(record: Record, elapsed: float, alive: bool, seed: int) -> dict:
    """Counts per source, the 5xx, the slow answers and the requests with no answer."""
    answers = record.answers
    for a in answers:  # a model's request sent while a burst's chats queue waits behind them
        if a.model and any(a.at < end and start < a.at + a.seconds
                           for start, end in record.bursts):
            a.bounded = False
    rows: dict[str, dict] = {}
    for a in answers:
        key = a.source if a.bounded else a.source + " (waits its turn)"
        row = rows.setdefault(key, {"requests": 0, "5xx": 0, "slowest": 0.0, "over": 0,
                                    "none": 0, "statuses": collections.Counter()})
        row["requests"] += 1
        row["statuses"][a.status] += 1
        row["5xx"] += a.status >= 500
        row["slowest"] = max(row["slowest"], a.seconds)
        row["over"] += a.bounded and a.seconds > BOUND and a.status != 0
        row["none"] += a.status == 0
    labels: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for a in answers:  # each hostile request's label and status, for --json
        if a.source != "generated" and a.bounded:
            labels[a.source][f"{a.what.split('[')[-1].rstrip(']')}: {a.status}"] += 1
    fivexx = [a for a in answers if a.status >= 500]
    slow = [a for a in answers if a.bounded and a.seconds > BOUND and a.status != 0]
    none = [a for a in answers if a.status == 0]
    # The queue answers each burst chat: a 503 would be the wall, a 4xx a refusal.
    refused = [a for a in answers if "[burst chat" in a.what and a.status not in (0, 200)]
    stuck = [a for a in answers if "[a burst stuck]" in a.what]
    near = sorted((a for a in answers if a.bounded and BOUND / 2 < a.seconds <= BOUND),
                  key=lambda a: -a.seconds)
    return {"seed": seed, "seconds": round(elapsed, 1), "alive": alive, "rows": rows,
            "fivexx": [vars(a) for a in fivexx], "slow": [vars(a) for a in slow],
            "none": [vars(a) for a in none], "refused": [vars(a) for a in refused],
            "stuck": [vars(a) for a in stuck],
            "bursts": record.bursts,
            "generator_failures": record.failures,
            "labels": {k: dict(v) for k, v in labels.items()},
            "near": [vars(a) for a in near],  # over half the bound, for --json
            "slowest": max((a.seconds for a in answers if a.bounded and a.status),
                           default=0.0)}


def report(result: dict) -> str:
    """The table."""
    out = [f"{result['seconds']} s, seed {result['seed']}, {len(result['bursts'])} queue "
           f"bursts; the server {'lived' if result['alive'] else 'DIED'}",
           f"{'source':34s}{'requests':>9s}{'5xx':>6s}{'slowest s':>11s}{'over 1 s':>10s}"
           f"{'no answer':>11s}  statuses"]
    total = collections.Counter()
    for name in sorted(result["rows"], key=lambda n: (not n.startswith("generated"), n)):
        row = result["rows"][name]
        statuses = " ".join(f"{s}:{n}" for s, n in sorted(row["statuses"].items()))
        out.append(f"{name:34s}{row['requests']:9d}{row['5xx']:6d}{row['slowest']:11.3f}"
                   f"{row['over']:10d}{row['none']:11d}  {statuses}")
        total.update({k: row[k] for k in ("requests", "5xx", "over", "none")})
    out.append(f"{'all':34s}{total['requests']:9d}{total['5xx']:6d}"
               f"{result['slowest']:11.3f}{total['over']:10d}{total['none']:11d}")
    out.append(f"5xx replies: {total['5xx']} (target 0)")
    out.append(f"answers over {BOUND:g} s: {total['over']} (target 0); the slowest held to "
               f"it: {result['slowest']:.3f} s")
    out.append(f"requests with no answer within the timeout: {total['none']} (target 0)")
    out.append(f"burst chats refused: {len(result['refused'])} (target 0)")
    if result["generator_failures"]:
        out.append(f"generator failures (schemathesis' own, not the server's): "
                   f"{len(result['generator_failures'])}")
    for name in ("fivexx", "slow", "none", "refused", "stuck"):
        for a in result[name][:30]:
            out.append(f"  {name}: at {a['at']:.1f} s {a['source']} {a['what'][:200]} -> "
                       f"{a['status']} in {a['seconds']:.3f} s {a['note'][:400]}")
    for line in sorted(set(result["generator_failures"]))[:10]:
        out.append(f"  generator failure: {line}")
    return "\n".join(out)


def failed(result: dict) -> bool:
    """Whether a target is missed."""
    return bool(result["fivexx"] or result["slow"] or result["none"] or result["refused"]
                or not result["alive"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--generators", type=int, default=2,
                        help="threads sending schemathesis-generated requests")
    parser.add_argument("--hostile", type=int, default=2,
                        help="threads sending hostile requests")
    parser.add_argument("--examples", type=int, default=5,
                        help="generated requests to one operation before the next")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds a request may take before it counts as unanswered")
    parser.add_argument("--keep", help="a folder to keep the run's files and log in")
    parser.add_argument("--json", help="also write the result as JSON to this file")
    args = parser.parse_args(argv)
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="hostile-mix-"))
    try:
        result = run(args.seconds, args.seed, folder, args.generators, args.hostile,
                     args.examples, args.timeout)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 1 if failed(result) else 0


if __name__ == "__main__":
    sys.exit(main())
