"""Download tasks: `Downloads` runs each in the background, one thread a task.

A task is a list of files (localrt.downloads.fetch's Item and Task). Each file is fetched
over one connection (localrt.downloads.fetch) or, when big, in pieces over several
(localrt.downloads.pieces); either way it is written to `<name>.part`, resumed after a
cancel, a dropped connection or a kill, and renamed into place only once its size
and checksum match. An item already in place (`Item.files`) is only checked.
Progress is published on the EventBus, as cortex's events: `{"type":
"DownloadUpdated", "task": {"id", "type", "items": [{"id", "downloadUrl",
"localPath", "checksum", "bytes", "downloadedBytes"}]}}`, with localrt's own fields
(the task's status and error, each item's url) beside them. Outbound HTTP, with
the proxy and TLS fields of Config, is localrt.outbound. `stats()` gives GET /metrics
the bytes received and the running tasks.

A task that cannot fit is refused before it starts (`check_disk_space`: 507
insufficient_storage); one whose disk fills up meanwhile, or whose folder turns out
not to be writable, ends with an error that names the folder and what to do, and an
`errorCode` (disk_full, storage_error); its part files stay for the resume.

Callers take Item, Task, DownloadFailed, NoSpace, part_path and map_path
(localrt.downloads.fetch's)
from here, with Downloads and check_disk_space.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

from localrt import security
from localrt.errors import (Conflict, DiskFull, InsufficientStorage, NotFound, UpstreamError,
                            shown)
from localrt.events import EventBus
from localrt.downloads.fetch import (Cancelled, CannotWrite, DownloadFailed, Item, Link, NoSpace,
                                     Task, check_in_place, complete, fetch_stream, map_path,
                                     part_path)
from localrt.fsutil import (MOVE_DATA, NO_SPACE, NOT_WRITABLE, existing_folder, fsync_dir,
                            human_size, no_inodes, private_dir, space_short)
from localrt.downloads.pieces import PIECES_FROM, NoRanges, fetch_pieces, forget_pieces

__all__ = ["Downloads", "DownloadFailed", "Item", "NoSpace", "Task", "check_disk_space",
           "map_path", "part_path", "fsync_dir"]  # fsync_dir: localrt.models takes it from here

log = logging.getLogger(__name__)

FINISHED_KEPT = 100          # finished tasks still listed by GET /v1/models/pull


class Downloads:
    """Owns the download tasks and their threads."""

    def __init__(self, config: Callable[[], Mapping], events: EventBus,
                 connections: Callable[[], int]):
        self._config = config  # called per request, so Config changes apply at once
        self._events = events
        self._connections = connections  # downloadConnections, read per file
        # how the fetches reach the network
        self._link = Link(config, self._publish, self._received)
        # Guards _tasks (the dict, not the tasks' progress) and the end of each task
        # with its last event.
        self._lock = threading.Lock()
        self._tasks: dict[str, Task] = {}
        self._threads: list[threading.Thread] = []
        self._count_lock = threading.Lock()  # guards _bytes
        self._bytes = 0  # received over the network since the start, by every task

    def start(self, task: Task) -> Task:
        """Check for duplicates and disk space, then run `task` in a thread."""
        check_disk_space(task.id, task.items)
        with self._lock:
            current = self._tasks.get(task.id)
            if current is not None and current.running:
                raise Conflict(f"{task.id} is already downloading (taskId {task.id})",
                               extra={"taskId": task.id})
            self._tasks[task.id] = task
            self._forget_finished()
            thread = threading.Thread(target=self._run, args=(task,), daemon=True,
                                      name=f"download {task.id}")
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return task

    def progress(self, task: Task) -> None:
        """Say that a running task moved on: a DownloadUpdated event (a build's progress,
        localrt.engines.builds; fetches say their own through the Link)."""
        self._publish("DownloadUpdated", task)

    def running(self, task_id: str) -> Task | None:
        """The running task with this id, if any."""
        with self._lock:
            task = self._tasks.get(task_id)
        return task if task is not None and task.running else None

    def find(self, task_id: str) -> dict | None:
        """A task still known, as list() gives it; None for one never started or forgotten."""
        with self._lock:
            task = self._tasks.get(task_id)
        return None if task is None else task.to_dict()

    def list(self) -> list[dict]:
        """Every task still known, running ones first."""
        with self._lock:
            tasks = list(self._tasks.values())
        tasks.sort(key=lambda t: not t.running)
        return [t.to_dict() for t in tasks]

    def stats(self) -> dict:
        """For GET /metrics: {"bytes": received since the start, "active": running tasks}."""
        with self._lock:
            active = sum(1 for t in self._tasks.values() if t.running)
        with self._count_lock:
            return {"bytes": self._bytes, "active": active}

    def cancel(self, task_id: str) -> dict:
        """Stop a running task; its part files stay, so a new pull resumes."""
        with self._lock:
            task = self._tasks.get(task_id)
        if task is None:
            raise NotFound(f"No download task {shown(task_id)}", param="taskId")
        if not task.running:
            raise Conflict(f"Task {task_id} is not running (it is {task.status})",
                           param="taskId")
        task.cancel()
        return task.to_dict()

    def close(self, timeout: float = 5.0) -> None:
        """Cancel every task and wait for the threads (the server is stopping)."""
        with self._lock:
            tasks, threads = list(self._tasks.values()), list(self._threads)
        for task in tasks:
            task.cancel()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _forget_finished(self) -> None:
        finished = [tid for tid, t in self._tasks.items() if not t.running]
        for tid in finished[:max(0, len(finished) - FINISHED_KEPT)]:
            del self._tasks[tid]

    # --- the task's thread ----------------------------------------------------

    def _run(self, task: Task) -> None:
        started = time.monotonic()
        task.status = "Downloading"
        self._publish("DownloadStarted", task)
        try:
            for item in task.items:  # sees items that after_item appends
                self._fetch(task, item)
                if task.after_item is not None:
                    task.after_item(task, item)
            if task.cancelled.is_set():
                raise Cancelled()
            if task.on_success is not None:
                task.on_success(task)
        except Exception as exc:
            if isinstance(exc, Cancelled) or task.cancelled.is_set():
                # A cancel cuts the connections: whatever breaks after it is the cancel
                # (a read cut mid-redirect is an IncompleteRead, say), not a failure.
                self._finish(task, "Stopped", "DownloadStopped")
                log.info("download %s stopped", task.id)
            elif isinstance(exc, (CannotWrite, OSError, InsufficientStorage)):
                self._fail(task, *_storage_failure(task, exc))
            elif isinstance(exc, (DownloadFailed, UpstreamError)):
                self._fail(task, str(exc), getattr(exc, "code", None))
            else:
                log.exception("download %s failed", task.id)
                self._fail(task, "Internal error; the server log has the details")
        else:
            self._finish(task, "Success", "DownloadSuccess")
            elapsed = time.monotonic() - started
            total = sum(item.size for item in task.items)
            log.info("download %s finished: %s in %.2fs (%s/s)", task.id, human_size(total),
                     elapsed, human_size(total / max(elapsed, 1e-6)))

    def _fail(self, task: Task, message: str, code: str | None = None) -> None:
        if code and code not in message:  # the error names its code too, for its readers
            message = f"{message} ({code})"
        task.error = security.redact(message, security.secrets_of(self._config()))
        task.error_code = code
        self._finish(task, "Error", "DownloadError")
        log.warning("download %s failed: %s", task.id, task.error)

    def _finish(self, task: Task, status: str, event_type: str) -> None:
        """End a task and say so, before a new run of the same id can start (`start`
        holds the same lock), so its last event never follows the next run's first."""
        with self._lock:
            task.status = status
            self._publish(event_type, task)

    def _received(self, n: int) -> None:
        with self._count_lock:
            self._bytes += n

    def _publish(self, event_type: str, task: Task) -> None:
        self._events.publish(event_type, task=task.to_dict())

    def _fetch(self, task: Task, item: Item) -> None:
        """Download one file to its part file, check it, and rename it into place."""
        if item.files is not None:  # in place already: only checked
            check_in_place(self._link, task, item)
            return
        if complete(item, task.cancelled):
            item.downloaded = item.size
            return
        part = part_path(item.local_path)
        private_dir(part.parent)
        connections = self._connections()
        # A part file already laid out in pieces is finished in pieces, whatever the
        # setting says now: its bytes are no prefix that one stream could resume.
        if item.size >= PIECES_FROM and (connections > 1 or map_path(part).exists()):
            try:
                fetch_pieces(self._link, task, item, part, connections)
                return
            except NoRanges as exc:
                log.info("download %s: %s; fetching %s in one stream", task.id, exc, item.id)
        forget_pieces(part)
        fetch_stream(self._link, task, item, part)


