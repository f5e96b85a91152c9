"""Anthropic's Messages API on localrt's chat: POST /v1/messages and its count_tokens.

A dialect like the others, as Ollama's anthropic package is one: `read(body)` reads a
Messages request (schemas/anthropic-messages.json) into a native request
(localrt.native) for localrt.inference.chat (`Chats.create`, `Chats.count_tokens`);
`message(whole, body)` writes a whole reply as a Message, and `MessageStream` writes
the reply's events as Anthropic's Server-Sent Events. There is no second generation
path: models, starting them, tools (localrt.engines.toolcalls), stop sequences and
usage are chat's, for local and remote models alike; a model's thinking (a local
reasoning model's, or a remote model's reasoning) becomes thinking blocks before the
text (with an empty signature, as llama-server writes them: streamed, thinking_delta
pieces then one signature_delta).
`error_body(err)` is the error shape of these routes (api.DIALECTS). Pure functions
over plain data; nothing here sees an engine or the WSGI environ.

  Anthropic                                  native
  system (a string or text blocks)           a system message
  text blocks                                Text parts (joined by newlines)
  image blocks (user, and in tool_result)    Media: a base64 source as a data: URL, a
                                             url source as it is; `where` the block
  tool_use blocks (assistant)                tool calls, arguments = json.dumps(input)
  tool_result blocks (user)                  tool messages, before the user's text
  tools {name, description, input_schema}    function tools
  tool_choice auto, any, tool, none          auto, required, function, none;
    disable_parallel_tool_use                parallel_tool_calls false
  stop_sequences                             stop
  output_config.format (a json_schema)       response_format (a grammar keeps to it)
  max_tokens, temperature, top_p, top_k, stream   the same
  seed (localrt's, as llama-server takes it)   the same
  thinking {"type": "enabled", budget_tokens}  think true, reasoning_budget (any N >= 1:
                                             localrt has no minimum of 1,024)
  thinking {"type": "disabled"}              think false
  thinking {"type": "adaptive"}              the model's default, no budget
  output_config.effort                       effort
  thinking blocks (assistant)                Message.reasoning (redacted_thinking
                                             blocks, encrypted, are left out)

Refused with a 400: document and audio blocks, server tools, and a
last message from the assistant (a prefill: chat cannot continue a reply).
redacted_thinking blocks in the history are left out; other unknown fields are
ignored (README.rst lists them).

Tool-call ids: a call the model makes goes out as "toolu_" + chat's id. An id that
comes back reaches the chat template as 9 letters and digits, the strictest form a
family takes (Mistral's template refuses any other; Hermes, Qwen and Llama templates
do not show ids): the id itself when it is that, else 9 hex digits of its hash, the
same for a tool_use and its tool_result.

usage: input_tokens is the prompt less what the prompt cache held, which is
cache_read_input_tokens, as llama-server and Anthropic count them; streamed, the split
comes in message_delta's usage (MessageStream.events says why).

stop_reason: the reply's finish "length" is max_tokens and "tool_calls" tool_use;
"stop" is stop_sequence when the stop sequence that ended it (Finish.stop_sequence;
vLLM upstreams send it as stop_reason) is one of the request's stop_sequences, else
end_turn.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from typing import Iterator

from localrt import native
from localrt.admission import Disconnected, never
from localrt.dialects.common import Fields, NamedEvents, failure, write
from localrt.errors import HTTPError, InvalidField

# Anthropic's error type for each HTTP status (its API's errors page); any other 4xx is
# an invalid_request_error, any other 5xx an api_error.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               529: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use",
                "function_call": "tool_use", "content_filter": "refusal"}
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed")  # the same name in both
# Blocks a message may carry that localrt cannot show a model, and why.
_NO_AUDIO = ("the Messages API has no audio block: send audio to /v1/chat/completions "
             "(input_audio parts) or /v1/audio/transcriptions")
UNSUPPORTED_BLOCKS = {
    "document": "document blocks are not supported: send the text as a text block",
    "audio": _NO_AUDIO, "input_audio": _NO_AUDIO}
SKIPPED_BLOCKS = ("redacted_thinking",)  # encrypted thinking: nothing a template can read
_TEMPLATE_ID = re.compile(r"[A-Za-z0-9]{9}")


def error_body(err: HTTPError) -> dict:
    """Anthropic's error shape for a localrt error: {"type": "error", "error": {type, message}}."""
    kind = ERROR_TYPES.get(err.status) or \
        ("invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


# --- the route -----------------------------------------------------------------------


def messages(chats, body: dict, disconnected: Disconnected = never):
    """POST /v1/messages: a Message dict, or a MessageStream."""
    request = read(body)
    with FIELDS.named(request):
        return write(chats.create(request, disconnected), request.stream,
                     lambda reply: MessageStream(reply, body),
                     lambda whole: message(whole, body))


def count_tokens(chats, body: dict, disconnected: Disconnected = never) -> dict:
    """POST /v1/messages/count_tokens: the prompt's tokens in the model's chat template."""
    request = read_count(body)
    with FIELDS.named(request):
        return {"input_tokens": chats.count_tokens(request, disconnected)}


# --- the request ----------------------------------------------------------------------


def read(body: dict) -> native.Request:
    """A Messages request (or a count_tokens one, which has no max_tokens) as a native
    Request."""
    messages = []
    system = _system_text(body.get("system"))
    if system:
        messages.append(native.Message("system", [native.Text(system)]))
    last = len(body["messages"]) - 1
    for i, message in enumerate(body["messages"]):
        messages += _messages(i, message, i == last)
    choice = body.get("tool_choice") or {"type": "auto"}
    mode = {"auto": "auto", "any": "required", "none": "none"}.get(choice["type"])
    fmt = (body.get("output_config") or {}).get("format")
    effort = (body.get("output_config") or {}).get("effort")
    return native.Request(
        model=body["model"], messages=messages,
        sampling={k: body[k] for k in SAMPLING if body.get(k) is not None},
        stop=list(body.get("stop_sequences") or []),
        tools=[_tool(tool) for tool in body.get("tools") or ()],
        tool_choice=mode or "function", tool_function=None if mode else choice["name"],
        parallel_tool_calls=not choice.get("disable_parallel_tool_use"),
        response_format={"type": "json_schema", "schema": fmt["schema"], "name": "output"}
        if fmt else None,
        stream=bool(body.get("stream")), include_usage=bool(body.get("stream")),
        **({"effort": effort} if effort else {}), **_thinking(body.get("thinking")))


def _thinking(thinking: dict | None) -> dict:
    """The native think and reasoning_budget of Anthropic's `thinking`: enabled (with
    its budget_tokens), disabled, or adaptive (the model's default, no budget)."""
    kind = (thinking or {}).get("type")
    if kind == "enabled":
        return {"think": True, "reasoning_budget": thinking.get("budget_tokens")}
    if kind == "disabled":
        return {"think": False}
    return {}


def read_count(body: dict) -> native.Request:
    """The native request whose prompt a count_tokens request counts (its model, system,
    messages and tools; any other field is ignored)."""
    return read({k: body[k] for k in ("model", "system", "messages", "tools", "tool_choice",
                                      "thinking")
                 if k in body})


def _system_text(system) -> str:
    if isinstance(system, list):
        return "\n".join(block["text"] for block in system)
    return system or ""


def _messages(index: int, message: dict, last: bool) -> list:
    """The native messages of one Anthropic message: a user's tool results become tool
    messages (first, as chat templates want them right after the calls), its text and
    images a user message; an assistant's text and tool_use blocks one assistant
    message."""
    role, content = message["role"], message["content"]
    if role == "assistant" and last:
        raise InvalidField(f"Invalid field 'messages[{index}]': the last message is the "
                           f"assistant's (a prefill), which localrt cannot continue; end "
                           f"with a user message", param=f"messages[{index}]")
    if isinstance(content, str):
        return [native.Message(role, [native.Text(content)] if content else [])]
    parts, calls, results, thought = [], [], [], []
    for j, block in enumerate(content):
        field = f"messages[{index}].content[{j}]"
        kind = block["type"]
        if kind == "text":
            parts.append(native.Text(block["text"]))
        elif kind == "image" and role == "user":
            parts.append(_media(block, field))
        elif kind == "tool_use" and role == "assistant":
            calls.append(native.ToolCall(call_id(block["id"]), block["name"],
                                         json.dumps(block["input"], ensure_ascii=False)))
        elif kind == "tool_result" and role == "user":
            results.append(native.Message("tool", _result_parts(block.get("content"), field),
                                          tool_call_id=call_id(block["tool_use_id"])))
        elif kind == "thinking" and role == "assistant":
            thought.append(block["thinking"])
        elif kind in SKIPPED_BLOCKS and role == "assistant":
            continue
        elif kind in UNSUPPORTED_BLOCKS:
            raise InvalidField(f"Invalid field '{field}': {UNSUPPORTED_BLOCKS[kind]}",
                               param=field)
        else:
            raise InvalidField(f"Invalid field '{field}.type': a {role} message cannot "
                               f"carry {kind!r} blocks here (text"
                               f"{', tool_use' if role == 'assistant' else ', image'}"
                               f"{', tool_result' if role == 'user' else ''})",
                               param=f"{field}.type")
    if role == "assistant":
        return [native.Message("assistant", parts, calls, reasoning="".join(thought))]
    # The user's own message comes after its tool results.
    if results:
        return results + ([native.Message(role, parts)] if parts else [])
    return [native.Message(role, parts)]


def _media(block: dict, field: str) -> native.Media:
    """An image block as a Media part: a base64 source as a data: URL, a url source as
    its URL (both read by localrt.inference.media)."""
    source = block["source"]
    if str(source.get("media_type", "")).lower().startswith("audio/"):
        raise InvalidField(f"Invalid field '{field}.source.media_type': an image block "
                           f"cannot carry audio; {_NO_AUDIO}",
                           param=f"{field}.source.media_type")
    if source["type"] == "base64":
        return native.Media(f"data:{source['media_type']};base64,{source['data']}",
                            source["media_type"], field)
    return native.Media(source["url"], "image/*", field)


def _result_parts(content, field: str) -> list:
    """A tool_result's content as a tool message's parts: its text, and its images."""
    if not isinstance(content, list):
        return [native.Text(content)] if content else []
    parts = []
    for k, block in enumerate(content):
        where = f"{field}.content[{k}]"
        if block["type"] == "text":
            parts.append(native.Text(block["text"]))
        elif block["type"] == "image":
            parts.append(_media(block, where))
        else:
            why = UNSUPPORTED_BLOCKS.get(block["type"], "only text and image blocks are "
                                                        "supported")
            raise InvalidField(f"Invalid field '{where}': {why}", param=where)
    return parts


def _tool(tool: dict) -> dict:
    """An Anthropic (custom) tool as a function tool."""
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def call_id(tool_use_id: str) -> str:
    """The id a chat template gets for an Anthropic tool_use id (see the module docstring)."""
    own = tool_use_id[len("toolu_"):] if tool_use_id.startswith("toolu_") else tool_use_id
    if _TEMPLATE_ID.fullmatch(own):
        return own
    return hashlib.sha256(tool_use_id.encode("utf-8")).hexdigest()[:9]


def tool_use_id(chat_id: str | None) -> str:
    """The Anthropic id of a call the model made."""
    if not chat_id:
        return f"toolu_{uuid.uuid4().hex[:24]}"
    return chat_id if chat_id.startswith("toolu_") else f"toolu_{chat_id}"


# The native names of the fields of errors, and Anthropic's (the messages' indexes differ).
FIELDS = Fields((r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
                (r"tools\[(\d+)\]\.function\.name", r"tools[\1].name"),
                (r"tool_choice\.function\.name", "tool_choice.name"),
                (r"stop\b", "stop_sequences"),
                (r"response_format\.json_schema\.schema", "output_config.format.schema"),
                (r"response_format", "output_config.format"),
                (r"messages\[\d+\][\w.\[\]]*", "messages"))


# --- the reply ------------------------------------------------------------------------


def message(whole: native.Whole, body: dict) -> dict:
    """The Message of a whole reply (localrt's, or a remote upstream's)."""
    content = []
    if whole.reasoning:
        content.append({"type": "thinking", "thinking": whole.reasoning, "signature": ""})
    if whole.text:
        content.append({"type": "text", "text": whole.text})
    for call in whole.calls:
        content.append({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
                        "input": _input(call.arguments)})
    reason, sequence = stop_reason(whole.finish, whole.stop_sequence, body)
    return {"id": _message_id(), "type": "message", "role": "assistant", "content": content,
            "model": body["model"], "stop_reason": reason, "stop_sequence": sequence,
            "usage": _usage(whole.usage)}


def stop_reason(finish_reason, matched, body: dict) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for the reply's finish reason and the stop sequence
    that ended it, if one did."""
    if finish_reason in (None, "stop"):
        if isinstance(matched, str) and matched in (body.get("stop_sequences") or ()):
            return "stop_sequence", matched
        return "end_turn", None
    return STOP_REASONS.get(finish_reason, "end_turn"), None


def _input(arguments) -> dict:
    """A call's arguments as tool_use's input object ({} when they are not one)."""
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _usage(usage: native.Usage | None) -> dict:
    """Anthropic's usage of a reply: the prompt split into the tokens read afresh
    (input_tokens) and those the prompt cache held (cache_read_input_tokens); localrt
    caches without being asked, so it never counts a cache write."""
    usage = usage or native.Usage()
    cached = min(usage.cached_tokens, usage.prompt_tokens)  # an upstream's, unchecked
    return {"input_tokens": usage.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": usage.completion_tokens}


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


class MessageStream(NamedEvents):
    """A streamed Message: Anthropic's Server-Sent Events (message_start, ping, each
    content block's start, deltas and stop, message_delta, message_stop) made from a
    native reply's events; a failure part way ends it with an `error` event. close()
    closes the reply, which frees the model."""

    def __init__(self, reply: native.Reply, body: dict):
        super().__init__(reply)
        self._body = body

    def named(self) -> Iterator[tuple[str, dict]]:
        """The events, each named by its `type`."""
        for event in self.events():
            yield event["type"], event

    def events(self) -> Iterator[dict]:
        """The events as dicts, each with its `type`."""
        # The prompt cache's share is known only once the prompt is read, and
        # message_start goes before that (a long prompt takes minutes): it counts the
        # whole prompt as input_tokens, and message_delta's usage, which clients take
        # over it (Anthropic's own streams send cumulative counts there), splits it.
        usage = _usage(native.Usage(self._reply.prompt_tokens))
        yield {"type": "message_start", "message": {
            "id": _message_id(), "type": "message", "role": "assistant", "content": [],
            "model": self._body["model"], "stop_reason": None, "stop_sequence": None,
            "usage": dict(usage)}}
        yield {"type": "ping"}
        blocks = _Blocks()
        finish = native.Finish("stop")
        for event in self._reply.events():
            if isinstance(event, native.Failed):
                yield from blocks.close()
                yield _error_event(failure(event.error, self._body["model"]))
                return
            if isinstance(event, native.Finish):
                finish = event
            elif isinstance(event, native.Usage):
                usage = _usage(event)
            else:
                yield from blocks.read(event)
        yield from blocks.close()
        reason, sequence = stop_reason(finish.reason, finish.stop_sequence, self._body)
        yield {"type": "message_delta",
               "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage}
        yield {"type": "message_stop"}


class _Blocks:
    """The content blocks of a streamed Message, from native events: thinking goes to a
    thinking block, text to a text block, each tool call to a tool_use block whose
    input comes as input_json_delta pieces; a block stops when the next one starts."""

    def __init__(self):
        self.index = -1
        self.open: tuple | None = None  # ("text",), ("thinking",) or ("tool", index)

    def read(self, event) -> Iterator[dict]:
        """The events for one native event."""
        if isinstance(event, native.Text) and event.text:
            if self.open != ("text",):
                yield from self._start(("text",), {"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": event.text})
        elif isinstance(event, native.Reasoning) and event.text:
            if self.open != ("thinking",):
                yield from self._start(("thinking",), {"type": "thinking", "thinking": "",
                                                       "signature": ""})
            yield self._delta({"type": "thinking_delta", "thinking": event.text})
        elif isinstance(event, native.CallStart):
            yield from self._start(("tool", event.index),
                                   {"type": "tool_use", "id": tool_use_id(event.id),
                                    "name": event.name, "input": {}})
        elif isinstance(event, native.CallArgs) and event.text:
            if self.open != ("tool", event.index):  # an upstream may interleave calls
                yield from self._start(("tool", event.index),
                                       {"type": "tool_use", "id": tool_use_id(None),
                                        "name": "", "input": {}})
            yield self._delta({"type": "input_json_delta", "partial_json": event.text})

    def close(self) -> Iterator[dict]:
        """The stop of the block still open, if one is; a thinking block's signature
        comes first, empty (Anthropic's streams end each thinking block with one)."""
        if self.open == ("thinking",):
            yield self._delta({"type": "signature_delta", "signature": ""})
        if self.open is not None:
            self.open = None
            yield {"type": "content_block_stop", "index": self.index}

    def _start(self, key: tuple, block: dict) -> Iterator[dict]:
        yield from self.close()
        self.index += 1
        self.open = key
        yield {"type": "content_block_start", "index": self.index, "content_block": block}

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}


def _error_event(error) -> dict:
    """The `error` event that ends a stream which broke part way (an api_error: the
    request was fine, generating it failed)."""
    message = error.get("message") if isinstance(error, dict) else None
    return {"type": "error", "error": {"type": "api_error",
                                       "message": str(message or "Generation failed")}}
