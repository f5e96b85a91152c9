"""gguf-cpp's reranking: each document scored against a query by a reranker GGUF.

A GGUF whose header pools by rank (`<arch>.pooling_type` 4, llama.cpp's
LLAMA_POOLING_TYPE_RANK: bge-reranker, jina-reranker, Qwen3-Reranker) loads in
llama.cpp's embedding mode as a `LlamaReranker` (localrt.engines.llama.model's
GgufEngine.load picks it by localrt.engines.llama.embedding.embedding_pooling): it
answers POST /v1/rerank
(localrt.inference.rerank); its generate() is a 409 and it gives no embeddings.

Each document is read together with the query, as llama.cpp's server pairs them
(`LlamaReranker.pair`): through the model's rerank template (its GGUF's
`tokenizer.chat_template.rerank`, with {query} and {document} replaced, special tokens
read as such) when it has one, else as BOS query EOS SEP document EOS, each special
token only where the vocabulary adds it (EOS is SEP for a vocabulary without one). A
pair pools to the model's classifier outputs (its `cls.output`); the first is the
score, raw, as llama.cpp's server gives it. The pairs are decoded by the embedding
mode's Embedder, as many in one decode as fit, each decode a job on the compute lane.
llama_cpp is imported only when a model loads.
"""

from __future__ import annotations

from typing import Callable

from localrt.engines.generation import Generation
from localrt.engines.llama.embedding import EmbeddingMode, EmbeddingModel
from localrt.engines.llama.measure import Measure
from localrt.errors import InvalidField

LLAMA_TOKEN_NULL = -1  # llama.h's "no such token" (a vocabulary without EOS, say)
ADVICE = "shorten it or start the model with a larger ctx_len"


class LlamaReranker(EmbeddingMode):
    """A reranker GGUF in llama.cpp's embedding mode: a score for each document, never
    text nor embeddings."""

    def __init__(self, llm, context: int):
        super().__init__(llm, context)
        llama_cpp = self._llama_cpp
        template = llama_cpp.llama_model_chat_template(llm.model, b"rerank")
        self.template = template.decode("utf-8") if template else None
        self._measure = Measure(llama_cpp, llm._model.vocab)  # texts before tokenizing

    def generate(self, messages: list, params: dict) -> Generation:
        """A 409: a reranker makes no text."""
        raise EmbeddingModel("The model is a reranker (its GGUF pools by rank): it answers "
                             "POST /v1/rerank, not chats or completions; chat with a model "
                             "that can", param="model")

    def rerank(self, query: str, documents: list, compute: Callable | None = None) -> tuple:
        """(scores, tokens read): each document's score with the query, in order; a 400
        naming `documents` for a pair longer than the context. Each decode is
        `compute(fn, *args)` (the scheduler's compute lane; here when None)."""
        pairs = self.pairs(query, documents)
        scores, tokens = self._embedder.embed(pairs, compute)
        return [float(row[0]) for row in scores], tokens

    def pairs(self, query: str, documents: list) -> list[list[int]]:
        """Each document's tokens with the query's, as llama.cpp's server pairs them (see
        the module), each checked against the context."""
        if self.template is not None:
            return [self._checked(i, self._templated(query, doc))
                    for i, doc in enumerate(documents)]
        ll, model = self._llama_cpp, self.llm._model
        vocab = model.vocab
        self._measure.check(len(query.encode("utf-8")), self.context, "query", "the query",
                            ADVICE, whole=True)
        query_tokens = model.tokenize(query.encode("utf-8"), add_bos=False, special=False)
        eos = ll.llama_vocab_eos(vocab)
        if eos == LLAMA_TOKEN_NULL:
            eos = ll.llama_vocab_sep(vocab)
        bos = [ll.llama_vocab_bos(vocab)] if ll.llama_vocab_get_add_bos(vocab) else []
        end = [eos] if ll.llama_vocab_get_add_eos(vocab) else []
        sep = [ll.llama_vocab_sep(vocab)] if ll.llama_vocab_get_add_sep(vocab) else []
        pairs = []
        for i, doc in enumerate(documents):
            data = doc.encode("utf-8")
            self._measure.check(len(data), self.context, "documents", f"documents[{i}]",
                                ADVICE, whole=True)
            doc_tokens = model.tokenize(data, add_bos=False, special=False)
            pairs.append(self._checked(i, bos + query_tokens + end + sep + doc_tokens + end))
        return pairs

    def _templated(self, query: str, doc: str) -> list[int]:
        """The rerank template's tokens with this query and document, as llama.cpp's
        server replaces them (every {query}, then every {document})."""
        prompt = self.template.replace("{query}", query).replace("{document}", doc)
        data = prompt.encode("utf-8")
        self._measure.check(len(data), self.context, "documents",
                            "a document with the query in the model's rerank template",
                            ADVICE, whole=True)
        return self.llm._model.tokenize(data, add_bos=False, special=True)

    def _checked(self, index: int, tokens: list[int]) -> list[int]:
        """A pair's tokens, or a 400 naming `documents` when it is empty or longer than
        the context (a pooled sequence is read in one decode)."""
        if not tokens:
            raise InvalidField(f"Invalid field 'documents': documents[{index}] and the query "
                               f"are both empty", param="documents")
        if len(tokens) > self.context:
            raise InvalidField(f"Invalid field 'documents': documents[{index}] with the "
                               f"query is {len(tokens)} tokens and the model's context "
                               f"(ctx_len) holds {self.context}; {ADVICE}",
                               param="documents")
        return tokens
