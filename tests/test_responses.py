"""OpenAI's Responses API (localrt.dialects.responses) on real llama.cpp: the translation onto chat
(checked against the chat completion of the same conversation), the typed events of a
stream, function calls, previous_response_id chains, the store, and bad bodies; then the
real `openai` SDK's client.responses against a live server.

The models are tiny random llamas (tests/emulators/ggufgen.py): "tiny" with a ChatML template, and
"qwen25" carrying Qwen 2.5's real chat template and <tool_call> token (as in
tests/test_tools.py), whose calls are forced (tool_choice "required") because random
weights write gibberish, and "caller", Qwen 2.5's template on weights scripted to always
call multi_agent_v1__spawn_agent, a function of Codex's namespace tool, so a request with
tool_choice "auto", shaped as Codex sends it, gets that call from real llama.cpp.
Replies are greedy (temperature 0), so the same prompt gives the same text through chat
and through Responses.
"""

from __future__ import annotations

import json
import re
import threading

import gguf
import jsonschema
import pytest
from emulators.chattemplates import TEMPLATES, TOKENS
from emulators.ggufgen import write_gguf
from support.apps import bind, call
from support.models import KINDS, NO_DRAFTS
from support.servers import run_foreground_server, send

from localrt.dialects import responses
from localrt.dialects.responses import Store

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "required": ["city", "metric"],
                          "properties": {"city": {"enum": ["Paris", "Rome"]},
                                         "metric": {"type": "boolean"}}}}
TIME = {"type": "function", "name": "get_time", "description": "The time in a zone",
        "parameters": {"type": "object", "required": ["zone"],
                       "properties": {"zone": {"enum": ["CET", "UTC"]}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
# The same tools as chat takes them.
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
              for t in TOOLS]


def _function(name: str, description: str, **properties) -> dict:
    return {"type": "function", "name": name, "description": description, "strict": False,
            "parameters": {"type": "object", "properties": properties,
                           "required": sorted(properties), "additionalProperties": False}}


# The tools as Codex 0.171 sends them with its default config: its own function tools,
# the hosted web search (never run by localrt), and the namespace of its sub-agent tools.
TEXT = {"type": "string"}
AGENT_ID = {"type": "string", "enum": ["agent-1", "agent-2"]}
MULTI_AGENT = {"type": "namespace", "name": "multi_agent_v1",
               "description": "Tools to spawn and manage sub-agents.",
               "tools": [_function("spawn_agent", "Spawn a sub-agent for a task.",
                                   message=TEXT),
                         _function("send_input", "Send a message to a sub-agent.",
                                   id=AGENT_ID, message=TEXT),
                         _function("resume_agent", "Resume a closed sub-agent.", id=AGENT_ID),
                         _function("wait_agent", "Wait for sub-agents to finish.",
                                   targets={"type": "array", "items": AGENT_ID,
                                            "minItems": 1, "maxItems": 2},
                                   timeout_ms={"enum": [1000, 30000]}),
                         _function("close_agent", "Close a sub-agent.", id=AGENT_ID)]}
CODEX_TOOLS = [_function("exec_command", "Runs a command in a PTY.", cmd=TEXT, workdir=TEXT),
               _function("write_stdin", "Writes characters to a running session.",
                         session_id={"type": "integer"}, chars=TEXT),
               _function("update_plan", "Updates the task plan.",
                         plan={"type": "array", "items": TEXT}),
               _function("apply_patch", "Edits files with a patch.", input=TEXT),
               _function("view_image", "Attaches a local image.", path=TEXT),
               {"type": "web_search", "external_web_access": False},
               MULTI_AGENT]
AGENT_SCHEMAS = {t["name"]: t["parameters"] for t in MULTI_AGENT["tools"]}
# Codex's freeform apply_patch, as it sends it for the models it gives a grammar: a custom
# tool, whose calls carry free text.
PATCH_GRAMMAR = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF'
APPLY_PATCH = {"type": "custom", "name": "apply_patch",
               "description": "Use the apply_patch tool to edit files.",
               "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}
PATCH = "*** Begin Patch\n*** Add File: hi.txt\n+hi\n*** End Patch"
# What "patcher" always writes: a Hermes call of apply_patch's function, with the text.
PATCHING = ["<tool_call>", json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}}),
            "</tool_call>"]
