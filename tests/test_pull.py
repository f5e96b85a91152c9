"""Pulling models from the hub emulator through the API: tasks, integrity, resume, cancel."""

from __future__ import annotations

import hashlib
from collections import namedtuple
from pathlib import Path

import pytest
from emulators.ggufgen import write_gguf
from support.apps import bind, call
from support.tasks import wait_bytes, wait_task

from localrt.app import create_app

pytestmark = pytest.mark.live

READ_TIMEOUT = 30.0  # seconds: localrt.downloads.fetch's read timeout, which a cancel must not wait out
MODEL_YML = (b"name: Tiny Q8\nengine: llama-cpp\nctx_len: 128\ntemperature: 0.5\n"
             b"stop: ['<|im_end|>']\n")


@pytest.fixture(scope="session")
def weights(tmp_path_factory):
    """Generated GGUF files: two small ones and a 22 MB one for slow transfers."""
    root = tmp_path_factory.mktemp("weights")
    W = namedtuple("W", "small other big")
    return W(write_gguf(root / "small.gguf", name="small", context_length=256),
             write_gguf(root / "other.gguf", name="other", seed=1),
             write_gguf(root / "big.gguf", name="big", n_embd=512, n_layer=2))


@pytest.fixture
def hub_repos(weights):
    """The repos conftest's `hub` serves in this module."""

    def add(hub):
        hub.add_repo("cortexso/tiny", {"README.md": b"# tiny\n"},
                     branches={"q8": {"model.yml": MODEL_YML, "model.gguf": weights.small}})
        hub.add_repo("org/multi", {"a.Q4_0.gguf": weights.small, "b.Q8_0.gguf": weights.other,
                                   "README.md": b"two files\n"})
        hub.add_repo("org/single", {"only.gguf": weights.small})
        hub.add_repo("org/big", {"big.gguf": weights.big})
        hub.add_repo("org/gated", {"g.gguf": weights.small}, gated_token="hf_secret")

    return add


@pytest.fixture
def api(hub_app):
    return bind(hub_app)


def test_builtin_variant_is_pulled_and_registered(api, hub, settings, weights):
    r = api("POST", "/v1/models/tiny:q8/pull")
    assert r.status == 200, r.body
    task = r.json["task"]
    assert task["id"] == "cortexso:tiny:q8" and task["type"] == "Model"
    assert len(task["id"].split(":")) == 3
    items = {i["id"]: i for i in task["items"]}
    assert set(items) == {"model.yml", "model.gguf"}
    gguf = items["model.gguf"]
    assert gguf["bytes"] == weights.small.stat().st_size
    assert gguf["checksum"] == hashlib.sha256(weights.small.read_bytes()).hexdigest()
    assert gguf["url"].startswith(hub.url) and set(gguf) >= {"localPath", "downloadedBytes"}
    assert wait_task(api, "cortexso:tiny:q8")["status"] == "Success"

    folder = settings.data_dir / "models" / f"127.0.0.1_{hub.port}" / "cortexso" / "tiny" / "q8"
    assert (folder / "model.gguf").read_bytes() == weights.small.read_bytes()
    assert not list(folder.glob("*.part"))
    listed = api("GET", "/v1/models").json
    assert listed["object"] == "list"
    [model] = listed["data"]
    assert model["id"] == "tiny:q8" and model["object"] == "model"
    assert model["engine"] == "gguf-cpp" and model["owned_by"] == "cortexso"
    assert isinstance(model["created"], int) and model["status"] == "downloaded"
    # model.yml wins over the GGUF's own defaults
    assert model["ctx_len"] == 128 and model["temperature"] == 0.5
    assert model["stop"] == ["<|im_end|>"] and model["name"] == "Tiny Q8"
    assert model["metadata"]["context_length"] == 256
    full = api("GET", "/v1/models/tiny:q8").json
    assert full["metadata"]["chat_template"] and full["source"]["revision"] == "q8"
    assert (folder / "model.json").stat().st_mode & 0o777 == 0o600


def test_pulling_again_downloads_nothing(api, hub):
    api("POST", "/v1/models/tiny:q8/pull")
    wait_task(api, "cortexso:tiny:q8")
    hub.clear_requests()
    r = api("POST", "/v1/models/tiny:q8/pull")
    assert r.status == 200 and "already downloaded" in r.json["message"]
    assert "task" not in r.json and hub.requests == []


