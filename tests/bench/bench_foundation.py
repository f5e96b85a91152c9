"""Foundation benchmark: localrt's HTTP throughput, CLI latency, memory and start time.

Run it from the repository root (not collected by pytest; it has no test_ functions):

    .venv/bin/python tests/bench/bench_foundation.py

It prints one table with columns metric, localrt, reference, ratio, target, result.
Each localrt number is compared with a reference measured in the same run:

1. GET /v1/configs requests per second over HTTP/1.1 keep-alive, with 1 and 8
   client threads, against `localrt start --foreground --port 0` and against a
   bare waitress app (8 threads too) returning the same body and headers;
   median of 3 alternating runs. Target: localrt >= 0.7 x reference.
2. `localrt config status` wall time, median of 15 runs, against the running
   server; reference `python -c pass`. Target <= 150 ms. Also whether
   llama_cpp, onnxruntime_genai or jsonschema get imported by it (target: none).
3. `localrt --help` wall time, median of 15 runs. Target <= 100 ms.
4. Idle server RSS after a few requests and 1 s idle; reference the bare
   waitress server. Target <= 60 MB.
5. Detached `localrt start --port 0` until it returns having printed
   "Server started", median of 3 runs (stopped with `localrt stop` between).
   Target <= 1.5 s.

Every child process runs with HOME set to a temporary folder and PYTHONPATH
set to this checkout, so the real home directory is never touched, and every
server binds port 0. Load clients run in their own process, so on a small
machine the client competes with the server the same way for both servers.
The script re-invokes itself for its helper processes (`--load`, `--reference`,
`--import-check`). Results are printed only; the exit code is 0 unless
something crashes.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
SELF = str(Path(__file__).resolve())
CONFIGS = "/v1/configs"

LOAD_SECONDS = 3.0
WARMUP_REQUESTS = 50
ROUNDS = 3
CLI_RUNS = 15
START_RUNS = 3
HEAVY = ("llama_cpp", "onnxruntime_genai", "jsonschema")

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# --- helper process modes -----------------------------------------------------------


def load_client(host: str, port: int, threads: int, seconds: float) -> None:
    """Hammer GET /v1/configs from `threads` keep-alive connections; print the rate as JSON."""
    counts = [0] * threads
    errors: list[str] = []
    window = {}

    def open_window():  # runs once, when every thread has warmed up
        window["start"] = time.monotonic()
        window["end"] = window["start"] + seconds

    barrier = threading.Barrier(threads, action=open_window)

    def get(conn):
        conn.request("GET", CONFIGS)
        resp = conn.getresponse()
        resp.read()
        if resp.status != 200:
            raise RuntimeError(f"status {resp.status}")

    def worker(i):
        conn = http.client.HTTPConnection(host, port, timeout=10)
        try:
            for _ in range(WARMUP_REQUESTS):
                get(conn)
            barrier.wait()
            while time.monotonic() < window["end"]:
                get(conn)
                counts[i] += 1
        except Exception as exc:  # reported by the caller
            errors.append(repr(exc))
            barrier.abort()
        finally:
            conn.close()

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.monotonic() - window.get("start", time.monotonic())
    rps = sum(counts) / elapsed if elapsed > 0 else 0.0
    print(json.dumps({"rps": rps, "errors": errors[:3]}))


def reference_server(spec_path: str) -> None:
    """A bare waitress app that returns localrt's GET /v1/configs bytes; prints its port."""
    from waitress.server import create_server

    spec = json.loads(Path(spec_path).read_text())
    body = spec["body"].encode("utf-8")
    headers = [(k, v) for k, v in spec["headers"]]

    def app(environ, start_response):
        start_response("200 OK", list(headers))
        return [body]

    server = create_server(app, host="127.0.0.1", port=0, threads=8, ident="reference")
    print(server.effective_port, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.run()


def import_check() -> None:
    """Run `config status` in-process; print which heavy modules it imported."""
    import io

    from localrt.cli import main

    code = main(["config", "status"], io.StringIO(), io.StringIO())
    print(json.dumps({"rc": code, "loaded": [m for m in HEAVY if m in sys.modules]}))


# --- processes ----------------------------------------------------------------------


def child_env(home: Path) -> dict:
    env = dict(os.environ)
    env["HOME"] = str(home)
    env["PYTHONPATH"] = str(REPO)
    env.pop("LOCALRT_CONFIG", None)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def new_home(root: Path, name: str) -> Path:
    """A temporary HOME whose settings file has a free apiServerPort.

    Servers are started with --port 0 and found through the pid file; the free
    port only keeps a CLI that auto-starts a server away from the default port.
    """
    from localrt import settings

    home = root / name
    home.mkdir()
    settings.load(environ={"HOME": str(home)}).update({"apiServerPort": free_port()})
    return home


def settings_for(home: Path):
    from localrt import settings

    return settings.load(environ={"HOME": str(home)})


def start_foreground(home: Path, procs: list):
    """`localrt start --foreground --port 0`; returns (process, Address) once healthy."""
    from localrt import server

    proc = subprocess.Popen([PY, "-m", "localrt", "start", "--foreground", "--port", "0"],
                            env=child_env(home), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    procs.append(proc)
    return proc, server.wait_started(settings_for(home), proc)


def start_reference(spec_path: Path, home: Path, procs: list):
    """The bare waitress child; returns (process, port)."""
    proc = subprocess.Popen([PY, SELF, "--reference", str(spec_path)], env=child_env(home),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    procs.append(proc)
    line = proc.stdout.readline()
    if not line.strip().isdigit():
        raise RuntimeError("reference server did not report its port")
    return proc, int(line)


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_detached(home: Path) -> None:
    """Last resort for `localrt start` servers: SIGTERM, then SIGKILL, by the pid file."""
    from localrt import server

    address = server.read_pid_file(settings_for(home))
    if not address:
        return
    os.kill(address.pid, signal.SIGTERM)
    if not server.wait_stopped(address, timeout=5):
        os.kill(address.pid, signal.SIGKILL)


# --- measurements -------------------------------------------------------------------


def fetch(port: int, path: str = CONFIGS):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.getheaders(), resp.read()
    finally:
        conn.close()


def write_reference_spec(port: int, path: Path) -> None:
    """Save localrt's GET /v1/configs body and its own headers for the reference child."""
    status, headers, body = fetch(port)
    if status != 200:
        raise RuntimeError(f"GET {CONFIGS} answered {status}")
    skip = {"server", "date", "connection"}  # waitress adds these itself
    kept = [(k, v) for k, v in headers if k.lower() not in skip]
    path.write_text(json.dumps({"body": body.decode("utf-8"), "headers": kept}))


def measure_rps(port: int, threads: int, home: Path) -> float:
    out = subprocess.run([PY, SELF, "--load", str(port), str(threads), str(LOAD_SECONDS)],
                         env=child_env(home), capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    if result["errors"]:
        raise RuntimeError(f"load client errors on port {port}: {result['errors']}")
    return result["rps"]


def throughput(localrt_port: int, ref_port: int, home: Path) -> dict:
    """Median of ROUNDS alternating runs: {threads: (localrt rps, reference rps)}."""
    runs: dict = {1: ([], []), 8: ([], [])}
    for _ in range(ROUNDS):
        for threads, samples in runs.items():
            for port, sample in zip((localrt_port, ref_port), samples):
                sample.append(measure_rps(port, threads, home))
    return {threads: tuple(statistics.median(s) for s in samples)
            for threads, samples in runs.items()}


def wall_time(cmd: list, home: Path) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env=child_env(home), stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def median_wall(cmd: list, home: Path, runs: int = CLI_RUNS) -> float:
    wall_time(cmd, home)  # warm the page cache and .pyc files
    return statistics.median(wall_time(cmd, home) for _ in range(runs))


def heavy_modules(home: Path) -> list:
    out = subprocess.run([PY, SELF, "--import-check"], env=child_env(home),
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    if result["rc"] != 0:
        raise RuntimeError(f"config status exited with {result['rc']}")
    return result["loaded"]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def idle_rss(ports_pids: list) -> list:
    """RSS in MB of each (port, pid) server after a few requests and 1 s idle."""
    for port, _ in ports_pids:
        for _ in range(5):
            fetch(port)
    time.sleep(1)
    return [rss_mb(pid) for _, pid in ports_pids]


def detached_start(home: Path) -> float:
    """Median time of `localrt start --port 0` until it returns; stopped after each run."""
    env = child_env(home)
    times = []
    for _ in range(START_RUNS):
        begin = time.perf_counter()
        out = subprocess.run([PY, "-m", "localrt", "start", "--port", "0"], env=env,
                             capture_output=True, text=True, timeout=30)
        times.append(time.perf_counter() - begin)
        try:
            if "Server started" not in out.stdout:
                raise RuntimeError(f"localrt start printed {out.stdout!r} {out.stderr!r}")
        finally:
            subprocess.run([PY, "-m", "localrt", "stop"], env=env, capture_output=True,
                           timeout=30)
    return statistics.median(times)


# --- report -------------------------------------------------------------------------


def row(metric, value, ref, fmt, target_text, ok):
    ratio = f"{value / ref:.2f}x" if ref else "-"
    ref_text = fmt.format(ref) if ref is not None else "-"
    return [metric, fmt.format(value), ref_text, ratio, target_text, "PASS" if ok else "FAIL"]


def print_table(rows) -> None:
    headers = ["metric", "localrt", "reference", "ratio", "target", "result"]
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    print("\n".join([rule, line(headers), rule, *(line(r) for r in rows), rule]))


def run_bench(root: Path, procs: list, homes: list) -> list:
    home = new_home(root, "home")
    homes.append(home)
    server_proc, address = start_foreground(home, procs)
    spec = root / "reference.json"
    write_reference_spec(address.port, spec)
    ref_proc, ref_port = start_reference(spec, home, procs)

    rss_localrt, rss_ref = idle_rss([(address.port, server_proc.pid), (ref_port, ref_proc.pid)])
    rps = throughput(address.port, ref_port, home)
    [rss_after] = idle_rss([(address.port, server_proc.pid)])

    python_pass = median_wall([PY, "-c", "pass"], home)
    status = median_wall([PY, "-m", "localrt", "config", "status"], home)
    loaded = heavy_modules(home)
    help_time = median_wall([PY, "-m", "localrt", "--help"], home)

    start_home = new_home(root, "start-home")
    homes.append(start_home)
    start_time = detached_start(start_home)

    ms = "{:.0f} ms"
    rows = [row(f"GET {CONFIGS} rps, {n} thread{'s' if n > 1 else ''}", lr, ref, "{:.0f}",
                ">= 0.70x ref", lr >= 0.7 * ref) for n, (lr, ref) in rps.items()]
    rows += [
        row("config status wall (median)", status * 1000, python_pass * 1000, ms, "<= 150 ms",
            status <= 0.150),
        ["config status heavy imports", ", ".join(loaded) or "none", "-", "-", "none",
         "FAIL" if loaded else "PASS"],
        row("--help wall (median)", help_time * 1000, python_pass * 1000, ms, "<= 100 ms",
            help_time <= 0.100),
        row("idle server RSS", rss_localrt, rss_ref, "{:.1f} MB", "<= 60 MB", rss_localrt <= 60),
        row("idle server RSS after load", rss_after, rss_ref, "{:.1f} MB", "<= 60 MB",
            rss_after <= 60),
        row("start (detached) wall (median)", start_time * 1000, python_pass * 1000, ms,
            "<= 1500 ms", start_time <= 1.5),
    ]
    return rows


def main() -> int:
    procs: list = []
    homes: list = []
    with tempfile.TemporaryDirectory(prefix="localrt-bench-") as tmp:
        try:
            rows = run_bench(Path(tmp), procs, homes)
        finally:
            for proc in procs:
                stop_process(proc)
            for home in homes:
                stop_detached(home)
    print(f"localrt foundation bench: python {sys.version.split()[0]}, {os.cpu_count()} cpus, "
          f"{LOAD_SECONDS:.0f} s per load run, median of {ROUNDS}; "
          f"CLI times are medians of {CLI_RUNS}; reference for CLI rows is `python -c pass`")
    print_table(rows)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--load":
        load_client("127.0.0.1", int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--reference":
        reference_server(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "--import-check":
        import_check()
    else:
        sys.exit(main())
