"""Reasoning models: where their thinking is, read from their chat template, and how a
reply is split into thinking and answer, turned off, and held to a budget (issue 34).

A syntax is one row of `SYNTAXES`: the marker that opens thinking, the one that ends
it, and the special tokens the engine must print as text for them to be seen (they are
control tokens in some vocabularies: [THINK], harmony's <|channel|>).

  think     Qwen3, Qwen3.5, QwQ, DeepSeek-R1 and its distills, SmolLM3, GLM:  <think>...</think>
  brackets  Ministral and Magistral reasoning:                              [THINK]...[/THINK]
  gemma4    Gemma 4's thought channel:                      <|channel>thought ... <channel|>
  harmony   gpt-oss: <|channel|>analysis<|message|>...<|end|> is thinking, the final
            channel the answer, commentary to=functions.NAME a tool call

Which row a model's template writes is not guessed from its name: `markers_of` renders
the template (in localrt.engines.chattemplate's sandbox) with and without the
generation prompt, with enable_thinking true and false, and with an assistant turn
that carries reasoning, and reads the difference (as llama.cpp's autoparser does):
a row whose markers the renderings write is the model's; whether enable_thinking
changes the prompt says whether the template has its own off switch, and whether
reasoning_effort does, whether it takes an effort.

A request's `Plan` (localrt.inference.chat makes it from native.Request's fields and
the model's `reasoning` and `reasoning_budget` defaults) gives the template its
variables (enable_thinking, reasoning_effort, chat_template_kwargs). The engine reads
the state the rendered prompt leaves the reply in (`Plan.prepare`: "thinking" when the
prompt already opened it, as Qwen3.5's and QwQ's do, "answer" when it closed it,
"before" when the model opens it itself; an engine that does not say is taken to have
rendered the template as it is, `Plan.state`), closing it there when thinking is off and
the template has no switch (a budget of 0), and follows the reply's tokens with a
`Tracker`: it counts the tokens written inside thinking (reasoning_tokens), and at the
budget gives the end marker's tokens for the engine to write itself, after which the
model answers. A tool_choice that forces a call (`Plan.call`) is, for harmony, a
commentary message that its grammar writes whole from where the analysis ends
(`Plan.commentary`). The reply's text is split by a `Splitter` (localrt.inference.chat's
Completion): thinking becomes native.Reasoning, the rest the answer, where tool calls
are read (harmony's own calls come from its commentary channel here).
"""

from __future__ import annotations

import codecs
import functools
import re
import uuid
from dataclasses import dataclass, field

# Efforts as a template that takes one reads them (gpt-oss: low, medium, high).
EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high",
           "xhigh": "high", "max": "high"}
MODES = ("on", "off", "auto")  # a model's `reasoning` default


@dataclass(frozen=True)
class Syntax:
    """How one family of templates marks thinking (see the module docstring)."""

    name: str
    start: str            # opens thinking
    end: str              # ends it
    marks: tuple          # a rendering holding all of these is this syntax's
    tokens: tuple         # special tokens of the syntax, printed as text
    harmony: bool = False

    def force(self, call: bool = False) -> str:
        """What localrt writes to end thinking at the budget (`call`: a harmony reply
        whose answer is a forced call, which its grammar writes after the analysis)."""
        if self.harmony and call:
            return "<|end|>"
        return "<|end|><|start|>assistant<|channel|>final<|message|>" if self.harmony \
            else self.end

    def closing(self, state: str) -> str:
        """What a prompt in `state` gets so that the reply starts with its answer."""
        if self.harmony:
            return "<|channel|>final<|message|>"
        return self.end if state == "thinking" else self.start + self.end


HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>",
                  "<|call|>", "<|return|>")

SYNTAXES = (
    Syntax("harmony", "<|channel|>analysis<|message|>", "<|end|>",
           marks=("<|channel|>", "analysis"), tokens=HARMONY_TOKENS, harmony=True),
    Syntax("gemma4", "<|channel>thought", "<channel|>", marks=("<|channel>thought", "<channel|>"),
           tokens=("<|channel>", "<channel|>")),
    Syntax("brackets", "[THINK]", "[/THINK]", marks=("[THINK]", "[/THINK]"),
           tokens=("[THINK]", "[/THINK]")),
    Syntax("think", "<think>", "</think>", marks=("<think>", "</think>"),
           tokens=("<think>", "</think>")),
)


