"""A running model and a request's turn on it.

`Running` is what the scheduler (localrt.inference.scheduler) keeps of a loaded model
and what `ps` shows about it; `Use` is a moment's use of it outside its turns, which
computes nothing (Scheduler.using); `Lease` is one request's turn on it: its generation,
paced on the compute lanes (localrt.inference.lanes), which ends with ModelStopped
when the model is stopped meanwhile, or with ClientGone once the request's client has
gone (localrt.admission).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from localrt.admission import ClientGone, Disconnected, never
from localrt.engines import contract
from localrt.errors import Conflict, InvalidField
from localrt.inference.lanes import ComputeLanes, FairLock, Stepper

log = logging.getLogger(__name__)


class ModelStopped(Conflict):
    """The model was stopped (`models stop`, the server stopping) while it replied."""

    code = "model_stopped"


@dataclass
class Running:
    """A loaded model and what `ps` shows about it."""

    model_id: str
    engine: str
    model: contract.Model
    options: dict
    ram: int
    vram: int
    kv: int = 0  # bytes of KV cache, in ram or vram
    slots: int = 1  # requests served at once
    stepper: Stepper | None = None  # a batched model's steps; None: one request at a time
    capabilities: frozenset = frozenset()  # its contract.OPTIONAL protocols (Lease.can)
    report: Callable[[], dict] = dict  # a Reporting model's own status fields
    started_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    turn: FairLock = field(default_factory=FairLock)  # a slot per request, in order
    active: int = 0  # requests holding or waiting for a slot; guarded by Scheduler._lock
    # Requests using it outside its turns (Scheduler.using), which its unload waits for;
    # guarded by Scheduler._lock.
    users: int = 0
    stopping: threading.Event = field(default_factory=threading.Event)
    # Seconds it stays loaded once idle (Scheduler.keep_for): None is the scheduler's
    # keep_alive, math.inf until stopped. Guarded by Scheduler._lock.
    keep_alive: float | None = None


class Use:
    """A moment's use of a running model outside its turns (Scheduler.using): its `model`,
    `options` and what it `can` do, as a Lease has them, for what reads the model
    without computing (llama-server's utility routes: localrt.inference.utility)."""

    def __init__(self, running: Running):
        self.running = running
        self.model = running.model
        self.options = running.options

    def can(self, protocol: type) -> bool:
        """Whether the model has one of localrt.engines.contract's OPTIONAL protocols."""
        return protocol in self.running.capabilities


class Lease:
    """A request's turn on a running model: the `model`, its `options`, what it `can`
    do, `generate()` and `steps()`. `release()` exactly once when done. `disconnected()`
    says the request's client has gone: its generation stops at the next token."""

    def __init__(self, running: Running, lanes: ComputeLanes,
                 give_back: Callable[[Running], None], disconnected: Disconnected = never):
        self.running = running
        self.disconnected = disconnected
        self.model = running.model
        self.options = running.options
        self._lanes = lanes  # the scheduler's compute lanes
        self._give_back = give_back  # the turn back to the scheduler (Scheduler._release)
        self._released = False
        self._callbacks: list = []

    def can(self, protocol: type) -> bool:
        """Whether the model has one of localrt.engines.contract's OPTIONAL protocols
        (contract.Tokenizing, contract.Embedding, ...), as found when it loaded."""
        return protocol in self.running.capabilities

    def lora(self, lora: list | None) -> dict:
        """The generation parameters of a request's `lora` (llama-server's [{"id",
        "scale"}]: {"lora": ...}, which the engine checks against its adapters), or {}
        when it has none; a 400 naming `lora` for adapters on a model whose engine has
        none (contract.Adapted)."""
        if lora is None:
            return {}
        if lora and not self.can(contract.Adapted):
            raise InvalidField(f"Invalid field 'lora': model {self.running.model_id}'s "
                               f"engine ({self.running.engine}) takes no LoRA adapters",
                               param="lora")
        return {"lora": [dict(e) for e in lora]}

    def generate(self, messages: list, params: dict):
        """The model's Generation of a reply (contract.Model.generate); a batched
        model's waits for its tokens on the scheduler's steps. Read it with steps()."""
        if self.running.stepper is None:
            return self.model.generate(messages, params)
        return self.model.generate(messages, params, wait=self._wait_step)

    def steps(self, generation) -> Iterator[str]:
        """The pieces of a generation made by generate(), computed on a compute lane:
        each token in its turn, or for a batched model by the steps that serve all its
        requests; ModelStopped if the model is stopped before the generation ends."""
        running = self.running
        if running.stepper is None:
            lanes, pieces = self._lanes, iter(generation)

            def read():
                return lanes.run(next, pieces, None)
        else:
            pieces = iter(generation)  # its waits run the steps (_wait_step)

            def read():
                return next(pieces, None)
        try:
            while not running.stopping.is_set():
                if self.disconnected():  # nobody would read the rest
                    raise ClientGone(f"The client disconnected during a reply of "
                                     f"{running.model_id}")
                piece = read()
                if piece is None:
                    return
                yield piece
            raise ModelStopped(f"Model {running.model_id} was stopped during this reply")
        except ModelStopped:
            log.info("a reply of %s was cut short: the model was stopped", running.model_id)
            raise

    def _wait_step(self) -> None:
        """How a batched model's generation waits for its next token."""
        running = self.running
        if running.stopping.is_set():
            raise ModelStopped(f"Model {running.model_id} was stopped during this reply")
        running.stepper.next()

    def run(self, fn, *args):
        """fn(*args) on a compute lane in this lease's turn (one decode of an embedding
        batch, say, which a batched model's steps take turns with): its result;
        ModelStopped if the model was stopped meanwhile."""
        running = self.running
        if running.stopping.is_set():
            raise ModelStopped(f"Model {running.model_id} was stopped during this request")
        return self._lanes.run(fn, *args)

    def on_release(self, callback) -> None:
        """Run `callback` after the release."""
        self._callbacks.append(callback)

    def release(self) -> None:
        """Give the model to the next request."""
        if not self._released:
            self._released = True
            try:
                self._give_back(self.running)
            finally:
                for callback in self._callbacks:
                    callback()
