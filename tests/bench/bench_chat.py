"""Chat benchmark: localrt's /v1/chat/completions against raw llama-cpp-python, same model.

Run it from the repository root (not collected by pytest; it has no test_ functions):

    .venv/bin/python tests/bench/bench_chat.py [--threads 2] [--max-tokens 128]

It prints one table with columns metric, localrt, reference, ratio, target, result
(the reference is raw llama-cpp-python, except where the metric says otherwise), and
exits with status 1 when a row with a target is FAIL, 0 otherwise, so a script can
gate on it. It takes about 1.5 minutes on 2 cores. Progress and a note on how much CPU
other processes took while it measured go to stderr: llama.cpp's threads wait for each
other at every step, so a busy machine slows both sides far beyond its own share and
makes the ratios noise.

The model is a synthetic llama (tests/emulators/ggufgen.py: n_embd 768, 8 layers, 12 heads, n_ff
2048, a 32000-token vocabulary, context 2048, random weights: 105.8 M parameters),
written in F16 and quantized to Q8_0 by llama.cpp itself (about 113 MB; writing and
quantizing take a few seconds); `--model PATH` uses a GGUF of your own instead. Both
sides load it with n_ctx 2048 and n_threads = n_threads_batch = --threads, and generate
exactly --max-tokens (K) tokens: temperature 0 (greedy), with the end-of-generation
tokens (</s> and <|im_end|>) banned through logit_bias.

localrt runs as `python -m localrt start --foreground --port 0` in its own process, as
a real server does (HOME in a temporary folder); the client is http.client with a new
connection per request, and while a stream lasts it only timestamps lines (it parses
them afterwards), to take as little CPU as it can from what it measures. The raw
reference is `llama_cpp.Llama.create_chat_completion` in this process: the same chat
template (the GGUF's), the same kind of per-token Python logits processor for the bias.
Only one side holds the model at a time: the bench alternates --rounds rounds of raw
(load, measure, close) and of localrt (POST start, measure, POST stop), so drift on a
shared machine hits both alike. Each load begins with an untimed warm-up request;
after it the prompt sits in llama-cpp-python's prefix cache on both sides, so every
timed request evaluates one prompt token and then decodes: the figures measure the
serving path, not prompt processing.

Rows (best = the fastest sample, since interference only ever slows a run down):
1. streamed decode tok/s: (K - 1) / (arrival of the last content chunk - arrival of
   the first), best of --repeats x --rounds streams a side. Target >= 0.97 x raw.
2. non-streamed tok/s: K / wall time of the whole request, best of as many. Target
   >= 0.98 x raw.
3. TTFT: from sending the request to the first chunk with non-empty content; median
   over those streams and --ttft-samples short (8-token) streams per round. Target: at
   most 5 ms over raw.
4. Concurrency, on one running model, --concurrent-rounds (3) times: one stream alone,
   then --clients (4) streams of K tokens started together. Every stream must end with
   K tokens and [DONE]. Aggregate tok/s = all their tokens / (the last one's end - the
   first one's request), best round; target >= 0.95 x one stream alone (K / its wall
   time, best). p95 TTFT over all the concurrent streams, nearest rank (of 12, the
   largest); the streams share the model's decode steps (n_parallel, default 4), so
   the last one's TTFT is the time to read all four prompts: reported, no target.
5. GET /v1/models from another thread every 20 ms over one keep-alive connection (it
   polls through the whole concurrency phase, so the single streams bear it too; only
   requests during the concurrent streams count): median, target <= 10 ms, and p95.
Context rows, no target: a bare `Llama.generate` loop's decode tok/s (no chat layer at
all: the ceiling), and whether localrt's non-streamed text is the same as raw's.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import benchlib  # noqa: E402  (this folder is on sys.path)

MODEL_ID = "bench"
CTX_LEN = 2048
PROMPT = ("You are the keeper of a lighthouse on a remote island. Tell me, in as much "
          "detail as you can, about an ordinary day: the weather, the lamp, the birds.")
TTFT_TOKENS = 8  # the short streams that sample TTFT
POLL_INTERVAL = 0.02  # seconds between GET /v1/models during the concurrent streams


def make_model(folder: Path) -> Path:
    """Write the ~106 M-parameter random llama in F16 and quantize it to Q8_0."""
    from emulators.ggufgen import write_gguf

    source = write_gguf(folder / "bench-f16.gguf", name="bench", n_embd=768, n_layer=8,
                        n_head=12, n_ff=2048, vocab_size=32000, context_length=CTX_LEN,
                        file_type="F16")
    target = benchlib.quantize(source, folder / "bench-q8_0.gguf", "Q8_0")
    source.unlink()  # 200 MB nobody reads again
    return target


def eog_bias(model: Path) -> tuple[dict, int]:
    """{token id: -100} for every end-of-generation token, and the parameter count."""
    import llama_cpp

    llm = llama_cpp.Llama(str(model), n_ctx=256, n_threads=1, verbose=False)
    try:
        vocab = llm._model.vocab
        bias = {t: -100.0 for t in range(llm.n_vocab())
                if llama_cpp.llama_vocab_is_eog(vocab, t)}
        return bias, llama_cpp.llama_model_n_params(llm.model)
    finally:
        llm.close()


def messages() -> list:
    """The one-turn conversation every request sends."""
    return [{"role": "user", "content": PROMPT}]


def first_last_content(stamped: list) -> tuple[float | None, float | None]:
    """Arrival times of the first and the last chunk with non-empty content."""
    times = [t for t, text in stamped if text]
    return (times[0], times[-1]) if times else (None, None)


# --- raw llama-cpp-python ------------------------------------------------------------


def raw_stream(llm, k: int, bias: dict) -> dict:
    """One streamed create_chat_completion: TTFT, decode tok/s, wall time."""
    started = time.perf_counter()
    stamped = []
    for chunk in llm.create_chat_completion(messages(), max_tokens=k, temperature=0,
                                            logit_bias=bias, stream=True):
        stamped.append((time.perf_counter(), chunk["choices"][0]["delta"].get("content")))
    ended = time.perf_counter()
    first, last = first_last_content(stamped)
    return {"ttft": first - started, "decode": (k - 1) / (last - first),
            "wall": ended - started}


def raw_complete(llm, k: int, bias: dict) -> dict:
    """One non-streamed create_chat_completion: wall time, token count, text."""
    started = time.perf_counter()
    reply = llm.create_chat_completion(messages(), max_tokens=k, temperature=0,
                                       logit_bias=bias)
    wall = time.perf_counter() - started
    return {"wall": wall, "tokens": reply["usage"]["completion_tokens"],
            "text": reply["choices"][0]["message"]["content"]}


def raw_generate_loop(llm, k: int) -> float:
    """Decode tok/s of a bare Llama.generate loop on the same prompt (no chat layer)."""
    prompt = llm.tokenize(PROMPT.encode(), add_bos=True, special=True)
    stamps = []
    for token in llm.generate(prompt, temp=0.0):
        stamps.append(time.perf_counter())
        if len(stamps) == k:
            break
    return (k - 1) / (stamps[-1] - stamps[0])


def raw_round(model: Path, args, bias: dict, out: dict) -> None:
    """Load the model in this process, take the raw samples into `out`, close it."""
    import llama_cpp

    llm = llama_cpp.Llama(str(model), n_ctx=CTX_LEN, n_threads=args.threads,
                          n_threads_batch=args.threads, n_gpu_layers=-1, verbose=False)
    try:
        sample(lambda k: raw_stream(llm, k, bias), lambda k: raw_complete(llm, k, bias),
               args, out, "raw")
        out["loop"].append(raw_generate_loop(llm, args.max_tokens))
    finally:
        llm.close()


def sample(stream, complete, args, out: dict, who: str) -> None:
    """The samples both sides take, in the same order: a warm-up completion (prompt
    evaluation, template compilation), then per repeat one K-token stream and one
    K-token completion, then the short TTFT streams. `stream(k)` and `complete(k)`
    return dicts as raw_stream and raw_complete do."""
    k = args.max_tokens
    complete(k)
    for _ in range(args.repeats):
        s = stream(k)
        out["ttft"].append(s["ttft"])
        out["decode"].append(s["decode"])
        c = complete(k)
        if c["tokens"] != k:
            raise RuntimeError(f"{who} generated {c['tokens']} tokens, not {k}")
        out["complete"].append(k / c["wall"])
        out["text"] = c["text"]
    for _ in range(args.ttft_samples):
        out["ttft"].append(stream(TTFT_TOKENS)["ttft"])


# --- localrt over HTTP ---------------------------------------------------------------


def api(port: int, method: str, path: str, body=None, conn=None) -> tuple[int, dict]:
    """benchlib.api, with time for a model to load or a reply to finish."""
    return benchlib.api(port, method, path, body, conn, timeout=120)


def chat_body(k: int, bias: dict, stream: bool) -> dict:
    """The chat request localrt gets (the same sampling as the raw calls)."""
    body = {"model": MODEL_ID, "messages": messages(), "max_tokens": k, "temperature": 0,
            "logit_bias": {str(t): v for t, v in bias.items()}, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def http_stream(port: int, k: int, bias: dict) -> dict:
    """One streamed chat over a new connection: TTFT, decode tok/s, wall, tokens, done."""
    data = json.dumps(chat_body(k, bias, True))
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/chat/completions", data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    lines = []
    while True:  # only timestamps here: parsing would steal CPU from the server
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
        raise RuntimeError(f"chat stream answered {resp.status}")
    stamped, tokens, done = [], None, False
    for t, line in lines:
        if line.startswith(b"data: [DONE]"):
            done = True
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"chat stream failed: {chunk['error']}")
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if chunk["choices"]:
            stamped.append((t, chunk["choices"][0]["delta"].get("content")))
    first, last = first_last_content(stamped)
    return {"started": started, "ended": ended, "ttft": first - started,
            "decode": (k - 1) / (last - first) if last > first else 0.0,
            "wall": ended - started, "tokens": tokens, "done": done}


def http_complete(port: int, k: int, bias: dict) -> dict:
    """One non-streamed chat: wall time, token count, text."""
    data = chat_body(k, bias, False)
    started = time.perf_counter()
    status, reply = api(port, "POST", "/v1/chat/completions", data)
    wall = time.perf_counter() - started
    if status != 200:
        raise RuntimeError(f"chat answered {status}: {reply}")
    return {"wall": wall, "tokens": reply["usage"]["completion_tokens"],
            "text": reply["choices"][0]["message"]["content"]}


def start_model(port: int, threads: int) -> None:
    """POST /v1/models/bench/start with the bench's context and threads."""
    status, body = api(port, "POST", f"/v1/models/{MODEL_ID}/start",
                       {"ctx_len": CTX_LEN, "cpu_threads": threads})
    if status != 200:
        raise RuntimeError(f"start answered {status}: {body}")


