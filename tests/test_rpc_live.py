"""llama.cpp RPC for real: the gguf-cpp +rpc variant compiled from llama-cpp-python's
sdist by localrt's own install task, two ggml-rpc-server processes built from the
llama.cpp that sdist vendors, and one model split across them.

What the tests' package index serves comes from tests/.rpc-build/sources, which
`python3 -m localrt.bootstrap --test` fills (the sdist, localrt.bootstrap.RPC_SDIST,
and the wheels its build needs). The session's install compiles the sdist once (some
minutes) and keeps the wheel in tests/.rpc-build/built under the key of its sdist and
flags (tests/support/variants.py), so later sessions install it from the index
instead. rpc-server is compiled against the installed variant's own libraries
(rpc-server.cpp needs only ggml's headers: a few seconds).

Where no compiler exists, point LOCALRT_TEST_RPC_WHEEL at a llama-cpp-python wheel built
with -DGGML_RPC=ON and LOCALRT_TEST_RPC_SERVER at an rpc-server (ggml-rpc-server) built
from the same llama.cpp. Without any of these the tests are skipped, except under CI.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from emulators.ggufgen import write_gguf
from emulators.pkgindex import PackageIndex
from support import REPO
from support.apps import call
from support.servers import free_port, run_foreground_server, send
from support.tasks import wait_task
from support import variants
from support.variants import labelled, newest_sdist, sdist_version

from localrt import settings as settings_mod
from localrt.app import create_app
from localrt.bootstrap import AMX_OFF
from localrt.engines.hardware import detect_hardware

pytestmark = [pytest.mark.live, pytest.mark.slow]

RPC_DIR = REPO / "tests" / ".rpc-build"
SOURCES, BUILT = RPC_DIR / "sources", RPC_DIR / "built"
BUILD_TIMEOUT = 40 * 60  # seconds; a compile takes 5 to 15 minutes on two cores
USER = [{"role": "user", "content": "hello"}]


def unavailable(why: str):
    if os.environ.get("CI"):
        raise RuntimeError(f"CI must run the RPC tests: {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def rpc_engine(tmp_path_factory):
    """A localrt home whose active gguf-cpp variant is the +rpc one, installed through
    the API from the tests' package index: compiled from the sdist, unless a wheel built
    before (or LOCALRT_TEST_RPC_WHEEL) is there."""
    sdist = newest_sdist()
    prebuilt = os.environ.get("LOCALRT_TEST_RPC_WHEEL")
    if sdist is None:
        unavailable(f"{SOURCES} has no llama-cpp-python sdist; run python3 -m "
                    f"localrt.bootstrap --test, or pip download --no-deps "
                    f"--no-binary=:all: -d {SOURCES} llama-cpp-python==0.3.36 and pip "
                    f"download --only-binary=:all: -d {SOURCES} scikit-build-core cmake "
                    f"ninja")
    version = sdist_version(sdist)
    level = detect_hardware().cpu_level()
    if level is None:
        unavailable("this CPU has none of the levels the gguf-cpp variants are built for")
    variant, local = f"{detect_hardware().platform}-{level}+rpc", f"{level}.rpc"
    wheel_key = variants.key(variants.variant(detect_hardware(), variant), sdist)
    index_dir = tmp_path_factory.mktemp("rpc-index")
    for source in SOURCES.iterdir():
        (index_dir / source.name).symlink_to(source)
    cached = prebuilt or variants.kept_wheel(BUILT, wheel_key, version, local)
    if cached:
        (index_dir / labelled(Path(cached).name, version, local)).symlink_to(cached)
    elif shutil.which("c++") is None:
        unavailable("no C++ compiler to build the +rpc variant; see the module docstring")

    home = tmp_path_factory.mktemp("rpc-home")
    done = variants.install_variant(variant, version, index_dir, home, BUILD_TIMEOUT,
                                    variants.scratch_caches(tmp_path_factory))
    built = [done.built] if done.built else []
    if built and not cached:  # keep it: later sessions install it from the index
        assert built[0].parent.name == wheel_key  # the key is localrt's own
        variants.keep_wheel(BUILT, wheel_key, built[0], labelled(built[0].name, version, local),
                            local)
    return SimpleNamespace(home=home, settings=done.settings, variant=variant, version=version,
                           sdist=sdist, reply=done.reply, task=done.task,
                           snapshots=done.snapshots, compiled=not cached, rows=done.rows,
                           folder=done.folder, built=built, seconds=done.seconds,
                           index_dir=index_dir)


@pytest.fixture(scope="session")
def rpc_server_binary(rpc_engine, tmp_path_factory):
    """ggml-rpc-server: LOCALRT_TEST_RPC_SERVER, or compiled from the sdist's
    tools/rpc/rpc-server.cpp against the installed variant's ggml."""
    given = os.environ.get("LOCALRT_TEST_RPC_SERVER")
    if given:
        return Path(given)
    if shutil.which("c++") is None:
        unavailable("no C++ compiler to build rpc-server; set LOCALRT_TEST_RPC_SERVER")
    root = tmp_path_factory.mktemp("rpc-server")
    top = f"llama_cpp_python-{rpc_engine.version}/vendor/llama.cpp/"
    wanted = (top + "tools/rpc/rpc-server.cpp", top + "ggml/include/")
    with tarfile.open(rpc_engine.sdist) as tar:
        tar.extractall(root, members=[m for m in tar.getmembers()
                                      if m.name.startswith(wanted)], filter="data")
    lib = rpc_engine.folder / "llama_cpp" / "lib"
    binary = root / "ggml-rpc-server"
    subprocess.run(["c++", "-std=c++17", "-O2", *AMX_OFF, f"-I{root / top / 'ggml/include'}",
                    str(root / top / "tools/rpc/rpc-server.cpp"), "-o", str(binary),
                    f"-L{lib}", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}", "-pthread"],
                   check=True, capture_output=True)
    return binary


