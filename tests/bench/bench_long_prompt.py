"""Long-prompt benchmark: localrt's prompt rate against llama-server's, side by side,
and the prompt cache on a second turn of an agent's session (issue 37, item 4).

Run it from the repository root (not collected by pytest):

    .venv/bin/python tests/bench/bench_long_prompt.py [--threads 2] [--rounds 7] \\
        [--tokens 7000] [--llama-server PATH] [--localrt-options JSON]

llama-server is built from the sdist the installed llama-cpp-python was built from
(`python -m localrt.bootstrap --test` downloads it to tests/.rpc-build/sources), with
the flags the wheel had (Release, ggml's -march=native, AMX off as
localrt.bootstrap.AMX_OFF): the first run builds it into tests/.bench-build (about 20
minutes on 2 busy cores) and later runs take it from there; --llama-server names
another binary.

The model is SmolLM2-135M's shape with random weights (the hub is out of reach):
llama, 30 layers, n_embd 576, 9 heads and 3 KV heads, n_ff 1536, a 49152-token
vocabulary, context 8192 (tests/emulators/ggufgen.py), written in F16 and quantized
to Q8_0 by llama.cpp (--quant F16 keeps F16: about 3 times slower here). Each side
runs as its users run it: llama-server with its defaults (-np auto: 4 slots in one
unified KV cache, -fa auto, --cache-ram) and -c 8192; localrt with its defaults (4
slots, flash attention auto, its prompt cache in RAM) and ctx_len 8192; both with
-t/-tb (cpu_threads) --threads. --localrt-options adds start options (e.g.
'{"flash_attn": false}', localrt's default before issue 37).

1. Prompt rate. Each round writes a new random prompt of about --tokens tokens (words
   of the vocabulary, one token each), and each side reads it in a chat with
   max_tokens 1 (nothing of it cached: the words are new), the sides taking turns
   first (the machine is shared: its neighbours come and go). A side's rate is its
   prompt tokens / the request's wall time at the client. Printed: every round's two
   rates and their ratio (localrt / llama-server), and the medians. Target: every
   round >= 1.0x. One long prompt on each side first, untimed (the first decode of a
   context allocates its graph).
2. The second turn of an agent's session, as Claude Code's is: a long system prompt
   and tool schemas (--session-tokens in all, Qwen 2.5's template renders the tools),
   a first question, the reply (16 tokens), then the second question after it. Each
   round a new session (its system prompt random): the TTFT of turn one and of turn
   two, streamed, and turn two's cached tokens as each side's usage reports them
   (prompt_tokens_details.cached_tokens). Reported, no target: llama-server's figures
   beside localrt's.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import benchlib  # noqa: E402  (this folder is on sys.path)
from emulators.ggufgen import EOS_ID, MIN_VOCAB_SIZE  # noqa: E402

CTX = 8192  # SmolLM2's trained context: each side's slots hold this many tokens
REPLY = 16  # the tokens of turn one's reply
SDIST = REPO / "tests" / ".rpc-build" / "sources"
BUILD = REPO / "tests" / ".bench-build"  # gitignored: the sdist's llama.cpp, built
# SmolLM2-135M's hyperparameters (its config.json).
SMOLLM2 = dict(vocab_size=49152, n_embd=576, n_layer=30, n_head=9, n_head_kv=3, n_ff=1536,
               context_length=CTX)


# --- llama-server, from the same sdist ----------------------------------------------


def llama_server_binary() -> Path:
    """tests/.bench-build's llama-server, built from the sdist of the installed
    llama-cpp-python the first time (cmake and a C++ compiler needed)."""
    import llama_cpp

    from localrt.bootstrap import AMX_OFF

    version = llama_cpp.__version__
    build = BUILD / f"llama-server-{version}"
    binary = build / "bin" / "llama-server"
    if binary.exists():
        return binary
    sdist = SDIST / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        sys.exit(f"{sdist} is missing: run `python -m localrt.bootstrap --test` or "
                 f"`pip download --no-deps --no-binary=:all: -d {SDIST} "
                 f"llama-cpp-python=={version}`, or give --llama-server")
    print(f"building llama-server {version} into {build} (once; ~20 minutes) ...",
          file=sys.stderr)
    BUILD.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(BUILD, filter="data")
    source = BUILD / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    # The wheel's flags: scikit-build-core's Release, ggml's defaults (native, OpenMP),
    # and localrt.bootstrap's AMX-off CFLAGS; nothing fetched from the network.
    env = dict(os.environ, CFLAGS=" ".join(AMX_OFF), CXXFLAGS=" ".join(AMX_OFF))
    subprocess.run(["cmake", "-S", source, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
                    "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_APP=OFF"], env=env, check=True)
    subprocess.run(["cmake", "--build", build, "--target", "llama-server", "-j",
                    str(os.cpu_count() or 2)], env=env, check=True)
    return binary


class LlamaServer:
    """llama-server on a free loopback port, as its users start it, plus -c and -t."""

    def __init__(self, binary: Path, model: Path, threads: int, log: Path):
        from support.servers import free_port

        self.port = free_port()
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
             "-c", str(CTX), "-t", str(threads), "-tb", str(threads), "--no-webui"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited; see {log}")
            try:
                if benchlib.api(self.port, "GET", "/health", timeout=2)[0] == 200:
                    return
            except (OSError, ValueError, http.client.HTTPException):
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError("llama-server did not start")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self._log.close()


class Localrt:
    """localrt in its own process, the model imported and started with `options`."""

    def __init__(self, root: Path, model: Path, threads: int, options: dict):
        self.proc, self.port = benchlib.start_server(root / "home", timeout=60)
        status, body = benchlib.api(self.port, "POST", "/v1/models/import", {
            "path": str(model), "id": "smol", "option": "symlink"})
        assert status == 200, body
        status, body = benchlib.api(self.port, "POST", "/v1/models/smol/start", {
            "ctx_len": CTX, "cpu_threads": threads, **options}, timeout=120)
        assert status == 200, body
        self.options = body.get("options", {})

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


# --- the model and the prompts ---------------------------------------------------------


def make_model(root: Path, quant: str) -> Path:
    """SmolLM2-135M's shape, random weights, Qwen 2.5's template (it renders tools)."""
    from emulators.chattemplates import QWEN25
    from emulators.ggufgen import write_gguf

    with benchlib.quiet_stderr():
        path = write_gguf(root / "smol.gguf", name="smol", chat_template=QWEN25,
                          file_type="F16", **SMOLLM2)
        if quant != "F16":
            path = benchlib.quantize(path, root / f"smol-{quant}.gguf", quant)
    return path


LETTERS = "etaoinshrdlucmfwypvbgkqjxz"


def words(rng: random.Random, n: int) -> str:
    """n random words, each one token: two letters ("ab" is the piece "▁ab" of
    ggufgen's vocabulary)."""
    return " ".join(rng.choice(LETTERS) + rng.choice(LETTERS) for _ in range(n))


def session(rng: random.Random, tokens: int, count) -> tuple[list, list]:
    """(messages, tools) of a new agent's first turn: 12 tool schemas and a system
    prompt of about `tokens` tokens together (`count(text)`: a text's tokens), and a
    question."""
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": words(rng, 40),
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": words(rng, 12)},
            "limit": {"type": "integer", "description": words(rng, 8)}},
            "required": ["path"]}}} for i in range(12)]
    rest = tokens - sum(count(json.dumps(tool)) for tool in tools)
    system = "You are a coding agent. " + words(rng, max(rest, 100))
    return [{"role": "system", "content": system},
            {"role": "user", "content": "Find the failing test. " + words(rng, 20)}], tools


