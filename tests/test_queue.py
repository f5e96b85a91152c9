"""A queue, not a wall: past its limit a request waits for a place, in arrival order.

In process, on localrt.admission's own objects: a place that frees goes to the first
in line, never to a newer arrival; one Queue bounds the waiting requests of every
kind together, and past it a request is the 503 with Retry-After that names the kind,
its limit and the queue; a waiter whose client leaves frees its place in the queue;
the server's threads cover the queue, and start only as requests need them
(localrt.connections.Dispatcher).

Against a real server (localrt.connections in a thread, as localrt.server.serve makes
it, on a tiny random llama, tests/emulators/ggufgen.py): 250 chats at once are all
answered, in their order of arrival as far as a client can see it, while GET
/v1/models answers within a second throughout and /metrics counts those in progress
and those waiting; past the limit and the queue a chat is the 503; a client that
closes its socket while it waits frees its place in the queue. The test holds the
model's every turn while the requests arrive, so they wait until it lets them go.
"""

from __future__ import annotations

import http.client
import json
import selectors
import threading
import time

import pytest
from emulators.ggufgen import write_gguf
from prometheus_client.parser import text_string_to_metric_families  # a test dependency
from support.apps import bind
from support.models import add_model
from support.servers import raw_request, send, waitress_server
from support.waiting import Leaving, wait_for

from localrt import connections, server
from localrt import settings as settings_mod
from localrt.admission import (DISCONNECT_POLL, FULL, LIMITS, SPARE_THREADS, WALL, Admission,
                               ClientGone, Queue, threads_for, wait)
from localrt.app import create_app
from localrt.errors import ServiceUnavailable
from localrt.metrics import Metrics

USER = [{"role": "user", "content": "hello"}]
PATIENCE = 30.0  # seconds any one event may take on a busy machine; none should take long
CHATS = 250  # the figure


