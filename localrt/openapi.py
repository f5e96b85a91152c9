"""The OpenAPI 3.1 document, made from the route table and `schemas/`; never written by hand.

`GET /openapi.json` serves it. Each route's summary is its handler's docstring, its
request body is the schema file the route names, its 200 reply the `$defs` entry of
schemas/replies.json the route names, and every error is schemas/error.json.
The schema files become `components.schemas`, named by their file name without
`.json`; a `$ref` from one file to another ("model-update.json#/properties/ctx_len")
becomes a reference inside the document.
"""

from __future__ import annotations

import re

from localrt import __version__, schemas, web
from localrt.routing import dialect_of

_PARAM = re.compile(r"\{(\w+)(?::path)?\}")
# Routes whose 200 reply is a stream of Server-Sent Events rather than JSON.
EVENT_STREAMS = {("GET", "/v1/events"), ("POST", "/v1/chat/completions"),
                 ("POST", "/v1/completions"), ("POST", "/v1/responses"),
                 ("POST", "/v1/messages")}
# What one event of such a stream is, as OpenAPI 3.1 has `schema` describe each event
# (and schemathesis reads it): the fields of its lines; `data` is a JSON chunk of the
# route's reply schema (the -chunk one in replies.json), or [DONE]; /v1/responses and
# /v1/messages send typed events (`event:` lines; replies.json's response-event and
# anthropic-stream-event), /v1/responses without [DONE].
SERVER_SENT_EVENT = {"type": "object", "properties": {
    "data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
    "retry": {"type": "integer"}}}
# Routes whose 200 reply is newline-delimited JSON unless the request asks for one
# object (Ollama's "stream": false), and the replies.json `$defs` entry each line is;
# the document gives such a stream as the array of its lines.
NDJSON_STREAMS = {("POST", "/api/chat"): "ollama-chat-line",
                  ("POST", "/api/generate"): "ollama-generate-line",
                  ("POST", "/api/pull"): "ollama-status-line"}
NDJSON = "application/x-ndjson"
# Routes whose 200 reply is text (or the page's icon), by its media types.
TEXT_REPLIES = {("GET", "/metrics"): ("text/plain; version=0.0.4",),
                ("GET", "/"): (web.MEDIA_TYPES[".html"],),
                ("GET", "/web/{name}"): tuple(sorted(set(web.MEDIA_TYPES.values())))}


def document(routes, dialects=()) -> dict:
    """The whole OpenAPI document for `routes` (localrt.api.ROUTES); errors on a
    dialect's routes have its error schema (localrt.api.DIALECTS)."""
    paths: dict = {}
    seen: dict[str, int] = {}
    for route in routes:
        path = document_path(route.pattern)
        name = route.handler.__name__
        seen[name] = seen.get(name, 0) + 1
        operation = {
            "operationId": name if seen[name] == 1 else f"{name}_{seen[name]}",
            "summary": (route.handler.__doc__ or name).strip().splitlines()[0],
            "responses": {"200": _success(route),
                          "default": _error_response(dialect_of(route.pattern, dialects))},
        }
        params = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                  for p in _PARAM.findall(route.pattern)]
        params += [{"name": q, "in": "query", "required": False, "schema": {"type": "string"}}
                   for q in route.query]
        if params:
            operation["parameters"] = params
        if route.schema:
            # A body may be left out when the schema requires nothing of it (it reads as {}).
            operation["requestBody"] = {
                "required": _needs_body(schemas.load(route.schema)),
                "content": {"multipart/form-data" if route.form is not None
                            else "application/json": {"schema": _ref(route.schema)}}}
        paths.setdefault(path, {})[route.method.lower()] = operation
    components = {_component(name): _local(schemas.load(name), name)
                  for name in schemas.names()}
    return {"openapi": "3.1.0",
            "info": {"title": "localrt", "version": __version__,
                     "description": "A local model runtime: configuration, engines, models "
                                    "and OpenAI-compatible chat completions, text "
                                    "completions and embeddings."},
            "paths": paths,
            "components": {"schemas": components}}


def document_path(pattern: str) -> str:
    """A route pattern as the document writes its path: "{model_id:path}" -> "{model_id}"."""
    return _PARAM.sub(r"{\1}", pattern)


def _needs_body(schema: dict) -> bool:
    """Whether a schema requires a field: itself, or each branch of its if/then/else."""
    if schema.get("required"):
        return True
    return "if" in schema and all(_needs_body(schema.get(k, {})) for k in ("then", "else"))


def _success(route) -> dict:
    body = {"schema": _ref("replies.json", f"/$defs/{route.reply}")} if route.reply else \
        {"schema": {}}
    if (route.method, route.pattern) in EVENT_STREAMS:
        content = {"text/event-stream": {"schema": SERVER_SENT_EVENT}}
        if route.reply:  # JSON unless the request asked for a stream
            content["application/json"] = body
        return {"description": "Server-Sent Events", "content": content}
    line = NDJSON_STREAMS.get((route.method, route.pattern))
    if line:
        content = {NDJSON: {"schema": {"type": "array",
                                       "items": _ref("replies.json", f"/$defs/{line}")}}}
        if route.reply:  # JSON when the request asked for one object
            content["application/json"] = body
        return {"description": "Newline-delimited JSON", "content": content}
    text = TEXT_REPLIES.get((route.method, route.pattern))
    if text:
        return {"description": "OK", "content": {t: {"schema": {"type": "string"}} for t in text}}
    return {"description": "OK", "content": {"application/json": body}}


def _error_response(dialect) -> dict:
    schema = _ref("replies.json", f"/$defs/{dialect.error_reply}") if dialect else \
        _ref("error.json")
    return {"description": "An error", "content": {"application/json": {"schema": schema}}}


def _component(file_name: str) -> str:
    return file_name[:-len(".json")]


def _ref(file_name: str, pointer: str = "") -> dict:
    return {"$ref": f"#/components/schemas/{_component(file_name)}{pointer}"}


def _local(schema, file_name: str):
    """A schema file as a component: no $id or $schema, references made local."""
    if isinstance(schema, dict):
        out = {}
        for key, value in schema.items():
            if key in ("$id", "$schema"):
                continue
            if key == "$ref" and isinstance(value, str):
                target, _, pointer = value.partition("#")
                out.update(_ref(target or file_name, pointer))
            else:
                out[key] = _local(value, file_name)
        return out
    if isinstance(schema, list):
        return [_local(v, file_name) for v in schema]
    return schema
