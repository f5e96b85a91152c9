"""Admission: how many long-lived replies of each kind are in progress at once, the
line of requests waiting for a place, the server threads they leave for everything
else, and noticing a client that left.

Every reply that can last holds one of waitress's worker threads from its arrival to
its close, generating, streaming or waiting for its turn: a chat (OpenAI's, and
through it Anthropic's messages, the Responses API and Ollama's /api/chat and
/api/generate), a completion, an embedding, a rerank, a GET /v1/events stream, an Ollama
/api/pull that follows its download. Each kind has its own `Admission` and its limit
(`LIMITS`) on requests in progress.

Past its limit a chat, completion, embedding or rerank waits for a place in its kind's
line, first come first served, and one `Queue` bounds how many wait, of all four kinds
together (maxQueuedRequests, as Ollama's OLLAMA_MAX_QUEUE bounds its one queue); only
past that is the request a 503 with Retry-After that names the kind, its limit and the
queue's, in its route's error shape. An event stream or a pull never waits: its place
lasts as long as its client listens or its download runs, so a wait for one could be
endless, and its 503 says to retry. Each waiting request holds a worker thread too,
so the server has one for each place and each place in the queue, and SPARE_THREADS
more (`threads_for`, localrt.server), so GET /v1/models, /healthz and the rest still
answer when every kind is at its limit and the queue is full.

A request whose client has gone gives its place back within DISCONNECT_POLL seconds,
even while it waits for its turn: the app hands the handler a `disconnected()`
callable (waitress's, localrt.connections), and every wait of a request (a place, a
model's turn, room for a model, an upstream with room, the next event) looks at it at
least that often (`wait`) and raises ClientGone. The domain modules see only the
callable.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable

from localrt.errors import HTTPError, ServiceUnavailable

# Each kind's limit on requests in progress (generating, streaming or waiting for a
# model's turn). If you add a kind, give it a limit here: THREADS grows with the sum.
LIMITS = {
    "chat": 16,        # OpenAI's, Anthropic's and Ollama's chats, and Responses
    "completion": 8,   # OpenAI's text completions, Ollama's raw /api/generate
    "embedding": 8,    # OpenAI's embeddings, Ollama's /api/embed
    "rerank": 8,       # POST /v1/rerank (and /rerank, /v1/reranking)
    "events": 4,       # open GET /v1/events streams
    "pull": 4,         # Ollama /api/pull replies following their download
}
# Worker threads no long-lived reply may hold: with every kind at its limit and the
# queue full, these still answer the short requests (listings, status, /healthz,
# config, a model start).
SPARE_THREADS = 8
# Seconds between looks at whether a waiting request's client is still there.
DISCONNECT_POLL = 0.2

# The 503's words with no room to wait, and with a queue that is full.
WALL = "Too many {what} requests in progress (at most {limit}); retry shortly"
FULL = ("Too many {what} requests in progress (at most {limit}) and too many requests "
        "waiting for a place (at most {queued}, maxQueuedRequests); retry shortly")


def threads_for(limits: dict[str, int], queued: int = 0) -> int:
    """The worker threads a server needs for these limits and a Queue of `queued`: one
    per request they admit or let wait, and SPARE_THREADS for the rest of the API."""
    return sum(limits.values()) + queued + SPARE_THREADS


def never() -> bool:
    """A client that cannot be seen to leave (a request with no socket, in a test)."""
    return False


Disconnected = Callable[[], bool]


class ClientGone(HTTPError):
    """The client closed its connection before its reply: nginx's 499, which no client
    reads, but /metrics counts."""

    status = 499
    type = "client_error"
    code = "client_disconnected"


class Queue:
    """The bound on requests waiting for a place: at most `limit` at once, of every
    kind that queues together.

    One bound, not one per kind, because what it bounds is the worker threads they
    hold, whatever their kind: the server needs one thread per place in it
    (`threads_for`), and a bound per kind would need that many for each kind, or
    split the places so that a burst of chats finds only a third of them. Ollama's
    queue (OLLAMA_MAX_QUEUE) is one for all its requests too. Each kind keeps its own
    line, in arrival order (`Admission`): a place of one kind is never given to another.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()  # guards _waiting
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """How many requests wait now, of every kind."""
        with self._lock:
            return self._waiting

    def join(self) -> bool:
        """Count one more waiting request; False (counting nothing) when `limit` wait."""
        with self._lock:
            if self._waiting >= self.limit:
                return False
            self._waiting += 1
            return True

    def leave(self) -> None:
        """One request waits no more: it has its place, or it left."""
        with self._lock:
            self._waiting -= 1


