"""cortex.cpp's request shapes for models, through a real server (issue 15): import
{"model", "modelPath"}, pull {"model", "id", "name"}, PATCH with model.yml's fields,
and start/stop {"model"}. Each call checks cortex's status code, the reply against
the schema GET /openapi.json documents, and what the registry holds afterwards."""

from __future__ import annotations

import json
import os

import pytest
from emulators.ggufgen import write_gguf
from support.servers import run_foreground_server, send
from support.tasks import wait_pull

from localrt.api import ROUTES
from localrt.routing import Router
from localrt.schemas import Validators

pytestmark = pytest.mark.live

MODEL_YML = (b"name: Cortex Tiny\nmodel: tiny:1b\nversion: 1\nengine: llama-cpp\nctx_len: 128\n"
             b"n_parallel: 2\nstream: true\nmirostat: false\ntfs_z: 0.9\ngrammar: ''\n"
             b"dynatemp_range: 0.0\nrepeat_last_n: many\n"
             b"files:\n  - models/cortex.so/tiny/1b/model.gguf\n")

_ROUTER, _VALIDATORS = Router(ROUTES), Validators()


def cortex(url, method, path, body=None):
    """send(), and the reply must match its documented schema: the route's reply for a
    200, schemas/error.json otherwise."""
    status, reply = send(url, method, path, body)
    if status >= 400:
        problems = _VALIDATORS.reply_errors("error", reply)
    else:
        route, _ = _ROUTER.match(method, path.split("?")[0])
        problems = _VALIDATORS.reply_errors(route.reply, reply)
    assert not problems, f"{method} {path} replied {status} off its schema: {problems[:3]}"
    return status, reply


def ids(url):
    return sorted(m["id"] for m in cortex(url, "GET", "/v1/models")[1]["data"])


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("src") / "Tiny.Q8.gguf", name="tiny-gguf")


@pytest.fixture
def hub_repos(gguf):
    """The repos conftest's `hub` serves in this module."""

    def add(hub):
        hub.add_repo("org/tiny", {"tiny.gguf": gguf})
        hub.add_cortexso("tiny", {"1b": {"model.gguf": gguf, "model.yml": MODEL_YML}},
                         default="1b")

    return add


@pytest.fixture
def server(home, settings, hub):
    settings.update({"modelHubUrl": hub.url})
    srv = run_foreground_server(home)
    yield srv
    srv.stop()


@pytest.fixture
def imported(live_server, gguf):
    status, _ = cortex(live_server.url, "POST", "/v1/models/import",
                       {"model": "me/tiny", "modelPath": str(gguf)})
    assert status == 200
    return live_server.url


# --- import ---------------------------------------------------------------------


def test_import_takes_cortex_body(live_server, gguf):
    url = live_server.url
    status, reply = cortex(url, "POST", "/v1/models/import",
                           {"model": "my-tiny", "modelPath": str(gguf), "name": "My Tiny",
                            "option": "copy"})
    assert status == 200 and reply["model"]["id"] == "my-tiny"
    model = cortex(url, "GET", "/v1/models/my-tiny")[1]
    assert (model["model"], model["name"], model["engine"], model["version"]) == \
        ("my-tiny", "My Tiny", "gguf-cpp", "1")
    copy = os.path.join(model["path"], gguf.name)
    assert not os.path.islink(copy) and open(copy, "rb").read() == gguf.read_bytes()
    # symlink is the default, and the name defaults to the GGUF's
    status, _ = cortex(url, "POST", "/v1/models/import",
                       {"model": "linked", "modelPath": str(gguf)})
    linked = cortex(url, "GET", "/v1/models/linked")[1]
    assert status == 200 and linked["name"] == "tiny-gguf"
    assert os.path.islink(os.path.join(linked["path"], gguf.name))
    # localrt's own shape is unchanged, beside cortex's
    status, reply = cortex(url, "POST", "/v1/models/import", {"path": str(gguf), "id": "own"})
    assert status == 200 and reply["model"]["model"] == "own"
    assert ids(url) == ["linked", "my-tiny", "own"]


