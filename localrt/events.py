"""Events: what download tasks (model pulls, engine installs) announce, in cortex's shape.

`EventBus` fans each event out to every open `GET /v1/events` stream (`listen`), and
to in-process followers of one task (`follow`: Ollama's pull progress). A slow
listener never slows a download: its queue is bounded, and when it overflows
the listener is disconnected (it can reconnect and read GET /v1/models/pull).
Open streams count in the bus's `admission` (the "events" kind of localrt.admission)
until the server closes them; a stream or follower whose client has gone
(`disconnected()`) ends within DISCONNECT_POLL seconds.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Iterator

from localrt.admission import DISCONNECT_POLL, Admission, Disconnected, never
from localrt.errors import ServiceUnavailable
from localrt.routing import sse, sse_comment

# An SSE comment this often: where the server cannot tell that a listener went away
# (no disconnected()), it is noticed only on a write, and until then it holds a server
# thread and a listener slot.
HEARTBEAT_SECONDS = 2.0
QUEUE_SIZE = 1000
_CLOSE = object()


class TooManyListeners(ServiceUnavailable):
    """Every listener slot is taken: a 503 with Retry-After."""


class _Listener(queue.Queue):
    """One listener's bounded queue; `wants(event)` says which events it takes."""

    def __init__(self, wants: Callable[[dict], bool] | None = None):
        super().__init__(QUEUE_SIZE)
        self.wants = wants or (lambda event: True)


class EventBus:
    """Publishes events to listeners; each listener is a bounded queue. At most
    `max_listeners` GET /v1/events streams are open at once (`admission`)."""

    def __init__(self, max_listeners: int):
        self.max_listeners = max_listeners
        self.admission = Admission("events", max_listeners,
                                   "Too many open event streams (at most {limit}); close one",
                                   TooManyListeners)
        self._lock = threading.Lock()  # guards _listeners and _closed
        self._listeners: list[_Listener] = []
        self._closed = False

    def publish(self, event_type: str, **payload) -> None:
        """Send one event, `{"type": event_type, **payload}`, to every listener."""
        event = {"type": event_type, **payload}
        with self._lock:
            listeners = list(self._listeners)
        for q in listeners:
            if not q.wants(event):
                continue
            try:
                q.put_nowait(event)
            except queue.Full:
                self._drop(q)

    def listen(self, disconnected: Disconnected = never) -> Iterator[bytes]:
        """A Server-Sent Events body: one `data:` line of JSON per event; counted in
        `admission` (TooManyListeners past it) until closed, and ended once
        `disconnected()`."""
        q = _Listener()
        self.admission.enter()
        with self._lock:
            closed = self._closed
            if not closed:
                self._listeners.append(q)
        if closed:
            self.admission.leave()
            return iter(())

        def remove():
            self._remove(q)
            self.admission.leave()

        return _Body(self._stream(q, disconnected), remove)

    def follow(self, task_id: str, disconnected: Disconnected = never) -> Iterator[dict]:
        """The events of one download task, as dicts, from now on: an in-process
        listener (not a GET /v1/events stream, so not under max_listeners). It ends
        when the bus closes, the listener falls behind or `disconnected()`, and is
        dropped when closed."""
        q = _Listener(lambda event: (event.get("task") or {}).get("id") == task_id)
        with self._lock:
            if self._closed:
                return iter(())
            self._listeners.append(q)
        return _Body(self._events(q, disconnected=disconnected), lambda: self._remove(q))

    def close(self) -> None:
        """End every stream (the server is stopping)."""
        with self._lock:
            self._closed = True
            listeners, self._listeners = self._listeners, []
        for q in listeners:
            _put_close(q)

    def _remove(self, q: _Listener) -> None:
        with self._lock:
            if q in self._listeners:
                self._listeners.remove(q)

    def _drop(self, q: _Listener) -> None:
        self._remove(q)
        _put_close(q)

    def _stream(self, q: _Listener, disconnected: Disconnected) -> Iterator[bytes]:
        # Sent at once, so a client knows it is listening before it starts a task.
        yield sse_comment("listening")
        for event in self._events(q, heartbeat=True, disconnected=disconnected):
            yield sse_comment("keep-alive") if event is None else sse(event)

    def _events(self, q: _Listener, heartbeat: bool = False,
                disconnected: Disconnected = never) -> Iterator[dict | None]:
        """The listener's events until it is closed or `disconnected()`; None every
        HEARTBEAT_SECONDS without one when `heartbeat`."""
        # A client that can be seen leaving is looked at every DISCONNECT_POLL seconds.
        poll = HEARTBEAT_SECONDS if disconnected is never else DISCONNECT_POLL
        quiet_since = time.monotonic()
        try:
            while not disconnected():
                try:
                    event = q.get(timeout=poll)
                except queue.Empty:
                    if heartbeat and time.monotonic() - quiet_since >= HEARTBEAT_SECONDS:
                        quiet_since = time.monotonic()
                        yield None
                    continue
                if event is _CLOSE:
                    return
                quiet_since = time.monotonic()
                yield event
        finally:
            self._remove(q)


class _Body:
    """A GET /v1/events body (or a follower) whose close() gives its listener slot back,
    once, even when the server closes it before reading it (a generator's `finally`
    would never run then)."""

    def __init__(self, stream: Iterator, remove):
        self._stream, self._remove = stream, remove
        self._closed = False

    def __iter__(self) -> Iterator:
        return self._stream

    def __next__(self):
        return next(self._stream)

    def close(self) -> None:
        """End the stream and free its listener slot."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stream.close()
        finally:
            self._remove()


def _put_close(q: queue.Queue) -> None:
    """Wake the listener up and end it, even when its queue is full."""
    while True:
        try:
            q.put_nowait(_CLOSE)
            return
        except queue.Full:
            try:
                q.get_nowait()
            except queue.Empty:
                pass