@pytest.fixture
def rpc_servers(rpc_server_binary, tmp_path):
    """Two rpc-servers on loopback ports; stopped (by pid) after the test."""
    servers = []
    try:
        for i in range(2):
            port = free_port()
            log = open(tmp_path / f"rpc-server-{i}.log", "wb")
            proc = subprocess.Popen([str(rpc_server_binary), "-H", "127.0.0.1", "-p",
                                     str(port)], stdout=log, stderr=subprocess.STDOUT)
            servers.append(SimpleNamespace(proc=proc, port=port, log=log,
                                           endpoint=f"127.0.0.1:{port}"))
        for server in servers:
            wait_listening(server.port, server.proc)
        yield servers
    finally:
        for server in servers:
            server.proc.send_signal(signal.SIGTERM)
            try:
                server.proc.wait(10)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait()
            server.log.close()


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """Until the port takes connections. A bare connect that sends nothing is harmless:
    rpc-server reads end of file and serves its next client."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "rpc-server exited"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"rpc-server on {port} never listened")


def rss(pid: int) -> int:
    """A process's resident memory in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="session")
def split_model(tmp_path_factory):
    """A random 4-layer llama of ~50 MB (F32): each server's share shows in its memory."""
    root = tmp_path_factory.mktemp("rpc-model")
    return write_gguf(root / "split.gguf", name="split", n_embd=512, n_layer=4, n_ff=1376,
                      context_length=512)


@pytest.fixture
def served(rpc_engine, split_model):
    """localrt on the +rpc variant, as a child process, with the model imported."""
    srv = run_foreground_server(rpc_engine.home)
    try:
        model_id = f"split-{time.monotonic_ns()}"
        code, body = send(srv.url, "POST", "/v1/models/import",
                          {"path": str(split_model), "id": model_id, "option": "symlink"})
        assert code == 200, body
        yield SimpleNamespace(url=srv.url, model=model_id, srv=srv)
    finally:
        srv.stop()


def chat(url: str, model: str) -> tuple[int, dict]:
    return send(url, "POST", "/v1/chat/completions",
                {"model": model, "messages": USER, "max_tokens": 12, "temperature": 0},
                timeout=120)


