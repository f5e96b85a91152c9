"""Admission: how many long-lived replies of each kind are in progress at once, the
server threads they leave for everything else, and noticing a client that left.

Every reply that can last holds one of waitress's worker threads from its arrival to
its close, generating, streaming or waiting for its turn: a chat (OpenAI's, and
through it Anthropic's messages, the Responses API and Ollama's /api/chat and
/api/generate), a completion, an embedding, a GET /v1/events stream, an Ollama
/api/pull that follows its download. Each kind has its own `Admission`; past its
limit a request is a 503 with Retry-After that names the kind and the limit, in its
route's error shape. The limits together (`LIMITS`) stay SPARE_THREADS below the
server's thread count (`threads_for`, localrt.server.THREADS), so GET /v1/models,
/healthz and the rest still answer when every kind is at its limit.

A request whose client has gone gives its place back within DISCONNECT_POLL seconds,
even while it waits for its turn: the app hands the handler a `disconnected()`
callable (waitress's, localrt.connections), and every wait of a request (a model's
turn, room for a model, an upstream with room, the next event) looks at it at least
that often (`wait`) and raises ClientGone. The domain modules see only the callable.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from localrt.errors import HTTPError, ServiceUnavailable

# Each kind's limit on requests in progress (generating, streaming or queued).
# If you add a kind, give it a limit here: THREADS grows with the sum.
LIMITS = {
    "chat": 16,        # OpenAI's, Anthropic's and Ollama's chats, and Responses
    "completion": 8,   # OpenAI's text completions, Ollama's raw /api/generate
    "embedding": 8,    # OpenAI's embeddings, Ollama's /api/embed
    "events": 4,       # open GET /v1/events streams
    "pull": 4,         # Ollama /api/pull replies following their download
}
# Worker threads no long-lived reply may hold: with every kind at its limit, these
# still answer the short requests (listings, status, /healthz, config, a model start).
SPARE_THREADS = 8
# Seconds between looks at whether a waiting request's client is still there.
DISCONNECT_POLL = 0.2


def threads_for(limits: dict[str, int]) -> int:
    """The worker threads a server needs for these limits: one per request they admit,
    and SPARE_THREADS for the rest of the API."""
    return sum(limits.values()) + SPARE_THREADS


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


class Admission:
    """At most `limit` requests of one kind (`what`: "chat", "completion", ...) in
    progress at once, generating or queued: each holds a server thread
    (localrt.server.THREADS), and the rest of the API needs some. Past that, a 503
    (`error`) with `message`, which may name {what} and {limit}."""

    def __init__(self, what: str, limit: int,
                 message: str = "Too many {what} requests in progress (at most {limit}); "
                                "retry shortly",
                 error: type[ServiceUnavailable] = ServiceUnavailable):
        self.what, self.limit = what, limit
        self._message, self._error = message, error
        self._lock = threading.Lock()  # guards _held
        self._held = 0

    @property
    def in_progress(self) -> int:
        """How many requests hold a place now."""
        with self._lock:
            return self._held

    def enter(self) -> None:
        """Count one more request in progress; a 503 when `limit` are."""
        with self._lock:
            if self._held < self.limit:
                self._held += 1
                return
        raise self._error(self._message.format(what=self.what, limit=self.limit),
                          headers=[("Retry-After", "1")])

    def leave(self) -> None:
        """One request fewer in progress."""
        with self._lock:
            if self._held <= 0:
                raise ValueError(f"{self.what} admission left more often than entered")
            self._held -= 1

    def lease(self, scheduler, model_id: str, **kwargs):
        """A turn on the model (localrt.inference.scheduler.Scheduler.lease with
        `kwargs`), counted here until the lease's release."""
        self.enter()
        try:
            lease = scheduler.lease(model_id, **kwargs)
        except BaseException:
            self.leave()
            raise
        lease.on_release(self.leave)
        return lease


def wait(cond: threading.Condition, disconnected: Disconnected, timeout: float | None,
         why: str) -> None:
    """cond.wait(timeout), held by the caller, but waking every DISCONNECT_POLL seconds
    to raise ClientGone (saying `why` it waited) once the client has gone."""
    if disconnected is never:
        cond.wait(timeout)
        return
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if disconnected():
            raise ClientGone(f"The client disconnected while its request waited for {why}")
        left = DISCONNECT_POLL if deadline is None else \
            min(DISCONNECT_POLL, deadline - time.monotonic())
        if left <= 0:
            return
        if cond.wait(left):
            return
