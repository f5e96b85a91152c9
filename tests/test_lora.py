"""LoRA adapters (issue 37 item 7) on real llama.cpp: an adapter GGUF is a file of the
model (localrt.models.roles.ADAPTER), imported with `lora` (the CLI's --lora
PATH[:SCALE]) or set by a PATCH, checked against the model's header and tensors,
applied at start with its scale; a request's `lora: [{"id", "scale"}]` (llama-server's)
sets the scales it decodes with; requests of different adapters share no decode step;
GET /lora-adapters lists them and POST /lora-adapters sets the scales of the requests
that give none.

The model is a scripted one (tests/emulators/ggufgen.py): it always writes " eta"
(then its end, or again and again with `loop`), and the adapters here
(support.adapters.write_lora) adapt its output weights so that its states write other
tokens: known replies, with and without each adapter, at each scale.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
from emulators.ggufgen import _vocab, write_gguf
from support.adapters import write_lora, write_random_lora
from support.cli import run

from localrt.cli import ExitCode
from localrt.engines.llama.promptcache import PromptCache
from localrt.models.roles import ADAPTER, check_adapter
from localrt.errors import InvalidField

SCRIPT = ["▁e", "t", "a"]
BASE = " eta"  # the scripted model's reply
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The scripted model, a looping one, adapters for them, and adapters that do not fit."""
    root = tmp_path_factory.mktemp("lora")
    tokens = _vocab(320)[0]
    e, t, a = (tokens.index(x) for x in SCRIPT)

    class Files:
        model = write_gguf(root / "tiny.gguf", name="tiny", script=SCRIPT)
        looping = write_gguf(root / "loop.gguf", name="loop", script=SCRIPT, loop=True)
        wide = write_gguf(root / "wide.gguf", name="wide", n_embd=96, script=SCRIPT)
        # the first state (any token outside the script) writes "a", then the end: "a"
        first_a = write_lora(root / "adapters" / "first-a.gguf", model, {0: (a, 20.0)})
        # after "▁e", "a" (not "t"): " ea"
        skip_t = write_lora(root / "adapters" / "skip-t.gguf", model, {1: (a, 20.0)})
        # on the looping model: " ea ea ..." and " et et ..." instead of " eta eta ..."
        loop_ea = write_lora(root / "adapters" / "loop-ea.gguf", looping, {1: (a, 20.0)})
        loop_et = write_lora(root / "adapters" / "loop-et.gguf", looping, {2: (e, 20.0)})
        other_arch = write_lora(root / "bad" / "arch.gguf", model, {0: (a, 20.0)},
                                arch="qwen2")
        not_adapter = write_lora(root / "bad" / "type.gguf", model, {0: (a, 20.0)},
                                 general_type="model")
        no_alpha = write_lora(root / "bad" / "alpha.gguf", model, {0: (a, 20.0)}, alpha=0)
        no_tensor = write_lora(root / "bad" / "tensor.gguf", model, {0: (a, 20.0)},
                               tensor="blk.7.attn_q.weight")
        bad_rank = write_lora(root / "bad" / "rank.gguf", model, {0: (a, 20.0)}, rank_of_b=2)
        for_wide = write_lora(root / "bad" / "wide.gguf", wide, {0: (a, 20.0)})
    return Files


def import_(api, model_id="tiny", path=None, lora=(), **body):
    r = api("POST", "/v1/models/import", {"path": str(path), "id": model_id,
                                          "lora": list(lora), **body})
    assert r.status == 200, r.body
    return r.json["model"]


def start(api, model_id="tiny", **options):
    r = api("POST", "/v1/models/start", {"model": model_id, "ctx_len": 64, "cpu_threads": 1,
                                         "n_parallel": 2, **options})
    assert r.status == 200, r.body


def chat(api, model_id="tiny", max_tokens=8, **body):
    r = api("POST", "/v1/chat/completions", {"model": model_id, "messages": MESSAGES,
                                             "temperature": 0, "max_tokens": max_tokens,
                                             **body})
    assert r.status == 200, r.body
    return r.json["choices"][0]["message"]["content"]


