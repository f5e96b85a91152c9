"""Who computes when: turns on a model, the compute lanes, and a batched model's steps.

  * `FairLock`: a model's slots, given to requests strictly in arrival order (each
    Running's `turn`, localrt.inference.scheduler).
  * `ComputeLanes`: the threads every token step runs on, in arrival order.
  * `Stepper`: a batched model's steps on a lane, one at a time, each serving every
    request that needs a token.
"""

from __future__ import annotations

import collections
import queue
import threading

from localrt.admission import Disconnected, never, wait
from localrt.errors import ServiceUnavailable


class FairLock:
    """A semaphore with `slots` that lets waiters in strictly in arrival order."""

    def __init__(self, slots: int = 1):
        self._cond = threading.Condition(threading.Lock())  # guards _free and _queue
        self._free = slots
        self._queue: collections.deque = collections.deque()

    def acquire(self, disconnected: Disconnected = never, why: str = "a slot") -> None:
        """Wait for a slot; earlier callers get theirs first. A caller whose client has
        gone (`disconnected()`) leaves the queue with ClientGone, saying `why` it waited."""
        with self._cond:
            if self._free and not self._queue:
                self._free -= 1
                return
            me = object()
            self._queue.append(me)
            try:
                while not (self._free and self._queue[0] is me):
                    wait(self._cond, disconnected, None, why)
            except BaseException:
                self._queue.remove(me)
                self._cond.notify_all()  # the next in line may be first now
                raise
            self._queue.popleft()
            self._free -= 1
            if self._free and self._queue:
                self._cond.notify_all()

    def release(self) -> None:
        """Give a slot back."""
        with self._cond:
            self._free += 1
            if self._queue:
                self._cond.notify_all()

    def __enter__(self) -> "FairLock":
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    @property
    def waiting(self) -> int:
        """How many callers are queued."""
        with self._cond:
            return len(self._queue)


class ComputeLanes:
    """Threads that run every token step, so llama.cpp always computes on the same threads.

    llama.cpp's OpenMP keeps a pool of helper threads per thread that calls it, and
    once several threads have called it each decode is about twice as slow (measured
    with tests/bench/bench_chat.py: 150 tokens/s fell to 79 when each request decoded
    on its own server thread). Steps are taken in arrival order.
    """

    def __init__(self, lanes: int = 1):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _closed and the end markers' place in _queue
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"localrt-compute-{i}",
                                          daemon=True) for i in range(lanes)]
        for thread in self._threads:
            thread.start()

    def run(self, fn, *args):
        """fn(*args) on a compute thread: its result, or its exception raised here."""
        done, box = threading.Event(), {}
        with self._lock:  # no step is queued behind the threads' ends
            if self._closed:
                raise ServiceUnavailable("The server is stopping")
            self._queue.put((fn, args, box, done))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            fn, args, box, done = job
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # handed to the caller, who raises it
                box["error"] = exc
            finally:
                done.set()

    def close(self) -> None:
        """End the threads once the steps already queued are done."""
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._queue.put(None)


class Stepper:
    """A batched model's steps, one at a time on a compute lane.

    The first request that needs its next token runs the model's next step; those
    that need one meanwhile wait for that step to end and look again, so one step
    serves them all, and a request that arrived during a step joins the next one.
    """

    def __init__(self, lanes: ComputeLanes, step):
        self._lanes = lanes
        self._step = step
        self._cond = threading.Condition(threading.Lock())  # guards _busy and _done
        self._busy = False  # a step is under way
        self._done = 0  # steps ended

    def next(self) -> None:
        """Run the next step, or wait for the one under way to end."""
        with self._cond:
            if self._busy:
                done = self._done
                while self._done == done:
                    self._cond.wait()
                return
            self._busy = True
        try:
            self._lanes.run(self._step)
        finally:
            with self._cond:
                self._busy = False
                self._done += 1
                self._cond.notify_all()
