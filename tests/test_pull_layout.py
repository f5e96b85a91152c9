"""Pulls against the hub as it really is: cortexso's branches and metadata.yml, repos of
many quantizations, split GGUFs, projectors, gated and unknown repos, rate limits, and
every id shape (README "Models"). Real HTTP to the hub emulator, real llama.cpp loads."""

from __future__ import annotations

import hashlib
from collections import namedtuple

import pytest
from emulators.ggufgen import write_gguf
from support.apps import bind
from support.projectors import write_projector
from support.servers import send
from support.tasks import wait_task

pytestmark = pytest.mark.live

MODEL_YML = (b"name: TinyLlama Chat\nmodel: tinyllama:1b\nversion: 2\nengine: llama.cpp\n"
             b"ctx_len: 128\ntemperature: 0.7\nn_parallel: 1\nngl: 33\n"
             b"prompt_template: \"<|system|>\\n{system_message}</s>\\n<|user|>\\n{prompt}</s>\"\n"
             b"files:\n  - models/tinyllama/1b/model.gguf\nreleased: 2024-05-01\n")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout")
    W = namedtuple("W", "a b c split projector small large")
    return W(write_gguf(root / "a.gguf", name="a"), write_gguf(root / "b.gguf", name="b", seed=1),
             write_gguf(root / "c.gguf", name="c", seed=2),
             write_gguf(root / "split" / "m.gguf", name="split", n_layer=2,
                        split_max_tensors=6),
             # a projector's header, which passes the header check (ggufcheck), with
             # nothing mtmd could run: loading it fails
             write_projector(root / "mmproj.gguf", 64),
             write_projector(root / "small.gguf", 64), write_projector(root / "large.gguf", 128))


@pytest.fixture
def hub_repos(weights):
    """The repos conftest's `hub` serves in this module."""

    def add(hub):
        hub.add_cortexso("tinyllama", {"1b": {"model.gguf": weights.a, "model.yml": MODEL_YML},
                                       "3b": {"model.gguf": weights.b}},
                         default="1b", source_model="tinyllama-1.1b-chat-v1.0")
        hub.add_cortexso("nodefault", {"1b": {"model.gguf": weights.a},
                                       "8b": {"model.gguf": weights.b}}, default=None)
        hub.add_cortexso("onlyone", {"2b": {"model.gguf": weights.a}}, metadata=False)
        hub.add_cortexso("vision", {"4b": {"model.gguf": weights.a,
                                           "mmproj.gguf": weights.projector}}, default="4b")
        hub.add_repo("org/quants", {"Model.Q2_K.gguf": weights.a, "model-q4_k_m.gguf": weights.b,
                                    "Model.Q8_0.gguf": weights.c,
                                    "mmproj-model-f16.gguf": weights.projector,
                                    "README.md": b"many\n"})
        for quants in (("F16", "BF16", "Q8_0"), ("BF16", "Q8_0", "Q4_K_M"), ("Q8_0", "Q4_0"),
                       ("Q4_K_M", "Q6_K"), ("Q6_K",)):  # several projectors, or one
            hub.add_repo(f"org/proj-{'-'.join(quants).lower()}",
                         {"m.Q4_K_M.gguf": weights.a,
                          **{f"mmproj-m-{q}.gguf": weights.large if q == "Q4_K_M" else
                             weights.small for q in quants}})
        hub.add_repo("org/nochoice", {"x.Q2_K.gguf": weights.a, "x.Q8_0.gguf": weights.b})
        parts = sorted(weights.split.parent.glob("m-*.gguf"))
        hub.add_repo("org/split", {f"Q4_K_M/{p.name.replace('m-', 'big-Q4_K_M-')}": p
                                   for p in parts} | {"big-Q8_0.gguf": weights.c})
        hub.add_repo("org/text", {"README.md": b"no weights\n", "config.json": b"{}"})
        hub.add_repo("org/gated", {"g.Q4_K_M.gguf": weights.a}, gated_token="hf_right")
        hub.parts = parts

    return add


@pytest.fixture
def api(hub_app):
    return bind(hub_app)


def fetched(hub):
    """The files whose bytes were asked for (GET on resolve), by path."""
    return sorted(r.path.split("/resolve/", 1)[1] for r in hub.requests_to("hub")
                  if r.method == "GET" and "/resolve/" in r.path)


def pull(api, model_id, **extra):
    r = api("POST", "/v1/models/pull", {"model": model_id, **extra})
    assert r.status == 200, r.body
    if "task" in r.json:
        assert wait_task(api, r.json["task"]["id"])["status"] == "Success"
    return r.json


@pytest.mark.parametrize("model_id", ["tinyllama", "cortexso/tinyllama",
                                      "{hub}/cortexso/tinyllama"])