# What "caller" always writes: a Hermes call of spawn_agent, named as localrt shows it.
SPAWN = ["<tool_call>", '{"name": "multi_agent_v1__spawn_agent", ',
         '"arguments": {"message": "Find the bug"}}', "</tool_call>"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("responses")
    return {"tiny": write_gguf(root / "tiny.gguf", context_length=512),
            "qwen25": write_gguf(root / "qwen25.gguf", name="qwen25", vocab_size=400,
                                 context_length=4096, chat_template=TEMPLATES["qwen25"],
                                 added_tokens=[(t, KINDS[k]) for t, k in TOKENS["qwen25"]]),
            "caller": write_gguf(root / "caller.gguf", name="caller", vocab_size=400,
                                 context_length=8192, chat_template=TEMPLATES["qwen25"],
                                 added_tokens=[(t, gguf.TokenType.USER_DEFINED)
                                               for t in SPAWN], script=SPAWN),
            "patcher": write_gguf(root / "patcher.gguf", name="patcher", vocab_size=400,
                                  context_length=4096, chat_template=TEMPLATES["qwen25"],
                                  added_tokens=[(t, gguf.TokenType.USER_DEFINED)
                                                for t in PATCHING], script=PATCHING)}


@pytest.fixture
def api(app, weights):
    for model_id, path in weights.items():
        r = call(app, "POST", "/v1/models/import", {"path": str(path), "id": model_id})
        assert r.status == 200, r.body
    return bind(app)


def respond(api, **body):
    body = {"model": "tiny", "temperature": 0, "max_output_tokens": 8, **body}
    return api("POST", "/v1/responses", body)


def chat(api, messages, **body):
    body = {"model": "tiny", "temperature": 0, "max_tokens": 8, "messages": messages, **body}
    r = api("POST", "/v1/chat/completions", body)
    assert r.status == 200, r.body
    return r.json


def text_of(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def events(app, r) -> list:
    """The typed events of a streamed response, each checked: its `event:` line names
    its type, sequence numbers count from 0, and replies.json's response-event holds."""
    assert r.status == 200, r.body
    assert r.headers["content-type"] == "text/event-stream"
    out = []
    for block in r.body.decode().split("\n\n"):
        if not block:
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[6:])
        assert event["type"] == name[7:] and event["sequence_number"] == len(out)
        assert not app.validators.reply_errors("response-event", event), event
        out.append(event)
    return out


# --- the translation onto chat -----------------------------------------------------------


@pytest.mark.live
def test_a_response_is_the_chat_completion_of_its_conversation(api):
    r = respond(api, input="Hello there", instructions="Be brief.", metadata={"k": "v"})
    assert r.status == 200, r.body
    out = r.json
    completion = chat(api, [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hello there"}])
    assert out["id"].startswith("resp_") and out["object"] == "response"
    assert out["model"] == "tiny" and out["instructions"] == "Be brief."
    assert out["metadata"] == {"k": "v"} and out["store"] is False
    assert out["error"] is None and out["temperature"] == 0 and out["tools"] == []
    message, = out["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["id"].startswith("msg_")
    assert message["content"] == [{"type": "output_text", "annotations": [],
                                   "text": completion["choices"][0]["message"]["content"]}]
    usage = completion["usage"]
    assert out["usage"]["input_tokens"] == usage["prompt_tokens"]
    assert out["usage"]["output_tokens"] == usage["completion_tokens"]
    assert out["usage"]["total_tokens"] == usage["total_tokens"]
    assert out["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    finish = completion["choices"][0]["finish_reason"]
    assert out["status"] == ("incomplete" if finish == "length" else "completed")


@pytest.mark.live
def test_max_output_tokens_makes_it_incomplete(api):
    out = respond(api, input="Hello there", max_output_tokens=3).json
    assert out["status"] == "incomplete" and out["usage"]["output_tokens"] == 3
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["output"][0]["status"] == "incomplete" and "completed_at" not in out
    assert out["max_output_tokens"] == 3


@pytest.mark.live
def test_input_items_are_the_conversation_chat_gets(api):
    """Every kind of input item, against the chat messages it stands for: the same prompt
    (Qwen 2.5's template renders calls and tool results), so the same reply."""
    items = [
        {"role": "developer", "content": "You answer about weather."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather in Paris?"},
                     {"type": "input_text", "text": "In celsius."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather",
         "arguments": '{"city": "Paris", "metric": true}', "status": "completed"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "call_a", "output": '{"celsius": 21}'},
        {"role": "user", "content": "Thanks"}]
    messages = [
        {"role": "system", "content": "You answer about weather."},
        {"role": "user", "content": "Weather in Paris?\nIn celsius."},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "metric": true}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": '{"celsius": 21}'},
        {"role": "user", "content": "Thanks"}]
    out = respond(api, model="qwen25", input=items, tools=TOOLS, tool_choice="none").json
    completion = chat(api, messages, model="qwen25", tools=CHAT_TOOLS, tool_choice="none")
    assert out["usage"]["input_tokens"] == completion["usage"]["prompt_tokens"]
    assert text_of(out) == completion["choices"][0]["message"]["content"]
    without_tools = chat(api, messages, model="qwen25")
    assert without_tools["usage"]["prompt_tokens"] < out["usage"]["input_tokens"]


@pytest.mark.live
def test_a_stream_is_typed_events_in_openais_order(app, api):
    plain = respond(api, input="Hello there", max_output_tokens=10).json
    got = events(app, respond(api, input="Hello there", max_output_tokens=10, stream=True))
    kinds = [e["type"] for e in got]
    deltas = [e for e in got if e["type"] == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done",
                     "response.incomplete" if plain["status"] == "incomplete" else
                     "response.completed"]
    assert len(deltas) >= 3  # piece by piece, not one blob
    created, final = got[0]["response"], got[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert created["usage"] is None and created["id"] == final["id"]
    added, item_done = got[2]["item"], got[-2]["item"]
    assert added["status"] == "in_progress" and added["content"][0]["text"] == ""
    assert all(e["item_id"] == added["id"] for e in got[3:-2])
    text = "".join(e["delta"] for e in deltas)
    assert text == text_of(plain) == got[-4]["text"] == got[-3]["part"]["text"]
    assert final["output"] == [item_done] and item_done["id"] == added["id"]
    assert final["status"] == plain["status"] and final["usage"] == {
        **plain["usage"], "input_tokens_details": {
            "cached_tokens": plain["usage"]["input_tokens"] - 1,  # the same prompt again
            "cache_write_tokens": 0}}
    assert b"[DONE]" not in respond(api, input="Hi", stream=True).body


# --- function calls --------------------------------------------------------------------


@pytest.mark.live
def test_a_forced_call_comes_back_as_a_function_call_item(app, api):
    body = {"model": "qwen25", "input": "What is the weather in Paris?", "tools": TOOLS,
            "tool_choice": "required", "parallel_tool_calls": False,
            "max_output_tokens": 120}
    out = respond(api, **body).json
    call_item, = out["output"]
    assert call_item["type"] == "function_call" and call_item["status"] == "completed"
    assert call_item["id"].startswith("fc_") and call_item["call_id"].startswith("call_")
    jsonschema.validate(json.loads(call_item["arguments"]), SCHEMAS[call_item["name"]])
    assert out["status"] == "completed" and out["tool_choice"] == "required"
    assert out["parallel_tool_calls"] is False and out["tools"] == TOOLS

    got = events(app, respond(api, **body, stream=True))
    kinds = [e["type"] for e in got]
    pieces = [e["delta"] for e in got if e["type"] == "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(pieces),
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    added, done, final = got[2]["item"], got[-2]["item"], got[-1]["response"]
    assert (added["name"], added["arguments"], added["status"]) == (
        call_item["name"], "", "in_progress")
    assert "".join(pieces) == got[-3]["arguments"] == call_item["arguments"]
    assert done["arguments"] == call_item["arguments"] and final["output"] == [done]

    # A named function, as Responses names it, and the function's output back.
    named = respond(api, **{**body, "tool_choice": {"type": "function", "name": "get_time"}})
    assert named.json["output"][0]["name"] == "get_time"
    follow = [{"role": "user", "content": "What is the weather in Paris?"}, call_item,
              {"type": "function_call_output", "call_id": call_item["call_id"],
               "output": [{"type": "input_text", "text": '{"celsius": 21}'}]}]
    final = respond(api, model="qwen25", input=follow, tools=TOOLS, tool_choice="none").json
    assert final["output"][0]["type"] == "message"
    assert final["usage"]["input_tokens"] > out["usage"]["input_tokens"]


# --- tools as Codex sends them: namespaces and hosted tools ------------------------------


@pytest.mark.live
def test_a_namespaced_function_comes_back_with_its_namespace(app, api):
    """tool_choice names a function of Codex's namespace tool, beside the hosted web
    search and a plain function (qwen25's context holds these, not all of Codex's
    tools): the forced call is the function's own name and its namespace, whole and
    streamed, and the response's tools are the request's as given."""
    tools = [TIME, {"type": "web_search", "external_web_access": False}, MULTI_AGENT]
    body = {"model": "qwen25", "input": "Wait for agent-1.", "tools": tools,
            "tool_choice": {"type": "function", "name": "wait_agent",
                            "namespace": "multi_agent_v1"},
            "parallel_tool_calls": False, "max_output_tokens": 120}
    out = respond(api, **body).json
    call_item, = out["output"]
    assert (call_item["type"], call_item["name"], call_item["namespace"]) == (
        "function_call", "wait_agent", "multi_agent_v1")
    jsonschema.validate(json.loads(call_item["arguments"]), AGENT_SCHEMAS["wait_agent"])
    assert out["tools"] == tools and out["tool_choice"] == body["tool_choice"]
    assert not app.validators.reply_errors("response", out)

    got = events(app, respond(api, **body, stream=True))
    added, done, final = got[2]["item"], got[-2]["item"], got[-1]["response"]
    assert (added["name"], added["namespace"], added["arguments"]) == (
        "wait_agent", "multi_agent_v1", "")
    assert got[-3]["type"] == "response.function_call_arguments.done"
    assert got[-3]["name"] == "wait_agent" and got[-3]["arguments"] == call_item["arguments"]
    assert done["namespace"] == "multi_agent_v1" and final["output"] == [done]

    # Named alone, where no other tool is called that; a plain function has no namespace.
    alone = respond(api, **{**body, "tool_choice": {"type": "function",
                                                    "name": "close_agent"}}).json
    assert (alone["output"][0]["name"], alone["output"][0]["namespace"]) == (
        "close_agent", "multi_agent_v1")
    plain = respond(api, **{**body, "tool_choice": {"type": "function",
                                                    "name": "get_time"}}).json
    assert plain["output"][0]["name"] == "get_time" and "namespace" not in plain["output"][0]


@pytest.mark.live
def test_hosted_tools_stay_out_of_the_prompt_and_namespaces_show_their_functions(api):
    """The prompt's size says what the template was given: hosted tools add nothing, a
    namespace's functions are there named NAMESPACE__FUNCTION, and a function_call item
    with a namespace goes back into the history under that name."""
    def prompt(tools, items=None):
        r = respond(api, model="qwen25", input=items or "Hello", tools=tools,
                    tool_choice="none", max_output_tokens=1)
        assert r.status == 200, r.body
        return r.json["usage"]["input_tokens"]

    hosted = [{"type": "web_search", "external_web_access": False},
              {"type": "web_search_preview"}, {"type": "file_search",
                                               "vector_store_ids": ["vs_1"]},
              {"type": "code_interpreter", "container": {"type": "auto"}},
              {"type": "computer_use_preview", "display_width": 1024,
               "display_height": 768, "environment": "linux"},
              {"type": "image_generation"},
              {"type": "mcp", "server_label": "docs", "server_url": "https://example.com/mcp",
               "require_approval": "never"}]
    assert prompt([WEATHER, *hosted]) == prompt([WEATHER]) < prompt([WEATHER, TIME])
    flat = [{**f, "name": "multi_agent_v1__" + f["name"]} for f in MULTI_AGENT["tools"]]
    assert prompt([WEATHER, MULTI_AGENT]) == prompt([WEATHER, *flat])

    def history(call):
        return [{"role": "user", "content": "Spawn one."},
                {"type": "function_call", "call_id": "call_1", "arguments": "{}", **call},
                {"type": "function_call_output", "call_id": "call_1", "output": "agent-1"}]
    namespaced = prompt([MULTI_AGENT], history({"name": "spawn_agent",
                                                "namespace": "multi_agent_v1"}))
    assert namespaced == prompt([MULTI_AGENT],
                                history({"name": "multi_agent_v1__spawn_agent"}))
    assert namespaced != prompt([MULTI_AGENT], history({"name": "spawn_agent"}))


@pytest.mark.live
def test_a_custom_tools_call_comes_back_as_a_custom_tool_call_with_its_text(app, api):
    """Codex's freeform apply_patch: the model is offered a function of one string, input
    (the grammar in its description), and its call comes back as a custom_tool_call item
    holding the text, whole and streamed; the call and its output go back into the prompt
    as the function's call and a tool message; tool_choice may force it."""
    body = {"model": "patcher", "input": "Add hi.txt.", "tools": [TIME, APPLY_PATCH],
            "tool_choice": "auto", "max_output_tokens": 60}
    out = respond(api, **body).json
    call, = out["output"]
    assert {k: call[k] for k in ("type", "name", "input", "status")} == {
        "type": "custom_tool_call", "name": "apply_patch", "input": PATCH,
        "status": "completed"}
    assert call["id"].startswith("ctc_") and out["tools"] == body["tools"]
    assert not app.validators.reply_errors("response", out)

    got = events(app, respond(api, **body, stream=True))
    kinds = [e["type"] for e in got]
    assert kinds[2:] == ["response.output_item.added", "response.custom_tool_call_input.delta",
                         "response.custom_tool_call_input.done", "response.output_item.done",
                         "response.completed"]
    assert got[2]["item"]["input"] == "" and got[3]["delta"] == got[4]["input"] == PATCH
    assert got[-2]["item"]["input"] == PATCH and got[-1]["response"]["output"] == [got[-2]["item"]]

    # Forced, the grammar makes the scripted weights write the call of apply_patch's
    # function (not their script, so its text never ends within max_output_tokens).
    forced = respond(api, **{**body, "tool_choice": {"type": "custom", "name": "apply_patch"},
                             "max_output_tokens": 40})
    assert forced.status == 200, forced.body
    assert re.search(r'"name"\s*:\s*"apply_patch"', text_of(forced.json)), forced.json

    def prompt(tools, items):
        r = respond(api, model="qwen25", input=items, tools=tools, tool_choice="none",
                    max_output_tokens=1)
        assert r.status == 200, r.body
        return r.json["usage"]["input_tokens"]

    user = {"role": "user", "content": "Add hi.txt."}
    as_function = {"type": "function", "name": "apply_patch",
                   "description": APPLY_PATCH["description"],
                   "parameters": responses.custom_parameters(APPLY_PATCH["format"])}
    assert prompt([APPLY_PATCH], [user]) == prompt([as_function], [user])
    custom = [user, {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch",
                     "input": PATCH},
              {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Done"}]
    plain = [user, {"type": "function_call", "call_id": "call_1", "name": "apply_patch",
                    "arguments": json.dumps({"input": PATCH})},
             {"type": "function_call_output", "call_id": "call_1", "output": "Done"}]
    assert prompt([APPLY_PATCH], custom) == prompt([as_function], plain) > \
        prompt([APPLY_PATCH], [user])


def test_hosted_tools_are_the_schemas_and_the_man_pages():
    """responses.HOSTED, the hosted types response-create.json takes (in tools and in
    tool_choice) and those localrt-api(7) lists are the same."""
    from pathlib import Path

    from localrt.schemas import load

    schema = load("response-create.json")["properties"]
    in_tools = schema["tools"]["items"]["properties"]["type"]["enum"]
    assert in_tools == ["function", "namespace", "custom", *responses.HOSTED]
    assert schema["tool_choice"]["anyOf"][2]["properties"]["type"]["enum"] == \
        list(responses.HOSTED)
    man = (Path(__file__).resolve().parent.parent / "man" / "localrt-api.7").read_text()
    assert all(f"\\fB{name}\\fR" in man.replace("\\_", "_") for name in responses.HOSTED)


# --- storage and previous_response_id ----------------------------------------------------


@pytest.mark.live
def test_previous_response_id_continues_the_stored_conversation(app, api):
    first = respond(api, input="Hello there", instructions="Be brief.", store=True).json
    assert first["store"] is True
    assert api("GET", f"/v1/responses/{first['id']}").json == first
    second = respond(api, input="And then?", previous_response_id=first["id"]).json
    assert second["previous_response_id"] == first["id"] and second["instructions"] is None
    # The first turn's input and output come first; its instructions do not (as OpenAI).
    completion = chat(api, [{"role": "user", "content": "Hello there"},
                            {"role": "assistant", "content": text_of(first)},
                            {"role": "user", "content": "And then?"}])
    assert second["usage"]["input_tokens"] == completion["usage"]["prompt_tokens"]
    assert text_of(second) == completion["choices"][0]["message"]["content"]
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]

    # store false (the default): not kept, so neither readable nor continued.
    r = api("GET", f"/v1/responses/{second['id']}")
    assert r.status == 404 and r.json["error"]["type"] == "not_found_error"
    assert second["id"] in r.json["message"]
    r = respond(api, input="Go on", previous_response_id=second["id"])
    assert r.status == 400 and r.json["error"]["param"] == "previous_response_id"
    assert r.json["error"]["code"] == "previous_response_not_found"
    assert r.json["message"] == f"Previous response with id '{second['id']}' not found."

    # A chain of stored responses carries every turn; a streamed one is stored too.
    third = events(app, respond(api, input="And then?", previous_response_id=first["id"],
                                store=True, stream=True))
    third_id = third[-1]["response"]["id"]
    stored = api("GET", f"/v1/responses/{third_id}").json
    assert stored["status"] in ("completed", "incomplete") and text_of(stored) == text_of(second)
    fourth = respond(api, input="Last", previous_response_id=third_id).json
    assert fourth["usage"]["input_tokens"] > second["usage"]["input_tokens"]

    r = api("DELETE", f"/v1/responses/{first['id']}")
    assert r.status == 200 and r.json == {"id": first["id"], "object": "response.deleted",
                                          "deleted": True}
    assert api("GET", f"/v1/responses/{first['id']}").status == 404
    assert api("DELETE", f"/v1/responses/{first['id']}").status == 404


def test_the_store_keeps_the_most_recently_used_within_its_bounds():
    store = Store(max_responses=2, max_bytes=10_000)
    for name in "abc":
        store.put({"id": name}, [{"role": "user", "content": name}])
    assert len(store) == 2 and store.get("a") is None
    assert store.get("b") is not None  # b is now the most recently used: c goes first
    store.put({"id": "d"}, [])
    assert store.get("c") is None and store.get("b") and store.get("d")
    big = [{"role": "user", "content": "x" * 6000}]
    store.put({"id": "e"}, big)
    store.put({"id": "f"}, big)  # two of these pass max_bytes: only the newest stays
    assert len(store) == 1 and store.get("f")[1] == tuple(big)
    assert store.delete("f") and not store.delete("f") and len(store) == 0


# --- bad requests --------------------------------------------------------------------------


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "model": 3}, "model"),
    ({"model": "tiny"}, "input"),
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "bot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0].text"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]},
     "input[0].output"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": "x", "tools": [{"type": "custom"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "custom", "name": "p", "format": {"type": "xml"}}]},
     "tools[0].format.type"),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "p"}]}, "input[0].input"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [
        {"type": "custom", "name": "f"}]}]}, "tools[0].tools[0].type"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "n.s", "tools": []}]},
     "tools[0].name"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "n"}]}, "tools[0].tools"),
    ({"input": "x", "tools": [{"type": "function", "name": "n__f"}, {"type": "web_search"},
                              {"type": "namespace", "name": "n", "tools": [
                                  {"type": "function", "name": "f"}]}]},
     "tools[2].tools[0].name"),
    ({"input": "x", "tools": [WEATHER, MULTI_AGENT],
      "tool_choice": {"type": "function", "name": "get_weather", "namespace": "multi_agent_v1"}},
     "tool_choice.name"),
    ({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
     "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "custom", "name": "apply_patch"}},
     "tool_choice.name"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
    ({"input": "x", "tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    pytest.param({"input": "x", "tools": TOOLS, "tool_choice": "required"}, "tools",
                 marks=pytest.mark.live),  # ChatML: no calls
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "top_p": "high"}, "top_p"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata.k"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "top_logprobs": 5}, "top_logprobs"),
    ({"input": "x", "store": "yes"}, "store"),
    pytest.param({"input": "x" * 3000}, "input",
                 marks=pytest.mark.live),  # longer than the context of 512 tokens
])
def test_bad_bodies_are_a_400_naming_the_field(api, body, param):
    r = api("POST", "/v1/responses", {"model": "tiny", **body})
    assert r.status == 400, r.body
    error = r.json["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert r.json["message"] == error["message"]
    # The field's name, or (as OpenAI words it) the unknown previous response's id.
    assert param in error["message"] or body[param] in error["message"]


@pytest.mark.live
def test_an_unknown_model_is_a_404_and_api_keys_apply(api, settings):
    r = respond(api, model="nope", input="x")
    assert r.status == 404 and r.json["error"]["code"] == "model_not_found"
    settings.update({"apiKeys": ["k-123"]})
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"),
                         ("DELETE", "/v1/responses/resp_x")):
        r = api(method, path, {"model": "tiny", "input": "x"} if method == "POST" else None)
        assert r.status == 401 and r.json["error"]["code"] == "unauthorized"
    r = api("POST", "/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens": 2},
            headers={"Authorization": "Bearer k-123"})
    assert r.status == 200 and r.json["object"] == "response"


