"""localrt's own words for a conversation: the request every dialect reads its body into,
and the events every reply is made of.

What Ollama's api/types.go is to Ollama and simonw/llm's parts are to llm. Each dialect
(localrt.dialects: OpenAI's, Anthropic's, the Responses API, Ollama's) is a reader and
a writer around these: it reads its body into a `Request`, calls the native chat
(localrt.inference.chat.Chats.create) or text completion, and writes the `Reply`'s
events in its own wire format, streamed, or whole through `collect`.

A request:

  Request       model, messages, sampling fields, stop, tools, tool_choice,
                response_format, logprobs, prediction, stream, include_usage, ...
  Message       role (system, user, assistant, tool), parts, tool calls, the
                tool_call_id a tool message answers, its name, an assistant's
                reasoning
  Text          a part that is text
  Media         a part that is bytes of a media type (an image today): `data` is the
                bytes, or a URL to read them from (data: or http(s)), read and checked
                by localrt.inference.media; `where` is the dialect's own path of the
                part, which its errors name (messages[1].content[0].source)
  ToolCall      an assistant's call in the history: id, name, arguments (JSON text)

A reply's events, in order: text, reasoning and calls as they come (a call's name
first, then its arguments in pieces), the log-probabilities of the tokens whose text
went out before the next event, then `Finish` and `Usage`; or `Failed` where the
reply broke part way.

  Text, Reasoning, CallStart(index, id, name), CallArgs(index, text),
  Logprobs(entries), Finish(reason, stop_sequence), Usage(...), Failed(error)

A text completion's reply has a Choice(index) before each choice's events, a Finish
ending each, and one Usage at the end.

This module is a leaf: it imports nothing of localrt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Union

# Request fields that are sampling parameters, and stored model parameters with the
# same meaning (schemas/model-update.json). If you add one, also pass it on in the
# engine adapters (localrt.engines.llama, localrt.engines.onnx) and read it in each
# dialect (localrt.dialects).
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "frequency_penalty",
            "presence_penalty", "repeat_penalty", "max_tokens")


# --- parts ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    """Text: a part of a message, or a piece of a reply's answer."""

    text: str


@dataclass(frozen=True)
class Media:
    """Bytes of a media type in a message: `data` is the bytes, or a URL (data: or
    http(s)) they are read from; `media_type` what the dialect says they are
    ("image/png", or "image/*" when it says only that they are an image); `where` the
    dialect's path of the part, for errors."""

    data: Union[bytes, str]
    media_type: str
    where: str

    @property
    def kind(self) -> str:
        """The media's kind: "image", "audio", ..."""
        return self.media_type.partition("/")[0]


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant made: its id, the function's name, its arguments as JSON text."""

    id: str
    name: str
    arguments: str


Part = Union[Text, Media]


@dataclass
class Message:
    """One message of a conversation. `parts` are Text and Media in order; an
    assistant's `tool_calls`, and its `reasoning` (the thinking it wrote before its
    answer, "" for none); a tool message's `tool_call_id` and `name`."""

    role: str
    parts: list = field(default_factory=list)
    tool_calls: list = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str = ""

    @property
    def text(self) -> str:
        """The text parts, joined by newlines."""
        return "\n".join(p.text for p in self.parts if isinstance(p, Text))

    @property
    def media(self) -> list:
        """The Media parts, in order."""
        return [p for p in self.parts if isinstance(p, Media)]


@dataclass
class Request:
    """A chat request in localrt's words.

    `sampling` holds the SAMPLING fields the request sets; `stop` its stop sequences;
    `tools` the function tools as chat templates take them ({"type": "function",
    "function": {name, description, parameters}}), `tool_choice` "auto", "none",
    "required" or "function", with `tool_function` the function's name; `response_format` {"type": "json_object" or
    "json_schema", "schema", "name"} or None for text; `logprobs` the alternatives
    each token comes with (None: no log-probabilities); `prediction` text the reply
    is expected to repeat; `speculative` False turns drafting off for this request;
`lora` llama-server's [{"id", "scale"}], the LoRA adapters' scales for this request
(None: the model's own).

    Thinking (a reasoning model's): `think` True or False turns it on or off, None
    leaves the model's default (its `reasoning` parameter); `effort` is the level a
    template that takes one is given ("minimal", "low", "medium", "high", "xhigh",
    "max"); `reasoning_budget` the most tokens the model may think before localrt ends
    its thinking (None: no budget); `reasoning_format` "none" leaves the reply as the
    model wrote it, markers in the text (None: thinking is parsed out into Reasoning
    events); `template_kwargs` are given to the chat template as they are
    (chat_template_kwargs: enable_thinking among them).
    """

    model: str
    messages: list
    sampling: dict = field(default_factory=dict)
    stop: list = field(default_factory=list)
    tools: list = field(default_factory=list)
    tool_choice: str = "auto"
    tool_function: str | None = None
    parallel_tool_calls: bool = True
    response_format: dict | None = None
    logprobs: int | None = None
    logit_bias: dict | None = None
    prediction: str | None = None
    speculative: bool | None = None
    lora: list | None = None
    stream: bool = False
    include_usage: bool = False
    think: bool | None = None
    effort: str | None = None
    reasoning_budget: int | None = None
    reasoning_format: str | None = None
    template_kwargs: dict = field(default_factory=dict)

    def media(self) -> Iterator[Media]:
        """Every Media part of the messages, in order."""
        for message in self.messages:
            yield from message.media


