"""The hub client against the emulator: files, branches, and hub errors as localrt errors."""

import hashlib
import time

import pytest
from emulators.ggufgen import write_gguf
from support.config import outbound_config as config

from localrt.models.hub import (RATE_LIMIT_TRIES, Hub, HubTokenRejected, HubTokenRequired, NotOnHub,
                         RateLimited)

pytestmark = pytest.mark.live


@pytest.fixture
def model(tmp_path):
    return write_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
def hub_repos(model):
    """The repos conftest's `hub` serves in this module."""

    def add(hub):
        hub.add_repo("cortexso/tiny", {"README.md": b"# tiny\n"},
                     branches={"q8": {"model.yml": b"name: tiny\n", "model.gguf": model}})
        hub.add_repo("org/gated", {"a.gguf": model}, gated_token="hf_ok")

    return add


def test_files_have_sizes_and_sha256(hub, model):
    files = {f.path: f for f in Hub(hub.url, config()).files("cortexso/tiny", "q8")}
    assert set(files) == {"model.yml", "model.gguf"}
    data = model.read_bytes()
    assert files["model.gguf"].size == len(data)
    assert files["model.gguf"].sha256 == hashlib.sha256(data).hexdigest()


def test_branches_are_the_variants(hub):
    assert set(Hub(hub.url, config()).branches("cortexso/tiny")) == {"main", "q8"}


def test_not_found(hub):
    with pytest.raises(NotOnHub) as info:
        Hub(hub.url, config()).files("org/missing")
    assert info.value.status == 404 and "org/missing" in info.value.message
    with pytest.raises(NotOnHub, match="revision nope"):
        Hub(hub.url, config()).files("cortexso/tiny", "nope")


def test_gated_repo_lists_its_files_and_refuses_their_bytes(hub):
    # As on huggingface.co: anyone can list a gated repo; resolve wants the right token.
    assert [f.path for f in Hub(hub.url, config()).files("org/gated")] == ["a.gguf"]
    with pytest.raises(HubTokenRequired, match="org/gated is gated and needs a token"):
        Hub(hub.url, config()).check_access("org/gated", "main", "a.gguf")
    with pytest.raises(HubTokenRejected, match="did not accept the token for org/gated"):
        Hub(hub.url, config(modelhub_token="hf_bad")).check_access("org/gated", "main", "a.gguf")
    Hub(hub.url, config(modelhub_token="hf_ok")).check_access("org/gated", "main", "a.gguf")
    # a HEAD on the hub, never following the redirect: the CDN is not asked
    assert [r.method for r in hub.requests_to("hub")[-3:]] == ["HEAD"] * 3
    assert not hub.requests_to("cdn")


def test_missing_repo_is_not_a_token_problem(hub):
    for status in (401, 404):
        hub.missing_repo_status = status
        for config_ in (config(), config(modelhub_token="hf_ok")):
            with pytest.raises(NotOnHub) as info:
                Hub(hub.url, config_).files("org/missing")
            assert info.value.status == 404 and "org/missing does not exist" in info.value.message
            assert "token" in info.value.message and "not a token problem" in info.value.message


def test_tree_pages_are_all_read(hub, tmp_path):
    hub.add_repo("org/many", {f"f{i:02d}.txt": f"{i}".encode() for i in range(7)})
    hub.tree_page_size = 2
    hub.clear_requests()
    paths = [f.path for f in Hub(hub.url, config()).files("org/many")]
    assert paths == [f"f{i:02d}.txt" for i in range(7)]
    assert len([r for r in hub.requests_to("hub") if "/tree/" in r.path]) == 4


def test_429_is_waited_out_then_a_clear_error(hub):
    hub.rate_limit = [1, 1]
    started = time.monotonic()
    assert {f.path for f in Hub(hub.url, config()).files("cortexso/tiny", "q8")} == \
        {"model.yml", "model.gguf"}
    assert time.monotonic() - started >= 1.9  # it waited as Retry-After said
    hub.rate_limit = [0] * 10
    with pytest.raises(RateLimited) as info:
        Hub(hub.url, config()).files("cortexso/tiny", "q8")
    assert info.value.status == 502 and "rate-limiting" in info.value.message
    assert hub.rate_limit == [0] * (10 - 1 - RATE_LIMIT_TRIES)  # bounded: 6 tries in all
