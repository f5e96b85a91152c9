"""Agents benchmark: speculative decoding from the context and the RAM prompt cache,
against raw llama-cpp-python and llama-server, same model and threads, one run.

Run it from the repository root (not collected by pytest):

    .venv/bin/python tests/bench/bench_agents.py [--threads 2] \\
        [--llama-server PATH/TO/llama-server]

llama-server is built from the llama.cpp that llama-cpp-python's sdist vendors, as the
RPC test builds ggml-rpc-server (about 15 minutes on 2 cores):

    tar xzf llama_cpp_python-0.3.36.tar.gz
    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DLLAMA_CURL=OFF \\
        -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF
    cmake --build build --target llama-server -j2

Without --llama-server its rows are left out. The models are generated (no hub): a
synthetic llama of n_embd 768, 8 layers, a 32000-token vocabulary (about 110 M
parameters, Q8_0), random or scripted:

1. Edit task, single stream, greedy: the prompt is a 400-token text and "repeat this
   text"; the scripted model writes that text (a copy, as an edit is, 98 % of it).
   localrt's decode tok/s against raw llama-cpp-python's (no speculation): target
   2x; and against llama-server with --spec-type ngram-simple and ngram-mod: target
   1.0x the better; and localrt with draft_max 64 (ngram-mod drafts 48 to 64), reported.
2. A reply with nothing to copy (the random model): localrt against raw, target 0.97x.
3. Eight agents on 4 slots, three turns each, a 2,000-token shared system prompt: the
   median TTFT of turns 2 and 3 against the TTFT of the same turns replayed at once
   (their whole prefix then in a slot: only their new tokens read, at the same
   depth). Target 1.3x; llama-server with --cache-ram the same way.
4. Four concurrent streams of the random model, speculation on against off (the
   aggregate of before this change): target 0.97x.
Each side holds the model alone: localrt is stopped while raw or llama-server runs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import benchlib  # noqa: E402

CTX = 4096
COPY_TOKENS = 400
SYSTEM_TOKENS = 2000
EOS = 2


def make_models(root: Path) -> dict:
    from ggufgen import _vocab, write_gguf

    with benchlib.quiet_stderr():
        dims = dict(vocab_size=32000, n_embd=768, n_layer=8, n_head=12, n_ff=2048,
                    context_length=CTX, file_type="F16")
        script = copyable(root, dims)
        copy = write_gguf(root / "copy.gguf", name="copy", script=script, **dims)
        fresh = write_gguf(root / "fresh.gguf", name="fresh", weight_scale=0.05, **dims)
        out = {"copy": benchlib.quantize(copy, root / "copy-Q8_0.gguf", "Q8_0"),
               "fresh": benchlib.quantize(fresh, root / "fresh-Q8_0.gguf", "Q8_0")}
    out["text"] = "".join(script).replace("\u2581", " ").strip()
    out["words"] = len(script)
    return out


def copyable(root: Path, dims: dict) -> list:
    """COPY_TOKENS distinct whole-word pieces of the vocabulary that the tokenizer gives
    back as themselves, in a text of them: the scripted model writes exactly the tokens
    of its prompt's text, as a real model copying its context does."""
    import llama_cpp
    from ggufgen import _vocab, write_gguf

    vocab_path = write_gguf(root / "vocab.gguf", vocab_size=dims["vocab_size"], n_embd=64,
                            context_length=CTX)
    vocab = llama_cpp.Llama(str(vocab_path), vocab_only=True, verbose=False)
    try:
        pieces = _vocab(dims["vocab_size"])[0]
        # the tokenizer puts a word start (a space) before the text itself
        words = [i for i, p in enumerate(pieces) if p.startswith("\u2581") and len(p) > 2
                 and vocab.tokenize(p[1:].encode(), add_bos=False, special=False) == [i]]
        script = [pieces[i] for i in words[:COPY_TOKENS]]
        text = "".join(script).replace("\u2581", " ")[1:]
        got = vocab.tokenize(text.encode(), add_bos=False, special=False)
        if got != words[:COPY_TOKENS]:
            raise RuntimeError("the script's text does not tokenize back into the script")
        return script
    finally:
        vocab.close()


def edit_messages(text: str) -> list:
    return [{"role": "user", "content": f"{text}\n\nRepeat this text with one word changed."}]


