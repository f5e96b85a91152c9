"""The WSGI application: request parsing, validation, CORS, the one error boundary, and
the count of every request (localrt.metrics) once its reply's body is closed.

`create_app(settings)` builds it; nothing here is module-level state, so two
apps can live in one process. Routes and handlers are in `localrt.api`, the domain
objects they use are built by `localrt.services.build_services`.
"""

from __future__ import annotations

import json
import logging
import re
import time
from array import array
from http import HTTPStatus
from itertools import accumulate
from typing import Iterable
from urllib.parse import parse_qsl

from localrt import security
from localrt.admission import ClientGone, never
from localrt.errors import (BadRequest, Forbidden, HTTPError, InternalError, InvalidJSON,
                            PayloadTooLarge, Unauthorized, UnsupportedMediaType, shown)
from localrt.openapi import document_path
from localrt.routing import Reply, Request, Router, dialect_of
from localrt.services import build_services
from localrt.settings import Settings

log = logging.getLogger(__name__)

MAX_BODY = 1024 * 1024  # bytes; larger request bodies get a 413
# Arrays and objects nested deeper than this are a 400 before the body is parsed: json
# and jsonschema recurse once a level, and Python's recursion stops near 1,000.
MAX_DEPTH = 64
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
PREFLIGHT_MAX_AGE = "600"
# Anthropic's clients send their key as x-api-key, with anthropic-version (and -beta).
ALLOWED_REQUEST_HEADERS = ("Content-Type, Authorization, X-Api-Key, Anthropic-Version, "
                           "Anthropic-Beta")


