"""The built-in engines' adapters: llama.cpp (gguf-cpp) and onnxruntime-genai (onnx-runtime).

An engine object has `name`, `format`, `description` and `load(model_path, options)`,
and may have the engine's own rules, which localrt.engines.catalog asks before anything waits:

  check_options(options) -> [(option, why)]   the start options it cannot take
                                              (schemas/model-start.json's names)
  check_request(params)                       raises InvalidField for a chat request it
                                              cannot serve (its response_format, tools,
                                              tool_choice and logprobs)

The model it loads has:

  generate(messages, params) -> Generation   an iterator of text pieces, one per token
                                             (or fewer while a stop sequence might be
                                             starting); `finish_reason`, `usage` and
                                             `stop_sequence` (the one of params["stop"]
                                             that ended it) are set once it is
                                             exhausted, `close()` stops it
  count_tokens(messages, params) -> int      the prompt's tokens as generate() would
                                             read them, computing nothing (Anthropic's
                                             count_tokens; optional)
  chat(messages, params, stream)             the older contract custom engines may keep:
                                             a dict, or an iterator of pieces
  memory() -> {"ram", "vram"[, "kv"]}        bytes, when the engine knows better than
                                             the RSS delta measured around the load
                                             (kv: its KV cache, part of ram or vram)
  chat_template                              its Jinja chat template, when it has one
                                             (localrt.inference.toolcalls reads its call format)
  unload()
  slots, step()                              only a model that batches: it serves
                                             `slots` generations at once, and each
                                             step() gives every one its next token

and, for localrt.inference.completions and localrt.inference.embeddings, when the engine can:

  tokenize(text) / detokenize(tokens)        a prompt's tokens as generate() reads
  n_vocab                                    params["prompt"], and back, and how many
                                             token ids there are; such a model's
                                             generate() takes params["prompt_tokens"]
  fim_prompt(prefix, suffix) -> tokens       a fill-in-the-middle prompt (None without
                                             the vocabulary's FIM tokens)
  embed(inputs) -> (vectors, tokens)         a model loaded in embedding mode: one vector
                                             per input (a text or a token list), and the
                                             tokens read; its generate() is a 409

gguf-cpp loads a model in llama.cpp's embedding mode (`LlamaEmbedder`) when it is
started with the start option `embedding`, or when its GGUF is an embedding model (it
declares a pooling type, or non-causal attention); see `embedding_pooling`.

A custom engine's model with only chat() is wrapped in `ChatOnlyModel`, so every
loaded model has generate(). `generate` raises InvalidField before it computes
anything (a prompt longer than the context, a bad response_format or grammar), so a
streamed reply never starts with an error. It does no locking of its own:
localrt.inference.scheduler lets one request at a time use a model (`slots` at a time for a
batched one), and runs each token, or each step, in the compute lane. gguf-cpp
batches (LlamaModel, with localrt.engines.batching: n_parallel sequences in one context, and
the prompt cache); onnx-runtime serves one request at a time. `params` come from
localrt.inference.chat: OpenAI's sampling fields (`response_format` as {"type": "json_object"}
or {"type": "json_schema", "schema"}) plus `prompt` (the text of a model's
prompt_template, used instead of the chat template when present) and `stop` (a
list). For tool calls (localrt.inference.toolcalls): `tools` (OpenAI's list, given to the chat
template as Hugging Face gives it), `grammar` (GBNF that constrains the reply instead
of response_format) and `preserved_tokens` (special tokens printed as their text, as
a call's syntax needs). A generation's `usage` also counts `cached_tokens`: prompt
tokens a batched model found in its cache. Log probabilities (localrt.inference.logprobs):
`logprobs` (how many alternatives each token's comes with, 0 to 20; absent or None:
none) and `prompt_logprobs` (score the prompt's tokens too: a completion's echo); an
engine that computes them sets the Generation's `logprobs` to a Log, and token_loop
feeds it. Both built-in engines read the logits before sampling: gguf-cpp in
LlamaBatch.decode, onnx-runtime with Generator.get_logits() before each
generate_next_token() (it cannot score a prompt). A generation without a Log (a
custom engine's) makes localrt.inference.chat and localrt.inference.completions answer a 400.
llama_cpp and onnxruntime_genai are imported only when a model loads.
"""

