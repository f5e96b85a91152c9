"""gguf-cpp's embeddings: pooled vectors from llama.cpp's embedding mode.

A GGUF embedding model (it declares a pooling type, or non-causal attention; see
`embedding_pooling`), or any GGUF started with the start option `embedding`, loads in
llama.cpp's embedding mode (`LlamaEmbedder`): it answers POST /v1/embeddings
(localrt.inference.embeddings), and its generate() is a 409. One that pools by rank
(a reranker) loads so too, as localrt.engines.llama.rerank's LlamaReranker
(localrt.engines.llama.model's GgufEngine.load picks it by `embedding_pooling`), an
`EmbeddingMode` as LlamaEmbedder is. A decoder started without that option is a chat
model (localrt.engines.llama.model.LlamaModel) that embeds too, on a second context
of its own in embedding mode over the same weights (`EmbeddingContext`), made at its
first embeddings request. Both compute with one
`Embedder`, with the same context parameters (`embedding_params`), so a decoder's
vectors are the same in either mode. Both are localrt.engines.contract's Embedding.
llama_cpp is imported only when a model loads.
"""

from __future__ import annotations

import threading
from typing import Callable

from localrt.engines.generation import GeneratingModel, Generation
from localrt.engines.llama.measure import Measure, token_piece
from localrt.errors import Conflict, InvalidField


def _here(fn, *args):
    """Compute where called: embed()'s `compute` when no scheduler gives one."""
    return fn(*args)


class EmbeddingModel(Conflict):
    """A model in embedding mode was asked for text."""

    code = "embedding_model"


def embedding_pooling(model_path: str, options: dict) -> int | None:
    """How a GGUF loads: None to generate text, else in llama.cpp's embedding mode with
    this pooling type.

    An embedding model's GGUF says how it pools (`<arch>.pooling_type`: mean, cls, last,
    rank) or has non-causal attention (an encoder, such as BERT); it always loads in
    embedding mode and pools its own way (LLAMA_POOLING_TYPE_UNSPECIFIED lets llama.cpp
    read it; LLAMA_POOLING_TYPE_RANK, a reranker, loads as
    localrt.engines.llama.rerank.LlamaReranker). Any other model loads so only with the
    start option `embedding`, pooled by the mean of its tokens, as llama.cpp's server
    pools a decoder.
    """
    import llama_cpp

    from localrt.engines import ggufinfo

    try:
        meta = ggufinfo.read_metadata(model_path)
    except (OSError, ggufinfo.GGUFError):
        meta = {}  # llama.cpp says what is wrong with the file when it loads it
    if ggufinfo.is_rerank(meta):
        return llama_cpp.LLAMA_POOLING_TYPE_RANK
    if ggufinfo.declares_pooling(meta):
        return llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED
    if ggufinfo.is_embedding(meta) or options.get("embedding"):
        return llama_cpp.LLAMA_POOLING_TYPE_MEAN
    return None