def started(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


# --- in process: the line and the queue ---------------------------------------------


def test_a_freed_place_goes_to_the_first_in_line_never_to_a_newer_arrival():
    admission = Admission("chat", 1, queue=Queue(8))
    admission.enter()  # the one place is taken
    order, go = [], {}

    def request(name):
        admission.enter()
        order.append(name)
        go[name].wait(PATIENCE)
        admission.leave()

    threads = []
    for name in "BCD":
        go[name] = threading.Event()
        threads.append(started(request, name))
        wait_for(lambda: admission.queued == len(threads), PATIENCE, f"{name} waits")
    admission.leave()  # the place goes to B, the first in line
    wait_for(lambda: order == ["B"], PATIENCE, "B has the place")
    assert (admission.in_progress, admission.queued, admission.queue.waiting) == (1, 2, 2)
    go["E"] = threading.Event()  # a newer arrival waits behind C and D
    threads.append(started(request, "E"))
    wait_for(lambda: admission.queued == 3, PATIENCE, "E waits")
    for event in go.values():
        event.set()
    for thread in threads:
        thread.join(PATIENCE)
    assert order == ["B", "C", "D", "E"]
    assert (admission.in_progress, admission.queued, admission.queue.waiting) == (0, 0, 0)


def test_one_queue_bounds_every_kind_and_past_it_a_503_with_retry_after():
    queue = Queue(2)
    chats, completions = Admission("chat", 1, queue=queue), Admission("completion", 1,
                                                                        queue=queue)
    chats.enter()
    completions.enter()
    waiters = [started(chats.enter), started(completions.enter)]
    wait_for(lambda: queue.waiting == 2, PATIENCE, "a chat and a completion wait")
    for admission in (chats, completions):
        with pytest.raises(ServiceUnavailable) as refused:
            admission.enter()
        assert refused.value.status == 503
        assert refused.value.message == FULL.format(what=admission.what, limit=1, queued=2)
        assert ("Retry-After", "1") in refused.value.headers
    assert refused.value.message == (
        "Too many completion requests in progress (at most 1) and too many requests "
        "waiting for a place (at most 2, maxQueuedRequests); retry shortly")
    for admission in (chats, completions):
        admission.leave()  # to the one waiting
    for waiter in waiters:
        waiter.join(PATIENCE)
    assert (chats.in_progress, chats.queued, completions.in_progress, queue.waiting) == \
        (1, 0, 1, 0)
    # With no room to wait (maxQueuedRequests 0, or a kind that never waits): the wall.
    for wall in (Admission("chat", 1, queue=Queue(0)), Admission("pull", 1)):
        wall.enter()
        with pytest.raises(ServiceUnavailable) as refused:
            wall.enter()
        assert refused.value.message == WALL.format(what=wall.what, limit=1) == \
            f"Too many {wall.what} requests in progress (at most 1); retry shortly"
        assert ("Retry-After", "1") in refused.value.headers


def test_a_waiter_whose_client_leaves_frees_its_place_in_the_queue():
    admission = Admission("chat", 1, queue=Queue(1))
    admission.enter()
    leaving, errors = Leaving(), []

    def request(disconnected):
        try:
            admission.enter(disconnected)
        except ClientGone as exc:
            errors.append(exc)

    first = started(request, leaving)
    wait_for(lambda: admission.queued == 1, PATIENCE, "the first waits")
    with pytest.raises(ServiceUnavailable):  # the queue's one place is the first's
        admission.enter()
    leaving.leave()
    took = wait_for(lambda: errors, PATIENCE, "the first gave up")
    first.join(PATIENCE)
    assert errors[0].status == 499 and "a place among the 1 chat requests" in \
        errors[0].message
    assert (admission.in_progress, admission.queued, admission.queue.waiting) == (1, 0, 0)
    second = started(admission.enter)  # its place in the queue is free again
    wait_for(lambda: admission.queued == 1, PATIENCE, "the second waits")
    admission.leave()
    second.join(PATIENCE)
    assert (admission.in_progress, admission.queued) == (1, 0)  # the second's, not the first's
    admission.leave()
    print(f"a waiter whose client left gave up its place in {took * 1000:.0f} ms")


def test_a_notify_spent_on_a_poll_that_timed_out_is_not_lost():
    """A request whose client can leave waits DISCONNECT_POLL seconds at a time. A
    notify() that comes as such a wait times out, while the notifier holds the lock, is
    spent on it, yet Condition.wait says False: `wait` returns then all the same, so the
    waiter looks again at what it waits for. A chat in the queue was handed its place
    so and waited for ever (tests/bench/hostile_mix.py found it, once a minute)."""
    cond, granted, waiting = threading.Condition(), [], threading.Event()

    def waiter():
        with cond:
            waiting.set()
            while not granted:
                wait(cond, Leaving(), None, "a place")

    thread = started(waiter)
    assert waiting.wait(PATIENCE)
    with cond:  # taken once the waiter waits
        time.sleep(3 * DISCONNECT_POLL)  # its wait times out; it cannot take the lock back
        granted.append(True)
        cond.notify()  # the waiter is still listed: this is spent on it
    thread.join(PATIENCE)
    assert not thread.is_alive(), "the waiter missed its notify"


def test_the_threads_and_connections_cover_the_queue():
    assert server.THREADS == threads_for(LIMITS) == sum(LIMITS.values()) + SPARE_THREADS
    assert threads_for(LIMITS, 512) == server.THREADS + 512 == 568
    # A connection for each thread's request and more for the short ones, even where
    # few files may be open.
    assert connections.connection_limit(1024, 560) >= 560 + connections.MIN_CONNECTIONS
    assert connections.connection_limit(65536, 560) > 60000


def test_max_queued_requests_is_a_setting_of_0_or_more(home):
    settings = settings_mod.load()
    assert settings["maxQueuedRequests"] == 512  # Ollama's OLLAMA_MAX_QUEUE
    assert settings.update({"maxQueuedRequests": 0})["maxQueuedRequests"] == 0
    for bad in (-1, 70000, True, "many", 1.5):
        with pytest.raises(ValueError, match="whole number from 0 to 65536"):
            settings.update({"maxQueuedRequests": bad})
    (home / ".localrtrc").write_text("maxQueuedRequests: -3\n")
    with pytest.raises(settings_mod.SettingsError, match="maxQueuedRequests"):
        settings_mod.load()


class Blocking:
    """A waitress task that holds its worker thread until `done` is set."""

    def __init__(self, done: threading.Event, ran: list):
        self.done, self.ran = done, ran

    def service(self):
        self.ran.append(self)
        self.done.wait(PATIENCE)

    def cancel(self):
        pass


def test_the_dispatcher_starts_threads_as_requests_need_them_and_ends_them_idle():
    dispatcher = connections.Dispatcher(2, 4, idle=0.2)
    done, ran = threading.Event(), []
    try:
        assert len(dispatcher.threads) == 2
        for _ in range(6):
            dispatcher.add_task(Blocking(done, ran))
        wait_for(lambda: len(ran) == 4, PATIENCE, "four tasks run")
        assert len(dispatcher.threads) == 4 and len(dispatcher.queue) == 2  # never more
        done.set()
        wait_for(lambda: len(ran) == 6, PATIENCE, "the other two run")
        # Idle, the threads past the standing two end; a new burst starts them again.
        wait_for(lambda: len(dispatcher.threads) == 2, PATIENCE, "back to two threads")
        done.clear()
        for _ in range(3):
            dispatcher.add_task(Blocking(done, ran))
        wait_for(lambda: len(ran) == 9, PATIENCE, "three more tasks run")
        assert len(dispatcher.threads) == 3
    finally:
        done.set()
        dispatcher.shutdown()
    assert not dispatcher.threads
    dispatcher.add_task(Blocking(done, ran))  # after shutdown: no thread starts
    assert not dispatcher.threads


def test_a_burst_starts_a_thread_for_each_task_no_idle_one_takes():
    dispatcher = connections.Dispatcher(2, 100, idle=0.2)
    done, ran = threading.Event(), []
    try:
        wait_for(lambda: dispatcher.active_count == 0, PATIENCE, "the standing two idle")
        for _ in range(10):  # in one go, as a burst of requests comes
            dispatcher.add_task(Blocking(done, ran))
        wait_for(lambda: len(ran) == 10, PATIENCE, "all ten run")
        assert len(dispatcher.threads) == 10  # the two standing and eight more, no spare
    finally:
        done.set()
        dispatcher.shutdown()


def test_metrics_give_each_kinds_requests_in_progress_and_queued():
    metrics = Metrics(admissions=lambda: {"chat": (16, 234), "pull": (1, 0)})
    s = scrape_text(metrics.render())
    assert s[("localrt_requests_in_progress", "chat")] == 16
    assert s[("localrt_requests_queued", "chat")] == 234
    assert s[("localrt_requests_in_progress", "pull")] == 1
    assert s[("localrt_requests_queued", "pull")] == 0


def scrape_text(text: str) -> dict:
    """{(name, kind): value} of the samples with a `kind` label, read by
    prometheus_client's parser."""
    return {(s.name, s.labels["kind"]): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples if "kind" in s.labels}


# --- against a real server -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("queue") / "tiny.gguf", context_length=512)


@pytest.fixture
def held(settings, tiny_gguf):
    """A function of (limits) giving an app with "tiny" running whose every turn this
    test holds, so the requests that come wait; the turns are given back by
    `let_go()` or after the test. Yields (make, let_go)."""
    apps, leases = [], []

    def make(limits=None):
        app = create_app(settings, limits=limits)
        apps.append(app)
        add_model(bind(app), tiny_gguf, "tiny", start={})
        scheduler = app.services.scheduler
        slots = scheduler.status()[0]["slots"]
        leases.extend(scheduler.lease("tiny") for _ in range(slots))
        return app

    def let_go():
        while leases:
            leases.pop().release()

    try:
        yield make, let_go
    finally:
        let_go()
        for app in apps:
            app.close()


class Poller:
    """GET /v1/models on one connection, again and again, until stopped: the slowest
    answer's seconds, and how many answered."""

    def __init__(self, port: int):
        self.port, self.slowest, self.answered = port, 0.0, 0
        self.failures: list = []
        self._stop = threading.Event()
        self._thread = started(self._run)

    def _run(self):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=PATIENCE)
        try:
            while not self._stop.is_set():
                began = time.monotonic()
                conn.request("GET", "/v1/models")
                resp = conn.getresponse()
                body = resp.read()
                self.slowest = max(self.slowest, time.monotonic() - began)
                if resp.status != 200 or b'"tiny"' not in body:
                    self.failures.append((resp.status, body[:200]))
                self.answered += 1
                time.sleep(0.02)
        except OSError as exc:
            self.failures.append(repr(exc))
        finally:
            conn.close()

    def stop(self):
        self._stop.set()
        self._thread.join(PATIENCE)