from __future__ import annotations

import codecs
import collections
import ctypes
import functools
import json
import logging
import random
from pathlib import Path
from typing import Iterator

from localrt.inference import toolcalls
from localrt.engines.batching import Batcher, LlamaBatch, Sampling, Sequence
from localrt.errors import Conflict, InvalidField
from localrt.inference.logprobs import Log, TokenLogprob, scored

GGUF_ENGINE, ONNX_ENGINE = "gguf-cpp", "onnx-runtime"

# Model start options (schemas/model-start.json) become llama.cpp's parameters in
# _model_params (ngl, use_mmap, mlock; rpc_servers: the devices, localrt.engines.rpc) and
# _context_params (ctx_len x n_parallel, n_parallel, n_batch, cpu_threads, flash_attn,
# cache_type); caching_enabled is the Batcher's. If you add one, also map it there.
DEFAULT_BATCH = 512  # n_batch when not given (and the most n_ubatch is), llama-cpp-python's
# cache_type -> ggml_type, for the context's type_k and type_v (ggml.h's enum ggml_type),
# and the bytes each value of the KV cache takes in it (ggml's block size / block length).
# If you add one, also add it to the cache_type enum of schemas/model-update.json.
CACHE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
               "iq4_nl": 20, "bf16": 30}
CACHE_TYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32,
                    "q4_1": 20 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32, "iq4_nl": 18 / 32}
# Start options -> llama_cpp.Llama arguments, for the embedding mode's Llama (the
# batched LlamaModel makes its own llama.cpp parameters: _model_params, _context_params).
LLAMA_OPTIONS = {"ctx_len": "n_ctx", "ngl": "n_gpu_layers", "cpu_threads": "n_threads",
                 "n_batch": "n_batch", "mlock": "use_mlock", "use_mmap": "use_mmap",
                 "flash_attn": "flash_attn"}
# Quantized V caches need flash attention in llama.cpp.
QUANTIZED_CACHE = tuple(k for k in CACHE_TYPES if k not in ("f32", "f16", "bf16"))
# Sampling defaults where neither the request nor the model says: llama.cpp's own.
DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05,
            "repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


class Generation:
    """Text pieces as they are generated; `finish_reason` and `usage` once it ends.

    A batched model's generation (one of a model with `slots`) calls `wait()` when its
    next token is not computed yet: the model's own step() unless the scheduler sets
    its own (localrt.inference.scheduler.Lease.steps). `on_close` runs at close(), read or not.
    """

    def __init__(self, prompt_tokens: int, run, on_close=None):
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None  # the stop sequence that ended it, if one did
        self.usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0}
        self.wait = None
        self.logprobs = None  # a localrt.inference.logprobs.Log, when asked for and computed
        self._pieces = run(self)
        self._on_close = on_close

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
    out by itself. With `gen.logprobs` (a localrt.inference.logprobs.Log), `scores(token)` is each
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


def _check_room(prompt_tokens: int, context: int) -> int:
    """The tokens left for the reply; a 400 when the prompt fills the context."""
    if prompt_tokens >= context:
        raise InvalidField(f"Invalid field 'messages': the prompt is {prompt_tokens} tokens "
                           f"and the model's context (ctx_len) holds {context}; shorten the "
                           f"conversation or start the model with a larger ctx_len",
                           param="messages")
    return context - prompt_tokens


def _seed(params: dict, bits: int) -> int:
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
        """See the module docstring."""
        raise NotImplementedError

    def chat(self, messages: list, params: dict, stream: bool):
        """The older chat(messages, params, stream) contract; see the module docstring."""
        generation = self.generate(messages, params)
        if stream:
            return generation
        content = "".join(generation)
        return {"content": content, "finish_reason": generation.finish_reason,
                "usage": dict(generation.usage)}