@dataclass
class TextRequest:
    """A text completion in localrt's words: `prompts` (strings or token-id lists, one
    choice each), `suffix` for a fill-in-the-middle prompt, `echo` to give the prompt
    back first, `logprobs` the alternatives each token comes with (None: none); the
    rest as Request's."""

    model: str
    prompts: list
    suffix: str | None = None
    echo: bool = False
    sampling: dict = field(default_factory=dict)
    stop: list = field(default_factory=list)
    logprobs: int | None = None
    logit_bias: dict | None = None
    speculative: bool | None = None
    lora: list | None = None
    stream: bool = False
    include_usage: bool = False


# --- reply events ---------------------------------------------------------------------


@dataclass(frozen=True)
class Reasoning:
    """A piece of the model's thinking, apart from its answer."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A tool call begins: its index in the reply, its id and the function's name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    """A piece of the arguments (JSON text) of the call at `index`."""

    index: int
    text: str


@dataclass(frozen=True)
class Logprobs:
    """The log-probabilities of tokens whose text went out (localrt.engines.logprobs
    Entry objects), for the event that follows; `base` is added to their text offsets
    (a text completion's prompt, when it is not echoed)."""

    entries: list
    base: int = 0


@dataclass(frozen=True)
class Choice:
    """A text completion's next choice begins (one per prompt, in order)."""

    index: int


@dataclass(frozen=True)
class Finish:
    """Why the reply ended: "stop", "length" or "tool_calls"; the stop sequence that
    ended it, if one did."""

    reason: str
    stop_sequence: str | None = None


@dataclass(frozen=True)
class Usage:
    """The tokens a reply read and wrote."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    audio_tokens: int = 0  # of prompt_tokens, those of audio clips


@dataclass(frozen=True)
class Failed:
    """The reply broke part way: `error` is what broke it (an exception)."""

    error: BaseException


Event = Union[Text, Reasoning, CallStart, CallArgs, Logprobs, Choice, Finish, Usage,
              Failed]


class Reply:
    """A reply being made: its `events()` (once), the prompt's token count (known before
    the first event), and close(), which frees what it holds; the server calls close
    once when a streamed reply ends or its client goes away."""

    def __init__(self, events: Iterable, close: Callable[[], None] = lambda: None,
                 prompt_tokens: Callable[[], int] = lambda: 0):
        self._events = events
        self._close = close
        self._prompt_tokens = prompt_tokens

    @property
    def prompt_tokens(self) -> int:
        """The prompt's tokens."""
        return self._prompt_tokens()

    def events(self) -> Iterator:
        """The events, in order."""
        return iter(self._events)

    def close(self) -> None:
        """Stop generating, if it still does, and free the model."""
        self._close()


# --- a whole reply --------------------------------------------------------------------


@dataclass
class Whole:
    """A reply folded whole: its text, reasoning, calls (ToolCall), the log-probability
    entries of all its tokens, why it ended, and its usage (None if none came)."""

    text: str = ""
    reasoning: str = ""
    calls: list = field(default_factory=list)
    logprobs: list | None = None
    finish: str = "stop"
    stop_sequence: str | None = None
    usage: Usage | None = None


def collect(events: Iterable) -> Whole:
    """A reply's events folded into one Whole; a Failed event's error is raised."""
    text, reasoning, calls, whole = [], [], {}, Whole()
    for event in events:
        if isinstance(event, Text):
            text.append(event.text)
        elif isinstance(event, Reasoning):
            reasoning.append(event.text)
        elif isinstance(event, CallStart):
            calls[event.index] = [event.id, event.name, ""]
        elif isinstance(event, CallArgs):
            calls.setdefault(event.index, ["", "", ""])[2] += event.text
        elif isinstance(event, Logprobs):
            whole.logprobs = (whole.logprobs or []) + list(event.entries)
        elif isinstance(event, Finish):
            whole.finish, whole.stop_sequence = event.reason, event.stop_sequence
        elif isinstance(event, Usage):
            whole.usage = event
        elif isinstance(event, Failed):
            raise event.error
    whole.text, whole.reasoning = "".join(text), "".join(reasoning)
    whole.calls = [ToolCall(*calls[i]) for i in sorted(calls)]
    return whole
