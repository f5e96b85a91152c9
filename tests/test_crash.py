"""Kill -9 the server at random points, restart it, and check what it left.

Covered: config writes (a stream of PATCHes), pulls, engine installs and model
starts. After every restart the registry must be consistent (no model listed whose
files are incomplete, no engine listed that is half unpacked), downloads resume,
and no file is corrupt. The random points come from a seeded generator, printed
on failure, so a failing run can be repeated.
"""

import hashlib
import http.client
import itertools
import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest
import yaml
from emulators.ggufgen import write_gguf
from emulators.hubemu import HubEmulator
from emulators.pkgindex import PackageIndex
from support.servers import run_foreground_server, send
from support.tasks import wait_pull

pytestmark = [pytest.mark.live, pytest.mark.slow]

SEED = 20261121


@pytest.fixture
def servers():
    """Every server a test starts; any still running at the end is killed."""
    started = []
    yield started
    for srv in started:
        srv.stop(sig=signal.SIGKILL)  # closes the pipes of those already stopped, too


def patch_forever(url, tokens, sent, stop):
    """PATCH both proxy fields with one token no other PATCH of the test uses."""
    while not stop.is_set():
        n = next(tokens)  # itertools.count: safe to share between the two workers
        body = {"proxy_username": f"user{n}", "no_proxy": f"host{n}"}
        sent.add(n)  # before the request: the server may apply it and die before answering
        req = urllib.request.Request(url + "/v1/configs", method="PATCH",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                r.read()
        except (urllib.error.URLError, http.client.HTTPException, OSError):
            return


def proxy_state(path) -> tuple:
    """(proxyUsername, noProxy) as the settings file holds them; the file must parse."""
    data = yaml.safe_load(path.read_text())
    assert data["apiServerPort"] == 39281 and data["cors"] is True, data
    return data["proxyUsername"], data["noProxy"]


def test_kill_9_during_patches_leaves_old_or_new_state(home, servers):
    rng = random.Random(1234)
    tokens = itertools.count(1)
    for _ in range(4):
        srv = run_foreground_server(home)
        servers.append(srv)
        old = proxy_state(srv.settings.path)  # what the last round left, or the defaults
        sent, stop = set(), threading.Event()
        workers = [threading.Thread(target=patch_forever, args=(srv.url, tokens, sent, stop))
                   for _ in range(2)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 30  # a busy machine may take a while to get going
        while len(sent) <= 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.4))
        srv.stop(sig=signal.SIGKILL, timeout=10)
        stop.set()
        for w in workers:
            w.join(timeout=10)
        assert len(sent) > 5, "the PATCH stream never got going"

        # Every PATCH writes both fields with its own token, so a torn or mixed write
        # matches neither the state before this round nor any one PATCH of it.
        state = proxy_state(srv.settings.path)
        whole = {old} | {(f"user{n}", f"host{n}") for n in sent}
        assert state in whole, (old, state)
        # The next server starts on the same file and reads those values.
        srv = run_foreground_server(home)
        servers.append(srv)
        with urllib.request.urlopen(srv.url + "/v1/configs") as r:
            config = json.loads(r.read())
        assert (config["proxy_username"], config["no_proxy"]) == state
        srv.stop()


# --- helpers ---------------------------------------------------------------------


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def assert_models_whole(url) -> list:
    """Every listed model's files exist with the size and sha256 its definition records."""
    status, body = send(url, "GET", "/v1/models")
    assert status == 200
    for model in body["data"]:
        for f in model["files"]:
            path = os.path.join(model["path"], f["path"])
            assert os.path.getsize(path) == f["size"], (model["id"], path)
            if f.get("sha256"):
                assert sha256(path) == f["sha256"], (model["id"], path)
    return body["data"]


# --- pulls -------------------------------------------------------------------------


