"""The Hugging Face hub API, as much of it as pulling models needs.

  GET /api/models/{repo}/tree/{rev}       sizes, and lfs.oid, the sha256
  GET /api/models/{repo}/refs             branches (the variants of built-ins)
  GET /{repo}/resolve/{rev}/{path}        the bytes (see localrt.downloads)
Hub failures become localrt errors with their own status, never a 500.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import quote

from localrt.downloads import open_url
from localrt.errors import Forbidden, NotFound, UpstreamError


class HubTokenRequired(Forbidden):
    code = "hub_token_required"


class HubTokenRejected(Forbidden):
    code = "hub_token_rejected"


class NotOnHub(NotFound):
    code = "model_not_found_on_hub"


@dataclass(frozen=True)
class HubFile:
    """One file of a repo revision."""

    path: str
    size: int
    sha256: str | None  # None for small non-LFS files, which the hub gives no sha256 for
    git_oid: str | None = None  # the git blob sha1, the checksum of those small files


class Hub:
    """Calls one hub with the current Config (proxy, SSL flags, token)."""

    def __init__(self, url: str, config: Mapping):
        self.url = url.rstrip("/")
        self.config = config

    def files(self, repo: str, revision: str = "main") -> list[HubFile]:
        """Every file of `repo` at `revision`, with sizes and sha256 where the hub has them."""
        entries = self._get(f"/api/models/{quote(repo)}/tree/{quote(revision, safe='')}"
                            "?recursive=1", repo, revision)
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
            raise UpstreamError(f"The model hub {self.url} sent a file list localrt cannot "
                                f"read for {repo}") from None

    def branches(self, repo: str) -> list[str]:
        """The repo's branch names (a built-in model's variants)."""
        refs = self._get(f"/api/models/{quote(repo)}/refs", repo)
        return [b["name"] for b in refs.get("branches", [])]

    def file_url(self, repo: str, revision: str, path: str) -> str:
        """Where a file's bytes are (the hub may redirect to a CDN)."""
        return f"{self.url}/{quote(repo)}/resolve/{quote(revision, safe='')}/{quote(path)}"

    def _get(self, path: str, repo: str, revision: str | None = None):
        try:
            with open_url(self.config, self.url + path, hub_url=self.url,
                          headers={"Accept": "application/json"}) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            exc.close()
            raise self._error(exc.code, repo, revision) from None
        except (http.client.HTTPException, OSError) as exc:  # cut off or timed out mid-reply
            raise UpstreamError(f"The model hub {self.url} did not finish its reply for "
                                f"{repo}: {exc.__class__.__name__}") from None
        except ValueError:
            raise UpstreamError(f"The model hub {self.url} sent a reply that is not JSON") \
                from None

    def _error(self, status: int, repo: str, revision: str | None):
        has_token = bool(self.config.get("modelhub_token"))
        if status in (401, 403) and has_token:
            return HubTokenRejected(f"The model hub did not accept the token for {repo}; check "
                                    f"modelhub_token and that it has access to the repository")
        if status in (401, 403):
            return HubTokenRequired(f"The repository {repo} needs a token: set one with "
                                    f"`localrt config --modelhub_token TOKEN`")
        if status == 404:
            where = f"{repo} at revision {revision}" if revision else repo
            return NotOnHub(f"No such model on the hub: {where}")
        return UpstreamError(f"The model hub answered HTTP {status} for {repo}")
