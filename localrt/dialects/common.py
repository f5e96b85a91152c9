"""What the dialects share: their names for native fields in errors, the error of a
reply that broke, and their named-event streams.

Every dialect reads its body (checked against its own schema) into a native request
(localrt.native), calls the native call, and writes the reply's events in its wire
format (`write`: streamed, or whole through native.collect). A 400 from the native call names the native field
(`tools[0].function.parameters`); `Fields` renames it to the dialect's own
(`tools[0].input_schema`), so a client reads the name it sent. A media part carries
the dialect's own path (`where`), which its errors name as it is.

Thinking is asked for in each dialect's words and read into the native request's
think, effort and reasoning_budget: OpenAI's reasoning_effort (and the Responses API's
reasoning.effort) through `thinking`, llama-server's budget fields through `budget`.
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable, Iterator

from localrt import native
from localrt.errors import HTTPError
from localrt.routing import stream_error
from localrt.routing import sse


# OpenAI's reasoning_effort levels beside "none" (which turns thinking off): each turns
# it on, and a template that takes an effort is given it. If you change this, also
# change reasoning_effort in schemas/chat-completion.json and response-create.json.
EFFORTS = ("minimal", "low", "medium", "high", "xhigh", "max")


def thinking(effort: str | None = None, template_kwargs: dict | None = None) -> dict:
    """The native think and effort of OpenAI's reasoning_effort and a chat template's
    enable_thinking (chat_template_kwargs), as llama-server reads them: a boolean
    enable_thinking turns thinking on or off, reasoning_effort "none" turns it off
    whatever that says, and a level is the effort (thinking on, unless enable_thinking
    false turned it off). {} when neither is given: the model's default."""
    out: dict = {}
    enable = (template_kwargs or {}).get("enable_thinking")
    if isinstance(enable, bool):
        out["think"] = enable
    if effort == "none":
        out["think"] = False
    elif effort is not None:
        out["effort"] = effort
        out.setdefault("think", True)
    return out


def budget(body: dict) -> int | None:
    """The thinking budget of a request's reasoning_budget_tokens, else its
    thinking_budget_tokens (llama-server's two names); None (the model's default) for
    neither, or for -1, as llama-server reads it."""
    for name in ("reasoning_budget_tokens", "thinking_budget_tokens"):
        value = body.get(name)
        if value is not None:
            return None if value < 0 else int(value)
    return None


class Fields:
    """A dialect's names for native fields: (pattern, replacement) rules, each a regular
    expression matched at the start of an error's `param`; the first that matches
    replaces what it matched (the rest of the param stays)."""

    def __init__(self, *rules: tuple[str, str]):
        self._rules = tuple((re.compile(pattern), name) for pattern, name in rules)

    def rename(self, err: HTTPError, own: frozenset = frozenset()) -> HTTPError:
        """`err` with the dialect's name in its param and message (changed in place); a
        param in `own` is the dialect's own already (a Media part's `where`)."""
        if err.param is None or err.param in own:
            return err
        for pattern, name in self._rules:
            if pattern.match(err.param):
                new = pattern.sub(name, err.param, count=1)
                err.message = err.message.replace(f"'{err.param}", f"'{new}")
                err.args = (err.message,)
                err.param = new
                break
        return err

    @contextlib.contextmanager
    def named(self, request=None):
        """Errors raised inside, with the dialect's field names; those naming a media
        part of `request` (a native.Request) keep the dialect's path they have."""
        own = frozenset(m.where for m in request.media()) if request is not None \
            else frozenset()
        try:
            yield
        except HTTPError as err:
            raise self.rename(err, own) from None


def write(reply, streamed: bool, stream: Callable, whole: Callable):
    """The dialect template's last step: `stream(reply)`, the dialect's streamed writer
    (closed by the server), or with streamed false `whole(native.collect(events))`, the
    whole reply written, the reply closed either way."""
    if streamed:
        return stream(reply)
    try:
        return whole(native.collect(reply.events()))
    finally:
        reply.close()


def failure(exc: BaseException, model_id: str) -> dict:
    """The error of a reply that broke part way ({code, message, type, ...}), as
    localrt.inference.requests.stream_error says it."""
    return stream_error(exc, model_id)["error"]


class NamedEvents:
    """A dialect's streamed reply: Server-Sent Events with an `event:` name each, made
    from a native reply's events. Subclasses give `named()`, (name, data) pairs;
    close() closes the native reply, which frees the model."""

    content_type = "text/event-stream"

    def __init__(self, reply):
        self._reply = reply

    def __iter__(self) -> Iterator[bytes]:
        for name, data in self.named():
            yield sse(data, event=name)

    def named(self) -> Iterator[tuple[str, dict]]:
        """The events, as (name, data)."""
        raise NotImplementedError

    def close(self) -> None:
        """Called by the server when the reply ends or the client goes away."""
        self._reply.close()
