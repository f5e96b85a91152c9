"""Model ids: every shape of spec 2.4, and the ids rejected before any I/O."""

import pytest

from localrt import settings as settings_mod
from localrt.errors import InvalidField
from localrt.models.ids import ModelRef, parse_id
from localrt.models.pulls import quantization

HUB = "https://huggingface.co"


def parse(model_id):
    return parse_id(model_id, HUB, "cortexso")


@pytest.mark.parametrize("model_id, ref, known_id", [
    # a built-in's default branch is known only once the hub's metadata.yml is read
    ("tinyllama", ModelRef("cortexso/tinyllama", None, None, True), None),
    ("cortexso/tinyllama", ModelRef("cortexso/tinyllama", None, None, True), None),
    ("tinyllama:1b", ModelRef("cortexso/tinyllama", "1b", None, True), "tinyllama:1b"),
    ("cortexso/tinyllama:1b-gguf", ModelRef("cortexso/tinyllama", "1b-gguf", None, True),
     "tinyllama:1b-gguf"),
    ("TheBloke/TinyLlama-1.1B-GGUF", ModelRef("TheBloke/TinyLlama-1.1B-GGUF", None, None,
                                               False), None),
    ("org/repo:model.Q4_K_M.gguf", ModelRef("org/repo", None, None, False,
                                            pick="model.Q4_K_M.gguf"), None),
    ("org/repo:q8_0", ModelRef("org/repo", None, None, False, pick="q8_0"), None),
    # the id a single-file pull registers pulls the same file again
    ("org:repo:model.Q4_K_M.gguf", ModelRef("org/repo", None, None, False,
                                            pick="model.Q4_K_M.gguf"), None),
    ("org:repo:sub/dir/m.gguf", ModelRef("org/repo", None, None, False, pick="sub/dir/m.gguf"),
     None),
    # a main file of the built-ins' org is a file, not a branch
    ("cortexso/tinyllama:tinyllama-q2_k.gguf", ModelRef("cortexso/tinyllama", None, None, False,
                                                        pick="tinyllama-q2_k.gguf"), None),
    (f"{HUB}/org/repo/resolve/main/model.gguf", ModelRef("org/repo", "main", "model.gguf", False),
     "org:repo:model.gguf"),
    (f"{HUB}/org/repo/blob/dev/sub/dir/m.gguf", ModelRef("org/repo", "dev", "sub/dir/m.gguf",
                                                          False), "org:repo:sub/dir/m.gguf"),
    (f"{HUB}/org/repo", ModelRef("org/repo", None, None, False), None),
    (f"{HUB}/org/repo/tree/dev", ModelRef("org/repo", "dev", None, False), None),
    (f"{HUB}/cortexso/tinyllama/tree/1b", ModelRef("cortexso/tinyllama", "1b", None, True),
     "tinyllama:1b"),
    (f"{HUB}/cortexso/tinyllama/blob/1b/model.gguf",
     ModelRef("cortexso/tinyllama", "1b", None, True), "tinyllama:1b"),
    (f"{HUB}/cortexso/tinyllama/resolve/main/tinyllama-q2_k.gguf",
     ModelRef("cortexso/tinyllama", "main", "tinyllama-q2_k.gguf", False),
     "cortexso:tinyllama:tinyllama-q2_k.gguf"),
])
def test_shapes(model_id, ref, known_id):
    assert parse(model_id) == ref
    assert ref.known_id == known_id


@pytest.mark.parametrize("name, quant", [
    ("tinyllama-1.1b-chat-v1.0.Q4_K_M.gguf", "Q4_K_M"),
    ("qwen2.5-0.5b-instruct-q8_0.gguf", "Q8_0"),
    ("Llama-3.2-1B-Instruct-IQ4_XS.gguf", "IQ4_XS"),
    ("Q4_K_M/Model-UD-Q4_K_XL-00001-of-00002.gguf", "Q4_K_XL"),
    ("gemma-3-270m-it-F16.gguf", "F16"),
    ("model-bf16.gguf", "BF16"),
    ("model.gguf", None),
    ("qwen2-7b.gguf", None),
])
def test_quantization_from_a_file_name(name, quant):
    assert quantization(name) == quant


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
    ("name:", "nothing follows"),
    ("bad name", "not a model id"),
    ("https://evil.example/org/repo/resolve/main/x.gguf", "configured model hub"),
    (f"{HUB}/org/repo/tree/main/x.gguf", "URL shaped"),
    (f"{HUB}/org/repo/commits/main", "URL shaped"),
    ("org:repo:../x.gguf", "'..'"),
    ("org/repo:", "nothing follows"),
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