class ChatOnlyModel(GeneratingModel):
    """A custom engine's model that has only the older chat(): generate() reads its
    streamed pieces, each counted as a token. Everything else is the model's own."""

    def __init__(self, model):
        self._model = model

    def generate(self, messages: list, params: dict) -> Generation:
        """See the module docstring."""
        return generation_of_pieces(self._model.chat(messages, params, True), params)

    def chat(self, messages: list, params: dict, stream: bool):
        """The model's own chat()."""
        return self._model.chat(messages, params, stream)

    def unload(self) -> None:
        """The model's own unload()."""
        self._model.unload()

    def __getattr__(self, name):  # memory(), and anything else the engine offers
        return getattr(self._model, name)


def generating(model):
    """A loaded model with generate(): the model itself, or a ChatOnlyModel around it."""
    return model if hasattr(model, "generate") else ChatOnlyModel(model)


# --- gguf-cpp ------------------------------------------------------------------------


class GgufEngine:
    """gguf-cpp: llama.cpp through llama-cpp-python, imported at the first load.

    `_rpc` is this process's use of rpc-servers (localrt.engines.rpc.Client), shared by the
    models it loads with `rpc_servers`.
    """

    name, format = GGUF_ENGINE, "GGUF"
    description = "llama.cpp through llama-cpp-python; runs GGUF models"

    def __init__(self):
        from localrt.engines import rpc

        self._rpc = rpc.Client()

    def load(self, model_path: str, options: dict) -> "LlamaModel":
        """Load a GGUF file and make its context: n_parallel sequences of ctx_len tokens,
        or, for an embedding model or the start option `embedding`, llama.cpp's embedding
        mode (`LlamaEmbedder`)."""
        pooling = embedding_pooling(model_path, options)
        if pooling is not None:
            if options.get("rpc_servers"):
                raise InvalidField("Invalid field 'rpc_servers': an embedding model loads "
                                   "on this machine only", param="rpc_servers")
            return LlamaEmbedder.open(model_path, options, pooling)
        return LlamaModel(model_path, options, self._rpc)

    @staticmethod
    def check_options(options: dict) -> Iterator[tuple[str, str]]:
        """(option, why) for each start option llama.cpp cannot take (localrt.engines.catalog
        checks rpc_servers against the build and rpcTrustedHosts)."""
        if options.get("grp_attn_n", 1) > 1:
            yield "grp_attn_n", "gguf-cpp has no group attention (self-extend); leave it at 1"
        if options.get("cache_type") in QUANTIZED_CACHE and not options.get("flash_attn"):
            yield "cache_type", f"a {options['cache_type']} KV cache needs flash_attn: true"
        if options.get("rpc_servers") and options.get("embedding"):
            yield "rpc_servers", "an embedding model loads on this machine only"

    @staticmethod
    def check_request(params: dict) -> None:
        """A 400 for a JSON Schema (a response format's or a forced tool's) that cannot
        become a grammar."""
        json_grammar(params.get("response_format"))
        toolcalls.check_schemas(params.get("tools"), params.get("tool_choice"))


