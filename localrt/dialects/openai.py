"""OpenAI's API, a dialect like the others: POST /v1/chat/completions and /v1/completions.

Each route is the dialect template: read the body (which passed its schema,
schemas/chat-completion.json or completion.json) into a native request
(`read_chat`, `read_text`: localrt.native), call the native call (Chats.create,
Completions.create), and write the reply's events in OpenAI's shapes: a whole
chat.completion or text_completion (`chat_completion`, `text_completion`), or
Server-Sent Events of chunks then [DONE] (`ChatChunks`, `TextChunks`).

One deliberate branch: a remote model's reply is its upstream's own, to the body as
the client sent it, passed through untouched (a dict, or a stream of its chunks), so
fields localrt does not know (vLLM's) reach the client.

  OpenAI                                      native
  messages[i].content: a string, or text and    Message.parts: Text, and Media
    image_url parts                               (the URL, read later), `where`
                                                  messages[i].content[j]
    input_audio parts {data, format}              Media of audio/wav|mpeg|flac (a data:
                                                  URL of the base64, read later)
  developer messages                            system messages (chat templates know
                                                  system, user and assistant)
  tool_calls, tool_call_id, name                Message.tool_calls (ToolCall), ...
  tools, tool_choice, parallel_tool_calls       the same; tool_choice "function" with
                                                  tool_function for {"type": "function"}
  max_completion_tokens                         sampling["max_tokens"]
  stop (a string or a list)                     stop (a list)
  logprobs: true, top_logprobs                  logprobs (the count of alternatives)
  response_format                               {"type", "schema", "name"}
  prediction.content (text or text parts)       prediction (text)
  stream_options.include_usage                  include_usage
  reasoning_effort: "none", or a level          think false; think true and effort
  chat_template_kwargs                          template_kwargs (a boolean
                                                  enable_thinking is think too)
  reasoning_format: "none"                      reasoning_format "none" (raw)
  reasoning_budget_tokens,                      reasoning_budget (-1: the model's)
    thinking_budget_tokens
  an assistant's reasoning_content or           Message.reasoning
    reasoning

A reply's thinking (Reasoning events) is written twice, as `reasoning_content`
(llama-server's and DeepSeek's name) and `reasoning` (vLLM's, Ollama's and LM
Studio's), on the message and on each chunk's delta, since clients read one or the
other; usage.completion_tokens_details.reasoning_tokens counts its tokens.

A reply's choice that a stop sequence ended names it as `stop_reason` (vLLM's field).
Log-probabilities (the entries of localrt.engines.logprobs) are written here in
OpenAI's two shapes: chat's logprobs.content ({"content": [...], "refusal": null},
each {token, logprob, bytes, top_logprobs}; a stream's chunk carries those of the
tokens whose text it sends), and the legacy completions object (tokens,
token_logprobs, top_logprobs, text_offset). A token whose bytes are not UTF-8 by
themselves (a piece of a character split over several tokens) is written
`bytes:\\xe2\\x80` in `token`; its `bytes` are exact. Special tokens are written as
their text (`<|im_end|>`).
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Iterator

from localrt import native
from localrt.admission import Disconnected, never
from localrt.dialects.common import budget, thinking, write
from localrt.errors import InvalidField, shown
from localrt.engines.audio import MEDIA_TYPES
from localrt.inference.completions import read_prompt
from localrt.routing import EventStream, stream_error

UNLIKELY = -9999.0  # OpenAI's stand-in for a log-probability too small to write
# The names of a reply's thinking, on a message and on a delta: both are written, the
# first read first (localrt.remote.wire.REASONING_FIELDS reads an upstream's the same).
REASONING = ("reasoning_content", "reasoning")


# --- chat -----------------------------------------------------------------------------


def chat(chats, body: dict, disconnected: Disconnected = never):
    """POST /v1/chat/completions: a chat.completion dict, or a stream of its chunks."""
    upstream = chats.passthrough(body, disconnected)
    if upstream is not None:
        return upstream  # a remote model's upstream's own reply, untouched
    request = read_chat(body)
    return write(chats.create(request, disconnected), request.stream,
                 lambda reply: ChatChunks(reply, request),
                 lambda whole: chat_completion(whole, request))


def read_chat(body: dict) -> native.Request:
    """A chat-completions body as a native Request; a 400 naming the field that
    localrt cannot take (n above 1, top_logprobs without logprobs, a json_schema
    response_format without its schema, a content part of another type)."""
    if body.get("n") not in (None, 1):
        raise InvalidField("Invalid field 'n': only n=1 is supported", param="n")
    return native.Request(
        model=body["model"], **reasoning(body),
        messages=[_message(i, m) for i, m in enumerate(body["messages"])],
        sampling=sampling(body), stop=stops(body.get("stop")),
        tools=list(body.get("tools") or []), **_tool_choice(body.get("tool_choice")),
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        response_format=response_format(body.get("response_format")),
        logprobs=_top_logprobs(body), logit_bias=body.get("logit_bias") or None,
        prediction=_prediction(body.get("prediction")),
        speculative=body.get("speculative"), lora=body.get("lora"),
        stream=bool(body.get("stream")), include_usage=include_usage(body))


def reasoning(body: dict) -> dict:
    """The native request's thinking fields of a chat body: think and effort
    (reasoning_effort, chat_template_kwargs: common.thinking), reasoning_budget,
    reasoning_format and template_kwargs. A model that does not reason ignores them:
    clients send reasoning_effort to every model."""
    kwargs = dict(body.get("chat_template_kwargs") or {})
    return {**thinking(body.get("reasoning_effort"), kwargs),
            "reasoning_budget": budget(body), "template_kwargs": kwargs,
            # llama-server's other formats (auto, deepseek, ...) all parse thinking out.
            "reasoning_format": "none" if body.get("reasoning_format") == "none" else None}


def sampling(body: dict) -> dict:
    """The sampling fields a body sets (native.SAMPLING; max_completion_tokens is
    max_tokens)."""
    out = {k: body[k] for k in native.SAMPLING if body.get(k) is not None}
    if body.get("max_completion_tokens") is not None:
        out["max_tokens"] = body["max_completion_tokens"]
    return out


def stops(stop) -> list:
    """A stop field (a string or a list) as a list."""
    return [stop] if isinstance(stop, str) else list(stop or [])


def include_usage(body: dict) -> bool:
    """Whether a streamed reply ends with a chunk of its usage (stream_options)."""
    return bool((body.get("stream_options") or {}).get("include_usage"))


def _audio(given, where: str) -> native.Media:
    """An input_audio part ({data: base64, format: wav|mp3|flac}) as a Media part, its
    data a data: URL (localrt.inference.media decodes and checks it, naming `where`)."""
    fmt = given.get("format") if isinstance(given, dict) else None
    if fmt not in MEDIA_TYPES:
        raise InvalidField(f"Invalid field '{where}.input_audio.format': expected wav, mp3 "
                           f"or flac, got {shown(fmt)}", param=f"{where}.input_audio.format")
    data = given.get("data")
    if not isinstance(data, str):
        raise InvalidField(f"Invalid field '{where}.input_audio.data': expected the clip "
                           f"as base64 text", param=f"{where}.input_audio.data")
    return native.Media(f"data:{MEDIA_TYPES[fmt]};base64,{data}", MEDIA_TYPES[fmt], where)


def _message(index: int, message: dict) -> native.Message:
    content = message.get("content")
    parts: list = []
    if isinstance(content, list):
        for j, part in enumerate(content):
            where = f"messages[{index}].content[{j}]"
            if part.get("type") == "text":
                parts.append(native.Text(part["text"]))
            elif part.get("type") == "image_url":
                given = part.get("image_url")
                url = given.get("url") if isinstance(given, dict) else given
                parts.append(native.Media(url, "image/*", where))
            elif part.get("type") == "input_audio":
                parts.append(_audio(part.get("input_audio"), where))
            else:
                raise InvalidField(f"Invalid field '{where}': only text, image_url and "
                                   f"input_audio parts are supported, got "
                                   f"{part.get('type')!r}", param=where)
    elif content:
        parts.append(native.Text(content))
    # Chat templates know system, user and assistant; OpenAI's newer "developer"
    # messages are system messages to them.
    role = "system" if message["role"] == "developer" else message["role"]
    calls = [native.ToolCall(call.get("id", ""), call["function"]["name"],
                             call["function"].get("arguments"))
             for call in message.get("tool_calls") or ()] if role == "assistant" else []
    return native.Message(role, parts, calls,
                          message.get("tool_call_id") if role == "tool" else None,
                          message.get("name") if role == "tool" else None,
                          _reasoning(message) if role == "assistant" else "")


def _reasoning(message: dict) -> str:
    """An assistant message's thinking: its reasoning_content, else its reasoning (the
    names clients give it back under)."""
    for name in REASONING:
        if isinstance(message.get(name), str) and message[name]:
            return message[name]
    return ""


def _tool_choice(choice) -> dict:
    if isinstance(choice, dict):
        return {"tool_choice": "function", "tool_function": choice["function"]["name"]}
    return {"tool_choice": choice or "auto"}


def _top_logprobs(body: dict) -> int | None:
    """How many alternatives each token's log-probability comes with (0 to 20); None
    when the request does not ask for logprobs. top_logprobs needs logprobs: true, as
    OpenAI's does."""
    top = body.get("top_logprobs")
    if not body.get("logprobs"):
        if top is not None:
            raise InvalidField("Invalid field 'top_logprobs': it needs \"logprobs\": true",
                               param="top_logprobs")
        return None
    return int(top or 0)  # 3.0 passes the schema as an integer


