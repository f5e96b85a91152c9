"""Anthropic's Messages API on localrt's chat: POST /v1/messages and its count_tokens.

A thin translation, as Ollama's anthropic package is one: `chat_request(body)` turns a
Messages request (schemas/anthropic-messages.json) into an OpenAI chat request for
localrt.inference.chat (`Chats.create`, `Chats.count_tokens`); `message(completion, body)` turns
the chat.completion back into a Message, and `MessageStream` turns the stream's
chat.completion.chunk dicts into Anthropic's Server-Sent Events. There is no second
generation path: models, starting them, tools (localrt.engines.toolcalls), stop sequences and
usage are chat's, for local and remote models alike. `error_body(err)` is the error
shape of these routes (api.DIALECTS). Pure functions over plain data; nothing here
sees an engine or the WSGI environ.

  Anthropic                                  OpenAI chat
  system (a string or text blocks)           a system message
  text blocks                                the content, joined by newlines
  image blocks (user, and in tool_result)    image_url parts: a base64 source as a
                                             data: URL, a url source as it is
  tool_use blocks (assistant)                tool_calls, arguments = json.dumps(input)
  tool_result blocks (user)                  role "tool" messages, before the user's text
  tools {name, description, input_schema}    function tools
  tool_choice auto, any, tool, none          auto, required, the function, none;
    disable_parallel_tool_use                parallel_tool_calls: false
  stop_sequences                             stop
  output_config.format (a json_schema)       response_format (a grammar keeps to it)
  max_tokens, temperature, top_p, top_k, stream   the same
  seed (localrt's, as llama-server takes it)   the same

Refused with a 400: document blocks, server tools, and a
last message from the assistant (a prefill: chat cannot continue a reply). thinking
blocks in the history are left out; other unknown fields are ignored (README.rst
lists them).

Tool-call ids: a call the model makes goes out as "toolu_" + chat's id. An id that
comes back reaches the chat template as 9 letters and digits, the strictest form a
family takes (Mistral's template refuses any other; Hermes, Qwen and Llama templates
do not show ids): the id itself when it is that, else 9 hex digits of its hash, the
same for a tool_use and its tool_result.

stop_reason: chat's finish_reason "length" is max_tokens and "tool_calls" tool_use;
"stop" is stop_sequence when the choice's `stop_reason` (vLLM's field, which localrt.inference.chat
sets and vLLM upstreams send) is one of the request's stop_sequences, else end_turn.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from typing import Iterator

from localrt.dialects.common import Fields, NamedEvents
from localrt.errors import HTTPError, InvalidField, UpstreamError

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
UNSUPPORTED_BLOCKS = {
    "document": "document blocks are not supported: send the text as a text block"}
SKIPPED_BLOCKS = ("thinking", "redacted_thinking")  # a history's reasoning, not shown
_TEMPLATE_ID = re.compile(r"[A-Za-z0-9]{9}")


def error_body(err: HTTPError) -> dict:
    """Anthropic's error shape for a localrt error: {"type": "error", "error": {type, message}}."""
    kind = ERROR_TYPES.get(err.status) or \
        ("invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


# --- the request ----------------------------------------------------------------------


def chat_request(body: dict) -> dict:
    """The OpenAI chat request (schemas/chat-completion.json) for a Messages request
    (or a count_tokens one, which has no max_tokens)."""
    return translate(body)[0]


def translate(body: dict) -> tuple[dict, Fields]:
    """(the chat request, `FIELDS` with the Anthropic path of each image part it made):
    an error about an image names the block the client sent."""
    messages, paths = [], {}
    system = _system_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    last = len(body["messages"]) - 1
    for i, message in enumerate(body["messages"]):
        made, places = _messages(i, message, i == last)
        for offset, part, where in places:
            paths[f"messages[{len(messages) + offset}].content[{part}]"] = where
        messages += made
    return _request(body, messages), FIELDS.with_paths(paths)


def _request(body: dict, messages: list) -> dict:
    """The chat request of a Messages request, its messages translated already."""
    out = {"model": body["model"], "messages": messages}
    out.update((k, body[k]) for k in SAMPLING if body.get(k) is not None)
    if body.get("stop_sequences"):
        out["stop"] = list(body["stop_sequences"])
    if body.get("tools"):
        out["tools"] = [_tool(tool) for tool in body["tools"]]
    choice = body.get("tool_choice")
    if choice:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice["type"]) or {"type": "function", "function": {"name": choice["name"]}}
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    fmt = (body.get("output_config") or {}).get("format")
    if fmt:
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if body.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out


