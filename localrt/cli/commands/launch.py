"""`localrt launch CLIENT [--model ID] [-- ARGS...]`: run a coding agent or chat client
pointed at localrt, as `ollama launch` does; `--print` shows how, `--list` which are known.

Launching starts the server if none runs (Context.client()), makes the model ready
(pulled or imported as `run` does), starts it with a ctx_len that holds the client's
prompt (localrt.cli.commands.models.context_for: Claude Code's first request alone is
tens of thousands of tokens), then runs the client with its exit status passed through.
A model already running with a smaller ctx_len is restarted with the larger one, and the
user is told.

Each client is one `Agent` entry of CLIENTS: its command, how it is installed, the
context its prompt needs, and `setup`, which says how that client is pointed at a
server (environment variables, command-line options, files of its own). Nothing of
the user's own configuration is edited: Codex gets `-c` options, opencode its config
in $OPENCODE_CONFIG_CONTENT, and llm a user folder of its own under localrt's data
folder (`launch/llm`). The model launched last is remembered in `launch/last-model`
there, the choice when no `--model` is given and not exactly one model is running.
If you add a client, also add it to man/localrt.1 (launch).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from localrt.cli.commands.models import context_for
from localrt.cli.context import CliError, Context, ExitCode
from localrt.cli.output import table
from localrt.client import ApiError, Unreachable

# Slots a launched model gets unless it stores n_parallel: the agent's conversation keeps
# its cached prompt in one while the client's side requests (titles, summaries) use the
# other; each slot holds ctx_len tokens of KV cache, so more would multiply the memory.
LAUNCH_SLOTS = 2
# The smallest CLAUDE_CODE_AUTO_COMPACT_WINDOW Claude Code 2.1 takes (it reads a smaller one
# as this); CLAUDE_CODE_MAX_CONTEXT_TOKENS sets a smaller window.
CLAUDE_MIN_COMPACT_WINDOW = 100_000
# What a client is handed for the API key when the server has none: Claude Code asks
# for a login and the OpenAI clients for a key without one, and localrt ignores it.
NO_KEY = "localrt"


@dataclass
class Setup:
    """How one client is pointed at localrt: variables to set (None: to remove), options
    put before the user's ARGS, and files to write (path -> text)."""

    env: dict = field(default_factory=dict)
    args: list = field(default_factory=list)
    files: dict = field(default_factory=dict)


@dataclass
class Target:
    """What a client is pointed at: the server's URL, the model, its ctx_len (None when
    unknown: a remote model), the API key (None when keys are off), launch's folder."""

    url: str
    model: str
    ctx_len: int | None
    key: str | None
    folder: Path


@dataclass
class Agent:
    """A client `launch` knows: `context` is the tokens its prompt needs."""

    name: str
    title: str
    command: str
    install: str
    context: int
    setup: Callable[[Target], Setup]


def _claude(t: Target) -> Setup:
    """Claude Code speaks Anthropic's Messages API, at ANTHROPIC_BASE_URL (without /v1);
    every model it would pick is the launched one."""
    env = {"ANTHROPIC_BASE_URL": t.url, "ANTHROPIC_AUTH_TOKEN": t.key or NO_KEY,
           "ANTHROPIC_API_KEY": None,  # a real Anthropic key is never sent to localrt
           "ANTHROPIC_MODEL": t.model, "ANTHROPIC_SMALL_FAST_MODEL": t.model,
           "ANTHROPIC_DEFAULT_OPUS_MODEL": t.model, "ANTHROPIC_DEFAULT_SONNET_MODEL": t.model,
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": t.model,
           # A token count reminder in each request would change the prompt's end at every
           # turn, so the prompt cache could not hold the conversation.
           "CLAUDE_CODE_TOTAL_TOKENS_REMINDER": "off"}
    if t.ctx_len:
        # Claude Code takes a model it does not know for one of a million tokens: this is
        # the window it counts and compacts the conversation within.
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(t.ctx_len)
        if t.ctx_len >= CLAUDE_MIN_COMPACT_WINDOW:  # below, it ignores it, and says so
            env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(t.ctx_len)
    return Setup(env=env)


