"""gguf-cpp: llama.cpp through llama-cpp-python, for GGUF models.

`GgufEngine` loads a GGUF as a `LlamaModel`, localrt.engines.contract's Batched,
Measured, Tokenizing, Counting, Embedding and Templated model (and Vocabulary,
Rendering and Slotted, for llama-server's utility routes): one llama.cpp context
whose n_parallel sequences share each decode step (localrt.engines.llama.batch), with
the prompt cache, and embeddings on a second context of its own
(localrt.engines.llama.embedding.EmbeddingContext). Its start options become
llama.cpp's parameters in localrt.engines.llama.params. An embedding model, or one
started with the start option `embedding`, loads in llama.cpp's embedding mode instead
(localrt.engines.llama.embedding), and a reranker so too (localrt.engines.llama.rerank).
A model with a projector (the option `mmproj`, its role's key, which
localrt.inference.scheduler sets from the record: localrt.models.roles) loads it
through llama.cpp's mtmd and reads chats with images (localrt.engines.llama.media). One
with LoRA adapters (the option `lora`, their role's key) loads them onto the model and
applies each request's scales (localrt.engines.llama.adapters). A JSON response_format becomes a grammar
(localrt.engines.llama.grammar); log probabilities (localrt.engines.logprobs) are read
from the logits before sampling, in LlamaBatch.decode, for the prompt too. llama_cpp is
imported only when a model loads.
"""

from __future__ import annotations

import codecs
import ctypes
import logging
import os
from pathlib import Path
from typing import Callable, Iterator

from localrt.engines.llama import offload
from localrt.engines.llama.adapters import Adapters
from localrt.engines.llama.batch import Batcher, Sequence
from localrt.engines.llama.decode import LlamaBatch, Sampling
from localrt.engines.llama.drafting import DRAFT_MAX, Drafter, prediction_counts
from localrt.engines.llama.promptcache import PromptCache
from localrt.engines.llama.embedding import EmbeddingContext, LlamaEmbedder, embedding_pooling
from localrt.engines.llama.rerank import LlamaReranker
from localrt.engines.generation import (GeneratingModel, Generation, check_room,
                                        render_template, seed_of, sampling_value,
                                        token_loop)
from localrt.engines.llama.grammar import check_gbnf, json_grammar
from localrt.engines.llama.measure import Measure, token_piece
from localrt.engines.llama.media import (Projector, Prompt, has_images, refuse_media,
                                         texts_and_images)
from localrt.engines.llama.params import (CACHE_TYPE_BYTES, QUANTIZED_CACHE, context_params,
                                          engine_dir, llama_arguments, model_params,
                                          rpc_targets)
from localrt.errors import InvalidChatTemplate, InvalidField
from localrt.engines import toolcalls
from localrt.engines.ggufinfo import RANK_POOLING
from localrt.engines.logprobs import Log, TokenLogprob

GGUF_ENGINE = "gguf-cpp"
_CHILD_LOG = None  # GgufEngine.in_child's log callback, kept alive for llama.cpp

