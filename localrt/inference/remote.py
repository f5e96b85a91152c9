"""Remote models: chats forwarded to OpenAI-compatible servers, the upstreams.

A remote model is a registry entry (localrt.models.registry) with no files and a list of
upstreams, `{"url", "model"?, "api_key"?, "max_inflight"?}`: vLLM or SGLang on GPU
hosts, llama.cpp's llama-server, llama-cpp-python's server, another localrt. Its
engine is the catalog's `remote` row (localrt.engines.catalog), whose adapter is `RemoteEngine`:
nothing is loaded, and localrt.inference.chat hands a remote model's request here whole.

  Remotes   registration (POST /v1/models/remote, a PATCH of the upstreams), the status
            rows, the probe thread, and forwarding a chat (`chat`)
  Pool      one model's upstreams: health, in-flight counts, latency, and the requests
            that wait, in arrival order, for an upstream with room
  Exchange  one request on the wire to one upstream; `close()` hangs up

Routing, after Envoy's least-request balancing and outlier detection: a request goes
to the usable (healthy, or not probed yet) upstream with the fewest requests in
flight among those under their `max_inflight`; when every one is full it waits in
arrival order, at most `upstreamTimeout` seconds, and Chats.admission bounds how
many wait. A connection that fails before the first byte takes its upstream out at
once and is retried once on another. Every upstream's GET /models is probed every
PROBE_INTERVAL s (PROBE_RETRY s while it is out, and at once after a failure). A slow
answer is not a failure: llama-cpp-python's server answers a probe only between two
replies. A refused or reset connection is, and so are a 5xx answer and a 401 or 403
(the upstream refuses localrt's key).

The request goes out as it came, with `model` rewritten to the upstream's name; each
reply (each event of a stream, passed on as it comes) carries localrt's id instead.
Errors: 502 when an upstream fails (a 401 or 403 says it refused localrt's key), 504
when no first byte comes within upstreamTimeout, 503 when no upstream is healthy; a
stream that breaks after its first byte ends with an error event, never silently.
Upstream keys are secrets: records never show them (localrt.models.registry), and `secrets()`
feeds the redaction of logs and error bodies (localrt.security). Connections go
through localrt.downloads.opener, with the Config's proxy, no_proxy and TLS flags.
"""

from __future__ import annotations

import collections
import dataclasses
import http.client
import itertools
import json
import logging
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping
from urllib.parse import urlsplit

from localrt import security
from localrt.engines.catalog import REMOTE_ENGINE
from localrt.errors import (BadRequest, Conflict, HTTPError, InvalidField,
                            ServiceUnavailable, UpstreamError)
from localrt.models.ids import check_new_id, folder_name
from localrt.metrics import Clock
from localrt.downloads.opener import (CertificateFailed, ProxyAuthFailed, build_opener, origin,
                                      proxy_refused)
from localrt.inference.requests import EventStream, stream_error
from localrt.inference.scheduler import Admission

log = logging.getLogger(__name__)

PROBE_INTERVAL = 10.0   # seconds between probes of a healthy upstream
PROBE_RETRY = 2.0       # ... of one that is out
PROBE_TIMEOUT = 30.0    # a probe unanswered by then is slow (busy), not failed
PROBE_TICK = 0.25       # how often the probe thread looks for upstreams due
FIRST_PROBE_WAIT = 1.0  # how long a registration waits for its first probes
MESSAGE_LIMIT = 300     # characters of an upstream's own error message quoted
ERROR_BODY_LIMIT = 65536
DONE = b"[DONE]"  # the data of the event that ends an OpenAI stream

HEALTHY, UNHEALTHY, UNKNOWN = "healthy", "unhealthy", "unknown"


class UpstreamKeyRefused(UpstreamError):
    code = "upstream_key_refused"


class UpstreamTimeout(HTTPError):
    status = 504
    type = "server_error"
    code = "upstream_timeout"


class NoHealthyUpstream(ServiceUnavailable):
    code = "no_healthy_upstream"


class UpstreamRejected(BadRequest):
    """The upstream refused the request itself (a 400 or 422): the client's to mend."""

    code = "upstream_rejected_request"


class _ConnectFailed(Exception):
    """The connection failed before the first byte: retried once on another upstream."""


class RemoteEngine:
    """The catalog's adapter of remote models: it loads nothing (localrt.engines.catalog)."""

    name = REMOTE_ENGINE
    format = "OpenAI API"
    description = ("forwards chats to OpenAI-compatible servers (vLLM, llama-server, "
                   "another localrt); ships with localrt")

    def load(self, model_path: str, options: dict):
        raise BadRequest("A remote model is not loaded here: its upstreams serve it",
                         param="model")


