"""Ollama's generation routes under /api/: its requests as native ones, and the native
replies in its shapes. localrt.dialects.ollama_models has its names and listings.

Clients that speak only Ollama (Open WebUI, Continue, editors' plugins, the `ollama`
packages) work unchanged. Each route is the dialect template, onto the calls the
OpenAI routes use, so there is one generation path:

  POST /api/chat       a native chat (Chats.create), always streamed inside: its
                       events become Ollama's newline-delimited JSON objects, or one
                       object with "stream": false
  POST /api/generate   the prompt (after `system`, with its `images`) as a one-turn
                       chat, so the model's chat template applies and `format` works;
                       with `raw`, or a `suffix`, a text completion
                       (Completions.create) of the raw or fill-in-the-middle prompt
  POST /api/embed      an embeddings request (Embeddings.create)

Options: num_ctx is the context a model starts with, so it applies when the request
starts the model (clamped to what the model was trained on); a running model keeps its
own, where Ollama would reload it. num_predict is max_tokens (0 or less: no limit
but the context), and temperature, top_p, top_k, min_p, seed, stop and the penalties
are sampling fields. Any other option is ignored. `format` is a response format:
"json" a JSON object, a schema that schema. `keep_alive` (`keep_alive`) sets how long
the model stays loaded once idle (through the request path, RequestPath.keep_for): 0
unloads it after the reply, a negative value keeps it until stopped, and a request
without one puts back the server's keepAlive, as Ollama's default does.

Images (`images` of a chat message, or of /api/generate: base64) become Media parts,
before the text as Ollama puts them; a model that cannot take them is refused before
it starts, and an error about one names it as Ollama's request does
(messages[0].images[1], /api/generate's images[0]).

Replies carry Ollama's statistics in nanoseconds (`Timer`): measured around the reply,
so total_duration includes waiting for the model; load_duration is the start of a
model that was not running; prompt_eval_duration runs from the model's turn to the
first piece, eval_duration from there to the end. Tool calls come whole, their
arguments an object; one whose arguments are not a JSON object (cut short by
num_predict) is left out.

Thinking: `think` false turns a reasoning model's thinking off, true or a level
("low", "medium", "high": the effort a template that takes one is given) on; left
out, the model's default. `think` true or a level on a model that does not reason (its
record's capabilities have no "reasoning") is a 400 naming think and the model, as
Ollama answers it; false there is accepted. A remote model's upstream is asked as it
is (localrt.remote.wire), since localrt cannot know whether it reasons. The model's
thinking (a remote model's reasoning) is /api/chat's `message.thinking` and
/api/generate's `thinking`, apart from the answer, streamed and whole; a history
message's `thinking` is given back to the template (Message.reasoning). A raw or
fill-in-the-middle prompt is a text completion: no thinking is parsed out of it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from typing import Callable, Iterator

from localrt import __version__, native
from localrt.admission import Disconnected, never
from localrt.dialects.common import Fields, failure
from localrt.dialects.ollama_models import FOREVER, SAMPLING, Lines, Names, now
from localrt.errors import HTTPError, InternalError, InvalidField, shown
from localrt.inference.media import data_url
from localrt.inference.running import ModelStopped
from localrt.models.registry import capabilities

log = logging.getLogger(__name__)

VERSION = "0.33.0"  # the Ollama release whose API (docs/api.md) this module follows
UNLIMITED = 16777216  # max_tokens for "no limit but the context" (completions default to 16)
# A Go duration's parts: a number ("1", "1.5", ".5": one way to read each, so neither
# regex can backtrack) and its unit; _DURATIONS is a whole text made of them.
_NUMBER = r"(?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)"
_UNIT = r"(?:ns|us|µs|μs|ms|s|m|h)"
_DURATION = re.compile(rf"({_NUMBER})({_UNIT})")
_DURATIONS = re.compile(rf"(?:{_NUMBER}{_UNIT})+")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
          "h": 3600.0}
# The native names of the fields of errors, and Ollama's (/api/generate's prompt is the
# chat's messages).
FIELDS = Fields((r"response_format\.json_schema\.schema", "format"),
                (r"response_format.*", "format"), (r"max_tokens", "options.num_predict"))
GENERATE_FIELDS = Fields((r"response_format\.json_schema\.schema", "format"),
                         (r"response_format.*", "format"),
                         (r"max_tokens", "options.num_predict"), (r"messages.*", "prompt"))


def error_body(err: HTTPError) -> dict:
    """An error as Ollama writes it: {"error": message}, with the HTTP status."""
    return {"error": err.message}


def version() -> dict:
    """GET /api/version."""
    return {"version": VERSION, "localrt": __version__}


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
        if not _DURATIONS.fullmatch(body):
            raise InvalidField(f"Invalid field 'keep_alive': {shown(value)} is not a duration; "
                               f"use seconds, or a duration such as \"5m\" or \"1h30m\"",
                               param="keep_alive")
        value = sign * sum(float(a) * _UNITS[u] for a, u in _DURATION.findall(body))
    return math.inf if value < 0 or value >= FOREVER.total_seconds() else float(value)


# --- requests ----------------------------------------------------------------------


def sampling(options: dict | None) -> tuple[dict, list]:
    """(sampling fields, stop sequences) of Ollama's options: the sampling ones, and
    num_predict as max_tokens."""
    options = options or {}
    out = {k: options[k] for k in SAMPLING if k != "stop" and options.get(k) is not None}
    for name in ("top_k", "seed"):  # 8.0 passes the schema as an integer
        if name in out:
            out[name] = int(out[name])
    predict = options.get("num_predict")
    if predict is not None and predict > 0:
        out["max_tokens"] = int(predict)
    stop = options.get("stop")
    return out, [stop] if isinstance(stop, str) else list(stop or [])


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
    """Ollama's `format` as a native response format."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object", "schema": None}
    return {"type": "json_schema", "schema": fmt, "name": "format"}


