"""Log-probabilities: what an engine scores for each token.

A request asks for them with chat's `logprobs: true` (and `top_logprobs`, 0 to 20
alternatives) or a completion's `logprobs` (0 to 20). The engine then scores every
token it samples (`score`: the log-softmax of the logits the model produced for it,
over the whole vocabulary, and the most likely alternatives): these are the model's
own log-probabilities, before anything a request does to sampling (temperature,
top_k/top_p/min_p, penalties, logit_bias, a grammar), as OpenAI's and llama.cpp's
server (with post_sampling_probs off) report them. A greedy reply's tokens are
therefore its top-1 alternatives, and a logit bias does not change what is reported.

  TokenLogprob  one scored token: its id, its log-probability, the alternatives
  Log           a Generation's scores as its text goes out (localrt.engines.generation's
                token_loop feeds it): a token is released once the text it made has
                been sent, and a stop sequence drops the tokens that made only it
  Entry         a released token as text: its bytes, its log-probability, the
                alternatives' bytes, and where its text starts in the reply

Replies carry the entries as native Logprobs events (localrt.native); each dialect
writes them in its shapes (OpenAI's two: localrt.dialects.openai).

numpy, which llama-cpp-python brings, is imported by `score` only.
"""

from __future__ import annotations

import codecs
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

MOST = 20  # the most alternatives a token carries (OpenAI's limit)
GROUP = 64  # logits per group when the top ones are sought (`_candidates`)


@dataclass(frozen=True)
class TokenLogprob:
    """One scored token: `logprob` is None for a prompt's first token (nothing came
    before it to predict it), and then `top` is None too."""

    token: int
    logprob: float | None
    top: tuple = ()  # ((token, logprob), ...), most likely first


def score(logits, top: int) -> tuple[float, tuple]:
    """(log-sum-exp, the `top` most likely (token, logprob) pairs, most likely first) of
    one row of logits (a float32 numpy array over the vocabulary): a token's
    log-probability is its logit minus the first. Ties go to the lower token id, as a
    greedy sampler picks."""
    import numpy as np

    peak = float(logits.max())
    # A float32 sum of exp(x - peak) holds exp(0) = 1, so the log-sum-exp is never below
    # the peak and no log-probability is above 0.
    lse = peak + math.log(float(np.exp(logits - peak).sum()))
    if top <= 0:
        return lse, ()
    ids = _candidates(np, logits, min(top, logits.shape[0]))
    order = np.lexsort((ids, -logits[ids]))[:top]
    return lse, tuple((int(t), float(logits[t]) - lse) for t in ids[order])


def _candidates(np, logits, top: int):
    """Token ids that include the `top` largest logits, and few others: split the row
    into groups (the columns of it as GROUP rows), and keep the logits at least as large
    as the top-th largest group maximum. The top-th largest logit is at least that: each
    of the `top` groups with the largest maxima holds a logit that large. It reads the
    row twice, several times faster than an argpartition of it."""
    n = logits.shape[0]
    whole = n - n % GROUP
    if whole < GROUP * top * 4:  # a small vocabulary: all of it
        return np.arange(n)
    maxima = logits[:whole].reshape(GROUP, -1).max(axis=0)  # an elementwise max of rows
    if whole < n:
        maxima = np.concatenate((maxima, logits[whole:]))  # the rest: a group each
    floor = np.partition(maxima, -top)[-top]
    return np.flatnonzero(logits >= floor)


def scored(logits, token: int, top: int) -> TokenLogprob:
    """The TokenLogprob of `token` in a row of logits, with `top` alternatives."""
    lse, best = score(logits, top)
    return TokenLogprob(token, float(logits[token]) - lse, best)


def certain(token: int, top: int) -> TokenLogprob:
    """The TokenLogprob of a token localrt writes itself (the end of a thinking budget):
    no model chose it, so its log-probability is 0 and it is its only alternative."""
    return TokenLogprob(token, 0.0, ((token, 0.0),)[:top])


@dataclass(frozen=True)
class Entry:
    """A token as a reply writes it: its bytes (special tokens as their text), its
    log-probability (None: a prompt's first token), the alternatives as (bytes,
    logprob) pairs (None with it), and the character where its text starts."""

    piece: bytes
    logprob: float | None
    top: tuple | None
    offset: int


class Log:
    """A generation's scored tokens, released as the text they made is sent.

    `piece(token, special)` is the engine's bytes of a token (special tokens as their
    text when `special`); `prompt()`, when the engine scores the prompt too (a
    completion's echo), is the prompt's TokenLogprobs, its first with logprob None,
    once the prompt has been read (after the first piece, or the end).
    Offsets count characters of the reply's text, from its first.
    """

    def __init__(self, piece: Callable[[int, bool], bytes], prompt=None):
        self._piece = piece
        self._prompt = prompt
        self._held: deque = deque()  # (TokenLogprob, start, end) not released yet
        self._out: list[Entry] = []

    @property
    def scores_prompt(self) -> bool:
        """Whether the engine scores the prompt's tokens too."""
        return self._prompt is not None

    def add(self, token: TokenLogprob, start: int, end: int) -> None:
        """A token whose text spans characters [start, end) of the decoded reply."""
        self._held.append((token, start, end))

    def sent(self, upto: int) -> None:
        """The reply's first `upto` characters are sent: release the tokens they hold."""
        while self._held and self._held[0][2] <= upto:
            self._release(*self._held.popleft()[:2])

    def cut(self, at: int) -> None:
        """A stop sequence starts at character `at`: tokens with text before it are
        released, the rest (the stop sequence's own) dropped."""
        while self._held:
            token, start, _ = self._held.popleft()
            if start < at:
                self._release(token, start)
        self._held.clear()

    def finish(self) -> None:
        """The reply ended with no stop sequence: release every token."""
        while self._held:
            self._release(*self._held.popleft()[:2])

    def take(self) -> list[Entry]:
        """The tokens released since the last take, in order."""
        out, self._out = self._out, []
        return out

    def prompt(self, text: str) -> list[Entry] | None:
        """The prompt's tokens as entries, their offsets in `text` (the echoed prompt);
        None when the engine did not score the prompt."""
        if self._prompt is None:
            return None
        tokens = self._prompt()
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        starts, written = [], 0
        for t in tokens:
            starts.append(written)
            written += len(decoder.decode(self._piece(t.token, False)))
        written += len(decoder.decode(b"", final=True))
        # A tokenizer that adds a space before the text (SentencePiece's) writes one
        # more character than the prompt had: offsets count in the prompt's text.
        extra = written - len(text)
        if extra < 0:
            extra = 0
        return [self._entry(t, max(0, start - extra)) for t, start in zip(tokens, starts)]

    def _release(self, token: TokenLogprob, start: int) -> None:
        self._out.append(self._entry(token, start))

    def _entry(self, token: TokenLogprob, offset: int) -> Entry:
        piece = self._piece
        top = None if token.logprob is None else \
            tuple((piece(t, True), lp) for t, lp in token.top)
        return Entry(piece(token.token, True), token.logprob, top, offset)
