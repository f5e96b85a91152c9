"""Self-test of the test-support modules pkgindex (package index) and enginepkg (echo
engine wheel).

The index is checked with the standard library (urllib, http.client) and once with pip,
which installs the echo wheel through it; the installed engine then runs in a child
Python that finds it by its entry point.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import http.client
import io
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import zipfile
from datetime import datetime, timezone
from pathlib import Path

import pytest

from emulators.enginepkg import (ENTRY_POINT_GROUP, build_echo_engine_wheel, wheel_filename,
                                 write_echo_model)
from emulators.pkgindex import CHUNK, JSON_TYPE, PackageIndex

pytestmark = pytest.mark.live

PROJECT = "localrt-echo-engine"
WHEEL = wheel_filename()
SDIST = "localrt_echo_engine-0.9.0.tar.gz"
BIG = "bigpkg-2.0-py3-none-any.whl"  # not a real zip: a stand-in for a large download
BIG_SIZE = 3 * CHUNK + 1234


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # urllib then raises HTTPError for the 3xx, which fetch() returns


def fetch(url, headers=None, method="GET", follow=True):
    """(status, headers, body) for one request; errors are returned, not raised."""
    # An empty ProxyHandler: ignore any proxy settings in the environment.
    handlers = [urllib.request.ProxyHandler({})] + ([] if follow else [_NoRedirect()])
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.build_opener(*handlers).open(req, timeout=10) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.headers, err.read()


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dists")
    build_echo_engine_wheel(path)
    (path / SDIST).write_bytes(b"not really a tarball")
    (path / BIG).write_bytes(os.urandom(BIG_SIZE))
    (path / "README.txt").write_text("not a distribution; the index ignores it")
    return path


@pytest.fixture
def index(dist_dir):
    with PackageIndex(dist_dir) as index:
        yield index


def test_json_project_page(index, dist_dir):
    status, headers, body = fetch(index.url + PROJECT + "/", {"Accept": JSON_TYPE})
    assert status == 200
    assert headers["Content-Type"] == JSON_TYPE
    page = json.loads(body)
    assert page["meta"] == {"api-version": "1.1"}
    assert page["name"] == PROJECT
    assert page["versions"] == ["0.9.0", "1.0.0"]
    files = {f["filename"]: f for f in page["files"]}
    assert set(files) == {SDIST, WHEEL}
    wheel = files[WHEEL]
    assert wheel["hashes"] == {"sha256": sha256_of(dist_dir / WHEEL)}
    assert wheel["requires-python"] == ">=3.9"
    assert wheel["size"] == (dist_dir / WHEEL).stat().st_size
    assert files[SDIST]["requires-python"] is None
    status, _, data = fetch(wheel["url"])
    assert status == 200 and data == (dist_dir / WHEEL).read_bytes()

    status, headers, body = fetch(index.url, {"Accept": f"text/html;q=0.2, {JSON_TYPE}"})
    assert headers["Content-Type"] == JSON_TYPE
    assert json.loads(body)["projects"] == [{"name": "bigpkg"}, {"name": PROJECT}]


def test_json_files_give_their_upload_time(index, dist_dir):
    """PEP 700's upload-time: the file's modification time, in UTC."""
    _, _, body = fetch(index.url + PROJECT + "/", {"Accept": JSON_TYPE})
    wheel = {f["filename"]: f for f in json.loads(body)["files"]}[WHEEL]
    mtime = datetime.fromtimestamp((dist_dir / WHEEL).stat().st_mtime, timezone.utc)
    assert wheel["upload-time"] == mtime.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@pytest.mark.parametrize("accept", [None, "text/html", f"{JSON_TYPE};q=0.5, text/html",
                                    "*/*"])
def test_html_project_page(index, dist_dir, accept):
    status, headers, body = fetch(index.url + PROJECT + "/", {"Accept": accept} if accept else {})
    assert status == 200
    assert headers["Content-Type"].startswith("text/html")
    page = body.decode()
    assert (f'<a href="../../files/{WHEEL}#sha256={sha256_of(dist_dir / WHEEL)}" '
            f'data-requires-python="&gt;=3.9">{WHEEL}</a>') in page
    assert f'<a href="../../files/{SDIST}#sha256={sha256_of(dist_dir / SDIST)}">' in page
    assert '<a href="localrt-echo-engine/">' in fetch(index.url)[2].decode()


def test_html_only_ignores_json_accept(index):
    index.html_only = True
    _, headers, body = fetch(index.url + PROJECT + "/", {"Accept": JSON_TYPE})
    assert headers["Content-Type"].startswith("text/html") and b"<a href=" in body


def test_unknown_project_and_file_are_404(index):
    assert fetch(index.url + "no-such-project/", {"Accept": JSON_TYPE})[0] == 404
    assert fetch(index.url + "no-such-project/")[0] == 404
    assert fetch(index.root_url + "/files/no_such-1.0-py3-none-any.whl")[0] == 404
    assert fetch(index.root_url + "/files/README.txt")[0] == 404


@pytest.mark.parametrize("path", ["Localrt_Echo.Engine/", "localrt-echo-engine"])
def test_non_normalized_project_redirects(index, path):
    status, headers, _ = fetch(index.url + path, follow=False)
    assert status == 301
    assert headers["Location"] == index.url + PROJECT + "/"
    assert fetch(index.url + path)[0] == 200


def test_wrong_sha256_switch(index, dist_dir):
    index.wrong_sha256.add(WHEEL)
    real = sha256_of(dist_dir / WHEEL)
    page = json.loads(fetch(index.url + PROJECT + "/", {"Accept": JSON_TYPE})[2])
    advertised = {f["filename"]: f["hashes"]["sha256"] for f in page["files"]}
    assert advertised[WHEEL] != real and len(advertised[WHEEL]) == 64
    assert advertised[SDIST] == sha256_of(dist_dir / SDIST)
    assert f"#sha256={advertised[WHEEL]}" in fetch(index.url + PROJECT + "/")[2].decode()
    assert hashlib.sha256(fetch(index.root_url + "/files/" + WHEEL)[2]).hexdigest() == real


def test_dropped_download_resumes_with_range(index, dist_dir):
    data = (dist_dir / BIG).read_bytes()
    url = index.root_url + "/files/" + BIG
    index.drop_after = 100_000
    conn = http.client.HTTPConnection("127.0.0.1", index.port, timeout=10)
    conn.request("GET", "/files/" + BIG)
    resp = conn.getresponse()
    assert resp.status == 200 and resp.headers["Content-Length"] == str(BIG_SIZE)
    with pytest.raises(http.client.IncompleteRead) as err:
        resp.read()
    conn.close()
    part = err.value.partial
    assert part == data[:100_000]

    status, headers, rest = fetch(url, {"Range": f"bytes={len(part)}-"})
    assert status == 206
    assert headers["Content-Range"] == f"bytes {len(part)}-{BIG_SIZE - 1}/{BIG_SIZE}"
    assert headers["Content-Length"] == str(BIG_SIZE - len(part))
    assert part + rest == data
    assert fetch(url)[2] == data  # dropped once per file only

    status, headers, _ = fetch(url, {"Range": f"bytes={BIG_SIZE}-"})
    assert status == 416 and headers["Content-Range"] == f"bytes */{BIG_SIZE}"
    status, headers, body = fetch(url, method="HEAD")
    assert (status, headers["Content-Length"], body) == (200, str(BIG_SIZE), b"")
    method, path, logged = index.requests[-1]
    assert (method, path) == ("HEAD", "/files/" + BIG) and "host" in logged


def test_fail_status_and_throttle(index, dist_dir):
    index.fail_status["/simple/"] = 503
    assert fetch(index.url)[0] == 503
    del index.fail_status["/simple/"]

    index.throttle = 0.1
    conn = http.client.HTTPConnection("127.0.0.1", index.port, timeout=10)
    started = time.monotonic()
    conn.request("GET", "/files/" + BIG)
    resp = conn.getresponse()
    first = resp.read(CHUNK)
    assert time.monotonic() - started >= 0.08
    # While that download stalls, other requests are answered.
    assert fetch(index.url)[0] == 200
    index.throttle = 0
    assert first + resp.read() == (dist_dir / BIG).read_bytes()
    conn.close()


def _check_record(wheel: Path) -> None:
    """Every file in the wheel is in RECORD with its right sha256 and size."""
    with zipfile.ZipFile(wheel) as zf:
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(zf.read(record).decode())))
        assert sorted(row[0] for row in rows) == sorted(zf.namelist())
        for path, digest, size in rows:
            if path == record:
                assert digest == size == ""
                continue
            data = zf.read(path)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert (digest, int(size)) == (f"sha256={expected.decode()}", len(data)), path


def test_echo_wheel_is_valid_and_reproducible(tmp_path, dist_dir):
    _check_record(dist_dir / WHEEL)
    again = build_echo_engine_wheel(tmp_path)
    assert again.read_bytes() == (dist_dir / WHEEL).read_bytes()


# Runs in a child Python: argv = site dir, model file.
_ENGINE_SCRIPT = textwrap.dedent(f"""
    import importlib.metadata, json, sys
    sys.path.insert(0, sys.argv[1])
    (ep,) = importlib.metadata.entry_points(group={ENTRY_POINT_GROUP!r}, name="echo")
    engine = ep.load()
    model = engine.load(sys.argv[2], {{"n_ctx": 8}})
    messages = [{{"role": "system", "content": "be brief"}},
                {{"role": "user", "content": "hello there world"}}]
    out = {{"engine": [engine.name, engine.format, engine.version, ep.dist.version],
           "options": model.options,
           "chat": model.chat(messages, {{}}, False),
           "short": model.chat(messages, {{"max_tokens": 2}}, False),
           "stream": list(model.chat(messages, {{}}, True))}}
    try:
        engine.load(sys.argv[2] + ".missing", {{}})
    except FileNotFoundError:
        out["missing"] = "FileNotFoundError"
    model.unload()
    try:
        model.chat(messages, {{}}, False)
    except RuntimeError:
        out["after_unload"] = "RuntimeError"
    print(json.dumps(out))
