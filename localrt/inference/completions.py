"""Text completions, OpenAI compatible (the legacy API): the prompt, the choices, the reply.

`Completions.create(body)` takes a request that passed schemas/completion.json and
returns either the text_completion dict or a `Stream` of Server-Sent Events. As with
chat, every check that can fail happens before either is returned.

The prompt is raw text or tokens, never a chat template (nor a model's
prompt_template): a string, an array of strings (one choice each, in order), an array
of token ids, or an array of such arrays. Token prompts need a model that takes them
(localrt.engines.contract.Tokenizing, params["prompt_tokens"]). `suffix` makes a
fill-in-the-middle prompt with the model's FIM tokens (`fim_prompt`); a model without
them is a 400 naming `suffix`. `echo` puts the prompt's text before the completion.
The sampling fields are chat's (localrt.inference.chat.SAMPLING): a field left out takes the
model's stored parameter, and the model's own stop sequences always apply; max_tokens
defaults to 16, as OpenAI's does. `n` and `best_of` can only be 1. The choices are
generated one after another in one turn of the model (`Lease.steps` paces their
tokens), so a reply with several is as long as their sum.

`logprobs` (0 to 20 alternatives) gives each choice OpenAI's legacy object: tokens,
token_logprobs, top_logprobs (a dict per token of the alternatives and the chosen
token) and text_offset (characters from the start of the prompt's text, echoed or
not, as OpenAI counts them); localrt.engines.logprobs computes and writes them. With `echo`
the prompt's tokens come first, the first with nulls (nothing came before it): the
engine scores the prompt too (gguf-cpp reads it whole then, without its cached
prefix); an engine that cannot, or a suffix (the echo is only the prefix), is a 400
naming logprobs.

Each request takes chat's path (localrt.inference.requests): timed and counted in
/metrics, and a remote model's request goes whole to an upstream's /v1/completions
(its `logprobs` too).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Iterator

from localrt.engines import contract
from localrt.errors import InvalidField
from localrt.engines import logprobs
from localrt.inference.chat import SAMPLING
from localrt.admission import LIMITS, Disconnected, never
from localrt.inference.requests import EventStream, Kind, Local, RequestPath, respond, stream_error
from localrt.inference.running import Lease
from localrt.metrics import Clock


DEFAULT_MAX_TOKENS = 16  # OpenAI's, when neither the request nor the model says


class Completions:
    """Turns completion requests into generations on the scheduler's running models.

    At most `max_requests` are in progress (generating or queued) at once: each holds a
    server thread (localrt.server.THREADS). Past that, a 503. A request takes the one
    path of localrt.inference.requests: a remote model's goes to its upstreams.
    """

    def __init__(self, path: RequestPath, max_requests: int = LIMITS["completion"]):
        self._path = path
        self.kind = Kind("completion", "/completions", max_requests)
        self.admission = self.kind.admission

    def create(self, body: dict, disconnected: Disconnected = never):
        """A text_completion dict, or a Stream when body["stream"] is true."""
        return self._path.serve(self.kind, body, lambda local: self._create(local, body),
                                disconnected=disconnected)

    def _create(self, local: Local, body: dict):
        for name in ("n", "best_of"):
            if body.get(name) not in (None, 1):
                raise InvalidField(f"Invalid field '{name}': only {name}=1 is supported",
                                   param=name)
        prompts = read_prompt(body["prompt"])
        if body.get("suffix") is not None and not all(isinstance(p, str) for p in prompts):
            raise InvalidField("Invalid field 'suffix': a suffix needs a text prompt",
                               param="suffix")
        if body.get("logprobs") is not None and body.get("echo") and \
                body.get("suffix") is not None:
            raise InvalidField("Invalid field 'logprobs': an echoed prompt's log "
                               "probabilities need a prompt without suffix (the echo is "
                               "the prefix only)", param="logprobs")
        model_id = local.model_id
        lease = local.lease(purpose="a completion request")
        choices: list = []
        try:
            params = _params(body, local.record, lease.options)
            for i, prompt in enumerate(prompts):
                field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                choices.append(_choice(lease, model_id, field, prompt, body, params))
        except BaseException:
            for choice in choices:
                choice.generation.close()
            lease.release()
            raise
        return respond(body, TextCompletion(model_id, choices, lease, local.clock), Stream)


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
    if body.get("speculative") is False:
        params["speculative"] = False
    if body.get("logprobs") is not None:  # the alternatives; echo scores the prompt too
        params["logprobs"] = int(body["logprobs"])
        params["prompt_logprobs"] = bool(body.get("echo"))
    return params


def _choice(lease: Lease, model_id: str, field: str, prompt, body: dict,
            params: dict) -> "Choice":
    """One prompt's Choice; a 400 naming `field` for a prompt the model cannot take,
    and one naming logprobs when its engine cannot give what they ask."""
    params = dict(params)
    model, tokenizing = lease.model, lease.can(contract.Tokenizing)
    suffix, tokens = body.get("suffix"), None
    if suffix is not None:
        tokens = model.fim_prompt(prompt, suffix) if tokenizing else None
        if tokens is None:
            raise InvalidField(f"Invalid field 'suffix': model {model_id} has no "
                               f"fill-in-the-middle tokens, so it cannot take a suffix",
                               param="suffix")
    elif isinstance(prompt, list):
        if not tokenizing:
            raise InvalidField(f"Invalid field '{field}': model {model_id}'s engine takes "
                               f"text prompts only", param="prompt")
        n_vocab = model.n_vocab
        bad = next((t for t in prompt if n_vocab and not 0 <= t < n_vocab), None)
        if bad is not None:
            raise InvalidField(f"Invalid field '{field}': token {bad} is not in the model's "
                               f"vocabulary of {n_vocab}", param="prompt")
        tokens = prompt
    text = prompt if isinstance(prompt, str) else model.detokenize(prompt)
    if tokens is None and tokenizing:
        count = len(model.tokenize(text))
    else:
        count = None if tokens is None else len(tokens)
    context = model.context if tokenizing else None
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
    generation = lease.generate([{"role": "user", "content": text}], params)
    log = generation.logprobs
    if params.get("logprobs") is not None and (
            log is None or (params["prompt_logprobs"] and not log.scores_prompt)):
        generation.close()
        what = "an echoed prompt's log" if log is not None else "log"
        raise InvalidField(f"Invalid field 'logprobs': model {model_id}'s engine does not "
                           f"give {what} probabilities", param="logprobs")
    return Choice(text if body.get("echo") else "", text, generation)


@dataclass
class Choice:
    """One prompt's completion: the text it echoes ("" without echo), the prompt's text
    (logprobs' text_offset counts from its start, echoed or not, as OpenAI's), and its
    Generation."""

    echo: str
    prompt: str
    generation: object

    def logprobs(self) -> dict | None:
        """The legacy logprobs object of the tokens whose text went out since the last
        call; None when not asked for."""
        log = self.generation.logprobs
        return None if log is None else logprobs.legacy(log.take(), len(self.prompt))

    def echoed(self) -> dict | None:
        """The legacy logprobs object of the echoed prompt's tokens (its first has
        nulls), once the prompt is read; None when not asked for, or not echoed."""
        log = self.generation.logprobs
        if log is None or not self.echo:
            return None
        return logprobs.legacy(log.prompt(self.echo))

    def all_logprobs(self) -> dict | None:
        """The echoed prompt's and then the reply's: a whole reply's logprobs object."""
        echoed, out = self.echoed(), self.logprobs()
        if echoed is None or out is None:
            return out
        return {key: echoed[key] + out[key] for key in out}


