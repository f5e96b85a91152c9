"""The first load of a model file happens in a child process (issue 38, item 1).

Real llama.cpp on tiny generated GGUFs: a file whose RMS-norm epsilon is NaN (which
model_fuzz found) passes every header check (localrt.engines.ggufcheck) and loads,
then aborts llama.cpp (SIGABRT, ggml's `eps >= 0` assert) at its first decode; a file that lacks a tensor is refused by llama.cpp's
loader in its own words. Each is refused with 400 invalid_model_file by the import,
the pull's end and the start, from a child's load, while the server and another
model's stream go on; a file a child loaded is never loaded by a child again (the
outcome is kept by sha256 and build, across restarts).
"""

from __future__ import annotations

import json
import os
import shutil

import gguf
import pytest
from emulators import ggufmutate
from emulators.ggufgen import write_gguf
from support.models import NO_DRAFTS, NO_EOS
from support.servers import RawStream, send
from support.tasks import wait_task

from localrt.app import create_app
from localrt.engines.vetting import every_byte_text
from support.apps import bind

pytestmark = pytest.mark.live  # real children, real loads

CRASHED = "the engine crashed (signal 6) while loading it"


def _write_with(path, change):
    """write_gguf, each tensor passed through `change(name, array)` (None drops it)."""
    original = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, array, *args, **kwargs):
        array = change(name, array)
        if array is not None:
            original(self, name, array, *args, **kwargs)

    gguf.GGUFWriter.add_tensor = add_tensor
    try:
        return write_gguf(path)
    finally:
        gguf.GGUFWriter.add_tensor = original


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A good tiny model; one whose RMS-norm epsilon is NaN (the same size, a header
    that passes every check: llama.cpp aborts at its first decode); one without ffn_up."""
    root = tmp_path_factory.mktemp("child-load")
    good = write_gguf(root / "good.gguf")
    nan = ggufmutate.read(good)
    nan.set("llama.attention.layer_norm_rms_epsilon", 6, float("nan"))  # a float32 still
    crashes = root / "nan.gguf"
    crashes.write_bytes(nan.write()[0])
    missing = _write_with(root / "missing.gguf",
                          lambda name, a: None if name == "blk.0.ffn_up.weight" else a)
    return {"good": good, "crashes": crashes, "missing": missing}


def _vetting(app):
    return app.services.scheduler.vetting


def test_the_text_holds_every_byte_utf8_can_carry():
    held = set(every_byte_text().encode("utf-8"))
    assert set(range(256)) - held == {0xC0, 0xC1, *range(0xF5, 0x100)}


def test_an_import_of_a_file_that_crashes_llama_cpp_is_refused(api, app, files, settings):
    r = api("POST", "/v1/models/import", {"path": str(files["crashes"]), "id": "bad"})
    assert r.status == 400, r.body
    assert r.json["error"]["code"] == "invalid_model_file"
    message = r.json["message"]
    assert "nan.gguf" in message and CRASHED in message and "SIGABRT" in message
    assert api("GET", "/v1/models").json["data"] == []  # nothing registered
    assert not (settings.data_dir / "models" / "imported" / "bad").exists()
    kept = json.loads((settings.data_dir / "engines" / "vetted.json").read_text())
    [outcome] = kept["outcomes"].values()
    assert outcome["ok"] is False and outcome["file"] == "nan.gguf"
    # This process, which serves the app, is alive to read the reply; the good file
    # still imports, and chats.
    r = api("POST", "/v1/models/import", {"path": str(files["good"]), "id": "good"})
    assert r.status == 200 and r.json["model"]["vetting"]["ok"] is True
    r = api("POST", "/v1/chat/completions", {"model": "good", "max_tokens": 3,
                                             "messages": [{"role": "user", "content": "hi"}]})
    assert r.status == 200, r.body


def test_the_reason_is_llama_cpps_own(api, files):
    r = api("POST", "/v1/models/import", {"path": str(files["missing"]), "id": "missing"})
    assert r.status == 400 and r.json["error"]["code"] == "invalid_model_file"
    assert "missing.gguf" in r.json["message"]
    assert "tensor 'blk.0.ffn_up.weight' not found" in r.json["message"]


def test_a_file_a_child_loaded_is_never_loaded_by_a_child_again(api, app, files, settings):
    vetting = _vetting(app)
    assert api("POST", "/v1/models/import", {"path": str(files["good"]),
                                             "id": "a"}).status == 200
    assert vetting.children == 1
    # The same content under another id, and the model's starts: no second child.
    assert api("POST", "/v1/models/import", {"path": str(files["good"]),
                                             "id": "b"}).status == 200
    for _ in range(2):
        r = api("POST", "/v1/models/a/start", {"cpu_threads": 1})
        assert r.status == 200, r.body
        assert api("POST", "/v1/models/a/stop").status == 200
    assert vetting.children == 1
    # A linked file's sha256 is computed once and kept with its stat stamp.
    kept = json.loads((settings.data_dir / "engines" / "vetted.json").read_text())
    assert list(kept["hashes"]) == [os.path.realpath(files["good"])]
    # Kept across a restart: a new server on the same data starts it without a child.
    again = create_app(settings)
    try:
        r = bind(again)("POST", "/v1/models/b/start", {"cpu_threads": 1})
        assert r.status == 200, r.body
        assert _vetting(again).children == 0
    finally:
        again.close()


def test_the_start_refuses_a_file_changed_behind_its_back(api, app, files, tmp_path):
    linked = tmp_path / "model.gguf"
    shutil.copyfile(files["good"], linked)
    assert api("POST", "/v1/models/import", {"path": str(linked), "id": "m"}).status == 200
    # Same size, another content: the registry's size check cannot tell, the sha256 can.
    shutil.copyfile(files["crashes"], linked)
    assert linked.stat().st_size == files["good"].stat().st_size
    r = api("POST", "/v1/models/m/start", {"cpu_threads": 1})
    assert r.status == 400 and r.json["error"]["code"] == "invalid_model_file", r.body
    assert CRASHED in r.json["message"]
    record = api("GET", "/v1/models/m").json
    assert record["status"] == "invalid" and CRASHED in record["vetting"]["reason"]
    assert api("GET", "/v1/models").json["data"][0]["status"] == "invalid"
    children = _vetting(app).children
    r = api("POST", "/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": "hi"}]})
    assert r.status == 400 and r.json["error"]["code"] == "invalid_model_file"
    assert _vetting(app).children == children  # refused from what was kept


@pytest.fixture
def bad_repo(files):
    return lambda hub: hub.add_repo("org/bad", {"bad.gguf": files["crashes"]})


@pytest.fixture
def hub_repos(bad_repo):
    return bad_repo


def test_a_pulls_end_says_so_and_the_record_shows_it(hub_app, files):
    api = bind(hub_app)
    r = api("POST", "/v1/models/pull", {"model": "org/bad"})
    assert r.status == 200, r.body
    task = wait_task(api, r.json["task"]["id"])
    assert task["status"] == "Error"
    assert "invalid_model_file" in task["error"] and CRASHED in task["error"]
    [model] = api("GET", "/v1/models").json["data"]
    assert model["status"] == "invalid" and model["vetting"]["ok"] is False
    children = _vetting(hub_app).children
    r = api("POST", f"/v1/models/{model['id']}/start", {"cpu_threads": 1})
    assert r.status == 400 and r.json["error"]["code"] == "invalid_model_file"
    assert _vetting(hub_app).children == children
    assert api("DELETE", f"/v1/models/{model['id']}").status == 200


def test_the_server_and_another_models_stream_go_on(live_server, slow_gguf, files):
    url = live_server.url
    assert send(url, "POST", "/v1/models/import", {"path": str(slow_gguf), "id": "slow"},
                timeout=60)[0] == 200
    status, reply = send(url, "POST", "/v1/models/slow/start",
                         {"cpu_threads": 1, "ctx_len": 4096, **NO_DRAFTS}, timeout=60)
    assert status == 200, reply
    stream = RawStream(url, {"model": "slow", "stream": True, "max_tokens": 1500,
                             "temperature": 0, "logit_bias": NO_EOS,
                             "messages": [{"role": "user", "content": "hi"}]})
    events = iter(stream)
    first = next(events)
    assert first["choices"][0]["delta"] is not None
    status, reply = send(url, "POST", "/v1/models/import",
                         {"path": str(files["crashes"]), "id": "bad"}, timeout=60)
    assert status == 400 and reply["error"]["code"] == "invalid_model_file", reply
    status, _ = send(url, "GET", "/healthz")
    assert status == 200
    rest = list(events)
    assert rest[-1] == "[DONE]"
    finish = [e["choices"][0]["finish_reason"] for e in rest[:-1] if e["choices"]]
    assert finish[-1] == "length"
    usage = [e["usage"] for e in rest[:-1] if e.get("usage")]
    assert not usage or usage[-1]["completion_tokens"] == 1500
    stream.close()
    assert live_server.process.poll() is None
