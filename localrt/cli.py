"""The `localrt` command line. Every subcommand talks to the server through localrt.client.

`main(argv, stdout, stderr)` returns an exit code and never calls sys.exit.
Imports here stay light: `localrt --help` must not load the server, jsonschema
or any engine. If you add a command or option, also add it to man/localrt.1
(tests/test_man.py checks).
"""

from __future__ import annotations

import argparse
import sys
from enum import IntEnum

from localrt import __version__


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


# --- the commands ---------------------------------------------------------------


def cmd_start(ctx: "Context") -> int:
    """Start the server in the background, or in the foreground with --foreground."""
    from localrt import server

    settings = ctx.settings
    host = ctx.args.host or settings["apiServerHost"]
    port = settings["apiServerPort"] if ctx.args.port is None else ctx.args.port
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
        Client(target.url, timeout=10).stop_server()
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
            rows += [(name, _show(v)) for v in values] or [(name, "")]
        ctx.out(table(["Config name", "Value"], rows))
    return ExitCode.OK


COMMANDS = {"start": cmd_start, "stop": cmd_stop, "config": cmd_config}


# --- output helpers -------------------------------------------------------------


def _show(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


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

    def __init__(self, args, stdout, stderr):
        self.args, self.stdout, self.stderr = args, stdout, stderr
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

    def start_server(self, host: str, port: int):
        """Spawn a detached server and wait until it answers; return its Address."""
        from localrt import server

        try:
            server.check_port_free(host, port)
            child = server.spawn(self.settings, host, port)
            return server.wait_started(self.settings, child)
        except (server.PortInUse, RuntimeError) as exc:
            raise CliError(str(exc), ExitCode.UNAVAILABLE) from None

    def call(self, fn):
        """Run `fn(client)`; if no server is running, start one first and say so."""
        from localrt import server
        from localrt.client import Client, Unreachable

        address = server.locate(self.settings)
        try:
            return fn(Client(address.url))
        except Unreachable:
            if server.read_pid_file(self.settings):
                raise  # a server process exists but does not answer; starting another won't help
        address = self.start_server(self.settings["apiServerHost"], self.settings["apiServerPort"])
        self.err(f"The localrt server was not running; started it at {address.url}")
        return fn(Client(address.url))


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
    return parser


def main(argv=None, stdout=None, stderr=None) -> int:
    """Run the localrt command line; return its exit code."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
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
    ctx = Context(args, stdout, stderr)
    try:
        return int(COMMANDS[args.command](ctx))
    except (CliError, ApiError, Unreachable, SettingsError) as exc:
        ctx.err(f"Error: {exc}")
        return next(exc.code if code is None else code
                    for kind, code in codes if isinstance(exc, kind))
    except KeyboardInterrupt:
        ctx.err("Interrupted")
        return ExitCode.INTERRUPTED
