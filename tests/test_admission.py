"""Too many requests in progress: the 503 of each kind, through the WSGI app.

Chats, completions and embeddings each admit at most a fixed number of requests at once
(localrt.admission.Admission); past that, with no room to wait (maxQueuedRequests 0,
as every test here sets: the wall itself), a request is a 503 that names its kind and
the limit, with Retry-After (the queue in front of the wall is tests/test_queue.py's).
A remote model's request counts in the same admission as a local one, and the dialect
routes that go through chat, completion or embedding give that 503 in their own error
shape. GET /v1/events has its own limit, on open event streams
(localrt.events.EventBus).

A test takes every slot but the ones it needs by entering the real admission itself,
as that many requests in progress would, and gives them back after, so no test has to
hold sixteen requests open. The model is a tiny random llama (tests/emulators/ggufgen.py); the
remote model's upstream is an address nothing listens on, so only the admission can
answer its 503 with these words.

Against a real server (localrt.connections in a thread, every kind's limit set to one
through create_app): with every kind at its limit, each holding a worker thread, GET
/v1/models still answers; and a client that closes its socket, while its request
waits for its turn or while its stream runs, frees its place at once (waited for as
an event, within a generous limit). Ollama's /api/pull has its own kind.
"""

from __future__ import annotations

import io
import json
import threading
import time
from contextlib import contextmanager
from wsgiref.util import setup_testing_defaults
from wsgiref.validate import validator

import pytest
from emulators.ggufgen import write_bert_gguf, write_gguf
from emulators.hubemu import HubEmulator
from support.apps import bind, events
from support.models import NO_EOS
from support.servers import free_port, raw_request, send, waitress_server
from support.waiting import Leaving, wait_for

from localrt import server
from localrt import settings as settings_mod
from localrt.admission import LIMITS, SPARE_THREADS, ClientGone, never, threads_for
from localrt.app import create_app
from localrt.dialects import openai
from localrt.inference.lanes import FairLock
from localrt.services import MAX_EVENT_LISTENERS

USER = [{"role": "user", "content": "hello"}]
# Each native route, the admission its requests count in, and a body for it.
NATIVE = {
    "chat": ("/v1/chat/completions", "chats",
             {"messages": USER, "max_tokens": 4}),
    "completion": ("/v1/completions", "completions",
                   {"prompt": "Once upon a time", "max_tokens": 4}),
    "embedding": ("/v1/embeddings", "embeddings", {"input": "the quick brown fox"}),
    "response": ("/v1/responses", "chats", {"input": "hello", "max_output_tokens": 4}),
}
# Each dialect route, the kind of request it makes, and a body for it.
DIALECTS = {
    "anthropic-messages": ("/v1/messages", "chats",
                           {"messages": USER, "max_tokens": 4}),
    "ollama-chat": ("/api/chat", "chats", {"messages": USER, "options": {"num_predict": 4}}),
    "ollama-generate": ("/api/generate", "chats",
                        {"prompt": "hello", "options": {"num_predict": 4}}),
    "ollama-generate-raw": ("/api/generate", "completions",
                            {"prompt": "hello", "raw": True, "options": {"num_predict": 4}}),
    "ollama-embed": ("/api/embed", "embeddings", {"input": "the quick brown fox"}),
}


@pytest.fixture
def settings(home):
    """The settings with no queue: past its limit a request is a 503 at once."""
    settings = settings_mod.load()
    settings.update({"maxQueuedRequests": 0})
    return settings


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("admission") / "tiny.gguf", context_length=512)


@pytest.fixture
def far(api):
    """A remote model whose one upstream nothing listens on."""
    r = api("POST", "/v1/models/remote",
            {"id": "far", "upstreams": [{"url": f"http://127.0.0.1:{free_port()}/v1"}]})
    assert r.status == 200, r.body
    return "far"


@contextmanager
def taken(admission, leave_free=0):
    """Every slot of `admission` but `leave_free` taken, as by requests in progress."""
    count = admission.limit - leave_free
    for _ in range(count):
        admission.enter()
    try:
        yield
    finally:
        for _ in range(count):
            admission.leave()