def adapter(path, scale=None):
    return {"path": str(path), **({} if scale is None else {"scale": scale})}


# --- the check of an adapter's file ------------------------------------------------------


@pytest.mark.parametrize("which, words", [
    ("not_adapter", "general.type is 'model'"),
    ("model", "not a LoRA adapter GGUF"),
    ("other_arch", "is for the qwen2 architecture, but the model tiny.gguf is llama"),
    ("no_alpha", "no adapter.lora.alpha"),
    ("no_tensor", "the model has no tensor blk.7.attn_q.weight"),
    ("bad_rank", "do not make that shape"),
    ("for_wide", "output.weight is [64, 320] in the model"),
])
def test_an_adapter_that_does_not_fit_is_refused_naming_why(files, which, words):
    with pytest.raises(InvalidField) as caught:
        check_adapter(str(getattr(files, which)), files.model, field="lora[1].path")
    assert caught.value.param == "lora[1].path"
    assert words in caught.value.message, caught.value.message


def test_an_adapter_of_the_model_passes(files):
    assert check_adapter(str(files.first_a), files.model) == files.first_a
    assert ADAPTER.claims("lora-first-a.gguf") and ADAPTER.many


def test_the_ram_cache_serves_a_prompt_only_the_states_of_its_adapters():
    cache = PromptCache(1 << 20)
    tokens = list(range(40))
    cache.put(tokens, b"base", 4)
    assert cache.wants(tokens, ((0, 1.0),)) and not cache.wants(tokens)
    cache.put(tokens, b"adapted", 7, ((0, 1.0),))
    assert len(cache) == 2  # the same tokens, two states
    assert cache.find(tokens + [99])[0].data == b"base"
    assert cache.find(tokens + [99], ((0, 1.0),))[0].data == b"adapted"
    assert cache.find(tokens + [99], ((0, 0.5),)) == (None, 0)
    cache.put(tokens + [40], b"longer", 8, ((0, 1.0),))  # replaces its own prefix only
    assert cache.find(tokens)[0].data == b"base" and len(cache) == 2


# --- imports and PATCHes --------------------------------------------------------------------


def test_import_links_the_adapters_in_order_with_their_scales(api, files):
    model = import_(api, path=files.model, lora=[adapter(files.first_a),
                                                 adapter(files.skip_t, 0.5)])
    assert model["lora"] == [{"path": "lora-first-a.gguf", "scale": 1.0},
                             {"path": "lora-skip-t.gguf", "scale": 0.5}]
    names = [f["path"] for f in model["files"]]
    assert names == ["tiny.gguf", "lora-first-a.gguf", "lora-skip-t.gguf"]
    assert model["capabilities"] == ["chat"]
    assert model["vetting"]["ok"] is True  # a child loaded the model with its adapters
    assert model["source"]["lora"] == [str(files.first_a), str(files.skip_t)]
    listed = {m["id"]: m for m in api("GET", "/v1/models").json["data"]}
    assert listed["tiny"]["lora"] == model["lora"]


@pytest.mark.parametrize("which, words", [
    ("other_arch", "qwen2 architecture"),
    ("relative.gguf", "not an absolute path"),
    ("missing", "does not exist"),
])
def test_an_import_with_a_bad_adapter_is_refused_naming_it(api, files, tmp_path, which, words):
    given = {"missing": str(tmp_path / "none.gguf")}.get(which) or \
        str(getattr(files, which, which))
    r = api("POST", "/v1/models/import", {"path": str(files.model), "id": "tiny",
                                          "lora": [adapter(files.first_a), {"path": given}]})
    assert r.status == 400 and r.json["error"]["param"] == "lora[1].path", r.body
    assert words in r.json["message"]
    assert api("GET", "/v1/models/tiny").status == 404


def test_an_onnx_folder_takes_no_adapter(api, files, tmp_path):
    folder = tmp_path / "onnx"
    folder.mkdir()
    (folder / "genai_config.json").write_text("{}")
    r = api("POST", "/v1/models/import", {"path": str(folder), "lora": [adapter(files.first_a)]})
    assert r.status == 400 and r.json["error"]["param"] == "lora", r.body


