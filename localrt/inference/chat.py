"""Chat: a native request (localrt.native.Request) made into a reply of native events.

`Chats.create(request)` gives a `native.Reply`; every check that can fail happens
before it is returned, so a streamed reply never starts with an error: only a failure
in the middle of generating ends up inside it (a `Failed` event).
`Chats.count_tokens(request)` gives the token count of the prompt create() would read.
No wire format is known here: each dialect (localrt.dialects) reads its body into the
request and writes the events its own way.

The steps: a request takes the one path of localrt.inference.requests (a remote
model's goes to its upstreams there, through localrt.remote.wire, or, for OpenAI's
own route, as the client sent it), the media of its messages are checked against the
model and read (localrt.inference.media), the engine checks what it can serve
(localrt.engines.catalog), the scheduler gives the model and paces its tokens
(`Lease.steps`, localrt.inference.scheduler), and localrt.engines.toolcalls knows
each model family's tool-call syntax: the grammar that forces a call and the parser
whose events become CallStart and CallArgs here.

A streamed reply's events come as the text does: each piece's Logprobs (when asked
for: the entries of the tokens whose text it sends) before its Text or call events,
the entries of tokens whose text was held back or was none before Finish. A whole
reply (stream false) reads its text for calls at once, so a call whose JSON broke is
text again, and gives all its Logprobs at the end. An engine that does not give
log-probabilities (a custom engine's generation has no `logprobs` Log) is a 400
naming logprobs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from types import SimpleNamespace
from typing import Iterator

from localrt import native
from localrt.admission import LIMITS, Disconnected, never
from localrt.engines import contract, reasoning, toolcalls
from localrt.engines.generation import render_template
from localrt.errors import InvalidField
from localrt.inference import media as media_mod
from localrt.inference.requests import Kind, Local, RequestPath
from localrt.inference.running import Lease
from localrt.metrics import Clock
from localrt.remote import wire

log = logging.getLogger(__name__)


def _direct() -> dict:
    """Outbound settings for a Chats built without the Config's (tests): no proxy."""
    return {"proxy_url": "", "proxy_username": "", "proxy_password": "", "no_proxy": "",
            "verify_host_ssl": True, "verify_peer_ssl": True}


