"""Outbound HTTP: one urllib opener per request, built from the Config fields.

Proxy, credentials, no_proxy and the SSL flags come only from Config (spec 2.1),
never from the environment, and are read afresh for every request, so a change
applies to the next one without a restart. The hub token is added as an
unredirected header, so it reaches the hub and never the host a redirect leads to.

Download tasks (`Downloads`) run in the background, one thread each. Every file
is written to `<name>.part`, resumed with a Range request after a cancel, a
dropped connection or a kill, and renamed into place only once its size and
checksum match. Progress is published on the EventBus.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import ipaddress
import logging
import os
import queue
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
from localrt.fsutil import fsync_dir, human_size, private_dir

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
    """https:// through a connection that reports its socket as soon as it has one."""

    def __init__(self, context: ssl.SSLContext, on_socket: Callable):
        super().__init__(context=context)
        self._connection = _reporting(http.client.HTTPSConnection, on_socket)

    def https_open(self, req):
        return self.do_open(self._connection, req, context=self._context)


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
    if on_socket is None:
        handlers = [urllib.request.HTTPSHandler(context=ssl_context(config))]
    else:
        handlers = [_HTTPHandler(on_socket), _HTTPSHandler(ssl_context(config), on_socket)]
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
MAX_ATTEMPTS = 5             # tries per file without progress before the task fails
BACKOFF_SECONDS = (0.5, 1.0, 2.0, 4.0, 8.0)
UPDATE_INTERVAL = 0.5        # seconds between DownloadUpdated events of one task
DISK_MARGIN = 64 * 1024 * 1024  # free space kept beyond what a pull needs
FINISHED_KEPT = 100          # finished tasks still listed by GET /v1/models/pull


class DownloadFailed(Exception):
    """A file could not be downloaded; the message says why, for the task's error."""


class _Retry(Exception):
    """A transient failure: try the file again after a pause."""


class _Cancelled(Exception):
    pass


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
    socket: object = field(default=None, repr=False)  # the open connection's, to abort

    def connected(self, sock) -> None:
        """Note the download's socket; shut it at once if a cancel came first."""
        self.socket = sock
        if self.cancelled.is_set():
            _abort(sock)

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


class Downloads:
    """Owns the download tasks and their threads."""

    def __init__(self, config: Callable[[], Mapping], events: EventBus):
        self._config = config  # called per request, so Config changes apply at once
        self._events = events
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
        task.cancelled.set()
        _abort(task.socket)
        return task.to_dict()

    def close(self, timeout: float = 5.0) -> None:
        """Cancel every task and wait for the threads (the server is stopping)."""
        with self._lock:
            tasks, threads = list(self._tasks.values()), list(self._threads)
        for task in tasks:
            task.cancelled.set()
            _abort(task.socket)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _forget_finished(self) -> None:
        finished = [tid for tid, t in self._tasks.items() if not t.running]
        for tid in finished[:max(0, len(finished) - FINISHED_KEPT)]:
            del self._tasks[tid]

    # --- the worker ----------------------------------------------------------

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
        with open(part, "ab+", buffering=0) as out:
            hasher = _Hasher(item)
            if os.fstat(out.fileno()).st_size > item.size:
                out.truncate(0)  # the hub now lists a smaller file: start over
            hasher.catch_up(out, task.cancelled)
            item.downloaded = out.tell()
            attempts = 0
            while item.downloaded < item.size or item.size == 0:
                if task.cancelled.is_set():
                    raise _Cancelled()
                before = item.downloaded
                try:
                    self._transfer(task, item, out, hasher)
                    if item.size == 0:
                        break
                except _Retry as exc:
                    attempts = 0 if item.downloaded > before else attempts + 1
                    if attempts >= MAX_ATTEMPTS:
                        raise DownloadFailed(f"{item.id}: {exc} (gave up after "
                                             f"{MAX_ATTEMPTS} tries)") from None
                    delay = BACKOFF_SECONDS[min(attempts, len(BACKOFF_SECONDS) - 1)]
                    log.info("download %s: %s; retrying in %.1fs", task.id, exc, delay)
                    if task.cancelled.wait(delay):
                        raise _Cancelled() from None
            os.fsync(out.fileno())
            on_disk = os.fstat(out.fileno()).st_size
        if item.downloaded != item.size or on_disk != item.size:
            raise DownloadFailed(f"{item.id}: got {item.downloaded} bytes, expected "
                                 f"{item.size}")
        if not hasher.matches():
            part.unlink()
            item.downloaded = 0
            raise DownloadFailed(f"{item.id}: checksum mismatch (expected sha256 "
                                 f"{item.sha256 or item.git_oid}, got {hasher.hexdigest()}); "
                                 f"the damaged download was deleted, pull again")
        os.replace(part, item.local_path)
        fsync_dir(item.local_path.parent)

    def _transfer(self, task: Task, item: Item, out, hasher: "_Hasher") -> None:
        """One HTTP request, resuming at item.downloaded; raises _Retry on transient errors."""
        offset = item.downloaded
        os.ftruncate(out.fileno(), offset)  # whatever a failed write left past it goes
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        try:
            resp = open_url(self._config(), item.url, hub_url=task.hub_url,
                            headers=headers, timeout=30.0, on_socket=task.connected)
        except urllib.error.HTTPError as exc:
            if task.cancelled.is_set():
                raise _Cancelled() from None
            exc.close()
            if exc.code == 416 and offset:
                _restart(item, out, hasher)  # the part is not a prefix of this file
                raise _Retry("the server refused to resume; starting over") from None
            if exc.code >= 500 or exc.code == 429:
                raise _Retry(f"HTTP {exc.code} from {_origin(exc.url or item.url)}") from None
            if task.hub_url and exc.url and \
                    urlsplit(exc.url).netloc != urlsplit(task.hub_url).netloc:
                # The CDN refused its signed URL (it expired, say); the hub signs a new one.
                raise _Retry(f"HTTP {exc.code} from {_origin(exc.url)}") from None
            raise DownloadFailed(_http_failure(exc.code, item)) from None
        except (ProxyAuthFailed, CertificateFailed):
            raise
        except UpstreamError as exc:
            if task.cancelled.is_set():  # the cancel shut the socket before the headers
                raise _Cancelled() from None
            raise _Retry(str(exc)) from None
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
            task.socket = None
            resp.close()

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


def _content_range_starts_at(resp, offset: int) -> bool:
    value = resp.headers.get("Content-Range", "")
    try:
        return int(value.split()[1].split("-")[0]) == offset
    except (IndexError, ValueError):
        return False


def _abort(sock) -> None:
    """Unblock a thread waiting on `sock` by shutting it down."""
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


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
                have = max(have, path.stat().st_size)
            except FileNotFoundError:
                pass
        needed += max(0, item.size - have)
    where = items[0].local_path.parent
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if needed + DISK_MARGIN > free:
        raise InsufficientStorage(
            f"Not enough disk space for {what}: it needs {human_size(needed)} and "
            f"{where} has {human_size(free)} free")
