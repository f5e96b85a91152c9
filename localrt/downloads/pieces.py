"""One big file of a download task, fetched as pieces over several connections.

A file of PIECES_FROM bytes or more is fetched as pieces, byte ranges that
downloadConnections workers ask for at once and write in place in the part file;
`<name>.part.map` records how much of each piece is on disk, so a resume fetches
only what is missing; it is padded to the longest it can grow, so that on a disk that
filled up meanwhile it is still saved, overwritten in place. The task's thread
coordinates: it hashes the file's complete prefix as it grows, publishes progress
and saves the map. The parts a one-stream
fetch also uses (Item, Task, Link, Request, the checksum and the final rename) are
in localrt.downloads.fetch; localrt.downloads.tasks decides which way a file is fetched.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

from localrt.downloads.fetch import (CHUNK, UPDATE_INTERVAL, Backoff, Cancelled, CannotWrite,
                           DownloadFailed, Hasher, Item, Link, Request, Retry, Task,
                           content_range, install, map_path, shut, start_writeback)
from localrt.fsutil import NO_SPACE, atomic_write
from localrt.outbound import origin

log = logging.getLogger(__name__)

# Files this big or bigger are fetched as byte ranges over downloadConnections
# connections: a CDN caps each connection, so one stream rarely fills the link.
PIECES_FROM = 64 * 1024 * 1024
PIECE_MAX = 32 * 1024 * 1024  # bytes per piece; less only so each connection gets one,
PIECE_MIN = 8 * 1024 * 1024   # but not less than this: a request costs a round trip or two
MAP_INTERVAL = 1.0           # seconds between saves of the part map: what a kill -9 may cost
WATCH_INTERVAL = 0.05        # seconds the coordinator waits for news before it looks again
HASH_STEP = 8 * CHUNK        # bytes hashed between the coordinator's other duties
# Bytes a piece worker receives at once, into a buffer it keeps: no allocation per
# read, so memory stays flat however many workers run.
PIECE_BUFFER = 256 * 1024
MAP_VERSION = 1              # of the part map's JSON; another version is not trusted


class NoRanges(Exception):
    """The server answered a Range request with the whole file: fetch it in one stream."""


def fetch_pieces(link: Link, task: Task, item: Item, part: Path, connections: int) -> None:
    """Fetch a big file as byte ranges over several connections, check it, rename it.

    Worker threads take the pieces in order and write each where it belongs in the
    preallocated part file. Meanwhile this thread hashes the file's complete prefix
    as it grows (so the final check is short), publishes progress, and saves the part
    map, so that a resume after a cancel or a kill fetches no piece twice.
    """
    fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        pieces = _Pieces(task, item, fd, map_path(part), *_layout(item, part, fd,
                                                                  connections))
        _preallocate(fd, item)
        with _PrefixHasher(item, part) as hasher:
            _run_workers(link, pieces, max(1, connections), hasher)
            if pieces.error is not None:
                raise pieces.error
            if task.cancelled.is_set():
                raise Cancelled()
            if pieces.prefix() != item.size:
                raise DownloadFailed(f"{item.id}: the pieces ended with "
                                     f"{pieces.prefix()} of {item.size} bytes")
            hasher.hash_to(item.size)
        os.fsync(fd)
    finally:
        os.close(fd)
    install(item, part, hasher)


def _run_workers(link: Link, pieces: _Pieces, connections: int,
                 hasher: _PrefixHasher) -> None:
    """Run the workers and follow them until they end."""
    workers = [threading.Thread(target=_work, args=(link, pieces), daemon=True,
                                name=f"download {pieces.task.id} #{n}")
               for n in range(min(connections, pieces.pending()))]
    for worker in workers:
        worker.start()
    try:
        _follow(link, pieces, workers, hasher)
    except BaseException as exc:
        pieces.fail(exc)  # the workers stop too
        raise
    finally:
        for worker in workers:
            worker.join()
        if pieces.prefix() < pieces.item.size:
            try:
                pieces.save()  # the workers' last bytes, for the resume
            except OSError as exc:
                log.warning("download %s: cannot save %s: %s", pieces.task.id,
                            pieces.map_file, exc.strerror or exc)


def _follow(link: Link, pieces: _Pieces, workers: list, hasher: _PrefixHasher) -> None:
    """While the workers run: hash the complete prefix as it grows, publish progress,
    save the part map, and stop the workers on a cancel or a failure."""
    task = pieces.task
    next_update = time.monotonic() + UPDATE_INTERVAL
    next_save = time.monotonic() + MAP_INTERVAL
    while any(worker.is_alive() for worker in workers):
        if task.cancelled.is_set():
            pieces.halt()  # wakes the workers that wait out a backoff
        if pieces.stop.is_set():
            break
        prefix = pieces.wait(hasher.hashed, WATCH_INTERVAL)
        hasher.hash_to(min(prefix, hasher.hashed + HASH_STEP))
        now = time.monotonic()
        if now >= next_update:
            next_update = now + UPDATE_INTERVAL
            link.progress(task)
        if now >= next_save:
            pieces.save()
            next_save = time.monotonic() + MAP_INTERVAL


def _work(link: Link, pieces: _Pieces) -> None:
    """A worker thread: fetch pieces until none is left or the workers stop."""
    buf = memoryview(bytearray(PIECE_BUFFER))
    try:
        while (i := pieces.take()) is not None:
            _fetch_piece(link, pieces, i, buf)
    except Cancelled:
        pass
    except Exception as exc:  # the task's thread raises it
        pieces.fail(exc)


def _fetch_piece(link: Link, pieces: _Pieces, i: int, buf: memoryview) -> None:
    """Fetch piece i, going on from its last byte after each transient failure."""
    backoff = Backoff(pieces.item.id)
    while pieces.left(i):
        if pieces.stopped():
            raise Cancelled()
        before = pieces.done[i]
        try:
            _get_range(link, pieces, i, buf)
        except Retry as exc:
            delay = backoff.pause(exc, pieces.done[i] > before)
            log.info("download %s: %s at byte %d; retrying that piece in %.1fs",
                     pieces.task.id, exc, pieces.span(i)[0] + pieces.done[i], delay)
            if pieces.stop.wait(delay):
                raise Cancelled() from None


def _get_range(link: Link, pieces: _Pieces, i: int, buf: memoryview) -> None:
    """One request for the rest of piece i; raises Retry on transient errors."""
    item = pieces.item
    start, end = pieces.span(i)
    offset = start + pieces.done[i]
    with Request(link, pieces.task, pieces.connected, pieces.stopped) as request:
        try:
            resp = request.open(item, pieces.url, {"Range": f"bytes={offset}-{end - 1}"})
        except Retry:
            pieces.url = item.url  # ask the hub again: a CDN's signed URL expires
            raise
        if resp.status != 206:
            raise NoRanges(f"{origin(resp.url)} answered a Range request with "
                           f"the whole file")
        if content_range(resp) != (offset, end - 1):
            raise Retry(f"{origin(resp.url)} sent other bytes than those asked for")
        pieces.url = resp.url  # the CDN's signed URL: the next pieces skip the hub
        _receive_piece(link, pieces, i, resp, offset, end, buf)


def _receive_piece(link: Link, pieces: _Pieces, i: int, resp, offset: int, end: int,
                   buf: memoryview) -> None:
    """Write the bytes of `resp` at `offset` on, in place, until piece i ends at `end`."""
    item = pieces.item
    while offset < end:
        received = resp.readinto(buf[:min(len(buf), end - offset)])
        if not received:
            raise Retry(f"connection closed at byte {offset} of {item.size}")
        try:
            written = 0
            while written < received:
                written += os.pwrite(pieces.fd, buf[written:received], offset + written)
        except OSError as exc:  # our disk, not the network: no retry
            raise CannotWrite(item, exc) from None
        offset += received
        pieces.advance(i, received)
        link.received(received)
        if pieces.stopped():
            raise Cancelled()


class _Pieces:
    """One file being fetched in pieces: what is done, and which piece goes next.

    Piece i is bytes [i * size, min((i + 1) * size, item.size)) of the file; done[i]
    counts the bytes at its start that are written. Only the worker that took a piece
    advances it. `_cond`'s lock guards done, _next, _open, item.downloaded and error;
    the coordinator waits on it to hear that the complete prefix of the file grew.
    """

    def __init__(self, task: Task, item: Item, fd: int, map_file: Path, size: int,
                 done: list[int]):
        self.task, self.item, self.fd, self.map_file = task, item, fd, map_file
        self.size = size
        self.done = done
        self.url = item.url  # where ranges are asked for: the CDN's URL once it is known
        self.error: BaseException | None = None  # the first worker failure
        self.stop = threading.Event()  # the workers end: a cancel or a failure
        # Guards done, _next, _open, item.downloaded and error; notified when the
        # complete prefix grows or the workers stop.
        self._cond = threading.Condition()
        self._next = 0  # the next piece to hand out
        self._open = 0  # the first piece that is not complete
        self._skip_complete()
        item.downloaded = sum(done)

    def span(self, i: int) -> tuple[int, int]:
        """Piece i's first byte, and the byte after its last."""
        start = i * self.size
        return start, min(start + self.size, self.item.size)

    def left(self, i: int) -> int:
        """Bytes of piece i still to fetch."""
        start, end = self.span(i)
        return end - start - self.done[i]

    def pending(self) -> int:
        """How many pieces still need bytes."""
        with self._cond:
            return sum(1 for i in range(len(self.done)) if self.left(i))

    def take(self) -> int | None:
        """The next piece that needs bytes, for a worker; None when none is left."""
        with self._cond:
            while self._next < len(self.done) and not self.left(self._next):
                self._next += 1
            if self.stop.is_set() or self._next == len(self.done):
                return None
            self._next += 1
            return self._next - 1

    def advance(self, i: int, n: int) -> None:
        """Count `n` more bytes of piece i as written."""
        with self._cond:
            self.done[i] += n
            self.item.downloaded += n
            if i == self._open:
                self._skip_complete()
                self._cond.notify_all()

    def prefix(self) -> int:
        """How many bytes at the start of the file are all written."""
        with self._cond:
            return self._prefix()

    def wait(self, beyond: int, timeout: float) -> int:
        """The prefix, once it passes `beyond`, `timeout` passes or the workers stop."""
        with self._cond:
            if self._prefix() <= beyond and not self.stop.is_set():
                self._cond.wait(timeout)
            return self._prefix()

    def save(self) -> None:
        """Save the part map with what is done now."""
        with self._cond:
            done = list(self.done)
        _save_map(self.map_file, self.item, self.size, done, self.fd)

    def stopped(self) -> bool:
        """Whether the workers are to end (a cancel may not have reached `stop` yet)."""
        return self.stop.is_set() or self.task.cancelled.is_set()

    def halt(self) -> None:
        """Have the workers end, and wake whoever waits."""
        self.stop.set()
        with self._cond:
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """A worker (or the coordinator) cannot go on: keep why, and stop the others now."""
        with self._cond:
            if self.error is None:
                self.error = exc
        self.halt()
        self.task.abort()

    def connected(self, sock) -> None:
        """Note a worker's socket with the task; shut it at once if the workers stop."""
        self.task.connected(sock)
        if self.stop.is_set():  # set before the task knew the socket: `fail` missed it
            shut(sock)

    def _prefix(self) -> int:
        if self._open == len(self.done):
            return self.item.size
        return self.span(self._open)[0] + self.done[self._open]

    def _skip_complete(self) -> None:
        while self._open < len(self.done) and not self.left(self._open):
            self._open += 1


