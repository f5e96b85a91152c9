"""Model-file campaign: hostile GGUFs imported, started and chatted with, against a
running `localrt start`, while another model streams beside them (issue 38).

Run it from the repository root (not collected by pytest; tests/test_model_fuzz.py runs
a short one in CI):

    .venv/bin/python tests/bench/model_fuzz.py --files 10000 [--seed 1] [--keep DIR]

The mutants come from tests/emulators/ggufmutate.py, made from three tiny generated models
(a SentencePiece vocabulary in F32, the same quantized to Q8_0, and a byte-level BPE
vocabulary with merges), the kinds dealt from shuffled decks: header fields, key/value
types, string lengths and array counts, the tensor table, tensor offsets, truncation
in every region, flipped bytes, the vocabulary's arrays, the merges, the
hyperparameters, the tensors and the chat template.

One server runs throughout (`python -m localrt start --foreground --port 0`, its own
HOME, its log in the campaign's folder). A well-formed model streams 300-token replies
one after another the whole time, on its own connection. Each mutant is written to a
file, imported (`POST /v1/models/import`, linked), started and sent one chat whose
text holds every byte-sized character class a tokenizer trips on ('|', a byte that is
not ASCII, a special token's text); then it is stopped and deleted. What each step
answered decides the mutant's row:

- header: the import or the start was a 400 `invalid_model_file` from the Python
  header check (its message names a rule);
- child: a 400 `invalid_model_file` from the child process that loads a new file
  first (its message says the engine failed or crashed while loading it);
- refused: another clean 4xx on import or start;
- loaded: started, but the chat was a clean 4xx (an `invalid_chat_template`, say);
- answered: the chat was a 200.

Beside the rows it counts what must stay 0: the server's deaths (it is started again
on the same HOME, and the mutant that killed it is printed), 5xx replies, stalls (a
request over --timeout seconds), and interruptions of the steady model's stream (a
stream that ended without [DONE], or a stream that could not be opened, while the
server lived). It exits 1 when any of those is not 0.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from emulators import ggufmutate  # noqa: E402
from emulators.ggufgen import write_gguf  # noqa: E402
from support.models import NO_EOS, quantize  # noqa: E402
from support.servers import LoggedServer  # noqa: E402

ROWS = ("header", "child", "refused", "loaded", "answered")
# Text that trips tokenizers: '|' (a byte token's piece), a non-ASCII byte, control
# tokens' texts, a long run of one character.
HOSTILE_TEXT = "a | b ÿ ü 中文 <|im_start|> <s> </s> <0x7C> " + "|" * 64


class Campaign:
    """One server, its steady stream, and the counts."""

    def __init__(self, folder: Path, timeout: float):
        self.folder, self.timeout = folder, timeout
        self.server = LoggedServer(folder)
        self.rows = collections.Counter()
        self.by_kind: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)
        self.deaths: list[str] = []
        self.fivexx: list[str] = []
        self.stalls: list[str] = []
        self.interruptions: list[str] = []
        self.streams = 0
        self._streaming = threading.Event()
        self._stream_thread = None
        self._lock = threading.Lock()

    def alive(self) -> bool:
        """Whether the server process still runs."""
        return self.server.alive()

    def send(self, method: str, path: str, body=None) -> tuple[int, dict]:
        """One request: (status, reply); status 0 when no reply came (the reply is
        then {"error": why})."""
        parts = urlsplit(self.server.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.timeout)
        try:
            data = None if body is None else json.dumps(body)
            conn.request(method, path, data,
                         {"Content-Type": "application/json"} if data else {})
            resp = conn.getresponse()
            raw = resp.read()
            try:
                reply = json.loads(raw) if raw else {}
            except ValueError:
                reply = {"raw": raw[:200].decode("utf-8", "replace")}
            return resp.status, reply
        except TimeoutError:
            return 0, {"error": "timeout"}
        except (OSError, http.client.HTTPException) as exc:
            return 0, {"error": repr(exc)}
        finally:
            conn.close()

    # --- the steady stream ---------------------------------------------------------

    def start_streaming(self) -> None:
        """Stream replies from the steady model, one after another, until stopped."""
        self._streaming.set()
        self._stream_thread = threading.Thread(target=self._stream_loop, daemon=True)
        self._stream_thread.start()

    def stop_streaming(self) -> None:
        """Stop after the stream in progress."""
        self._streaming.clear()
        if self._stream_thread is not None:
            self._stream_thread.join(timeout=self.timeout + 30)

    def _stream_loop(self) -> None:
        body = {"model": "steady", "stream": True, "max_tokens": 300,
                "messages": [{"role": "user", "content": "Tell a long story."}],
                "logit_bias": NO_EOS}
        while self._streaming.is_set():
            problem = self._one_stream(body)
            if problem and self._streaming.is_set():
                with self._lock:
                    # a stream the server's death cut is counted as a death, not here
                    time.sleep(0.2)
                    if self.alive():
                        self.interruptions.append(problem)

    def _one_stream(self, body: dict) -> str | None:
        """One streamed reply; None when it ended with [DONE], else what went wrong."""
        parts = urlsplit(self.server.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.timeout)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                return f"stream answered {resp.status}: {resp.read()[:300]!r}"
            for line in resp:
                if line.strip() == b"data: [DONE]":
                    self.streams += 1
                    return None
                if line.startswith(b"data: ") and b'"error"' in line:
                    return f"stream error event: {line[:300]!r}"
            return "stream ended without [DONE]"
        except (OSError, http.client.HTTPException) as exc:
            return f"stream failed: {exc!r}"
        finally:
            conn.close()

    # --- one mutant ----------------------------------------------------------------

    def try_mutant(self, n: int, mutant: ggufmutate.Mutant) -> str:
        """Import, start and chat with one mutant; its row."""
        path = self.folder / "mutants" / f"m{n}.gguf"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(mutant.data)
        model_id = f"m{n}"
        label = f"#{n} {mutant.base} {mutant.kind}: {mutant.what}"
        try:
            row = self._steps(model_id, path, label)
        finally:
            if self.alive():
                self.send("POST", f"/v1/models/{model_id}/stop")
                self.send("DELETE", f"/v1/models/{model_id}")
            path.unlink(missing_ok=True)
        self.rows[row] += 1
        self.by_kind[mutant.kind][row] += 1
        return row

    def _steps(self, model_id: str, path: Path, label: str) -> str:
        steps = [
            ("import", "POST", "/v1/models/import", {"path": str(path), "id": model_id}),
            ("start", "POST", f"/v1/models/{model_id}/start",
             {"cpu_threads": 1, "ctx_len": 512}),
            ("chat", "POST", "/v1/chat/completions",
             {"model": model_id, "max_tokens": 8,
              "messages": [{"role": "system", "content": HOSTILE_TEXT},
                           {"role": "user", "content": HOSTILE_TEXT}]}),
        ]
        for step, method, route, body in steps:
            status, reply = self.send(method, route, body)
            if status == 0:
                if not self.alive():
                    raise ServerDied(f"{label}: the server died at the {step}")
                self.stalls.append(f"{label}: {step} {reply.get('error')}")
                return "refused"
            if status >= 500:
                self.fivexx.append(f"{label}: {step} {status} {json.dumps(reply)[:300]}")
                return "refused"
            if status >= 400:
                code = (reply.get("error") or {}).get("code") \
                    if isinstance(reply.get("error"), dict) else None
                if code == "invalid_model_file":
                    return "child" if by_child(reply.get("message", "")) else "header"
                return "loaded" if step == "chat" else "refused"
        return "answered"


class ServerDied(Exception):
    """The server process ended while a mutant was tried."""


def by_child(message: str) -> bool:
    """Whether an invalid_model_file message is the child load's (it says the engine
    failed or crashed loading the file), not the header check's (it names a rule)."""
    return "cannot be loaded" in message  # localrt.engines.vetting.invalid_file


