"""Vision benchmark: a chat with one image through localrt against raw mtmd, same pair.

Run it from the repository root (not collected by pytest):

    .venv/bin/python tests/bench/bench_vision.py [--threads 2] [--samples 8]

The pair is support.vision's generator at a bench size: a text model of n_embd 512,
4 layers, n_ff 1024 (quantized to Q8_0 by llama.cpp) and an "mlp" projector of a
224-pixel square in 14-pixel patches (256 image tokens), a 4-layer 256-wide vision
tower. Images are 256x256 random-pixel PNGs, a new one for every request on both sides,
so no prompt cache helps either.

Rows:
1. Time to first token of a chat with one image: localrt's non-streamed reply with
   max_tokens 1, from sending the request to its end, over HTTP to a `localrt start`
   child; against raw mtmd in this process on the same pair and threads (PNG decode,
   mtmd_tokenize, mtmd_helper_eval_chunks, the first token's argmax). --rounds rounds
   alternate the two sides, --samples each a round, so a busy spell hits both; the
   median over all. Target: localrt at least 0.95x raw's speed (raw / localrt time).
2. Two text streams' aggregate decode rate while a third client sends image chats one
   after the other, against the same two streams alone: reported, no target. (No
   speculation for them: a random model's loops would be drafted.) Each step that
   evaluates an image gives each stream one token, so while images keep coming the
   streams go at one token per image encode.
It prints a table (metric, localrt, reference, ratio, target, result) and exits 1 when
a row with a target fails. Only one side computes at a time.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import benchlib  # noqa: E402

MODEL_ID = "vision-bench"
CTX_LEN = 2048
QUESTION = "Describe the picture in detail."


def make_pair(folder: Path) -> tuple[Path, Path]:
    from support.models import quantize
    from support.vision import write_projector, write_vision_pair

    with benchlib.quiet_stderr():
        model, _ = write_vision_pair(folder, n_embd=512, n_layer=4, n_ff=1024,
                                     context_length=CTX_LEN, name="bench")
        mmproj = write_projector(folder / "mmproj-bench.gguf", n_embd=512, image_size=224,
                                 patch_size=14, v_embd=256, v_head=4, v_ff=1024,
                                 v_layer=4, mm_hidden=512)
        return quantize(model, folder / "bench-Q8_0.gguf", "Q8_0"), mmproj


def image(seed: int) -> bytes:
    from support.vision import png

    return png(256, 256, seed)


def raw_ttft(model: Path, mmproj: Path, threads: int, samples: int,
             first: int = 1000) -> list[float]:
    """Seconds from an image's bytes to the first token, raw mtmd, `samples` times."""
    import llama_cpp
    import numpy as np
    from llama_cpp import mtmd_cpp as mtmd

    ll = llama_cpp
    mparams = ll.llama_model_default_params()
    lmodel = ll.llama_model_load_from_file(str(model).encode(), mparams)
    cparams = ll.llama_context_default_params()
    cparams.n_ctx, cparams.n_threads, cparams.n_threads_batch = CTX_LEN, threads, threads
    ctx = ll.llama_init_from_model(lmodel, cparams)
    p = mtmd.mtmd_context_params_default()
    p.n_threads, p.print_timings, p.use_gpu = threads, False, False
    mctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), lmodel, p)
    vocab = ll.llama_model_get_vocab(lmodel)
    n_vocab = ll.llama_vocab_n_tokens(vocab)
    text = (f"<|im_start|>user\n{QUESTION}\n{mtmd.mtmd_default_marker().decode()}"
            f"<|im_end|>\n<|im_start|>assistant\n").encode()
    times = []
    try:
        for i in range(samples + 1):  # the first is a warm-up
            data = image(first + i)
            ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
            start = time.perf_counter()
            buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(mctx, buf, len(data), False)
            source = mtmd.mtmd_input_text(text, len(text), True, True)
            chunks = mtmd.mtmd_input_chunks_init()
            bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
            assert mtmd.mtmd_tokenize(mctx, chunks, ctypes.byref(source), bitmaps, 1) == 0
            n_past = ll.llama_pos(0)
            assert mtmd.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, 512, True,
                                                ctypes.byref(n_past)) == 0
            logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            int(np.argmax(logits))
            elapsed = time.perf_counter() - start
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)
            if i:
                times.append(elapsed)
    finally:
        mtmd.mtmd_free(mctx)
        ll.llama_free(ctx)
        ll.llama_model_free(lmodel)
    return times