def test_a_model_stopped_mid_stream_ends_it_failed(app, slow_gguf):
    """The chat stream's error becomes an `error` event and response.failed."""
    call(app, "POST", "/v1/models/import", {"path": str(slow_gguf), "id": "slow"})
    call(app, "POST", "/v1/models/slow/start", {"cpu_threads": 1, **NO_DRAFTS})
    body = {"model": "slow", "input": "Hello", "max_output_tokens": 3000}
    stream = responses.create(app.services.chats, app.services.responses,
                              {**body, "stream": True})
    try:
        got = stream.events()
        kinds = [next(got)[0] for _ in range(5)]  # created ... the first delta
        assert kinds[-1] == "response.output_text.delta"
        stopper = threading.Thread(target=app.services.scheduler.stop, args=("slow",))
        stopper.start()
        rest = list(got)
        stopper.join(30)
    finally:
        stream.close()
    error, failed = rest[-2][1], rest[-1][1]
    assert error["type"] == "error" and error["code"] == "model_stopped"
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert failed["response"]["output"][0]["type"] == "message"
    assert not app.validators.reply_errors("response-event", failed)


def test_a_remote_models_reply_is_translated_the_same_way(app, api, weights, tmp_path):
    """A remote model (llama-cpp-python's server upstream, tests/emulators/upstreams.py): its
    chat comes back through localrt.remote, streamed or not, and becomes the same response."""
    from emulators.upstreams import start_replica

    replica = start_replica(weights["tiny"], tmp_path / "replica.log", n_ctx=512)
    try:
        r = api("POST", "/v1/models/remote", {"id": "far", "upstreams": [{"url": replica.url}]})
        assert r.status == 200, r.body
        plain = respond(api, model="far", input="Hello there", instructions="Be brief.")
        assert plain.status == 200, plain.body
        out = plain.json
        assert out["model"] == "far" and out["output"][0]["type"] == "message"
        assert out["status"] in ("completed", "incomplete") and out["usage"]["output_tokens"]
        got = events(app, respond(api, model="far", input="Hello there",
                                  instructions="Be brief.", stream=True))
        text = "".join(e["delta"] for e in got if e["type"] == "response.output_text.delta")
        final = got[-1]["response"]
        assert got[-1]["type"] in ("response.completed", "response.incomplete")
        assert text == text_of(out) == text_of(final) and final["status"] == out["status"]
        assert replica.chats() == 2
    finally:
        replica.stop()


