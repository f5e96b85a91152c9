"""Ollama's API under /api/: its requests as localrt's, and localrt's replies in its shapes.

Clients that speak only Ollama (Open WebUI, Continue, editors' plugins, the `ollama`
packages) work unchanged. Each route translates onto the machinery the OpenAI routes
use, so there is one generation path:

  POST /api/chat       a chat completion (Chats.create), always streamed inside: its
                       chunks become Ollama's newline-delimited JSON objects, or one
                       object with "stream": false
  POST /api/generate   the prompt (after `system`, with its `images`) as a one-turn
                       chat, so the model's chat template applies and `format` works;
                       with `raw`, or a `suffix`, a text completion
                       (Completions.create) of the raw or fill-in-the-middle prompt
  POST /api/embed      an embeddings request (Embeddings.create)
  POST /api/pull       a pull (Models.pull); its task's progress, from the event bus
                       (EventBus.follow), becomes {status, digest, total, completed} lines;
                       each reply counts in the "pull" admission until it is closed
  DELETE /api/delete   a model delete, stopping the model first if it runs
  GET /api/tags, GET /api/ps, POST /api/show, GET /api/version
                       the registry's records, the scheduler's rows and the GGUF
                       header, in Ollama's shapes

Model names (`resolve`): an Ollama name is name:tag, the shape of a built-in's id
(<name>:<branch>), so a registered id is taken as it is; name:latest is name, and a
built-in's bare name (or name:latest) is its one downloaded variant. Other models keep
their localrt ids. A pull takes any localrt id; name:latest pulls name (the built-in's
default branch), and hf.co/<org>/<repo>[:<quant>] is <org>/<repo>[:<quant>].

Options: num_ctx is the context a model starts with, so it applies when the request
starts the model (clamped to what the model was trained on); a running model keeps its
own, where Ollama would reload it. num_predict is max_tokens (0 or less: no limit
but the context), and temperature, top_p, top_k, min_p, seed, stop and the penalties
are chat's fields. Any other option is ignored. `format` is a response_format:
"json" a JSON object, a schema that schema. `keep_alive` (`keep_alive`) sets how long
the model stays loaded once idle (Scheduler.keep_for): 0 unloads it after the reply,
a negative value keeps it until stopped, and a request without one puts back the
server's keepAlive, as Ollama's default does.

Images (`images` of a chat message, or of /api/generate: base64) become chat's image_url
parts (data: URLs), before the text as Ollama puts them; a model that cannot take them
is refused before it starts, and an error about one names it as Ollama's request does
(messages[0].images[1], /api/generate's images[0]).

Replies carry Ollama's statistics in nanoseconds (`Timer`): measured around the reply,
so total_duration includes waiting for the model; load_duration is the start of a
model that was not running; prompt_eval_duration runs from the model's turn to the
first piece, eval_duration from there to the end. Tool calls come whole, their
arguments an object; one whose arguments are not a JSON object (cut short by
num_predict) is left out.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import re
import time
from datetime import datetime, timedelta, timezone
from typing import Callable, Iterator

from localrt import __version__
from localrt.admission import ClientGone, Disconnected, never
from localrt.engines import toolcalls
from localrt.engines import ggufinfo
from localrt.dialects.common import Fields, native
from localrt.errors import Conflict, HTTPError, InternalError, InvalidField, UpstreamError
from localrt.inference.images import data_url
from localrt.models.registry import capabilities as registry_capabilities, weights_path
from localrt.inference.running import ModelStopped
from localrt.inference.scheduler import ModelNotRunning

log = logging.getLogger(__name__)

VERSION = "0.33.0"  # the Ollama release whose API (docs/api.md) this module follows
LATEST = ":latest"
HUB_PREFIXES = ("hf.co/", "huggingface.co/")  # Ollama's names for a Hugging Face repo
UNLIMITED = 16777216  # max_tokens for "no limit but the context" (completions default to 16)
FOREVER = timedelta(microseconds=(2 ** 63 - 1) // 1000)  # Go's longest Duration, as Ollama
_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|μs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
          "h": 3600.0}
# Ollama's options that are chat's fields of the same name (localrt.inference.chat.SAMPLING).
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty",
            "presence_penalty", "frequency_penalty", "stop")
# Stored parameters as Ollama's Modelfile PARAMETERs name them (POST /api/show).
PARAMETERS = (("ctx_len", "num_ctx"), ("max_tokens", "num_predict"), *(
    (name, name) for name in SAMPLING))
# An OpenAI field's name in a 400, as the Ollama request names it (/api/generate's
# prompt is chat's messages).
# Chat's and completions' names for the fields of their errors, and Ollama's.
FIELDS = Fields((r"response_format.*", "format"), (r"max_tokens", "options.num_predict"))
GENERATE_FIELDS = Fields((r"response_format.*", "format"),
                         (r"max_tokens", "options.num_predict"), (r"messages.*", "prompt"))


def error_body(err: HTTPError) -> dict:
    """An error as Ollama writes it: {"error": message}, with the HTTP status."""
    return {"error": err.message}


def version() -> dict:
    """GET /api/version."""
    return {"version": VERSION, "localrt": __version__}


# --- names and durations -----------------------------------------------------------


def resolve(services, name: str) -> str:
    """The localrt id an Ollama model name means (see the module docstring); a name no
    model has comes back as it is, for the registry's 404."""
    registry = services.registry
    if registry.has(name):
        return name
    base = name[:-len(LATEST)] if name.endswith(LATEST) else name
    if registry.has(base):
        return base
    if "/" in base or ":" in base:
        return name
    repo = f"{services.settings['modelHubOrg']}/{base}".lower()
    variants = sorted(r["id"] for r in registry.list()
                      if _source(r).get("type") == "hub" and _source(r).get("file") is None
                      and str(_source(r).get("repo", "")).lower() == repo)
    if len(variants) > 1:
        raise InvalidField(f"Invalid field 'model': {base} has {len(variants)} downloaded "
                           f"variants ({', '.join(variants)}); name one", param="model")
    return variants[0] if variants else name


