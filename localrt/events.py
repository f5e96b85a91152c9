"""Events: what download tasks (model pulls, engine installs) announce, in cortex's shape.

`EventBus` fans each event out to every open `GET /v1/events` stream. A slow
listener never slows a download: its queue is bounded, and when it overflows
the listener is disconnected (it can reconnect and read GET /v1/models/pull).
"""

from __future__ import annotations

import json
import queue
import threading
from typing import Iterator

# An SSE comment this often: a listener that went away is only noticed on a write,
# and until then it holds a server thread and a listener slot.
HEARTBEAT_SECONDS = 2.0
QUEUE_SIZE = 1000
_CLOSE = object()


class TooManyListeners(Exception):
    """Every listener slot is taken."""


class EventBus:
    """Publishes events to listeners; each listener is a bounded queue."""

    def __init__(self, max_listeners: int):
        self.max_listeners = max_listeners
        self._lock = threading.Lock()  # guards _listeners and _closed
        self._listeners: list[queue.Queue] = []
        self._closed = False

    def publish(self, event_type: str, **payload) -> None:
        """Send one event, `{"type": event_type, **payload}`, to every listener."""
        event = {"type": event_type, **payload}
        with self._lock:
            listeners = list(self._listeners)
        for q in listeners:
            try:
                q.put_nowait(event)
            except queue.Full:
                self._drop(q)

    def listen(self) -> Iterator[bytes]:
        """A Server-Sent Events body: one `data:` line of JSON per event."""
        q: queue.Queue = queue.Queue(QUEUE_SIZE)
        with self._lock:
            if self._closed:
                return iter(())
            if len(self._listeners) >= self.max_listeners:
                raise TooManyListeners()
            self._listeners.append(q)
        return self._stream(q)

    def close(self) -> None:
        """End every stream (the server is stopping)."""
        with self._lock:
            self._closed = True
            listeners, self._listeners = self._listeners, []
        for q in listeners:
            _put_close(q)

    def _drop(self, q: queue.Queue) -> None:
        with self._lock:
            if q in self._listeners:
                self._listeners.remove(q)
        _put_close(q)

    def _stream(self, q: queue.Queue) -> Iterator[bytes]:
        try:
            # Sent at once, so a client knows it is listening before it starts a task.
            yield b": listening\n\n"
            while True:
                try:
                    event = q.get(timeout=HEARTBEAT_SECONDS)
                except queue.Empty:
                    yield b": keep-alive\n\n"
                    continue
                if event is _CLOSE:
                    return
                yield b"data: " + json.dumps(event, ensure_ascii=False).encode("utf-8") + b"\n\n"
        finally:
            with self._lock:
                if q in self._listeners:
                    self._listeners.remove(q)


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
