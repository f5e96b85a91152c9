"""Soak: about five minutes of mixed traffic against one server, then its health.

Run it from the repository root (not collected by pytest; it has no test_ functions):

    .venv/bin/python tests/bench/bench_soak.py [--seconds 300]

The traffic, all at once, for --seconds:

- 8 threads of metadata requests, each over its own keep-alive connection, round
  robin over GET /healthz, /v1/models, /v1/models/{id}, /v1/models/status,
  /v1/models/pull, /v1/configs, /v1/engines, /openapi.json, and a PATCH
  /v1/configs that writes the settings file;
- 2 threads of streamed chat completions (max_tokens 64, temperature 0.7) against
  a small Q4_0 model, each stream read to [DONE];
- 1 thread of pulls from the hub emulator (tests/hubemu.py, its own process):
  pull a 64 MiB model, wait for Success, delete it, again.

Errors are any non-2xx reply, connection error, or stream without [DONE]. Server
RSS (VmRSS) and open file descriptors (/proc/<pid>/fd) are read after a warm-up
minute, when every kind of traffic has run, and again at the end, after the
traffic has stopped and the server has been idle for 2 s.

It prints one table: metric, value, target, result. Targets: zero errors; RSS
growth after warm-up at most 64 MB; open file descriptors at the end no more than
after warm-up (no leak). Every child runs with HOME in a temporary folder and
binds port 0.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
for p in (str(REPO), str(TESTS)):
    if p not in sys.path:
        sys.path.insert(0, p)

from benchlib import api, make_weights, quantize, start_hub, start_server  # noqa: E402

METADATA_THREADS = 8
CHAT_THREADS = 2
RSS_GROWTH_MB = 64
WARMUP = 60.0
MODEL_ID = "soak"


def proc_status(pid: int) -> tuple[int, int]:
    """(VmRSS in kB, open file descriptors) of a process."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


