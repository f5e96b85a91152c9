"""Log-probability benchmark: what `logprobs` with top_logprobs 5 costs a streamed chat.

Run it from the repository root (not collected by pytest; it has no test_ functions):

    .venv/bin/python tests/bench/bench_logprobs.py [--threads 2] [--max-tokens 128]

It prints one table (metric, with logprobs, without, ratio, target, result) and exits
with status 1 when the row with a target is FAIL, 0 otherwise. It takes a minute or
two on 2 cores; progress and how much CPU other processes took while it measured go
to stderr (a busy machine makes the ratios noise).

The model is bench_chat.py's synthetic llama (n_embd 768, 8 layers, a 32000-token
vocabulary, random weights, Q8_0); `--model PATH` uses a GGUF of your own. localrt
runs as `python -m localrt start --foreground --port 0` in its own process, with
n_parallel 2.

- alone: one stream at a time, the same prompt and greedy decoding (end-of-generation
  tokens banned, so every reply is K tokens), with `"logprobs": true, "top_logprobs":
  5` against without. Decode tok/s of a stream is (K - 1) / (arrival of its last
  content chunk - arrival of its first); the row gives the best of each side and the
  median as context. Target: with logprobs >= 0.9 x without (a log-softmax over the
  vocabulary each token, and the entries' JSON).
- beside: two streams at once sharing each decode step; the row is the plain
  stream's tok/s when its neighbour asks for logprobs against when it does not. The
  scoring runs inside the shared step, so a neighbour's logprobs do slow it a little;
  this row says how much.
- CPU: what one token's logprobs take in localrt (scoring a row of 32000 logits, the
  entry, its JSON), as this thread's CPU time, so other processes do not blur it; its
  ratio is the slowdown it alone would cause at the best plain rate.
The streamed texts must be equal with and without logprobs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "bench")]

import benchlib  # noqa: E402  (this folder is on sys.path)
from bench_chat import (CTX_LEN, cpu_snapshot, eog_bias, make_model,  # noqa: E402
                        messages, others_share)

MODEL_ID = "bench"
TOP = 5
TARGET = 0.9


def body(k: int, bias: dict, logprobs: bool) -> dict:
    """The streamed chat request of one side."""
    out = {"model": MODEL_ID, "messages": messages(), "max_tokens": k, "temperature": 0,
           "logit_bias": {str(t): v for t, v in bias.items()}, "stream": True,
           "stream_options": {"include_usage": True}}
    if logprobs:
        out.update(logprobs=True, top_logprobs=TOP)
    return out


def stream(port: int, request: dict) -> dict:
    """One streamed chat over a new connection: decode tok/s, text, logprob entries."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/chat/completions", json.dumps(request),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    lines = []
    while True:  # only timestamps here: parsing would steal CPU from the server
        line = resp.readline()
        if not line or line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: "):
            lines.append((time.perf_counter(), line))
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"chat stream answered {resp.status}")
    stamps, text, tokens, entries = [], [], None, 0
    for t, line in lines:
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"chat stream failed: {chunk['error']}")
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk["choices"]:
            entries += len((choice.get("logprobs") or {}).get("content") or ())
            piece = choice["delta"].get("content")
            if piece:
                stamps.append(t)
                text.append(piece)
    k = request["max_tokens"]
    if tokens != k:
        raise RuntimeError(f"a stream ended with {tokens} tokens, not {k}")
    if entries != (k if request.get("logprobs") else 0):
        raise RuntimeError(f"a stream carried {entries} logprob entries for {k} tokens")
    return {"decode": (k - 1) / (stamps[-1] - stamps[0]), "text": "".join(text)}


