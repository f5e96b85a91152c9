"""The one HTTP client for localrt's API, over urllib. The CLI uses only this.

Requests go through `_request` (and, for streams, `_stream`); errors are
decoded in one place, `_error`. A client given `start` starts a missing server
on its first request and retries there (the CLI's `Context.client()`).
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any, Callable, Iterator
from urllib.parse import quote

# Seconds an event stream may stay silent before the server counts as gone: many
# times the server's keep-alive interval (localrt.events.HEARTBEAT_SECONDS).
STREAM_TIMEOUT = 60.0
# Seconds to wait for a model to load or for the next token: a big model on a slow
# disk, or a chat queued behind others, takes minutes.
LOAD_TIMEOUT = 600.0


class ApiError(Exception):
    """The server answered with an error; `message` is its own words.

    `body` is the whole decoded error reply, for the extra top-level fields some
    errors carry (`files` on a 400 from a pull, `taskId` on a 409).
    """

    def __init__(self, status: int, message: str, code: str = "", body: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.body = dict(body or {})


class Unreachable(Exception):
    """Nothing answered at the server's address."""


class Client:
    """Calls one localrt server. Proxies are never used: the server is local."""

    def __init__(self, base_url: str, timeout: float = 30.0, api_key: str | None = None,
                 start: Callable[[], str | None] | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.api_key = api_key  # sent as a Bearer token when the server has apiKeys set
        # Called at most once, when the first request finds nothing at base_url: it
        # starts a server and returns its URL, where the request is made again, or
        # returns None and Unreachable is raised. See localrt.cli.context.
        self._start = start
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # --- the API -------------------------------------------------------------

    def get_config(self) -> dict:
        """GET /v1/configs."""
        return self._request("GET", "/v1/configs")

    def update_config(self, changes: dict) -> dict:
        """PATCH /v1/configs with only the given fields."""
        return self._request("PATCH", "/v1/configs", changes)

    def stop_server(self) -> dict:
        """DELETE /v1/system: ask the server to shut down."""
        return self._request("DELETE", "/v1/system")

    def events(self) -> "EventStream":
        """GET /v1/events, open once this returns: iterate it for each event as a dict."""
        return self._stream("GET", "/v1/events")

    def pull_model(self, model_id: str, file: str | None = None) -> dict:
        """POST /v1/models/pull: start a download, or say the model is already there."""
        body = {"model": model_id}
        if file is not None:
            body["file"] = file
        return self._request("POST", "/v1/models/pull", body)

    def model_variants(self, model_id: str) -> dict:
        """POST /v1/models/variants: a built-in's branches or a repo's GGUF models, sized."""
        return self._request("POST", "/v1/models/variants", {"model": model_id})

    def list_pulls(self) -> list:
        """GET /v1/models/pull: the download tasks with their progress."""
        return self._request("GET", "/v1/models/pull")["data"]

    def cancel_pull(self, task_id: str) -> dict:
        """DELETE /v1/models/pull: stop a download; a later pull resumes it."""
        return self._request("DELETE", "/v1/models/pull", {"taskId": task_id})

    def list_models(self) -> list:
        """GET /v1/models: the downloaded and imported models."""
        return self._request("GET", "/v1/models")["data"]

    def get_model(self, model_id: str) -> dict:
        """GET /v1/models/{id}: one model's record."""
        return self._request("GET", _model_path(model_id))

    def remove_model(self, model_id: str) -> dict:
        """DELETE /v1/models/{id}: the model's files and definition."""
        return self._request("DELETE", _model_path(model_id))

    def update_model(self, model_id: str, changes: dict) -> dict:
        """PATCH /v1/models/{id} with only the given stored parameters."""
        return self._request("PATCH", _model_path(model_id), changes)

    def add_remote_model(self, model_id: str, upstreams: list[dict]) -> dict:
        """POST /v1/models/remote: a model served by OpenAI-compatible servers."""
        return self._request("POST", "/v1/models/remote", {"id": model_id,
                                                          "upstreams": upstreams})

    def import_model(self, path: str, model_id: str | None = None,
                     option: str = "symlink", mmproj: str | None = None,
                     lora: list | None = None) -> dict:
        """POST /v1/models/import: register a local GGUF file (`path` is absolute), with
        its vision projector `mmproj` (absolute too) and its LoRA adapters `lora`
        ([{"path", "scale"?}], absolute paths) if given."""
        body = {"path": path, "option": option}
        if model_id is not None:
            body["id"] = model_id
        if mmproj is not None:
            body["mmproj"] = mmproj
        if lora:
            body["lora"] = lora
        return self._request("POST", "/v1/models/import", body)

    def list_engines(self) -> list:
        """GET /v1/engines: every engine with its status, variant and version."""
        return self._request("GET", "/v1/engines")["data"]

    def get_engine(self, engine: str) -> list:
        """GET /v1/engines/{engine}: its installed variants."""
        return self._request("GET", _engine_path(engine))

    def engine_release(self, engine: str, version: str = "latest") -> list:
        """GET /v1/engines/{engine}/releases/{version}: that release's variants for this
        machine and Python, from the package index ("latest": each one's newest)."""
        path = f"{_engine_path(engine)}/releases/{quote(version, safe='')}"
        return self._request("GET", path)

    def install_engine(self, engine: str, version: str | None = None,
                       variant: str | None = None) -> dict:
        """POST /v1/engines/{engine}/install: start installing a variant."""
        return self._request("POST", _engine_path(engine) + "/install",
                             _variant_body(version, variant))

    def install_engine_wheel(self, wheel: str) -> dict:
        """POST /v1/engines/install: a custom engine from a wheel (absolute path or URL)."""
        return self._request("POST", "/v1/engines/install", {"wheel": wheel})

    def uninstall_engine(self, engine: str, version: str | None = None,
                         variant: str | None = None) -> dict:
        """DELETE /v1/engines/{engine}/install."""
        return self._request("DELETE", _engine_path(engine) + "/install",
                             _variant_body(version, variant))

    def use_engine(self, engine: str, variant: str, version: str) -> dict:
        """POST /v1/engines/{engine}/default: the installed variant models load."""
        return self._request("POST", _engine_path(engine) + "/default",
                             {"variant": variant, "version": version})

    def start_model(self, model_id: str, options: dict | None = None) -> dict:
        """POST /v1/models/{id}/start: load a model with these start options."""
        return self._request("POST", _model_path(model_id) + "/start", options or {},
                             timeout=LOAD_TIMEOUT)

    def stop_model(self, model_id: str) -> dict:
        """POST /v1/models/{id}/stop: unload a model."""
        return self._request("POST", _model_path(model_id) + "/stop")

    def models_status(self) -> dict:
        """GET /v1/models/status: the running models, and the machine."""
        return self._request("GET", "/v1/models/status")

    def hardware(self) -> dict:
        """GET /v1/hardware: CPU, OS, RAM, storage and GPUs, in cortex's shape."""
        return self._request("GET", "/v1/hardware")

    def chat(self, request: dict) -> dict:
        """POST /v1/chat/completions, not streamed: the chat.completion."""
        return self._request("POST", "/v1/chat/completions", {**request, "stream": False},
                             timeout=LOAD_TIMEOUT)

    def chat_stream(self, request: dict) -> "EventStream":
        """POST /v1/chat/completions, streamed: an EventStream of chat.completion.chunk."""
        return EventStream(self._open("POST", "/v1/chat/completions",
                                      {**request, "stream": True}, timeout=LOAD_TIMEOUT),
                           self.base_url)

    def completion(self, request: dict) -> dict:
        """POST /v1/completions, not streamed: the text_completion."""
        return self._request("POST", "/v1/completions", {**request, "stream": False},
                             timeout=LOAD_TIMEOUT)

    def embeddings(self, model_id: str, inputs, dimensions: int | None = None) -> dict:
        """POST /v1/embeddings: one embedding per input (a text, or a list of texts)."""
        body = {"model": model_id, "input": inputs}
        if dimensions is not None:
            body["dimensions"] = dimensions
        return self._request("POST", "/v1/embeddings", body, timeout=LOAD_TIMEOUT)

    def rerank(self, model_id: str, query: str, documents: list,
               top_n: int | None = None) -> dict:
        """POST /v1/rerank: the documents' scores against the query, best first."""
        body = {"model": model_id, "query": query, "documents": documents}
        if top_n is not None:
            body["top_n"] = top_n
        return self._request("POST", "/v1/rerank", body, timeout=LOAD_TIMEOUT)

    def transcribe(self, model_id: str, data: bytes, filename: str,
                   response_format: str = "text", stream: bool = False,
                   language: str | None = None, prompt: str | None = None,
                   translate: bool = False):
        """POST /v1/audio/transcriptions (or /translations) of a clip's bytes, sent as a
        multipart/form-data body: the text (text, srt, vtt), the reply dict (json,
        verbose_json), or with `stream` an EventStream of transcript.text.* events."""
        fields = {"model": model_id, "response_format": response_format}
        if stream:
            fields["stream"] = "true"
        if language:
            fields["language"] = language
        if prompt:
            fields["prompt"] = prompt
        body, ctype = multipart_body(fields, "file", filename, data)
        path = "/v1/audio/translations" if translate else "/v1/audio/transcriptions"
        if stream:
            return EventStream(self._open("POST", path, (body, ctype),
                                          timeout=STREAM_TIMEOUT), self.base_url)
        with self._open("POST", path, (body, ctype), timeout=LOAD_TIMEOUT) as resp:
            raw = resp.read()
            kind = resp.headers.get("Content-Type", "")
        if kind.startswith("application/json"):
            return json.loads(raw)
        return raw.decode("utf-8")

    # --- plumbing ------------------------------------------------------------

    def _open(self, method: str, path: str, body: Any = None, timeout: float | None = None):
        start, self._start = self._start, None  # only the first request may start a server
        try:
            return self._open_once(method, path, body, timeout)
        except Unreachable:
            url = start() if start is not None else None
            if url is None:
                raise
        self.base_url = url.rstrip("/")
        return self._open_once(method, path, body, timeout)

    def _open_once(self, method: str, path: str, body: Any = None,
                   timeout: float | None = None):
        data = None
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        ctype = "application/json"
        if isinstance(body, tuple):  # a body already encoded: (bytes, its Content-Type)
            data, ctype = body
        elif body is not None:
            data = json.dumps(body).encode("utf-8")
        if body is not None or method not in ("GET", "HEAD"):
            # Also without a body: some WSGI servers (wsgiref) report a missing
            # Content-Type as text/plain, which the server refuses on unsafe methods.
            headers["Content-Type"] = ctype
        # "%" is safe: ids in paths arrive already quoted (see _model_path).
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

    def _request(self, method: str, path: str, body: Any = None,
                 timeout: float | None = None) -> Any:
        """One request; the decoded JSON reply, or ApiError/Unreachable."""
        with self._open(method, path, body, timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def _stream(self, method: str, path: str, body: Any = None) -> "EventStream":
        """One request whose reply is Server-Sent Events, opened now (not on first read)."""
        return EventStream(self._open(method, path, body, timeout=STREAM_TIMEOUT),
                           self.base_url)


class EventStream:
    """An open Server-Sent Events reply. Iterating yields each event's data, decoded as JSON.

    Opened eagerly, so that no event published after `Client.events()` returns is
    missed. Close it (or use `with`) when done.
    """

    def __init__(self, resp, base_url: str):
        self._resp, self._base_url = resp, base_url
        self._closed = False

    def __iter__(self) -> Iterator[Any]:
        data: list[str] = []
        try:
            for raw in self._resp:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line:  # a blank line ends an event
                    if data == ["[DONE]"]:  # OpenAI's end of a chat stream
                        return
                    if data:
                        yield json.loads("\n".join(data))
                    data = []
                elif line.startswith("data:"):
                    value = line[5:]
                    data.append(value[1:] if value.startswith(" ") else value)
                # comments (": keep-alive") and other fields carry nothing for us
        except (OSError, http.client.HTTPException) as exc:
            if not self._closed:
                raise Unreachable(f"Lost the event stream from the localrt server at "
                                  f"{self._base_url}: {exc}") from None

    def close(self) -> None:
        """Hang up."""
        self._closed = True
        self._resp.close()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def multipart_body(fields: dict, file_field: str, filename: str,
                   data: bytes) -> tuple[bytes, str]:
    """A multipart/form-data body of text fields and one file: (bytes, Content-Type)."""
    import secrets

    boundary = f"localrt-{secrets.token_hex(12)}"
    name = filename.replace('"', "%22").replace("\r", "").replace("\n", "")
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n'
             f'{value}\r\n'.encode("utf-8") for key, value in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{file_field}"; '
                 f'filename="{name}"\r\nContent-Type: application/octet-stream\r\n\r\n'
                 .encode("utf-8") + data + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def _model_path(model_id: str) -> str:
    """/v1/models/{id}, with "/", ":" and "%" in the id quoted so they arrive intact."""
    return "/v1/models/" + quote(model_id, safe="")


def _engine_path(engine: str) -> str:
    return "/v1/engines/" + quote(engine, safe="")


def _variant_body(version: str | None, variant: str | None) -> dict:
    return {k: v for k, v in (("version", version), ("variant", variant)) if v is not None}


def _error(exc: urllib.error.HTTPError) -> ApiError:
    """Decode an error reply: localrt's JSON body, or whatever the server sent."""
    try:
        body = json.loads(exc.read() or b"{}")
        error = body.get("error") or {}
        message = body.get("message") or error.get("message") or exc.reason
        return ApiError(exc.code, str(message), str(error.get("code", "")), body)
    except (ValueError, AttributeError, OSError):
        return ApiError(exc.code, f"HTTP {exc.code} {exc.reason}")
    finally:
        exc.close()
