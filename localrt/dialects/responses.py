"""OpenAI's Responses API (POST, GET and DELETE /v1/responses), as a translation onto chat.

`Responses.create(body)` takes a request that passed schemas/response-create.json and
turns it into a chat-completions body (schemas/chat-completion.json): `instructions`
become a system message, the input items become messages (a `function_call` an
assistant's tool call, a `function_call_output` a "tool" message, an `input_image` part
chat's image_url part), function tools
become chat's tools, `max_output_tokens` becomes max_tokens and `text.format` becomes
response_format. `Chats.create` (localrt.inference.chat; localrt.inference.remote for a remote model) runs
it, and what it gives back is reshaped: a chat.completion into a `response` object
(a `message` output item with `output_text`, one `function_call` item per tool call,
`status`, `usage`), a stream of chat.completion.chunk dicts into the Responses API's
typed Server-Sent Events (`ResponseStream`). Nothing here generates, or sees a model.

Stored responses (`store: true`; the default is false) live in memory in a `Store`,
for `GET /v1/responses/{id}`, `DELETE` and `previous_response_id`, which puts the
stored response's conversation (its input and output, and those of its own previous
responses, but not its instructions, as OpenAI does) before the new input. The store
keeps the MAX_STORED most recently used responses, and fewer when their
conversations' JSON together passes MAX_STORED_BYTES; it empties when the server stops.

Errors a chat raises name chat's fields; `FIELDS` gives them this API's names
(`messages` is `input`, `tools[i].function.parameters` is `tools[i].parameters`, ...).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Iterator

from localrt.admission import Disconnected, never
from localrt.dialects.common import Fields, NamedEvents, native
from localrt.errors import HTTPError, InvalidField, NotFound

# The store's bounds: responses, and the bytes of their conversations as JSON (each
# counted whole, so a long chain counts its shared start again in each response).
MAX_STORED = 1000
MAX_STORED_BYTES = 64 * 1024 * 1024

# Chat's field names in errors, and this API's names for them.
# Chat's names for the fields of its errors, and this API's (each the whole param).
FIELDS = Fields((r"messages(\[.*)?$", "input"),
                (r"tools\[(\d+)\]\.function\.(\w+)$", r"tools[\1].\2"),
                (r"tool_choice\.function\.name$", "tool_choice.name"),
                (r"(max_tokens|max_completion_tokens)$", "max_output_tokens"),
                (r"response_format\.json_schema\.schema$", "text.format.schema"),
                (r"response_format(\..*)?$", "text.format"))


class PreviousNotFound(InvalidField):
    """previous_response_id names no stored response: a 400, as OpenAI answers it."""

    code = "previous_response_not_found"


class Responses:
    """Responses on top of `chats` (localrt.inference.chat.Chats), and the store of those kept.

    `validators` (localrt.schemas.Validators) checks each chat body made here against
    schemas/chat-completion.json, so a translation that went wrong is a 400, never a 500.
    """

    def __init__(self, chats, validators, store: "Store | None" = None):
        self._chats = chats
        self._validators = validators
        self.store = store or Store()

    def create(self, body: dict, disconnected: Disconnected = never):
        """The response dict, or a ResponseStream when body["stream"] is true; a chat,
        in chat's admission (`disconnected`: localrt.admission)."""
        history = []
        previous = body.get("previous_response_id")
        if previous is not None:
            stored = self.store.get(previous)
            if stored is None:
                raise PreviousNotFound(f"Previous response with id '{previous}' not found.",
                                       param="previous_response_id")
            history = list(stored[1])
        places: list = []
        conversation = history + input_messages(body["input"], places)
        chat = chat_body(body, conversation)
        shell = response_shell(body)
        # Where each image of the input landed among chat's messages: errors name it.
        offset = len(history) + (1 if body.get("instructions") else 0)
        fields = FIELDS.with_paths({f"messages[{offset + at}].content[{j}]": where
                                    for at, j, where in places})
        native(self._validators, "chat-completion.json", chat, fields)
        with fields.named():
            result = self._chats.create(chat, disconnected)
        keep = self.store.put if body.get("store") else None
        if isinstance(result, dict):
            response = finished(shell, *output_of_completion(result))
            if keep:
                keep(response, conversation + output_messages(response["output"]))
            return response
        return ResponseStream(result, shell, conversation, keep)

    def get(self, response_id: str) -> dict:
        """A stored response; a 404 for one never stored or forgotten."""
        stored = self.store.get(response_id)
        if stored is None:
            raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
        return stored[0]

    def delete(self, response_id: str) -> dict:
        """Forget a stored response (OpenAI's deletion reply); a 404 for an unknown one."""
        if not self.store.delete(response_id):
            raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}


