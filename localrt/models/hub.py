"""The Hugging Face hub API, as much of it as pulling models needs.

  GET /api/models/{repo}/tree/{rev}       sizes, and lfs.oid, the sha256; paginated
                                          with Link: <...>; rel="next"
  GET /api/models/{repo}/refs             branches (the variants of built-ins)
  GET /{repo}/resolve/{rev}/{path}        the bytes (see localrt.downloads.tasks); small
                                          files (metadata.yml) are read here
Hub failures become localrt errors with their own status, never a 500. The hub's
X-Error-Code header says what a 401 or 403 means: RepoNotFound (huggingface.co answers
401 for a repository that does not exist, so as not to reveal private ones) is a 404
here, GatedRepo is a token problem. A 429 is waited out (Retry-After, capped) a few
times before it becomes an error.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import re
import threading
import urllib.error
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import quote, urljoin

from localrt.outbound import ProxyAuthFailed, open_url, retry_after_seconds
from localrt.errors import Forbidden, HTTPError, NotFound, UpstreamError

log = logging.getLogger(__name__)


class HubTokenRequired(Forbidden):
    code = "hub_token_required"


class HubTokenRejected(Forbidden):
    code = "hub_token_rejected"


class NotOnHub(NotFound):
    code = "model_not_found_on_hub"


class RevisionNotOnHub(NotOnHub):
    """The repository exists, the branch does not."""


class RateLimited(UpstreamError):
    code = "hub_rate_limited"


MAX_PAGES = 1000        # tree pages read for one listing (1000 entries each on huggingface.co)
RATE_LIMIT_TRIES = 5    # 429s waited out for one request before giving up
# A Link header's next page; no "<" inside the brackets, so a run of them cannot make it
# backtrack.
_NEXT = re.compile(r'<([^<>]*)>\s*;\s*rel="?next"?', re.IGNORECASE)


@dataclass(frozen=True)
class HubFile:
    """One file of a repo revision."""

    path: str
    size: int
    sha256: str | None  # None for small non-LFS files, which the hub gives no sha256 for
    git_oid: str | None = None  # the git blob sha1, the checksum of those small files


class Hub:
    """Calls one hub with the current Config (proxy, SSL flags, token)."""

    def __init__(self, url: str, config: Mapping, stopping: threading.Event | None = None):
        self.url = url.rstrip("/")
        self.config = config
        self._stopping = stopping or threading.Event()  # cuts a Retry-After wait short

    def files(self, repo: str, revision: str = "main") -> list[HubFile]:
        """Every file of `repo` at `revision`, with sizes and sha256 where the hub has them."""
        url = (f"{self.url}/api/models/{quote(repo)}/tree/{quote(revision, safe='')}"
               "?recursive=1")
        entries: list = []
        for _ in range(MAX_PAGES):
            page, url = self._page(url, repo, revision)
            if not isinstance(page, list):
                raise self._unreadable(repo)
            entries += page
            if url is None:
                break
        else:
            raise UpstreamError(f"The model hub {self.url} listed more than {MAX_PAGES} pages "
                                f"of files for {repo}")
        try:
            files = [HubFile(e["path"], e.get("size", 0), (e.get("lfs") or {}).get("oid"),
                             e.get("oid"))
                     for e in entries if e.get("type") == "file"]
            if not all(isinstance(f.path, str) and type(f.size) is int and f.size >= 0 and
                       all(isinstance(x, (str, type(None))) for x in (f.sha256, f.git_oid))
                       for f in files):
                raise ValueError("a field has the wrong type")
            return files
        except (KeyError, TypeError, ValueError, AttributeError):
            raise self._unreadable(repo) from None

    def branches(self, repo: str) -> list[str]:
        """The repo's branch names (a built-in model's variants), `main` included."""
        refs, _ = self._page(f"{self.url}/api/models/{quote(repo)}/refs", repo)
        try:
            names = [b["name"] for b in refs.get("branches", [])]
            if not all(isinstance(n, str) for n in names):
                raise TypeError
            return names
        except (AttributeError, KeyError, TypeError):
            raise self._unreadable(repo) from None

    def text(self, repo: str, revision: str, path: str, limit: int = 1 << 20) -> str | None:
        """A small file's text (metadata.yml), or None when the revision has no such file."""
        try:
            with self._open(self.file_url(repo, revision, path), repo, revision,
                            missing_file_ok=True) as resp:
                return resp.read(limit).decode("utf-8", errors="replace")
        except _MissingFile:
            return None
        except (http.client.HTTPException, OSError) as exc:
            raise self._cut_off(repo, exc) from None

    def check_access(self, repo: str, revision: str, path: str) -> None:
        """HEAD a file on the hub, not following its CDN redirect, so that a gated repo's
        401 or 403 comes before any download starts. Only those are errors here: anything
        else is left to the download's own retries."""
        try:
            with self._open(self.file_url(repo, revision, path), repo, revision,
                            method="HEAD", redirects=False):
                pass
        except (HubTokenRequired, HubTokenRejected, ProxyAuthFailed):
            raise
        except (HTTPError, http.client.HTTPException, OSError) as exc:
            log.info("checking access to %s/%s: %s; the download will tell", repo, path, exc)

    def file_url(self, repo: str, revision: str, path: str) -> str:
        """Where a file's bytes are (the hub may redirect to a CDN)."""
        return f"{self.url}/{quote(repo)}/resolve/{quote(revision, safe='')}/{quote(path)}"

    def _page(self, url: str, repo: str, revision: str | None = None):
        """One JSON reply, and the URL of the next page (Link rel="next") or None."""
        try:
            with self._open(url, repo, revision, headers={"Accept": "application/json"}) \
                    as resp:
                body = json.loads(resp.read())
                found = _NEXT.search(resp.headers.get("Link", ""))
        except (http.client.HTTPException, OSError) as exc:  # cut off or timed out mid-reply
            raise self._cut_off(repo, exc) from None
        except ValueError:
            raise UpstreamError(f"The model hub {self.url} sent a reply that is not JSON") \
                from None
        return body, (urljoin(url, found.group(1)) if found else None)

    def _open(self, url: str, repo: str, revision: str | None, headers=None,
              missing_file_ok: bool = False, **kwargs):
        """open_url, with the hub's errors turned into localrt's and 429s waited out."""
        for attempt in range(RATE_LIMIT_TRIES + 1):
            try:
                return open_url(self.config, url, hub_url=self.url, headers=headers, **kwargs)
            except urllib.error.HTTPError as exc:
                exc.close()
                if 300 <= exc.code < 400 and not kwargs.get("redirects", True):
                    return contextlib.nullcontext(exc)  # a redirect was the answer asked for
                code = exc.headers.get("X-Error-Code", "") if exc.headers else ""
                if exc.code == 429 and attempt < RATE_LIMIT_TRIES:
                    wait = retry_after_seconds(exc.headers)
                    if not self._stopping.wait(wait if wait is not None else 2.0 ** attempt):
                        continue
                if missing_file_ok and exc.code == 404 and code != "RevisionNotFound" \
                        and code != "RepoNotFound":
                    raise _MissingFile() from None
                raise self._error(exc.code, code, repo, revision) from None
        raise AssertionError("unreachable")

    def _error(self, status: int, code: str, repo: str, revision: str | None):
        if code == "RepoNotFound" or (status == 404 and not code and revision is None):
            return NotOnHub(f"No such model on the hub: the repository {repo} does not "
                            f"exist on {self.url} (this is not a token problem; check the "
                            f"name)", param="model")
        if status == 404 and code == "RevisionNotFound" or (status == 404 and not code):
            return RevisionNotOnHub(f"No such model on the hub: {repo} has no revision "
                                    f"{revision}", param="model")
        if status in (401, 403):
            gated = "is gated and " if code == "GatedRepo" else ""
            if self.config.get("modelhub_token"):
                return HubTokenRejected(
                    f"The model hub did not accept the token for {repo}: the repository "
                    f"{gated}needs a token with access to it; check modelhub_token, and ask "
                    f"for access on the repository's page")
            return HubTokenRequired(f"The repository {repo} {gated}needs a token: set one "
                                    f"with `localrt config --modelhub_token TOKEN`")
        if status == 429:
            return RateLimited(f"The model hub {self.url} is rate-limiting requests for "
                               f"{repo} (HTTP 429, {RATE_LIMIT_TRIES} tries); try again later")
        return UpstreamError(f"The model hub answered HTTP {status} for {repo}")

    def _unreadable(self, repo: str) -> UpstreamError:
        return UpstreamError(f"The model hub {self.url} sent a file list localrt cannot read "
                             f"for {repo}")

    def _cut_off(self, repo: str, exc: Exception) -> UpstreamError:
        return UpstreamError(f"The model hub {self.url} did not finish its reply for {repo}: "
                             f"{exc.__class__.__name__}")


class _MissingFile(Exception):
    """The revision exists and the file does not."""