def _source(record: dict) -> dict:
    source = record.get("source")
    return source if isinstance(source, dict) else {}


def pull_id(name: str) -> str:
    """The localrt id a pull of an Ollama model name takes."""
    for prefix in HUB_PREFIXES:
        if name.lower().startswith(prefix):
            name = name[len(prefix):]
            break
    return name[:-len(LATEST)] if name.endswith(LATEST) else name


def keep_alive(value) -> float | None:
    """Seconds of a keep_alive (a number of seconds, or a Go duration such as "5m" or
    "1h30m"): math.inf for a negative one (or one past Go's longest), None when left out."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        if body == "0":
            return 0.0
        parts = _DURATION.findall(body)
        if not body or "".join(a + u for a, u in parts) != body:
            raise InvalidField(f"Invalid field 'keep_alive': {value!r} is not a duration; use "
                               f"seconds, or a duration such as \"5m\" or \"1h30m\"",
                               param="keep_alive")
        value = sign * sum(float(a) * _UNITS[u] for a, u in parts)
    return math.inf if value < 0 or value >= FOREVER.total_seconds() else float(value)


def _now() -> str:
    return _stamp(datetime.now(timezone.utc))


def _stamp(when: datetime) -> str:
    """RFC 3339 in UTC, as Ollama writes times."""
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _at(seconds: float) -> str:
    return _stamp(datetime.fromtimestamp(seconds, timezone.utc))


# --- requests ----------------------------------------------------------------------


def sampling(options: dict | None) -> dict:
    """The chat fields of Ollama's options: the sampling ones, and num_predict as max_tokens."""
    options = options or {}
    out = {k: options[k] for k in SAMPLING if options.get(k) is not None}
    for name in ("top_k", "seed"):  # 8.0 passes the schema as an integer
        if name in out:
            out[name] = int(out[name])
    predict = options.get("num_predict")
    if predict is not None and predict > 0:
        out["max_tokens"] = int(predict)
    return out