def test_kill_9_at_random_points_of_a_pull(home, settings, tmp_path, servers):
    rng = random.Random(SEED)
    weights = write_gguf(tmp_path / "big.gguf", name="big", n_embd=512, n_layer=2)
    size = weights.stat().st_size
    with HubEmulator() as hub:
        hub.add_repo("org/big", {"big.gguf": weights})
        settings.update({"modelHubUrl": hub.url})
        hub.delay_per_chunk = 0.004  # 64 KiB chunks: about 1.5 s for the whole file
        fetched = []
        for round_ in range(5):
            srv = run_foreground_server(home)
            servers.append(srv)
            assert_models_whole(srv.url)  # nothing half-downloaded is listed
            hub.clear_requests()
            status, body = send(srv.url, "POST", "/v1/models/org/big/pull")
            if "task" not in body:  # an earlier round finished it before the kill
                break
            wait = rng.uniform(0.05, 1.0)
            time.sleep(wait)
            _, tasks = send(srv.url, "GET", "/v1/models/pull")
            srv.stop(sig=signal.SIGKILL, timeout=10)
            gets = [r for r in hub.requests_to("cdn") if r.method == "GET"]
            fetched.append(gets[-1].range if gets else None)
            print(f"pull: killed after {wait:.2f}s at about "
                  f"{tasks['data'][0]['items'][0]['downloadedBytes'] if tasks['data'] else 0}"
                  f" of {size} bytes (this run asked for {fetched[-1] or 'all'})")
        hub.delay_per_chunk = 0
        srv = run_foreground_server(home)
        servers.append(srv)
        try:
            status, body = send(srv.url, "POST", "/v1/models/org/big/pull")
            if "task" in body:
                task = wait_pull(srv.url, body["task"]["id"])
                assert task["status"] == "Success", task
            [model] = assert_models_whole(srv.url)
            assert model["id"] == "org:big:big.gguf"
            assert sha256(os.path.join(model["path"], model["files"][0]["path"])) == \
                sha256(weights)
            assert model["files"][0]["size"] == size
        finally:
            srv.stop()
    # Later rounds asked for the rest only (Range), not the whole file again.
    assert any(r and r.startswith("bytes=") and r != "bytes=0-" for r in fetched), fetched


def test_kill_9_at_random_points_of_a_parallel_pull(home, settings, tmp_path, servers):
    """A file fetched in pieces: after each kill the part map counts only bytes that are
    in the part file, and the next server asks for the rest of each piece, no more."""
    rng = random.Random(SEED + 3)
    weights = write_gguf(tmp_path / "huge.gguf", name="huge", n_embd=1024, n_layer=2)
    size = weights.stat().st_size
    assert size >= 64 * 2**20  # big enough to go in pieces
    with HubEmulator() as hub:
        hub.add_repo("org/huge", {"huge.gguf": weights})
        settings.update({"modelHubUrl": hub.url, "downloadConnections": 4})
        hub.max_bytes_per_second = 4 * 2**20  # four connections: about 5 s for the file
        expected = None  # the ranges the next server must ask for, from the map left
        resumed = []
        for round_ in range(6):
            srv = run_foreground_server(home)
            servers.append(srv)
            assert_models_whole(srv.url)
            hub.clear_requests()
            status, body = send(srv.url, "POST", "/v1/models/org/huge/pull")
            if "task" not in body:  # an earlier round finished it before the kill
                break
            part = body["task"]["items"][0]["localPath"] + ".part"
            wait = rng.uniform(0.5, 2.5)
            time.sleep(wait)
            srv.stop(sig=signal.SIGKILL, timeout=10)
            asked = sorted(tuple(int(n) for n in r.range[len("bytes="):].split("-"))
                           for r in hub.requests_to("cdn") if r.method == "GET")
            if expected is not None:
                assert asked == expected, (round_, asked, expected)
            expected = None
            if os.path.exists(part + ".map"):
                with open(part + ".map") as f:
                    saved = json.load(f)
                piece = saved["piece"]
                expected = []
                with open(part, "rb") as got, open(weights, "rb") as want:
                    for i, done in enumerate(saved["done"]):
                        start, end = i * piece, min((i + 1) * piece, size)
                        got.seek(start)
                        want.seek(start)
                        assert got.read(done) == want.read(done), (round_, i, done)
                        if start + done < end:
                            expected.append((start + done, end - 1))
                resumed += [r for r in expected if r[0] % piece]
            print(f"parallel pull: killed after {wait:.2f}s; the next server is to ask "
                  f"for {expected}")
        hub.max_bytes_per_second = None
        srv = run_foreground_server(home)
        servers.append(srv)
        try:
            status, body = send(srv.url, "POST", "/v1/models/org/huge/pull")
            if "task" in body:
                task = wait_pull(srv.url, body["task"]["id"])
                assert task["status"] == "Success", task
            [model] = assert_models_whole(srv.url)
            path = os.path.join(model["path"], model["files"][0]["path"])
            assert sha256(path) == sha256(weights) and not os.path.exists(path + ".part.map")
        finally:
            srv.stop()
    assert resumed, "no kill left a piece half done"


