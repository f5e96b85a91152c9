"""The upstreams of remote models: their health, in-flight counts and probes.

  Upstream  one OpenAI-compatible server of a remote model (its url, upstream model
            name, key and max_inflight), with what probes and requests learned of it
  Pool      one model's upstreams: health, in-flight counts, latency, and the requests
            that wait, in arrival order, for an upstream with room
  probe     GET <url>/models once

Routing, after Envoy's least-request balancing and outlier detection: a request goes
to the usable (healthy, or not probed yet) upstream with the fewest requests in
flight among those under their `max_inflight`; when every one is full it waits in
arrival order, at most `upstreamTimeout` seconds. A failure takes an upstream out at
once (`Pool.failed`), and probes bring it back: every upstream's GET /models every
PROBE_INTERVAL s (PROBE_RETRY s while it is out, and at once after a failure). A slow
answer is not a failure: llama-cpp-python's server answers a probe only between two
replies. A refused or reset connection is, and so are a 5xx answer and a 401 or 403
(the upstream refuses localrt's key; its own words say why). localrt.remote.remotes
forwards the requests.
"""

from __future__ import annotations

import collections
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Iterable, Mapping
from urllib.parse import urlsplit

from localrt import security
from localrt.admission import Disconnected, never, wait
from localrt.outbound import build_opener, origin, proxy_refused
from localrt.engines.catalog import REMOTE_ENGINE
from localrt.errors import BadRequest, HTTPError, InvalidField, ServiceUnavailable, UpstreamError

log = logging.getLogger(__name__)

PROBE_INTERVAL = 10.0   # seconds between probes of a healthy upstream
PROBE_RETRY = 2.0       # ... of one that is out
PROBE_TIMEOUT = 30.0    # a probe unanswered by then is slow (busy), not failed
PROBE_TICK = 0.25       # how often the probe thread looks for upstreams due
FIRST_PROBE_WAIT = 1.0  # how long a registration waits for its first probes
MESSAGE_LIMIT = 300     # characters of an upstream's own error message quoted
ERROR_BODY_LIMIT = 65536

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


def is_this_server(url: str, host: str, port: int) -> bool:
    """Whether an upstream's URL names the server that would forward to it (listening on
    `host`:`port`): its port, and a host that is this server's (its address; loopback
    when it listens there or everywhere; when everywhere, any of this machine's
    addresses). A remote model served by itself would send each request round forever."""
    parts = urlsplit(url)
    try:
        their_port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return False
    if their_port != port or not parts.hostname:
        return False
    own = host.strip("[]").lower()
    everywhere = own in ("", "0.0.0.0", "::")
    own_addresses = _addresses(own, port)
    for address in _addresses(parts.hostname.lower(), port):
        if address in own_addresses or \
                address.is_loopback and (everywhere or security.is_loopback(own)) or \
                everywhere and (address.is_unspecified or _local(address)):
            return True
    return False


def _addresses(host: str, port: int) -> set:
    """A host's IP addresses: its own, a legacy form (2130706433, 127.1), loopback for
    localhost and *.localhost, else as the resolver gives them (none when it cannot)."""
    import ipaddress

    if host in ("", "0.0.0.0", "::"):
        return {ipaddress.ip_address(host or "0.0.0.0")}
    try:
        return {ipaddress.ip_address(host)}
    except ValueError:
        pass
    try:
        return {ipaddress.ip_address(socket.inet_ntoa(socket.inet_aton(host)))}
    except OSError:
        pass
    if security.is_loopback(host):
        return {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return set()
    return {ipaddress.ip_address(info[4][0].split("%")[0]) for info in found}


def _local(address) -> bool:
    """Whether an address is one of this machine's: a socket can be bound to it."""
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((str(address), 0))
        return True
    except OSError:
        return False


def text_of(value, param: str):
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
            text_of(value, f"{param}[{i}].{key}")
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

    def acquire(self, exclude: Iterable[Upstream], timeout: float,
                disconnected: Disconnected = never) -> Upstream:
        """The usable upstream with room and the fewest requests in flight, once this
        request's turn comes; 503 (or 502: keys refused) when none is usable, 504 when
        none had room for `timeout` seconds, ClientGone once `disconnected()`."""
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
                    wait(self._cond, disconnected, left,
                         f"an upstream of remote model {self.model_id} with room")
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




# --- probes and what upstreams say ---------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """What a probe found: `health` None is a slow answer, which changes nothing."""

    health: str | None
    error: str | None = None
    refused_key: bool = False
    latency_ms: float | None = None
    listed: str | None = None


def request_to(upstream: Upstream, path: str, body: bytes | None = None) -> urllib.request.Request:
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
        with build_opener(config, redirects=False).open(request_to(upstream, "/models"),
                                                        timeout=timeout) as resp:
            raw = resp.read(ERROR_BODY_LIMIT)
    except urllib.error.HTTPError as exc:
        if proxy_refused(config, upstream.url, exc.code, exc.headers):
            exc.close()
            return Probe(UNHEALTHY, f"the proxy {origin(config['proxy_url'])} refused its "
                                    f"credentials (HTTP {exc.code})")
        if exc.code in (401, 403):  # the upstream's own words say why (Invalid API key)
            return Probe(UNHEALTHY, f"it refused localrt's key ({answer_of(exc)})", True)
        exc.close()
        if exc.code >= 500:
            return Probe(UNHEALTHY, f"GET /models answered HTTP {exc.code}")
        return Probe(HEALTHY, latency_ms=(time.monotonic() - started) * 1000)  # it answers
    except Exception as exc:  # noqa: BLE001 - every way a connection fails is an outcome
        if timed_out(exc):
            return Probe(None)
        return Probe(UNHEALTHY, reason_of(exc))
    latency = (time.monotonic() - started) * 1000
    try:
        ids = [m["id"] for m in json.loads(raw)["data"] if isinstance(m.get("id"), str)]
    except (ValueError, KeyError, TypeError, AttributeError):
        ids = []
    return Probe(HEALTHY, latency_ms=latency, listed=ids[0] if len(ids) == 1 else None)


def timed_out(exc: BaseException) -> bool:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return isinstance(reason, (socket.timeout, TimeoutError))


def reason_of(exc: BaseException) -> str:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return str(reason) or type(reason).__name__


def answer_of(exc: urllib.error.HTTPError) -> str:
    """An upstream's error answer in a few words: "HTTP 401: Invalid API key"; closed."""
    try:
        message = upstream_message(exc.read(ERROR_BODY_LIMIT))
    except Exception:  # noqa: BLE001 - a body that cannot be read says nothing
        message = ""
    finally:
        exc.close()
    return f"HTTP {exc.code}" + (f": {message}" if message else "")


def upstream_message(raw: bytes) -> str:
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