def translate_count(body: dict) -> tuple[dict, Fields]:
    """The chat request whose prompt a count_tokens request counts (its model, system,
    messages and tools; any other field is ignored), with its Fields (as `translate`
    gives them)."""
    return translate({k: body[k] for k in ("model", "system", "messages", "tools",
                                           "tool_choice") if k in body})


def _system_text(system) -> str:
    if isinstance(system, list):
        return "\n".join(block["text"] for block in system)
    return system or ""


def _messages(index: int, message: dict, last: bool) -> tuple[list, list]:
    """The chat messages of one Anthropic message: a user's tool results become tool
    messages (first, as chat templates want them right after the calls), its text and
    images a user message; an assistant's text and tool_use blocks one assistant
    message. With them, (message offset, part index, Anthropic path) of each image."""
    role, content = message["role"], message["content"]
    if role == "assistant" and last:
        raise InvalidField(f"Invalid field 'messages[{index}]': the last message is the "
                           f"assistant's (a prefill), which localrt cannot continue; end "
                           f"with a user message", param=f"messages[{index}]")
    if isinstance(content, str):
        return [{"role": role, "content": content}], []
    parts, calls, results, places = [], [], [], []
    for j, block in enumerate(content):
        field = f"messages[{index}].content[{j}]"
        kind = block["type"]
        if kind == "text":
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            places.append((None, len(parts), field))
            parts.append(_image_part(block, field))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": call_id(block["id"]), "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block["input"],
                                                               ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            result, images = _result_content(block.get("content"), field)
            places += [(len(results), k, where) for k, where in images]
            results.append({"role": "tool", "tool_call_id": call_id(block["tool_use_id"]),
                            "content": result})
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
    text = "\n".join(p["text"] for p in parts if p["type"] == "text")
    if role == "assistant":
        reply = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            reply["tool_calls"] = calls
        return [reply], []
    # The user's own message comes after its tool results.
    places = [(len(results) if at is None else at, k, where) for at, k, where in places]
    own = parts if any(p["type"] == "image_url" for p in parts) else text
    if results:
        return results + ([{"role": role, "content": own}] if parts else []), places
    return [{"role": role, "content": own}], places


def _image_part(block: dict, field: str) -> dict:
    """An image block as chat's image_url part: a base64 source as a data: URL, a url
    source as its URL (fetched by localrt.inference.images)."""
    source = block["source"]
    if source["type"] == "base64":
        url = f"data:{source['media_type']};base64,{source['data']}"
    else:
        url = source["url"]
    return {"type": "image_url", "image_url": {"url": url}}


def _result_content(content, field: str) -> tuple:
    """A tool_result's content as a tool message's: its text, or with images a list of
    text and image_url parts; and (part index, Anthropic path) of each image."""
    if not isinstance(content, list):
        return content or "", []
    parts, places = [], []
    for k, block in enumerate(content):
        where = f"{field}.content[{k}]"
        if block["type"] == "text":
            parts.append({"type": "text", "text": block["text"]})
        elif block["type"] == "image":
            places.append((len(parts), where))
            parts.append(_image_part(block, where))
        else:
            why = UNSUPPORTED_BLOCKS.get(block["type"], "only text and image blocks are "
                                                        "supported")
            raise InvalidField(f"Invalid field '{where}': {why}", param=where)
    if places:
        return parts, places
    return "\n".join(p["text"] for p in parts), []


def _tool(tool: dict) -> dict:
    """An Anthropic (custom) tool as an OpenAI function tool."""
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


