"""llama-server's utility routes on a running model: its tokens, its prompt, its slots.

Clients written for llama.cpp's server (its web UI, editors' plugins, token counters,
prompt tools) call these beside the OpenAI routes; each answers in llama-server's
own shape:

    tokenize        {"tokens": [id, ...]}, or with `with_pieces` [{"id", "piece"}],
                    a piece that is not UTF-8 by itself as the list of its bytes
    detokenize      {"content"}: the tokens' pieces, special tokens as their text
    apply_template  {"prompt"}: the text a chat request's messages (and tools) become,
                    rendered as chat renders it (Chats.prompt_text)
    props           the model's context, slots, chat template, modalities and build
    slots           one row per slot: {id, state, n_ctx, prompt_tokens, cached_tokens}
    lora_adapters   one row per LoRA adapter: {id, path, scale}; POST sets the scales
                    of the requests that give none (llama-server's global scales,
                    until the model stops)

Each names its model (`model`; when it is left out, the one running model); a model
that is not running is a 409 model_not_running (none is started for a look at it),
one that is not there a 404, a remote model a 400 (its upstreams answer their own
routes). Nothing here computes: each reads the model outside its turns
(Scheduler.using, whose unload waits for the read), beside its generations, as
llama-server reads its vocabulary from its HTTP threads. What a model can answer is
its engine's (localrt.engines.contract's Vocabulary, Rendering and Slotted); an
engine without one is a 400 naming the model.
"""

from __future__ import annotations

from types import SimpleNamespace

from localrt import __version__, native
from localrt.engines import contract
from localrt.errors import HTTPError, InvalidField, ServiceUnavailable, shown
from localrt.inference.chat import Chats
from localrt.inference.requests import RequestPath
from localrt.models.ids import check_id
from localrt.models.registry import capabilities, weights_path


