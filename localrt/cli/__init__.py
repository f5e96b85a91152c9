"""The `localrt` command line. Every command talks to the server through localrt.client.

`main(argv, stdout, stderr, stdin)` returns an exit code (`ExitCode`) and never
calls sys.exit; it is the one place exceptions become exit codes (a closed output
pipe, as in `localrt models list | head -1`, ends any command quietly: BROKEN_PIPE).
The package:

- `context`: ExitCode, CliError, and the Context each command gets; its
  `client()` connects to the server, or starts it once.
- `parser`: the argparse tree; `flags`: the options made from the request schemas.
- `commands`: the handlers, one module per command group, and the name tables.
- `follow`: following a download or install task; `chat`: the `run` chat;
  `output`: tables, values and progress bars; `menu`: the numbered choices
  `pull` and `engines install --menu` ask for.

A command's result goes to stdout, and a success is one line in cortex.cpp's words
(`Model ID downloaded successfully!`...) that a script can grep; news, questions,
progress and errors go to stderr, so does the line saying the server was started.

Imports stay light: `localrt --help` must not load the server, jsonschema, tqdm or
any engine, so the commands are imported only once the arguments are parsed. If
you add a command or option, also add it to man/localrt.1 (tests/test_man.py checks).
"""

from __future__ import annotations

import sys

from localrt.cli.context import CliError, Context, ExitCode
from localrt.cli.flags import model_update_options
from localrt.cli.parser import build_parser

__all__ = ["CliError", "Context", "ExitCode", "build_parser", "main", "model_update_options"]


def main(argv=None, stdout=None, stderr=None, stdin=None) -> int:
    """Run the localrt command line; return its exit code."""
    stdout = stdout or sys.stdout
    try:
        code = _main(argv, stdout, stderr or sys.stderr, sys.stdin if stdin is None else stdin)
        stdout.flush()  # argparse's help is buffered: a closed pipe is found here, not at exit
        return code
    except BrokenPipeError:  # `localrt models list | head -1`: whatever the command was doing
        _discard(stdout)
        return ExitCode.BROKEN_PIPE


def _discard(stream) -> None:
    """Point a real stream's file at /dev/null, so that the flush at exit finds no closed
    pipe to complain about (Python's advice for SIGPIPE)."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    except (AttributeError, OSError, ValueError):  # not a file (a test's StringIO)
        pass


def _main(argv, stdout, stderr, stdin) -> int:
    """main(), but for a closed output pipe."""
    parser = build_parser(stdout, stderr)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help, --version, or a usage error
        return exc.code if isinstance(exc.code, int) else ExitCode.USAGE
    if not args.command:
        parser.print_help(stdout)
        return ExitCode.OK
    from localrt.cli.commands import COMMANDS
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