def write_bases(folder: Path) -> dict:
    """The three base models the mutants come from: {name: ggufmutate.Gguf}."""
    folder.mkdir(parents=True, exist_ok=True)
    f32 = write_gguf(folder / "spm-f32.gguf", name="spm", n_layer=2, context_length=1024)
    q8 = quantize(f32, folder / "spm-q8_0.gguf", "Q8_0")
    spm = ggufmutate.read(f32)
    return {"spm-f32": spm, "spm-q8_0": ggufmutate.read(q8),
            "bpe-f32": ggufmutate.bpe_model(spm)}


def run(files: int, seed: int, folder: Path, timeout: float, quiet: bool = False) -> dict:
    """The campaign; its counts."""
    bases = write_bases(folder / "bases")
    steady = write_gguf(folder / "bases" / "steady.gguf", name="steady", n_layer=2,
                        context_length=4096)
    camp = Campaign(folder, timeout)
    camp.server.start()
    status, reply = camp.send("POST", "/v1/models/import", {"path": str(steady), "id": "steady"})
    assert status == 200, reply
    status, reply = camp.send("POST", "/v1/models/steady/start", {"cpu_threads": 1})
    assert status == 200, reply
    started = time.monotonic()
    camp.start_streaming()
    try:
        for n, mutant in enumerate(ggufmutate.mutants(bases, files, seed)):
            try:
                row = camp.try_mutant(n, mutant)
            except ServerDied as exc:
                camp.deaths.append(f"{exc} ({tail(folder / 'server.log')})")
                row = "death"
                camp.by_kind[mutant.kind][row] += 1
                camp.stop_streaming()
                camp.server.start()
                camp.send("DELETE", f"/v1/models/m{n}")
                camp.send("POST", "/v1/models/steady/start", {"cpu_threads": 1})
                camp.start_streaming()
            if not quiet:
                print(f"{n:6d} {row:9s} {mutant.base} {mutant.kind}: {mutant.what[:90]}",
                      flush=True)
    finally:
        camp.stop_streaming()
        camp.server.close()
    elapsed = time.monotonic() - started
    return {"files": files, "seed": seed, "rows": dict(camp.rows),
            "by_kind": {k: dict(v) for k, v in camp.by_kind.items()},
            "deaths": camp.deaths, "fivexx": camp.fivexx, "stalls": camp.stalls,
            "interruptions": camp.interruptions, "streams": camp.streams,
            "seconds": round(elapsed, 1)}


