"""Remote models: requests forwarded to OpenAI-compatible servers, the upstreams.

A remote model is a registry entry (localrt.models.registry) with no files and a list of
upstreams, `{"url", "model"?, "api_key"?, "max_inflight"?}`: vLLM or SGLang on GPU
hosts, llama.cpp's llama-server, llama-cpp-python's server, another localrt. Its
engine is the catalog's `remote` row (localrt.engines.catalog), whose adapter is
`RemoteEngine`: nothing is loaded, and localrt.inference.requests hands a remote
model's chat, completion or embedding request here whole.

  Remotes   registration (POST /v1/models/remote, a PATCH of the upstreams), the status
            rows, the probe thread, and forwarding a request (`forward`)
  Exchange  one request on the wire to one upstream; `close()` hangs up
  RemoteStream  a streamed reply, the upstream's events as they come

Which upstream takes a request, and their health, is localrt.remote.upstreams
(`Pool`); the kind's admission bounds how many requests wait. A connection that
fails before the first byte takes its upstream out at once and is retried once on
another.

The request goes out as it came, with `model` rewritten to the upstream's name; each
reply (each event of a stream, passed on as it comes) carries localrt's id instead.
Errors: 502 when an upstream fails (a 401 or 403 says it refused localrt's key, in
the upstream's own words), 504 when no first byte comes within upstreamTimeout, 503
when no upstream is healthy; a stream that breaks after its first byte ends with an
error event, never silently. Upstream keys are secrets: records never show them
(localrt.models.registry), and `secrets()` feeds the redaction of logs and error
bodies (localrt.security). Connections go through localrt.outbound, with the
Config's proxy, no_proxy and TLS flags.
"""

from __future__ import annotations

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
from typing import Callable, Iterable, Iterator, Mapping

from localrt import security
from localrt.engines.catalog import REMOTE_ENGINE
from localrt.errors import (BadRequest, Conflict, HTTPError, InvalidField,
                            ServiceUnavailable, UpstreamError, shown)
from localrt.models.ids import check_new_id, folder_name
from localrt.metrics import Clock
from localrt.outbound import (CertificateFailed, ProxyAuthFailed, build_opener, origin,
                              proxy_refused)
from localrt.routing import EventStream, stream_error
from localrt.admission import Admission, Disconnected, never
from localrt.remote.upstreams import (FIRST_PROBE_WAIT, PROBE_TICK, UNHEALTHY, Pool, Probe,
                                      Upstream, UpstreamKeyRefused, UpstreamRejected,
                                      UpstreamTimeout, is_this_server, parse_upstreams,
                                      probe, reason_of, answer_of, request_to, text_of,
                                      timed_out)

log = logging.getLogger(__name__)

DONE = b"[DONE]"  # the data of the event that ends an OpenAI stream


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



def _hastext_of(choice) -> bool:
    """Whether a streamed choice carries a piece of the reply (text, or a call's)."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content") or delta.get("tool_calls"))
    return bool(choice.get("text"))



# --- one request on the wire --------------------------------------------------------


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
            self._resp = opener.open(request_to(self.upstream, self.path, payload),
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
        if any(_hastext_of(c) for c in data.get("choices") or ()):
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
        if not timed_out(exc):
            self.pool.failed(self.upstream, f"a stream broke: {reason_of(exc)}")
        message = security.redact(f"Upstream {self.upstream.url} broke off the reply: "
                                  f"{reason_of(exc)}", self._secrets())
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
        where, said = self.upstream.url, security.redact(answer_of(exc), self._secrets())
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
        if timed_out(exc):
            return UpstreamTimeout(f"Upstream {where} of remote model {self.model_id} {what} "
                                   f"within {timeout:g} s (upstreamTimeout)")
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, ssl.SSLCertVerificationError):
            self.pool.failed(self.upstream, f"TLS: {reason.verify_message}")
            return CertificateFailed(f"TLS certificate check failed for {where}: "
                                     f"{reason.verify_message}")
        if isinstance(reason, (OSError, http.client.HTTPException)):
            return _ConnectFailed(f"{where}: {reason_of(exc)}")
        return UpstreamError(f"Upstream {where} of remote model {self.model_id} cannot be "
                             f"reached: {reason_of(exc)}")


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
                 timeout: Callable[[], float], secrets: Callable[[], Iterable[str]] = list,
                 address: Callable[[], tuple[str, int]] | None = None):
        self._registry = registry
        self._address = address  # (host, port) this server listens on, to refuse itself
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
        model_id = check_new_id(text_of(body["id"], "id"), "id")
        text_of(body.get("name"), "name")
        upstreams = self._not_itself(parse_upstreams(body["upstreams"]))
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
        upstreams = self._not_itself(parse_upstreams(changes["upstreams"]))
        self._remember(upstreams)
        record = self._registry.update(model_id, {**changes, "upstreams": upstreams})
        self._probe_now(self._pool(model_id))
        return record

    def _not_itself(self, upstreams: list[dict]) -> list[dict]:
        """`upstreams`; a 400 naming the first that is this server itself."""
        if self._address is not None:
            host, port = self._address()
            for i, entry in enumerate(upstreams):
                if is_this_server(entry["url"], host, port):
                    raise InvalidField(
                        f"Invalid field 'upstreams[{i}].url': {shown(entry['url'])} is this "
                        f"server itself, so each request to the remote model would come back "
                        f"to it; give another server's URL", param=f"upstreams[{i}].url")
        return upstreams

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
                path: str = "/chat/completions", clock: Clock | None = None,
                disconnected: Disconnected = never):
        """Forward a request to `path` of an upstream's OpenAI API (chat completions,
        completions, embeddings): the reply dict, or a RemoteStream. It counts in the
        calling service's `admission` (localrt.admission.Admission) until it ends;
        `clock` times and counts it in /metrics; a wait for an upstream with room ends
        when `disconnected()` says the client has gone."""
        pool = self._pool(record["id"])
        admission.enter(disconnected)
        try:
            exchange, first = self._exchange(pool, record["id"], body, path, clock,
                                             disconnected)
        except BaseException:
            admission.leave()
            raise
        exchange.on_close(admission.leave)
        if body.get("stream"):
            return RemoteStream(exchange, first)
        exchange.close()
        return first

    def _exchange(self, pool: Pool, model_id: str, body: dict, path: str, clock,
                  disconnected: Disconnected = never):
        """(Exchange, its first event or whole reply); a connection that fails before the
        first byte is retried once on another upstream."""
        timeout = float(self._timeout())
        tried: list[Upstream] = []
        failure = None
        while len(tried) < 2:
            try:
                upstream = pool.acquire(tried, timeout, disconnected)
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