class Embedder:
    """Pooled embeddings on one llama.cpp context in embedding mode, the embedding mode's
    (`LlamaEmbedder`) and a chat model's own (`EmbeddingContext`) alike, so both give
    the same vectors.

    Inputs are read as sequences of one decode (a pooled sequence never spans two
    ubatches, and an encoder must read a whole sequence at once: n_batch = n_ubatch =
    `context`), as many as fit in `budget` tokens and n_seq_max sequences, so 64 short
    texts take one decode. Each decode is one call of `compute` (embed()'s argument):
    the scheduler's compute lane, where a chat model's steps take turns with them.
    """

    def __init__(self, model, ctx, batch, context: int, budget: int):
        import llama_cpp

        self._llama_cpp = llama_cpp
        self.model, self.ctx, self.batch = model, ctx, batch  # llama_cpp._internals'
        self.context = context
        self.budget = min(budget, context)
        # The numbers a sequence pools to: n_embd, or a reranker's classifier outputs
        # (its scores), which is all llama.cpp keeps of a sequence pooled by rank.
        self.width = model.n_embd()
        if llama_cpp.llama_pooling_type(ctx.ctx) == llama_cpp.LLAMA_POOLING_TYPE_RANK:
            self.width = llama_cpp.llama_model_n_cls_out(model.model)
        self._measure = Measure(llama_cpp, model.vocab)  # inputs before tokenizing
        self._lock = threading.Lock()  # one decode at a time uses ctx and batch

    def embed(self, inputs: list, compute: Callable | None = None) -> tuple:
        """One vector per input (an array of `width` floats, as the model pools them) and
        the tokens read; a 400 naming `input` for an empty one, one longer than the
        context, or a token not in the vocabulary. Each decode is `compute(fn, *args)`
        (the scheduler's compute lane; here when None)."""
        import numpy as np

        compute = compute or _here
        lists = [self._tokens(i, item) for i, item in enumerate(inputs)]
        most = self.ctx.params.n_seq_max  # sequences in one decode
        groups: list[list[int]] = []
        used = 0
        for row, tokens in enumerate(lists):
            if not groups or used + len(tokens) > self.budget or len(groups[-1]) >= most:
                groups.append([])
                used = 0
            groups[-1].append(row)
            used += len(tokens)
        out = np.empty((len(lists), self.width), dtype=np.float32)
        for rows in groups:
            compute(self._decode, [lists[row] for row in rows], out[rows[0]:rows[-1] + 1])
        return out, sum(map(len, lists))

    def _decode(self, lists: list, out) -> None:
        """One decode of `lists` (sequences 0, 1, ...), their vectors into the rows of `out`."""
        import numpy as np

        llama_cpp, ctx, batch = self._llama_cpp, self.ctx, self.batch
        n_embd = out.shape[1]
        with self._lock:
            batch.reset()
            try:
                for seq, tokens in enumerate(lists):
                    batch.add_sequence(tokens, seq, True)
                ctx.kv_cache_clear()
                ctx.decode(batch)
                for seq in range(len(lists)):
                    vector = llama_cpp.llama_get_embeddings_seq(ctx.ctx, seq)
                    out[seq] = np.ctypeslib.as_array(vector, shape=(n_embd,))
            finally:
                batch.reset()
                ctx.kv_cache_clear()

    def _tokens(self, index: int, item) -> list[int]:
        """An input's tokens: a text's as llama.cpp's embed() makes them (with the
        model's BOS, or BERT's CLS and SEP), a token list as it is."""
        model, field = self.model, f"input[{index}]"
        if isinstance(item, str):
            data = item.encode("utf-8")
            self._measure.check(len(data), self.context, "input", field,
                                "shorten it or start the model with a larger ctx_len",
                                whole=True)
            tokens = model.tokenize(data, add_bos=True, special=False)
        else:
            tokens = list(item)
            n_vocab = model.n_vocab()
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


class EmbeddingMode(GeneratingModel):
    """A GGUF model loaded in llama.cpp's embedding mode (llama_cpp.Llama's context, read
    by an `Embedder`): what `LlamaEmbedder` and a reranker
    (localrt.engines.llama.rerank.LlamaReranker) share."""

    def __init__(self, llm, context: int):
        import llama_cpp

        self.llm = llm
        self._llama_cpp = llama_cpp
        context = min(context, llm.n_ctx(), llm.n_batch)
        self._embedder = Embedder(llm._model, llm._ctx, llm._batch, context, context)
        self.context = context
        self.placement = None  # where llama.cpp put its buffers, once `open` read its log

    @classmethod
    def open(cls, model_path: str, arguments: dict, context: int | None, pooling: int):
        """Load a GGUF in embedding mode: llama_cpp.Llama with `arguments` (the start
        options', localrt.engines.llama.params.llama_arguments), one batch of `context`
        tokens (ctx_len; 512 when None) and the pooling type `pooling`."""
        import llama_cpp

        from localrt.engines.llama import offload

        context = context or 512
        with offload.capture(llama_cpp) as logged:  # where llama.cpp put its buffers
            llm = llama_cpp.Llama(model_path=model_path, verbose=False, embedding=True,
                                  pooling_type=pooling, **{**arguments, "n_ctx": context,
                                                           "n_batch": context,
                                                           "n_ubatch": context})
        opened = cls(llm, context)
        opened.placement = offload.read(offload.text_of(logged))
        return opened

    # llama-server's utility routes (contract.Vocabulary), as LlamaModel's.

    @property
    def n_vocab(self) -> int:
        """The vocabulary's size: token ids are below it."""
        return self.llm.n_vocab()

    def encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """A text's tokens as llama-server's POST /tokenize gives them."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_special,
                                 special=parse_special)

    def piece(self, token: int) -> bytes:
        """A token's bytes, a special token's as its text."""
        return token_piece(self._llama_cpp, self.llm._model.vocab, token, True)

    def memory(self) -> dict:
        """RAM and VRAM as llama.cpp accounts them: the buffers it logged as it loaded
        the model and its context, on the host or on devices
        (localrt.engines.llama.offload); where it logged none, the weights (split by
        offloaded layers) and the context's state."""
        llama_cpp, llm = self._llama_cpp, self.llm
        placement = self.placement
        if placement is not None and placement.buffers:
            return {"ram": placement.host(), "vram": sum(placement.devices().values()),
                    "kv": placement.kv()}
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


