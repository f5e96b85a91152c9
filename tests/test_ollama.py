"""Ollama's API under /api/ (localrt.dialects.ollama): the real `ollama` client against a live
server, and each route's edges through the WSGI app, on real llama.cpp.

The models are generated (tests/emulators/ggufgen.py): a tiny random llama with a ChatML template
(gibberish, so the tests check shapes, counts, finish reasons and that a grammar holds),
the same llama with fill-in-the-middle tokens, a tiny random BERT for embeddings, and a
"scripted" llama carrying Qwen 2.5's real chat template whose weights make it always
answer with one Hermes tool call, so an Ollama request, which has no tool_choice, gets a
call from real llama.cpp. Pulls come from the hub emulator (tests/emulators/hubemu.py).
"""

from __future__ import annotations

import json
import signal
import time
from datetime import datetime, timezone

import gguf
import ollama
import pytest
from emulators.chattemplates import TEMPLATES
from emulators.ggufgen import FIM_TOKENS, write_bert_gguf, write_gguf
from support.apps import bind, call
from support.servers import run_foreground_server, send
from support.waiting import wait_for

from localrt.api import IMAGE_BODY

USER = [{"role": "user", "content": "Why is the sky blue?"}]
CALL_NAME = '{"name": "get_weather", '
CALL_ARGS = '"arguments": {"city": "Paris"}}'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
NO_EOS = {"num_predict": 6, "temperature": 0}  # short replies (EOS rarely comes first)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ollama")
    user = gguf.TokenType.USER_DEFINED
    script = ["<tool_call>", CALL_NAME, CALL_ARGS, "</tool_call>"]
    return {
        "tiny": write_gguf(root / "tiny.gguf", context_length=512),
        "fim": write_gguf(root / "fim.gguf", added_tokens=FIM_TOKENS),
        "bert": write_bert_gguf(root / "bert.gguf"),
        "caller": write_gguf(root / "caller.gguf", name="caller", vocab_size=400,
                             context_length=2048, chat_template=TEMPLATES["qwen25"],
                             added_tokens=[(t, user) for t in script],
                             script=script),
    }


# --- through the WSGI app ----------------------------------------------------------


@pytest.fixture
def api(app, ggufs):
    """call(...) bound to an app with every generated model imported."""
    api = bind(app)
    for model_id, path in ggufs.items():
        r = api("POST", "/v1/models/import", {"path": str(path), "id": model_id})
        assert r.status == 200, r.body
    return api


def lines(app, r, kind: str) -> list:
    """A newline-delimited JSON reply's objects, each checked against replies.json."""
    assert r.status == 200, r.body
    assert r.headers["content-type"] == "application/x-ndjson"
    text = r.body.decode()
    assert text.endswith("\n") and "\n\n" not in text
    out = [json.loads(line) for line in text.splitlines()]
    for obj in out:
        assert not app.validators.reply_errors(f"ollama-{kind}-line", obj), obj
    return out


@pytest.mark.live
def test_a_chat_streams_pieces_then_the_statistics(app, api):
    r = api("POST", "/api/chat", {"model": "tiny", "messages": USER, "options": NO_EOS})
    got = lines(app, r, "chat")
    *pieces, last = got
    assert pieces and all(not p["done"] and p["model"] == "tiny" for p in pieces)
    assert all(set(p["message"]) == {"role", "content"} for p in pieces)
    assert last["done"] is True and last["done_reason"] == "length"
    assert last["message"] == {"role": "assistant", "content": ""}
    assert last["eval_count"] == 6 and last["prompt_eval_count"] > 5
    assert last["total_duration"] >= last["load_duration"] + last["prompt_eval_duration"] \
        + last["eval_duration"] > 0
    assert last["load_duration"] > 0  # the request started the model
    text = "".join(p["message"]["content"] for p in pieces)

    whole = api("POST", "/api/chat", {"model": "tiny", "messages": USER, "options": NO_EOS,
                                      "stream": False})
    assert whole.status == 200 and whole.headers["content-type"] == "application/json"
    reply = whole.json
    assert reply["message"] == {"role": "assistant", "content": text}  # greedy: the same
    assert reply["done"] and reply["done_reason"] == "length" and reply["eval_count"] == 6
    assert reply["load_duration"] == 0  # running already
    datetime.strptime(reply["created_at"], "%Y-%m-%dT%H:%M:%S.%fZ")