def _layout(item: Item, part: Path, fd: int, connections: int) -> tuple[int, list[int]]:
    """The piece size and the bytes done in each piece: from the part map if it fits
    this file, else a new layout, saved before the part file grows."""
    saved = map_path(part)
    for stale in part.parent.glob(glob.escape(f".{saved.name}.") + "*.tmp"):
        stale.unlink(missing_ok=True)  # atomic_write's temp file, from a kill mid-save
    length = os.fstat(fd).st_size
    if saved.exists():
        layout = _read_map(saved, item, length)
        if layout is not None:
            return layout
        log.info("%s: its part map does not fit the file; starting over", item.id)
        kept = 0
    else:
        kept = length if length <= item.size else 0  # a one-stream download's prefix
    if kept < length:
        os.ftruncate(fd, kept)
    size = _piece_size(item.size, connections)
    done = []
    for start in range(0, item.size, size):
        done.append(min(max(kept - start, 0), min(size, item.size - start)))
    # Saved before the part file grows to its full length: a full-length part without
    # a map would read as a finished one-stream download.
    _save_map(saved, item, size, done, fd)
    return size, done


def _piece_size(size: int, connections: int) -> int:
    """Pieces of PIECE_MAX, or smaller so that each connection has one; whole CHUNKs."""
    each = -(-size // max(1, connections))
    return min(PIECE_MAX, max(PIECE_MIN, -(-each // CHUNK) * CHUNK))


def _read_map(path: Path, item: Item, length: int) -> tuple[int, list[int]] | None:
    """The (piece size, done) a part map records, if it is this file's and fits the
    part file's `length`; None for anything else, which is never trusted."""
    try:
        data = json.loads(path.read_bytes())
        check = data.pop("check", None)
        if check is not None and check != _check(data):
            return None  # torn while it was overwritten in place
        size, done = data["piece"], data["done"]
        if not (data["version"] == MAP_VERSION and data["size"] == item.size
                and data["sha256"] == item.sha256 and data["gitOid"] == item.git_oid
                and _is_count(size) and size > 0 and isinstance(done, list)
                and len(done) == -(-item.size // size)):
            return None
        for i, count in enumerate(done):
            start = i * size
            if not _is_count(count) or count > min(size, item.size - start) or \
                    start + count > length:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return size, done


def _is_count(value) -> bool:
    return type(value) is int and value >= 0


def _save_map(path: Path, item: Item, size: int, done: list[int], fd: int) -> None:
    """Record how much of each piece is written, once those bytes are on disk."""
    # Before the map counts the bytes, they are made durable; `done` was taken before
    # this sync, so it counts no byte written after it.
    getattr(os, "fdatasync", os.fsync)(fd)
    fields = {"version": MAP_VERSION, "size": item.size, "sha256": item.sha256,
              "gitOid": item.git_oid, "piece": size, "done": done}
    data = json.dumps({**fields, "check": _check(fields)}).encode()
    # Padded (JSON ends in spaces) to the length of a map whose pieces are all done:
    # the file never has to grow, so a disk with no block left can still take it.
    longest = json.dumps({**fields, "done": [size] * len(done), "check": _check(fields)})
    data = data.ljust(len(longest) + 1, b" ")
    try:
        atomic_write(path, data)
    except OSError as exc:
        # No block for atomic_write's temp file: overwrite the map's own blocks instead.
        # A kill mid-way tears it, which its check tells, and the resume starts over.
        if exc.errno not in NO_SPACE or not _overwrite(path, data):
            raise


def _check(fields: dict) -> str:
    """The sha256 a part map carries of its other fields."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _overwrite(path: Path, data: bytes) -> bool:
    """Write `data` over the file at `path` in place, if it is as long; whether it was."""
    try:
        with open(path, "r+b", buffering=0) as f:
            length = os.fstat(f.fileno()).st_size
            if length < len(data):
                return False
            f.write(data.ljust(length, b" "))
            os.fsync(f.fileno())
    except FileNotFoundError:
        return False
    return True


def _preallocate(fd: int, item: Item) -> None:
    """Give the part file its full length, reserving its disk blocks where possible."""
    if os.fstat(fd).st_size >= item.size:
        return  # done by the run that laid the pieces out
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, item.size)
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise CannotWrite(item, exc) from None  # ENOSPC: the task says how much
    os.ftruncate(fd, item.size)  # a sparse file, then


def forget_pieces(part: Path) -> None:
    """Start a part file laid out in pieces over, for one stream to fetch."""
    saved = map_path(part)
    if saved.exists():
        try:
            os.truncate(part, 0)
        except FileNotFoundError:
            pass
        saved.unlink()


class _PrefixHasher(Hasher):
    """A part file's checksum, computed over its start as the pieces complete it: the
    bytes are read back (from the page cache, mostly) through one buffer it keeps."""

    def __init__(self, item: Item, part: Path):
        super().__init__(item)
        self.hashed = 0  # bytes of the file fed to the checksum so far
        self._file = open(part, "rb", buffering=0)
        self._buf = memoryview(bytearray(CHUNK))

    def __enter__(self) -> _PrefixHasher:
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()

    def hash_to(self, end: int) -> None:
        """Feed the bytes from `hashed` up to `end` to the checksum."""
        start = self.hashed
        if end <= start:
            return
        if self.active:
            self._file.seek(start)
            while self.hashed < end:
                n = self._file.readinto(self._buf[:min(len(self._buf), end - self.hashed)])
                if not n:
                    raise OSError(errno.EIO, f"the part file ended at byte {self.hashed}")
                self.update(self._buf[:n])
                self.hashed += n
        self.hashed = end
        # Read, so no longer needed in memory; and what is still dirty starts to be
        # written, so that the final fsync is short.
        start_writeback(self._file.fileno(), start, end - start)

