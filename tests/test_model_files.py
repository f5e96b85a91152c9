"""A model's files through the API and the CLI (issue 38): a GGUF that breaks a rule of
the header check (localrt.engines.ggufcheck) is a 400 invalid_model_file at its import,
its pull's end and its start, and registers nothing; a registered file that fails shows
"status": "invalid"; a file deleted or truncated behind localrt's back shows "missing"
or "damaged", and its start is a 409 model_file_missing naming the path and saying to
pull or import it again."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from emulators.ggufgen import write_gguf
from support import ggufedit as ge
from support.apps import bind
from support.cli import run
from support.models import add_model
from support.tasks import wait_task
from support.vision import write_vision_pair

from localrt import settings as settings_mod
from localrt.app import create_app
from localrt.cli import ExitCode
from localrt.engines import ggufcheck


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A tiny model that passes the header check."""
    return write_gguf(tmp_path_factory.mktemp("good") / "good.gguf")


@pytest.fixture(scope="module")
def bad(good, tmp_path_factory):
    """The tiny model with 600 layers, over llama.cpp's 512 (it aborts on it): the same
    size as `good`, so a file replaced by it is "invalid", not "damaged"."""
    doc = ge.read(good)
    doc.kv["llama.block_count"].value = 600
    path = ge.write(doc, tmp_path_factory.mktemp("bad") / "bad.gguf")
    assert path.stat().st_size == good.stat().st_size
    return path


def copy_of(source, folder, name="model.gguf"):
    """A copy of `source` in `folder`: a file a test may change or delete."""
    folder.mkdir(parents=True, exist_ok=True)
    return shutil.copyfile(source, folder / name)


def status(api, model_id):
    record = api("GET", f"/v1/models/{model_id}").json
    listed = {m["id"]: m["status"] for m in api("GET", "/v1/models").json["data"]}
    assert listed[model_id] == record["status"]
    return record["status"], record.get("status_message")


# --- import ----------------------------------------------------------------------------

def test_an_import_of_an_invalid_gguf_is_a_400_and_registers_nothing(api, bad, settings):
    for option in ("symlink", "copy"):
        r = api("POST", "/v1/models/import", {"path": str(bad), "id": "bad", "option": option})
        assert r.status == 400 and r.json["error"]["code"] == "invalid_model_file", r.body
        assert r.json["error"]["param"] == "path"
        assert r.json["message"] == (f"Invalid model file {bad}: llama.block_count is 600; "
                                     f"llama.cpp takes 1 to 512 layers (LLAMA_MAX_LAYERS); "
                                     f"nothing was imported")
    r = api("POST", "/v1/models/import", {"model": "bad", "modelPath": str(bad)})  # cortex's
    assert r.status == 400 and r.json["error"]["param"] == "modelPath"
    assert api("GET", "/v1/models").json["data"] == []
    assert not (settings.data_dir / "models" / "imported").exists() or \
        not any((settings.data_dir / "models" / "imported").iterdir())


def test_an_invalid_projector_is_a_400_naming_mmproj(api, tmp_path):
    model, mmproj = write_vision_pair(tmp_path / "pair")
    doc = ge.read(mmproj)
    doc.kv["general.alignment"] = ge.KV(ge.UINT32, 16)
    ge.write(doc, mmproj)
    r = api("POST", "/v1/models/import", {"path": str(model), "id": "v", "mmproj": str(mmproj)})
    assert r.status == 400 and r.json["error"]["code"] == "invalid_model_file", r.body
    assert r.json["error"]["param"] == "mmproj" and str(mmproj) in r.json["message"]
    assert "general.alignment 16 is below 32" in r.json["message"]
    assert api("GET", "/v1/models").json["data"] == []


# --- start -----------------------------------------------------------------------------

def test_a_file_that_turns_invalid_is_refused_at_start_and_shown_invalid(api, good, bad,
                                                                        tmp_path):
    path = copy_of(good, tmp_path / "src")
    add_model(api, path, "m", option="symlink")
    assert status(api, "m") == ("downloaded", None)
    shutil.copyfile(bad, path)  # the same size: only the header check can tell
    assert status(api, "m") == ("downloaded", None)  # a list never reads a header
    r = api("POST", "/v1/models/m/start", {"cpu_threads": 1})
    assert r.status == 400 and r.json["error"]["code"] == "invalid_model_file", r.body
    assert r.json["error"]["param"] == "model"
    linked = Path(api("GET", "/v1/models/m").json["path"]) / "model.gguf"  # the link to path
    assert r.json["message"] == (f"Invalid model file {linked}: llama.block_count is 600; "
                                 f"llama.cpp takes 1 to 512 layers (LLAMA_MAX_LAYERS); "
                                 f"model m cannot start")
    state, why = status(api, "m")
    assert state == "invalid" and "llama.block_count is 600" in why
    assert "import it again (`localrt models import --path" in why and str(path) in why
    r = api("POST", "/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": "hi"}]})
    assert r.status == 400 and r.json["error"]["code"] == "invalid_model_file"
    shutil.copyfile(good, path)  # a new file: no longer the one that failed
    assert status(api, "m") == ("downloaded", None)


