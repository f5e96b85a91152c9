"""The GPU check's driver (tests/device/check_gpu.sh runs it; issue 35, item 7).

On a machine with an NVIDIA GPU and no network: installs gguf-cpp's CUDA variant
through localrt's API from a local package index (the llama-cpp-python sdist and its
build wheels from tests/.rpc-build/sources, the CUDA toolkit from
tests/.cuda-build/toolkit: `python3 -m localrt.bootstrap --test` downloads both),
which compiles it for this GPU; meanwhile builds llama-server from the same sdist's
llama.cpp (its CPU half; at run time it loads the variant's own libllama and
libggml-cuda, so both sides run the same CUDA kernels); generates two models (no
network, so no real weights: a tiny one, and one with Llama 3.2 1B's layers and a 32k
vocabulary, random weights, Q8_0); starts each with ngl unset (fit) and prints its
layers and bytes on the GPU, `localrt ps`, and the decode rate of a greedy 256-token
reply on the CUDA variant, on the CPU build localrt ships, and on llama-server (all
layers on the GPU). Each step prints a line; the last line is one summary,
"CHECK_GPU OK ..." or "CHECK_GPU FAIL <step>: <why>".

CHECK_GPU_REHEARSAL=1 runs the same steps on a machine without a GPU, to check the
script itself: the +rpc CPU variant from tests/.rpc-build/built instead of the CUDA one,
a smaller second model, and llama-server from CHECK_GPU_LLAMA_SERVER when given.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from emulators.ggufgen import EOS_ID, write_gguf  # noqa: E402
from emulators.pkgindex import PackageIndex  # noqa: E402
from support.servers import LoggedServer, subprocess_env  # noqa: E402

from localrt.engines import cuda, gpus  # noqa: E402
from localrt.engines.hardware import detect_hardware  # noqa: E402

SOURCES = REPO / "tests" / ".rpc-build" / "sources"
TOOLKIT = REPO / "tests" / ".cuda-build" / "toolkit"
LIMIT = float(os.environ.get("CHECK_GPU_LIMIT", "560"))  # seconds for all of it
CTX = 4096
REPLY = 256
BIG = dict(vocab_size=32000, n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192,
           context_length=CTX)  # Llama 3.2 1B's layers, a Llama 2-sized vocabulary
REHEARSAL = os.environ.get("CHECK_GPU_REHEARSAL") == "1"
if REHEARSAL:  # two cores: a model that decodes in seconds
    BIG = dict(BIG, n_embd=512, n_layer=4, n_head=8, n_head_kv=4, n_ff=1024)
BUILT_RPC = REPO / "tests" / ".rpc-build" / "built"  # <key>/<wheel> (tests/support/variants.py)
STARTED = time.monotonic()
step_name = "start"


def say(text: str) -> None:
    print(f"[{time.monotonic() - STARTED:5.0f}s] {text}", flush=True)


def step(name: str) -> None:
    global step_name
    step_name = name
    say(f"== {name}")


def left() -> float:
    """Seconds left of LIMIT (at least 1)."""
    return max(LIMIT - (time.monotonic() - STARTED), 1.0)


def request(port: int, method: str, path: str, body=None, timeout: float = 60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, None if body is None else json.dumps(body),
                     {"Content-Type": "application/json"})
        reply = conn.getresponse()
        data = reply.read()
        return reply.status, json.loads(data) if data else None
    finally:
        conn.close()


class Localrt(LoggedServer):
    """`localrt start --foreground --port 0` on `folder`/home, its log in
    `folder`/server.log (tests/support/servers.py), with the API calls and the
    `localrt ps` this check makes."""

    def api(self, method: str, path: str, body=None, timeout: float = 120):
        return request(self.port, method, path, body, timeout)

    def ps(self) -> str:
        out = subprocess.run([sys.executable, "-m", "localrt", "ps"],
                             env=subprocess_env(self.home), capture_output=True, text=True,
                             timeout=60)
        return out.stdout + out.stderr


def decode_rate(port: int, path: str, body: dict) -> float:
    """Tokens a second after the first of a streamed greedy reply of REPLY tokens
    (OpenAI's or llama-server's SSE)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", path, json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    reply = conn.getresponse()
    if reply.status != 200:
        raise RuntimeError(f"{path}: {reply.status} {reply.read()[:300]!r}")
    times = []
    for raw in reply:
        line = raw.strip()
        if line.startswith(b"data:") and line != b"data: [DONE]":
            chunk = json.loads(line[5:])
            text = chunk.get("content") if "content" in chunk else \
                (chunk.get("choices") or [{}])[0].get("text")
            if text:
                times.append(time.monotonic())
    conn.close()
    if len(times) < 16:
        raise RuntimeError(f"{path}: only {len(times)} pieces came")
    # REPLY tokens came (no end token: it is biased out, or ignored), some chunks
    # holding several (speculative decoding's accepted drafts)
    return (REPLY - 1) / (times[-1] - times[0])