""")


def test_echo_wheel_installs_through_the_index_and_runs(index, tmp_path):
    site = tmp_path / "site"
    # Only this index: no pip config file and no PIP_* settings (find-links, extra index).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir",
         "--disable-pip-version-check", "--no-compile", "--quiet", "--target", str(site),
         "--index-url", index.url, f"{PROJECT}==1.0.0"],
        env=env, capture_output=True, text=True, timeout=60)
    assert pip.returncode == 0, pip.stderr
    # pip asked for PEP 691 JSON and checked the advertised sha256 against the download.
    page_requests = [r for r in index.requests if r.path == f"/simple/{PROJECT}/"]
    assert page_requests and JSON_TYPE in page_requests[0].headers["accept"]

    model = write_echo_model(tmp_path / "echo.model")
    child = subprocess.run([sys.executable, "-I", "-c", _ENGINE_SCRIPT, str(site), str(model)],
                           capture_output=True, text=True, timeout=30)
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout)
    assert out["engine"] == ["echo", "ECHO", "1.0.0", "1.0.0"]
    assert out["options"] == {"n_ctx": 8}
    assert out["chat"] == {"content": "echo: hello there world", "finish_reason": "stop",
                           "usage": {"prompt_tokens": 5, "completion_tokens": 4}}
    assert out["short"]["content"] == "echo: hello"
    assert out["short"]["finish_reason"] == "length"
    assert out["short"]["usage"]["completion_tokens"] == 2
    assert out["stream"] == ["echo:", " hello", " there", " world"]
    assert out["missing"] == "FileNotFoundError"
    assert out["after_unload"] == "RuntimeError"