def test_cortex_import_errors(live_server, gguf, tmp_path):
    url = live_server.url
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    torn = tmp_path / "torn.gguf"
    torn.write_bytes(b"GGUF" + b"\xff" * 64)  # the magic, then no header to read
    assert cortex(url, "POST", "/v1/models/import",
                  {"model": "taken", "modelPath": str(gguf)})[0] == 200
    for path, model_id in ((tmp_path / "missing.gguf", "new"), (text, "new"), (torn, "new"),
                           (tmp_path / "missing.gguf", "taken")):  # the path comes first
        status, reply = cortex(url, "POST", "/v1/models/import",
                               {"model": model_id, "modelPath": str(path)})
        assert status == 400 and reply["message"].startswith("Error importing model"), reply
        assert reply["error"]["param"] == "modelPath" and str(path) in reply["message"]
    status, reply = cortex(url, "POST", "/v1/models/import", {"modelPath": str(gguf)})
    assert status == 400 and reply["error"]["param"] == "model"
    status, reply = cortex(url, "POST", "/v1/models/import",
                           {"model": "taken", "modelPath": str(gguf)})
    assert status == 409 and reply["error"]["param"] == "model"
    # one shape or the other, never both
    status, reply = cortex(url, "POST", "/v1/models/import",
                           {"model": "x", "modelPath": str(gguf), "path": str(gguf)})
    assert status == 400 and reply["error"]["param"] == "path"
    assert ids(url) == ["taken"]


# --- pull -------------------------------------------------------------------------


def test_pull_registers_the_id_and_name_asked_for(server, hub):
    url = server.url
    status, reply = cortex(url, "POST", "/v1/models/pull",
                           {"model": "org/tiny", "id": "tiny-local", "name": "Tiny Local"})
    assert status == 200 and reply["model"] == "tiny-local"
    assert wait_pull(url, reply["task"]["id"])["status"] == "Success"
    model = cortex(url, "GET", "/v1/models/tiny-local")[1]
    assert (model["model"], model["name"]) == ("tiny-local", "Tiny Local")
    assert model["source"]["repo"] == "org/tiny" and ids(url) == ["tiny-local"]
    # again under the same id: nothing to do; under an id another model holds: a 409
    status, reply = cortex(url, "POST", "/v1/models/pull",
                           {"model": "org/tiny", "id": "tiny-local"})
    assert status == 200 and "already downloaded" in reply["message"]
    status, reply = cortex(url, "POST", "/v1/models/pull",
                           {"model": "tiny:1b", "id": "tiny-local"})
    assert status == 409 and reply["error"]["param"] == "id"
    status, reply = cortex(url, "POST", "/v1/models/pull", {"model": "org/tiny", "id": "../x"})
    assert status == 400 and reply["error"]["param"] == "id"
    # `file` is still taken, beside them
    status, reply = cortex(url, "POST", "/v1/models/pull",
                           {"model": "org/tiny", "file": "tiny.gguf", "name": "Again"})
    assert status == 200 and "already downloaded as tiny-local" in reply["message"]
    assert ids(url) == ["tiny-local"]


def test_pull_keeps_model_yml_fields_typed(server, hub):
    url = server.url
    status, reply = cortex(url, "POST", "/v1/models/pull", {"model": "tiny", "name": "Mine"})
    assert status == 200 and reply["model"] == "tiny:1b"
    assert wait_pull(url, reply["task"]["id"])["status"] == "Success"
    model = cortex(url, "GET", "/v1/models/tiny:1b")[1]
    assert model["name"] == "Mine" and model["engine"] == "gguf-cpp"  # cortex's llama-cpp
    assert (model["n_parallel"], model["stream"], model["mirostat"], model["tfs_z"]) == \
        (2, True, False, 0.9)
    assert model["version"] == 1 and model["model"] == "tiny:1b"
    assert "repeat_last_n" not in model  # "many" is no integer: left out, as a parameter is


# --- PATCH ------------------------------------------------------------------------

# mmproj is not kept as given: it is the path of a projector, checked and linked in
# (tests/test_vision_models.py); one that is no projector is a refusal below.
CORTEX_FIELDS = {"n_parallel": 4, "cpu_threads": 2, "seed": 7, "grammar": 'root ::= "a"',
                 "stream": False, "mirostat": 2,
                 "dynatemp_range": 0.5, "tfs_z": 0.95, "typ_p": 0.8, "ignore_eos": True,
                 "prompt_template": "{system_message}{prompt}", "version": "2",
                 "top_k": 20, "min_keep": 1}