def think(body: dict, record: dict, remote: bool = False) -> dict:
    """The native think and effort of a body's `think` (see the module docstring): a
    400 naming think and the model when it turns thinking on for a model that does not
    reason (`remote`: an upstream's model, which is asked as it is)."""
    value = body.get("think")
    if value is None:
        return {}
    if value is False:
        return {"think": False}
    if not remote and "reasoning" not in capabilities(record):
        raise InvalidField(f"Invalid field 'think': {json.dumps(body['model'])} does not "
                           f"support thinking", param="think")
    return {"think": True} if value is True else {"think": True, "effort": value}


def chat_request(model_id: str, body: dict, thinking: dict | None = None) -> native.Request:
    """POST /api/chat's body as a streamed native chat request; `thinking` its think
    and effort (`think`)."""
    fields, stop = sampling(body.get("options"))
    return native.Request(model=model_id, messages=messages(body.get("messages") or []),
                          sampling=fields, stop=stop, tools=list(body.get("tools") or []),
                          response_format=response_format(body.get("format")),
                          stream=True, include_usage=True, **(thinking or {}))


def messages(given: list) -> list:
    """Ollama's messages as native ones: an assistant's calls get ids (their own, else
    ones every family's template takes: 9 letters and digits), and a tool message the
    id of the call it answers (its tool_call_id, else the first unanswered call of its
    tool_name)."""
    out, unanswered, count = [], [], 0
    for i, m in enumerate(given):
        calls, call_id, name = [], None, None
        if m["role"] == "assistant" and m.get("tool_calls"):
            for call in m["tool_calls"]:
                count += 1
                own = call.get("id") or f"call{count:05d}"
                function = call["function"]
                calls.append(native.ToolCall(own, function["name"],
                                             json.dumps(function.get("arguments") or {})))
                unanswered.append((own, function["name"]))
        elif m["role"] == "tool":
            name = m.get("tool_name") or None
            call_id = m.get("tool_call_id")
            if not call_id:
                match = next((c for c in unanswered if name in (None, c[1])), None)
                count += 1
                call_id = match[0] if match else f"call{count:05d}"
            unanswered = [c for c in unanswered if c[0] != call_id]
        out.append(native.Message(m["role"], parts(m.get("content"), m.get("images"),
                                                   f"messages[{i}].images"),
                                  calls, call_id, name,
                                  (m.get("thinking") or "") if m["role"] == "assistant" else ""))
    return out