@dataclass(frozen=True)
class Markers:
    """What a reasoning model's template says: its syntax, whether enable_thinking
    false changes its prompt (its own off switch), whether it takes an effort, and the
    states its generation prompt leaves a reply in with enable_thinking true and false
    (`state_of`)."""

    syntax: Syntax
    switch: bool
    effort: bool
    states: tuple = ("before", "before")


# --- finding the markers --------------------------------------------------------------

_USER = [{"role": "user", "content": "Which is larger, 7 or 9?"}]
_THOUGHT, _ANSWER = "Seven is less than nine.", "9 is larger."


def markers_of(template: str | None) -> Markers | None:
    """The markers a chat template writes thinking with; None for a model that does
    not reason (or a template that cannot be rendered)."""
    if not template:
        return None
    return _markers(template)


@functools.lru_cache(maxsize=32)
def _markers(template: str) -> Markers | None:
    """Read once per template: every chat and every listing asks."""
    from localrt.engines.chattemplate import ChatTemplate, MessagesRefused, TemplateRefused

    try:
        compiled = ChatTemplate(template, eos_token="</s>", bos_token="<s>", context=4096)
    except TemplateRefused:
        return None

    def render(messages, generation=True, **kwargs) -> str:
        try:
            return compiled.render(messages, generation=generation, kwargs=kwargs)
        except (TemplateRefused, MessagesRefused):
            return ""

    on = render(_USER, enable_thinking=True)
    off = render(_USER, enable_thinking=False)
    turn = {"role": "assistant", "content": _ANSWER, "reasoning_content": _THOUGHT,
            "thinking": _THOUGHT}
    history = render(_USER + [turn], generation=False, enable_thinking=True)
    rendered = "\n".join((on, off, history))
    for syntax in SYNTAXES:
        if all(mark in rendered for mark in syntax.marks):
            effort = render(_USER, reasoning_effort="low") != \
                render(_USER, reasoning_effort="high")
            return Markers(syntax, switch=on != off, effort=effort,
                           states=(state_of(syntax, on), state_of(syntax, off)))
    # A template that only strips earlier thinking (DeepSeek-R1's distills: the model
    # opens it itself, and the history drops it) names its end marker in its source.
    for syntax in SYNTAXES:
        if not syntax.harmony and (f"'{syntax.end}'" in template
                                   or f'"{syntax.end}"' in template):
            return Markers(syntax, switch=on != off, effort=False,
                           states=(state_of(syntax, on), state_of(syntax, off)))
    return None


# --- a request's plan -----------------------------------------------------------------


@dataclass
class Plan:
    """One chat's thinking: the template's variables, and what the engine does with the
    prompt and the reply (see the module docstring). `think` False turns thinking off,
    `budget` None is none, `raw` leaves the reply's text as the model wrote it."""

    markers: Markers
    think: bool = True
    effort: str | None = None
    budget: int | None = None
    raw: bool = False
    template_kwargs: dict = field(default_factory=dict)
    call: bool = False  # a tool_choice forces a call (the answer is that call)

    @property
    def syntax(self) -> Syntax:
        """The model's syntax."""
        return self.markers.syntax

    def kwargs(self) -> dict:
        """The template's variables: enable_thinking (by the template's own switch),
        reasoning_effort when it takes one, then the request's chat_template_kwargs."""
        out = {"enable_thinking": self.think}
        if self.markers.effort and self.effort in EFFORTS and self.think:
            out["reasoning_effort"] = EFFORTS[self.effort]
        out.update(self.template_kwargs)
        return out

    def tokens(self) -> list:
        """The special tokens to print as text."""
        return list(self.syntax.tokens)

    @property
    def commentary(self) -> bool:
        """Whether the answer is a forced call in harmony's commentary channel: its
        grammar (localrt.engines.toolcalls.harmony_grammar) writes the whole message,
        header and all, from where the analysis ends."""
        return self.call and self.syntax.harmony

    @property
    def state(self) -> str:
        """The state the model's own template leaves a reply in, thinking on or off as
        planned: what an engine that does not say (its Generation's `thinking` None: a
        custom engine's) is taken to have rendered."""
        return self.markers.states[0 if self.think else 1]

    def prepare(self, prompt: str) -> tuple[str, str]:
        """(prompt, state): the rendered prompt, closed when thinking is off and the
        template did not close it (or the budget is 0), and the state the reply starts
        in: "thinking", "answer" or "before". A forced harmony call is never closed
        into the final channel: with thinking on the prompt opens the analysis (so the
        model thinks freely and its grammar starts at the analysis's end), with it off
        the grammar writes the call at once."""
        state = state_of(self.syntax, prompt)
        if self.commentary and state == "before":
            if self.think and self.budget != 0:
                return prompt + self.syntax.start, "thinking"
            return prompt, state
        if state != "answer" and (not self.think or self.budget == 0):
            closing = self.syntax.closing(state)
            return prompt + closing, "answer"
        return prompt, state

    def tracker(self, state: str, piece, tokenize) -> "Tracker":
        """A reply's Tracker: `piece(token)` its bytes as printed (special tokens as
        text), `tokenize(text)` the tokens localrt writes to end thinking."""
        return Tracker(self.syntax, state, self.budget, piece, tokenize,
                       call=self.commentary)

    def splitter(self, state: str) -> "Splitter":
        """A reply's Splitter, starting in `state`."""
        return splitter(self.syntax, state)


