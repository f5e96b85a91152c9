"""Following a server task (a model download, an engine install) to its end.

The server's event stream tells each task's progress; when all its event-stream
slots are taken, the task list is polled instead. Ctrl-C while following cancels
the task, or, on a terminal, asks first.
"""

from __future__ import annotations

import time

from localrt.cli.context import CliError, Context, ExitCode
from localrt.cli.output import Progress
from localrt.client import ApiError

# What each last event of a download means; tasks carry the same word as their status.
FINISHED = {"DownloadSuccess": "Success", "DownloadError": "Error",
            "DownloadStopped": "Stopped"}


def open_events(client):
    """The server's event stream, or None when all its event-stream slots are taken."""
    try:
        return client.events()
    except ApiError as exc:
        # 503: too many streams, which can be those of clients that already left
        # (the server notices only at its next write); polling works as well.
        if exc.status != 503:
            raise
        return None


def polled_events(client, interval: float = 0.5):
    """Events made from GET /v1/models/pull, for when there is no event stream.

    Started after the pull, so each task listed is the current one of its id.
    """
    while True:
        for task in client.list_pulls():
            kind = next((k for k, status in FINISHED.items() if status == task["status"]),
                        "DownloadUpdated")
            yield {"type": kind, "task": task}
        time.sleep(interval)


def follow(ctx: Context, client, stream, task: dict, what: str, done: str,
           again: str) -> int:
    """Show the task's progress from the event stream until it ends, or Ctrl-C.

    `what` names the thing ("Model x"), `done` says what success did, and `again`
    is the command that follows (and resumes) the task.
    """
    task_id = task["id"]
    progress = Progress(ctx.stderr, what.split(" ", 1)[-1], task)
    try:
        for event in stream:
            current = event.get("task") or {}
            if current.get("id") != task_id:
                continue  # another download
            progress.update(current)
            if event.get("type") in FINISHED:
                task = current
                break
        else:
            task = _after_stream_ended(client, task_id)
    except KeyboardInterrupt:
        progress.close()
        return _interrupted(ctx, client, task_id, again)
    progress.close()
    status = task.get("status")
    if status == "Success":
        ctx.out(f"{what} {done}")
        return ExitCode.OK
    if status == "Stopped":
        raise CliError(f"Download {task_id} was cancelled")
    raise CliError(f"Download {task_id} failed: {task.get('error') or 'no reason given'}")


def _after_stream_ended(client, task_id: str) -> dict:
    """The server hung up the event stream (it is stopping): how did the task end?"""
    task = {t["id"]: t for t in client.list_pulls()}.get(task_id)
    if task is None or task.get("status") not in FINISHED.values():
        raise CliError(f"The server closed the event stream before download {task_id} "
                       f"finished", ExitCode.UNAVAILABLE)
    return task


def _interrupted(ctx: Context, client, task_id: str, again: str) -> int:
    """Ctrl-C while following: cancel the download, or (on a terminal) leave it running."""
    if ctx.interactive:
        try:
            answer = ctx.ask("Cancel the download? [y/N] ")
        except KeyboardInterrupt:  # a second Ctrl-C: leave the download alone
            ctx.err("")
            answer = None
        if (answer or "").strip().lower() not in ("y", "yes"):
            ctx.err(f"The download continues in the server. Run `{again}` to "
                    f"follow it again, and press Ctrl-C there to cancel it.")
            return ExitCode.INTERRUPTED
    try:
        client.cancel_pull(task_id)
    except ApiError as exc:
        if exc.status != 409:  # 409: it finished meanwhile; the message says how
            raise
        ctx.err(exc.message)
        return ExitCode.INTERRUPTED
    ctx.err(f"Download {task_id} cancelled; `{again}` resumes it")
    return ExitCode.INTERRUPTED
