"""Test support: a Hugging Face-compatible model hub emulator.

Not a test module. Tests import it as ``from hubemu import HubEmulator`` (tests/ is on
sys.path under pytest)::

    with HubEmulator() as hub:
        hub.add_repo("org/model", {"model.yml": b"...", "model.gguf": Path(...)})
        ...  # point the client at hub.url

Two real HTTP/1.1 servers on 127.0.0.1, each on a port chosen by the OS:

* the *hub* (``hub.url``) answers the huggingface.co API (``/api/models/...``) and the
  ``/{repo}/resolve/{rev}/{path}`` file URLs;
* the *CDN* (``hub.cdn_url``) serves LFS blobs by sha256, the way huggingface.co
  redirects large files to cdn-lfs.hf.co with a signed URL.

Both support keep-alive, Range requests, optional TLS, a request log and fault switches
(dropped connections, corrupted bytes, slow bodies, error statuses); see HubEmulator.
Bodies are streamed in 64 KiB chunks, so a 1 GiB file given as a Path never sits in
memory.
"""

from __future__ import annotations

import hashlib
import json
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
from urllib.parse import parse_qs, quote, unquote, urlsplit

from loopback import DISCONNECTS, LoopbackHandler, LoopbackServer

__all__ = ["HubEmulator", "RequestRecord", "HubFile"]

CHUNK = 64 * 1024

# Files stored with Git LFS on the emulated hub (huggingface.co decides this per repo
# with .gitattributes; model weights are always LFS there).
LFS_SUFFIXES = (".gguf", ".onnx", ".bin", ".safetensors", ".data")
LFS_THRESHOLD = 10 * 1024

# Errors that mean "the client went away"; handled quietly.

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


def _iter_file(path: Path, start: int = 0, length: Optional[int] = None):
    with open(path, "rb") as f:
        f.seek(start)
        remaining = length
        while remaining is None or remaining > 0:
            chunk = f.read(CHUNK if remaining is None else min(CHUNK, remaining))
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
        try:
            if self.server.kind == "cdn":
                self._cdn()
            else:
                self._hub()
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
                    sent = os.sendfile(self.connection.fileno(), src.fileno(), pos, end - pos)
                    if not sent:
                        break
                    pos += sent
            return
        if isinstance(f.source, bytes):
            view = memoryview(f.source)
            chunks = (view[pos:pos + CHUNK] for pos in range(start, start + limit, CHUNK))
        else:
            chunks = _iter_file(f.source, start, limit)
        pos = start
        for i, chunk in enumerate(chunks):
            if i and delay:
                time.sleep(delay)
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
        """Gated-repo check; answers 401/403 itself and returns False on failure."""
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

    def _hub(self):
        segs = self.segments
        if len(segs) >= 3 and segs[:2] == ["api", "models"]:
            self._api(segs)
            return
        if "resolve" in segs[1:3]:
            self._resolve(segs)
            return
        self._error(404, "Not Found")

    def _api(self, segs):
        repo, n = self._find_repo(segs, 2)
        if repo is None:
            self._error(404, "Repository not found", "RepoNotFound")
            return
        if not self._authorized(repo):
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
        self._json(200, dir_entries + entries)

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
            self._error(404, "Repository not found", "RepoNotFound")
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
    * ``delay_per_chunk`` (seconds): sleep between 64 KiB body chunks.
    * ``fail_status`` (list of ints): each file request (hub resolve GET/HEAD, or CDN
      GET/HEAD) pops the first status and is answered with it and a JSON error.
    * ``redirect_to_cdn`` (bool, default True): False serves LFS files from the hub.

    ``requests`` is the log of RequestRecord, in arrival order, for both servers.
    """

    def __init__(self, ssl_context: Optional[ssl.SSLContext] = None):
        self._lock = threading.Lock()
        self._repos: Dict[str, _Repo] = {}
        self._blobs: Dict[str, HubFile] = {}  # sha256 -> file, for the CDN
        self.requests: List[RequestRecord] = []
        self.redirect_to_cdn = True
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
        With `gated_token`, every API and file request for the repo needs
        ``Authorization: Bearer <gated_token>`` (401 without it, 403 with another).
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
        with self._lock:
            self.drop_after: Optional[int] = None
            self.drop_once = True
            self.corrupt = False
            self.delay_per_chunk = 0.0
            self.fail_status: List[int] = []

    def clear_requests(self):
        with self._lock:
            self.requests.clear()

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
