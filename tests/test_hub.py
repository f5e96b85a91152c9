"""The hub client against the emulator: files, branches, and hub errors as localrt errors."""

import hashlib

import pytest
from conftest import outbound_config as config
from ggufgen import write_gguf
from hubemu import HubEmulator

from localrt.hub import Hub, HubTokenRejected, HubTokenRequired, NotOnHub


@pytest.fixture
def hub(tmp_path):
    model = write_gguf(tmp_path / "tiny.gguf")
    with HubEmulator() as emu:
        emu.add_repo("cortexso/tiny", {"README.md": b"# tiny\n"},
                     branches={"q8": {"model.yml": b"name: tiny\n", "model.gguf": model}})
        emu.add_repo("org/gated", {"a.gguf": model}, gated_token="hf_ok")
        emu.model = model
        yield emu


def test_files_have_sizes_and_sha256(hub):
    files = {f.path: f for f in Hub(hub.url, config()).files("cortexso/tiny", "q8")}
    assert set(files) == {"model.yml", "model.gguf"}
    data = hub.model.read_bytes()
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


def test_gated_repo_needs_a_token(hub):
    with pytest.raises(HubTokenRequired, match="needs a token"):
        Hub(hub.url, config()).files("org/gated")
    with pytest.raises(HubTokenRejected, match="did not accept the token"):
        Hub(hub.url, config(modelhub_token="hf_bad")).files("org/gated")
    assert [f.path for f in Hub(hub.url, config(modelhub_token="hf_ok")).files("org/gated")] \
        == ["a.gguf"]
