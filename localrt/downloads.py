"""Outbound HTTP: one urllib opener per request, built from the Config fields.

Proxy, credentials, no_proxy and the SSL flags come only from Config (spec 2.1),
never from the environment, and are read afresh for every request, so a change
applies to the next one without a restart. The hub token is added as an
unredirected header, so it reaches the hub and never the host a redirect leads to.

Download tasks (`Downloads`) run in the background, one thread each. Every file
is written to `<name>.part`, resumed with a Range request after a cancel, a
dropped connection or a kill, and renamed into place only once its size and
checksum match. Progress is published on the EventBus.

A file of PIECES_FROM bytes or more is fetched as pieces, byte ranges that
downloadConnections workers ask for at once and write in place; `<name>.part.map`
records how much of each piece is on disk, so a resume fetches only what is missing.
"""

from __future__ import annotations

import base64
import datetime
import email.utils
import errno
import glob
import hashlib
import http.client
import ipaddress
import json
import logging
import math
import os
import queue
import re
import shutil
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping
from urllib.parse import quote, unquote, urlsplit

from localrt import security
from localrt.errors import Conflict, InsufficientStorage, NotFound, UpstreamError
from localrt.events import EventBus
from localrt.fsutil import atomic_write, fsync_dir, human_size, private_dir

log = logging.getLogger(__name__)


class ProxyAuthFailed(UpstreamError):
    code = "proxy_auth_failed"


class CertificateFailed(UpstreamError):
    code = "tls_verification_failed"


def no_proxy_matches(host: str, no_proxy: str) -> bool:
    """Whether `host` bypasses the proxy, with curl's meaning of NO_PROXY.

    Entries are comma-separated: `*` matches every host; a name matches itself
    and its subdomains (a leading dot is optional); an IP or CIDR range matches
    addresses in it. Ports on entries are ignored.
    """
    host = host.strip("[]").lower().rstrip(".")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for entry in (e.strip().lower() for e in no_proxy.split(",")):
        if not entry:
            continue
        if entry == "*":
            return True
        if entry.startswith("["):
            entry = entry[1:].split("]", 1)[0]
        elif entry.count(":") == 1:
            entry = entry.split(":", 1)[0]  # host:port
        if address is not None:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                pass
            continue
        entry = entry.lstrip(".").rstrip(".")
        if entry and (host == entry or host.endswith("." + entry)):
            return True
    return False


class _ConfigProxyHandler(urllib.request.ProxyHandler):
    """urllib's proxy handling, but with no_proxy and credentials from Config."""

    def __init__(self, proxy_url: str, username: str, password: str, no_proxy: str):
        super().__init__({"http": proxy_url, "https": proxy_url})
        self._no_proxy = no_proxy
        self._auth = None
        if username or password:
            creds = f"{username}:{password}".encode("utf-8")
            self._auth = "Basic " + base64.b64encode(creds).decode("ascii")

    def proxy_open(self, req, proxy, type):
        if req.host and no_proxy_matches(urlsplit(f"//{req.host}").hostname or "",
                                         self._no_proxy):
            return None
        hostport = unquote(urlsplit(proxy).netloc.rpartition("@")[2])
        if self._auth:
            # Sent to the proxy only: on https targets urllib moves it to the CONNECT,
            # and being unredirected it never follows a redirect to a host that
            # no_proxy sends direct (the CDN).
            req.add_unredirected_header("Proxy-Authorization", self._auth)
        req.set_proxy(hostport, urlsplit(proxy).scheme)
        return None


def ssl_context(config: Mapping) -> ssl.SSLContext:
    """The TLS context for hub and CDN connections, per verify_peer_ssl and verify_host_ssl."""
    ctx = ssl.create_default_context()
    if not config["verify_host_ssl"] or not config["verify_peer_ssl"]:
        ctx.check_hostname = False
    if not config["verify_peer_ssl"]:
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _reporting(connection_class, on_socket: Callable):
    """`connection_class`, reporting each socket it connects (a tunnel's too)."""

    class Reporting(connection_class):
        def connect(self):
            super().connect()
            on_socket(self.sock)

    return Reporting


