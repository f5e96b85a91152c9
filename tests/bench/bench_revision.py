"""Revision benchmark: this checkout's localrt against an earlier revision of itself.

Run it from the repository root (not collected by pytest; it has no test_ functions):

    .venv/bin/python tests/bench/bench_revision.py [--reference fb993c4] [--rounds 5]

It answers "did this change cost the serving path anything?": the same model, the same
requests, two servers, one from this checkout and one from `--reference` (a git
revision, unpacked with `git archive` into a temporary folder; fb993c4 by default, the
last commit before the native vocabulary of issue 33). Each is
`python -m localrt start --foreground --port 0` in its own process with its own HOME,
importing its own tree. The model is bench_chat's (tests/bench/bench_chat.py: a random
~106 M-parameter llama, Q8_0), started in each with n_ctx 2048 and --threads threads
(1 by default: on a 2-core machine that also runs the client, ggml's second thread
spins between steps, and two-thread figures, wall clock and CPU alike, jump between
two levels from one stream to the next, the same tree's too); requests are greedy with
the end-of-generation tokens banned, so every stream gives exactly K tokens.

The sides take turns, --rounds times, the order flipping each round, so drift on a
shared machine hits both alike; each turn starts the model anew (`fresh`), so its
streams never depend on what the turn before left in the slots and the prompt cache;
each figure is the median of its rounds:

1. one stream: decode tok/s, (K - 1) / (last content chunk - first), of one streamed
   chat alone;
2. one stream's CPU: its K tokens over the CPU seconds the server process spent on the
   whole request (user and system, from /proc: its Python and llama.cpp's threads).
   What the serving path costs, far less moved by other processes than a wall clock
   on a shared machine (ticks of 10 ms: a K of 128 or more keeps that under 1 %);
3. four streams: aggregate tok/s of --clients streamed chats started together, all
   their tokens over the first request to the last stream's end.

It prints metric, this tree, reference, ratio, and PASS when a ratio is at least
--target (0.99: within 1 %), and exits 1 when a row FAILs. On a shared 2-core machine
the wall-clock rows move by several percent from run to run (a run of this tree
against itself, --reference HEAD, shows how much); the CPU row is the steady one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(Path(__file__).resolve().parent)]

import bench_chat  # noqa: E402  (this folder is on sys.path)

DEFAULT_REFERENCE = "fb993c4"


def unpack(revision: str, folder: Path) -> Path:
    """The tree of `revision`, unpacked into `folder` (git archive)."""
    folder.mkdir(parents=True, exist_ok=True)
    archive = folder / "tree.tar"
    subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), revision],
                   cwd=REPO, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder / "tree")
    archive.unlink()
    return folder / "tree"


def start(tree: Path, home: Path) -> tuple[subprocess.Popen, int]:
    """A server importing `tree`, with HOME at `home`: (process, port) once it answers."""
    from localrt import server, settings

    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HOME=str(home), PYTHONPATH=str(tree))
    env.pop("LOCALRT_CONFIG", None)
    proc = subprocess.Popen([sys.executable, "-m", "localrt", "start", "--foreground",
                             "--port", "0"], cwd=str(tree), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    s = settings.load(environ={"HOME": str(home)})
    return proc, server.wait_started(s, proc, timeout=60).port


def load(port: int, model: Path) -> None:
    """Import the bench model."""
    status, body = bench_chat.api(port, "POST", "/v1/models/import",
                                  {"path": str(model), "id": bench_chat.MODEL_ID})
    if status != 200:
        raise RuntimeError(f"import answered {status}: {body}")


def fresh(port: int, threads: int, bias: dict) -> None:
    """The model started anew (stopped first if it runs) and warmed up: every round's
    first stream finds the same state, its prompt cached in one slot and the other
    slots empty, whatever the round before left (which slot the last of four streams
    freed, what the prompt cache kept, which drafts were long)."""
    bench_chat.api(port, "POST", f"/v1/models/{bench_chat.MODEL_ID}/stop")
    bench_chat.start_model(port, threads)
    one(port, 8, bias)  # warm-up: the prompt is cached after it


def cpu_seconds(pid: int) -> float:
    """The CPU time a process has spent, user and system, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one(port: int, k: int, bias: dict, pid: int | None = None) -> tuple[float, float]:
    """(decode tok/s, tokens per server CPU second) of one stream alone."""
    before = cpu_seconds(pid) if pid else 0.0
    s = bench_chat.http_stream(port, k, bias)
    spent = cpu_seconds(pid) - before if pid else 0.0
    if s["tokens"] != k or not s["done"]:
        raise RuntimeError(f"a stream gave {s['tokens']} tokens of {k}")
    return s["decode"], (k / spent if spent else 0.0)