class App:
    """The localrt WSGI callable."""

    def __init__(self, settings: Settings, routes=None, shutdown=None, hardware=None,
                 run_probe=None, dialects=None, limits=None):
        if routes is None:
            from localrt.api import DIALECTS, ROUTES as routes
            dialects = DIALECTS if dialects is None else dialects
        self.router = Router(routes)
        self.dialects = tuple(dialects or ())
        # Each route's label in the request metrics: its path as the OpenAPI document writes it.
        self._route_labels = {r.pattern: document_path(r.pattern) for r in self.router.routes}
        self.services = build_services(settings, shutdown=shutdown, hardware=hardware,
                                       run_probe=run_probe, limits=limits)
        self.validators = self.services.validators

    def __call__(self, environ, start_response):
        arrived = time.monotonic()
        origin = environ.get("HTTP_ORIGIN")
        cors_on = self.services.config.cors_enabled()
        allowed_origin = origin if cors_on and origin and \
            self.services.config.origin_allowed(origin) else None
        try:
            reply = self._dispatch(environ, cors_on, allowed_origin)
        except HTTPError as err:
            # Messages can quote what upstream said; secrets never leave in them.
            reply = Reply(security.redact_data(self._error_body(environ, err),
                                               self.services.secrets()),
                          err.status, err.headers)
        except Exception:
            log.exception("unexpected error on %s %s", environ.get("REQUEST_METHOD"),
                          environ.get("PATH_INFO"))
            err = InternalError("Internal server error; the server log has the details")
            reply = Reply(self._error_body(environ, err), err.status)
        headers = list(reply.headers)
        if cors_on:
            headers.append(("Vary", "Origin"))
            if allowed_origin:
                headers.append(("Access-Control-Allow-Origin", allowed_origin))
        if reply.content_type == "application/json":
            data = b"" if reply.status == 204 else json.dumps(
                reply.body, ensure_ascii=False).encode("utf-8")
            chunks: Iterable[bytes] = [data]
            headers.append(("Content-Length", str(len(data))))
        else:
            chunks = reply.body
        if reply.status != 204:
            headers.append(("Content-Type", reply.content_type))
        start_response(_STATUS_LINES[reply.status], headers)
        if environ.get("REQUEST_METHOD") == "HEAD":
            chunks = []

        def count():  # once the body is sent: a stream is counted when it ends
            method = environ.get("REQUEST_METHOD", "").upper()
            self.services.metrics.observe_request(method, self._route_of(method, environ),
                                                  reply.status, time.monotonic() - arrived)

        return _Body(chunks, reply.after, count)

    def _dispatch(self, environ, cors_on: bool, allowed_origin: str | None) -> Reply:
        method = environ["REQUEST_METHOD"].upper()
        path = _path(environ)
        host = environ.get("HTTP_HOST")
        if security.is_loopback(self.services.settings["apiServerHost"]) and \
                not security.loopback_host(host):
            # DNS rebinding: a page on evil.example whose name now points at 127.0.0.1
            # sends Host: evil.example. A server only on loopback is never that host, and
            # a request that names no host, or two, is not one for it either.
            named = f"Host {shown(host)}" if host else "A request with no Host header"
            raise Forbidden(f"{named} is not this server: it listens on loopback, so "
                            f"use localhost or 127.0.0.1")
        preflight = method == "OPTIONS" and "HTTP_ORIGIN" in environ and \
            "HTTP_ACCESS_CONTROL_REQUEST_METHOD" in environ
        keys = self.services.settings["apiKeys"]
        # A browser never sends credentials with a preflight, so it cannot need a key.
        if keys and not security.is_open(path) and not preflight and \
                not security.key_accepted(environ.get("HTTP_AUTHORIZATION"), keys,
                                          environ.get("HTTP_X_API_KEY")):
            sent = environ.get("HTTP_AUTHORIZATION") or environ.get("HTTP_X_API_KEY")
            raise Unauthorized("An API key is required: send 'Authorization: Bearer <key>' "
                               "(or 'x-api-key: <key>') with a key from apiKeys (or "
                               "LOCALRT_API_KEY)" if not sent else
                               "The API key was not accepted",
                               headers=[("WWW-Authenticate", 'Bearer realm="localrt"')])
        if method == "OPTIONS":
            return self._options(environ, path, cors_on, allowed_origin)
        route, params = self.router.match(method, path)
        origin = environ.get("HTTP_ORIGIN")
        if method not in SAFE_METHODS and origin and not allowed_origin and \
                origin != f"{environ.get('wsgi.url_scheme', 'http')}://{environ.get('HTTP_HOST')}":
            # A page elsewhere can send a "simple" POST with no preflight (a pull, say);
            # the browser would hide the answer, but the request would still act.
            raise Forbidden(f"Cross-origin {method} from {shown(origin)} refused; add the "
                            f"origin to allowed_origins and turn cors on")
        if route.form is not None:  # read, and its fields validated, there
            body = _read_form(environ, route, self.validators)
        else:
            body = _read_body(environ, method, route.max_body or MAX_BODY)
            if route.schema is not None:
                body = {} if body is _NO_BODY else body
                self.validators.validate(route.schema, body)
            elif body is _NO_BODY or body == {}:
                body = None
            else:
                raise BadRequest(f"{route.method} {path} takes no request body")
        # waitress's look at the connection (localrt.connections reads ahead for it);
        # another server's request cannot be seen to end early.
        disconnected = environ.get("waitress.client_disconnected") or never
        request = Request(method=method, path=path, params=params,
                          query=_query(environ),
                          headers=_headers(environ), body=body, disconnected=disconnected)
        result = route.handler(self.services, request)
        return result if isinstance(result, Reply) else Reply(result)

    def _options(self, environ, path, cors_on, allowed_origin) -> Reply:
        allowed = self.router.allowed_methods(path)
        if not allowed:
            self.router.match("OPTIONS", path)  # raises the 404
        allowed = allowed + ["OPTIONS"]
        headers = [("Allow", ", ".join(allowed))]
        origin = environ.get("HTTP_ORIGIN")
        preflight = origin and "HTTP_ACCESS_CONTROL_REQUEST_METHOD" in environ
        if cors_on and preflight:
            if not allowed_origin:
                raise Forbidden(f"Origin {shown(origin)} is not allowed; add it to "
                                f"allowed_origins")
            requested = environ.get("HTTP_ACCESS_CONTROL_REQUEST_HEADERS")
            headers += [("Access-Control-Allow-Methods", ", ".join(allowed)),
                        ("Access-Control-Allow-Headers", requested or ALLOWED_REQUEST_HEADERS),
                        ("Access-Control-Max-Age", PREFLIGHT_MAX_AGE)]
        return Reply(None, 204, headers)

    def _error_body(self, environ, err: HTTPError) -> dict:
        """The error's JSON body in the shape its route's API speaks (localrt's by default)."""
        dialect = dialect_of(environ.get("PATH_INFO", ""), self.dialects)
        return dialect.error_body(err) if dialect else err.body()

    def _route_of(self, method: str, environ) -> str | None:
        """The label of the route a request was for; None when no route has its path."""
        try:
            pattern = self.router.pattern(method, _path(environ))
        except BadRequest:
            return None
        return self._route_labels.get(pattern)

    def close(self) -> None:
        """End event streams, stop download tasks (their part files stay), unload models."""
        self.services.close()


def create_app(settings: Settings, **kwargs) -> App:
    """Build the WSGI app for these settings."""
    return App(settings, **kwargs)


class _Body:
    """A response body that, when the server closes it, runs the reply's `after`, then
    counts the request."""

    def __init__(self, chunks, after, count):
        self._chunks, self._after, self._count = chunks, after, count

    def __iter__(self):
        return iter(self._chunks)

    def close(self):
        try:
            if hasattr(self._chunks, "close"):
                self._chunks.close()
        finally:
            try:
                if self._after is not None:
                    self._after()
            finally:
                self._count()


_STATUS_LINES = {s.value: f"{s.value} {s.phrase}" for s in HTTPStatus}
_STATUS_LINES[ClientGone.status] = f"{ClientGone.status} Client Closed Request"  # nginx's


def _query(environ) -> dict:
    qs = environ.get("QUERY_STRING")
    return dict(parse_qsl(qs)) if qs else {}


def _path(environ) -> str:
    # PEP 3333 hands PATH_INFO over as latin-1; the URL itself was UTF-8.
    raw = environ.get("PATH_INFO", "") or "/"
    try:
        return raw.encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise BadRequest("The request path is not valid UTF-8") from None