def response_format(fmt: dict | None) -> dict | None:
    """{"type": "json_object"} or {"type": "json_schema", "schema", "name"}; None for
    text."""
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object", "schema": fmt.get("schema")}
    given = fmt.get("json_schema") or {}
    schema = given.get("schema")
    if not isinstance(schema, dict):
        raise InvalidField("Invalid field 'response_format.json_schema.schema': a json_schema "
                           "response format needs the JSON Schema object",
                           param="response_format.json_schema.schema")
    return {"type": "json_schema", "schema": schema, "name": given.get("name")}


def _prediction(prediction) -> str | None:
    content = (prediction or {}).get("content")
    if not content:
        return None
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def chat_completion(whole: native.Whole, request: native.Request) -> dict:
    """A whole reply as a chat.completion."""
    message = {"role": "assistant",
               "content": whole.text if whole.text or not whole.calls else None}
    if whole.reasoning:
        message.update(dict.fromkeys(REASONING, whole.reasoning))
    if whole.calls:
        message["tool_calls"] = [{"id": call.id, "type": "function",
                                  "function": {"name": call.name,
                                               "arguments": call.arguments}}
                                 for call in whole.calls]
    choice = {"index": 0, "message": message, "logprobs": _chat_logprobs(whole.logprobs),
              "finish_reason": whole.finish, **_stop_reason(whole.stop_sequence)}
    return {"id": _id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
            "model": request.model, "choices": [choice], "usage": usage(whole.usage)}


