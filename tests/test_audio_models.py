"""Audio models in the registry (issue 36, item 1): a projector whose header declares an
audio encoder (clip.has_audio_encoder) gives its model the capability "audio", beside
"vision" where it has both; imports take it as `mmproj` and check its output size
against the text model; Ollama's /api/show says "audio". The projectors are headers
(support.audio.write_audio_header) and the tiny qwen2a projector mtmd really loads
(support.audio.write_audio_projector)."""

from __future__ import annotations

import pytest
from emulators.ggufgen import write_gguf
from support.audio import write_audio_header, write_audio_projector
from support.projectors import write_projector

from localrt.engines import ggufinfo
from localrt.models.registry import capabilities

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A 64-wide text model; audio, audio+vision and vision projectors of 64; one of 96."""
    root = tmp_path_factory.mktemp("audio")

    class Files:
        model = write_gguf(root / "tiny.gguf", name="tiny")
        audio = write_audio_header(root / "mmproj-audio.gguf", 64)
        omni = write_audio_header(root / "mmproj-omni.gguf", 64, kind="qwen2.5o",
                                  vision=True)
        vision = write_projector(root / "mmproj-vision.gguf", 64)
        audio96 = write_audio_header(root / "mmproj-audio96.gguf", 96)
        real = write_audio_projector(root / "mmproj-real.gguf", n_embd=64)
    return Files


def import_(api, **body):
    r = api("POST", "/v1/models/import", {k: str(v) for k, v in body.items()})
    assert r.status == 200, r.body
    return r.json["model"]


def test_an_audio_projectors_header_is_read(files):
    found = ggufinfo.projector(files.audio)
    assert (found.type, found.vision, found.audio, found.audio_type,
            found.audio_output_size) == ("qwen2a", False, True, "qwen2a", 64)
    real = ggufinfo.projector(files.real)
    assert (real.audio, real.audio_output_size, real.vision) == (True, 64, False)
    omni = ggufinfo.projector(files.omni)
    assert (omni.vision, omni.audio, omni.audio_output_size) == (True, True, 64)


def test_capabilities_say_audio_beside_vision(api, files):
    import_(api, path=files.model, id="hearing", mmproj=files.audio)
    import_(api, path=files.model, id="both", mmproj=files.omni)
    import_(api, path=files.model, id="seeing", mmproj=files.vision)
    import_(api, path=files.model, id="real", mmproj=files.real)
    listed = {m["id"]: m["capabilities"] for m in api("GET", "/v1/models").json["data"]}
    assert listed == {"hearing": ["chat", "audio"], "both": ["chat", "vision", "audio"],
                      "seeing": ["chat", "vision"], "real": ["chat", "audio"]}
    for model_id, caps in listed.items():
        record = api("GET", f"/v1/models/{model_id}").json
        assert record["capabilities"] == caps == capabilities(record)


def test_ollama_show_says_audio(api, files):
    import_(api, path=files.model, id="hearing", mmproj=files.audio)
    import_(api, path=files.model, id="both", mmproj=files.omni)
    shown = api("POST", "/api/show", {"model": "hearing"}).json["capabilities"]
    assert "audio" in shown and "vision" not in shown
    shown = api("POST", "/api/show", {"model": "both"}).json["capabilities"]
    assert "audio" in shown and "vision" in shown


def test_an_audio_projector_of_another_size_is_refused_at_import(api, files):
    r = api("POST", "/v1/models/import", {"path": str(files.model), "id": "x",
                                          "mmproj": str(files.audio96)})
    assert r.status == 400 and r.json["error"]["param"] == "mmproj"
    assert "gives audio embeddings of size 96, but the model tiny.gguf takes " \
           "embeddings of size 64" in r.json["error"]["message"]
    assert api("GET", "/v1/models/x").status == 404


def test_a_patch_gives_a_model_an_audio_projector(api, files):
    import_(api, path=files.model, id="m")
    r = api("PATCH", "/v1/models/m", {"mmproj": str(files.audio)})
    assert r.status == 200, r.body
    assert api("GET", "/v1/models/m").json["capabilities"] == ["chat", "audio"]