def image_body(seed: int, max_tokens: int = 1, stream: bool = False) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image(seed)).decode()
    return {"model": MODEL_ID, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image_url", "image_url": {"url": url}}]}]}


def localrt_ttft(port: int, samples: int, first: int = 2000) -> list[float]:
    times = []
    for i in range(samples + 1):
        body = image_body(first + i)
        start = time.perf_counter()
        status, reply = benchlib.api(port, "POST", "/v1/chat/completions", body)
        elapsed = time.perf_counter() - start
        if status != 200:
            raise RuntimeError(f"chat answered {status}: {reply}")
        if i:
            times.append(elapsed)
    return times


def text_stream(port: int, tokens: int, seed: int, out: list) -> None:
    """One streamed text chat of `tokens` tokens; appends (first, last) content times."""
    body = {"model": MODEL_ID, "max_tokens": tokens, "temperature": 0, "stream": True,
            "seed": seed, "logit_bias": {"2": -100}, "speculative": False,
            "messages": [{"role": "user", "content": f"Tell me a story number {seed}."}]}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    stamps = []
    for line in resp:
        stamps.append((time.perf_counter(), line))
    conn.close()
    times = [t for t, line in stamps if line.startswith(b"data: {") and b'"content"' in line
             and b'"content": ""' not in line]
    out.append((times[0], times[-1], len(times)))


def streams_rate(port: int, tokens: int, with_images: bool) -> float:
    """Aggregate tok/s of two text streams (with image chats beside them)."""
    out, stop = [], threading.Event()
    threads = [threading.Thread(target=text_stream, args=(port, tokens, s, out))
               for s in (1, 2)]
    sent = [0]

    def images():
        i = 0
        while not stop.is_set():
            benchlib.api(port, "POST", "/v1/chat/completions", image_body(3000 + i))
            i += 1
        sent[0] = i

    side = threading.Thread(target=images)
    for t in threads:
        t.start()
    if with_images:
        side.start()
    for t in threads:
        t.join()
    stop.set()
    if with_images:
        side.join()
    first, last = min(o[0] for o in out), max(o[1] for o in out)
    return sum(o[2] for o in out) / (last - first)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print("writing the pair ...", file=sys.stderr)
        model, mmproj = make_pair(root)
        raw, ours = [], []
        proc, port = benchlib.start_server(root / "home", timeout=60)
        try:
            status, body = benchlib.api(port, "POST", "/v1/models/import", {
                "path": str(model), "mmproj": str(mmproj), "id": MODEL_ID,
                "option": "symlink"})
            if status != 200:
                raise RuntimeError(f"import answered {status}: {body}")
            status, body = benchlib.api(port, "POST", f"/v1/models/{MODEL_ID}/start", {
                "ctx_len": CTX_LEN, "cpu_threads": args.threads, "flash_attn": True})
            if status != 200:
                raise RuntimeError(f"start answered {status}: {body}")
            for r in range(args.rounds):
                print(f"round {r + 1}: raw mtmd, localrt ...", file=sys.stderr)
                with benchlib.quiet_stderr():
                    raw += raw_ttft(model, mmproj, args.threads, args.samples, 1000 + 100 * r)
                ours += localrt_ttft(port, args.samples, 2000 + 100 * r)
            print("streams ...", file=sys.stderr)
            alone = streams_rate(port, args.tokens, False)
            beside = streams_rate(port, args.tokens, True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    raw_ms, our_ms = statistics.median(raw) * 1000, statistics.median(ours) * 1000
    ratio = raw_ms / our_ms
    rows = [("metric", "localrt", "reference", "ratio", "target", "result"),
            ("TTFT, one 256x256 image (ms, median)", f"{our_ms:.1f}", f"{raw_ms:.1f}",
             f"{ratio:.2f}x", ">= 0.95x", "PASS" if ratio >= 0.95 else "FAIL"),
            ("2 text streams, tok/s (beside image chats / alone)", f"{beside:.1f}",
             f"{alone:.1f}", f"{beside / alone:.2f}x", "report", "-")]
    for r in rows:
        print(f"{r[0]:<52} {r[1]:>9} {r[2]:>10} {r[3]:>7} {r[4]:>9} {r[5]:>6}")
    return 1 if ratio < 0.95 else 0


if __name__ == "__main__":
    sys.exit(main())