def _complete(data: bytes) -> bool:
    """Whether `data` holds a whole reply: its head and Content-Length bytes of body."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    lengths = [line.split(b":", 1)[1] for line in head.split(b"\r\n")[1:]
               if line.lower().startswith(b"content-length:")]
    return bool(lengths) and len(body) >= int(lengths[0])


def replies_in_order(socks: list) -> list[tuple[int, int, dict]]:
    """Read every socket's reply in one thread, as they come: (index in `socks`,
    status, decoded body) in the order their last bytes came."""
    selector = selectors.DefaultSelector()
    data = {}
    for index, sock in enumerate(socks):
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, index)
        data[index] = b""
    ended = []
    while len(ended) < len(socks):
        ready = selector.select(PATIENCE)
        assert ready, f"no reply for {PATIENCE} s; {len(ended)} of {len(socks)} ended"
        for key, _ in ready:
            chunk = key.fileobj.recv(65536)
            data[key.data] += chunk
            if chunk and not _complete(data[key.data]):
                continue
            selector.unregister(key.fileobj)
            head, _, body = data[key.data].partition(b"\r\n\r\n")
            ended.append((key.data, int(head.split()[1]), json.loads(body)))
    selector.close()
    return ended


def kind_counts(port: int) -> dict:
    """GET /metrics' localrt_requests_* samples: {(name, kind): value}."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=PATIENCE)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200
        return scrape_text(resp.read().decode())
    finally:
        conn.close()


