"""Running models: starting and stopping them, how many stay loaded, and who computes when.

A model starts with the options localrt.models.options resolves (its stored
parameters, overridden by the start options of the request). At most
`maxRunningModels` stay loaded: starting one more unloads the least recently used.
With `keepAlive` set, a model idle that long is unloaded too; `keep_for` gives one
running model its own time (Ollama's per-request keep_alive: localrt.dialects.ollama),
and 0 unloads it as soon as it is idle.

The scheduler owns what runs, so it also refuses what must not happen to a running
model: deleting it, or uninstalling its engine (`not_running`, `engine_unused`).

Compute is scheduled in two steps (localrt.inference.lanes), so generations never
fight over the CPU:
  * a model serves as many requests at once as it has slots (a gguf-cpp model's
    n_parallel; one for an engine that cannot batch); more requests queue for it in
    arrival order (`Running.turn`, localrt.inference.running), and `lease(model_id)`
    waits for a slot;
  * every step of every model is computed on a compute lane (`Scheduler.lanes`):
    `computeLanes` threads (default 1) taking steps in arrival order. A batched
    model's step is one decode that gives each of its requests its next token
    (localrt.engines.llama.batch); the first request that needs a token runs the step
    and the others wait for it (`Stepper`). Any other model's step is one token of
    its one request. `Lease.generate` (localrt.inference.running) gives a batched
    model's generation the wait for a step, and `Lease.steps` reads its tokens, ending
    with ModelStopped when the model is stopped meanwhile. Two llama.cpp computations
    that share the cores are both many times slower than one after the other, so on a
    machine with cores for several models, raise computeLanes and give each model
    `cpu_threads` = cores / lanes.

A request's `disconnected()` (localrt.admission) ends its wait for a turn or for room
under maxRunningModels, and its generation at the next token, once its client has gone.

Before a GGUF model loads, its weights, KV cache and compute buffers are counted from its
headers and refused with 503 insufficient_memory when the free RAM (and GPU memory)
cannot hold them (localrt.engines.memory), so the out-of-memory killer never has to.

Before a model's files are loaded here for the first time with an engine build, a child
process loads them (`vetted`, localrt.engines.vetting): a file the child could not load
is refused with 400 invalid_model_file and never loaded here, and its record says so
(`vetting`). Imports and pulls ask the same before they register a model (`vet_new`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from pathlib import Path

from localrt.admission import Disconnected, never, wait
from localrt.engines import contract, memory
from localrt.engines.hardware import free_ram
from localrt.engines.vetting import invalid_file
from localrt.errors import BadRequest, Conflict, HTTPError, ServiceUnavailable
from localrt.inference.lanes import ComputeLanes, FairLock, Stepper
from localrt.inference.running import Lease, Running, Use
from localrt.models import roles
from localrt.models.options import StartOptions
from localrt.models.registry import weights_path

log = logging.getLogger(__name__)

MAX_TURN_RETRIES = 3  # a request whose model was stopped while it waited restarts it this often


class ModelNotRunning(Conflict):
    code = "model_not_running"


class ModelLoadFailed(HTTPError):
    """The engine could not load the model (a corrupt file, not enough memory, ...)."""

    status = 422
    type = "invalid_request_error"
    code = "model_load_failed"


class Scheduler:
    """Owns the running models.

    `_lock` guards `_running` (model id -> Running) and each Running's `active`,
    `users`, `last_used` and `keep_alive`; `_idle` (on the same lock) is notified when a
    model's last request ends, or its last use outside its turns (`using`).
    `_start_lock` lets one load happen at a time, so a model is never loaded twice and
    the RSS measured around a load is that model's. Neither is held while a model
    computes."""

    def __init__(self, registry, engines, options: StartOptions, max_models: int = 2,
                 keep_alive: float = 0.0, lanes: int = 1, vetting=None,
                 gpu_overhead: int = 512 << 20):
        self._registry = registry
        self._engines = engines
        self.vetting = vetting  # localrt.engines.vetting.Vetting: first loads in a child
        self._options = options  # what a model starts with (localrt.models.options)
        self.max_models = max_models
        self.gpu_overhead = gpu_overhead  # bytes fit leaves free on each device (gpuOverheadMiB)
        self.keep_alive = keep_alive  # seconds; 0 is off
        self.reaper = Reaper(self)
        self.lanes = ComputeLanes(lanes)
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

    @contextlib.contextmanager
    def using(self, model_id: str):
        """A running model's `Use` for a moment outside its turns (llama-server's utility
        routes read its vocabulary, template and slots beside its generations); its
        unload waits until the body ends. A 409 model_not_running when it is not
        running (a 404 for no such model): nothing is started."""
        with self._lock:
            running = self._running.get(model_id)
            if running is not None and running.stopping.is_set():
                running = None
            if running is not None:
                running.users += 1
        if running is None:
            self._registry.get(model_id)  # a 404 for an unknown model
            raise ModelNotRunning(f"Model {model_id} is not running; start it first with "
                                  f"`localrt models start {model_id}`", param="model")
        try:
            yield Use(running)
        finally:
            with self._lock:
                running.users -= 1
                if not running.users:
                    self._idle.notify_all()

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
        effective = self._options.resolve(record, options or {})  # 400s before waiting
        with self._lock:
            if model_id in self._running:
                return self._running[model_id], False
        self._registry.check_files(model_id)  # 409 model_file_missing, 400 invalid_model_file
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
            return Lease(running, self.lanes, self._release, disconnected)
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

    # --- the first load of a file, in a child ----------------------------------

    def vetted(self, record: dict, options: dict | None = None) -> dict | None:
        """How a child's load of the model's files with the build its engine loads went
        (localrt.engines.vetting), asked of a child only the first time: the record's
        `vetting` state, {"ok", "build", "reason" when not ok, "template" when its chat
        template refused the child's chat}; None for an engine whose
        loads are not vetted. `options`: the start options (None: the stored ones). A
        ModelLoadFailed when the child failed for a reason that is not the file's."""
        if self.vetting is None:
            return None
        if options is None:
            options = self._options.resolve(record, {})
        engine = options["engine"]
        build = self._engines.build(engine)
        if build is None:
            return None
        name, engine_dir = build
        weights = self._model_path(record)
        folder = Path(record["path"])
        key = self.vetting.key([(folder / f["path"], f.get("sha256"))
                                 for f in record["files"]], name)
        outcome = self.vetting.known(key)
        if outcome is None:
            loading = self._loading(record, options)
            outcome = self.vetting.vet(key, engine, engine_dir, weights, loading,
                                        sum(f["size"] for f in record["files"]))
        if not outcome.about_file:
            raise ModelLoadFailed(f"Model {record['id']} failed to load with {engine} (in a "
                                  f"child, before this server loads it): {outcome.reason}",
                                  param="model")
        state = {"ok": outcome.ok, "build": name}
        if not outcome.ok:
            state["reason"] = outcome.reason
        if outcome.template:  # the file loads; its chat template refused the child's chat
            state["template"] = outcome.template
        return state

    def vet_new(self, record: dict) -> dict | None:
        """For an import or a pull's end, before the model is registered: `vetted` with
        its stored start options; None when that cannot be said now (its engine is not
        installed, a stored parameter it cannot start with, a failure that is not the
        file's), which its start will say."""
        try:
            return self.vetted(record)
        except HTTPError as exc:
            log.info("model %s: its first load waits for its start: %s", record["id"],
                     exc.message)
            return None

    def _vet(self, record: dict, options: dict) -> None:
        """Raise InvalidModelFile unless a child loaded the model's files (`vetted`);
        the record keeps the state."""
        state = self.vetted(record, options)
        if state is None:
            return
        if state != record.get("vetting") and self._registry.has(record["id"]):
            self._registry.set_vetting(record["id"], state)
        if not state["ok"]:
            raise invalid_file(record["id"], self._model_path(record).name, state["reason"])

    def _load(self, record: dict, options: dict) -> Running:
        engine = options["engine"]
        path = self._model_path(record)
        fitted = self._check_memory(record, options)  # before anything allocates
        self._vet(record, options)  # before any native code reads the file here
        before = _rss()
        loading = self._loading(record, options)
        if fitted is not None:  # the engine loads that many layers, and says it was fit
            loading.update(ngl=fitted, fit=True)
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

    def _check_memory(self, record: dict, options: dict) -> int | None:
        """A 503 insufficient_memory, before anything loads, for a GGUF model whose
        weights, KV cache and compute buffers this machine cannot hold now
        (localrt.engines.memory); and for a GPU build started without `ngl`, the layers
        its devices hold (memory.fit), which it returns (None: nothing was fit); with an
        `ngl`, a 400 where it puts a tensor over a device's buffer limit on it
        (memory.check_buffers: ggml's Vulkan backend would abort the server). A model
        with rpc_servers is not checked (its layers go elsewhere), nor one on a system
        without /proc/meminfo; a header the estimate cannot read is left to the file's
        checks."""
        path, ram = self._model_path(record), free_ram()
        if path.suffix.lower() != ".gguf" or options.get("rpc_servers"):
            return None
        beside = []  # a projector's path, and each adapter's (a list of {path, scale})
        for value in roles.beside(record).values():
            beside += [Path(e["path"]) for e in value] if isinstance(value, list) \
                else [Path(value)]
        try:
            needed = memory.need(memory.parts_of(path), beside, options)
        except (OSError, ValueError, TypeError) as exc:  # GGUFError is a ValueError
            log.info("model %s: no memory estimate (%s)", record["id"], exc)
            return None
        ngl = options.get("ngl")
        devices = self._offload_devices(options) if ngl != 0 else []
        fitted = None
        if devices and ngl is None:
            decided = memory.fit(needed, devices, self.gpu_overhead)
            fitted = decided.ngl
            log.info("model %s: fit puts %d of its %d layers on %s (%d MiB free for them "
                     "after gpuOverheadMiB %d and compute buffers; all would need %d MiB)",
                     record["id"], decided.ngl, decided.of,
                     ", ".join(d["name"] for d in devices), decided.room >> 20,
                     self.gpu_overhead >> 20, decided.needs >> 20)
            if decided.over is not None:
                log.info("model %s: fit stops before the %s layer: its %s is %d MiB, over "
                         "the %d MiB one buffer may hold there", record["id"],
                         decided.over.layer, decided.over.tensor, decided.over.bytes >> 20,
                         decided.over.limit >> 20)
        elif devices:  # an explicit ngl: never a tensor ggml would abort on
            memory.check_buffers(record["id"], needed, int(ngl), devices)
        if ram is not None and needed.total > ram:  # only then ask the GPUs
            memory.check(record["id"], needed, ram, *self._device_memory(devices))
        log.info("model %s needs about %d MiB (weights %d, KV cache %d, compute %d)",
                 record["id"], needed.total >> 20, needed.weights >> 20, needed.kv >> 20,
                 needed.compute >> 20)
        return fitted

    def _offload_devices(self, options: dict) -> list[dict]:
        """The devices the engine's build puts layers on (memory.offload_devices): a
        CUDA or Vulkan build's, lavapipe's included; [] for a CPU build, which never
        reads the GPUs."""
        build = self._engines.build(options["engine"])
        variant = build[0].split("/")[1] if build and build[0].count("/") >= 2 else ""
        backend = next((b for b in ("cuda", "vulkan") if b in variant), None)
        if backend is None:
            return []
        return memory.offload_devices(self._engines.hardware.gpus.list(), backend)

    @staticmethod
    def _device_memory(devices: list[dict]) -> tuple[int, str]:
        """(bytes free, names) on the offload `devices` (none with ngl 0 or a CPU build)
        that are not the CPU (lavapipe's memory is the RAM)."""
        gpus = [g for g in devices if g["type"] != "cpu"]
        return sum(g["free"] for g in gpus), ", ".join(g["name"] for g in gpus)

    @staticmethod
    def _loading(record: dict, options: dict) -> dict:
        """What the engine loads a model with: its start options, the files it loads
        beside the weights, each under its role's key (a vision model's projector:
        localrt.engines.llama.media; its LoRA adapters: localrt.engines.llama.adapters),
        and its id as `model`, for its messages; never
        the options a status row shows."""
        return {**options, **roles.beside(record), "model": record["id"]}

    def _model_path(self, record: dict) -> Path:
        path = weights_path(record)
        if path is None:
            raise BadRequest(f"Model {record['id']} has no GGUF or ONNX file to load",
                             param="model")
        return path

    def _unload(self, running: Running, why: str) -> None:
        running.stopping.set()
        with self._lock:  # a use outside the turns (`using`) ends first: it is short
            while running.users:
                self._idle.wait()
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