def test_repo_with_several_ggufs_needs_a_choice(api, hub):
    r = api("POST", "/v1/models/org/multi/pull")
    assert r.status == 400 and r.json["error"]["param"] == "file"
    assert r.json["files"] == ["a.Q4_0.gguf", "b.Q8_0.gguf"]
    assert "a.Q4_0.gguf" in r.json["message"] and "b.Q8_0.gguf" in r.json["message"]

    r = api("POST", "/v1/models/pull", {"model": "org/multi", "file": "b.Q8_0.gguf"})
    assert r.status == 200 and r.json["task"]["id"] == "org:multi:b.Q8_0.gguf"
    assert [i["id"] for i in r.json["task"]["items"]] == ["b.Q8_0.gguf"]
    assert wait_task(api, "org:multi:b.Q8_0.gguf")["status"] == "Success"
    assert api("GET", "/v1/models/org:multi:b.Q8_0.gguf").json["engine"] == "gguf-cpp"

    r = api("POST", "/v1/models/org/multi:a.Q4_0.gguf/pull")
    assert r.status == 200 and r.json["model"] == "org:multi:a.Q4_0.gguf"
    wait_task(api, "org:multi:a.Q4_0.gguf")
    ids = [m["id"] for m in api("GET", "/v1/models").json["data"]]
    assert ids == ["org:multi:a.Q4_0.gguf", "org:multi:b.Q8_0.gguf"]


def test_single_gguf_repo_and_hub_url_ids(api, hub):
    r = api("POST", "/v1/models/pull", {"model": "org/single"})
    assert r.status == 200 and r.json["model"] == "org:single:only.gguf"
    wait_task(api, "org:single:only.gguf")
    r = api("POST", "/v1/models/pull",
            {"model": f"{hub.url}/org/multi/blob/main/a.Q4_0.gguf"})
    assert r.status == 200 and r.json["model"] == "org:multi:a.Q4_0.gguf"
    assert wait_task(api, "org:multi:a.Q4_0.gguf")["status"] == "Success"


@pytest.mark.parametrize("model, status, words", [
    ("org/missing", 404, "No such model on the hub"),
    ("org/multi:nope.gguf", 404, "No file nope.gguf"),
    ("org/gated", 403, "needs a token"),
    ("../etc", 400, "'..'"),
    ("a" * 300, 400, "longer than 255"),
])
def test_bad_pulls_are_clear_errors(api, hub, model, status, words):
    r = api("POST", "/v1/models/pull", {"model": model})
    assert r.status == status, r.body
    assert words in r.json["message"]
    assert api("GET", "/v1/models/pull").json["data"] == []


def test_file_only_goes_with_a_repo(api):
    r = api("POST", "/v1/models/pull", {"model": "tiny:q8", "file": "x.gguf"})
    assert r.status == 400 and r.json["error"]["param"] == "file"
    r = api("POST", "/v1/models/pull", {"model": "org/multi", "file": "../x.gguf"})
    assert r.status == 400 and r.json["error"]["param"] == "file"
    r = api("POST", "/v1/models/pull", {"model": 5})
    assert r.status == 400 and r.json["error"]["param"] == "model"


def test_token_reaches_the_hub_and_not_the_cdn(api, hub):
    api("PATCH", "/v1/configs", {"modelhub_token": "hf_secret"})
    r = api("POST", "/v1/models/org/gated/pull")
    assert r.status == 200, r.body
    assert wait_task(api, "org:gated:g.gguf")["status"] == "Success"
    hub_reqs, cdn_reqs = hub.requests_to("hub"), hub.requests_to("cdn")
    assert cdn_reqs, "the file should have come from the CDN"
    assert all(r.headers.get("authorization") == "Bearer hf_secret" for r in hub_reqs)
    assert not any("authorization" in r.headers for r in cdn_reqs)


def test_wrong_token_is_refused_clearly(api, hub):
    api("PATCH", "/v1/configs", {"modelhub_token": "hf_wrong"})
    r = api("POST", "/v1/models/org/gated/pull")
    assert r.status == 403 and "did not accept the token" in r.json["message"]
    assert "hf_wrong" not in r.body.decode()