def usage(u: native.Usage | None) -> dict:
    """OpenAI's usage object of a chat (audio_tokens: the prompt's clips' tokens)."""
    u = u or native.Usage()
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens,
                                      "audio_tokens": u.audio_tokens},
            "completion_tokens_details": {
                "reasoning_tokens": u.reasoning_tokens,
                "accepted_prediction_tokens": u.accepted_prediction_tokens,
                "rejected_prediction_tokens": u.rejected_prediction_tokens}}


def _chat_logprobs(entries: list | None) -> dict | None:
    """A choice's logprobs in OpenAI's shape; None when there are none to give."""
    if entries is None:
        return None
    return {"content": chat_content(entries), "refusal": None}


def _stop_reason(matched: str | None) -> dict:
    """{"stop_reason": the stop sequence} when one ended the reply, else {}."""
    return {"stop_reason": matched} if matched is not None else {}


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Chunks(EventStream):
    """A streamed OpenAI reply: chunks whose `object` is the class's, each with the
    reply's id (`prefix`-...), created and model, and with include_usage a usage
    (null but in the last); close() frees the model."""

    object = ""
    prefix = ""

    def __init__(self, reply: native.Reply, request):
        self._reply = reply
        self._request = request
        self.id = _id(self.prefix)
        self.created = int(time.time())

    def close(self) -> None:
        """Called by the server when the reply ends or the client goes away."""
        self._reply.close()

    def _chunk(self, choices: list, usage: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": self.object, "created": self.created,
                 "model": self._request.model, "choices": choices}
        if self._request.include_usage:
            chunk["usage"] = usage
        return chunk