def _codex(t: Target) -> Setup:
    """Codex speaks only the Responses API: a model provider of its own, given with `-c`
    (which overrides ~/.codex/config.toml for this run and edits nothing)."""
    provider = {"name": "localrt", "base_url": f"{t.url}/v1", "wire_api": "responses"}
    env = {}
    if t.key:
        provider["env_key"] = "LOCALRT_API_KEY"
        env["LOCALRT_API_KEY"] = t.key
    table_ = ", ".join(f"{name} = {_toml(value)}" for name, value in provider.items())
    args = ["-c", 'model_provider="localrt"', "-c", f"model_providers.localrt={{{table_}}}",
            "-c", f"model={_toml(t.model)}"]
    if t.ctx_len:
        args += ["-c", f"model_context_window={t.ctx_len}"]
    return Setup(env=env, args=args)


def _toml(value: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(value)


def _opencode(t: Target) -> Setup:
    """opencode reads a whole config from $OPENCODE_CONFIG_CONTENT, merged over the
    user's: a provider through the AI SDK's OpenAI-compatible package."""
    options = {"baseURL": f"{t.url}/v1"}
    env = {}
    if t.key:
        options["apiKey"] = "{env:LOCALRT_API_KEY}"
        env["LOCALRT_API_KEY"] = t.key
    model = {"name": t.model, "tool_call": True}
    if t.ctx_len:
        model["limit"] = {"context": t.ctx_len, "output": min(t.ctx_len // 4, 32768)}
    config = {"$schema": "https://opencode.ai/config.json",
              "provider": {"localrt": {"npm": "@ai-sdk/openai-compatible", "name": "localrt",
                                       "options": options, "models": {t.model: model}}},
              "model": f"localrt/{t.model}", "small_model": f"localrt/{t.model}"}
    env["OPENCODE_CONFIG_CONTENT"] = json.dumps(config)
    return Setup(env=env)


def _aider(t: Target) -> Setup:
    """aider reaches OpenAI-compatible servers through litellm's `openai/` models."""
    model = f"openai/{t.model}"
    return Setup(env={"OPENAI_API_BASE": f"{t.url}/v1", "OPENAI_API_KEY": t.key or NO_KEY,
                      "AIDER_MODEL": model, "AIDER_WEAK_MODEL": model,
                      "AIDER_EDITOR_MODEL": model})


def _llm(t: Target) -> Setup:
    """llm finds OpenAI-compatible models only in extra-openai-models.yaml of its user
    folder: one of its own under launch's folder, holding that, the default model and
    the key (JSON is YAML)."""
    folder = t.folder / "llm"
    models = [{"model_id": t.model, "model_name": t.model, "api_base": f"{t.url}/v1",
               "api_key_name": "localrt", "can_stream": True, "supports_tools": True}]
    return Setup(env={"LLM_USER_PATH": str(folder)},
                 files={folder / "extra-openai-models.yaml": json.dumps(models, indent=2) + "\n",
                        folder / "default_model.txt": t.model + "\n",
                        folder / "keys.json": json.dumps({"localrt": t.key or NO_KEY}) + "\n"})


CLIENTS = {agent.name: agent for agent in (
    # Claude Code's first request, its system prompt and tool schemas, is 24,300 tokens by
    # 2.1.332's own count (/context) and about 55,000 with more tools and MCP servers;
    # Codex 0.171's is smaller (its request is 41 kB against Claude Code's 50) but grows.
    Agent("claude", "Claude Code", "claude", "npm install -g @anthropic-ai/claude-code",
          65536, _claude),
    Agent("codex", "Codex", "codex", "npm install -g @openai/codex", 32768, _codex),
    Agent("opencode", "opencode", "opencode", "npm install -g opencode-ai", 32768, _opencode),
    Agent("aider", "aider", "aider", "python3 -m pip install aider-install && aider-install",
          16384, _aider),
    Agent("llm", "llm", "llm", "python3 -m pip install llm", 8192, _llm))}


# --- the command ---------------------------------------------------------------------


def cmd_launch(ctx: Context) -> int:
    """Run a client pointed at localrt; or print how (--print), or list the clients."""
    args = ctx.args
    if args.list:
        return _list(ctx)
    if args.client is None:
        raise CliError(f"Name the client to launch: one of {', '.join(CLIENTS)} "
                       f"(`localrt launch --list` shows them)", ExitCode.USAGE)
    agent = CLIENTS[args.client]
    if args.print:
        return _print(ctx, agent)
    executable = shutil.which(agent.command)
    if executable is None:
        raise CliError(f"{agent.title} is not installed (no `{agent.command}` on PATH); "
                       f"install it with: {agent.install}", ExitCode.USAGE)
    client = ctx.client()  # starts the server when none runs
    model_id = _chosen(ctx, client, pull=True)
    ctx_len = _started(ctx, client, model_id, agent)
    setup = agent.setup(Target(client.base_url, model_id, ctx_len, ctx.api_key,
                               _folder(ctx)))
    for path, text in setup.files.items():
        _write(path, text)
    _remember(ctx, model_id)
    ctx.err(f"Launching {agent.title} with model {model_id}"
            + (f" (ctx_len {ctx_len})" if ctx_len else ""))
    return _run([executable, *setup.args, *args.client_args], _environment(setup.env))


def _list(ctx: Context) -> int:
    """The known clients, whether each is installed, and how to install it."""
    rows = [(agent.name, agent.title, shutil.which(agent.command) or "no", agent.install)
            for agent in CLIENTS.values()]
    ctx.out(table(["Client", "Name", "Installed", "Install with"], rows))
    return ExitCode.OK


def _print(ctx: Context, agent: Agent) -> int:
    """The environment, options and files the client would get; nothing is started.

    A running server says which model and context; without one, --model names the model
    and the context is what the client needs."""
    from localrt import server

    client = ctx.connect(server.locate(ctx.settings))  # no start hook: never starts one
    try:
        model_id = _chosen(ctx, client, pull=False)
        record = _record(client, model_id)
        running = _running(client, model_id)
    except Unreachable:
        if not ctx.args.model:
            raise CliError(f"The localrt server is not running at {client.base_url}, so it "
                           f"cannot say which model; give one with --model ID",
                           ExitCode.USAGE) from None
        model_id, record, running = ctx.args.model, None, None
    if running is not None and running["options"].get("ctx_len"):
        ctx_len = max(running["options"]["ctx_len"], _wanted(record, agent))
    elif record is not None and _remote(record):
        ctx_len = None
    else:
        ctx_len = _wanted(record, agent)
    setup = agent.setup(Target(client.base_url, model_id, ctx_len, ctx.api_key,
                               _folder(ctx)))
    ctx.out(f"# {agent.title} pointed at localrt: model {model_id}"
            + (f", ctx_len {ctx_len}" if ctx_len else ""))
    for name, value in setup.env.items():
        ctx.out(f"unset {name}" if value is None else f"export {name}={shlex.quote(value)}")
    ctx.out(shlex.join([agent.command, *setup.args, *ctx.args.client_args]))
    for path, text in setup.files.items():
        ctx.out(f"# {path}:")
        ctx.out(text.rstrip("\n"))
    return ExitCode.OK


def _wanted(record: dict | None, agent: Agent) -> int:
    """The ctx_len the client needs of this model (its own need without a record)."""
    return agent.context if record is None else context_for(record, agent.context)


# --- the model -----------------------------------------------------------------------


def _chosen(ctx: Context, client, pull: bool) -> str:
    """The model to launch: --model (made ready as `run` does, when `pull`), else the one
    running chat model, else the one launched last, else the running one started last;
    else the chat models are listed and the command exits 2."""
    if ctx.args.model:
        if not pull:
            return ctx.args.model
        from localrt.cli.commands.run import ready  # pulled, or imported from a file

        return ready(ctx, client, ctx.args.model, pull=True)
    chats = {m["id"] for m in client.list_models() if "chat" in m.get("capabilities", ())}
    running = [m for m in client.models_status()["data"] if m["id"] in chats]
    if len(running) == 1:
        return running[0]["id"]
    last = _last(ctx)
    if last in chats:
        return last
    if running:
        return max(running, key=lambda m: m.get("startedAt", 0))["id"]
    if not chats:
        raise CliError("No models to launch with: `localrt pull ID` downloads one, and "
                       "`localrt launch CLIENT --model ID` launches with it", ExitCode.USAGE)
    raise CliError("Which model? None is running; give one with --model ID:\n"
                   + "\n".join(f"  {model_id}" for model_id in sorted(chats)), ExitCode.USAGE)


def _started(ctx: Context, client, model_id: str, agent: Agent) -> int | None:
    """Start the model with a context that holds the client's prompt (restarting it if
    it runs with less); its ctx_len, or None for a remote model, whose is unknown."""
    record = client.get_model(model_id)
    if _remote(record):
        client.start_model(model_id)
        return None
    wanted = context_for(record, agent.context)
    running = _running(client, model_id)
    if running is not None:
        have = running["options"].get("ctx_len") or 0
        if have >= wanted:
            return have
        ctx.err(f"Model {model_id} is running with ctx_len {have}; restarting it with "
                f"{wanted}, which {agent.title}'s prompt needs")
        client.stop_model(model_id)
    options = {"ctx_len": wanted}
    if record.get("n_parallel") is None:
        options["n_parallel"] = LAUNCH_SLOTS
    reply = client.start_model(model_id, options)
    ctx.err(reply["message"])
    if wanted < agent.context:
        ctx.err(f"Note: model {model_id} takes at most {wanted} tokens of context; "
                f"{agent.title}'s prompt needs about {agent.context} and may not fit")
    return reply["options"].get("ctx_len", wanted)


def _record(client, model_id: str) -> dict | None:
    """The model's record, or None when the server does not have it."""
    try:
        return client.get_model(model_id)
    except ApiError as exc:
        if exc.status != 404:
            raise
        return None


def _running(client, model_id: str) -> dict | None:
    """The model's row of `ps` when it runs, else None."""
    return next((m for m in client.models_status()["data"] if m["id"] == model_id), None)


def _remote(record: dict) -> bool:
    """Whether a model is served by other servers (its context is theirs)."""
    return bool(record.get("upstreams"))


def _folder(ctx: Context) -> Path:
    """launch's own folder, in localrt's data folder."""
    return Path(ctx.settings["dataFolderPath"]) / "launch"


def _last(ctx: Context) -> str | None:
    """The model launched last, or None."""
    try:
        return (_folder(ctx) / "last-model").read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeError):
        return None


def _remember(ctx: Context, model_id: str) -> None:
    """Note the model launched, for the next launch without --model."""
    _write(_folder(ctx) / "last-model", model_id + "\n")


def _write(path: Path, text: str) -> None:
    """Write one of launch's files whole, readable by this user only (llm's holds a key)."""
    from localrt.fsutil import atomic_write

    atomic_write(path, text.encode("utf-8"), mode=0o600)


# --- running the client ------------------------------------------------------------------


def _environment(changes: dict) -> dict:
    """This process's environment with a client's changes (None removes a variable)."""
    env = dict(os.environ)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def _run(argv: list, env: dict) -> int:
    """Run the client in the foreground; its exit status (128 + N when signal N ended it,
    as shells report it). Ctrl-C is the client's to handle, not this process's."""
    try:
        child = subprocess.Popen(argv, env=env)
    except OSError as exc:  # found on PATH, but not runnable
        raise CliError(f"Cannot run {argv[0]}: {exc.strerror}") from None
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        code = child.wait()
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
    return 128 - code if code < 0 else code
