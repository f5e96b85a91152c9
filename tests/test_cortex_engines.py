"""cortex.cpp's engine calls and download events, through a real server (issue 15).

Each call is made as cortex's clients make it (`{"version", "variant"}` bodies, "latest",
versions with a "v"), against a `localrt start --foreground` child whose package index
is the emulator serving the real onnxruntime-genai wheels (tests/.engine-wheels). The
checks are cortex's status codes and shapes, and what each call did to the engines.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import urllib.request
from importlib import metadata

import pytest
from emulators.enginepkg import build_echo_engine_wheel, build_wheel
from emulators.pkgindex import PackageIndex
from support import WHEELS
from support.servers import run_foreground_server, send

from localrt import settings as settings_mod

pytestmark = pytest.mark.live

CORTEX_EVENTS = ("DownloadStarted", "DownloadUpdated", "DownloadSuccess", "DownloadStopped",
                 "DownloadError")
ENDS = ("DownloadSuccess", "DownloadError", "DownloadStopped")
ONNX = "onnx-runtime"
GGUF_VERSION = metadata.version("llama-cpp-python")
ISO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z\Z")


def index_dir_with(root, *extra):
    """A folder for the index: the real engine wheels, and `extra` (name, version) wheels."""
    root.mkdir(parents=True, exist_ok=True)
    for wheel in WHEELS.glob("*.whl"):
        (root / wheel.name).symlink_to(wheel)
    for name, version in extra:
        build_wheel(root, name, version, {f"{name.replace('-', '_')}_stub/__init__.py": ""})
    return root


def start_server(home, index):
    """A real server whose engine index is `index`."""
    settings = settings_mod.load(environ={"HOME": str(home)})
    settings.update({"engineIndexUrl": index.url})
    return run_foreground_server(home)


@pytest.fixture(scope="module")
def browsing(tmp_path_factory):
    """A server for calls that change nothing, with two more releases in its index: an
    onnxruntime-genai release candidate and a gguf-cpp avx2 build."""
    root = tmp_path_factory.mktemp("cortex-index")
    index_dir_with(root / "files", ("onnxruntime-genai", "0.19.0rc1"),
                   ("llama-cpp-python", "0.3.99+avx2"))
    with PackageIndex(root / "files") as index:
        home = root / "home"
        home.mkdir()
        srv = start_server(home, index)
        try:
            yield srv
        finally:
            srv.stop()


@pytest.fixture
def index(tmp_path):
    with PackageIndex(index_dir_with(tmp_path / "index")) as emu:
        yield emu


@pytest.fixture
def server(home, index):
    srv = start_server(home, index)
    yield srv
    srv.stop(sig=signal.SIGKILL if srv.process.poll() is None else signal.SIGTERM)


class Events:
    """GET /v1/events of a real server, read by a thread from the start."""

    def __init__(self, url: str):
        self.events: list = []
        self._changed = threading.Condition()
        self._open = threading.Event()
        threading.Thread(target=self._read, args=(url,), daemon=True).start()
        assert self._open.wait(10)

    def _read(self, url):
        with urllib.request.urlopen(url + "/v1/events", timeout=120) as resp:
            self.content_type = resp.headers["Content-Type"]
            self._open.set()
            for line in resp:
                if line.startswith(b"data: "):
                    with self._changed:
                        self.events.append(json.loads(line[6:]))
                        self._changed.notify_all()

    def mark(self) -> int:
        """Where the next task's events will start."""
        with self._changed:
            return len(self.events)

    def of_task(self, task_id: str, since: int, timeout: float = 90.0) -> list:
        """The events of a task after `since`, up to its last one."""
        def ended():
            return any(e["type"] in ENDS and e["task"]["id"] == task_id
                       for e in self.events[since:])
        with self._changed:
            assert self._changed.wait_for(ended, timeout), self.events[since:]
            return [e for e in self.events[since:] if e["task"]["id"] == task_id]


