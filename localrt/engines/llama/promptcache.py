"""The prompt cache in RAM: sequence states that outlive their slots.

A batched model's slots keep the KV of their last sequence (localrt.engines.llama.batch),
but only `n_parallel` of them: a fifth conversation takes a slot and its next turn
would read its whole prompt again. So when a slot is about to lose cached tokens to a
new prompt, the Batcher saves its sequence's state (llama.cpp's per-sequence state:
its KV, as llama_state_seq_get_data writes it) here first, keyed by its tokens; and a
new prompt that shares a longer prefix with a saved state than with any free slot has
that state restored into its slot, and reads only the rest (as llama-server's
--cache-ram does).

The cache holds at most `limit` bytes (the setting promptCacheMiB), evicting the
least recently used state. Tokens are the Batcher's prompt items, so an image's
positions (localrt.engines.llama.media) match by the image's hash. States shorter than
MIN_TOKENS are not worth a copy. A state serves only a prompt of the LoRA adapters
it was computed with (its `adapters`: localrt.engines.llama.adapters). It lives and dies with its model: stopping or
unloading the model drops it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

MIN_TOKENS = 32  # the fewest tokens a state must hold to be saved


@dataclass
class State:
    tokens: tuple  # the prompt items its KV holds, from position 0
    data: object  # the bytes llama.cpp gave (a bytes-like object)
    size: int
    adapters: tuple = ()  # the LoRA adapters (id, scale) its KV was computed with

    @property
    def key(self) -> tuple:
        return self.adapters, self.tokens


class PromptCache:
    """Saved sequence states, least recently used first; not thread-safe (the
    Batcher's lock guards it)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.bytes = 0
        self.lookups = self.hits = 0  # prompts looked up, and those a state served
        self.restored = 0  # tokens restored, all hits together
        # (adapters, tokens) -> State
        self._states: collections.OrderedDict[tuple, State] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def wants(self, tokens: list, adapters: tuple = ()) -> bool:
        """Whether a state of these tokens is worth saving: long enough, and not held
        already (by a state of these tokens or more, of the same adapters)."""
        if len(tokens) < MIN_TOKENS or self.limit <= 0:
            return False
        key = tuple(tokens)
        return not any(s.tokens[:len(key)] == key and s.adapters == adapters
                       for s in self._states.values())

    def put(self, tokens: list, data, size: int, adapters: tuple = ()) -> None:
        """Keep a state; states it extends go, then the least recently used until the
        cache fits its limit (a state larger than the limit is not kept)."""
        if size > self.limit:
            return
        state = State(tuple(tokens), data, size, adapters)
        for old in [s.key for s in self._states.values()
                    if s.adapters == adapters and state.tokens[:len(s.tokens)] == s.tokens]:
            self._drop(old)
        self._states[state.key] = state
        self.bytes += size
        while self.bytes > self.limit:
            self._drop(next(iter(self._states)))

    def find(self, prompt: list, adapters: tuple = ()) -> tuple[State | None, int]:
        """The state of `adapters` sharing the longest prefix with `prompt`, and how
        long it is."""
        self.lookups += 1
        best, shared = None, 0
        for state in self._states.values():
            if state.adapters != adapters:
                continue
            n = common_prefix(state.tokens, prompt)
            if n > shared:
                best, shared = state, n
        return best, shared

    def used(self, state: State, tokens: int) -> None:
        """A state served a prompt with `tokens` of its tokens: it is the most recent."""
        self.hits += 1
        self.restored += tokens
        self._states.move_to_end(state.key)

    def clear(self) -> None:
        self._states.clear()
        self.bytes = 0

    def report(self) -> dict:
        """Its GET /v1/models/status fields."""
        return {"bytes": self.bytes, "limit": self.limit, "states": len(self._states),
                "lookups": self.lookups, "hits": self.hits,
                "hitRate": round(self.hits / self.lookups, 3) if self.lookups else 0.0,
                "restoredTokens": self.restored}

    def _drop(self, key: tuple) -> None:
        self.bytes -= self._states.pop(key).size


def common_prefix(a, b) -> int:
    """How many leading items `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
