"""Text completions, OpenAI compatible (the legacy API): the prompt, the choices, the reply.

`Completions.create(body)` takes a request that passed schemas/completion.json and
returns either the text_completion dict or a `Stream` of Server-Sent Events. As with
chat, every check that can fail happens before either is returned.

The prompt is raw text or tokens, never a chat template (nor a model's
prompt_template): a string, an array of strings (one choice each, in order), an array
of token ids, or an array of such arrays. Token prompts need a model that takes them
(localrt.adapters: `detokenize`, params["prompt_tokens"]). `suffix` makes a
fill-in-the-middle prompt with the model's FIM tokens (`fim_prompt`); a model without
them is a 400 naming `suffix`. `echo` puts the prompt's text before the completion.
The sampling fields are chat's (localrt.chat.SAMPLING): a field left out takes the
model's stored parameter, and the model's own stop sequences always apply; max_tokens
defaults to 16, as OpenAI's does. `logprobs` is refused for now, and `n` and `best_of`
can only be 1. The choices are generated one after another in one turn of the model
(`Lease.steps` paces their tokens), so a reply with several is as long as their sum.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Iterator

from localrt.chat import SAMPLING
from localrt.errors import InvalidField, ServiceUnavailable
from localrt.scheduler import Lease, ModelStopped, Scheduler

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16  # OpenAI's, when neither the request nor the model says


class Completions:
    """Turns completion requests into generations on the scheduler's running models.

    At most `max_requests` are in progress (generating or queued) at once: each holds a
    server thread (localrt.server.THREADS). Past that, a 503.
    """

    def __init__(self, registry, scheduler: Scheduler, max_requests: int = 8):
        self._registry = registry
        self._scheduler = scheduler
        self.max_requests = max_requests
        self._slots = threading.BoundedSemaphore(max_requests)

    def create(self, body: dict):
        """A text_completion dict, or a Stream when body["stream"] is true."""
        model_id = body["model"]
        record = self._registry.get(model_id)  # 404 before anything starts
        for name in ("n", "best_of"):
            if body.get(name) not in (None, 1):
                raise InvalidField(f"Invalid field '{name}': only {name}=1 is supported",
                                   param=name)
        if body.get("logprobs") is not None:
            raise InvalidField("Invalid field 'logprobs': log probabilities are not "
                               "supported yet", param="logprobs")
        prompts = read_prompt(body["prompt"])
        if body.get("suffix") is not None and not all(isinstance(p, str) for p in prompts):
            raise InvalidField("Invalid field 'suffix': a suffix needs a text prompt",
                               param="suffix")
        if not self._slots.acquire(blocking=False):
            raise ServiceUnavailable(f"Too many completion requests in progress (at most "
                                     f"{self.max_requests}); retry shortly",
                                     headers=[("Retry-After", "1")])
        try:
            lease = self._scheduler.lease(model_id, purpose="a completion request")
        except BaseException:
            self._slots.release()
            raise
        lease.on_release(self._slots.release)
        choices: list = []
        try:
            params = _params(body, record, lease.options)
            for i, prompt in enumerate(prompts):
                field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                choices.append(_choice(lease.model, model_id, field, prompt, body, params))
        except BaseException:
            for _, generation in choices:
                generation.close()
            lease.release()
            raise
        completion = TextCompletion(model_id, choices, lease)
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return Stream(completion, include_usage)
        try:
            return completion.complete()
        finally:
            completion.close()


def read_prompt(value) -> list:
    """The prompts as a list of strings and token lists (the schema allows only these
    shapes): a string or one token array is a single prompt. Token ids become ints:
    JSON Schema counts 1.0 as an integer."""
    if isinstance(value, str):
        return [value]
    if value and not isinstance(value[0], (str, list)):
        return [[int(v) for v in value]]
    return [v if isinstance(v, str) else [int(t) for t in v] for v in value]


def _params(body: dict, record: dict, options: dict) -> dict:
    """Sampling parameters: the request's, else the model's stored ones, else 16 tokens."""
    params = {k: record[k] for k in SAMPLING if record.get(k) is not None}
    params.update((k, body[k]) for k in SAMPLING if body.get(k) is not None)
    params.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    for name in ("max_tokens", "top_k"):  # 8.0 passes the schema as an integer
        if params.get(name) is not None:
            params[name] = int(params[name])
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    for s in options.get("stop") or []:  # the model's own stop sequences always apply
        if s not in stops:
            stops.append(s)
    params["stop"] = stops
    if body.get("logit_bias"):
        params["logit_bias"] = body["logit_bias"]
    return params


def _choice(model, model_id: str, field: str, prompt, body: dict, params: dict):
    """(the echoed text, the Generation) of one prompt; a 400 naming `field` for a
    prompt the model cannot take."""
    params = dict(params)
    suffix, tokens = body.get("suffix"), None
    if suffix is not None:
        fim = getattr(model, "fim_prompt", None)
        tokens = fim(prompt, suffix) if fim else None
        if tokens is None:
            raise InvalidField(f"Invalid field 'suffix': model {model_id} has no "
                               f"fill-in-the-middle tokens, so it cannot take a suffix",
                               param="suffix")
    elif isinstance(prompt, list):
        if not hasattr(model, "detokenize"):
            raise InvalidField(f"Invalid field '{field}': model {model_id}'s engine takes "
                               f"text prompts only", param="prompt")
        n_vocab = getattr(model, "n_vocab", None)
        bad = next((t for t in prompt if n_vocab and not 0 <= t < n_vocab), None)
        if bad is not None:
            raise InvalidField(f"Invalid field '{field}': token {bad} is not in the model's "
                               f"vocabulary of {n_vocab}", param="prompt")
        tokens = prompt
    text = prompt if isinstance(prompt, str) else model.detokenize(prompt)
    if tokens is None and hasattr(model, "tokenize"):
        count = len(model.tokenize(text))
    else:
        count = None if tokens is None else len(tokens)
    context = getattr(model, "context", None)
    if count == 0:
        raise InvalidField(f"Invalid field '{field}': the prompt is empty", param="prompt")
    if count is not None and isinstance(context, int) and count >= context:
        raise InvalidField(f"Invalid field '{field}': the prompt is {count} tokens and the "
                           f"model's context (ctx_len) holds {context}; shorten it or start "
                           f"the model with a larger ctx_len", param="prompt")
    if tokens is None:
        params["prompt"] = text
    else:
        params["prompt_tokens"] = tokens
    # Engines that honour params["prompt"] never read the messages; others chat it.
    generation = model.generate([{"role": "user", "content": text}], params)
    return (text if body.get("echo") else ""), generation


class TextCompletion:
    """One completion request: its id, its choices ((echo, Generation) pairs, read one
    after another), and the lease it holds."""

    def __init__(self, model_id: str, choices: list, lease: Lease):
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_id = model_id
        self.choices = choices
        self._lease = lease

    def pieces(self, generation) -> Iterator[str]:
        """A choice's text pieces as the scheduler computes them; ModelStopped if the
        model stops."""
        return self._lease.steps(generation)

    def usage(self) -> dict:
        """OpenAI's usage object, over every choice."""
        prompt = sum(g.usage["prompt_tokens"] for _, g in self.choices)
        completion = sum(g.usage["completion_tokens"] for _, g in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def complete(self) -> dict:
        """The whole reply as a text_completion."""
        choices = []
        for i, (echo, generation) in enumerate(self.choices):
            text = echo + "".join(self.pieces(generation))
            generation.close()  # its sequence is done; the next choice's starts
            choices.append({"text": text, "index": i, "logprobs": None,
                            "finish_reason": generation.finish_reason or "stop"})
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model_id, "choices": choices, "usage": self.usage()}

    def close(self) -> None:
        """Stop generating (if still going) and give the model to the next request."""
        try:
            for _, generation in self.choices:
                generation.close()
        finally:
            self._lease.release()


