"""The Batcher's engine on llama.cpp (localrt.engines.llama.batch decides what each step
computes; this computes it): one context holding a sequence per slot, the llama_batch
each step fills, each sequence's sampler chain, and the saving and restoring of a
slot's state for the RAM prompt cache (localrt.engines.llama.promptcache).

Sampling a draft (localrt.engines.llama.drafting): a step feeds a generating sequence's next
token and its draft; each position's logits are kept, and the sequence's own sampler
chain picks a token from each in turn while the picks agree with the draft, so the
chain sees only the tokens the reply keeps. A reasoning reply whose answer a grammar
constrains samples with its free chain while it thinks; before its thinking, a token
that does not open it (whitespace, the opening marker, harmony's message header) is
the answer's first and is sampled from the grammar's chain, which takes over there
(`_pick`), and once the model has begun a marker of several tokens it writes the rest.
An image entry (localrt.engines.llama.media) is
evaluated after the text's decode and its sampling, since its decode overwrites the
logits. llama_cpp is imported by the caller (localrt.engines.llama.model) when a model loads.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

from localrt.engines import logprobs
from localrt.engines.llama.batch import Entry, Sequence
from localrt.engines.llama.media import image_item

log = logging.getLogger(__name__)

PENALTY_LAST_N = 64  # tokens the repeat/frequency/presence penalties look back over


@dataclass(frozen=True)
class Sampling:
    """How one sequence picks its tokens (localrt.engines.generation.SAMPLING_DEFAULTS
    fills in the defaults)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int
    bias: tuple = ()  # (token, bias) pairs
    grammar: str | None = None  # GBNF, its rule "root" first


