"""Vision models in the registry: capabilities in the model records, a projector given
with an import (`mmproj`) or set by a PATCH, and the checks a projector passes: a
projector GGUF for images whose output size is the model's embedding size. The
projectors here are headers with the keys and tensor shapes those checks read
(support.projectors); a pull's projector is tests/test_pull_layout.py's."""

from __future__ import annotations

import json
import os

import gguf
import pytest
from emulators.ggufgen import write_bert_gguf, write_gguf
from support.cli import run
from support.projectors import OUTPUT_TENSORS, write_projector

from localrt.cli import ExitCode
from localrt.engines import ggufinfo
from localrt.models.registry import capabilities, weights_path
from localrt.models.roles import PROJECTOR


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A 64-wide text model, projectors of 64 and 96, and an embedding model."""
    root = tmp_path_factory.mktemp("vision")

    class Files:
        model = write_gguf(root / "tiny.gguf", name="tiny")
        wide = write_gguf(root / "wide.gguf", name="wide", n_embd=96, n_head=4, seed=3)
        proj = write_projector(root / "mmproj-tiny-f16.gguf", 64)
        other = write_projector(root / "other" / "vision-64.gguf", 64, kind="gemma3")
        proj96 = write_projector(root / "mmproj-wide.gguf", 96)
        audio = write_projector(root / "mmproj-audio.gguf", 64, vision=False)
        bert = write_bert_gguf(root / "bert.gguf")
        pooled = write_gguf(root / "pooled.gguf", name="pooled",
                            pooling_type=int(gguf.PoolingType.MEAN))
    return Files


def import_(api, **body):
    r = api("POST", "/v1/models/import", {k: str(v) for k, v in body.items()})
    assert r.status == 200, r.body
    return r.json["model"]


# --- reading projector headers -------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(OUTPUT_TENSORS))
def test_a_projectors_output_size_is_read_from_its_tensor_shapes(tmp_path, kind):
    found = ggufinfo.projector(write_projector(tmp_path / "p.gguf", 80, kind=kind))
    assert found == ggufinfo.Projector(kind, True, 80)


def test_the_model_input_size_counts_deepstack_layers():
    md = {"general.architecture": "qwen3vl", "qwen3vl.embedding_length": 64}
    assert ggufinfo.model_input_size(md) == 64
    assert ggufinfo.model_input_size({**md, "qwen3vl.n_deepstack_layers": 3}) == 256
    assert ggufinfo.model_input_size({"general.architecture": "x"}) is None


def test_a_text_model_is_no_projector(files):
    with pytest.raises(ggufinfo.GGUFError, match="clip.projector_type"):
        ggufinfo.projector(files.model)


def test_tensor_shapes_match_the_gguf_package(files):
    _, shapes = ggufinfo.read_tensor_shapes(files.model)
    reader = gguf.GGUFReader(files.model)
    assert shapes == {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}


# --- capabilities ----------------------------------------------------------------------


def test_capabilities_in_the_list_and_the_record(api, files):
    import_(api, path=files.model, id="chat")
    import_(api, path=files.model, id="seeing", mmproj=files.proj)
    import_(api, path=files.bert, id="bert")
    import_(api, path=files.pooled, id="pooled")
    listed = {m["id"]: m["capabilities"] for m in api("GET", "/v1/models").json["data"]}
    assert listed == {"chat": ["chat"], "seeing": ["chat", "vision"],
                      "bert": ["embedding"], "pooled": ["embedding"]}
    for model_id, caps in listed.items():
        record = api("GET", f"/v1/models/{model_id}").json
        assert record["capabilities"] == caps == capabilities(record)
    assert api("GET", "/v1/models/bert").json["metadata"]["embedding"] is True


def test_a_record_written_before_embedding_was_recorded_reads_it_once(app, api, files):
    import_(api, path=files.bert, id="bert")
    import_(api, path=files.model, id="chat")
    for model_id in ("bert", "chat"):  # as a definition from before this key looks
        folder = api("GET", f"/v1/models/{model_id}").json["path"]
        stored = json.loads(open(os.path.join(folder, "model.json")).read())
        del stored["metadata"]["embedding"]
        with open(os.path.join(folder, "model.json"), "w") as f:
            json.dump(stored, f)
    app.services.registry._models = None  # as a new server reads the definitions
    listed = {m["id"]: m["capabilities"] for m in api("GET", "/v1/models").json["data"]}
    assert listed == {"bert": ["embedding"], "chat": ["chat"]}


# --- import with a projector ------------------------------------------------------------


def test_import_links_the_projector_as_the_model(api, files):
    model = import_(api, path=files.model, id="seeing", mmproj=files.proj)
    assert model["mmproj"] == files.proj.name and model["capabilities"] == ["chat", "vision"]
    link = PROJECTOR.path(model)
    assert link.is_symlink() and link.resolve() == files.proj.resolve()
    assert [f["path"] for f in model["files"]] == [files.model.name, files.proj.name]
    assert model["size"] == files.model.stat().st_size + files.proj.stat().st_size
    assert weights_path(model).name == files.model.name  # never the projector
    assert model["source"]["mmproj"] == str(files.proj)


def test_import_by_copy_copies_the_projector_under_a_projector_name(api, files):
    model = import_(api, path=files.model, id="seeing", mmproj=files.other, option="copy")
    assert model["mmproj"] == "mmproj-vision-64.gguf"  # PROJECTOR.claims it
    copy = PROJECTOR.path(model)
    assert not copy.is_symlink() and copy.read_bytes() == files.other.read_bytes()
    assert len(model["files"][1]["sha256"]) == 64


@pytest.mark.parametrize("which, words", [
    ("proj96", "gives embeddings of size 96, but the model tiny.gguf takes embeddings of "
               "size 64 (llama.embedding_length)"),
    ("model", "not a projector GGUF (mmproj): it has no clip.projector_type"),
    ("audio", "without a vision or an audio encoder"),
    ("/etc/hostname", "not a GGUF file"),
    ("relative.gguf", "not an absolute path"),
    ("/nonexistent/mmproj.gguf", "not a readable file"),
    ("/tmp", "is a folder, not a projector GGUF file"),
])
def test_a_projector_that_does_not_fit_is_refused_at_import(api, files, which, words):
    mmproj = getattr(files, which, which)
    r = api("POST", "/v1/models/import", {"path": str(files.model), "id": "seeing",
                                          "mmproj": str(mmproj)})
    assert r.status == 400 and r.json["error"]["param"] == "mmproj", r.body
    assert words in r.json["message"]
    assert api("GET", "/v1/models").json["data"] == []


def test_a_wide_model_takes_a_wide_projector(api, files):
    model = import_(api, path=files.wide, mmproj=files.proj96)
    assert model["id"] == "wide" and model["capabilities"] == ["chat", "vision"]


def test_an_onnx_folder_takes_no_projector(api, files, tmp_path):
    (tmp_path / "genai_config.json").write_text("{}")
    r = api("POST", "/v1/models/import", {"path": str(tmp_path), "mmproj": str(files.proj)})
    assert r.status == 400 and r.json["error"]["param"] == "mmproj"
    assert "GGUF model file" in r.json["message"]


# --- PATCH mmproj -----------------------------------------------------------------------


def test_patch_sets_then_replaces_a_projector(api, files):
    model = import_(api, path=files.model, id="chat")
    r = api("PATCH", "/v1/models/chat", {"mmproj": str(files.proj), "top_k": 7})
    assert r.status == 200, r.body
    first = r.json["model"]
    assert first["mmproj"] == files.proj.name and first["top_k"] == 7
    assert first["capabilities"] == ["chat", "vision"] and r.json["message"] == \
        "Model chat updated"
    assert PROJECTOR.path(first).resolve() == files.proj.resolve()

    r = api("PATCH", "/v1/models/chat", {"mmproj": str(files.other)})
    assert r.status == 200, r.body
    second = r.json["model"]
    assert second["mmproj"] == "mmproj-vision-64.gguf"
    assert [f["path"] for f in second["files"]] == [files.model.name, second["mmproj"]]
    assert not os.path.lexists(os.path.join(model["path"], files.proj.name))  # the old link
    assert files.proj.is_file()  # never the file it pointed at
    stored = json.loads(open(os.path.join(model["path"], "model.json")).read())
    assert stored["mmproj"] == second["mmproj"] and stored["files"] == second["files"]

    # The projector the model has, by its name or its path, changes nothing.
    for same in (second["mmproj"], str(PROJECTOR.path(second))):
        r = api("PATCH", "/v1/models/chat", {"mmproj": same})
        assert r.status == 200 and r.json["model"]["files"] == second["files"]


def test_patch_with_a_projector_of_the_same_name_keeps_a_whole_model(api, files, tmp_path):
    import_(api, path=files.model, id="chat", mmproj=files.proj)
    again = write_projector(tmp_path / files.proj.name, 64, kind="idefics3")
    r = api("PATCH", "/v1/models/chat", {"mmproj": str(again)})
    assert r.status == 200, r.body
    model = r.json["model"]
    assert model["mmproj"] != files.proj.name and PROJECTOR.path(model).resolve() == again
    assert ggufinfo.projector(PROJECTOR.path(model)).type == "idefics3"


@pytest.mark.parametrize("which, words", [
    ("proj96", "gives embeddings of size 96"),
    ("model", "not a projector GGUF"),
    ("relative.gguf", "not an absolute path"),
])
def test_a_bad_patch_projector_changes_nothing(api, files, which, words):
    import_(api, path=files.model, id="chat", mmproj=files.proj)
    before = api("GET", "/v1/models/chat").json
    mmproj = str(getattr(files, which, which))
    r = api("PATCH", "/v1/models/chat", {"mmproj": mmproj, "top_k": 3})
    assert r.status == 400 and r.json["error"]["param"] == "mmproj", r.body
    assert words in r.json["message"]
    assert api("GET", "/v1/models/chat").json == before


@pytest.mark.live
def test_a_running_model_keeps_its_projector_until_it_starts_again(app, api, files):
    import_(api, path=files.model, id="chat")
    assert api("POST", "/v1/models/start", {"model": "chat", "ctx_len": 64}).status == 200
    r = api("PATCH", "/v1/models/chat", {"mmproj": str(files.proj)})
    assert r.status == 200, r.body
    assert "loads this one when it is started again" in r.json["message"]
    assert r.json["model"]["status"] == "running"


def test_a_remote_model_takes_no_projector(api, files):
    r = api("POST", "/v1/models/remote", {"id": "far", "upstreams": [
        {"url": "http://127.0.0.1:9/v1", "model": "m"}]})
    assert r.status == 200, r.body
    assert r.json["model"]["capabilities"] == ["chat"]
    r = api("PATCH", "/v1/models/far", {"mmproj": str(files.proj)})
    assert r.status == 400 and "no GGUF weights" in r.json["message"]


# --- the CLI ----------------------------------------------------------------------------


def test_cli_import_and_update_with_mmproj(thread_server, files, tmp_path, monkeypatch):
    monkeypatch.chdir(files.proj.parent)  # a relative path is the caller's
    code, out, err = run("models", "import", "--path", str(files.model), "--id", "seeing",
                         "--mmproj", files.proj.name)
    assert code == ExitCode.OK, err
    code, out, err = run("models", "get", "seeing")
    model = json.loads(out)
    assert model["mmproj"] == files.proj.name and model["capabilities"] == ["chat", "vision"]

    code, out, err = run("models", "update", "seeing", "--mmproj", str(files.other))
    assert code == ExitCode.OK, err
    assert f'mmproj="{files.other}"' in out
    code, out, err = run("models", "update", "seeing", "--mmproj", str(files.proj96))
    assert code != ExitCode.OK and "gives embeddings of size 96" in err
    assert json.loads(run("models", "get", "seeing")[1])["mmproj"] == "mmproj-vision-64.gguf"