class TextCompletion:
    """One completion request: its id, its Choices (read one after another), the lease
    it holds, and the `Clock` it is timed on (its first piece is the time to first
    token; all choices' tokens are counted)."""

    def __init__(self, model_id: str, choices: list, lease: Lease, clock: Clock | None = None):
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_id = model_id
        self.choices = choices
        self._lease = lease
        self._clock = clock or Clock(None, model_id)

    def pieces(self, generation) -> Iterator[str]:
        """A choice's text pieces as the scheduler computes them; ModelStopped if the
        model stops."""
        for piece in self._lease.steps(generation):
            self._clock.piece()
            yield piece

    def usage(self) -> dict:
        """OpenAI's usage object, over every choice."""
        prompt = sum(c.generation.usage["prompt_tokens"] for c in self.choices)
        completion = sum(c.generation.usage["completion_tokens"] for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def complete(self) -> dict:
        """The whole reply as a text_completion."""
        choices = []
        for i, choice in enumerate(self.choices):
            generation = choice.generation
            text = choice.echo + "".join(self.pieces(generation))
            generation.close()  # its sequence is done; the next choice's starts
            choices.append({"text": text, "index": i,
                            "logprobs": choice.all_logprobs(),
                            "finish_reason": generation.finish_reason or "stop"})
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model_id, "choices": choices, "usage": self.usage()}

    def close(self) -> None:
        """Stop generating (if still going), give the model to the next request, and
        count the completion."""
        try:
            for choice in self.choices:
                choice.generation.close()
        finally:
            try:
                self._lease.release()
            finally:
                self._clock.done()
                self._clock.end(self.usage())


