"""Test support: a Hugging Face-compatible model hub emulator.

Not a test module. Tests import it as ``from emulators.hubemu import HubEmulator``
(tests/ is on sys.path under pytest)::

    with HubEmulator() as hub:
        hub.add_repo("org/model", {"model.yml": b"...", "model.gguf": Path(...)})
        ...  # point the client at hub.url

Two real HTTP/1.1 servers on 127.0.0.1, each on a port chosen by the OS:

* the *hub* (``hub.url``) answers the huggingface.co API (``/api/models/...``) and the
  ``/{repo}/resolve/{rev}/{path}`` file URLs;
* the *CDN* (``hub.cdn_url``) serves LFS blobs by sha256, the way huggingface.co
  redirects large files to cdn-lfs.hf.co with a signed URL.

Both support keep-alive, Range requests, optional TLS, a request log and fault switches
(dropped connections, corrupted bytes, slow bodies, error statuses, 429 rate limits, a
per-connection bandwidth cap); see HubEmulator. Bodies are streamed in 64 KiB chunks, so
a 1 GiB file given as a Path never sits in memory.

Where huggingface.co behaves in a way a client must cope with, the emulator does too:

* tree listings (``/api/models/{repo}/tree/{rev}``) come in pages of at most
  ``hub.tree_page_size`` entries (1000, as on huggingface.co); a page with more to come
  has a ``Link: <...&cursor=...>; rel="next"`` header;
* a gated repo's API answers (info, tree, refs) need no token, only its files do:
  ``resolve`` answers 401 without a token and 403 with a wrong one
  (``X-Error-Code: GatedRepo``);
* an unknown repo is a 401 ``RepoNotFound`` (``hub.missing_repo_status``), not a 404, so
  that a private repo's existence is not revealed;
* ``hub.add_cortexso(name, variants, ...)`` publishes a built-in model with cortexso's
  layout: one branch per variant, and a ``main`` branch with README.md, metadata.yml
  (``default:`` names the default variant), a template model.yml and a copy of every
  variant's weights as ``<name>-<branch>.gguf``, so pulling all of main would download
  every quantization.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import os
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Union
from urllib.parse import parse_qs, parse_qsl, quote, unquote, urlencode, urlsplit

from emulators.loopback import DISCONNECTS, LoopbackHandler, LoopbackServer

__all__ = ["HubEmulator", "RequestRecord", "HubFile"]

CHUNK = 64 * 1024
# With a bandwidth cap, sendfile goes out in slices of at most this size, with sleeps
# between them; small enough to pace smoothly, big enough to cost little CPU.
PACED_SLICE = 256 * 1024

# Files stored with Git LFS on the emulated hub (huggingface.co decides this per repo
# with .gitattributes; model weights are always LFS there).
LFS_SUFFIXES = (".gguf", ".onnx", ".bin", ".safetensors", ".data")
LFS_THRESHOLD = 10 * 1024

_FileSource = Union[bytes, bytearray, str, os.PathLike]

# sha256 of on-disk files, keyed by (path, size, mtime), so that a 1 GiB bench file
# is hashed once per process even when many emulators serve it.
_digest_cache: Dict[tuple, tuple] = {}
_digest_lock = threading.Lock()


@dataclass
class RequestRecord:
    """One request as a server saw it (``hub.requests``)."""

    server: str            # "hub" or "cdn"
    method: str
    path: str              # path with query string, as sent
    headers: Dict[str, str]  # lower-cased header names
    range: Optional[str]   # the Range header, or None
    status: Optional[int] = None  # filled in once the response status is sent


@dataclass
class HubFile:
    """A file of one branch, with the identifiers huggingface.co reports for it."""

    path: str
    source: Union[bytes, Path]
    size: int
    sha256: str            # of the content; the LFS oid
    git_oid: str           # git blob sha1: of the content, or of the LFS pointer
    lfs: bool
    pointer_size: int = 0  # size of the LFS pointer file

    def lfs_info(self) -> dict:
        """The "lfs" object of this file's tree entry."""
        return {"oid": self.sha256, "size": self.size, "pointerSize": self.pointer_size}


@dataclass
class _Branch:
    name: str
    sha: str
    files: Dict[str, HubFile]