def localrt_rate(srv: Localrt) -> float:
    """The decode rate of a greedy REPLY-token completion, after a short one that warms
    the model up (a first request reads the vocabulary's pieces)."""
    srv.api("POST", "/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 8},
            timeout=300)
    return decode_rate(srv.port, "/v1/completions", {
        "model": "m", "prompt": "Once upon a time", "max_tokens": REPLY, "temperature": 0,
        "logit_bias": {str(EOS_ID): -100}})


def build_llama_server(sdist: Path, work: Path) -> subprocess.Popen:
    """Start compiling llama-server from the sdist's llama.cpp (ggml's CPU half, shared
    libraries, no RPATH: LD_LIBRARY_PATH picks the variant's CUDA libraries at run time)."""
    with tarfile.open(sdist) as tar:
        tar.extractall(work / "src", filter="data")
    source = next((work / "src").glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
    build = work / "llama-server"
    jobs = str(max((os.cpu_count() or 2) // 2, 1))  # the other half compiles the variant
    env = dict(os.environ)
    if shutil.which("cmake") is None or shutil.which("ninja") is None:
        # the build wheels the index serves localrt's build, installed for this one
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                        "--find-links", str(SOURCES), "--target", str(work / "tools"),
                        "cmake", "ninja"], check=True, timeout=300)
        env["PATH"] = f"{work / 'tools' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = str(work / "tools")
    script = (f"cmake -S '{source}' -B '{build}' -G Ninja -DCMAKE_BUILD_TYPE=Release "
              f"-DBUILD_SHARED_LIBS=ON -DCMAKE_SKIP_RPATH=ON -DLLAMA_CURL=OFF "
              f"-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
              f"-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF "
              f"&& cmake --build '{build}' --target llama-server -j {jobs}")
    return subprocess.Popen(["nice", "-n", "5", "bash", "-c", script], env=env,
                            stdout=open(work / "llama-server-build.log", "wb"),
                            stderr=subprocess.STDOUT)


def llama_server_rate(binary: Path, libs: Path, model: Path, work: Path) -> tuple[float, str]:
    """llama-server's decode rate with every layer on the GPU, and its offload line."""
    from support.servers import free_port

    port, log = free_port(), work / f"llama-server-{model.stem}.log"
    # the variant's libllama and libggml (CUDA) first; the build's own others after
    env = dict(os.environ, LD_LIBRARY_PATH=f"{libs}{os.pathsep}{binary.parent}")
    proc = subprocess.Popen([str(binary), "-m", str(model), "--host", "127.0.0.1",
                             "--port", str(port), "-c", str(CTX), "-np", "1", "-ngl", "999",
                             "--no-webui"], env=env, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + min(120, left())
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {log.read_text()[-800:]}")
            try:
                if request(port, "GET", "/health", timeout=2)[0] == 200:
                    break
            except (OSError, ValueError, http.client.HTTPException):
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("llama-server did not start")
        request(port, "POST", "/completion", {"prompt": "Hi", "n_predict": 8}, timeout=300)
        rate = decode_rate(port, "/completion", {"prompt": "Once upon a time",
                                                 "n_predict": REPLY, "temperature": 0,
                                                 "ignore_eos": True})
        said = [line for line in log.read_text().splitlines()
                if "offloaded" in line or "CUDA0 model buffer" in line]
        return rate, "; ".join(s.split(": ", 1)[-1] for s in said)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="check-gpu-"))
    summary = {}
    servers = []
    stack = contextlib.ExitStack()
    try:
        step("1/7 the GPU (NVML) and its driver")
        found = [g for g in gpus.detect() if g["backend"] == "cuda"]
        hw = detect_hardware()
        if REHEARSAL:
            variant = f"{hw.platform}-{hw.cpu_level()}+rpc"
            found = [{"id": "-", "name": "rehearsal", "computeCap": "-", "free": 0,
                      "total": 0, "driver": "-", "version": "-"}]
            hw = type("Rehearsal", (), {"cuda": "13.0", "platform": hw.platform})()
        elif not found or hw.cuda is None:
            raise RuntimeError("no NVIDIA GPU or driver (NVML lists none, or libcuda gives "
                               "no CUDA version)")
        for g in found:
            say(f"   GPU {g['id']}: {g['name']}, compute {g['computeCap']}, "
                f"{g['free'] >> 20} of {g['total'] >> 20} MiB free, driver {g['driver']}, "
                f"CUDA {g['version']}")
        major = hw.cuda.split(".")[0]
        if not REHEARSAL:
            variant = f"{hw.platform}-cuda-{major}"
        summary["gpu"] = found[0]["name"].replace(" ", "_")
        summary["driver"] = f"{found[0]['driver']}/CUDA{hw.cuda}"
        if not cuda.TOOLKITS.get(major):
            raise RuntimeError(f"the driver supports CUDA {hw.cuda}: localrt compiles only "
                               f"the cuda-13 variant (the index has no CUDA {major} nvcc), "
                               f"which needs a driver for CUDA 13 (580 or newer)")

        step("2/7 a local package index: the sdist, its build wheels, the CUDA toolkit")
        sdists = sorted(SOURCES.glob("llama_cpp_python-*.tar.gz"))
        wheels = sorted(TOOLKIT.glob("*.whl"))
        if not sdists or not any(w.name.startswith("nvidia_cuda_nvcc-") for w in wheels):
            raise RuntimeError(f"{SOURCES} needs the llama-cpp-python sdist and {TOOLKIT} "
                               f"the CUDA toolkit's wheels (python3 -m localrt.bootstrap "
                               f"--test downloads both; carry them to this machine)")
        index_dir = work / "index"
        index_dir.mkdir()
        rehearsed = list(BUILT_RPC.rglob("*.whl")) if REHEARSAL else []
        for source in [*SOURCES.iterdir(), *wheels, *rehearsed]:
            (index_dir / source.name).symlink_to(source.resolve())
        index = stack.enter_context(PackageIndex(index_dir))
        say(f"   {index.url}: {len(list(index_dir.iterdir()))} files")

        step("3/7 install gguf-cpp " + variant + " through the API (compiles it)")
        given = os.environ.get("CHECK_GPU_LLAMA_SERVER")
        server_build = subprocess.Popen(["true"]) if given else \
            build_llama_server(sdists[-1], work)
        # kept between runs: a rerun installs the wheel built before in seconds
        srv = Localrt(Path(os.environ.get("CHECK_GPU_HOME", REPO / "tests" / ".cuda-build"
                                          / "check-home")))
        servers.append(srv)
        srv.start({"engineIndexUrl": index.url})
        code, reply = srv.api("POST", "/v1/engines/gguf-cpp/install", {"variant": variant})
        if code != 200:
            raise RuntimeError(f"install: {code} {reply}")
        task_id, built_at, shown = reply["task"]["id"], time.monotonic(), 0.0
        say(f"   {reply.get('note', '')}")
        step("4/7 two generated models (no network: random weights), while it builds")
        tiny = write_gguf(work / "tiny.gguf", name="tiny", n_embd=256, n_ff=512, n_layer=4,
                          context_length=CTX)
        source = write_gguf(work / "big-f16.gguf", name="big", file_type="F16", **BIG)
        from support.models import quantize

        big = quantize(source, work / "big-Q8_0.gguf", "Q8_0")
        source.unlink()
        say(f"   tiny {tiny.stat().st_size >> 20} MiB; 1B-shaped {big.stat().st_size >> 20} MiB")
        step("3/7 (continued) the install")
        while True:
            tasks = {t["id"]: t for t in srv.api("GET", "/v1/models/pull")[1]["data"]}
            task = tasks[task_id]
            if task["status"] not in ("Pending", "Downloading"):
                break
            if time.monotonic() - shown >= 30:
                shown = time.monotonic()
                say(f"   {task.get('build') or task['status']}")
            if left() < 200:  # the models and the rates need about that
                raise RuntimeError(f"the build did not end in time: {task.get('build')}")
            time.sleep(2)
        if task["status"] != "Success":
            raise RuntimeError(f"the install ended {task['status']}: {task.get('error')}")
        summary["build_s"] = round(time.monotonic() - built_at)
        say(f"   installed in {summary['build_s']} s")
        srv.stop()  # and again: the variant installed is the one it starts with
        srv.start()
        engine = srv.api("GET", "/v1/engines/gguf-cpp")[1]
        say(f"   variants: {json.dumps(engine)[:300]}")


        cpu_srv = Localrt(work / "cpu")
        servers.append(cpu_srv)
        cpu_srv.start()
        server_build.wait(timeout=left())
        binary = Path(given) if given else work / "llama-server" / "bin" / "llama-server"
        libs = next(p for p in (srv.home / "localrt" / "engines" / "gguf-cpp").rglob("lib")
                    if p.parent.name == "llama_cpp")
        for name, model in (("tiny", tiny), ("1B", big)):
            step(f"5/7 {name}: localrt on {variant}, ngl unset (fit)")
            for s in (srv, cpu_srv):
                s.api("DELETE", "/v1/models/m")  # a failed run's, in the kept home
                code, reply = s.api("POST", "/v1/models/import",
                                    {"path": str(model), "id": "m", "option": "symlink"})
                if code != 200:
                    raise RuntimeError(f"import: {code} {reply}")
            code, reply = srv.api("POST", "/v1/models/m/start",
                                  {"ctx_len": CTX, "n_parallel": 1}, timeout=300)
            if code != 200:
                raise RuntimeError(f"start: {code} {reply}")
            row = {r["id"]: r for r in srv.api("GET", "/v1/models/status")[1]["data"]}["m"]
            offload = row.get("offload") or {}
            say(f"   offload {json.dumps(offload)}; ram {row['ram'] >> 20} MiB, "
                f"vram {row['vram'] >> 20} MiB")
            for line in srv.ps().splitlines():
                say(f"   ps| {line}")
            gpu_rate = localrt_rate(srv)
            srv.api("POST", "/v1/models/m/stop")
            step(f"6/7 {name}: the CPU build, and llama-server on the GPU")
            code, reply = cpu_srv.api("POST", "/v1/models/m/start",
                                      {"ctx_len": CTX, "n_parallel": 1,
                                       "cpu_threads": os.cpu_count() or 1}, timeout=300)
            if code != 200:
                raise RuntimeError(f"CPU start: {code} {reply}")
            cpu_rate = localrt_rate(cpu_srv)
            cpu_srv.api("POST", "/v1/models/m/stop")
            if server_build.returncode != 0 or not binary.exists():
                raise RuntimeError(f"llama-server did not build: "
                                   f"{(work / 'llama-server-build.log').read_text()[-800:]}")
            ls_rate, ls_said = llama_server_rate(binary, libs, model, work)
            say(f"   llama-server: {ls_said}")
            say(f"   {name}: localrt {variant} {gpu_rate:.0f} tok/s, CPU build "
                f"{cpu_rate:.1f} tok/s, llama-server (CUDA) {ls_rate:.0f} tok/s")
            summary[name] = (f"{gpu_rate:.0f}/{cpu_rate:.1f}/{ls_rate:.0f}tok/s "
                             f"layers={offload.get('layers')}/{offload.get('of')} "
                             f"vram={row['vram'] >> 20}MiB")
            for s in (srv, cpu_srv):
                s.api("DELETE", "/v1/models/m")
        step("7/7 done")
        print("CHECK_GPU OK " + " ".join(f"{k}={v}" for k, v in summary.items())
              + " (rates: localrt-cuda/cpu-build/llama-server)", flush=True)
        return 0
    except Exception as exc:  # every failure ends in the one summary line
        traceback.print_exc(file=sys.stdout)
        print(f"CHECK_GPU FAIL {step_name}: {exc} "
              + " ".join(f"{k}={v}" for k, v in summary.items()), flush=True)
        return 1
    finally:
        for s in servers:
            s.close()
        stack.close()
        if os.environ.get("CHECK_GPU_KEEP") != "1":
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