# --- engine installs ---------------------------------------------------------------


def test_kill_9_at_random_points_of_an_engine_install(home, settings, index_dir, servers):
    """After each kill, onnx-runtime is Ready with every file of its wheels, or not
    installed at all; the install then completes."""
    rng = random.Random(SEED + 1)
    with PackageIndex(index_dir) as index:
        settings.update({"engineIndexUrl": index.url})
        index.throttle = 0.004  # 64 KiB chunks: about 2 s for the ~35 MB of wheels
        for round_ in range(4):
            srv = run_foreground_server(home)
            servers.append(srv)
            assert_engine_whole(srv.url, settings, index_dir)
            status, body = send(srv.url, "POST", "/v1/engines/onnx-runtime/install")
            if status == 409:  # installed by an earlier round
                break
            assert status == 200, body
            wait = rng.uniform(0.1, 2.6)
            time.sleep(wait)
            _, tasks = send(srv.url, "GET", "/v1/models/pull")
            srv.stop(sig=signal.SIGKILL, timeout=10)
            print(f"engine install: killed after {wait:.2f}s; tasks then: "
                  f"{[(t['status'], sum(i['downloadedBytes'] for i in t['items'])) for t in tasks['data']]}")
        index.throttle = 0
        srv = run_foreground_server(home)
        servers.append(srv)
        try:
            assert_engine_whole(srv.url, settings, index_dir)
            status, body = send(srv.url, "POST", "/v1/engines/onnx-runtime/install")
            if status == 200:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    status, engines = send(srv.url, "GET", "/v1/engines")
                    onnx = {e["name"]: e for e in engines["data"]}["onnx-runtime"]
                    if onnx["status"] == "Ready":
                        break
                    time.sleep(0.2)
            assert assert_engine_whole(srv.url, settings, index_dir) == "Ready"
        finally:
            srv.stop()


def assert_engine_whole(url, settings, index_dir) -> str:
    """onnx-runtime's status; when Ready, every file of every wheel is in its folder."""
    status, engines = send(url, "GET", "/v1/engines")
    onnx = {e["name"]: e for e in engines["data"]}["onnx-runtime"]
    assert onnx["status"] in ("Ready", "Not Installed"), onnx
    if onnx["status"] == "Ready":
        _, variants = send(url, "GET", "/v1/engines/onnx-runtime")
        [ready] = [v for v in variants if v["status"] == "Ready"]
        folder = settings.data_dir / "engines" / "onnx-runtime" / ready["name"] / \
            ready["version"].lstrip("v")
        state = json.loads((settings.data_dir / "engines" / "engines.json").read_text())
        assert state  # parses
        wheels = list(index_dir.glob("onnxruntime_genai-*.whl"))
        assert wheels
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                for info in zf.infolist():
                    if info.is_dir() or ".data/" in info.filename:
                        continue
                    assert (folder / info.filename).stat().st_size == info.file_size, \
                        info.filename
    return onnx["status"]