@dataclass
class _Repo:
    repo_id: str
    default_branch: str
    gated_token: Optional[str]
    branches: Dict[str, _Branch] = field(default_factory=dict)
    object_id: str = ""

    def branch(self, rev: str) -> Optional[_Branch]:
        """A branch by name or by its commit sha (clients resolve by commit too)."""
        if rev in self.branches:
            return self.branches[rev]
        for branch in self.branches.values():
            if rev == branch.sha:
                return branch
        return None


def _git_blob_oid(size: int, chunks) -> str:
    """The git object id of a blob: sha1 over "blob <size>\\0" + content."""
    h = hashlib.sha1(b"blob %d\0" % size)
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def _iter_file(path: Path, start: int = 0, length: Optional[int] = None,
               chunk_size: int = CHUNK):
    with open(path, "rb") as f:
        f.seek(start)
        remaining = length
        while remaining is None or remaining > 0:
            chunk = f.read(chunk_size if remaining is None else min(chunk_size, remaining))
            if not chunk:
                return
            if remaining is not None:
                remaining -= len(chunk)
            yield chunk


def _is_lfs(path: str, size: int) -> bool:
    return path.lower().endswith(LFS_SUFFIXES) or size > LFS_THRESHOLD


def _make_file(path: str, source: _FileSource) -> HubFile:
    if isinstance(source, str):
        source = source.encode()
    if isinstance(source, (bytes, bytearray)):
        source = bytes(source)
        size = len(source)
        sha256 = hashlib.sha256(source).hexdigest()
        content_oid = _git_blob_oid(size, [source])
    else:
        source = Path(source)
        st = source.stat()
        key = (str(source.resolve()), st.st_size, st.st_mtime_ns)
        with _digest_lock:
            cached = _digest_cache.get(key)
        if cached is None:
            h256 = hashlib.sha256()
            h1 = hashlib.sha1(b"blob %d\0" % st.st_size)
            for chunk in _iter_file(source):
                h256.update(chunk)
                h1.update(chunk)
            cached = (h256.hexdigest(), h1.hexdigest())
            with _digest_lock:
                _digest_cache[key] = cached
        size = st.st_size
        sha256, content_oid = cached
    if not _is_lfs(path, size):
        return HubFile(path, source, size, sha256, content_oid, lfs=False)
    # In git an LFS file is a small pointer file; the tree's "oid" is the pointer blob's
    # id and "lfs.pointerSize" its length (134 bytes for a 9-digit size).
    pointer = ("version https://git-lfs.github.com/spec/v1\n"
               f"oid sha256:{sha256}\nsize {size}\n").encode()
    return HubFile(path, source, size, sha256, _git_blob_oid(len(pointer), [pointer]),
                   lfs=True, pointer_size=len(pointer))


def _parse_range(value: Optional[str], size: int):
    """(start, end) inclusive for a single byte range; None to serve the whole file;
    "unsatisfiable" for a 416.  Malformed or multi-range headers are ignored, as
    RFC 9110 allows."""
    if not value:
        return None
    m = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", value)
    if not m or (not m.group(1) and not m.group(2)):
        return None
    first, last = m.group(1), m.group(2)
    if not first:  # suffix range: the last N bytes
        n = int(last)
        if n == 0 or size == 0:
            return "unsatisfiable"
        return max(0, size - n), size - 1
    start = int(first)
    end = int(last) if last else size - 1
    if last and end < start:
        return None
    if start >= size:
        return "unsatisfiable"
    return start, min(end, size - 1)


class _Pacer:
    """Holds one response body to at most `rate` bytes per second.

    Before a slice goes out it waits until the body's bytes so far, that slice
    included, fit the rate since the body started; so the last byte leaves no sooner
    than size / rate after the first, as from a capped CDN edge."""

    def __init__(self, rate: Optional[float]):
        self.rate = rate
        self.start = time.monotonic()
        self.sent = 0

    def slice_size(self, largest: int) -> int:
        """How much to send at once: `largest`, or ~100 ms of bytes when that is less."""
        if not self.rate:
            return largest
        return max(1024, min(largest, int(self.rate / 10)))

    def wait(self, n: int) -> None:
        """Sleep until `n` more bytes may go out."""
        if not self.rate:
            return
        self.sent += n
        delay = self.start + self.sent / self.rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def refund(self, n: int) -> None:
        """Take back `n` bytes that wait() allowed for but that did not go out."""
        self.sent -= n