def test_a_corrupt_byte_is_caught(api, hub, settings):
    hub.corrupt = True
    api("POST", "/v1/models/org/single/pull")
    task = wait_task(api, "org:single:only.gguf")
    assert task["status"] == "Error" and "checksum mismatch" in task["error"]
    assert api("GET", "/v1/models").json["data"] == []
    assert not [p for p in (settings.data_dir / "models").rglob("*.gguf*") if p.is_file()]
    hub.corrupt = False
    api("POST", "/v1/models/org/single/pull")
    assert wait_task(api, "org:single:only.gguf")["status"] == "Success"


def test_a_dropped_connection_resumes_with_range(api, hub, weights):
    hub.drop_after = 5 * 1024 * 1024
    api("POST", "/v1/models/org/big/pull")
    assert wait_task(api, "org:big:big.gguf")["status"] == "Success"
    ranges = [r.range for r in hub.requests_to("cdn") if r.range]
    assert ranges == [f"bytes={5 * 1024 * 1024}-"]
    assert api("GET", "/v1/models/org:big:big.gguf").json["size"] == weights.big.stat().st_size


def test_server_errors_are_retried(api, hub):
    hub.fail_status = [500, 503]
    api("POST", "/v1/models/org/single/pull")
    assert wait_task(api, "org:single:only.gguf")["status"] == "Success"


def test_a_file_gone_from_the_hub_fails_the_task(api, hub):
    # The first 404 answers the pull's access check (a HEAD), which leaves anything but
    # a 401 or 403 to the download; the second is the download's.
    hub.fail_status = [404, 404]
    api("POST", "/v1/models/org/single/pull")
    task = wait_task(api, "org:single:only.gguf")
    assert task["status"] == "Error" and "HTTP 404" in task["error"]


def test_cancel_stops_quickly_registers_nothing_and_a_new_pull_resumes(api, hub, settings):
    hub.delay_per_chunk = 0.02
    r = api("POST", "/v1/models/org/big/pull")
    task_id = r.json["task"]["id"]
    wait_bytes(api, task_id, 512 * 1024)

    dup = api("POST", "/v1/models/pull", {"model": "org/big"})
    assert dup.status == 409 and dup.json["taskId"] == task_id

    r = api("DELETE", "/v1/models/pull", {"taskId": task_id})
    assert r.status == 200
    task = wait_task(api, task_id)
    assert task["status"] == "Stopped"
    assert api("GET", "/v1/models").json["data"] == []
    assert api("GET", "/v1/models/org:big:big.gguf").status == 404
    [part] = list((settings.data_dir / "models").rglob("big.gguf.part"))
    kept = part.stat().st_size
    # Stopped mid-file, not once the file was in: the cancel did not wait for the end.
    assert 0 < kept < hub.file("org/big", "big.gguf").size

    hub.delay_per_chunk = 0
    hub.clear_requests()
    api("POST", "/v1/models/org/big/pull")
    assert wait_task(api, task_id)["status"] == "Success"
    [ranged] = [r for r in hub.requests_to("cdn") if r.method == "GET"]
    assert ranged.range == f"bytes={kept}-"


def test_cancel_stops_a_download_whose_server_never_answers(api, hub):
    """The CDN accepts the connection and says nothing: the cancel must not wait for
    the 30 s read timeout."""
    import socket

    silent = socket.create_server(("127.0.0.1", 0))
    try:
        hub.cdn_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        r = api("POST", "/v1/models/org/big/pull")
        task_id = r.json["task"]["id"]
        conn, _ = silent.accept()  # the download has connected; nothing will answer it
        conn.settimeout(READ_TIMEOUT / 3)
        assert conn.recv(65536).startswith(b"GET ")  # it now waits for response headers
        assert api("DELETE", "/v1/models/pull", {"taskId": task_id}).status == 200
        # Far sooner than the read timeout would have ended it (a ratio, not a clock).
        task = wait_task(api, task_id, timeout=READ_TIMEOUT / 3)
        assert task["status"] == "Stopped"
        assert conn.recv(1) == b""  # the cancel shut the download's socket
        conn.close()
    finally:
        silent.close()


