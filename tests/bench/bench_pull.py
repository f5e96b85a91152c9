"""Pull and registry benchmark: download speed against aria2c and curl, memory, and
GET /v1/models latency.

Run it from the repository root (not collected by pytest; it has no test_ functions):

    .venv/bin/python tests/bench/bench_pull.py [--size-mib 512]

It prints one table with columns metric, localrt, reference, ratio, target, result.
Every pull is of one file of --size-mib MiB (default 512) from the hub emulator
(tests/emulators/hubemu.py, in its own process, redirecting to its CDN port like the real hub),
through `POST /v1/models/pull`, timed from the POST until the DownloadSuccess event;
localrt checks the sha256 and fsyncs the file before it says so. Best of 3 runs each,
alternating with the reference.

1. A CDN that caps each connection at 25 MiB/s (`max_bytes_per_second`): localrt with
   its default downloadConnections (8) against `aria2c -x8 -s8 --checksum=sha-256=...`
   (8 connections, and the file checked, as localrt does). Target: >= 0.9 x aria2c's
   speed. Context rows: aria2c without the check, and localrt with
   downloadConnections 1 (one stream), one run.
2. Uncapped, on loopback: localrt against `curl -o FILE && sha256sum FILE` (the file
   fetched and checked). Target: >= 1.0 x. Context rows: `curl -o` alone, `curl -o`
   then `sync FILE` (on disk, as localrt leaves it), and localrt with one stream.
3. Server RSS growth during a pull: peak VmRSS sampled every 50 ms minus VmRSS before
   the pull, the most of all the pulls above. Target <= 32 MB.
4. GET /v1/models with 200 models registered (imported by symlink): median latency
   of 300 requests over one keep-alive connection, after 20 warm-up requests.
   Target <= 5 ms.

Every child runs with HOME in a temporary folder and binds port 0. The file is a
GGUF header followed by random bytes, so registration reads real metadata.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import shutil
import statistics
import subprocess
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

RUNS = 3
MODELS = 200
LIST_REQUESTS = 300
CAP = 25 * 2**20  # bytes per second per connection, for the capped runs
MODEL = "org/big"


def rss_kb(pid: int) -> int:
    """A process's resident memory, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Server:
    """A localrt server child with its own HOME, pulling from `hub_url`."""

    def __init__(self, home: Path, hub_url: str, connections: int):
        self.proc, self.port = start_server(home, {"modelHubUrl": hub_url, "logLevel": "INFO",
                                                   "downloadConnections": connections})
        self.growth_mb = 0.0  # the most RSS growth of any pull so far

    def pull(self) -> float:
        """Seconds from the POST to DownloadSuccess; the model is removed afterwards."""
        events = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        events.request("GET", "/v1/events")
        stream = events.getresponse()
        before = rss_kb(self.proc.pid)
        peak, done = [before], threading.Event()

        def sample():
            while not done.wait(0.05):
                peak.append(rss_kb(self.proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.perf_counter()
        status, body = api(self.port, "POST", "/v1/models/pull", {"model": MODEL})
        assert status == 200, body
        task_id = body["task"]["id"]
        while True:
            line = stream.readline()
            assert line, "the event stream ended"
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event["task"]["id"] == task_id and event["type"] in (
                    "DownloadSuccess", "DownloadError", "DownloadStopped"):
                break
        elapsed = time.perf_counter() - started
        done.set()
        sampler.join()
        events.close()
        assert event["type"] == "DownloadSuccess", event
        self.growth_mb = max(self.growth_mb, (max(peak) - before) / 1024)
        status, body = api(self.port, "DELETE", f"/v1/models/{task_id}")
        assert status == 200, body
        return elapsed

    def stop(self) -> None:
        """Stop the server and wait for it."""
        self.proc.terminate()
        self.proc.wait(15)


def aria2c_pull(url: str, target: Path, sha256: str | None) -> float:
    """Seconds for aria2c with 8 connections to fetch the file, and check its sha256
    if given."""
    check = [f"--checksum=sha-256={sha256}"] if sha256 else []
    started = time.perf_counter()
    subprocess.run(["aria2c", "-x8", "-s8", "-q", "--allow-overwrite=true",
                    "--auto-file-renaming=false", *check, "-d", str(target.parent),
                    "-o", target.name, url], check=True)
    elapsed = time.perf_counter() - started
    target.unlink()
    return elapsed


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


def file_sha256(path: Path) -> str:
    """A file's sha256, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def row(metric, value, ref, fmt, target_text, ok):
    """One line of the table: the value, the reference and their ratio, the target."""
    ratio = f"{value / ref:.2f}x" if ref else ""
    ref_text = fmt.format(ref) if ref else ""
    return [metric, fmt.format(value), ref_text, ratio, target_text, "ok" if ok else "MISSED"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=512)
    args = parser.parse_args()
    if shutil.which("aria2c") is None:
        print("aria2c is missing: apt-get install aria2", file=sys.stderr)
        return 2

    from emulators.ggufgen import write_gguf

    size = args.size_mib * 1024 * 1024
    mib_s = lambda seconds: size / seconds / 2**20  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="localrt-bench-") as tmp:
        root = Path(tmp)
        weights = root / "big.gguf"
        make_weights(weights, size, "bench")
        sha256 = file_sha256(weights)
        hub, hub_url = start_hub(MODEL, "big.gguf", weights)
        servers = []
        try:
            parallel = Server(root / "home8", hub_url, 8)
            servers.append(parallel)
            stream = Server(root / "home1", hub_url, 1)
            servers.append(stream)
            url = f"{hub_url}/{MODEL}/resolve/main/big.gguf"
            os.sync()  # the weights just written must not be flushed during the runs

            cap_hub(hub, CAP)
            ours_capped, aria2, aria2_unchecked = [], [], []
            for _ in range(RUNS):
                aria2.append(aria2c_pull(url, root / "aria2.out", sha256))
                aria2_unchecked.append(aria2c_pull(url, root / "aria2.out", None))
                ours_capped.append(parallel.pull())
            one_capped = stream.pull()

            cap_hub(hub, None)
            ours, ours_one, theirs, synced, checked = [], [], [], [], []
            for _ in range(RUNS):
                plain, then_synced, then_checked = curl_pull(url, root / "curl.out")
                theirs.append(plain)
                synced.append(then_synced)
                checked.append(then_checked)
                ours.append(parallel.pull())
                ours_one.append(stream.pull())
            print("seconds, capped: localrt", [round(t, 2) for t in ours_capped],
                  "aria2c", [round(t, 2) for t in aria2], "aria2c unchecked",
                  [round(t, 2) for t in aria2_unchecked], "localrt one stream",
                  round(one_capped, 2), file=sys.stderr)
            print("seconds, uncapped: localrt", [round(t, 2) for t in ours],
                  "localrt one stream", [round(t, 2) for t in ours_one],
                  "curl", [round(t, 2) for t in theirs],
                  "curl+sync", [round(t, 2) for t in synced],
                  "curl+sha256sum", [round(t, 2) for t in checked], file=sys.stderr)
            growth = max(s.growth_mb for s in servers)
            small = write_gguf(root / "small.gguf")
            latency = list_latency(parallel.port, small)
        finally:
            for server in servers:
                server.stop()
            hub.stdin.close()
            hub.wait(15)
    capped_rate, aria2_rate = mib_s(min(ours_capped)), mib_s(min(aria2))
    rate, checked_rate = mib_s(min(ours)), mib_s(min(checked))
    rows = [
        row(f"pull {args.size_mib} MiB, CDN at 25 MiB/s a connection, MiB/s", capped_rate,
            aria2_rate, "{:.0f}", ">= 0.9x aria2c -x8 -s8", capped_rate >= 0.9 * aria2_rate),
        row("  same, against aria2c without --checksum", capped_rate,
            mib_s(min(aria2_unchecked)), "{:.0f}", "(context)", True),
        row("  same, downloadConnections 1 (one stream)", mib_s(one_capped), aria2_rate,
            "{:.0f}", "(context)", True),
        row(f"pull {args.size_mib} MiB, uncapped loopback, MiB/s", rate, checked_rate,
            "{:.0f}", ">= 1.0x curl && sha256sum", rate >= checked_rate),
        row("  same, against curl -o alone", rate, mib_s(min(theirs)), "{:.0f}",
            "(context)", True),
        row("  same, against curl -o && sync FILE", rate, mib_s(min(synced)), "{:.0f}",
            "(context)", True),
        row("  same, downloadConnections 1 (one stream)", mib_s(min(ours_one)), checked_rate,
            "{:.0f}", "(context)", True),
        row("server RSS growth during a pull, MB", growth, None, "{:.1f}", "<= 32 MB",
            growth <= 32),
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
