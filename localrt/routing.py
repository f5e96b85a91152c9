"""Routes as data, `Router.match` (a pure function of method and path), and what a
handler takes and gives: `Request` and `Reply`, and the framing of a Server-Sent
Events body (`sse`), which every streamed reply and GET /v1/events use.

A pattern is a path with `{name}` parts, which match one path segment, and
`{name:path}` parts, which match one or more segments (model ids hold `/`).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from localrt.admission import Disconnected, never
from localrt.errors import HTTPError, MethodNotAllowed, NotFound, shown

_PART = re.compile(r"\{(\w+)(?::(path))?\}")


@dataclass(frozen=True)
class Route:
    """One endpoint: method, path pattern, handler, the request body's schema file, the
    name of its 200 reply's schema in schemas/replies.json (`$defs`), the largest
    body it takes (None: the app's MAX_BODY; the routes that take images take more),
    the query parameters its handler reads (`Request.query`: each optional, a
    string), and for a route whose body is multipart/form-data instead of JSON, the
    `form`'s bounds (localrt.multipart.Limits): its schema then checks the text fields
    and each file as {filename, content_type, size}, and the handler gets the fields
    with each file as a localrt.multipart.Upload."""

    method: str
    pattern: str
    handler: Callable
    schema: str | None = None
    reply: str | None = None
    max_body: int | None = None
    query: tuple[str, ...] = ()
    form: Any = None
    regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "regex", _compile(self.pattern))


@dataclass(frozen=True)
class Dialect:
    """The routes under `prefix` speak another API (Anthropic's, Ollama's): an error on
    them, from routing, a key check, validation or a handler, takes that API's shape.
    `error_body(err)` builds it from a `localrt.errors.HTTPError`; `error_reply` names its
    schema in schemas/replies.json (`$defs`), which the OpenAPI document gives."""

    prefix: str
    error_body: Callable
    error_reply: str


def dialect_of(path: str, dialects) -> Dialect | None:
    """The dialect whose routes `path` is under, if any."""
    return next((d for d in dialects if path.startswith(d.prefix)), None)


@dataclass
class Request:
    """What a handler sees: plain data, never the WSGI environ. `disconnected()` says
    whether the client has closed its connection: a long request passes it down, so
    its waits give up (localrt.admission)."""

    method: str
    path: str
    params: dict = field(default_factory=dict)
    query: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    body: Any = None
    disconnected: Disconnected = never


@dataclass
class Reply:
    """A handler's answer when a plain 200 JSON body is not enough.

    `body` is JSON-able data, or an iterable of bytes when `content_type` is
    not JSON. `after` runs once the response has been handed to the server.
    """

    body: Any
    status: int = 200
    headers: list = field(default_factory=list)
    content_type: str = "application/json"
    after: Callable[[], None] | None = None


# The Server-Sent Events headers of a streamed reply: never cached, never buffered by a
# proxy (nginx reads X-Accel-Buffering).
STREAM_HEADERS = (("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no"))
SSE_DONE = b"data: [DONE]\n\n"  # OpenAI's end of a stream


def sse(data, event: str | None = None) -> bytes:
    """One Server-Sent Event: `data` as compact UTF-8 JSON, named `event` when given."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(data, ensure_ascii=False).encode("utf-8") + b"\n\n"


def sse_comment(text: str) -> bytes:
    """A Server-Sent Events comment line, which clients ignore (a heartbeat)."""
    return f": {text}\n\n".encode("utf-8")


def _compile(pattern: str) -> re.Pattern:
    out, pos = "", 0
    for m in _PART.finditer(pattern):
        out += re.escape(pattern[pos:m.start()])
        out += f"(?P<{m.group(1)}>.+?)" if m.group(2) else f"(?P<{m.group(1)}>[^/]+)"
        pos = m.end()
    # DOTALL: a parameter may hold any character (a model id with a newline must reach
    # its handler, which refuses it by name, not be "no such endpoint").
    return re.compile(out + re.escape(pattern[pos:]) + r"\Z", re.DOTALL)


class Router:
    """Matches (method, path) against the route table, in table order."""

    def __init__(self, routes):
        self.routes = tuple(routes)

    def match(self, method: str, path: str) -> tuple[Route, dict]:
        """Return (route, path parameters); raise NotFound, or MethodNotAllowed with Allow."""
        if method == "HEAD":
            method = "GET"
        for route in self.routes:
            if route.method == method:
                m = route.regex.match(path)
                if m:
                    return route, m.groupdict()
        allowed = self.allowed_methods(path)
        if allowed:
            raise MethodNotAllowed(f"Method {shown(method)} is not allowed on {shown(path)}; "
                                   f"allowed: {', '.join(allowed)}", allowed)
        raise NotFound(f"No such endpoint: {shown(path)}")

    def pattern(self, method: str, path: str) -> str | None:
        """The pattern of the route `match` takes, else of the first route on `path` (a
        405, an OPTIONS); None when no route has the path."""
        if method == "HEAD":
            method = "GET"
        found = None
        for route in self.routes:
            if route.regex.match(path):
                if route.method == method:
                    return route.pattern
                found = found or route.pattern
        return found

    def allowed_methods(self, path: str) -> list[str]:
        """Every method some route accepts on `path` (GET brings HEAD), or [] if none."""
        methods = []
        for route in self.routes:
            if route.method not in methods and route.regex.match(path):
                methods.append(route.method)
        if "GET" in methods:
            methods.append("HEAD")
        return methods


# --- streamed replies ---------------------------------------------------------------


log = logging.getLogger(__name__)


def stream_error(exc: BaseException, model_id: str) -> dict:
    """The {"error": ...} event that ends a stream broken part way: an HTTPError's own
    code and message (a model stopped mid-reply, an upstream that broke off); anything
    else is logged and said as generation_failed, its text kept out of the reply."""
    if isinstance(exc, HTTPError):
        return {"error": exc.body()["error"]}
    log.error("generation failed in a stream of %s", model_id, exc_info=exc)
    return {"error": {"message": f"Generation failed part way through the reply of model "
                                 f"{model_id}; the server log has the details",
                      "type": "server_error", "code": "generation_failed"}}


class EventStream:
    """A streamed reply as OpenAI writes it: Server-Sent Events of chunk dicts, then
    [DONE]. Subclasses give `chunks()` (one {"error"} dict ends a broken one) and
    `close()`, which the server calls once when the reply ends or the client goes away."""

    content_type = "text/event-stream"

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.chunks():
            yield sse(chunk)
        yield SSE_DONE

    def chunks(self) -> Iterator[dict]:
        """The reply's chunk dicts."""
        raise NotImplementedError

    def close(self) -> None:
        """Free what the reply holds."""
        raise NotImplementedError