def test_cancel_unknown_task_is_404(api):
    r = api("DELETE", "/v1/models/pull", {"taskId": "org:nope:x.gguf"})
    assert r.status == 404 and r.json["error"]["param"] == "taskId"
    r = api("DELETE", "/v1/models/pull", {})
    assert r.status == 400 and r.json["error"]["param"] == "taskId"


def test_too_little_disk_space_is_refused(api, monkeypatch):
    import shutil

    from localrt import fsutil

    usage = shutil.disk_usage("/")
    monkeypatch.setattr(fsutil.shutil, "disk_usage",
                        lambda path: usage._replace(free=1024))
    r = api("POST", "/v1/models/org/single/pull")
    assert r.status == 507 and "Not enough disk space" in r.json["message"]
    assert r.json["error"]["code"] == "insufficient_storage"
    assert api("GET", "/v1/models/pull").json["data"] == []


def test_registry_survives_a_restart_and_shows_damaged_models(api, settings):
    api("POST", "/v1/models/org/single/pull")
    wait_task(api, "org:single:only.gguf")
    api("POST", "/v1/models/tiny:q8/pull")
    wait_task(api, "cortexso:tiny:q8")

    again = create_app(settings)
    ids = [m["id"] for m in call(again, "GET", "/v1/models").json["data"]]
    assert ids == ["org:single:only.gguf", "tiny:q8"]

    folder = Path(call(again, "GET", "/v1/models/tiny:q8").json["path"])
    with open(folder / "model.gguf", "r+b") as f:
        f.truncate(100)
    fresh = create_app(settings)
    listed = {m["id"]: m["status"] for m in call(fresh, "GET", "/v1/models").json["data"]}
    assert listed == {"org:single:only.gguf": "downloaded", "tiny:q8": "damaged"}


def test_a_hub_file_path_cannot_escape_the_models_folder(api, hub, weights, settings):
    hub.add_repo("cortexso/evil", branches={"v1": {"../../../escape.gguf": weights.small}})
    r = api("POST", "/v1/models/evil:v1/pull")
    assert r.status == 502 and "unsafe path" in r.json["message"], r.body
    assert not list(settings.data_dir.parent.rglob("escape.gguf*"))


def test_proxy_credentials_never_reach_a_cdn_that_is_not_proxied(api, hub, settings, tmp_path):
    from emulators.proxyfix import start_proxy

    with start_proxy(tmp_path, username="u", password="s3cret") as proxy:
        settings.update({"modelHubUrl": f"http://localhost:{hub.port}"})
        api("PATCH", "/v1/configs", {"proxy_url": proxy.url, "proxy_username": "u",
                                     "proxy_password": "s3cret", "no_proxy": "127.0.0.1"})
        r = api("POST", "/v1/models/org/single/pull")
        assert r.status == 200, r.body
        assert wait_task(api, "org:single:only.gguf")["status"] == "Success"
    assert all("via" in r.headers for r in hub.requests_to("hub"))
    cdn = hub.requests_to("cdn")
    assert cdn and not any("proxy-authorization" in r.headers or "via" in r.headers
                           for r in cdn)


def test_a_failed_write_fails_the_task_and_never_renames(api, hub, monkeypatch):
    from localrt.downloads import fetch

    real_write, calls = fetch.os.write, []

    def flaky_write(fd, data):
        calls.append(len(data))
        if len(calls) == 2:
            return real_write(fd, bytes(data)[:1000])  # a short write ...
        if len(calls) == 3:
            raise OSError(28, "No space left on device")  # ... then the disk is full
        return real_write(fd, data)

    monkeypatch.setattr(fetch.os, "write", flaky_write)
    api("POST", "/v1/models/org/big/pull")
    task = wait_task(api, "org:big:big.gguf")
    assert (task["status"], task["errorCode"]) == ("Error", "disk_full")
    assert "no space left in" in task["error"] and "pull it again" in task["error"]
    assert api("GET", "/v1/models").json["data"] == []
    monkeypatch.setattr(fetch.os, "write", real_write)
    api("POST", "/v1/models/org/big/pull")
    assert wait_task(api, "org:big:big.gguf")["status"] == "Success"
    path = Path(api("GET", "/v1/models/org:big:big.gguf").json["path"]) / "big.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == hub.file("org/big",
                                                                      "big.gguf").sha256
