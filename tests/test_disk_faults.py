"""Disk faults (issue 38, item 7), each on a real small filesystem: a tmpfs that the test
mounts where localrt writes (tests/support/disks.py), then fills up, runs out of inodes
on, or makes read-only. A pull that fills the disk, one that cannot fit, an import that
does not fit, a settings PATCH with no space left, an engine install that does not fit,
a read-only models folder, and the RAM prompt cache on a full disk.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
from emulators.enginepkg import build_echo_engine_wheel
from emulators.ggufgen import write_gguf
from support.apps import bind
from support.tasks import wait_bytes, wait_task

from localrt import settings as settings_mod
from localrt.app import create_app
from localrt.downloads import pieces
from localrt.downloads.fetch import Item
from localrt.downloads.pieces import PIECES_FROM
from localrt.fsutil import disk_margin, human_size

SYSTEM = "You are a careful assistant."
ENGINE_PACKAGE = "localrt_echo_engine"


@pytest.fixture(scope="module")
def pulled(tmp_path_factory):
    """A 3.2 MB GGUF (f32, not quantized): some fifty 64 KiB chunks to download."""
    root = tmp_path_factory.mktemp("pulled")
    return write_gguf(root / "fill.gguf", name="fill", n_embd=256, n_ff=512,
                      context_length=256)


@pytest.fixture(scope="module")
def pulled_big(tmp_path_factory):
    """A 70 MB GGUF: past PIECES_FROM, so it is fetched in pieces over connections."""
    root = tmp_path_factory.mktemp("pulled-big")
    return write_gguf(root / "big.gguf", name="big", n_embd=1024, n_ff=4096,
                      context_length=256)


@pytest.fixture
def hub_repos(pulled, pulled_big):
    def add(hub):
        hub.add_repo("org/fill", {"fill.gguf": pulled})
        hub.add_repo("org/big", {"big.gguf": pulled_big})
        # Bigger than the whole disk: it can never fit.
        hub.add_repo("org/huge", {"huge.gguf": b"GGUF" + bytes(9 << 20)})

    return add


@pytest.fixture
def disk(small_disk, home):
    """The data folder (~/localrt: models, engines) on an 8 MiB tmpfs."""
    return small_disk(home / "localrt", "8m")


@pytest.fixture
def settings(disk):
    """conftest's settings, loaded once the data folder is mounted."""
    return settings_mod.load()


@pytest.fixture
def api(hub_app):
    return bind(hub_app)


def error_of(r, status: int, code: str) -> str:
    """The message of an error reply, once its status and code are checked."""
    assert r.status == status, (r.status, r.body)
    assert r.json["error"]["code"] == code, r.json
    return r.json["error"]["message"]


