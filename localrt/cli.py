"""The `localrt` command line. Every subcommand talks to the server through localrt.client.

`main(argv, stdout, stderr, stdin)` returns an exit code and never calls sys.exit.
Imports here stay light: `localrt --help` must not load the server, jsonschema,
tqdm or any engine. If you add a command or option, also add it to man/localrt.1
(tests/test_man.py checks).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from enum import IntEnum

from localrt import __version__
from localrt.fsutil import human_size


class ExitCode(IntEnum):
    OK = 0
    ERROR = 1            # the server answered with an error
    USAGE = 2            # bad arguments; argparse's own code
    UNAVAILABLE = 3      # the server is not running and could not be started
    SETTINGS = 4         # the settings file cannot be used
    INTERRUPTED = 130    # Ctrl-C


class CliError(Exception):
    """A failure to report in one line, with its exit code."""

    def __init__(self, message: str, code: ExitCode = ExitCode.ERROR):
        super().__init__(message)
        self.code = code


# Config fields the `config` command sets, with their argparse value type name.
# If you add a Config field, also add it here (and see localrt/settings.py KEYS).
CONFIG_OPTIONS = (
    ("allowed_origins", "origins", "ORIGINS", "comma-separated origins, no spaces; * allows any"),
    ("cors", "on_off", "on|off", "send CORS headers"),
    ("modelhub_token", "text", "TOKEN", "bearer token for the model hub"),
    ("no_proxy", "text", "HOSTS", "comma-separated hosts that bypass the proxy"),
    ("proxy_url", "text", "URL", "http(s) proxy URL, or an empty string for none"),
    ("proxy_username", "text", "NAME", "proxy user name"),
    ("proxy_password", "text", "PASSWORD", "proxy password"),
    ("verify_host_ssl", "on_off", "on|off", "check TLS host names"),
    ("verify_peer_ssl", "on_off", "on|off", "check TLS certificate chains"),
    ("verify_proxy_host_ssl", "on_off", "on|off", "check an https proxy's host name"),
    ("verify_proxy_ssl", "on_off", "on|off", "check an https proxy's certificate chain"),
)


def _on_off(value: str) -> bool:
    words = {"on": True, "off": False, "true": True, "false": False}
    try:
        return words[value.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}") from None


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {value!r}")
    return port


def _origins(value: str) -> list:
    return [part.strip() for part in value.split(",") if part.strip()]


_TYPES = {"on_off": _on_off, "origins": _origins, "text": str}


def model_update_options(schema: str = "model-update.json", skip=("id",)):
    """(flag, argparse keywords) for each property of a schema: stored model parameters.

    The schema is the one list of parameters: a property added there becomes a
    `models update` (or, in model-start.json, `models start`) flag here, and must be
    added to man/localrt.1; tests/test_man.py checks.
    """
    from localrt import schemas  # plain JSON reading; jsonschema stays unloaded

    for name, spec in schemas.load(schema)["properties"].items():
        if name in skip:  # ids cannot change; start's model id is an argument
            continue
        if "$ref" in spec:  # "model-update.json#/properties/ctx_len"
            target, _, pointer = spec["$ref"].partition("#/properties/")
            spec = schemas.load(target)["properties"][pointer]
        kind = spec.get("type")
        options = {"dest": f"param_{name}", "help": _parameter_help(name, spec)}
        if "enum" in spec:
            options.update(choices=spec["enum"], metavar="VALUE")
        elif kind == "integer":
            options.update(type=int, metavar="N")
        elif kind == "number":
            options.update(type=float, metavar="X")
        elif kind == "boolean":
            options.update(type=_on_off, metavar="on|off")
        elif kind == "array":  # of strings: one flag per element
            options.update(action="append", metavar="TEXT")
        elif kind == "string":
            options.update(metavar="TEXT")
        else:
            options.update(type=json.loads, metavar="JSON")
        yield f"--{name}", options


def _parameter_help(name: str, spec: dict) -> str:
    text = spec.get("description") or name.replace("_", " ")
    if text[1:2].islower():  # "Context length" -> "context length", but "CPU threads"
        text = text[:1].lower() + text[1:]
    if "minimum" in spec and "maximum" in spec:
        text += f"; {spec['minimum']} to {spec['maximum']}"
    if "enum" in spec:
        text += "; one of " + ", ".join(spec["enum"])
    if spec.get("type") == "array":
        text += "; repeat the flag for several, or give '' alone for none"
    return text.replace("%", "%%")  # argparse %-formats help


# --- the commands ---------------------------------------------------------------


def cmd_start(ctx: "Context") -> int:
    """Start the server in the background, or in the foreground with --foreground."""
    from localrt import server

    settings = ctx.settings
    host = ctx.args.host or settings["apiServerHost"]
    port = settings["apiServerPort"] if ctx.args.port is None else ctx.args.port
    try:
        server.check_exposure(settings, host)
    except server.UnsafeAddress as exc:
        raise CliError(str(exc), ExitCode.SETTINGS) from None
    if ctx.args.foreground:
        try:
            server.serve(settings, host, port)
        except server.PortInUse as exc:
            raise CliError(str(exc), ExitCode.UNAVAILABLE) from None
        return ExitCode.OK
    running = server.read_pid_file(settings)
    if running and server.healthy(running):
        ctx.out(f"Server is already running at {running.url}")
        return ExitCode.OK
    if port and server.healthy(server.Address(host, port)):
        ctx.out(f"Server is already running at {server.Address(host, port).url}")
        return ExitCode.OK
    address = ctx.start_server(host, port)
    ctx.out(f"Server started at {address.url}")
    return ExitCode.OK


def cmd_stop(ctx: "Context") -> int:
    """Stop the server gracefully and wait until its port is free."""
    import os
    import signal

    from localrt import server
    from localrt.client import Client, Unreachable

    running = server.read_pid_file(ctx.settings)
    target = running or server.Address(ctx.settings["apiServerHost"],
                                       ctx.settings["apiServerPort"])
    try:
        Client(target.url, timeout=10, api_key=ctx.api_key).stop_server()
    except Unreachable:
        if not running:
            ctx.out("Server is not running")
            return ExitCode.OK
        os.kill(running.pid, signal.SIGTERM)  # alive but not answering: still starting, or stuck
    if not server.wait_stopped(target):
        if running:
            os.kill(running.pid, signal.SIGTERM)
        if not server.wait_stopped(target, timeout=5):
            raise CliError(f"The server at {target.url} did not stop", ExitCode.UNAVAILABLE)
    ctx.out("Server stopped")
    return ExitCode.OK


def cmd_config(ctx: "Context") -> int:
    """Set Config fields with one PATCH, or print them all as a table."""
    changes = {name: getattr(ctx.args, name) for name, *_ in CONFIG_OPTIONS
               if getattr(ctx.args, name) is not None}
    if changes:
        ctx.call(lambda client: client.update_config(changes))
        ctx.out("Configuration updated successfully!")
    if not changes or ctx.args.action == "status":
        config = ctx.call(lambda client: client.get_config())
        rows = []
        for name, value in config.items():
            values = value if isinstance(value, list) else [value]
            if name == "proxy_url":  # user:password@ in a URL is never shown
                from localrt.security import url_without_credentials

                values = [url_without_credentials(v) for v in values]
            rows += [(name, _show(v)) for v in values] or [(name, "")]
        ctx.out(table(["Config name", "Value"], rows))
    return ExitCode.OK


def cmd_pull(ctx: "Context") -> int:
    """Download a model from the hub, following its progress until it is registered."""
    model_id, file = ctx.args.model, ctx.args.file
    # The event stream opens first, so that no event of the task the pull starts is missed.
    stream, client = ctx.call(lambda client: (_open_events(client), client))
    return _download(ctx, client, stream, model_id, file)[0]


def _download(ctx: "Context", client, stream, model_id: str,
              file: str | None) -> tuple[int, str]:
    """Start a pull and follow it until it ends: (exit code, the model's local id).

    `stream` is the event stream, opened before the pull (None: poll instead).
    """
    with stream or contextlib.nullcontext():
        started = _start_pull(ctx, client, model_id, file)
        if isinstance(started, str):  # already downloaded
            return ExitCode.OK, started
        model, pull_id, task = started
        code = _follow(ctx, client, stream or _polled_events(client), task,
                       f"Model {model}", "downloaded", f"localrt pull {pull_id}")
        return code, model


def _open_events(client):
    """The server's event stream, or None when all its event-stream slots are taken."""
    from localrt.client import ApiError

    try:
        return client.events()
    except ApiError as exc:
        # 503: too many streams, which can be those of clients that already left
        # (the server notices only at its next write); polling works as well.
        if exc.status != 503:
            raise
        return None


def _polled_events(client, interval: float = 0.5):
    """Events made from GET /v1/models/pull, for when there is no event stream.

    Started after the pull, so each task listed is the current one of its id.
    """
    while True:
        for task in client.list_pulls():
            kind = next((k for k, status in _FINISHED.items() if status == task["status"]),
                        "DownloadUpdated")
            yield {"type": kind, "task": task}
        time.sleep(interval)


def _start_pull(ctx: "Context", client, model_id: str, file: str | None):
    """POST the pull; return (model id, id to pull again, task), or the model's id if it
    is already downloaded. On a terminal, an id that leaves a choice open asks first."""
    from localrt.client import ApiError

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


def _ask_variant(ctx: "Context", client, model_id: str) -> str:
    """A built-in's branch (sizes shown, the default marked, Enter takes it), or a repo's
    file when the server cannot choose one; `model_id` itself when there is no choice."""
    from localrt.client import ApiError

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
    return _ask_number(ctx, noun, [row["id"] for row in rows], [row["name"] for row in rows],
                       default)


def _list_choices(ctx: "Context", rows) -> None:
    """Numbered lines of (name, size or None, quantization or None, note), aligned."""
    width = max(len(name) for name, *_ in rows)
    for number, (name, size, quant, note) in enumerate(rows, 1):
        size = human_size(size) if size is not None else ""
        ctx.err(f"  {number}. {name:<{width}}  {size:>10}  {quant or '':<8} {note}".rstrip())


def _ask_number(ctx: "Context", noun: str, ids: list, names: list,
                default: str | None = None) -> str:
    """Read a choice by number or name (Enter: the default, if any); its id."""
    hint = f", Enter for {names[ids.index(default)]}" if default in ids else ""
    while True:
        answer = ctx.ask(f"Choose a {noun} [1-{len(ids)}{hint}]: ")
        if answer is None:
            raise CliError(f"No {noun} chosen")
        answer = answer.strip()
        if not answer and default in ids:
            return default
        if answer in names:
            return ids[names.index(answer)]
        if answer.isdigit() and 1 <= int(answer) <= len(ids):
            return ids[int(answer) - 1]
        ctx.err(f"Please answer with a number from 1 to {len(ids)}")


def _choose_file(ctx: "Context", model_id: str, choices: list) -> str:
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
    return _ask_number(ctx, "file", files, files)


# What each last event of a download means; tasks carry the same word as their status.
_FINISHED = {"DownloadSuccess": "Success", "DownloadError": "Error",
             "DownloadStopped": "Stopped"}


def _follow(ctx: "Context", client, stream, task: dict, what: str, done: str,
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
            if event.get("type") in _FINISHED:
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
    if task is None or task.get("status") not in _FINISHED.values():
        raise CliError(f"The server closed the event stream before download {task_id} "
                       f"finished", ExitCode.UNAVAILABLE)
    return task


def _interrupted(ctx: "Context", client, task_id: str, again: str) -> int:
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
    from localrt.client import ApiError

    try:
        client.cancel_pull(task_id)
    except ApiError as exc:
        if exc.status != 409:  # 409: it finished meanwhile; the message says how
            raise
        ctx.err(exc.message)
        return ExitCode.INTERRUPTED
    ctx.err(f"Download {task_id} cancelled; `{again}` resumes it")
    return ExitCode.INTERRUPTED


def cmd_models(ctx: "Context") -> int:
    """Run a `localrt models` subcommand."""
    name = ctx.args.models_command
    return MODEL_COMMANDS[MODEL_ALIASES.get(name, name)](ctx)


def cmd_models_list(ctx: "Context") -> int:
    """Print the downloaded and imported models as a table."""
    models = ctx.call(lambda client: client.list_models())
    if not models:
        ctx.out("No models downloaded yet; `localrt pull ID` downloads one")
        return ExitCode.OK
    rows = [(number, m["id"], m.get("engine", ""), human_size(m.get("size", 0)),
             m.get("status", "")) for number, m in enumerate(models, 1)]
    ctx.out(table(["#", "ID", "Engine", "Size", "Status"], rows))
    return ExitCode.OK


def cmd_models_get(ctx: "Context") -> int:
    """Print one model's record as JSON."""
    model = ctx.call(lambda client: client.get_model(ctx.args.model))
    ctx.out(json.dumps(model, indent=2, ensure_ascii=False))
    return ExitCode.OK


def cmd_models_remove(ctx: "Context") -> int:
    """Delete a model's files and definition."""
    ctx.call(lambda client: client.remove_model(ctx.args.model))
    ctx.out(f"Model {ctx.args.model} removed")
    return ExitCode.OK


def cmd_models_update(ctx: "Context") -> int:
    """Change a model's stored parameters with one PATCH."""
    changes = _flag_values(ctx, ctx.args.parameters)
    if not changes:
        raise CliError("Nothing to update: give at least one option (see "
                       "`localrt models update -h`)", ExitCode.USAGE)
    reply = ctx.call(lambda client: client.update_model(ctx.args.model, changes))
    shown = ", ".join(f"{name}={json.dumps(value, ensure_ascii=False)}"
                      for name, value in changes.items())
    ctx.out(f"Model {reply['model']['id']} updated: {shown}")
    return ExitCode.OK


def _flag_values(ctx: "Context", names) -> dict:
    """The values of the model_update_options() flags that were given ('' drops out of a list)."""
    values = {}
    for name in names:
        value = getattr(ctx.args, f"param_{name}")
        if value is not None:
            values[name] = [v for v in value if v] if isinstance(value, list) else value
    return values


def _start_options(ctx: "Context") -> dict:
    """The start options given as flags (`models start`, `run`)."""
    return _flag_values(ctx, ctx.args.start_options)


def cmd_models_start(ctx: "Context") -> int:
    """Load a model, with its stored parameters and the options given."""
    reply = ctx.call(lambda client: client.start_model(ctx.args.model, _start_options(ctx)))
    ctx.out(reply["message"])
    return ExitCode.OK


def cmd_models_stop(ctx: "Context") -> int:
    """Unload a running model."""
    ctx.out(ctx.call(lambda client: client.stop_model(ctx.args.model))["message"])
    return ExitCode.OK


def cmd_ps(ctx: "Context") -> int:
    """Print the running models, and the machine they run on."""
    status = ctx.call(lambda client: client.models_status())
    rows = [(m["id"], m["engine"], human_size(m["ram"]), human_size(m["vram"]),
             _duration(m["uptime"]), m["options"].get("ctx_len", ""))
            for m in status["data"]]
    if rows:
        ctx.out(table(["Model", "Engine", "RAM", "VRAM", "Up time", "Context"], rows))
    else:
        ctx.out("No models are running; `localrt run ID` starts one and chats with it")
    hw = status.get("hardware") or {}
    if hw:
        gpu = f"CUDA {hw['cuda']}" if hw.get("cuda") else "no GPU"
        ctx.out(f"CPU: {hw.get('cpu') or 'unknown'} ({hw.get('cores')} cores, "
                f"{hw.get('cpuLevel') or 'no AVX'}); RAM: {human_size(hw.get('ramAvailable', 0))} "
                f"free of {human_size(hw.get('ramTotal', 0))}; {gpu}")
    return ExitCode.OK


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60}m"


def cmd_run(ctx: "Context") -> int:
    """Pull the model if needed, start it, then chat with it in the terminal."""
    from localrt.client import ApiError

    model_id = ctx.args.model

    def local(client):
        """(client, whether the model is downloaded); a request, so a server is started."""
        try:
            client.get_model(model_id)
        except ApiError as exc:
            if exc.status != 404:
                raise
            return client, False
        return client, True

    client, downloaded = ctx.call(local)
    if not downloaded:
        ctx.err(f"Model {model_id} is not downloaded yet; pulling it")
        model_id = _pull_for_run(ctx, client, model_id)
    reply = client.start_model(model_id, _start_options(ctx))
    ctx.err(reply["message"])
    return Chat(ctx, client, model_id).loop()


def _pull_for_run(ctx: "Context", client, model_id: str) -> str:
    """Pull a model, following its progress; return the local id it got."""
    code, model = _download(ctx, client, _open_events(client), model_id, None)
    if code != ExitCode.OK:
        raise CliError(f"Model {model_id} was not downloaded", code)
    return model


class Chat:
    """The terminal chat of `localrt run`: history kept, replies streamed as they come."""

    HELP = "Type a message and press Enter. /exit or Ctrl-D leaves; Ctrl-C stops a reply."

    def __init__(self, ctx: "Context", client, model_id: str):
        self.ctx, self.client, self.model_id = ctx, client, model_id
        self.history: list[dict] = []

    def loop(self) -> int:
        """Read a message, stream the reply; until /exit or end of input."""
        from localrt.client import ApiError

        self.ctx.err(self.HELP)
        while True:
            try:
                line = self._read()
            except KeyboardInterrupt:  # at the prompt: say how to leave, as Ollama does
                self.ctx.err("\nUse /exit or Ctrl-D to leave.")
                continue
            if line is None or line.strip() in ("/exit", "/bye", "/quit"):
                self.ctx.err("")
                return ExitCode.OK
            if not line.strip():
                continue
            if line.strip() in ("/help", "/?"):
                self.ctx.err(self.HELP)
                continue
            self.history.append({"role": "user", "content": line})
            try:
                reply = self._reply()
            except (ApiError, CliError) as exc:  # e.g. the conversation outgrew the context
                self.history.pop()
                self.ctx.err(f"Error: {exc}")
                continue
            self.history.append({"role": "assistant", "content": reply})

    def _read(self) -> str | None:
        """One line from the user; None at end of input (Ctrl-D)."""
        ctx = self.ctx
        if ctx.stdin is sys.stdin and ctx.interactive:
            try:
                import readline  # noqa: F401  (line editing and history for input())
            except ImportError:
                pass
            try:
                return input(">>> ")
            except EOFError:
                return None
        return ctx.ask(">>> ")

    def _reply(self) -> str:
        """Stream one reply to stdout; Ctrl-C ends it early and keeps what came."""
        pieces: list[str] = []
        stream = None
        try:
            # Opening waits for the model's turn (and reads the prompt): Ctrl-C may come here.
            stream = self.client.chat_stream({"model": self.model_id,
                                              "messages": self.history})
            for chunk in stream:
                if "error" in chunk:
                    raise CliError(f"The reply failed: {chunk['error'].get('message')}")
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        pieces.append(piece)
                        self.ctx.stdout.write(piece)
                        self.ctx.stdout.flush()
        except KeyboardInterrupt:  # the server stops generating when the stream closes
            self.ctx.stdout.write(" [interrupted]")
        finally:
            if stream is not None:
                stream.close()
        self.ctx.out("")
        return "".join(pieces)


def cmd_models_import(ctx: "Context") -> int:
    """Register a local GGUF file, linked (the default) or copied."""
    # The server resolves nothing relative to the caller's directory: send an absolute path.
    path = os.path.abspath(os.path.expanduser(ctx.args.path))
    option = "copy" if ctx.args.copy else "symlink"
    reply = ctx.call(lambda client: client.import_model(path, ctx.args.id, option))
    ctx.out(f"Model {reply['model']['id']} imported from {path}")
    return ExitCode.OK


def cmd_engines(ctx: "Context") -> int:
    """Run a `localrt engines` subcommand."""
    return ENGINE_COMMANDS[ctx.args.engines_command](ctx)


def cmd_engines_list(ctx: "Context") -> int:
    """Print every engine as a table."""
    engines = ctx.call(lambda client: client.list_engines())
    rows = [(number, e["name"], e["format"], e["version"], e["variant"], e["status"])
            for number, e in enumerate(engines, 1)]
    ctx.out(table(("#", "Name", "Supported Formats", "Version", "Variant", "Status"), rows))
    for e in engines:
        if e.get("reason"):
            ctx.err(f"{e['name']}: {e['reason']}")
    return ExitCode.OK


def cmd_engines_get(ctx: "Context") -> int:
    """Print an engine's installed variants as a table."""
    name = ctx.args.engine
    variants = ctx.call(lambda client: client.get_engine(name))
    if not variants:
        ctx.out(f"No variant of {name} is installed; `localrt engines install {name}` "
                f"installs one")
        return ExitCode.OK
    rows = [(number, v["engine"], v["version"], v["name"], v.get("status", "Installed"))
            for number, v in enumerate(variants, 1)]
    ctx.out(table(("#", "Name", "Version", "Variant", "Status"), rows))
    for v in variants:
        if v.get("reason"):
            ctx.err(f"{v['name']}: {v['reason']}")
    return ExitCode.OK


def cmd_engines_install(ctx: "Context") -> int:
    """Install an engine variant, or a custom engine wheel, following its progress."""
    args = ctx.args
    target = args.engine
    is_wheel = target.endswith(".whl")
    if is_wheel and "://" not in target:
        target = os.path.abspath(target)  # the server resolves paths from its own cwd
    stream, client = ctx.call(lambda client: (_open_events(client), client))
    with stream or contextlib.nullcontext():
        if is_wheel:
            reply = ctx.call(lambda c: c.install_engine_wheel(target))
        else:
            reply = ctx.call(lambda c: c.install_engine(target, args.version, args.variant))
        if "task" not in reply:
            ctx.out(reply["message"])
            return ExitCode.OK
        # A wheel given by URL names its engine only once it has been downloaded.
        name = reply.get("engine") or os.path.basename(target)
        return _follow(ctx, client, stream or _polled_events(client), reply["task"],
                       f"Engine {name}", "installed", f"localrt engines install {args.engine}")


def cmd_engines_uninstall(ctx: "Context") -> int:
    """Uninstall an engine variant (the active one unless told)."""
    args = ctx.args
    reply = ctx.call(lambda c: c.uninstall_engine(args.engine, args.version, args.variant))
    ctx.out(reply["message"])
    return ExitCode.OK


def cmd_engines_use(ctx: "Context") -> int:
    """Choose the installed variant an engine's models load."""
    args = ctx.args
    ctx.out(ctx.call(lambda c: c.use_engine(args.engine, args.variant, args.version))["message"])
    return ExitCode.OK


COMMANDS = {"start": cmd_start, "stop": cmd_stop, "config": cmd_config, "pull": cmd_pull,
            "run": cmd_run, "ps": cmd_ps, "models": cmd_models, "engines": cmd_engines}
ENGINE_COMMANDS = {"list": cmd_engines_list, "get": cmd_engines_get,
                   "install": cmd_engines_install, "uninstall": cmd_engines_uninstall,
                   "use": cmd_engines_use}
MODEL_COMMANDS = {"list": cmd_models_list, "get": cmd_models_get, "remove": cmd_models_remove,
                  "update": cmd_models_update, "import": cmd_models_import, "pull": cmd_pull,
                  "start": cmd_models_start, "stop": cmd_models_stop, "run": cmd_run}
MODEL_ALIASES = {"rm": "remove", "delete": "remove"}


# --- output helpers -------------------------------------------------------------


def _show(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class Progress:
    """A download's progress: a tqdm bar on a terminal, otherwise one line at the end."""

    def __init__(self, stream, label: str, task: dict):
        self.stream, self.label = stream, label
        self.total, self.done = _task_bytes(task)
        self.started = time.monotonic()
        self.bar = None
        self.closed = False
        if _isatty(stream):
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.done, desc=label, unit="B",
                            unit_scale=True, unit_divisor=1024, file=stream,
                            dynamic_ncols=True)

    def update(self, task: dict) -> None:
        """Move to the task's position (it goes back when a damaged file restarts)."""
        self.total, done = _task_bytes(task)
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.update(done - self.done)
        self.done = done

    def close(self) -> None:
        """End the bar, or write the one line a log file gets."""
        if self.closed:
            return
        self.closed = True
        if self.bar is not None:
            self.bar.close()
            return
        from tqdm import tqdm

        line = tqdm.format_meter(self.done, self.total, time.monotonic() - self.started,
                                 prefix=self.label, unit="B", unit_scale=True,
                                 unit_divisor=1024, ascii=True, ncols=80)
        print(line, file=self.stream, flush=True)


def _task_bytes(task: dict) -> tuple[int, int]:
    """(total, downloaded) bytes over a task's items."""
    items = task.get("items") or []
    return (sum(i.get("bytes") or 0 for i in items),
            sum(i.get("downloadedBytes") or 0 for i in items))


def table(headers, rows) -> str:
    """A boxed text table, as cortex prints them."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([rule, line(headers), rule, *(line(r) for r in rows), rule])


# --- context and main ------------------------------------------------------------


class Context:
    """What a command needs: its arguments, its streams, the settings and a client."""

    def __init__(self, args, stdout, stderr, stdin=None):
        self.args, self.stdout, self.stderr = args, stdout, stderr
        self.stdin = stdin
        self._settings = None

    @property
    def settings(self):
        if self._settings is None:
            from localrt import settings

            self._settings = settings.load(self.args.config)
        return self._settings

    def out(self, text: str) -> None:
        print(text, file=self.stdout, flush=True)

    def err(self, text: str) -> None:
        print(text, file=self.stderr, flush=True)

    @property
    def interactive(self) -> bool:
        """Whether a person can answer questions: stdin is a terminal."""
        return self.stdin is not None and _isatty(self.stdin)

    def ask(self, prompt: str) -> str | None:
        """Ask on stderr, read one line from stdin; None at end of input."""
        self.stderr.write(prompt)
        self.stderr.flush()
        line = self.stdin.readline()
        return line.rstrip("\r\n") if line else None

    def start_server(self, host: str, port: int):
        """Spawn a detached server and wait until it answers; return its Address."""
        from localrt import server

        try:
            server.check_port_free(host, port)
            child = server.spawn(self.settings, host, port)
            return server.wait_started(self.settings, child)
        except (server.PortInUse, RuntimeError) as exc:
            raise CliError(str(exc), ExitCode.UNAVAILABLE) from None

    @property
    def api_key(self) -> str | None:
        """The key the CLI sends: $LOCALRT_API_KEY, else the first of apiKeys."""
        keys = self.settings["apiKeys"]
        return keys[0] if keys else None

    def call(self, fn):
        """Run `fn(client)`; if no server is running, start one first and say so."""
        from localrt import server
        from localrt.client import Client, Unreachable

        address = server.locate(self.settings)
        try:
            return fn(Client(address.url, api_key=self.api_key))
        except Unreachable:
            if server.read_pid_file(self.settings):
                raise  # a server process exists but does not answer; starting another won't help
        address = self.start_server(self.settings["apiServerHost"], self.settings["apiServerPort"])
        self.err(f"The localrt server was not running; started it at {address.url}")
        return fn(Client(address.url, api_key=self.api_key))


class _Parser(argparse.ArgumentParser):
    """argparse that prints to the streams main() was given."""

    streams = (sys.stdout, sys.stderr)

    def _print_message(self, message, file=None):
        if message:
            out, err = self.streams
            (err if file is sys.stderr or file is None else out).write(message)


def build_parser(stdout=None, stderr=None) -> argparse.ArgumentParser:
    """The whole argparse tree."""
    parser_class = type("Parser", (_Parser,), {"streams": (stdout or sys.stdout,
                                                           stderr or sys.stderr)})
    parser = parser_class(prog="localrt", description="A local model runtime: an HTTP API "
                          "server and this command line for it.")
    parser.add_argument("--version", action="version", version=f"localrt {__version__}")
    parser.add_argument("--config", metavar="PATH",
                        help="settings file to use instead of ~/.localrtrc ($LOCALRT_CONFIG)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("start", help="start the API server", description="Start the API "
                       "server in the background and wait until it answers.")
    p.add_argument("--host", help="address to bind (default: apiServerHost, 127.0.0.1)")
    p.add_argument("--port", type=_port, help="port to bind (default: apiServerPort, 39281; "
                   "0 picks a free one)")
    p.add_argument("--foreground", action="store_true",
                   help="run in the foreground, for systemd and containers; SIGTERM stops it")

    sub.add_parser("stop", help="stop the API server",
                   description="Stop the API server gracefully and wait until its port is free.")

    p = sub.add_parser("config", help="show or change the server's configuration",
                       description="Without options, or with `status`, print every setting. "
                       "With options, change those settings in one request.")
    p.add_argument("action", nargs="?", choices=["status"], help="print every setting")
    for name, kind, metavar, help_text in CONFIG_OPTIONS:
        p.add_argument(f"--{name}", type=_TYPES[kind], metavar=metavar, help=help_text)

    pull_help = "download a model from the hub, with a progress bar"
    pull_description = ("Download a model from the model hub and register it, showing its "
                        "progress. ID is <name>, <name>:<variant>, <org>/<repo>, "
                        "<org>/<repo>:<file> or a hub URL. If the download is already "
                        "running, follow it. Ctrl-C asks whether to cancel it.")
    _add_pull_arguments(sub.add_parser("pull", help=pull_help, description=pull_description))

    run_help = "pull a model if needed, start it and chat with it"
    run_description = ("Download the model if it is not local yet (with progress), start "
                       "it, then chat with it in the terminal: replies stream as they are "
                       "generated and the conversation is kept. /exit or Ctrl-D leaves; "
                       "Ctrl-C stops a reply without leaving.")
    _add_start_arguments(sub.add_parser("run", help=run_help, description=run_description))
    sub.add_parser("ps", help="show the running models and the hardware",
                   description="Print the running models (engine, RAM, VRAM, up time, "
                   "context length) and this machine's CPU, memory and GPU.")

    p = sub.add_parser("models", help="list, inspect, change, import and pull models",
                       description="Manage the downloaded and imported models.")
    models = p.add_subparsers(dest="models_command", metavar="SUBCOMMAND", required=True)
    models.add_parser("list", help="list the models", description="Print a table of the "
                      "downloaded and imported models.")
    p = models.add_parser("get", help="print a model's record as JSON",
                          description="Print a model's whole record as JSON.")
    p.add_argument("model", metavar="ID", help="the model's id, as `models list` shows it")
    p = models.add_parser("remove", aliases=[a for a, n in MODEL_ALIASES.items()
                                             if n == "remove"],
                          help="delete a model", description="Delete a model's files and "
                          "definition. An imported model's own file is never deleted.")
    p.add_argument("model", metavar="ID", help="the model's id")
    p = models.add_parser("update", help="change a model's stored parameters",
                          description="Change the stored load and inference parameters "
                          "of a model in one request. Only the options given change.")
    p.add_argument("model", metavar="ID", help="the model's id")
    names = []
    for flag, options in model_update_options():
        p.add_argument(flag, **options)
        names.append(flag[2:])
    p.set_defaults(parameters=tuple(names))
    p = models.add_parser("import", help="register a local GGUF file or ONNX folder",
                          description="Register a local GGUF file, or an ONNX model folder "
                          "(one holding genai_config.json), as a model, without the hub. "
                          "It is linked, or copied with --copy.")
    p.add_argument("--path", required=True, metavar="PATH", help="the GGUF file or ONNX "
                   "model folder")
    p.add_argument("--id", metavar="ID", help="the model's id (default: the file name "
                   "without .gguf)")
    p.add_argument("--copy", action="store_true", help="copy the file into the models "
                   "folder instead of linking to it")
    _add_pull_arguments(models.add_parser("pull", help=pull_help,
                                          description=pull_description))
    _add_start_arguments(models.add_parser(
        "start", help="load a model", description="Load a model with its stored "
        "parameters; the options given override them for this run."))
    p = models.add_parser("stop", help="unload a running model",
                          description="Unload a running model and free its memory.")
    p.add_argument("model", metavar="ID", help="the model's id")
    _add_start_arguments(models.add_parser("run", help=run_help, description=run_description))

    p = sub.add_parser("engines", help="list, install and uninstall inference engines",
                       description="Manage the inference engines: gguf-cpp (GGUF, "
                       "llama.cpp), onnx-runtime (ONNX) and custom engines.")
    engines = p.add_subparsers(dest="engines_command", metavar="SUBCOMMAND", required=True)
    engines.add_parser("list", help="list the engines", description="Print a table of the "
                       "engines with their version, variant and status.")
    p = engines.add_parser("get", help="list an engine's installed variants",
                           description="Print a table of an engine's installed variants.")
    p.add_argument("engine", metavar="ENGINE", help="gguf-cpp, onnx-runtime, or a custom "
                   "engine's name")
    p = engines.add_parser("install", help="install an engine, with a progress bar",
                           description="Install an engine variant from the package index "
                           "(engineIndexUrl), or a custom engine from a wheel file or URL, "
                           "showing its progress. Ctrl-C asks whether to cancel it.")
    p.add_argument("engine", metavar="ENGINE", help="the engine's name, or the path or "
                   "URL of a custom engine's .whl file")
    _add_variant_arguments(p, "install (default: the newest)",
                           "install (default: the one recommended for this machine)")
    p = engines.add_parser("uninstall", help="uninstall an engine variant",
                           description="Uninstall an engine variant, the active one unless "
                           "told. The gguf-cpp build that ships with localrt is deactivated, "
                           "not deleted; `engines install gguf-cpp` turns it back on.")
    p.add_argument("engine", metavar="ENGINE", help="the engine's name")
    _add_variant_arguments(p, "uninstall", "uninstall")
    p = engines.add_parser("use", help="choose which installed variant models load",
                           description="Make an installed variant the one the engine's "
                           "models load. If the engine is already loaded, restart the "
                           "server for it to take effect.")
    p.add_argument("engine", metavar="ENGINE", help="the engine's name")
    p.add_argument("--variant", required=True, metavar="VARIANT", help="the variant to use")
    p.add_argument("--version", required=True, metavar="VERSION", help="its version")
    return parser


def _add_variant_arguments(p: argparse.ArgumentParser, version_help: str,
                           variant_help: str) -> None:
    p.add_argument("--version", metavar="VERSION", help=f"the version to {version_help}")
    p.add_argument("--variant", metavar="VARIANT", help=f"the variant to {variant_help}, "
                   f"such as linux-amd64-avx2")


def _add_start_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="ID", help="the model's id")
    names = []
    for flag, options in model_update_options("model-start.json", skip=("model",)):
        p.add_argument(flag, **options)
        names.append(flag[2:])
    p.set_defaults(start_options=tuple(names))


def _add_pull_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="ID", help="the model to download")
    p.add_argument("--file", metavar="NAME", help="which GGUF file of an <org>/<repo> "
                   "repository to download (asked for on a terminal when it holds several)")


def main(argv=None, stdout=None, stderr=None, stdin=None) -> int:
    """Run the localrt command line; return its exit code."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    stdin = sys.stdin if stdin is None else stdin
    parser = build_parser(stdout, stderr)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help, --version, or a usage error
        return exc.code if isinstance(exc.code, int) else ExitCode.USAGE
    if not args.command:
        parser.print_help(stdout)
        return ExitCode.OK
    from localrt.client import ApiError, Unreachable
    from localrt.settings import SettingsError

    # The one place exceptions become exit codes.
    codes = ((CliError, None), (ApiError, ExitCode.ERROR), (Unreachable, ExitCode.UNAVAILABLE),
             (SettingsError, ExitCode.SETTINGS))
    ctx = Context(args, stdout, stderr, stdin)
    try:
        return int(COMMANDS[args.command](ctx))
    except (CliError, ApiError, Unreachable, SettingsError) as exc:
        ctx.err(f"Error: {exc}")
        return next(exc.code if code is None else code
                    for kind, code in codes if isinstance(exc, kind))
    except KeyboardInterrupt:
        ctx.err("Interrupted")
        return ExitCode.INTERRUPTED