class ChatChunks(_Chunks):
    """A streamed chat: Server-Sent Events of chat.completion.chunk, then [DONE]; the
    first chunk gives the role, the last the finish_reason (and with include_usage a
    chunk of no choices the usage); one {"error"} chunk ends a reply that broke part
    way. close() frees the model."""

    object = "chat.completion.chunk"
    prefix = "chatcmpl"

    def __init__(self, reply: native.Reply, request: native.Request):
        super().__init__(reply, request)
        self._pending: list = []  # log-probability entries the next chunk carries

    def chunks(self) -> Iterator[dict]:
        """The reply's chunk dicts."""
        yield self._event({"role": "assistant", "content": ""})
        for event in self._reply.events():
            if isinstance(event, native.Logprobs):
                self._pending.extend(event.entries)
            elif isinstance(event, native.Text):
                yield self._event({"content": event.text})
            elif isinstance(event, native.Reasoning):
                yield self._event(dict.fromkeys(REASONING, event.text))
            elif isinstance(event, native.CallStart):
                yield self._event({"tool_calls": [
                    {"index": event.index, "id": event.id, "type": "function",
                     "function": {"name": event.name, "arguments": ""}}]})
            elif isinstance(event, native.CallArgs):
                yield self._event({"tool_calls": [
                    {"index": event.index, "function": {"arguments": event.text}}]})
            elif isinstance(event, native.Finish):
                last = self._event({}, event.reason)
                last["choices"][0].update(_stop_reason(event.stop_sequence))
                yield last
            elif isinstance(event, native.Usage):
                if self._request.include_usage:
                    yield self._chunk([], usage=usage(event))
            elif isinstance(event, native.Failed):
                yield stream_error(event.error, self._request.model)
                return

    def _event(self, delta: dict, finish_reason: str | None = None) -> dict:
        entries, self._pending = self._pending, []
        choice = {"index": 0, "delta": delta, "logprobs": _chat_logprobs(entries or None),
                  "finish_reason": finish_reason}
        return self._chunk([choice])



# --- text completions -----------------------------------------------------------------


def completion(completions, body: dict, disconnected: Disconnected = never):
    """POST /v1/completions: a text_completion dict, or a stream of its chunks."""
    upstream = completions.passthrough(body, disconnected)
    if upstream is not None:
        return upstream  # a remote model's upstream's own reply, untouched
    request = read_text(body)
    reply = completions.create(request, disconnected)
    if request.stream:
        return TextChunks(reply, request)
    try:
        return text_completion(reply.events(), request)
    finally:
        reply.close()


def read_text(body: dict) -> native.TextRequest:
    """A completions body as a native TextRequest; a 400 for n or best_of above 1."""
    for name in ("n", "best_of"):
        if body.get(name) not in (None, 1):
            raise InvalidField(f"Invalid field '{name}': only {name}=1 is supported",
                               param=name)
    return native.TextRequest(
        model=body["model"], prompts=read_prompt(body["prompt"]), suffix=body.get("suffix"),
        echo=bool(body.get("echo")), sampling=sampling(body), stop=stops(body.get("stop")),
        logprobs=None if body.get("logprobs") is None else int(body["logprobs"]),
        logit_bias=body.get("logit_bias") or None, speculative=body.get("speculative"),
        lora=body.get("lora"), stream=bool(body.get("stream")),
        include_usage=include_usage(body))