@pytest.mark.live
def test_250_chats_at_once_are_all_answered_in_order_of_arrival(held, settings):
    """Each chat is sent once the server has counted the one before (in progress or
    waiting), so their order of arrival is known; the model's turns are held until all
    have come. Then all are answered, none a 503, and no reply comes before one that
    arrived twice the chat limit or more earlier: only the ones in progress together
    (generating side by side, or finishing in the same instant) may swap."""
    make, let_go = held
    app = make()
    admission = app.services.admissions["chat"]
    assert admission.queue.limit == settings["maxQueuedRequests"] == 512
    limit = admission.limit
    body = {"model": "tiny", "messages": USER, "max_tokens": 2}
    socks = []
    with waitress_server(app, server.THREADS, settings["maxQueuedRequests"]) as srv:
        dispatcher = srv.server.task_dispatcher
        assert len(dispatcher.threads) == server.THREADS  # none yet for a queue
        poller = Poller(srv.port)
        try:
            for n in range(1, CHATS + 1):
                socks.append(raw_request(srv.port, "POST", "/v1/chat/completions", body,
                                         timeout=PATIENCE, close=True))
                wait_for(lambda: admission.in_progress + admission.queued == n, PATIENCE,
                         f"chat {n} counted")
            assert (admission.in_progress, admission.queued) == (limit, CHATS - limit)
            counts = kind_counts(srv.port)
            assert counts[("localrt_requests_in_progress", "chat")] == limit
            assert counts[("localrt_requests_queued", "chat")] == CHATS - limit
            assert counts[("localrt_requests_queued", "completion")] == 0
            threads = len(dispatcher.threads)  # a worker for each, and the spare ones
            assert server.THREADS < threads <= threads_for(LIMITS, 512)
            let_go()
            began = time.monotonic()
            ended = replies_in_order(socks)
            took = time.monotonic() - began
        finally:
            poller.stop()
            for sock in socks:
                sock.close()
    assert not poller.failures, poller.failures[:3]
    statuses = [status for _, status, _ in ended]
    assert statuses == [200] * CHATS, {s: statuses.count(s) for s in set(statuses)}
    assert all(reply["object"] == "chat.completion" and reply["choices"]
               for _, _, reply in ended)
    position = {index: p for p, (index, _, _) in enumerate(ended)}
    late = [(i, j) for i in range(CHATS) for j in range(i + 2 * limit, CHATS)
            if position[j] < position[i]]
    assert not late, f"answered before chats that arrived far earlier: {late[:5]}"
    swaps = sum(1 for i in range(CHATS - 1) if position[i + 1] < position[i])
    farthest = max(j - i for i in range(CHATS) for j in range(i, CHATS)
                   if position[j] < position[i]) if swaps else 0
    print(f"{CHATS} chats answered in {took:.1f} s once let go; {swaps} neighbours "
          f"answered out of order, none more than {farthest} places early; GET "
          f"/v1/models answered {poller.answered} times, the slowest in "
          f"{poller.slowest * 1000:.0f} ms; {threads} worker threads")
    assert poller.answered >= 10 and poller.slowest < 1.0  # the bound
    assert (admission.in_progress, admission.queued) == (0, 0)


