"""Chat completions, OpenAI compatible: the request's parameters, the prompt, the reply.

`Chats.create(body)` takes a request that passed schemas/chat-completion.json and
returns either the chat.completion dict or a `Stream` of Server-Sent Events. Every
check that can fail happens before either is returned, so a streamed reply never
starts with an error: only a failure in the middle of generating ends up inside it.
`Chats.count_tokens(body)` gives the token count of the prompt create() would read.
A choice that a stop sequence ended names it as `stop_reason` (vLLM's field), so
localrt.dialects.anthropic can give Anthropic's stop_sequence.

This module keeps only OpenAI's shapes: a request takes the one path of
localrt.inference.requests (a remote model's goes whole to its upstreams there), the
engine checks what it can serve (localrt.engines.catalog), the scheduler gives the
model and paces its tokens (`Lease.steps`, localrt.inference.scheduler), and
localrt.engines.toolcalls knows each model family's tool-call syntax: the grammar
that forces a call and the parser whose events become message.tool_calls and
delta.tool_calls here.

`logprobs: true` (with `top_logprobs`, 0 to 20 alternatives; top_logprobs alone is a
400) gives choices[0].logprobs = {"content": [...], "refusal": null}, one entry per
generated token as localrt.engines.logprobs writes them (the model's own log-probabilities,
before sampling settings). A stream's chunk carries the entries of the tokens whose
text it sends, and its last chunk those whose text was held back or was none. With
tool calls the entries cover every generated token, the calls' included: a token can
be half text and half call syntax, so they are not split between content and calls.
An engine that does not give them (a custom engine's generation has no `logprobs`
Log) is a 400 naming logprobs.

Images come as image_url parts (every dialect translates its own shape into them):
`Chats.messages` checks them against the model (images_not_supported for one without
a projector) and reads each into a contract.Image (localrt.inference.images), in the
request's thread before the model's turn. A remote model's request goes to its
upstreams with its parts as they came.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from types import SimpleNamespace
from typing import Iterator

from localrt.engines import contract
from localrt.errors import InvalidField, UpstreamError
from localrt.inference import images as images_mod
from localrt.models.registry import capabilities
from localrt.engines import logprobs, toolcalls
from localrt.admission import LIMITS, Disconnected, never
from localrt.inference.requests import (EventStream, Kind, Local, RequestPath, respond,
                                        stream_error)
from localrt.inference.running import Lease
from localrt.metrics import Clock

log = logging.getLogger(__name__)

# Request fields that are sampling parameters, and stored model parameters with the
# same meaning (schemas/model-update.json). If you add one, also pass it on in
# localrt.engines.llama and localrt.engines.onnx (and add it to schemas/chat-completion.json).
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "frequency_penalty",
            "presence_penalty", "repeat_penalty", "max_tokens")


def _direct() -> dict:
    """Outbound settings for a Chats built without the Config's (tests): no proxy."""
    return {"proxy_url": "", "proxy_username": "", "proxy_password": "", "no_proxy": "",
            "verify_host_ssl": True, "verify_peer_ssl": True}


