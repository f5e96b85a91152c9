"""Engine-neutral generation: the Generation every loaded model's generate() returns.

A Generation is an iterator of text pieces, one per token (or fewer while a stop
sequence might be starting). `token_loop` turns an engine's tokens into those pieces:
it cuts the text at a stop sequence (`StopText`), an end token or max_tokens, counts
the tokens in `usage`, feeds the Generation's Log (localrt.engines.logprobs) when
the request asked for log probabilities, and sets `finish_reason` and
`stop_sequence` at the end. A custom engine's model with only the older chat() is
wrapped in `ChatOnlyModel`, whose generations count chat()'s streamed pieces as
tokens, so every loaded model has generate() (localrt.engines.contract says what
else a model may have).

Sampling defaults (`SAMPLING_DEFAULTS`, `sampling_value`), the request's seed
(`seed_of`) and the room a prompt leaves in the context (`check_room`) are the same
for every engine.
"""

from __future__ import annotations

import random
from typing import Callable, Iterator

from localrt.errors import InvalidField

# Sampling defaults where neither the request nor the model says: llama.cpp's own.
SAMPLING_DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05,
                     "repeat_penalty": 1.0, "frequency_penalty": 0.0,
                     "presence_penalty": 0.0}


class Generation:
    """Text pieces as they are generated; `finish_reason` and `usage` once it ends.

    `run(generation)` makes the iterator of pieces (read lazily); `on_close` runs at
    close(), read or not; `logprobs` is a localrt.engines.logprobs.Log when the
    request asked for log probabilities and the engine computes them (token_loop
    feeds it). A batched model's generation is given how to wait for its next token
    when the model builds it (localrt.engines.contract.Batched).
    """

    def __init__(self, prompt_tokens: int, run: Callable[["Generation"], Iterator[str]],
                 on_close: Callable[[], None] | None = None, logprobs=None):
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None  # the stop sequence that ended it, if one did
        # A reasoning reply's state where it starts, as its engine rendered the prompt
        # (localrt.engines.reasoning: "before", "thinking" or "answer"); None: unknown.
        self.thinking: str | None = None
        self.usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0}
        self.logprobs = logprobs
        self._on_close = on_close
        self._pieces = run(self)

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Stop generating; the engine is free for the next request."""
        try:
            self._pieces.close()
        finally:
            if self._on_close is not None:
                self._on_close()


class StopText:
    """Cuts generated text at the first stop sequence, holding back what might start one."""

    def __init__(self, stops):
        self.stops = [s for s in stops or () if s]
        self.hit = False
        self.matched: str | None = None  # the stop sequence found, once `hit`
        self._pending = ""

    def feed(self, text: str) -> str:
        """The part of `text` (after what was held back) that is safe to send."""
        if self.hit:
            return ""
        pending = self._pending + text
        cuts = [(i, s) for i, s in ((pending.find(s), s) for s in self.stops) if i >= 0]
        if cuts:
            cut, self.matched = min(cuts, key=lambda c: c[0])
            self.hit, self._pending = True, ""
            return pending[:cut]
        hold = 0
        for k in range(min(len(pending), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(pending[-k:]) for s in self.stops):
                hold = k
                break
        self._pending = pending[len(pending) - hold:]
        return pending[:len(pending) - hold]

    def flush(self) -> str:
        """What was held back, once generation ended without a stop sequence."""
        out, self._pending = ("" if self.hit else self._pending), ""
        return out


def token_loop(gen: Generation, tokens, *, decode, is_end=lambda token: False,
               final=lambda: "", stops=(), max_tokens: int | None = None,
               exhausted: str = "length", scores=None) -> Iterator[str]:
    """The text of `tokens` as it comes, cut at a stop sequence, an end token or max_tokens.

    Counts completion tokens in `gen.usage` and sets `gen.finish_reason` (and
    `gen.stop_sequence`) at the end; `exhausted` is the finish reason when `tokens` runs
    out by itself. With `gen.logprobs` (a localrt.engines.logprobs.Log), `scores(token)` is each
    token's TokenLogprob, and the log learns which text each token made and what of it
    is sent.
    """
    stop, finish, log = StopText(stops), exhausted, gen.logprobs
    decoded = sent = 0  # characters of text decoded, and sent (a prefix of them)
    for token in tokens:
        if is_end(token):
            finish = "stop"
            break
        gen.usage["completion_tokens"] += 1
        text = decode(token)
        piece = stop.feed(text)
        if log is not None:
            log.add(scores(token), decoded, decoded + len(text))
            decoded, sent = decoded + len(text), sent + len(piece)
            if stop.hit:
                log.cut(sent)
            else:
                log.sent(sent)
        if piece:
            yield piece
        if stop.hit:
            finish = "stop"
            break
        if max_tokens and gen.usage["completion_tokens"] >= max_tokens:
            finish = "length"
            break
    tail = stop.feed(final()) + stop.flush()
    if log is not None and stop.hit:
        log.cut(sent + len(tail))
    elif log is not None:
        log.finish()
    if tail:
        yield tail
    gen.finish_reason = finish
    gen.stop_sequence = stop.matched if finish == "stop" else None


def generation_of_pieces(pieces, params: dict) -> Generation:
    """A Generation over an engine's streamed chat() pieces, each counted as a token."""
    def run(gen: Generation) -> Iterator[str]:
        try:
            yield from token_loop(gen, pieces, decode=str, stops=params.get("stop"),
                                  max_tokens=params.get("max_tokens"), exhausted="stop")
        finally:
            if hasattr(pieces, "close"):
                pieces.close()

    return Generation(getattr(pieces, "prompt_tokens", 0), run)


