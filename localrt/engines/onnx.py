"""onnx-runtime: onnxruntime-genai, for ONNX model folders.

`OnnxEngine` loads a folder as an `OnnxModel`, which serves one request at a time (a
fresh Generator per request) and counts a chat's tokens (localrt.engines.contract's
Counting). Log probabilities (localrt.engines.logprobs) come from
Generator.get_logits() before each generate_next_token(); it cannot score a prompt.
onnxruntime_genai is imported only when a model loads, from its engine folder.

A reasoning model (localrt.engines.reasoning; its template is tokenizer_config.json's
chat_template, so the model is Templated) follows the request's Plan as the llama
engine does: its prompt is rendered by localrt's own ChatTemplate (onnxruntime-genai's
apply_chat_template takes no template variables: enable_thinking, reasoning_effort),
prepared by the plan, and the state it leaves the reply in is the Generation's
`thinking`; a Tracker follows the reply's tokens (reasoning_tokens), and at the budget
the end marker's tokens are appended to the generator (Generator.append_tokens) and go
to the reply as if the model wrote them, after which the model answers.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Iterator

from localrt.engines.generation import (GeneratingModel, Generation, check_room, seed_of,
                                        sampling_value, token_loop)
from localrt.errors import InvalidChatTemplate, InvalidField
from localrt.engines.logprobs import Log, certain, scored

ONNX_ENGINE = "onnx-runtime"


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
                         min(context, options.get("ctx_len") or context),
                         _tokenizer_config(folder), options.get("model") or folder.name)

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


def _tokenizer_config(folder: Path) -> dict:
    """tokenizer_config.json's fields (none when it is missing or unreadable: the
    model then has no template of its own for localrt)."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def chat_template_of(config) -> str | None:
    """tokenizer_config.json's chat_template (`config`, its parsed JSON), or None where it
    has none: what an ONNX model chats with (and what the registry reads its
    capabilities from)."""
    template = config.get("chat_template") if isinstance(config, dict) else None
    return template if isinstance(template, str) and template else None


def _token_text(value) -> str:
    """A tokenizer_config token: a string, or an added token's {"content"}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class OnnxModel(GeneratingModel):
    """A loaded ONNX model; a fresh Generator per request. `chat_template` is
    tokenizer_config.json's (None without one)."""

    def __init__(self, og, model, tokenizer, context: int, config: dict | None = None,
                 name: str = "onnx"):
        self._og, self._model, self._tokenizer, self._context = og, model, tokenizer, context
        self.name = name  # the model's id as messages name it
        config = config or {}
        self.chat_template = chat_template_of(config)
        self._specials = (_token_text(config.get("eos_token")),
                          _token_text(config.get("bos_token")))
        self._formatter = None  # the compiled template (or the TemplateRefused), at first use

    def generate(self, messages: list, params: dict) -> Generation:
        """Tokenize and check now; compute token by token as the Generation is read."""
        og, tok = self._og, self._tokenizer
        ids, state = self._prompt(messages, params)
        room = check_room(len(ids), self._context)
        max_tokens = min(params.get("max_tokens") or room, room)
        search = {"max_length": len(ids) + max_tokens, "random_seed": seed_of(params, 31)}
        temperature = sampling_value(params, "temperature")
        if temperature > 0:
            search.update(do_sample=True, temperature=float(temperature),
                          top_p=float(sampling_value(params, "top_p")),
                          top_k=int(sampling_value(params, "top_k")))
        if params.get("repeat_penalty"):
            search["repetition_penalty"] = float(params["repeat_penalty"])
        OnnxEngine.check_request(params)
        eos = {int(t) for t in tok.eos_token_ids}
        top = params.get("logprobs")
        scores: collections.deque = collections.deque()
        plan = params.get("reasoning")
        thinking = None if state is None else \
            plan.tracker(state, self._piece, lambda text: list(tok.encode(text)))

        def run(gen: Generation) -> Iterator[str]:
            gen_params = og.GeneratorParams(self._model)
            gen_params.set_search_options(**search)
            generator = og.Generator(self._model, gen_params)
            generator.append_tokens(ids)

            def tokens_out() -> Iterator[int]:
                made = 0
                while not generator.is_done():
                    # The model's logits for the next token, read before the search
                    # samples from them: its own log-probabilities (localrt.engines.logprobs).
                    logits = None if top is None else self._logits(generator)
                    generator.generate_next_token()
                    token = int(generator.get_next_tokens()[0])
                    if logits is not None:
                        scores.append(scored(logits, token, top))
                    made += 1
                    yield token
                    forced = thinking.step(token) if thinking is not None else []
                    forced = forced[:max_tokens - made]  # max_tokens bounds the whole reply
                    if forced:
                        # The end of thinking, written by localrt: certain, never counted.
                        thinking.forced(forced)
                        # get_logits() runs the model on the token just sampled first:
                        # append_tokens() alone would feed the written ones without it.
                        generator.get_logits()
                        generator.append_tokens(forced)
                        for written in forced:
                            if top is not None:
                                scores.append(certain(written, top))
                            made += 1
                            yield written

            try:
                yield from token_loop(gen, tokens_out(), decode=tok.create_stream().decode,
                                      is_end=eos.__contains__, stops=params.get("stop"),
                                      max_tokens=max_tokens,
                                      scores=lambda t: scores.popleft())
            finally:
                if thinking is not None:
                    gen.usage["reasoning_tokens"] = thinking.count

        generation = Generation(len(ids), run,
                                logprobs=None if top is None else Log(self._piece))
        generation.thinking = state
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
        return len(self._prompt(messages, params)[0])

    def _prompt(self, messages: list, params: dict):
        """(token ids, state): the prompt text, or the chat template's rendering (by
        localrt's ChatTemplate for a reasoning plan, prepared by it; else by the
        tokenizer's apply_chat_template), and the state it leaves a reasoning reply in
        (None without a plan)."""
        prompt, state = params.get("prompt"), None
        plan = params.get("reasoning")
        if prompt is None and plan is not None and self.chat_template:
            prompt, state = plan.prepare(self._render(messages,
                                                      params.get("template_kwargs") or {}))
        elif prompt is None:
            prompt = self._tokenizer.apply_chat_template(json.dumps(messages),
                                                         add_generation_prompt=True)
        return self._tokenizer.encode(prompt), state

    def _render(self, messages: list, kwargs: dict) -> str:
        """The chat template's rendering with the template's variables, by localrt's
        ChatTemplate (compiled once); a 400 for a template or messages it refuses."""
        from localrt.engines import chattemplate

        if self._formatter is None:
            eos, bos = self._specials
            try:
                self._formatter = chattemplate.ChatTemplate(
                    self.chat_template, eos_token=eos, bos_token=bos, context=self._context)
            except chattemplate.TemplateRefused as exc:
                self._formatter = exc  # refused at every chat, never compiled again
        try:
            if isinstance(self._formatter, chattemplate.TemplateRefused):
                raise self._formatter
            return self._formatter.render(messages, kwargs=kwargs)
        except chattemplate.TemplateRefused as exc:
            raise InvalidChatTemplate(f"Model {self.name}'s chat template is refused: {exc}",
                                      param="model") from None
        except chattemplate.MessagesRefused as exc:
            raise InvalidField(f"Invalid field 'messages': the model's chat template "
                               f"refused them: {exc}", param="messages") from None

    def unload(self) -> None:
        """Drop the model; onnxruntime frees it with the last reference."""
        self._model = None