def test_patch_sets_replaces_keeps_and_drops_adapters(api, files):
    import_(api, path=files.model)
    r = api("PATCH", "/v1/models/tiny", {"lora": [adapter(files.first_a, 2.0)]})
    assert r.status == 200, r.body
    model = r.json["model"]
    assert model["lora"] == [{"path": "lora-first-a.gguf", "scale": 2.0}]
    folder = model["path"]
    # The one it has (by name, or by its path in the folder) stays; a new one joins.
    r = api("PATCH", "/v1/models/tiny", {"lora": [
        adapter(files.skip_t), {"path": f"{folder}/lora-first-a.gguf", "scale": 0.25}]})
    assert r.status == 200, r.body
    assert r.json["model"]["lora"] == [{"path": "lora-skip-t.gguf", "scale": 1.0},
                                       {"path": "lora-first-a.gguf", "scale": 0.25}]
    r = api("PATCH", "/v1/models/tiny", {"lora": [adapter("lora-skip-t.gguf", 3.0)]})
    assert r.json["model"]["lora"] == [{"path": "lora-skip-t.gguf", "scale": 3.0}]
    assert [f["path"] for f in r.json["model"]["files"]] == ["tiny.gguf", "lora-skip-t.gguf"]
    assert not os.path.lexists(f"{folder}/lora-first-a.gguf")  # the link, never its target
    assert files.first_a.exists()
    r = api("PATCH", "/v1/models/tiny", {"lora": []})
    assert r.status == 200 and "lora" not in r.json["model"], r.body
    assert [f["path"] for f in r.json["model"]["files"]] == ["tiny.gguf"]


def test_a_bad_patch_adapter_changes_nothing(api, files):
    import_(api, path=files.model, lora=[adapter(files.first_a)])
    before = api("GET", "/v1/models/tiny").json
    r = api("PATCH", "/v1/models/tiny", {"lora": [adapter(files.skip_t), adapter(files.for_wide)],
                                         "top_k": 3})
    assert r.status == 400 and r.json["error"]["param"] == "lora[1].path", r.body
    assert api("GET", "/v1/models/tiny").json == before
    r = api("PATCH", "/v1/models/tiny", {"lora": [{"path": str(files.first_a), "scale": "x"}]})
    assert r.status == 400, r.body


def test_a_remote_model_takes_no_adapter(api, files):
    r = api("POST", "/v1/models/remote", {"id": "far", "upstreams": [
        {"url": "http://127.0.0.1:9/v1", "model": "m"}]})
    assert r.status == 200, r.body
    r = api("PATCH", "/v1/models/far", {"lora": [adapter(files.first_a)]})
    assert r.status == 400 and "no GGUF weights" in r.json["message"]


# --- applied, on real llama.cpp ------------------------------------------------------------


@pytest.mark.live
def test_an_adapter_changes_the_greedy_reply_and_scale_0_gives_the_base_back(api, files):
    import_(api, "base", path=files.model)
    import_(api, "adapted", path=files.model, lora=[adapter(files.first_a)])
    import_(api, "off", path=files.model, lora=[adapter(files.first_a, 0.0)])
    for model_id in ("base", "adapted", "off"):
        start(api, model_id)
    assert chat(api, "base") == BASE
    assert chat(api, "adapted") == "a"
    assert chat(api, "off") == BASE