def check_room(prompt_tokens: int, context: int) -> int:
    """The tokens left for the reply; a 400 when the prompt fills the context. An engine
    caps max_tokens by it, so a reply that reaches the context's end finishes with
    "length", as at max_tokens (tests/test_context_end.py, in every dialect)."""
    if prompt_tokens >= context:
        raise InvalidField(f"Invalid field 'messages': the prompt is {prompt_tokens} tokens "
                           f"and the model's context (ctx_len) holds {context}; shorten the "
                           f"conversation or start the model with a larger ctx_len",
                           param="messages")
    return context - prompt_tokens


def seed_of(params: dict, bits: int) -> int:
    """The request's seed as the engine takes it; a random one when none is given.

    Folded below 2**bits - 1, which llama.cpp reads as "pick a random seed". A seed
    written 7.0 is 7: JSON Schema counts it as an integer.
    """
    seed = params.get("seed")
    if seed is None or seed < 0:
        return random.getrandbits(bits) % ((1 << bits) - 1)
    return int(seed) % ((1 << bits) - 1)


class GeneratingModel:
    """A loaded model with generate(); chat() offers the older contract on top of it."""

    def generate(self, messages: list, params: dict) -> Generation:
        """See localrt.engines.contract.Model."""
        raise NotImplementedError

    def chat(self, messages: list, params: dict, stream: bool):
        """The older chat(messages, params, stream) contract (contract.ChatModel)."""
        generation = self.generate(messages, params)
        if stream:
            return generation
        content = "".join(generation)
        return {"content": content, "finish_reason": generation.finish_reason,
                "usage": dict(generation.usage)}


class ChatOnlyModel(GeneratingModel):
    """A custom engine's model that has only the older chat() (localrt.engines.contract's
    ChatModel): generate() reads its streamed pieces, each counted as a token.
    Everything else is `model`'s own, the engine's loaded model."""

    def __init__(self, model):
        self.model = model

    def generate(self, messages: list, params: dict) -> Generation:
        """See localrt.engines.contract.Model."""
        return generation_of_pieces(self.model.chat(messages, params, True), params)

    def chat(self, messages: list, params: dict, stream: bool):
        """The model's own chat()."""
        return self.model.chat(messages, params, stream)

    def unload(self) -> None:
        """The model's own unload()."""
        self.model.unload()

    # The optional capabilities contract.capabilities found on `model` (memory(),
    # count_tokens(), ...) are called through this.
    def __getattr__(self, name):
        return getattr(self.model, name)


def sampling_value(params: dict, name: str) -> float:
    """A sampling parameter of the request, else its default (SAMPLING_DEFAULTS)."""
    value = params.get(name)
    return SAMPLING_DEFAULTS[name] if value is None else value


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