@pytest.mark.live
def test_past_the_limit_and_the_queue_a_503_and_a_client_that_leaves_frees_its_place(
        held, settings):
    settings.update({"maxQueuedRequests": 2})
    make, let_go = held
    limits = {"chat": 1}
    app = make(limits)
    admission = app.services.admissions["chat"]
    body = {"model": "tiny", "messages": USER, "max_tokens": 2}
    socks = {}
    with waitress_server(app, threads_for({**LIMITS, **limits}), 2) as srv:
        try:
            for n, name in enumerate("ABC", 1):  # A takes the place, B and C wait
                socks[name] = raw_request(srv.port, "POST", "/v1/chat/completions", body,
                                          timeout=PATIENCE, close=True)
                wait_for(lambda: admission.in_progress + admission.queued == n, PATIENCE,
                         f"{name} counted")
            counts = kind_counts(srv.port)
            assert (counts[("localrt_requests_in_progress", "chat")],
                    counts[("localrt_requests_queued", "chat")]) == (1, 2)
            status, reply = send(srv.url, "POST", "/v1/chat/completions", body,
                                 timeout=PATIENCE)
            assert status == 503, reply
            assert reply["error"]["code"] == "unavailable"
            assert reply["error"]["message"] == FULL.format(what="chat", limit=1, queued=2)
            status, reply = send(srv.url, "POST", "/v1/messages", body, timeout=PATIENCE)
            assert status == 503 and reply["error"]["type"] == "overloaded_error", reply
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=PATIENCE)
            conn.request("POST", "/v1/chat/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            assert conn.getresponse().getheader("Retry-After") == "1"
            conn.close()
            socks.pop("B").close()  # B's client leaves the queue: its place is free
            took = wait_for(lambda: admission.queued == 1, PATIENCE, "B left the queue")
            socks["D"] = raw_request(srv.port, "POST", "/v1/chat/completions", body,
                                     timeout=PATIENCE, close=True)
            wait_for(lambda: admission.queued == 2, PATIENCE, "D waits in B's place")
            let_go()
            ended = replies_in_order(list(socks.values()))
        finally:
            for sock in socks.values():
                sock.close()
    names = list(socks)
    assert sorted((names[index], status) for index, status, _ in ended) == \
        [("A", 200), ("C", 200), ("D", 200)]
    assert (admission.in_progress, admission.queued, admission.queue.waiting) == (0, 0, 0)
    print(f"a client that left the queue freed its place in {took * 1000:.0f} ms")