def test_a_builtin_pulls_its_default_branch_only(api, hub, weights, model_id):
    reply = pull(api, model_id.format(hub=hub.url))
    assert reply["model"] == "tinyllama:1b" and reply["task"]["id"] == "cortexso:tinyllama:1b"
    # metadata.yml from main, then the 1b branch's files: never main's quantizations
    assert fetched(hub) == ["1b/README.md", "1b/metadata.yml", "1b/model.gguf",
                            "1b/model.yml", "main/metadata.yml"]
    assert not any("tinyllama-1.1b-chat-v1.0" in p for p in fetched(hub))
    model = api("GET", "/v1/models/tinyllama:1b").json
    assert model["source"]["revision"] == "1b" and model["engine"] == "gguf-cpp"
    assert hashlib.sha256(weights.a.read_bytes()).hexdigest() in \
        [f["sha256"] for f in model["files"]]
    # model.yml: its parameters are stored, its other fields kept and shown
    assert model["name"] == "TinyLlama Chat" and model["ctx_len"] == 128
    assert model["temperature"] == 0.7 and model["ngl"] == 33
    assert model["prompt_template"].startswith("<|system|>")
    assert model["n_parallel"] == 1 and model["version"] == 2 and model["model"] == "tinyllama:1b"
    assert model["released"] == "2024-05-01"  # a YAML date, kept as text
    assert [f["path"] for f in model["files"]] != ["models/tinyllama/1b/model.gguf"]
    # pulled again by any of its names: nothing is fetched
    hub.clear_requests()
    for again in ("tinyllama:1b", "tinyllama"):
        r = api("POST", "/v1/models/pull", {"model": again})
        assert r.status == 200 and "already downloaded" in r.json["message"], r.body
    assert fetched(hub) == ["main/metadata.yml"]  # only the bare name asks for the default


def test_a_named_branch_and_branch_urls(api, hub):
    assert pull(api, "tinyllama:3b")["model"] == "tinyllama:3b"
    assert fetched(hub) == sorted(["3b/README.md", "3b/metadata.yml", "3b/model.gguf"])
    base = f"{hub.url}/cortexso/nodefault"
    assert pull(api, f"{base}/tree/8b")["model"] == "nodefault:8b"
    assert pull(api, f"{base}/blob/1b/model.gguf")["model"] == "nodefault:1b"
    ids = [m["id"] for m in api("GET", "/v1/models").json["data"]]
    assert ids == ["nodefault:1b", "nodefault:8b", "tinyllama:3b"]


def test_a_branch_that_does_not_exist_names_those_that_do(api, hub):
    r = api("POST", "/v1/models/tinyllama:70b/pull")
    assert r.status == 404 and r.json["error"]["param"] == "model"
    assert "no variant 70b" in r.json["message"] and "1b, 3b" in r.json["message"]
    assert r.json["branches"] == ["1b", "3b"]
    assert api("GET", "/v1/models/pull").json["data"] == []


def test_without_a_default_one_branch_is_taken_and_several_are_a_choice(api, hub):
    assert pull(api, "onlyone")["model"] == "onlyone:2b"
    hub.clear_requests()
    r = api("POST", "/v1/models/pull", {"model": "nodefault"})
    assert r.status == 400 and r.json["error"]["param"] == "model"
    assert "choose one: `localrt pull nodefault:1b`, `localrt pull nodefault:8b`" in \
        r.json["message"]
    assert r.json["branches"] == ["1b", "8b"]
    assert fetched(hub) == ["main/metadata.yml"]
    assert api("GET", "/v1/models/pull").json["data"][0]["id"] == "cortexso:onlyone:2b"


def test_variants_lists_branches_with_sizes_and_the_default(api, hub, weights):
    r = api("POST", "/v1/models/variants", {"model": "tinyllama"})
    assert r.status == 200, r.body
    assert r.json["kind"] == "branches" and r.json["default"] == "tinyllama:1b"
    rows = {row["name"]: row for row in r.json["data"]}
    assert set(rows) == {"1b", "3b"} and rows["1b"]["default"] and not rows["3b"]["default"]
    assert rows["3b"]["id"] == "tinyllama:3b"
    assert rows["3b"]["size"] > weights.b.stat().st_size  # the weights and the small files
    r = api("POST", "/v1/models/variants", {"model": "org/quants"})
    assert r.json["kind"] == "files" and r.json["default"] == "org/quants:model-q4_k_m.gguf"
    assert [(row["name"], row["quantization"]) for row in r.json["data"]] == [
        ("Model.Q2_K.gguf", "Q2_K"), ("Model.Q8_0.gguf", "Q8_0"),
        ("model-q4_k_m.gguf", "Q4_K_M")]
    r = api("POST", "/v1/models/variants", {"model": "tinyllama:1b"})
    assert r.status == 400 and r.json["error"]["param"] == "model"


