"""A text measured before it is tokenized: no token of a vocabulary stands for more bytes
than its longest piece, so a text of more bytes than the context's tokens could hold
cannot fit, and is refused before llama.cpp reads it (a 10 MiB prompt was tokenized
whole, for 30 s and more, and then refused). Every text tokenized for a prompt is
measured first, so tokenizing is bounded by the context.

Only SentencePiece and byte-level BPE vocabularies are measured: their tokens give
back every byte of the text they were read from. WordPiece and Unigram tokenizers
drop and merge what they normalize (runs of spaces), so a long text may still be few
tokens there; their texts are tokenized as they come.
"""

from __future__ import annotations

import ctypes

from localrt.errors import InvalidField

PIECE_BUFFER = 256  # bytes: a longer piece says its length as a negative count


class Measure:
    """The most bytes one token of a model's vocabulary stands for (its longest piece,
    special tokens as their text), read at the first text long enough to need it: a
    vocabulary of 150,000 tokens takes a third of a second."""

    def __init__(self, llama_cpp, vocab):
        self._llama_cpp, self._vocab = llama_cpp, vocab
        kind = llama_cpp.llama_vocab_type(vocab)
        self.measured = kind in (llama_cpp.LLAMA_VOCAB_TYPE_SPM,
                                 llama_cpp.LLAMA_VOCAB_TYPE_BPE)
        self._longest: int | None = None

    def longest(self) -> int:
        """The bytes of the vocabulary's longest piece."""
        if self._longest is None:
            ll, vocab = self._llama_cpp, self._vocab
            buf, longest = ctypes.create_string_buffer(PIECE_BUFFER), 1
            for token in range(ll.llama_vocab_n_tokens(vocab)):
                n = ll.llama_token_to_piece(vocab, token, buf, PIECE_BUFFER, 0, True)
                longest = max(longest, abs(n))
            self._longest = longest
        return self._longest

    def check(self, size: int, context: int, field: str, what: str, advice: str,
              whole: bool = False) -> None:
        """A 400 naming `field` when a text of `size` bytes is at least `context` tokens
        (as check_room says of a prompt that fills the context; with `whole`, more than
        `context`, as an embedding's input may fill it), before it is tokenized. `what`
        names the text ("the prompt"); `advice` ends the message."""
        if size < context or not self.measured:
            return  # each token is one byte or more: it fits, or it is not measured
        longest = self.longest()
        least = -(-size // longest)
        if least > context or least == context and not whole:
            raise InvalidField(f"Invalid field '{field}': {what} is at least {least} tokens "
                               f"({size} bytes, and no token of the model's stands for more "
                               f"than {longest}) and the model's context (ctx_len) holds "
                               f"{context}; {advice}", param=field)

    def cut(self, data: bytes, context: int) -> bytes:
        """At most the bytes `context` tokens could stand for, whole characters: all of a
        text that may matter (a prediction's drafts)."""
        if len(data) < context or not self.measured:
            return data
        most = context * self.longest()
        return data if len(data) <= most else \
            data[:most].decode("utf-8", "ignore").encode("utf-8")


def token_piece(llama_cpp, vocab, token: int, special: bool) -> bytes:
    """The bytes a token stands for, a special token's as its text when `special` (as
    nothing else): llama_token_to_piece with a buffer as long as the piece needs."""
    size = 64
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, size, 0, special)
        if n >= 0:
            return buf.raw[:n]
        size = -n