def tail(log: Path, lines: int = 3) -> str:
    """The last lines of the server's log, for a death's report."""
    try:
        text = log.read_bytes()[-4000:].decode("utf-8", "replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def report(result: dict) -> str:
    """The campaign's table."""
    kinds = sorted(result["by_kind"])
    head = f"{'kind':14s}" + "".join(f"{r:>10s}" for r in ROWS + ("death",))
    out = [f"{result['files']} files, seed {result['seed']}, {result['seconds']} s; "
           f"{result['streams']} steady streams completed beside them", head]
    for kind in kinds:
        row = result["by_kind"][kind]
        out.append(f"{kind:14s}" + "".join(f"{row.get(r, 0):10d}" for r in ROWS + ("death",)))
    total = result["rows"]
    out.append(f"{'all':14s}" + "".join(f"{total.get(r, 0):10d}" for r in ROWS)
               + f"{len(result['deaths']):10d}")
    out.append(f"server deaths: {len(result['deaths'])} (target 0)")
    out.append(f"5xx replies: {len(result['fivexx'])} (target 0)")
    out.append(f"stalls over the timeout: {len(result['stalls'])} (target 0)")
    out.append(f"interrupted steady streams: {len(result['interruptions'])} (target 0)")
    for name in ("deaths", "fivexx", "stalls", "interruptions"):
        for line in result[name][:20]:
            out.append(f"  {name}: {line}")
    return "\n".join(out)


def failed(result: dict) -> bool:
    """Whether any count that must be 0 is not."""
    return any(result[k] for k in ("deaths", "fivexx", "stalls", "interruptions"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds a request may take before it counts as a stall")
    parser.add_argument("--keep", help="a folder to keep the campaign's files and log in")
    parser.add_argument("--quiet", action="store_true", help="print only the table")
    parser.add_argument("--json", help="also write the counts as JSON to this file")
    args = parser.parse_args(argv)
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="model-fuzz-"))
    try:
        result = run(args.files, args.seed, folder, args.timeout, args.quiet)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 1 if failed(result) else 0


if __name__ == "__main__":
    sys.exit(main())