def state_of(syntax: Syntax, prompt: str) -> str:
    """The state a rendered prompt leaves the reply in: "thinking" (the generation prompt
    opened it), "answer" (it opened and closed it: thinking is off) or "before"."""
    tail = prompt.rstrip()
    if syntax.harmony:
        if tail.endswith("<|channel|>final<|message|>"):
            return "answer"
        return "thinking" if tail.endswith(syntax.start) else "before"
    start, end = prompt.rfind(syntax.start), prompt.rfind(syntax.end)
    if start > end and not prompt[start + len(syntax.start):].strip():
        return "thinking"
    if end >= 0 and end > start and not prompt[end + len(syntax.end):].strip():
        return "answer"
    return "before"


# --- splitting the reply --------------------------------------------------------------


def splitter(syntax: Syntax, state: str) -> "Splitter":
    """The Splitter of a reply in `syntax`, starting in `state`."""
    return HarmonySplitter(state) if syntax.harmony else TagSplitter(syntax, state)


def _held(text: str, marker: str) -> int:
    """Where a suffix of `text` that may be the start of `marker` begins (len: none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


class Splitter:
    """Reads a reply's text as it comes: feed(text) and close() give events,
    ("reasoning", text), ("answer", text), and for harmony ("call", name) and
    ("args", text); `state` is "before", "thinking" or "answer"."""

    state = "answer"
    _buf = ""

    @property
    def held(self) -> str:
        """The text fed and not settled yet (before the thinking: what may open it)."""
        return self._buf

    def feed(self, text: str) -> list:
        """The events `text` (after what came before) settles."""
        raise NotImplementedError

    def close(self) -> list:
        """The events of the end of the reply: a reply that ends while thinking ends
        with its thinking."""
        raise NotImplementedError


class TagSplitter(Splitter):
    """A reply whose thinking is between two markers (<think>...</think>): thinking
    opens only at the reply's start (or in the prompt); whitespace around the thinking
    is dropped."""

    def __init__(self, syntax: Syntax, state: str):
        self.start, self.end = syntax.start, syntax.end
        self.state = state
        self._buf = ""
        self._fresh = True  # at the start of the thinking or the answer: drop whitespace

    def feed(self, text: str) -> list:
        """The events `text` (after what came before) settles."""
        out: list = []
        self._buf += text
        while self._buf:
            if self.state == "before":
                head = self._buf.lstrip()
                if head.startswith(self.start):
                    self._buf, self.state, self._fresh = head[len(self.start):], "thinking", True
                    continue
                if self.start.startswith(head):
                    break  # it may be coming
                self.state = "answer"
            elif self.state == "thinking":
                i = self._buf.find(self.end)
                if i >= 0:
                    self._emit(out, "reasoning", self._buf[:i].rstrip())
                    self._buf, self.state, self._fresh = self._buf[i + len(self.end):], \
                        "answer", True
                    continue
                keep = _held(self._buf, self.end)
                keep = len(self._buf[:keep].rstrip())  # whitespace before the end goes
                self._emit(out, "reasoning", self._buf[:keep])
                self._buf = self._buf[keep:]
                break
            else:
                self._emit(out, "answer", self._buf)
                self._buf = ""
        return out

    def _emit(self, out: list, kind: str, text: str) -> None:
        if self._fresh:
            text = text.lstrip()
            self._fresh = not text
        if text:
            out.append((kind, text))

    def close(self) -> list:
        """The events of the end of the reply: its thinking, if it ended inside it."""
        out: list = []
        if self.state == "thinking":
            self._emit(out, "reasoning", self._buf.rstrip())
        elif self.state == "before":
            self._emit(out, "answer", self._buf)
        self._buf = ""
        return out


_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_ENDS = ("<|end|>", "<|call|>", "<|return|>")


class HarmonySplitter(Splitter):
    """gpt-oss's harmony: messages of a header (<|start|>assistant, <|channel|>NAME, a
    recipient to=functions.NAME, <|constrain|>json) then <|message|> and a body ended by
    <|end|>, <|call|> or <|return|>. The analysis channel is thinking, commentary to a
    function a call, anything else the answer. A reply that is not harmony is answer."""

    def __init__(self, state: str):
        self._buf = ""
        self.calls = 0
        if state == "answer":
            self._mode, self._channel = "body", "final"
        elif state == "thinking":
            self._mode, self._channel = "body", "analysis"
        else:
            self._mode, self._channel = "header", None
        self._recipient = None

    @property
    def state(self) -> str:
        """"thinking" inside an analysis message, "before" in a header, else "answer"."""
        if self._mode == "plain":
            return "answer"
        if self._mode == "header":
            return "before"
        return "thinking" if self._channel == "analysis" else "answer"

    def feed(self, text: str) -> list:
        """The events `text` (after what came before) settles."""
        out: list = []
        self._buf += text
        while self._buf:
            if self._mode == "plain":
                out.append(("answer", self._buf))
                self._buf = ""
            elif self._mode == "header":
                i = self._buf.find("<|message|>")
                if i < 0:
                    head = self._buf.lstrip()
                    if head and not (head.startswith("<|") or "<|".startswith(head)):
                        self._mode = "plain"  # not harmony: the model wrote plain text
                        continue
                    break
                self._open(self._buf[:i], out)
                self._buf, self._mode = self._buf[i + len("<|message|>"):], "body"
            else:
                cuts = [(self._buf.find(e), e) for e in _ENDS if e in self._buf]
                if cuts:
                    i, end = min(cuts)
                    self._body(self._buf[:i], out)
                    self._buf, self._mode = self._buf[i + len(end):], "header"
                    self._channel = self._recipient = None
                    continue
                keep = min(_held(self._buf, e) for e in _ENDS)
                self._body(self._buf[:keep], out)
                self._buf = self._buf[keep:]
                break
        return out

    def _open(self, header: str, out: list) -> None:
        match = re.search(r"<\|channel\|>\s*(\w+)", header)
        self._channel = match.group(1) if match else "final"
        recipient = _RECIPIENT.search(header)
        self._recipient = recipient.group(1) if recipient else None
        if self._recipient:
            out.append(("call", self.calls, "call_" + uuid.uuid4().hex[:24], self._recipient))
            self.calls += 1

    def _body(self, text: str, out: list) -> None:
        if not text:
            return
        if self._recipient:
            out.append(("args", self.calls - 1, text))
        else:
            out.append(("reasoning" if self._channel == "analysis" else "answer", text))

    def close(self) -> list:
        """The events of the end of the reply: the body it ended inside, if any."""
        out: list = []
        if self._mode == "body":
            self._body(self._buf, out)
        elif self._mode == "plain":
            out.append(("answer", self._buf))
        self._buf = ""
        return out


# --- following the reply's tokens -------------------------------------------------------


class Tracker:
    """Follows one reply's tokens as the engine makes them: `step(token)` counts it as
    thinking or not (`count`: the opening marker and a harmony header included) and gives
    the tokens localrt writes itself to end thinking once `count` reaches the budget
    (empty otherwise); the engine feeds those and steps them too. `answering` turns
    true where the answer starts (a grammar applies from there); with `call` (a forced
    harmony call: Plan.commentary) that is wherever the reply is not in its analysis,
    the next message's header included, since the call's grammar writes it. Before the
    thinking, `answers(token)` and `opening()` say which tokens the model may write
    while a grammar waits for its answer (the engine asks before it steps the token)."""

    def __init__(self, syntax: Syntax, state: str, budget: int | None, piece, tokenize,
                 call: bool = False):
        self.count = 0
        self.budget = budget
        self._splitter = splitter(syntax, state)
        self._piece, self._tokenize = piece, tokenize
        self._force = syntax.force(call)
        self._call = call
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = 0  # tokens before the thinking opened, that may be its marker
        self._forcing = False
        self._syntax = syntax
        self._opening = None  # the opening marker's tokens, and their texts (_marker)
        self.answering = self._answers(state)

    @property
    def may_force(self) -> bool:
        """Whether it may give tokens to write (a budget, while not answering)."""
        return self.budget is not None and not self.answering

    def quiet(self) -> int | None:
        """How many tokens it surely follows before any of them makes it give tokens to
        write (a draft may be verified that far: localrt.engines.llama.batch); None for
        any number (no budget, or answering)."""
        if not self.may_force:
            return None
        # each token adds at most one to `count`, and the pending ones once
        return max(self.budget - self.count - self._pending - 1, 0)

    def step(self, token: int) -> list:
        """Follow one token; the tokens to write now (see the class docstring)."""
        if self.answering:
            return []
        before = self._splitter.state
        events = self._splitter.feed(self._decoder.decode(self._piece(token)))
        state = self._splitter.state
        if self._forcing:
            pass  # localrt's own end marker is not the model's thinking
        elif state == "thinking" or before == "thinking" or \
                any(e[0] == "reasoning" for e in events):
            self.count += 1 + self._pending
            self._pending = 0
        elif state == "before":
            self._pending += 1
        else:
            self._pending = 0
        if self._answers(state):
            self.answering = True
            return []
        if self.budget is not None and self.count >= self.budget and state == "thinking" \
                and not self._forcing:
            return self._tokenize(self._force)
        return []

    @property
    def state(self) -> str:
        """The reply's state so far: "before", "thinking" or "answer"."""
        return self._splitter.state

    def opening(self) -> int | None:
        """Before the thinking, partway through the opening marker the model began (its
        first tokens of several): the marker's next token, which the model must write
        when a grammar waits for its answer (the answer cannot start inside the marker:
        localrt.engines.llama.decode keeps it to that token); None otherwise."""
        if self.answering or self._syntax.harmony or self.state != "before":
            return None
        head = self._splitter.held.lstrip()
        tokens, texts = self._marker()
        for k in range(1, len(tokens)):
            if head and texts[k] == head:
                return tokens[k]
        return None

    def answers(self, token: int) -> bool:
        """Whether `token`, written next while the reply is before its thinking, starts
        the answer: anything but whitespace, a token that opens the thinking (the whole
        marker, or the first of its tokens) or, for harmony, a message's header (<|...),
        where the answer starts only after the header of a channel that is not the
        analysis. Asked before the token is followed (step)."""
        text = self._piece(token).decode("utf-8", "replace")
        head = (self._splitter.held + text).lstrip()
        if not head:
            return False
        if self._syntax.harmony:
            return not head.startswith("<|")
        if head.startswith(self._syntax.start):
            return False
        tokens, _ = self._marker()
        return not (len(tokens) > 1 and token == tokens[0]
                    and not self._splitter.held.strip())

    def constrained(self) -> None:
        """A grammar writes the reply from here (the model answered before thinking):
        it is the answer whatever the grammar writes, and nothing is written into it at
        a budget (llama.cpp aborts on a token a grammar rejects)."""
        self.answering = True

    def _marker(self) -> tuple[list, list]:
        """The opening marker's tokens as localrt's tokenizer writes it, and the text of
        each run of them from the start (texts[k]: the first k); no tokens when they
        do not write the marker's text back (a tokenizer that puts a space before a
        word after a special token): only a token that holds the whole marker opens it
        then."""
        if self._opening is None:
            tokens, texts = list(self._tokenize(self._syntax.start)), [""]
            for token in tokens:
                texts.append(texts[-1] + self._piece(token).decode("utf-8", "replace"))
            self._opening = (tokens, texts) if texts[-1] == self._syntax.start else ([], [""])
        return self._opening

    def _answers(self, state: str) -> bool:
        """Whether the reply's answer has started in `state`."""
        return state == "answer" or (self._call and state != "thinking")

    def forced(self, tokens: list) -> None:
        """Follow the tokens localrt wrote to end thinking (never counted)."""
        self._forcing = True
        try:
            for token in tokens:
                self.step(token)
        finally:
            self._forcing = False