# --- upstreams ------------------------------------------------------------------------


def upstream_url(url: str, param: str) -> str:
    """An upstream's OpenAI base URL, checked: http(s)://host[:port]/path (/v1 for none)."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:  # a bracketed host that is no IPv6 address, a port past 65535
        parts, port = urlsplit(""), 0
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname or \
            "@" in parts.netloc or port == 0 or parts.query or parts.fragment:
        raise InvalidField(f"Invalid field '{param}': expected the server's OpenAI base URL, "
                           f"http(s)://host[:port]/v1, with no credentials (give a key as "
                           f"api_key), query or fragment", param=param)
    return f"{parts.scheme.lower()}://{parts.netloc}{parts.path.rstrip('/') or '/v1'}"


def _text(value, param: str):
    """`value`, unless it is a string that is not UTF-8 text (JSON allows lone surrogates)."""
    try:
        if isinstance(value, str):
            value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidField(f"Invalid field '{param}': it is not UTF-8 text (it holds a lone "
                           f"surrogate)", param=param) from None
    return value


def parse_upstreams(items: list, param: str = "upstreams") -> list[dict]:
    """A request's upstreams (schemas/model-remote.json), URLs checked; keys kept."""
    out, seen = [], set()
    for i, item in enumerate(items):
        for key, value in item.items():
            _text(value, f"{param}[{i}].{key}")
        entry = {"url": upstream_url(item["url"], f"{param}[{i}].url")}
        entry.update((k, item[k]) for k in ("model", "api_key", "max_inflight")
                     if item.get(k) is not None)
        if (entry["url"], entry.get("model")) in seen:
            raise InvalidField(f"Invalid field '{param}[{i}]': {entry['url']} is listed twice",
                               param=f"{param}[{i}]")
        seen.add((entry["url"], entry.get("model")))
        out.append(entry)
    return out


@dataclass(eq=False)
class Upstream:
    """One upstream and what is known of it; its Pool's lock guards the fields that change."""

    url: str
    model: str | None = None
    api_key: str | None = None
    max_inflight: int | None = None
    health: str = UNKNOWN
    error: str | None = None          # why it is out
    refused_key: bool = False         # it answered 401 or 403
    inflight: int = 0
    requests: int = 0                 # forwarded to it since localrt started
    latency_ms: float | None = None   # time to the first byte of its last probe or request
    listed: str | None = None         # the model its GET /models lists, when it lists one
    probing: bool = False
    next_probe: float = 0.0           # time.monotonic() of its next probe
    picked: int = 0                   # when it was last chosen (Pool._picks)

    def __repr__(self) -> str:  # never the key
        return f"Upstream({self.url!r}, {self.health})"

    @property
    def key(self) -> tuple:
        return self.url, self.model, self.api_key

    @property
    def usable(self) -> bool:
        return self.health != UNHEALTHY

    def has_room(self) -> bool:
        return self.max_inflight is None or self.inflight < self.max_inflight

    def upstream_model(self, model_id: str) -> str:
        """The name a request asks this upstream for."""
        return self.model or self.listed or model_id

    def row(self) -> dict:
        """What GET /v1/models/status shows of it (replies.json upstream-status)."""
        row = {"url": self.url, "model": self.model or self.listed, "health": self.health,
               "inflight": self.inflight, "max_inflight": self.max_inflight,
               "requests": self.requests, "latency_ms": self.latency_ms}
        if self.error and self.health == UNHEALTHY:
            row["error"] = self.error
        return row