class Store:
    """Stored responses with their conversations, least recently used first.

    `_lock` guards `_entries` (id -> (response, conversation, bytes)) and `_bytes`,
    their sum: server threads store, read and delete at once."""

    def __init__(self, max_responses: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._entries: OrderedDict = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list) -> None:
        """Keep a response; the least recently used go while the store is over a bound
        (the newest always stays)."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        with self._lock:
            self._entries[response["id"]] = (response, tuple(conversation), size)
            self._bytes += size
            while len(self._entries) > 1 and (len(self._entries) > self.max_responses or
                                              self._bytes > self.max_bytes):
                self._bytes -= self._entries.popitem(last=False)[1][2]

    def get(self, response_id: str):
        """(response, conversation) of a stored response, now the most recently used; None
        when it is not stored."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                return None
            self._entries.move_to_end(response_id)
            return entry[0], entry[1]

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was stored."""
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self._bytes -= entry[2]
            return entry is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


# --- requests: Responses input onto chat messages ------------------------------------


def input_messages(given, places: list | None = None) -> list[dict]:
    """Chat messages from `input`: a string is a user message; items in order, an
    assistant's function_call items joined to its message as tool_calls. `places`, when
    given, gets (message index, part index, this API's path) for each image part."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    places = [] if places is None else places
    messages: list[dict] = []
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item["role"], "content": _content(
                item["content"], f"input[{i}].content", len(messages), places)})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _content(item["output"], f"input[{i}].output",
                                                 len(messages), places)})
        # "reasoning" items: localrt's models show no reasoning; they are left out.
    return messages


def _content(content, field: str, at: int, places: list):
    """A message's content as chat's: one string, its text parts joined as chat joins
    them; with input_image parts, a list of text and image_url parts (each image's
    (at, part index, path) added to `places`)."""
    if isinstance(content, str):
        return content
    if not any(part.get("type") == "input_image" for part in content):
        return "\n".join(part.get("text", part.get("refusal", "")) for part in content)
    parts = []
    for j, part in enumerate(content):
        if part.get("type") == "input_image":
            url = {"url": part["image_url"]}
            if part.get("detail") is not None:
                url["detail"] = part["detail"]
            places.append((at, j, f"{field}[{j}]"))
            parts.append({"type": "image_url", "image_url": url})
        else:
            parts.append({"type": "text", "text": part.get("text", part.get("refusal", ""))})
    return parts


def chat_body(body: dict, conversation: list) -> dict:
    """The chat-completions request for a Responses request and its conversation."""
    messages = list(conversation)
    if body.get("instructions"):
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    if not messages:
        raise InvalidField("Invalid field 'input': there is no message to answer",
                           param="input")
    chat = {"model": body["model"], "messages": messages}
    for name, chat_name in (("max_output_tokens", "max_tokens"), ("temperature", None),
                            ("top_p", None), ("seed", None), ("parallel_tool_calls", None)):
        if body.get(name) is not None:
            chat[chat_name or name] = body[name]
    if body.get("tools"):
        chat["tools"] = [{"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters", "strict")
            if tool.get(k) is not None}} for tool in body["tools"]]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format")
    if fmt and fmt["type"] == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name") or "response", "schema": fmt["schema"]}}
    elif fmt:
        chat["response_format"] = {"type": fmt["type"]}
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