# --- the build ----------------------------------------------------------------------


def test_the_rpc_variant_is_compiled_from_the_sdist_with_progress(rpc_engine):
    if not rpc_engine.compiled:
        pytest.skip("a wheel built before was installed; delete tests/.rpc-build/built "
                    "to compile again")
    reply = rpc_engine.reply
    assert reply["message"] == "Engine gguf-cpp starts installing"
    assert "localrt compiles llama_cpp_python-" in reply["note"]
    # The task downloaded the sdist (sha256 checked), and the build's progress moved.
    item, = [i for i in rpc_engine.task["items"] if i["id"].endswith(".tar.gz")]
    assert item["downloadedBytes"] == item["bytes"] == rpc_engine.sdist.stat().st_size
    stages = [s["stage"] for s in rpc_engine.snapshots]
    assert "compile" in stages and stages[-1] == "done", stages
    steps = [s["step"] for s in rpc_engine.snapshots if s["stage"] == "compile"]
    assert len(steps) >= 3 and steps == sorted(steps) and steps[-1] > steps[0]
    total = {s["steps"] for s in rpc_engine.snapshots if s["stage"] == "compile" and s["steps"]}
    assert len(total) == 1 and total.pop() >= 50
    assert rpc_engine.built and rpc_engine.built[0].name.endswith(".whl")
    print(f"compiled in {rpc_engine.seconds:.0f} s, {steps[-1]} ninja steps")


def test_the_installed_variant_has_the_rpc_backend_and_is_active(rpc_engine):
    rows = {row["name"]: row for row in rpc_engine.rows}
    row = rows[rpc_engine.variant]
    assert (row["status"], row["version"]) == ("Ready", f"v{rpc_engine.version}")
    assert (rpc_engine.folder / "llama_cpp" / "lib" / "libggml-rpc.so").exists()
    proc = subprocess.run(
        [sys.executable, "-c",
         "import sys; sys.path.insert(0, sys.argv[1]); import llama_cpp; "
         "print(llama_cpp.__file__, llama_cpp.llama_supports_rpc())", str(rpc_engine.folder)],
        capture_output=True, text=True, check=True)
    where, supports = proc.stdout.split()
    assert Path(where).is_relative_to(rpc_engine.folder) and supports == "True"


def test_installing_it_again_after_an_uninstall_takes_the_wheel_built_before(rpc_engine):
    if not rpc_engine.compiled:
        pytest.skip("no build in this session")
    settings = settings_mod.load(environ={"HOME": str(rpc_engine.home)})
    with PackageIndex(rpc_engine.index_dir) as index:
        settings.update({"engineIndexUrl": index.url})
        app = create_app(settings)
        try:
            api = lambda *a, **k: call(app, *a, **k)  # noqa: E731
            body = {"variant": rpc_engine.variant, "version": rpc_engine.version}
            assert api("DELETE", "/v1/engines/gguf-cpp/install", body).status == 200
            started = time.monotonic()
            r = api("POST", "/v1/engines/gguf-cpp/install", body)
            assert r.status == 200 and "built here before" in r.json["note"], r.body
            task = wait_task(api, r.json["task"]["id"], timeout=120)
            assert task["status"] == "Success" and "build" not in task, task
            assert time.monotonic() - started < 120
            assert not any(i["id"].endswith(".tar.gz") for i in task["items"])
        finally:
            app.close()