class LlamaBatch:
    """The Batcher's engine on llama.cpp: one context holding a sequence per slot, the
    llama_batch each step fills, and each sequence's sampler chain."""

    def __init__(self, llama_cpp, model, params, projector=None, adapters=None):
        self._ll = llama_cpp
        self.projector = projector  # a vision model's (localrt.engines.llama.media.Projector)
        self.adapters = adapters  # a model's LoRA adapters (localrt.engines.llama.adapters)
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if self.ctx is None:
            raise ValueError("llama.cpp could not make the context (not enough memory for "
                             "ctx_len x n_parallel?)")
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self._n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self._memory = llama_cpp.llama_get_memory(self.ctx)
        self._batch = llama_cpp.llama_batch_init(llama_cpp.llama_n_batch(self.ctx), 0, 1)

    def sampler(self, s: Sampling, prompt: list[int]):
        """A new sampler chain; ValueError for a grammar llama.cpp cannot parse."""
        ll = self._ll
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        try:
            if s.bias:
                pairs = (ll.llama_logit_bias * len(s.bias))(*s.bias)
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_logit_bias(
                    self._n_vocab, len(s.bias), pairs))
            if (s.repeat_penalty, s.frequency_penalty, s.presence_penalty) != (1.0, 0.0, 0.0):
                penalties = ll.llama_sampler_init_penalties(
                    self._n_vocab, PENALTY_LAST_N, s.repeat_penalty, s.frequency_penalty, s.presence_penalty)
                text = [t for t in prompt if image_item(t) is None]
                for token in text[-PENALTY_LAST_N:]:  # the prompt counts, as in llama.cpp
                    ll.llama_sampler_accept(penalties, token)
                ll.llama_sampler_chain_add(chain, penalties)
            if s.grammar is not None:
                grammar = ll.llama_sampler_init_grammar(self._vocab, s.grammar.encode("utf-8"),
                                                        b"root")
                if not grammar:
                    raise ValueError("llama.cpp cannot parse the grammar")
                ll.llama_sampler_chain_add(chain, grammar)
            if s.temperature <= 0:
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
            else:
                for sampler in (ll.llama_sampler_init_top_k(s.top_k),
                                ll.llama_sampler_init_top_p(s.top_p, 1),
                                ll.llama_sampler_init_min_p(s.min_p, 1),
                                ll.llama_sampler_init_temp(s.temperature),
                                ll.llama_sampler_init_dist(s.seed)):
                    ll.llama_sampler_chain_add(chain, sampler)
        except BaseException:
            ll.llama_sampler_free(chain)
            raise
        return chain

    def save(self, slot: int) -> tuple:
        """The slot's sequence state (its KV), as llama.cpp writes it: (data, size)."""
        ll = self._ll
        size = ll.llama_state_seq_get_size(self.ctx, slot)
        if not size:
            return None, 0
        data = (ctypes.c_uint8 * size)()
        n = ll.llama_state_seq_get_data(self.ctx, data, size, slot)
        return data, n

    def restore(self, slot: int, data, size: int) -> bool:
        """Replace the slot's sequence with a saved state; false when llama.cpp could
        not (the slot is then empty)."""
        ll = self._ll
        ll.llama_memory_seq_rm(self._memory, slot, -1, -1)
        if ll.llama_state_seq_set_data(self.ctx, data, size, slot):
            return True
        ll.llama_memory_seq_rm(self._memory, slot, -1, -1)
        return False

    def trim(self, slot: int, keep: int) -> bool:
        """Drop a slot's KV from position `keep` on; false when the model's memory cannot
        cut a sequence short (a recurrent one), which it always can from 0."""
        return bool(self._ll.llama_memory_seq_rm(self._memory, slot, keep, -1))

    def decode(self, entries: list[Entry]) -> list[list[int]]:
        """One llama_decode of every text entry, the sampled tokens of each that samples
        (_decode's), then each image entry's image (one that fails is marked `failed`),
        with the LoRA adapters of the entries' sequences (one set a step)."""
        if self.adapters is not None and entries:  # the Batcher's step has one set
            self.adapters.apply(self.ctx, entries[0].seq.adapters)
        images = [e for e in entries if e.image is not None]
        sampled: list = self._decode([e for e in entries if e.image is None])
        for entry in images:  # after sampling: an image's decode overwrites the logits
            try:
                self.projector.evaluate(entry.image, self.ctx, entry.pos, entry.slot,
                                        self._ll.llama_n_batch(self.ctx))
            except Exception as exc:
                log.warning("an image could not be evaluated: %s", exc)
                entry.failed = exc
        return sampled

    def _decode(self, entries: list[Entry]) -> list[list[int]]:
        """One llama_decode; for each entry that samples, its tokens: one, or with a
        draft, one per position the samples agreed with the draft, and one more."""
        if not entries:
            return []
        ll, batch = self._ll, self._batch
        n, outputs, scored = 0, [], []
        for entry in entries:
            every = entry.reading and entry.seq.prompt_logprobs  # logits for each token
            if every:
                scored.append((entry, n))
            for offset, token in enumerate(entry.tokens):
                batch.token[n] = token
                batch.pos[n] = entry.pos + offset
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = entry.slot
                batch.logits[n] = every
                n += 1
            if entry.sample:  # the last token's logits, and each draft token's
                first = n - 1 - entry.draft
                for j in range(first, n):
                    batch.logits[j] = True
                outputs.append((entry, first))
        batch.n_tokens = n
        code = ll.llama_decode(self.ctx, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode failed with status {code}")
        for entry, first in scored:
            self._score_prompt(entry, first)
        sampled = []
        for entry, first in outputs:
            draft = entry.tokens[len(entry.tokens) - entry.draft:]
            got = []
            for j in range(entry.draft + 1):  # the sampler chain sees only kept tokens
                token = self._sample(entry.seq, first + j)
                got.append(token)
                if j == entry.draft or token != draft[j] or self.is_end(token):
                    break
            sampled.append(got)
        return sampled

    def _sample(self, seq: Sequence, i: int) -> int:
        """The sequence's token from output row `i`, scored when it asks for logprobs."""
        if seq.top_logprobs is None:  # the common case costs nothing more
            return self._pick(seq, i)
        logits = self._logits(i)  # raw: read before the sampler chain sees them
        lse, top = logprobs.score(logits, seq.top_logprobs)
        token = self._pick(seq, i)
        seq.scores.append(logprobs.TokenLogprob(token, float(logits[token]) - lse, top))
        return token

    def _pick(self, seq: Sequence, i: int) -> int:
        """The token the sequence's sampler chain picks from output row `i`. A reply
        before its thinking whose answer a grammar waits for (see the module docstring)
        writes whitespace, the opening marker (its next token, once it has begun it) or
        the answer's first token, which its grammar's chain picks: that chain then takes
        over, so the whole answer is the grammar's. The chain never accepts a token its
        grammar rejects (llama.cpp aborts on one): it samples the token itself."""
        ll, tracker = self._ll, seq.thinking
        if seq.after_thinking is None or tracker is None or tracker.answering \
                or tracker.state != "before":
            return ll.llama_sampler_sample(seq.sampler, self.ctx, i)
        must = tracker.opening()
        if must is not None:
            ll.llama_sampler_accept(seq.sampler, must)
            return must
        token = ll.llama_sampler_sample(seq.sampler, self.ctx, i)
        if not self.is_end(token) and not tracker.answers(token):
            return token
        self.constrain(seq)  # the model answers at once (or ends): the grammar's token
        tracker.constrained()
        return ll.llama_sampler_sample(seq.sampler, self.ctx, i)

    def _logits(self, i: int):
        """The logits of output row `i` of the last decode, as a numpy array (a view)."""
        import numpy as np

        return np.ctypeslib.as_array(self._ll.llama_get_logits_ith(self.ctx, i),
                                     shape=(self._n_vocab,))

    def _score_prompt(self, entry: Entry, first: int) -> None:
        """Score the prompt tokens an entry's logits predict: row `first + j` (position
        entry.pos + j) gives the next prompt token's log-probability."""
        seq = entry.seq
        for j in range(len(entry.tokens)):
            target = entry.pos + j + 1
            if target >= len(seq.prompt):
                break
            seq.prompt_scores.append(
                logprobs.scored(self._logits(first + j), seq.prompt[target], seq.top_logprobs or 0))

    def is_end(self, token: int) -> bool:
        """Whether a token ends a generation (end of sequence, end of turn, ...)."""
        return bool(self._ll.llama_vocab_is_eog(self._vocab, token))

    def accept(self, seq: Sequence, tokens: list) -> None:
        """Tokens written for a sequence (the end of its thinking), into its sampler chain
        as if it had sampled them."""
        for token in tokens:
            self._ll.llama_sampler_accept(seq.sampler, token)

    def constrain(self, seq: Sequence) -> None:
        """The sequence's answer starts: its grammar's chain takes over from the free one."""
        self._ll.llama_sampler_free(seq.sampler)
        seq.sampler, seq.after_thinking = seq.after_thinking, None

    def release(self, seq: Sequence) -> None:
        """Free a sequence's sampler chains, and its image chunks."""
        for chain in (seq.sampler, seq.after_thinking):
            if chain is not None:
                self._ll.llama_sampler_free(chain)
        seq.sampler = seq.after_thinking = None
        if seq.images:
            self.projector.free_chunks(seq.images)

    def prompt_evaluated(self) -> int:
        """Prompt tokens llama.cpp counted as evaluated (batches of more than one token)."""
        return self._ll.llama_perf_context(self.ctx).n_p_eval

    def close(self) -> None:
        """Free the batch and the context."""
        if self.projector is not None:
            self.projector.close()
        if self.ctx is not None:
            self._ll.llama_batch_free(self._batch)
            self._ll.llama_free(self.ctx)
            self.ctx = None
