"""Waiting for download tasks, in process (`api`, a support.apps.bind) or on a real
server (`url`)."""

from __future__ import annotations

import time

from support.servers import send


def wait_task(api, task_id, timeout=20.0):
    """Poll GET /v1/models/pull until the task is no longer running; return it."""
    return _wait_ended(lambda: api("GET", "/v1/models/pull").json["data"], task_id, timeout,
                       0.02)


def wait_pull(url, task_id, timeout=30.0):
    """wait_task for a real server at `url`."""
    return _wait_ended(lambda: send(url, "GET", "/v1/models/pull")[1]["data"], task_id,
                       timeout, 0.05)


def _wait_ended(list_tasks, task_id, timeout, interval):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        task = {t["id"]: t for t in list_tasks()}.get(task_id)
        if task and task["status"] not in ("Pending", "Downloading"):
            return task
        time.sleep(interval)
    raise AssertionError(f"task {task_id} still running after {timeout}s")


def wait_bytes(api, task_id, at_least, timeout=20.0):
    """Poll GET /v1/models/pull until the task has at least `at_least` bytes; return it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tasks = {t["id"]: t for t in api("GET", "/v1/models/pull").json["data"]}
        task = tasks.get(task_id)
        if task and sum(i["downloadedBytes"] for i in task["items"]) >= at_least:
            return task
        time.sleep(0.01)
    raise AssertionError(f"task {task_id} did not reach {at_least} bytes")
