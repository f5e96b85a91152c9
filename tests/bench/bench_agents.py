"""Agents benchmark: speculative decoding from the context and the RAM prompt cache,
against raw llama-cpp-python and llama-server, same model and threads, one run.

Run it from the repository root (not collected by pytest):

    .venv/bin/python tests/bench/bench_agents.py [--threads 2] [--rounds 5] \\
        [--llama-server PATH/TO/llama-server]

llama-server is built from the llama.cpp that llama-cpp-python's sdist vendors, as the
RPC test builds ggml-rpc-server (about 15 minutes on 2 cores):

    tar xzf llama_cpp_python-0.3.36.tar.gz
    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DLLAMA_CURL=OFF \\
        -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF
    cmake --build build --target llama-server -j2

Without --llama-server its rows are left out. The models are generated (no hub): a
synthetic llama of n_embd 768, 8 layers, a 32000-token vocabulary (about 110 M
parameters, Q8_0), random or scripted. The sides take turns, --rounds times (5: the
machine's neighbours come and go), and each figure is the median of its rounds.
Each server answers the same request twice (after a one-token read of its prompt):
llama-server's n-gram pool outlives a request, so its first reply drafts from the
prompt alone, as for a new edit, and its second also from its memory of the first;
a side's figure is the better of the two, and the first replies are reported apart.

1. Edit task, single stream, greedy: the prompt is a 400-token text and "repeat this
   text with one word changed"; the scripted model writes that text with one word in
   50 changed (it copies 98 % of it, as the issue's real model did).
   localrt's decode tok/s against raw llama-cpp-python's (no speculation): target
   2x; and against llama-server with --spec-type ngram-simple and ngram-mod: target
   1.0x the better. Reported beside: localrt with draft_max 64; llama-server with a
   draft model that is always right (a small model scripted to write the same reply:
   the most a draft model can give, item 3); and a pure copy (the text whole), where
   ngram-mod's drafts of 48 to 64 tokens meet no change, against localrt's default
   draft_max of 16 and 64, and ngram-mod held to 16. And a story (a scripted reply
   whose words the prompt lacks: nothing to copy) with llama-server's always-right
   draft model, against its none and localrt: what a draft model could give where
   n-gram drafting cannot.
2. A reply with nothing to copy (the random model): localrt against raw, target 0.97x;
   and localrt with speculation on against off, reported (what speculation costs).
3. Eight agents on 4 slots, three turns each, a 2,000-token shared system prompt: the
   median TTFT of turns 2 and 3 against the TTFT of the same turns replayed at once
   (their whole prefix then in a slot: only their new tokens read, at the same
   depth). Target 1.3x; llama-server with --cache-ram the same way.
4. Four concurrent streams of the random model, speculation on against off (the
   aggregate of before this change): target 0.97x.
Each side holds the model alone: localrt's model is stopped while raw or llama-server
runs.
"""

from __future__ import annotations

import argparse
import collections
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
CHANGE_EVERY = 50  # the edit changes one word in 50: it copies 98 % of the text
SYSTEM_TOKENS = 2000
EOS = 2


def make_models(root: Path) -> dict:
    """The models, quantized to Q8_0: "copy" writes the edited text (98 % of its
    prompt's), "pure" the prompt's text whole, "story" words its prompt lacks,
    "fresh" is random (nothing to copy); "draft" and "story draft" are small models
    that write what "copy" and "story" write (draft models that are always right:
    the most any draft model could give)."""
    from emulators.ggufgen import write_gguf

    dims = dict(vocab_size=32000, n_embd=768, n_layer=8, n_head=12, n_ff=2048,
                context_length=CTX, file_type="F16")
    small = dict(dims, n_embd=512, n_layer=1, n_head=8, n_ff=512)
    with benchlib.quiet_stderr():
        original, script, story = copyable(root, dims)
        made = {"copy": write_gguf(root / "copy.gguf", name="copy", script=script, **dims),
                "pure": write_gguf(root / "pure.gguf", name="pure", script=original,
                                   **dims),
                "fresh": write_gguf(root / "fresh.gguf", name="fresh", weight_scale=0.05,
                                    **dims),
                "draft": write_gguf(root / "draft.gguf", name="draft", script=script,
                                    **small),
                "story": write_gguf(root / "story.gguf", name="story", script=story,
                                    **dims),
                "story draft": write_gguf(root / "story-draft.gguf", name="story-draft",
                                          script=story, **small)}
        out = {name: benchlib.quantize(path, root / f"{path.stem}-Q8_0.gguf", "Q8_0")
               for name, path in made.items()}
    out["text"] = "".join(original).replace("\u2581", " ").strip()
    return out