def start_options(options: dict | None, record: dict) -> dict:
    """The start options of Ollama's options: num_ctx as ctx_len, within the context the
    model was trained on (Ollama clamps it too)."""
    ctx = (options or {}).get("num_ctx")
    if ctx is None:
        return {}
    trained = (record.get("metadata") or {}).get("context_length")
    if isinstance(trained, int) and not isinstance(trained, bool) and trained > 0:
        ctx = min(ctx, trained)
    return {"ctx_len": int(ctx)}


def response_format(fmt) -> dict | None:
    """Ollama's `format` as chat's response_format."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}


def chat_request(model_id: str, body: dict) -> dict:
    """POST /api/chat's body as a streamed chat completion request."""
    out = {"model": model_id, "messages": messages(body.get("messages") or []),
           "stream": True, "stream_options": {"include_usage": True},
           **sampling(body.get("options"))}
    if body.get("tools"):
        out["tools"] = body["tools"]
    fmt = response_format(body.get("format"))
    if fmt:
        out["response_format"] = fmt
    return out


def messages(given: list) -> list:
    """Ollama's messages as OpenAI's: an assistant's calls get ids (their own, else ones
    every family's template takes: 9 letters and digits), and a tool message the id of
    the call it answers (its tool_call_id, else the first unanswered call of its
    tool_name)."""
    out, unanswered, count = [], [], 0
    for i, m in enumerate(given):
        message = {"role": m["role"], "content": content(m.get("content"), m.get("images"))}
        if m["role"] == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = []
            for call in m["tool_calls"]:
                count += 1
                call_id = call.get("id") or f"call{count:05d}"
                function = call["function"]
                message["tool_calls"].append(
                    {"id": call_id, "type": "function",
                     "function": {"name": function["name"],
                                  "arguments": json.dumps(function.get("arguments") or {})}})
                unanswered.append((call_id, function["name"]))
        elif m["role"] == "tool":
            name = m.get("tool_name")
            call_id = m.get("tool_call_id")
            if not call_id:
                match = next((c for c in unanswered if name in (None, c[1])), None)
                count += 1
                call_id = match[0] if match else f"call{count:05d}"
            unanswered = [c for c in unanswered if c[0] != call_id]
            message["tool_call_id"] = call_id
            if name:
                message["name"] = name
        out.append(message)
    return out


def content(text: str | None, images: list | None):
    """A message's content as chat's: its text, or with images (base64) their image_url
    parts first, as Ollama puts them before the text, then the text."""
    if not images:
        return text or ""
    parts = [{"type": "image_url", "image_url": {"url": data_url(b64)}} for b64 in images]
    return parts + ([{"type": "text", "text": text}] if text else [])


def with_images(fields: Fields, request: dict, generate: bool = False) -> Fields:
    """`fields`, and Ollama's path of each image part of a chat request made here:
    messages[i].images[n] (/api/generate's: images[n])."""
    paths = {}
    for i, message in enumerate(request.get("messages") or ()):
        if isinstance(message["content"], list):
            images = [k for k, part in enumerate(message["content"])
                      if part["type"] == "image_url"]
            paths.update((f"messages[{i}].content[{k}]",
                          f"images[{n}]" if generate else f"messages[{i}].images[{n}]")
                         for n, k in enumerate(images))
    return fields.with_paths(paths)


def generate_request(model_id: str, body: dict, record: dict) -> tuple[str, dict]:
    """POST /api/generate's body as ("chat", a chat completion request), or, with raw
    or a suffix, ("completion", a text completion request); both streamed."""
    if body.get("images") and (body.get("raw") or body.get("suffix")):
        raise InvalidField("Invalid field 'images': a raw or fill-in-the-middle prompt is a "
                           "text completion, which takes no images; leave out raw and "
                           "suffix", param="images")
    if body.get("template"):
        raise InvalidField("Invalid field 'template': localrt puts the prompt in the model's "
                           "own chat template; send \"raw\": true with a prompt you put in "
                           "a template yourself", param="template")
    prompt, suffix = body.get("prompt") or "", body.get("suffix")
    options = sampling(body.get("options"))
    if body.get("raw") or suffix:
        if response_format(body.get("format")):
            raise InvalidField("Invalid field 'format': a raw or fill-in-the-middle prompt is a "
                               "text completion, which follows no format", param="format")
        request = {"model": model_id, "prompt": prompt, "stream": True,
                   "stream_options": {"include_usage": True}, **options}
        if suffix:
            request["suffix"] = suffix
        if "max_tokens" not in request and record.get("max_tokens") is None:
            request["max_tokens"] = UNLIMITED
        return "completion", request
    turns = [{"role": "system", "content": body["system"]}] if body.get("system") else []
    turns.append({"role": "user", "content": content(prompt, body.get("images"))})
    request = chat_request(model_id, {**body, "messages": turns, "tools": None})
    return "chat", request


