"""Self-test of the test-support modules hubemu (hub emulator) and ggufgen (tiny GGUFs).

Only the standard library talks to the emulator here (urllib, http.client).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import ssl
import time
import urllib.error
import urllib.request

import pytest

from ggufgen import read_gguf_metadata, write_fake_blob, write_gguf
from hubemu import HubEmulator

REPO = "acme/tiny-llama"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # urllib then raises HTTPError for the 3xx, which fetch() returns


def fetch(url, headers=None, method="GET", follow=True, context=None, unredirected=None):
    """(status, headers, body) for one request; errors are returned, not raised."""
    # An empty ProxyHandler: ignore any proxy settings in the environment.
    handlers = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    if not follow:
        handlers.append(_NoRedirect())
    opener = urllib.request.build_opener(*handlers)
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    for name, value in (unredirected or {}).items():
        req.add_unredirected_header(name, value)
    try:
        with opener.open(req, timeout=10) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.headers, err.read()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", context_length=512)


@pytest.fixture
def hub(model):
    with HubEmulator() as hub:
        hub.add_repo(REPO, {"model.yml": b"name: tiny\n", "model.gguf": model},
                     branches={"q8": {"model.yml": b"name: tiny-q8\n", "model.gguf": model}})
        yield hub


def test_write_gguf(tmp_path, model):
    import gguf

    assert model.read_bytes()[:4] == b"GGUF"
    assert 100_000 < model.stat().st_size < 1_000_000
    reader = gguf.GGUFReader(model)
    assert reader.get_field("llama.context_length").contents() == 512
    meta = read_gguf_metadata(model)
    assert meta["general.architecture"] == "llama"
    assert meta["tokenizer.ggml.model"] == "llama"
    assert "<|im_start|>" in meta["tokenizer.chat_template"]
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output.weight", "blk.0.ffn_down.weight"} <= names

    f16 = write_gguf(tmp_path / "f16.gguf", file_type="F16", n_layer=2, chat_template=None)
    reader = gguf.GGUFReader(f16)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.1.attn_q.weight"] == "F16" and types["output_norm.weight"] == "F32"
    assert "tokenizer.chat_template" not in read_gguf_metadata(f16)

    blob = write_fake_blob(tmp_path / "blob", 300_000, seed=1)
    assert blob.stat().st_size == 300_000
    assert write_fake_blob(tmp_path / "blob2", 300_000, seed=1).read_bytes() == blob.read_bytes()


def test_api_tree_refs(hub, model):
    status, _, body = fetch(f"{hub.url}/api/models/{REPO}")
    info = json.loads(body)
    assert status == 200 and info["id"] == info["modelId"] == REPO
    assert info["gated"] is False and info["sha"] == hub.commit_sha(REPO)
    assert sorted(s["rfilename"] for s in info["siblings"]) == ["model.gguf", "model.yml"]

    status, _, body = fetch(f"{hub.url}/api/models/{REPO}/revision/q8")
    assert status == 200 and json.loads(body)["sha"] == hub.commit_sha(REPO, "q8")
    assert hub.commit_sha(REPO, "q8") != hub.commit_sha(REPO)

    status, _, body = fetch(f"{hub.url}/api/models/{REPO}/tree/main?recursive=1")
    tree = {e["path"]: e for e in json.loads(body)}
    assert status == 200 and tree.keys() == {"model.gguf", "model.yml"}
    data = model.read_bytes()
    assert tree["model.gguf"]["size"] == len(data)
    assert tree["model.gguf"]["lfs"]["oid"] == hashlib.sha256(data).hexdigest()
    assert "lfs" not in tree["model.yml"] and len(tree["model.yml"]["oid"]) == 40

    status, _, body = fetch(f"{hub.url}/api/models/{REPO}/refs")
    refs = json.loads(body)
    assert {b["name"]: b["targetCommit"] for b in refs["branches"]} == {
        "main": hub.commit_sha(REPO), "q8": hub.commit_sha(REPO, "q8")}

    assert fetch(f"{hub.url}/api/models/acme/nope")[0] == 404
    assert json.loads(fetch(f"{hub.url}/api/models/{REPO}/revision/nope")[2]) == {
        "error": "Revision not found"}
    status, headers, body = fetch(f"{hub.url}/{REPO}/resolve/main/missing.txt")
    assert status == 404 and json.loads(body) == {"error": "Entry not found"}
    assert headers["X-Error-Code"] == "EntryNotFound"


def test_resolve_small_file_and_redirect(hub, model):
    status, headers, body = fetch(f"{hub.url}/{REPO}/resolve/q8/model.yml")
    assert (status, body) == (200, b"name: tiny-q8\n")
    assert headers["X-Repo-Commit"] == hub.commit_sha(REPO, "q8")
    assert headers["ETag"] == f'"{hub.file(REPO, "model.yml", "q8").git_oid}"'

    # Without following: the 302 and its X-Linked-* headers.
    status, headers, _ = fetch(f"{hub.url}/{REPO}/resolve/main/model.gguf", method="HEAD",
                               follow=False)
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    assert status == 302 and headers["Location"].startswith(hub.cdn_url + "/repos/")
    assert headers["X-Linked-Etag"] == f'"{sha}"'
    assert int(headers["X-Linked-Size"]) == model.stat().st_size

    hub.clear_requests()
    status, _, body = fetch(f"{hub.url}/{REPO}/resolve/main/model.gguf",
                            unredirected={"Authorization": "Bearer secret"})
    assert status == 200 and body == model.read_bytes()
    assert [(r.server, r.method, r.status) for r in hub.requests] == [
        ("hub", "GET", 302), ("cdn", "GET", 200)]
    assert hub.requests_to("hub")[0].headers["authorization"] == "Bearer secret"
    assert "authorization" not in hub.requests_to("cdn")[0].headers

    hub.redirect_to_cdn = False
    hub.clear_requests()
    status, _, body = fetch(f"{hub.url}/{REPO}/resolve/main/model.gguf")
    assert status == 200 and body == model.read_bytes()
    assert [r.server for r in hub.requests] == ["hub"]


@pytest.mark.parametrize("via_cdn", [True, False])
def test_range(hub, model, via_cdn):
    hub.redirect_to_cdn = via_cdn
    data = model.read_bytes()
    url = f"{hub.url}/{REPO}/resolve/main/model.gguf"
    status, headers, body = fetch(url, {"Range": "bytes=1000-"})
    assert status == 206 and body == data[1000:]
    assert headers["Content-Range"] == f"bytes 1000-{len(data) - 1}/{len(data)}"
    assert hub.requests[-1].range == "bytes=1000-"
    status, headers, body = fetch(url, {"Range": "bytes=10-19"})
    assert (status, body, headers["Content-Length"]) == (206, data[10:20], "10")
    status, headers, _ = fetch(url, {"Range": f"bytes={len(data)}-"})
    assert status == 416 and headers["Content-Range"] == f"bytes */{len(data)}"
    status, headers, _ = fetch(url)
    assert status == 200 and headers["Accept-Ranges"] == "bytes"


def test_keep_alive(hub):
    conn = http.client.HTTPConnection("127.0.0.1", hub.port, timeout=10)
    try:
        for _ in range(3):
            conn.request("GET", f"/{REPO}/resolve/main/model.yml")
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read() == b"name: tiny\n"
            conn.request("GET", f"/api/models/{REPO}/nonsense")
            resp = conn.getresponse()
            assert resp.status == 404 and resp.read()
        sock = conn.sock
        conn.request("HEAD", f"/{REPO}/resolve/main/model.gguf")
        resp = conn.getresponse()
        assert resp.status == 302 and resp.read() == b""
        assert conn.sock is sock  # still the first connection
    finally:
        conn.close()


def test_gated(hub, model):
    hub.add_repo("acme/gated", {"model.gguf": model, "model.yml": b"x: 1\n"},
                 gated_token="hf_good")
    for url in (f"{hub.url}/api/models/acme/gated",
                f"{hub.url}/api/models/acme/gated/tree/main",
                f"{hub.url}/acme/gated/resolve/main/model.yml"):
        status, headers, body = fetch(url)
        assert status == 401 and "Please log in" in json.loads(body)["error"]
        assert headers["X-Error-Code"] == "GatedRepo"
        status, _, body = fetch(url, {"Authorization": "Bearer hf_bad"})
        assert status == 403 and json.loads(body)["error"]
        status, _, _ = fetch(url, {"Authorization": "Bearer hf_good"})
        assert status == 200
    status, _, body = fetch(f"{hub.url}/api/models/acme/gated",
                            {"Authorization": "Bearer hf_good"})
    assert json.loads(body)["gated"] == "manual"


def test_drop_after(hub, model):
    url = f"{hub.url}/{REPO}/resolve/main/model.gguf"
    hub.drop_after = 5000
    with pytest.raises(http.client.IncompleteRead) as info:
        fetch(url)
    assert len(info.value.partial) == 5000
    assert hub.drop_after is None  # drop_once
    assert fetch(url)[2] == model.read_bytes()

    hub.drop_once = False
    hub.drop_after = 10
    for _ in range(2):
        with pytest.raises(http.client.IncompleteRead):
            fetch(url, {"Range": "bytes=100-"})


def test_corrupt(hub, model):
    hub.corrupt = True
    body = fetch(f"{hub.url}/{REPO}/resolve/main/model.gguf")[2]
    data = model.read_bytes()
    assert len(body) == len(data)
    assert [i for i in range(len(data)) if body[i] != data[i]] == [len(data) // 2]


def test_fail_status(hub):
    url = f"{hub.url}/{REPO}/resolve/main/model.yml"
    hub.fail_status = [503, 503]
    assert fetch(url)[0] == 503
    status, _, body = fetch(url)
    assert status == 503 and "error" in json.loads(body)
    assert fetch(url)[0] == 200


def test_delay_and_streamed_path(hub, tmp_path):
    blob = write_fake_blob(tmp_path / "weights.bin", 3 * 64 * 1024 + 7, seed=3)
    hub.add_repo("acme/blob", {"weights.bin": blob})
    hub.delay_per_chunk = 0.05
    start = time.monotonic()
    status, _, body = fetch(f"{hub.url}/acme/blob/resolve/main/weights.bin")
    assert status == 200 and body == blob.read_bytes()
    assert time.monotonic() - start >= 0.15  # four chunks, three pauses


def test_tls(model):
    import trustme

    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    with HubEmulator(ssl_context=server_ctx) as hub:
        hub.add_repo(REPO, {"model.gguf": model})
        assert hub.url.startswith("https://") and hub.cdn_url.startswith("https://")
        status, _, body = fetch(f"{hub.url}/{REPO}/resolve/main/model.gguf",
                                context=client_ctx)
        assert status == 200 and body == model.read_bytes()
        assert [r.server for r in hub.requests] == ["hub", "cdn"]
        status, _, body = fetch(f"{hub.url}/{REPO}/resolve/main/model.gguf",
                                {"Range": "bytes=4-"}, context=client_ctx)
        assert status == 206 and body == model.read_bytes()[4:]
        # A client that does not trust the CA fails the handshake; the hub stays up.
        with pytest.raises(urllib.error.URLError):
            fetch(f"{hub.url}/api/models/{REPO}", context=ssl.create_default_context())
        assert fetch(f"{hub.url}/api/models/{REPO}", context=client_ctx)[0] == 200