# --- raw llama-cpp-python -----------------------------------------------------------


def raw_rate(model: Path, messages: list, k: int, threads: int) -> float:
    """Decode tok/s of a greedy chat through llama-cpp-python, no speculation."""
    import llama_cpp

    with benchlib.quiet_stderr():
        llm = llama_cpp.Llama(str(model), n_ctx=CTX, n_threads=threads,
                              n_threads_batch=threads, verbose=False)
    try:
        best = 0.0
        for _ in range(2):
            llm.reset()
            stamps = []
            for chunk in llm.create_chat_completion(messages, max_tokens=k, temperature=0,
                                                    stream=True, logit_bias={EOS: -100}):
                if chunk["choices"][0]["delta"].get("content"):
                    stamps.append(time.perf_counter())
            best = max(best, (len(stamps) - 1) / (stamps[-1] - stamps[0]))
        return best
    finally:
        llm.close()


# --- HTTP: localrt and llama-server speak OpenAI's chat -------------------------------


def stream(port: int, body: dict) -> dict:
    """One streamed chat: its TTFT, decode tok/s and usage."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    stamps, usage = [], None
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            usage = event["usage"]
        choices = event.get("choices") or []
        if choices and choices[0].get("delta", {}).get("content"):
            stamps.append(time.perf_counter())
    conn.close()
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 2 else 0.0
    return {"ttft": stamps[0] - start if stamps else None, "rate": rate,
            "tokens": len(stamps), "usage": usage}


def best_rate(port: int, model: str, messages: list, k: int, n: int = 2) -> float:
    body = {"model": model, "messages": messages, "max_tokens": k, "temperature": 0,
            "logit_bias": {str(EOS): -100}}
    return max(stream(port, body)["rate"] for _ in range(n))


def agents(port: int, model: str, turns: int = 3, n: int = 8) -> tuple[list, list]:
    """Eight conversations interleaved turn by turn; (TTFTs of turns 2 and 3, the same
    turns replayed at once: their prefix in a slot)."""
    system = " ".join(f"rule {i}: be exact." for i in range(SYSTEM_TOKENS // 6))
    talks = [[{"role": "system", "content": system},
              {"role": "user", "content": f"Agent {i}, start task {i}."}] for i in range(n)]
    later, alone = [], []
    for t in range(turns):
        for i, talk in enumerate(talks):
            body = {"model": model, "messages": talk, "max_tokens": 16, "temperature": 0,
                    "logit_bias": {str(EOS): -100}}
            first = stream(port, body)
            if t:
                later.append(first["ttft"])
                alone.append(stream(port, body)["ttft"])  # its prefix is in a slot now
            reply = "done step %d of task %d" % (t, i)
            talk += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": f"Go on with step {t + 1}."}]
    return later, alone


def concurrent(port: int, model: str, k: int = 64) -> float:
    out = []

    def one(i):
        out.append(stream(port, {"model": model, "max_tokens": k, "temperature": 0,
                                 "logit_bias": {str(EOS): -100},
                                 "messages": [{"role": "user", "content": f"Story {i}"}]}))

    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(o["tokens"] for o in out) / (time.perf_counter() - start)


# --- servers ---------------------------------------------------------------------------


class Localrt:
    def __init__(self, root: Path, models: dict, threads: int):
        self.proc, self.port = benchlib.start_server(root / "home", timeout=60)
        self.threads = threads
        for name in ("copy", "fresh"):
            status, body = benchlib.api(self.port, "POST", "/v1/models/import", {
                "path": str(models[name]), "id": name, "option": "symlink"})
            assert status == 200, body

    def start(self, model: str, **options) -> None:
        benchlib.api(self.port, "POST", f"/v1/models/{model}/stop")
        status, body = benchlib.api(self.port, "POST", f"/v1/models/{model}/start", {
            "ctx_len": CTX, "cpu_threads": self.threads, "n_parallel": 4, **options})
        assert status == 200, body

    def stop(self, model: str) -> None:
        benchlib.api(self.port, "POST", f"/v1/models/{model}/stop")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def llama_server(binary: str, model: Path, threads: int, *extra: str):
    """A llama-server child on a free port with 4 slots: (process, port)."""
    from support.servers import free_port

    port = free_port()
    proc = subprocess.Popen([binary, "-m", str(model), "--host", "127.0.0.1", "--port",
                             str(port), "-c", str(CTX * 4), "-np", "4", "-t", str(threads),
                             "-tb", str(threads), "--no-webui", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if benchlib.api(port, "GET", "/health", timeout=2)[0] == 200:
                return proc, port
        except (OSError, ValueError, http.client.HTTPException):
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("llama-server did not start")


def with_server(binary, model, threads, extra, job):
    proc, port = llama_server(binary, model, threads, *extra)
    try:
        return job(port)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--llama-server", help="a llama-server binary (see above)")
    args = parser.parse_args()
    rows, k = [], args.tokens
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print("writing the models ...", file=sys.stderr)
        models = make_models(root)
        edit = edit_messages(models["text"])
        fresh_msgs = [{"role": "user", "content": "Tell me a long story."}]
        print("raw llama-cpp-python ...", file=sys.stderr)
        raw_copy = raw_rate(models["copy"], edit, k, args.threads)
        raw_fresh = raw_rate(models["fresh"], fresh_msgs, k, args.threads)
        server = Localrt(root, models, args.threads)
        try:
            print("localrt ...", file=sys.stderr)
            server.start("copy")
            ours_copy = best_rate(server.port, "copy", edit, k)
            server.start("copy", draft_max=64)
            ours_copy64 = best_rate(server.port, "copy", edit, k)
            server.stop("copy")
            server.start("fresh")
            ours_fresh = best_rate(server.port, "fresh", fresh_msgs, k)
            on = max(concurrent(server.port, "fresh") for _ in range(2))
            server.start("fresh", speculative="off")
            off = max(concurrent(server.port, "fresh") for _ in range(2))
            server.start("fresh")
            later, alone = agents(server.port, "fresh")
            server.stop("fresh")
        finally:
            server.close()
        spec, cache = {}, None
        if args.llama_server:
            print("llama-server ...", file=sys.stderr)
            for mode in ("ngram-simple", "ngram-mod"):
                spec[mode] = with_server(args.llama_server, models["copy"], args.threads,
                                         ["--spec-type", mode],
                                         lambda p: best_rate(p, "copy", edit, k))
            spec["none"] = with_server(args.llama_server, models["copy"], args.threads, [],
                                       lambda p: best_rate(p, "copy", edit, k))
            cache = with_server(args.llama_server, models["fresh"], args.threads,
                                ["--cache-ram", "2048"], lambda p: agents(p, "fresh"))

    def row(metric, ours, ref, target, ok):
        ratio = ours / ref if ref else float("nan")
        rows.append((metric, f"{ours:.2f}", f"{ref:.2f}", f"{ratio:.2f}x", target,
                     "-" if ok is None else ("PASS" if ok(ratio) else "FAIL")))

    row("1. edit, decode tok/s vs raw", ours_copy, raw_copy, ">= 2x", lambda r: r >= 2)
    if spec:
        best = max(spec["ngram-simple"], spec["ngram-mod"])
        row("1. edit, vs llama-server best n-gram", ours_copy, best, ">= 1.0x",
            lambda r: r >= 1.0)
        row("   the same with draft_max 64", ours_copy64, best, "report", None)
        for mode in ("ngram-simple", "ngram-mod"):
            row(f"   llama-server {mode} vs its none", spec[mode], spec["none"], "report",
                None)
    row("2. nothing to copy, tok/s vs raw", ours_fresh, raw_fresh, ">= 0.97x",
        lambda r: r >= 0.97)
    row("3. agents, TTFT turns 2-3 vs new tokens alone (s)", statistics.median(later),
        statistics.median(alone), "<= 1.3x", lambda r: r <= 1.3)
    if cache:
        row("   llama-server --cache-ram, the same", statistics.median(cache[0]),
            statistics.median(cache[1]), "report", None)
    row("4. four streams, speculation on vs off (tok/s)", on, off, ">= 0.97x",
        lambda r: r >= 0.97)
    for r in rows:
        print(f"{r[0]:<52} {r[1]:>9} {r[2]:>9} {r[3]:>7} {r[4]:>9} {r[5]:>5}")
    return 1 if any(r[5] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
