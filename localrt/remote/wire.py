"""OpenAI's chat wire as an upstream speaks it: a native request written as the body an
upstream takes, and the upstream's reply read back into native events.

A remote model (localrt.inference.remote) is served by OpenAI-compatible servers. A
chat that reaches it through any dialect but OpenAI's own (which passes the client's
body and the upstream's chunks through untouched: localrt.dialects.openai) is written
here (`chat_body`) and its reply, whole or streamed, read here (`reply`): content is
Text, `reasoning_content` (or `reasoning`, as vLLM and Ollama write it, or `thinking`)
Reasoning, tool calls CallStart and CallArgs, finish_reason and vLLM's stop_reason
Finish, usage Usage, and an error event Failed (`UpstreamFailed`, which keeps the
upstream's error as it came). So a remote model's reasoning reaches every dialect.

What a request asks of the model's thinking goes upstream in the fields
OpenAI-compatible servers read (`_thinking`), each only when the request asked:
thinking off is reasoning_effort "none" (llama-server, vLLM, Ollama and OpenAI read
it), a level is that reasoning_effort, the budget llama-server's
thinking_budget_tokens, and chat_template_kwargs and reasoning_format go as they
came; thinking on at no level is the upstream's default, which no portable field
says. An assistant's earlier thinking goes back as reasoning_content and reasoning.
"""

from __future__ import annotations

import base64
from typing import Iterator

from localrt import native
from localrt.errors import HTTPError, UpstreamError

# The names a reply's reasoning has, in the order they are looked for.
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
# The names an assistant's earlier thinking is sent back under: llama-server reads the
# first, Ollama the second, vLLM either.
HISTORY_FIELDS = ("reasoning_content", "reasoning")


class UpstreamFailed(HTTPError):
    """A stream an upstream ended with an error event: `error` as the upstream wrote it
    (a dict with message, code and param, or a bare message)."""

    status = 502
    type = "server_error"
    code = "upstream_error"

    def __init__(self, error):
        message = error.get("message") if isinstance(error, dict) else error
        super().__init__(str(message or "The upstream's reply broke off"))
        self.error = error

    def body(self) -> dict:
        """The error as the upstream wrote it."""
        return {"message": self.message, "error": self.error}


# --- the request ----------------------------------------------------------------------


def chat_body(request: native.Request) -> dict:
    """The chat-completions body an upstream takes for a native request."""
    body = {"model": request.model, "messages": [_message(m) for m in request.messages]}
    body.update((k, v) for k, v in request.sampling.items() if v is not None)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.tools:
        body["tools"] = list(request.tools)
        if request.tool_choice == "function":
            body["tool_choice"] = {"type": "function",
                                   "function": {"name": request.tool_function}}
        elif request.tool_choice != "auto":
            body["tool_choice"] = request.tool_choice
    elif request.tool_choice in ("none", "required"):
        body["tool_choice"] = request.tool_choice
    if not request.parallel_tool_calls:
        body["parallel_tool_calls"] = False
    fmt = request.response_format
    if fmt and fmt["type"] == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name") or "response", "schema": fmt["schema"]}}
    elif fmt:
        body["response_format"] = {"type": fmt["type"]}
    if request.logprobs is not None:
        body["logprobs"] = True
        if request.logprobs:
            body["top_logprobs"] = request.logprobs
    if request.logit_bias:
        body["logit_bias"] = request.logit_bias
    if request.prediction:
        body["prediction"] = {"type": "content", "content": request.prediction}
    if request.stream:
        body["stream"] = True
        if request.include_usage:
            body["stream_options"] = {"include_usage": True}
    body.update(_thinking(request))
    return body


def _thinking(request: native.Request) -> dict:
    """The thinking controls of a request, as an upstream's body takes them (see the
    module docstring)."""
    out: dict = {}
    if request.think is False:
        out["reasoning_effort"] = "none"
    elif request.effort is not None:
        out["reasoning_effort"] = request.effort
    if request.reasoning_budget is not None:
        out["thinking_budget_tokens"] = request.reasoning_budget
    if request.reasoning_format is not None:
        out["reasoning_format"] = request.reasoning_format
    if request.template_kwargs:
        out["chat_template_kwargs"] = dict(request.template_kwargs)
    return out


def _message(message: native.Message) -> dict:
    out = {"role": message.role}
    if message.media:
        out["content"] = [_part(p) for p in message.parts]
    else:
        text = message.text
        out["content"] = None if not text and message.tool_calls else text
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in message.tool_calls]
    if message.role == "assistant" and message.reasoning:
        out.update(dict.fromkeys(HISTORY_FIELDS, message.reasoning))
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
        if message.name:
            out["name"] = message.name
    return out


def _part(part) -> dict:
    """A part as OpenAI's: text, or an image_url (a URL as it came; bytes as a data:
    URL)."""
    if isinstance(part, native.Text):
        return {"type": "text", "text": part.text}
    url = part.data
    if isinstance(url, bytes):
        media_type = part.media_type if "*" not in part.media_type else \
            "application/octet-stream"
        url = f"data:{media_type};base64,{base64.b64encode(url).decode('ascii')}"
    return {"type": "image_url", "image_url": {"url": url}}