class Chats:
    """Turns chat requests into generations on the scheduler's running models.

    At most `max_requests` chats are in progress (generating or queued) at once: each
    holds a server thread, and the rest of the API needs some. Past that, a 503.
    Each completion is timed and counted in /metrics (its Clock). A request takes the
    one path of localrt.inference.requests: a remote model's goes to its upstreams.
    """

    def __init__(self, path: RequestPath, max_requests: int = LIMITS["chat"],
                 images: images_mod.Images | None = None):
        self._path = path
        self.kind = Kind("chat", "/chat/completions", max_requests)
        self.admission = self.kind.admission
        # Reads the images of a request (localrt.inference.images); the default one
        # fetches with no proxy, under the settings' defaults.
        self.images = images or images_mod.Images(_direct, images_mod.Policy)

    def create(self, body: dict, disconnected: Disconnected = never,
               messages: list | None = None):
        """A chat.completion dict, or a Stream when body["stream"] is true. `messages`:
        the body's messages as read_images() read them already, if it did."""
        return self._path.serve(self.kind, body,
                                lambda local: self._create(local, body, messages),
                                disconnected=disconnected)

    def read_images(self, body: dict) -> list | None:
        """The body's messages with their images read and checked, for a route that
        starts the model before it creates the chat (Ollama's), so that no image error
        waits for a start; create() takes them as they are. None when there is nothing
        to read: no image, or a remote model, whose upstreams get the images as they
        came."""
        record = self._path.registry.get(body["model"])
        if self._path.is_remote(record) or not any(images_mod.parts(body["messages"])):
            return None
        return self.messages(SimpleNamespace(model_id=body["model"], record=record), body)

    def messages(self, local, body: dict) -> list:
        """The request's messages as chat templates take them, each image read (a URL
        fetched) and checked: all before the model's turn, so before any compute.
        `local` needs only its model_id and record (a `Local`)."""
        images_mod.check(local.model_id, "vision" in capabilities(local.record),
                         body["messages"], self.images.policy())
        return [_message(i, m, self.images.read) for i, m in enumerate(body["messages"])]

    def _create(self, local: Local, body: dict, messages: list | None = None):
        if messages is None:
            messages = self.messages(local, body)
        if body.get("n") not in (None, 1):
            raise InvalidField("Invalid field 'n': only n=1 is supported", param="n")
        top = _top_logprobs(body)
        response_format = _response_format(body.get("response_format"))
        tools = toolcalls.ToolRequest.read(body)
        # What the engine cannot serve (a schema it cannot follow): a 400 before waiting.
        local.check_request({"response_format": response_format,
                             "tools": tools and tools.tools,
                             "tool_choice": body.get("tool_choice"), "logprobs": top})
        lease = local.lease()
        try:
            params, plan = _prompt_params(body, local.record, lease, messages, tools)
            params["response_format"], params["logprobs"] = response_format, top
            generation = lease.generate(messages, params)
            if top is not None and generation.logprobs is None:
                generation.close()
                raise InvalidField(f"Invalid field 'logprobs': model {local.model_id}'s "
                                   f"engine does not give log probabilities", param="logprobs")
        except BaseException:
            lease.release()
            raise
        completion = Completion(local.model_id, generation, lease,
                                plan and plan.parser(), local.clock)
        return respond(body, completion, Stream)

    def count_tokens(self, body: dict, disconnected: Disconnected = never) -> int:
        """How many tokens the prompt of a chat request is, rendered as create() renders
        it, without generating (Anthropic's count_tokens). The model starts if it is
        not running; a remote model's count is the prompt_tokens of a one-token reply."""
        return self._path.serve(self.kind, body, lambda local: self._count(local, body),
                                remote=lambda forward: _remote_count(forward, body),
                                disconnected=disconnected)

    def _count(self, local: Local, body: dict) -> int:
        messages = self.messages(local, body)
        tools = toolcalls.ToolRequest.read(body)
        lease = local.lease()
        try:
            if not lease.can(contract.Counting):
                raise InvalidField(f"Invalid field 'model': the engine of {local.model_id} "
                                   f"({local.record['engine']}) cannot count tokens",
                                   param="model")
            params, _ = _prompt_params(body, local.record, lease, messages, tools)
            return lease.model.count_tokens(messages, params)
        finally:
            lease.release()


def _remote_count(forward, body: dict) -> int:
    """A remote model's prompt tokens: the usage of a one-token reply from its upstream."""
    reply = forward({**body, "stream": False, "max_tokens": 1})
    usage = reply.get("usage") if isinstance(reply, dict) else None
    count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if not isinstance(count, int):
        raise UpstreamError(f"The upstream of remote model {body['model']} did not say how "
                            f"many tokens the prompt is (usage.prompt_tokens)")
    return count


def _prompt_params(body: dict, record: dict, lease: Lease, messages: list, tools):
    """(params, plan): the generation's parameters from the request, the model's stored
    ones and the leased model's template, and the tool plan (None without tools)."""
    params = _params(body, record, lease.options)
    plan = tools and tools.plan(lease.model.chat_template if lease.can(contract.Templated)
                                else None)
    if plan:
        params.update(plan.params())
    template = lease.options.get("prompt_template")
    # A prompt_template cannot show tools: calls need the model's own template.
    if template and not (plan and plan.parses):
        if any(isinstance(m["content"], list) for m in messages):
            raise InvalidField("Invalid field 'messages': the model's prompt_template has "
                               "no place for images; clear it to use the model's own chat "
                               "template", param="messages")
        params["prompt"] = render_template(template, messages)
    return params, plan


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


def _message(index: int, message: dict, read=None) -> dict:
    """An OpenAI message as chat templates take it: its content as one string (text
    parts joined), or with images a list of parts in order ({"type": "text"} and
    {"type": "image", "image": contract.Image}, each image read by `read(url, where)`);
    an assistant's tool_calls with their arguments as objects, a tool reply's
    tool_call_id."""
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{index}].content[{j}]"
            if part.get("type") == "text":
                parts.append({"type": "text", "text": part["text"]})
            elif part.get("type") == "image_url" and read is not None:
                parts.append({"type": "image",
                              "image": read(images_mod.url_of(part), where)})
            else:
                raise InvalidField(f"Invalid field '{where}': only text and image_url parts "
                                   f"are supported, got {part.get('type')!r}", param=where)
        if any(p["type"] == "image" for p in parts):
            content = parts
        else:
            content = "\n".join(p["text"] for p in parts)
    # Chat templates know system, user and assistant; OpenAI's newer "developer"
    # messages are system messages to them.
    role = "system" if message["role"] == "developer" else message["role"]
    out = {"role": role, "content": content or ""}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = [_call_of(call) for call in message["tool_calls"]]
    elif role == "tool":
        out["tool_call_id"] = message["tool_call_id"]
        if message.get("name"):
            out["name"] = message["name"]
    return out


