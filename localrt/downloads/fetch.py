"""One file of a download task: fetched over one connection, checked, renamed into place.

A file is written to `<name>.part`, resumed with a Range request after a cancel, a
dropped connection or a kill, and renamed into place only once its size and
checksum match (`install`); an item that is in place already (an engine installed
before) is only checked there (`check_in_place`). `Item` and `Task` are what a
download is made of. A `Link` is how a fetch reaches the network (localrt.outbound,
with the Config of the moment) and reports progress; a `Request` is one GET, its
sockets, and what its failures mean. localrt.downloads.pieces fetches big files in pieces
with these same parts; localrt.downloads.tasks runs the tasks.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import queue
import re
import socket
import threading
import time
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping
from urllib.parse import urlsplit

from localrt import security
from localrt.errors import UpstreamError
from localrt.fsutil import fsync_dir
from localrt.outbound import (CertificateFailed, ProxyAuthFailed, open_url, origin,
                              retry_after_seconds)

log = logging.getLogger(__name__)

CHUNK = 1024 * 1024          # bytes per read
PIPELINE = 4                 # chunks in flight between receiving and hashing
WRITEBACK_EVERY = 32 * CHUNK  # bytes written between nudges to the kernel's writeback
MAX_ATTEMPTS = 5             # tries per file (or piece) without progress before the task fails
BACKOFF_SECONDS = (0.5, 1.0, 2.0, 4.0, 8.0)
MAX_RATE_LIMITED = 5         # 429 answers in a row for one file (or piece) before it fails
UPDATE_INTERVAL = 0.5        # seconds between DownloadUpdated events of one task


class DownloadFailed(Exception):
    """A file could not be downloaded; the message says why, for the task's error."""

    code: str | None = None  # the task's errorCode, for the failures that have one


class NoSpace(DownloadFailed):
    """No space left on the disk a task writes to; the message names the folder and
    how much more the task needs."""

    code = "disk_full"


class CannotWrite(DownloadFailed):
    """Writing a file of `item` failed: our disk, not the network, so never retried;
    localrt.downloads.tasks says what it means for the whole task."""

    def __init__(self, item: "Item", error: OSError):
        self.error = error
        self.folder = item.local_path.parent
        super().__init__(f"{item.id}: cannot write {self.folder}: {error.strerror or error}")


class Retry(Exception):
    """A transient failure: try the file (or the piece) again after a pause."""


class RateLimited(Retry):
    """An HTTP 429: try again once the server's Retry-After has passed."""

    def __init__(self, url: str, delay: float | None):
        super().__init__(f"HTTP 429 from {origin(url)}")
        self.origin = origin(url)
        self.delay = delay


class Unsatisfiable(Retry):
    """An HTTP 416: the server has no such byte range of the file."""


class Cancelled(Exception):
    """The task was cancelled (or the server is stopping): end without an error."""


class Backoff:
    """How long to pause before the next try of one file or piece, and when to give up.

    Tries without progress count toward MAX_ATTEMPTS. 429s count apart, toward
    MAX_RATE_LIMITED in a row, and wait what the server's Retry-After asks.
    """

    def __init__(self, what: str):
        self.what = what
        self.attempts = 0
        self.limited = 0

    def pause(self, exc: Retry, progressed: bool) -> float:
        """Seconds to wait before the next try; raises DownloadFailed to give up."""
        if isinstance(exc, RateLimited):
            self.limited += 1
            if self.limited >= MAX_RATE_LIMITED:
                raise DownloadFailed(f"{self.what}: {exc.origin} rate-limited the download "
                                     f"(HTTP 429 {self.limited} times in a row); try again "
                                     f"later") from None
            if exc.delay is not None:
                return exc.delay
            return BACKOFF_SECONDS[min(self.limited - 1, len(BACKOFF_SECONDS) - 1)]
        self.limited = 0
        self.attempts = 0 if progressed else self.attempts + 1
        if self.attempts >= MAX_ATTEMPTS:
            raise DownloadFailed(f"{self.what}: {exc} (gave up after {MAX_ATTEMPTS} "
                                 f"tries)") from None
        return BACKOFF_SECONDS[min(self.attempts, len(BACKOFF_SECONDS) - 1)]


