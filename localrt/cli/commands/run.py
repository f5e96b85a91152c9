"""`localrt run` (and `models run`): pull the model if needed, or import the GGUF file
it names, start it, and chat with it, or answer one prompt and exit as `ollama run` does.

A prompt comes from the PROMPT words and, when stdin is not a terminal, from stdin
(before them): `localrt run ID "a prompt"`, `echo a prompt | localrt run ID`. Without
one, the session reads messages (localrt.cli.chat). A prompt longer than the model's
stored ctx_len holds starts it with a longer one, when it was trained on more and no
--ctx_len is given (`_fitting`).
"""

from __future__ import annotations

import os

from localrt.cli.chat import Chat, reasons_of
from localrt.cli.commands.models import context_for, start_options
from localrt.cli.commands.pull import download
from localrt.cli.context import CliError, Context, ExitCode
from localrt.cli.follow import open_events
from localrt.client import ApiError


def cmd_run(ctx: Context) -> int:
    """Make the model ready, then chat with it in the terminal or answer one prompt."""
    prompt = _prompt(ctx)
    client = ctx.client()
    model_id = ready(ctx, client, ctx.args.model, pull=True)
    think = ctx.args.think
    if think not in (None, False) and not reasons_of(client, model_id):
        raise CliError(f"Model '{model_id}' does not support thinking; run it without "
                       f"--think", ExitCode.USAGE)
    reply = client.start_model(model_id, {**_fitting(client, model_id, prompt),
                                          **start_options(ctx)})
    ctx.err(reply["message"])

    def load(given: str) -> str:  # /load: a local model, or a file imported, started
        loaded = ready(ctx, client, given, pull=False)
        ctx.err(client.start_model(loaded)["message"])
        return loaded

    chat = Chat(ctx, client, model_id, load=load, verbose=ctx.args.verbose, think=think,
                hide_thinking=ctx.args.hidethinking)
    return chat.loop() if prompt is None else chat.once(prompt)


# Tokens of context kept for the reply when a prompt sizes it.
REPLY_ROOM = 2048
# The bytes of text a token is counted as when a prompt sizes the context: fewer than
# most tokenizers put in one (about 4 in English), so the estimate errs long.
BYTES_PER_TOKEN = 3


def _fitting(client, model_id: str, prompt: str | None) -> dict:
    """The start options that make room for a one-shot prompt and its reply: a ctx_len
    (within what the model was trained on) when its stored one is too short; {} for a
    session, a prompt that fits, or a remote model."""
    if prompt is None:
        return {}
    need = len(prompt.encode("utf-8")) // BYTES_PER_TOKEN + REPLY_ROOM
    record = client.get_model(model_id)
    if record.get("upstreams") or need <= (record.get("ctx_len") or 0):
        return {}
    return {"ctx_len": context_for(record, -(-need // 1024) * 1024)}


def _prompt(ctx: Context) -> str | None:
    """The one prompt to answer: stdin's text (when stdin is no terminal), then the
    PROMPT words, joined by a space as Ollama joins them; None for a session."""
    words = list(ctx.args.prompt)
    if ctx.interactive:
        return " ".join(words) if words else None
    piped = ctx.stdin.read().strip() if ctx.stdin is not None else ""
    prompt = " ".join([piped, *words] if piped else words)
    if not prompt.strip():
        raise CliError("Nothing to answer: give a PROMPT, or text on standard input",
                       ExitCode.USAGE)
    return prompt


def ready(ctx: Context, client, given: str, pull: bool) -> str:
    """The id of the model `given` names, imported if it is a file on disk, pulled
    (when `pull`) if it is not local yet."""
    path = _path(given)
    if path is not None:
        return _imported(ctx, client, path)
    if _downloaded(client, given):
        return given
    if not pull:
        raise CliError(f"Couldn't find model '{given}'; `localrt pull {given}` downloads it")
    ctx.err(f"Model {given} is not downloaded yet; pulling it")
    return _pull_for_run(ctx, client, given)


def _path(given: str) -> str | None:
    """The absolute path when ID names a file or folder on disk (/..., ./..., ../...,
    ~/..., or an existing NAME.gguf here), else None: an id."""
    if given.startswith(("/", "./", "../", "~/")) or \
            given.lower().endswith(".gguf") and os.path.isfile(given):
        return os.path.abspath(os.path.expanduser(given))
    return None


def _imported(ctx: Context, client, path: str) -> str:
    """The model imported from `path`: the one already imported from it, else a new
    import (linked, its id the file's name), asking nothing."""
    for model in client.list_models():
        source = model.get("source") or {}
        if source.get("type") == "import" and source.get("path") == path:
            return model["id"]
    try:
        reply = client.import_model(path)
    except ApiError as exc:
        if exc.status != 409:
            raise
        raise CliError(f"{exc.message}; `localrt models import --path {path} --id NEW_ID` "
                       f"imports the file under another id") from None
    model_id = reply["model"]["id"]
    ctx.err(f"Imported {path} as model {model_id}")
    return model_id


def _downloaded(client, model_id: str) -> bool:
    """Whether the server has this model (downloaded or imported)."""
    try:
        client.get_model(model_id)
    except ApiError as exc:
        if exc.status != 404:
            raise
        return False
    return True


def _pull_for_run(ctx: Context, client, model_id: str) -> str:
    """Pull a model, following its progress; return the local id it got."""
    code, model = download(ctx, client, open_events(client), model_id, None)
    if code != ExitCode.OK:
        raise CliError(f"Model {model_id} was not downloaded", code)
    return model
