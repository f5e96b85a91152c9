"""Tool-call benchmark: the cost of reading a streamed reply for tool calls.

Run it from the repository root (not collected by pytest; it has no test_ functions):

    .venv/bin/python tests/bench/bench_tools.py [--threads 2] [--max-tokens 128]

It prints one table (metric, with tools, without, ratio, target, result) and exits
with status 1 when the row with a target is FAIL, 0 otherwise. It takes about a
minute on 2 cores; progress and how much CPU other processes took while it measured
go to stderr (llama.cpp's threads wait for each other at every step, so a busy
machine makes the ratio noise).

The model is bench_chat.py's synthetic llama (n_embd 768, 8 layers, 12 heads, n_ff
2048, a 32000-token vocabulary, random weights, quantized to Q8_0 by llama.cpp), here
carrying Qwen 2.5's real chat template and its <tool_call> and </tool_call> tokens;
`--model PATH` uses a GGUF of your own (one whose template calls tools the Hermes way).
localrt runs as `python -m localrt start --foreground --port 0` in its own process.

The two requests give the model the same prompt, token for token, and greedy decoding
makes the same K tokens of text (the end-of-generation tokens and <tool_call> are
banned through logit_bias, so no call starts and every reply is K tokens long):

- with tools: `tools` (two functions) and tool_choice "auto": localrt renders them
  with the template and reads every streamed piece for calls;
- without: no `tools`, and a system message holding the very text the template writes
  for those tools, so the prompt is the same and nothing is read for calls.

So the ratio is what reading for tool calls costs a stream, and nothing else (a
longer prompt alone would slow decoding: attention reads every cached token). The
requests alternate, --repeats of each per round, after an untimed warm-up of each
(from then on the prompt sits in the prefix cache). Decode tok/s of a stream is
(K - 1) / (arrival of its last content chunk - arrival of its first); the row gives
the best of each side (interference only ever slows a run down), and the median as
context. Target: with tools >= 0.97 x without. The streamed texts must be equal.
A context row times the parser alone on the streamed pieces, in this process: its
ratio is the slowdown it alone would cause at the best decode rate without tools, a
figure no busy machine blurs.
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
from bench_chat import PROMPT, cpu_snapshot, others_share  # noqa: E402

MODEL_ID = "bench-tools"
CTX_LEN = 2048
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city, now",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"city": {"type": "string"},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "get_tide", "description": "High and low tide times for a harbour",
        "parameters": {"type": "object", "required": ["harbour"],
                       "properties": {"harbour": {"type": "string"},
                                      "days": {"type": "integer"}}}}},
]


def make_model(folder: Path) -> Path:
    """bench_chat's random llama with Qwen 2.5's template and tool-call tokens, Q8_0."""
    import gguf
    from emulators.chattemplates import QWEN25, TOKENS
    from emulators.ggufgen import write_gguf

    added = [(text, gguf.TokenType.USER_DEFINED) for text, _ in TOKENS["qwen25"]]
    source = write_gguf(folder / "bench-tools-f16.gguf", name="bench-tools", n_embd=768,
                        n_layer=8, n_head=12, n_ff=2048, vocab_size=32000,
                        context_length=CTX_LEN, file_type="F16", chat_template=QWEN25,
                        added_tokens=added)
    target = benchlib.quantize(source, folder / "bench-tools-q8_0.gguf", "Q8_0")
    source.unlink()
    return target


def banned(model: Path) -> tuple[dict, str]:
    """{token id: -100} for the end-of-generation tokens and <tool_call>, and the system
    text the template writes for TOOLS (so a request without tools gets the same prompt)."""
    import llama_cpp
    from llama_cpp import llama_chat_format

    llm = llama_cpp.Llama(str(model), n_ctx=256, n_threads=1, verbose=False)
    try:
        vocab = llm._model.vocab
        bias = {str(t): -100.0 for t in range(llm.n_vocab())
                if llama_cpp.llama_vocab_is_eog(vocab, t)}
        for token in llm.tokenize(b"<tool_call>", add_bos=False, special=True):
            bias[str(token)] = -100.0
        template = llm.metadata["tokenizer.chat_template"]
    finally:
        llm.close()
    render = llama_chat_format.Jinja2ChatFormatter(template, eos_token="", bos_token="")
    prompt = render(messages=[{"role": "user", "content": PROMPT}], tools=TOOLS).prompt
    system = prompt[len("<|im_start|>system\n"):prompt.index("<|im_end|>")]
    same = render(messages=[{"role": "system", "content": system},
                            {"role": "user", "content": PROMPT}]).prompt
    if same != prompt:
        raise RuntimeError("the template writes tools differently from a system message")
    return bias, system


def body(k: int, bias: dict, system: str, with_tools: bool) -> dict:
    """The streamed chat request of one side."""
    out = {"model": MODEL_ID, "max_tokens": k, "temperature": 0, "logit_bias": bias,
           "stream": True, "stream_options": {"include_usage": True}}
    if with_tools:
        out.update(messages=[{"role": "user", "content": PROMPT}], tools=TOOLS,
                   tool_choice="auto")
    else:
        out["messages"] = [{"role": "system", "content": system},
                           {"role": "user", "content": PROMPT}]
    return out


def stream(port: int, request: dict) -> dict:
    """One streamed chat over a new connection: decode tok/s, tokens, text."""
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
    stamps, text, tokens = [], [], None
    for t, line in lines:
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"chat stream failed: {chunk['error']}")
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk["choices"]:
            if choice["delta"].get("tool_calls"):
                raise RuntimeError("a reply made a tool call; it should be text")
            piece = choice["delta"].get("content")
            if piece:
                stamps.append(t)
                text.append(piece)
    k = request["max_tokens"]
    if tokens != k:
        raise RuntimeError(f"a stream ended with {tokens} tokens, not {k}")
    return {"decode": (k - 1) / (stamps[-1] - stamps[0]), "text": "".join(text),
            "pieces": text}


def parser_cost(pieces: list, times: int = 200) -> float:
    """Seconds localrt's parser takes per piece of a streamed reply, in this process."""
    from localrt.engines import toolcalls

    family = toolcalls.family_of("<tool_call>")
    started = time.perf_counter()
    for _ in range(times):
        parser = toolcalls.CallParser(family, 1 << 30)
        for piece in pieces:
            parser.feed(piece)
        parser.close()
    return (time.perf_counter() - started) / (times * len(pieces))