@dataclass
class Item:
    """One file of a task."""

    id: str                  # the file's path in its repo
    url: str
    local_path: Path
    size: int
    sha256: str | None = None   # the hub's lfs.oid
    git_oid: str | None = None  # git blob sha1, for small files the hub has no sha256 for
    downloaded: int = 0
    # An item that is in place already (an engine installed before): its files, each
    # (path, sha256 hex, size or None), are checked where they are (`check_in_place`),
    # and nothing is fetched.
    files: tuple | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        """The item as the API shows it: cortex's fields, and `url` as localrt had it."""
        url = security.url_without_credentials(self.url)
        return {"id": self.id, "url": url, "downloadUrl": url,
                "localPath": str(self.local_path),
                "bytes": self.size, "downloadedBytes": self.downloaded,
                "checksum": self.sha256}


@dataclass
class Task:
    """A background download: what `POST .../pull` starts and events carry."""

    id: str
    type: str                # "Model" or "Engine"
    items: list[Item]
    hub_url: str | None = None  # the host the token may be sent to
    status: str = "Pending"  # Pending, Downloading, Success, Error, Stopped
    error: str | None = None
    error_code: str | None = None  # disk_full, storage_error: what a client can act on
    on_success: Callable[["Task"], None] | None = field(default=None, repr=False)
    # Called after each item is complete; it may append items (an engine wheel's
    # requirements are known only once the wheel is there).
    after_item: Callable[["Task", "Item"], None] | None = field(default=None, repr=False)
    cancelled: threading.Event = field(default_factory=threading.Event, repr=False)
    # A build's progress, for an engine variant compiled from source (localrt.engines.builds):
    # {"stage", "step", "steps", "line"}, shown as the task's `build`.
    build: dict | None = None
    # The sockets of the task's open connections (one per worker), to shut on a cancel.
    _sockets: set = field(default_factory=set, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False,
                                  repr=False)  # guards _sockets

    def connected(self, sock) -> None:
        """Note a download's socket; shut it at once if a cancel came first."""
        with self._lock:
            self._sockets.add(sock)
        if self.cancelled.is_set():  # set before the add, so `cancel` may have missed it
            shut(sock)

    def released(self, *socks) -> None:
        """Forget sockets whose requests are over."""
        with self._lock:
            self._sockets.difference_update(socks)

    def abort(self) -> None:
        """Shut every open connection of the task, so no thread waits on one."""
        with self._lock:
            socks = list(self._sockets)
        for sock in socks:
            shut(sock)

    def cancel(self) -> None:
        """Stop the task: flag it, then shut its connections."""
        self.cancelled.set()
        self.abort()

    @property
    def running(self) -> bool:
        return self.status in ("Pending", "Downloading")

    def to_dict(self) -> dict:
        """The task as the API and events show it."""
        out = {"id": self.id, "type": self.type, "status": self.status,
               "items": [item.to_dict() for item in self.items]}
        if self.build is not None:
            out["build"] = dict(self.build)
        if self.error:
            out["error"] = self.error
        if self.error_code:
            out["errorCode"] = self.error_code
        return out


def part_path(path: Path) -> Path:
    """Where a file is written until it is complete and checked."""
    return path.with_name(path.name + ".part")


def map_path(part: Path) -> Path:
    """The part map beside a part file fetched in pieces: how much of each piece is done."""
    return part.with_name(part.name + ".map")


