"""Running models: starting and stopping them, how many stay loaded, and who computes when.

A model starts with its stored parameters, overridden by the start options of the
request (schemas/model-start.json). At most `maxRunningModels` stay loaded: starting
one more unloads the least recently used. With `keepAlive` set, a model idle that
long is unloaded too; `keep_for` gives one running model its own time (Ollama's
per-request keep_alive: localrt.dialects.ollama), and 0 unloads it as soon as it is idle.

The scheduler owns what runs, so it also refuses what must not happen to a running
model: deleting it, or uninstalling its engine (`not_running`, `engine_unused`).

Compute is scheduled in two steps (localrt.inference.lanes), so generations never
fight over the CPU:
  * a model serves as many requests at once as it has slots (a gguf-cpp model's
    n_parallel; one for an engine that cannot batch); more requests queue for it in
    arrival order (`Running.turn`), and `lease(model_id)` waits for a slot;
  * every step of every model is computed on a compute lane (`Scheduler.lanes`):
    `computeLanes` threads (default 1) taking steps in arrival order. A batched
    model's step is one decode that gives each of its requests its next token
    (localrt.engines.llama.batch); the first request that needs a token runs the step
    and the others wait for it (`Stepper`). Any other model's step is one token of
    its one request. `Lease.generate` gives a batched model's generation the wait for
    a step, and `Lease.steps` reads its tokens, ending with ModelStopped when the
    model is stopped meanwhile. Two llama.cpp computations that share the cores are
    both many times slower than one after the other, so on a machine with cores for
    several models, raise computeLanes and give each model `cpu_threads` = cores / lanes.

A request's `disconnected()` (localrt.admission) ends its wait for a turn or for room
under maxRunningModels, and its generation at the next token, once its client has gone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from localrt.admission import ClientGone, Disconnected, never, wait
from localrt.engines import contract
from localrt.engines.catalog import EngineNotFound
from localrt.errors import BadRequest, Conflict, HTTPError, InvalidField, ServiceUnavailable
from localrt.engines.hardware import available_cores
from localrt.inference.lanes import ComputeLanes, FairLock, Stepper
from localrt.models.registry import DEFAULT_CTX_LEN, projector_path, weights_path

log = logging.getLogger(__name__)

# The start options (schemas/model-start.json): they are also stored model parameters.
# If you add one, also map it in localrt.engines.llama and add it to the CLI (models start).
# `embedding` (llama.cpp's embedding mode) is a start option only, never stored.
START_OPTIONS = ("prompt_template", "stop", "ngl", "ctx_len", "cpu_threads", "n_batch",
                 "n_parallel", "caching_enabled", "grp_attn_n", "grp_attn_w", "mlock",
                 "flash_attn", "cache_type", "use_mmap", "speculative", "draft_max",
                 "rpc_servers", "engine")
DEFAULT_PARALLEL = 4  # n_parallel (a gguf-cpp model's slots) when nothing says
MAX_TURN_RETRIES = 3  # a request whose model was stopped while it waited restarts it this often


class ModelNotRunning(Conflict):
    code = "model_not_running"


class ModelStopped(Conflict):
    """The model was stopped (`models stop`, the server stopping) while it replied."""

    code = "model_stopped"


class InvalidStoredParameter(Conflict):
    """A stored parameter the model cannot start with; `models update` fixes it."""

    code = "invalid_stored_parameter"


class ModelLoadFailed(HTTPError):
    """The engine could not load the model (a corrupt file, not enough memory, ...)."""

    status = 422
    type = "invalid_request_error"
    code = "model_load_failed"


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
    stopping: threading.Event = field(default_factory=threading.Event)
    # Seconds it stays loaded once idle (Scheduler.keep_for): None is the scheduler's
    # keep_alive, math.inf until stopped. Guarded by Scheduler._lock.
    keep_alive: float | None = None


class Lease:
    """A request's turn on a running model: the `model`, its `options`, what it `can`
    do, `generate()` and `steps()`. `release()` exactly once when done. `disconnected()`
    says the request's client has gone: its generation stops at the next token."""

    def __init__(self, scheduler: "Scheduler", running: Running,
                 disconnected: Disconnected = never):
        self.running = running
        self.disconnected = disconnected
        self.model = running.model
        self.options = running.options
        self._scheduler = scheduler
        self._released = False
        self._callbacks: list = []

    def can(self, protocol: type) -> bool:
        """Whether the model has one of localrt.engines.contract's OPTIONAL protocols
        (contract.Tokenizing, contract.Embedding, ...), as found when it loaded."""
        return protocol in self.running.capabilities

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
            lanes, pieces = self._scheduler.lanes, iter(generation)

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
        return self._scheduler.lanes.run(fn, *args)

    def on_release(self, callback) -> None:
        """Run `callback` after the release."""
        self._callbacks.append(callback)

    def release(self) -> None:
        """Give the model to the next request."""
        if not self._released:
            self._released = True
            try:
                self._scheduler._release(self.running)
            finally:
                for callback in self._callbacks:
                    callback()