def test_patch_takes_model_yml_fields(imported):
    url = imported
    status, reply = cortex(url, "PATCH", "/v1/models/me/tiny",
                           {"model": "me/tiny", **CORTEX_FIELDS})
    assert status == 200
    model = cortex(url, "GET", "/v1/models/me/tiny")[1]
    assert {k: model[k] for k in CORTEX_FIELDS} == CORTEX_FIELDS
    assert model["model"] == "me/tiny" and reply["model"] == model
    stored = json.loads(open(os.path.join(model["path"], "model.json")).read())
    assert {k: stored[k] for k in CORTEX_FIELDS} == CORTEX_FIELDS
    assert "model" not in stored  # it is the id, never kept twice
    listed = cortex(url, "GET", "/v1/models")[1]["data"][0]
    assert listed["n_parallel"] == 4 and listed["version"] == "2"


def test_patch_may_repeat_what_only_a_pull_or_import_sets(imported):
    url = imported
    model = cortex(url, "GET", "/v1/models/me/tiny")[1]
    paths = [f["path"] for f in model["files"]]
    for same in ({"files": model["files"]}, {"files": paths},
                 {"files": [os.path.join(model["path"], p) for p in paths]},
                 {"engine": "gguf-cpp"}, {"engine": "llama-cpp"}, {"object": "model"},
                 {"created": model["created"], "owned_by": "local", "size": model["size"],
                  "id": "me/tiny", "model": "me/tiny", "top_p": 0.5}):
        status, reply = cortex(url, "PATCH", "/v1/models/me/tiny", same)
        assert status == 200, (same, reply)
    after = cortex(url, "GET", "/v1/models/me/tiny")[1]
    assert {**model, "top_p": 0.5} == after


@pytest.mark.parametrize("body, status, param", [
    ({"model": "other"}, 400, "model"),
    ({"files": ["/elsewhere/model.gguf"]}, 409, "files"),
    ({"engine": "onnx-runtime"}, 409, "engine"),
    ({"created": 1}, 409, "created"),
    ({"n_parallel": "4"}, 400, "n_parallel"),
    ({"mirostat": 3}, 400, "mirostat"),
    ({"stream": "yes"}, 400, "stream"),
    ({"grammar": 5}, 400, "grammar"),
    ({"object": "list"}, 400, "object"),
    ({"n_parallel": 2, "bogus": 1}, 400, "bogus"),
    ({"mmproj": "/models/mmproj.gguf", "n_parallel": 2}, 400, "mmproj"),
])
def test_patch_refusals_change_nothing(imported, body, status, param):
    url = imported
    before = cortex(url, "GET", "/v1/models/me/tiny")[1]
    got, reply = cortex(url, "PATCH", "/v1/models/me/tiny", body)
    assert (got, reply["error"]["param"]) == (status, param), reply
    if status == 409:
        assert "changes only through" in reply["message"]
    assert cortex(url, "GET", "/v1/models/me/tiny")[1] == before


# --- start and stop -------------------------------------------------------------


def test_start_and_stop_take_the_model_in_the_body(imported):
    url = imported
    status, reply = cortex(url, "POST", "/v1/models/start", {"model": "me/tiny"})
    assert status == 200 and reply["model"] == "me/tiny" and not reply["alreadyRunning"]
    assert cortex(url, "GET", "/v1/models/me/tiny")[1]["status"] == "running"
    running = cortex(url, "GET", "/v1/models/status")[1]["data"]
    assert [m["id"] for m in running] == ["me/tiny"]
    status, reply = cortex(url, "POST", "/v1/models/start", {"model": "me/tiny"})
    assert status == 200 and reply["alreadyRunning"]
    status, reply = cortex(url, "POST", "/v1/models/stop", {"model": "me/tiny"})
    assert status == 200 and reply["model"] == "me/tiny"
    assert cortex(url, "GET", "/v1/models/me/tiny")[1]["status"] == "downloaded"
    assert cortex(url, "GET", "/v1/models/status")[1]["data"] == []
    status, reply = cortex(url, "POST", "/v1/models/stop", {"model": "me/tiny"})
    assert status == 409 and reply["error"]["code"] == "model_not_running"
    for path in ("/v1/models/start", "/v1/models/stop"):
        status, reply = cortex(url, "POST", path, {})
        assert status == 400 and reply["error"]["param"] == "model"
    status, reply = cortex(url, "POST", "/v1/models/start", {"model": "nope"})
    assert status == 404 and reply["error"]["code"] == "model_not_found"