class LlamaModel(GeneratingModel):
    """A loaded GGUF model: one llama.cpp context whose `slots` sequences (n_parallel)
    share each decode step (localrt.engines.batching), and the generations read from them.

    It has `slots` and `step()`: localrt.inference.scheduler lets that many requests in at once
    and runs the steps.
    """

    def __init__(self, model_path: str, options: dict, rpc_client=None):
        import llama_cpp
        from llama_cpp import _internals

        # llama.cpp logs through llama-cpp-python's logger; errors only, as Llama(verbose=False).
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        self._llama_cpp = llama_cpp
        params = _model_params(llama_cpp, options)
        self._rpc, self._rpc_targets = rpc_client, _rpc_targets(llama_cpp, options)
        if self._rpc_targets:
            devices = rpc_client.devices(self._rpc_targets, _engine_dir(llama_cpp))
            params.devices = ctypes.cast(devices, ctypes.c_void_p)  # kept until loaded
        try:
            self._model = _internals.LlamaModel(path_model=model_path, verbose=False,
                                                params=params)
        except BaseException:
            self._release_rpc()
            raise
        try:
            self.slots = options.get("n_parallel") or 1  # the scheduler's default is 4
            # Each sequence has ctx_len tokens of KV; llama.cpp may round the context up.
            self.context = options.get("ctx_len") or self._model.n_ctx_train()
            params = _context_params(llama_cpp, options, self.slots * self.context,
                                     self.slots)
            self._batch = LlamaBatch(llama_cpp, self._model.model, params)
        except BaseException:
            self._model.close()
            self._release_rpc()
            raise
        self._batcher = Batcher(self.slots, params.n_batch, self._batch,
                                caching=options.get("caching_enabled", True))
        self._cache_type = options.get("cache_type") or "f16"
        self._metadata = self._model.metadata()
        self._formatter = None  # the GGUF's chat template, compiled at the first chat
        self._pieces: dict[int, bytes] = {}  # token -> its bytes; the vocabulary is fixed
        self._special_pieces: dict[int, bytes] = {}  # the same, special tokens printed

    @property
    def chat_template(self) -> str | None:
        """The GGUF's Jinja chat template (tokenizer.chat_template), if it has one."""
        return self._metadata.get("tokenizer.chat_template")

    def generate(self, messages: list, params: dict) -> Generation:
        """Tokenize and check now; the tokens come as steps compute them."""
        tokens = self._prompt_tokens(messages, params)
        if not tokens:
            raise InvalidField("Invalid field 'messages': the prompt is empty",
                               param="messages")
        room = _check_room(len(tokens), self.context)
        max_tokens = min(params.get("max_tokens") or room, room)
        keep = self._preserved(params.get("preserved_tokens"))
        top, echo = params.get("logprobs"), bool(params.get("prompt_logprobs"))
        seq = Sequence(tokens, max_tokens, self._sampler(params, tokens), top_logprobs=top,
                       prompt_logprobs=echo and top is not None)
        batcher = self._batcher

        def run(gen: Generation) -> Iterator[str]:
            batcher.join(seq)
            decoder = codecs.getincrementaldecoder("utf-8")("replace")
            try:
                yield from token_loop(
                    gen, batcher.tokens(seq, lambda: gen.wait()),
                    decode=lambda t: decoder.decode(self._piece(t, t in keep)),
                    is_end=self._batch.is_end, final=lambda: decoder.decode(b"", final=True),
                    stops=params.get("stop"), max_tokens=max_tokens,
                    scores=lambda t: seq.scores.popleft())
            finally:
                batcher.leave(seq)
                gen.usage["cached_tokens"] = seq.cached

        generation = Generation(len(tokens), run, on_close=lambda: batcher.leave(seq))
        generation.wait = self.step
        if top is not None:
            generation.logprobs = Log(self._piece, prompt=(
                (lambda: [TokenLogprob(tokens[0], None), *seq.prompt_scores])
                if seq.prompt_logprobs else None))
        return generation

    def count_tokens(self, messages: list, params: dict) -> int:
        """The prompt's tokens as generate() reads them; nothing is computed."""
        return len(self._prompt_tokens(messages, params))

    def _prompt_tokens(self, messages: list, params: dict) -> list[int]:
        """The prompt: a completion's own tokens, its prompt text, or the chat template's
        rendering of the messages (and tools)."""
        model = self._model
        if params.get("prompt_tokens") is not None:  # a completion's own tokens
            return list(params["prompt_tokens"])
        if params.get("prompt") is not None:
            text, bos = params["prompt"], model.add_bos_token()
        else:
            text, bos = self._format(messages, params.get("tools"))
        return model.tokenize(text.encode("utf-8"), add_bos=bos, special=True)

    def step(self) -> None:
        """One decode for every sequence (localrt.engines.batching.Batcher.step)."""
        self._batcher.step()

    def counters(self) -> dict:
        """Decode steps so far, and the prompt tokens they read: as the batcher counted
        them, and as llama.cpp did (it counts the tokens of decodes of more than one)."""
        return {"decodes": self._batcher.decodes, "prompt_read": self._batcher.prompt_read,
                "prompt_evaluated": self._batch.prompt_evaluated()}

    def _sampler(self, params: dict, tokens: list[int]):
        """The request's sampler chain; a 400 for a logit_bias token not in the
        vocabulary, or a grammar llama.cpp cannot parse."""
        n_vocab = self._model.n_vocab()
        bias = []
        for key, value in (params.get("logit_bias") or {}).items():
            token = int(key)
            if not 0 <= token < n_vocab:
                raise InvalidField(f"Invalid field 'logit_bias': token {key} is not in the "
                                   f"model's vocabulary of {n_vocab}", param="logit_bias")
            bias.append((token, float(value)))
        # A grammar of the caller's own (GBNF: a forced tool call's) goes before
        # response_format's.
        grammar, source = params.get("grammar"), "grammar"
        if not grammar:
            grammar, source = json_grammar(params.get("response_format")), "response_format"
        sampling = Sampling(
            temperature=_number(params, "temperature"), top_k=int(_number(params, "top_k")),
            top_p=_number(params, "top_p"), min_p=_number(params, "min_p"),
            repeat_penalty=_number(params, "repeat_penalty"),
            frequency_penalty=_number(params, "frequency_penalty"),
            presence_penalty=_number(params, "presence_penalty"),
            seed=_seed(params, 32), bias=tuple(bias), grammar=grammar)
        try:
            return self._batch.sampler(sampling, tokens)
        except ValueError as exc:
            raise InvalidField(f"Invalid field '{source}': {exc}", param=source) from None

    # --- for localrt.inference.completions ----------------------------------------------

    @property
    def n_vocab(self) -> int:
        """The vocabulary's size: token ids are below it."""
        return self._model.n_vocab()

    def tokenize(self, text: str) -> list[int]:
        """A prompt text's tokens, as generate() reads params["prompt"]."""
        model = self._model
        return model.tokenize(text.encode("utf-8"), add_bos=model.add_bos_token(),
                              special=True)

    def detokenize(self, tokens) -> str:
        """The text of tokens (special ones render as nothing)."""
        return self._model.detokenize(list(tokens)).decode("utf-8", errors="replace")

    def fim_prompt(self, prefix: str, suffix: str) -> list[int] | None:
        """The fill-in-the-middle prompt llama.cpp's server writes (BOS when the model
        adds one, then FIM_PRE prefix FIM_SUF suffix FIM_MID); None when the vocabulary
        has no FIM tokens."""
        model = self._model
        pre, suf, mid = model.token_prefix(), model.token_suffix(), model.token_middle()
        if min(pre, suf, mid) < 0:
            return None

        def text(t: str) -> list[int]:
            return model.tokenize(t.encode("utf-8"), add_bos=False, special=False)

        bos = [model.token_bos()] if model.add_bos_token() and model.token_bos() >= 0 else []
        return bos + [pre] + text(prefix) + [suf] + text(suffix) + [mid]

    def _piece(self, token: int, special: bool = False) -> bytes:
        """A token's bytes (special tokens render as nothing, as in llama-cpp-python,
        unless `special`)."""
        pieces = self._special_pieces if special else self._pieces
        piece = pieces.get(token)
        if piece is None:
            vocab, size = self._model.vocab, 64
            while True:
                buf = ctypes.create_string_buffer(size)
                n = self._llama_cpp.llama_token_to_piece(vocab, token, buf, size, 0, special)
                if n >= 0:
                    break
                size = -n
            piece = pieces[token] = buf.raw[:n]
        return piece

    def _preserved(self, texts) -> frozenset:
        """The ids of the special tokens spelled `texts`, to print as text."""
        ids = set()
        for text in texts or ():
            tokens = self._model.tokenize(text.encode("utf-8"), add_bos=False, special=True)
            if len(tokens) == 1:
                ids.add(tokens[0])
        return frozenset(ids)

    def memory(self) -> dict:
        """RAM and VRAM from llama.cpp: the weights (split by offloaded layers) and the
        KV cache of every slot (`kv`, in ram or vram). A model split across rpc-servers
        offloads to them, not to a GPU here: that part is `remote`, in neither."""
        from localrt.engines import rpc

        llama_cpp, model = self._llama_cpp, self._model
        weights = llama_cpp.llama_model_size(model.model)
        kv = self.kv_bytes()
        layers = llama_cpp.llama_model_n_layer(model.model)
        offloaded = 0
        if self._rpc_targets or rpc.local_gpu(llama_cpp):
            ngl = model.params.n_gpu_layers
            offloaded = layers + 1 if ngl < 0 else min(ngl, layers + 1)
        # The offloaded layers' weights go to the GPU, and so does the KV cache
        # (llama.cpp's offload_kqv) once any layer is offloaded.
        away = weights * offloaded // (layers + 1) + (kv if offloaded else 0)
        if self._rpc_targets:
            return {"ram": weights + kv - away, "vram": 0, "kv": kv, "remote": away}
        return {"ram": weights + kv - away, "vram": away, "kv": kv}

    def kv_bytes(self) -> int:
        """The KV cache's size: keys and values of every layer for every token of every slot."""
        llama_cpp, model, meta = self._llama_cpp, self._model.model, self._metadata
        arch = meta.get("general.architecture", "")
        heads = llama_cpp.llama_model_n_head(model) or 1
        head = llama_cpp.llama_model_n_embd(model) // heads
        key = int(meta.get(f"{arch}.attention.key_length", head))
        value = int(meta.get(f"{arch}.attention.value_length", head))
        width = (key + value) * llama_cpp.llama_model_n_head_kv(model)
        cells = llama_cpp.llama_n_ctx(self._batch.ctx)
        return int(llama_cpp.llama_model_n_layer(model) * cells * width
                   * CACHE_TYPE_BYTES[self._cache_type])

    def _format(self, messages: list, tools: list | None = None) -> tuple[str, bool]:
        """The prompt from the GGUF's chat template (llama-2's format if it has none),
        given `tools` as Hugging Face's apply_chat_template gives them."""
        from llama_cpp import llama_chat_format

        if self._formatter is None:
            template = self._metadata.get("tokenizer.chat_template")
            if template:
                model = self._model

                def text(token: int) -> str:
                    return model.token_get_text(token) if token >= 0 else ""

                self._formatter = llama_chat_format.Jinja2ChatFormatter(
                    template=template, eos_token=text(model.token_eos()),
                    bos_token=text(model.token_bos()))
            else:
                self._formatter = llama_chat_format.format_llama2
        try:
            out = self._formatter(messages=messages, tools=tools)
        except Exception as exc:  # jinja2 errors, and the template's raise_exception()
            raise InvalidField(f"Invalid field 'messages': the model's chat template "
                               f"refused them: {exc}", param="messages") from None
        return out.prompt, not out.added_special

    def unload(self) -> None:
        """Free the sequences, the context and the model (no step runs any more)."""
        with self._batcher.stepping():
            self._batcher.close()
            self._batch.close()
            self._model.close()
        self._release_rpc()

    def _release_rpc(self) -> None:
        if self._rpc_targets:
            self._rpc.release(self._rpc_targets)
            self._rpc_targets = []


