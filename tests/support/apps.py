"""The app in process: requests through wsgiref.validate, with no socket, and the
check that every JSON reply matches the schema GET /openapi.json documents for it."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from wsgiref.util import setup_testing_defaults
from wsgiref.validate import validator

from localrt.app import App
from localrt.errors import HTTPError
from localrt.routing import dialect_of


@dataclass
class Response:
    status: int
    headers: dict
    body: bytes

    @property
    def json(self):
        return json.loads(self.body)


def call(app, method, path, json_body=None, body=None, headers=None, query="") -> Response:
    """Drive the app through wsgiref.validate, with no socket."""
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "SCRIPT_NAME": "",
               "QUERY_STRING": query}
    headers = dict(headers or {})
    if json_body is not None:
        body = json.dumps(json_body).encode()
        headers.setdefault("Content-Type", "application/json")
    if body is not None:
        environ["CONTENT_LENGTH"] = str(len(body))
        environ["wsgi.input"] = io.BytesIO(body)
    for name, value in headers.items():
        key = name.upper().replace("-", "_")
        if key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            environ[key] = value
        else:
            environ["HTTP_" + key] = value
    setup_testing_defaults(environ)
    captured = {}

    def start_response(status, response_headers, exc_info=None):
        captured["status"] = int(status.split()[0])
        captured["headers"] = response_headers
        return lambda data: None

    result = validator(app)(environ, start_response)
    try:
        data = b"".join(result)
    finally:
        result.close()
    names = [k.lower() for k, _ in captured["headers"]]
    assert len(names) == len(set(names)), f"duplicate headers: {captured['headers']}"
    response = Response(captured["status"], {k.lower(): v for k, v in captured["headers"]},
                        data)
    check_documented(app, method, path, response)
    return response


def bind(app):
    """call(...) bound to `app`: api("GET", "/v1/models")."""
    def api(*args, **kwargs):
        return call(app, *args, **kwargs)

    return api


def check_documented(app, method, path, response) -> None:
    """Every JSON reply a test sees matches the schema GET /openapi.json documents for it:
    the route's reply schema for a 200, schemas/error.json (or its dialect's error
    schema) for an error."""
    if not isinstance(app, App) or method in ("HEAD", "OPTIONS") or \
            not response.headers.get("content-type", "").startswith("application/json"):
        return
    if response.status >= 400:
        dialect = dialect_of(path, app.dialects)
        problems = app.validators.reply_errors(dialect.error_reply if dialect else "error",
                                               response.json)
    else:
        try:
            route, _ = app.router.match(method, path)
        except HTTPError:  # a path this app's table does not have: nothing documents it
            return
        if route.reply is None:
            return
        problems = app.validators.reply_errors(route.reply, response.json)
    assert not problems, f"{method} {path} replied {response.status} against its " \
        f"documented schema: {problems[:3]}"


def events(r) -> list:
    """The data of each Server-Sent Event in a reply, [DONE] included."""
    out = []
    for block in r.body.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
