"""Waiting for what a test must see happen: a condition polled until it holds, with
a deadline that only a failing test reaches."""

from __future__ import annotations

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