def _headers(environ) -> dict:
    out = {k[5:].replace("_", "-").lower(): v for k, v in environ.items() if k.startswith("HTTP_")}
    if environ.get("CONTENT_TYPE"):
        out["content-type"] = environ["CONTENT_TYPE"]
    return out


_NO_BODY = object()  # no request body at all, as opposed to a JSON null


def _read_form(environ, route, validators) -> dict:
    """A multipart/form-data body (localrt.multipart) within the route's max_body, its
    fields (and each file as {filename, content_type, size}) checked against the
    route's schema: the fields, each file an Upload."""
    from localrt import multipart

    ctype = environ.get("CONTENT_TYPE", "")
    if ctype.split(";", 1)[0].strip().lower() != "multipart/form-data":
        raise UnsupportedMediaType(f"{route.method} {route.pattern} takes a "
                                   f"multipart/form-data body (got "
                                   f"{shown(ctype.split(';', 1)[0]) if ctype else 'none'})")
    limit = route.max_body or MAX_BODY
    data = _read_bytes(environ, _content_length(environ), limit)
    form = multipart.read(data, ctype, route.form)
    shown_files = {name: {"filename": f.filename, "content_type": f.content_type,
                          "size": len(f.data)} for name, f in form.files.items()}
    if route.schema is not None:
        validators.validate(route.schema, {**form.fields, **shown_files})
    return {**form.fields, **form.files}


def _content_length(environ) -> int:
    """The request's Content-Length (0 when absent); a 400 when it is not a number."""
    raw_length = environ.get("CONTENT_LENGTH", "")
    try:
        return int(raw_length) if raw_length else 0
    except ValueError:
        raise BadRequest(f"Invalid Content-Length: {shown(raw_length)}") from None


def _read_bytes(environ, length: int, limit: int) -> bytes:
    """The body's bytes (`length` of them, or a chunked body's to its end); a 413 past
    `limit`, said before reading when Content-Length already says so."""
    if length > limit:
        raise PayloadTooLarge(f"Request body is {length} bytes; the limit is {limit}")
    stream = environ["wsgi.input"]
    data = stream.read(length) if length else stream.read(limit + 1)
    if len(data) > limit:
        raise PayloadTooLarge(f"Request body is over the limit of {limit} bytes")
    return data


def _read_body(environ, method: str, limit: int = MAX_BODY):
    """The parsed JSON body, or _NO_BODY; a 413 past `limit` bytes, a 400 for arrays and
    objects nested deeper than MAX_DEPTH."""
    ctype = environ.get("CONTENT_TYPE", "")
    media = ctype.split(";", 1)[0].strip().lower()
    length = _content_length(environ)
    chunked = "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()
    has_body = length > 0 or chunked
    # A body, or any Content-Type on an unsafe method, must be JSON: this also
    # stops cross-site "simple" form and text/plain POSTs. A body with no Content-Type
    # at all is read as JSON when no Origin came with it (litellm's Ollama providers
    # send none, and Ollama never looks): a browser sends Origin with every cross-site
    # POST, so the check still stands where it is needed.
    untyped = not ctype and not environ.get("HTTP_ORIGIN")
    if (has_body or (ctype and method not in SAFE_METHODS)) and media != "application/json" \
            and not untyped:
        shown_media = shown(media) if media else "none"
        raise UnsupportedMediaType(
            f"Request bodies must be sent with Content-Type: application/json (got "
            f"{shown_media})")
    if not has_body:
        return _NO_BODY
    data = _read_bytes(environ, length, limit)
    if not data:
        return _NO_BODY
    try:
        # As json.loads(bytes) reads it: UTF-8, or UTF-16/32 by the bytes it starts with.
        text = data.decode(json.detect_encoding(data), "surrogatepass")
        body = json.loads(text, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise InvalidJSON("Request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise InvalidJSON(f"Malformed JSON in request body: {exc.msg} "
                          f"at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:  # json's own guard, near 1,000 levels: never a 500
        raise _too_deep() from None
    check_depth(text)
    return body


# A JSON string (the body has parsed, so each one ends) and what is not a bracket: both
# linear, neither can backtrack. Then each bracket is a step in or out, as signed bytes.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def check_depth(text: str, limit: int = MAX_DEPTH) -> None:
    """A 400 when a JSON text that parsed nests arrays and objects more than `limit`
    deep. No recursion and no Python loop over its characters: its strings and all but
    its brackets are taken out, and the deepest running sum of the steps is the depth."""
    if text.count("[") + text.count("{") <= limit:
        return
    brackets = _NOT_BRACKETS.sub("", _STRING.sub("", text)).encode("ascii")
    if max(accumulate(array("b", brackets.translate(_STEPS))), default=0) > limit:
        raise _too_deep(limit)


def _too_deep(limit: int = MAX_DEPTH) -> BadRequest:
    return BadRequest(f"Request body nests arrays and objects deeper than the limit of "
                      f"{limit} levels")


def _reject_constant(name: str):
    raise json.JSONDecodeError(f"{name} is not valid JSON", name, 0)
