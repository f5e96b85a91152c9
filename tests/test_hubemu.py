"""Self-test of the test-support modules hubemu (hub emulator) and ggufgen (tiny GGUFs).

Only the standard library talks to the emulator here (urllib, http.client).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import ssl
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml

from emulators.ggufgen import read_gguf_metadata, write_fake_blob, write_gguf
from emulators.hubemu import HubEmulator

pytestmark = pytest.mark.live

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
def hub_repos(model):
    """The repos conftest's `hub` serves in this module."""

    def add(hub):
        hub.add_repo(REPO, {"model.yml": b"name: tiny\n", "model.gguf": model},
                     branches={"q8": {"model.yml": b"name: tiny-q8\n", "model.gguf": model}})

    return add


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


def test_gated_lists_without_a_token_but_files_need_one(hub, model):
    hub.add_repo("acme/gated", {"model.gguf": model, "model.yml": b"x: 1\n"},
                 branches={"q8": {"model.yml": b"x: 2\n"}}, gated_token="hf_good")
    # The API is public for a gated repo, with or without a token.
    for auth in ({}, {"Authorization": "Bearer hf_bad"}):
        status, _, body = fetch(f"{hub.url}/api/models/acme/gated", auth)
        assert status == 200 and json.loads(body)["gated"] == "manual"
        status, _, body = fetch(f"{hub.url}/api/models/acme/gated/revision/q8", auth)
        assert status == 200 and json.loads(body)["sha"] == hub.commit_sha("acme/gated", "q8")
        status, _, body = fetch(f"{hub.url}/api/models/acme/gated/tree/main?recursive=1", auth)
        assert status == 200 and {e["path"] for e in json.loads(body)} == {
            "model.gguf", "model.yml"}
        status, _, body = fetch(f"{hub.url}/api/models/acme/gated/refs", auth)
        assert status == 200 and {b["name"] for b in json.loads(body)["branches"]} == {
            "main", "q8"}
    # Files are not: 401 without a token, 403 with the wrong one, GET and HEAD alike.
    for path, content in (("model.yml", b"x: 1\n"), ("model.gguf", model.read_bytes())):
        url = f"{hub.url}/acme/gated/resolve/main/{path}"
        for method in ("GET", "HEAD"):
            status, headers, body = fetch(url, method=method)
            assert status == 401 and headers["X-Error-Code"] == "GatedRepo"
            assert "Please log in" in headers["X-Error-Message"]
            if method == "GET":
                assert "Please log in" in json.loads(body)["error"]
            status, headers, _ = fetch(url, {"Authorization": "Bearer hf_bad"}, method=method)
            assert status == 403 and headers["X-Error-Code"] == "GatedRepo"
            assert "authorized list" in headers["X-Error-Message"]
        status, _, body = fetch(url, unredirected={"Authorization": "Bearer hf_good"})
        assert (status, body) == (200, content)


@pytest.mark.parametrize("status", [401, 404])
def test_unknown_repo(hub, status):
    if status != 401:
        hub.missing_repo_status = status
    for url in (f"{hub.url}/api/models/acme/nope",
                f"{hub.url}/api/models/acme/nope/tree/main?recursive=1",
                f"{hub.url}/api/models/acme/nope/refs",
                f"{hub.url}/acme/nope/resolve/main/model.gguf"):
        for method in ("GET", "HEAD"):
            got, headers, body = fetch(url, method=method)
            assert got == status, url
            assert headers["X-Error-Code"] == "RepoNotFound"
            assert headers["X-Error-Message"] == "Repository not found"
            if method == "GET":
                assert json.loads(body) == {"error": "Repository not found"}
    # An unknown revision or file of a known repo is still a 404.
    got, headers, _ = fetch(f"{hub.url}/api/models/{REPO}/tree/nope")
    assert got == 404 and headers["X-Error-Code"] == "RevisionNotFound"
    got, headers, _ = fetch(f"{hub.url}/{REPO}/resolve/nope/model.yml")
    assert got == 404 and headers["X-Error-Code"] == "RevisionNotFound"
    got, headers, _ = fetch(f"{hub.url}/{REPO}/resolve/main/nope.yml")
    assert got == 404 and headers["X-Error-Code"] == "EntryNotFound"


