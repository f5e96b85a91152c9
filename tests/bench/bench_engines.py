"""gguf-cpp build benchmark: prompt and decode tokens/s of the shipped llama.cpp build
against a reference build, on the same F16 model in the same run.

Run it from the repository root (not collected by pytest; it has no test_ functions):

    .venv/bin/python tests/bench/bench_engines.py --reference DIR [--threads 2]

DIR is a folder holding another llama_cpp package, for example the default build
unpacked from its wheel (`pip wheel --no-cache-dir --no-deps llama-cpp-python` with no
CFLAGS, then `python -m zipfile -e WHEEL DIR`). The shipped build is the llama_cpp this
Python imports. F16 is used because both builds run it: the default build crashes on
quantized models on CPUs with AMX (see README.rst), which the probe rows show.

Each build runs in its own child process (so a crash is reported, not fatal):
the model (tests/emulators/ggufgen.py: llama, n_embd 1024, 4 layers, about 100 MB in F16) gets
a 256-token prompt, then 64 greedy decode steps; the figures are llama.cpp's own
timings (llama_perf_context), best of 3. Ratio = shipped / reference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

CHILD = r"""
import json, sys
if sys.argv[1]:
    sys.path.insert(0, sys.argv[1])
import llama_cpp
model, threads = sys.argv[2], int(sys.argv[3])
llm = llama_cpp.Llama(model, n_ctx=512, n_batch=512, n_threads=threads, verbose=False)
best = {"prompt": 0.0, "decode": 0.0}
for _ in range(3):
    llm.reset()
    llama_cpp.llama_perf_context_reset(llm.ctx)
    prompt = [1] + [300 + (i * 7) % 20 for i in range(255)]
    llm.eval(prompt)
    for _ in range(64):
        llm.eval([int(llm.sample(temp=0.0))])
    perf = llama_cpp.llama_perf_context(llm.ctx)
    best["prompt"] = max(best["prompt"], perf.n_p_eval / (perf.t_p_eval_ms / 1000))
    best["decode"] = max(best["decode"], perf.n_eval / (perf.t_eval_ms / 1000))
print(json.dumps({"version": llama_cpp.__version__, **best}))
"""


def measure(engine_dir: str, model: Path, threads: int) -> dict:
    """Tokens/s of one build, in a child process; {"error": ...} if it fails."""
    proc = subprocess.run([sys.executable, "-c", CHILD, engine_dir, str(model), str(threads)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-200:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    from emulators.ggufgen import write_gguf

    from localrt.engines.hardware import detect_hardware
    from localrt.engines.probe import run_probe

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", required=True, help="folder holding a llama_cpp "
                        "package (the default build)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    hw = detect_hardware()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_gguf(Path(tmp) / "bench-f16.gguf", n_embd=1024, n_layer=4, n_head=8,
                           n_ff=2816, vocab_size=1024, context_length=1024, file_type="F16")
        shipped, reference = measure("", model, args.threads), \
            measure(args.reference, model, args.threads)
    probe_shipped = run_probe(None, hw)
    probe_reference = run_probe(args.reference, hw)
    print(f"{'metric':32} {'shipped':>12} {'reference':>12} {'ratio':>7}")
    for key in ("prompt", "decode"):
        if "error" in shipped or "error" in reference:
            print(f"{key + ' tokens/s (F16)':32} {shipped.get(key, shipped.get('error'))!s:>12}"
                  f" {reference.get(key, reference.get('error'))!s:>12}")
            continue
        print(f"{key + ' tokens/s (F16)':32} {shipped[key]:12.1f} {reference[key]:12.1f} "
              f"{shipped[key] / reference[key]:7.2f}")
    for label, probe in (("probe, shipped", probe_shipped), ("probe, reference", probe_reference)):
        print(f"{label:32} {probe.get('reason') or 'quantized Q8_0 and Q4_0 decode'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