# --- replies -----------------------------------------------------------------------


class Timer:
    """The durations of one reply, in nanoseconds (see the module docstring)."""

    def __init__(self):
        self.arrived = time.monotonic_ns()
        self.load = 0
        self.ready: int | None = None  # the model's turn began (the request was created)
        self.first: int | None = None  # the first piece came
        self.end: int | None = None

    def mark(self, name: str) -> None:
        """Note that `name` (ready, first or end) happens now; only the first time."""
        if getattr(self, name) is None:
            setattr(self, name, time.monotonic_ns())

    def stats(self, usage: dict) -> dict:
        """Ollama's statistics of the reply, with the tokens of `usage` (OpenAI's)."""
        end = self.end or time.monotonic_ns()
        ready = self.ready or self.arrived
        first = self.first or end
        return {"total_duration": end - self.arrived, "load_duration": self.load,
                "prompt_eval_count": int(usage.get("prompt_tokens") or 0),
                "prompt_eval_duration": max(first - ready, 0),
                "eval_count": int(usage.get("completion_tokens") or 0),
                "eval_duration": max(end - first, 0)}


class Translation:
    """A streamed reply's chunks (chat.completion.chunk dicts, or with `texts`
    text_completion ones) as Ollama's objects: /api/chat's, or (`chat` false)
    /api/generate's. `objects()` gives the stream's lines, `whole()` the one object."""

    def __init__(self, name: str, chunks: Iterator[dict], timer: Timer, chat: bool,
                 texts: bool = False):
        self.name, self.chat, self.texts = name, chat, texts
        self._chunks, self.timer = chunks, timer
        self.usage: dict = {}
        self.finish = "stop"
        self.error_code: str | None = None  # the code of the error a broken reply ended with

    def objects(self) -> Iterator[dict]:
        """The pieces (done false), then the final object; an {"error"} line ends a reply
        that broke."""
        calls: dict[int, list] = {}  # index -> [id, name, arguments text], until whole
        for chunk in self._chunks:
            if "error" in chunk:
                error = chunk["error"] if isinstance(chunk["error"], dict) else \
                    {"message": str(chunk["error"])}
                self.error_code = error.get("code")
                yield {"error": str(error.get("message") or error)}
                return
            if chunk.get("usage"):
                self.usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                text, deltas = self._read(choice)
                for delta in deltas:
                    self.timer.mark("first")
                    index = delta.get("index", 0)
                    if index not in calls:
                        yield from self._calls(calls)
                        function = delta.get("function") or {}
                        calls[index] = [delta.get("id"), function.get("name", ""), ""]
                    calls[index][2] += (delta.get("function") or {}).get("arguments") or ""
                if text:
                    self.timer.mark("first")
                    yield from self._calls(calls)
                    yield self._piece(text)
                if choice.get("finish_reason"):
                    reason = choice["finish_reason"]
                    self.finish = "length" if reason == "length" else "stop"
        yield from self._calls(calls)
        self.timer.mark("end")
        yield self.final()

    def whole(self) -> dict:
        """The reply as one object (stream false); an error the stream ended with is
        raised."""
        text, calls = [], []
        for obj in self.objects():
            if "error" in obj:
                if self.error_code == ModelStopped.code:
                    raise ModelStopped(obj["error"])
                raise InternalError(f"The reply broke off: {obj['error']}")
            if obj["done"]:
                if self.chat:
                    obj["message"]["content"] = "".join(text)
                    if calls:
                        obj["message"]["tool_calls"] = calls
                else:
                    obj["response"] = "".join(text)
                return obj
            if self.chat:
                text.append(obj["message"]["content"])
                calls += obj["message"].get("tool_calls", [])
            else:
                text.append(obj["response"])
        raise InternalError("The reply ended without its last object")  # objects() ends so

    def final(self, reason: str | None = None, stats: bool = True) -> dict:
        """The last object: done, with its done_reason and (`stats`) statistics."""
        obj = self._object("", done=True)
        obj["done_reason"] = reason or self.finish
        if stats:
            obj.update(self.timer.stats(self.usage))
        return obj

    def _read(self, choice: dict) -> tuple[str, list]:
        if self.texts:
            return choice.get("text") or "", []
        delta = choice.get("delta") or {}
        return delta.get("content") or "", delta.get("tool_calls") or []

    def _calls(self, calls: dict) -> Iterator[dict]:
        """The calls read so far, each whole, as objects; then none are left."""
        for index in sorted(calls):
            call_id, name, text = calls.pop(index)
            try:
                arguments = json.loads(text) if text.strip() else {}
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                log.warning("a call of %s had arguments that are no JSON object; left out: "
                            "%.200s", name, text)
                continue
            obj = self._object("")
            call = {"function": {"index": index, "name": name, "arguments": arguments}}
            if call_id:
                call["id"] = call_id
            obj["message"]["tool_calls"] = [call]
            yield obj

    def _piece(self, text: str) -> dict:
        return self._object(text)

    def _object(self, text: str, done: bool = False) -> dict:
        obj = {"model": self.name, "created_at": _now()}
        if self.chat:
            obj["message"] = {"role": "assistant", "content": text}
        else:
            obj["response"] = text
        obj["done"] = done
        return obj