def too_many(kind: str, limit: int) -> str:
    return f"Too many {kind} requests in progress (at most {limit}); retry shortly"


def admission_of(app, service: str):
    return getattr(app.services, service).admission


def assert_too_many(r, message: str) -> None:
    """A 503 in localrt's own (OpenAI's) error shape, with Retry-After."""
    assert r.status == 503, r.body
    assert r.json["error"]["code"] == "unavailable", r.json
    assert r.json["error"]["message"] == r.json["message"] == message
    assert r.headers["retry-after"] == "1"


@pytest.mark.parametrize("route, stream", [(route, stream) for route in sorted(NATIVE)
                                           for stream in (False, True)
                                           if not (stream and route == "embedding")])
def test_past_the_limit_a_request_is_a_503_naming_its_kind(app, api, tiny, route, stream):
    path, service, body = NATIVE[route]
    admission = admission_of(app, service)
    with taken(admission):
        r = api("POST", path, {"model": tiny, **body, **({"stream": True} if stream else {})})
    assert_too_many(r, too_many(admission.what, admission.limit))
    assert (admission.what, admission.limit) == {
        "chats": ("chat", 16), "completions": ("completion", 8),
        "embeddings": ("embedding", 8)}[service]
    # Nothing was started for it, and the slots it did not get are free again.
    assert api("GET", "/v1/models/status").json["data"] == []
    with taken(admission, leave_free=1):
        assert api("POST", path, {"model": tiny, **body}).status == 200


def test_a_request_in_progress_holds_its_slot_until_its_reply_ends(app, api, tiny):
    admission = admission_of(app, "chats")
    body = {"model": tiny, "messages": USER, "max_tokens": 8, "logit_bias": NO_EOS}
    with taken(admission, leave_free=1):
        status, _, reply = open_stream(app, "/v1/chat/completions", {**body, "stream": True})
        assert status == 200
        next(iter(reply))  # generating: it holds the last slot
        try:
            assert_too_many(api("POST", "/v1/chat/completions", body),
                            too_many("chat", admission.limit))
        finally:
            reply.close()  # the reply ends (or the client hangs up): its slot is free
        r = api("POST", "/v1/chat/completions", {**body, "stream": True})
        assert r.status == 200 and events(r)[-1] == "[DONE]"


@pytest.mark.parametrize("route", sorted(NATIVE))
def test_a_remote_models_request_counts_in_its_kinds_admission(app, api, far, route):
    path, service, body = NATIVE[route]
    admission = admission_of(app, service)
    with taken(admission):
        r = api("POST", path, {"model": far, **body})
    assert_too_many(r, too_many(admission.what, admission.limit))
    # With a slot free it goes on to the upstream, which is not there: another 503.
    with taken(admission, leave_free=1):
        r = api("POST", path, {"model": far, **body})
    assert r.status == 503 and r.json["error"]["code"] == "no_healthy_upstream", r.json


@pytest.mark.parametrize("route", sorted(DIALECTS))
def test_a_dialect_gives_the_503_in_its_own_shape(app, api, tiny, route):
    path, service, body = DIALECTS[route]
    admission = admission_of(app, service)
    message = too_many(admission.what, admission.limit)
    with taken(admission):
        r = api("POST", path, {"model": tiny, **body})
    assert r.status == 503, r.body
    assert r.headers["retry-after"] == "1"
    if path == "/v1/messages":
        assert r.json == {"type": "error",
                          "error": {"type": "overloaded_error", "message": message}}
    else:
        assert r.json == {"error": message}


def test_a_remote_model_through_a_dialect_gives_the_503_in_its_shape(app, api, far):
    admission = admission_of(app, "chats")
    with taken(admission):
        r = api("POST", "/v1/messages", {"model": far, "messages": USER, "max_tokens": 4})
        counted = api("POST", "/v1/messages/count_tokens", {"model": far, "messages": USER})
    message = too_many("chat", admission.limit)
    for reply in (r, counted):  # a remote model's count is a one-token chat upstream
        assert reply.status == 503, reply.body
        assert reply.json == {"type": "error",
                              "error": {"type": "overloaded_error", "message": message}}
        assert reply.headers["retry-after"] == "1"