@pytest.mark.live
def test_options_are_sampling_fields(api):
    def chat(**options):
        r = api("POST", "/api/chat", {"model": "tiny", "messages": USER, "stream": False,
                                      "options": {"num_predict": 12, **options}})
        assert r.status == 200, r.body
        return r.json

    seeded = chat(temperature=1.5, seed=7, top_k=50, top_p=0.95)
    assert seeded["message"] == chat(temperature=1.5, seed=7, top_k=50, top_p=0.95)["message"]
    greedy = chat(temperature=0)
    assert greedy["message"] == chat(temperature=0, num_thread=3, mirostat=1)["message"]
    content = greedy["message"]["content"]
    stop = content[3:5]
    cut = chat(temperature=0, stop=[stop])
    assert cut["done_reason"] == "stop"
    assert cut["message"]["content"] == content[:content.index(stop)]


@pytest.mark.live
def test_num_ctx_starts_the_model_with_that_context(api):
    r = api("POST", "/api/generate", {"model": "tiny", "options": {"num_ctx": 300}})
    assert r.status == 200 and r.json["done_reason"] == "load"
    assert running(api, "tiny")["options"]["ctx_len"] == 300
    # a running model keeps its context; more than the model was trained on is clamped
    api("POST", "/api/chat", {"model": "tiny", "messages": USER, "stream": False,
                              "options": {"num_ctx": 100, "num_predict": 1}})
    assert running(api, "tiny")["options"]["ctx_len"] == 300
    api("POST", "/v1/models/stop", {"model": "tiny"})
    r = api("POST", "/api/generate", {"model": "tiny", "options": {"num_ctx": 100000}})
    assert r.status == 200 and running(api, "tiny")["options"]["ctx_len"] == 512


def running(api, model_id):
    rows = {r["id"]: r for r in api("GET", "/v1/models/status").json["data"]}
    return rows.get(model_id)


@pytest.mark.live
def test_keep_alive_sets_when_the_model_unloads(api):
    ask = {"model": "tiny", "messages": USER, "options": {"num_predict": 2}, "stream": False}
    r = api("POST", "/api/chat", {**ask, "keep_alive": "1h"})
    assert r.status == 200, r.body
    [row] = api("GET", "/api/ps").json["models"]
    expires = datetime.strptime(row["expires_at"], "%Y-%m-%dT%H:%M:%S.%fZ") \
        .replace(tzinfo=timezone.utc).timestamp()
    assert abs(expires - (time.time() + 3600)) < 60
    assert row["name"] == "tiny" and row["context_length"] == 512
    r = api("POST", "/api/chat", {**ask, "keep_alive": -1})
    [row] = api("GET", "/api/ps").json["models"]
    assert row["expires_at"].startswith("23")  # Ollama's "forever": about 292 years on
    r = api("POST", "/api/chat", {**ask, "keep_alive": 0.3})
    assert api("GET", "/api/ps").json["models"]
    wait_for(lambda: api("GET", "/api/ps").json["models"] == [], 10,
             "the model unloaded 0.3 s after its reply")
    r = api("POST", "/api/chat", {**ask, "keep_alive": "0"})  # unloads once the reply is done
    assert r.status == 200 and r.json["message"]["content"]
    assert api("GET", "/api/ps").json["models"] == []


