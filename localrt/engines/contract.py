"""The engine contract: what an engine object and the models it loads have.

Each part is a runtime-checkable `typing.Protocol`, checked where it matters and
nowhere else:

  * an engine object is an `Engine` (localrt.engines.catalog checks a built-in
    adapter when it makes it, localrt.engines.plugins a custom engine when it loads
    its entry point); `ChecksOptions` and `ChecksRequests` are the engine's own rules,
    which the catalog asks before anything waits;
  * the model it loads is a `Model`, or a `ChatModel` of the older contract that
    `generating` wraps into one (localrt.engines.generation.ChatOnlyModel);
  * what else a model can do (`OPTIONAL`: `Batched`, `Measured`, `Tokenizing`,
    `Counting`, `Embedding`, `Reranking`, `Templated`, `Reporting`, and for llama-server's
    utility routes `Vocabulary`, `Rendering`, `Slotted` and `Adapted`) is found once, by
    `capabilities`, when localrt.inference.scheduler loads it, and recorded in its
    Running record; the inference modules ask that record (Lease.can), never the model.

Every model's generate() raises InvalidField before it computes anything (a prompt
longer than the context, a bad response_format or grammar), so a streamed reply never
starts with an error. It does no locking of its own: localrt.inference.scheduler lets
one request at a time use a model (`slots` at a time for a Batched one), and runs
each token, or each step, on a compute lane. gguf-cpp batches (localrt.engines.llama.model);
onnx-runtime serves one request at a time (localrt.engines.onnx). llama_cpp and
onnxruntime_genai are imported only when a model loads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Protocol, runtime_checkable

from localrt.engines.generation import ChatOnlyModel, Generation

# --- what a request gives a model ----------------------------------------------------


@dataclass(frozen=True)
class Image:
    """An image of a request, as its bytes (PNG, JPEG, BMP or GIF, not checked yet), and
    `where` the request had it ("messages[0].content[1]"), for the error that names it.

    A chat message with images reaches a vision model's generate() with its content as
    a list of parts, in order: {"type": "text", "text": ...} and {"type": "image",
    "image": Image}. A message without images has its content as one string.
    """

    data: bytes = field(repr=False)
    where: str

    @property
    def digest(self) -> str:
        """The SHA-256 of the bytes: the prompt cache's key for the image's tokens."""
        return hashlib.sha256(self.data).hexdigest()


@dataclass(frozen=True)
class Audio:
    """An audio clip of a request, as its bytes (WAV, MP3 or FLAC, checked by signature
    and length), its `format` ("wav", "mp3", "flac"), its length in `seconds` (read from
    the header, or estimated for an MP3), and `where` the request had it.

    It reaches an audio model's generate() as a part {"type": "audio", "audio": Audio}
    of a message's content, beside text and image parts; the projector's own decoder
    (llama.cpp's mtmd) decodes it.
    """

    data: bytes = field(repr=False)
    where: str
    format: str = "wav"
    seconds: float = 0.0

    @property
    def digest(self) -> str:
        """The SHA-256 of the bytes: the prompt cache's key for the clip's tokens."""
        return hashlib.sha256(self.data).hexdigest()


# --- engines ---------------------------------------------------------------------------


@runtime_checkable
class Engine(Protocol):
    """An engine: its `name`, the `format` of the models it runs (GGUF, ONNX, ...), a
    one-line `description`, and load(). A custom engine may also have a `version`."""

    name: str
    format: str
    description: str

    def load(self, model_path: str, options: dict) -> object:
        """A loaded Model (or ChatModel) of the file or folder at `model_path`, with the
        start options `options` (schemas/model-start.json's names) and the absolute path
        of each file the model has beside its weights, under its role's key
        (localrt.models.roles: `mmproj`, a projector GGUF)."""


@runtime_checkable
class ChecksOptions(Protocol):
    """An engine's own rule on start options, asked before a model starts."""

    def check_options(self, options: dict) -> Iterable[tuple[str, str]]:
        """(option, why) for each start option the engine cannot take."""


@runtime_checkable
class ChecksRequests(Protocol):
    """An engine's own rule on chat requests, asked before a request waits."""

    def check_request(self, params: dict) -> None:
        """Raise InvalidField for a chat request the engine cannot serve (its
        response_format, tools, tool_choice ("auto", "none", "required" or
        "function", with tool_function its name) and logprobs)."""


# --- models ----------------------------------------------------------------------------


@runtime_checkable
class Model(Protocol):
    """A loaded model: generate() and unload().

    `params` come from localrt.inference.chat and localrt.inference.completions:
    OpenAI's sampling fields (`response_format` as {"type": "json_object"} or
    {"type": "json_schema", "schema"}) plus `prompt` (the text of a model's
    prompt_template, or a completion's prompt, used instead of the chat template when
    present) and `stop` (a list). For tool calls (localrt.engines.toolcalls): `tools`
    (OpenAI's list, given to the chat template as Hugging Face gives it), `grammar`
    (GBNF that constrains the reply instead of response_format) and `preserved_tokens`
    (special tokens printed as their text, as a call's syntax needs). For log
    probabilities (localrt.engines.logprobs): `logprobs` (how many alternatives each
    token's comes with, 0 to 20; absent or None: none) and `prompt_logprobs` (score
    the prompt's tokens too: a completion's echo). A Tokenizing model's generate()
    also takes `prompt_tokens` (a completion's own tokens). For a reasoning model
    (localrt.engines.reasoning): `template_kwargs` (more variables for the chat
    template: enable_thinking, reasoning_effort, chat_template_kwargs) and `reasoning`
    (the request's reasoning.Plan: an engine that follows it prepares the rendered
    prompt with it, sets the Generation's `thinking` to the state it gives, and
    counts `reasoning_tokens` in its usage, and keeps the plan's budget; one that does
    not may ignore both: its reply is then split as if its prompt were the model's
    template rendered as it is (reasoning.Plan.state), and a request with a budget
    while thinking is on is a 400 naming reasoning_budget).
    """

    def generate(self, messages: list, params: dict) -> Generation:
        """A Generation: an iterator of text pieces, one per token (or fewer while a
        stop sequence might be starting); its `finish_reason`, `usage` and
        `stop_sequence` (the one of params["stop"] that ended it) are set once it is
        exhausted, and close() stops it. Its `usage` may also count `cached_tokens`
        (prompt tokens a batched model found in its cache). An engine that computes
        log probabilities gives the Generation a Log when params["logprobs"] asks; a
        Generation without one makes chat and completions answer a 400."""

    def unload(self) -> None:
        """Free the model; it is never used again."""


@runtime_checkable
class ChatModel(Protocol):
    """The older contract custom engines may keep: chat() and unload(). `generating`
    wraps such a model, so its chats are generated like any other's."""

    def chat(self, messages: list, params: dict, stream: bool):
        """A dict {"content", "finish_reason", "usage": {"prompt_tokens",
        "completion_tokens"}}, or with `stream` an iterator of text pieces."""

    def unload(self) -> None:
        """Free the model."""


@runtime_checkable
class Batched(Protocol):
    """A model that serves `slots` generations at once, in steps: each step() gives
    every generation its next token (gguf-cpp's n_parallel sequences in one context,
    localrt.engines.llama.batch). localrt.inference.scheduler lets `slots` requests in
    at once and runs the steps on a compute lane, one at a time."""

    slots: int

    def step(self) -> None:
        """One decode for every generation that needs a token."""

    def generate(self, messages: list, params: dict,
                 wait: Optional[Callable[[], None]] = None) -> Generation:
        """As Model.generate; the Generation calls `wait()` whenever its next token is
        not computed yet (the scheduler's wait for the next step; the model's own
        step() when None)."""


@runtime_checkable
class Measured(Protocol):
    """A model that knows its memory better than the RSS delta measured around its load."""

    def memory(self) -> dict:
        """{"ram", "vram"[, "kv"][, "remote"]} in bytes (kv: its KV cache, part of ram or
        vram; remote: what rpc-servers hold)."""


@runtime_checkable
class Tokenizing(Protocol):
    """A model whose tokens localrt.inference.completions can see: it checks token
    prompts, counts text prompts and builds fill-in-the-middle prompts, and passes
    params["prompt_tokens"] to generate()."""

    n_vocab: int  # how many token ids there are: each is below it
    context: int  # the tokens a prompt and its reply may fill

    def tokenize(self, text: str) -> list:
        """A prompt text's tokens, as generate() reads params["prompt"]."""

    def detokenize(self, tokens) -> str:
        """The text of tokens."""

    def fim_prompt(self, prefix: str, suffix: str) -> Optional[list]:
        """A fill-in-the-middle prompt's tokens; None without the vocabulary's FIM tokens."""


@runtime_checkable
class Counting(Protocol):
    """A model that counts a chat's prompt tokens without generating (Anthropic's
    count_tokens)."""

    def count_tokens(self, messages: list, params: dict) -> int:
        """The prompt's tokens as generate() would read them, computing nothing."""


@runtime_checkable
class Embedding(Protocol):
    """A model that gives embeddings (POST /v1/embeddings): one loaded in an embedding
    mode only, whose generate() is a 409, or a chat model that embeds beside its
    generations (gguf-cpp's decoders: localrt.engines.llama.embedding)."""

    def embed(self, inputs: list, compute: Callable) -> tuple:
        """(vectors, tokens read): one vector per input, a text or a token list. Each
        batch it computes is `compute(fn, *args)` (fn's result), on the scheduler's
        compute lane, so a Batched model's steps take turns with the batches and wait
        for one at most; nothing is computed outside it."""


@runtime_checkable
class Reranking(Protocol):
    """A model that scores documents against a query (POST /v1/rerank): a reranker, one
    whose GGUF pools by rank, loaded in llama.cpp's embedding mode, whose generate() is a
    409 (gguf-cpp's: localrt.engines.llama.rerank)."""

    def rerank(self, query: str, documents: list, compute: Callable) -> tuple:
        """(scores, tokens read): one float per document, in order, each read with the
        query as the model pairs them. Each batch it computes is `compute(fn, *args)`,
        as Embedding.embed's."""


@runtime_checkable
class Templated(Protocol):
    """A model with a Jinja chat template (localrt.engines.toolcalls reads its call
    format from it)."""

    chat_template: Optional[str]  # None when the model has none after all


@runtime_checkable
class Reporting(Protocol):
    """A model with more to say in its GET /v1/models/status row (/metrics reads it)."""

    def report(self) -> dict:
        """The row's extra fields, read under the scheduler's lock (cheap, no llama.cpp
        call): gguf-cpp's {"speculative": {"drafted", "accepted"}}, draft tokens
        proposed and kept since it loaded."""


@runtime_checkable
class Vocabulary(Protocol):
    """A model whose vocabulary llama-server's utility routes read (POST /tokenize and
    /detokenize: localrt.inference.utility). Both run outside the model's turns, beside
    its generations, so they only read the vocabulary (llama.cpp's tokenizer is safe to
    call so, as llama-server calls it from its HTTP threads)."""

    n_vocab: int  # how many token ids there are: each is below it

    def encode(self, text: str, add_special: bool, parse_special: bool) -> list:
        """A text's tokens: with the vocabulary's BOS (and EOS) when `add_special` and
        the model adds them, the text of a special token read as that token when
        `parse_special`. Not bounded by the context: any text is counted."""

    def piece(self, token: int) -> bytes:
        """A token's bytes, a special token's as its text (llama-server's pieces); the
        caller checks that the token is below n_vocab."""


@runtime_checkable
class Rendering(Protocol):
    """A model that says the prompt text a chat's messages become (POST /apply-template)."""

    media_marker: Optional[str]  # the text an image is in that prompt; None: no images

    def render_prompt(self, messages: list, params: dict) -> str:
        """The text generate() would tokenize for `messages` and `params` (Model's):
        params["prompt"] when given, else the chat template's rendering with
        params["tools"] (a vision model's images as its projector's markers)."""


@runtime_checkable
class Slotted(Protocol):
    """A model that says what each of its slots holds (GET /slots)."""

    def slot_states(self) -> list:
        """One dict per slot, in id order: {"processing" (a generation holds it),
        "prompt_tokens" (its generation's prompt, or its last one's), "cached_tokens"
        (the tokens its KV cache holds)}; read without calling the engine."""


@runtime_checkable
class Adapted(Protocol):
    """A model that applies LoRA adapters (the start option `lora`: localrt.models.roles),
    each request with its own scales (params["lora"], llama-server's [{"id", "scale"}];
    generate() raises InvalidField naming lora[i].id for an adapter it does not have)."""

    def lora_adapters(self) -> list:
        """GET /lora-adapters: {"id", "path", "scale"} per adapter, in the option's
        order; the scale is the one a request that names none gets."""

    def set_lora_scales(self, entries: list) -> None:
        """POST /lora-adapters: llama-server's [{"id", "scale"}] become the scales of
        the requests that name none (an adapter left out: 0); InvalidField naming
        `[i].id` for one it does not have."""


# What a loaded model may have besides Model's: `capabilities` finds these.
OPTIONAL = (Batched, Measured, Tokenizing, Counting, Embedding, Reranking, Templated,
            Reporting, Vocabulary, Rendering, Slotted, Adapted)


def missing(obj, protocol: type) -> list[str]:
    """The members of `protocol` that `obj` lacks, in the protocol's order."""
    names = list(getattr(protocol, "__annotations__", {}))
    names += [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
    return [n for n in names if not hasattr(obj, n)]


def generating(model) -> Model:
    """A loaded model as a Model: the model itself, or a ChatOnlyModel around one of
    the older ChatModel contract."""
    return model if isinstance(model, Model) else ChatOnlyModel(model)


def capabilities(model) -> frozenset:
    """The OPTIONAL protocols a loaded model has, found once when it loads. A
    ChatOnlyModel has its engine model's (it passes their calls on), but it cannot
    batch: its generations read chat()'s pieces."""
    wrapped = isinstance(model, ChatOnlyModel)
    own = model.model if wrapped else model
    found = {p for p in OPTIONAL if isinstance(own, p)}
    if Batched in found and (wrapped or not isinstance(own.slots, int) or own.slots < 1
                             or not callable(own.step)):
        found.discard(Batched)
    return frozenset(found)
