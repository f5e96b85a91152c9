"""Big files come as byte ranges over several connections: coverage, resume, cancel, 429s.

Most tests drive `Downloads` directly against the hub emulator over loopback, with a
generated file of random bytes just over 64 MiB (a download does not care what it holds);
one pulls a real GGUF of that size through the API, so the model is registered too.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from pathlib import Path

import pytest
from emulators.ggufgen import write_fake_blob, write_gguf
from emulators.hubemu import HubEmulator
from emulators.loopback import LoopbackHandler, LoopbackServer
from support.apps import call
from support.config import outbound_config
from support.tasks import wait_task
from support.waiting import wait_for

from localrt.app import create_app
from localrt.downloads.tasks import Downloads, Item, Task, map_path, part_path
from localrt.events import EventBus
from localrt.outbound import retry_after_seconds

pytestmark = pytest.mark.live

MiB = 1024 * 1024
READ_TIMEOUT = 30.0  # seconds: localrt.downloads.fetch's read timeout, which a cancel must not wait out
SIZE = 70 * MiB + 12345  # not a whole number of pieces: the last one is short


@pytest.fixture(scope="module")
def blob(tmp_path_factory):
    return write_fake_blob(tmp_path_factory.mktemp("blob") / "big.gguf", SIZE, seed=7)


@pytest.fixture
def hub_repos(blob):
    """The repos conftest's `hub` serves in this module."""

    def add(hub):
        hub.add_repo("org/big", {"big.gguf": blob})
        hub.add_repo("org/gated", {"big.gguf": blob}, gated_token="hf_secret")
        hub.add_repo("org/small", {"small.gguf": b"x" * (3 * MiB)})

    return add


class Recorder(EventBus):
    """The event bus, keeping what is published for the test to read."""

    def __init__(self):
        super().__init__(max_listeners=1)
        self.events = []

    def publish(self, event_type: str, **payload) -> None:
        self.events.append({"type": event_type, **payload})


class Puller:
    """A Downloads with a settable connection count, and its tasks' files."""

    def __init__(self, hub: HubEmulator, folder: Path, connections: int = 4, **config):
        self.hub, self.folder, self.connections = hub, folder, connections
        self.events = Recorder()
        self.downloads = Downloads(lambda: outbound_config(**config), self.events,
                                   lambda: self.connections)

    def start(self, repo="org/big", name="big.gguf") -> Task:
        """Start a task for one file of `repo`, as a pull would."""
        f = self.hub.file(repo, name)
        item = Item(name, f"{self.hub.url}/{repo}/resolve/main/{name}", self.folder / name,
                    f.size, sha256=f.sha256)
        return self.downloads.start(Task(f"{repo}:{name}", "Model", [item],
                                         hub_url=self.hub.url))

    def pull(self, repo="org/big", name="big.gguf", timeout=60.0) -> Task:
        """Run a task to its end."""
        return wait_end(self.start(repo, name), timeout)


def wait_end(task: Task, timeout=60.0) -> Task:
    """`task`, once it is no longer running."""
    deadline = time.monotonic() + timeout
    while task.running:
        assert time.monotonic() < deadline, f"{task.id} still running"
        time.sleep(0.02)
    return task


def threads_of(task: Task) -> list:
    """The task's threads still alive: its own and its workers' (localrt.downloads.pieces)."""
    return [t for t in threading.enumerate() if t.name == f"download {task.id}"
            or t.name.startswith(f"download {task.id} #")]


@pytest.fixture
def puller(hub, tmp_path):
    p = Puller(hub, tmp_path / "models")
    yield p
    p.downloads.close()


def ranges(hub) -> list[tuple[int, int]]:
    """The byte ranges the CDN was asked for, in order; (0, None) for a whole file."""
    out = []
    for r in hub.requests_to("cdn"):
        if r.method != "GET":
            continue
        if r.range is None:
            out.append((0, None))
        else:
            first, last = re.fullmatch(r"bytes=(\d+)-(\d*)", r.range).groups()
            out.append((int(first), int(last) if last else None))
    return out