def _next_link(headers):
    link = headers.get("Link")
    if link is None:
        return None
    m = re.fullmatch(r'<([^>]+)>; rel="next"', link)
    assert m, link
    return m.group(1)


def _all_pages(url):
    """Every entry of a tree listing, following Link headers; also the page lengths."""
    entries, sizes = [], []
    while url:
        status, headers, body = fetch(url)
        assert status == 200, body
        page = json.loads(body)
        entries += page
        sizes.append(len(page))
        url = _next_link(headers)
    return entries, sizes


def test_tree_pagination(hub):
    files = {f"f{i:02}.txt": b"%d" % i for i in range(5)}
    files.update({"sub/a.txt": b"a", "sub/deep/b.txt": b"b"})
    hub.add_repo("acme/many", files)
    base = f"{hub.url}/api/models/acme/many/tree/main"
    everything = json.loads(fetch(base + "?recursive=1")[2])  # one page of 1000
    assert hub.tree_page_size == 1000 and len(everything) == 9

    hub.tree_page_size = 2
    entries, sizes = _all_pages(base + "?recursive=1&expand=false")
    assert entries == everything and sizes == [2, 2, 2, 2, 1]
    entries, sizes = _all_pages(base)
    assert [e["path"] for e in entries] == ["sub"] + sorted(f"f{i:02}.txt" for i in range(5))
    assert sizes == [2, 2, 2]

    status, headers, _ = fetch(base + "?recursive=1&expand=false")
    link = _next_link(headers)
    assert link.startswith(base + "?recursive=1&expand=false&cursor=")
    # The last page says nothing more.
    hub.tree_page_size = len(everything)
    assert "Link" not in fetch(base + "?recursive=1")[1]
    # A folder listing pages too, and its Link keeps the folder.
    hub.tree_page_size = 1
    entries, sizes = _all_pages(base + "/sub?recursive=1")
    assert [e["path"] for e in entries] == ["sub/deep", "sub/a.txt", "sub/deep/b.txt"]

    for cursor in ("garbage!", "eyJmaWxlX25hbWUiOiAibm9wZSJ9"):  # the second: "nope"
        status, _, body = fetch(f"{base}?recursive=1&cursor={cursor}")
        assert status == 400 and "cursor" in json.loads(body)["error"]


def test_refs_include_main(hub):
    refs = json.loads(fetch(f"{hub.url}/api/models/{REPO}/refs")[2])
    assert {b["name"] for b in refs["branches"]} == {"main", "q8"}
    assert all(b["ref"] == "refs/heads/" + b["name"] for b in refs["branches"])


@pytest.mark.parametrize("kind", ["api", "resolve", "cdn"])
def test_rate_limit(hub, kind):
    cdn = fetch(f"{hub.url}/{REPO}/resolve/main/model.gguf", follow=False)[1]["Location"]
    urls = {"api": f"{hub.url}/api/models/{REPO}",
            "resolve": f"{hub.url}/{REPO}/resolve/main/model.yml",
            "cdn": cdn}
    hub.rate_limit_on = {kind}
    hub.rate_limit = [7, 0.5]
    # The other kinds pass through and leave the queue alone.
    for other, url in urls.items():
        if other != kind:
            assert fetch(url)[0] == 200
    assert hub.rate_limit == [7, 0.5]
    hub.clear_requests()
    status, headers, body = fetch(urls[kind])
    assert status == 429 and headers["Retry-After"] == "7"
    assert "X-Error-Code" not in headers and json.loads(body)["error"]
    assert hub.requests[-1].server == ("cdn" if kind == "cdn" else "hub")
    status, headers, _ = fetch(urls[kind], method="HEAD")
    assert status == 429 and headers["Retry-After"] == "1"  # rounded up
    assert hub.rate_limit == [] and fetch(urls[kind])[0] == 200