def check_cortex_shape(event: dict) -> None:
    """cortex's DownloadEvent: {type, task: {id, type, items: [{id, downloadUrl, localPath,
    checksum, bytes, downloadedBytes}]}}, with localrt's fields alongside."""
    assert event["type"] in CORTEX_EVENTS
    task = event["task"]
    assert isinstance(task["id"], str) and task["type"] == "Engine"
    assert task["items"]
    for item in task["items"]:
        assert isinstance(item["id"], str) and isinstance(item["localPath"], str)
        assert item["downloadUrl"] == item["url"]
        assert item["checksum"] is None or re.fullmatch(r"[0-9a-f]{64}", item["checksum"])
        assert isinstance(item["bytes"], int) and isinstance(item["downloadedBytes"], int)
        assert 0 <= item["downloadedBytes"] <= item["bytes"]


def engines(url) -> dict:
    status, body = send(url, "GET", "/v1/engines")
    assert status == 200
    return {e["name"]: e for e in body["data"]}


def install(url, events, engine, body=None, timeout=90.0):
    """POST .../install as cortex sends it; (reply, the task's events to its end)."""
    since = events.mark()
    status, reply = send(url, "POST", f"/v1/engines/{engine}/install", body, timeout=60)
    assert status == 200, reply
    task_events = events.of_task(reply["task"]["id"], since, timeout)
    for event in task_events:
        check_cortex_shape(event)
    return reply, task_events


# --- releases ------------------------------------------------------------------------


def test_releases_list_the_versions_the_index_has(browsing):
    status, releases = send(browsing.url, "GET", f"/v1/engines/{ONNX}/releases")
    assert status == 200
    assert [r["name"] for r in releases] == ["v0.19.0rc1", "v0.18.0"]  # newest first
    rc, final = releases
    assert (final["version"], final["draft"], final["prerelease"]) == ("0.18.0", False, False)
    assert rc["prerelease"] is True
    assert final["url"].endswith("/simple/onnxruntime-genai/")
    assert ISO_TIME.match(final["published_at"])  # the index's upload-time (PEP 700)
    assert final["variants"] == ["linux-amd64"]  # no onnxruntime-genai-cuda in the index

    status, variants = send(browsing.url, "GET", f"/v1/engines/{ONNX}/releases/v0.18.0")
    assert status == 200
    (row,) = variants
    assert (row["name"], row["version"], row["compatible"]) == ("linux-amd64", "v0.18.0", True)
    assert row["file"].startswith("onnxruntime_genai-0.18.0-") and row["size"] > 1_000_000
    assert ISO_TIME.match(row["created_at"])
    # "latest" is what an install without a version takes: the newest final version.
    status, latest = send(browsing.url, "GET", f"/v1/engines/{ONNX}/releases/latest")
    assert status == 200 and [r["version"] for r in latest] == ["v0.18.0"]
    status, rc_variants = send(browsing.url, "GET", f"/v1/engines/{ONNX}/releases/0.19.0rc1")
    assert status == 200 and rc_variants[0]["file"].endswith("-py3-none-any.whl")
    # A version the index lacks has no variants, as cortex answers.
    assert send(browsing.url, "GET", f"/v1/engines/{ONNX}/releases/v9.9.9") == (200, [])

    # gguf-cpp's releases are llama-cpp-python wheels; a local label names the variant.
    status, releases = send(browsing.url, "GET", "/v1/engines/gguf-cpp/releases")
    assert status == 200
    assert [(r["name"], r["variants"]) for r in releases] == \
        [("v0.3.99", ["linux-amd64-avx2"])]
    status, variants = send(browsing.url, "GET", "/v1/engines/gguf-cpp/releases/v0.3.99")
    assert [v["name"] for v in variants] == ["linux-amd64-avx2"]
    assert isinstance(variants[0]["compatible"], bool)