def test_past_the_open_event_streams_limit_events_is_a_503(app, api):
    assert app.services.events.max_listeners == MAX_EVENT_LISTENERS == 4
    streams = [listening(app) for _ in range(MAX_EVENT_LISTENERS)]
    try:
        # Not through call(): a stream that opened would never end.
        status, headers, reply = open_stream(app, "/v1/events", method="GET")
        try:
            assert status == 503, f"event stream {MAX_EVENT_LISTENERS + 1} opened"
            body = json.loads(b"".join(reply))
        finally:
            reply.close()
        assert headers["content-type"] == "application/json"
        assert body["error"]["code"] == "unavailable", body
        assert body["error"]["message"] == body["message"] == \
            f"Too many open event streams (at most {MAX_EVENT_LISTENERS}); close one"
        assert headers["retry-after"] == "1"
        streams.pop().close()  # a client hangs up: one more may listen
        streams.append(listening(app))
    finally:
        for stream in streams:
            stream.close()


def test_an_event_stream_closed_before_its_first_read_frees_its_place(app):
    """A server may close a reply it never read (the client left at once)."""
    for _ in range(MAX_EVENT_LISTENERS + 2):
        status, _, reply = open_stream(app, "/v1/events", method="GET")
        assert status == 200
        reply.close()
    listening(app).close()


def listening(app):
    """GET /v1/events through the WSGI app, read up to its first line and left open."""
    status, _, reply = open_stream(app, "/v1/events", method="GET")
    assert status == 200 and next(iter(reply)) == b": listening\n\n"
    return reply


def open_stream(app, path, body=None, method="POST"):
    """A request through the WSGI app whose reply is left open: (status, headers, the
    reply's iterable), which the caller reads and closes, as the server does."""
    data = b"" if body is None else json.dumps(body).encode()
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "SCRIPT_NAME": "",
               "QUERY_STRING": "", "CONTENT_TYPE": "application/json",
               "CONTENT_LENGTH": str(len(data)), "wsgi.input": io.BytesIO(data)}
    setup_testing_defaults(environ)
    started = []

    def start_response(line, headers, exc_info=None):
        started.append((int(line.split()[0]), {k.lower(): v for k, v in headers}))
        return lambda _: None

    reply = validator(app)(environ, start_response)
    status, headers = started[0]
    return status, headers, reply


# --- against a real server: threads, and clients that leave ----------------------------

LOW = {kind: 1 for kind in LIMITS}  # every kind at its limit with one request each
PATIENCE = 30.0  # seconds any one event may take on a busy machine; none should take long


def test_the_limits_leave_threads_for_short_requests(app):
    assert server.THREADS == threads_for(LIMITS) == sum(LIMITS.values()) + SPARE_THREADS
    assert threads_for(LIMITS, 512) == server.THREADS + 512  # a thread per queued request
    assert SPARE_THREADS >= 4
    assert {kind: a.limit for kind, a in app.services.admissions.items()} == LIMITS
    assert LIMITS == {"chat": 16, "completion": 8, "embedding": 8, "rerank": 8, "events": 4,
                      "pull": 4}
    assert {kind: a.what for kind, a in app.services.admissions.items()} == \
        {kind: kind for kind in LIMITS}


def test_past_the_pull_limit_an_ollama_pull_is_a_503_in_ollamas_shape(app, api):
    admission = app.services.admissions["pull"]
    with taken(admission):
        for stream in (True, False):
            r = api("POST", "/api/pull", {"model": "org/anything", "stream": stream})
            assert r.status == 503, r.body
            assert r.json == {"error": too_many("pull", 4)}
            assert r.headers["retry-after"] == "1"
    assert api("GET", "/v1/models/pull").json["data"] == []  # no download started
    assert admission.in_progress == 0


@pytest.fixture(scope="module")
def slow_hub():
    """A hub whose one repo downloads at 2 KB/s: a pull of it lasts the test."""
    with HubEmulator() as emu:
        emu.add_repo("org/big", {"big.gguf": b"GGUF" + bytes(2_000_000)})
        emu.max_bytes_per_second = 2000
        yield emu


