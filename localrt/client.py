"""The one HTTP client for localrt's API, over urllib. The CLI uses only this.

Requests go through `_request` (and, for streams, `_stream`); errors are
decoded in one place, `_error`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Iterator
from urllib.parse import quote


class ApiError(Exception):
    """The server answered with an error; `message` is its own words."""

    def __init__(self, status: int, message: str, code: str = ""):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class Unreachable(Exception):
    """Nothing answered at the server's address."""


class Client:
    """Calls one localrt server. Proxies are never used: the server is local."""

    def __init__(self, base_url: str, timeout: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # --- the API -------------------------------------------------------------

    def health(self) -> dict:
        """GET /healthz."""
        return self._request("GET", "/healthz")

    def get_config(self) -> dict:
        """GET /v1/configs."""
        return self._request("GET", "/v1/configs")

    def update_config(self, changes: dict) -> dict:
        """PATCH /v1/configs with only the given fields."""
        return self._request("PATCH", "/v1/configs", changes)

    def stop_server(self) -> dict:
        """DELETE /v1/system: ask the server to shut down."""
        return self._request("DELETE", "/v1/system")

    # --- plumbing ------------------------------------------------------------

    def _open(self, method: str, path: str, body: Any = None, timeout: float | None = None):
        data = None
        headers = {"Accept": "application/json"}
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        url = self.base_url + quote(path, safe="/:?=&%")
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            return self._opener.open(req, timeout=self.timeout if timeout is None else timeout)
        except urllib.error.HTTPError as exc:
            raise _error(exc) from None
        except urllib.error.URLError as exc:
            raise Unreachable(f"Cannot reach the localrt server at {self.base_url}: "
                              f"{exc.reason}") from None
        except (ConnectionError, TimeoutError) as exc:
            raise Unreachable(f"Cannot reach the localrt server at {self.base_url}: {exc}") from None

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        """One request; the decoded JSON reply, or ApiError/Unreachable."""
        with self._open(method, path, body) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def _stream(self, method: str, path: str, body: Any = None) -> Iterator[str]:
        """One request whose reply is Server-Sent Events; yields each event's data."""
        with self._open(method, path, body, timeout=None) as resp:
            for line in resp:
                line = line.decode("utf-8").rstrip("\r\n")
                if line.startswith("data:"):
                    yield line[5:].lstrip()


def _error(exc: urllib.error.HTTPError) -> ApiError:
    """Decode an error reply: localrt's JSON body, or whatever the server sent."""
    try:
        body = json.loads(exc.read() or b"{}")
        error = body.get("error") or {}
        message = body.get("message") or error.get("message") or exc.reason
        return ApiError(exc.code, str(message), str(error.get("code", "")))
    except (ValueError, AttributeError, OSError):
        return ApiError(exc.code, f"HTTP {exc.code} {exc.reason}")
    finally:
        exc.close()