# --- the openai SDK --------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(weights, tmp_path_factory):
    """The real openai SDK against a live `localrt start --foreground` with both models."""
    import openai

    srv = run_foreground_server(tmp_path_factory.mktemp("responses-home"))
    try:
        for model_id, path in weights.items():
            status, body = send(srv.url, "POST", "/v1/models/import",
                                {"path": str(path), "id": model_id})
            assert status == 200, body
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120) as sdk:
            yield sdk
    finally:
        srv.stop()


def test_the_sdk_creates_streams_retrieves_and_deletes(client):
    import openai

    first = client.responses.create(model="tiny", input="Hello there", temperature=0,
                                    max_output_tokens=8, store=True)
    assert first.object == "response" and first.status in ("completed", "incomplete")
    assert isinstance(first.output_text, str) and first.usage.output_tokens <= 8
    assert first.output[0].type == "message" and first.output[0].role == "assistant"
    assert client.responses.retrieve(first.id).output_text == first.output_text

    # Streamed with stream=True: the SDK's typed events.
    stream = client.responses.create(model="tiny", input="Hello there", temperature=0,
                                     max_output_tokens=8, stream=True)
    kinds, text, final = [], "", None
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert text == first.output_text == final.output_text

    # max_output_tokens: incomplete, as the SDK reads it.
    short = client.responses.create(model="tiny", input="Hello there", temperature=0,
                                    max_output_tokens=2)
    assert short.status == "incomplete" and short.incomplete_details.reason == \
        "max_output_tokens"

    # A chain: the second turn's prompt holds the first.
    second = client.responses.create(model="tiny", input="And then?", temperature=0,
                                     max_output_tokens=8, previous_response_id=first.id)
    assert second.usage.input_tokens > first.usage.input_tokens + 3

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)  # store defaults to false
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input="x", previous_response_id=first.id)
    assert caught.value.code == "previous_response_not_found"
    assert caught.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input="x", temperature=5)
    assert caught.value.param == "temperature"


