"""Speculative decoding's drafts, from the context itself (n-gram lookup).

Agents copy long runs of their prompt into their replies: an edit, a quote, a JSON
rewrite. A `Drafter` watches one sequence's tokens (its prompt, then what it
generates) and, when the last few tokens appeared before, proposes the tokens that
followed them then. localrt.engines.llama.batch verifies a draft in the same decode as
the other sequences' tokens: the model's own sampler picks each position's token from
the target's distribution, and the draft's tokens count only as long as they agree,
so a reply is the one it would be without drafting (the same tokens, greedy or
seeded), only sooner. On a CPU that is nearly free: decode is bound by reading the
weights, which one pass does for all the draft's tokens.

A draft that keeps failing costs compute for nothing, so each Drafter sizes its next
draft by how its last one did (`settle`): it doubles after a draft accepted whole,
is about twice the tokens kept after one accepted in part, halves after one that
missed at once, and rests for a while when the size falls to nothing. A request's
`prediction` (OpenAI's predicted output: the text an editor expects back) is looked up
like the context, before it; its usage counts are OpenAI's (`prediction_counts`).
"""

from __future__ import annotations

from collections import Counter

DRAFT_MAX = 16  # the most tokens a draft proposes
NGRAM = (4, 3, 2)  # the lookup's n-gram lengths, the longest tried first
REST = 16  # steps a drafter that fell to nothing waits before it tries again
START = 4  # a new drafter's first draft size


class Drafter:
    """One sequence's n-gram index and its draft size.

    `tokens` holds the sequence so far (prompt text tokens, then generated ones);
    `_seen[n][gram]` is the index just after gram's latest occurrence before the end.
    """

    def __init__(self, prompt: list, prediction: list | None = None,
                 draft_max: int = DRAFT_MAX):
        self.draft_max = draft_max
        self.size = min(START, draft_max)
        self.rest = 0
        self.drafted = self.accepted = 0  # tokens proposed, and of those accepted
        self.tokens: list[int] = []
        self._seen: dict[int, dict[tuple, int]] = {n: {} for n in NGRAM}
        # The prediction: where each of its n-grams occurs (the index after it), and
        # how far the reply has followed it, so a repeated phrase continues in order.
        self._prediction = list(prediction or [])
        self._predicted: dict[int, dict[tuple, list]] = {n: {} for n in NGRAM}
        for i in range(len(self._prediction)):
            for n in NGRAM:
                if i + 1 >= n:
                    gram = tuple(self._prediction[i + 1 - n:i + 1])
                    self._predicted[n].setdefault(gram, []).append(i + 1)
        self._followed = 0
        self._pending = None  # where in the prediction the draft under way came from
        self.extend(t for t in prompt if isinstance(t, int))

    def extend(self, tokens) -> None:
        """Tokens the sequence now holds, in order."""
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in NGRAM:
                if end > n:  # index the n-gram ending just before this token
                    self._seen[n][tuple(self.tokens[end - 1 - n:end - 1])] = end - 1

    def propose(self, limit: int) -> list[int]:
        """Up to min(limit, the current size) tokens that may come next; [] for none."""
        if self.rest:
            self.rest -= 1
            return []
        want = min(limit, self.size)
        if want <= 0:
            return []
        for n in NGRAM:
            if len(self.tokens) < n:
                continue
            gram = tuple(self.tokens[-n:])
            # The prediction first: it is the text expected back.
            places = self._predicted[n].get(gram, ())
            at = next((i for i in places if i >= self._followed), None)
            if at is None and places:
                at = places[0]
            if at is not None and at < len(self._prediction):
                self._pending = at
                return self._prediction[at:at + want]
            at = self._seen[n].get(gram)
            if at is not None:
                return self.tokens[at:at + want]
        return []

    def settle(self, proposed: int, accepted: int) -> None:
        """How a draft of `proposed` tokens did: the next one's size follows."""
        self.drafted += proposed
        self.accepted += accepted
        if self._pending is not None:
            self._followed, self._pending = self._pending + accepted, None
        if accepted == proposed:
            self.size = min(self.size * 2, self.draft_max)
        elif accepted:  # about twice what it kept: the text it copies may end soon
            self.size = min(2 * accepted + 2, self.draft_max)
        else:
            self.size //= 2
            if self.size == 0:
                self.size, self.rest = 1, REST


def prediction_counts(prediction: list, completion: list) -> tuple[int, int]:
    """OpenAI's accepted and rejected prediction tokens: the prediction's tokens that
    appear in the completion (each at most as often as the completion holds it), and
    the rest of them, whether or not any draft proposed them."""
    shared = sum((Counter(prediction) & Counter(completion)).values())
    return shared, len(prediction) - shared