class Pool:
    """One remote model's upstreams, and the requests waiting for one with room.

    `_cond`'s lock guards `upstreams`, every Upstream's changing fields, `_queue` (the
    waiting requests, in arrival order), `_picks` and `_closed`; it is notified when
    any of them changes. It is never held while a request or a probe is on the wire.
    """

    def __init__(self, model_id: str, specs: list[dict]):
        self.model_id = model_id
        self.started_at = time.time()
        self.upstreams: list[Upstream] = []
        self._specs: tuple = ()
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque = collections.deque()
        self._picks = 0
        self._closed = False
        self.configure(specs)

    def configure(self, specs: list[dict]) -> None:
        """Take the model's upstreams as stored; one listed before keeps its state."""
        wanted = tuple((s["url"], s.get("model"), s.get("api_key"), s.get("max_inflight"))
                       for s in specs)
        with self._cond:
            if wanted == self._specs:
                return
            known = {u.key: u for u in self.upstreams}
            fresh = []
            for url, model, key, limit in wanted:
                upstream = known.get((url, model, key)) or Upstream(url, model, key)
                upstream.max_inflight = limit
                fresh.append(upstream)
            self.upstreams, self._specs = fresh, wanted
            self._cond.notify_all()

    def acquire(self, exclude: Iterable[Upstream], timeout: float) -> Upstream:
        """The usable upstream with room and the fewest requests in flight, once this
        request's turn comes; 503 (or 502: keys refused) when none is usable, 504 when
        none had room for `timeout` seconds."""
        exclude = list(exclude)
        deadline = time.monotonic() + timeout
        me = object()
        with self._cond:
            self._queue.append(me)
            try:
                while True:
                    if self._closed:
                        raise ServiceUnavailable("The server is stopping")
                    usable = [u for u in self.upstreams if u.usable and u not in exclude]
                    if not usable:
                        raise self._unavailable(exclude)
                    free = [u for u in usable if u.has_room()]
                    if free and self._queue[0] is me:
                        # Ties go to the one chosen longest ago, so equal loads alternate.
                        chosen = min(free, key=lambda u: (u.inflight, u.picked))
                        self._picks += 1
                        chosen.picked, chosen.inflight = self._picks, chosen.inflight + 1
                        chosen.requests += 1
                        return chosen
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise UpstreamTimeout(f"Every upstream of remote model {self.model_id} "
                                              f"stayed full (max_inflight) for {timeout:g} s "
                                              f"(upstreamTimeout)")
                    self._cond.wait(left)
            finally:
                self._queue.remove(me)
                self._cond.notify_all()

    def release(self, upstream: Upstream, latency_ms: float | None) -> None:
        """A request on `upstream` ended; its time to the first byte, if it got one."""
        with self._cond:
            upstream.inflight -= 1
            if latency_ms is not None:
                upstream.latency_ms = round(latency_ms, 1)
            self._cond.notify_all()

    def failed(self, upstream: Upstream, why: str, refused_key: bool = False) -> None:
        """Take an upstream out at once; it is probed now, and probes bring it back."""
        with self._cond:
            was = upstream.health
            upstream.health, upstream.error = UNHEALTHY, why
            upstream.refused_key = refused_key
            upstream.next_probe = 0.0
            self._cond.notify_all()
        if was != UNHEALTHY:
            log.warning("upstream %s of remote model %s is out: %s", upstream.url,
                        self.model_id, why)

    def due(self, now: float) -> list[Upstream]:
        """The upstreams to probe now, marked as being probed."""
        with self._cond:
            found = [u for u in self.upstreams if not u.probing and u.next_probe <= now]
            for u in found:
                u.probing = True
            return found

    def probed(self, upstream: Upstream, outcome: "Probe") -> None:
        """Record a probe's outcome; a slow answer leaves the health as it was."""
        with self._cond:
            was = upstream.health
            upstream.probing = False
            if outcome.health is not None:
                upstream.health, upstream.error = outcome.health, outcome.error
                upstream.refused_key = outcome.refused_key
            if outcome.latency_ms is not None:
                upstream.latency_ms = round(outcome.latency_ms, 1)
            if outcome.listed is not None:
                upstream.listed = outcome.listed
            upstream.next_probe = time.monotonic() + (
                PROBE_RETRY if upstream.health == UNHEALTHY else PROBE_INTERVAL)
            now = upstream.health
            self._cond.notify_all()
        if was != now and now == HEALTHY:
            log.info("upstream %s of remote model %s is healthy", upstream.url, self.model_id)
        elif was != now and now == UNHEALTHY:
            log.warning("upstream %s of remote model %s is out: %s", upstream.url,
                        self.model_id, outcome.error)

    def counts(self) -> tuple[int, int]:
        """(healthy upstreams, all upstreams)."""
        with self._cond:
            return sum(u.health == HEALTHY for u in self.upstreams), len(self.upstreams)

    def usable(self) -> bool:
        """Whether some upstream may take a request."""
        with self._cond:
            return any(u.usable for u in self.upstreams)

    def status(self) -> dict:
        """The model's row of GET /v1/models/status."""
        with self._cond:
            rows = [u.row() for u in self.upstreams]
            busy = sum(u.inflight for u in self.upstreams) + len(self._queue)
        return {"id": self.model_id, "object": "model", "engine": REMOTE_ENGINE, "ram": 0,
                "vram": 0, "startedAt": int(self.started_at),
                "uptime": round(time.time() - self.started_at, 1), "requests": busy,
                "options": {}, "upstreams_healthy": sum(r["health"] == HEALTHY for r in rows),
                "upstreams_total": len(rows), "upstreams": rows}

    def close(self) -> None:
        """Wake every waiting request with a 503 (the server is stopping)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _unavailable(self, exclude: list) -> HTTPError:
        others = [u for u in self.upstreams if u not in exclude]
        if not self.upstreams:
            return NoHealthyUpstream(f"Remote model {self.model_id} has no upstreams")
        if others and all(u.refused_key for u in others):
            said = "; ".join(f"{u.url}: {u.error}" for u in others)
            return UpstreamKeyRefused(f"Every upstream of remote model {self.model_id} "
                                      f"refused localrt's key ({said}); set the "
                                      f"upstream's api_key (PATCH the model's upstreams)")
        why = "; ".join(f"{u.url}: {u.error or u.health}" for u in others)
        return NoHealthyUpstream(f"No upstream of remote model {self.model_id} is healthy "
                                 f"({why}); localrt probes them every {PROBE_RETRY:g} s",
                                 headers=[("Retry-After", f"{PROBE_RETRY:g}")])


# --- one request on the wire --------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """What a probe found: `health` None is a slow answer, which changes nothing."""

    health: str | None
    error: str | None = None
    refused_key: bool = False
    latency_ms: float | None = None
    listed: str | None = None


def _request(upstream: Upstream, path: str, body: bytes | None = None) -> urllib.request.Request:
    headers = {"Accept": "application/json, text/event-stream"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(upstream.url + path, data=body, headers=headers,
                                 method="GET" if body is None else "POST")
    if upstream.api_key:  # never follows a redirect: redirects are answers here
        req.add_unredirected_header("Authorization", f"Bearer {upstream.api_key}")
    return req


def probe(config: Mapping, upstream: Upstream, timeout: float = PROBE_TIMEOUT) -> Probe:
    """GET <url>/models once."""
    started = time.monotonic()
    try:
        with build_opener(config, redirects=False).open(_request(upstream, "/models"),
                                                        timeout=timeout) as resp:
            raw = resp.read(ERROR_BODY_LIMIT)
    except urllib.error.HTTPError as exc:
        if proxy_refused(config, upstream.url, exc.code, exc.headers):
            exc.close()
            return Probe(UNHEALTHY, f"the proxy {origin(config['proxy_url'])} refused its "
                                    f"credentials (HTTP {exc.code})")
        if exc.code in (401, 403):  # the upstream's own words say why (Invalid API key)
            return Probe(UNHEALTHY, f"it refused localrt's key ({_said(exc)})", True)
        exc.close()
        if exc.code >= 500:
            return Probe(UNHEALTHY, f"GET /models answered HTTP {exc.code}")
        return Probe(HEALTHY, latency_ms=(time.monotonic() - started) * 1000)  # it answers
    except Exception as exc:  # noqa: BLE001 - every way a connection fails is an outcome
        if _timed_out(exc):
            return Probe(None)
        return Probe(UNHEALTHY, _reason(exc))
    latency = (time.monotonic() - started) * 1000
    try:
        ids = [m["id"] for m in json.loads(raw)["data"] if isinstance(m.get("id"), str)]
    except (ValueError, KeyError, TypeError, AttributeError):
        ids = []
    return Probe(HEALTHY, latency_ms=latency, listed=ids[0] if len(ids) == 1 else None)


def _timed_out(exc: BaseException) -> bool:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return isinstance(reason, (socket.timeout, TimeoutError))


def _has_text(choice) -> bool:
    """Whether a streamed choice carries a piece of the reply (text, or a call's)."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content") or delta.get("tool_calls"))
    return bool(choice.get("text"))


def _reason(exc: BaseException) -> str:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return str(reason) or type(reason).__name__


def _said(exc: urllib.error.HTTPError) -> str:
    """An upstream's error answer in a few words: "HTTP 401: Invalid API key"; closed."""
    try:
        message = _upstream_message(exc.read(ERROR_BODY_LIMIT))
    except Exception:  # noqa: BLE001 - a body that cannot be read says nothing
        message = ""
    finally:
        exc.close()
    return f"HTTP {exc.code}" + (f": {message}" if message else "")


def _upstream_message(raw: bytes) -> str:
    """The upstream's own words in an error body, shortened."""
    try:
        data = json.loads(raw)
    except ValueError:
        text = raw.decode("utf-8", "replace")
    else:
        error = data.get("error") if isinstance(data, dict) else None
        text = (error.get("message") if isinstance(error, dict) else error) or \
            (data.get("detail") or data.get("message") if isinstance(data, dict) else None) or \
            json.dumps(data)
    text = " ".join(str(text).split())
    return text[:MESSAGE_LIMIT] + ("..." if len(text) > MESSAGE_LIMIT else "")


class Exchange:
    """One forwarded request on one upstream: its reply, read as it comes, and `close()`."""

    def __init__(self, pool: Pool, upstream: Upstream, model_id: str,
                 secrets: Callable[[], Iterable[str]] = list, path: str = "/chat/completions",
                 clock: Clock | None = None):
        self.pool, self.upstream, self.model_id = pool, upstream, model_id
        self.path = path  # under the upstream's /v1: /chat/completions, /completions, ...
        self._secrets = secrets  # what an error event must not say
        # Timed and counted in /metrics like a local completion: the upstream's usage when
        # it sends one, else the events that carried text (a token each, on the servers
        # tested: llama.cpp's, llama-cpp-python's, vLLM's).
        self._clock = clock or Clock(None, model_id)
        self._usage: dict | None = None
        self._pieces = 0
        self._sockets: list = []
        self._resp = None
        self._payloads: Iterator[bytes] = iter(())
        self._started = 0.0
        self._latency: float | None = None
        self._closed = False
        self._on_close: list = []

    def send(self, config: Mapping, body: dict, timeout: float) -> None:
        """POST the request, `model` rewritten; raises the mapped error, or _ConnectFailed."""
        try:
            payload = json.dumps({**body, "model": self.upstream.upstream_model(self.model_id)},
                                 ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:  # JSON allows lone surrogates; UTF-8 does not
            raise InvalidField("Invalid request body: it holds text that is not UTF-8 (a lone "
                               "surrogate)") from None
        opener = build_opener(config, self._sockets.append, redirects=False)
        self._started = time.monotonic()
        try:
            self._resp = opener.open(_request(self.upstream, self.path, payload),
                                     timeout=timeout)
        except urllib.error.HTTPError as exc:
            raise self._refusal(exc, config) from None
        except Exception as exc:  # noqa: BLE001 - _failure sorts them
            raise self._failure(exc, timeout, "sent no first byte") from None

    def whole(self, timeout: float) -> dict:
        """A reply that is not streamed: the upstream's JSON with localrt's model id."""
        try:
            raw = self._resp.read()
        except Exception as exc:  # noqa: BLE001
            raise self._failure(exc, timeout, "sent no whole reply") from None
        self._latency = (time.monotonic() - self._started) * 1000
        try:
            reply = json.loads(raw)
        except ValueError:
            raise UpstreamError(f"Upstream {self.upstream.url} answered with something other "
                                f"than JSON") from None
        if isinstance(reply, dict):
            self._clock.piece()
            self._clock.done()
            self._note_usage(reply)
            if "model" in reply:
                reply["model"] = self.model_id
        return reply

    def first(self, timeout: float) -> bytes:
        """A stream's first event, read before the reply starts, so what fails before it
        is an HTTP error (and a connection failure is retried)."""
        self._payloads = self._read()
        try:
            payload = next(self._payloads)
        except StopIteration:
            raise _ConnectFailed(f"{self.upstream.url} closed the stream before its first "
                                 f"event") from None
        except Exception as exc:  # noqa: BLE001
            raise self._failure(exc, timeout, "sent no first event") from None
        self._latency = (time.monotonic() - self._started) * 1000
        return payload

    def payloads(self) -> Iterator[bytes]:
        """The data of the stream's events after the first, up to [DONE]. Raises what
        breaks the stream, or ConnectionError when it ends before [DONE]."""
        for payload in self._payloads:
            yield payload
            if payload == DONE:
                return
        raise ConnectionError("the upstream closed the stream before [DONE]")

    def chunk(self, payload: bytes) -> dict | None:
        """One event's data as a chunk dict with localrt's model id (None for [DONE],
        and for an event that is not a JSON object, which is left out)."""
        try:
            data = json.loads(payload)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        self._note_usage(data)
        if any(_has_text(c) for c in data.get("choices") or ()):
            self._clock.piece()
            self._pieces += 1
        if "model" in data:
            data["model"] = self.model_id
        return data

    def _note_usage(self, data: dict) -> None:
        usage = data.get("usage")
        if isinstance(usage, dict) and all(isinstance(usage.get(k), int) for k in (
                "prompt_tokens", "completion_tokens")):
            self._usage = usage

    def broken(self, exc: BaseException) -> UpstreamError:
        """What ends a stream which broke after its first event (its error event)."""
        if not _timed_out(exc):
            self.pool.failed(self.upstream, f"a stream broke: {_reason(exc)}")
        message = security.redact(f"Upstream {self.upstream.url} broke off the reply: "
                                  f"{_reason(exc)}", self._secrets())
        log.warning("remote model %s: %s", self.model_id, message)
        return UpstreamError(message)

    def on_close(self, callback: Callable[[], None]) -> None:
        """Run `callback` once this exchange is closed."""
        self._on_close.append(callback)

    def close(self) -> None:
        """Hang up (the upstream sees it and stops generating) and free the upstream."""
        if self._closed:
            return
        self._closed = True
        if self._latency is not None:  # a reply came: count it (a failed try is not)
            if self._clock.ended is None:
                self._clock.done()
            self._clock.end(self._usage or {"prompt_tokens": 0,
                                            "completion_tokens": self._pieces})
        try:
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            if self._resp is not None:
                self._resp.close()
        finally:
            self.pool.release(self.upstream, self._latency)
            for callback in self._on_close:
                callback()

    def _read(self) -> Iterator[bytes]:
        """The data of each Server-Sent Event, line by line as the upstream sends it."""
        for raw in self._resp:
            if raw.startswith(b"data:"):
                data = raw[5:].rstrip(b"\r\n")
                yield data[1:] if data.startswith(b" ") else data

    def _refusal(self, exc: urllib.error.HTTPError, config: Mapping) -> HTTPError:
        """The localrt error for an upstream's error answer, with the upstream's own
        words (secrets redacted: an upstream may quote the key it refused)."""
        where, said = self.upstream.url, security.redact(_said(exc), self._secrets())
        if proxy_refused(config, exc.url or where, exc.code, exc.headers):
            return ProxyAuthFailed(f"The proxy {origin(config['proxy_url'])} refused to "
                                   f"forward to {where} ({said}); check proxy_username and "
                                   f"proxy_password")
        if exc.code in (401, 403):
            self.pool.failed(self.upstream, f"it refused localrt's key ({said})", True)
            return UpstreamKeyRefused(f"Upstream {where} of remote model {self.model_id} "
                                      f"refused localrt's key ({said}); set the upstream's "
                                      f"api_key (PATCH the model's upstreams)")
        if exc.code in (400, 413, 422):
            return UpstreamRejected(f"Upstream {where} refused the request ({said})")
        if exc.code == 429:
            return ServiceUnavailable(f"Upstream {where} is busy ({said}); retry shortly",
                                      headers=[("Retry-After", exc.headers.get("Retry-After")
                                                or "1")])
        return UpstreamError(f"Upstream {where} of remote model {self.model_id} failed "
                             f"({said})")

    def _failure(self, exc: BaseException, timeout: float, what: str) -> Exception:
        """A failure without an HTTP answer: a 504, a TLS 502, or a retried connection."""
        where = self.upstream.url
        if _timed_out(exc):
            return UpstreamTimeout(f"Upstream {where} of remote model {self.model_id} {what} "
                                   f"within {timeout:g} s (upstreamTimeout)")
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, ssl.SSLCertVerificationError):
            self.pool.failed(self.upstream, f"TLS: {reason.verify_message}")
            return CertificateFailed(f"TLS certificate check failed for {where}: "
                                     f"{reason.verify_message}")
        if isinstance(reason, (OSError, http.client.HTTPException)):
            return _ConnectFailed(f"{where}: {_reason(exc)}")
        return UpstreamError(f"Upstream {where} of remote model {self.model_id} cannot be "
                             f"reached: {_reason(exc)}")


class RemoteStream(EventStream):
    """A remote model's streamed reply: the upstream's events as they come, with
    localrt's model id; close() hangs up."""

    def __init__(self, exchange: Exchange, first: bytes):
        self._exchange = exchange
        self._first = first

    def chunks(self) -> Iterator[dict]:
        """The events as chunk dicts (chat.Stream.chunks' shape); an {"error": ...} dict
        ends a stream that broke. An event that is not a JSON object is left out."""
        exchange = self._exchange
        if self._first == DONE:
            return
        try:
            for payload in itertools.chain([self._first], exchange.payloads()):
                if payload == DONE:
                    return
                chunk = exchange.chunk(payload)
                if chunk is not None:
                    yield chunk
        except Exception as exc:  # noqa: BLE001 - the reply has started: say so in it
            yield stream_error(exchange.broken(exc), exchange.model_id)

    def close(self) -> None:
        """Called by the server when the reply ends or the client goes away."""
        self._exchange.close()


# --- the remote models ----------------------------------------------------------------


class Remotes:
    """The remote models' pools: registration, status, probes and forwarding.

    `_lock` guards `_pools` (model id -> Pool), `_keys` (every upstream key seen, for
    redaction) and `_prober` (the probe thread, started with the first pool); each Pool
    guards its upstreams. Neither is held while a request or a probe is on the wire.
    """

    def __init__(self, registry, engines, config: Callable[[], Mapping],
                 timeout: Callable[[], float], secrets: Callable[[], Iterable[str]] = list):
        self._registry = registry
        self._engines = engines
        self._config = config        # the Config fields of outbound requests
        self._timeout = timeout      # upstreamTimeout, in seconds
        self._more_secrets = secrets  # the settings' secrets, for what a stream says
        self._lock = threading.Lock()
        self._pools: dict[str, Pool] = {}
        self._keys: set[str] = set()
        self._prober: threading.Thread | None = None
        self._closed = threading.Event()

    def serves(self, record: dict) -> bool:
        """Whether a model record is a remote model's."""
        return self._engines.forwards(record["engine"])

    # --- registration and status ---------------------------------------------------

    def add(self, body: dict) -> dict:
        """Register a remote model (schemas/model-remote.json); its record, once its first
        probes are done (or FIRST_PROBE_WAIT has passed)."""
        model_id = check_new_id(_text(body["id"], "id"), "id")
        _text(body.get("name"), "name")
        upstreams = parse_upstreams(body["upstreams"])
        if self._registry.has(model_id):
            raise Conflict(f"A model with id {model_id} already exists", param="id")
        definition = {"id": model_id, "name": body.get("name") or model_id,
                      "engine": REMOTE_ENGINE, "created": int(time.time()),
                      "owned_by": "remote", "files": [], "source": {"type": "remote"},
                      "upstreams": upstreams}
        self._remember(upstreams)
        record = self._registry.add(self._registry.root / "remote" / folder_name(model_id),
                                    definition)
        self._probe_now(self._pool(model_id))
        log.info("remote model %s added with %d upstreams", model_id, len(upstreams))
        return record

    def update(self, model_id: str, changes: dict) -> dict:
        """A PATCH with `upstreams`: they replace the model's (a 400 for a local model)."""
        if not self.serves(self._registry.get(model_id)):
            raise InvalidField(f"Invalid field 'upstreams': model {model_id} is not a remote "
                               f"model; only remote models (POST /v1/models/remote) have "
                               f"upstreams", param="upstreams")
        upstreams = parse_upstreams(changes["upstreams"])
        self._remember(upstreams)
        record = self._registry.update(model_id, {**changes, "upstreams": upstreams})
        self._probe_now(self._pool(model_id))
        return record

    def annotate(self, record: dict) -> dict:
        """A record with `upstreams_healthy` and `upstreams_total` when it is remote; its
        status is "running" while an upstream may take requests, else "unavailable"."""
        if not self.serves(record):
            return record
        pool = self._pool(record["id"])
        healthy, total = pool.counts()
        return {**record, "status": "running" if pool.usable() else "unavailable",
                "upstreams_healthy": healthy, "upstreams_total": total}

    def started(self, model_id: str, options: dict) -> dict:
        """The reply to a start of a remote model: nothing loads; 400 for start options."""
        for name in options:
            raise InvalidField(f"Invalid field '{name}': remote model {model_id} takes no "
                               f"start options; its upstreams run it", param=name)
        healthy, total = self._pool(model_id).counts()
        return {"message": f"Model {model_id} is remote, served by its upstreams ({healthy} "
                           f"of {total} healthy); it needs no start",
                "model": model_id, "engine": REMOTE_ENGINE, "options": {},
                "alreadyRunning": True}

    def stopped(self, model_id: str) -> dict:
        """The reply to a stop of a remote model: nothing runs here to stop."""
        return {"message": f"Model {model_id} is remote: its upstreams keep serving it, and "
                           f"nothing was stopped here", "model": model_id}

    def status(self) -> list[dict]:
        """The rows of GET /v1/models/status: each remote model with its upstreams."""
        ids = [r["id"] for r in self._registry.list() if self.serves(r)]
        with self._lock:  # pools of models deleted meanwhile go
            for gone in set(self._pools) - set(ids):
                self._pools.pop(gone).close()
        return [self._pool(model_id).status() for model_id in ids]

    def secrets(self) -> list[str]:
        """Every upstream key seen, for localrt.security to take out of logs and errors."""
        with self._lock:
            return list(self._keys)

    def _all_secrets(self) -> list[str]:
        return [*self._more_secrets(), *self.secrets()]

    def close(self) -> None:
        """Stop probing and wake waiting requests (the server is stopping)."""
        self._closed.set()
        with self._lock:
            pools = list(self._pools.values())
        for pool in pools:
            pool.close()

    # --- forwarding ------------------------------------------------------------------

    def forward(self, record: dict, body: dict, admission: Admission,
                path: str = "/chat/completions", clock: Clock | None = None):
        """Forward a request to `path` of an upstream's OpenAI API (chat completions,
        completions, embeddings): the reply dict, or a RemoteStream. It counts in the
        calling service's `admission` (localrt.inference.scheduler.Admission) until it ends;
        `clock` times and counts it in /metrics."""
        pool = self._pool(record["id"])
        admission.enter()
        try:
            exchange, first = self._exchange(pool, record["id"], body, path, clock)
        except BaseException:
            admission.leave()
            raise
        exchange.on_close(admission.leave)
        if body.get("stream"):
            return RemoteStream(exchange, first)
        exchange.close()
        return first

    def _exchange(self, pool: Pool, model_id: str, body: dict, path: str, clock):
        """(Exchange, its first event or whole reply); a connection that fails before the
        first byte is retried once on another upstream."""
        timeout = float(self._timeout())
        tried: list[Upstream] = []
        failure = None
        while len(tried) < 2:
            try:
                upstream = pool.acquire(tried, timeout)
            except HTTPError:
                if failure is None:
                    raise
                break  # nothing else to retry on
            tried.append(upstream)
            exchange = Exchange(pool, upstream, model_id, self._all_secrets, path, clock)
            try:
                exchange.send(self._config(), body, timeout)
                if body.get("stream"):
                    return exchange, exchange.first(timeout)
                return exchange, exchange.whole(timeout)
            except _ConnectFailed as exc:
                exchange.close()
                pool.failed(upstream, str(exc))
                failure = exc
            except BaseException:
                exchange.close()
                raise
        raise UpstreamError(f"Remote model {model_id}: the connection failed before the "
                            f"first byte ({failure}) on "
                            f"{'both upstreams tried' if len(tried) > 1 else 'its only usable upstream'}")

    # --- pools and probes ------------------------------------------------------------

    def _pool(self, model_id: str) -> Pool:
        """The model's pool, made or brought up to date from its stored upstreams."""
        specs = self._registry.definition(model_id).get("upstreams") or []
        with self._lock:
            self._keys.update(s["api_key"] for s in specs if s.get("api_key"))
            pool = self._pools.get(model_id)
            if pool is None:
                pool = self._pools[model_id] = Pool(model_id, specs)
                if self._prober is None and not self._closed.is_set():
                    self._prober = threading.Thread(target=self._probe_loop, daemon=True,
                                                    name="localrt-probes")
                    self._prober.start()
                return pool
        pool.configure(specs)
        return pool

    def _remember(self, upstreams: list[dict]) -> None:
        with self._lock:
            self._keys.update(u["api_key"] for u in upstreams if u.get("api_key"))

    def _probe_now(self, pool: Pool, wait: float = FIRST_PROBE_WAIT) -> None:
        """Probe the upstreams due (new ones are) and wait for them at most `wait` s."""
        threads = [self._start_probe(pool, u) for u in pool.due(time.monotonic())]
        deadline = time.monotonic() + wait
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _probe_loop(self) -> None:
        while not self._closed.wait(PROBE_TICK):
            with self._lock:
                pools = list(self._pools.values())
            now = time.monotonic()
            for pool in pools:
                for upstream in pool.due(now):
                    self._start_probe(pool, upstream)

    def _start_probe(self, pool: Pool, upstream: Upstream) -> threading.Thread:
        thread = threading.Thread(target=self._probe, args=(pool, upstream), daemon=True,
                                  name="localrt-probe")
        thread.start()
        return thread

    def _probe(self, pool: Pool, upstream: Upstream) -> None:
        try:
            outcome = probe(self._config(), upstream)
        except Exception as exc:  # noqa: BLE001 - a bad Config (an https proxy) says why
            outcome = Probe(UNHEALTHY, str(exc))
        if outcome.error:  # an upstream's words may quote the key it refused
            outcome = dataclasses.replace(outcome, error=security.redact(outcome.error,
                                                                         self.secrets()))
        pool.probed(upstream, outcome)
