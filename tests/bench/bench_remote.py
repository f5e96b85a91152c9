"""Remote-model benchmark: what localrt adds in front of an upstream, and how replicas scale.

Run it from the repository root (not collected by pytest; it has no test_ functions):

    .venv/bin/python tests/bench/bench_remote.py [--max-tokens 128] [--rounds 4]

It prints one table with columns metric, localrt, reference, ratio, target, result, and
exits with status 1 when a row with a target is FAIL, 0 otherwise. It takes about three
minutes on 2 cores. It needs two cores for the scale rows (taskset -c 0 and -c 1) and
llama-cpp-python's server (`pip install 'llama-cpp-python[server]'`, the test extra).

The upstreams are llama-cpp-python's own server (`python -m llama_cpp.server
--interrupt_requests False`, tests/emulators/upstreams.py), each replica pinned with taskset to
one core and running the model on one thread. The model is bench_chat.py's synthetic
llama (106 M parameters, Q8_0, random weights, a 32000-token vocabulary). Requests are
greedy and ban the end-of-generation tokens through logit_bias, so each reply is exactly
--max-tokens (K) tokens. (A bias of hundreds of tokens would measure jsonschema instead:
localrt validates every request body, and a big logit_bias object takes it milliseconds.)
localrt runs as `python -m localrt start --foreground --port 0` in its own
process, with remote models on those replicas; the client is http.client with a new
connection per request, timestamping lines and parsing them afterwards.

Rows:
1. TTFT median, ms: from sending the request to the first chunk with content, through
   localrt and directly to the same replica, alternating, over --rounds rounds of
   --ttft-samples short (8-token) streams and --repeats K-token streams a side. Target:
   at most 2 ms added.
2. streamed decode tok/s: (K - 1) / (last content chunk - first), best of the K-token
   streams a side. Target >= 0.98 x direct.
3. Scale: --clients (4) streams of K tokens started together on a remote model with two
   replicas (cores 0 and 1), against the same on a remote model with one of them.
   Aggregate tok/s = all their tokens / (the last one's end - the first one's request),
   best of --scale-rounds (2). Target >= 1.8 x one replica. A replica serves one
   request at a time, so with one replica the clients queue behind each other. A
   context row does the same straight to the replicas, clients split between them by
   hand: what the machine itself allows (two replicas share its memory bandwidth).
Other processes' share of the CPUs while it measured goes to stderr: on a shared
machine the figures are noise, and the scale row needs both cores free.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(Path(__file__).resolve().parent)]

import benchlib  # noqa: E402  (this folder is on sys.path)
from bench_chat import PROMPT, eog_bias, first_last_content, make_model, row  # noqa: E402
from emulators.upstreams import start_replica  # noqa: E402

TTFT_TOKENS = 8
BIAS: dict = {}  # the model's end-of-generation tokens, banned (main sets it)


def chat_body(model: str, k: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": k, "temperature": 0, "logit_bias": BIAS, "stream": True}


def stream(host_port: tuple[str, int], path: str, model: str, k: int) -> dict:
    """One streamed chat over a new connection: TTFT, decode tok/s, start and end."""
    data = json.dumps(chat_body(model, k))
    started = time.perf_counter()
    conn = http.client.HTTPConnection(*host_port, timeout=600)
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    lines = []
    while True:  # only timestamps here: parsing would steal CPU from what is measured
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            lines.append((time.perf_counter(), line))
            if line.startswith(b"data: [DONE]"):
                break
    ended = time.perf_counter()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{path} answered {resp.status}")
    stamped = []
    for t, line in lines:
        if line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"the stream failed: {chunk['error']}")
        if chunk.get("choices"):
            stamped.append((t, chunk["choices"][0]["delta"].get("content")))
    first, last = first_last_content(stamped)
    pieces = sum(1 for _, text in stamped if text)
    return {"started": started, "ended": ended, "ttft": first - started,
            "decode": (k - 1) / (last - first) if last > first else 0.0, "pieces": pieces}


def overhead(port: int, replica, args) -> dict:
    """Alternating samples, direct and through localrt: TTFTs and K-token decode rates."""
    direct = ("127.0.0.1", replica.port), "/v1/chat/completions", "direct"
    ours = ("127.0.0.1", port), "/v1/chat/completions", "one"
    out = {"direct": {"ttft": [], "decode": []}, "localrt": {"ttft": [], "decode": []}}
    for side in (direct, ours):  # warm-up: the prompt lands in the replica's cache
        stream(*side, TTFT_TOKENS)
    for i in range(args.rounds):
        for _ in range(args.ttft_samples):
            for name, side in (("direct", direct), ("localrt", ours)):
                out[name]["ttft"].append(stream(*side, TTFT_TOKENS)["ttft"])
        for _ in range(args.repeats):
            for name, side in (("direct", direct), ("localrt", ours)):
                sample = stream(*side, args.max_tokens)
                out[name]["ttft"].append(sample["ttft"])
                out[name]["decode"].append(sample["decode"])
        print(f"overhead round {i + 1}/{args.rounds} done", file=sys.stderr)
    return out


def at_once(ports: list, model: str, n: int, k: int) -> float:
    """Aggregate tok/s of n K-token streams started together, client i on ports[i % len]:
    localrt's port, or the replicas' own (the reference without localrt)."""
    results, errors = [], []

    def client(port):
        try:
            results.append(stream(("127.0.0.1", port), "/v1/chat/completions", model, k))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(ports[i % len(ports)],))
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"concurrent streams failed: {errors}")
    span = max(r["ended"] for r in results) - min(r["started"] for r in results)
    return n * k / span


def cpu_snapshot(pids: list) -> tuple[int, int]:
    """(jiffies the machine was busy, jiffies these processes and this one used)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    own = 0
    for pid in [os.getpid(), *pids]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            own += int(stat[11]) + int(stat[12])
        except OSError:
            pass
    return sum(fields) - fields[3] - fields[4], own


