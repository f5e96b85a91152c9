"""`localrt run` (and `models run`): pull the model if needed, start it, chat with it."""

from __future__ import annotations

from localrt.cli.chat import Chat
from localrt.cli.commands.models import start_options
from localrt.cli.commands.pull import download
from localrt.cli.context import CliError, Context, ExitCode
from localrt.cli.follow import open_events
from localrt.client import ApiError


def cmd_run(ctx: Context) -> int:
    """Pull the model if needed, start it, then chat with it in the terminal."""
    model_id = ctx.args.model
    client = ctx.client()
    if not _downloaded(client, model_id):
        ctx.err(f"Model {model_id} is not downloaded yet; pulling it")
        model_id = _pull_for_run(ctx, client, model_id)
    reply = client.start_model(model_id, start_options(ctx))
    ctx.err(reply["message"])
    return Chat(ctx, client, model_id).loop()


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