def test_releases_of_what_cannot_have_any(browsing):
    status, body = send(browsing.url, "GET", "/v1/engines/nope/releases")
    assert status == 404 and body["error"]["param"] == "engine"
    status, body = send(browsing.url, "GET", f"/v1/engines/{ONNX}/releases/not-a-version")
    assert status == 400 and body["error"]["param"] == "version"
    assert "not-a-version" in body["error"]["message"]


# --- a version or variant the index lacks ----------------------------------------------


def test_an_unknown_version_or_variant_is_400_naming_it_and_what_exists(browsing):
    status, body = send(browsing.url, "POST", f"/v1/engines/{ONNX}/install",
                        {"version": "v9.9.9", "variant": "linux-amd64"})
    assert status == 400 and body["error"]["param"] == "version"
    assert "9.9.9" in body["message"] and "v0.18.0" in body["message"]
    for variant in ("windows-amd64", "linux-amd64-metal"):
        status, body = send(browsing.url, "POST", f"/v1/engines/{ONNX}/install",
                            {"variant": variant})
        assert status == 400 and body["error"]["param"] == "variant"
        assert variant in body["message"] and "linux-amd64-cuda-12" in body["message"]
    # A version that is no version is a 400 too (it was a 500).
    status, body = send(browsing.url, "POST", f"/v1/engines/{ONNX}/install",
                        {"version": "b4932"})
    assert status == 400 and body["error"]["param"] == "version"
    # gguf-cpp lists the build that ships with localrt among what exists.
    status, body = send(browsing.url, "POST", "/v1/engines/gguf-cpp/install",
                        {"version": "9.9.9"})
    assert status == 400 and body["error"]["param"] == "version"
    assert f"v{GGUF_VERSION} (the build that ships with localrt" in body["message"]
    assert engines(browsing.url)[ONNX]["status"] == "Not Installed"


# --- install, default, install again, uninstall ------------------------------------------


