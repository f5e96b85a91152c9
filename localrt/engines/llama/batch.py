"""Continuous batching: the generations of one model share each decode step.

A batched model (localrt.engines.llama.model's LlamaModel) keeps `slots` sequences in
one llama.cpp context, each with its own KV cache of ctx_len tokens. `Batcher` decides what each
step computes; `LlamaBatch` (localrt.engines.llama.decode) computes it with llama.cpp:

  * A generation joins (`join`) when it is first read, and takes a slot at the next
    step, in arrival order (localrt.inference.scheduler lets at most `slots` generations in).
  * One `step()` is one llama_decode: the next token of every generating sequence,
    then the prompts of the sequences still reading theirs, in arrival order, until
    the batch holds n_batch tokens. A long prompt is read a chunk a step, so it holds
    the others up by one chunk at a time, never by all of it. Each sequence whose
    last token the step carried gets its next token from its own sampler chain. The
    batch lists the sequences in slot order: llama.cpp computes each run of
    consecutive slots in one pass over the weights, so slots 0, 1, 2 generating cost
    one pass and slots 0 and 2 two (a free slot between them splits the run).
  * The prompt cache: a slot keeps the tokens of its last sequence (their KV) after
    it ends. A new sequence takes the free slot sharing the longest prefix with its
    prompt, as llama.cpp's server does (cache_prompt), and reads only the rest; it
    counts as `cached`. Only a slot whose cache the prompt continues for at least
    half, or whose cache holds at least half the prompt, is chosen that way;
    otherwise the least recently used slot is, so other conversations keep theirs.
    With caching off, every prompt is read whole.
  * The prompt cache in RAM (localrt.engines.llama.promptcache), when the engine can save
    and restore a sequence's state: a slot about to lose cached tokens to a new
    prompt is saved there first, and a prompt that shares more with a saved state
    than with any free slot has it restored into its slot; `cached` counts those too.
  * Log-probabilities (localrt.engines.logprobs), only for a sequence that asks: each token it
    samples is scored from its row of logits before its sampler chain sees them, and
    with `prompt_logprobs` (a completion's echo) so is every prompt token, which takes
    logits for each: such a prompt is read whole (its cached prefix has no logits
    left), SCORED_CHUNK tokens a step. The other sequences of the batch pay nothing.
  * Images (localrt.engines.llama.media): a prompt item is a text token or one position of
    an image. A prompt is read as text up to its next image; that image is one step's
    work for its sequence (the engine's encode and decode of its embeddings, after the
    step's text, the text before it among them), at most one image a step, beside the
    text the other sequences decode in the same step, so an image holds the others up
    by one image's time at most. A cached prefix never ends inside an image
    (vision.whole_images).
  * Speculation (localrt.engines.llama.drafting): a generating sequence with a Drafter feeds
    its next token and a draft of the tokens that may follow it, all in the same
    decode; the engine samples each position in turn from the sequence's own sampler
    and keeps the draft as far as it agrees, so one step may give several tokens. The
    rejected draft tokens' KV is cut off at once. Drafts come after every sequence's
    next token in the batch's room, before prompt chunks.
  * Thinking (localrt.engines.reasoning): a reasoning reply's sequence has a Tracker,
    which each of its tokens passes through as the step records it. At its budget the
    tracker gives the end-of-thinking marker's tokens: they go to the reply as if the
    model wrote them, into its sampler chain, and into the next step's decode after the
    sampled token, and the model answers from there. A sequence whose answer a grammar
    constrains (a JSON schema, a forced call) thinks freely: its sampler chain is
    swapped for the grammar's where its answer starts (before its thinking, the engine
    samples the answer's first token with the grammar's chain and swaps there itself:
    localrt.engines.llama.decode). Such a sequence drafts only once
    its answer has started (the swap's token is unknown before); one with a budget
    drafts no further than its tracker surely stays quiet (Tracker.quiet), so the
    tokens the tracker acts on are never draft tokens whose KV was kept.
  * LoRA adapters (localrt.engines.llama.adapters): a sequence's `adapters` are the
    (id, scale) pairs it decodes with, and the context applies one such set at a
    time, so a step carries only the sequences of one set; when several sets have
    work, the steps take them in turn (the one after the last step's, in arrival
    order). A slot's cache, and a state in the RAM cache, serve only a prompt of the
    set they were computed with.
  * A sequence ends at an end-of-generation token or max_tokens. One that is left
    (`leave`: its reply is done, or its client hung up) frees its slot at the end of
    the step under way, or at once when none is.

Who calls step(), and when, is localrt.inference.lanes' business (`Stepper`): one step
at a time, on a compute lane, when a generation needs its next token. What a step
computes on llama.cpp is localrt.engines.llama.decode's.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

from localrt.engines.logprobs import certain
from localrt.engines.llama.promptcache import PromptCache, common_prefix
from localrt.engines.llama.media import image_item, whole_images

log = logging.getLogger(__name__)

REUSE_AT_LEAST = 0.5  # how much of a slot's cache, or of the prompt, must be shared
SCORED_CHUNK = 64  # the most prompt tokens a step reads of a prompt whose logprobs are asked


class Sequence:
    """One generation's place in the batch: its prompt, where it stands, its new tokens.

    The Batcher's lock guards everything but `prompt`, `max_tokens` and `sampler`.
    """

    def __init__(self, prompt: list, max_tokens: int, sampler=None,
                 top_logprobs: int | None = None, prompt_logprobs: bool = False,
                 images: dict | None = None, drafter=None, adapters: tuple = (),
                 thinking=None, after_thinking=None):
        self.prompt = prompt  # text tokens, and ("image", digest, k) per image position
        self.images = images or {}  # the engine's chunk of each image, by its first index
        self.drafter = drafter  # drafting.Drafter, when this sequence speculates
        self.adapters = adapters  # the (id, scale) LoRA adapters it decodes with
        self.max_tokens = max_tokens
        self.sampler = sampler  # the engine's, handed to its decode(); freed by release()
        # A reasoning reply's reasoning.Tracker (None: none), and the sampler chain that
        # takes over where its answer starts (a grammar's; None: the same chain goes on).
        self.thinking = thinking
        self.after_thinking = after_thinking
        self.forced: list = []  # tokens localrt writes itself, fed after `next`
        # Log-probabilities (localrt.engines.logprobs), for a request that asks: each sampled
        # token's, with this many alternatives (None: none computed), and with
        # prompt_logprobs the prompt's too, which is then read whole (no cached
        # prefix: its logits are gone). The engine's decode() appends a TokenLogprob to
        # `scores` before its token goes to `ready`, and the prompt's, from its second
        # token on, to `prompt_scores` as it reads them.
        self.top_logprobs = top_logprobs
        self.prompt_logprobs = prompt_logprobs
        self.scores: collections.deque = collections.deque()
        self.prompt_scores: list = []
        self.slot: Slot | None = None
        self.cached = 0  # prompt tokens found in the slot's cache
        self.read = 0  # prompt tokens in the KV cache, the cached ones included
        self.next: int | None = None  # the last sampled token: the next step feeds it
        self.generated = 0
        self.ready: collections.deque = collections.deque()  # sampled, not taken yet
        self.ended = False  # no token will come any more
        self.left = False
        self.error: Exception | None = None


@dataclass
class Slot:
    """A sequence id of the context, and the tokens its KV cache holds."""

    id: int
    tokens: list = field(default_factory=list)
    seq: Sequence | None = None
    used: int = 0  # when its last sequence left (a step count): least recently used first
    prompt: int = 0  # the prompt positions of its sequence, or of its last one (GET /slots)
    adapters: tuple = ()  # the LoRA adapters its KV was computed with


@dataclass
class Entry:
    """What one step computes for one sequence: `tokens` from position `pos` of its
    slot (a prompt chunk when `reading`), and (`sample`) the token after the last."""

    seq: Sequence
    slot: int
    tokens: list
    pos: int
    sample: bool
    reading: bool
    image: object = None  # the engine's image chunk, when the entry is an image
    draft: int = 0  # how many of `tokens`, at the end, are a draft to verify
    failed: Exception | None = None  # the engine could not evaluate this entry


class Batcher:
    """The slots of one batched model, and what each step computes.

    `engine` has trim(slot, keep) (drop a slot's KV from position `keep` on; false
    when it cannot, which never happens for keep 0),
    decode(entries) -> for each entry with `sample`, in order, its sampled tokens (a
    list: one, or with a draft those the samples kept and one more; a lone int is
    taken as one), is_end(token) and release(sequence) (free what the engine made for
    it), accept(sequence, tokens) (tokens written for it, into its sampler chain) and
    constrain(sequence) (its after_thinking chain takes over); with an image entry, decode marks it `failed` when it cannot evaluate it.
    `_lock` guards the slots, `_waiting`, `_active` and the sequences' state;
    `_stepping` lets one step run at a time and is held while it decodes.
    """

    def __init__(self, slots: int, n_batch: int, engine, caching: bool = True,
                 cache: PromptCache | None = None):
        self.slots = [Slot(i) for i in range(slots)]
        self.n_batch = max(n_batch, slots)  # room for every sequence's next token
        self.caching = caching
        # The RAM cache: the engine then also has save(slot) -> (data, size) and
        # restore(slot, data, size) -> bool.
        self.cache = cache if caching else None
        self.prompt_read = 0  # prompt tokens decoded, all sequences together
        self.decodes = 0  # steps that decoded something
        self.drafted = self.accepted = 0  # draft tokens proposed, and of those accepted
        self._engine = engine
        self._lock = threading.Lock()
        self._stepping = threading.Lock()
        self._waiting: collections.deque = collections.deque()  # joined, no slot yet
        self._active: list[Sequence] = []  # in a slot, in the order they took it
        self._in_flight: set = set()  # the sequences the decode under way carries
        self._clock = itertools.count(1)
        self._adapters: tuple = ()  # the adapter set the last step carried

    # --- the generations' side ------------------------------------------------------

    def join(self, seq: Sequence) -> None:
        """Queue a sequence: it takes a slot at the next step."""
        with self._lock:
            self._waiting.append(seq)

    def tokens(self, seq: Sequence, wait: Callable[[], None]) -> Iterator[int]:
        """The sequence's tokens as steps make them; `wait()` while the next is not made."""
        while True:
            with self._lock:
                if seq.ready:
                    token = seq.ready.popleft()
                elif seq.error is not None:
                    raise seq.error
                elif seq.ended:
                    return
                else:
                    token = None
            if token is None:
                wait()
            else:
                yield token

    def leave(self, seq: Sequence) -> None:
        """The sequence is done with: its slot is free after the step under way."""
        with self._lock:
            if seq.left:
                return
            seq.left = seq.ended = True
            if seq in self._waiting:
                self._waiting.remove(seq)
            if seq.slot is None:  # never had one
                self._engine.release(seq)
            elif seq not in self._in_flight:
                self._free(seq)

    # --- the step ---------------------------------------------------------------------

    def step(self) -> None:
        """One decode for every sequence that has something to compute."""
        with self._stepping:
            with self._lock:
                self._admit()
                plan = self._plan()
                self._in_flight = {e.seq for e in plan}
            try:
                sampled = self._engine.decode(plan) if plan else []
                self.decodes += bool(plan)
            except Exception as exc:
                log.exception("a decode step failed")
                with self._lock:
                    self._fail(plan, exc)
                return
            with self._lock:
                self._record(plan, sampled)

    def stepping(self):
        """Hold this while the engine frees what steps use."""
        return self._stepping

    def slot_states(self) -> list[dict]:
        """Each slot's state as GET /slots gives it (contract.Slotted): whether a
        sequence holds it, its (last) sequence's prompt positions, and the tokens its
        KV cache holds."""
        with self._lock:
            return [{"processing": slot.seq is not None, "prompt_tokens": slot.prompt,
                     "cached_tokens": len(slot.tokens)} for slot in self.slots]

    def _admit(self) -> None:
        """Waiting sequences into free slots, in arrival order; each slot's KV is cut
        to what its new sequence reuses."""
        while self._waiting:
            free = [s for s in self.slots if s.seq is None]
            if not free:
                break
            seq = self._waiting.popleft()
            slot, keep = self._choose(free, seq)
            if self.cache is not None:
                keep = self._through_cache(slot, keep, seq)
            keep = min(keep, len(seq.prompt) - 1)  # the last prompt token gives the logits
            keep = whole_images(seq.prompt, keep)
            if seq.prompt_logprobs:  # every prompt token's logits are needed
                keep = 0
            if not self._engine.trim(slot.id, keep):  # a model that cannot cut (recurrent)
                keep = 0
                self._engine.trim(slot.id, 0)
            slot.seq, slot.tokens, slot.prompt = seq, slot.tokens[:keep], len(seq.prompt)
            slot.adapters = seq.adapters
            seq.slot, seq.cached, seq.read = slot, keep, keep
            self._active.append(seq)

    def _through_cache(self, slot: Slot, keep: int, seq: Sequence) -> int:
        """Save what the slot would lose; restore a saved state that serves the
        sequence's prompt better than the slot does. How many of the slot's tokens the
        prompt reuses."""
        cache, prompt = self.cache, seq.prompt
        state, shared = cache.find(prompt, seq.adapters)
        shared = whole_images(prompt, min(shared, len(prompt) - 1))
        if state is not None and shared > keep:
            self._save(slot)
            if self._engine.restore(slot.id, state.data, state.size):
                slot.tokens = list(state.tokens)
                cache.used(state, shared)
                return shared
            slot.tokens = []  # what the KV holds now is unknown; it is read afresh
            return 0
        if keep < len(slot.tokens):
            self._save(slot)
        return keep

    def _save(self, slot: Slot) -> None:
        if self.cache.wants(slot.tokens, slot.adapters):
            data, size = self._engine.save(slot.id)
            if size:
                self.cache.put(slot.tokens, data, size, slot.adapters)

    def _choose(self, free: list[Slot], seq: Sequence) -> tuple[Slot, int]:
        """The slot for a sequence's prompt, and how many of its cached tokens the
        prompt reuses (none of a cache computed with other LoRA adapters)."""
        oldest = min(free, key=lambda s: s.used)
        if not self.caching:
            return oldest, 0
        prompt = seq.prompt
        shared = {s.id: common_prefix(s.tokens, prompt) if s.adapters == seq.adapters else 0
                  for s in free}
        # A slot the prompt continues (most of its cache is reused), or one whose cache
        # is most of the prompt (a long shared system prompt, a turn whose reply the
        # template rewrote): else the least recently used, so conversations keep theirs.
        fits = [s for s in free if shared[s.id] >= REUSE_AT_LEAST * len(s.tokens)
                or shared[s.id] >= REUSE_AT_LEAST * len(prompt)]
        best = max(fits, key=lambda s: (shared[s.id], -s.used), default=oldest)
        return best, shared[best.id]

    def _turn(self) -> tuple:
        """The LoRA adapter set this step carries: of the sets of the sequences with
        something to compute, in arrival order, the one after the last step's."""
        sets: list[tuple] = []
        for seq in self._active:
            if not seq.ended and (seq.next is not None or seq.read < len(seq.prompt)) \
                    and seq.adapters not in sets:
                sets.append(seq.adapters)
        if len(sets) <= 1:
            return sets[0] if sets else ()
        if self._adapters in sets:
            return sets[(sets.index(self._adapters) + 1) % len(sets)]
        return sets[0]

    def _plan(self) -> list[Entry]:
        """This step's entries: each generating sequence's token, then prompt chunks,
        of the sequences whose adapter set is this step's."""
        self._adapters = turn = self._turn()
        active = [seq for seq in self._active if seq.adapters == turn]
        generating = [seq for seq in active if seq.next is not None and not seq.ended]
        room = self.n_batch - len(generating)
        plan = []
        for seq in generating:
            draft = []
            if seq.drafter is not None and room > 0 and not seq.forced:
                # no more than it may still say: its KV stays inside its context
                draft = seq.drafter.propose(min(room, seq.max_tokens - seq.generated - 1,
                                                _draft_limit(seq)))
                room -= len(draft)
            # Tokens localrt writes go in as the batch has room; the sequence samples
            # again once the last of them is in.
            written = seq.forced[:max(room, 0)]
            room -= len(written)
            plan.append(Entry(seq, seq.slot.id, [seq.next, *written] + draft,
                              len(seq.slot.tokens), len(written) == len(seq.forced), False,
                              draft=len(draft)))
        reach = {}  # where each sequence's KV will end after this step's text
        for seq in active:
            if room <= 0:
                break
            if seq.ended or seq.read >= len(seq.prompt) or seq.read in seq.images:
                continue
            # A prompt scored token by token outputs logits for each: a short chunk
            # keeps llama.cpp's output buffer (tokens x vocabulary floats) small.
            most = min(room, SCORED_CHUNK) if seq.prompt_logprobs else room
            end = min(seq.read + most, _next_image(seq))
            chunk = seq.prompt[seq.read:end]
            last = end == len(seq.prompt)
            plan.append(Entry(seq, seq.slot.id, chunk, len(seq.slot.tokens), last, True))
            reach[seq] = end
            room -= len(chunk)
        # One image a step, the first waiting in arrival order: one whose text before it
        # this step reads comes right after that text (the engine decodes text first).
        for seq in active:
            start = reach.get(seq, seq.read)
            if not seq.ended and start in seq.images:
                end = _next_text(seq.prompt, start)
                pos = len(seq.slot.tokens) + start - seq.read
                plan.append(Entry(seq, seq.slot.id, seq.prompt[start:end], pos, False, True,
                                  image=seq.images[start]))
                break
        # In slot order: llama.cpp splits a batch of sequences with KV of their own into
        # one pass per run of consecutive sequence ids, and each pass reads all weights.
        plan.sort(key=lambda e: e.slot)
        return plan

    def _record(self, plan: list[Entry], sampled: list[int]) -> None:
        """What a decode did: the slots' caches grow, sampled tokens go to their sequences."""
        results = iter(sampled)
        for entry in plan:
            seq = entry.seq
            if entry.failed is not None:  # its image: the others' step went on
                seq.slot.tokens = []  # what its KV holds now is unknown
                seq.error, seq.ended, seq.next = entry.failed, True, None
                continue
            got = []
            if entry.sample:
                got = next(results)
                got = got if isinstance(got, list) else [got]
            kept = entry.tokens
            if entry.draft:  # its next token and the draft tokens the samples agreed with
                accepted = len(got) - 1
                kept = entry.tokens[:1 + accepted]
                self.drafted += entry.draft
                self.accepted += accepted
                seq.drafter.settle(entry.draft, accepted)
            seq.slot.tokens.extend(kept)
            if len(kept) < len(entry.tokens):  # the rejected draft's KV goes
                self._engine.trim(seq.slot.id, len(seq.slot.tokens))
            if entry.reading:
                seq.read += len(entry.tokens)
                self.prompt_read += len(entry.tokens)
            else:  # what of its token and the tokens localrt writes is still to feed
                left = [seq.next, *seq.forced][len(kept):] if not entry.draft else []
                seq.next, seq.forced = (left[0], left[1:]) if left else (None, [])
            if seq.left:
                continue
            for token in got:
                seq.ready.append(token)
                seq.generated += 1
                if seq.drafter is not None:
                    seq.drafter.extend((token,))
                if self._engine.is_end(token):
                    seq.ended = True
                    break
                if seq.thinking is not None and self._think(seq, token):
                    break
                if seq.generated >= seq.max_tokens:
                    seq.ended = True
                    break
            else:
                if got:
                    seq.next = got[-1]
        self._in_flight = set()
        for seq in [s for s in self._active if s.left]:
            self._free(seq)

    def _think(self, seq: Sequence, token: int) -> bool:
        """Follow a token of a reasoning reply (see the module docstring); True when
        localrt writes the end of its thinking after it."""
        forced = seq.thinking.step(token)
        if forced and seq.generated < seq.max_tokens:
            seq.thinking.forced(forced)
            self._engine.accept(seq, forced)
            seq.next, seq.forced = token, list(forced)
            for written in forced:
                if seq.top_logprobs is not None:  # localrt's own: certain
                    seq.scores.append(certain(written, seq.top_logprobs))
                seq.ready.append(written)
                seq.generated += 1
                if seq.generated >= seq.max_tokens:
                    seq.ended = True
                    break
        else:
            forced = []
        if seq.thinking.answering and seq.after_thinking is not None:
            self._engine.constrain(seq)
        return bool(forced)

    def _fail(self, plan: list[Entry], exc: Exception) -> None:
        """A decode failed: its sequences end with the error, their slots forget their KV."""
        for entry in plan:
            seq = entry.seq
            seq.slot.tokens = []  # what the KV holds now is unknown; read it afresh
            seq.error, seq.ended, seq.next = exc, True, None
        self._in_flight = set()
        for seq in [s for s in self._active if s.left]:
            self._free(seq)

    def _free(self, seq: Sequence) -> None:
        slot = seq.slot
        slot.seq, slot.used = None, next(self._clock)
        self._active.remove(seq)
        self._engine.release(seq)

    def close(self) -> None:
        """Release every sequence and drop the RAM cache (the model is unloading)."""
        with self._lock:
            if self.cache is not None:
                self.cache.clear()
            for seq in list(self._waiting) + list(self._active):
                self._engine.release(seq)
            self._waiting.clear()
            self._active.clear()


def _draft_limit(seq: Sequence) -> int:
    """The most draft tokens a thinking sequence may verify this step (see the module
    docstring): none while a grammar waits for its answer, what its tracker surely
    follows quietly under a budget; no bound otherwise."""
    unbounded = 1 << 30
    thinking = seq.thinking
    if thinking is None or thinking.answering:
        return unbounded
    if seq.after_thinking is not None:
        return 0
    quiet = thinking.quiet()
    return unbounded if quiet is None else quiet


def _next_image(seq: Sequence) -> int:
    """The index of the sequence's next image after what it has read, or the prompt's end."""
    return min((i for i in seq.images if i > seq.read), default=len(seq.prompt))


def _next_text(prompt: list, start: int) -> int:
    """The index after the image that starts at `start`."""
    end = start + 1
    while end < len(prompt) and image_item(prompt[end]) is not None and prompt[end][2] > 0:
        end += 1
    return end