def parts(text: str | None, images: list | None, field: str) -> list:
    """A message's parts: its images (base64) first, as Ollama puts them before the
    text, each named `field`[n], then its text. An audio file given in `images` (as
    Ollama takes them) is told apart by its first bytes and becomes an audio part."""
    out = []
    for n, b64 in enumerate(images or ()):
        url = data_url(b64)
        kind = url[len("data:"):].split(";", 1)[0]
        out.append(native.Media(url, kind if kind.startswith("audio/") else "image/*",
                                f"{field}[{n}]"))
    return out + ([native.Text(text)] if text else [])


def generate_request(model_id: str, body: dict, record: dict, thinking: dict | None = None):
    """POST /api/generate's body as a streamed native request: a chat (`thinking` its
    think and effort), or with raw or a suffix a text completion (native.TextRequest),
    whose text is never parsed for thinking."""
    if body.get("images") and (body.get("raw") or body.get("suffix")):
        raise InvalidField("Invalid field 'images': a raw or fill-in-the-middle prompt is a "
                           "text completion, which takes no images; leave out raw and "
                           "suffix", param="images")
    if body.get("template"):
        raise InvalidField("Invalid field 'template': localrt puts the prompt in the model's "
                           "own chat template; send \"raw\": true with a prompt you put in "
                           "a template yourself", param="template")
    prompt, suffix = body.get("prompt") or "", body.get("suffix")
    fields, stop = sampling(body.get("options"))
    if body.get("raw") or suffix:
        if response_format(body.get("format")):
            raise InvalidField("Invalid field 'format': a raw or fill-in-the-middle prompt is a "
                               "text completion, which follows no format", param="format")
        if "max_tokens" not in fields and record.get("max_tokens") is None:
            fields["max_tokens"] = UNLIMITED
        return native.TextRequest(model=model_id, prompts=[prompt], suffix=suffix or None,
                                  sampling=fields, stop=stop, stream=True,
                                  include_usage=True)
    turns = [native.Message("system", [native.Text(body["system"])])] \
        if body.get("system") else []
    turns.append(native.Message("user", parts(prompt, body.get("images"), "images")))
    return native.Request(model=model_id, messages=turns, sampling=fields, stop=stop,
                          response_format=response_format(body.get("format")),
                          stream=True, include_usage=True, **(thinking or {}))


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

    def stats(self, usage: native.Usage | None) -> dict:
        """Ollama's statistics of the reply, with the tokens of `usage`."""
        end = self.end or time.monotonic_ns()
        ready = self.ready or self.arrived
        first = self.first or end
        return {"total_duration": end - self.arrived, "load_duration": self.load,
                "prompt_eval_count": usage.prompt_tokens if usage else 0,
                "prompt_eval_duration": max(first - ready, 0),
                "eval_count": usage.completion_tokens if usage else 0,
                "eval_duration": max(end - first, 0)}