def test_the_sdk_function_call_round_trip(client):
    """function_call, its output, the final answer, as the SDK's users write it; the SDK's
    own output objects go back as input."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(model="qwen25", input=ask, tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=False,
                                    temperature=0, max_output_tokens=120)
    tool_call, = first.output
    assert tool_call.type == "function_call" and tool_call.status == "completed"
    arguments = json.loads(tool_call.arguments)
    jsonschema.validate(arguments, SCHEMAS[tool_call.name])
    follow = ask + list(first.output) + [
        {"type": "function_call_output", "call_id": tool_call.call_id,
         "output": json.dumps({"result": "sunny"})}]
    final = client.responses.create(model="qwen25", input=follow, tools=TOOLS,
                                    tool_choice="none", temperature=0, max_output_tokens=8)
    assert final.output[0].type == "message" and isinstance(final.output_text, str)
    assert final.usage.input_tokens > first.usage.input_tokens

    # The same first step streamed, through the SDK's stream helper.
    with client.responses.stream(model="qwen25", input=ask, tools=TOOLS,
                                 tool_choice="required", parallel_tool_calls=False,
                                 temperature=0, max_output_tokens=120) as stream:
        pieces = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = stream.get_final_response()
    call_again, = streamed.output
    assert (call_again.name, call_again.arguments, "".join(pieces)) == (
        tool_call.name, tool_call.arguments, tool_call.arguments)

    # Chained instead of resent: the call's output continues the stored response.
    stored = client.responses.create(model="qwen25", input=ask, tools=TOOLS,
                                     tool_choice="required", parallel_tool_calls=False,
                                     temperature=0, max_output_tokens=120, store=True)
    chained = client.responses.create(
        model="qwen25", previous_response_id=stored.id, tools=TOOLS, tool_choice="none",
        temperature=0, max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": stored.output[0].call_id,
                "output": json.dumps({"result": "sunny"})}])
    assert chained.usage.input_tokens == final.usage.input_tokens
    assert chained.output_text == final.output_text


def test_the_sdk_stream_helper_rebuilds_a_completed_response(client, weights):
    """client.responses.stream() wants response.completed: a reply that ends at one of the
    model's stop sequences (stored on a copy of tiny) completes."""
    url = str(client.base_url).rstrip("/").removesuffix("/v1")
    send(url, "POST", "/v1/models/import", {"path": str(weights["tiny"]), "id": "tiny-stop"})
    body = {"model": "tiny-stop", "input": "Hello there", "temperature": 0,
            "max_output_tokens": 24}
    full = client.responses.create(**body).output_text
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2)
                if full[i:i + 2].strip() and "\ufffd" not in full[i:i + 2])
    send(url, "POST", "/v1/models/tiny-stop/stop")
    assert send(url, "PATCH", "/v1/models/tiny-stop", {"stop": [stop]})[0] == 200
    with client.responses.stream(**body) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.completed_at
    assert text == final.output_text == full[:full.index(stop)]