def _rpc_targets(llama_cpp, options: dict) -> list[str]:
    """The rpc-servers of the start option `rpc_servers` ("host:port" each); a 400 when
    this llama.cpp has no RPC backend (localrt.engines.catalog names the variant that has)."""
    from localrt.engines import rpc

    if not options.get("rpc_servers"):
        return []
    if not llama_cpp.llama_supports_rpc():
        raise InvalidField("Invalid field 'rpc_servers': the llama.cpp this server loaded "
                           "has no RPC backend; install a gguf-cpp +rpc variant (localrt "
                           "engines install gguf-cpp --variant ...+rpc), or, if it is the "
                           "active one already, restart the server to load it",
                           param="rpc_servers")
    try:
        return rpc.endpoints(rpc.parse_servers(options["rpc_servers"]))
    except ValueError as exc:
        raise InvalidField(f"Invalid field 'rpc_servers': {exc}", param="rpc_servers") \
            from None


def _engine_dir(llama_cpp) -> str:
    """The folder llama_cpp was imported from (an engine variant's, or site-packages)."""
    return str(Path(llama_cpp.__file__).resolve().parent.parent)


def _model_params(llama_cpp, options: dict):
    """llama_model_params for the start options (ngl, use_mmap, mlock)."""
    params = llama_cpp.llama_model_default_params()
    ngl = options.get("ngl")
    if ngl is not None:
        params.n_gpu_layers = 0x7FFFFFFF if ngl < 0 else ngl  # INT32_MAX: every layer
    mmap, mlock = options.get("use_mmap", True) is not False, bool(options.get("mlock"))
    params.load_mode = {(True, True): llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK,
                        (False, True): llama_cpp.LLAMA_LOAD_MODE_MLOCK,
                        (True, False): llama_cpp.LLAMA_LOAD_MODE_MMAP,
                        (False, False): llama_cpp.LLAMA_LOAD_MODE_NONE}[mmap, mlock]
    return params


