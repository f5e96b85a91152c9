"""Reasoning benchmark (issue 34, item 8): what separating a model's thinking costs, and
what a budget saves.

Run it from the repository root (not collected by pytest; it has no test_ functions):

    .venv/bin/python tests/bench/bench_reasoning.py [--rounds 7] [--tokens 512]

Two models with Qwen3's own chat template (tests/emulators/templates/), both scripted
(tests/emulators/ggufgen.py `script`: the reply is known, token for token, whatever the
sampling), 8 layers of n_embd 512 so that each token costs real llama.cpp work:

- `loop` writes <think>, 100 thinking tokens, </think>, 100 answer tokens, and again,
  forever: the same greedy reply of `--tokens` tokens each time, markers in it.
  Streamed once with `"reasoning_format": "none"` (the text as the model wrote it, no
  parsing) and once parsed (thinking apart, as reasoning_content and reasoning), the
  sides alternating which goes first; the row is each side's median decode rate
  (completion tokens over the time from the first streamed piece to the last), and
  the ratio parsed / none. Target: >= 0.99.
- `long` thinks for 400 tokens, then answers. The row is the time from sending the
  request to the first piece of the answer (content), with `thinking_budget_tokens` 64
  against none; localrt ends the thinking itself at the budget.

Progress goes to stderr; the table to stdout; exit status 1 when the target fails.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "bench")]

import benchlib  # noqa: E402  (this folder is on sys.path)

TARGET = 0.99
THINK, LOOP_ANSWER, LONG_THINK = 100, 100, 400


def make_models(root: Path) -> dict:
    """The two scripted GGUFs: {"loop": path, "long": path}."""
    import gguf
    from emulators.chattemplates import template
    from emulators.ggufgen import write_gguf

    qwen3 = template("Qwen-Qwen3-0.6B")
    user = gguf.TokenType.USER_DEFINED
    thinking = [f"▁t{k}" for k in range(LONG_THINK)]
    answer = [f"▁a{k}" for k in range(LOOP_ANSWER)]
    added = ["<think>", "</think>", *thinking, *answer]
    shape = {"vocab_size": 1200, "context_length": 4096, "n_embd": 512, "n_layer": 8,
             "n_head": 8, "chat_template": qwen3,
             "added_tokens": [(t, user) for t in added]}
    loop = ["<think>", *thinking[:THINK], "</think>", *answer]
    long = ["<think>", *thinking, "</think>", *answer[:20]]
    return {"loop": write_gguf(root / "loop.gguf", name="loop", script=loop, loop=True,
                               **shape),
            "long": write_gguf(root / "long.gguf", name="long", script=long, **shape)}


def stream(port: int, body: dict) -> dict:
    """One streamed chat: {"sent", "first", "last", "first_answer", "tokens",
    "reasoning", "content"} (monotonic times)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    out = {"first": None, "last": None, "first_answer": None, "tokens": 0,
           "reasoning": "", "content": ""}
    out["sent"] = time.monotonic()
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"chat failed: {resp.status} {resp.read()[:300]!r}")
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            out["tokens"] = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            thought, text = delta.get("reasoning_content"), delta.get("content")
            if thought or text:
                now = time.monotonic()
                out["first"] = out["first"] or now
                out["last"] = now
            if thought:
                out["reasoning"] += thought
            if text:
                out["content"] += text
                out["first_answer"] = out["first_answer"] or time.monotonic()
    conn.close()
    return out


def ask(model: str, tokens: int, **fields) -> dict:
    """A greedy streamed chat request of `tokens` tokens at most."""
    return {"model": model, "messages": [{"role": "user", "content": "Think, then answer."}],
            "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **fields}


def rate(run: dict) -> float:
    """Decode tokens per second of a streamed reply."""
    return (run["tokens"] - 1) / (run["last"] - run["first"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-reasoning-") as tmp:
        root = Path(tmp)
        home = root / "home"
        home.mkdir()
        models = make_models(root)
        process, port = benchlib.start_server(home)
        try:
            for model_id, path in models.items():
                benchlib.api(port, "POST", "/v1/models/import",
                             {"path": str(path), "id": model_id})
                benchlib.api(port, "POST", "/v1/models/start",
                             {"model": model_id, "cpu_threads": args.threads,
                              "n_parallel": 1, "ctx_len": 4096})
            return measure(port, args)
        finally:
            process.terminate()
            process.wait(timeout=30)


def measure(port: int, args) -> int:
    """Run the rounds and print the table."""
    stream(port, ask("loop", 32))  # warm: the first reply pays for page faults
    raw_rates, parsed_rates, ratios = [], [], []
    for k in range(args.rounds):
        order = ("none", "parsed") if k % 2 == 0 else ("parsed", "none")
        runs = {}
        for side in order:
            fields = {"reasoning_format": "none"} if side == "none" else {}
            runs[side] = stream(port, ask("loop", args.tokens, **fields))
        raw, parsed = runs["none"], runs["parsed"]
        if raw["tokens"] != parsed["tokens"] or "<think>" not in raw["content"] \
                or not parsed["reasoning"]:
            raise SystemExit(f"the two sides differ: {raw['tokens']} and "
                             f"{parsed['tokens']} tokens")
        raw_rates.append(rate(raw))
        parsed_rates.append(rate(parsed))
        ratios.append(parsed_rates[-1] / raw_rates[-1])
        print(f"round {k + 1}: none {raw_rates[-1]:.1f} tok/s, parsed "
              f"{parsed_rates[-1]:.1f} tok/s, ratio {ratios[-1]:.3f}", file=sys.stderr)

    unbounded, budgeted = [], []
    for k in range(args.rounds):
        order = (None, 64) if k % 2 == 0 else (64, None)
        for budget in order:
            fields = {} if budget is None else {"thinking_budget_tokens": budget}
            run = stream(port, ask("long", LONG_THINK + 64, **fields))
            (unbounded if budget is None else budgeted).append(
                run["first_answer"] - run["sent"])
        print(f"round {k + 1}: first answer piece {unbounded[-1]:.3f} s without a budget, "
              f"{budgeted[-1]:.3f} s with 64", file=sys.stderr)

    ratio = statistics.median(parsed_rates) / statistics.median(raw_rates)
    ok = ratio >= TARGET
    rows = [("decode tok/s, 512-token reply", f"{statistics.median(parsed_rates):.1f}",
             f"{statistics.median(raw_rates):.1f}", f"{ratio:.3f}", f">= {TARGET}",
             "PASS" if ok else "FAIL"),
            ("  per-round ratio (min / median / max)", "", "",
             f"{min(ratios):.3f} / {statistics.median(ratios):.3f} / {max(ratios):.3f}",
             "", ""),
            (f"time to first answer piece, {LONG_THINK}-token thinking",
             f"{statistics.median(budgeted):.3f} s", f"{statistics.median(unbounded):.3f} s",
             f"{statistics.median(budgeted) / statistics.median(unbounded):.3f}",
             "reported", "")]
    header = ("metric", "parsed / budget 64", "none / no budget", "ratio", "target",
              "result")
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