def text_completion(events, request: native.TextRequest) -> dict:
    """A whole reply's events as a text_completion; a Failed event's error is raised."""
    choices, text_usage = [], native.Usage()
    for event in events:
        if isinstance(event, native.Choice):
            choices.append({"text": [], "index": event.index, "logprobs": None,
                            "finish_reason": "stop"})
        elif isinstance(event, native.Text):
            choices[-1]["text"].append(event.text)
        elif isinstance(event, native.Logprobs):
            choices[-1]["logprobs"] = _legacy(choices[-1]["logprobs"], event)
        elif isinstance(event, native.Finish):
            choices[-1]["finish_reason"] = event.reason
        elif isinstance(event, native.Usage):
            text_usage = event
        elif isinstance(event, native.Failed):
            raise event.error
    for choice in choices:
        choice["text"] = "".join(choice["text"])
    return {"id": _id("cmpl"), "object": "text_completion", "created": int(time.time()),
            "model": request.model, "choices": choices, "usage": _text_usage(text_usage)}


def _text_usage(u: native.Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _legacy(before: dict | None, event: native.Logprobs) -> dict:
    """The legacy logprobs object `before` with the event's tokens after its own."""
    out = legacy(event.entries, event.base)
    return out if before is None else {key: before[key] + out[key] for key in out}


class TextChunks(_Chunks):
    """A streamed text completion: Server-Sent Events of text_completion chunks, then
    [DONE]. Each choice sends its echo (when asked), its pieces, then an empty text
    with its finish_reason; with include_usage a last chunk with no choices carries the
    usage. With logprobs each chunk carries those of the tokens whose text it sends.
    close() frees the model."""

    object = "text_completion"
    prefix = "cmpl"

    def chunks(self) -> Iterator[dict]:
        """The reply's chunk dicts; one {"error": ...} dict ends a reply that broke."""
        index, pending = 0, None
        for event in self._reply.events():
            if isinstance(event, native.Choice):
                index, pending = event.index, None
            elif isinstance(event, native.Logprobs):
                pending = _legacy(pending, event)
            elif isinstance(event, native.Text):
                yield self._event(index, event.text, pending)
                pending = None
            elif isinstance(event, native.Finish):
                yield self._event(index, "", pending, event.reason)
                pending = None
            elif isinstance(event, native.Usage):
                if self._request.include_usage:
                    yield self._chunk([], usage=_text_usage(event))
            elif isinstance(event, native.Failed):
                yield stream_error(event.error, self._request.model)
                return

    def _event(self, index: int, text: str, logprobs: dict | None = None,
               finish_reason: str | None = None) -> dict:
        if logprobs is not None and not logprobs["tokens"]:
            logprobs = None  # nothing of this chunk's text came from a token
        choice = {"text": text, "index": index, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        return self._chunk([choice])



# --- log-probabilities ----------------------------------------------------------------


def text_of(piece: bytes) -> str:
    """A token's text: its bytes as UTF-8, or `bytes:\\xNN...` when they are not."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def _number(logprob: float) -> float:
    """A log-probability JSON can carry (never -inf or nan)."""
    return logprob if math.isfinite(logprob) else UNLIKELY


def chat_content(entries: list) -> list[dict]:
    """Chat's logprobs.content: {token, logprob, bytes, top_logprobs} per token
    (localrt.engines.logprobs.Entry)."""
    return [{"token": text_of(e.piece), "logprob": _number(e.logprob),
             "bytes": list(e.piece),
             "top_logprobs": [{"token": text_of(p), "logprob": _number(lp),
                               "bytes": list(p)} for p, lp in e.top or ()]}
            for e in entries]


def legacy(entries: list, base: int = 0) -> dict:
    """The legacy completions' logprobs object; `base` is added to every offset (the
    choice's text before these tokens that they do not count: the prompt's, when it
    is not echoed). Each top_logprobs dict holds the alternatives and the chosen token,
    so up to logprobs + 1 of them, as OpenAI's; a prompt's first token has nulls."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(text_of(e.piece))
        offsets.append(base + e.offset)
        if e.logprob is None:
            logprobs.append(None)
            tops.append(None)
            continue
        logprobs.append(_number(e.logprob))
        ranked = sorted([*e.top, (e.piece, e.logprob)], key=lambda pair: -pair[1])
        top: dict = {}
        for piece, lp in ranked:  # two tokens with the same text: the likelier one
            top.setdefault(text_of(piece), _number(lp))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
            "text_offset": offsets}