class LlamaEmbedder(EmbeddingMode):
    """A GGUF model in llama.cpp's embedding mode: vectors, never text."""

    def generate(self, messages: list, params: dict) -> Generation:
        """A 409: a model in embedding mode makes no text."""
        raise EmbeddingModel("The model runs in llama.cpp's embedding mode (an embedding "
                             "model, or one started with embedding: true): it answers "
                             "POST /v1/embeddings, not chats or completions; stop it to "
                             "chat with a model that can", param="model")

    def embed(self, inputs: list, compute: Callable | None = None) -> tuple:
        """See Embedder.embed."""
        return self._embedder.embed(inputs, compute)


def embedding_params(llama_cpp, arguments: dict, context: int, pooling: int):
    """llama_context_params of one embedding context: those llama_cpp.Llama makes for
    LlamaEmbedder.open's `arguments` (localrt.engines.llama.params.llama_arguments),
    `context` tokens in one batch and the pooling type `pooling`; a chat model's
    EmbeddingContext makes its own with them, so it pools as the embedding mode does. If
    llama-cpp-python changes what Llama sets, change this too (tests/test_embeddings.py
    compares them)."""
    import multiprocessing

    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = context
    params.n_threads = arguments.get("n_threads") or max(multiprocessing.cpu_count() // 2, 1)
    params.n_threads_batch = arguments.get("n_threads_batch") or multiprocessing.cpu_count()
    params.rope_scaling_type = llama_cpp.LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED
    params.pooling_type = pooling
    params.attention_type = llama_cpp.LLAMA_ATTENTION_TYPE_UNSPECIFIED
    params.rope_freq_base = params.rope_freq_scale = 0
    params.yarn_ext_factor, params.yarn_attn_factor = -1.0, 1.0
    params.yarn_beta_fast, params.yarn_beta_slow, params.yarn_orig_ctx = 32.0, 1.0, 0
    params.embeddings, params.offload_kqv = True, True
    params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
                              if arguments.get("flash_attn")
                              else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    if arguments.get("type_k") is not None:
        params.type_k = params.type_v = arguments["type_k"]
    params.no_perf = False
    params.n_seq_max = min(context, llama_cpp.llama_max_parallel_sequences())
    params.kv_unified = True
    return params


class EmbeddingContext:
    """A chat model's embeddings: a second llama.cpp context in embedding mode on its
    loaded weights (mean pooling, as the start option `embedding` gives a decoder),
    made at the first embed() and freed by close().

    Its KV cache (`context` tokens) is apart from the chat slots', so an embedding never
    touches a chat's cache; each decode reads at most `budget` tokens (the chat model's
    n_batch) unless one input is longer, so a chat step waits for one such decode at
    most (the steps and the decodes take turns on the compute lane).
    """

    def __init__(self, model, arguments: dict, context: int, budget: int):
        self._model = model  # llama_cpp._internals.LlamaModel, the chat model's
        self._arguments = arguments
        self.context, self._budget = context, budget
        self._lock = threading.Lock()  # guards _embedder, made once
        self._embedder: Embedder | None = None

    def embed(self, inputs: list, compute: Callable | None = None) -> tuple:
        """See Embedder.embed; the first call makes the context (on `compute`)."""
        with self._lock:
            if self._embedder is None:
                self._embedder = (compute or _here)(self._open)
            embedder = self._embedder
        return embedder.embed(inputs, compute)

    def _open(self) -> Embedder:
        import llama_cpp
        from llama_cpp import _internals

        params = embedding_params(llama_cpp, self._arguments, self.context,
                                  llama_cpp.LLAMA_POOLING_TYPE_MEAN)
        ctx = _internals.LlamaContext(model=self._model, params=params, verbose=False)
        batch = _internals.LlamaBatch(n_tokens=self.context, embd=0, n_seq_max=1,
                                      verbose=False)
        return Embedder(self._model, ctx, batch, self.context, self._budget)

    def close(self) -> None:
        """Free the context (the model is unloading; no embed() runs any more)."""
        with self._lock:
            if self._embedder is not None:
                self._embedder.batch.close()
                self._embedder.ctx.close()
                self._embedder = None
