"""Pull and registry benchmark: download speed against curl, memory, and GET /v1/models latency.

Run it from the repository root (not collected by pytest; it has no test_ functions):

    .venv/bin/python tests/bench/bench_pull.py [--size-mib 1024]

It prints one table with columns metric, localrt, reference, ratio, target, result:

1. Pulling one file of --size-mib MiB (default 1024) from the hub emulator
   (tests/hubemu.py, in its own process, redirecting to its CDN port like the real
   hub) through `POST /v1/models/pull`, timed from the POST until the task reports
   Success (polled every 50 ms); reference: `curl -sSL -o` of the same URL in the
   same run. Best of 3 runs each, alternating. Target: localrt >= 0.9 x curl's speed.
   localrt also checks the sha256 and fsyncs the file; curl does neither, so two
   more reference rows are `curl -o` followed by `sync FILE` (the file on disk, as
   localrt leaves it; on a slow disk this is what bounds both), and `curl -o`
   followed by `sha256sum`.
2. Server RSS growth during the pull: peak VmRSS sampled every 50 ms minus VmRSS
   before the pull. Target <= 32 MB.
3. GET /v1/models with 200 models registered (imported by symlink): median latency
   of 300 requests over one keep-alive connection, after 20 warm-up requests.
   Target <= 5 ms.

Every child runs with HOME in a temporary folder and binds port 0. The file is a
GGUF header followed by random bytes, so registration reads real metadata.
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
for p in (str(REPO), str(TESTS)):
    if p not in sys.path:
        sys.path.insert(0, p)

from benchlib import api, make_weights, start_hub, start_server  # noqa: E402

RUNS = 3
MODELS = 200
LIST_REQUESTS = 300


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def localrt_pull(port: int, pid: int, data_dir: Path) -> tuple[float, float]:
    """(seconds, RSS growth in MB) for one pull; the model is removed afterwards."""
    before = rss_kb(pid)
    peak = before
    started = time.perf_counter()
    status, body = api(port, "POST", "/v1/models/pull", {"model": "org/big"})
    assert status == 200, body
    task_id = body["task"]["id"]
    while True:
        peak = max(peak, rss_kb(pid))
        _, tasks = api(port, "GET", "/v1/models/pull")
        task = {t["id"]: t for t in tasks["data"]}[task_id]
        if task["status"] not in ("Pending", "Downloading"):
            break
        time.sleep(0.05)
    elapsed = time.perf_counter() - started
    assert task["status"] == "Success", task
    api(port, "DELETE", "/v1/models/org:big:big.gguf")
    return elapsed, (peak - before) / 1024


def curl_pull(url: str, target: Path) -> tuple[float, float, float]:
    """Seconds for curl -o; for curl -o, then `sync FILE` (on disk, as localrt leaves a
    file); and for curl -o, then sha256sum."""
    started = time.perf_counter()
    subprocess.run(["curl", "-sSL", "--fail", "-o", str(target), url], check=True)
    elapsed = time.perf_counter() - started
    subprocess.run(["sync", str(target)], check=True)  # coreutils: fsync of that file
    durable = time.perf_counter() - started
    subprocess.run(["sha256sum", str(target)], check=True, stdout=subprocess.DEVNULL)
    checked = time.perf_counter() - started - (durable - elapsed)
    target.unlink()
    return elapsed, durable, checked


def list_latency(port: int, gguf: Path) -> float:
    """Median ms of GET /v1/models with MODELS models registered."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    for i in range(MODELS):
        status, body = api(port, "POST", "/v1/models/import",
                           {"path": str(gguf), "id": f"bench/model-{i:03d}:q4"}, conn)
        assert status == 200, body
    times = []
    for i in range(20 + LIST_REQUESTS):
        started = time.perf_counter()
        status, body = api(port, "GET", "/v1/models", conn=conn)
        if i >= 20:
            times.append(time.perf_counter() - started)
    assert status == 200 and len(body["data"]) == MODELS
    conn.close()
    return statistics.median(times) * 1000


def row(metric, value, ref, fmt, target_text, ok):
    ratio = f"{value / ref:.2f}x" if ref else ""
    ref_text = fmt.format(ref) if ref else ""
    return [metric, fmt.format(value), ref_text, ratio, target_text, "ok" if ok else "MISSED"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    args = parser.parse_args()

    from ggufgen import write_gguf

    size = args.size_mib * 1024 * 1024
    with tempfile.TemporaryDirectory(prefix="localrt-bench-") as tmp:
        root = Path(tmp)
        weights = root / "big.gguf"
        make_weights(weights, size, "bench")
        hub, hub_url = start_hub("org/big", "big.gguf", weights)
        home = root / "home"
        proc, port = start_server(home, {"modelHubUrl": hub_url, "logLevel": "INFO"})
        try:
            url = f"{hub_url}/org/big/resolve/main/big.gguf"
            os.sync()  # the weights just written must not be flushed during the runs
            ours, theirs, synced, checked, growth = [], [], [], [], []
            for _ in range(RUNS):
                plain, then_synced, then_checked = curl_pull(url, root / "curl.out")
                theirs.append(plain)
                synced.append(then_synced)
                checked.append(then_checked)
                seconds, mb = localrt_pull(port, proc.pid, home / "localrt" / "models")
                ours.append(seconds)
                growth.append(mb)
            print("seconds: localrt", [round(t, 2) for t in ours], "curl",
                  [round(t, 2) for t in theirs], "curl+sync", [round(t, 2) for t in synced],
                  "curl+sha256sum", [round(t, 2) for t in checked], file=sys.stderr)
            ours_rate = size / min(ours) / 2**20
            curl_rate = size / min(theirs) / 2**20
            synced_rate = size / min(synced) / 2**20
            checked_rate = size / min(checked) / 2**20
            small = write_gguf(root / "small.gguf")
            latency = list_latency(port, small)
        finally:
            proc.terminate()
            proc.wait(15)
            hub.stdin.close()
            hub.wait(15)
    rows = [
        row(f"pull {args.size_mib} MiB, MiB/s", ours_rate, curl_rate, "{:.0f}", ">= 0.9x curl",
            ours_rate >= 0.9 * curl_rate),
        row("  same, against curl -o && sync FILE", ours_rate, synced_rate, "{:.0f}",
            "(context)", True),
        row("  same, against curl -o && sha256sum", ours_rate, checked_rate, "{:.0f}",
            "(context)", True),
        row("server RSS growth during pull, MB", max(growth), None, "{:.1f}", "<= 32 MB",
            max(growth) <= 32),
        row(f"GET /v1/models, {MODELS} models, median ms", latency, None, "{:.2f}", "<= 5 ms",
            latency <= 5),
    ]
    header = ["metric", "localrt", "reference", "ratio", "target", "result"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