def copyable(root: Path, dims: dict) -> tuple[list, list, list]:
    """(the text, its edit, a story). The text: COPY_TOKENS distinct whole-word pieces
    of the vocabulary that the tokenizer gives back as themselves, so a scripted model
    writes the tokens of its prompt's text, as a real model copying its context does.
    The edit: the same with one word in CHANGE_EVERY changed, as the issue's real
    model copied 98 % of it. The story: as many other pieces, none of the others'."""
    import llama_cpp
    from emulators.ggufgen import _vocab, write_gguf

    vocab_path = write_gguf(root / "vocab.gguf", vocab_size=dims["vocab_size"], n_embd=64,
                            context_length=CTX)
    vocab = llama_cpp.Llama(str(vocab_path), vocab_only=True, verbose=False)
    try:
        pieces = _vocab(dims["vocab_size"])[0]
        # the tokenizer puts a word start (a space) before the text itself
        words = [i for i, p in enumerate(pieces) if p.startswith("\u2581") and len(p) > 2
                 and vocab.tokenize(p[1:].encode(), add_bos=False, special=False) == [i]]
        original = [pieces[i] for i in words[:COPY_TOKENS]]
        text = "".join(original).replace("\u2581", " ")[1:]
        got = vocab.tokenize(text.encode(), add_bos=False, special=False)
        if got != words[:COPY_TOKENS]:
            raise RuntimeError("the text does not tokenize back into its pieces")
        # the edit: one word in every CHANGE_EVERY another, a word the text lacks
        spare = iter(words[COPY_TOKENS:])
        script = [pieces[next(spare)] if i % CHANGE_EVERY == CHANGE_EVERY // 2 else p
                  for i, p in enumerate(original)]
        others = set(original) | set(script)
        story = [p for p in pieces[::-1] if p.startswith("\u2581") and len(p) > 2
                 and p not in others][:COPY_TOKENS]
        return original, script, story
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


def replies(port: int, model: str, messages: list, k: int) -> list[float]:
    """The decode tok/s of a server's first two replies of k tokens to `messages`, the
    prompt read once before with one token (it is then cached). llama-server's n-gram
    pool outlives a request: its first reply drafts from the prompt alone, as for a
    new edit, and its second also from its memory of the first reply."""
    body = {"model": model, "messages": messages, "max_tokens": k, "temperature": 0,
            "logit_bias": {str(EOS): -100}}
    stream(port, {**body, "max_tokens": 1})
    return [stream(port, body)["rate"] for _ in range(2)]


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
        for name in ("copy", "pure", "story", "fresh"):
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

    def replies(self, model: str, messages: list, k: int, **options) -> list[float]:
        """replies() of the model just started, as each llama-server's are."""
        self.start(model, **options)
        try:
            return replies(self.port, model, messages, k)
        finally:
            self.stop(model)

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