def test_the_sdk_sends_codexs_tools_and_gets_the_namespaced_call(client):
    """A request shaped as Codex 0.171 sends it with its default config (instructions, a
    developer message, its function tools, the hosted web search, the multi_agent_v1
    namespace, tool_choice auto, reasoning and include it sets), through the SDK, whole and
    streamed: the scripted model's call of spawn_agent comes back with its namespace, the
    tools as given, and the round trip goes on; forcing web search is a 400 naming it."""
    import openai

    body = dict(model="caller", instructions="You are Codex, a coding agent.",
                input=[{"type": "message", "role": "developer",
                        "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
                       {"type": "message", "role": "user",
                        "content": [{"type": "input_text", "text": "Find the bug."}]}],
                tools=CODEX_TOOLS, tool_choice="auto", parallel_tool_calls=False,
                reasoning={"effort": "medium", "summary": "auto"}, store=False,
                include=["reasoning.encrypted_content"], prompt_cache_key="session-1",
                temperature=0, max_output_tokens=60)
    raw = client.responses.with_raw_response.create(**body)
    assert raw.http_response.json()["tools"] == CODEX_TOOLS
    first = raw.parse()
    call, = first.output
    assert (call.type, call.name, call.namespace) == (
        "function_call", "spawn_agent", "multi_agent_v1")
    assert json.loads(call.arguments) == {"message": "Find the bug"}
    assert first.status == "completed"

    kinds, pieces, final = [], [], None
    for event in client.responses.create(**body, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_item.added":
            assert (event.item.name, event.item.namespace) == ("spawn_agent", "multi_agent_v1")
        elif event.type == "response.function_call_arguments.delta":
            pieces.append(event.delta)
        elif event.type == "response.completed":
            final = event.response
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    streamed, = final.output
    assert (streamed.name, streamed.namespace, streamed.arguments) == (
        "spawn_agent", "multi_agent_v1", "".join(pieces))
    assert json.loads(streamed.arguments) == json.loads(call.arguments)

    # The call's output back, with the SDK's own output item: the loop goes on.
    follow = body["input"] + list(first.output) + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "agent-1"}]
    second = client.responses.create(**{**body, "input": follow})
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.output[0].namespace == "multi_agent_v1"

    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**{**body, "tool_choice": {"type": "web_search"}})
    assert caught.value.status_code == 400 and caught.value.param == "tool_choice"
    assert "web_search" in caught.value.message