def localrt_round(port: int, args, bias: dict, out: dict) -> None:
    """Start the model in the server, take localrt's samples into `out`, stop it."""
    k = args.max_tokens
    start_model(port, args.threads)

    def stream(n: int) -> dict:
        s = http_stream(port, n, bias)
        if n == k and (s["tokens"] != k or not s["done"]):
            raise RuntimeError(f"a stream ended with {s['tokens']} tokens, done={s['done']}")
        return s

    sample(stream, lambda n: http_complete(port, n, bias), args, out, "localrt")
    status, body = api(port, "POST", f"/v1/models/{MODEL_ID}/stop")
    if status != 200:
        raise RuntimeError(f"stop answered {status}: {body}")


def poll_models(port: int, stop: threading.Event, recording: threading.Event,
                times: list) -> None:
    """GET /v1/models every POLL_INTERVAL until `stop`; ms into `times` while `recording`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    while not stop.is_set():
        started = time.perf_counter()
        status, _ = api(port, "GET", "/v1/models", conn=conn)
        if recording.is_set():
            times.append((time.perf_counter() - started) * 1000)
        if status != 200:
            times.append(math.inf)  # shows up in the median as a failure
        stop.wait(POLL_INTERVAL)
    conn.close()


def streams_at_once(port: int, n: int, k: int, bias: dict) -> list:
    """`n` streamed chats started together; a failed one is {"error": ...}."""
    results: list = [None] * n
    gate = threading.Barrier(n)

    def client(i):
        """Stream `k` tokens as soon as all `n` clients are ready."""
        gate.wait()
        try:
            results[i] = http_stream(port, k, bias)
        except Exception as exc:  # reported as an incomplete stream
            results[i] = {"error": repr(exc)}

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def concurrent(port: int, args, bias: dict) -> dict:
    """Rounds of one stream, then --clients streams at once, with /v1/models polled."""
    k, n = args.max_tokens, args.clients
    start_model(port, args.threads)
    http_complete(port, k, bias)  # warm-up
    streams, aggregate, single, polled = [], [], [], []
    stop, recording = threading.Event(), threading.Event()
    poller = threading.Thread(target=poll_models, args=(port, stop, recording, polled),
                              daemon=True)
    poller.start()  # for the single streams too, so both sides of the ratio bear it
    try:
        for _ in range(args.concurrent_rounds):
            one = http_stream(port, k, bias)
            single.append(k / one["wall"])
            recording.set()
            results = streams_at_once(port, n, k, bias)
            recording.clear()
            streams += results
            ok = [r for r in results if "error" not in r]
            if ok:
                span = max(r["ended"] for r in ok) - min(r["started"] for r in ok)
                aggregate.append(sum(r["tokens"] or 0 for r in ok) / span)
    finally:
        stop.set()
        poller.join()
    complete = sum(1 for r in streams
                   if "error" not in r and r["tokens"] == k and r["done"])
    ttfts = sorted(r["ttft"] for r in streams if "error" not in r)
    return {"complete": complete, "total": len(streams), "aggregate": max(aggregate or [0]),
            "single": max(single), "p95_ttft": nearest_rank(ttfts, 95) if ttfts else math.inf,
            "models_median": statistics.median(polled or [math.inf]),
            "models_p95": nearest_rank(sorted(polled), 95) if polled else math.inf,
            "polls": len(polled), "errors": [r["error"] for r in streams if "error" in r]}


def nearest_rank(ordered: list, pct: float) -> float:
    """The nearest-rank percentile of an ascending list (the max for p95 of < 20 items)."""
    return ordered[max(1, math.ceil(pct / 100 * len(ordered))) - 1]


def cpu_snapshot(server_pid: int) -> tuple[int, int]:
    """(jiffies the whole machine was busy, jiffies this process and the server used)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    own = 0
    for pid in (os.getpid(), server_pid):
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read().rsplit(")", 1)[1].split()
        own += int(stat[11]) + int(stat[12])  # utime, stime
    return busy, own