class Utility:
    """Answers llama-server's utility routes on the scheduler's running models (see the
    module); `chats` renders a chat's prompt as chat does."""

    def __init__(self, path: RequestPath, chats: Chats):
        self._path = path
        self._chats = chats

    def tokenize(self, body: dict) -> dict:
        """POST /tokenize: the tokens of body["content"] (add_special, default false:
        the BOS the model adds; parse_special, default true: special tokens read from
        their text; with_pieces: each token with its piece)."""
        model_id = self.model_of(body.get("model"))
        with self._path.scheduler.using(model_id) as use:
            model = self._can(use, model_id, contract.Vocabulary, "tokenize")
            tokens = model.encode(body["content"], bool(body.get("add_special", False)),
                                  body.get("parse_special", True) is not False)
            if not body.get("with_pieces"):
                return {"tokens": tokens}
            return {"tokens": [{"id": t, "piece": _piece(model.piece(t))} for t in tokens]}

    def detokenize(self, body: dict) -> dict:
        """POST /detokenize: the text of body["tokens"], each token's piece in turn
        (special tokens as their text; bytes that are not UTF-8 as U+FFFD); a 400
        naming the first token that is not in the vocabulary."""
        model_id = self.model_of(body.get("model"))
        with self._path.scheduler.using(model_id) as use:
            model = self._can(use, model_id, contract.Vocabulary, "detokenize")
            n_vocab = model.n_vocab
            # JSON Schema's integers include 5.0: each is made an int for llama.cpp.
            tokens = [int(t) for t in body["tokens"]]
            for i, token in enumerate(tokens):
                if not 0 <= token < n_vocab:
                    raise InvalidField(f"Invalid field 'tokens[{i}]': token {shown(token)} is "
                                       f"not in the vocabulary of {model_id} (0 to "
                                       f"{n_vocab - 1})", param=f"tokens[{i}]")
            data = b"".join(model.piece(t) for t in tokens)
        return {"content": data.decode("utf-8", "replace")}

    def apply_template(self, request: native.Request) -> dict:
        """POST /apply-template: {"prompt"}, the text chat would have the model read for
        the request's messages and tools (its chat template, or its prompt_template),
        nothing generated. Its media are read and checked first, as chat reads them."""
        model_id = self.model_of(request.model or None)
        record = self._path.registry.get(model_id)
        messages = self._chats.messages(SimpleNamespace(model_id=model_id, record=record),
                                        request)
        with self._path.scheduler.using(model_id) as use:
            self._can(use, model_id, contract.Rendering, "render a chat template")
            return {"prompt": self._chats.prompt_text(request, record, use, messages)}

    def props(self, model: str | None) -> dict:
        """GET /props: the model's context and slots, the stored parameters its requests
        start from, its chat template, modalities (and a vision model's media marker)
        and the build that runs it."""
        model_id = self.model_of(model)
        record = self._path.registry.get(model_id)
        with self._path.scheduler.using(model_id) as use:
            running = use.running
            template = use.model.chat_template if use.can(contract.Templated) else None
            marker = use.model.media_marker if use.can(contract.Rendering) else None
            context = _context(use)
        params = {k: record[k] for k in native.SAMPLING if record.get(k) is not None}
        own = capabilities(record)
        params["stop"] = list(use.options.get("stop") or [])
        build = self._build(running.engine)
        path = weights_path(record)
        extra = {"media_marker": marker} if marker else {}
        return {"model": model_id, "engine": running.engine,
                "default_generation_settings": {"n_ctx": context, "params": params},
                "total_slots": running.slots,
                "model_path": str(path) if path is not None else "",
                "chat_template": template or "",
                "modalities": {"vision": "vision" in own, "audio": "audio" in own},
                "build_info": f"localrt {__version__}" + (f", {build}" if build else ""),
                "is_sleeping": False, **extra}

    def slots(self, model: str | None, fail_on_no_slot: bool = False) -> list[dict]:
        """GET /slots: one row per slot of the model, {id, state ("idle" or
        "processing"), n_ctx, prompt_tokens, cached_tokens}; a 503 with
        `fail_on_no_slot` when none is idle. An engine that cannot say what a slot
        holds gives its counts as null, its slots' states from the requests in them."""
        model_id = self.model_of(model)
        with self._path.scheduler.using(model_id) as use:
            context = _context(use)
            if use.can(contract.Slotted):
                states = use.model.slot_states()
            else:
                held = min(use.running.active, use.running.slots)
                states = [{"processing": i < held, "prompt_tokens": None,
                           "cached_tokens": None} for i in range(use.running.slots)]
        rows = [{"id": i, "state": "processing" if s["processing"] else "idle",
                 "n_ctx": context, "prompt_tokens": s["prompt_tokens"],
                 "cached_tokens": s["cached_tokens"]} for i, s in enumerate(states)]
        if fail_on_no_slot and all(row["state"] == "processing" for row in rows):
            raise ServiceUnavailable(f"No slot of model {model_id} is idle")
        return rows

    def lora_adapters(self, model: str | None) -> list[dict]:
        """GET /lora-adapters: the model's LoRA adapters, {id, path, scale} each, in the
        order a request's lora[].id counts them (none for an engine without them)."""
        model_id = self.model_of(model)
        with self._path.scheduler.using(model_id) as use:
            if not use.can(contract.Adapted):
                return []
            return use.model.lora_adapters()

    def set_lora_adapters(self, model: str | None, entries: list) -> dict:
        """POST /lora-adapters: llama-server's [{id, scale}] become the scales of the
        model's requests that give none (an adapter left out: 0) until it stops; a 400
        naming [i].id for an adapter it does not have. It changes only what the next
        requests decode with: nothing is computed."""
        model_id = self.model_of(model)
        with self._path.scheduler.using(model_id) as use:
            if entries and not use.can(contract.Adapted):
                raise InvalidField(f"Invalid field '[0].id': model {model_id} has no LoRA "
                                   f"adapters", param="[0].id")
            if use.can(contract.Adapted):
                use.model.set_lora_scales(entries)
        return {"success": True}

    def model_of(self, given: str | None) -> str:
        """The model a request names (a 400 for an id no model can have, a 404 for one
        that is not there, a 400 for a remote model), or when it names none the one
        running model (a 400 naming `model` when none runs, or several do)."""
        path = self._path
        if given is not None:
            check_id(given)
            if path.is_remote(path.registry.get(given)):
                raise InvalidField(f"Invalid field 'model': {given} is a remote model; its "
                                   f"upstreams answer their own utility routes, these read "
                                   f"models loaded here", param="model")
            return given
        running = sorted(row["id"] for row in path.scheduler.status())
        if len(running) == 1:
            return running[0]
        which = f"{len(running)} models are running ({', '.join(running)})" if running \
            else "no model is running"
        raise InvalidField(f"Missing required field 'model': {which}; name one",
                           param="model")

    @staticmethod
    def _can(use, model_id: str, protocol: type, what: str):
        """The running model, once it has `protocol`; else a 400 naming the model."""
        if not use.can(protocol):
            raise InvalidField(f"Invalid field 'model': the engine of {model_id} "
                               f"({use.running.engine}) cannot {what}", param="model")
        return use.model

    def _build(self, engine: str) -> str | None:
        """The build a running model's engine loaded with ("gguf-cpp/<variant>/<version>"),
        or None for an engine whose builds are not tracked."""
        try:
            build = self._path.engines.build(engine)  # kept since the model loaded
        except HTTPError:  # its engine cannot load any more (uninstalled meanwhile)
            return None
        return build[0] if build else None


def _context(use) -> int | None:
    """The tokens one slot's prompt and reply may fill: the model's own count, else its
    ctx_len start option."""
    if use.can(contract.Tokenizing):
        return use.model.context
    return getattr(use.model, "context", None) or use.options.get("ctx_len")


def _piece(data: bytes):
    """A piece as llama-server writes it: its text, or the list of its bytes when they
    are not UTF-8 by themselves (a character split over several tokens)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)