class Chats:
    """Turns chat requests (native.Request) into replies (native.Reply) on the
    scheduler's running models.

    At most `max_requests` chats are in progress (generating or waiting for their turn)
    at once: each holds a server thread, and the rest of the API needs some. Past that
    a chat waits for a place in line, and past the queue it is a 503 (localrt.admission).
    Each completion is timed and counted in /metrics (its Clock). A request takes the
    one path of localrt.inference.requests: a remote model's goes to its upstreams.
    """

    def __init__(self, path: RequestPath, max_requests: int = LIMITS["chat"],
                 images: media_mod.Images | None = None):
        self._path = path
        self.kind = Kind("chat", "/chat/completions", max_requests, queue=path.queue)
        self.admission = self.kind.admission
        # Reads the images of a request (localrt.inference.media); the default one
        # fetches with no proxy, under the settings' defaults.
        self.images = images or media_mod.Images(_direct, media_mod.Policy)

    def create(self, request: native.Request, disconnected: Disconnected = never,
               messages: list | None = None):
        """The reply (a native.Reply of events) to `request`. `messages`: its messages
        as read_media() read them already, if it did. A remote model's request goes to
        its upstreams, written and read back by localrt.remote.wire."""
        return self._path.serve(
            self.kind, request.model,
            lambda local: self._create(local, request, messages),
            remote=lambda forward: wire.reply(forward(wire.chat_body(request))),
            disconnected=disconnected)

    def passthrough(self, body: dict, disconnected: Disconnected = never):
        """For a remote model, its upstream's own reply to OpenAI's chat body as the
        client sent it; None for a model loaded here (RequestPath.passthrough)."""
        return self._path.passthrough(self.kind, body, disconnected)

    def read_media(self, request: native.Request) -> list | None:
        """The request's messages with their media read and checked, for a route that
        starts the model before it creates the chat (Ollama's), so that no media error
        waits for a start; create() takes them as they are. None when there is nothing
        to read: no media, or a remote model, whose upstreams get them as they came.
        What the engine cannot serve (a schema past its grammar's bounds) is a 400 here
        too, before a start."""
        record = self._path.registry.get(request.model)
        if self._path.is_remote(record):
            return None
        self._path.engines.check_request(record["engine"], _checked(request))
        if not any(request.media()):
            return None
        return self.messages(SimpleNamespace(model_id=request.model, record=record), request)

    def messages(self, local, request: native.Request) -> list:
        """The request's messages as chat templates take them, each medium read (a URL
        fetched) and checked: all before the model's turn, so before any compute.
        `local` needs only its model_id and record (a `Local`)."""
        media_mod.check(local.model_id, media_mod.kinds(local.record),
                        list(request.media()), self.images.policy())
        return [_message(m, self.images.read_media) for m in request.messages]

    def _create(self, local: Local, request: native.Request, messages: list | None = None):
        if messages is None:
            messages = self.messages(local, request)
        top = request.logprobs
        response_format = request.response_format
        tools = _tools(request)
        # What the engine cannot serve (a schema it cannot follow): a 400 before waiting.
        local.check_request(_checked(request))
        lease = local.lease()
        try:
            params, plan = _prompt_params(request, local.record, lease, messages, tools)
            params["response_format"], params["logprobs"] = response_format, top
            params.update(lease.lora(request.lora))
            generation = lease.generate(messages, params)
            if top is not None and generation.logprobs is None:
                generation.close()
                raise InvalidField(f"Invalid field 'logprobs': model {local.model_id}'s "
                                   f"engine does not give log probabilities", param="logprobs")
            thinking = params.get("reasoning")
            if thinking is not None and thinking.think and thinking.budget is not None \
                    and getattr(generation, "thinking", None) is None:
                # An engine that does not follow the plan cannot end the thinking.
                generation.close()
                raise InvalidField(f"Invalid field 'reasoning_budget': model "
                                   f"{local.model_id}'s engine cannot end thinking at a "
                                   f"budget (the request's, or the model's "
                                   f"reasoning_budget)", param="reasoning_budget")
        except BaseException:
            lease.release()
            raise
        completion = Completion(local.model_id, generation, lease,
                                plan and plan.parser(), local.clock,
                                thinking=params.get("reasoning"))
        return native.Reply(completion.events(request.stream), completion.close,
                            completion.prompt_tokens)

    def count_tokens(self, request: native.Request,
                     disconnected: Disconnected = never) -> int:
        """How many tokens the prompt of a chat request is, rendered as create() renders
        it, without generating (Anthropic's count_tokens). The model starts if it is
        not running; a remote model's count is the prompt_tokens of a one-token reply."""
        return self._path.serve(self.kind, request.model,
                                lambda local: self._count(local, request),
                                remote=lambda forward: _remote_count(forward, request),
                                disconnected=disconnected)

    def _count(self, local: Local, request: native.Request) -> int:
        messages = self.messages(local, request)
        tools = _tools(request)
        lease = local.lease()
        try:
            if not lease.can(contract.Counting):
                raise InvalidField(f"Invalid field 'model': the engine of {local.model_id} "
                                   f"({local.record['engine']}) cannot count tokens",
                                   param="model")
            params, _ = _prompt_params(request, local.record, lease, messages, tools)
            return lease.model.count_tokens(messages, params)
        finally:
            lease.release()


    def prompt_text(self, request: native.Request, record: dict, use, messages: list) -> str:
        """The prompt text create() would have the model read for `request`, rendered as
        create() renders it, tools and prompt_template included (llama-server's POST
        /apply-template: localrt.inference.utility). `use` is the running model's
        (Scheduler.using; a contract.Rendering model), `messages` are messages()'s."""
        params, _ = _prompt_params(request, record, use, messages, _tools(request))
        return use.model.render_prompt(messages, params)


def _tools(request: native.Request):
    """The request's ToolRequest (localrt.engines.toolcalls); None without tools."""
    return toolcalls.ToolRequest.read(request.tools, request.tool_choice,
                                      request.tool_function, request.parallel_tool_calls)


def _remote_count(forward, request: native.Request) -> int:
    """A remote model's prompt tokens: the usage of a one-token reply from its upstream."""
    one = dataclasses.replace(request, stream=False, include_usage=False,
                              sampling={**request.sampling, "max_tokens": 1})
    return wire.prompt_tokens(forward(wire.chat_body(one)), request.model)


def _prompt_params(request: native.Request, record: dict, lease: Lease, messages: list,
                   tools):
    """(params, plan): the generation's parameters from the request, the model's stored
    ones and the leased model's template, and the tool plan (None without tools).
    `lease` may be a running.Use too: only its model, options and can() are read."""
    params = _params(request, record, lease.options)
    chat_template = lease.model.chat_template if lease.can(contract.Templated) else None
    thinking = _thinking(request, record, lease.options, chat_template,
                         call=bool(tools and tools.forced()))
    plan = tools and tools.plan(chat_template,
                                own=thinking is not None and thinking.syntax.harmony)
    if plan:
        params.update(plan.params())
    if thinking is not None:
        params["reasoning"] = thinking
        params["template_kwargs"] = thinking.kwargs()
        params["preserved_tokens"] = [*params.get("preserved_tokens", ()), *thinking.tokens()]
    elif request.template_kwargs:
        params["template_kwargs"] = dict(request.template_kwargs)
    template = lease.options.get("prompt_template")
    # A prompt_template cannot show tools: calls need the model's own template.
    if template and not (plan and plan.parses):
        if any(isinstance(m["content"], list) for m in messages):
            # Media go where their parts were, inside {prompt}: the engine renders the
            # template around its media markers (as llama-server puts its markers in
            # the text).
            params["prompt_template"] = template
        else:
            params["prompt"] = render_template(template, messages)
        params.pop("reasoning", None)  # the model's own template is not used
    return params, plan