def others_share(before: tuple, after: tuple, seconds: float) -> float:
    """The share of all CPUs that other processes used between two cpu_snapshots."""
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(others, 0) / os.sysconf("SC_CLK_TCK") / (seconds * os.cpu_count())


# --- the report ----------------------------------------------------------------------


def row(metric: str, ours, ref, fmt: str, target: str, ok, ratio: str | None = None) -> list:
    """One table row; `ok` None marks a context row without a target."""
    if ratio is None:
        ratio = f"{ours / ref:.3f}x" if isinstance(ref, float) and ref else ""
    ref_text = fmt.format(ref) if isinstance(ref, float) else (ref or "")
    ours_text = fmt.format(ours) if isinstance(ours, float) else str(ours)
    result = "" if ok is None else ("PASS" if ok else "FAIL")
    return [metric, ours_text, ref_text, ratio, target, result]


def report(args, n_params: int, raw: dict, ours: dict, conc: dict) -> list:
    """The table rows from the collected samples."""
    k = args.max_tokens
    raw_decode, our_decode = max(raw["decode"]), max(ours["decode"])
    raw_complete_, our_complete = max(raw["complete"]), max(ours["complete"])
    raw_ttft = statistics.median(raw["ttft"]) * 1000
    our_ttft = statistics.median(ours["ttft"]) * 1000
    single = conc["single"]
    rows = [
        row(f"streamed decode tok/s (K={k})", our_decode, raw_decode, "{:.1f}",
            ">= 0.97x raw", our_decode >= 0.97 * raw_decode),
        row("non-streamed tok/s, whole request", our_complete, raw_complete_, "{:.1f}",
            ">= 0.98x raw", our_complete >= 0.98 * raw_complete_),
        row("TTFT median, ms", our_ttft, raw_ttft, "{:.2f}", "<= raw + 5 ms",
            our_ttft <= raw_ttft + 5, ratio=f"{our_ttft - raw_ttft:+.2f} ms"),
        row(f"{args.clients} concurrent streams completed", f"{conc['complete']}/"
            f"{conc['total']}", None, "", "all", conc["complete"] == conc["total"]),
        row(f"{args.clients} concurrent, aggregate tok/s", conc["aggregate"], single,
            "{:.1f}", ">= 0.95x 1 stream", conc["aggregate"] >= 0.95 * single),
        row(f"{args.clients} concurrent, p95 TTFT ms", conc["p95_ttft"] * 1000, None,
            "{:.0f}", "(report)", None),
        row("GET /v1/models during them, median ms", conc["models_median"], None,
            "{:.2f}", "<= 10 ms", conc["models_median"] <= 10),
        row(f"  same, p95 ms ({conc['polls']} requests)", conc["models_p95"], None,
            "{:.2f}", "(report)", None),
        row("bare Llama.generate loop decode tok/s", "", max(raw["loop"]), "{:.1f}",
            "(ceiling)", None, ratio=""),
        row("non-streamed text equals raw's", "yes" if ours["text"] == raw["text"] else
            "no", None, "", "(context)", None),
    ]
    print(f"model: {n_params / 1e6:.1f} M parameters, Q8_0, n_ctx {CTX_LEN}, "
          f"{args.threads} threads, K = {k} tokens; samples: "
          f"{len(ours['decode'])} streams and {len(ours['complete'])} non-streamed "
          f"requests per side, {len(ours['ttft'])} TTFTs", file=sys.stderr)
    return rows


