"""The commands: `COMMANDS` maps each command name to its handler.

A handler takes the Context, reaches the server only through `ctx.client()`, and
returns an ExitCode; it raises CliError (or lets the client's errors rise) to fail.
`models` and `engines` dispatch again on their subcommand. One module per group:
`server` (start, stop), `config`, `pull`, `models` (and ps), `run`, `embed`, `rerank`,
`transcribe`, `engines`, `launch`.
"""

from __future__ import annotations

from localrt.cli.commands.config import cmd_config
from localrt.cli.commands.embed import cmd_embed
from localrt.cli.commands.engines import (cmd_engines_get, cmd_engines_install,
                                          cmd_engines_list, cmd_engines_uninstall,
                                          cmd_engines_use)
from localrt.cli.commands.launch import cmd_launch
from localrt.cli.commands.models import (cmd_models_add_remote, cmd_models_get,
                                         cmd_models_import, cmd_models_list,
                                         cmd_models_remove, cmd_models_start, cmd_models_stop,
                                         cmd_models_update, cmd_ps)
from localrt.cli.commands.pull import cmd_pull
from localrt.cli.commands.rerank import cmd_rerank
from localrt.cli.commands.run import cmd_run
from localrt.cli.commands.server import cmd_start, cmd_stop
from localrt.cli.commands.transcribe import cmd_transcribe
from localrt.cli.context import Context
from localrt.cli.parser import MODEL_ALIASES


def cmd_models(ctx: Context) -> int:
    """Run a `localrt models` subcommand."""
    name = ctx.args.models_command
    return MODEL_COMMANDS[MODEL_ALIASES.get(name, name)](ctx)


def cmd_engines(ctx: Context) -> int:
    """Run a `localrt engines` subcommand."""
    return ENGINE_COMMANDS[ctx.args.engines_command](ctx)


COMMANDS = {"start": cmd_start, "stop": cmd_stop, "config": cmd_config, "pull": cmd_pull,
            "run": cmd_run, "embed": cmd_embed, "ps": cmd_ps, "models": cmd_models,
            "engines": cmd_engines, "rerank": cmd_rerank, "transcribe": cmd_transcribe,
            "launch": cmd_launch}
ENGINE_COMMANDS = {"list": cmd_engines_list, "get": cmd_engines_get,
                   "install": cmd_engines_install, "uninstall": cmd_engines_uninstall,
                   "use": cmd_engines_use}
MODEL_COMMANDS = {"list": cmd_models_list, "get": cmd_models_get, "remove": cmd_models_remove,
                  "update": cmd_models_update, "import": cmd_models_import, "pull": cmd_pull,
                  "start": cmd_models_start, "stop": cmd_models_stop, "run": cmd_run,
                  "add-remote": cmd_models_add_remote}