class Lines:
    """A newline-delimited JSON reply body: one line per object; close(), which the
    server calls once, ends the objects and runs `on_close` (it frees the model)."""

    content_type = "application/x-ndjson"

    def __init__(self, objects: Iterator[dict], on_close: Callable[[], None]):
        self._objects = objects
        self._on_close = on_close
        self._closed = False

    def __iter__(self) -> Iterator[bytes]:
        for obj in self._objects:
            yield json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n"

    def close(self) -> None:
        """End the reply: the generation stops if it still runs."""
        if self._closed:
            return
        self._closed = True
        try:
            close = getattr(self._objects, "close", None)
            if close is not None:
                close()
        finally:
            self._on_close()


# --- chat, generate, embed ---------------------------------------------------------


def chat(services, body: dict, disconnected: Disconnected = never):
    """POST /api/chat: Lines, or one dict with stream false (or for no messages)."""
    name, model_id, record, keep, timer = _begin(services, body)
    if not body.get("messages"):
        return _load(services, record, body, keep, Translation(name, iter(()), timer, True))
    request = chat_request(model_id, body)
    fields = with_images(FIELDS, request)
    request = native(services.validators, "chat-completion.json", request, fields)
    with fields.named():  # images the model cannot take: a 400 before it starts
        read = services.chats.read_images(request)
    return _run(services, record, body, keep, timer,
                functools.partial(services.chats.create, messages=read), request,
                lambda chunks: Translation(name, chunks, timer, True), fields, disconnected)


def generate(services, body: dict, disconnected: Disconnected = never):
    """POST /api/generate: Lines, or one dict with stream false (or for no prompt)."""
    name, model_id, record, keep, timer = _begin(services, body)
    if not body.get("prompt"):
        return _load(services, record, body, keep, Translation(name, iter(()), timer, False))
    kind, request = generate_request(model_id, body, record)
    schema = "chat-completion.json" if kind == "chat" else "completion.json"
    fields = with_images(GENERATE_FIELDS, request, generate=True)
    request = native(services.validators, schema, request, fields)
    create = services.completions.create
    if kind == "chat":
        with fields.named():  # images the model cannot take: a 400 before it starts
            read = services.chats.read_images(request)
        create = functools.partial(services.chats.create, messages=read)
    return _run(services, record, body, keep, timer, create, request,
                lambda chunks: Translation(name, chunks, timer, False, kind == "completion"),
                fields, disconnected)