def _context_params(llama_cpp, options: dict, n_ctx: int, slots: int):
    """llama_context_params: `slots` sequences of their own (no unified KV) in n_ctx."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_seq_max, params.kv_unified = n_ctx, slots, False
    n_batch = max(options.get("n_batch") or DEFAULT_BATCH, slots)
    params.n_batch, params.n_ubatch = n_batch, min(n_batch, DEFAULT_BATCH)
    threads = options.get("cpu_threads")
    if threads:
        params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if options.get("flash_attn")
                              else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    if options.get("cache_type"):
        params.type_k = params.type_v = CACHE_TYPES[options["cache_type"]]
    params.no_perf = False  # keeps llama.cpp's count of evaluated prompt tokens
    return params


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

    from localrt.models import ggufinfo

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
    def open(cls, model_path: str, options: dict, pooling: int) -> "LlamaEmbedder":
        """Load a GGUF in embedding mode with the Llama arguments the options map to."""
        import llama_cpp

        kwargs = {LLAMA_OPTIONS[k]: v for k, v in options.items()
                  if k in LLAMA_OPTIONS and v is not None}
        if options.get("cache_type"):
            kwargs["type_k"] = kwargs["type_v"] = CACHE_TYPES[options["cache_type"]]
        if "n_threads" in kwargs:
            kwargs["n_threads_batch"] = kwargs["n_threads"]
        context = options.get("ctx_len") or 512
        kwargs.update(n_ctx=context, n_batch=context, n_ubatch=context)
        llm = llama_cpp.Llama(model_path=model_path, verbose=False, embedding=True,
                              pooling_type=pooling, **kwargs)
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


def json_grammar(response_format: dict | None) -> str | None:
    """The GBNF grammar gguf-cpp constrains a JSON reply with; a 400 for a schema it cannot
    turn into one. Checked before a request waits for its model, too."""
    kind = (response_format or {}).get("type")
    if kind not in ("json_object", "json_schema"):
        return None
    from llama_cpp.llama_grammar import JSON_GBNF

    schema = response_format.get("schema")
    if schema is None:
        return JSON_GBNF
    try:
        return _schema_grammar(json.dumps(schema, sort_keys=True))
    except Exception as exc:  # the converter raises bare Exceptions for what it cannot do
        raise InvalidField(f"Invalid field 'response_format': the JSON Schema cannot be "
                           f"turned into a grammar: {exc}", param="response_format") from None


@functools.lru_cache(maxsize=64)
def _schema_grammar(schema_json: str) -> str:
    """The grammar of a JSON Schema, converted once: a request checks it before it waits
    for its model and uses it after, and clients send the same schema again and again."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    return json_schema_to_gbnf(schema_json)


