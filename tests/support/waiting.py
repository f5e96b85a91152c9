"""Waiting for what a test must see happen: a condition polled until it holds, with
a deadline that only a failing test reaches; and a client that leaves when told
(`Leaving`), for the waits that a gone client ends."""

from __future__ import annotations

import threading
import time

PATIENCE = 20.0  # seconds a condition may take on a busy machine before the test fails


def wait_for(condition, timeout: float = PATIENCE, what: str = "the condition") -> float:
    """Poll `condition()` until it is true; the seconds it took. An AssertionError
    naming `what` once `timeout` seconds have passed."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: still not the case after {timeout} s")
        time.sleep(0.01)
    return time.monotonic() - started


class Leaving:
    """A `disconnected()` that turns true once `leave()` is called."""

    def __init__(self):
        self.gone = threading.Event()

    def __call__(self) -> bool:
        return self.gone.is_set()

    def leave(self):
        self.gone.set()