@pytest.mark.live
def test_a_requests_lora_sets_its_own_scales(api, files):
    import_(api, path=files.model, lora=[adapter(files.first_a), adapter(files.skip_t, 0.0)])
    start(api)
    assert chat(api) == "a"  # the model's scales: first-a at 1, skip-t at 0
    assert chat(api, lora=[]) == BASE  # llama-server's: an adapter left out is 0
    assert chat(api, lora=[{"id": 0, "scale": 0}]) == BASE
    assert chat(api, lora=[{"id": 0, "scale": 0.25}]) == BASE  # 5 against the base's 10
    assert chat(api, lora=[{"id": 0, "scale": 0.75}]) == "a"
    assert chat(api, lora=[{"id": 1, "scale": 1.0}]) == " ea"
    assert chat(api, lora=[{"id": 1}]) == BASE  # no scale: 0, as llama-server's
    assert chat(api) == "a"  # nothing a request gave stays
    r = api("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 8,
                                        "temperature": 0, "lora": [{"id": 1, "scale": 1}]})
    assert r.status == 200 and r.json["choices"][0]["text"] == " ea", r.body


@pytest.mark.live
def test_an_unknown_adapter_id_is_a_400_naming_it(api, files):
    import_(api, path=files.model, lora=[adapter(files.first_a)])
    import_(api, "plain", path=files.model)
    start(api)
    start(api, "plain")
    for route, body in (("/v1/chat/completions", {"messages": MESSAGES}),
                        ("/v1/completions", {"prompt": "hi"})):
        r = api("POST", route, {"model": "tiny", **body,
                                "lora": [{"id": 0, "scale": 1}, {"id": 1, "scale": 1}]})
        assert r.status == 400 and r.json["error"]["param"] == "lora[1].id", r.body
        assert "has no adapter 1; its adapters are 0 to 0" in r.json["message"]
        r = api("POST", route, {"model": "plain", **body, "lora": [{"id": 0, "scale": 1}]})
        assert r.status == 400 and r.json["error"]["param"] == "lora[0].id", r.body
        assert "it has no LoRA adapters" in r.json["message"]


@pytest.mark.live
def test_concurrent_requests_of_different_adapters_each_get_their_own(api, files):
    # The looping model never ends: each of its tokens comes from a decode step, and
    # a step that mixed the two requests' adapters would put the wrong tokens in one.
    import_(api, path=files.looping, lora=[adapter(files.loop_ea, 0.0),
                                           adapter(files.loop_et, 0.0)])
    start(api, ctx_len=128)
    wanted = {None: " eta" * 20, 0: " ea" * 20, 1: " et" * 20}
    lengths = {None: 40, 0: 30, 1: 30}
    got, gate = {}, threading.Barrier(3)

    def one(which):
        lora = [] if which is None else [{"id": which, "scale": 1.0}]
        gate.wait()
        got[which] = chat(api, max_tokens=lengths[which], lora=lora)

    threads = [threading.Thread(target=one, args=(w,)) for w in wanted]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert got == {w: _tokens_of(wanted[w], lengths[w]) for w in wanted}


@pytest.mark.live
def test_a_prompt_cached_with_other_adapters_is_read_again(api, tmp_path):
    # A random model whose adapter changes its attention's values, so the KV it caches:
    # the one slot's cache of a prompt read with the adapter must not serve the same
    # prompt without it (nor the other way round), or the replies would differ from a
    # model that never had the adapter.
    model = write_gguf(tmp_path / "random.gguf", name="random", seed=5, weight_scale=0.2)
    lora = write_random_lora(tmp_path / "lora-v.gguf", model, "blk.0.attn_v.weight", 64, 64)
    import_(api, "adapted", path=model, lora=[adapter(lora, 0.0)])
    import_(api, "plain", path=model)
    for model_id in ("adapted", "plain"):
        start(api, model_id, n_parallel=1, ctx_len=128)
    body = {"max_tokens": 8, "logit_bias": {"2": -100}}
    base = chat(api, "plain", **body)
    with_adapter = chat(api, "adapted", lora=[{"id": 0, "scale": 1.0}], **body)
    assert with_adapter != base  # the adapter matters to this prompt's KV
    assert chat(api, "adapted", **body) == base
    assert chat(api, "adapted", lora=[{"id": 0, "scale": 1.0}], **body) == with_adapter
    assert chat(api, "adapted", **body) == base


