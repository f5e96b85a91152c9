"""Test support: real OpenAI-compatible upstreams, llama-cpp-python's own server, on loopback.

Not a test module. Each replica is ``python -m llama_cpp.server`` (the
``llama-cpp-python[server]`` extra) in its own process, on a free port, with its output
in a log file the tests read: it prints ``Disconnected from client`` when a client
hangs up mid-stream.

It starts with ``--interrupt_requests False``: by default llama-cpp-python's server cuts
a running stream short as soon as any other request arrives, a health probe included.
It serves one request at a time; others wait for it, GET /v1/models too.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT = 120.0  # seconds: importing fastapi and llama_cpp is slow on a busy machine


def free_port() -> int:
    """A port nothing listens on now (bound to 0, then let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Replica:
    """One llama_cpp.server process."""

    process: subprocess.Popen
    port: int
    log: Path
    api_key: str | None = None
    scheme: str = "http"

    @property
    def url(self) -> str:
        """Its OpenAI base URL."""
        return f"{self.scheme}://127.0.0.1:{self.port}/v1"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def chats(self) -> int:
        """How many chat requests it has answered or is answering (its access log)."""
        return self.log_text().count('"POST /v1/chat/completions HTTP/1.1"')

    def kill(self) -> None:
        """SIGKILL: the replica dies as a crashed host would, mid-reply."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


def start_replica(model: Path, log: Path, *, api_key: str | None = None, n_ctx: int = 4096,
                  threads: int = 1, taskset: str | None = None, extra=(),
                  scheme: str = "http") -> Replica:
    """Start a replica serving `model`; returns once it answers GET /v1/models.

    `taskset` pins it to those CPUs; `scheme` is "https" when `extra` gives it a
    certificate (--ssl_keyfile, --ssl_certfile)."""
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host",
           "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads",
           str(threads), "--n_threads_batch", str(threads), "--interrupt_requests", "False",
           *extra]
    if api_key:
        cmd += ["--api_key", api_key]
    if taskset:
        cmd = ["taskset", "-c", taskset, *cmd]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy"):
        env.pop(name, None)
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    replica = Replica(process, port, log, api_key, scheme)
    try:
        wait_ready(replica)
    except BaseException:
        replica.stop()
        raise
    return replica


def wait_ready(replica: Replica, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {replica.api_key}"} if replica.api_key else {}
    unverified = ssl.create_default_context()
    unverified.check_hostname, unverified.verify_mode = False, ssl.CERT_NONE
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=unverified))
    while time.monotonic() < deadline:
        if replica.process.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited: {replica.log_text()[-2000:]}")
        try:
            with opener.open(urllib.request.Request(replica.url + "/models", headers=headers),
                             timeout=5) as resp:
                json.loads(resp.read())
                return
        except (OSError, ValueError):
            time.sleep(0.2)
    raise RuntimeError(f"llama_cpp.server did not answer in {timeout} s: "
                       f"{replica.log_text()[-2000:]}")