def files_under(folder) -> list[str]:
    """Every file below `folder` (fillers left out), as paths relative to it."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and not p.name.startswith(".filler")
                  and ".inodes" not in p.parts)


# --- pulls ----------------------------------------------------------------------------


def test_a_pull_that_fills_the_disk_ends_disk_full_keeps_its_part_and_resumes(
        api, hub, disk, settings, pulled):
    hub.delay_per_chunk = 0.1  # some five seconds in all: time to fill the disk meanwhile
    r = api("POST", "/v1/models/pull", {"model": "org/fill"})
    assert r.status == 200, r.body
    task_id = r.json["task"]["id"]
    wait_bytes(api, task_id, 1)
    disk.fill()  # another program takes the rest of the disk
    task = wait_task(api, task_id)
    assert (task["status"], task.get("errorCode")) == ("Error", "disk_full"), task

    folder = settings.data_dir / "models" / f"127.0.0.1_{hub.port}" / "org" / "fill" / \
        "fill.gguf"
    part = folder / "fill.gguf.part"
    kept = part.stat().st_size
    size = pulled.stat().st_size
    assert 0 < kept < size
    assert part.read_bytes() == pulled.read_bytes()[:kept]  # whole bytes, for the resume
    # It names the folder and how much more it needs: what is left, and the margin.
    free = disk.free_bytes()
    more = human_size(size - kept + disk_margin(8 << 20) - free)
    assert f"no space left in {folder}" in task["error"]
    assert f"it needs {more} more" in task["error"], task["error"]
    assert "pull it again" in task["error"]
    # Nothing is registered.
    assert not (folder / "model.json").exists()
    assert api("GET", "/v1/models").json["data"] == []

    disk.free()
    hub.reset_faults()
    hub.clear_requests()
    r = api("POST", "/v1/models/pull", {"model": "org/fill"})
    assert r.status == 200, r.body
    assert wait_task(api, task_id)["status"] == "Success"
    ranges = [q.range for q in hub.requests_to("cdn") if q.method == "GET"]
    assert f"bytes={kept}-" in ranges, ranges  # resumed, not started over
    assert (folder / "fill.gguf").read_bytes() == pulled.read_bytes()
    assert [m["id"] for m in api("GET", "/v1/models").json["data"]] == \
        ["org:fill:fill.gguf"]


def test_a_pull_in_pieces_has_its_space_so_a_disk_that_fills_meanwhile_does_not_stop_it(
        api, hub, small_disk, home, pulled_big):
    """A file fetched in pieces is preallocated, and its part map, padded to its longest,
    is overwritten in place when no block is left for a new one: another program
    filling the disk meanwhile takes nothing from it."""
    disk = small_disk(home / "localrt" / "models", "100m")
    assert pulled_big.stat().st_size >= PIECES_FROM
    hub.delay_per_chunk = 0.05  # some 7 s for each connection's piece: the map is saved
    r = api("POST", "/v1/models/pull", {"model": "org/big"})
    assert r.status == 200, r.body
    task_id = r.json["task"]["id"]
    wait_bytes(api, task_id, 1)
    assert disk.fill() > 0
    [task] = api("GET", "/v1/models/pull").json["data"]
    assert task["status"] == "Downloading"  # the disk filled while it downloads
    assert wait_task(api, task_id, timeout=60.0)["status"] == "Success"
    folder = disk.path / f"127.0.0.1_{hub.port}" / "org" / "big" / "big.gguf"
    assert (folder / "big.gguf").read_bytes() == pulled_big.read_bytes()
    assert [m["id"] for m in api("GET", "/v1/models").json["data"]] == ["org:big:big.gguf"]


def test_a_part_map_overwritten_in_place_and_torn_is_not_trusted(tmp_path):
    """The map a full disk makes pieces.py overwrite in place carries a check of its
    fields: one torn by a kill mid-write is refused, and the resume starts over."""
    item = Item("f.gguf", "", tmp_path / "f.gguf", 100 << 20, sha256="ab" * 32)
    part, saved = tmp_path / "f.gguf.part", tmp_path / "f.gguf.part.map"
    with open(part, "wb") as f:
        f.truncate(item.size)
        pieces._save_map(saved, item, 32 << 20, [32 << 20, 5, 0, 0], f.fileno())
    assert pieces._read_map(saved, item, item.size) == (32 << 20, [32 << 20, 5, 0, 0])
    text = saved.read_text()
    assert text.endswith(" ")  # padded: a later save never needs a new block
    torn = text.replace(", 5, 0, 0]", ", 9, 0, 0]")
    assert torn != text and len(torn) == len(text)
    saved.write_text(torn)
    assert pieces._read_map(saved, item, item.size) is None


def test_a_pull_that_cannot_fit_is_refused_up_front_with_507(api, hub, disk, settings):
    message = error_of(api("POST", "/v1/models/pull", {"model": "org/huge"}), 507,
                       "insufficient_storage")
    folder = settings.data_dir / "models" / f"127.0.0.1_{hub.port}" / "org" / "huge"
    assert f"Not enough disk space in {folder / 'huge.gguf'} for org:huge:huge.gguf" in \
        message, message
    assert re.search(r"free [\d.]+ [KM]iB more there", message), message
    assert "dataFolderPath" in message
    assert api("GET", "/v1/models/pull").json["data"] == []  # no task
    assert files_under(settings.data_dir) == []  # no part file, nothing at all


# --- imports --------------------------------------------------------------------------


def test_an_import_that_does_not_fit_is_507_and_leaves_no_file(api, disk, settings, pulled):
    disk.fill()
    message = error_of(api("POST", "/v1/models/import",
                           {"path": str(pulled), "id": "copied", "option": "copy"}),
                       507, "insufficient_storage")
    assert "Not enough disk space in" in message and str(settings.data_dir) in message
    assert f"it needs {human_size(pulled.stat().st_size)}" in message
    assert files_under(settings.data_dir / "models") == []
    assert api("GET", "/v1/models").json["data"] == []


def test_an_import_whose_disk_fills_part_way_is_507_and_leaves_no_file(
        api, small_disk, settings, tmp_path):
    """Bytes are free but inodes run out after a few files: the copy fails part-way."""
    imported = settings.data_dir / "models" / "imported"
    inodes = small_disk(imported, "4m", inodes=8)
    before = inodes.free_inodes()
    source = tmp_path / "onnx-model"
    source.mkdir()
    (source / "genai_config.json").write_text("{}")
    for n in range(12):
        (source / f"part{n}.onnx.data").write_bytes(bytes(1000))
    message = error_of(api("POST", "/v1/models/import",
                           {"path": str(source), "id": "many", "option": "copy"}),
                       507, "insufficient_storage")
    assert f"No space left in {imported}" in message
    assert "no free inodes" in message and "free some space" in message
    assert files_under(imported) == [] and list(imported.iterdir()) == []
    assert inodes.free_inodes() == before


# --- settings -------------------------------------------------------------------------


def test_a_settings_patch_with_no_space_left_is_507_and_changes_nothing(small_disk, home):
    disk = small_disk(home, "2m")  # HOME's .localrtrc lives on it
    settings = settings_mod.load()
    app = create_app(settings)
    try:
        api = bind(app)
        before = settings.path.read_text()
        config = api("GET", "/v1/configs").json
        disk.fill()
        message = error_of(api("PATCH", "/v1/configs",
                               {"cors": False, "proxy_url": "http://proxy.example:3128"}),
                           507, "insufficient_storage")
        assert f"No space left in {home} to write the settings file {settings.path}" in \
            message
        assert "free some space" in message and message.endswith("Nothing was changed.")
        assert settings.path.read_text() == before
        assert api("GET", "/v1/configs").json == config
        assert not [p for p in home.iterdir() if p.name.endswith(".tmp")]
        disk.free()
        r = api("PATCH", "/v1/configs", {"cors": False})
        assert r.status == 200 and r.json["config"]["cors"] is False
    finally:
        app.close()


# --- engines --------------------------------------------------------------------------


@pytest.fixture
def engine_modules():
    """The echo engine that a test puts on sys.path and imports is taken off again."""
    path = list(sys.path)
    yield
    sys.path[:] = path
    for name in [m for m in sys.modules if m.split(".")[0] == ENGINE_PACKAGE]:
        del sys.modules[name]


def test_an_engine_install_that_does_not_fit_fails_and_the_engine_stays(
        small_disk, settings, tmp_path, engine_modules):
    root = settings.data_dir / "engines"
    small_disk(root, "2m", inodes=48)
    app = create_app(settings)
    try:
        api = bind(app)

        def install(wheel):
            r = api("POST", "/v1/engines/install", {"wheel": str(wheel)})
            assert r.status == 200, r.body
            return wait_task(api, r.json["task"]["id"], timeout=60.0)

        assert install(build_echo_engine_wheel(tmp_path / "1"))["status"] == "Success"
        state = (root / "engines.json").read_text()
        variants = api("GET", "/v1/engines/echo").json

        # 4 MiB unpacked from a wheel of a few KiB: refused before it unpacks.
        big = build_echo_engine_wheel(tmp_path / "2", version="2.0.0",
                                      data={"weights.txt": "x" * (4 << 20)})
        task = install(big)
        assert (task["status"], task.get("errorCode")) == ("Error", "disk_full"), task
        assert f"echo 2.0.0 takes 4.0 MiB unpacked, and {root} has" in task["error"]
        assert re.search(r"free [\d.]+ MiB more there", task["error"]), task["error"]

        # Small files, more than the inodes left: the disk fills while it unpacks.
        many = build_echo_engine_wheel(tmp_path / "3", version="3.0.0",
                                       data={f"part{n}.txt": "x" for n in range(60)})
        task = install(many)
        assert (task["status"], task.get("errorCode")) == ("Error", "disk_full"), task
        assert "no free inodes" in task["error"] and "install it again" in task["error"]

        # The engine stays as it was: the same variants, the same engines.json, and no
        # half-unpacked folder left taking the space.
        assert api("GET", "/v1/engines/echo").json == variants
        assert (root / "engines.json").read_text() == state
        assert json.loads(state)["engines"]["echo"]["active"]["version"] == "1.0.0"
        variant_dir = next((root / "echo").iterdir())
        assert [p.name for p in variant_dir.iterdir()] == ["1.0.0"]
    finally:
        app.close()


# --- a read-only models folder --------------------------------------------------------


def test_a_read_only_models_folder_is_a_clear_error_at_the_first_write(
        small_disk, settings, hub, pulled):
    models = settings.data_dir / "models"
    disk = small_disk(models, "8m")
    settings.update({"modelHubUrl": hub.url})
    app = create_app(settings)
    try:
        api = bind(app)
        r = api("POST", "/v1/models/import", {"path": str(pulled), "id": "kept"})
        assert r.status == 200, r.body
        kept = api("GET", "/v1/models/kept").json
        disk.read_only()

        for option in ("symlink", "copy"):
            message = error_of(api("POST", "/v1/models/import",
                                   {"path": str(pulled), "id": "new", "option": option}),
                               507, "storage_error")
            assert f"{models / 'imported'} is not writable (Read-only file system)" in \
                message, message
            assert "make it writable" in message
        message = error_of(api("PATCH", "/v1/models/kept", {"temperature": 0.3}), 507,
                           "storage_error")
        assert "is not writable" in message and "definition of model kept" in message
        message = error_of(api("DELETE", "/v1/models/kept"), 507, "storage_error")
        assert "cannot delete model kept" in message
        assert api("GET", "/v1/models/kept").json == kept

        r = api("POST", "/v1/models/pull", {"model": "org/fill"})
        assert r.status == 200, r.body
        task = wait_task(api, r.json["task"]["id"])
        assert (task["status"], task.get("errorCode")) == ("Error", "storage_error"), task
        assert f"{models} is not writable (Read-only file system)" in task["error"]
        assert "pull it again" in task["error"]

        disk.writable()
        assert api("PATCH", "/v1/models/kept", {"temperature": 0.3}).status == 200
    finally:
        app.close()


# --- the RAM prompt cache -------------------------------------------------------------


@pytest.fixture
def tiny_start():
    return {"n_parallel": 1}


def test_with_the_disk_full_chats_go_on_and_the_prompt_cache_still_hits(
        api, disk, settings, tiny):
    disk.fill()
    assert disk.free_bytes() == 0

    def chat(text):
        r = api("POST", "/v1/chat/completions", {
            "model": tiny, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": text}]})
        assert r.status == 200, r.body
        return r.json

    first = chat("Number one")
    chat("Number two")  # the one slot moves on; the first conversation's state is kept
    again = chat("Number one")
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    cache = api("GET", "/v1/models/status").json["data"][0]["promptCache"]
    assert cache["lookups"] == 3 and cache["hits"] >= 1, cache
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
        first["usage"]["prompt_tokens"] - 1
    # A write on the same full disk is a clear 507, and the model stays as it was.
    record = api("GET", f"/v1/models/{tiny}").json
    message = error_of(api("PATCH", f"/v1/models/{tiny}", {"temperature": 0.3}), 507,
                       "insufficient_storage")
    assert "No space left in" in message and "free some space" in message
    assert api("GET", f"/v1/models/{tiny}").json == record
