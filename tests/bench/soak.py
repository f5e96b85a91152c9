"""Soak: mixed load against one real server for --minutes, and its health each minute.

Run it from the repository root (not collected by pytest; it has no test_ functions):

    .venv/bin/python tests/bench/soak.py --minutes 60 [--seed 1]

The server is `localrt start --foreground` in a child process, with a temporary HOME;
the hub emulator (tests/emulators/hubemu.py) runs in another. The load, all at once:

- streamed chats on two models (tiny generated GGUFs, `chat-a` and `chat-b`), two
  clients each; one stream in four is hung up after its first few events;
- completions (streamed or not) and embeddings (a tiny generated BERT, `embed`);
- pulls from the hub emulator (64 MiB, each connection capped at 2 MB/s): half are cancelled at a
  random point, the others end and the model is deleted;
- PATCH /v1/configs every couple of seconds;
- GET /v1/events listeners coming and going, three at a time, each for a few seconds;
- the connection flood of issue 25, item 1 for one minute in ten (from minute 7, or
  minute 1 in a run shorter than ten): 1,000 TCP connections that never send a byte,
  opened again as the server closes them (requestTimeout), while a probe times
  GET /v1/models every second.

Every minute it prints the server's RSS (VmRSS), open descriptors (/proc/<pid>/fd) and
threads (/proc/<pid>/task). At the end: each one's least-squares slope per minute over
the minutes after the warm-up (the first 5; a third of a short run), leaving out those
read during a flood; the idle readings before the load and after it (descriptors and
threads must come back to the first); the requests per kind, the 503s (expected: a kind
at its limit answers 503 with Retry-After) and every other error.

Targets: RSS grows less than 20 MB after the warm-up, descriptors and threads return to
their idle baseline, no error other than a 503. It prints figures and a verdict per
target and never asserts timings; the exit code is 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import resource
import socket
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

from benchlib import api, cap_hub, make_weights, start_hub, start_server  # noqa: E402

CHAT_MODELS = ("chat-a", "chat-b")
EMBED_MODEL = "embed"
PULL_REPO, PULL_FILE = "org/soak", "soak.gguf"
PULL_MODEL = "org:soak:soak.gguf"
PULL_SIZE = 64 << 20
PULL_RATE = 2e6            # bytes per second per connection: 8 connections, about 4 s a pull
FLOOD = 1000               # idle connections, as in tests/test_connections.py
FLOOD_EVERY = 10           # minutes between floods
FLOOD_MINUTES = 1
LISTENERS = 3
WARMUP_MINUTES = 5
RSS_GROWTH_MB = 20
IDLE_WAIT = 10.0           # seconds the server idles before an idle reading


def proc_reading(pid: int) -> tuple[int, int, int]:
    """(VmRSS in kB, open descriptors, threads) of a process."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (x, y) points; 0 for fewer than two."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