# --- requests --------------------------------------------------------------------------


def chat(port: int, body: dict) -> dict:
    """One streamed chat: its wall time, TTFT, text and usage."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps({
        **body, "model": "smol", "stream": True, "temperature": 0,
        "stream_options": {"include_usage": True}}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{resp.status}: {resp.read()[:500]!r}")
    ttft, text, usage = None, [], None
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        usage = event.get("usage") or usage
        choices = event.get("choices") or []
        delta = choices[0].get("delta", {}) if choices else {}
        # the first token: content, a tool call or the finish (localrt's first chunk,
        # the role, comes before the prompt is read)
        if ttft is None and (delta.get("content") or delta.get("tool_calls")
                             or (choices and choices[0].get("finish_reason"))):
            ttft = time.perf_counter() - start
        text.append(delta.get("content") or "")
    wall = time.perf_counter() - start
    conn.close()
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"wall": wall, "ttft": ttft, "text": "".join(text),
            "prompt": usage["prompt_tokens"], "cached": cached or 0}


def read_prompt(port: int, text: str) -> dict:
    """A chat of one user message that reads it and says one token."""
    return chat(port, {"messages": [{"role": "user", "content": text}], "max_tokens": 1})


def two_turns(port: int, messages: list, tools: list, eos: dict) -> dict:
    """Turn one and turn two of a session: their TTFTs, and turn two's cached tokens."""
    one = chat(port, {"messages": messages, "tools": tools, "max_tokens": REPLY,
                      "logit_bias": eos})
    later = messages + [{"role": "assistant", "content": one["text"]},
                        {"role": "user", "content": "Run it again with -x and tell me what "
                                                    "fails first."}]
    two = chat(port, {"messages": later, "tools": tools, "max_tokens": REPLY,
                      "logit_bias": eos})
    return {"ttft1": one["ttft"], "prompt1": one["prompt"], "ttft2": two["ttft"],
            "prompt2": two["prompt"], "cached2": two["cached"]}