def _number(params: dict, name: str) -> float:
    value = params.get(name)
    return DEFAULTS[name] if value is None else value


# --- onnx-runtime ----------------------------------------------------------------------


class OnnxEngine:
    """onnx-runtime: onnxruntime-genai, imported from its engine folder at the first load.

    A model is a folder holding genai_config.json, the ONNX graph and the tokenizer
    files; the chat template comes from tokenizer_config.json.
    """

    name, format = ONNX_ENGINE, "ONNX"
    description = "onnxruntime-genai; runs ONNX models"

    def load(self, model_path: str, options: dict) -> "OnnxModel":
        """Load a model folder (or the folder of a file in it)."""
        import onnxruntime_genai as og

        folder = Path(model_path)
        if folder.is_file():
            folder = folder.parent
        model = og.Model(str(folder))
        config = json.loads((folder / "genai_config.json").read_text())
        context = config.get("model", {}).get("context_length") or 2048
        return OnnxModel(og, model, og.Tokenizer(model),
                         min(context, options.get("ctx_len") or context))

    @staticmethod
    def check_options(options: dict) -> Iterator[tuple[str, str]]:
        """onnxruntime-genai ignores the llama.cpp options rather than refusing them, but
        it has no embedding mode."""
        if options.get("embedding"):
            yield "embedding", "onnx-runtime cannot compute embeddings; use a GGUF model"

    @staticmethod
    def check_request(params: dict) -> None:
        """A 400 for a JSON response format or tools: onnxruntime-genai can neither
        constrain a reply nor render tools into its chat template."""
        if (params.get("response_format") or {}).get("type") in ("json_object",
                                                                  "json_schema"):
            raise InvalidField("Invalid field 'response_format': onnx-runtime cannot "
                               "constrain replies to JSON; use a GGUF model",
                               param="response_format")
        if params.get("tools"):
            raise InvalidField("Invalid field 'tools': onnx-runtime models cannot call "
                               "tools; use a GGUF model", param="tools")