@contextmanager
def real_server(app, limits):
    """localrt.connections' server for `app` on loopback, in a thread, with the threads
    those limits need (localrt.server derives THREADS the same way) and no queue."""
    with waitress_server(app, threads_for(limits)) as srv:
        yield srv.url, srv.port


@pytest.fixture
def crowded(settings, slow_hub, tiny_gguf, tmp_path):
    """A real server whose every kind is at its limit of one: a chat, a completion, an
    embedding and a rerank waiting for their turn (this test holds the models' turns),
    an open event stream and an Ollama pull following a slow download, each on its own
    connection. Yields (app, port, {kind: its socket})."""
    settings.update({"modelHubUrl": slow_hub.url, "maxRunningModels": 3})
    app = create_app(settings, limits=LOW)
    api = bind(app)
    reranker = write_bert_gguf(tmp_path / "rerank.gguf", pooling_type=4)
    for model_id, path in (("tiny", tiny_gguf), ("tiny-embed", tiny_gguf),
                           ("tiny-rerank", reranker)):
        r = api("POST", "/v1/models/import", {"path": str(path), "id": model_id})
        assert r.status == 200, r.body
    scheduler = app.services.scheduler
    scheduler.start("tiny", {"cpu_threads": 1})
    scheduler.start("tiny-embed", {"cpu_threads": 1, "embedding": True})
    scheduler.start("tiny-rerank", {"cpu_threads": 1})
    slots = {row["id"]: row["slots"] for row in scheduler.status()}
    leases = [scheduler.lease(m) for m in slots for _ in range(slots[m])]  # every turn
    clients = {}
    try:
        with real_server(app, LOW) as (url, port):
            clients["chat"] = raw_request(port, "POST", "/v1/chat/completions", {
                "model": "tiny", "messages": USER, "max_tokens": 4, "stream": True})
            clients["completion"] = raw_request(port, "POST", "/v1/completions", {
                "model": "tiny", "prompt": "Once", "max_tokens": 4})
            clients["embedding"] = raw_request(port, "POST", "/v1/embeddings", {
                "model": "tiny-embed", "input": "the quick brown fox"})
            clients["rerank"] = raw_request(port, "POST", "/v1/rerank", {
                "model": "tiny-rerank", "query": "a fox", "documents": ["the fox"]})
            clients["events"] = raw_request(port, "GET", "/v1/events")
            clients["pull"] = raw_request(port, "POST", "/api/pull", {"model": "org/big"})
            for kind in ("events", "pull"):  # their replies have begun
                assert clients[kind].recv(4096).startswith(b"HTTP/1.1 200")
            admissions = app.services.admissions
            wait_for(lambda: all(a.in_progress == 1 for a in admissions.values()), PATIENCE,
                     "every kind at its limit")
            yield app, url, port, clients
    finally:
        for sock in clients.values():
            sock.close()
        for lease in leases:
            lease.release()
        app.close()


@pytest.mark.live
def test_models_answer_while_every_kind_is_at_its_limit(crowded):
    app, url, port, _ = crowded
    started = time.monotonic()
    status, body = send(url, "GET", "/v1/models", timeout=PATIENCE)
    answered = time.monotonic() - started
    assert status == 200 and {m["id"] for m in body["data"]} == {"tiny", "tiny-embed",
                                                                 "tiny-rerank"}
    assert send(url, "GET", "/healthz", timeout=PATIENCE)[0] == 200
    print(f"GET /v1/models answered in {answered * 1000:.0f} ms with every kind at its limit")
    # One more of each kind is the 503 naming it, in its route's shape.
    more = {"chat": ("POST", "/v1/chat/completions", {"model": "tiny", "messages": USER}),
            "completion": ("POST", "/v1/completions", {"model": "tiny", "prompt": "a"}),
            "embedding": ("POST", "/v1/embeddings", {"model": "tiny-embed", "input": "a"}),
            "rerank": ("POST", "/v1/rerank", {"model": "tiny-rerank", "query": "a",
                                              "documents": ["b"]}),
            "pull": ("POST", "/api/pull", {"model": "org/big"})}
    for kind, (method, path, body) in more.items():
        status, reply = send(url, method, path, body, timeout=PATIENCE)
        message = too_many(kind, 1)
        assert status == 503, (kind, reply)
        assert reply == {"error": message} if path.startswith("/api/") else \
            reply["error"]["message"] == message
    status, reply = send(url, "GET", "/v1/events", timeout=PATIENCE)
    assert status == 503
    assert reply["message"] == "Too many open event streams (at most 1); close one"