def _call_of(call: dict) -> dict:
    """A tool call of the history, its arguments an object as chat templates write them
    (Hugging Face's convention; the JSON text when it is not an object)."""
    arguments = call["function"].get("arguments")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        parsed = arguments
    return {"id": call.get("id", ""), "type": "function",
            "function": {"name": call["function"]["name"],
                         "arguments": parsed if isinstance(parsed, dict) else arguments}}


def _params(body: dict, record: dict, options: dict) -> dict:
    """Sampling parameters: the request's, else the model's stored ones."""
    params = {k: record[k] for k in SAMPLING if record.get(k) is not None}
    params.update((k, body[k]) for k in SAMPLING if body.get(k) is not None)
    if body.get("max_completion_tokens") is not None:
        params["max_tokens"] = body["max_completion_tokens"]
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    for s in options.get("stop") or []:  # the model's own stop sequences always apply
        if s not in stops:
            stops.append(s)
    params["stop"] = stops
    if body.get("logit_bias"):
        params["logit_bias"] = body["logit_bias"]
    if body.get("speculative") is False:
        params["speculative"] = False
    prediction = (body.get("prediction") or {}).get("content")
    if prediction:  # text, or text parts
        params["prediction"] = prediction if isinstance(prediction, str) else \
            "".join(part["text"] for part in prediction)
    return params


def _response_format(fmt: dict | None) -> dict | None:
    """{"type": "json_object"} or {"type": "json_schema", "schema"}; None for text."""
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object", "schema": fmt.get("schema")}
    schema = (fmt.get("json_schema") or {}).get("schema")
    if not isinstance(schema, dict):
        raise InvalidField("Invalid field 'response_format.json_schema.schema': a json_schema "
                           "response format needs the JSON Schema object",
                           param="response_format.json_schema.schema")
    return {"type": "json_schema", "schema": schema}


def render_template(template: str, messages: list) -> str:
    """A prompt from a cortex-style template with {system_message} and {prompt}.

    The text before {system_message} opens the system turn, the text between it and
    {prompt} opens each user turn, and the text after {prompt} opens each assistant
    turn, so a ChatML template renders a whole conversation in ChatML.
    """
    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    head, has_system, rest = template.partition("{system_message}")
    if not has_system:
        head, rest = "", template
    user_open, _, assistant_open = rest.partition("{prompt}")
    out = [head, system] if has_system else []
    pending_system = "" if has_system else system
    for m in messages:
        if m["role"] == "system":
            continue
        if m["role"] == "assistant":
            out += [assistant_open, m["content"]]
        else:
            text = m["content"]
            if pending_system:
                text, pending_system = f"{pending_system}\n\n{text}", ""
            out += [user_open, text]
    out.append(assistant_open)
    return "".join(out)