def test_install_default_install_again_and_uninstall(server, index, settings):
    url = server.url
    events = Events(url)
    assert events.content_type.startswith("text/event-stream")
    status, body = send(url, "GET", f"/v1/engines/{ONNX}/default")
    assert status == 409 and body["error"]["code"] == "engine_not_installed"

    reply, task_events = install(url, events, ONNX,
                                 {"version": "v0.18.0", "variant": "linux-amd64"})
    assert reply["message"] == f"Engine {ONNX} starts installing"
    types = [e["type"] for e in task_events]
    assert types[0] == "DownloadStarted" and types[-1] == "DownloadSuccess", types
    done = task_events[-1]["task"]
    assert done["status"] == "Success"
    wheels = {i["id"]: i for i in done["items"]}
    genai = next(i for name, i in wheels.items() if name.startswith("onnxruntime_genai-0.18.0"))
    assert genai["downloadUrl"].startswith(index.root_url + "/files/")
    assert re.fullmatch(r"[0-9a-f]{64}", genai["checksum"])
    assert genai["downloadedBytes"] == genai["bytes"] > 1_000_000
    onnx = engines(url)[ONNX]
    assert (onnx["status"], onnx["version"], onnx["variant"]) == \
        ("Ready", "v0.18.0", "linux-amd64")
    assert send(url, "GET", f"/v1/engines/{ONNX}/default") == \
        (200, {"engine": ONNX, "variant": "linux-amd64", "version": "v0.18.0"})
    status, body = send(url, "POST", f"/v1/engines/{ONNX}/default",
                        {"version": "v0.18.0", "variant": "linux-amd64"})
    assert status == 200 and "linux-amd64" in body["message"]
    status, body = send(url, "POST", f"/v1/engines/{ONNX}/default",
                        {"version": "v0.17.0", "variant": "linux-amd64"})
    assert status == 409 and body["error"]["code"] == "engine_not_installed"

    # Installing it again (as "latest", cortex's default) fetches nothing: the task
    # checks every installed file against its wheel's RECORD and ends with success.
    fetched = sum(1 for r in index.requests if r.path.startswith("/files/"))
    reply, task_events = install(url, events, ONNX, {"version": "latest"})
    assert reply["message"] == \
        f"Engine {ONNX} v0.18.0 (linux-amd64) is already installed; checking its files"
    types = [e["type"] for e in task_events]
    assert types[0] == "DownloadStarted" and types[-1] == "DownloadSuccess", types
    checked = task_events[-1]["task"]
    assert sorted(i["id"] for i in checked["items"]) == sorted(wheels)
    for item in checked["items"]:
        assert item["localPath"].endswith(".dist-info") and item["checksum"] is None
        assert item["downloadUrl"].startswith("file://")
        assert item["downloadedBytes"] == item["bytes"] > 0
    assert sum(1 for r in index.requests if r.path.startswith("/files/")) == fetched

    # A changed file fails the check and is named; the engine stays as it was.
    folder = settings.data_dir / "engines" / ONNX / "linux-amd64" / "0.18.0"
    changed = folder / "onnxruntime_genai" / "__init__.py"
    changed.write_text(changed.read_text() + "# changed\n")
    reply, task_events = install(url, events, ONNX, {"variant": "linux-amd64"})
    failed = task_events[-1]
    assert failed["type"] == "DownloadError", [e["type"] for e in task_events]
    assert str(changed) in failed["task"]["error"]
    assert "changed since it was installed" in failed["task"]["error"]
    assert engines(url)[ONNX]["status"] == "Ready"

    # Uninstall takes the same body; then the engine is gone everywhere.
    status, body = send(url, "DELETE", f"/v1/engines/{ONNX}/install",
                        {"version": "v0.18.0", "variant": "linux-amd64"})
    assert (status, body) == (200, {"message": f"Engine {ONNX} uninstalled successfully"})
    assert not folder.exists()
    assert send(url, "GET", f"/engines/{ONNX}") == (200, [])
    assert engines(url)[ONNX]["status"] == "Not Installed"
    assert send(url, "GET", f"/v1/engines/{ONNX}/default")[0] == 409
    status, body = send(url, "DELETE", f"/v1/engines/{ONNX}/install",
                        {"version": "v0.18.0", "variant": "linux-amd64"})
    assert status == 409 and body["error"]["code"] == "engine_not_installed"
    # After the uninstall an install fetches it afresh, and the changed file is mended.
    reply, task_events = install(url, events, ONNX)
    assert task_events[-1]["type"] == "DownloadSuccess"
    assert "# changed" not in changed.read_text()


# --- the build that ships with localrt ----------------------------------------------------


