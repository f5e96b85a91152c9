"""What the benchmarks share: a localrt server and a hub emulator, each in its own
process, JSON requests, and the model files they serve.

Not a benchmark. The bench scripts import it as `benchlib` (their folder is on
sys.path when they run); run as a script, it is the hub emulator's child process.
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
TESTS = REPO / "tests"


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


def make_weights(path: Path, size: int, name: str) -> Path:
    """A valid GGUF header padded with random bytes to `size`, so that registering
    it reads real metadata."""
    import shutil

    from emulators.ggufgen import write_fake_blob, write_gguf

    header = write_gguf(path.with_suffix(".head"), name=name)
    pad = write_fake_blob(path.with_suffix(".pad"), size - header.stat().st_size)
    with open(path, "wb") as out:
        for part in (header, pad):
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 4 << 20)
            part.unlink()
    return path


def quantize(source: Path, target: Path, ftype_name: str) -> Path:
    """Quantize a GGUF file with llama.cpp itself (ftype_name: "Q8_0", "Q4_0"), quietly."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    with quiet_stderr():
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(),
                                                params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize failed with status {status}")
    return target


def start_hub(repo: str, filename: str, weights: Path):
    """The hub emulator (tests/emulators/hubemu.py) in its own process, serving `weights` as
    `repo`/`filename`; (process, hub URL). Close the process's stdin to stop it."""
    hub = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), repo, filename,
                            str(weights)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True)
    return hub, hub.stdout.readline().strip()


def cap_hub(hub: subprocess.Popen, bytes_per_second: float | None) -> None:
    """Cap each connection of a start_hub child at `bytes_per_second` (None: uncapped),
    as a CDN edge does; returns once the child has it."""
    hub.stdin.write(f"cap {bytes_per_second or 'none'}\n")
    hub.stdin.flush()
    assert hub.stdout.readline().strip() == "ok"


def _serve_hub(repo: str, filename: str, weights: str) -> None:
    """start_hub's child: print the hub URL, then serve until stdin closes, taking
    `cap BYTES_PER_SECOND` and `cap none` lines from it (cap_hub)."""
    from emulators.hubemu import HubEmulator

    with HubEmulator() as hub:
        hub.add_repo(repo, {filename: Path(weights)})
        print(hub.url, flush=True)
        for line in sys.stdin:
            value = line.split()[1]
            hub.max_bytes_per_second = None if value == "none" else float(value)
            print("ok", flush=True)


if __name__ == "__main__":
    sys.path[:0] = [str(REPO), str(TESTS)]
    _serve_hub(*sys.argv[1:4])
