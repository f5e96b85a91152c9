"""The one path of a generation request: chat, completions and embeddings.

Each of the three kinds takes the same steps, written here once:

    record   the model's definition (a 404 before anything starts)
    clock    its times from the request's arrival, counted in /metrics (`Kind.timed`)
    remote?  decided here, once: a remote model's request goes whole to its upstreams
             (localrt.remote.remotes), counted in the kind's admission until it ends
    local    otherwise the kind's own code reads the request, takes a turn on the
             running model (`Local.lease`: the kind's admission, then the scheduler's
             lease) and makes the reply: a dict, or an `EventStream`

A request holds its place in the kind's admission (localrt.admission) until its reply
is closed: a streamed one until the server closes it. `disconnected()`, the app's
look at the client's connection, ends a wait for a turn or an upstream, and a
generation, once the client has gone (localrt.admission.ClientGone).

A streamed reply never starts with an error: what fails before its first event is an
HTTP error. What fails part way ends the stream with one error event (`stream_error`),
which carries the error's code and a message, never an exception's raw text.

Dialects (localrt.dialects) use `start` and `keep_for` to load a model before its
first request and to say how long it stays loaded after it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from localrt.errors import HTTPError
from localrt.admission import Admission, Disconnected, never
from localrt.inference.running import Lease
from localrt.metrics import Clock
from localrt.routing import SSE_DONE, sse

log = logging.getLogger(__name__)


@dataclass
class Kind:
    """One kind of generation request: its name in messages, its path under an
    upstream's /v1, whether /metrics counts it, and the limit on those in progress
    (localrt.admission.LIMITS by default)."""

    name: str
    path: str
    max_requests: int
    timed: bool = True
    admission: Admission = field(init=False)

    def __post_init__(self):
        self.admission = Admission(self.name, self.max_requests)


@dataclass
class Local:
    """A request for a model loaded here: its id, record and clock, and its turn."""

    model_id: str
    record: dict
    clock: Clock
    kind: Kind
    _path: "RequestPath"
    disconnected: Disconnected = never

    def lease(self, **kwargs) -> Lease:
        """A turn on the model (started if it is not running; Scheduler.lease's
        `kwargs`), counted in the kind's admission until the lease's release; given up
        when the client leaves while it waits."""
        return self.kind.admission.lease(self._path.scheduler, self.model_id,
                                         disconnected=self.disconnected, **kwargs)

    def check_request(self, params: dict) -> None:
        """A 400 for what the model's engine cannot serve, before any wait."""
        self._path.engines.check_request(self.record["engine"], params)

    def check_options(self, options: dict) -> list[tuple[str, str]]:
        """(option, why) for each start option the model's engine cannot take."""
        return self._path.engines.check_options(self.record["engine"], options)


class RequestPath:
    """The steps every chat, completion and embedding request shares (see the module)."""

    def __init__(self, registry, engines, scheduler, remotes, metrics=None):
        self.registry = registry
        self.engines = engines
        self.scheduler = scheduler
        self.remotes = remotes  # localrt.remote.remotes.Remotes
        self.metrics = metrics

    def serve(self, kind: Kind, body: dict, local: Callable[[Local], object],
              remote: Callable[[Callable[[dict], object]], object] | None = None,
              disconnected: Disconnected = never):
        """The reply to `body`: local(request) for a model loaded here; for a remote
        model its upstream's reply, or remote(forward) where the kind asks the upstream
        something else (`forward(body)` sends a body of its own). `disconnected()` says
        the client has gone (localrt.admission)."""
        model_id = body["model"]
        # From the arrival; an untimed kind's clock counts nowhere (metrics None).
        clock = Clock(self.metrics if kind.timed else None, model_id)
        record = self.registry.get(model_id)  # 404 before anything starts
        if self.is_remote(record):
            def forward(sent: dict):
                return self.remotes.forward(record, sent, kind.admission, kind.path,
                                            clock, disconnected)
            return forward(body) if remote is None else remote(forward)
        return local(Local(model_id, record, clock, kind, self, disconnected))

    def is_remote(self, record: dict) -> bool:
        """Whether a model is served by upstreams: nothing loads here."""
        return self.engines.forwards(record["engine"])

    def start(self, model_id: str, options: dict) -> int:
        """Load a model that is not running, with these start options: the nanoseconds
        the load took (0 for one running already, or a remote model)."""
        record = self.registry.get(model_id)
        if self.is_remote(record) or self.scheduler.is_running(model_id):
            return 0
        began = time.monotonic_ns()
        self.scheduler.start(model_id, options)
        return time.monotonic_ns() - began

    def keep_for(self, model_id: str, seconds: float | None) -> None:
        """How long a running model stays loaded once idle (Scheduler.keep_for)."""
        self.scheduler.keep_for(model_id, seconds)


def respond(body: dict, reply, stream: Callable[[object, bool], "EventStream"]):
    """A local reply: `stream(reply, include_usage)` when the request streams, else the
    whole reply dict (`reply.complete()`), the model freed either way (`reply.close()`)."""
    if body.get("stream"):
        return stream(reply, include_usage(body))
    try:
        return reply.complete()
    finally:
        reply.close()


def include_usage(body: dict) -> bool:
    """Whether a streamed reply ends with a chunk of its usage (stream_options)."""
    return bool((body.get("stream_options") or {}).get("include_usage"))


def stream_error(exc: BaseException, model_id: str) -> dict:
    """The {"error": ...} event that ends a stream broken part way: an HTTPError's own
    code and message (a model stopped mid-reply, an upstream that broke off); anything
    else is logged and said as generation_failed, its text kept out of the reply."""
    if isinstance(exc, HTTPError):
        return {"error": exc.body()["error"]}
    log.error("generation failed in a stream of %s", model_id, exc_info=exc)
    return {"error": {"message": f"Generation failed part way through the reply of model "
                                 f"{model_id}; the server log has the details",
                      "type": "server_error", "code": "generation_failed"}}


class EventStream:
    """A streamed reply as OpenAI writes it: Server-Sent Events of chunk dicts, then
    [DONE]. Subclasses give `chunks()` (one {"error"} dict ends a broken one) and
    `close()`, which the server calls once when the reply ends or the client goes away."""

    content_type = "text/event-stream"

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.chunks():
            yield sse(chunk)
        yield SSE_DONE

    def chunks(self) -> Iterator[dict]:
        """The reply's chunk dicts."""
        raise NotImplementedError

    def close(self) -> None:
        """Free what the reply holds."""
        raise NotImplementedError
