"""OpenAI's Responses API (POST, GET and DELETE /v1/responses), a dialect on native chat.

`create(chats, store, body)` reads a request that passed schemas/response-create.json
into a native request (localrt.native): `instructions` become a system message, the
input items messages (a `function_call` an assistant's tool call, a
`function_call_output` a tool message, an `input_image` part a Media part named by
its path in `input`), function tools tools, `max_output_tokens` max_tokens and
`text.format` the response format, `reasoning.effort` the thinking's (as OpenAI chat's
reasoning_effort: "none" turns it off), and a `reasoning` input item the thinking of
the assistant message or call after it. A `namespace` tool's functions are tools named
NAMESPACE__FUNCTION (SEPARATOR), and a call of one comes back as a `function_call` with
the function's own `name` and its `namespace`; a `custom` tool (free text in, as Codex's
freeform apply_patch) is a function of one string, `input` (its grammar, if any, is in
the description the model reads; it is not enforced), and a call of one comes back as a
`custom_tool_call` item holding that text; OpenAI's hosted tools (HOSTED: web
search, file search, ...) are accepted, echoed in the response's `tools`, left out of
the prompt and so never called. `Chats.create` runs it (for a remote model through
its upstreams), and its events are written as a `response` object (a `reasoning`
item when the model's thinking came apart, a `message` output item with
`output_text`, one `function_call` or `custom_tool_call` item per tool call, `status`,
`usage`), or as the
Responses API's typed Server-Sent Events (`ResponseStream`). Nothing here generates,
or sees a model. A reasoning item is {"type": "reasoning", "id", "summary": [],
"content": [{"type": "reasoning_text", "text"}], "encrypted_content": null}: localrt
writes the thinking as the model wrote it, never a summary, and encrypts nothing.

Stored responses (`store: true`; the default is false) live in memory in a `Store`,
for `GET /v1/responses/{id}`, `DELETE` and `previous_response_id`, which puts the
stored response's conversation (its input and output, and those of its own previous
responses, but not its instructions, as OpenAI does) before the new input. The store
keeps the MAX_STORED most recently used responses, and fewer when their
conversations' JSON together passes MAX_STORED_BYTES; it empties when the server stops.

Errors of the native call name native fields; `FIELDS` gives them this API's names
(`messages` is `input`, `tools[i].function.parameters` is `tools[i].parameters`, ...),
and `Tools.fields` the request's own, where a native tool is a namespace's function
(`tools[8].tools[1].parameters`) or hosted tools before it moved its index.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator

from localrt import native
from localrt.admission import Disconnected, never
from localrt.dialects.common import Fields, NamedEvents, failure, thinking, write
from localrt.errors import InvalidField, NotFound, shown

# The store's bounds: responses, and the bytes of their conversations as JSON (each
# counted whole, so a long chain counts its shared start again in each response).
MAX_STORED = 1000
MAX_STORED_BYTES = 64 * 1024 * 1024

# The native names of the fields of errors, and this API's: a rule matches the start of
# the param, and what follows the match stays (the path inside a tool's schema).
RULES = ((r"messages(\[.*)?$", "input"),
         (r"tools\[(\d+)\]\.function\.(\w+)", r"tools[\1].\2"),
         (r"tool_choice\.function\.name$", "tool_choice.name"),
         (r"(max_tokens|max_completion_tokens)$", "max_output_tokens"),
         (r"response_format\.json_schema\.schema", "text.format.schema"),
         (r"response_format(\..*)?$", "text.format"))
FIELDS = Fields(*RULES)

# OpenAI's tools that its own servers run, or that its models call with output items of
# their own (local_shell, shell, apply_patch): accepted, echoed, never offered to the
# model (it could not call them). If you change this, also change the tool types of
# schemas/response-create.json (its "tool" and "tool_choice") and man/localrt-api.7.
HOSTED = ("web_search", "web_search_2025_08_26", "web_search_preview",
          "web_search_preview_2025_03_11", "file_search", "code_interpreter", "computer",
          "computer_use", "computer_use_preview", "image_generation", "mcp", "local_shell",
          "shell", "apply_patch", "tool_search")

# Between a namespace and its function in the name the model sees and calls:
# multi_agent_v1__spawn_agent. Not a dot: every family's parser reads any JSON string
# back, but remote models' OpenAI-compatible upstreams (and OpenAI's chat API, whose
# names schemas/chat-completion.json follows) take only [a-zA-Z0-9_-] in a name, and
# some chat templates print names into identifiers; two underscores keep the name a
# plain identifier (templates that write tools as TypeScript, as gpt-oss's does, need
# one) and are the separator other Responses-to-chat bridges use.
SEPARATOR = "__"


class PreviousNotFound(InvalidField):
    """previous_response_id names no stored response: a 400, as OpenAI answers it."""

    code = "previous_response_not_found"


def create(chats, store: "Store", body: dict, disconnected: Disconnected = never):
    """POST /v1/responses: the response dict, or a ResponseStream when body["stream"] is
    true; a chat on `chats` (localrt.inference.chat.Chats), kept in `store` with
    store: true."""
    history: list = []
    previous = body.get("previous_response_id")
    if previous is not None:
        stored = store.get(previous)
        if stored is None:
            raise PreviousNotFound(f"Previous response with id {shown(previous)} not found.",
                                   param="previous_response_id")
        history = list(stored[1])
    given = body["input"]
    items = [{"type": "message", "role": "user", "content": given}] \
        if isinstance(given, str) else list(given)
    tools = Tools.read(body.get("tools"))
    request = read(body, history, items, tools)
    shell = response_shell(body)
    conversation = history + items
    keep = store.put if body.get("store") else None
    def whole(whole: native.Whole) -> dict:
        response = finished(shell, *output_of(whole, tools.named, tools.custom))
        if keep:
            keep(response, conversation + output_items(response["output"]))
        return response

    with tools.fields().named(request):
        return write(chats.create(request, disconnected), request.stream,
                     lambda reply: ResponseStream(reply, shell, conversation, keep,
                                                  tools.named, tools.custom), whole)


def get(store: "Store", response_id: str) -> dict:
    """A stored response; a 404 for one never stored or forgotten."""
    stored = store.get(response_id)
    if stored is None:
        raise NotFound(f"Response with id {shown(response_id)} not found.", param="response_id")
    return stored[0]


def delete(store: "Store", response_id: str) -> dict:
    """Forget a stored response (OpenAI's deletion reply); a 404 for an unknown one."""
    if not store.delete(response_id):
        raise NotFound(f"Response with id {shown(response_id)} not found.", param="response_id")
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


# --- requests: Responses input as native messages ----------------------------------


@dataclass
class Tools:
    """A request's tools as the model is offered them: `native` the function tools as
    native.Request carries them (a namespace's named NAMESPACE__FUNCTION, hosted tools
    left out), `where` each one's path in the request (tools[3], tools[8].tools[1]),
    and `named` the native name -> (namespace, function) of each namespace's function."""

    native: list = field(default_factory=list)
    where: list = field(default_factory=list)
    named: dict = field(default_factory=dict)
    custom: set = field(default_factory=set)  # the custom tools' names

    @classmethod
    def read(cls, given) -> "Tools":
        """The tools of a request's `tools` (passed response-create.json)."""
        tools = cls()
        for i, tool in enumerate(given or ()):
            if tool["type"] == "function":
                tools._add(tool, f"tools[{i}]")
            elif tool["type"] == "namespace":
                for j, function in enumerate(tool["tools"]):
                    tools._add(function, f"tools[{i}].tools[{j}]", tool["name"])
            elif tool["type"] == "custom":
                tools.custom.add(tool["name"])
                tools._add({"name": tool["name"], "description": tool.get("description"),
                            "parameters": custom_parameters(tool.get("format"))},
                           f"tools[{i}]")
            # A hosted tool (HOSTED): nothing for the model to see or call.
        return tools

    def _add(self, tool: dict, where: str, namespace: str | None = None) -> None:
        name = tool["name"] if namespace is None else namespace + SEPARATOR + tool["name"]
        if namespace is not None:
            self.named[name] = (namespace, tool["name"])
        self.native.append({"type": "function", "function": {
            "name": name, **{k: tool[k] for k in ("description", "parameters", "strict")
                             if tool.get(k) is not None}}})
        self.where.append(where)

    def choice(self, choice) -> tuple[str, str | None]:
        """(native tool_choice, its function's native name) of a request's tool_choice; a
        400 for one that forces a hosted tool, or a function no namespace holds."""
        if not isinstance(choice, dict):
            return choice or "auto", None
        if choice["type"] == "custom":
            if choice["name"] not in self.custom:
                raise InvalidField(f"Invalid field 'tool_choice.name': no custom tool "
                                   f"{shown(choice['name'])} in tools",
                                   param="tool_choice.name")
            return "function", choice["name"]
        if choice["type"] != "function":
            raise InvalidField(f"Invalid field 'tool_choice': {shown(choice['type'])} is a "
                               f"hosted tool, which localrt accepts in tools but never "
                               f"calls, so it cannot be forced", param="tool_choice")
        name, namespace = choice["name"], choice.get("namespace")
        if namespace is not None:
            if self.named.get(namespace + SEPARATOR + name) != (namespace, name):
                raise InvalidField(f"Invalid field 'tool_choice.name': no function "
                                   f"{shown(name)} in a namespace {shown(namespace)}",
                                   param="tool_choice.name")
            return "function", namespace + SEPARATOR + name
        plain = {t["function"]["name"] for t in self.native} - self.named.keys()
        if name not in plain:  # a namespace's function, named alone where that is unique
            held = [native for native, (_, function) in self.named.items()
                    if function == name]
            if len(held) == 1:
                return "function", held[0]
        return "function", name

    def fields(self) -> Fields:
        """FIELDS, with this request's paths for the native tools first."""
        return Fields(*((rf"tools\[{k}\]\.function\.", where + ".")
                        for k, where in enumerate(self.where)), *RULES)


def custom_parameters(fmt: dict | None) -> dict:
    """The arguments a custom tool takes as a function: its free text, as `input`; the
    grammar a `format` gives it is shown to the model in the description."""
    about = "The tool's input, as free text"
    if (fmt or {}).get("type") == "grammar" and fmt.get("definition"):
        grammar = f"{fmt['syntax']} grammar" if fmt.get("syntax") else "grammar"
        about += f", following this {grammar}:\n{fmt['definition']}"
    return {"type": "object", "properties": {"input": {"type": "string", "description": about}},
            "required": ["input"], "additionalProperties": False}


def custom_input(arguments: str) -> str:
    """A custom tool's text, from the arguments its function was called with (the text
    as written when it is not the JSON object custom_parameters asks for)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return arguments


def read(body: dict, history: list, items: list, tools: Tools | None = None) -> native.Request:
    """The native request of a Responses request: its instructions, the stored
    conversation it continues (`history`, input items), its own input `items` and its
    `tools` (Tools.read of body["tools"] when not given)."""
    messages = []
    if body.get("instructions"):
        messages.append(native.Message("system", [native.Text(body["instructions"])]))
    messages += input_messages(history, "previous_response_id")
    messages += input_messages(items, "input")
    if not messages:
        raise InvalidField("Invalid field 'input': there is no message to answer",
                           param="input")
    sampling = {native_name or name: body[name]
                for name, native_name in (("max_output_tokens", "max_tokens"),
                                          ("temperature", None), ("top_p", None),
                                          ("seed", None))
                if body.get(name) is not None}
    tools = Tools.read(body.get("tools")) if tools is None else tools
    choice, function = tools.choice(body.get("tool_choice"))
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    response_format = {"json_schema": {"type": "json_schema", "schema": fmt.get("schema"),
                                       "name": fmt.get("name") or "response"},
                       "json_object": {"type": "json_object", "schema": None}}.get(fmt["type"])
    return native.Request(
        model=body["model"], messages=messages, sampling=sampling,
        tools=tools.native, tool_choice=choice, tool_function=function,
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        response_format=response_format,
        stream=bool(body.get("stream")), include_usage=bool(body.get("stream")),
        **thinking((body.get("reasoning") or {}).get("effort")))


def input_messages(items: list, field: str) -> list:
    """Native messages from input items, in order, an assistant's function_call items
    joined to its message as tool calls, and a reasoning item's thinking to the
    assistant message or call that follows it (a reasoning item nothing of the
    assistant's follows is left out); `field` names the items in errors."""
    messages: list = []
    thought = ""  # a reasoning item's text, until the assistant's item it came before
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "reasoning":
            thought += reasoning_text(item)
            continue
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append(native.Message(role, _parts(item["content"],
                                                         f"{field}[{i}].content")))
        elif kind == "function_call":
            name = item["name"] if not item.get("namespace") else \
                item["namespace"] + SEPARATOR + item["name"]
            call = native.ToolCall(item["call_id"], name, item["arguments"])
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and not thought:
                last.tool_calls.append(call)
            else:
                messages.append(native.Message("assistant", [], [call]))
        elif kind == "custom_tool_call":  # as the model called its function
            call = native.ToolCall(item["call_id"], item["name"],
                                   json.dumps({"input": item["input"]}, ensure_ascii=False))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls.append(call)
            else:
                messages.append(native.Message("assistant", [], [call]))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append(native.Message("tool", _parts(item["output"],
                                                          f"{field}[{i}].output"),
                                           tool_call_id=item["call_id"]))
        if messages and messages[-1].role == "assistant" and thought:
            messages[-1].reasoning += thought
        thought = ""
    return messages


def reasoning_text(item: dict) -> str:
    """The thinking a reasoning input item carries: its reasoning_text parts (localrt's
    and llama-server's), else its summary (what OpenAI's models give)."""
    parts = [p.get("text") for p in item.get("content") or ()
             if p.get("type") == "reasoning_text"]
    if not any(parts):
        parts = [p.get("text") for p in item.get("summary") or ()]
    return "".join(p for p in parts if isinstance(p, str))


def _parts(content, field: str) -> list:
    """A message's content as native parts: text, and input_image parts as Media."""
    if isinstance(content, str):
        return [native.Text(content)] if content else []
    parts = []
    for j, part in enumerate(content):
        if part.get("type") == "input_image":
            parts.append(native.Media(part["image_url"], "image/*", f"{field}[{j}]"))
        else:
            parts.append(native.Text(part.get("text", part.get("refusal", ""))))
    return parts


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
            "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"),
                          "summary": (body.get("reasoning") or {}).get("summary")},
            "service_tier": "default",
            "store": bool(body.get("store")),
            "temperature": body.get("temperature"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [], "top_logprobs": 0,
            "top_p": body.get("top_p"), "truncation": "disabled", "usage": None,
            "user": body.get("user"), "metadata": body.get("metadata") or {}}