class Link:
    """What a fetch needs from the Downloads that runs it: the Config of the moment for
    each request, a way to say that a task's progress moved on, and one to count the
    bytes received."""

    def __init__(self, config: Callable[[], Mapping], publish: Callable[[str, Task], None],
                 received: Callable[[int], None] = lambda n: None):
        self.config = config  # called per request, so Config changes apply at once
        self._publish = publish
        self.received = received  # told each count of bytes that came over the network

    def progress(self, task: Task) -> None:
        """Publish a DownloadUpdated event for `task`."""
        self._publish("DownloadUpdated", task)

    def open(self, task: Task, item: Item, url: str, headers: Mapping, on_socket: Callable,
             stopped: Callable[[], bool]):
        """GET `url` for `item`; a failure becomes Cancelled, Retry or DownloadFailed."""
        try:
            return open_url(self.config(), url, hub_url=task.hub_url, headers=headers,
                            timeout=30.0, on_socket=on_socket)
        except urllib.error.HTTPError as exc:
            exc.close()
            if stopped():
                raise Cancelled() from None
            raise _status_error(task, item, exc) from None
        except (ProxyAuthFailed, CertificateFailed):
            raise
        except UpstreamError as exc:
            if stopped():  # the cancel shut the socket before the headers
                raise Cancelled() from None
            raise Retry(str(exc)) from None


class Request:
    """One GET of a file or a piece, used as a context: its sockets are the task's until
    it ends, and once the answer is open, a lost connection becomes Cancelled or Retry.

    Both the one-stream fetch and each piece worker make their requests through it.
    """

    def __init__(self, link: Link, task: Task, note_socket: Callable,
                 stopped: Callable[[], bool]):
        self._link, self._task = link, task
        self._note_socket = note_socket  # the task's (or the pieces') `connected`
        self._stopped = stopped
        self._sockets: list = []
        self._resp = None

    def open(self, item: Item, url: str, headers: Mapping):
        """The answer to a GET of `url`, unless the task stopped meanwhile."""
        self._resp = self._link.open(self._task, item, url, headers, self._connected,
                                     self._stopped)
        if self._stopped():
            raise Cancelled()
        return self._resp

    def _connected(self, sock) -> None:
        self._sockets.append(sock)
        self._note_socket(sock)

    def __enter__(self) -> "Request":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        try:
            if self._resp is not None:
                self._resp.close()
        finally:
            self._task.released(*self._sockets)
        if self._resp is not None and isinstance(exc, (http.client.HTTPException, OSError)):
            if self._stopped():
                raise Cancelled() from None
            if isinstance(exc, OSError) and exc.filename:
                return False  # our own file, not the network
            raise Retry(f"connection lost ({exc.__class__.__name__})") from None
        return False


# --- one stream ------------------------------------------------------------------


def fetch_stream(link: Link, task: Task, item: Item, part: Path) -> None:
    """Fetch a file over one connection, resuming where its part file ends."""
    with open(part, "ab+", buffering=0) as out:
        hasher = Hasher(item)
        if os.fstat(out.fileno()).st_size > item.size:
            out.truncate(0)  # the hub now lists a smaller file: start over
        hasher.catch_up(out, task.cancelled)
        item.downloaded = out.tell()
        backoff = Backoff(item.id)
        while item.downloaded < item.size or item.size == 0:
            if task.cancelled.is_set():
                raise Cancelled()
            before = item.downloaded
            try:
                _transfer(link, task, item, out, hasher)
                if item.size == 0:
                    break
            except Retry as exc:
                delay = backoff.pause(exc, item.downloaded > before)
                log.info("download %s: %s; retrying in %.1fs", task.id, exc, delay)
                if task.cancelled.wait(delay):
                    raise Cancelled() from None
        os.fsync(out.fileno())
        on_disk = os.fstat(out.fileno()).st_size
    if item.downloaded != item.size or on_disk != item.size:
        raise DownloadFailed(f"{item.id}: got {item.downloaded} bytes, expected "
                             f"{item.size}")
    install(item, part, hasher)


def _transfer(link: Link, task: Task, item: Item, out, hasher: Hasher) -> None:
    """One HTTP request, resuming at item.downloaded; raises Retry on transient errors."""
    offset = item.downloaded
    os.ftruncate(out.fileno(), offset)  # whatever a failed write left past it goes
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    with Request(link, task, task.connected, task.cancelled.is_set) as request:
        try:
            resp = request.open(item, item.url, headers)
        except Unsatisfiable:
            if not offset:
                raise
            _restart(item, out, hasher)  # the part is not a prefix of this file
            raise Retry("the server refused to resume; starting over") from None
        if offset and resp.status != 206:
            _restart(item, out, hasher)  # the server ignored the Range header
        elif offset and not _content_range_starts_at(resp, offset):
            raise Retry("the server resumed at the wrong offset")
        _copy(link, task, item, resp, out, hasher)