def embed(services, body: dict, disconnected: Disconnected = never) -> dict:
    """POST /api/embed: one vector per input; none (the model is loaded) for no input."""
    name, model_id, record, keep, timer = _begin(services, body)
    given = body.get("input")
    inputs = ([given] if given else []) if isinstance(given, str) or given is None \
        else list(given)
    request = {"model": model_id, "input": inputs}
    if body.get("dimensions") is not None:
        request["dimensions"] = body["dimensions"]
    services.embeddings.check_mode(model_id)  # the request's own check, before a start
    try:
        timer.load = services.requests.start(  # as a chat would: it embeds and chats
            model_id, start_options(body.get("options"), record))
        usage, vectors = {}, []
        if inputs:
            reply = services.embeddings.create(
                native(services.validators, "embedding.json", request, FIELDS), disconnected)
            vectors = [d["embedding"] for d in sorted(reply["data"], key=lambda d: d["index"])]
            usage = reply.get("usage") or {}
    finally:
        services.requests.keep_for(model_id, keep)
    return {"model": name, "embeddings": vectors,
            "total_duration": time.monotonic_ns() - timer.arrived, "load_duration": timer.load,
            "prompt_eval_count": int(usage.get("prompt_tokens") or 0)}


def _begin(services, body: dict) -> tuple:
    """(the name as given, its localrt id, the model's record, the keep_alive, a Timer)."""
    timer = Timer()
    keep = keep_alive(body.get("keep_alive"))
    model_id = resolve(services, body["model"])
    return body["model"], model_id, services.registry.get(model_id), keep, timer


def _load(services, record: dict, body: dict, keep, translation: Translation) -> dict:
    """A request with nothing to generate: load the model, or with keep_alive 0 unload it
    (`translation`, of no chunks, writes the one object)."""
    if keep == 0:
        services.requests.keep_for(record["id"], 0)
        return translation.final("unload", stats=False)
    translation.timer.load = services.requests.start(
        record["id"], start_options(body.get("options"), record))
    services.requests.keep_for(record["id"], keep)
    return translation.final("load", stats=False)


def _run(services, record: dict, body: dict, keep, timer: Timer, create, request: dict,
         translate: Callable[[Iterator[dict]], Translation], fields: Fields,
         disconnected: Disconnected = never):
    """Start the model, create the streamed reply, and give it as Lines (or whole); the
    model's keep_alive is set once the reply is done. The reply holds its place in its
    kind's admission until it is closed."""
    model_id = record["id"]

    def done():
        services.requests.keep_for(model_id, keep)

    try:
        timer.load = services.requests.start(model_id,
                                             start_options(body.get("options"), record))
        with fields.named():
            stream = create(request, disconnected)
    except BaseException:
        done()
        raise
    timer.mark("ready")

    def close():
        try:
            stream.close()
        finally:
            done()

    translation = translate(stream.chunks())
    if body.get("stream") is False:
        try:
            return translation.whole()
        finally:
            close()
    return Lines(translation.objects(), close)


# --- pull and delete ---------------------------------------------------------------