def completion_body(request: native.TextRequest) -> dict:
    """The completions body an upstream takes for a native text request."""
    body = {"model": request.model,
            "prompt": request.prompts[0] if len(request.prompts) == 1 else request.prompts}
    body.update((k, v) for k, v in request.sampling.items() if v is not None)
    if request.suffix is not None:
        body["suffix"] = request.suffix
    if request.echo:
        body["echo"] = True
    if request.stop:
        body["stop"] = list(request.stop)
    if request.logprobs is not None:
        body["logprobs"] = request.logprobs
    if request.logit_bias:
        body["logit_bias"] = request.logit_bias
    if request.stream:
        body["stream"] = True
        if request.include_usage:
            body["stream_options"] = {"include_usage": True}
    return body


# --- the reply ------------------------------------------------------------------------


def reply(result) -> native.Reply:
    """An upstream's reply as a native Reply: a whole chat.completion dict, or a stream
    (its `chunks()` dicts; close() hangs up)."""
    if isinstance(result, dict):
        return native.Reply(_whole(result))
    return native.Reply(_streamed(result.chunks()), result.close)


def text_reply(result) -> native.Reply:
    """An upstream's text completion as a native Reply: a whole text_completion dict,
    or a stream of its chunks."""
    if isinstance(result, dict):
        return native.Reply(_texts([result]))
    return native.Reply(_texts(result.chunks()), result.close)


def prompt_tokens(result, model_id: str) -> int:
    """The usage.prompt_tokens of an upstream's whole reply."""
    usage = result.get("usage") if isinstance(result, dict) else None
    count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if not isinstance(count, int):
        raise UpstreamError(f"The upstream of remote model {model_id} did not say how "
                            f"many tokens the prompt is (usage.prompt_tokens)")
    return count


def _whole(completion: dict) -> Iterator:
    try:
        choice = completion["choices"][0]
        message = choice["message"]
        text = message.get("content")
        reasoning = _reasoning(message)
        calls = [(call.get("id") or "", call["function"]["name"],
                  call["function"].get("arguments"))
                 for call in message.get("tool_calls") or []]
    except (KeyError, IndexError, TypeError, AttributeError):
        yield native.Failed(UpstreamError("The model's reply was not a chat completion"))
        return
    if reasoning:
        yield native.Reasoning(reasoning)
    if isinstance(text, str):
        yield native.Text(text)
    for index, (call_id, name, arguments) in enumerate(calls):
        yield native.CallStart(index, call_id, name)
        if isinstance(arguments, str):
            yield native.CallArgs(index, arguments)
    yield _finish(choice)
    yield _usage(completion.get("usage"))


def _streamed(chunks) -> Iterator:
    finish, usage, started = None, None, set()
    for chunk in chunks:
        if "error" in chunk and not chunk.get("choices"):
            yield native.Failed(UpstreamFailed(chunk["error"]))
            return
        if isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = _reasoning(delta)
            if reasoning:
                yield native.Reasoning(reasoning)
            if isinstance(delta.get("content"), str) and delta["content"]:
                yield native.Text(delta["content"])
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                index = call.get("index", 0)
                if index not in started:
                    started.add(index)
                    yield native.CallStart(index, call.get("id") or "",
                                           function.get("name") or "")
                arguments = function.get("arguments")
                if isinstance(arguments, str) and arguments:
                    yield native.CallArgs(index, arguments)
            if choice.get("finish_reason"):
                finish = choice
    yield _finish(finish or {})
    yield _usage(usage)


def _texts(chunks) -> Iterator:
    """Text completion chunks (or one whole reply) as events: a Choice when a choice's
    index first comes, its text, its Finish; the Usage last."""
    usage, current = None, None
    for chunk in chunks:
        if "error" in chunk and not chunk.get("choices"):
            yield native.Failed(UpstreamFailed(chunk["error"]))
            return
        if isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            if index != current:
                current = index
                yield native.Choice(index)
            if isinstance(choice.get("text"), str) and choice["text"]:
                yield native.Text(choice["text"])
            if choice.get("finish_reason"):
                yield _finish(choice)
    yield _usage(usage)


def _reasoning(message: dict) -> str:
    for name in REASONING_FIELDS:
        value = message.get(name)
        if isinstance(value, str) and value:
            return value
    return ""


def _finish(choice: dict) -> native.Finish:
    matched = choice.get("stop_reason")  # vLLM's: the stop sequence that ended it
    return native.Finish(choice.get("finish_reason") or "stop",
                         matched if isinstance(matched, str) else None)


def _usage(usage) -> native.Usage:
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details") or {}
    out = usage.get("completion_tokens_details") or {}
    return native.Usage(_count(usage.get("prompt_tokens")),
                        _count(usage.get("completion_tokens")),
                        cached_tokens=_count(details.get("cached_tokens")),
                        reasoning_tokens=_count(out.get("reasoning_tokens")),
                        audio_tokens=_count(details.get("audio_tokens")))


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else 0