def test_a_repo_takes_its_q4_k_m_file_whatever_the_case_and_its_projector(api, hub, weights):
    reply = pull(api, "org/quants")
    assert reply["model"] == "org:quants:model-q4_k_m.gguf"
    assert fetched(hub) == ["main/mmproj-model-f16.gguf", "main/model-q4_k_m.gguf"]
    model = api("GET", f"/v1/models/{reply['model']}").json
    assert model["mmproj"] == "mmproj-model-f16.gguf"
    # the projector is never what loads as the model; it loads beside it, through
    # mtmd, and this one (a header of no real projector) fails the start clearly, not a 500
    r = api("POST", f"/v1/models/{reply['model']}/start", {"ctx_len": 64})
    assert r.status == 422 and r.json["error"]["code"] == "model_load_failed", r.body
    assert "projector" in r.json["message"]


@pytest.mark.parametrize("pick, file", [(":Q8_0", "Model.Q8_0.gguf"),
                                        (":q2_k", "Model.Q2_K.gguf"),
                                        (":Model.Q8_0.gguf", "Model.Q8_0.gguf")])
def test_a_quantization_or_a_file_picks_one(api, hub, pick, file):
    reply = pull(api, "org/quants" + pick)
    assert reply["model"] == f"org:quants:{file}"
    assert f"main/{file}" in fetched(hub) and len(fetched(hub)) == 2  # and the projector
    # the registered id pulls the same file again
    r = api("POST", "/v1/models/pull", {"model": reply["model"]})
    assert r.status == 200 and "already downloaded" in r.json["message"]
    api("DELETE", f"/v1/models/{reply['model']}")
    assert pull(api, reply["model"])["model"] == reply["model"]


def test_no_q4_k_m_and_no_choice_is_a_400_listing_files(api, hub, weights):
    r = api("POST", "/v1/models/pull", {"model": "org/nochoice"})
    assert r.status == 400 and r.json["error"]["param"] == "file"
    assert r.json["files"] == ["x.Q2_K.gguf", "x.Q8_0.gguf"]
    assert [(c["file"], c["quantization"], c["size"]) for c in r.json["choices"]] == [
        ("x.Q2_K.gguf", "Q2_K", weights.a.stat().st_size),
        ("x.Q8_0.gguf", "Q8_0", weights.b.stat().st_size)]
    r = api("POST", "/v1/models/pull", {"model": "org/nochoice:Q4_0"})
    assert r.status == 404 and "x.Q2_K.gguf, x.Q8_0.gguf" in r.json["message"]
    assert api("GET", "/v1/models/pull").json["data"] == []


def test_a_repo_without_weights_is_a_400_before_any_download(api, hub):
    r = api("POST", "/v1/models/pull", {"model": "org/text"})
    assert r.status == 400 and "no GGUF or ONNX model files" in r.json["message"]
    assert fetched(hub) == [] and api("GET", "/v1/models/pull").json["data"] == []


def test_a_split_gguf_pulls_every_part_and_loads_the_first(api, hub):
    reply = pull(api, "org/split")  # Q4_K_M is a folder of parts here, as on the hub
    first = f"Q4_K_M/big-Q4_K_M-00001-of-{len(hub.parts):05d}.gguf"
    assert reply["model"] == f"org:split:{first}"
    assert fetched(hub) == [f"main/Q4_K_M/{p.name.replace('m-', 'big-Q4_K_M-')}"
                            for p in hub.parts]
    model = api("GET", f"/v1/models/{reply['model']}").json
    assert len(model["files"]) == len(hub.parts) > 2 and model["metadata"]["name"] == "split"
    r = api("POST", "/v1/chat/completions", {"model": reply["model"], "max_tokens": 3,
                                            "messages": [{"role": "user", "content": "hi"}]})
    assert r.status == 200, r.body  # real llama.cpp read every part
    assert r.json["usage"]["completion_tokens"] >= 1


def test_a_builtin_branch_with_a_projector_records_it(api, hub):
    reply = pull(api, "vision")
    assert reply["model"] == "vision:4b"
    assert reply["message"] == "Model vision:4b starts downloading, with its projector " \
                               "mmproj.gguf"
    assert "4b/mmproj.gguf" in fetched(hub)
    model = api("GET", "/v1/models/vision:4b").json
    assert model["mmproj"] == "mmproj.gguf" and model["metadata"]["name"] == "a"
    assert model["capabilities"] == ["chat", "vision"]