def _tokens_of(text: str, n: int) -> str:
    """The first `n` tokens of a looping reply (each of " e", "t", "a" is one)."""
    out, i = [], 0
    while len(out) < n:
        piece = text[i:i + 2] if text[i] == " " else text[i]
        out.append(piece)
        i += len(piece)
    return "".join(out)


# --- the routes ---------------------------------------------------------------------------


@pytest.mark.live
def test_get_lora_adapters_lists_a_running_models_adapters(api, files):
    model = import_(api, path=files.model, lora=[adapter(files.first_a),
                                                 adapter(files.skip_t, 0.5)])
    r = api("GET", "/lora-adapters", query="model=tiny")
    assert r.status == 409 and r.json["error"]["code"] == "model_not_running", r.body
    assert api("GET", "/lora-adapters", query="model=nope").status == 404
    start(api)
    r = api("GET", "/lora-adapters", query="model=tiny")
    assert r.status == 200, r.body
    folder = model["path"]
    assert r.json == [{"id": 0, "path": f"{folder}/lora-first-a.gguf", "scale": 1.0},
                      {"id": 1, "path": f"{folder}/lora-skip-t.gguf", "scale": 0.5}]
    assert api("GET", "/lora-adapters").json == r.json  # the one running model


@pytest.mark.live
def test_post_lora_adapters_sets_the_scales_of_requests_that_give_none(api, files):
    import_(api, path=files.model, lora=[adapter(files.first_a), adapter(files.skip_t, 0.0)])
    start(api)
    r = api("POST", "/lora-adapters", [{"id": 1, "scale": 1.0}], query="model=tiny")
    assert r.status == 200 and r.json == {"success": True}, r.body
    assert [a["scale"] for a in api("GET", "/lora-adapters", query="model=tiny").json] \
        == [0.0, 1.0]
    assert chat(api) == " ea"
    assert chat(api, lora=[{"id": 0, "scale": 1.0}]) == "a"  # a request's own still win
    r = api("POST", "/lora-adapters", [{"id": 2, "scale": 1.0}], query="model=tiny")
    assert r.status == 400 and r.json["error"]["param"] == "[0].id", r.body
    # A restart loads the stored scales again.
    assert api("POST", "/v1/models/stop", {"model": "tiny"}).status == 200
    start(api)
    assert chat(api) == "a"


@pytest.mark.live
def test_a_running_model_keeps_its_adapters_until_it_starts_again(api, files):
    import_(api, path=files.model)
    start(api)
    r = api("PATCH", "/v1/models/tiny", {"lora": [adapter(files.first_a)]})
    assert r.status == 200, r.body
    assert "running with the adapters it started with, and loads these" in r.json["message"]
    assert chat(api) == BASE
    assert api("POST", "/v1/models/stop", {"model": "tiny"}).status == 200
    start(api)
    assert chat(api) == "a"


# --- the CLI ------------------------------------------------------------------------------


def test_cli_import_and_update_with_lora(thread_server, files, monkeypatch):
    monkeypatch.chdir(files.first_a.parent)  # a relative path is the caller's
    code, out, err = run("models", "import", "--path", str(files.model), "--id", "tiny",
                         "--lora", files.first_a.name, "--lora", f"{files.skip_t.name}:0.5")
    assert code == ExitCode.OK, err
    model = json.loads(run("models", "get", "tiny")[1])
    assert model["lora"] == [{"path": "lora-first-a.gguf", "scale": 1.0},
                             {"path": "lora-skip-t.gguf", "scale": 0.5}]
    code, out, err = run("models", "update", "tiny", "--lora", f"{files.skip_t}:-1.5")
    assert code == ExitCode.OK, err
    assert json.loads(run("models", "get", "tiny")[1])["lora"] == [
        {"path": "lora-skip-t.gguf", "scale": -1.5}]
    code, out, err = run("models", "update", "tiny", "--lora", str(files.other_arch))
    assert code != ExitCode.OK and "qwen2 architecture" in err
    code, out, err = run("models", "update", "tiny", "--lora", "")
    assert code == ExitCode.OK, err
    assert "lora" not in json.loads(run("models", "get", "tiny")[1])