def main() -> int:
    """Build or reuse the model, run the rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="n_threads on both sides")
    parser.add_argument("--max-tokens", type=int, default=128, help="K, tokens generated "
                        "per request")
    parser.add_argument("--rounds", type=int, default=5, help="alternations of raw and "
                        "localrt")
    parser.add_argument("--repeats", type=int, default=2, help="streams and non-streamed "
                        "requests per round")
    parser.add_argument("--ttft-samples", type=int, default=4, help="short streams per round")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--concurrent-rounds", type=int, default=3)
    parser.add_argument("--model", type=Path, help="a GGUF to use instead of generating one")
    args = parser.parse_args()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="localrt-bench-") as tmp:
        root = Path(tmp)
        model = args.model.resolve() if args.model else make_model(root)
        bias, n_params = eog_bias(model)
        print(f"model {model}: {n_params:,} parameters", file=sys.stderr)
        proc, port = benchlib.start_server(root / "home", timeout=60)
        try:
            status, body = api(port, "POST", "/v1/models/import",
                               {"path": str(model), "id": MODEL_ID})
            if status != 200:
                raise RuntimeError(f"import answered {status}: {body}")
            raw = {"ttft": [], "decode": [], "complete": [], "loop": [], "text": None}
            ours = {"ttft": [], "decode": [], "complete": [], "text": None}
            cpu_before, measured_from = cpu_snapshot(proc.pid), time.perf_counter()
            for i in range(args.rounds):
                raw_round(model, args, bias, raw)
                localrt_round(port, args, bias, ours)
                print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
            conc = concurrent(port, args, bias)
            if conc["errors"]:
                print("concurrent stream errors:", conc["errors"], file=sys.stderr)
            # llama.cpp's threads wait for each other at every step, so anything else
            # on the cores slows both sides by far more than its own share: say so.
            busy = others_share(cpu_before, cpu_snapshot(proc.pid),
                                time.perf_counter() - measured_from)
        finally:
            proc.terminate()
            proc.wait(30)
    rows = report(args, n_params, raw, ours, conc)
    print(f"other processes used {busy:.0%} of the CPUs while it measured"
          + (" -- the machine was busy; the figures are not reliable" if busy > 0.05
             else ""), file=sys.stderr)
    header = ["metric", "localrt", "reference", "ratio", "target", "result"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"total {time.perf_counter() - began:.0f} s", file=sys.stderr)
    return 1 if any(r[-1] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