def test_the_shipped_gguf_build_uninstalls_and_installs_for_real(server):
    url = server.url
    events = Events(url)
    status, rows = send(url, "GET", "/engines/gguf-cpp")
    assert status == 200
    (shipped,) = rows
    assert (shipped["version"], shipped["builtin"]) == (f"v{GGUF_VERSION}", True)
    assert send(url, "GET", "/v1/engines/gguf-cpp/default") == \
        (200, {"engine": "gguf-cpp", "variant": shipped["name"],
               "version": f"v{GGUF_VERSION}"})

    # Installing it while it is installed checks llama-cpp-python against pip's RECORD.
    reply, task_events = install(url, events, "gguf-cpp")
    assert "is already installed; checking its files" in reply["message"]
    assert task_events[-1]["type"] == "DownloadSuccess"
    (item,) = task_events[-1]["task"]["items"]
    assert item["id"] == f"llama_cpp_python-{GGUF_VERSION}.dist-info"
    assert item["downloadedBytes"] == item["bytes"] > 1_000_000

    # Uninstalled, it leaves the variants list and the engine is Not Installed.
    status, body = send(url, "DELETE", "/v1/engines/gguf-cpp/install",
                        {"version": f"v{GGUF_VERSION}", "variant": shipped["name"]})
    assert (status, body) == (200, {"message": "Engine gguf-cpp uninstalled successfully"})
    assert send(url, "GET", "/engines/gguf-cpp") == (200, [])
    assert send(url, "GET", "/v1/engines/gguf-cpp") == (200, [])
    gguf = engines(url)["gguf-cpp"]
    assert (gguf["status"], gguf["version"], gguf["variant"]) == ("Not Installed", "", "")
    assert send(url, "GET", "/v1/engines/gguf-cpp/default")[0] == 409
    status, body = send(url, "POST", "/v1/engines/gguf-cpp/default",
                        {"version": f"v{GGUF_VERSION}", "variant": shipped["name"]})
    assert status == 409 and body["error"]["code"] == "engine_not_installed"
    status, body = send(url, "DELETE", "/v1/engines/gguf-cpp/install")
    assert status == 409 and body["error"]["code"] == "engine_not_installed"

    # Installing it again is an install like any other: a task and its events, then
    # it is back in the list, Ready and the default.
    reply, task_events = install(url, events, "gguf-cpp",
                                 {"version": f"v{GGUF_VERSION}", "variant": shipped["name"]})
    assert reply["message"] == "Engine gguf-cpp starts installing"
    types = [e["type"] for e in task_events]
    assert types[0] == "DownloadStarted" and types[-1] == "DownloadSuccess", types
    assert task_events[-1]["task"]["status"] == "Success"
    assert send(url, "GET", "/engines/gguf-cpp") == (200, rows)
    assert engines(url)["gguf-cpp"]["status"] == "Ready"
    assert send(url, "GET", "/v1/engines/gguf-cpp/default")[1]["version"] == \
        f"v{GGUF_VERSION}"


def test_a_custom_engine_has_a_default_but_no_releases(server, tmp_path):
    url = server.url
    events = Events(url)
    wheel = build_echo_engine_wheel(tmp_path / "dist")
    since = events.mark()
    status, reply = send(url, "POST", "/v1/engines/install", {"wheel": str(wheel)})
    assert status == 200, reply
    assert events.of_task(reply["task"]["id"], since)[-1]["type"] == "DownloadSuccess"
    assert send(url, "GET", "/v1/engines/echo/default") == \
        (200, {"engine": "echo", "variant": "linux-amd64", "version": "v1.0.0"})
    status, body = send(url, "GET", "/v1/engines/echo/releases")
    assert status == 400 and "custom engine" in body["message"]


# --- what an installed variant's check reads ----------------------------------------------


def test_recorded_files_are_where_unpack_put_them(tmp_path):
    """A check reads each wheel's RECORD: `.data/purelib` files are where unpack put them,
    parts unpack skips and files outside the folder (pip's scripts) are not checked."""
    from localrt.engines import wheels

    wheel = build_wheel(tmp_path / "dist", "some-engine", "1.0",
                        {"some_engine/__init__.py": "A = 1\n",
                         "some_engine-1.0.data/purelib/extra.py": "B = 2\n",
                         "some_engine-1.0.data/scripts/tool": "#!/bin/sh\n"})
    site = tmp_path / "site"
    wheels.unpack(wheel, site)
    dist_info = site / "some_engine-1.0.dist-info"
    with open(dist_info / "RECORD", "a") as record:
        record.write("../../bin/tool,sha256=AAAA,4\n")
    found = {path.relative_to(site).as_posix(): size
             for path, _, size in wheels.recorded_files(dist_info)}
    assert found == {"some_engine/__init__.py": 6, "extra.py": 6,
                     "some_engine-1.0.dist-info/METADATA": len(
                         (dist_info / "METADATA").read_bytes()),
                     "some_engine-1.0.dist-info/WHEEL": len((dist_info / "WHEEL").read_bytes())}
    assert all(path.is_file() for path, _, _ in wheels.recorded_files(dist_info))