class Translation:
    """A native reply's events as Ollama's objects: /api/chat's, or (`chat` false)
    /api/generate's. `objects(events)` gives the stream's lines, `whole(events)` the
    one object."""

    def __init__(self, name: str, timer: Timer, chat: bool):
        self.name, self.chat, self.timer = name, chat, timer
        self.usage: native.Usage | None = None
        self.finish = "stop"

    def objects(self, events) -> Iterator[dict]:
        """The pieces (done false), then the final object; an {"error"} line ends a reply
        that broke."""
        calls: dict[int, list] = {}  # index -> [id, name, arguments text], until whole
        for event in events:
            if isinstance(event, native.Failed):
                error = failure(event.error, self.name)
                if not isinstance(error, dict):
                    error = {"message": str(error)}
                yield {"error": str(error.get("message") or error)}
                return
            if isinstance(event, native.Usage):
                self.usage = event
            elif isinstance(event, native.Finish):
                self.finish = "length" if event.reason == "length" else "stop"
            elif isinstance(event, (native.CallStart, native.CallArgs)):
                self.timer.mark("first")
                if event.index not in calls:
                    yield from self._calls(calls)
                    start = isinstance(event, native.CallStart)
                    calls[event.index] = [event.id if start else None,
                                          event.name if start else "", ""]
                if isinstance(event, native.CallArgs):
                    calls[event.index][2] += event.text
            elif isinstance(event, (native.Text, native.Reasoning)) and event.text:
                self.timer.mark("first")
                yield from self._calls(calls)
                yield self._object(event.text) if isinstance(event, native.Text) else \
                    self._object("", thinking=event.text)
        yield from self._calls(calls)
        self.timer.mark("end")
        yield self.final()

    def whole(self, events) -> dict:
        """The reply as one object (stream false): the events folded (native.collect);
        an error the reply ended with is raised (ModelStopped as it is)."""
        try:
            whole = native.collect(self._timed(events))
        except ModelStopped:
            raise
        except Exception as exc:  # noqa: BLE001 - said as Ollama's reply that broke off
            error = failure(exc, self.name)
            message = error.get("message") if isinstance(error, dict) else error
            raise InternalError(f"The reply broke off: {message or error}") from None
        self.usage = whole.usage
        self.finish = "length" if whole.finish == "length" else "stop"
        obj = self.final()
        if self.chat:
            obj["message"]["content"] = whole.text
            if whole.reasoning:
                obj["message"]["thinking"] = whole.reasoning
            calls = [self._call(index, call.id or None, call.name, call.arguments)
                     for index, call in enumerate(whole.calls)]
            calls = [call for call in calls if call is not None]
            if calls:
                obj["message"]["tool_calls"] = calls
        else:
            obj["response"] = whole.text
            if whole.reasoning:
                obj["thinking"] = whole.reasoning
        return obj

    def _timed(self, events) -> Iterator:
        """The events, the timer marking the first piece and the end."""
        for event in events:
            if isinstance(event, (native.CallStart, native.CallArgs)) or (
                    isinstance(event, (native.Text, native.Reasoning)) and event.text):
                self.timer.mark("first")
            yield event
        self.timer.mark("end")

    def final(self, reason: str | None = None, stats: bool = True) -> dict:
        """The last object: done, with its done_reason and (`stats`) statistics."""
        obj = self._object("", done=True)
        obj["done_reason"] = reason or self.finish
        if stats:
            obj.update(self.timer.stats(self.usage))
        return obj

    def _calls(self, calls: dict) -> Iterator[dict]:
        """The calls read so far, each whole, as objects; then none are left."""
        for index in sorted(calls):
            call = self._call(index, *calls.pop(index))
            if call is not None:
                obj = self._object("")
                obj["message"]["tool_calls"] = [call]
                yield obj

    @staticmethod
    def _call(index: int, call_id: str | None, name: str, text: str | None) -> dict | None:
        """A call as Ollama's, its arguments an object; None (logged) when they are not."""
        text = text or ""
        try:
            arguments = json.loads(text) if text.strip() else {}
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            log.warning("a call of %s had arguments that are no JSON object; left out: "
                        "%.200s", name, text)
            return None
        call = {"function": {"index": index, "name": name, "arguments": arguments}}
        if call_id:
            call["id"] = call_id
        return call

    def _object(self, text: str, done: bool = False, thinking: str | None = None) -> dict:
        obj = {"model": self.name, "created_at": now()}
        if self.chat:
            obj["message"] = {"role": "assistant", "content": text}
            if thinking:
                obj["message"]["thinking"] = thinking
        else:
            obj["response"] = text
            if thinking:
                obj["thinking"] = thinking
        obj["done"] = done
        return obj


# --- chat, generate, embed ---------------------------------------------------------


def chat(chats, path, names: Names, body: dict, disconnected: Disconnected = never):
    """POST /api/chat: Lines, or one dict with stream false (or for no messages).
    `chats` makes the reply, `path` (the request path) starts the model and keeps it."""
    name, record, keep, timer = _begin(names, body)
    translation = Translation(name, timer, True)
    if not body.get("messages"):
        return _load(path, record, body, keep, translation)
    request = chat_request(record["id"], body, think(body, record, path.is_remote(record)))
    with FIELDS.named(request):  # images the model cannot take: a 400 before it starts
        read = chats.read_media(request)
    return _run(path, record, body, keep, translation, FIELDS.named(request),
                lambda: chats.create(request, disconnected, messages=read))