def pull(services, body: dict, disconnected: Disconnected = never):
    """POST /api/pull: Lines of progress, or {"status": "success"} once done with
    stream false. A pull of a model downloading already follows that download; one
    downloaded already succeeds at once. The download goes on if the client leaves.
    The reply holds a place in the "pull" admission (a 503 past its limit) until it
    is closed, and stops following once `disconnected()`."""
    model_id = pull_id(body.get("model") or body.get("name"))
    admission = services.admissions["pull"]
    admission.enter()  # before the download starts: a refused pull starts nothing
    try:
        try:
            started = services.pulls.pull(model_id)
        except Conflict as exc:
            if not exc.extra.get("taskId"):
                raise
            started = {"task": {"id": exc.extra["taskId"]}}
        task_id = (started.get("task") or {}).get("id")
        events = iter(()) if task_id is None else \
            services.events.follow(task_id, disconnected)
        # Listening first, then the task as it stands: nothing it did is missed.
        task = None if task_id is None else services.downloads.find(task_id)
    except BaseException:
        admission.leave()
        raise

    def close():
        try:
            getattr(events, "close", lambda: None)()
        finally:
            admission.leave()

    objects = progress(task_id, task, events)
    if body.get("stream") is False:
        try:
            for obj in objects:
                if "error" in obj:
                    if disconnected():
                        raise ClientGone(f"The client disconnected while it followed the "
                                         f"pull of {model_id}")
                    raise _pull_error(obj["error"])
            return {"status": "success"}
        finally:
            close()
    return Lines(objects, close)


def progress(task_id: str | None, task: dict | None, events: Iterator[dict]) -> Iterator[dict]:
    """A pull's lines, as Ollama's: "pulling manifest", each file's bytes as they
    change, then "success"; an {"error"} line ends a pull that failed. `task` is the
    task as it stood once `events` (the event bus's, of this task) began."""
    yield {"status": "pulling manifest"}
    seen: dict = {}
    try:
        while task_id is not None:
            if task is None:
                yield {"error": f"The download {task_id} is no longer known"}
                return
            for item in task["items"]:
                done = (item.get("downloadedBytes") or 0, item.get("bytes") or 0)
                if seen.get(item["id"]) != done:
                    seen[item["id"]] = done
                    checksum = item.get("checksum")
                    yield {"status": f"pulling {item['id']}",
                           "digest": f"sha256:{checksum}" if checksum else item["id"],
                           "total": done[1], "completed": done[0]}
            if task["status"] not in ("Pending", "Downloading"):
                break
            event = next(events, None)
            if event is None:  # the server is stopping, or this listener fell behind
                yield {"error": f"The download {task_id} is no longer followed; "
                                f"GET /v1/models/pull shows how it goes on"}
                return
            task = event["task"]
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()
    if task is not None and task["status"] != "Success":
        yield {"error": task.get("error") or f"The download ended: {task['status']}"}
        return
    yield {"status": "verifying sha256 digest"}
    yield {"status": "writing manifest"}
    yield {"status": "success"}


def _pull_error(message: str) -> HTTPError:
    return UpstreamError(f"The pull failed: {message}")


def delete(services, body: dict) -> dict:
    """DELETE /api/delete: the model's files and definition; a running model is stopped
    first (a reply it is giving ends)."""
    model_id = resolve(services, body.get("model") or body.get("name"))
    services.registry.get(model_id)  # the 404
    if services.scheduler.is_running(model_id):
        try:
            services.scheduler.stop(model_id, "to delete it (DELETE /api/delete)")
        except ModelNotRunning:  # it stopped meanwhile
            pass
    with services.scheduler.not_running(model_id):
        services.registry.remove(model_id)
    return {"status": "success"}


# --- models as Ollama lists them ---------------------------------------------------


def tags(services) -> dict:
    """GET /api/tags: every downloaded model."""
    return {"models": [model_row(r) for r in services.registry.list()]}


def ps(services) -> dict:
    """GET /api/ps: the running models, with when they unload and their memory."""
    models = []
    for row in services.scheduler.status():
        if not services.registry.has(row["id"]):  # deleted meanwhile
            continue
        expires = row.get("expiresAt")
        models.append({**model_row(services.registry.get(row["id"])),
                       "expires_at": _at(expires) if expires is not None else
                       _stamp(datetime.now(timezone.utc) + FOREVER),
                       "size": row["ram"] + row["vram"], "size_vram": row["vram"],
                       "context_length": int(row["options"].get("ctx_len") or 0)})
    return {"models": models}


def model_row(record: dict) -> dict:
    """A model as /api/tags lists it."""
    return {"name": record["id"], "model": record["id"], "modified_at": _at(record["created"]),
            "size": record["size"], "digest": digest(record), "details": details(record)}


