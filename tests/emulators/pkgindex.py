"""Test support: a Python package index emulator (PEP 503 / PEP 691 "simple" API).

Not a test module. Tests import it as ``from emulators.pkgindex import PackageIndex``
(tests/ is on sys.path under pytest)::

    with PackageIndex(dist_dir) as index:
        ...  # pip install --index-url index.url ..., or any simple-API client

It serves the distribution files found in a directory (scanned on every listing, so
files added while it runs show up), on 127.0.0.1 with a port chosen by the OS:

* ``GET /simple/`` lists projects; ``GET /simple/<project>/`` lists a project's files.
  Both answer PEP 503 HTML, or PEP 691 JSON (api-version 1.1, PEP 700's ``versions``,
  ``size`` and ``upload-time``, the file's mtime) when the Accept header prefers
  ``application/vnd.pypi.simple.v1+json``.
  A project URL that is not normalized (``/simple/Foo_Bar/`` or without the slash)
  answers 301 to the normalized one, as PyPI does.
* ``GET``/``HEAD /files/<filename>`` downloads a file, with ``Range: bytes=...``
  (206 + Content-Range, or 416 past the end).

Project and version come from the file names (``{name}-{ver}(-{build})?-{py}-{abi}-
{plat}.whl`` and ``{name}-{ver}.tar.gz``); Requires-Python from a wheel's METADATA.
Other files in the directory are ignored. Fault switches and the request log are
attributes of PackageIndex. Bodies stream in 64 KiB chunks, so large files never sit in
memory, and every connection has its own daemon thread.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
import socket
import threading
import time
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from email.parser import HeaderParser
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Set
from urllib.parse import quote, unquote, urlsplit

from emulators.loopback import DISCONNECTS, LoopbackHandler, LoopbackServer

__all__ = ["PackageIndex", "Distribution", "Request", "normalize", "JSON_TYPE", "CHUNK"]

CHUNK = 64 * 1024

JSON_TYPE = "application/vnd.pypi.simple.v1+json"
HTML_TYPE = "text/html; charset=utf-8"
API_VERSION = "1.1"

# Media types that ask for each format; "*/*" counts for HTML only, so a client that
# names neither JSON type explicitly gets HTML, as PEP 691 suggests for old clients.
_JSON_RANGES = {JSON_TYPE, "application/vnd.pypi.simple.latest+json"}
_HTML_RANGES = {"application/vnd.pypi.simple.v1+html",
                "application/vnd.pypi.simple.latest+html", "text/html", "text/*", "*/*"}

_WHEEL_RE = re.compile(r"(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl")
_SDIST_RE = re.compile(r"(?P<name>.+)-(?P<version>[^-]+)\.tar\.gz")

# Errors that mean "the client went away"; handled quietly.


def normalize(name: str) -> str:
    """The PEP 503 normalized form of a project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


class Request(NamedTuple):
    """One request as the index saw it (``index.requests``)."""

    method: str
    path: str               # with query string, as sent
    headers: Dict[str, str]  # lower-cased names


@dataclass(frozen=True)
class Distribution:
    """A file the index serves, with what it advertises about it."""

    filename: str
    path: Path
    project: str            # normalized
    version: str
    size: int
    sha256: str
    requires_python: Optional[str]
    upload_time: str = ""    # the file's mtime, as PEP 700's upload-time gives it


# (sha256, Requires-Python) of files, keyed by (path, size, mtime), so each file is read
# once per process however often it is listed.
_scan_cache: Dict[tuple, tuple] = {}
_scan_lock = threading.Lock()


def _iter_file(path: Path, start: int, length: int):
    with open(path, "rb") as f:
        f.seek(start)
        while length > 0:
            chunk = f.read(min(CHUNK, length))
            if not chunk:
                return
            length -= len(chunk)
            yield chunk