def _thinking(request: native.Request, record: dict, options: dict, template: str | None,
              call: bool = False):
    """The request's reasoning.Plan for a model whose chat template thinks (None for
    one that does not): thinking on or off as the request says, else as the model's
    `reasoning` (a start option or stored parameter: on, off or auto, which thinks),
    the budget the request gives, else the model's `reasoning_budget`; `call`: its
    tool_choice forces a call."""
    markers = reasoning.markers_of(template)
    if markers is None:
        return None
    think = request.think
    if think is None:
        think = (options.get("reasoning") or record.get("reasoning") or "auto") != "off"
    budget = request.reasoning_budget
    if budget is None:
        budget = options.get("reasoning_budget", record.get("reasoning_budget"))
    return reasoning.Plan(markers, think=think, effort=request.effort, budget=budget,
                          raw=request.reasoning_format == "none",
                          template_kwargs=dict(request.template_kwargs or {}), call=call)


def _message(message: native.Message, read) -> dict:
    """A native message as chat templates take it: its content as one string (text
    parts joined), or with media a list of parts in order ({"type": "text"} and
    {"type": "image", "image": contract.Image} or {"type": "audio", "audio":
    contract.Audio}, each medium read by `read(media)`); an
    assistant's tool_calls with their arguments as objects, a tool reply's
    tool_call_id."""
    if message.media:
        content = [{"type": "text", "text": part.text} if isinstance(part, native.Text)
                   else {"type": part.kind, part.kind: read(part)} for part in message.parts]
    else:
        content = message.text
    out = {"role": message.role, "content": content or ""}
    thought = message.reasoning
    if message.role == "assistant" and thought:
        # Under the names templates read it: Qwen3's and DeepSeek's, and gpt-oss's.
        out["reasoning_content"] = out["thinking"] = thought
    if message.role == "assistant" and message.tool_calls:
        out["tool_calls"] = [_call_of(call) for call in message.tool_calls]
    elif message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
        if message.name:
            out["name"] = message.name
    return out


def _call_of(call: native.ToolCall) -> dict:
    """A tool call of the history, its arguments an object as chat templates write them
    (Hugging Face's convention; the JSON text when it is not an object)."""
    arguments = call.arguments
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        parsed = arguments
    return {"id": call.id or "", "type": "function",
            "function": {"name": call.name,
                         "arguments": parsed if isinstance(parsed, dict) else arguments}}


def _checked(request: native.Request) -> dict:
    """What an engine's check_request reads of a request (its schemas and tool fields)."""
    tools = _tools(request)
    return {"response_format": request.response_format, "tools": tools and tools.tools,
            "tool_choice": request.tool_choice, "tool_function": request.tool_function,
            "logprobs": request.logprobs}


def _params(request: native.Request, record: dict, options: dict) -> dict:
    """Sampling parameters: the request's, else the model's stored ones."""
    params = {k: record[k] for k in native.SAMPLING if record.get(k) is not None}
    params.update((k, v) for k, v in request.sampling.items() if v is not None)
    stops = list(request.stop)
    for s in options.get("stop") or []:  # the model's own stop sequences always apply
        if s not in stops:
            stops.append(s)
    params["stop"] = stops
    if request.logit_bias:
        params["logit_bias"] = request.logit_bias
    if request.speculative is False:
        params["speculative"] = False
    if request.prediction:
        params["prediction"] = request.prediction
    return params