@pytest.mark.live
def test_keep_alive_0_waits_for_the_models_other_requests(app, api):
    api("POST", "/api/chat", {"model": "tiny", "messages": []})
    lease = app.services.scheduler.lease("tiny")  # another request, under way
    try:
        r = api("POST", "/api/chat", {"model": "tiny", "messages": USER, "keep_alive": 0,
                                      "stream": False, "options": {"num_predict": 2,
                                                                   "temperature": 0}})
        assert r.status == 200 and r.json["eval_count"] == 2
        # What unloads an idle model past its keep-alive, run now: this one is not idle.
        app.services.scheduler.reap()
        assert running(api, "tiny") is not None
    finally:
        lease.release()
    wait_for(lambda: running(api, "tiny") is None, 10, "the model unloaded once idle")


@pytest.mark.live
def test_no_messages_loads_and_keep_alive_0_unloads(api):
    r = api("POST", "/api/chat", {"model": "tiny", "messages": []})
    assert r.status == 200 and r.json["done"] and r.json["done_reason"] == "load"
    assert r.json["message"] == {"role": "assistant", "content": ""}
    assert running(api, "tiny") is not None
    r = api("POST", "/api/generate", {"model": "tiny", "keep_alive": 0})
    assert r.status == 200 and r.json["done_reason"] == "unload" and r.json["response"] == ""
    assert running(api, "tiny") is None


@pytest.mark.live
def test_generate_puts_the_prompt_in_the_template_unless_raw(app, api):
    ask = {"model": "tiny", "prompt": "Why is the sky blue?", "options": NO_EOS}
    templated = lines(app, api("POST", "/api/generate", ask), "generate")
    raw = lines(app, api("POST", "/api/generate", {**ask, "raw": True}), "generate")
    for got in (templated, raw):
        *pieces, last = got
        assert all("response" in p and not p["done"] for p in pieces)
        assert last["done"] and last["response"] == "" and last["eval_count"] == 6
    # ChatML's turn markers and "user"/"assistant" are many more tokens than BOS alone
    assert templated[-1]["prompt_eval_count"] > raw[-1]["prompt_eval_count"] + 5
    system = api("POST", "/api/generate", {**ask, "system": "Be brief.", "stream": False})
    assert system.json["prompt_eval_count"] > templated[-1]["prompt_eval_count"]
    assert system.json["response"] and system.json["done_reason"] == "length"


@pytest.mark.live
def test_a_suffix_is_a_fill_in_the_middle_prompt(api):
    r = api("POST", "/api/generate", {"model": "fim", "prompt": "def add(a, b):",
                                      "suffix": "return c", "stream": False,
                                      "options": NO_EOS})
    assert r.status == 200, r.body
    assert r.json["eval_count"] == 6 and r.json["response"]
    r = api("POST", "/api/generate", {"model": "tiny", "prompt": "a", "suffix": "b"})
    assert r.status == 400 and "suffix" in r.json["error"]


@pytest.mark.live
def test_format_json_and_a_schema(app, api):
    r = api("POST", "/api/chat", {"model": "tiny", "messages": USER, "format": ANSWER,
                                  "stream": False, "options": {"num_predict": 64}})
    assert r.status == 200, r.body
    assert json.loads(r.json["message"]["content"])["answer"] in ("yes", "no")
    got = lines(app, api("POST", "/api/generate", {"model": "tiny", "prompt": "Sky?",
                                                   "format": ANSWER,
                                                   "options": {"num_predict": 64}}),
                "generate")
    assert json.loads("".join(o["response"] for o in got))["answer"] in ("yes", "no")
    r = api("POST", "/api/chat", {"model": "tiny", "messages": USER, "format": "json",
                                  "stream": False, "options": {"num_predict": 4}})
    assert r.json["message"]["content"].lstrip().startswith(("{", "["))