class OnnxModel(GeneratingModel):
    """A loaded ONNX model; a fresh Generator per request."""

    def __init__(self, og, model, tokenizer, context: int):
        self._og, self._model, self._tokenizer, self._context = og, model, tokenizer, context

    def generate(self, messages: list, params: dict) -> Generation:
        """Tokenize and check now; compute token by token as the Generation is read."""
        og, tok = self._og, self._tokenizer
        ids = self._prompt_tokens(messages, params)
        room = _check_room(len(ids), self._context)
        max_tokens = min(params.get("max_tokens") or room, room)
        search = {"max_length": len(ids) + max_tokens, "random_seed": _seed(params, 31)}
        temperature = _number(params, "temperature")
        if temperature > 0:
            search.update(do_sample=True, temperature=float(temperature),
                          top_p=float(_number(params, "top_p")),
                          top_k=int(_number(params, "top_k")))
        if params.get("repeat_penalty"):
            search["repetition_penalty"] = float(params["repeat_penalty"])
        OnnxEngine.check_request(params)
        eos = {int(t) for t in tok.eos_token_ids}
        top = params.get("logprobs")
        scores: collections.deque = collections.deque()

        def run(gen: Generation) -> Iterator[str]:
            gen_params = og.GeneratorParams(self._model)
            gen_params.set_search_options(**search)
            generator = og.Generator(self._model, gen_params)
            generator.append_tokens(ids)

            def tokens_out() -> Iterator[int]:
                while not generator.is_done():
                    # The model's logits for the next token, read before the search
                    # samples from them: its own log-probabilities (localrt.inference.logprobs).
                    logits = None if top is None else self._logits(generator)
                    generator.generate_next_token()
                    token = int(generator.get_next_tokens()[0])
                    if logits is not None:
                        scores.append(scored(logits, token, top))
                    yield token

            yield from token_loop(gen, tokens_out(), decode=tok.create_stream().decode,
                                  is_end=eos.__contains__, stops=params.get("stop"),
                                  max_tokens=max_tokens, scores=lambda t: scores.popleft())

        generation = Generation(len(ids), run)
        if top is not None:
            generation.logprobs = Log(self._piece)
        return generation

    @staticmethod
    def _logits(generator):
        """The last position's logits (a float32 numpy array over the vocabulary)."""
        import numpy as np

        logits = np.asarray(generator.get_logits(), dtype=np.float32)
        return logits.reshape(-1, logits.shape[-1])[-1]

    def _piece(self, token: int, special: bool = True) -> bytes:
        """A token's text as the tokenizer decodes it alone, as UTF-8 (a token holding
        part of a character decodes as U+FFFD: its bytes are not exact)."""
        return self._tokenizer.decode([token]).encode("utf-8")

    def count_tokens(self, messages: list, params: dict) -> int:
        """The prompt's tokens as generate() reads them; nothing is computed."""
        return len(self._prompt_tokens(messages, params))

    def _prompt_tokens(self, messages: list, params: dict):
        """The prompt text, or the tokenizer's chat template's rendering, as token ids."""
        prompt = params.get("prompt")
        if prompt is None:
            prompt = self._tokenizer.apply_chat_template(json.dumps(messages),
                                                         add_generation_prompt=True)
        return self._tokenizer.encode(prompt)

    def unload(self) -> None:
        """Drop the model; onnxruntime frees it with the last reference."""
        self._model = None