@pytest.mark.live
def test_a_client_that_leaves_frees_its_place(crowded):
    """Waiting for a turn (chat, completion, embedding, rerank) or streaming (events, a pull):
    the client closes its socket, and its kind has a place free again. Nothing else
    could free it while the test runs: the test's leases hold every turn, the pull
    lasts a thousand seconds at the hub's 2 KB/s, and the connection timeouts are LONG."""
    app, url, port, clients = crowded
    times = {}
    for kind, sock in list(clients.items()):
        admission = app.services.admissions[kind]
        assert admission.in_progress == 1
        sock.close()
        times[kind] = wait_for(lambda: admission.in_progress == 0, PATIENCE,
                               f"the {kind} request's place is free")
    print("place freed after the client left: " +
          ", ".join(f"{kind} {t * 1000:.0f} ms" for kind, t in times.items()))
    # The requests that left wait no more, and the turns they waited for were never
    # given: only this test's leases are on the models.
    assert all(r["requests"] == r["slots"] for r in app.services.scheduler.status())


# --- giving up: the waits and a generation, in process ----------------------------------


def test_a_waiter_whose_client_leaves_gives_up_its_place_in_line():
    lock, order = FairLock(), []
    lock.acquire()  # the model is busy
    leaving, errors = Leaving(), []

    def wait(name, disconnected):
        try:
            lock.acquire(disconnected, "its turn")
        except ClientGone as exc:
            errors.append(exc)
            return
        order.append(name)
        lock.release()

    first = threading.Thread(target=wait, args=("first", leaving))
    first.start()
    wait_for(lambda: lock.waiting == 1, PATIENCE, "the first waits")
    second = threading.Thread(target=wait, args=("second", never))
    second.start()
    wait_for(lambda: lock.waiting == 2, PATIENCE, "the second waits behind it")
    leaving.leave()
    took = wait_for(lambda: errors, PATIENCE, "the first gave up")
    assert lock.waiting == 1 and "its turn" in errors[0].message
    lock.release()
    second.join(PATIENCE)
    first.join(PATIENCE)
    assert order == ["second"]  # the one that left never had the turn
    assert took < 5 and errors[0].status == 499


def test_a_reply_whose_client_leaves_stops_generating_and_frees_its_place(app, api, tiny):
    admission = app.services.admissions["chat"]
    calls = []

    def disconnected():  # gone after a few looks: part way through the reply
        calls.append(1)
        return len(calls) > 5

    body = {"model": tiny, "messages": USER, "max_tokens": 200, "logit_bias": NO_EOS}
    with pytest.raises(ClientGone):
        openai.chat(app.services.chats, body, disconnected)
    assert admission.in_progress == 0
    assert [r["requests"] for r in app.services.scheduler.status()] == [0]
    assert api("POST", "/v1/chat/completions", {**body, "max_tokens": 4}).status == 200


@pytest.mark.live
def test_a_closed_pull_reply_frees_its_place_read_or_not(settings, slow_hub):
    """An Ollama pull following a download that lasts: each reply closed, unread or
    after its first line, gives its place and its follower back; the download goes on."""
    settings.update({"modelHubUrl": slow_hub.url})
    app = create_app(settings)
    try:
        admission, bus = app.services.admissions["pull"], app.services.events
        for n in range(admission.limit + 2):
            status, _, reply = open_stream(app, "/api/pull", {"model": "org/big"})
            assert status == 200 and admission.in_progress == 1
            if n % 2:
                assert json.loads(next(iter(reply))) == {"status": "pulling manifest"}
            reply.close()
            assert admission.in_progress == 0 and bus._listeners == []
        tasks = bind(app)("GET", "/v1/models/pull").json["data"]
        assert len(tasks) == 1 and tasks[0]["status"] in ("Pending", "Downloading")
    finally:
        app.close()
