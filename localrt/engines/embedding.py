"""gguf-cpp's embedding mode: a GGUF loaded in llama.cpp's embedding mode gives vectors.

gguf-cpp (localrt.engines.llama.GgufEngine) loads a model this way (`LlamaEmbedder`)
when it is started with the start option `embedding`, or when its GGUF is an
embedding model (it declares a pooling type, or non-causal attention); see
`embedding_pooling`. Such a model is localrt.engines.contract's Embedding: it answers
POST /v1/embeddings (localrt.inference.embeddings), and its generate() is a 409.
llama_cpp is imported only when a model loads.
"""

from __future__ import annotations

from localrt.engines.generation import GeneratingModel, Generation
from localrt.errors import Conflict, InvalidField


class EmbeddingModel(Conflict):
    """A model in embedding mode was asked for text."""

    code = "embedding_model"


def embedding_pooling(model_path: str, options: dict) -> int | None:
    """How a GGUF loads: None to generate text, else in llama.cpp's embedding mode with
    this pooling type.

    An embedding model's GGUF says how it pools (`<arch>.pooling_type`: mean, cls, last,
    rank) or has non-causal attention (an encoder, such as BERT); it always loads in
    embedding mode and pools its own way (LLAMA_POOLING_TYPE_UNSPECIFIED lets llama.cpp
    read it). Any other model loads so only with the start option `embedding`, pooled by
    the mean of its tokens, as llama.cpp's server pools a decoder.
    """
    import llama_cpp

    from localrt.engines import ggufinfo

    try:
        meta = ggufinfo.read_metadata(model_path)
    except (OSError, ggufinfo.GGUFError):
        meta = {}  # llama.cpp says what is wrong with the file when it loads it
    arch = meta.get("general.architecture", "")
    pooling = meta.get(f"{arch}.pooling_type")
    if isinstance(pooling, int) and pooling > llama_cpp.LLAMA_POOLING_TYPE_NONE:
        return llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED
    if meta.get(f"{arch}.attention.causal") is False or options.get("embedding"):
        return llama_cpp.LLAMA_POOLING_TYPE_MEAN
    return None


class LlamaEmbedder(GeneratingModel):
    """A GGUF model in llama.cpp's embedding mode: vectors, never text.

    Inputs are read as sequences of one batch, as many as fit in the context
    (n_batch = n_ubatch = ctx_len: an encoder must read a whole sequence in one ubatch,
    and pooled sequences never span two), so 64 short texts take one decode.
    """

    def __init__(self, llm, context: int):
        import llama_cpp

        self.llm = llm
        self._llama_cpp = llama_cpp
        self.context = min(context, llm.n_ctx(), llm.n_batch)

    @classmethod
    def open(cls, model_path: str, arguments: dict, context: int | None,
             pooling: int) -> "LlamaEmbedder":
        """Load a GGUF in embedding mode: llama_cpp.Llama with `arguments` (the start
        options', localrt.engines.llama.llama_arguments), one batch of `context` tokens
        (ctx_len; 512 when None) and the pooling type `pooling`."""
        import llama_cpp

        context = context or 512
        llm = llama_cpp.Llama(model_path=model_path, verbose=False, embedding=True,
                              pooling_type=pooling, **{**arguments, "n_ctx": context,
                                                       "n_batch": context,
                                                       "n_ubatch": context})
        if llm.pooling_type() == llama_cpp.LLAMA_POOLING_TYPE_RANK:
            llm.close()
            raise InvalidField("Invalid field 'model': the model is a reranker (pooling "
                               "rank): it scores pairs of texts and gives no embeddings",
                               param="model")
        return cls(llm, context)

    def generate(self, messages: list, params: dict) -> Generation:
        """A 409: a model in embedding mode makes no text."""
        raise EmbeddingModel("The model runs in llama.cpp's embedding mode (an embedding "
                             "model, or one started with embedding: true): it answers "
                             "POST /v1/embeddings, not chats or completions; stop it to "
                             "chat with a model that can", param="model")

    def embed(self, inputs: list) -> tuple:
        """One vector per input (an array of n_embd floats, as the model pools them) and
        the tokens read; a 400 naming `input` for an empty one, one longer than the
        context, or a token not in the vocabulary."""
        import numpy as np

        llama_cpp, llm = self._llama_cpp, self.llm
        lists = [self._tokens(i, item) for i, item in enumerate(inputs)]
        n_embd, ctx, batch = llm.n_embd(), llm._ctx, llm._batch
        most = llm.context_params.n_seq_max  # sequences in one batch
        out = np.empty((len(lists), n_embd), dtype=np.float32)
        rows: list[int] = []
        used = 0

        def decode() -> None:
            ctx.kv_cache_clear()
            ctx.decode(batch)
            for seq, row in enumerate(rows):
                vector = llama_cpp.llama_get_embeddings_seq(ctx.ctx, seq)
                out[row] = np.ctypeslib.as_array(vector, shape=(n_embd,))
            batch.reset()

        batch.reset()
        try:
            for row, tokens in enumerate(lists):
                if rows and (used + len(tokens) > self.context or len(rows) >= most):
                    decode()
                    rows, used = [], 0
                batch.add_sequence(tokens, len(rows), True)
                rows.append(row)
                used += len(tokens)
            if rows:
                decode()
        finally:
            batch.reset()
            ctx.kv_cache_clear()
        return out, sum(map(len, lists))

    def _tokens(self, index: int, item) -> list[int]:
        """An input's tokens: a text's as llama.cpp's embed() makes them (with the
        model's BOS, or BERT's CLS and SEP), a token list as it is."""
        llm, field = self.llm, f"input[{index}]"
        if isinstance(item, str):
            tokens = llm.tokenize(item.encode("utf-8"), add_bos=True, special=False)
        else:
            tokens = list(item)
            n_vocab = llm.n_vocab()
            bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
            if bad is not None:
                raise InvalidField(f"Invalid field 'input': {field} holds token {bad}, not "
                                   f"in the model's vocabulary of {n_vocab}", param="input")
        if not tokens:
            raise InvalidField(f"Invalid field 'input': {field} is empty", param="input")
        if len(tokens) > self.context:
            raise InvalidField(f"Invalid field 'input': {field} is {len(tokens)} tokens and "
                               f"the model's context (ctx_len) holds {self.context}; "
                               f"shorten it or start the model with a larger ctx_len",
                               param="input")
        return tokens

    def memory(self) -> dict:
        """RAM and VRAM from llama.cpp: the weights (split by offloaded layers) and the
        context."""
        llama_cpp, llm = self._llama_cpp, self.llm
        weights = llama_cpp.llama_model_size(llm.model)
        context = llama_cpp.llama_state_get_size(llm.ctx)
        layers = llama_cpp.llama_model_n_layer(llm.model)
        offloaded = 0
        if llama_cpp.llama_supports_gpu_offload():
            ngl = llm.model_params.n_gpu_layers
            offloaded = layers + 1 if ngl < 0 else min(ngl, layers + 1)
        vram = weights * offloaded // (layers + 1) + (context if offloaded else 0)
        return {"ram": weights + context - vram, "vram": vram}

    def unload(self) -> None:
        """Free the model and its context."""
        self.llm.close()