def pair(port: int, k: int, bias: dict, neighbour_logprobs: bool) -> float:
    """Two streams at once; the plain one's decode tok/s."""
    out: dict = {}

    def run(name: str, logprobs: bool) -> None:
        out[name] = stream(port, body(k, bias, logprobs))

    threads = [threading.Thread(target=run, args=("plain", False)),
               threading.Thread(target=run, args=("neighbour", neighbour_logprobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out["plain"]["decode"]


def score_cost(n_vocab: int = 32000, times: int = 2000) -> float:
    """CPU seconds (this thread's: other processes do not count) that one token's
    logprobs take in localrt: scoring a row of n_vocab logits, the entry, its JSON."""
    import numpy as np

    from localrt.dialects.openai import chat_content
    from localrt.engines import logprobs

    row = np.random.default_rng(0).standard_normal(n_vocab).astype(np.float32)
    log = logprobs.Log(lambda token, special: b" piece")
    started = time.thread_time()
    for _ in range(times):
        lse, top = logprobs.score(row, TOP)
        log.add(logprobs.TokenLogprob(7, float(row[7]) - lse, top), 0, 6)
        log.sent(6)
        json.dumps(chat_content(log.take()))
    return (time.thread_time() - started) / times


def main() -> int:
    """Build or reuse the model, run the rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="the model's cpu_threads")
    parser.add_argument("--max-tokens", type=int, default=128, help="K, tokens per reply")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="streams of each side a round")
    parser.add_argument("--model", type=Path, help="a GGUF to use instead of generating one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="localrt-bench-") as tmp:
        root = Path(tmp)
        model = args.model.resolve() if args.model else make_model(root)
        bias, _ = eog_bias(model)
        proc, port = benchlib.start_server(root / "home", timeout=60)
        try:
            for path, request in (("/v1/models/import", {"path": str(model), "id": MODEL_ID}),
                                  (f"/v1/models/{MODEL_ID}/start",
                                   {"ctx_len": CTX_LEN, "cpu_threads": args.threads,
                                    "n_parallel": 2})):
                status, reply = benchlib.api(port, "POST", path, request, timeout=120)
                if status != 200:
                    raise RuntimeError(f"{path} answered {status}: {reply}")
            k = args.max_tokens
            alone = {True: [], False: []}
            beside = {True: [], False: []}
            texts = {True: set(), False: set()}
            for logprobs in (True, False):  # warm-up: the prompt goes into the cache
                stream(port, body(k, bias, logprobs))
            cpu_before, measured_from = cpu_snapshot(proc.pid), time.perf_counter()
            for i in range(args.rounds):
                order = (True, False) if i % 2 == 0 else (False, True)
                for _ in range(args.repeats):
                    for logprobs in order:
                        s = stream(port, body(k, bias, logprobs))
                        alone[logprobs].append(s["decode"])
                        texts[logprobs].add(s["text"])
                for logprobs in order:
                    beside[logprobs].append(pair(port, k, bias, logprobs))
                print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
            busy = others_share(cpu_before, cpu_snapshot(proc.pid),
                                time.perf_counter() - measured_from)
        finally:
            proc.terminate()
            proc.wait(30)
    best = {side: max(values) for side, values in alone.items()}
    median = {side: statistics.median(values) for side, values in alone.items()}
    near = {side: max(values) for side, values in beside.items()}
    ratio = best[True] / best[False]
    same = texts[True] == texts[False] and len(texts[True]) == 1
    cost = score_cost()
    rows = [["streamed decode tok/s, best", f"{best[True]:.1f}", f"{best[False]:.1f}",
             f"{ratio:.3f}", f">= {TARGET}", "PASS" if ratio >= TARGET else "FAIL"],
            ["streamed decode tok/s, median", f"{median[True]:.1f}", f"{median[False]:.1f}",
             f"{median[True] / median[False]:.3f}", "", ""],
            ["a plain stream's tok/s beside one with/without", f"{near[True]:.1f}",
             f"{near[False]:.1f}", f"{near[True] / near[False]:.3f}", "", ""],
            ["the same streamed text", "yes" if same else "NO", "", "", "", ""],
            [f"a token's logprobs work, 32000 logits, top {TOP} (CPU)", f"{cost * 1e6:.1f} us",
             "", f"{1 / (1 + cost * best[False]):.4f}", "", ""]]
    print(f"other processes used {busy:.0%} of the CPUs while it measured"
          + (" -- the machine was busy; the figures are not reliable" if busy > 0.05
             else ""), file=sys.stderr)
    header = ["metric", "with logprobs", "without", "ratio", "target", "result"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    return 1 if ratio < TARGET or not same else 0


if __name__ == "__main__":
    sys.exit(main())
