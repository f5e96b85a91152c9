"""Embedding benchmark: localrt's /v1/embeddings against raw llama-cpp-python embed().

Run it from the repository root (not collected by pytest; it has no test_ functions):

    .venv/bin/python tests/bench/bench_embed.py [--threads 2] [--rounds 5]

It prints one table (metric, localrt, reference, ratio, target, result) and exits
with status 1 when a row with a target is FAIL, 0 otherwise. It takes about a minute
on 2 cores; progress and how much CPU other processes took while it measured go to
stderr (llama.cpp's threads wait for each other at every step, so a busy machine
makes the ratio noise).

The model is a synthetic BERT the size of all-MiniLM-L6-v2 (tests/emulators/ggufgen.py's
write_bert_gguf: n_embd 384, 6 layers, 12 heads, n_ff 1536, a 30522-token vocabulary,
context 512, mean pooling, random weights), quantized to Q8_0 by llama.cpp; `--model
PATH` uses a GGUF embedding model of your own. The inputs are 64 short texts (5 to 14
words). Both sides load the model with n_ctx = n_batch = n_ubatch = 512 and n_threads
= n_threads_batch = --threads, so both read the 64 texts in the same decodes.

The reference is `llama_cpp.Llama(embedding=True).embed(texts, normalize=True)` in this
process (unit vectors, as localrt gives them). localrt runs as `python -m localrt start
--foreground --port 0` in its own process; each request is one POST /v1/embeddings of
all 64 texts over a new connection with http.client, the reply read and parsed (JSON
floats; base64 in a context row). Only one side holds the model at a time: the bench
alternates --rounds rounds of raw (load, warm up, --repeats timed calls, close) and of
localrt (POST start with embedding, warm up, --repeats timed requests, POST stop), so
drift on a shared machine hits both alike.

Rows (best = the fastest sample: interference only ever slows a run down):
1. inputs/s, float: 64 / wall time of a whole request, best; target >= 0.9 x raw.
2. inputs/s, base64 (the openai package's default encoding): context.
3. the vectors equal raw's (the smallest cosine similarity over the 64): context.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "bench")]

import benchlib  # noqa: E402  (this folder is on sys.path)
from bench_chat import cpu_snapshot, others_share, row  # noqa: E402

MODEL_ID = "bench-embed"
CTX_LEN = 512
N_TEXTS = 64
WORDS = ("the lighthouse keeper wrote about weather lamp birds island sea storm morning "
         "evening light ship harbour rocks wind rain fog boat sailor map coast tide "
         "waves stars moon night cold warm bright dark quiet loud long short").split()


def texts(n: int = N_TEXTS) -> list[str]:
    """`n` short texts of 5 to 14 words, the same every run."""
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 14))) for _ in range(n)]


def make_model(folder: Path) -> Path:
    """A BERT the size of all-MiniLM-L6-v2, quantized to Q8_0."""
    from emulators.ggufgen import write_bert_gguf

    source = write_bert_gguf(folder / "bench-embed-f32.gguf", name="bench-embed",
                             context_length=CTX_LEN, vocab_size=30522, n_embd=384,
                             n_layer=6, n_head=12, n_ff=1536)
    target = benchlib.quantize(source, folder / "bench-embed-q8_0.gguf", "Q8_0")
    source.unlink()
    return target


# --- raw llama-cpp-python ------------------------------------------------------------


def raw_round(model: Path, args, inputs: list, out: dict) -> None:
    """Load the model in this process in embedding mode, time embed(), close it."""
    import llama_cpp

    llm = llama_cpp.Llama(str(model), embedding=True, n_ctx=CTX_LEN, n_batch=CTX_LEN,
                          n_ubatch=CTX_LEN, n_threads=args.threads,
                          n_threads_batch=args.threads, n_gpu_layers=-1, verbose=False)
    try:
        llm.embed(inputs, normalize=True)  # warm-up
        for _ in range(args.repeats):
            started = time.perf_counter()
            vectors = llm.embed(inputs, normalize=True)
            out["float"].append(len(inputs) / (time.perf_counter() - started))
        out["vectors"] = vectors
    finally:
        llm.close()


# --- localrt over HTTP ---------------------------------------------------------------


def api(port: int, method: str, path: str, body=None) -> tuple[int, dict]:
    """benchlib.api, with time for a model to load."""
    return benchlib.api(port, method, path, body, timeout=120)


def http_embed(port: int, inputs: list, encoding: str) -> tuple[float, list]:
    """One POST /v1/embeddings over a new connection: inputs/s, and the vectors."""
    data = json.dumps({"model": MODEL_ID, "input": inputs, "encoding_format": encoding})
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/embeddings", data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    reply = json.loads(resp.read())
    if resp.status != 200:
        raise RuntimeError(f"embeddings answered {resp.status}: {reply}")
    vectors = [d["embedding"] for d in reply["data"]]
    if encoding == "base64":  # decoded as the openai package does (with numpy)
        import numpy as np

        vectors = [np.frombuffer(base64.b64decode(v), dtype="<f4") for v in vectors]
    rate = len(inputs) / (time.perf_counter() - started)
    conn.close()
    return rate, vectors


def localrt_round(port: int, args, inputs: list, out: dict) -> None:
    """Start the model in embedding mode, time requests of both encodings, stop it."""
    status, body = api(port, "POST", f"/v1/models/{MODEL_ID}/start",
                       {"embedding": True, "ctx_len": CTX_LEN, "cpu_threads": args.threads})
    if status != 200:
        raise RuntimeError(f"start answered {status}: {body}")
    http_embed(port, inputs, "float")  # warm-up
    for _ in range(args.repeats):
        rate, out["vectors"] = http_embed(port, inputs, "float")
        out["float"].append(rate)
        out["base64"].append(http_embed(port, inputs, "base64")[0])
    status, body = api(port, "POST", f"/v1/models/{MODEL_ID}/stop")
    if status != 200:
        raise RuntimeError(f"stop answered {status}: {body}")


def min_cosine(ours: list, raw: list) -> float:
    """The smallest cosine similarity between our vectors and raw's, pair by pair."""
    import numpy as np

    a, b = np.asarray(ours, dtype=np.float64), np.asarray(raw, dtype=np.float64)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