def digest(record: dict) -> str:
    """A sha256 naming the model's content: localrt keeps no manifest to take one from,
    so it is the digest of its id and its files' paths, sizes and sha256s."""
    files = [[f["path"], f["size"], f.get("sha256")] for f in record.get("files") or []]
    text = json.dumps([record["id"], files], sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def details(record: dict) -> dict:
    """Ollama's details: the format, the GGUF's architecture, size and quantization."""
    meta = record.get("metadata") or {}
    family = str(meta.get("architecture") or "")
    count = meta.get("parameter_count")
    return {"parent_model": "", "format": _format(record), "family": family,
            "families": [family] if family else None,
            "parameter_size": _parameters(count) if isinstance(count, int) else "",
            "quantization_level": str(meta.get("quantization") or "")}


def _format(record: dict) -> str:
    if "upstreams" in record:
        return "remote"
    path = weights_path(record)
    return path.suffix.lstrip(".").lower() if path is not None else ""


def _parameters(count: int) -> str:
    """A parameter count as Ollama writes it: 7.6B, 494.0M, 22.7K."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


def show(services, body: dict) -> dict:
    """POST /api/show: the Modelfile localrt's record makes, its parameters, template,
    details and GGUF metadata."""
    model_id = resolve(services, body.get("model") or body.get("name"))
    record = services.registry.get(model_id)
    template = str((record.get("metadata") or {}).get("chat_template") or "")
    info = model_info(record)
    parameters = [(ollama, record[name]) for name, ollama in PARAMETERS
                  if record.get(name) is not None]
    lines = [(k, json.dumps(s)) for k, v in parameters if k == "stop" for s in v] + \
        [(k, json.dumps(v)) for k, v in parameters if k != "stop"]
    path = weights_path(record)
    modelfile = ["# Modelfile generated by localrt (for reading: localrt takes none)",
                 f"FROM {path if path is not None else model_id}"]
    if template:
        modelfile.append(f'TEMPLATE """{template}"""')
    modelfile += [f"PARAMETER {k} {v}" for k, v in lines]
    return {"modelfile": "\n".join(modelfile) + "\n",
            "parameters": "\n".join(f"{k:<30} {v}" for k, v in lines),
            "template": template, "details": details(record), "model_info": info,
            "capabilities": capabilities(info, template, registry_capabilities(record)),
            "modified_at": _at(record["created"])}


def model_info(record: dict) -> dict:
    """The GGUF header's keys and values; the vocabulary's arrays are empty lists, as
    Ollama gives them unless asked, and the chat template is `template`."""
    path = weights_path(record)
    if path is None or path.suffix.lower() != ".gguf":
        return {}
    try:
        meta = ggufinfo.read_metadata(path)
    except (ggufinfo.GGUFError, OSError) as exc:
        log.warning("model %s: its GGUF header cannot be read: %s", record["id"], exc)
        return {}
    out = {}
    for key, value in meta.items():
        if key == "tokenizer.chat_template":
            continue
        if isinstance(value, ggufinfo.ArrayInfo) or key in (
                "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.scores"):
            value = []
        out[key] = _finite(value)
    return out


def _finite(value):
    """A header value as JSON can hold it: NaN and infinities become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def capabilities(info: dict, template: str, own: list = ()) -> list:
    """What a model does, as Ollama names it: embedding (a GGUF with a pooling type, or
    an encoder, or what localrt.models.registry.capabilities, `own`, calls one), else
    completion, vision when `own` says so (a projector), tools when its template calls
    tools in a family localrt reads, insert when its vocabulary has fill-in-the-middle
    tokens."""
    arch = info.get("general.architecture")
    if f"{arch}.pooling_type" in info or arch in ("bert", "nomic-bert", "jina-bert-v2") or \
            ("embedding" in own and "chat" not in own):
        return ["embedding"]
    out = ["completion"]
    if "vision" in own:
        out.append("vision")
    if template and toolcalls.family_of(template) is not None:
        out.append("tools")
    if "tokenizer.ggml.fim_pre_token_id" in info:
        out.append("insert")
    return out