class Scheduler:
    """Owns the running models.

    `_lock` guards `_running` (model id -> Running) and each Running's `active`,
    `last_used` and `keep_alive`; `_idle` (on the same lock) is notified when a model's
    last request ends. `_start_lock` lets one load happen at a time, so a model is never
    loaded twice and the RSS measured around a load is that model's. Neither is held
    while a model computes."""

    def __init__(self, registry, engines, max_models: int = 2, keep_alive: float = 0.0,
                 lanes: int = 1, cores: int | None = None, prompt_cache: int = 0):
        self._registry = registry
        self._engines = engines
        self.prompt_cache = prompt_cache  # bytes of RAM cache per model (promptCacheMiB)
        self.max_models = max_models
        self.keep_alive = keep_alive  # seconds; 0 is off
        self.reaper = Reaper(self)
        self.lanes = ComputeLanes(lanes)
        # Each lane's generation gets its share of the cores, so together they never
        # use more threads than there are cores.
        self.default_threads = max(1, (cores or available_cores()) // lanes)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._start_lock = threading.Lock()
        self._running: dict[str, Running] = {}
        self._closed = threading.Event()
        if keep_alive > 0:
            self.reaper.need()

    # --- queries ---------------------------------------------------------------

    def is_running(self, model_id: str) -> bool:
        """Whether a model is loaded."""
        with self._lock:
            return model_id in self._running

    def loaded(self, model_id: str):
        """A running model's loaded model object; a 409 when it is not running."""
        with self._lock:
            running = self._running.get(model_id)
        if running is None:
            raise ModelNotRunning(f"Model {model_id} is not running", param="model")
        return running.model

    def models_of(self, engine: str) -> list[str]:
        """The running models of an engine."""
        with self._lock:
            return [m for m, r in self._running.items() if r.engine == engine]

    @contextlib.contextmanager
    def not_running(self, model_id: str):
        """Hold off model loads while the body runs; a 409 if `model_id` is running."""
        with self._start_lock:
            if self.is_running(model_id):
                raise Conflict(f"Model {model_id} is running; stop it first with "
                               f"`localrt models stop {model_id}`", param="model")
            yield

    @contextlib.contextmanager
    def engine_unused(self, engine: str):
        """Hold off model loads while the body runs; a 409 if a model of `engine` runs."""
        with self._start_lock:
            running = sorted(self.models_of(engine))
            if running:
                raise Conflict(f"Engine {engine} is running {', '.join(running)}; stop "
                               f"{'them' if len(running) > 1 else 'it'} first", param="engine")
            yield

    def status(self) -> list[dict]:
        """One row per running model: engine, memory, uptime and effective options."""
        now = time.time()
        with self._lock:  # `active` changes under it
            return [{"id": r.model_id, "object": "model", "engine": r.engine, "ram": r.ram,
                     "vram": r.vram, "kvCache": r.kv, "slots": r.slots,
                     "startedAt": int(r.started_at), "uptime": round(now - r.started_at, 1),
                     "requests": r.active, "options": dict(r.options),
                     "expiresAt": self._expires_at(r, now),
                     **r.report()}
                    for r in self._running.values()]

    @property
    def closed(self) -> bool:
        """Whether the scheduler is closed (the server is stopping)."""
        return self._closed.is_set()

    # --- keep-alive ------------------------------------------------------------

    def keep_for(self, model_id: str, seconds: float | None) -> None:
        """Keep a running model loaded `seconds` once idle, instead of keepAlive (Ollama's
        keep_alive): None is keepAlive again, math.inf until it is stopped (or evicted
        by maxRunningModels), 0 unloads it now if idle, else when its requests end. A
        model that is not running is left alone."""
        with self._lock:
            running = self._running.get(model_id)
            if running is None:
                return
            running.keep_alive = seconds
            now = seconds == 0 and running.active == 0
            if now:
                del self._running[model_id]
        if not now and seconds is not None and seconds < math.inf:
            self.reaper.need()
        self.reaper.wake()
        if now:
            self._unload(running, "after its request (keep_alive 0)")

    def reap(self) -> None:
        """Unload the models idle past their keep-alive (the Reaper's thread calls this)."""
        now = time.monotonic()
        with self._lock:
            idle = [(r, self._keep_of(r)) for r in self._running.values()
                    if r.active == 0 and now - r.last_used >= self._keep_of(r)]
            for r, _ in idle:
                del self._running[r.model_id]
        for r, keep in idle:
            self._unload(r, f"after {keep:g} s idle (" +
                         ("keepAlive)" if r.keep_alive is None else "keep_alive)"))

    def reap_interval(self) -> float:
        """How long the Reaper sleeps between reaps: a quarter of the shortest
        keep-alive, 0.05 to 30 s."""
        with self._lock:
            keeps = [self._keep_of(r) for r in self._running.values()]
        keeps = [k for k in keeps + [self.keep_alive or math.inf] if k < math.inf]
        return min(30.0, max(min(keeps, default=120.0) / 4, 0.05))

    def _keep_of(self, r: Running) -> float:
        """Seconds a model stays loaded once idle; math.inf: until stopped. Under the lock."""
        if r.keep_alive is not None:
            return r.keep_alive
        return self.keep_alive if self.keep_alive > 0 else math.inf

    def _expires_at(self, r: Running, now: float) -> float | None:
        """When a model will be unloaded if no request comes (Unix seconds; counted from
        now while it is busy), or None when it stays until stopped. Under the lock."""
        keep = self._keep_of(r)
        if keep == math.inf:
            return None
        idle = 0.0 if r.active else time.monotonic() - r.last_used
        return round(now + max(keep - idle, 0.0), 3)

    # --- start and stop --------------------------------------------------------

    def start(self, model_id: str, options: dict | None = None,
              disconnected: Disconnected = never) -> tuple[Running, bool]:
        """Load a model; (running, False) if it was running already. A request's start
        waiting for room (maxRunningModels) gives up once `disconnected()`."""
        record = self._registry.get(model_id)  # 404 when it is not downloaded
        effective = self.effective_options(record, options or {})  # 400s before waiting
        with self._lock:
            if model_id in self._running:
                return self._running[model_id], False
        with self._start_lock:
            with self._lock:
                if model_id in self._running:
                    return self._running[model_id], False
            if self._closed.is_set():
                raise ServiceUnavailable("The server is stopping")
            self._make_room(disconnected)
            running = self._load(record, effective)
            with self._lock:
                if not self._closed.is_set():
                    self._running[model_id] = running
            if self._closed.is_set():  # close() has unloaded the others meanwhile
                running.model.unload()
                raise ServiceUnavailable("The server is stopping")
        log.info("model %s started with %s: %s", model_id, running.engine, effective)
        return running, True

    def stop(self, model_id: str, why: str = "on request") -> None:
        """Unload a running model once its current request has stopped generating."""
        with self._lock:
            running = self._running.pop(model_id, None)
        if running is None:
            self._registry.get(model_id)  # a 404 for an unknown model
            raise ModelNotRunning(f"Model {model_id} is not running", param="model")
        self._unload(running, why)

    def close(self) -> None:
        """Unload every model (the server is stopping)."""
        self._closed.set()
        self.reaper.wake()
        with self._lock:
            running, self._running = list(self._running.values()), {}
        for r in running:
            self._unload(r, "the server is stopping")
        self.lanes.close()

    # --- leases, for chat ------------------------------------------------------

    def lease(self, model_id: str, purpose: str = "a chat request",
              disconnected: Disconnected = never) -> Lease:
        """Wait for this model's turn, starting the model with its stored parameters;
        `purpose` is what the log says the model started for. ClientGone, with nothing
        held, once `disconnected()` says the client left while it waited."""
        for _ in range(MAX_TURN_RETRIES):
            if self._closed.is_set():
                raise ServiceUnavailable("The server is stopping")
            with self._lock:
                running = self._running.get(model_id)
                if running is not None:
                    running.active += 1
            if running is None:  # start() answers a 404 for a model that is not there
                log.info("starting model %s for %s, with its stored parameters",
                         model_id, purpose)
                self.start(model_id, None, disconnected)
                continue
            try:
                running.turn.acquire(disconnected, f"its turn on model {model_id}")
            except BaseException:  # the client left: it never had the turn
                self._gave_up(running)
                raise
            if running.stopping.is_set():  # stopped or evicted while we waited
                self._release(running)
                continue
            with self._lock:
                running.last_used = time.monotonic()
            return Lease(self, running, disconnected)
        raise Conflict(f"Model {model_id} kept being stopped while this request waited; "
                       f"raise maxRunningModels or send fewer models at once", param="model")

    def _release(self, running: Running) -> None:
        self._gave_up(running)
        running.turn.release()

    def _gave_up(self, running: Running) -> None:
        """A request no longer holds or waits for a turn on `running`."""
        with self._lock:
            running.active -= 1
            running.last_used = time.monotonic()
            if running.active == 0:
                self._idle.notify_all()

    # --- internals -------------------------------------------------------------

    def effective_options(self, record: dict, requested: dict) -> dict:
        """Stored parameters overridden by the request; 400 for what the model cannot take.

        A stored parameter the model cannot take is a 409 that says how to change it.
        """
        stored = {k: record[k] for k in START_OPTIONS if record.get(k) is not None}
        options = {"engine": record["engine"], "ctx_len": DEFAULT_CTX_LEN,
                   "cpu_threads": self.default_threads, "ngl": -1, "caching_enabled": True,
                   "n_parallel": DEFAULT_PARALLEL,
                   **stored, **{k: v for k, v in requested.items() if v is not None}}

        def refuse(name: str, why: str):
            if name in requested:
                raise InvalidField(f"Invalid field '{name}': {why}", param=name)
            raise InvalidStoredParameter(
                f"Model {record['id']} has the stored parameter {name}="
                f"{json.dumps(options[name])}, but {why}; change it with `localrt models "
                f"update {record['id']} --{name} ...` or override it in the start request",
                param=name)

        engine = options["engine"]
        if engine != record["engine"]:
            try:
                self._engines.require_known(engine)
            except EngineNotFound as exc:
                refuse("engine", exc.message[0].lower() + exc.message[1:])
            wanted = self._engines.entry(record["engine"])["format"]
            runs = self._engines.entry(engine)["format"]
            if runs != wanted:
                refuse("engine", f"model {record['id']} is {wanted}, and engine {engine} "
                                 f"runs {runs or 'other'} models")
        trained = (record.get("metadata") or {}).get("context_length")
        if isinstance(trained, int) and options["ctx_len"] > trained:
            if "ctx_len" in requested:
                refuse("ctx_len", f"{options['ctx_len']} is beyond the {trained} tokens "
                                  f"model {record['id']} was trained on")
            options["ctx_len"] = trained
        for name, why in self._engines.check_options(engine, options):
            refuse(name, why)
        template = options.get("prompt_template")
        if template is not None and "{prompt}" not in template:
            refuse("prompt_template", "it needs a {prompt} placeholder")
        return options

    def _make_room(self, disconnected: Disconnected = never) -> None:
        """Unload least recently used models until one more fits under max_models.

        Only an idle model is unloaded: with every model busy, this waits for one to
        finish its requests rather than cut a reply short.
        """
        while True:
            with self._lock:
                if len(self._running) < self.max_models:
                    return
                idle = [r for r in self._running.values() if r.active == 0]
                if not idle:
                    wait(self._idle, disconnected, 1.0,
                         f"room for one more model (maxRunningModels {self.max_models})")
                    continue
                victim = min(idle, key=lambda r: r.last_used)
                del self._running[victim.model_id]
            self._unload(victim, f"to stay within maxRunningModels ({self.max_models})")

    def _load(self, record: dict, options: dict) -> Running:
        engine = options["engine"]
        path = self._model_path(record)
        before = _rss()
        # What the engine loads beside the options: a vision model's projector
        # (localrt.engines.llama.media), the RAM the prompt cache may keep (promptCacheMiB).
        loading = {**options, "prompt_cache_bytes": self.prompt_cache}
        projector = projector_path(record)
        if projector is not None:
            loading["mmproj"] = str(projector)
        try:
            model = self._engines.open(engine, str(path), loading)
        except HTTPError:
            raise
        except Exception as exc:  # llama.cpp and onnxruntime say why in their own words
            log.warning("model %s failed to load with %s: %s", record["id"], engine, exc)
            raise ModelLoadFailed(f"Model {record['id']} failed to load with {engine}: {exc} "
                                  f"(a damaged file, or not enough memory for ctx_len "
                                  f"{options.get('ctx_len')} x n_parallel "
                                  f"{options.get('n_parallel')})", param="model") from None
        measured = {"ram": max(_rss() - before, 0), "vram": 0, "kv": 0}
        can = contract.capabilities(model)
        if contract.Measured in can:
            try:
                measured.update(model.memory())
            except Exception:
                log.exception("model %s: the engine could not say its memory", record["id"])
        # A Batched model serves `slots` requests at once, in steps (localrt.engines.contract).
        slots, stepper = 1, None
        if contract.Batched in can:
            slots, stepper = model.slots, Stepper(self.lanes, model.step)
        return Running(record["id"], engine, model, options, measured["ram"], measured["vram"],
                       kv=measured["kv"], slots=slots, stepper=stepper, turn=FairLock(slots),
                       capabilities=can,
                       report=model.report if contract.Reporting in can else dict)

    def _model_path(self, record: dict) -> Path:
        path = weights_path(record)
        if path is None:
            raise BadRequest(f"Model {record['id']} has no GGUF or ONNX file to load",
                             param="model")
        return path

    def _unload(self, running: Running, why: str) -> None:
        running.stopping.set()
        # Take every slot: this waits for the requests generating now, which stop at
        # their next token (and those waiting for a slot give theirs back at once).
        for _ in range(running.slots):
            running.turn.acquire()
        try:
            running.model.unload()
        except Exception:
            log.exception("unloading %s failed", running.model_id)
        finally:
            for _ in range(running.slots):
                running.turn.release()
        log.info("model %s stopped %s", running.model_id, why)


class Reaper:
    """A scheduler's keep-alive thread, started with the first keep-alive (`need`): it
    asks the scheduler to unload what was idle too long (Scheduler.reap), then sleeps
    as long as the scheduler says or until woken because a keep-alive changed."""

    def __init__(self, scheduler: Scheduler):
        self._scheduler = scheduler
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards _thread
        self._thread: threading.Thread | None = None

    def need(self) -> None:
        """Start the thread, unless it runs."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="localrt-keep-alive",
                                                daemon=True)
                self._thread.start()

    def wake(self) -> None:
        """Look again now: a keep-alive changed, or the scheduler is closing."""
        self._wake.set()

    def _run(self) -> None:
        scheduler = self._scheduler
        while not scheduler.closed:
            self._wake.wait(scheduler.reap_interval())
            self._wake.clear()
            if scheduler.closed:
                return
            scheduler.reap()


def _rss() -> int:
    """This process's resident memory in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0