class _Ticket:
    """A request waiting in a kind's line; `granted` once a leaving request handed it
    its place."""

    __slots__ = ("turn", "granted")

    def __init__(self, lock: threading.Lock):
        self.turn = threading.Condition(lock)  # notified once when granted
        self.granted = False


class Admission:
    """At most `limit` requests of one kind (`what`: "chat", "completion", ...) in
    progress at once, generating or waiting for their model: each holds a server
    thread (localrt.server), and the rest of the API needs some. Past that a request
    waits for a place in this kind's line, while `queue` has room (none: no line), and
    a place that frees goes to the first in line, never to a newer arrival. Past both,
    a 503 (`error`) with `message`, which may name {what} and {limit} (and FULL's
    {queued} when there is a queue)."""

    def __init__(self, what: str, limit: int, message: str = WALL,
                 error: type[ServiceUnavailable] = ServiceUnavailable,
                 queue: Queue | None = None):
        self.what, self.limit = what, limit
        self._message, self._error = message, error
        self.queue = queue
        self._lock = threading.Lock()  # guards _held, _line and each ticket's granted
        self._held = 0
        self._line: collections.deque[_Ticket] = collections.deque()

    @property
    def in_progress(self) -> int:
        """How many requests hold a place now."""
        with self._lock:
            return self._held

    @property
    def queued(self) -> int:
        """How many requests wait for a place now."""
        with self._lock:
            return len(self._line)

    def enter(self, disconnected: Disconnected = never) -> None:
        """Count one more request in progress, once it has a place: at once while fewer
        than `limit` are and none waits, else in its turn in the line; a 503 when
        the queue is full (or there is none), ClientGone once `disconnected()`."""
        with self._lock:
            if self._held < self.limit and not self._line:
                self._held += 1
                return
            if self.queue is None or not self.queue.join():
                raise self._full()
            ticket = _Ticket(self._lock)
            self._line.append(ticket)
            try:
                while not ticket.granted:
                    wait(ticket.turn, disconnected, None,
                         f"a place among the {self.limit} {self.what} requests in progress")
            except BaseException:
                if ticket.granted:  # handed its place as it gave up: the next one's
                    self._pass_on()
                else:
                    self._line.remove(ticket)
                raise
            finally:
                self.queue.leave()

    def leave(self) -> None:
        """One request fewer in progress: its place goes to the first in line."""
        with self._lock:
            if self._held <= 0:
                raise ValueError(f"{self.what} admission left more often than entered")
            self._pass_on()

    def _pass_on(self) -> None:
        """A place is free: hand it to the first in line, or count it free. Held by the
        caller: a newer arrival cannot take it in between."""
        if self._line:
            ticket = self._line.popleft()
            ticket.granted = True
            ticket.turn.notify()
        else:
            self._held -= 1

    def _full(self) -> ServiceUnavailable:
        """The 503 of a request that found no place and no room to wait for one."""
        message = self._message if self.queue is None or not self.queue.limit else FULL
        return self._error(message.format(what=self.what, limit=self.limit,
                                          queued=self.queue.limit if self.queue else 0),
                           headers=[("Retry-After", "1")])

    def lease(self, scheduler, model_id: str, **kwargs):
        """A turn on the model (localrt.inference.scheduler.Scheduler.lease with
        `kwargs`), counted here until the lease's release; the wait for a place ends
        once kwargs' `disconnected()` says the client has gone."""
        self.enter(kwargs.get("disconnected", never))
        try:
            lease = scheduler.lease(model_id, **kwargs)
        except BaseException:
            self.leave()
            raise
        lease.on_release(self.leave)
        return lease


def wait(cond: threading.Condition, disconnected: Disconnected, timeout: float | None,
         why: str) -> None:
    """cond.wait(timeout), held by the caller, for at most DISCONNECT_POLL seconds when
    a client can leave, raising ClientGone (saying `why` it waited) once it has gone.

    Like cond.wait it may return before what the caller waits for holds, so the caller
    looks again, in a loop. It must: a notify() that comes while a timed wait is timing
    out, and this thread waits to take the lock back, is spent on it, yet cond.wait
    says False, and waiting on for another notify would wait forever (a chat in the
    queue was handed its place so, and never took it)."""
    if disconnected is never:
        cond.wait(timeout)
        return
    if disconnected():
        raise ClientGone(f"The client disconnected while its request waited for {why}")
    cond.wait(DISCONNECT_POLL if timeout is None else min(DISCONNECT_POLL, timeout))