# --- replies: chat onto Responses output -----------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_shell(body: dict) -> dict:
    """A response in progress: its id, and the request's settings as OpenAI echoes them."""
    return {"id": new_id("resp"), "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "background": False, "error": None,
            "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "max_tool_calls": None,
            "model": body["model"], "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
            "store": bool(body.get("store")),
            "temperature": body.get("temperature"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [], "top_logprobs": 0,
            "top_p": body.get("top_p"), "truncation": "disabled", "usage": None,
            "user": body.get("user"), "metadata": body.get("metadata") or {}}


def finished(shell: dict, output: list, finish_reason: str | None, usage: dict | None,
             error: dict | None = None) -> dict:
    """The response once its output is whole: completed, incomplete (cut at
    max_output_tokens or the context) or failed."""
    response = {**shell, "output": output, "usage": usage_of(usage)}
    if error is not None:
        response.update(status="failed", error={"code": "server_error",
                                                "message": error.get("message", "")})
    elif finish_reason == "length":
        response.update(status="incomplete",
                        incomplete_details={"reason": "max_output_tokens"})
    else:
        response.update(status="completed", completed_at=int(time.time()))
    return response


def usage_of(usage: dict | None) -> dict:
    """Chat's usage in the Responses API's shape (zeros when an upstream gave none)."""
    usage = usage or {}
    prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": prompt, "output_tokens": completion,
            "total_tokens": usage.get("total_tokens") or prompt + completion,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    """An assistant `message` output item holding one `output_text` part."""
    return {"id": item_id or new_id("msg"), "type": "message", "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> dict:
    """A `function_call` output item."""
    return {"id": item_id or new_id("fc"), "type": "function_call", "status": status,
            "call_id": call_id, "name": name, "arguments": arguments}


def output_of_completion(completion: dict) -> tuple[list, str | None, dict | None]:
    """(output items, finish_reason, usage) of a chat.completion: its text as a message
    (also when it is empty and there are no calls), then its tool calls."""
    choices = completion.get("choices") or [{}]
    message = choices[0].get("message") or {}
    finish = choices[0].get("finish_reason")
    status = "incomplete" if finish == "length" else "completed"
    calls = message.get("tool_calls") or []
    output = []
    if message.get("content") or not calls:
        output.append(message_item(message.get("content") or "", status))
    for call in calls:
        function = call.get("function") or {}
        output.append(call_item(call.get("id") or new_id("call"), function.get("name", ""),
                                function.get("arguments") or "", status))
    return output, finish, completion.get("usage")


def output_messages(output: list) -> list[dict]:
    """The chat messages of a response's output, for the conversation a later
    previous_response_id continues."""
    items = [{"type": "message", "role": "assistant", "content": item["content"]}
             if item["type"] == "message" else item for item in output]
    return input_messages(items)


# --- streams ----------------------------------------------------------------------------


class ResponseStream(NamedEvents):
    """A streamed response: the chat stream's chunks as the Responses API's typed events
    (`event:` and `data:` lines, each with its sequence_number); close() frees the model.

    The order, as OpenAI sends it: response.created, response.in_progress; for each
    output item, response.output_item.added, then a message's response.content_part.added,
    response.output_text.delta... response.output_text.done, response.content_part.done,
    or a call's response.function_call_arguments.delta... .done; response.output_item.done;
    last response.completed, or response.incomplete, or an `error` event and
    response.failed when generation broke part way.
    """

    def __init__(self, chat_stream, shell: dict, conversation: list, keep=None):
        super().__init__(chat_stream)
        self._chat = chat_stream
        self._shell = shell
        self._conversation = conversation
        self._keep = keep            # Store.put, when the response is to be stored
        self._sequence = 0
        self._output: list = []      # finished items, and the open one last
        self._open: dict | None = None
        self._calls: dict = {}       # the chat stream's call index -> its output item

    def named(self) -> Iterator[tuple[str, dict]]:
        """The events, as (name, data)."""
        return self.events()

    def events(self) -> Iterator[tuple[str, dict]]:
        """(event type, data) pairs, the data carrying its type and sequence_number."""
        yield self._event("response.created", response=dict(self._shell))
        yield self._event("response.in_progress", response=dict(self._shell))
        finish, usage = None, None
        for chunk in self._chat.chunks():
            if chunk.get("error") and not chunk.get("choices"):  # generation broke
                yield from self._failed(chunk["error"], usage)
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    yield from self._text(delta["content"])
                for call in delta.get("tool_calls") or []:
                    yield from self._call(call)
                finish = choice.get("finish_reason") or finish
        if not self._output:  # no text and no call: an empty message, as unstreamed
            yield from self._text("")
        yield from self._close("incomplete" if finish == "length" else "completed")
        response = finished(self._shell, self._output, finish, usage)
        if self._keep is not None:
            self._keep(response, self._conversation + output_messages(self._output))
        yield self._event("response.incomplete" if finish == "length" else
                          "response.completed", response=response)

    def _text(self, piece: str) -> Iterator[tuple[str, dict]]:
        if self._open is None or self._open["type"] != "message":
            yield from self._close("completed")
            yield from self._added(message_item("", "in_progress"))
            yield self._event("response.content_part.added", **self._at(),
                              content_index=0, part=_part(""))
        if piece:
            self._open["content"][0]["text"] += piece
            yield self._event("response.output_text.delta", **self._at(), content_index=0,
                              delta=piece, logprobs=[])

    def _call(self, delta: dict) -> Iterator[tuple[str, dict]]:
        function = delta.get("function") or {}
        index = delta.get("index", 0)
        item = self._calls.get(index)
        if item is None:
            yield from self._close("completed")
            item = self._calls[index] = call_item(delta.get("id") or new_id("call"),
                                                  function.get("name") or "", "",
                                                  "in_progress")
            yield from self._added(item)
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
        if function.get("arguments") and item is self._open:  # an upstream may interleave
            yield self._event("response.function_call_arguments.delta", **self._at(),
                              delta=function["arguments"])

    def _added(self, item: dict) -> Iterator[tuple[str, dict]]:
        self._output.append(item)
        self._open = item
        yield self._event("response.output_item.added", output_index=len(self._output) - 1,
                          item=_copy(item))

    def _close(self, status: str) -> Iterator[tuple[str, dict]]:
        """Finish the open item, if any, with its .done events."""
        item, self._open = self._open, None
        if item is None:
            return
        at = {"item_id": item["id"], "output_index": self._output.index(item)}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield self._event("response.output_text.done", **at, content_index=0, text=text,
                              logprobs=[])
            yield self._event("response.content_part.done", **at, content_index=0,
                              part=_part(text))
        else:
            yield self._event("response.function_call_arguments.done", **at,
                              name=item["name"], arguments=item["arguments"])
        item["status"] = status
        yield self._event("response.output_item.done", output_index=at["output_index"],
                          item=_copy(item))

    def _failed(self, error, usage) -> Iterator[tuple[str, dict]]:
        if not isinstance(error, dict):  # an upstream's error may be a bare message
            error = {"message": str(error)}
        yield self._event("error", code=error.get("code"), message=error.get("message", ""),
                          param=error.get("param"))
        response = finished(self._shell, [_copy(i) for i in self._output], None, usage,
                            error)
        yield self._event("response.failed", response=response)

    def _at(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self._output) - 1}

    def _event(self, kind: str, /, **data) -> tuple[str, dict]:
        event = {"type": kind, "sequence_number": self._sequence, **data}
        self._sequence += 1
        return kind, event


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def _copy(item: dict) -> dict:
    """An item as it is now (events must not change when the item grows later)."""
    return json.loads(json.dumps(item))