def _wheel_requires_python(path: Path) -> Optional[str]:
    """Requires-Python from a wheel's .dist-info/METADATA; None if absent or unreadable."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist()
                     if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if not names:
                return None
            text = zf.read(names[0]).decode("utf-8", "replace")
    except (zipfile.BadZipFile, OSError):
        return None
    return HeaderParser().parsestr(text, headersonly=True).get("Requires-Python")


def _distribution(path: Path) -> Optional[Distribution]:
    """The Distribution for a file in the served directory; None if not a dist file."""
    name = path.name
    match = _WHEEL_RE.fullmatch(name) or _SDIST_RE.fullmatch(name)
    if match is None or not path.is_file():
        return None
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    with _scan_lock:
        cached = _scan_cache.get(key)
    if cached is None:
        digest = hashlib.sha256()
        for chunk in _iter_file(path, 0, st.st_size):
            digest.update(chunk)
        requires = _wheel_requires_python(path) if name.endswith(".whl") else None
        cached = (digest.hexdigest(), requires)
        with _scan_lock:
            _scan_cache[key] = cached
    uploaded = datetime.fromtimestamp(st.st_mtime, timezone.utc)
    return Distribution(name, path, normalize(match["name"]), match["version"],
                        st.st_size, *cached, uploaded.strftime("%Y-%m-%dT%H:%M:%S.%fZ"))


def _version_key(version: str):
    # Natural order ("1.10" after "1.9"); re.split with a group alternates text and
    # digits, so the lists always compare str with str and int with int.
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", version))]


def _wants_json(accept: Optional[str]) -> bool:
    """Whether an Accept header prefers PEP 691 JSON over HTML (ties go to JSON)."""
    best = {"json": 0.0, "html": 0.0}
    for item in (accept or "").split(","):
        media, *params = [p.strip() for p in item.split(";")]
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        media = media.lower()
        kind = "json" if media in _JSON_RANGES else "html" if media in _HTML_RANGES else None
        if kind:
            best[kind] = max(best[kind], q)
    return best["json"] > 0 and best["json"] >= best["html"]


def _parse_range(value: Optional[str], size: int):
    """(start, end) inclusive for a single byte range; None to serve the whole file;
    "unsatisfiable" for a 416. Malformed or multi-range headers are ignored, as RFC 9110
    allows."""
    m = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", value or "")
    if not m or not (m[1] or m[2]):
        return None
    if not m[1]:  # suffix range: the last N bytes
        n = int(m[2])
        return "unsatisfiable" if n == 0 or size == 0 else (max(0, size - n), size - 1)
    start = int(m[1])
    end = int(m[2]) if m[2] else size - 1
    if m[2] and end < start:
        return None
    if start >= size:
        return "unsatisfiable"
    return start, min(end, size - 1)


class _HTTPError(Exception):
    """Raised by route handlers; _Handler._dispatch turns it into the response."""

    def __init__(self, status: int, message: str, location: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.location = location


class _Server(LoopbackServer):
    """The listening socket; each connection is served by a daemon thread."""

    def __init__(self, index: "PackageIndex"):
        self.index = index
        super().__init__(_Handler)


class _Handler(LoopbackHandler):
    server_version = "pkgindex/1.0"
    server: _Server

    # The routes: (path pattern, handler method name); the first full match wins.
    ROUTES = [
        (re.compile(r"/simple/"), "_project_list"),
        (re.compile(r"/simple/(?P<project>[^/]+)(?P<slash>/?)"), "_project_page"),
        (re.compile(r"/files/(?P<filename>[^/]+)"), "_file"),
    ]

    def do_GET(self):
        self._dispatch()

    do_HEAD = do_GET

    def _dispatch(self):
        index = self.server.index
        index._log(self)
        self.head = self.command == "HEAD"
        path = urlsplit(self.path).path
        try:
            status = index.fail_status.get(path)
            if status is not None:
                raise _HTTPError(status, f"pkgindex: injected HTTP {status}")
            for pattern, name in self.ROUTES:
                match = pattern.fullmatch(path)
                if match:
                    getattr(self, name)(**{k: unquote(v) for k, v in match.groupdict().items()})
                    return
            raise _HTTPError(404, "Not Found")
        except _HTTPError as err:
            self._send_error(err)
        except DISCONNECTS:
            raise
        except Exception as exc:  # an emulator bug: say so instead of hanging
            self.close_connection = True
            try:
                self._send_error(_HTTPError(500, f"pkgindex: {type(exc).__name__}: {exc}"))
            except DISCONNECTS:
                pass
            raise

    # -- responses --------------------------------------------------------------

    def _send_body(self, status: int, content_type: str, body: bytes, headers=()):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if not self.head:
            self.wfile.write(body)

    def _send_error(self, err: _HTTPError):
        headers = [("Location", err.location)] if err.location else []
        self._send_body(err.status, "text/plain; charset=utf-8", f"{err}\n".encode(), headers)

    def _send_listing(self, json_obj: dict, html_links: List[str], title: str):
        """The page as PEP 691 JSON or PEP 503 HTML, as the Accept header prefers."""
        vary = [("Vary", "Accept")]
        if not self.server.index.html_only and _wants_json(self.headers.get("Accept")):
            body = json.dumps({"meta": {"api-version": API_VERSION}, **json_obj}).encode()
            self._send_body(200, JSON_TYPE, body, vary)
            return
        page = (f'<!DOCTYPE html>\n<html>\n<head>\n'
                f'<meta name="pypi:repository-version" content="{API_VERSION}">\n'
                f"<title>{html.escape(title)}</title>\n</head>\n<body>\n"
                + "".join(f"{link}<br>\n" for link in html_links)
                + "</body>\n</html>\n")
        self._send_body(200, HTML_TYPE, page.encode(), vary)

    # -- routes -----------------------------------------------------------------

    def _project_list(self):
        projects = sorted({d.project for d in self.server.index.distributions()})
        self._send_listing(
            {"projects": [{"name": p} for p in projects]},
            [f'<a href="{quote(p)}/">{html.escape(p)}</a>' for p in projects],
            "Simple index")

    def _project_page(self, project: str, slash: str):
        if project != normalize(project) or not slash:
            raise _HTTPError(301, "Moved Permanently",
                             f"{self.server.index.url}{quote(normalize(project))}/")
        index = self.server.index
        dists = [d for d in index.distributions() if d.project == project]
        if not dists:
            raise _HTTPError(404, f"Project {project!r} not found")
        files, links = [], []
        for d in dists:
            sha256 = index.advertised_sha256(d)
            files.append({"filename": d.filename,
                          "url": f"{index.root_url}/files/{quote(d.filename)}",
                          "hashes": {"sha256": sha256},
                          "requires-python": d.requires_python,
                          "size": d.size,
                          "upload-time": d.upload_time})
            requires = ("" if d.requires_python is None else
                        f' data-requires-python="{html.escape(d.requires_python)}"')
            links.append(f'<a href="../../files/{quote(d.filename)}#sha256={sha256}"'
                         f"{requires}>{html.escape(d.filename)}</a>")
        versions = sorted({d.version for d in dists}, key=_version_key)
        self._send_listing({"name": project, "files": files, "versions": versions},
                           links, f"Links for {project}")

    def _file(self, filename: str):
        index = self.server.index
        dist = next((d for d in index.distributions() if d.filename == filename), None)
        if dist is None:
            raise _HTTPError(404, f"File {filename!r} not found")
        rng = _parse_range(self.headers.get("Range"), dist.size)
        if rng == "unsatisfiable":
            self._send_body(416, "text/plain; charset=utf-8",
                            b"Requested Range Not Satisfiable\n",
                            [("Content-Range", f"bytes */{dist.size}")])
            return
        start, end = rng or (0, dist.size - 1)
        length = end - start + 1
        self.send_response(206 if rng else 200)
        content_type = "application/zip" if filename.endswith(".whl") else "application/gzip"
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{end}/{dist.size}")
        self.end_headers()
        if self.head:
            return
        drop = index._take_drop(filename)
        for chunk in _iter_file(dist.path, start, length if drop is None else min(drop, length)):
            # Read on every chunk, so a test can change the throttle mid-download.
            if index.throttle:
                time.sleep(index.throttle)
            self.wfile.write(chunk)
        if drop is not None and drop < length:
            # FIN without the promised bytes: the client reads `drop` bytes, then EOF.
            self.close_connection = True
            self.wfile.flush()
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class PackageIndex:
    """A PEP 503/691 simple index serving the distribution files in `files_dir`.

    Fault switches (plain attributes, settable while it runs):

    * ``wrong_sha256`` (set of filenames): listings advertise a wrong sha256 for these
      (the bytes served stay right).
    * ``throttle`` (seconds): sleep before each 64 KiB chunk of a file body.
    * ``drop_after`` (int or None): a file body stops after that many bytes and the
      connection closes; once per file, later downloads of it complete. Assigning the
      switch again re-arms it for every file.
    * ``fail_status`` (dict path -> status): requests for that URL path (no query)
      are answered with the status until the entry is removed.
    * ``html_only`` (bool): always answer HTML, ignoring a JSON Accept header.

    ``requests`` logs every Request(method, path, headers), in arrival order.
    """

    def __init__(self, files_dir: Path):
        self.files_dir = Path(files_dir)
        self.wrong_sha256: Set[str] = set()
        self.throttle = 0.0
        self.fail_status: Dict[str, int] = {}
        self.html_only = False
        self.requests: List[Request] = []
        self._lock = threading.Lock()  # guards requests and _dropped
        self._dropped: Set[str] = set()  # files already cut short under this drop_after
        self._drop_after: Optional[int] = None
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> "PackageIndex":
        """Bind 127.0.0.1 on a free port and serve in a background thread."""
        if self._server is not None:
            raise RuntimeError("PackageIndex already started")
        self._server = _Server(self)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05},
                                        name="pkgindex", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and cut open connections. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        server.close_connections()
        self._thread.join(timeout=5)

    def __enter__(self) -> "PackageIndex":
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def port(self) -> int:
        """The port the index listens on (once started)."""
        if self._server is None:
            raise RuntimeError("PackageIndex not started")
        return self._server.server_port

    @property
    def root_url(self) -> str:
        """The server's base URL, without a trailing slash."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The index URL to give clients (pip's --index-url); ends in /simple/."""
        return f"{self.root_url}/simple/"

    # -- content ----------------------------------------------------------------

    def distributions(self) -> List[Distribution]:
        """The files served now, sorted by file name."""
        paths = sorted(self.files_dir.iterdir()) if self.files_dir.is_dir() else []
        return [d for d in map(_distribution, paths) if d is not None]

    def advertised_sha256(self, dist: Distribution) -> str:
        """The sha256 the listings give for a file: wrong if it is in wrong_sha256."""
        if dist.filename in self.wrong_sha256:
            return hashlib.sha256(b"pkgindex-wrong:" + dist.sha256.encode()).hexdigest()
        return dist.sha256

    # -- faults and log ---------------------------------------------------------

    @property
    def drop_after(self) -> Optional[int]:
        """Bytes of a file body after which the connection closes (once per file)."""
        return self._drop_after

    @drop_after.setter
    def drop_after(self, value: Optional[int]) -> None:
        with self._lock:
            self._drop_after = value
            self._dropped.clear()

    def _take_drop(self, filename: str) -> Optional[int]:
        with self._lock:
            if self._drop_after is None or filename in self._dropped:
                return None
            self._dropped.add(filename)
            return self._drop_after

    def _log(self, handler: BaseHTTPRequestHandler) -> None:
        record = Request(handler.command, handler.path,
                         {k.lower(): v for k, v in handler.headers.items()})
        with self._lock:
            self.requests.append(record)