class GgufEngine:
    """gguf-cpp: llama.cpp through llama-cpp-python, imported at the first load.

    `prompt_cache_bytes` is the RAM each model it loads may keep of prompt states
    (promptCacheMiB; 0: none). `_rpc` is this process's use of rpc-servers
    (localrt.engines.rpc.Client), shared by the models it loads with `rpc_servers`.
    """

    name, format = GGUF_ENGINE, "GGUF"
    description = "llama.cpp through llama-cpp-python; runs GGUF models"

    def __init__(self, prompt_cache_bytes: int = 0):
        from localrt.engines import rpc

        self.prompt_cache_bytes = prompt_cache_bytes
        self._rpc = rpc.Client()

    def load(self, model_path: str, options: dict) -> "LlamaModel":
        """Load a GGUF file and make its context: n_parallel sequences of ctx_len tokens,
        or, for an embedding model or the start option `embedding`, llama.cpp's embedding
        mode (`LlamaEmbedder`; a reranker's GGUF, which pools by rank, `LlamaReranker`)."""
        pooling = embedding_pooling(model_path, options)
        if pooling is not None:
            if options.get("rpc_servers"):
                raise InvalidField("Invalid field 'rpc_servers': an embedding model loads "
                                   "on this machine only", param="rpc_servers")
            kind = LlamaReranker if pooling == RANK_POOLING else LlamaEmbedder
            return kind.open(model_path, llama_arguments(options), options.get("ctx_len"),
                             pooling)
        return LlamaModel(model_path, options, self._rpc, self.prompt_cache_bytes)

    @staticmethod
    def in_child(log_fd: int) -> None:
        """For a file's first load in a child (localrt.engines.vetting): llama.cpp's
        warnings and errors go to `log_fd`, even while llama-cpp-python points fd 2 at
        /dev/null around a load, so a failed assert's message (which ggml writes to fd
        2 itself) and the loader's reason reach the parent."""
        import llama_cpp
        from llama_cpp import _utils

        global _CHILD_LOG
        shown = {3, 4}  # ggml.h's GGML_LOG_LEVEL_WARN and _ERROR; 5 continues a line
        last = [0]

        @llama_cpp.llama_log_callback
        def write(level, text, user_data):
            if level != 5:
                last[0] = level
            if last[0] in shown:
                os.write(log_fd, text)

        _CHILD_LOG = write  # ctypes calls it for as long as the process lives
        # through offload's callback, which also reads where the model's buffers went
        offload.install(llama_cpp, forward=write)
        devnull = getattr(_utils, "errnull_file", None)
        if devnull is not None:  # its "null" for fd 2 is our log instead
            os.dup2(log_fd, devnull.fileno())

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
        toolcalls.check_schemas(params.get("tools"), params.get("tool_choice") or "auto",
                                params.get("tool_function"))