def check_disk_space(what: str, items: list[Item]) -> None:
    """Raise DiskFull (507 insufficient_storage) unless the items' missing bytes fit on
    the disk, with the margin kept free (fsutil.disk_margin)."""
    if not items:
        return
    needed = missing_bytes(items)
    where = items[0].local_path.parent  # made by the task; its disk is an ancestor's
    short, free, margin = space_short(where, needed)
    if short:
        raise DiskFull(f"Not enough disk space in {where} for {what}: it needs "
                       f"{human_size(needed)}, and {human_size(margin)} is kept free, but "
                       f"that disk has {human_size(free)} free; free {human_size(short)} "
                       f"more there{MOVE_DATA}, then try again")


def missing_bytes(items: list[Item]) -> int:
    """The bytes the items still have to write: their sizes less what their files (or
    part files) hold already."""
    needed = 0
    for item in items:
        if item.files is not None:  # in place already: nothing is written
            continue
        have = 0
        for path in (item.local_path, part_path(item.local_path)):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            # Blocks, not length: a part file fetched in pieces has its full length from
            # the start, and only its written (or preallocated) blocks are space taken.
            have = max(have, min(st.st_size, st.st_blocks * 512))
        needed += max(0, item.size - have)
    return needed


def _storage_failure(task: Task, exc: Exception) -> tuple[str, str | None]:
    """What a failed write means for `task`: (its error, its errorCode)."""
    if isinstance(exc, InsufficientStorage):  # a write of the task's end (model.json)
        return exc.message, "disk_full" if isinstance(exc, DiskFull) else "storage_error"
    if isinstance(exc, CannotWrite):
        error, folder = exc.error, exc.folder
    else:
        error = exc
        folder = Path(exc.filename) if exc.filename else \
            (task.items[0].local_path.parent if task.items else Path("."))
    folder = existing_folder(folder)
    again = "pull it again" if task.type == "Model" else "install it again"
    if error.errno in NO_SPACE:
        missing = missing_bytes(task.items)
        short, free, margin = space_short(folder, missing)
        message = f"The disk is full: no space left in {folder} for {task.id}"
        if no_inodes(folder):
            message += " (it has no free inodes: too many files)"
        if missing and short:
            message += (f"; it needs {human_size(short)} more ({human_size(missing)} still "
                        f"to download, and {human_size(margin)} kept free, with "
                        f"{human_size(free)} free now): free that much there, then {again}")
        else:
            message += f"; free some space there, then {again}"
        written = sum(item.downloaded for item in task.items if item.files is None)
        if written > 0:
            message += f": it resumes from the {human_size(written)} already downloaded"
        return message, "disk_full"
    if error.errno in NOT_WRITABLE:
        return (f"{folder} is not writable ({error.strerror or error}), so {task.id} "
                f"cannot be saved there; make it writable (or set dataFolderPath to a "
                f"writable folder), then {again}", "storage_error")
    return f"Cannot write {error.filename or folder}: {error.strerror or error}", None
