"""Events: what download tasks (model pulls, engine installs) announce, in cortex's shape.

`EventBus` fans each event out to every open `GET /v1/events` stream (`listen`), and
to in-process followers of one task (`follow`: Ollama's pull progress). A slow
listener never slows a download: its queue is bounded, and when it overflows
the listener is disconnected (it can reconnect and read GET /v1/models/pull).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator

from localrt.routing import sse, sse_comment

# An SSE comment this often: a listener that went away is only noticed on a write,
# and until then it holds a server thread and a listener slot.
HEARTBEAT_SECONDS = 2.0
QUEUE_SIZE = 1000
_CLOSE = object()


class TooManyListeners(Exception):
    """Every listener slot is taken."""


class _Listener(queue.Queue):
    """One listener's bounded queue; `wants(event)` says which events it takes."""

    def __init__(self, wants: Callable[[dict], bool] | None = None, counted: bool = True):
        super().__init__(QUEUE_SIZE)
        self.wants = wants or (lambda event: True)
        self.counted = counted  # a GET /v1/events stream, under max_listeners


class EventBus:
    """Publishes events to listeners; each listener is a bounded queue."""

    def __init__(self, max_listeners: int):
        self.max_listeners = max_listeners
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

    def listen(self) -> Iterator[bytes]:
        """A Server-Sent Events body: one `data:` line of JSON per event."""
        q = _Listener()
        with self._lock:
            if self._closed:
                return iter(())
            if sum(1 for x in self._listeners if x.counted) >= self.max_listeners:
                raise TooManyListeners()
            self._listeners.append(q)
        return _Body(self._stream(q), lambda: self._remove(q))

    def follow(self, task_id: str) -> Iterator[dict]:
        """The events of one download task, as dicts, from now on: an in-process
        listener (not a GET /v1/events stream, so not under max_listeners). It ends
        when the bus closes or the listener falls behind, and is dropped when closed."""
        q = _Listener(lambda event: (event.get("task") or {}).get("id") == task_id,
                      counted=False)
        with self._lock:
            if self._closed:
                return iter(())
            self._listeners.append(q)
        return self._events(q)

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

    def _drop(self, q: queue.Queue) -> None:
        with self._lock:
            if q in self._listeners:
                self._listeners.remove(q)
        _put_close(q)

    def _stream(self, q: _Listener) -> Iterator[bytes]:
        # Sent at once, so a client knows it is listening before it starts a task.
        yield sse_comment("listening")
        for event in self._events(q, heartbeat=True):
            yield sse_comment("keep-alive") if event is None else sse(event)

    def _events(self, q: _Listener, heartbeat: bool = False) -> Iterator[dict | None]:
        """The listener's events until it is closed; None every HEARTBEAT_SECONDS
        without one when `heartbeat`."""
        try:
            while True:
                try:
                    event = q.get(timeout=HEARTBEAT_SECONDS)
                except queue.Empty:
                    if heartbeat:
                        yield None
                    continue
                if event is _CLOSE:
                    return
                yield event
        finally:
            with self._lock:
                if q in self._listeners:
                    self._listeners.remove(q)


class _Body:
    """A GET /v1/events body whose close() gives its listener slot back, even when the
    server closes it before reading it (a generator's `finally` would never run then)."""

    def __init__(self, stream: Iterator[bytes], remove):
        self._stream, self._remove = stream, remove

    def __iter__(self) -> Iterator[bytes]:
        return self._stream

    def close(self) -> None:
        """End the stream and free its listener slot."""
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