def _copy(link: Link, task: Task, item: Item, resp, out, hasher: Hasher) -> None:
    # Hashing runs in its own thread (hashlib drops the GIL), so checking the
    # sha256 costs little download speed; the bounded queue bounds the memory.
    filled: queue.Queue = queue.Queue(PIPELINE)

    def hash_chunks():
        while (chunk := filled.get()) is not None:
            hasher.update(chunk)

    worker = threading.Thread(target=hash_chunks, daemon=True, name=f"sha {item.id}")
    worker.start()
    try:
        _receive(link, task, item, resp, out.fileno(), filled)
    finally:
        filled.put(None)
        worker.join()


def _receive(link: Link, task: Task, item: Item, resp, fd: int, filled: queue.Queue) -> None:
    flushed = item.downloaded
    next_update = time.monotonic() + UPDATE_INTERVAL
    while True:
        # read1: whatever has arrived, up to CHUNK, so progress moves on slow links too
        chunk = resp.read1(CHUNK)
        if not chunk:
            break
        if item.downloaded + len(chunk) > item.size:
            raise DownloadFailed(f"{item.id}: the server sent more than the "
                                 f"{item.size} bytes the hub listed")
        view = memoryview(chunk)
        try:
            while view:
                view = view[os.write(fd, view):]
        except OSError as exc:  # our disk, not the network: no retry
            raise CannotWrite(item, exc) from None
        filled.put(chunk)
        item.downloaded += len(chunk)
        link.received(len(chunk))
        if item.downloaded - flushed >= WRITEBACK_EVERY:
            start_writeback(fd, flushed, item.downloaded - flushed)
            flushed = item.downloaded
        if task.cancelled.is_set():
            raise Cancelled()
        now = time.monotonic()
        if now >= next_update:
            next_update = now + UPDATE_INTERVAL
            link.progress(task)
    if item.downloaded < item.size:
        raise Retry(f"connection closed at byte {item.downloaded} of {item.size}")


def _restart(item: Item, out, hasher: Hasher) -> None:
    out.seek(0)
    out.truncate()
    item.downloaded = 0
    hasher.reset()


def _content_range_starts_at(resp, offset: int) -> bool:
    span = content_range(resp)
    return span is not None and span[0] == offset


# --- what both ways of fetching share --------------------------------------------


def install(item: Item, part: Path, hasher: Hasher) -> None:
    """Rename a complete part file into place if its checksum matches; else delete it."""
    saved = map_path(part)
    if not hasher.matches():
        part.unlink()
        saved.unlink(missing_ok=True)
        item.downloaded = 0
        raise DownloadFailed(f"{item.id}: checksum mismatch (expected sha256 "
                             f"{item.sha256 or item.git_oid}, got {hasher.hexdigest()}); "
                             f"the damaged download was deleted, pull again")
    # The map goes first: a kill before the rename then leaves a whole part file, which
    # the next pull takes for a finished one-stream download and checks again.
    saved.unlink(missing_ok=True)
    os.replace(part, item.local_path)
    fsync_dir(item.local_path.parent)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Have the kernel start writing a range to disk now, so the final fsync is short.

    On Linux, POSIX_FADV_DONTNEED starts writeback of dirty pages (and drops the
    clean ones from the page cache, which a download will not read again).
    """
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


class Hasher:
    """The checksum the hub gives for a file: sha256 for LFS files, git's sha1 otherwise."""

    def __init__(self, item: Item):
        self.item = item
        self.reset()

    def reset(self) -> None:
        """Start the checksum over (the part file is being started over)."""
        if self.item.sha256:
            self._h = hashlib.sha256()
        elif self.item.git_oid:
            self._h = hashlib.sha1(b"blob %d\0" % self.item.size)
        else:
            self._h = None

    @property
    def active(self) -> bool:
        """Whether there is a checksum to compute (not for a file given without one)."""
        return self._h is not None

    def catch_up(self, f, cancelled: threading.Event | None = None) -> None:
        """Hash what a part file already holds (a resumed download)."""
        f.seek(0)
        if self._h is not None:
            while chunk := f.read(CHUNK):
                self._h.update(chunk)
                if cancelled is not None and cancelled.is_set():
                    raise Cancelled()
        f.seek(0, os.SEEK_END)

    def update(self, data) -> None:
        if self._h is not None:
            self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest() if self._h is not None else ""

    def matches(self) -> bool:
        expected = self.item.sha256 or self.item.git_oid
        return expected is None or self.hexdigest() == expected.lower()