def test_a_cancelled_build_stops_its_compilers(tmp_path):
    sdist = newest_sdist()
    if sdist is None or shutil.which("c++") is None:
        unavailable("no sdist or no compiler (see the module docstring)")
    level = detect_hardware().cpu_level()
    home = tmp_path / "home"
    home.mkdir()
    settings = settings_mod.load(environ={"HOME": str(home)})
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    for source in SOURCES.iterdir():
        (index_dir / source.name).symlink_to(source)
    with PackageIndex(index_dir) as index:
        settings.update({"engineIndexUrl": index.url})
        app = create_app(settings)
        try:
            api = lambda *a, **k: call(app, *a, **k)  # noqa: E731
            variant = f"{detect_hardware().platform}-{level}+rpc"
            r = api("POST", "/v1/engines/gguf-cpp/install",
                    {"variant": variant, "version": sdist_version(sdist)})
            task_id = r.json["task"]["id"]
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                task = {t["id"]: t for t in api("GET", "/v1/models/pull").json["data"]}[task_id]
                if (task.get("build") or {}).get("stage") == "compile":
                    break
                assert task["status"] in ("Pending", "Downloading"), task
                time.sleep(0.2)
            else:
                raise AssertionError("the build never reached its compile stage")
            assert api("DELETE", "/v1/models/pull", {"taskId": task_id}).status == 200
            task = wait_task(api, task_id, timeout=60)
            assert task["status"] == "Stopped", task
            time.sleep(1)
            leftover = subprocess.run(["pgrep", "-f", str(settings.data_dir / "engines")],
                                      capture_output=True, text=True).stdout.split()
            assert leftover == []
            engines = settings.data_dir / "engines"
            assert not list((engines / ".builds").rglob("*.whl"))
            assert not list((engines / ".builds").rglob(".*.partial"))
            assert not (engines / "gguf-cpp" / variant).exists()
        finally:
            app.close()


# --- one model across two rpc-servers ---------------------------------------------


def test_a_model_split_across_two_rpc_servers_answers_as_it_does_alone(served,
                                                                        rpc_servers):
    url, model = served.url, served.model
    # Alone, on this machine's CPU, with the same build.
    code, body = send(url, "POST", f"/v1/models/{model}/start", {"ctx_len": 256})
    assert code == 200, body
    code, alone = chat(url, model)
    assert code == 200, alone
    assert send(url, "POST", f"/v1/models/{model}/stop")[0] == 200

    before = [rss(s.proc.pid) for s in rpc_servers]
    endpoints = ",".join(s.endpoint for s in rpc_servers)
    code, body = send(url, "POST", f"/v1/models/{model}/start",
                      {"ctx_len": 256, "rpc_servers": endpoints}, timeout=120)
    assert code == 200, body
    assert body["options"]["rpc_servers"] == endpoints
    grown = [rss(s.proc.pid) - b for s, b in zip(rpc_servers, before)]
    # Each server holds part of the ~50 MB of weights (llama.cpp splits by free memory).
    assert all(g > 8 * 2**20 for g in grown), grown
    row, = [r for r in send(url, "GET", "/v1/models/status")[1]["data"] if r["id"] == model]
    assert row["vram"] == 0 and row["ram"] < 8 * 2**20, row  # the weights are not here

    code, split = chat(url, model)
    assert code == 200, split
    answer = split["choices"][0]["message"]["content"]
    assert answer and split["usage"]["completion_tokens"] == 12
    assert answer == alone["choices"][0]["message"]["content"]  # the same computation
    assert send(url, "POST", f"/v1/models/{model}/stop")[0] == 200
    assert send(url, "GET", "/healthz")[0] == 200


def test_an_unreachable_rpc_server_is_a_502_naming_it_and_the_server_lives(served,
                                                                           rpc_servers):
    url, model = served.url, served.model
    nobody = f"127.0.0.1:{free_port()}"
    code, body = send(url, "POST", f"/v1/models/{model}/start",
                      {"rpc_servers": f"{rpc_servers[0].endpoint},{nobody}"}, timeout=60)
    assert code == 502 and body["error"]["code"] == "rpc_server_error", body
    assert body["error"]["param"] == "rpc_servers"
    assert f"Cannot use the rpc-server {nobody}: Failed to connect to {nobody}" in \
        body["message"]
    assert send(url, "GET", "/healthz")[0] == 200
    assert send(url, "GET", "/v1/models/status")[1]["data"] == []
    # The servers it could reach are not left holding anything: a start on them works.
    code, body = send(url, "POST", f"/v1/models/{model}/start",
                      {"ctx_len": 256, "rpc_servers": rpc_servers[0].endpoint}, timeout=120)
    assert code == 200, body
    assert chat(url, model)[0] == 200
