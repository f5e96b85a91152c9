"""What the benchmarks share: a localrt server in its own process, and JSON requests to it.

Not a benchmark. The bench scripts import it as `benchlib` (their folder is on
sys.path when they run).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def child_env(home: Path) -> dict:
    """The environment of a child localrt: HOME at `home`, this checkout importable."""
    env = dict(os.environ, HOME=str(home))
    env.pop("LOCALRT_CONFIG", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def start_server(home: Path, changes: dict | None = None, timeout: float = 20.0):
    """`python -m localrt start --foreground --port 0` with HOME at `home`, after writing
    `changes` to its settings file; (process, port) once it answers."""
    from localrt import server, settings

    home.mkdir(parents=True, exist_ok=True)
    s = settings.load(environ={"HOME": str(home)})
    if changes:
        s.update(changes)
    proc = subprocess.Popen([sys.executable, "-m", "localrt", "start", "--foreground",
                             "--port", "0"], env=child_env(home), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return proc, server.wait_started(s, proc, timeout=timeout).port


def api(port: int, method: str, path: str, body=None, conn=None,
        timeout: float = 60) -> tuple[int, dict]:
    """One JSON request; a new connection unless `conn` is given."""
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"} if body is not None else {}
    conn.request(method, path, json.dumps(body) if body is not None else None, headers)
    resp = conn.getresponse()
    data = json.loads(resp.read())
    if own:
        conn.close()
    return resp.status, data


@contextlib.contextmanager
def quiet_stderr():
    """Silence file descriptor 2 (llama.cpp's quantizer prints every tensor there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