def complete(item: Item, cancelled: threading.Event | None = None) -> bool:
    """Whether the final file is already there (a pull that stopped after the rename)."""
    try:
        if item.local_path.stat().st_size != item.size:
            return False
    except FileNotFoundError:
        return False
    hasher = Hasher(item)
    with open(item.local_path, "rb") as f:
        hasher.catch_up(f, cancelled)
    return hasher.matches()


def check_in_place(link: Link, task: Task, item: Item) -> None:
    """Hash each file of an item in place (`item.files`) against its sha256 and size,
    counting the bytes read as downloaded; DownloadFailed names the first that differs."""
    item.downloaded = 0
    next_update = time.monotonic() + UPDATE_INTERVAL
    for path, sha256, size in item.files:
        digest, read = hashlib.sha256(), 0
        try:
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    if task.cancelled.is_set():
                        raise Cancelled()
                    digest.update(chunk)
                    read += len(chunk)
                    item.downloaded += len(chunk)
                    if time.monotonic() >= next_update:
                        next_update = time.monotonic() + UPDATE_INTERVAL
                        link.progress(task)
        except FileNotFoundError:
            raise DownloadFailed(f"{item.id}: {path} is missing") from None
        except OSError as exc:
            raise DownloadFailed(f"{item.id}: cannot read {path}: "
                                 f"{exc.strerror or exc}") from None
        if digest.hexdigest() != sha256 or size not in (None, read):
            raise DownloadFailed(f"{item.id}: {path} has changed since it was installed "
                                 f"({read} bytes with sha256 {digest.hexdigest()}; "
                                 f"expected {size} bytes with sha256 {sha256})")
    item.downloaded = item.size


def content_range(resp) -> tuple[int, int] | None:
    """The first and last byte a 206 answer carries, from its Content-Range."""
    match = re.fullmatch(r"\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*",
                         resp.headers.get("Content-Range", ""))
    return (int(match[1]), int(match[2])) if match else None


def shut(sock) -> None:
    """Unblock a thread waiting on `sock` by shutting it down."""
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _status_error(task: Task, item: Item, exc: urllib.error.HTTPError) -> Exception:
    """What an HTTP error answer to a download means: a Retry, or a DownloadFailed."""
    url = exc.url or item.url
    if exc.code == 429:
        return RateLimited(url, retry_after_seconds(exc.headers))
    if exc.code == 416:
        return Unsatisfiable(f"HTTP 416 from {origin(url)}")
    if exc.code >= 500:
        return Retry(f"HTTP {exc.code} from {origin(url)}")
    if task.hub_url and exc.url and urlsplit(exc.url).netloc != urlsplit(task.hub_url).netloc:
        # The CDN refused its signed URL (it expired, say); the hub signs a new one.
        return Retry(f"HTTP {exc.code} from {origin(exc.url)}")
    return DownloadFailed(_http_failure(exc.code, item))


def _http_failure(status: int, item: Item) -> str:
    if status in (401, 403):
        return (f"{item.id}: the hub refused the file (HTTP {status}); the repository "
                f"needs a token, or the token was not accepted")
    if status == 404:
        return f"{item.id}: the file is no longer on the hub (HTTP 404)"
    return f"{item.id}: HTTP {status} from {origin(item.url)}"