class Stream(EventStream):
    """The reply as Server-Sent Events of text_completion chunks; close() frees the model.

    Each choice sends its echo (when asked), its pieces, then an empty text with its
    finish_reason; with stream_options.include_usage a last chunk with no choices
    carries the usage, as chat's does. With logprobs each chunk carries those of the
    tokens whose text it sends (the echo's: the prompt's, known once the prompt is
    read, so the echo waits for the first piece), the last one those left.
    """

    def __init__(self, completion: TextCompletion, include_usage: bool):
        self._completion = completion
        self._include_usage = include_usage

    def chunks(self) -> Iterator[dict]:
        """The reply as text_completion chunk dicts; one {"error": ...} dict ends a reply
        that failed part way. Ollama's /api/generate (localrt.dialects.ollama) translates these."""
        completion = self._completion
        try:
            for i, choice in enumerate(completion.choices):
                yield from self._choice(i, choice)
        except Exception as exc:  # noqa: BLE001 - the reply has started: say so in it
            yield stream_error(exc, completion.model_id)
            return
        if self._include_usage:
            yield self._chunk([], usage=completion.usage())

    def _choice(self, i: int, choice: Choice) -> Iterator[dict]:
        generation = choice.generation
        pieces = iter(self._completion.pieces(generation))
        if choice.echo:
            first = None
            if generation.logprobs is not None:  # the prompt's are known once it is read
                first = next(pieces, None)
            yield self._event(i, choice.echo, choice.echoed())
            if first is not None:
                yield self._event(i, first, choice.logprobs())
        for piece in pieces:
            yield self._event(i, piece, choice.logprobs())
        generation.close()
        yield self._event(i, "", choice.logprobs(), generation.finish_reason or "stop")

    def close(self) -> None:
        """Called by the server when the reply ends or the client goes away."""
        self._completion.close()

    def _event(self, index: int, text: str, logprobs: dict | None = None,
               finish_reason: str | None = None) -> dict:
        if logprobs is not None and not logprobs["tokens"]:
            logprobs = None  # nothing of this chunk's text came from a token
        choice = {"text": text, "index": index, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        return self._chunk([choice])

    def _chunk(self, choices: list, usage: dict | None = None) -> dict:
        c = self._completion
        chunk = {"id": c.id, "object": "text_completion", "created": c.created,
                 "model": c.model_id, "choices": choices}
        if self._include_usage:
            chunk["usage"] = usage
        return chunk
