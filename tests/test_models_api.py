"""The model registry through the API: get, update, remove and import (no hub needed)."""

from __future__ import annotations

import json
import os

import pytest
from emulators.ggufgen import write_gguf
from support.servers import send


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("src") / "Tiny-Chat.Q8.gguf", name="tiny-chat",
                      context_length=8192)


@pytest.fixture
def imported(api, gguf):
    r = api("POST", "/v1/models/import", {"path": str(gguf), "id": "me/tiny:chat"})
    assert r.status == 200, r.body
    return r.json["model"]


def test_import_links_the_file_and_reads_its_defaults(api, gguf, imported, settings):
    assert imported["id"] == "me/tiny:chat" and imported["engine"] == "gguf-cpp"
    assert imported["name"] == "tiny-chat" and imported["owned_by"] == "local"
    assert imported["ctx_len"] == 4096  # the default never goes above 4096
    assert imported["metadata"]["context_length"] == 8192
    assert imported["stop"] == ["</s>"] and imported["source"]["option"] == "symlink"
    link = os.path.join(imported["path"], gguf.name)
    assert os.path.islink(link) and os.path.realpath(link) == str(gguf.resolve())
    assert imported["path"].startswith(str(settings.data_dir / "models"))


def test_import_by_copy_and_default_id(api, gguf):
    r = api("POST", "/v1/models/import", {"path": str(gguf), "option": "copy"})
    assert r.status == 200, r.body
    model = r.json["model"]
    assert model["id"] == "Tiny-Chat.Q8"
    copy = os.path.join(model["path"], gguf.name)
    assert not os.path.islink(copy) and open(copy, "rb").read() == gguf.read_bytes()
    assert len(model["files"][0]["sha256"]) == 64


@pytest.mark.parametrize("body, param, words", [
    ({"path": "relative.gguf"}, "path", "not an absolute path"),
    ({"path": "/nonexistent/x.gguf"}, "path", "not a readable file"),
    ({"path": "/etc/hostname"}, "path", "not a GGUF file"),
    ({"path": "GGUF", "option": "hardlink"}, "option", "symlink or copy"),
    ({}, "path", "Missing required field"),
    ({"path": "SRC", "id": "../x"}, "id", "'..'"),
])
def test_bad_imports(api, gguf, body, param, words):
    body = {k: (str(gguf) if v in ("SRC", "GGUF") else v) for k, v in body.items()}
    r = api("POST", "/v1/models/import", body)
    assert r.status == 400, r.body
    assert r.json["error"]["param"] == param and words in r.json["message"]
    assert api("GET", "/v1/models").json["data"] == []


def test_import_of_a_taken_id_is_a_conflict(api, gguf, imported):
    r = api("POST", "/v1/models/import", {"path": str(gguf), "id": "me/tiny:chat"})
    assert r.status == 409 and r.json["error"]["param"] == "id"


def test_list_and_get(api, imported):
    listed = api("GET", "/v1/models").json
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["me/tiny:chat"]
    row = listed["data"][0]
    assert {"id", "object", "created", "owned_by", "engine", "size", "status"} <= set(row)
    assert "chat_template" not in row["metadata"]  # the list stays light
    one = api("GET", "/v1/models/me/tiny:chat").json
    assert one["metadata"]["chat_template"]
    r = api("GET", "/v1/models/nope")
    assert r.status == 404 and r.json["error"]["code"] == "model_not_found"


def test_update_changes_only_the_given_parameters(api, imported):
    r = api("PATCH", "/v1/models/me/tiny:chat", {"ctx_len": 2048, "stop": ["<|end|>"],
                                                  "temperature": 0.2})
    assert r.status == 200, r.body
    model = api("GET", "/v1/models/me/tiny:chat").json
    assert (model["ctx_len"], model["stop"], model["temperature"]) == (2048, ["<|end|>"], 0.2)
    assert model["name"] == "tiny-chat"
    stored = json.loads(open(os.path.join(model["path"], "model.json")).read())
    assert stored["ctx_len"] == 2048 and "path" not in stored and "status" not in stored


@pytest.mark.parametrize("body, param", [
    ({"ctx_len": "big"}, "ctx_len"),
    ({"ctx_len": 0}, "ctx_len"),
    ({"bogus": 1}, "bogus"),
    ({"id": "other"}, "id"),
    ({"cache_type": "f8"}, "cache_type"),
    ({"stop": "x"}, "stop"),
])
def test_bad_updates_change_nothing(api, imported, body, param):
    before = api("GET", "/v1/models/me/tiny:chat").json
    r = api("PATCH", "/v1/models/me/tiny:chat", body)
    assert r.status == 400 and r.json["error"]["param"] == param, r.body
    assert api("GET", "/v1/models/me/tiny:chat").json == before


def test_update_with_the_same_id_is_fine(api, imported):
    r = api("PATCH", "/v1/models/me/tiny:chat", {"id": "me/tiny:chat", "top_k": 5})
    assert r.status == 200 and r.json["model"]["top_k"] == 5
    assert api("PATCH", "/v1/models/nope", {"top_k": 5}).status == 404


def test_remove_deletes_the_link_but_never_the_imported_file(api, gguf, imported):
    r = api("DELETE", "/v1/models/me/tiny:chat")
    assert r.status == 200 and r.json["deleted"] is True
    assert not os.path.exists(imported["path"])
    assert gguf.is_file()
    assert api("GET", "/v1/models").json["data"] == []
    assert api("DELETE", "/v1/models/me/tiny:chat").status == 404


@pytest.mark.live
def test_running_models_cannot_be_removed(app, api, imported):
    assert api("POST", "/v1/models/start", {"model": "me/tiny:chat"}).status == 200
    assert api("GET", "/v1/models/me/tiny:chat").json["status"] == "running"
    r = api("DELETE", "/v1/models/me/tiny:chat")
    assert r.status == 409 and "running" in r.json["message"]
    assert api("GET", "/v1/models/me/tiny:chat").status == 200


def test_ids_with_slashes_and_colons_work_url_encoded(live_server, gguf):
    url = live_server.url
    status, _ = send(url, "POST", "/v1/models/import", {"path": str(gguf), "id": "me/tiny:chat"})
    assert status == 200
    for path in ("/v1/models/me/tiny:chat", "/v1/models/me%2Ftiny%3Achat",
                 "/v1/models/me%2ftiny:chat"):
        status, body = send(url, "GET", path)
        assert (status, body["id"]) == (200, "me/tiny:chat"), path
    status, body = send(url, "PATCH", "/v1/models/me%2Ftiny%3Achat", {"ctx_len": 1024})
    assert status == 200 and body["model"]["ctx_len"] == 1024
    status, _ = send(url, "DELETE", "/v1/models/me%2Ftiny%3Achat")
    assert status == 200


def test_long_ids_and_a_folder_deleted_by_hand(api, gguf):
    import shutil

    long_id = "é" * 120  # 240 bytes: allowed, but too long to quote into a folder name
    r = api("POST", "/v1/models/import", {"path": str(gguf), "id": long_id})
    assert r.status == 200, r.body
    shutil.rmtree(r.json["model"]["path"])
    wsgi_path = f"/v1/models/{long_id}".encode().decode("latin-1")  # PEP 3333
    assert api("DELETE", wsgi_path).status == 200
    assert api("GET", "/v1/models").json["data"] == []
