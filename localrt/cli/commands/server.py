"""`localrt start` and `localrt stop`: the server's life, through localrt.server."""

from __future__ import annotations

import os
import signal

from localrt import server
from localrt.cli.context import CliError, Context, ExitCode
from localrt.client import Unreachable


def cmd_start(ctx: Context) -> int:
    """Start the server in the background, or in the foreground with --foreground."""
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


def cmd_stop(ctx: Context) -> int:
    """Stop the server gracefully and wait until its port is free.

    It never starts a server, so it connects itself rather than through ctx.client().
    """
    running = server.read_pid_file(ctx.settings)
    target = running or server.Address(ctx.settings["apiServerHost"],
                                       ctx.settings["apiServerPort"])
    try:
        ctx.connect(target, timeout=10).stop_server()
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