def main() -> int:
    """Build or reuse the model, run the rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="n_threads on both sides")
    parser.add_argument("--rounds", type=int, default=5, help="alternations of raw and "
                        "localrt")
    parser.add_argument("--repeats", type=int, default=5, help="timed requests per round")
    parser.add_argument("--model", type=Path, help="a GGUF embedding model to use instead")
    args = parser.parse_args()
    began = time.perf_counter()
    inputs = texts()
    with tempfile.TemporaryDirectory(prefix="localrt-bench-") as tmp:
        root = Path(tmp)
        model = args.model.resolve() if args.model else make_model(root)
        print(f"model {model}", file=sys.stderr)
        proc, port = benchlib.start_server(root / "home", timeout=60)
        try:
            status, body = api(port, "POST", "/v1/models/import",
                               {"path": str(model), "id": MODEL_ID})
            if status != 200:
                raise RuntimeError(f"import answered {status}: {body}")
            raw = {"float": [], "vectors": None}
            ours = {"float": [], "base64": [], "vectors": None}
            cpu_before, measured_from = cpu_snapshot(proc.pid), time.perf_counter()
            for i in range(args.rounds):
                raw_round(model, args, inputs, raw)
                localrt_round(port, args, inputs, ours)
                print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
            busy = others_share(cpu_before, cpu_snapshot(proc.pid),
                                time.perf_counter() - measured_from)
        finally:
            proc.terminate()
            proc.wait(30)
    raw_best, ours_best = max(raw["float"]), max(ours["float"])
    cosine = min_cosine(ours["vectors"], raw["vectors"])
    rows = [
        row(f"inputs/s, {N_TEXTS} short texts, float", ours_best, raw_best, "{:.1f}",
            ">= 0.9x raw", ours_best >= 0.9 * raw_best),
        row("  same, base64 (openai's default)", max(ours["base64"]), raw_best, "{:.1f}",
            "(context)", None),
        row("vectors equal raw's: min cosine", cosine, None, "{:.6f}", "(context)", None),
    ]
    print(f"{args.threads} threads, {args.rounds} rounds x {args.repeats} requests a side; "
          f"other processes used {busy:.0%} of the CPUs while it measured"
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