class Tally:
    """Requests per kind, 503s per kind and the errors; `lock` guards all three."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ok: dict[str, int] = {}
        self.busy: dict[str, int] = {}
        self.errors: list[str] = []

    def add(self, kind: str, status: int | None = None, error: str | None = None) -> None:
        """Count one request: a 2xx status, a 503, or an error (another status or none)."""
        with self.lock:
            if error is None and status is not None and 200 <= status < 300:
                self.ok[kind] = self.ok.get(kind, 0) + 1
            elif error is None and status == 503:
                self.busy[kind] = self.busy.get(kind, 0) + 1
            else:
                self.errors.append(f"{time.strftime('%H:%M:%S')} {kind}: "
                                   f"{error or f'HTTP {status}'}")


class Load:
    """The soak's client threads against one server; they run until `stop` is set."""

    def __init__(self, port: int, pid: int, tally: Tally, seed: int):
        self.port = port
        self.pid = pid
        self.tally = tally
        self.seed = seed
        self.stop = threading.Event()
        self.flooding = threading.Event()
        self.flood_worst = 0.0  # seconds: the slowest GET /v1/models during a flood
        self.flood_peak_fds = 0  # the server's most open descriptors during a flood
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start every client thread."""
        loops = [(self.chat, m, i) for m in CHAT_MODELS for i in range(2)]
        loops += [(self.completion, None, 0), (self.embedding, None, 0), (self.pull, None, 0),
                  (self.configs, None, 0), (self.flood_probe, None, 0)]
        loops += [(self.listener, None, i) for i in range(LISTENERS)]
        for n, (target, model, i) in enumerate(loops):
            rng = random.Random(self.seed * 1000 + n)
            args = (rng,) if model is None else (rng, model)
            t = threading.Thread(target=target, args=args, daemon=True,
                                 name=f"{target.__name__}-{model or i}")
            t.start()
            self.threads.append(t)

    def join(self, timeout: float) -> list[str]:
        """Stop the clients and wait for them; the names of any still running."""
        self.stop.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        return [t.name for t in self.threads if t.is_alive()]

    def _conn(self, timeout: float = 120) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def _post_stream(self, kind, path, body, rng) -> None:
        """POST a streamed request; read it to [DONE], or hang up early one time in four."""
        hang_up = rng.random() < 0.25
        conn = self._conn()
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                resp.read()
                self.tally.add(kind, resp.status)
                return
            seen, done = 0, False
            for line in resp:
                if line.startswith(b"data: "):
                    seen += 1
                    if line.strip() == b"data: [DONE]":
                        done = True
                        break
                    if b'"error"' in line:
                        self.tally.add(kind, error=line.decode().strip()[:300])
                        return
                    if hang_up and seen >= 3:
                        break
            if hang_up and seen >= 3:
                self.tally.add(kind + " (hung up)", 200)
            else:
                self.tally.add(kind, 200 if done else None,
                               None if done else "stream ended without [DONE]")
        except (OSError, http.client.HTTPException) as exc:
            self.tally.add(kind, error=repr(exc))
        finally:
            conn.close()

    def chat(self, rng, model) -> None:
        """Streamed chats on `model`."""
        while not self.stop.is_set():
            body = {"model": model, "stream": True, "max_tokens": rng.randint(16, 64),
                    "temperature": 0.8,
                    "messages": [{"role": "user", "content": f"Tell me about {rng.random()}"}]}
            self._post_stream("chat stream", "/v1/chat/completions", body, rng)

    def completion(self, rng) -> None:
        """Completions on either chat model, half of them streamed."""
        while not self.stop.is_set():
            body = {"model": rng.choice(CHAT_MODELS), "prompt": f"Once {rng.random()}",
                    "max_tokens": rng.randint(8, 32)}
            if rng.random() < 0.5:
                self._post_stream("completion stream", "/v1/completions",
                                  {**body, "stream": True}, rng)
                continue
            self._call("completion", "POST", "/v1/completions", body)

    def embedding(self, rng) -> None:
        """Embeddings of one to eight short texts."""
        while not self.stop.is_set():
            texts = [f"text {rng.random()}" for _ in range(rng.randint(1, 8))]
            self._call("embedding", "POST", "/v1/embeddings",
                       {"model": EMBED_MODEL, "input": texts})
            time.sleep(rng.uniform(0.0, 0.3))

    def _call(self, kind, method, path, body=None, timeout=120) -> tuple[int | None, dict]:
        try:
            status, reply = api(self.port, method, path, body, timeout=timeout)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.tally.add(kind, error=repr(exc))
            return None, {}
        self.tally.add(kind, status, None if status < 300 or status == 503
                       else f"HTTP {status}: {json.dumps(reply)[:300]}")
        return status, reply

    def pull(self, rng) -> None:
        """Pull, then cancel at a random point or let it end and delete the model."""
        while not self.stop.is_set():
            status, body = self._call("pull", "POST", f"/v1/models/{PULL_REPO}/pull")
            if status != 200:
                time.sleep(1)
                continue
            task_id = body["task"]["id"]
            cancel = rng.random() < 0.5
            if cancel:
                time.sleep(rng.uniform(0.1, 3.0))
                try:
                    status, reply = api(self.port, "DELETE", "/v1/models/pull",
                                        {"taskId": task_id})
                    # 409: the pull ended before the cancel came, a race of the client's
                    self.tally.add("pull cancel" if status != 409 else "pull cancel (too late)",
                                   200 if status == 409 else status,
                                   None if status in (200, 409, 503)
                                   else f"HTTP {status}: {json.dumps(reply)[:300]}")
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    self.tally.add("pull cancel", error=repr(exc))
            task = self._wait_task(task_id)
            if task is None:
                continue
            if task["status"] == "Success":
                self._call("delete", "DELETE", f"/v1/models/{PULL_MODEL}")
            elif not cancel:
                self.tally.add("pull", error=f"task ended {task['status']}: "
                               f"{task.get('error')}")

    def _wait_task(self, task_id: str) -> dict | None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            status, tasks = self._call("pull list", "GET", "/v1/models/pull")
            if status == 200:
                task = {t["id"]: t for t in tasks["data"]}.get(task_id)
                if task is None or task["status"] not in ("Pending", "Downloading"):
                    return task
            time.sleep(0.2)
        self.tally.add("pull", error=f"task {task_id} still running after 300 s")
        return None

    def configs(self, rng) -> None:
        """PATCH /v1/configs with a fresh value every couple of seconds, and read it back."""
        n = 0
        while not self.stop.wait(rng.uniform(1.0, 3.0)):
            n += 1
            value = f"localhost,127.0.0.1,::1,soak{n}"
            status, _ = self._call("config patch", "PATCH", "/v1/configs", {"no_proxy": value})
            status, config = self._call("config get", "GET", "/v1/configs")
            if status == 200 and config.get("no_proxy") != value:
                self.tally.add("config get", error=f"no_proxy {config.get('no_proxy')!r}, "
                               f"not {value!r}")

    def listener(self, rng) -> None:
        """GET /v1/events for a few seconds, hang up, again. A raw socket: http.client's
        reply cannot be read again after a read timed out, and pull progress keeps
        events coming, so only a clock ends the listening."""
        while not self.stop.is_set():
            listen_for = rng.uniform(0.5, 5.0)
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=120) as sock:
                    sock.sendall(b"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                    head = b""
                    while b"\r\n\r\n" not in head:
                        data = sock.recv(65536)
                        if not data:
                            raise ConnectionError(f"closed after {head!r:.200}")
                        head += data
                    status = int(head.split(b" ", 2)[1])
                    if status != 200:
                        self.tally.add("events", status)
                        time.sleep(1)
                        continue
                    deadline = time.monotonic() + listen_for
                    ended = False
                    while not ended and (left := deadline - time.monotonic()) > 0:
                        sock.settimeout(left)
                        try:
                            ended = not sock.recv(65536)
                        except TimeoutError:
                            break
                    self.tally.add("events", None if ended else 200,
                                   "the server ended the event stream" if ended else None)
            except (OSError, ValueError, IndexError) as exc:
                self.tally.add("events", error=repr(exc))
            time.sleep(rng.uniform(0.0, 1.0))

    def flood_probe(self, rng) -> None:
        """GET /v1/models every second while a flood is on; the slowest answer is kept."""
        while not self.stop.is_set():
            if not self.flooding.wait(timeout=1.0):
                continue
            started = time.monotonic()
            status, _ = self._call("models during flood", "GET", "/v1/models", timeout=30)
            if status is not None:
                self.flood_worst = max(self.flood_worst, time.monotonic() - started)
            time.sleep(1.0)

    def flood(self, seconds: float) -> int:
        """Hold FLOOD idle connections for `seconds`, opening again those the server
        closes; the number opened in all."""
        socks: list[socket.socket] = []
        opened = 0
        self.flooding.set()
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and not self.stop.is_set():
                alive = []
                for s in socks:
                    try:
                        if s.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                            s.close()  # the server closed it (requestTimeout)
                            continue
                    except BlockingIOError:
                        pass
                    except OSError:
                        s.close()
                        continue
                    alive.append(s)
                socks = alive
                while len(socks) < FLOOD:
                    try:
                        socks.append(socket.create_connection(("127.0.0.1", self.port),
                                                              timeout=10))
                        opened += 1
                    except OSError as exc:
                        self.tally.add("flood connect", error=repr(exc))
                        break
                self.flood_peak_fds = max(self.flood_peak_fds, proc_reading(self.pid)[1])
                time.sleep(1.0)
        finally:
            self.flooding.clear()
            for s in socks:
                s.close()
        return opened


def make_models(folder: Path) -> dict:
    """Two tiny chat models and a tiny BERT: {id: path}."""
    from emulators.ggufgen import write_bert_gguf, write_gguf

    paths = {model: write_gguf(folder / f"{model}.gguf", name=model, n_embd=128,
                               context_length=512, seed=i)
             for i, model in enumerate(CHAT_MODELS)}
    paths[EMBED_MODEL] = write_bert_gguf(folder / "embed.gguf")
    return paths


def flood_minutes(minutes: int) -> set[int]:
    """The minutes (from 0) during which the flood is on."""
    first = 7 if minutes >= FLOOD_EVERY else 1
    return {start + k for start in range(first, minutes, FLOOD_EVERY)
            for k in range(FLOOD_MINUTES)}


def run(minutes: int, seed: int, out) -> int:
    """The soak; prints as it goes to `out`; 0 when every target is met."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FLOOD + 512
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    warmup = min(WARMUP_MINUTES, minutes // 3)
    floods = flood_minutes(minutes)

    def say(*args):
        print(*args, file=out, flush=True)

    with tempfile.TemporaryDirectory(prefix="localrt-soak-") as tmp:
        tmp = Path(tmp)
        models = make_models(tmp)
        weights = make_weights(tmp / "pull.gguf", PULL_SIZE, "soakpull")
        hub, hub_url = start_hub(PULL_REPO, PULL_FILE, weights)
        cap_hub(hub, PULL_RATE)
        proc, port = start_server(tmp / "home", {"modelHubUrl": hub_url,
                                                  "maxRunningModels": 3})
        tally = Tally()
        load = Load(port, proc.pid, tally, seed)
        readings: list[tuple[int, int, int, int, bool]] = []  # minute, rss, fds, threads, flood
        try:
            for model, path in models.items():
                status, body = api(port, "POST", "/v1/models/import",
                                   {"path": str(path), "id": model})
                assert status == 200, body
                status, body = api(port, "POST", f"/v1/models/{model}/start", {})
                assert status == 200, body
            # One request of each kind, so the idle baseline has loaded what they load.
            for model in CHAT_MODELS:
                api(port, "POST", "/v1/chat/completions", {
                    "model": model, "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}]})
            api(port, "POST", "/v1/embeddings", {"model": EMBED_MODEL, "input": "hi"})
            time.sleep(IDLE_WAIT)
            idle_before = proc_reading(proc.pid)
            say(f"soak: {minutes} min, seed {seed}, server pid {proc.pid}, port {port}; "
                f"floods in minutes {sorted(floods)}; warm-up {warmup} min")
            say(f"idle before the load: RSS {idle_before[0] / 1024:.1f} MB, "
                f"{idle_before[1]} fds, {idle_before[2]} threads")
            say(f"{'minute':>6} {'RSS MB':>8} {'fds':>5} {'threads':>7} {'ok':>7} "
                f"{'503s':>5} {'errors':>6}  flood")
            started = time.monotonic()
            load.start()
            flood_thread = None
            for minute in range(minutes + 1):
                time.sleep(max(0.0, started + 60 * minute - time.monotonic()))
                rss, fds, threads = proc_reading(proc.pid)
                flooding = load.flooding.is_set()
                readings.append((minute, rss, fds, threads, flooding))
                with tally.lock:
                    ok, busy, errors = (sum(tally.ok.values()), sum(tally.busy.values()),
                                        len(tally.errors))
                say(f"{minute:>6} {rss / 1024:>8.1f} {fds:>5} {threads:>7} {ok:>7} "
                    f"{busy:>5} {errors:>6}  {'on' if flooding else ''}")
                if minute in floods and minute < minutes:
                    flood_thread = threading.Thread(target=load.flood,
                                                    args=(60 * FLOOD_MINUTES - 2,), daemon=True)
                    flood_thread.start()
            stuck = load.join(timeout=180)
            if flood_thread:
                flood_thread.join(timeout=60)
            for name in stuck:
                tally.add("client", error=f"{name} still running 180 s after the stop")
            time.sleep(IDLE_WAIT)
            idle_after = proc_reading(proc.pid)
            alive = proc.poll() is None
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except Exception:
                proc.kill()
            hub.stdin.close()
            hub.wait(timeout=30)

    steady = [r for r in readings if r[0] >= warmup and not r[4]]
    rss_slope = slope([(r[0], r[1] / 1024) for r in steady])
    fd_slope = slope([(r[0], r[2]) for r in steady])
    thread_slope = slope([(r[0], r[3]) for r in steady])
    growth = (max(r[1] for r in steady) - steady[0][1]) / 1024 if steady else 0.0
    span = steady[-1][0] - steady[0][0] if steady else 0
    say()
    say(f"after minute {warmup}, flood minutes left out ({len(steady)} readings):")
    say(f"  RSS slope      {rss_slope:+.3f} MB/min ({rss_slope * span:+.1f} MB over {span} min); "
        f"highest minus first {growth:+.1f} MB (target < {RSS_GROWTH_MB})")
    say(f"  fds slope      {fd_slope:+.3f} /min")
    say(f"  threads slope  {thread_slope:+.3f} /min")
    say(f"idle before / after: RSS {idle_before[0] / 1024:.1f} / {idle_after[0] / 1024:.1f} MB, "
        f"fds {idle_before[1]} / {idle_after[1]}, threads {idle_before[2]} / {idle_after[2]}")
    say(f"worst GET /v1/models during a flood: {load.flood_worst:.3f} s; the server held "
        f"up to {load.flood_peak_fds} fds then")
    say("requests ok per kind: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.ok.items())))
    say("503s per kind: " + (", ".join(f"{k} {v}" for k, v in sorted(tally.busy.items()))
                             or "none"))
    say(f"errors other than 503: {len(tally.errors)}")
    kinds: dict[str, int] = {}
    for error in tally.errors:
        kind = error.split(" ", 1)[1].split(":", 1)[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    if kinds:
        say("  per kind: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    for error in tally.errors[:20]:
        say("  " + error)
    targets = {
        "server alive at the end": alive,
        f"RSS growth after warm-up < {RSS_GROWTH_MB} MB": rss_slope * span < RSS_GROWTH_MB
        and growth < RSS_GROWTH_MB,
        "fds back to the idle baseline": idle_after[1] <= idle_before[1],
        "threads back to the idle baseline": idle_after[2] <= idle_before[2],
        "no error other than 503": not tally.errors,
    }
    for name, met in targets.items():
        say(f"{'ok    ' if met else 'MISSED'} {name}")
    return 0 if all(targets.values()) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    return run(args.minutes, args.seed, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