class LlamaModel(GeneratingModel):
    """A loaded GGUF model: one llama.cpp context whose `slots` sequences (n_parallel)
    share each decode step (localrt.engines.llama.batch), and the generations read from them.

    It is Batched (localrt.engines.contract): localrt.inference.scheduler lets `slots`
    requests in at once and runs the steps.
    """

    def __init__(self, model_path: str, options: dict, rpc_client=None,
                 prompt_cache_bytes: int = 0):
        import llama_cpp
        from llama_cpp import _internals

        # llama.cpp logs through llama-cpp-python's logger; errors only, as Llama(verbose=False).
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        self._llama_cpp = llama_cpp
        params = model_params(llama_cpp, options)
        self._rpc, self._rpc_targets = rpc_client, rpc_targets(llama_cpp, options)
        if self._rpc_targets:
            devices = rpc_client.devices(self._rpc_targets, engine_dir(llama_cpp))
            params.devices = ctypes.cast(devices, ctypes.c_void_p)  # kept until loaded
        # What llama.cpp logs of its buffers while the model and its context load
        # says where it put them (localrt.engines.llama.offload).
        self._asked = "fit" if options.get("fit") or options.get("ngl") is None \
            else options["ngl"]
        with offload.capture(llama_cpp) as logged:
            try:
                self._model = _internals.LlamaModel(path_model=model_path, verbose=False,
                                                    params=params)
            except BaseException:
                self._release_rpc()
                raise
            # The model's id as messages name it (the scheduler gives it as `model`).
            self.name = options.get("model") or Path(model_path).name
            self._mmproj = options.get("mmproj")  # the projector's key (localrt.models.roles)
            projector = None
            try:
                self.slots = options.get("n_parallel") or 1  # the scheduler's default is 4
                # Each sequence has ctx_len tokens of KV; llama.cpp may round the context up.
                self.context = options.get("ctx_len") or self._model.n_ctx_train()
                params = context_params(llama_cpp, options, self.slots * self.context,
                                        self.slots)
                # freed with the model (llama.cpp frees a model's adapters with it)
                self.adapters = Adapters(llama_cpp, self._model.model, options.get("lora"))
                if self._mmproj:
                    projector = Projector(llama_cpp, self._mmproj, self._model.model, options)
                # The batch owns the projector from here: its close() frees it.
                self._batch = LlamaBatch(llama_cpp, self._model.model, params, projector,
                                         self.adapters if len(self.adapters) else None)
            except BaseException:
                if projector is not None:
                    projector.close()
                self._model.close()
                self._release_rpc()
                raise
        self.placement = offload.read(offload.text_of(logged))
        self._devices = {name: offload.describe(name)
                         for name in self.placement.devices()}
        self._batcher = Batcher(self.slots, params.n_batch, self._batch,
                                caching=options.get("caching_enabled", True),
                                cache=PromptCache(prompt_cache_bytes)
                                if prompt_cache_bytes else None)
        # Embeddings beside the chats, on a context of their own (made at the first).
        self._embedding = EmbeddingContext(self._model, llama_arguments(options),
                                           self.context, params.n_batch)
        self._cache_type = options.get("cache_type") or "f16"
        # Speculative decoding (localrt.engines.llama.drafting), on unless the start option
        # says off, and never for a model whose memory cannot cut a sequence short
        # (a recurrent or hybrid one: a rejected draft's KV could not go).
        model = self._model.model
        self.speculative = options.get("speculative", "ngram") != "off" and not (
            llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model))
        self.draft_max = options.get("draft_max") or DRAFT_MAX
        self._metadata = self._model.metadata()
        self._measure = Measure(llama_cpp, self._model.vocab)  # texts before tokenizing
        # The GGUF's chat template, compiled at the first chat (a ChatTemplate, llama-2's
        # format when it has none, or the TemplateRefused its compiling raised).
        self._formatter = None
        self._pieces: dict[int, bytes] = {}  # token -> its bytes; the vocabulary is fixed
        self._special_pieces: dict[int, bytes] = {}  # the same, special tokens printed

    @property
    def chat_template(self) -> str | None:
        """The GGUF's Jinja chat template (tokenizer.chat_template), if it has one."""
        return self._metadata.get("tokenizer.chat_template")

    def generate(self, messages: list, params: dict,
                 wait: Callable[[], None] | None = None) -> Generation:
        """Tokenize and check now; the tokens come as steps compute them: the generation
        calls `wait()` for its next one (the scheduler's wait for a step; step() itself
        when None)."""
        prompt = self._prompt(messages, params)
        tokens = prompt.items
        thinking, after = None, None  # a reasoning reply's Tracker, its grammar's chain
        sampler = None
        try:
            if not tokens:
                raise InvalidField("Invalid field 'messages': the prompt is empty",
                                   param="messages")
            room = check_room(len(tokens), self.context)
            max_tokens = min(params.get("max_tokens") or room, room)
            keep = self._preserved(params.get("preserved_tokens"))
            adapters = self.adapters.key(params.get("lora"))
            top, echo = params.get("logprobs"), bool(params.get("prompt_logprobs"))
            sampler = self._sampler(params, tokens)
            plan = params.get("reasoning")
            if plan is not None and prompt.thinking is not None:
                thinking = plan.tracker(prompt.thinking, lambda t: self._piece(t, True),
                                        self._special_tokens)
                if not thinking.answering and self._grammar(params)[0]:
                    # The thinking is free; the grammar constrains the answer after it.
                    after, sampler = sampler, None
                    sampler = self._sampler(params, tokens, grammar=False)
        except BaseException:
            self._batch.release(Sequence([], 0, sampler, after_thinking=after))
            if prompt.chunks:
                self._batch.projector.free(prompt)
            raise
        predicted = None  # the prediction's tokens, when the request has one
        if params.get("prediction"):
            predicted = self._text_tokens(params["prediction"])
        seq = Sequence(tokens, max_tokens, sampler, top_logprobs=top,
                       prompt_logprobs=echo and top is not None, images=prompt.chunks,
                       drafter=self._drafter(params, tokens, predicted),
                       adapters=adapters, thinking=thinking, after_thinking=after)
        batcher, wait = self._batcher, wait or self.step
        made: list[int] = []  # the reply's tokens, for the prediction's counts

        def made_tokens() -> Iterator[int]:
            for token in batcher.tokens(seq, wait):
                made.append(token)
                yield token

        def run(gen: Generation) -> Iterator[str]:
            batcher.join(seq)
            decoder = codecs.getincrementaldecoder("utf-8")("replace")
            try:
                yield from token_loop(
                    gen, made_tokens(),
                    decode=lambda t: decoder.decode(self._piece(t, t in keep)),
                    is_end=self._batch.is_end, final=lambda: decoder.decode(b"", final=True),
                    stops=params.get("stop"), max_tokens=max_tokens,
                    scores=lambda t: seq.scores.popleft())
            finally:
                batcher.leave(seq)
                gen.usage["cached_tokens"] = seq.cached
                if thinking is not None:
                    gen.usage["reasoning_tokens"] = thinking.count
                if predicted is not None:  # OpenAI's counts, drafted or not
                    (gen.usage["accepted_prediction_tokens"],
                     gen.usage["rejected_prediction_tokens"]) = \
                        prediction_counts(predicted, made)
                elif seq.drafter is not None:  # the draft tokens the reply kept
                    gen.usage["accepted_prediction_tokens"] = seq.drafter.accepted

        log = None
        if top is not None:
            log = Log(self._piece, prompt=(
                (lambda: [TokenLogprob(tokens[0], None), *seq.prompt_scores])
                if seq.prompt_logprobs else None))
        generation = Generation(prompt.n_tokens, run, on_close=lambda: batcher.leave(seq),
                                logprobs=log)
        generation.thinking = prompt.thinking
        if prompt.audio_tokens:
            generation.usage["audio_tokens"] = prompt.audio_tokens
        return generation

    def _drafter(self, params: dict, tokens: list, predicted: list | None):
        """The sequence's Drafter, or None: speculation off for the model or the request
        (`speculative: false`), or log probabilities asked (each token is scored as it
        is sampled, one at a time)."""
        if not self.speculative or params.get("speculative") is False \
                or params.get("logprobs") is not None:
            return None
        return Drafter(tokens, predicted, draft_max=self.draft_max)

    def count_tokens(self, messages: list, params: dict) -> int:
        """The prompt's tokens as generate() reads them (an image's among them); nothing
        is computed."""
        prompt = self._prompt(messages, params)
        if prompt.chunks:
            self._batch.projector.free(prompt)
        return prompt.n_tokens

    def _prompt(self, messages: list, params: dict) -> Prompt:
        """The prompt: a completion's own tokens, its prompt text, or the chat template's
        rendering of the messages (and tools), images split out by the projector."""
        model = self._model
        if params.get("prompt_tokens") is not None:  # a completion's own tokens
            tokens = list(params["prompt_tokens"])
            return Prompt(tokens, n_tokens=len(tokens))
        thinking = None  # the state a reasoning reply starts in (reasoning.Plan.prepare)
        if params.get("prompt") is not None:
            text, bos = params["prompt"], model.add_bos_token()
        elif has_images(messages):
            projector = self._batch.projector
            if projector is None:
                raise refuse_media(messages)
            messages, images = texts_and_images(messages, projector.marker)
            if params.get("prompt_template"):  # a cortex-style template: markers in {prompt}
                text = render_template(params["prompt_template"], messages)
            else:
                text, _ = self._format(messages, params.get("tools"),
                                       params.get("template_kwargs"))
                text, thinking = self._thinking(text, params)
            # With the model's BOS unless the template wrote it, as llama-server and
            # llama-cpp-python's own mtmd handlers read a prompt with images.
            bos = model.token_bos()
            bos_text = self._piece(bos, True).decode("utf-8", "replace") if bos >= 0 else ""
            self._fits(text.encode("utf-8"), "messages")
            heard = projector.audio_tokens(images)  # planned before any clip is decoded
            if heard >= self.context:
                raise InvalidField(f"Invalid field 'messages': the prompt's audio is {heard} "
                                   f"tokens (as llama.cpp's mtmd counts its clips) and the "
                                   f"model's context (ctx_len) holds {self.context}; send "
                                   f"shorter clips or start the model with a larger ctx_len",
                                   param="messages")
            prompt = projector.tokenize(text, images,
                                        not (bos_text and text.startswith(bos_text)))
            prompt.thinking = thinking
            return prompt
        else:
            text, bos = self._format(messages, params.get("tools"),
                                     params.get("template_kwargs"))
            text, thinking = self._thinking(text, params)
        data = text.encode("utf-8")
        self._fits(data, "messages")
        tokens = model.tokenize(data, add_bos=bos, special=True)
        return Prompt(tokens, n_tokens=len(tokens), thinking=thinking)

    @staticmethod
    def _thinking(text: str, params: dict) -> tuple[str, str | None]:
        """A rendered chat prompt as a reasoning plan leaves it (closed when thinking is
        off and the template did not close it), and the state the reply starts in
        (localrt.engines.reasoning.Plan.prepare); None without a plan."""
        plan = params.get("reasoning")
        if plan is None:
            return text, None
        return plan.prepare(text)

    def _special_tokens(self, text: str) -> list[int]:
        """A text's tokens, special tokens read from their text (an end marker's)."""
        return self._model.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def _fits(self, data: bytes, field: str) -> None:
        """A 400 for a prompt text that cannot fit the context, before it is tokenized."""
        advice = ("shorten the conversation" if field == "messages" else "shorten it") + \
            " or start the model with a larger ctx_len"
        self._measure.check(len(data), self.context, field, "the prompt", advice)

    def step(self) -> None:
        """One decode for every sequence (localrt.engines.llama.batch.Batcher.step)."""
        self._batcher.step()

    def report(self) -> dict:
        """Its GET /v1/models/status fields (contract.Reporting): speculation's counts."""
        batcher = self._batcher
        out = {"speculative": {"drafted": batcher.drafted, "accepted": batcher.accepted}}
        if batcher.cache is not None:
            out["promptCache"] = batcher.cache.report()
        if not self._rpc_targets:
            out["offload"] = self.offload()
        return out

    def offload(self) -> dict:
        """Its layers on devices as llama.cpp put them: `ngl` as asked ("fit" when the
        scheduler fit it, or when left unset), `layers` of `of` (the blocks and the
        output layer), and each device's bytes (localrt.engines.llama.offload)."""
        placement = self.placement
        devices = [{"name": self._devices[name], "bytes": size}
                   for name, size in placement.devices().items()]
        return {"ngl": self._asked, "layers": placement.on_devices(),
                "of": self._llama_cpp.llama_model_n_layer(self._model.model) + 1,
                "devices": devices}

    def embed(self, inputs: list, compute: Callable | None = None) -> tuple:
        """Embeddings as the start option `embedding` gives them, beside the chats
        (localrt.engines.llama.embedding.EmbeddingContext): each decode is `compute(fn, *args)`
        (the scheduler's compute lane; here when None)."""
        return self._embedding.embed(inputs, compute)

    def counters(self) -> dict:
        """Decode steps so far, and the prompt tokens they read: as the batcher counted
        them, and as llama.cpp did (it counts the tokens of decodes of more than one)."""
        return {"decodes": self._batcher.decodes, "prompt_read": self._batcher.prompt_read,
                "prompt_evaluated": self._batch.prompt_evaluated(),
                "drafted": self._batcher.drafted, "accepted": self._batcher.accepted}

    def _grammar(self, params: dict) -> tuple[str | None, str]:
        """(GBNF, the field it comes from): a grammar of the caller's own (a forced tool
        call's) before response_format's; None when the reply is free."""
        grammar, source = params.get("grammar"), "grammar"
        if not grammar:
            grammar, source = json_grammar(params.get("response_format")), "response_format"
        return grammar, source

    def _sampler(self, params: dict, tokens: list[int], grammar: bool = True):
        """The request's sampler chain (without its grammar, if any, when not `grammar`);
        a 400 for a logit_bias token not in the vocabulary, or a grammar llama.cpp
        cannot parse."""
        n_vocab = self._model.n_vocab()
        bias = []
        for key, value in (params.get("logit_bias") or {}).items():
            token = int(key)
            if not 0 <= token < n_vocab:
                raise InvalidField(f"Invalid field 'logit_bias': token {key} is not in the "
                                   f"model's vocabulary of {n_vocab}", param="logit_bias")
            bias.append((token, float(value)))
        rules, source = self._grammar(params) if grammar else (None, "grammar")
        if rules:
            check_gbnf(rules, source)  # llama.cpp's parser recurses once a group
        def value(name: str) -> float:
            return sampling_value(params, name)

        sampling = Sampling(
            temperature=value("temperature"), top_k=int(value("top_k")), top_p=value("top_p"),
            min_p=value("min_p"), repeat_penalty=value("repeat_penalty"),
            frequency_penalty=value("frequency_penalty"),
            presence_penalty=value("presence_penalty"),
            seed=seed_of(params, 32), bias=tuple(bias), grammar=rules)
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
        model, data = self._model, text.encode("utf-8")
        self._fits(data, "prompt")
        return model.tokenize(data, add_bos=model.add_bos_token(), special=True)

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
        self._fits(prefix.encode("utf-8") + suffix.encode("utf-8"), "prompt")
        bos = [model.token_bos()] if model.add_bos_token() and model.token_bos() >= 0 else []
        return (bos + [pre] + self._text_tokens(prefix) + [suf] + self._text_tokens(suffix)
                + [mid])

    # --- for llama-server's utility routes (localrt.inference.utility) ---------------------

    def encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """A text's tokens as llama-server's POST /tokenize gives them (contract.Vocabulary):
        the BOS (and EOS) the model adds when `add_special`, special tokens read from
        their text when `parse_special`."""
        # llama_tokenize's add_bos is its add_special: BOS and EOS as the vocabulary says.
        return self._model.tokenize(text.encode("utf-8"), add_bos=add_special,
                                    special=parse_special)

    def piece(self, token: int) -> bytes:
        """A token's bytes, a special token's as its text, as llama-server's pieces are."""
        return self._piece(token, True)

    @property
    def media_marker(self) -> str | None:
        """The projector's marker, where an image is in a rendered prompt (random per
        load, as llama-server's); None without a projector."""
        projector = self._batch.projector
        return projector.marker if projector is not None else None

    def render_prompt(self, messages: list, params: dict) -> str:
        """The prompt text generate() would tokenize (contract.Rendering): params["prompt"],
        or the chat template's rendering, a vision model's images as its projector's
        markers (a cortex-style prompt_template around them when params has one)."""
        if params.get("prompt") is not None:
            return params["prompt"]
        if has_images(messages):
            projector = self._batch.projector
            if projector is None:
                raise refuse_media(messages)
            messages, _ = texts_and_images(messages, projector.marker)
            if params.get("prompt_template"):
                return render_template(params["prompt_template"], messages)
        text = self._format(messages, params.get("tools"), params.get("template_kwargs"))[0]
        return self._thinking(text, params)[0]

    def lora_adapters(self) -> list[dict]:
        """Its LoRA adapters as GET /lora-adapters lists them (contract.Adapted):
        {"id", "path", "scale"} each."""
        return self.adapters.listing()

    def set_lora_scales(self, entries: list) -> None:
        """POST /lora-adapters: the scales of the requests that name none
        (contract.Adapted); a 400 naming an unknown id."""
        self.adapters.set_scales(entries)

    def slot_states(self) -> list[dict]:
        """Each slot's state (contract.Slotted: localrt.engines.llama.batch.Batcher's)."""
        return self._batcher.slot_states()

    def _text_tokens(self, text: str) -> list[int]:
        """A text's tokens as plain text: no BOS, and no special token read from it."""
        return self._model.tokenize(self._measure.cut(text.encode("utf-8"), self.context),
                                    add_bos=False, special=False)

    def _piece(self, token: int, special: bool = False) -> bytes:
        """A token's bytes (special tokens render as nothing, as in llama-cpp-python,
        unless `special`)."""
        pieces = self._special_pieces if special else self._pieces
        piece = pieces.get(token)
        if piece is None:
            piece = pieces[token] = token_piece(self._llama_cpp, self._model.vocab, token,
                                                special)
        return piece

    def exercise(self) -> None:
        """For a file's first load in a child (localrt.engines.vetting): tokenize the text
        of every special token (control, user-defined, unknown), and read the piece of
        every token, printed plain and special, as replies and logprobs read them."""
        llama_cpp, vocab = self._llama_cpp, self._model.vocab
        special = (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
                   | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN)
        texts = []
        for token in range(self._model.n_vocab()):
            if llama_cpp.llama_vocab_get_attr(vocab, token) & special:
                texts.append(llama_cpp.llama_vocab_get_text(vocab, token) or b"")
            self._piece(token, False)
            self._piece(token, True)
        self._pieces.clear()
        self._special_pieces.clear()
        self._model.tokenize(b" ".join(texts), add_bos=True, special=True)

    def exercise_audio(self) -> None:
        """For a file's first load in a child (localrt.engines.vetting), with an audio
        projector: a ValueError when its plan refuses a test clip
        (localrt.engines.llama.audiotokens), then one test clip through mtmd and a
        decode, so that a crash of mtmd's happens there, never in the server."""
        from localrt.engines.contract import Audio
        from localrt.engines.llama import audiotokens
        from localrt.errors import HTTPError

        projector = self._batch.projector
        if projector is None or not projector.audio:
            return
        projector.test_clips()
        seconds = audiotokens.TEST_SECONDS[0]
        clip = Audio(data=audiotokens.test_clip(seconds), where="the test clip",
                     format="wav", seconds=seconds)
        messages = [{"role": "user", "content": [
            {"type": "audio", "audio": clip}, {"type": "text", "text": "What is said?"}]}]
        try:
            generation = self.generate(messages, {"max_tokens": 1, "temperature": 0.0,
                                                  "seed": 0})
        except HTTPError as exc:
            if exc.code == "invalid_audio":  # mtmd counted it otherwise than planned
                raise ValueError(f"its projector cannot take a {seconds:g}-second clip: "
                                 f"{exc.message}") from None
            return  # the context cannot hold a clip, or the template refused: not the file's
        try:
            for _ in generation:
                pass
        finally:
            generation.close()

    def _preserved(self, texts) -> frozenset:
        """The ids of the special tokens spelled `texts`, to print as text."""
        ids = set()
        for text in texts or ():
            tokens = self._model.tokenize(text.encode("utf-8"), add_bos=False, special=True)
            if len(tokens) == 1:
                ids.add(tokens[0])
        return frozenset(ids)

    def memory(self) -> dict:
        """RAM and VRAM as llama.cpp accounts them: every buffer it allocated for the
        model and its context (weights, KV cache, compute and output buffers), on the
        host or on devices (localrt.engines.llama.offload), with the projector's and the
        adapters' files in the RAM; `kv` the KV cache's part. Where llama.cpp's log said
        nothing of its buffers, or the model is split across rpc-servers (that part is
        `remote`, in neither), an estimate from the weights and KV cache instead."""
        from localrt.engines import rpc

        llama_cpp, model = self._llama_cpp, self._model
        weights = llama_cpp.llama_model_size(model.model)
        beside = 0
        if self._mmproj:  # the projector's weights, counted with the model's
            beside += Path(self._mmproj).stat().st_size
        for path in self.adapters.paths:  # and so are the adapters'
            beside += Path(path).stat().st_size
        placement = self.placement
        if placement.buffers and not self._rpc_targets:
            return {"ram": placement.host() + beside,
                    "vram": sum(placement.devices().values()),
                    "kv": placement.kv() or self.kv_bytes()}
        weights += beside
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

    def _format(self, messages: list, tools: list | None = None,
                kwargs: dict | None = None) -> tuple[str, bool]:
        """The prompt from the GGUF's chat template, rendered within bounds
        (localrt.engines.chattemplate; llama-2's format if it has none), given `tools`
        as Hugging Face's apply_chat_template gives them, and `kwargs` (chat_template_kwargs,
        a reasoning plan's enable_thinking and reasoning_effort), and whether llama.cpp
        adds the BOS. A template past its bounds, or that fails, is InvalidChatTemplate; its
        own raise_exception() is InvalidField on 'messages'."""
        from llama_cpp import llama_chat_format

        from localrt.engines import chattemplate

        if self._formatter is None:
            template = self._metadata.get("tokenizer.chat_template")
            if template:
                vocab, get = self._model.vocab, self._llama_cpp.llama_vocab_get_text

                def text(token: int) -> str:
                    return (get(vocab, token) or b"").decode("utf-8", "replace") \
                        if token >= 0 else ""

                try:
                    self._formatter = chattemplate.ChatTemplate(
                        template, eos_token=text(self._model.token_eos()),
                        bos_token=text(self._model.token_bos()), context=self.context)
                except chattemplate.TemplateRefused as exc:
                    self._formatter = exc  # refused at every chat, never compiled again
            else:
                self._formatter = llama_chat_format.format_llama2
        formatter = self._formatter
        try:
            if isinstance(formatter, chattemplate.TemplateRefused):
                raise formatter
            if isinstance(formatter, chattemplate.ChatTemplate):
                return formatter.render(messages, tools, kwargs=kwargs), False  # it writes the BOS
            out = formatter(messages=messages, tools=tools)
        except chattemplate.TemplateRefused as exc:
            raise InvalidChatTemplate(f"Model {self.name}'s chat template is refused: {exc}; "
                                      f"give it a prompt_template of its own (localrt "
                                      f"models update {self.name} --prompt_template ...) "
                                      f"or use /v1/completions", param="model") from None
        except Exception as exc:  # the template's raise_exception(), llama-2's errors
            raise InvalidField(f"Invalid field 'messages': the model's chat template "
                               f"refused them: {exc}", param="messages") from None
        return out.prompt, not out.added_special

    def unload(self) -> None:
        """Free the sequences, the context and the model (no step runs any more)."""
        self._embedding.close()
        with self._batcher.stepping():
            self._batcher.close()
            self._batch.close()
            self._model.close()
        self._release_rpc()

    def _release_rpc(self) -> None:
        if self._rpc_targets:
            self._rpc.release(self._rpc_targets)
            self._rpc_targets = []