class Tally:
    """Counts per kind of traffic, and the first few errors; `lock` guards both."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ok: dict[str, int] = {}
        self.errors: list[str] = []

    def add(self, kind: str, error: str | None = None) -> None:
        with self.lock:
            if error is None:
                self.ok[kind] = self.ok.get(kind, 0) + 1
            else:
                self.errors.append(f"{kind}: {error}")


def metadata_loop(port: int, stop: threading.Event, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    paths = ["/healthz", "/v1/models", f"/v1/models/{MODEL_ID}", "/v1/models/status",
             "/v1/models/pull", "/v1/configs", "/v1/engines", "/openapi.json"]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    i = 0
    while not stop.is_set():
        i += 1
        try:
            if i % 25 == 0:
                status, _ = api(port, "PATCH", "/v1/configs",
                                {"no_proxy": f"localhost,127.0.0.1,::1,soak{rng.randrange(9)}"},
                                conn=conn)
                kind = "PATCH /v1/configs"
            else:
                path = paths[i % len(paths)]
                status, _ = api(port, "GET", path, conn=conn)
                kind = "GET"
            tally.add(kind, None if status == 200 else f"HTTP {status}")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            tally.add("metadata", repr(exc))
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.close()


def chat_loop(port: int, stop: threading.Event, tally: Tally) -> None:
    body = {"model": MODEL_ID, "stream": True, "max_tokens": 64, "temperature": 0.7,
            "messages": [{"role": "user", "content": "Tell me about the sea."}]}
    while not stop.is_set():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                tally.add("chat", f"HTTP {resp.status}: {resp.read()[:200]!r}")
                continue
            done = False
            for line in resp:
                if line.strip() == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: ") and b'"error"' in line:
                    tally.add("chat", line.decode().strip())
            tally.add("chat stream", None if done else "stream ended without [DONE]")
        except (OSError, http.client.HTTPException) as exc:
            tally.add("chat", repr(exc))
        finally:
            conn.close()


def pull_loop(port: int, stop: threading.Event, tally: Tally) -> None:
    model = "org:soak:soak.gguf"
    while not stop.is_set():
        try:
            status, body = api(port, "POST", "/v1/models/org/soak/pull")
            if status != 200:
                tally.add("pull", f"HTTP {status}: {body}")
                time.sleep(1)
                continue
            task_id = body["task"]["id"]
            while True:
                status, tasks = api(port, "GET", "/v1/models/pull")
                task = {t["id"]: t for t in tasks["data"]}.get(task_id)
                if task and task["status"] not in ("Pending", "Downloading"):
                    break
                time.sleep(0.1)
            if task["status"] != "Success":
                tally.add("pull", f"task ended {task['status']}: {task.get('error')}")
                continue
            status, body = api(port, "DELETE", f"/v1/models/{model}")
            tally.add("pull + delete", None if status == 200 else f"delete HTTP {status}")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            tally.add("pull", repr(exc))
            time.sleep(1)


def make_model(folder: Path) -> Path:
    """A small random llama, quantized to Q4_0 by llama.cpp: replies take a second or two."""
    from ggufgen import write_gguf

    source = write_gguf(folder / "soak-f16.gguf", name="soak", n_embd=512, n_layer=4,
                        n_ff=1024, context_length=2048, file_type="F16")
    return quantize(source, folder / "soak-Q4_0.gguf", "Q4_0")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    args = parser.parse_args(argv)
    warmup = min(WARMUP, args.seconds / 3)
    with tempfile.TemporaryDirectory(prefix="localrt-soak-") as tmp:
        tmp = Path(tmp)
        model = make_model(tmp)
        weights = tmp / "pull.gguf"
        make_weights(weights, 64 << 20, "soakpull")
        hub, hub_url = start_hub("org/soak", "soak.gguf", weights)
        proc, port = start_server(tmp / "home", {"modelHubUrl": hub_url})
        try:
            status, body = api(port, "POST", "/v1/models/import",
                               {"path": str(model), "id": MODEL_ID})
            assert status == 200, body
            status, body = api(port, "POST", f"/v1/models/{MODEL_ID}/start", {})
            assert status == 200, body
            tally, stop = Tally(), threading.Event()
            threads = [threading.Thread(target=metadata_loop, args=(port, stop, tally, i))
                       for i in range(METADATA_THREADS)]
            threads += [threading.Thread(target=chat_loop, args=(port, stop, tally))
                        for _ in range(CHAT_THREADS)]
            threads.append(threading.Thread(target=pull_loop, args=(port, stop, tally)))
            started = time.monotonic()
            for t in threads:
                t.start()
            time.sleep(warmup)
            rss_warm, fds_warm = proc_status(proc.pid)
            time.sleep(max(0.0, args.seconds - (time.monotonic() - started)))
            stop.set()
            for t in threads:
                t.join(timeout=180)
            elapsed = time.monotonic() - started
            time.sleep(2)
            rss_end, fds_end = proc_status(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            hub.stdin.close()
            hub.wait(timeout=30)

    growth = (rss_end - rss_warm) / 1024
    rows = [("run, seconds", f"{elapsed:.0f}", "", "")]
    rows += [(f"requests ok: {kind}", str(n), "", "") for kind, n in sorted(tally.ok.items())]
    rows += [("errors", str(len(tally.errors)), "0", "ok" if not tally.errors else "FAILED"),
             ("server RSS after warm-up, MB", f"{rss_warm / 1024:.1f}", "", ""),
             ("server RSS growth after warm-up, MB", f"{growth:.1f}", f"<= {RSS_GROWTH_MB}",
              "ok" if growth <= RSS_GROWTH_MB else "FAILED"),
             ("open fds after warm-up / at the end", f"{fds_warm} / {fds_end}", "no growth",
              "ok" if fds_end <= fds_warm else "FAILED")]
    widths = [max(len(r[i]) for r in rows + [("metric", "value", "target", "result")])
              for i in range(4)]
    for row in [("metric", "value", "target", "result"), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    for error in tally.errors[:10]:
        print("error:", error)
    return 0 if not tally.errors and growth <= RSS_GROWTH_MB and fds_end <= fds_warm else 1


if __name__ == "__main__":
    sys.exit(main())