# --- the run ---------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=7000)
    parser.add_argument("--session-tokens", type=int, default=4000)
    parser.add_argument("--quant", default="Q8_0", choices=("F16", "Q8_0"))
    parser.add_argument("--llama-server", help="a llama-server binary (default: built)")
    parser.add_argument("--localrt-options", default="{}",
                        help="start options for localrt's model, as JSON")
    parser.add_argument("--seed", type=int, default=37)
    args = parser.parse_args()
    import llama_cpp

    binary = Path(args.llama_server) if args.llama_server else llama_server_binary()
    rng = random.Random(args.seed)
    # </s> and <|im_end|> (ggufgen's ids: the last ChatML token ends its fixed part)
    eos = {str(EOS_ID): -100, str(MIN_VOCAB_SIZE - 1): -100}  # replies of REPLY tokens
    rates = {"localrt": [], "llama-server": []}
    turns = {"localrt": [], "llama-server": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print("writing the model ...", file=sys.stderr)
        model = make_model(root, args.quant)
        vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)

        def count(text: str) -> int:
            return len(vocab.tokenize(text.encode(), add_bos=False, special=False))

        sides = {}
        try:
            sides["localrt"] = Localrt(root, model, args.threads,
                                       json.loads(args.localrt_options))
            sides["llama-server"] = LlamaServer(binary, model, args.threads,
                                                root / "llama-server.log")
            for side in sides.values():  # untimed: each context's first decodes
                read_prompt(side.port, words(rng, 1000))
            for r in range(args.rounds):
                print(f"round {r + 1} of {args.rounds} ...", file=sys.stderr)
                text = words(rng, args.tokens)
                messages, tools = session(rng, args.session_tokens, count)
                order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                for name in order:
                    got = read_prompt(sides[name].port, text)
                    rates[name].append((got["prompt"] - got["cached"]) / got["wall"])
                print(f"  rates: localrt {rates['localrt'][-1]:.1f}, llama-server "
                      f"{rates['llama-server'][-1]:.1f} tok/s", file=sys.stderr)
                for name in order:
                    turns[name].append(two_turns(sides[name].port, messages, tools, eos))
                    print(f"  {name}: {turns[name][-1]}", file=sys.stderr)
            options = sides["localrt"].options
        finally:
            for side in sides.values():
                side.close()
    ratios = [a / b for a, b in zip(rates["localrt"], rates["llama-server"])]
    print(f"model: SmolLM2-135M's shape ({args.quant}), {args.threads} threads each, "
          f"prompts of {args.tokens} words")
    print("localrt's options: " + ", ".join(f"{k}={options[k]}" for k in sorted(options)
                                           if k not in ("engine", "prompt_template")))
    print("1. prompt rate (tok/s), localrt / llama-server, every round:")
    for i, (a, b, q) in enumerate(zip(rates["localrt"], rates["llama-server"], ratios)):
        print(f"   round {i + 1}: localrt {a:7.1f}  llama-server {b:7.1f}  {q:.2f}x")
    med = {k: statistics.median(v) for k, v in rates.items()}
    ok = min(ratios) >= 1.0
    print(f"   median:  localrt {med['localrt']:7.1f}  llama-server "
          f"{med['llama-server']:7.1f}  {statistics.median(ratios):.2f}x (median of the "
          f"rounds' ratios; lowest {min(ratios):.2f}x, target every round >= 1.0x: "
          f"{'PASS' if ok else 'FAIL'})")
    print("2. an agent's second turn (median of the rounds; TTFT in s):")
    for name, runs in turns.items():
        m = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        print(f"   {name:<12} turn 1: {m['prompt1']:.0f} tokens, TTFT {m['ttft1']:.2f}; "
              f"turn 2: {m['prompt2']:.0f} tokens, {m['cached2']:.0f} cached, TTFT "
              f"{m['ttft2']:.2f} ({m['ttft2'] / m['ttft1']:.3f} of turn 1's)")
        print("      every round (TTFT 1, TTFT 2, cached 2): " + "; ".join(
            f"{run['ttft1']:.2f} {run['ttft2']:.2f} {run['cached2']}" for run in runs))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