def generate(chats, completions, path, names: Names, body: dict,
             disconnected: Disconnected = never):
    """POST /api/generate: Lines, or one dict with stream false (or for no prompt)."""
    name, record, keep, timer = _begin(names, body)
    translation = Translation(name, timer, False)
    if not body.get("prompt"):
        return _load(path, record, body, keep, translation)
    raw = body.get("raw") or body.get("suffix")
    request = generate_request(record["id"], body, record,
                               None if raw else think(body, record, path.is_remote(record)))
    named = GENERATE_FIELDS.named(request if isinstance(request, native.Request) else None)
    if isinstance(request, native.TextRequest):
        create = lambda: completions.create(request, disconnected)  # noqa: E731
    else:
        with GENERATE_FIELDS.named(request):  # images the model cannot take: a 400 first
            read = chats.read_media(request)
        create = lambda: chats.create(request, disconnected, messages=read)  # noqa: E731
    return _run(path, record, body, keep, translation, named, create)


def embed(embeddings, path, names: Names, body: dict,
          disconnected: Disconnected = never) -> dict:
    """POST /api/embed: one vector per input; none (the model is loaded) for no input."""
    name, record, keep, timer = _begin(names, body)
    model_id = record["id"]
    given = body.get("input")
    inputs = ([given] if given else []) if isinstance(given, str) or given is None \
        else list(given)
    request = {"model": model_id, "input": inputs}
    if body.get("dimensions") is not None:
        request["dimensions"] = body["dimensions"]
    embeddings.check_mode(model_id)  # the request's own check, before a start
    try:
        timer.load = path.start(  # as a chat would: it embeds and chats
            model_id, start_options(body.get("options"), record))
        usage, vectors = {}, []
        if inputs:
            with FIELDS.named():
                reply = embeddings.create(request, disconnected)
            vectors = [d["embedding"] for d in sorted(reply["data"], key=lambda d: d["index"])]
            usage = reply.get("usage") or {}
    finally:
        path.keep_for(model_id, keep)
    return {"model": name, "embeddings": vectors,
            "total_duration": time.monotonic_ns() - timer.arrived, "load_duration": timer.load,
            "prompt_eval_count": int(usage.get("prompt_tokens") or 0)}


def _begin(names: Names, body: dict) -> tuple:
    """(the name as given, the model's record, the keep_alive, a Timer)."""
    timer = Timer()
    keep = keep_alive(body.get("keep_alive"))
    return body["model"], names.record(body["model"]), keep, timer


def _load(path, record: dict, body: dict, keep, translation: Translation) -> dict:
    """A request with nothing to generate: load the model, or with keep_alive 0 unload it
    (`translation` writes the one object)."""
    if keep == 0:
        path.keep_for(record["id"], 0)
        return translation.final("unload", stats=False)
    translation.timer.load = path.start(record["id"],
                                        start_options(body.get("options"), record))
    path.keep_for(record["id"], keep)
    return translation.final("load", stats=False)


def _run(path, record: dict, body: dict, keep, translation: Translation, named,
         create: Callable[[], native.Reply]):
    """Start the model, create the streamed reply (errors `named` in Ollama's words),
    and give it as Lines (or whole); the model's keep_alive is set once the reply is
    done. The reply holds its place in its kind's admission until it is closed."""
    model_id = record["id"]
    timer = translation.timer

    def done():
        path.keep_for(model_id, keep)

    try:
        timer.load = path.start(model_id, start_options(body.get("options"), record))
        with named:
            reply = create()
    except BaseException:
        done()
        raise
    timer.mark("ready")

    def close():
        try:
            reply.close()
        finally:
            done()

    if body.get("stream") is False:
        try:
            return translation.whole(reply.events())
        finally:
            close()
    return Lines(translation.objects(reply.events()), close)
