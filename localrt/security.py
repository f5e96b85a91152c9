"""Keeping strangers out: loopback checks, API keys, and secrets kept out of text.

Plain functions over plain data; the app and the server call them.

- A server bound to loopback refuses Host headers that are not loopback
  (DNS rebinding), and needs no key.
- A server bound to any other address must have at least one API key
  (`apiKeys` in the settings file, or $LOCALRT_API_KEY), or it does not start.
- With keys set, every request but `/healthz`, the chat page's files (`/`, `/web/...`:
  the page asks the person for a key) and CORS preflights must carry
  `Authorization: Bearer <key>` or `x-api-key: <key>` (what Anthropic's clients
  send), compared in constant time.
"""

from __future__ import annotations

import hmac
import logging
import re
from typing import Callable, Iterable, Mapping
from urllib.parse import urlsplit, urlunsplit

from localrt.settings import KEYS

# Paths anyone may ask for, with or without a key: the CLI and supervisors
# probe it to learn whether a server is up.
OPEN_PATHS = ("/healthz",)
# The chat page's files hold no data, and the page cannot ask for a key before it loads.
OPEN_PAGE = ("/", "/web/")


def is_open(path: str) -> bool:
    """Whether `path` is answered with no key: /healthz and the chat page's files."""
    return path in OPEN_PATHS or path == OPEN_PAGE[0] or \
        path.startswith(OPEN_PAGE[1]) and "/" not in path[len(OPEN_PAGE[1]):]
REDACTED = "***"


def is_loopback(host: str) -> bool:
    """Whether a host name or address is this machine's loopback."""
    host = host.lower().rstrip(".")
    return host in ("localhost", "::1", "[::1]") or host.endswith(".localhost") or \
        host.startswith("127.") and host.replace(".", "").isdigit()


def host_name(host: str) -> str:
    """A Host header without its port: "127.0.0.1:39281" -> "127.0.0.1", "[::1]:1" -> "::1"."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_:[]%")


def loopback_host(host: str | None) -> bool:
    """Whether a Host header names this machine's loopback: one host[:port] that is.
    No header, an empty one, or two values joined ("127.0.0.1:1, evil.example", as a
    server joins two Host headers) are not: a server on loopback answers them as it
    answers a foreign host."""
    if not host or len(host) > 300 or not _HOST_CHARS.issuperset(host):
        return False
    return is_loopback(host_name(host))


def exposure_problem(host: str, keys: Iterable[str]) -> str | None:
    """Why the server must not bind `host` with these keys, or None if it may."""
    if is_loopback(host) or any(keys):
        return None
    return (f"Refusing to listen on {host}: only loopback (127.0.0.1) is served without "
            f"an API key. Set apiKeys in the settings file, or LOCALRT_API_KEY, and send "
            f"it as 'Authorization: Bearer <key>'")


def key_accepted(authorization: str | None, keys: Iterable[str],
                 api_key: str | None = None) -> bool:
    """Whether an Authorization header (`Bearer <key>`) or an x-api-key header
    (`api_key`) carries one of `keys`.

    Every key is compared, each in constant time, so neither the answer's
    timing nor which key matched tells an attacker how close a guess was.
    """
    presented = []
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() == "bearer":
        presented.append(token.strip().encode("utf-8"))
    if api_key is not None:
        presented.append(api_key.strip().encode("utf-8"))
    found = False
    for candidate in presented:
        for key in keys:
            found |= hmac.compare_digest(candidate, key.encode("utf-8"))
    return found


# The secret fields, by their settings-file names and their Config (API) names.
SECRET_FIELDS = tuple(name for key in KEYS if key.secret
                      for name in (key.name, key.api) if name)
MIN_SECRET = 4  # shorter values are not hunted for: replacing "ab" everywhere garbles text


def secrets_of(values: Mapping) -> list[str]:
    """The secrets in a Config or settings mapping: the hub token, proxy password, API keys."""
    found: list[str] = []
    for name in SECRET_FIELDS:
        value = values.get(name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and len(item) >= MIN_SECRET:
                found.append(item)
    return found


def redact(text: str, secrets: Iterable[str]) -> str:
    """`text` with every secret, and any user:password@ in a URL, replaced by ***."""
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return _without_userinfo(text)


def redact_data(data, secrets: Iterable[str]):
    """A JSON-able value with `redact` applied to every string in it."""
    secrets = list(secrets)
    if isinstance(data, str):
        return redact(data, secrets)
    if isinstance(data, dict):
        return {k: redact_data(v, secrets) for k, v in data.items()}
    if isinstance(data, list):
        return [redact_data(v, secrets) for v in data]
    return data


class RedactingFilter(logging.Filter):
    """A log handler filter that takes the current secrets out of every record."""

    def __init__(self, secrets: Callable[[], Iterable[str]]):
        super().__init__()
        self._secrets = secrets
        self._formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = list(self._secrets())
        record.msg = redact(record.getMessage(), secrets)
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text, secrets)
        return True


def url_without_credentials(url: str) -> str:
    """A URL to show people: http://user:pw@proxy:3128 -> http://***@proxy:3128."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=f"{REDACTED}@{parts.netloc.rsplit('@', 1)[1]}"))


_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_SCHEME = _LETTERS | frozenset("0123456789+.-")
_USERINFO = re.compile(r"[^/@\s]*")  # one class, starred: it cannot backtrack


def _without_userinfo(text: str) -> str:
    """`text` with the userinfo of each URL (scheme://user:pw@) replaced by ***.

    A scan from each "://", in time linear in the text: every message an error or log
    line carries passes here, and a regex for it backtracked on a long run of letters
    (quadratic: a 60,000-character model id held a request 24 s). It takes what
    ([a-zA-Z][a-zA-Z0-9+.-]*://)[^/\\s@]+@ would: a scheme that starts with a letter,
    then characters that are neither "/", "@" nor space, then "@".
    """
    out, done, at = [], 0, text.find("://")
    while at >= 0:
        start = at
        while start > done and text[start - 1] in _SCHEME:
            start -= 1
        while start < at and text[start] not in _LETTERS:  # a scheme starts with a letter
            start += 1
        end = _USERINFO.match(text, at + 3).end()
        if start < at and end > at + 3 and end < len(text) and text[end] == "@":
            out += [text[done:at + 3], REDACTED, "@"]
            done = end + 1
            at = text.find("://", done)
        else:  # the next "://" may begin inside what was scanned ("a://b://c@")
            at = text.find("://", at + 1)
    out.append(text[done:])
    return "".join(out)