# --- model starts --------------------------------------------------------------------


def start_cut_short(url) -> None:
    """POST a model start whose server is about to be killed: no answer is fine."""
    try:
        send(url, "POST", "/v1/models/tiny/start", {}, 30)
    except (OSError, http.client.HTTPException):
        pass


def test_kill_9_at_random_points_of_model_starts(home, quantized, servers):
    """A kill while a model loads or runs leaves its definition and files as they were."""
    rng = random.Random(SEED + 2)
    srv = run_foreground_server(home)
    servers.append(srv)
    status, body = send(srv.url, "POST", "/v1/models/import",
                        {"path": str(quantized["Q8_0"]), "id": "tiny", "option": "copy"})
    assert status == 200, body
    definition = send(srv.url, "GET", "/v1/models/tiny")[1]
    srv.stop(sig=signal.SIGKILL, timeout=10)
    for round_ in range(4):
        srv = run_foreground_server(home)
        servers.append(srv)
        assert send(srv.url, "GET", "/v1/models/status")[1]["data"] == []
        assert send(srv.url, "GET", "/v1/models/tiny")[1] == definition
        assert_models_whole(srv.url)
        starter = threading.Thread(target=start_cut_short, args=(srv.url,))
        starter.start()
        wait = rng.uniform(0.0, 2.0)
        time.sleep(wait)
        running = send(srv.url, "GET", "/v1/models/status")[1]["data"]
        srv.stop(sig=signal.SIGKILL, timeout=10)
        starter.join(timeout=30)
        print(f"model start: killed after {wait:.2f}s, "
              f"{'loaded' if running else 'while loading'}")
    srv = run_foreground_server(home)
    servers.append(srv)
    try:
        assert send(srv.url, "GET", "/v1/models/tiny")[1] == definition
        status, body = send(srv.url, "POST", "/v1/chat/completions", {
            "model": "tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1, body
    finally:
        srv.stop()


# --- temp files of writes cut short -----------------------------------------------------


def test_a_start_removes_the_temp_files_that_killed_writes_left(home, settings, quantized):
    """A kill between atomic_write's temp file and its rename leaves `.<name>.*.tmp`
    beside the settings file (in the home folder), a model.json or engines.json; the
    next start removes those older than fsutil.STALE_TEMP_AGE and leaves younger ones,
    which may be another process's write in flight."""
    from support.apps import call

    from localrt import fsutil, settings as settings_mod
    from localrt.app import create_app

    app = create_app(settings)
    try:
        r = call(app, "POST", "/v1/models/import", {"path": str(quantized["Q8_0"]), "id": "tiny"})
        assert r.status == 200, r.body
        folder = call(app, "GET", "/v1/models/tiny").json["path"]
    finally:
        app.close()
    engines = settings.data_dir / "engines"
    old = time.time() - fsutil.STALE_TEMP_AGE - 5
    stale, young = [], []
    for where, name in ((home, settings.path.name), (folder, "model.json"),
                        (engines, "engines.json")):
        fsutil.private_dir(where)
        for kind, mtime in ((stale, old), (young, None)):
            path = Path(where) / f".{name}.{len(kind)}{'ab' if mtime else 'cd'}.tmp"
            path.write_text("{half a wri")
            if mtime:
                os.utime(path, (mtime, mtime))
            kind.append(path)
    s = settings_mod.load()
    app = create_app(s)
    try:
        assert [m["id"] for m in call(app, "GET", "/v1/models").json["data"]] == ["tiny"]
        assert call(app, "GET", "/v1/engines").status == 200
    finally:
        app.close()
    assert [p for p in stale if p.exists()] == []
    assert [p for p in young if not p.exists()] == []