class _HTTPHandler(urllib.request.HTTPHandler):
    """http:// through a connection that reports its socket as soon as it has one."""

    def __init__(self, on_socket: Callable):
        super().__init__()
        self._connection = _reporting(http.client.HTTPConnection, on_socket)

    def http_open(self, req):
        return self.do_open(self._connection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    """https:// with the TLS context of `config`, through a connection that reports its
    socket as soon as it has one (if `on_socket` is given).

    The context is made only when an https URL is opened: making one reads the
    system's CA store (about 15 ms), and a download in pieces opens many URLs.
    """

    def __init__(self, config: Mapping, on_socket: Callable | None):
        super().__init__()
        self._config = config
        self._connection = http.client.HTTPSConnection if on_socket is None else \
            _reporting(http.client.HTTPSConnection, on_socket)

    def https_open(self, req):
        return self.do_open(self._connection, req, context=ssl_context(self._config))


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is the answer itself (an HTTPError with its 3xx status)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


def build_opener(config: Mapping, on_socket: Callable | None = None,
                 redirects: bool = True) -> urllib.request.OpenerDirector:
    """An opener honouring the proxy, no_proxy and SSL fields of `config`.

    `on_socket(sock)` is called with each connected socket, so that a cancel can shut
    it down even before the response headers arrive.
    """
    handlers = [_HTTPSHandler(config, on_socket)]
    if on_socket is not None:
        handlers.append(_HTTPHandler(on_socket))
    if urlsplit(config["proxy_url"]).scheme.lower() == "https":
        # The API refuses these (schemas/config-update.json); this catches a hand-edited rc.
        raise UpstreamError("https:// proxy URLs are not supported; set proxy_url to the "
                            "proxy's http:// address")
    if config["proxy_url"]:
        handlers.append(_ConfigProxyHandler(config["proxy_url"], config["proxy_username"],
                                            config["proxy_password"], config["no_proxy"]))
    else:
        handlers.append(urllib.request.ProxyHandler({}))  # never the environment's proxy
    if not redirects:
        handlers.append(_NoRedirects())
    return urllib.request.build_opener(*handlers)


def open_url(config: Mapping, url: str, *, hub_url: str | None = None, headers=None,
             timeout: float = 30.0, on_socket: Callable | None = None, method: str = "GET",
             redirects: bool = True):
    """Open `url`; the hub token goes to the hub's host only. Raises UpstreamError.

    With `redirects` False a 3xx comes back as an HTTPError carrying its status.
    """
    req = urllib.request.Request(url, headers=dict(headers or {}), method=method)
    token = config.get("modelhub_token")
    if token and hub_url and urlsplit(url).netloc == urlsplit(hub_url).netloc:
        req.add_unredirected_header("Authorization", f"Bearer {token}")
    try:
        return build_opener(config, on_socket, redirects).open(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        # A 407 is the proxy's, and so is any answer that challenges for proxy credentials
        # (some proxies refuse with 401 or 403 plus Proxy-Authenticate): never the hub's.
        if exc.code == 407 or (config["proxy_url"] and exc.headers is not None
                               and exc.headers.get("Proxy-Authenticate")):
            exc.close()
            raise ProxyAuthFailed(_proxy_auth_message(config)) from None
        raise  # the caller knows what a 401, 403 or 404 from the hub means
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, OSError) and "407" in str(reason):
            raise ProxyAuthFailed(_proxy_auth_message(config)) from None
        if isinstance(reason, ssl.SSLCertVerificationError):
            raise CertificateFailed(f"TLS certificate check failed for {_origin(url)}: "
                                    f"{reason.verify_message}") from None
        raise UpstreamError(f"Cannot connect to {_origin(url)}: {reason}") from None
    except (OSError, ValueError) as exc:
        raise UpstreamError(f"Cannot connect to {_origin(url)}: {exc}") from None


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def _proxy_auth_message(config: Mapping) -> str:
    proxy = _origin(config["proxy_url"])  # never shows credentials
    if config["proxy_username"]:
        return (f"The proxy {proxy} rejected the credentials of user "
                f"{quote(config['proxy_username'])!r}; check proxy_username and proxy_password")
    return (f"The proxy {proxy} requires authentication; set proxy_username and "
            f"proxy_password")


# --- download tasks ------------------------------------------------------------

CHUNK = 1024 * 1024          # bytes per read
PIPELINE = 4                 # chunks in flight between receiving and hashing
WRITEBACK_EVERY = 32 * CHUNK  # bytes written between nudges to the kernel's writeback
MAX_ATTEMPTS = 5             # tries per file (or piece) without progress before the task fails
BACKOFF_SECONDS = (0.5, 1.0, 2.0, 4.0, 8.0)
MAX_RATE_LIMITED = 5         # 429 answers in a row for one file (or piece) before it fails
RETRY_AFTER_CAP = 30.0       # seconds: the longest Retry-After a download waits out
UPDATE_INTERVAL = 0.5        # seconds between DownloadUpdated events of one task
DISK_MARGIN = 64 * 1024 * 1024  # free space kept beyond what a pull needs
FINISHED_KEPT = 100          # finished tasks still listed by GET /v1/models/pull
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


class DownloadFailed(Exception):
    """A file could not be downloaded; the message says why, for the task's error."""


class _Retry(Exception):
    """A transient failure: try the file (or the piece) again after a pause."""


class _RateLimited(_Retry):
    """An HTTP 429: try again once the server's Retry-After has passed."""

    def __init__(self, url: str, delay: float | None):
        super().__init__(f"HTTP 429 from {_origin(url)}")
        self.origin = _origin(url)
        self.delay = delay


class _Unsatisfiable(_Retry):
    """An HTTP 416: the server has no such byte range of the file."""


class _NoRanges(Exception):
    """The server answered a Range request with the whole file: fetch it in one stream."""


class _Cancelled(Exception):
    pass


def retry_after_seconds(headers, cap: float = RETRY_AFTER_CAP) -> float | None:
    """The wait a Retry-After header asks for, in seconds up to `cap`; None if it has none."""
    value = headers.get("Retry-After") if headers is not None else None
    if not value:
        return None
    try:
        seconds = float(value.strip())  # RFC 9110: delay-seconds ...
        if not math.isfinite(seconds):
            return None
    except ValueError:
        try:  # ... or an HTTP date
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.timezone.utc)
        seconds = (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    return min(max(seconds, 0.0), cap)


class _Backoff:
    """How long to pause before the next try of one file or piece, and when to give up.

    Tries without progress count toward MAX_ATTEMPTS. 429s count apart, toward
    MAX_RATE_LIMITED in a row, and wait what the server's Retry-After asks.
    """

    def __init__(self, what: str):
        self.what = what
        self.attempts = 0
        self.limited = 0

    def pause(self, exc: _Retry, progressed: bool) -> float:
        """Seconds to wait before the next try; raises DownloadFailed to give up."""
        if isinstance(exc, _RateLimited):
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

    def to_dict(self) -> dict:
        """The item as the API shows it."""
        return {"id": self.id, "url": security.url_without_credentials(self.url),
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
    on_success: Callable[["Task"], None] | None = field(default=None, repr=False)
    # Called after each item is complete; it may append items (an engine wheel's
    # requirements are known only once the wheel is there).
    after_item: Callable[["Task", "Item"], None] | None = field(default=None, repr=False)
    cancelled: threading.Event = field(default_factory=threading.Event, repr=False)
    # The sockets of the task's open connections (one per worker), to shut on a cancel.
    _sockets: set = field(default_factory=set, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False,
                                  repr=False)  # guards _sockets

    def connected(self, sock) -> None:
        """Note a download's socket; shut it at once if a cancel came first."""
        with self._lock:
            self._sockets.add(sock)
        if self.cancelled.is_set():  # set before the add, so `cancel` may have missed it
            _abort(sock)

    def released(self, *socks) -> None:
        """Forget sockets whose requests are over."""
        with self._lock:
            self._sockets.difference_update(socks)

    def abort(self) -> None:
        """Shut every open connection of the task, so no thread waits on one."""
        with self._lock:
            socks = list(self._sockets)
        for sock in socks:
            _abort(sock)

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
        if self.error:
            out["error"] = self.error
        return out


def part_path(path: Path) -> Path:
    """Where a file is written until it is complete and checked."""
    return path.with_name(path.name + ".part")


def map_path(part: Path) -> Path:
    """The part map beside a part file fetched in pieces: how much of each piece is done."""
    return part.with_name(part.name + ".map")


class Downloads:
    """Owns the download tasks and their threads."""

    def __init__(self, config: Callable[[], Mapping], events: EventBus,
                 connections: Callable[[], int]):
        self._config = config  # called per request, so Config changes apply at once
        self._events = events
        self._connections = connections  # downloadConnections, read per file
        # Guards _tasks (the dict, not the tasks' progress) and the end of each task
        # with its last event.
        self._lock = threading.Lock()
        self._tasks: dict[str, Task] = {}
        self._threads: list[threading.Thread] = []

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

    def running(self, task_id: str) -> Task | None:
        """The running task with this id, if any."""
        with self._lock:
            task = self._tasks.get(task_id)
        return task if task is not None and task.running else None

    def list(self) -> list[dict]:
        """Every task still known, running ones first."""
        with self._lock:
            tasks = list(self._tasks.values())
        tasks.sort(key=lambda t: not t.running)
        return [t.to_dict() for t in tasks]

    def cancel(self, task_id: str) -> dict:
        """Stop a running task; its part files stay, so a new pull resumes."""
        with self._lock:
            task = self._tasks.get(task_id)
        if task is None:
            raise NotFound(f"No download task {task_id!r}", param="taskId")
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
                raise _Cancelled()
            if task.on_success is not None:
                task.on_success(task)
        except _Cancelled:
            self._finish(task, "Stopped", "DownloadStopped")
            log.info("download %s stopped", task.id)
        except (DownloadFailed, UpstreamError) as exc:
            self._fail(task, str(exc))
        except OSError as exc:
            self._fail(task, f"Cannot write {exc.filename or 'a model file'}: "
                             f"{exc.strerror or exc}")
        except Exception:
            log.exception("download %s failed", task.id)
            self._fail(task, "Internal error; the server log has the details")
        else:
            self._finish(task, "Success", "DownloadSuccess")
            elapsed = time.monotonic() - started
            total = sum(item.size for item in task.items)
            log.info("download %s finished: %s in %.2fs (%s/s)", task.id, human_size(total),
                     elapsed, human_size(total / max(elapsed, 1e-6)))

    def _fail(self, task: Task, message: str) -> None:
        task.error = security.redact(message, security.secrets_of(self._config()))
        self._finish(task, "Error", "DownloadError")
        log.warning("download %s failed: %s", task.id, task.error)

    def _finish(self, task: Task, status: str, event_type: str) -> None:
        """End a task and say so, before a new run of the same id can start (`start`
        holds the same lock), so its last event never follows the next run's first."""
        with self._lock:
            task.status = status
            self._publish(event_type, task)

    def _publish(self, event_type: str, task: Task) -> None:
        self._events.publish(event_type, task=task.to_dict())

    def _fetch(self, task: Task, item: Item) -> None:
        """Download one file to its part file, check it, and rename it into place."""
        if _complete(item, task.cancelled):
            item.downloaded = item.size
            return
        part = part_path(item.local_path)
        private_dir(part.parent)
        connections = self._connections()
        # A part file already laid out in pieces is finished in pieces, whatever the
        # setting says now: its bytes are no prefix that one stream could resume.
        if item.size >= PIECES_FROM and (connections > 1 or map_path(part).exists()):
            try:
                self._fetch_pieces(task, item, part, connections)
                return
            except _NoRanges as exc:
                log.info("download %s: %s; fetching %s in one stream", task.id, exc, item.id)
        _forget_pieces(part)
        self._fetch_stream(task, item, part)

    def _open(self, task: Task, item: Item, url: str, headers: Mapping, on_socket: Callable,
              stopped: Callable[[], bool]):
        """GET `url` for `item`; a failure becomes _Cancelled, _Retry or DownloadFailed."""
        try:
            return open_url(self._config(), url, hub_url=task.hub_url, headers=headers,
                            timeout=30.0, on_socket=on_socket)
        except urllib.error.HTTPError as exc:
            exc.close()
            if stopped():
                raise _Cancelled() from None
            raise _status_error(task, item, exc) from None
        except (ProxyAuthFailed, CertificateFailed):
            raise
        except UpstreamError as exc:
            if stopped():  # the cancel shut the socket before the headers
                raise _Cancelled() from None
            raise _Retry(str(exc)) from None

    # --- one stream ------------------------------------------------------------

    def _fetch_stream(self, task: Task, item: Item, part: Path) -> None:
        """Fetch a file over one connection, resuming where its part file ends."""
        with open(part, "ab+", buffering=0) as out:
            hasher = _Hasher(item)
            if os.fstat(out.fileno()).st_size > item.size:
                out.truncate(0)  # the hub now lists a smaller file: start over
            hasher.catch_up(out, task.cancelled)
            item.downloaded = out.tell()
            backoff = _Backoff(item.id)
            while item.downloaded < item.size or item.size == 0:
                if task.cancelled.is_set():
                    raise _Cancelled()
                before = item.downloaded
                try:
                    self._transfer(task, item, out, hasher)
                    if item.size == 0:
                        break
                except _Retry as exc:
                    delay = backoff.pause(exc, item.downloaded > before)
                    log.info("download %s: %s; retrying in %.1fs", task.id, exc, delay)
                    if task.cancelled.wait(delay):
                        raise _Cancelled() from None
            os.fsync(out.fileno())
            on_disk = os.fstat(out.fileno()).st_size
        if item.downloaded != item.size or on_disk != item.size:
            raise DownloadFailed(f"{item.id}: got {item.downloaded} bytes, expected "
                                 f"{item.size}")
        _install(item, part, hasher)

    def _transfer(self, task: Task, item: Item, out, hasher: "_Hasher") -> None:
        """One HTTP request, resuming at item.downloaded; raises _Retry on transient errors."""
        offset = item.downloaded
        os.ftruncate(out.fileno(), offset)  # whatever a failed write left past it goes
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        opened: list = []

        def connected(sock):
            opened.append(sock)
            task.connected(sock)

        try:
            try:
                resp = self._open(task, item, item.url, headers, connected,
                                  task.cancelled.is_set)
            except _Unsatisfiable:
                if not offset:
                    raise
                _restart(item, out, hasher)  # the part is not a prefix of this file
                raise _Retry("the server refused to resume; starting over") from None
            try:
                if task.cancelled.is_set():
                    raise _Cancelled()
                if offset and resp.status != 206:
                    _restart(item, out, hasher)  # the server ignored the Range header
                elif offset and not _content_range_starts_at(resp, offset):
                    raise _Retry("the server resumed at the wrong offset")
                self._copy(task, item, resp, out, hasher)
            except (http.client.HTTPException, OSError) as exc:
                if task.cancelled.is_set():
                    raise _Cancelled() from None
                if isinstance(exc, OSError) and exc.filename:
                    raise  # our own file, not the network
                raise _Retry(f"connection lost ({exc.__class__.__name__})") from None
            finally:
                resp.close()
        finally:
            task.released(*opened)

    def _copy(self, task: Task, item: Item, resp, out, hasher: "_Hasher") -> None:
        # Hashing runs in its own thread (hashlib drops the GIL), so checking the
        # sha256 costs little download speed; the bounded queue bounds the memory.
        filled: queue.Queue = queue.Queue(PIPELINE)

        def hash_chunks():
            while (chunk := filled.get()) is not None:
                hasher.update(chunk)

        worker = threading.Thread(target=hash_chunks, daemon=True, name=f"sha {item.id}")
        worker.start()
        try:
            self._receive(task, item, resp, out.fileno(), filled)
        finally:
            filled.put(None)
            worker.join()

    def _receive(self, task: Task, item: Item, resp, fd: int, filled: queue.Queue) -> None:
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
                raise DownloadFailed(f"{item.id}: cannot write {item.local_path.parent}: "
                                     f"{exc.strerror or exc}") from None
            filled.put(chunk)
            item.downloaded += len(chunk)
            if item.downloaded - flushed >= WRITEBACK_EVERY:
                _start_writeback(fd, flushed, item.downloaded - flushed)
                flushed = item.downloaded
            if task.cancelled.is_set():
                raise _Cancelled()
            now = time.monotonic()
            if now >= next_update:
                next_update = now + UPDATE_INTERVAL
                self._publish("DownloadUpdated", task)
        if item.downloaded < item.size:
            raise _Retry(f"connection closed at byte {item.downloaded} of {item.size}")

    # --- pieces over several connections ---------------------------------------

    def _fetch_pieces(self, task: Task, item: Item, part: Path, connections: int) -> None:
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
                self._run_workers(pieces, max(1, connections), hasher)
                if pieces.error is not None:
                    raise pieces.error
                if task.cancelled.is_set():
                    raise _Cancelled()
                if pieces.prefix() != item.size:
                    raise DownloadFailed(f"{item.id}: the pieces ended with "
                                         f"{pieces.prefix()} of {item.size} bytes")
                hasher.hash_to(item.size)
            os.fsync(fd)
        finally:
            os.close(fd)
        _install(item, part, hasher)

    def _run_workers(self, pieces: "_Pieces", connections: int,
                     hasher: "_PrefixHasher") -> None:
        """Run the workers and follow them until they end."""
        workers = [threading.Thread(target=self._work, args=(pieces,), daemon=True,
                                    name=f"download {pieces.task.id} #{n}")
                   for n in range(min(connections, pieces.pending()))]
        for worker in workers:
            worker.start()
        try:
            self._follow(pieces, workers, hasher)
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

    def _follow(self, pieces: "_Pieces", workers: list, hasher: "_PrefixHasher") -> None:
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
                self._publish("DownloadUpdated", task)
            if now >= next_save:
                pieces.save()
                next_save = time.monotonic() + MAP_INTERVAL

    def _work(self, pieces: "_Pieces") -> None:
        """A worker thread: fetch pieces until none is left or the workers stop."""
        buf = memoryview(bytearray(PIECE_BUFFER))
        try:
            while (i := pieces.take()) is not None:
                self._fetch_piece(pieces, i, buf)
        except _Cancelled:
            pass
        except Exception as exc:  # the task's thread raises it
            pieces.fail(exc)

    def _fetch_piece(self, pieces: "_Pieces", i: int, buf: memoryview) -> None:
        """Fetch piece i, going on from its last byte after each transient failure."""
        backoff = _Backoff(pieces.item.id)
        while pieces.left(i):
            if pieces.stopped():
                raise _Cancelled()
            before = pieces.done[i]
            try:
                self._get_range(pieces, i, buf)
            except _Retry as exc:
                delay = backoff.pause(exc, pieces.done[i] > before)
                log.info("download %s: %s at byte %d; retrying that piece in %.1fs",
                         pieces.task.id, exc, pieces.span(i)[0] + pieces.done[i], delay)
                if pieces.stop.wait(delay):
                    raise _Cancelled() from None

    def _get_range(self, pieces: "_Pieces", i: int, buf: memoryview) -> None:
        """One request for the rest of piece i; raises _Retry on transient errors."""
        task, item = pieces.task, pieces.item
        start, end = pieces.span(i)
        offset = start + pieces.done[i]
        opened: list = []

        def connected(sock):
            opened.append(sock)
            pieces.connected(sock)

        try:
            try:
                resp = self._open(task, item, pieces.url, {"Range": f"bytes={offset}-{end - 1}"},
                                  connected, pieces.stopped)
            except _Retry:
                pieces.url = item.url  # ask the hub again: a CDN's signed URL expires
                raise
            try:
                if pieces.stopped():
                    raise _Cancelled()
                if resp.status != 206:
                    raise _NoRanges(f"{_origin(resp.url)} answered a Range request with "
                                    f"the whole file")
                if _content_range(resp) != (offset, end - 1):
                    raise _Retry(f"{_origin(resp.url)} sent other bytes than those asked for")
                pieces.url = resp.url  # the CDN's signed URL: the next pieces skip the hub
                self._receive_piece(pieces, i, resp, offset, end, buf)
            except (http.client.HTTPException, OSError) as exc:
                if pieces.stopped():
                    raise _Cancelled() from None
                raise _Retry(f"connection lost ({exc.__class__.__name__})") from None
            finally:
                resp.close()
        finally:
            task.released(*opened)

    def _receive_piece(self, pieces: "_Pieces", i: int, resp, offset: int, end: int,
                       buf: memoryview) -> None:
        """Write the bytes of `resp` at `offset` on, in place, until piece i ends at `end`."""
        item = pieces.item
        while offset < end:
            received = resp.readinto(buf[:min(len(buf), end - offset)])
            if not received:
                raise _Retry(f"connection closed at byte {offset} of {item.size}")
            try:
                written = 0
                while written < received:
                    written += os.pwrite(pieces.fd, buf[written:received], offset + written)
            except OSError as exc:  # our disk, not the network: no retry
                raise DownloadFailed(f"{item.id}: cannot write {item.local_path.parent}: "
                                     f"{exc.strerror or exc}") from None
            offset += received
            pieces.advance(i, received)
            if pieces.stopped():
                raise _Cancelled()


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
            _abort(sock)

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
    atomic_write(path, json.dumps({"version": MAP_VERSION, "size": item.size,
                                   "sha256": item.sha256, "gitOid": item.git_oid,
                                   "piece": size, "done": done}).encode())


def _preallocate(fd: int, item: Item) -> None:
    """Give the part file its full length, reserving its disk blocks where possible."""
    if os.fstat(fd).st_size >= item.size:
        return  # done by the run that laid the pieces out
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, item.size)
            return
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DownloadFailed(f"{item.id}: not enough disk space in "
                                     f"{item.local_path.parent} for "
                                     f"{human_size(item.size)}") from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    os.ftruncate(fd, item.size)  # a sparse file, then




def _forget_pieces(part: Path) -> None:
    """Start a part file laid out in pieces over, for one stream to fetch."""
    saved = map_path(part)
    if saved.exists():
        try:
            os.truncate(part, 0)
        except FileNotFoundError:
            pass
        saved.unlink()


def _install(item: Item, part: Path, hasher: "_Hasher") -> None:
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


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Have the kernel start writing a range to disk now, so the final fsync is short.

    On Linux, POSIX_FADV_DONTNEED starts writeback of dirty pages (and drops the
    clean ones from the page cache, which a download will not read again).
    """
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


class _Hasher:
    """The checksum the hub gives for a file: sha256 for LFS files, git's sha1 otherwise."""

    def __init__(self, item: Item):
        self.item = item
        self._reset()

    def _reset(self) -> None:
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
                    raise _Cancelled()
        f.seek(0, os.SEEK_END)

    def update(self, data) -> None:
        if self._h is not None:
            self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest() if self._h is not None else ""

    def matches(self) -> bool:
        expected = self.item.sha256 or self.item.git_oid
        return expected is None or self.hexdigest() == expected.lower()


class _PrefixHasher(_Hasher):
    """A part file's checksum, computed over its start as the pieces complete it: the
    bytes are read back (from the page cache, mostly) through one buffer it keeps."""

    def __init__(self, item: Item, part: Path):
        super().__init__(item)
        self.hashed = 0  # bytes of the file fed to the checksum so far
        self._file = open(part, "rb", buffering=0)
        self._buf = memoryview(bytearray(CHUNK))

    def __enter__(self) -> "_PrefixHasher":
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
        _start_writeback(self._file.fileno(), start, end - start)


def _restart(item: Item, out, hasher: _Hasher) -> None:
    out.seek(0)
    out.truncate()
    item.downloaded = 0
    hasher._reset()


def _complete(item: Item, cancelled: threading.Event | None = None) -> bool:
    """Whether the final file is already there (a pull that stopped after the rename)."""
    try:
        if item.local_path.stat().st_size != item.size:
            return False
    except FileNotFoundError:
        return False
    hasher = _Hasher(item)
    with open(item.local_path, "rb") as f:
        hasher.catch_up(f, cancelled)
    return hasher.matches()


def _content_range(resp) -> tuple[int, int] | None:
    """The first and last byte a 206 answer carries, from its Content-Range."""
    match = re.fullmatch(r"\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*",
                         resp.headers.get("Content-Range", ""))
    return (int(match[1]), int(match[2])) if match else None


def _content_range_starts_at(resp, offset: int) -> bool:
    span = _content_range(resp)
    return span is not None and span[0] == offset


def _abort(sock) -> None:
    """Unblock a thread waiting on `sock` by shutting it down."""
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _status_error(task: Task, item: Item, exc: urllib.error.HTTPError) -> Exception:
    """What an HTTP error answer to a download means: a _Retry, or a DownloadFailed."""
    url = exc.url or item.url
    if exc.code == 429:
        return _RateLimited(url, retry_after_seconds(exc.headers))
    if exc.code == 416:
        return _Unsatisfiable(f"HTTP 416 from {_origin(url)}")
    if exc.code >= 500:
        return _Retry(f"HTTP {exc.code} from {_origin(url)}")
    if task.hub_url and exc.url and urlsplit(exc.url).netloc != urlsplit(task.hub_url).netloc:
        # The CDN refused its signed URL (it expired, say); the hub signs a new one.
        return _Retry(f"HTTP {exc.code} from {_origin(exc.url)}")
    return DownloadFailed(_http_failure(exc.code, item))


def _http_failure(status: int, item: Item) -> str:
    if status in (401, 403):
        return (f"{item.id}: the hub refused the file (HTTP {status}); the repository "
                f"needs a token, or the token was not accepted")
    if status == 404:
        return f"{item.id}: the file is no longer on the hub (HTTP 404)"
    return f"{item.id}: HTTP {status} from {_origin(item.url)}"


def check_disk_space(what: str, items: list[Item]) -> None:
    """Raise InsufficientStorage unless the items' missing bytes fit on the disk."""
    if not items:
        return
    needed = 0
    for item in items:
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
    where = items[0].local_path.parent
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if needed + DISK_MARGIN > free:
        raise InsufficientStorage(
            f"Not enough disk space for {what}: it needs {human_size(needed)} and "
            f"{where} has {human_size(free)} free")