def test_rate_limit_applies_to_every_kind_by_default(hub):
    location = fetch(f"{hub.url}/{REPO}/resolve/main/model.gguf", follow=False)[1]["Location"]
    hub.rate_limit = [1, 2, 3]
    assert fetch(f"{hub.url}/api/models/{REPO}")[1]["Retry-After"] == "1"
    assert fetch(f"{hub.url}/{REPO}/resolve/main/model.yml")[1]["Retry-After"] == "2"
    status, headers, _ = fetch(location)
    assert status == 429 and headers["Retry-After"] == "3"
    assert fetch(location)[0] == 200


@pytest.fixture
def blob2m(tmp_path):
    return write_fake_blob(tmp_path / "weights.bin", 2 * 1024 * 1024, seed=5)


@pytest.mark.parametrize("via_cdn, as_bytes", [(True, False), (False, False), (True, True)])
def test_bandwidth_cap(hub, blob2m, via_cdn, as_bytes):
    # A Path goes out with sendfile, in slices; bytes through the chunked path.
    hub.add_repo("acme/blob", {"weights.bin": blob2m.read_bytes() if as_bytes else blob2m})
    hub.redirect_to_cdn = via_cdn
    url = f"{hub.url}/acme/blob/resolve/main/weights.bin"
    hub.max_bytes_per_second = 4 * 1024 * 1024
    start = time.monotonic()
    status, _, body = fetch(url)
    elapsed = time.monotonic() - start
    assert status == 200 and body == blob2m.read_bytes()
    assert elapsed >= 0.4  # 2 MiB at 4 MiB/s: about 0.5 s
    # Ranges are paced the same way: the last 1 MiB takes about 0.25 s.
    start = time.monotonic()
    status, _, body = fetch(url, {"Range": "bytes=1048576-"})
    assert status == 206 and body == blob2m.read_bytes()[1048576:]
    assert time.monotonic() - start >= 0.2