def finished(shell: dict, output: list, finish_reason: str | None,
             usage: native.Usage | None, error: dict | None = None) -> dict:
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


def usage_of(usage: native.Usage | None) -> dict:
    """A reply's usage in the Responses API's shape (zeros when an upstream gave none)."""
    usage = usage or native.Usage()
    prompt, completion = usage.prompt_tokens, usage.completion_tokens
    return {"input_tokens": prompt, "output_tokens": completion,
            "total_tokens": prompt + completion,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens}}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    """An assistant `message` output item holding one `output_text` part."""
    return {"id": item_id or new_id("msg"), "type": "message", "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None, named: dict | None = None, custom=()) -> dict:
    """A `function_call` output item; a call of a namespace's function (`named`:
    Tools.named) has the function's own name and its `namespace`, and one of a custom
    tool (its name in `custom`, Tools.custom) is a `custom_tool_call` item."""
    if name in custom:
        return custom_call_item(call_id, name, custom_input(arguments), status, item_id)
    item = {"id": item_id or new_id("fc"), "type": "function_call", "status": status,
            "call_id": call_id, "name": name, "arguments": arguments}
    if named and name in named:
        item["namespace"], item["name"] = named[name]
    return item


def custom_call_item(call_id: str, name: str, text: str, status: str = "completed",
                     item_id: str | None = None) -> dict:
    """A `custom_tool_call` output item: the custom tool's name and its free text, `input`."""
    return {"id": item_id or new_id("ctc"), "type": "custom_tool_call", "status": status,
            "call_id": call_id, "name": name, "input": text}


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    """A `reasoning` output item holding the model's thinking as one reasoning_text."""
    return {"id": item_id or new_id("rs"), "type": "reasoning", "status": status,
            "summary": [], "content": [_reasoning_part(text)], "encrypted_content": None}


def output_of(whole: native.Whole, named: dict | None = None, custom=()
              ) -> tuple[list, str | None, native.Usage | None]:
    """(output items, finish reason, usage) of a whole reply: its reasoning, its text as
    a message (also when it is empty and there are no calls), then its tool calls (of
    namespaces' functions by `named`, Tools.named; custom tools' by `custom`)."""
    status = "incomplete" if whole.finish == "length" else "completed"
    output = []
    if whole.reasoning:
        output.append(reasoning_item(whole.reasoning, status))
    if whole.text or not whole.calls:
        output.append(message_item(whole.text, status))
    for call in whole.calls:
        output.append(call_item(call.id or new_id("call"), call.name, call.arguments or "",
                                status, named=named, custom=custom))
    return output, whole.finish, whole.usage


def output_items(output: list) -> list[dict]:
    """A response's output as input items, for the conversation a later
    previous_response_id continues."""
    return [{"type": "message", "role": "assistant", "content": item["content"]}
            if item["type"] == "message" else item for item in output]


# --- streams ----------------------------------------------------------------------------


class ResponseStream(NamedEvents):
    """A streamed response: a native reply's events as the Responses API's typed events
    (`event:` and `data:` lines, each with its sequence_number); close() frees the model.

    The order, as OpenAI sends it: response.created, response.in_progress; for each
    output item, response.output_item.added, then a message's response.content_part.added,
    response.output_text.delta... response.output_text.done, response.content_part.done,
    a reasoning item's response.content_part.added (a reasoning_text part),
    response.reasoning_text.delta... .done, response.content_part.done, a call's
    response.function_call_arguments.delta... .done, or a custom tool's call's
    response.custom_tool_call_input.delta and .done (its text is read out of the
    arguments once they are whole, so it comes in one delta); response.output_item.done;
    last response.completed, or response.incomplete, or an `error` event and
    response.failed when generation broke part way.
    """

    def __init__(self, reply: native.Reply, shell: dict, conversation: list, keep=None,
                 named: dict | None = None, custom=()):
        super().__init__(reply)
        self._named = named          # Tools.named: the namespaces' functions
        self._custom = custom        # Tools.custom: the custom tools' names
        self._custom_args: dict = {}  # a custom tool call's item id -> its arguments so far
        self._shell = shell
        self._conversation = conversation
        self._keep = keep            # Store.put, when the response is to be stored
        self._sequence = 0
        self._output: list = []      # finished items, and the open one last
        self._open: dict | None = None
        self._calls: dict = {}       # the reply's call index -> its output item

    def named(self) -> Iterator[tuple[str, dict]]:
        """The events, as (name, data)."""
        return self.events()

    def events(self) -> Iterator[tuple[str, dict]]:
        """(event type, data) pairs, the data carrying its type and sequence_number."""
        yield self._event("response.created", response=dict(self._shell))
        yield self._event("response.in_progress", response=dict(self._shell))
        finish, usage = None, None
        for event in self._reply.events():
            if isinstance(event, native.Failed):  # generation broke
                yield from self._failed(failure(event.error, self._shell["model"]), usage)
                return
            if isinstance(event, native.Text) and event.text:
                yield from self._text(event.text)
            elif isinstance(event, native.Reasoning) and event.text:
                yield from self._reasoning(event.text)
            elif isinstance(event, native.CallStart):
                yield from self._call(event.index, event.id, event.name, "")
            elif isinstance(event, native.CallArgs) and event.text:
                yield from self._call(event.index, None, "", event.text)
            elif isinstance(event, native.Finish):
                finish = event.reason
            elif isinstance(event, native.Usage):
                usage = event
        if not self._output:  # no text and no call: an empty message, as unstreamed
            yield from self._text("")
        yield from self._close("incomplete" if finish == "length" else "completed")
        response = finished(self._shell, self._output, finish, usage)
        if self._keep is not None:
            self._keep(response, self._conversation + output_items(self._output))
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

    def _reasoning(self, piece: str) -> Iterator[tuple[str, dict]]:
        if self._open is None or self._open["type"] != "reasoning":
            yield from self._close("completed")
            item = reasoning_item("", "in_progress")
            item["content"] = []  # as OpenAI's: the part comes in its own event
            yield from self._added(item)
            item["content"].append(_reasoning_part(""))
            yield self._event("response.content_part.added", **self._at(),
                              content_index=0, part=_reasoning_part(""))
        self._open["content"][0]["text"] += piece
        yield self._event("response.reasoning_text.delta", **self._at(), content_index=0,
                          delta=piece)

    def _call(self, index: int, call_id: str | None, name: str,
              arguments: str) -> Iterator[tuple[str, dict]]:
        item = self._calls.get(index)
        if item is None:
            yield from self._close("completed")
            item = self._calls[index] = call_item(call_id or new_id("call"), name, "",
                                                  "in_progress", named=self._named,
                                                  custom=self._custom)
            yield from self._added(item)
        if item["type"] == "custom_tool_call":
            self._custom_args[item["id"]] = self._custom_args.get(item["id"], "") + arguments
            return
        if arguments:
            item["arguments"] += arguments
        if arguments and item is self._open:  # an upstream may interleave
            yield self._event("response.function_call_arguments.delta", **self._at(),
                              delta=arguments)

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
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            yield self._event("response.reasoning_text.done", **at, content_index=0,
                              text=text)
            yield self._event("response.content_part.done", **at, content_index=0,
                              part=_reasoning_part(text))
        elif item["type"] == "custom_tool_call":
            item["input"] = custom_input(self._custom_args.pop(item["id"], ""))
            if item["input"]:
                yield self._event("response.custom_tool_call_input.delta", **at,
                                  delta=item["input"])
            yield self._event("response.custom_tool_call_input.done", **at,
                              input=item["input"])
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


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def _copy(item: dict) -> dict:
    """An item as it is now (events must not change when the item grows later)."""
    return json.loads(json.dumps(item))