@pytest.mark.parametrize("repo, chosen", [
    ("org/proj-f16-bf16-q8_0", "mmproj-m-F16.gguf"),
    ("org/proj-bf16-q8_0-q4_k_m", "mmproj-m-BF16.gguf"),
    ("org/proj-q8_0-q4_0", "mmproj-m-Q8_0.gguf"),
    ("org/proj-q4_k_m-q6_k", "mmproj-m-Q4_K_M.gguf"),  # none preferred: the largest
    ("org/proj-q6_k", "mmproj-m-Q6_K.gguf"),  # the only one
])
def test_a_repo_with_several_projectors_pulls_one_by_its_quantization(api, hub, repo,
                                                                       chosen):
    reply = pull(api, repo)
    assert reply["message"].endswith(f", with its projector {chosen}")
    assert fetched(hub) == sorted([f"main/{chosen}", "main/m.Q4_K_M.gguf"])
    model = api("GET", f"/v1/models/{reply['model']}").json
    assert model["mmproj"] == chosen and model["capabilities"] == ["chat", "vision"]
    assert sorted(f["path"] for f in model["files"]) == sorted([chosen, "m.Q4_K_M.gguf"])


def test_a_gated_repo_fails_clearly_before_downloading(api, hub):
    r = api("POST", "/v1/models/pull", {"model": "org/gated"})
    assert r.status == 403 and r.json["error"]["code"] == "hub_token_required"
    assert "org/gated is gated and needs a token" in r.json["message"]
    api("PATCH", "/v1/configs", {"modelhub_token": "hf_wrong"})
    r = api("POST", "/v1/models/pull", {"model": "org/gated"})
    assert r.status == 403 and r.json["error"]["code"] == "hub_token_rejected"
    assert "org/gated" in r.json["message"] and "access" in r.json["message"]
    assert not hub.requests_to("cdn") and api("GET", "/v1/models/pull").json["data"] == []
    api("PATCH", "/v1/configs", {"modelhub_token": "hf_right"})
    assert pull(api, "org/gated")["model"] == "org:gated:g.Q4_K_M.gguf"


@pytest.mark.parametrize("status", [401, 404])
@pytest.mark.parametrize("model_id", ["org/missing", "missing", "missing:1b",
                                      "org:missing:x.gguf"])
def test_an_unknown_repo_is_a_404_and_no_task(api, hub, status, model_id):
    hub.missing_repo_status = status
    api("PATCH", "/v1/configs", {"modelhub_token": "hf_any"})
    r = api("POST", "/v1/models/pull", {"model": model_id})
    assert r.status == 404 and r.json["error"]["code"] == "model_not_found_on_hub", r.body
    assert "does not exist" in r.json["message"] and "not a token problem" in r.json["message"]
    assert api("GET", "/v1/models/pull").json["data"] == []


def test_pages_and_rate_limits_of_the_api_are_followed(api, hub):
    hub.tree_page_size = 1
    hub.rate_limit, hub.rate_limit_on = [1, 0], {"api"}
    assert pull(api, "tinyllama:1b")["model"] == "tinyllama:1b"
    model = api("GET", "/v1/models/tinyllama:1b").json
    assert len(model["files"]) == 4  # every page was read


@pytest.mark.parametrize("method, path", [
    ("POST", "/v1/models/a\nb/pull"), ("GET", "/v1/models/a\nb"),
    ("DELETE", "/v1/models/a\nb"), ("PATCH", "/v1/models/a\nb"),
    ("POST", "/v1/models/a\nb/start"), ("POST", "/v1/models/a\nb/stop"),
    ("POST", "/models/a\nb/stop"), ("POST", "/v1/models/a\x7fb/pull"),
])
def test_an_id_with_a_control_character_is_a_400_on_every_route(api, method, path):
    r = api(method, path, {} if method in ("PATCH", "POST") else None)
    assert r.status == 400 and r.json["error"]["param"] == "model", (path, r.body)
    assert "control character" in r.json["message"]


def test_a_percent_encoded_newline_reaches_the_route_over_http(live_server):
    status, body = send(live_server.url, "POST", "/v1/models/a%0Ab/pull")
    assert status == 400 and body["error"]["param"] == "model"
    assert "control character" in body["message"]


def test_a_wrong_proxy_password_is_never_a_token_error(api, hub, tmp_path):
    from emulators.proxyfix import start_proxy

    with start_proxy(tmp_path, username="alice", password="s3cret") as proxy:
        api("PATCH", "/v1/configs", {"proxy_url": proxy.url, "proxy_username": "alice",
                                     "proxy_password": "wrong", "no_proxy": "",
                                     "modelhub_token": "hf_right"})
        for model_id in ("tinyllama", "tinyllama:1b", "org/gated", "org/quants:Q8_0"):
            r = api("POST", "/v1/models/pull", {"model": model_id})
            assert r.status == 502 and r.json["error"]["code"] == "proxy_auth_failed", r.body
            assert f"127.0.0.1:{proxy.port}" in r.json["message"]
            assert b"wrong" not in r.body
            assert "token" not in r.json["message"]