def together(port: int, k: int, bias: dict, clients: int) -> float:
    """Aggregate tok/s of `clients` streams started together."""
    results: list = [None] * clients

    def client(i: int) -> None:
        results[i] = bench_chat.http_stream(port, k, bias)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(r is None or r["tokens"] != k or not r["done"] for r in results):
        raise RuntimeError("a concurrent stream did not give all its tokens")
    return clients * k / (max(r["ended"] for r in results) - began)


def main() -> int:
    """Run the rounds and print the table; 1 when a row fails."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", default=DEFAULT_REFERENCE,
                        help="the git revision to compare with (default: %(default)s)")
    parser.add_argument("--tree", help="a git revision to measure instead of this checkout "
                                       "(to find which commit moved a figure)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128, help="K, tokens per stream")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1,
                        help="the model's cpu_threads (default 1: see the module)")
    parser.add_argument("--target", type=float, default=0.99)
    parser.add_argument("--no-speculative", action="store_true",
                        help="send \"speculative\": false: the drafts from the context, "
                             "which a random model's loops make long, move a stream's "
                             "speed with what the sequences before it left")
    args = parser.parse_args()
    if args.no_speculative:
        body = bench_chat.chat_body
        bench_chat.chat_body = lambda k, bias, stream: {**body(k, bias, stream),
                                                        "speculative": False}
    with tempfile.TemporaryDirectory(prefix="bench-revision-") as tmp:
        root = Path(tmp)
        print(f"unpacking {args.reference} and writing the model...", file=sys.stderr)
        trees = {"this tree": unpack(args.tree, root / "tree") if args.tree else REPO,
                 "reference": unpack(args.reference, root / "ref")}
        model = bench_chat.make_model(root)
        bias, _ = bench_chat.eog_bias(model)
        servers = {}
        try:
            for side, tree in trees.items():
                servers[side] = start(tree, root / f"home-{len(servers)}")
                load(servers[side][1], model)
            figures = {(side, row): [] for side in trees for row in ("one", "cpu", "four")}
            cpu = time.process_time()
            for r in range(args.rounds):
                order = list(trees) if r % 2 == 0 else list(reversed(trees))
                for side in order:
                    proc, port = servers[side]
                    fresh(port, args.threads, bias)
                    rate, per_cpu = one(port, args.tokens, bias, proc.pid)
                    figures[(side, "one")].append(rate)
                    figures[(side, "cpu")].append(per_cpu)
                    figures[(side, "four")].append(
                        together(port, args.tokens, bias, args.clients))
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
            print(f"(this process took {time.process_time() - cpu:.1f} s of CPU)",
                  file=sys.stderr)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=30)
    failed = False
    print(f"{'metric':<34} {'this tree':>10} {'reference':>10} {'ratio':>7}  result")
    for row, label in (("one", "one stream, decode tok/s"),
                       ("cpu", "one stream, tokens per CPU second"),
                       ("four", f"{args.clients} streams, aggregate tok/s")):
        ours = statistics.median(figures[("this tree", row)])
        theirs = statistics.median(figures[("reference", row)])
        ratio = ours / theirs
        ok = ratio >= args.target
        failed |= not ok
        print(f"{label:<34} {ours:>10.1f} {theirs:>10.1f} {ratio:>7.3f}  "
              f"{'PASS' if ok else 'FAIL'} (>= {args.target})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