def test_a_deleted_file_is_missing_and_its_start_a_409(api, good, settings, tmp_path):
    path = copy_of(good, tmp_path / "src")
    add_model(api, path, "gone", option="symlink")
    path.unlink()
    state, why = status(api, "gone")
    assert state == "missing"
    folder = api("GET", "/v1/models/gone").json["path"]
    assert why == (f"its file {folder}/model.gguf is missing; import it again (`localrt "
                   f"models import --path {path} --id gone`) or remove it")
    r = api("POST", "/v1/models/gone/start")
    assert r.status == 409 and r.json["error"]["code"] == "model_file_missing", r.body
    assert r.json["message"] == f"Model gone cannot start: {why}"
    assert r.json["error"]["param"] == "model"

    again = create_app(settings)  # a restart keeps it listed, as missing
    try:
        assert status(bind(again), "gone")[0] == "missing"
    finally:
        again.close()
    elsewhere = copy_of(good, tmp_path / "elsewhere")  # imported again, under its id
    r = api("POST", "/v1/models/import", {"path": str(elsewhere), "id": "gone"})
    assert r.status == 200, r.body
    assert status(api, "gone") == ("downloaded", None)
    assert api("GET", "/v1/models/gone").json["source"]["path"] == str(elsewhere)
    r = api("POST", "/v1/models/import", {"path": str(elsewhere), "id": "gone"})
    assert r.status == 409  # whole again: an id taken like any other


def test_a_truncated_copy_is_damaged(api, good):
    add_model(api, good, "cut", option="copy")
    record = api("GET", "/v1/models/cut").json
    kept = f"{record['path']}/{good.name}"
    with open(kept, "r+b") as f:
        f.truncate(1000)
    state, why = status(api, "cut")
    assert state == "damaged"
    assert why.startswith(f"its file {kept} has 1000 bytes, not the "
                          f"{good.stat().st_size} it had when it was registered; ")
    r = api("POST", "/v1/models/cut/start")
    assert r.status == 409 and r.json["error"]["code"] == "model_file_missing"
    assert kept in r.json["message"] and "import it again" in r.json["message"]


@pytest.mark.live
def test_a_missing_model_evicts_nothing_and_a_second_start_reads_no_header(
        home, good, quantized, tmp_path, monkeypatch):
    settings = settings_mod.load(environ={"HOME": str(home)})
    settings.override(maxRunningModels=1)
    app = create_app(settings)
    try:
        api = bind(app)
        add_model(api, quantized["Q8_0"], "up", option="symlink")
        path = copy_of(good, tmp_path / "src")
        add_model(api, path, "gone", option="symlink")
        read = []
        real_check = ggufcheck.check
        monkeypatch.setattr(ggufcheck, "check", lambda p, param=None: (read.append(p),
                                                                       real_check(p, param)))
        assert api("POST", "/v1/models/up/start", {"cpu_threads": 1}).status == 200
        assert api("POST", "/v1/models/up/stop").status == 200
        assert api("POST", "/v1/models/up/start", {"cpu_threads": 1}).status == 200
        assert len(read) == 1  # the second start found the first one's outcome
        path.unlink()
        r = api("POST", "/v1/models/gone/start")
        assert r.status == 409 and r.json["error"]["code"] == "model_file_missing"
        running = [m["id"] for m in api("GET", "/v1/models/status").json["data"]]
        assert running == ["up"]  # maxRunningModels 1, and nothing was unloaded for it
        assert status(api, "up")[0] == "running"
    finally:
        app.close()


# --- pull ------------------------------------------------------------------------------

@pytest.fixture
def hub_repos(good, bad):
    def add(hub):
        hub.add_repo("org/single", {"only.gguf": good.read_bytes()})
        hub.add_repo("org/bad", {"bad.gguf": bad.read_bytes()})

    return add


@pytest.mark.live
def test_a_pull_of_an_invalid_gguf_fails_and_registers_nothing(hub_app, hub):
    api = bind(hub_app)
    assert api("POST", "/v1/models/org/bad/pull").status == 200
    task = wait_task(api, "org:bad:bad.gguf")
    assert task["status"] == "Error"
    assert "Invalid model file" in task["error"] and "bad.gguf: llama.block_count is 600" \
        in task["error"] and task["error"].endswith(
            "; model org:bad:bad.gguf was downloaded but not registered"), task["error"]
    assert api("GET", "/v1/models").json["data"] == []


@pytest.mark.live
def test_a_missing_pulled_model_is_pulled_again(hub_app, hub):
    api = bind(hub_app)
    api("POST", "/v1/models/org/single/pull")
    assert wait_task(api, "org:single:only.gguf")["status"] == "Success"
    kept = Path(api("GET", "/v1/models/org:single:only.gguf").json["path"]) / "only.gguf"
    kept.unlink()
    state, why = status(api, "org:single:only.gguf")
    assert state == "missing" and why.endswith(
        "pull it again (`localrt pull org:single:only.gguf`) or remove it")
    r = api("POST", "/v1/models/org:single:only.gguf/start")
    assert r.status == 409 and "pull it again" in r.json["message"]
    r = api("POST", "/v1/models/org/single/pull")
    assert r.status == 200 and "task" in r.json, r.body  # not "already downloaded"
    assert wait_task(api, "org:single:only.gguf")["status"] == "Success"
    assert kept.exists()
    assert status(api, "org:single:only.gguf") == ("downloaded", None)


# --- the CLI ---------------------------------------------------------------------------

@pytest.mark.live
def test_models_list_shows_the_status_and_start_says_what_to_do(thread_server, good, bad,
                                                                 tmp_path):
    path = copy_of(good, tmp_path / "src")
    assert run("models", "import", "--path", str(path), "--id", "gone")[0] == 0
    assert run("models", "import", "--path", str(good), "--id", "fine")[0] == 0
    path.unlink()
    code, out, err = run("models", "list")
    assert code == 0, err
    rows = {cells[1]: cells[-1] for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in out.splitlines())
            if cells[1:2] in (["gone"], ["fine"])}
    assert rows == {"gone": "missing", "fine": "downloaded"}, out
    code, out, err = run("models", "start", "gone")
    assert code == ExitCode.ERROR and "is missing; import it again" in err
    code, _, err = run("models", "import", "--path", str(bad), "--id", "bad")
    assert code == ExitCode.ERROR and "llama.block_count is 600" in err
