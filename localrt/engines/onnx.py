"""onnx-runtime: onnxruntime-genai, for ONNX model folders.

`OnnxEngine` loads a folder as an `OnnxModel`, which serves one request at a time (a
fresh Generator per request) and counts a chat's tokens (localrt.engines.contract's
Counting). Log probabilities (localrt.engines.logprobs) come from
Generator.get_logits() before each generate_next_token(); it cannot score a prompt.
onnxruntime_genai is imported only when a model loads, from its engine folder.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Iterator

from localrt.engines.generation import (GeneratingModel, Generation, check_room, seed_of,
                                        sampling_value, token_loop)
from localrt.errors import InvalidField
from localrt.engines.logprobs import Log, scored

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

        def run(gen: Generation) -> Iterator[str]:
            gen_params = og.GeneratorParams(self._model)
            gen_params.set_search_options(**search)
            generator = og.Generator(self._model, gen_params)
            generator.append_tokens(ids)

            def tokens_out() -> Iterator[int]:
                while not generator.is_done():
                    # The model's logits for the next token, read before the search
                    # samples from them: its own log-probabilities (localrt.engines.logprobs).
                    logits = None if top is None else self._logits(generator)
                    generator.generate_next_token()
                    token = int(generator.get_next_tokens()[0])
                    if logits is not None:
                        scores.append(scored(logits, token, top))
                    yield token

            yield from token_loop(gen, tokens_out(), decode=tok.create_stream().decode,
                                  is_end=eos.__contains__, stops=params.get("stop"),
                                  max_tokens=max_tokens, scores=lambda t: scores.popleft())

        return Generation(len(ids), run,
                          logprobs=None if top is None else Log(self._piece))

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