@pytest.mark.live
def test_a_tool_call_comes_whole_with_arguments_as_an_object(app, api):
    ask = {"model": "caller", "messages": USER, "tools": [WEATHER], "stream": False}
    reply = api("POST", "/api/chat", ask).json
    [call_] = reply["message"]["tool_calls"]
    assert call_["function"]["name"] == "get_weather"
    assert call_["function"]["arguments"] == {"city": "Paris"}
    assert reply["message"]["content"] == "" and reply["done_reason"] == "stop"
    streamed = lines(app, api("POST", "/api/chat", {**ask, "stream": True}), "chat")
    calls = [c for o in streamed for c in o["message"].get("tool_calls", [])]
    assert [c["function"] for c in calls] == [{**call_["function"], "index": 0}]
    assert streamed[-1]["done"] and streamed[-1]["eval_count"] > 3

    # the round trip: the call and the tool's answer rendered by Qwen's own template
    history = USER + [reply["message"], {"role": "tool", "tool_name": "get_weather",
                                         "content": '{"celsius": 21}'}]
    again = api("POST", "/api/chat", {**ask, "messages": history}).json
    assert again["prompt_eval_count"] > reply["prompt_eval_count"] + 10
    assert again["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.live
def test_embed_gives_one_unit_vector_per_input(api):
    r = api("POST", "/api/embed", {"model": "bert", "input": ["a fox", "a dog"]})
    assert r.status == 200, r.body
    reply = r.json
    assert reply["model"] == "bert" and len(reply["embeddings"]) == 2
    for v in reply["embeddings"]:
        assert abs(sum(x * x for x in v) - 1) < 1e-4
    assert reply["prompt_eval_count"] > 2 and reply["load_duration"] > 0
    one = api("POST", "/api/embed", {"model": "bert", "input": "a fox", "dimensions": 8})
    assert len(one.json["embeddings"][0]) == 8
    empty = api("POST", "/api/embed", {"model": "bert", "input": []}).json
    assert empty["embeddings"] == []


def test_show_reads_the_record_and_the_gguf(api):
    r = api("POST", "/api/show", {"model": "caller"})
    assert r.status == 200, r.body
    shown = r.json
    assert shown["template"] == TEMPLATES["qwen25"]
    assert shown["details"]["family"] == "llama" and shown["details"]["format"] == "gguf"
    assert shown["model_info"]["general.architecture"] == "llama"
    assert shown["model_info"]["llama.context_length"] == 2048
    assert shown["model_info"]["tokenizer.ggml.tokens"] == []
    assert "tokenizer.chat_template" not in shown["model_info"]
    assert shown["capabilities"] == ["completion", "tools"]
    assert "PARAMETER num_ctx 2048" in shown["modelfile"]
    assert shown["modelfile"].startswith("# Modelfile") and "FROM /" in shown["modelfile"]
    assert "num_ctx" in shown["parameters"]
    assert api("POST", "/api/show", {"name": "bert"}).json["capabilities"] == ["embedding"]
    fim = api("POST", "/api/show", {"model": "fim"}).json
    assert fim["capabilities"] == ["completion"]


def test_tags_list_every_model_by_its_id(api, ggufs):
    models = {m["name"]: m for m in api("GET", "/api/tags").json["models"]}
    assert set(models) == set(ggufs)
    tiny = models["tiny"]
    assert tiny["model"] == "tiny" and tiny["size"] == ggufs["tiny"].stat().st_size
    assert tiny["details"]["quantization_level"] == "F32" and len(tiny["digest"]) == 64
    assert tiny["digest"] != models["fim"]["digest"]


@pytest.mark.live
def test_delete_stops_a_running_model_first(api):
    api("POST", "/api/chat", {"model": "tiny", "messages": []})
    r = api("DELETE", "/api/delete", {"model": "tiny"})
    assert r.status == 200 and r.json == {"status": "success"}
    assert "tiny" not in {m["name"] for m in api("GET", "/api/tags").json["models"]}
    r = api("DELETE", "/api/delete", {"model": "tiny"})
    assert r.status == 404 and "tiny" in r.json["error"]


@pytest.mark.parametrize("method,path,body,status,field", [
    ("POST", "/api/chat", {"messages": USER}, 400, "model"),
    ("POST", "/api/chat", {"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("POST", "/api/chat", {"model": "tiny", "messages": [{"role": "robot"}]}, 400, "role"),
    ("POST", "/api/chat", {"model": "tiny", "messages": USER,
                           "options": {"temperature": "hot"}}, 400, "options.temperature"),
    ("POST", "/api/chat", {"model": "tiny", "messages": USER, "format": "yaml"}, 400,
     "format"),
    ("POST", "/api/chat", {"model": "tiny", "messages": USER, "keep_alive": "soon"}, 400,
     "keep_alive"),
    ("POST", "/api/chat", {"model": "tiny", "messages": [{**USER[0], "images": ["aGk="]}]},
     400, "does not take images"),
    ("POST", "/api/generate", {"model": "tiny", "prompt": "a", "raw": True,
                               "images": ["aGk="]}, 400, "images"),
    pytest.param("POST", "/api/chat", {"model": "tiny", "messages": USER, "tools": [WEATHER]},
                 400, "tools", marks=pytest.mark.live),  # ChatML: no calls localrt can read
    ("POST", "/api/chat", {"model": "nope", "messages": USER}, 404, "nope"),
    ("POST", "/api/generate", {"model": "tiny", "prompt": "a", "template": "{{ .Prompt }}"},
     400, "template"),
    ("POST", "/api/generate", {"model": "tiny", "prompt": "a", "raw": True,
                               "format": "json"}, 400, "format"),
    ("POST", "/api/generate", {"model": "tiny", "prompt": "a",
                               "options": {"num_predict": "many"}}, 400, "num_predict"),
    ("POST", "/api/embed", {"model": "bert", "input": [1, 2]}, 400, "input"),
    ("POST", "/api/embed", {"model": "tiny", "input": "a", "dimensions": 0}, 400,
     "dimensions"),
    ("POST", "/api/pull", {}, 400, "model"),
    ("POST", "/api/pull", {"model": "../../etc"}, 400, "model"),
    ("POST", "/api/show", {"model": "nope"}, 404, "nope"),
    ("DELETE", "/api/delete", {"model": 3}, 400, "model"),
    ("GET", "/api/chat", None, 405, "POST"),
    ("GET", "/api/nothing", None, 404, "/api/nothing"),
])
def test_bad_requests_get_ollamas_error_shape(api, method, path, body, status, field):
    r = api(method, path, body)  # call() checks the body against ollama-error
    assert r.status == status, r.body
    assert set(r.json) == {"error"} and field in r.json["error"]


def test_a_body_that_is_not_json(api):
    r = api("POST", "/api/chat", body=b"{nope", headers={"Content-Type": "application/json"})
    assert r.status == 400 and set(r.json) == {"error"}
    r = api("POST", "/api/chat", body=b'{"model": "tiny"}',
            headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status == 415 and "application/json" in r.json["error"]


def test_keys_host_checks_and_size_limits_hold_here_too(home):
    from localrt import settings as settings_mod
    from localrt.app import create_app

    (home / ".localrtrc").write_text("apiKeys: [sk-ollama-0123456789]\n")
    app = create_app(settings_mod.load())
    try:
        r = call(app, "GET", "/api/tags")
        assert r.status == 401 and "Authorization: Bearer" in r.json["error"]
        assert r.headers["www-authenticate"].startswith("Bearer")
        key = {"Authorization": "Bearer sk-ollama-0123456789"}
        assert call(app, "GET", "/api/tags", headers=key).json == {"models": []}
        r = call(app, "GET", "/api/version", headers={**key, "Host": "evil.example"})
        assert r.status == 403 and "evil.example" in r.json["error"]
        big = json.dumps({"model": "tiny", "prompt": "a" * IMAGE_BODY}).encode()
        r = call(app, "POST", "/api/generate", body=big,
                 headers={**key, "Content-Type": "application/json"})
        assert r.status == 413 and set(r.json) == {"error"}
    finally:
        app.close()


def test_the_openapi_document_has_the_routes_and_their_shapes(app):
    doc = call(app, "GET", "/openapi.json").json
    for method, path in (("get", "/api/tags"), ("post", "/api/show"), ("get", "/api/ps"),
                         ("get", "/api/version"), ("post", "/api/chat"),
                         ("post", "/api/generate"), ("post", "/api/embed"),
                         ("post", "/api/pull"), ("delete", "/api/delete")):
        operation = doc["paths"][path][method]
        error = operation["responses"]["default"]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/replies/$defs/ollama-error"}
    chat = doc["paths"]["/api/chat"]["post"]["responses"]["200"]["content"]
    assert set(chat) == {"application/x-ndjson", "application/json"}


# --- the real ollama client against a live server ----------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, module_hub, ggufs):
    """A live server pulling from the hub emulator, with the generated models imported."""
    from localrt import settings as settings_mod

    hub = module_hub
    hub.add_cortexso("hello", {"q8": {"model.gguf": ggufs["tiny"]},
                               "q4": {"model.gguf": ggufs["fim"]}}, default="q8")
    hub.add_repo("org/broken", {"a.gguf": b"GGUF not really"})
    home = tmp_path_factory.mktemp("ollama-home")
    settings = settings_mod.load(environ={"HOME": str(home)})
    settings.update({"modelHubUrl": hub.url})
    srv = run_foreground_server(home)
    try:
        for model_id, path in ggufs.items():
            status, body = send(srv.url, "POST", "/v1/models/import",
                                {"path": str(path), "id": model_id})
            assert status == 200, body
        yield srv
    finally:
        srv.stop(sig=signal.SIGTERM)


@pytest.fixture
def client(server):
    with ollama.Client(host=server.url, timeout=120) as client:
        yield client


def test_version_list_show(client, ggufs):
    assert client._client.get("/api/version").json()["version"]
    listed = {m.model: m for m in client.list().models}
    assert set(ggufs) <= set(listed)
    assert listed["tiny"].size == ggufs["tiny"].stat().st_size
    assert listed["tiny"].details.family == "llama"
    shown = client.show("caller")
    assert shown.template == TEMPLATES["qwen25"] and "tools" in shown.capabilities
    assert shown.modelinfo["llama.context_length"] == 2048


def test_chat_streamed_and_not(client):
    whole = client.chat(model="tiny", messages=USER, options={"num_predict": 8,
                                                              "temperature": 0})
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 8
    assert whole.message.role == "assistant" and whole.message.content
    parts = list(client.chat(model="tiny", messages=USER, stream=True,
                             options={"num_predict": 8, "temperature": 0}))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert parts[-1].eval_duration > 0 and parts[-1].prompt_eval_count == \
        whole.prompt_eval_count


def test_generate_streamed_and_not(client):
    whole = client.generate(model="tiny", prompt="Once upon a time",
                            options={"num_predict": 8, "temperature": 0})
    assert whole.done and whole.response and whole.eval_count == 8
    parts = list(client.generate(model="tiny", prompt="Once upon a time", stream=True,
                                 options={"num_predict": 8, "temperature": 0}))
    assert "".join(p.response for p in parts) == whole.response


def test_a_tool_call_round_trip(client):
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
          city: The city
        """
        return '{"celsius": 21}'

    reply = client.chat(model="caller", messages=USER, tools=[get_weather])
    [call_] = reply.message.tool_calls
    assert call_.function.name == "get_weather"
    assert call_.function.arguments == {"city": "Paris"}
    messages = USER + [reply.message, {"role": "tool", "tool_name": "get_weather",
                                       "content": get_weather(**call_.function.arguments)}]
    again = client.chat(model="caller", messages=messages, tools=[get_weather])
    assert again.prompt_eval_count > reply.prompt_eval_count


def test_format_json(client):
    reply = client.chat(model="tiny", messages=USER, format=ANSWER,
                        options={"num_predict": 64})
    assert json.loads(reply.message.content)["answer"] in ("yes", "no")


def test_embed(client):
    reply = client.embed(model="bert", input=["a fox", "a dog", "a cat"])
    assert len(reply.embeddings) == 3 and len(reply.embeddings[0]) == 64
    assert reply.prompt_eval_count > 3


def test_ps_and_keep_alive_0_unloads(client):
    client.generate(model="tiny", prompt="hi", options={"num_predict": 1})
    assert "tiny" in {m.model for m in client.ps().models}
    row = next(m for m in client.ps().models if m.model == "tiny")
    assert row.size > 0 and row.context_length and row.expires_at.year > 2300
    client.generate(model="tiny", prompt="hi", options={"num_predict": 1}, keep_alive=0)
    assert "tiny" not in {m.model for m in client.ps().models}


def test_pull_a_builtin_then_chat_with_it_by_its_ollama_names(client, server):
    progress = list(client.pull("hello:latest", stream=True))
    assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
    files = [p for p in progress if p.digest]
    assert files and files[-1].completed == files[-1].total > 0
    assert "hello:q8" in {m.model for m in client.list().models}
    assert client.pull("hello").status == "success"  # downloaded already
    for name in ("hello", "hello:latest", "hello:q8"):
        reply = client.chat(model=name, messages=USER, options={"num_predict": 2})
        assert reply.model == name and reply.eval_count == 2
    # a second variant: the bare name no longer says which
    assert client.pull("hello:q4").status == "success"
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="hello", messages=USER)
    assert caught.value.status_code == 400
    assert "hello:q4" in caught.value.error and "hello:q8" in caught.value.error
    assert client.delete("hello:q4").status == "success"
    assert client.delete("hello:latest").status == "success"
    assert not {"hello:q8", "hello:q4"} & {m.model for m in client.list().models}


def test_a_pull_under_way_is_followed_not_refused(client, module_hub):
    hub = module_hub
    hub.delay_per_chunk = 0.2
    try:
        first = client.pull("hello:q8", stream=True)
        assert next(first).status == "pulling manifest"
        assert client.pull("hello:q8").status == "success"  # waits for the same download
        assert [p.status for p in first][-1] == "success"
    finally:
        hub.delay_per_chunk = 0.0
    assert client.delete("hello:q8").status == "success"


def test_errors_reach_the_client_as_ollama_errors(client):
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="nope", messages=USER)
    assert caught.value.status_code == 404 and "nope" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="tiny", messages=USER, options={"temperature": "hot"})
    assert caught.value.status_code == 400 and "temperature" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        client.pull("org/broken", stream=False)
    assert caught.value.status_code == 502 and "GGUF" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        list(client.pull("org/broken", stream=True))
    assert "GGUF" in caught.value.error


def test_a_remote_model_answers_in_ollamas_shape(app, api, server):
    """A remote model (localrt.remote.remotes) whose upstream is the live server's OpenAI API:
    the forwarded stream's chunks become Ollama's lines too."""
    r = api("POST", "/v1/models/remote", {"id": "far", "upstreams": [
        {"url": server.url + "/v1", "model": "tiny"}]})
    assert r.status == 200, r.body
    ask = {"model": "far", "messages": USER, "options": {"num_predict": 5, "temperature": 0}}
    got = lines(app, api("POST", "/api/chat", ask), "chat")
    assert got[-1]["done"] and got[-1]["eval_count"] == 5 and got[-1]["load_duration"] == 0
    text = "".join(o["message"]["content"] for o in got)
    assert api("POST", "/api/chat", {**ask, "stream": False}).json["message"]["content"] == text
    row = {m["name"]: m for m in api("GET", "/api/tags").json["models"]}["far"]
    assert row["details"]["format"] == "remote" and row["size"] == 0
    assert api("POST", "/api/show", {"model": "far"}).json["model_info"] == {}