# Chat's names for the fields of its errors, and Anthropic's (the messages' indexes differ).
FIELDS = Fields((r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
                (r"tools\[(\d+)\]\.function\.name", r"tools[\1].name"),
                (r"tool_choice\.function\.name", "tool_choice.name"),
                (r"stop\b", "stop_sequences"),
                (r"response_format\.json_schema\.schema", "output_config.format.schema"),
                (r"response_format", "output_config.format"),
                (r"messages\[\d+\][\w.\[\]]*", "messages"))


# --- the reply ------------------------------------------------------------------------


def message(completion: dict, body: dict) -> dict:
    """The Message for a chat.completion (localrt's, or a remote upstream's)."""
    try:
        choice = completion["choices"][0]
        reply = choice["message"]
        content = []
        if isinstance(reply.get("content"), str) and reply["content"]:
            content.append({"type": "text", "text": reply["content"]})
        for call in reply.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": tool_use_id(call.get("id")),
                            "name": call["function"]["name"],
                            "input": _input(call["function"].get("arguments"))})
    except (KeyError, IndexError, TypeError, AttributeError):
        raise UpstreamError("The model's reply was not a chat completion") from None
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"),
                                   body)
    return {"id": _message_id(), "type": "message", "role": "assistant", "content": content,
            "model": body["model"], "stop_reason": reason, "stop_sequence": sequence,
            "usage": _usage(completion.get("usage"))}


def stop_reason(finish_reason, matched, body: dict) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for chat's finish_reason and the stop sequence that
    ended the reply, if one did."""
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


def _usage(usage) -> dict:
    usage = usage if isinstance(usage, dict) else {}
    return {"input_tokens": _count(usage.get("prompt_tokens")),
            "output_tokens": _count(usage.get("completion_tokens"))}


def _count(value) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


class MessageStream(NamedEvents):
    """A streamed Message: Anthropic's Server-Sent Events (message_start, ping, each
    content block's start, deltas and stop, message_delta, message_stop) made from a
    chat stream's chunks; a failure part way ends it with an `error` event. close()
    closes the chat stream, which frees the model."""

    def __init__(self, chat_stream, body: dict):
        super().__init__(chat_stream)
        self._chat = chat_stream
        self._body = body

    def named(self) -> Iterator[tuple[str, dict]]:
        """The events, each named by its `type`."""
        for event in self.events():
            yield event["type"], event

    def events(self) -> Iterator[dict]:
        """The events as dicts, each with its `type`."""
        usage = {"input_tokens": _count(getattr(self._chat, "prompt_tokens", 0)),
                 "output_tokens": 0}
        yield {"type": "message_start", "message": {
            "id": _message_id(), "type": "message", "role": "assistant", "content": [],
            "model": self._body["model"], "stop_reason": None, "stop_sequence": None,
            "usage": dict(usage)}}
        yield {"type": "ping"}
        blocks = _Blocks()
        finish = matched = None
        for chunk in self._chat.chunks():
            if "error" in chunk and not chunk.get("choices"):
                yield from blocks.close()
                yield _error_event(chunk["error"])
                return
            if isinstance(chunk.get("usage"), dict):
                usage = _usage(chunk["usage"])
            for choice in chunk.get("choices") or ():
                yield from blocks.read(choice.get("delta") or {})
                if choice.get("finish_reason"):
                    finish, matched = choice["finish_reason"], choice.get("stop_reason")
        yield from blocks.close()
        reason, sequence = stop_reason(finish, matched, self._body)
        yield {"type": "message_delta",
               "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage}
        yield {"type": "message_stop"}


class _Blocks:
    """The content blocks of a streamed Message, from chat deltas: text goes to a text
    block, each tool call to a tool_use block whose input comes as input_json_delta
    pieces; a block stops when the next one starts."""

    def __init__(self):
        self.index = -1
        self.open: tuple | None = None  # ("text",) or ("tool", chat's call index)

    def read(self, delta: dict) -> Iterator[dict]:
        """The events for one delta."""
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self.open != ("text",):
                yield from self._start(("text",), {"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": text})
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            key = ("tool", call.get("index", 0))
            if self.open != key:
                block = {"type": "tool_use", "id": tool_use_id(call.get("id")),
                         "name": function.get("name") or "", "input": {}}
                yield from self._start(key, block)
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments:
                yield self._delta({"type": "input_json_delta", "partial_json": arguments})

    def close(self) -> Iterator[dict]:
        """The stop of the block still open, if one is."""
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