def main() -> int:
    """Build or reuse the model, run the rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="the model's cpu_threads")
    parser.add_argument("--max-tokens", type=int, default=128, help="K, tokens per reply")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="streams of each side a round")
    parser.add_argument("--model", type=Path, help="a GGUF to use instead of generating one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="localrt-bench-") as tmp:
        root = Path(tmp)
        model = args.model.resolve() if args.model else make_model(root)
        bias, system = banned(model)
        proc, port = benchlib.start_server(root / "home", timeout=60)
        try:
            for path, request in (("/v1/models/import", {"path": str(model), "id": MODEL_ID}),
                                  (f"/v1/models/{MODEL_ID}/start",
                                   {"ctx_len": CTX_LEN, "cpu_threads": args.threads})):
                status, reply = benchlib.api(port, "POST", path, request, timeout=120)
                if status != 200:
                    raise RuntimeError(f"{path} answered {status}: {reply}")
            k = args.max_tokens
            sides = {True: [], False: []}
            texts = {True: set(), False: set()}
            for with_tools in (True, False):  # warm-up: the prompt goes into the cache
                stream(port, body(k, bias, system, with_tools))
            cpu_before, measured_from = cpu_snapshot(proc.pid), time.perf_counter()
            for i in range(args.rounds):
                for _ in range(args.repeats):
                    for with_tools in ((True, False) if i % 2 == 0 else (False, True)):
                        s = stream(port, body(k, bias, system, with_tools))
                        sides[with_tools].append(s["decode"])
                        texts[with_tools].add(s["text"])
                        pieces = s["pieces"]
                print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
            busy = others_share(cpu_before, cpu_snapshot(proc.pid),
                                time.perf_counter() - measured_from)
        finally:
            proc.terminate()
            proc.wait(30)
    best = {side: max(values) for side, values in sides.items()}
    median = {side: statistics.median(values) for side, values in sides.items()}
    ratio = best[True] / best[False]
    same = texts[True] == texts[False] and len(texts[True]) == 1
    cost = parser_cost(pieces)
    rows = [["streamed decode tok/s, best", f"{best[True]:.1f}", f"{best[False]:.1f}",
             f"{ratio:.3f}", ">= 0.97", "PASS" if ratio >= 0.97 else "FAIL"],
            ["streamed decode tok/s, median", f"{median[True]:.1f}", f"{median[False]:.1f}",
             f"{median[True] / median[False]:.3f}", "", ""],
            ["the same streamed text", "yes" if same else "NO", "", "", "", ""],
            ["parser time per token (in-process)", f"{cost * 1e6:.1f} us", "",
             f"{1 / (1 + cost * best[False]):.4f}", "", ""]]
    print(f"other processes used {busy:.0%} of the CPUs while it measured"
          + (" -- the machine was busy; the figures are not reliable" if busy > 0.05
             else ""), file=sys.stderr)
    header = ["metric", "with tools", "without", "ratio", "target", "result"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    return 1 if ratio < 0.97 or not same else 0


if __name__ == "__main__":
    sys.exit(main())