class Completion:
    """One chat completion: its generation, the lease it holds, the parser of its tool
    calls (None when the request offers none), the `Clock` it is timed on, and the
    reasoning.Plan of a model that thinks (None: one that does not).

    A reasoning reply's text is split (reasoning.Splitter) before calls are read:
    thinking becomes Reasoning events, and calls are read from the answer only (a call
    written inside the thinking is thinking); gpt-oss's calls come from its
    commentary channel, read by the splitter. With reasoning_format "none" the text
    goes out as the model wrote it, markers and all."""

    def __init__(self, model_id: str, generation, lease: Lease, parser=None,
                 clock: Clock | None = None, thinking: reasoning.Plan | None = None):
        self.model_id = model_id
        self.generation = generation
        self.parser = parser
        self._lease = lease
        self._clock = clock or Clock(None, model_id)
        self._called: bool | None = None  # a whole reply's: whether it holds calls
        self._splitter = None
        if thinking is not None and not thinking.raw:
            # An engine that does not say where its prompt left the thinking (a custom
            # one's) rendered the model's template, as far as localrt can tell.
            self._splitter = thinking.splitter(getattr(generation, "thinking", None)
                                               or thinking.state)
        self._thought = 0  # pieces that carried thinking (an engine that counts none)

    def prompt_tokens(self) -> int:
        """The prompt's tokens, known before the first event."""
        return self.generation.usage["prompt_tokens"]

    def pieces(self) -> Iterator[str]:
        """Text pieces as the scheduler computes them; ModelStopped if the model stops."""
        return self._clock.pieces(self._lease.steps(self.generation))

    def events(self, streamed: bool) -> Iterator:
        """The reply's native events. Streamed, text and calls as they come, each
        preceded by the log-probabilities of the tokens whose text it sends; whole, the
        text read for calls at once (a call that broke is text again). A failure ends
        them with Failed."""
        log = self.generation.logprobs
        try:
            if streamed:
                yield from self._streamed(log)
            else:
                yield from self._whole()
        except Exception as exc:  # noqa: BLE001 - the reply has started: say so in it
            yield native.Failed(exc)
            return
        if log is not None:  # tokens whose text came last, or was none
            entries = log.take()
            if entries or not streamed:
                yield native.Logprobs(entries)
        called = self._called if self._called is not None else \
            bool(self.parser and self.parser.calls) or self._own_calls()
        reason = self.generation.finish_reason or "stop"
        matched = getattr(self.generation, "stop_sequence", None)  # custom engines lack it
        yield native.Finish("tool_calls" if called and reason == "stop" else reason,
                            matched)
        u = self.generation.usage
        yield native.Usage(u["prompt_tokens"], u["completion_tokens"],
                           cached_tokens=u.get("cached_tokens", 0),
                           reasoning_tokens=u.get("reasoning_tokens", self._thought),
                           accepted_prediction_tokens=u.get("accepted_prediction_tokens", 0),
                           rejected_prediction_tokens=u.get("rejected_prediction_tokens", 0),
                           audio_tokens=u.get("audio_tokens", 0))

    def _own_calls(self) -> bool:
        """Whether the splitter read calls (harmony's commentary channel)."""
        return bool(getattr(self._splitter, "calls", 0))

    def _answer(self, piece: str) -> Iterator:
        """Events of a piece of the answer: text, or calls the parser reads."""
        if self.parser is None:
            yield native.Text(piece)
        else:
            yield from _events(self.parser.feed(piece))

    def _split(self, parts: list) -> Iterator:
        """Events of a splitter's parts: thinking, the answer, harmony's own calls."""
        for part in parts:
            if part[0] == "reasoning":
                yield native.Reasoning(part[1])
            elif part[0] == "answer":
                yield from self._answer(part[1])
            elif part[0] == "call":
                yield native.CallStart(part[1], part[2], part[3])
            else:
                yield native.CallArgs(part[1], part[2])

    def _streamed(self, log) -> Iterator:
        parser, splitter = self.parser, self._splitter
        for piece in self.pieces():
            entries = log.take() if log is not None else None
            if entries:
                yield native.Logprobs(entries)
            if splitter is None:
                yield from self._answer(piece)
                continue
            parts = splitter.feed(piece)
            self._thought += any(p[0] == "reasoning" for p in parts) or \
                splitter.state == "thinking"
            yield from self._split(parts)
        if splitter is not None:
            yield from self._split(splitter.close())
        if parser is not None:
            yield from _events(parser.close())

    def _whole(self) -> Iterator:
        text = "".join(self.pieces())
        if self._splitter is not None:
            parts = self._splitter.feed(text) + self._splitter.close()
            thought = "".join(p[1] for p in parts if p[0] == "reasoning")
            if thought:
                self._thought = 1
                yield native.Reasoning(thought)
            yield from self._split([p for p in parts if p[0] in ("call", "args")])
            text = "".join(p[1] for p in parts if p[0] == "answer")
        if self.parser is None:
            yield native.Text(text)
            return
        text, calls = toolcalls.read_reply(self.parser, text)
        self._called = bool(calls) or self._own_calls()  # a call that broke is text again
        yield native.Text(text)
        for index, (call_id, name, arguments) in enumerate(calls):
            yield native.CallStart(index, call_id, name)
            yield native.CallArgs(index, arguments)

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


def _events(parsed: list) -> Iterator:
    """A tool-call parser's events as native ones."""
    for event in parsed:
        if event[0] == "text":
            yield native.Text(event[1])
        elif event[0] == "call":
            yield native.CallStart(event[1], event[2], event[3])
        else:
            yield native.CallArgs(event[1], event[2])
