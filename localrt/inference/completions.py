"""Text completions (the legacy API): a native.TextRequest made into a reply of events.

`Completions.create(request)` gives a `native.Reply`; as with chat, every check that can
fail happens before it is returned. OpenAI's reading and writing of them is
localrt.dialects.openai's.

The prompt is raw text or tokens, never a chat template (nor a model's
prompt_template): each of `request.prompts` (strings or token-id lists) is one choice,
in order. Token prompts need a model that takes them
(localrt.engines.contract.Tokenizing, params["prompt_tokens"]). `suffix` makes a
fill-in-the-middle prompt with the model's FIM tokens (`fim_prompt`); a model without
them is a 400 naming `suffix`. `echo` puts the prompt's text before the completion.
The sampling fields are chat's (localrt.native.SAMPLING): a field left out takes the
model's stored parameter, and the model's own stop sequences always apply; max_tokens
defaults to 16, as OpenAI's does. The choices are generated one after another in one
turn of the model (`Lease.steps` paces their tokens), so a reply with several is as
long as their sum.

The events: for each choice a Choice, its echo (a Text, after the Logprobs of the
prompt's tokens, which are known once the prompt is read: so a streamed echo waits
for the first piece), its pieces (each after the Logprobs of its tokens, whose
`base` is the prompt's length when it is not echoed, as OpenAI's text_offset
counts), and a Finish; one Usage over all of them last. With `echo` and logprobs the
engine scores the prompt too (gguf-cpp reads it whole then, without its cached
prefix); an engine that cannot, or a suffix (the echo is only the prefix), is a 400
naming logprobs.

Each request takes chat's path (localrt.inference.requests): timed and counted in
/metrics, and a remote model's request goes to an upstream's /v1/completions (its
`logprobs` too): as the client sent it on OpenAI's route (`passthrough`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from localrt import native
from localrt.admission import LIMITS, Disconnected, never
from localrt.engines import contract
from localrt.errors import InvalidField
from localrt.inference.requests import Kind, Local, RequestPath
from localrt.inference.running import Lease
from localrt.metrics import Clock
from localrt.remote import wire


DEFAULT_MAX_TOKENS = 16  # OpenAI's, when neither the request nor the model says


class Completions:
    """Turns completion requests into generations on the scheduler's running models.

    At most `max_requests` are in progress (generating or waiting for their turn) at
    once: each holds a server thread (localrt.server). Past that a request waits for a
    place in line, and past the queue it is a 503 (localrt.admission). It takes the one
    path of localrt.inference.requests: a remote model's goes to its upstreams.
    """

    def __init__(self, path: RequestPath, max_requests: int = LIMITS["completion"]):
        self._path = path
        self.kind = Kind("completion", "/completions", max_requests, queue=path.queue)
        self.admission = self.kind.admission

    def create(self, request: native.TextRequest, disconnected: Disconnected = never):
        """The reply (a native.Reply) to `request`; a remote model's goes to its
        upstreams, written and read back by localrt.remote.wire."""
        return self._path.serve(
            self.kind, request.model, lambda local: self._create(local, request),
            remote=lambda forward: wire.text_reply(
                forward(wire.completion_body(request))),
            disconnected=disconnected)

    def passthrough(self, body: dict, disconnected: Disconnected = never):
        """For a remote model, its upstream's own reply to OpenAI's completion body as the
        client sent it; None for a model loaded here (RequestPath.passthrough)."""
        return self._path.passthrough(self.kind, body, disconnected)

    def _create(self, local: Local, request: native.TextRequest):
        prompts = request.prompts
        if request.suffix is not None and not all(isinstance(p, str) for p in prompts):
            raise InvalidField("Invalid field 'suffix': a suffix needs a text prompt",
                               param="suffix")
        if request.logprobs is not None and request.echo and request.suffix is not None:
            raise InvalidField("Invalid field 'logprobs': an echoed prompt's log "
                               "probabilities need a prompt without suffix (the echo is "
                               "the prefix only)", param="logprobs")
        model_id = local.model_id
        lease = local.lease(purpose="a completion request")
        choices: list = []
        try:
            params = _params(request, local.record, lease.options)
            params.update(lease.lora(request.lora))
            for i, prompt in enumerate(prompts):
                field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                choices.append(_choice(lease, model_id, field, prompt, request, params))
        except BaseException:
            for choice in choices:
                choice.generation.close()
            lease.release()
            raise
        completion = TextCompletion(model_id, choices, lease, local.clock)
        return native.Reply(completion.events(request.stream), completion.close,
                            completion.prompt_tokens)


def read_prompt(value) -> list:
    """The prompts as a list of strings and token lists (completion.json and
    embedding.json allow only these shapes): a string or one token array is a single
    prompt. Token ids become ints: JSON Schema counts 1.0 as an integer."""
    if isinstance(value, str):
        return [value]
    if value and not isinstance(value[0], (str, list)):
        return [[int(v) for v in value]]
    return [v if isinstance(v, str) else [int(t) for t in v] for v in value]


def _params(request: native.TextRequest, record: dict, options: dict) -> dict:
    """Sampling parameters: the request's, else the model's stored ones, else 16 tokens."""
    params = {k: record[k] for k in native.SAMPLING if record.get(k) is not None}
    params.update((k, v) for k, v in request.sampling.items() if v is not None)
    params.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    for name in ("max_tokens", "top_k"):  # 8.0 passes the schema as an integer
        if params.get(name) is not None:
            params[name] = int(params[name])
    stops = list(request.stop)
    for s in options.get("stop") or []:  # the model's own stop sequences always apply
        if s not in stops:
            stops.append(s)
    params["stop"] = stops
    if request.logit_bias:
        params["logit_bias"] = request.logit_bias
    if request.speculative is False:
        params["speculative"] = False
    if request.logprobs is not None:  # the alternatives; echo scores the prompt too
        params["logprobs"] = int(request.logprobs)
        params["prompt_logprobs"] = bool(request.echo)
    return params


def _choice(lease: Lease, model_id: str, field: str, prompt, request: native.TextRequest,
            params: dict) -> "Choice":
    """One prompt's Choice; a 400 naming `field` for a prompt the model cannot take,
    and one naming logprobs when its engine cannot give what they ask."""
    params = dict(params)
    model, tokenizing = lease.model, lease.can(contract.Tokenizing)
    suffix, tokens = request.suffix, None
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
    return Choice(text if request.echo else "", text, generation)


@dataclass
class Choice:
    """One prompt's completion: the text it echoes ("" without echo), the prompt's text
    (log-probabilities' offsets count from its start, echoed or not, as OpenAI's), and
    its Generation."""

    echo: str
    prompt: str
    generation: object

    def logprobs(self) -> native.Logprobs | None:
        """The Logprobs of the tokens whose text went out since the last call; None when
        not asked for."""
        log = self.generation.logprobs
        return None if log is None else native.Logprobs(log.take(), len(self.prompt))

    def echoed(self) -> native.Logprobs | None:
        """The Logprobs of the echoed prompt's tokens (its first has no log-probability),
        once the prompt is read; None when not asked for, or not echoed."""
        log = self.generation.logprobs
        if log is None or not self.echo:
            return None
        return native.Logprobs(log.prompt(self.echo))


class TextCompletion:
    """One completion request: its Choices (read one after another), the lease it holds,
    and the `Clock` it is timed on (its first piece is the time to first token; all
    choices' tokens are counted)."""

    def __init__(self, model_id: str, choices: list, lease: Lease, clock: Clock | None = None):
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

    def prompt_tokens(self) -> int:
        """The prompts' tokens, over every choice."""
        return sum(c.generation.usage["prompt_tokens"] for c in self.choices)

    def usage(self) -> dict:
        """The tokens read and written, over every choice."""
        prompt = self.prompt_tokens()
        completion = sum(c.generation.usage["completion_tokens"] for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion}

    def events(self, streamed: bool) -> Iterator:
        """The reply's native events (see the module); a failure ends them with Failed."""
        try:
            for i, choice in enumerate(self.choices):
                yield native.Choice(i)
                if streamed:
                    yield from self._streamed(choice)
                else:
                    yield from self._whole(choice)
        except Exception as exc:  # noqa: BLE001 - the reply has started: say so in it
            yield native.Failed(exc)
            return
        usage = self.usage()
        yield native.Usage(usage["prompt_tokens"], usage["completion_tokens"])

    def _whole(self, choice: Choice) -> Iterator:
        generation = choice.generation
        text = "".join(self.pieces(generation))
        generation.close()  # its sequence is done; the next choice's starts
        echoed = choice.echoed()
        if echoed is not None:
            yield echoed
        if choice.echo:
            yield native.Text(choice.echo)
        out = choice.logprobs()
        if out is not None:
            yield out
        yield native.Text(text)
        yield native.Finish(generation.finish_reason or "stop")

    def _streamed(self, choice: Choice) -> Iterator:
        generation = choice.generation
        pieces = iter(self.pieces(generation))
        if choice.echo:
            first = None
            if generation.logprobs is not None:  # the prompt's are known once it is read
                first = next(pieces, None)
            echoed = choice.echoed()
            if echoed is not None:
                yield echoed
            yield native.Text(choice.echo)
            if first is not None:
                yield from self._piece(choice, first)
        for piece in pieces:
            yield from self._piece(choice, piece)
        generation.close()
        out = choice.logprobs()
        if out is not None:
            yield out
        yield native.Finish(generation.finish_reason or "stop")

    @staticmethod
    def _piece(choice: Choice, piece: str) -> Iterator:
        out = choice.logprobs()
        if out is not None:
            yield out
        yield native.Text(piece)

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