def _encode_cursor(path: str) -> str:
    # Opaque to clients, like huggingface.co's (base64 of the last path listed).
    return base64.urlsafe_b64encode(json.dumps({"file_name": path}).encode()).decode()


def _decode_cursor(cursor: str) -> Optional[str]:
    try:
        path = json.loads(base64.urlsafe_b64decode(cursor.encode()))["file_name"]
    except (ValueError, KeyError, TypeError, binascii.Error):
        return None
    return path if isinstance(path, str) else None


class _Server(LoopbackServer):
    """One listening socket; connections are served by daemon threads."""

    def __init__(self, hub: "HubEmulator", kind: str, ssl_context: Optional[ssl.SSLContext]):
        self.hub = hub
        self.kind = kind
        super().__init__(_Handler, ssl_context)


class _Handler(LoopbackHandler):
    server_version = "hubemu/1.0"
    server: _Server

    def send_response(self, code, message=None):
        if getattr(self, "_record", None) is not None and self._record.status is None:
            self._record.status = code
        super().send_response(code, message)

    # -- dispatch ---------------------------------------------------------------

    def do_GET(self):
        self._dispatch()

    def do_HEAD(self):
        self._dispatch()

    def _not_allowed(self):
        self._record = self.server.hub._log(self.server.kind, self)
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self._json(405, {"error": "Method not allowed"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

    def _dispatch(self):
        hub = self.server.hub
        self._record = hub._log(self.server.kind, self)
        self.head = self.command == "HEAD"
        split = urlsplit(self.path)
        self.query = parse_qs(split.query)
        # Split before unquoting so an encoded "/" (revision "refs%2Fpr%2F1") stays in
        # its segment, as huggingface_hub quotes revisions with safe="".
        self.segments = [unquote(s) for s in split.path.split("/")[1:]]
        self.raw_path, self.raw_query = split.path, split.query
        try:
            kind = self._kind()
            if kind and self._take_rate_limit(kind):
                return
            if kind == "cdn":
                self._cdn()
            elif kind == "api":
                self._api(self.segments)
            elif kind == "resolve":
                self._resolve(self.segments)
            else:
                self._error(404, "Not Found")
        except DISCONNECTS:
            raise
        except Exception as exc:  # a bug in the emulator: say so instead of hanging
            self.close_connection = True
            try:
                self._json(500, {"error": f"hubemu: {type(exc).__name__}: {exc}"})
            except DISCONNECTS:
                pass
            raise

    # -- responses --------------------------------------------------------------

    def _json(self, status: int, obj, headers: Optional[Mapping[str, str]] = None):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if not self.head:
            self.wfile.write(body)

    def _error(self, status: int, message: str, code: Optional[str] = None):
        # huggingface_hub's hf_raise_for_status keys off X-Error-Code
        # (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo).
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._json(status, {"error": message}, headers)

    def _kind(self) -> Optional[str]:
        """"api", "resolve" or "cdn": which kind of request this is (None: neither)."""
        if self.server.kind == "cdn":
            return "cdn"
        segs = self.segments
        if len(segs) >= 3 and segs[:2] == ["api", "models"]:
            return "api"
        if "resolve" in segs[1:3]:
            return "resolve"
        return None

    def _take_rate_limit(self, kind: str) -> bool:
        """Answer 429 with Retry-After when a rate limit is queued for this kind."""
        seconds = self.server.hub._take_rate_limit(kind)
        if seconds is None:
            return False
        # huggingface.co sends no X-Error-Code with a 429, only the message.
        message = ("hubemu: rate limit reached; you have exceeded the request quota. "
                   "Retry later.")
        self._json(429, {"error": message}, {"X-Error-Message": message,
                                             "Retry-After": str(math.ceil(seconds))})
        return True

    def _take_fail_status(self) -> bool:
        status = self.server.hub._take_fail_status()
        if status is None:
            return False
        self._error(status, f"hubemu: injected HTTP {status}")
        return True

    def _send_file(self, f: HubFile, headers: Mapping[str, str]):
        """The file's bytes, honouring Range, with the fault switches applied."""
        hub = self.server.hub
        rng = _parse_range(self.headers.get("Range"), f.size)
        if rng == "unsatisfiable":
            body = b"Requested Range Not Satisfiable"
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{f.size}")
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not self.head:
                self.wfile.write(body)
            return
        start, end = rng if rng else (0, f.size - 1)
        length = end - start + 1 if f.size else 0
        self.send_response(206 if rng else 200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{end}/{f.size}")
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self.head:
            return
        hub._body_started()
        try:
            self._send_body(f, start, length)
        finally:
            hub._body_ended()

    def _send_body(self, f: HubFile, start: int, length: int):
        """`length` bytes of `f` from `start`, paced and with the faults applied."""
        hub = self.server.hub
        pacer = _Pacer(hub.max_bytes_per_second)
        drop = hub._take_drop()
        limit = length if drop is None else min(drop, length)
        flip = start + length // 2 if (hub.corrupt and length) else None
        delay = hub.delay_per_chunk
        if drop is None and flip is None and not delay and not isinstance(f.source, bytes) \
                and not isinstance(self.connection, ssl.SSLSocket):
            # No fault to inject: serve like a real CDN, with sendfile (no copies in Python)
            self.wfile.flush()
            with open(f.source, "rb") as src:
                pos, end = start, start + limit
                while pos < end:
                    # Uncapped, one sendfile call takes it all; capped, it goes in
                    # slices with sleeps between them.
                    count = end - pos
                    if pacer.rate:
                        count = pacer.slice_size(min(PACED_SLICE, count))
                    pacer.wait(count)
                    sent = os.sendfile(self.connection.fileno(), src.fileno(), pos, count)
                    if not sent:
                        break
                    pos += sent
                    pacer.refund(count - sent)  # a short write: the next slice has it
            return
        chunk_size = pacer.slice_size(CHUNK)
        if isinstance(f.source, bytes):
            view = memoryview(f.source)
            chunks = (view[pos:pos + chunk_size]
                      for pos in range(start, start + limit, chunk_size))
        else:
            chunks = _iter_file(f.source, start, limit, chunk_size)
        pos = start
        for i, chunk in enumerate(chunks):
            if i and delay:
                time.sleep(delay)
            pacer.wait(len(chunk))
            if flip is not None and pos <= flip < pos + len(chunk):
                chunk = bytearray(chunk)
                chunk[flip - pos] ^= 0xFF
            self.wfile.write(chunk)
            pos += len(chunk)
        if drop is not None:
            # Cut the connection mid-body: FIN without the promised bytes, so the client
            # reads exactly `drop` bytes and then EOF (an incomplete read).
            self.close_connection = True
            self.wfile.flush()
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- CDN --------------------------------------------------------------------

    def _cdn(self):
        # /repos/<xx>/<yy>/<sha256>?Expires=...&Signature=...: content-addressed blobs,
        # no authentication (the signed URL is the credential), like cdn-lfs.hf.co.
        segs = self.segments
        if self._take_fail_status():
            return
        blob = None
        if len(segs) == 4 and segs[0] == "repos":
            blob = self.server.hub._blobs.get(segs[3])
        if blob is None:
            self._error(404, "Not Found")
            return
        self._send_file(blob, {"ETag": f'"{blob.sha256}"'})

    # -- hub --------------------------------------------------------------------

    def _find_repo(self, segs, offset: int):
        """(repo, number of segments of its id); repo ids are "org/name" or "name"."""
        repos = self.server.hub._repos
        if len(segs) >= offset + 2 and "/".join(segs[offset:offset + 2]) in repos:
            return repos["/".join(segs[offset:offset + 2])], 2
        if len(segs) >= offset + 1 and segs[offset] in repos:
            return repos[segs[offset]], 1
        return None, 0

    def _authorized(self, repo: _Repo) -> bool:
        """Gated-repo check for a file; answers 401/403 itself and returns False on failure."""
        if repo.gated_token is None:
            return True
        auth = self.headers.get("Authorization")
        if not auth:
            self._error(401, f"Access to model {repo.repo_id} is restricted. You must have "
                        "access to it and be authenticated to access it. Please log in.",
                        "GatedRepo")
            return False
        if auth != f"Bearer {repo.gated_token}":
            self._error(403, f"Access to model {repo.repo_id} is restricted and you are not "
                        "in the authorized list. Visit https://huggingface.co/"
                        f"{repo.repo_id} to ask for access.", "GatedRepo")
            return False
        return True

    def _repo_not_found(self):
        # huggingface.co answers 401 for a repo that does not exist, the same as for a
        # private one without the token, so that private repos' names do not leak.
        self._error(self.server.hub.missing_repo_status, "Repository not found",
                    "RepoNotFound")

    def _api(self, segs):
        # A gated repo's API answers need no token (huggingface.co lists its files to
        # anyone); only its files do, in _resolve.
        repo, n = self._find_repo(segs, 2)
        if repo is None:
            self._repo_not_found()
            return
        rest = segs[2 + n:]
        if not rest:
            self._model_info(repo, repo.default_branch)
        elif rest[0] == "revision" and len(rest) == 2:
            self._model_info(repo, rest[1])
        elif rest[0] == "tree" and len(rest) >= 2:
            self._tree(repo, rest[1], "/".join(p for p in rest[2:] if p))
        elif rest == ["refs"]:
            self._refs(repo)
        else:
            self._error(404, "Not Found")

    def _branch_or_404(self, repo: _Repo, rev: str) -> Optional[_Branch]:
        branch = repo.branch(rev)
        if branch is None:
            self._error(404, "Revision not found", "RevisionNotFound")
        return branch

    def _model_info(self, repo: _Repo, rev: str):
        branch = self._branch_or_404(repo, rev)
        if branch is None:
            return
        blobs = self.query.get("blobs", [""])[0].lower() in ("1", "true")
        siblings = []
        for f in sorted(branch.files.values(), key=lambda f: f.path):
            sib = {"rfilename": f.path}
            if blobs:  # ?blobs=true adds sizes and LFS info, as on huggingface.co
                sib.update(size=f.size, blobId=f.git_oid)
                if f.lfs:
                    sib["lfs"] = {"sha256": f.sha256, "size": f.size,
                                  "pointerSize": f.pointer_size}
            siblings.append(sib)
        org = repo.repo_id.split("/")[0] if "/" in repo.repo_id else None
        info = {
            "_id": repo.object_id,
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": org,
            "sha": branch.sha,
            "lastModified": "2024-01-01T00:00:00.000Z",
            "createdAt": "2024-01-01T00:00:00.000Z",
            "private": False,
            "gated": "manual" if repo.gated_token else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
        }
        self._json(200, info)

    def _tree(self, repo: _Repo, rev: str, folder: str):
        branch = self._branch_or_404(repo, rev)
        if branch is None:
            return
        recursive = self.query.get("recursive", [""])[0].lower() in ("1", "true")
        prefix = folder + "/" if folder else ""
        entries, dirs = [], set()
        for f in sorted(branch.files.values(), key=lambda f: f.path):
            if not f.path.startswith(prefix):
                continue
            parts = f.path[len(prefix):].split("/")
            # directory entries for the folders between `folder` and the file
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                dirs.add(prefix + "/".join(parts[:depth]))
            if len(parts) > 1 and not recursive:
                continue
            entry = {"type": "file", "oid": f.git_oid, "size": f.size, "path": f.path}
            if f.lfs:
                entry["lfs"] = f.lfs_info()
            entries.append(entry)
        if folder and not entries and not dirs:
            self._error(404, "Entry not found", "EntryNotFound")
            return
        dir_entries = [{"type": "directory",
                        "oid": hashlib.sha1(f"{branch.sha}:{d}".encode()).hexdigest(),
                        "size": 0, "path": d} for d in sorted(dirs)]
        self._tree_page(dir_entries + entries)

    def _tree_page(self, listing: List[dict]):
        """One page of a tree listing, from ?cursor= on, with a Link to the next page."""
        begin = 0
        if "cursor" in self.query:
            after = _decode_cursor(self.query["cursor"][0])
            paths = [e["path"] for e in listing]
            if after is None or after not in paths:
                self._error(400, "Invalid cursor")
                return
            begin = paths.index(after) + 1
        size = max(1, self.server.hub.tree_page_size)
        page = listing[begin:begin + size]
        headers = {}
        if begin + size < len(listing):
            # huggingface.co keeps the request's own query (recursive, expand, ...) and
            # adds the cursor; clients follow the Link as it is.
            query = [(k, v) for k, v in parse_qsl(self.raw_query, keep_blank_values=True)
                     if k != "cursor"]
            query.append(("cursor", _encode_cursor(page[-1]["path"])))
            link = f"{self.server.hub.url}{self.raw_path}?{urlencode(query)}"
            headers["Link"] = f'<{link}>; rel="next"'
        self._json(200, page, headers)

    def _refs(self, repo: _Repo):
        refs = {
            "branches": [{"name": b.name, "ref": "refs/heads/" + b.name,
                          "targetCommit": b.sha} for b in repo.branches.values()],
            "converts": [],
            "tags": [],
        }
        if self.query.get("include_prs"):
            refs["pullRequests"] = []
        self._json(200, refs)

    def _resolve(self, segs):
        # /{repo_id}/resolve/{revision}/{path}
        hub = self.server.hub
        if self._take_fail_status():
            return
        repo, n = self._find_repo(segs, 0)
        if repo is None or len(segs) < n + 3 or segs[n] != "resolve":
            self._repo_not_found()
            return
        if not self._authorized(repo):
            return
        branch = self._branch_or_404(repo, segs[n + 1])
        if branch is None:
            return
        f = branch.files.get("/".join(segs[n + 2:]))
        if f is None:
            self._error(404, "Entry not found", "EntryNotFound")
            return
        headers = {"X-Repo-Commit": branch.sha}
        if not f.lfs:
            headers["ETag"] = f'"{f.git_oid}"'
            self._send_file(f, headers)
            return
        # LFS file: huggingface.co answers 302 to a signed CDN URL and reports the real
        # file through X-Linked-Size / X-Linked-Etag (the ETag on the redirect itself
        # belongs to the pointer file).
        headers.update({"X-Linked-Size": str(f.size), "X-Linked-Etag": f'"{f.sha256}"'})
        if not hub.redirect_to_cdn:
            headers["ETag"] = f'"{f.sha256}"'
            self._send_file(f, headers)
            return
        location = (f"{hub.cdn_url}/repos/{f.sha256[:2]}/{f.sha256[2:4]}/{f.sha256}"
                    f"?response-content-disposition={quote('inline; filename=' + f.path.split('/')[-1])}"
                    f"&Expires={int(time.time()) + 3600}&Signature=hubemu&Key-Pair-Id=HUBEMU")
        body = b"Found. Redirecting to " + location.encode()
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("ETag", f'"{f.git_oid}"')
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not self.head:
            self.wfile.write(body)


class HubEmulator:
    """A Hugging Face hub plus its LFS CDN, on two local ports.

    Fault switches (plain attributes, settable at any time):

    * ``drop_after`` (int or None): a file body response (hub or CDN) sends that many
      body bytes and then closes the connection; with ``drop_once`` (default True) the
      switch resets to None after the first such response.
    * ``corrupt`` (bool): flip one byte (XOR 0xFF) in the middle of every served file
      body, i.e. at offset start + length // 2 of the bytes being sent; stays on until
      reset.
    * ``delay_per_chunk`` (seconds): sleep between body chunks (64 KiB, or less under
      a low ``max_bytes_per_second``).
    * ``fail_status`` (list of ints): each file request (hub resolve GET/HEAD, or CDN
      GET/HEAD) pops the first status and is answered with it and a JSON error.
    * ``rate_limit`` (list of seconds): each request of a kind in ``rate_limit_on``
      (a set of "api", "resolve", "cdn"; default all three) pops the first entry and is
      answered 429 with ``Retry-After: <seconds>`` (rounded up to an integer) and a JSON
      error without X-Error-Code, as huggingface.co sends it.
    * ``max_bytes_per_second`` (number or None): caps every file body (hub and CDN) at
      that rate on each connection, as a CDN edge does; N parallel connections get N
      times the rate. None (the default) is uncapped.

    Behaviour of the real hub, also plain attributes, not reset by reset_faults():

    * ``tree_page_size`` (default 1000, as huggingface.co): entries per tree page.
    * ``missing_repo_status`` (default 401, as huggingface.co): the status of
      RepoNotFound answers; set 404 for hubs that answer so.
    * ``redirect_to_cdn`` (bool, default True): False serves LFS files from the hub.

    ``requests`` is the log of RequestRecord, in arrival order, for both servers;
    ``max_concurrent_bodies`` is the most file bodies that were being sent at the same
    time since the last clear_requests().
    """

    def __init__(self, ssl_context: Optional[ssl.SSLContext] = None):
        self._lock = threading.Lock()  # guards requests, the body counts and the faults
        self._repos: Dict[str, _Repo] = {}
        self._blobs: Dict[str, HubFile] = {}  # sha256 -> file, for the CDN
        self.requests: List[RequestRecord] = []
        self._open_bodies = 0
        self.max_concurrent_bodies = 0
        self.redirect_to_cdn = True
        self.tree_page_size = 1000
        self.missing_repo_status = 401
        self.reset_faults()
        scheme = "https" if ssl_context is not None else "http"
        self._servers = []
        self._threads = []
        for kind in ("hub", "cdn"):
            server = _Server(self, kind, ssl_context)
            thread = threading.Thread(target=server.serve_forever,
                                      kwargs={"poll_interval": 0.05},
                                      name=f"hubemu-{kind}", daemon=True)
            thread.start()
            self._servers.append(server)
            self._threads.append(thread)
        self.port = self._servers[0].server_port
        self.cdn_port = self._servers[1].server_port
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.cdn_url = f"{scheme}://127.0.0.1:{self.cdn_port}"
        self._stopped = False

    # -- lifecycle --------------------------------------------------------------

    def __enter__(self) -> "HubEmulator":
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        """Stop both servers and cut any open connections. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        # shutdown() waits for a poll interval; stop both servers in parallel.
        stoppers = [threading.Thread(target=server.shutdown) for server in self._servers]
        for stopper in stoppers:
            stopper.start()
        for stopper in stoppers:
            stopper.join()
        for server in self._servers:
            server.server_close()
            server.close_connections()
        for thread in self._threads:
            thread.join(timeout=5)

    # -- content ----------------------------------------------------------------

    def add_repo(self, repo_id: str, files: Optional[Mapping[str, _FileSource]] = None, *,
                 branches: Optional[Mapping[str, Mapping[str, _FileSource]]] = None,
                 gated_token: Optional[str] = None, default_branch: str = "main") -> None:
        """Publish (or replace) a model repo.

        `files` are the default branch's files, path -> bytes (or str) or a Path (streamed
        from disk; hashed once).  `branches` maps further branch names to their files.
        With `gated_token` the repo is gated, as on huggingface.co: its API answers need
        no token, but its files (resolve) need ``Authorization: Bearer <gated_token>``
        (401 without it, 403 with another).
        """
        trees = {default_branch: dict(files or {})}
        for name, branch_files in (branches or {}).items():
            if name == default_branch and trees[default_branch]:
                raise ValueError(f"files for {default_branch!r} given twice")
            trees[name] = dict(branch_files)
        repo = _Repo(repo_id, default_branch, gated_token,
                     object_id=hashlib.sha1(repo_id.encode()).hexdigest()[:24])
        for name, tree in trees.items():
            hub_files = {p.strip("/"): _make_file(p.strip("/"), src) for p, src in tree.items()}
            # A made-up but deterministic commit id: same content, same sha.
            h = hashlib.sha1(f"{repo_id}\0{name}\0".encode())
            for p in sorted(hub_files):
                h.update(f"{p}\0{hub_files[p].git_oid}\0".encode())
            repo.branches[name] = _Branch(name, h.hexdigest(), hub_files)
        with self._lock:
            for branch in repo.branches.values():
                for f in branch.files.values():
                    if f.lfs:
                        self._blobs[f.sha256] = f
            self._repos[repo_id] = repo

    def add_cortexso(self, name: str, variants: Mapping[str, Mapping[str, _FileSource]], *,
                     default: Optional[str] = None, org: str = "cortexso",
                     author: str = "cortexso", source_model: Optional[str] = None,
                     metadata: bool = True, gated_token: Optional[str] = None) -> None:
        """Publish `org`/`name` laid out like a real cortexso built-in model repo.

        `variants` maps branch name -> that branch's files (e.g. model.gguf, model.yml,
        mmproj.gguf).  Each branch also gets copies of README.md and metadata.yml.
        ``main`` holds README.md, metadata.yml (``default: <default>``, left out when
        `default` is None; no file at all with ``metadata=False``), a template model.yml
        and every variant's model.gguf as ``<source_model or name>-<branch>.gguf``.
        """
        if "main" in variants:
            raise ValueError("a cortexso variant cannot be called 'main'")
        lines = ["version: 1", f"name: {name}"]
        if default is not None:
            lines.append(f"default: {default}")
        lines.append(f"author: {json.dumps(author)}")  # a JSON string is a YAML string
        shared = {"README.md": _cortexso_readme(org, name, list(variants), default)}
        if metadata:
            shared["metadata.yml"] = "\n".join(lines) + "\n"
        main = {**shared, "model.yml": _CORTEXSO_TEMPLATE.format(name=name)}
        stem = source_model or name
        branches = {}
        for branch, files in variants.items():
            if "model.gguf" in files:
                main[f"{stem}-{branch}.gguf"] = files["model.gguf"]
            branches[branch] = {**shared, **files}
        self.add_repo(f"{org}/{name}", main, branches=branches, gated_token=gated_token)

    def commit_sha(self, repo_id: str, branch: Optional[str] = None) -> str:
        """The commit sha reported for a branch (default: the repo's default branch)."""
        repo = self._repos[repo_id]
        return repo.branches[branch or repo.default_branch].sha

    def file(self, repo_id: str, path: str, branch: Optional[str] = None) -> HubFile:
        """The HubFile (size, sha256, git_oid, lfs) for a published file."""
        repo = self._repos[repo_id]
        return repo.branches[branch or repo.default_branch].files[path]

    # -- faults and log ---------------------------------------------------------

    def reset_faults(self):
        """Turn every fault switch off (see the class docstring)."""
        with self._lock:
            self.drop_after: Optional[int] = None
            self.drop_once = True
            self.corrupt = False
            self.delay_per_chunk = 0.0
            self.fail_status: List[int] = []
            self.rate_limit: List[float] = []
            self.rate_limit_on = {"api", "resolve", "cdn"}
            self.max_bytes_per_second: Optional[float] = None

    def clear_requests(self):
        """Empty the request log and restart the max_concurrent_bodies count."""
        with self._lock:
            self.requests.clear()
            self.max_concurrent_bodies = self._open_bodies

    def requests_to(self, server: str) -> List[RequestRecord]:
        """The logged requests that reached "hub" or "cdn"."""
        with self._lock:
            return [r for r in self.requests if r.server == server]

    def _log(self, server: str, handler: BaseHTTPRequestHandler) -> RequestRecord:
        record = RequestRecord(server, handler.command, handler.path,
                               {k.lower(): v for k, v in handler.headers.items()},
                               handler.headers.get("Range"))
        with self._lock:
            self.requests.append(record)
        return record

    def _take_drop(self) -> Optional[int]:
        with self._lock:
            drop = self.drop_after
            if drop is not None and self.drop_once:
                self.drop_after = None
            return drop

    def _take_fail_status(self) -> Optional[int]:
        with self._lock:
            if self.fail_status:
                return self.fail_status.pop(0)
            return None

    def _take_rate_limit(self, kind: str) -> Optional[float]:
        with self._lock:
            if self.rate_limit and kind in self.rate_limit_on:
                return self.rate_limit.pop(0)
            return None

    def _body_started(self):
        with self._lock:
            self._open_bodies += 1
            self.max_concurrent_bodies = max(self.max_concurrent_bodies, self._open_bodies)

    def _body_ended(self):
        with self._lock:
            self._open_bodies -= 1


# The template model.yml on a cortexso repo's main branch: the variants' own model.yml
# files are what a client reads; this one only names the fields, like the real one.
_CORTEXSO_TEMPLATE = """\
# BEGIN GENERAL GGUF METADATA
id: {name}
model: {name}
name: {name}
version: 1
files:
  - model.gguf
# END GENERAL GGUF METADATA

# BEGIN INFERENCE PARAMETERS
stop: []
stream: true
# END INFERENCE PARAMETERS

# BEGIN MODEL LOAD PARAMETERS
engine: llama-cpp
ctx_len: 4096
# END MODEL LOAD PARAMETERS
"""


def _cortexso_readme(org: str, name: str, branches: List[str], default: Optional[str]) -> str:
    rows = "".join(f"| {i} | [{b}](https://huggingface.co/{org}/{name}/tree/{b}) | "
                   f"`cortex run {name}:{b}` |\n" for i, b in enumerate(branches, 1))
    note = f"\nThe default variant is `{default}`.\n" if default else ""
    return (f"---\nlicense: other\npipeline_tag: text-generation\ntags:\n- cortex.cpp\n---\n\n"
            f"## Overview\n\n{name}, packaged for local use.\n\n## Variants\n\n"
            f"| No | Variant | Command |\n|----|---------|---------|\n{rows}{note}")