def add_remote(port: int, model_id: str, urls: list) -> None:
    status, body = benchlib.api(port, "POST", "/v1/models/remote",
                                {"id": model_id, "upstreams": [{"url": u} for u in urls]})
    if status != 200 or body["model"]["upstreams_healthy"] != len(urls):
        raise RuntimeError(f"adding {model_id} answered {status}: {body}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=128, help="K, tokens per stream")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="K-token streams per round")
    parser.add_argument("--ttft-samples", type=int, default=4, help="short streams per round")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--scale-rounds", type=int, default=2)
    parser.add_argument("--model", type=Path, help="a GGUF to use instead of generating one")
    args = parser.parse_args()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="localrt-bench-remote-") as tmp:
        root = Path(tmp)
        model = args.model.resolve() if args.model else make_model(root)
        BIAS.update((str(t), v) for t, v in eog_bias(model)[0].items())
        replicas = []
        proc = None
        try:
            for core in ("0", "1"):
                replicas.append(start_replica(model, root / f"replica-{core}.log",
                                              n_ctx=2048, taskset=core))
            proc, port = benchlib.start_server(root / "home", timeout=60)
            add_remote(port, "one", [replicas[0].url])
            add_remote(port, "pair", [r.url for r in replicas])
            pids = [proc.pid, *(r.process.pid for r in replicas)]
            cpu_before, measured_from = cpu_snapshot(pids), time.perf_counter()
            samples = overhead(port, replicas[0], args)
            one, pair, direct_one, direct_pair = [], [], [], []
            ports = [r.port for r in replicas]
            for i in range(args.scale_rounds):
                one.append(at_once([port], "one", args.clients, args.max_tokens))
                pair.append(at_once([port], "pair", args.clients, args.max_tokens))
                direct_one.append(at_once(ports[:1], "direct", args.clients, args.max_tokens))
                direct_pair.append(at_once(ports, "direct", args.clients, args.max_tokens))
                print(f"scale round {i + 1}/{args.scale_rounds}: one replica "
                      f"{one[-1]:.1f} tok/s, two {pair[-1]:.1f} tok/s; without localrt "
                      f"{direct_one[-1]:.1f} and {direct_pair[-1]:.1f}", file=sys.stderr)
            cpu_after, seconds = cpu_snapshot(pids), time.perf_counter() - measured_from
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)
            for replica in replicas:
                replica.stop()
    others = max((cpu_after[0] - cpu_before[0]) - (cpu_after[1] - cpu_before[1]), 0)
    busy = others / os.sysconf("SC_CLK_TCK") / (seconds * os.cpu_count())
    direct, ours = samples["direct"], samples["localrt"]
    d_ttft = statistics.median(direct["ttft"]) * 1000
    o_ttft = statistics.median(ours["ttft"]) * 1000
    d_decode, o_decode = max(direct["decode"]), max(ours["decode"])
    best_one, best_pair = max(one), max(pair)
    k = args.max_tokens
    rows = [
        row("TTFT median, ms", o_ttft, d_ttft, "{:.2f}", "<= direct + 2 ms",
            o_ttft <= d_ttft + 2, ratio=f"{o_ttft - d_ttft:+.2f} ms"),
        row(f"streamed decode tok/s (K={k})", o_decode, d_decode, "{:.1f}",
            ">= 0.98x direct", o_decode >= 0.98 * d_decode),
        row(f"{args.clients} clients, 2 replicas vs 1, aggregate tok/s", best_pair,
            best_one, "{:.1f}", ">= 1.8x 1 replica", best_pair >= 1.8 * best_one),
        row("  the same without localrt (clients split by hand)", max(direct_pair),
            max(direct_one), "{:.1f}", "(the machine's own)", None),
    ]
    print(f"samples: {len(ours['ttft'])} TTFTs and {len(ours['decode'])} K-token streams a "
          f"side; other processes used {busy:.0%} of the CPUs while it measured"
          + (" -- the machine was busy; the figures are not reliable" if busy > 0.05 else ""),
          file=sys.stderr)
    header = ["metric", "localrt", "reference", "ratio", "target", "result"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"total {time.perf_counter() - began:.0f} s", file=sys.stderr)
    return 1 if any(r[-1] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