def test_bandwidth_cap_is_per_connection(hub, blob2m):
    hub.add_repo("acme/blob", {"weights.bin": blob2m})
    hub.max_bytes_per_second = 2 * 1024 * 1024
    url = f"{hub.url}/acme/blob/resolve/main/weights.bin"
    half = 1024 * 1024
    results, barrier = {}, threading.Barrier(2)

    def get(i):
        barrier.wait()
        begin = time.monotonic()
        status, _, body = fetch(url, {"Range": f"bytes={i * half}-{(i + 1) * half - 1}"})
        results[i] = (status, body, time.monotonic() - begin)

    # What one connection takes for both halves: about 1 s at the cap.
    begin = time.monotonic()
    status, _, body = fetch(url, {"Range": f"bytes=0-{2 * half - 1}"})
    one = time.monotonic() - begin
    assert status == 206 and len(body) == 2 * half

    settled(hub)  # the one connection's body is done on the server's side too
    threads = [threading.Thread(target=get, args=(i,)) for i in range(2)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = time.monotonic() - start
    data = blob2m.read_bytes()
    for i in range(2):
        status, body, elapsed = results[i]
        assert status == 206 and body == data[i * half:(i + 1) * half]
        assert elapsed >= 0.4  # 1 MiB at 2 MiB/s each
    # Each connection had the full rate: together about half of what one connection
    # takes for the same bytes (a shared cap would make it the same). A ratio of two
    # times taken alike, so a busy machine slows both.
    assert total < 0.8 * one, (total, one)
    assert hub.max_concurrent_bodies == 2
    settled(hub)


def settled(hub) -> None:
    """Wait until the hub sends no body, its count restarted. clear_requests() restarts
    the count from the bodies still open; the server may still be finishing one that
    the client has already read in full."""
    deadline = time.monotonic() + 5
    while True:
        hub.clear_requests()
        if hub.max_concurrent_bodies == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert hub.max_concurrent_bodies == 0


def test_add_cortexso(hub, model, tmp_path):
    other = write_fake_blob(tmp_path / "q8.gguf", 50_000, seed=9)
    mmproj = write_fake_blob(tmp_path / "mmproj.gguf", 20_000, seed=8)
    hub.add_cortexso("tinyllm", {
        "1b": {"model.gguf": model, "model.yml": b"name: tinyllm 1b\n"},
        "1b-q8": {"model.gguf": other, "model.yml": b"name: tinyllm q8\n",
                  "mmproj.gguf": mmproj},
    }, default="1b", author="Acme Labs")

    def tree(rev):
        status, _, body = fetch(f"{hub.url}/api/models/cortexso/tinyllm/tree/{rev}?recursive=1")
        assert status == 200
        return {e["path"]: e for e in json.loads(body)}

    main = tree("main")
    assert set(main) == {"README.md", "metadata.yml", "model.yml",
                         "tinyllm-1b.gguf", "tinyllm-1b-q8.gguf"}
    assert main["tinyllm-1b.gguf"]["size"] == model.stat().st_size
    assert main["tinyllm-1b-q8.gguf"]["lfs"]["oid"] == \
        hashlib.sha256(other.read_bytes()).hexdigest()
    assert set(tree("1b")) == {"README.md", "metadata.yml", "model.yml", "model.gguf"}
    assert set(tree("1b-q8")) == {"README.md", "metadata.yml", "model.yml", "model.gguf",
                                  "mmproj.gguf"}
    refs = json.loads(fetch(f"{hub.url}/api/models/cortexso/tinyllm/refs")[2])
    assert {b["name"] for b in refs["branches"]} == {"main", "1b", "1b-q8"}

    for rev in ("main", "1b", "1b-q8"):
        status, _, body = fetch(f"{hub.url}/cortexso/tinyllm/resolve/{rev}/metadata.yml")
        assert status == 200
        assert yaml.safe_load(body) == {"version": 1, "name": "tinyllm", "default": "1b",
                                        "author": "Acme Labs"}
    assert fetch(f"{hub.url}/cortexso/tinyllm/resolve/1b/model.yml")[2] == \
        b"name: tinyllm 1b\n"
    template = fetch(f"{hub.url}/cortexso/tinyllm/resolve/main/model.yml")[2]
    assert yaml.safe_load(template)["model"] == "tinyllm"
    assert fetch(f"{hub.url}/cortexso/tinyllm/resolve/main/tinyllm-1b.gguf")[2] == \
        model.read_bytes()


def test_add_cortexso_options(hub, model):
    hub.add_cortexso("nodefault", {"2b": {"model.gguf": model}}, default=None)
    meta = yaml.safe_load(fetch(f"{hub.url}/cortexso/nodefault/resolve/2b/metadata.yml")[2])
    assert "default" not in meta and meta["name"] == "nodefault"

    hub.add_cortexso("plain", {"2b": {"model.gguf": model}}, org="acme",
                     source_model="Plain-Base", metadata=False, gated_token="hf_ok")
    status, _, body = fetch(f"{hub.url}/api/models/acme/plain/tree/main")
    assert status == 200
    assert {e["path"] for e in json.loads(body)} == {"README.md", "model.yml",
                                                     "Plain-Base-2b.gguf"}
    assert fetch(f"{hub.url}/acme/plain/resolve/2b/model.gguf")[0] == 401
    assert fetch(f"{hub.url}/acme/plain/resolve/2b/README.md",
                 {"Authorization": "Bearer hf_ok"})[0] == 200
    with pytest.raises(ValueError):
        hub.add_cortexso("bad", {"main": {"model.gguf": model}})


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