def sha256(path) -> str:
    """A file's sha256, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MiB):
            h.update(chunk)
    return h.hexdigest()


def assert_installed(puller, blob, name="big.gguf"):
    """The file is in place with the right bytes, and nothing is beside it."""
    target = puller.folder / name
    assert sha256(target) == sha256(blob)
    assert sorted(p.name for p in puller.folder.iterdir()) == [name]  # no part, no map


def test_a_big_file_comes_in_concurrent_ranges_that_cover_it(hub, tmp_path, blob):
    puller = Puller(hub, tmp_path / "models", connections=4, modelhub_token="hf_secret")
    hub.max_bytes_per_second = 100 * MiB  # so that the pieces' bodies overlap
    task = puller.pull("org/gated")
    assert task.status == "Success", task.error
    asked = sorted(ranges(hub))
    assert len(asked) == 4 and asked[0][0] == 0 and asked[-1][1] == SIZE - 1
    assert all(a[1] + 1 == b[0] for a, b in zip(asked, asked[1:])), asked  # no gap, no overlap
    assert hub.max_concurrent_bodies == 4
    assert task.items[0].downloaded == SIZE
    assert_installed(puller, blob)
    # The token went to the hub's resolve, and never followed its redirect to the CDN.
    resolves = hub.requests_to("hub")
    assert resolves and all(r.headers.get("authorization") == "Bearer hf_secret"
                            for r in resolves)
    assert not any("authorization" in r.headers for r in hub.requests_to("cdn"))


def test_one_connection_is_one_stream(puller, hub, blob):
    puller.connections = 1
    assert puller.pull().status == "Success"
    assert ranges(hub) == [(0, None)] and hub.max_concurrent_bodies == 1
    assert_installed(puller, blob)


def test_a_file_under_64_mib_is_one_stream(puller, hub):
    puller.connections = 8
    assert puller.pull("org/small", "small.gguf").status == "Success"
    assert ranges(hub) == [(0, None)]


def test_a_dropped_connection_resumes_its_piece_where_it_broke(puller, hub, blob):
    hub.drop_after = 5 * MiB  # the first body breaks off after 5 MiB
    assert puller.pull().status == "Success"
    asked = ranges(hub)
    assert len(asked) == 5, asked
    pieces = sorted(asked)
    resumed = [r for r in pieces if any(r[0] == p[0] + 5 * MiB and r[1] == p[1]
                                        for p in pieces)]
    assert len(resumed) == 1, asked
    assert_installed(puller, blob)


def test_a_corrupt_byte_fails_the_checksum_and_deletes_part_and_map(puller, hub):
    hub.corrupt = True
    task = puller.pull()
    assert task.status == "Error" and "checksum mismatch" in task.error, task.error
    assert list(puller.folder.iterdir()) == []


def test_cancel_stops_every_connection_and_a_new_pull_skips_done_pieces(puller, hub, blob):
    hub.max_bytes_per_second = 6 * MiB  # about three seconds for the file
    task = puller.start()
    item = task.items[0]
    wait_for(lambda: item.downloaded >= 16 * MiB, what="16 MiB")
    puller.downloads.cancel(task.id)
    wait_end(task)
    assert task.status == "Stopped"  # and not Success: see 0 < sum(done) < SIZE below
    # No body is still being sent, and none is asked for later: every thread of the
    # task has ended, so nothing is left to ask.
    wait_for(lambda: not threads_of(task), what="the task's threads to end")
    wait_for(lambda: (hub.clear_requests(), hub.max_concurrent_bodies)[1] == 0,
             what="the emulator's bodies to end")
    assert ranges(hub) == []

    saved = json.loads(map_path(part_path(item.local_path)).read_text())
    piece, done = saved["piece"], saved["done"]
    assert sum(done) == item.downloaded and 0 < sum(done) < SIZE
    # One total progress for the task, across the pieces, growing update by update.
    events = puller.events.events
    assert events[0]["type"] == "DownloadStarted" and events[-1]["type"] == "DownloadStopped"
    progress = [e["task"]["items"][0]["downloadedBytes"] for e in events
                if e["type"] == "DownloadUpdated"]
    assert progress and progress == sorted(progress) and progress[-1] <= sum(done)
    assert events[-1]["task"]["items"][0]["downloadedBytes"] == sum(done)
    missing = [(i * piece + d, min((i + 1) * piece, SIZE) - 1) for i, d in enumerate(done)
               if i * piece + d < min((i + 1) * piece, SIZE)]
    hub.max_bytes_per_second = None
    assert puller.pull().status == "Success"
    assert sorted(ranges(hub)) == missing  # each piece from where it stopped; none twice
    assert_installed(puller, blob)


def test_cancel_stops_connections_whose_server_never_answers(puller, hub):
    """Every worker has connected and waits for response headers that never come: the
    cancel must not wait for the 30 s read timeout."""
    import socket

    silent = socket.create_server(("127.0.0.1", 0), backlog=16)
    try:
        hub.cdn_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        task = puller.start()
        conns = [silent.accept()[0] for _ in range(4)]
        for conn in conns:
            conn.settimeout(READ_TIMEOUT / 3)
            assert conn.recv(65536).startswith(b"GET ")  # all four now wait for headers
        puller.downloads.cancel(task.id)
        # Far sooner than the read timeout would have ended them (a ratio, not a clock).
        assert wait_end(task, timeout=READ_TIMEOUT / 3).status == "Stopped"
        for conn in conns:
            assert conn.recv(1) == b""  # the end: the worker shut its socket
            conn.close()
    finally:
        silent.close()


def test_close_stops_every_connection(puller, hub):
    hub.max_bytes_per_second = 6 * MiB
    task = puller.start()
    wait_for(lambda: task.items[0].downloaded >= 4 * MiB, what="4 MiB")
    puller.downloads.close()
    assert task.status == "Stopped"
    wait_for(lambda: (hub.clear_requests(), hub.max_concurrent_bodies)[1] == 0,
             what="the emulator's bodies to end")


@pytest.mark.parametrize("garbage", [
    b"\x00not json",
    b'{"version": 1}',
    "wrong sha256",
    "a piece done past its end",
])
def test_a_map_that_does_not_fit_means_starting_over(puller, hub, blob, garbage):
    f = hub.file("org/big", "big.gguf")
    part = part_path(puller.folder / "big.gguf")
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\xff" * SIZE)  # wrong bytes everywhere
    piece = 32 * MiB
    count = -(-SIZE // piece)
    layouts = {"wrong sha256": {"sha256": "0" * 64, "done": [piece, piece, SIZE - 2 * piece]},
               "a piece done past its end": {"sha256": f.sha256, "done": [piece + 1, 0, 0]}}
    if isinstance(garbage, str):
        garbage = json.dumps({"version": 1, "size": SIZE, "gitOid": None, "piece": piece,
                              **layouts[garbage]}).encode()
        assert len(json.loads(garbage)["done"]) == count
    map_path(part).write_bytes(garbage)
    assert puller.pull().status == "Success"
    asked = sorted(ranges(hub))
    assert asked[0] == (0, asked[0][1]) and sum(b - a + 1 for a, b in asked) == SIZE
    assert_installed(puller, blob)


def test_a_one_stream_part_is_kept_by_the_pieces(puller, hub, blob):
    """A part file left by a one-stream download (downloadConnections was 1) is a prefix
    of the file: the pieces it covers are not fetched again."""
    part = part_path(puller.folder / "big.gguf")
    part.parent.mkdir(parents=True)
    with open(blob, "rb") as src:
        part.write_bytes(src.read(20 * MiB))
    assert puller.pull().status == "Success"
    assert min(first for first, _ in ranges(hub)) == 20 * MiB
    assert_installed(puller, blob)


class _NoRangeHandler(LoopbackHandler):
    """Serves one file and ignores Range, as some servers do."""

    def do_GET(self):
        self.server.asked.append(self.headers.get("Range"))
        data = self.server.data
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_a_server_that_ignores_range_gets_one_stream(puller, blob):
    server = LoopbackServer(_NoRangeHandler)
    server.data, server.asked = blob.read_bytes(), []
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/big.gguf"
        item = Item("big.gguf", url, puller.folder / "big.gguf", SIZE,
                    sha256=hashlib.sha256(server.data).hexdigest())
        task = wait_end(puller.downloads.start(Task("big", "Model", [item])))
        assert task.status == "Success", task.error
        assert server.asked[-1] is None and all(server.asked[:-1]), server.asked
        assert_installed(puller, blob)
    finally:
        server.shutdown()
        server.server_close()
        server.close_connections()


@pytest.mark.parametrize("repo, name, where", [
    ("org/big", "big.gguf", "cdn"),
    ("org/big", "big.gguf", "resolve"),
    ("org/small", "small.gguf", "resolve"),
])
def test_a_429_is_waited_out_as_retry_after_says(puller, hub, repo, name, where):
    hub.rate_limit, hub.rate_limit_on = [1, 1], {where}
    started = time.monotonic()
    assert puller.pull(repo, name).status == "Success"
    assert time.monotonic() - started >= 1.0  # Retry-After: 1 was waited out
    assert sum(r.status == 429 for r in hub.requests) == 2


@pytest.mark.parametrize("repo, name, where", [
    ("org/big", "big.gguf", "cdn"),
    ("org/small", "small.gguf", "resolve"),
])
def test_a_persistent_429_fails_with_a_clear_error(puller, hub, repo, name, where):
    hub.rate_limit, hub.rate_limit_on = [0] * 100, {where}
    task = puller.pull(repo, name)
    port = hub.cdn_port if where == "cdn" else hub.port
    assert task.status == "Error"
    assert f"http://127.0.0.1:{port} rate-limited the download" in task.error, task.error
    assert "HTTP 429 5 times in a row" in task.error


@pytest.mark.parametrize("value, expected", [
    ("3", 3.0), ("0", 0.0), ("2.5", 2.5), ("3600", 30.0), ("-4", 0.0),
    (None, None), ("", None), ("soon", None), ("nan", None),
    ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # a date gone by
])
def test_retry_after_seconds(value, expected):
    headers = {} if value is None else {"Retry-After": value}
    assert retry_after_seconds(headers) == expected


def test_retry_after_as_a_date_to_come():
    from email.utils import formatdate

    seconds = retry_after_seconds({"Retry-After": formatdate(time.time() + 10, usegmt=True)})
    assert 8 <= seconds <= 10
    assert retry_after_seconds({"Retry-After": "12"}, cap=5) == 5


def test_download_connections_setting(home):
    from localrt import settings as settings_mod

    s = settings_mod.load()
    assert s["downloadConnections"] == 8
    assert s.update({"downloadConnections": 2})["downloadConnections"] == 2
    for bad in (0, -1, "4", True):
        with pytest.raises(ValueError):
            s.update({"downloadConnections": bad})


@pytest.fixture(scope="module")
def big_gguf(tmp_path_factory):
    """A real GGUF model of about 82 MB, so a pull of it goes in pieces."""
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "huge.gguf", name="huge",
                      n_embd=1024, n_layer=2)
    assert path.stat().st_size >= 64 * MiB
    return path


def test_an_api_pull_of_a_big_gguf_goes_in_pieces_and_registers_it(settings, big_gguf):
    with HubEmulator() as hub:
        hub.add_repo("org/huge", {"huge.gguf": big_gguf})
        settings.update({"modelHubUrl": hub.url, "downloadConnections": 3})
        app = create_app(settings)
        try:
            r = call(app, "POST", "/v1/models/pull", {"model": "org/huge"})
            assert r.status == 200, r.body
            assert wait_task(lambda *a, **k: call(app, *a, **k), r.json["task"]["id"],
                             timeout=60)["status"] == "Success"
            model = call(app, "GET", "/v1/models/org:huge:huge.gguf").json
            assert model["size"] == big_gguf.stat().st_size
            assert len(ranges(hub)) == 3
            path = Path(model["path"]) / "huge.gguf"
            assert sha256(path) == sha256(big_gguf)
            assert not list(path.parent.glob("*.part*"))
        finally:
            app.close()


def test_what_breaks_after_a_cancel_ends_the_task_stopped_not_failed(puller, hub):
    """A cancel cuts the task's connections; a read cut mid-redirect then raises
    http.client.IncompleteRead, which must end the task "Stopped", not "Error"."""
    import http.client

    def cut(task, item):
        puller.downloads.cancel(task.id)
        raise http.client.IncompleteRead(b"partial", 10)

    f = hub.file("org/small", "small.gguf")
    item = Item("small.gguf", f"{hub.url}/org/small/resolve/main/small.gguf",
                puller.folder / "small.gguf", f.size, sha256=f.sha256)
    task = Task("org/small:cut", "Model", [item], hub_url=hub.url)
    task.after_item = cut
    task = wait_end(puller.downloads.start(task))
    assert task.status == "Stopped" and not task.error