class Stream:
    """The reply as Server-Sent Events of text_completion chunks; close() frees the model.

    Each choice sends its echo (when asked), its pieces, then an empty text with its
    finish_reason; with stream_options.include_usage a last chunk with no choices
    carries the usage, as chat's does.
    """

    content_type = "text/event-stream"

    def __init__(self, completion: TextCompletion, include_usage: bool):
        self._completion = completion
        self._include_usage = include_usage

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.chunks():
            yield _sse(chunk)
        yield b"data: [DONE]\n\n"

    def chunks(self) -> Iterator[dict]:
        """The reply as text_completion chunk dicts; one {"error": ...} dict ends a reply
        that failed part way. Ollama's /api/generate (localrt.ollama) translates these."""
        completion = self._completion
        try:
            for i, (echo, generation) in enumerate(completion.choices):
                if echo:
                    yield self._event(i, echo)
                for piece in completion.pieces(generation):
                    yield self._event(i, piece)
                generation.close()
                yield self._event(i, "", generation.finish_reason or "stop")
        except Exception as exc:
            if isinstance(exc, ModelStopped):
                error = exc.body()["error"]
            else:
                log.exception("generation failed in a stream of %s", completion.model_id)
                error = {"message": f"Generation failed: {exc}", "type": "server_error",
                         "code": "generation_failed"}
            yield {"error": error}
            return
        if self._include_usage:
            yield self._chunk([], usage=completion.usage())

    def close(self) -> None:
        """Called by the server when the reply ends or the client goes away."""
        self._completion.close()

    def _event(self, index: int, text: str, finish_reason: str | None = None) -> dict:
        choice = {"text": text, "index": index, "logprobs": None,
                  "finish_reason": finish_reason}
        return self._chunk([choice])

    def _chunk(self, choices: list, usage: dict | None = None) -> dict:
        c = self._completion
        chunk = {"id": c.id, "object": "text_completion", "created": c.created,
                 "model": c.model_id, "choices": choices}
        if self._include_usage:
            chunk["usage"] = usage
        return chunk


def _sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode("utf-8") + b"\n\n"
