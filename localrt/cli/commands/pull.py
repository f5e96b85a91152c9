"""`localrt pull`: download a model from the hub, asking which variant or file on a
terminal when the id leaves a choice open, and following the download to its end.
`localrt run` pulls through `download` too.
"""

from __future__ import annotations

import contextlib

from localrt.cli.context import CliError, Context, ExitCode
from localrt.cli.follow import follow, open_events, polled_events
from localrt.cli.menu import ask_number, list_choices
from localrt.client import ApiError
from localrt.fsutil import human_size

# The line added to a pull's error when the hub cannot be reached (a 502 from the server).
ON_DISK = ("A GGUF file already on disk needs no hub: `localrt run ./model.gguf` imports "
           "it and chats, `localrt models import --path FILE` imports it.")


def cmd_pull(ctx: Context) -> int:
    """Download a model from the hub, following its progress until it is registered."""
    client = ctx.client()
    # The event stream opens first, so that no event of the task the pull starts is missed.
    return download(ctx, client, open_events(client), ctx.args.model, ctx.args.file)[0]


def download(ctx: Context, client, stream, model_id: str,
             file: str | None) -> tuple[int, str]:
    """Start a pull and follow it until it ends: (exit code, the model's local id).

    `stream` is the event stream, opened before the pull (None: poll instead).
    """
    with stream or contextlib.nullcontext():
        try:
            started = _start_pull(ctx, client, model_id, file)
        except ApiError as exc:
            if exc.status != 502:  # 502: the hub cannot be reached, or answers nonsense
                raise
            raise CliError(f"{exc}\n{ON_DISK}") from None
        if isinstance(started, str):  # already downloaded
            return ExitCode.OK, started
        model, pull_id, task = started
        code = follow(ctx, client, stream or polled_events(client), task,
                      f"Model {model}", "downloaded successfully!", f"localrt pull {pull_id}")
        return code, model


def _start_pull(ctx: Context, client, model_id: str, file: str | None):
    """POST the pull; return (model id, id to pull again, task), or the model's id if it
    is already downloaded. On a terminal, an id that leaves a choice open asks first."""
    if file is None and ctx.interactive:
        model_id = _ask_variant(ctx, client, model_id)
    pull_id = model_id if file is None else f"{model_id}:{file}"
    try:
        reply = client.pull_model(model_id, file)
    except ApiError as exc:
        files, task_id = exc.body.get("files"), exc.body.get("taskId")
        if exc.status == 400 and isinstance(files, list) and files and file is None \
                and (exc.body.get("error") or {}).get("param") == "file":
            choices = exc.body.get("choices") or [{"file": f} for f in files]
            return _start_pull(ctx, client, model_id, _choose_file(ctx, model_id, choices))
        if exc.status == 409 and isinstance(task_id, str):
            ctx.err(f"{exc.message}; following it")
            running = {t["id"]: t for t in client.list_pulls()}
            return (exc.body.get("model") or pull_id, pull_id,
                    running.get(task_id, {"id": task_id, "items": []}))
        raise
    if "task" not in reply:
        ctx.out(reply["message"])
        return reply.get("model", model_id)
    return reply["model"], pull_id, reply["task"]


def _ask_variant(ctx: Context, client, model_id: str) -> str:
    """A built-in's branch (sizes shown, the default marked, Enter takes it), or a repo's
    file when the server cannot choose one; `model_id` itself when there is no choice."""
    if ":" in model_id or model_id.startswith(("http://", "https://")):
        return model_id  # it names one model already
    try:
        found = client.model_variants(model_id)
    except ApiError as exc:
        if exc.status in (400, 404):
            return model_id  # the pull says why, in the same words
        raise
    rows, default = found["data"], found["default"]
    if found["kind"] == "files" and (default is not None or len(rows) < 2):
        return model_id  # the server takes its only or Q4_K_M file
    if not rows:
        return model_id
    noun = "variant" if found["kind"] == "branches" else "file"
    ctx.err(f"{model_id} has {len(rows)} {noun}s:")
    _list_choices(ctx, [(row["name"], row["size"], row.get("quantization"),
                         "(default)" if row["default"] else "") for row in rows])
    return ask_number(ctx, noun, [row["id"] for row in rows], [row["name"] for row in rows],
                      default)


def _list_choices(ctx: Context, rows) -> None:
    """Numbered lines of (name, size or None, quantization or None, note), aligned."""
    list_choices(ctx, [(name, human_size(size) if size is not None else "", quant or "",
                        note) for name, size, quant, note in rows], right=(1,))


def _choose_file(ctx: Context, model_id: str, choices: list) -> str:
    """Ask which GGUF model of a repository to pull (file, size, quantization); without a
    terminal, explain how to say."""
    files = [c["file"] for c in choices]
    if not ctx.interactive:
        listing = "".join(f"\n  {name}" for name in files)
        raise CliError(f"{model_id} holds {len(files)} GGUF files; choose one with "
                       f"--file NAME or as {model_id}:NAME or {model_id}:QUANTIZATION:"
                       f"{listing}")
    ctx.err(f"{model_id} holds {len(files)} GGUF models:")
    _list_choices(ctx, [(c["file"], c.get("size"), c.get("quantization"), "")
                        for c in choices])
    return ask_number(ctx, "file", files, files)
