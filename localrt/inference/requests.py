"""The one path of a generation request: chat, completions and embeddings.

Each of the three kinds takes the same steps, written here once:

    record   the model's definition (a 404 before anything starts)
    clock    its times from the request's arrival, counted in /metrics (`Kind.timed`)
    remote?  decided here, once: a remote model's request goes whole to its upstreams
             (localrt.remote.remotes), counted in the kind's admission until it ends
    local    otherwise the kind's own code reads the request, takes a turn on the
             running model (`Local.lease`: the kind's admission, then the scheduler's
             lease) and makes the reply (native events for chat and completions)

A request holds its place in the kind's admission (localrt.admission) until its reply
is closed: a streamed one until the server closes it. Past the kind's limit it waits
for a place in the kind's line, and the three kinds' lines share one bound
(`RequestPath.queue`, maxQueuedRequests). `disconnected()`, the app's
look at the client's connection, ends a wait for a turn or an upstream, and a
generation, once the client has gone (localrt.admission.ClientGone).

A streamed reply never starts with an error: what fails before its first event is an
HTTP error. What fails part way ends the stream with one error event
(localrt.routing.stream_error), which carries the error's code and a message, never an
exception's raw text.

Dialects (localrt.dialects) use `start` and `keep_for` to load a model before its
first request and to say how long it stays loaded after it, and Ollama's `running`
and `remove`: no dialect sees the scheduler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from localrt.admission import Admission, Disconnected, Queue, never
from localrt.inference.running import Lease
from localrt.inference.scheduler import ModelNotRunning
from localrt.metrics import Clock


@dataclass
class Kind:
    """One kind of generation request: its name in messages, its path under an
    upstream's /v1, whether /metrics counts it, the limit on those in progress
    (localrt.admission.LIMITS by default), and the queue its requests wait in past
    that limit (RequestPath.queue; None: a 503 at once)."""

    name: str
    path: str
    max_requests: int
    timed: bool = True
    queue: Queue | None = None
    admission: Admission = field(init=False)

    def __post_init__(self):
        self.admission = Admission(self.name, self.max_requests, queue=self.queue)


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

    def __init__(self, registry, engines, scheduler, remotes, metrics=None,
                 queue: Queue | None = None):
        self.registry = registry
        self.engines = engines
        self.scheduler = scheduler
        self.remotes = remotes  # localrt.remote.remotes.Remotes
        self.metrics = metrics
        # The bound on requests of its kinds waiting for a place, all kinds together
        # (localrt.admission.Queue); None: past its limit a kind's request is a 503.
        self.queue = queue

    def serve(self, kind: Kind, model_id: str, local: Callable[[Local], object],
              remote: Callable[[Callable[[dict], object]], object],
              disconnected: Disconnected = never):
        """The reply to a request for `model_id`: local(request) for a model loaded
        here; for a remote model remote(forward), where `forward(body)` sends a body
        to its upstreams and gives their reply. `disconnected()` says the client has
        gone (localrt.admission)."""
        # From the arrival; an untimed kind's clock counts nowhere (metrics None).
        clock = Clock(self.metrics if kind.timed else None, model_id)
        record = self.registry.get(model_id)  # 404 before anything starts
        if self.is_remote(record):
            def forward(sent: dict):
                return self.remotes.forward(record, sent, kind.admission, kind.path,
                                            clock, disconnected)
            return remote(forward)
        return local(Local(model_id, record, clock, kind, self, disconnected))

    def passthrough(self, kind: Kind, body: dict, disconnected: Disconnected = never):
        """For a remote model, its upstream's own reply to `body` as the client sent it
        (a dict, or a stream of its chunks): OpenAI's routes' one deliberate branch, so
        fields localrt does not know (vLLM's) reach its clients. None for a model
        loaded here; a 404 for no such model."""
        return self.serve(kind, body["model"], lambda local: None,
                          remote=lambda forward: forward(body), disconnected=disconnected)

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

    def running(self) -> list[dict]:
        """The running models' rows (Scheduler.status)."""
        return self.scheduler.status()

    def remove(self, model_id: str, why: str) -> None:
        """Delete a model: stopped first if it runs (`why` tells a reply it ends), then
        its files and definition; a 404 for no such model."""
        self.registry.get(model_id)  # the 404
        if self.scheduler.is_running(model_id):
            try:
                self.scheduler.stop(model_id, why)
            except ModelNotRunning:  # it stopped meanwhile
                pass
        with self.scheduler.not_running(model_id):
            self.registry.remove(model_id)

    def keep_for(self, model_id: str, seconds: float | None) -> None:
        """How long a running model stays loaded once idle (Scheduler.keep_for)."""
        self.scheduler.keep_for(model_id, seconds)
