"""Real servers and sockets: requests as curl makes them, `localrt start --foreground`
as a child process, a free port, and a stream read one event at a time."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from socketserver import ThreadingMixIn
from types import SimpleNamespace
from urllib.parse import urlsplit
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from localrt import settings as settings_mod

from support import REPO


def send(url, method, path, body=None, timeout=10):
    """One JSON request to a real server, as curl users make them: (status, decoded
    reply), error replies included."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(home: Path) -> dict:
    """The environment for a localrt child process: this checkout, this test's HOME."""
    env = dict(os.environ)
    env["HOME"] = str(home)
    env.pop("LOCALRT_CONFIG", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    port: int
    settings: settings_mod.Settings

    def stop(self, sig=signal.SIGTERM, timeout=15):
        """Signal the server, wait for it, and close its output pipes; its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()  # never leave a server behind
            self.process.wait()
            raise
        finally:
            self.process.stdout.close()
            self.process.stderr.close()


class LoggedServer:
    """`localrt start --foreground --port 0` on a HOME of its own under `folder`, its
    stderr appended to folder/server.log, for the long campaigns (tests/bench): they
    start it again on the same HOME after a death and quote the log's tail. `program`
    is the command before `start` (`python -m localrt` by default)."""

    def __init__(self, folder: Path, program: list | None = None):
        self.folder = folder
        self.home = folder / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.log = open(folder / "server.log", "ab")
        self.program = program or [sys.executable, "-m", "localrt"]
        self.process: subprocess.Popen | None = None
        self.url, self.port = "", 0

    def start(self, changes: dict | None = None) -> None:
        """Apply `changes` to its settings and start it; returns once /healthz answers."""
        from localrt import server

        settings = settings_mod.load(environ={"HOME": str(self.home)})
        if changes:
            settings.update(changes)
        cmd = [*self.program, "start", "--foreground", "--port", "0"]
        self.process = subprocess.Popen(cmd, env=subprocess_env(self.home),
                                        stdout=subprocess.DEVNULL, stderr=self.log)
        address = server.wait_started(settings, self.process, timeout=60)
        self.url, self.port = address.url, address.port

    def alive(self) -> bool:
        """Whether the server process still runs."""
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s."""
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def close(self) -> None:
        """Stop it and close its log."""
        self.stop()
        self.log.close()


def run_foreground_server(home: Path, extra=()) -> Server:
    """`localrt start --foreground --port 0` as a child; returns once /healthz answers."""
    from localrt import server

    settings = settings_mod.load(environ={"HOME": str(home)})
    cmd = [sys.executable, "-m", "localrt", "start", "--foreground", "--port", "0", *extra]
    process = subprocess.Popen(cmd, env=subprocess_env(home), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    try:
        address = server.wait_started(settings, process)
    except RuntimeError as exc:
        raise AssertionError(f"{exc}: {process.stderr.read().decode()}") from None
    return Server(process, address.url, address.port, settings)


LONG = 3600  # seconds: a connection timeout no test outlives


@contextmanager
def waitress_server(app, threads: int, queued: int = 0, timeout: float = LONG):
    """localrt.connections' server for `app` on loopback, in a thread of this process,
    as localrt.server.serve makes it: `threads` worker threads and up to `queued` more
    as requests wait, its connections' clocks `timeout` seconds. Yields (url, port,
    server); the server and its threads end after."""
    from localrt import connections
    from waitress import wasyncore

    srv = connections.make_server(app, "127.0.0.1", 0, threads, 1024, timeout, timeout,
                                  queued=queued)
    loop = threading.Thread(target=srv.run, daemon=True)
    loop.start()
    try:
        port = int(srv.effective_port)
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port, server=srv)
    finally:
        srv.trigger.pull_trigger(lambda: wasyncore.close_all(srv._map))  # ends the loop
        loop.join(30)
        srv.task_dispatcher.shutdown()


def raw_request(port: int, method: str, path: str, body=None, timeout: float = 30,
                close: bool = False) -> socket.socket:
    """A request sent on its own connection, its reply left unread; `close` asks the
    server to close the connection after its reply, so the reply ends at EOF."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    data = b"" if body is None else json.dumps(body).encode()
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n"
    if body is not None:
        head += "Content-Type: application/json\r\n"
    if close:
        head += "Connection: close\r\n"
    sock.sendall(head.encode() + b"\r\n" + data)
    return sock


class QuietHandler(WSGIRequestHandler):
    """wsgiref's handler without its access log on stderr."""

    def log_message(self, *args):
        pass


class ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """wsgiref's server, a thread a request, as the real server answers them."""

    daemon_threads = True


class RawStream:
    """A streamed chat on its own connection, read one Server-Sent Event at a time."""

    def __init__(self, url, body, timeout=60):
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        self.conn.request("POST", "/v1/chat/completions", json.dumps(body),
                          {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()

    def __iter__(self):
        """Each event's data: a decoded chunk, or the string "[DONE]"."""
        for line in self.resp:
            if line.startswith(b"data: "):
                data = line[6:].strip()
                yield "[DONE]" if data == b"[DONE]" else json.loads(data)

    def close(self):
        """Hang up without reading the rest."""
        self.resp.close()
        self.conn.close()