class Completion:
    """One chat completion: its id, its generation, the lease it holds, the parser of
    its tool calls (None when the request offers none), and the `Clock` it is timed on."""

    def __init__(self, model_id: str, generation, lease: Lease, parser=None,
                 clock: Clock | None = None):
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_id = model_id
        self.generation = generation
        self.parser = parser
        self._lease = lease
        self._clock = clock or Clock(None, model_id)

    def pieces(self) -> Iterator[str]:
        """Text pieces as the scheduler computes them; ModelStopped if the model stops."""
        return self._clock.pieces(self._lease.steps(self.generation))

    def logprobs(self) -> list | None:
        """The logprobs.content entries of the tokens whose text has gone out since the
        last call ([] when none); None when the request did not ask for them."""
        log = self.generation.logprobs
        return None if log is None else logprobs.chat_content(log.take())

    def usage(self) -> dict:
        """OpenAI's usage object."""
        u = self.generation.usage
        return {"prompt_tokens": u["prompt_tokens"],
                "completion_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)},
                "completion_tokens_details": {
                    "reasoning_tokens": 0,
                    "accepted_prediction_tokens": u.get("accepted_prediction_tokens", 0),
                    "rejected_prediction_tokens": u.get("rejected_prediction_tokens", 0)}}

    def finish_reason(self, called: bool) -> str:
        """OpenAI's finish_reason; "tool_calls" when the reply ended with calls."""
        reason = self.generation.finish_reason or "stop"
        return "tool_calls" if called and reason == "stop" else reason

    def complete(self) -> dict:
        """The whole reply as a chat.completion."""
        content = "".join(self.pieces())
        message = {"role": "assistant", "content": content}
        calls = []
        if self.parser is not None:
            content, calls = toolcalls.read_reply(self.parser, content)
            message["content"] = content if content or not calls else None
        if calls:
            message["tool_calls"] = [
                {"id": call_id, "type": "function",
                 "function": {"name": name, "arguments": arguments}}
                for call_id, name, arguments in calls]
        content = self.logprobs()
        choice = {"index": 0, "message": message, "logprobs": _logprobs(content),
                  "finish_reason": self.finish_reason(bool(calls)), **self.stop_reason()}
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model_id, "choices": [choice], "usage": self.usage()}

    def stop_reason(self) -> dict:
        """{"stop_reason": the stop sequence} when one ended the reply (vLLM's field, which
        Anthropic's stop_sequence is made from), else {}."""
        matched = getattr(self.generation, "stop_sequence", None)  # custom engines may lack it
        return {"stop_reason": matched} if matched is not None else {}

    def close(self) -> None:
        """Stop generating (if still going), give the model to the next request, and
        count the completion."""
        try:
            self.generation.close()
        finally:
            try:
                self._lease.release()
            finally:
                self._clock.end(self.generation.usage)


class Stream(EventStream):
    """The reply as Server-Sent Events of chat.completion.chunk; close() frees the model."""

    def __init__(self, completion: Completion, include_usage: bool):
        self._completion = completion
        self._include_usage = include_usage
        self._pending: list = []  # logprobs.content entries the next event carries

    @property
    def prompt_tokens(self) -> int:
        """The prompt's tokens, known before the first chunk (Anthropic's message_start
        gives them)."""
        return self._completion.generation.usage["prompt_tokens"]

    def chunks(self) -> Iterator[dict]:
        """The reply as chat.completion.chunk dicts; one {"error": ...} dict ends a reply
        that failed part way. The other dialects (localrt.dialects.anthropic, ...) translate these."""
        completion, parser = self._completion, self._completion.parser
        yield self._event({"role": "assistant", "content": ""})
        try:
            for piece in completion.pieces():
                self._took(completion.logprobs())
                if parser is None:
                    yield self._event({"content": piece})
                else:
                    yield from self._deltas(parser.feed(piece))
            if parser is not None:
                yield from self._deltas(parser.close())
        except Exception as exc:  # noqa: BLE001 - the reply has started: say so in it
            yield stream_error(exc, completion.model_id)
            return
        self._took(completion.logprobs())  # tokens whose text came last, or was none
        last = self._event({}, completion.finish_reason(bool(parser and parser.calls)))
        last["choices"][0].update(completion.stop_reason())
        yield last
        if self._include_usage:
            yield self._chunk([], usage=completion.usage())

    def close(self) -> None:
        """Called by the server when the reply ends or the client goes away."""
        self._completion.close()

    def _deltas(self, events: list) -> Iterator[dict]:
        """The events of a tool-call parser as deltas: content, a call's id and name
        (with empty arguments, as OpenAI sends them), then its arguments in pieces."""
        for event in events:
            if event[0] == "text":
                delta = {"content": event[1]}
            elif event[0] == "call":
                delta = {"tool_calls": [{"index": event[1], "id": event[2],
                                         "type": "function",
                                         "function": {"name": event[3], "arguments": ""}}]}
            else:
                delta = {"tool_calls": [{"index": event[1],
                                         "function": {"arguments": event[2]}}]}
            yield self._event(delta)

    def _took(self, content: list | None) -> None:
        """Tokens whose text has gone out: the next event carries their logprobs."""
        if content:
            self._pending.extend(content)

    def _event(self, delta: dict, finish_reason: str | None = None) -> dict:
        content, self._pending = self._pending, []
        choice = {"index": 0, "delta": delta, "logprobs": _logprobs(content or None),
                  "finish_reason": finish_reason}
        return self._chunk([choice])

    def _chunk(self, choices: list, usage: dict | None = None) -> dict:
        c = self._completion
        chunk = {"id": c.id, "object": "chat.completion.chunk", "created": c.created,
                 "model": c.model_id, "choices": choices}
        if self._include_usage:
            chunk["usage"] = usage
        return chunk


def _logprobs(content: list | None) -> dict | None:
    """A choice's logprobs in OpenAI's shape; None when there are none to give."""
    return None if content is None else {"content": content, "refusal": None}
