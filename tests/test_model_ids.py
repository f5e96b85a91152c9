"""Model ids: every shape of spec 2.4, and the ids rejected before any I/O."""

import pytest

from localrt import settings as settings_mod
from localrt.errors import InvalidField
from localrt.models import ModelRef, parse_id

HUB = "https://huggingface.co"


def parse(model_id):
    return parse_id(model_id, HUB, "cortexso")


@pytest.mark.parametrize("model_id, ref, local_id", [
    ("tinyllama", ModelRef("cortexso/tinyllama", "main", None, True), "tinyllama"),
    ("tinyllama:1b-gguf", ModelRef("cortexso/tinyllama", "1b-gguf", None, True),
     "tinyllama:1b-gguf"),
    ("TheBloke/TinyLlama-1.1B-GGUF", ModelRef("TheBloke/TinyLlama-1.1B-GGUF", "main", None,
                                               False), "TheBloke/TinyLlama-1.1B-GGUF"),
    ("org/repo:model.Q4_K_M.gguf", ModelRef("org/repo", "main", "model.Q4_K_M.gguf", False),
     "org:repo:model.Q4_K_M.gguf"),
    (f"{HUB}/org/repo/resolve/main/model.gguf", ModelRef("org/repo", "main", "model.gguf", False),
     "org:repo:model.gguf"),
    (f"{HUB}/org/repo/blob/dev/sub/dir/m.gguf", ModelRef("org/repo", "dev", "sub/dir/m.gguf",
                                                          False), "org:repo:sub/dir/m.gguf"),
])
def test_shapes(model_id, ref, local_id):
    assert parse(model_id) == ref
    assert ref.local_id == local_id


@pytest.mark.parametrize("model_id, why", [
    ("", "empty"),
    ("../etc/passwd", "'..'"),
    ("org/..", "'..'"),
    ("org/repo:..", "'..'"),
    ("/etc/passwd", "absolute"),
    ("~/models", "absolute"),
    ("org\\repo", "backslash"),
    ("tiny\x00llama", "control"),
    ("tiny\nllama", "control"),
    ("a" * 256, "255 bytes"),
    ("é" * 128, "255 bytes"),
    ("a/b/c", "<org>/<repo>"),
    ("name:", "not a model id"),
    ("bad name", "not a model id"),
    ("https://evil.example/org/repo/resolve/main/x.gguf", "configured model hub"),
    (f"{HUB}/org/repo/tree/main/x.gguf", "URL shaped"),
    (f"{HUB}/org/repo/resolve/main/..%2F..%2Fx", "'..'"),
])
def test_rejected_before_any_io(model_id, why):
    with pytest.raises(InvalidField) as info:
        parse(model_id)
    assert info.value.status == 400 and info.value.param == "model"
    assert why in info.value.message


def test_hub_url_from_settings_and_environment(home, monkeypatch):
    s = settings_mod.load()
    assert s["modelHubUrl"] == "https://huggingface.co" and s["modelHubOrg"] == "cortexso"
    monkeypatch.setenv("LOCALRT_MODELHUB_URL", "http://127.0.0.1:9/")
    s = settings_mod.load()
    assert s["modelHubUrl"] == "http://127.0.0.1:9"
    s.update({"cors": False})  # the override is never written to the file
    assert "127.0.0.1:9" not in s.path.read_text()
    for bad in ("ftp://mirror", "http://", "mirror.example"):
        monkeypatch.setenv("LOCALRT_MODELHUB_URL", bad)
        with pytest.raises(settings_mod.SettingsError, match="LOCALRT_MODELHUB_URL"):
            settings_mod.load()
