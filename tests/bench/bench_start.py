"""Start benchmark: what the child load of issue 38 costs a model's start.

Run it from the repository root (not collected by pytest; it has no test_ functions):

    .venv/bin/python tests/bench/bench_start.py [--reference 2b791c1] [--rounds 9]

Two servers, one from this checkout and one from `--reference` (a git revision
unpacked with `git archive`; 2b791c1 by default, the last commit before the child
load, the header check and the bounded templates), each `python -m localrt start
--foreground --port 0` in its own process with its own HOME, importing its own tree.
The model is bench_chat's (a random ~106 M-parameter llama, Q8_0, about 110 MB).

Three figures, each the median of --rounds, the sides taking turns (the order
flipping each round) so that drift on a shared machine hits both alike:

1. today: `POST /v1/models/{id}/start` on the reference, the model stopped before;
2. cached: the same on this tree, for a file a child has loaded before (its outcome
   is kept by sha256 and build, so no child runs): target within 5 % of today;
3. first: this tree's start of a file no child has seen (each round imports a copy
   that differs in its name, so its sha256 is new), the child's load included. On
   this tree a new file's import runs the child already; `first` is therefore
   measured as import plus start, against today's import plus start.

It prints metric, this tree, reference, ratio; and PASS or FAIL for the cached row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parents[1] / "tests"), str(HERE)]

import bench_chat  # noqa: E402
from bench_revision import start, unpack  # noqa: E402
from emulators import ggufmutate  # noqa: E402

DEFAULT_REFERENCE = "2b791c1"


def timed(port: int, method: str, path: str, body=None) -> float:
    """Seconds one request took; raises unless it answered 200."""
    began = time.perf_counter()
    status, reply = bench_chat.api(port, method, path, body)
    took = time.perf_counter() - began
    if status != 200:
        raise RuntimeError(f"{method} {path} answered {status}: {reply}")
    return took


def start_once(port: int, model_id: str, threads: int) -> float:
    """Seconds of one start of a stopped model (stopped again after)."""
    took = timed(port, "POST", f"/v1/models/{model_id}/start", {"cpu_threads": threads})
    timed(port, "POST", f"/v1/models/{model_id}/stop")
    return took


def renamed(model: ggufmutate.Gguf, name: str, folder: Path) -> Path:
    """A copy of the model whose general.name (so whose sha256) is new."""
    copy = model.copy()
    copy.set("general.name", 8, name.encode())
    path = folder / f"{name}.gguf"
    path.write_bytes(copy.write()[0])
    return path


def main() -> int:
    """Run the rounds and print the table; 1 when the cached row fails."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", default=DEFAULT_REFERENCE)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--target", type=float, default=1.05,
                        help="the most a cached start may take, as a ratio of today's")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-start-"))
    print(f"unpacking {args.reference} and writing the model...", flush=True)
    tree = HERE.parents[1]
    reference = unpack(args.reference, work / "reference")
    (work / "model").mkdir()
    weights = bench_chat.make_model(work / "model")
    base = ggufmutate.read(weights)
    servers = {}
    try:
        for side, root in (("this", tree), ("ref", reference)):
            proc, port = start(root, work / f"home-{side}")
            servers[side] = (proc, port)
            timed(port, "POST", "/v1/models/import", {"path": str(weights), "id": "m"})
            start_once(port, "m", args.threads)  # the first start: a child, on this tree
        figures = {k: [] for k in ("today", "cached", "first", "first_ref")}
        for r in range(args.rounds):
            order = ("this", "ref") if r % 2 == 0 else ("ref", "this")
            for side in order:
                port = servers[side][1]
                figures["cached" if side == "this" else "today"].append(
                    start_once(port, "m", args.threads))
                path = renamed(base, f"new-{side}-{r}", work)
                began = time.perf_counter()
                timed(port, "POST", "/v1/models/import", {"path": str(path), "id": path.stem})
                start_once(port, path.stem, args.threads)
                figures["first" if side == "this" else "first_ref"].append(
                    time.perf_counter() - began)
                timed(port, "DELETE", f"/v1/models/{path.stem}")
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    med = {k: statistics.median(v) * 1000 for k, v in figures.items()}
    print(f"{'metric':44s}{'this tree':>11s}{'reference':>11s}{'ratio':>8s}  result")
    cached = med["cached"] / med["today"]
    verdict = "PASS" if cached <= args.target else "FAIL"
    print(f"{'start, ms (a file a child loaded before)':44s}{med['cached']:11.1f}"
          f"{med['today']:11.1f}{cached:8.3f}  {verdict} (<= {args.target})")
    first = med["first"] / med["first_ref"]
    print(f"{'import + first start, ms (a new file)':44s}{med['first']:11.1f}"
          f"{med['first_ref']:11.1f}{first:8.3f}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