def llama_modes(models: dict) -> dict:
    """llama-server's runs for the edit rows: name -> (model, its options)."""
    spec = ["--spec-type"]
    return {
        "none": ("copy", []),
        "ngram-simple": ("copy", spec + ["ngram-simple"]),
        "ngram-mod": ("copy", spec + ["ngram-mod"]),
        "draft model": ("copy", spec + ["draft-simple", "--spec-draft-model",
                                        str(models["draft"]), "--spec-draft-n-max", "16"]),
        "pure ngram-simple": ("pure", spec + ["ngram-simple"]),
        "pure ngram-mod": ("pure", spec + ["ngram-mod"]),
        "pure ngram-mod 16": ("pure", spec + ["ngram-mod", "--spec-ngram-mod-n-max", "16",
                                              "--spec-ngram-mod-n-min", "16"]),
        "story none": ("story", []),
        "story draft model": ("story", spec + ["draft-simple", "--spec-draft-model",
                                               str(models["story draft"]),
                                               "--spec-draft-n-max", "16"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--llama-server", help="a llama-server binary (see above)")
    args = parser.parse_args()
    k, threads = args.tokens, args.threads
    got = collections.defaultdict(list)  # each measure's samples, one a round

    def take(name, rates):  # a server's first reply, and its second
        got[name].append(rates[0])
        got[f"{name} again"].append(rates[1])

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print("writing the models ...", file=sys.stderr)
        models = make_models(root)
        edit = edit_messages(models["text"])
        story = [{"role": "user", "content": "Tell me a long story."}]
        server = Localrt(root, models, threads)
        try:
            for r in range(args.rounds):  # the sides take turns: the machine's noise
                print(f"round {r + 1} of {args.rounds} ...", file=sys.stderr)
                got["raw copy"].append(raw_rate(models["copy"], edit, k, threads))
                got["raw fresh"].append(raw_rate(models["fresh"], story, k, threads))
                take("copy", server.replies("copy", edit, k))
                take("copy 64", server.replies("copy", edit, k, draft_max=64))
                take("pure", server.replies("pure", edit, k))
                take("pure 64", server.replies("pure", edit, k, draft_max=64))
                take("story", server.replies("story", story, k))
                got["fresh"].append(max(server.replies("fresh", story, k)))
                got["fresh off"].append(max(server.replies("fresh", story, k,
                                                           speculative="off")))
                for name, options in (("on", {}), ("off", {"speculative": "off"})):
                    server.start("fresh", **options)
                    got[name].append(concurrent(server.port, "fresh"))
                server.stop("fresh")
                for name, (model, extra) in (llama_modes(models).items()
                                             if args.llama_server else ()):
                    messages = story if model == "story" else edit
                    take(name, with_server(
                        args.llama_server, models[model], threads, extra,
                        lambda port: replies(port, model, messages, k)))
            print("agents ...", file=sys.stderr)
            server.start("fresh")
            later, alone = agents(server.port, "fresh")
            server.stop("fresh")
        finally:
            server.close()
        cache = None
        if args.llama_server:
            cache = with_server(args.llama_server, models["fresh"], threads,
                                ["--cache-ram", "2048"], lambda p: agents(p, "fresh"))
    med = {name: statistics.median(samples) for name, samples in got.items()}
    # a side's figure: the better of its first and second replies
    best = {name: max(med[name], med.get(f"{name} again", 0)) for name in med}
    rows = []

    def row(metric, ours, ref, target, ok):
        ratio = ours / ref if ref else float("nan")
        rows.append((metric, f"{ours:.2f}", f"{ref:.2f}", f"{ratio:.2f}x", target,
                     "-" if ok is None else ("PASS" if ok(ratio) else "FAIL")))

    row("1. edit, decode tok/s vs raw", best["copy"], med["raw copy"], ">= 2x",
        lambda r: r >= 2)
    if args.llama_server:
        ref = max(best["ngram-simple"], best["ngram-mod"])
        row("1. edit, vs llama-server best n-gram", best["copy"], ref, ">= 1.0x",
            lambda r: r >= 1.0)
        first = max(med["ngram-simple"], med["ngram-mod"])
        row("   the same, first replies only", med["copy"], first, "report", None)
        row("   the same, localrt with draft_max 64", best["copy 64"], ref, "report", None)
        for mode in ("ngram-simple", "ngram-mod", "draft model"):
            row(f"   llama-server {mode} vs its none", best[mode], best["none"], "report",
                None)
        row("   llama-server draft model vs localrt", best["draft model"], best["copy"],
            "report", None)
        pure = max(best["pure ngram-simple"], best["pure ngram-mod"])
        row("   pure copy: localrt vs llama-server best", best["pure"], pure, "report", None)
        row("   pure copy: localrt draft_max 64, the same", best["pure 64"], pure, "report",
            None)
        row("   pure copy: localrt vs ngram-mod n_max 16", best["pure"],
            best["pure ngram-mod 16"], "report", None)
        row("   story: llama-server draft model vs its none", best["story draft model"],
            best["story none"], "report", None)
        row("   story: llama-server draft model vs localrt", best["story draft model"],
            best["story"], "report", None)
    row("2. nothing to copy, tok/s vs raw", med["fresh"], med["raw fresh"], ">= 0.97x",
        lambda r: r >= 0.97)
    row("   the same, localrt with speculation on vs off", med["fresh"], med["fresh off"],
        "report", None)
    row("3. agents, TTFT turns 2-3 vs new tokens alone (s)", statistics.median(later),
        statistics.median(alone), "<= 1.3x", lambda r: r <= 1.3)
    if cache:
        row("   llama-server --cache-ram, the same", statistics.median(cache[0]),
            statistics.median(cache[1]), "report", None)
    row("4. four streams, speculation on vs off (tok/s)", med["on"], med["off"],
        ">= 0.97x", lambda r: r >= 0.97)
    print(f"medians of {args.rounds} rounds; every sample:")
    for name, samples in got.items():
        print(f"  {name:<20} " + " ".join(f"{x:.1f}" for x in samples))
    for r in rows:
        print(f"{r[0]:<52} {r[1]:>9} {r[2]:>9} {r[3]:>7} {r[4]:>9} {r[5]:>5}")
    return 1 if any(r[5] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
