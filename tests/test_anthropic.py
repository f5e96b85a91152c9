"""Anthropic's Messages API (localrt.dialects.anthropic) on real llama.cpp: the translation onto
chat, messages whole and streamed as Anthropic's events, stop sequences and max_tokens,
tool use round trips, count_tokens, x-api-key, and Anthropic's error shape; then the
real `anthropic` SDK against a live server, a remote model included.

The models are tests/test_tools.py's: tiny random llamas carrying a real model's Jinja
chat template (Qwen 2.5, Llama 3.1, Mistral Nemo) and its added tokens. Their random
weights write gibberish, so calls are forced (tool_choice any or a named tool) on
arguments with few choices, and texts are compared with greedy decoding (temperature
0), which gives the same text every time.
"""

from __future__ import annotations

import http.client
import json
import re
from urllib.parse import urlsplit

import anthropic
import jsonschema
import pytest
from support.apps import call
from support.models import FAMILIES, NO_DRAFTS
from support.servers import send

from localrt.api import IMAGE_BODY
from localrt import native
from localrt.dialects import anthropic as dialect
from localrt.remote import wire

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "required": ["city", "metric"],
                            "properties": {"city": {"enum": ["Paris", "Rome"]},
                                           "metric": {"type": "boolean"}}}}
TIME = {"name": "get_time", "description": "The time in a zone",
        "input_schema": {"type": "object", "required": ["zone"],
                         "properties": {"zone": {"enum": ["CET", "UTC"]}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}
# The id each family's calls get, after toolu_ (Mistral's template takes 9 alphanumerics).
ID_OF = {"mistral_nemo": r"toolu_[a-zA-Z0-9]{9}", "qwen25": r"toolu_call_\w{24}",
         "llama31": r"toolu_call_\w{24}"}
KEY = "anthropic-test-key-5d2c"


def create(api, model="qwen25", **body):
    body = {"model": model, "max_tokens": 16, "temperature": 0, "messages": [ASK], **body}
    return api("POST", "/v1/messages", body)


def events(app, r) -> list:
    """The events of a streamed Message: each `event:` line names its data's type, and
    each data matches replies.json's anthropic-stream-event."""
    assert r.status == 200, r.body
    assert r.headers["content-type"] == "text/event-stream"
    out = []
    for block in r.body.decode().split("\n\n"):
        if not block.strip():
            continue
        event_line, data_line = block.split("\n")
        event = json.loads(data_line[len("data: "):])
        assert event_line == f"event: {event['type']}"
        assert not app.validators.reply_errors("anthropic-stream-event", event), event
        out.append(event)
    return out


def prompt_size(usage) -> int:
    """The prompt's tokens that a Message's usage counts (a dict, or the SDK's Usage):
    those read afresh, from the prompt cache, and written to it."""
    if not isinstance(usage, dict):
        usage = usage.model_dump()
    return usage["input_tokens"] + usage["cache_read_input_tokens"] + \
        usage["cache_creation_input_tokens"]


def read_stream(events_) -> dict:
    """The Message that a stream's events build, as the SDK builds it, checking their
    order: message_start, ping, blocks (start, deltas, stop), message_delta, message_stop."""
    kinds = [e["type"] for e in events_]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta",
                                                                     "message_stop"]
    message = events_[0]["message"]
    content, partial, open_index = [], {}, None
    for event in events_[2:-2]:
        if event["type"] == "content_block_start":
            assert open_index is None and event["index"] == len(content)
            open_index = event["index"]
            content.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_index
            block, delta = content[open_index], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                partial[open_index] = partial.get(open_index, "") + delta["partial_json"]
        else:
            assert event["type"] == "content_block_stop" and event["index"] == open_index
            open_index = None
    for index, text in partial.items():
        content[index]["input"] = json.loads(text)
    last = events_[-2]
    return {**message, "content": content, **last["delta"], "usage": last["usage"]}


# --- the translation ----------------------------------------------------------------


def test_a_conversation_becomes_a_native_request_and_an_upstreams_chat_request():
    body = {"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."},
                                                       {"type": "text", "text": "Be kind."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather?"},
                                             {"type": "text", "text": "In Paris."}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "x"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_01D7FLrfh4GYq7yT1ULFeyMV",
                     "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "toolu_Ab3De5Gh7", "name": "get_time",
                     "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_01D7FLrfh4GYq7yT1ULFeyMV",
                     "content": [{"type": "text", "text": "21"}, {"type": "text",
                                                                 "text": "sunny"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_Ab3De5Gh7",
                     "content": "12:00", "is_error": False},
                    {"type": "text", "text": "And tomorrow?"}]}],
            "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather",
                                                "disable_parallel_tool_use": True},
            "stop_sequences": ["END"], "temperature": 0.5, "top_p": 0.9, "top_k": 20,
            "stream": True, "metadata": {"user_id": "u"}}
    hashed = dialect.call_id("toolu_01D7FLrfh4GYq7yT1ULFeyMV")
    assert re.fullmatch(r"[0-9a-f]{9}", hashed)
    request = dialect.read(body)
    assert [m.role for m in request.messages] == ["system", "user", "assistant", "tool",
                                                  "tool", "user"]
    assert request.tool_choice == "function" and request.tool_function == "get_weather"
    assert request.messages[2].reasoning == "hm"  # a thinking block goes back to the template
    # A remote model's upstream gets the request as OpenAI's chat request, the thinking
    # under both names upstreams read it by.
    assert wire.chat_body(request) == {
        "model": "m", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 20,
        "messages": [
            {"role": "system", "content": "Be brief.\nBe kind."},
            {"role": "user", "content": "Weather?\nIn Paris."},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": hashed, "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "Ab3De5Gh7", "type": "function",
                 "function": {"name": "get_time", "arguments": "{}"}}],
             "reasoning_content": "hm", "reasoning": "hm"},
            {"role": "tool", "tool_call_id": hashed, "content": "21\nsunny"},
            {"role": "tool", "tool_call_id": "Ab3De5Gh7", "content": "12:00"},
            {"role": "user", "content": "And tomorrow?"}],
        "stop": ["END"],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city",
            "parameters": WEATHER["input_schema"]}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False, "stream": True,
        "stream_options": {"include_usage": True}}
    for choice, expected in (("auto", "auto"), ("any", "required"), ("none", "none")):
        assert dialect.read({**body, "tool_choice": {"type": choice}}).tool_choice == expected


def test_chat_replies_become_messages():
    body = {"model": "m", "stop_sequences": ["END"]}
    completion = {"choices": [{"index": 0, "finish_reason": "stop", "stop_reason": "END",
                               "message": {"role": "assistant", "content": "Hi"}}],
                  "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9,
                            "prompt_tokens_details": {"cached_tokens": 5}}}
    message = dialect.message(native.collect(wire.reply(completion).events()), body)
    assert message["id"].startswith("msg_")
    # An upstream's cached tokens are the prompt cache's share of the prompt, as
    # llama-server and Anthropic split it.
    assert {k: v for k, v in message.items() if k != "id"} == {
        "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "text", "text": "Hi"}], "stop_reason": "stop_sequence",
        "stop_sequence": "END", "usage": {"input_tokens": 2, "cache_creation_input_tokens": 0,
                                          "cache_read_input_tokens": 5, "output_tokens": 2}}
    del completion["usage"]["prompt_tokens_details"]
    message = dialect.message(native.collect(wire.reply(completion).events()), body)
    assert message["usage"] == {"input_tokens": 7, "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": 0, "output_tokens": 2}
    # The model's own stop sequence (not the request's), or its end token: end_turn.
    for matched in ("<|im_end|>", None):
        assert dialect.stop_reason("stop", matched, body) == ("end_turn", None)
    assert dialect.stop_reason("length", None, body) == ("max_tokens", None)
    assert dialect.stop_reason("tool_calls", None, body) == ("tool_use", None)


def test_anthropic_errors_by_status():
    from localrt import errors

    for err, kind in ((errors.InvalidField("x"), "invalid_request_error"),
                      (errors.Unauthorized("x"), "authentication_error"),
                      (errors.Forbidden("x"), "permission_error"),
                      (errors.NotFound("x"), "not_found_error"),
                      (errors.Conflict("x"), "invalid_request_error"),
                      (errors.PayloadTooLarge("x"), "request_too_large"),
                      (errors.ServiceUnavailable("x"), "overloaded_error"),
                      (errors.UpstreamError("x"), "api_error"),
                      (errors.InternalError("x"), "api_error")):
        assert dialect.error_body(err) == {"type": "error",
                                           "error": {"type": kind, "message": "x"}}


# --- messages on real llama.cpp -----------------------------------------------------


def test_a_message_whole_and_streamed(app, api, models):
    r = create(api)
    assert r.status == 200, r.body
    message = r.json
    assert message["model"] == "qwen25" and message["stop_sequence"] is None
    (block,) = message["content"]
    assert block["type"] == "text" and block["text"]
    assert message["stop_reason"] == "max_tokens" and message["usage"]["output_tokens"] == 16
    # The first prompt the model reads: all of it read afresh, as count_tokens counts it.
    count = api("POST", "/v1/messages/count_tokens", {"model": "qwen25", "messages": [ASK]})
    prompt = count.json["input_tokens"]
    assert count.status == 200 and count.json == {"input_tokens": prompt}
    assert message["usage"] == {"input_tokens": prompt, "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": 0, "output_tokens": 16}
    # The same prompt again, streamed: message_start counts the whole prompt (the cache's
    # share is not known before it is read), message_delta splits it: all but the last
    # token (which gives the logits) come from the prompt cache.
    streamed = events(app, create(api, stream=True))
    assert streamed[0]["message"]["usage"] == {
        "input_tokens": prompt, "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0, "output_tokens": 0}
    built = read_stream(streamed)
    assert built["content"] == message["content"]
    assert (built["stop_reason"], built["stop_sequence"], built["usage"]) == (
        "max_tokens", None, {"input_tokens": 1, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": prompt - 1, "output_tokens": 16})
    assert sum(e["type"] == "content_block_delta" for e in streamed) > 3


def test_stop_sequences_end_the_reply_and_are_named(app, api, models):
    text = create(api, max_tokens=24).json["content"][0]["text"]
    runs = [m for m in re.finditer(r"[A-Za-z0-9]{2,}", text) if m.start() > 0]
    assert runs, text
    stop = runs[0].group()
    before = text[:text.find(stop)]
    r = create(api, max_tokens=24, stop_sequences=["\u2603never", stop])
    assert r.status == 200, r.body
    assert (r.json["stop_reason"], r.json["stop_sequence"]) == ("stop_sequence", stop)
    assert "".join(b["text"] for b in r.json["content"]) == before
    built = read_stream(events(app, create(api, max_tokens=24, stream=True,
                                           stop_sequences=[stop])))
    assert (built["stop_reason"], built["stop_sequence"]) == ("stop_sequence", stop)
    assert "".join(b["text"] for b in built["content"]) == before
    # chat's OpenAI reply names it too, as vLLM does.
    r = api("POST", "/v1/chat/completions", {"model": "qwen25", "messages": [ASK],
                                             "max_tokens": 24, "temperature": 0,
                                             "stop": [stop]})
    assert r.json["choices"][0]["stop_reason"] == stop


@pytest.mark.parametrize("family", FAMILIES)
def test_a_forced_call_whole_and_streamed(app, api, models, family):
    r = create(api, family, max_tokens=120, tools=TOOLS, tool_choice=ONE_CALL)
    assert r.status == 200, r.body
    assert r.json["stop_reason"] == "tool_use"
    (call_,) = r.json["content"]
    assert call_["type"] == "tool_use" and re.fullmatch(ID_OF[family], call_["id"])
    jsonschema.validate(call_["input"], SCHEMAS[call_["name"]])
    named = create(api, family, max_tokens=120, tools=TOOLS,
                   tool_choice={"type": "tool", "name": "get_time",
                                "disable_parallel_tool_use": True})
    assert [b["name"] for b in named.json["content"] if b["type"] == "tool_use"] == [
        "get_time"]

    streamed = events(app, create(api, family, max_tokens=120, tools=TOOLS,
                                  tool_choice=ONE_CALL, stream=True))
    built = read_stream(streamed)
    assert built["stop_reason"] == "tool_use"
    (s_call,) = built["content"]
    assert re.fullmatch(ID_OF[family], s_call["id"])
    # Greedy decoding: the same call, its input sent in several pieces.
    assert (s_call["name"], s_call["input"]) == (call_["name"], call_["input"])
    assert sum(e["type"] == "content_block_delta" for e in streamed) > 3


def test_a_tool_result_reaches_the_template_and_count_tokens_counts_it(api, models):
    # Mistral's template refuses ids other than 9 alphanumerics: an id made by Anthropic
    # itself (a conversation begun with Claude) reaches it hashed to that form.
    for tool_id in ("toolu_01D7FLrfh4GYq7yT1ULFeyMV", "toolu_Ab3De5Gh7"):
        history = [ASK, {"role": "assistant", "content": [
            {"type": "tool_use", "id": tool_id, "name": "get_weather",
             "input": {"city": "Paris", "metric": True}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_id,
                                          "content": '{"celsius": 21}'}]}]
        for family in FAMILIES:
            r = create(api, family, messages=history, tools=TOOLS,
                       tool_choice={"type": "none"}, max_tokens=4)
            assert r.status == 200, (family, r.body)
            assert all(b["type"] == "text" for b in r.json["content"])
            count = api("POST", "/v1/messages/count_tokens", {
                "model": family, "messages": history, "tools": TOOLS})
            assert count.json == {"input_tokens": prompt_size(r.json["usage"])}
            shorter = api("POST", "/v1/messages/count_tokens", {"model": family,
                                                                "messages": [ASK]})
            assert shorter.json["input_tokens"] < count.json["input_tokens"]


def test_count_tokens_starts_the_model_and_counts_the_system_prompt(api, models):
    assert api("GET", "/v1/models/status").json["data"] == []
    plain = api("POST", "/v1/messages/count_tokens", {"model": "llama31", "messages": [ASK]})
    assert plain.status == 200, plain.body
    assert [m["id"] for m in api("GET", "/v1/models/status").json["data"]] == ["llama31"]
    system = api("POST", "/v1/messages/count_tokens", {
        "model": "llama31", "messages": [ASK], "system": "You answer in French."})
    assert system.json["input_tokens"] > plain.json["input_tokens"]


def test_output_config_format_keeps_the_text_to_a_schema(api, models):
    schema = {"type": "object", "required": ["city", "metric"],
              "properties": {"city": {"enum": ["Paris", "Rome"]}, "metric": {"type": "boolean"}}}
    r = create(api, max_tokens=60, output_config={"effort": "low", "format": {
        "type": "json_schema", "schema": schema}})
    assert r.status == 200, r.body
    assert r.json["stop_reason"] == "end_turn"
    jsonschema.validate(json.loads(r.json["content"][0]["text"]), schema)
    r = create(api, output_config={"format": {"type": "json_schema",
                                              "schema": {"type": "strange"}}})
    assert r.status == 400 and "'output_config.format'" in r.json["error"]["message"]


# --- errors -------------------------------------------------------------------------

DOCUMENT = {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                           "data": "a page"}}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}
FILE_IMAGE = {"type": "image", "source": {"type": "file", "file_id": "file_1"}}


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [DOCUMENT]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [FILE_IMAGE]}]},
     "messages[0].content[0].source.type"),
    ({"messages": [ASK, {"role": "assistant", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x.invalid/a.png"}}]},
        ASK]}, "messages[1].content[0].type"),
    ({"messages": [ASK, {"role": "assistant", "content": "It is"}]}, "messages[1]"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "x", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [DOCUMENT]}]}]},
     "messages[0].content[0].content[0]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "has space", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"temperature": 1.5}, "temperature"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    ({"system": 7}, "system"),
])
def test_bad_bodies_are_400s_in_anthropics_shape(api, models, body, field):
    r = create(api, **body)
    assert r.status == 400, r.body
    assert r.json["type"] == "error" and r.json["error"]["type"] == "invalid_request_error"
    assert f"'{field}" in r.json["error"]["message"], r.json
    assert api("GET", "/v1/models/status").json["data"] == []  # refused before starting


def test_transport_errors_are_in_anthropics_shape_too(api, models, quantized):
    cases = [
        (api("POST", "/v1/messages", body=b"{nope", headers={"Content-Type":
                                                             "application/json"}),
         400, "invalid_request_error"),
        (api("POST", "/v1/messages", body=b"x", headers={"Content-Type": "text/plain"}),
         415, "invalid_request_error"),
        (api("GET", "/v1/messages"), 405, "invalid_request_error"),
        (api("POST", "/v1/messages/nope", {}), 404, "not_found_error"),
        (create(api, "no-such-model"), 404, "not_found_error"),
        (api("POST", "/v1/messages", body=b" " * (IMAGE_BODY + 1),
             headers={"Content-Type": "application/json"}), 413, "request_too_large"),
    ]
    for r, status, kind in cases:
        assert (r.status, r.json["type"], r.json["error"]["type"]) == (status, "error", kind)
    # A template that writes no calls localrt reads: a 400 naming tools, as in chat.
    api("POST", "/v1/models/import", {"path": str(quantized["Q8_0"]), "id": "tiny"})
    r = create(api, "tiny", tools=TOOLS)
    assert r.status == 400 and "'tools'" in r.json["error"]["message"]
    # Other routes keep localrt's own shape.
    assert "code" in api("POST", "/v1/chat/completions", {}).json["error"]


def test_x_api_key_is_accepted_on_every_route(home):
    from localrt import settings as settings_mod
    from localrt.app import create_app

    (home / ".localrtrc").write_text(f"apiKeys: [{KEY}]\n")
    app = create_app(settings_mod.load())
    try:
        r = call(app, "GET", "/v1/models")
        assert r.status == 401 and "x-api-key" in r.json["message"]
        assert call(app, "GET", "/v1/models", headers={"x-api-key": KEY}).status == 200
        assert call(app, "GET", "/v1/models", headers={"x-api-key": "wrong"}).status == 401
        r = call(app, "POST", "/v1/messages/count_tokens", {"model": "m", "messages": [ASK]})
        assert r.status == 401 and r.json["error"]["type"] == "authentication_error"
        r = call(app, "POST", "/v1/messages/count_tokens", {"model": "m", "messages": [ASK]},
                 headers={"x-api-key": KEY, "anthropic-version": "2023-06-01",
                          "anthropic-beta": "token-counting-2024-11-01"})
        assert r.status == 404 and r.json["error"]["type"] == "not_found_error"
        # A browser may send the key and version headers across origins.
        r = call(app, "OPTIONS", "/v1/messages", headers={
            "Origin": "http://localhost:39281", "Access-Control-Request-Method": "POST"})
        allowed = r.headers.get("access-control-allow-headers", "").lower()
        assert "x-api-key" in allowed and "anthropic-version" in allowed
    finally:
        app.close()


def test_the_openapi_document_has_the_routes_and_anthropics_shapes(api):
    doc = api("GET", "/openapi.json").json
    messages = doc["paths"]["/v1/messages"]["post"]
    assert messages["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/anthropic-messages"}
    success = messages["responses"]["200"]["content"]
    assert set(success) == {"application/json", "text/event-stream"}
    assert success["application/json"]["schema"]["$ref"].endswith("/anthropic-message")
    assert messages["responses"]["default"]["content"]["application/json"]["schema"][
        "$ref"].endswith("/anthropic-error")
    count = doc["paths"]["/v1/messages/count_tokens"]["post"]
    assert count["responses"]["200"]["content"]["application/json"]["schema"][
        "$ref"].endswith("/anthropic-token-count")
    assert "anthropic-count-tokens" in doc["components"]["schemas"]


# --- the anthropic SDK --------------------------------------------------------------


# The SDK has no temperature (Anthropic's newest API dropped it): the field is sent as
# extra_body, or stored with the model (PATCH /v1/models/ID), as users of the SDK do.
GREEDY = {"temperature": 0}


def import_greedy(url, model_id, path):
    """Import a model with temperature 0 stored: its replies are greedy."""
    status, body = send(url, "POST", "/v1/models/import", {"path": str(path), "id": model_id})
    assert status == 200, body
    status, body = send(url, "PATCH", f"/v1/models/{model_id}", GREEDY)
    assert status == 200, body


def sdk(url, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=kwargs.pop("api_key", "unused"),
                               max_retries=0, timeout=120, **kwargs)


def test_the_sdk_creates_streams_and_counts(live_server, family_models):
    import_greedy(live_server.url, "qwen25", family_models["qwen25"])
    with sdk(live_server.url) as client:
        whole = client.messages.create(model="qwen25", max_tokens=16,
                                       messages=[ASK])
        assert whole.type == "message" and whole.role == "assistant"
        assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 16
        text = whole.content[0].text
        with client.messages.stream(model="qwen25", max_tokens=16,
                                    messages=[ASK]) as stream:
            pieces = list(stream.text_stream)
            final = stream.get_final_message()
        assert "".join(pieces) == text and len(pieces) > 3
        assert final.content[0].text == text and final.stop_reason == "max_tokens"
        assert prompt_size(final.usage) == prompt_size(whole.usage)
        assert final.usage.output_tokens == 16
        counted = client.messages.count_tokens(model="qwen25", messages=[ASK])
        assert counted.input_tokens == prompt_size(whole.usage)

        stop = next(m.group() for m in re.finditer(r"[A-Za-z0-9]{2,}", text) if m.start())
        cut = client.messages.create(model="qwen25", max_tokens=16,
                                     messages=[ASK], stop_sequences=[stop])
        assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
        assert "".join(b.text for b in cut.content) == text[:text.find(stop)]

        with pytest.raises(anthropic.NotFoundError) as caught:
            client.messages.create(model="nope", max_tokens=4, messages=[ASK])
        assert caught.value.body["error"]["type"] == "not_found_error"
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(model="qwen25", max_tokens=4, messages=[
                {"role": "user", "content": [IMAGE]}])
        assert "vision" in caught.value.body["error"]["message"]


# A long system prompt that no other test's prompt starts with.
LONG_SYSTEM = " ".join(f"Rule {i}: answer about the weather in city number {i}."
                       for i in range(40))


def test_the_sdk_reads_the_prompt_caches_share_of_a_second_turn(live_server, family_models):
    """A conversation's second turn reads only its new tokens: its usage counts the rest
    as cache_read_input_tokens, as llama-server and Anthropic do (Claude Code shows its
    cache hits from them), whole and streamed; the first turn reads all of its prompt."""
    import_greedy(live_server.url, "qwen25", family_models["qwen25"])

    def turn(client, messages, streamed):
        body = {"model": "qwen25", "max_tokens": 4, "system": LONG_SYSTEM,
                "messages": messages}
        prompt = client.messages.count_tokens(**{k: v for k, v in body.items()
                                                 if k != "max_tokens"}).input_tokens
        if not streamed:
            reply = client.messages.create(**body)
        else:
            with client.messages.stream(**body) as stream:
                start = next(e for e in stream if e.type == "message_start")
                reply = stream.get_final_message()
            # The cache's share is not known before the prompt is read: message_start
            # counts it all; message_delta's split is what the SDK's message keeps.
            assert (start.message.usage.input_tokens,
                    start.message.usage.cache_read_input_tokens) == (prompt, 0)
        assert reply.usage.cache_creation_input_tokens == 0
        assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == prompt
        return reply, prompt

    with sdk(live_server.url) as client:
        for streamed in (False, True):
            # A model just started has nothing cached.
            assert send(live_server.url, "POST", "/v1/models/qwen25/stop")[0] in (200, 409)
            first, first_prompt = turn(client, [ASK], streamed)
            assert first.usage.cache_read_input_tokens == 0
            assert first.usage.input_tokens == first_prompt > 200
            history = [ASK, {"role": "assistant", "content": first.content},
                       {"role": "user", "content": "And in Rome?"}]
            second, second_prompt = turn(client, history, streamed)
            # The first turn's prompt came from the cache, and only the rest was read.
            assert second.usage.cache_read_input_tokens >= first_prompt
            assert second.usage.input_tokens <= second_prompt - first_prompt


def test_the_sdk_tool_use_round_trip(live_server, family_models):
    """Call, tool result, final answer, as the SDK's users write it, for each family."""
    with sdk(live_server.url) as client:
        for family, path in family_models.items():
            import_greedy(live_server.url, family, path)
            first = client.messages.create(model=family, max_tokens=120,
                                           messages=[ASK], tools=TOOLS, tool_choice=ONE_CALL)
            assert first.stop_reason == "tool_use"
            (tool_use,) = [b for b in first.content if b.type == "tool_use"]
            assert re.fullmatch(ID_OF[family], tool_use.id)
            jsonschema.validate(tool_use.input, SCHEMAS[tool_use.name])
            # The SDK's own content blocks go back as they are.
            history = [ASK, {"role": "assistant", "content": first.content},
                       {"role": "user", "content": [{
                           "type": "tool_result", "tool_use_id": tool_use.id,
                           "content": [{"type": "text", "text": '{"result": "sunny"}'}]}]}]
            final = client.messages.create(model=family, max_tokens=8,
                                           messages=history, tools=TOOLS,
                                           tool_choice={"type": "none"})
            assert final.stop_reason in ("end_turn", "max_tokens")
            assert all(b.type == "text" for b in final.content)
            assert prompt_size(final.usage) > prompt_size(first.usage)
            assert client.messages.count_tokens(
                model=family, messages=history, tools=TOOLS).input_tokens == \
                prompt_size(final.usage)

            # The same first step streamed, as the SDK builds it from input_json_delta.
            with client.messages.stream(model=family, max_tokens=120,
                                        messages=[ASK], tools=TOOLS,
                                        tool_choice=ONE_CALL) as stream:
                streamed = stream.get_final_message()
            (s_use,) = streamed.content
            assert (s_use.name, s_use.input, streamed.stop_reason) == (
                tool_use.name, tool_use.input, "tool_use")
            send(live_server.url, "POST", f"/v1/models/{family}/stop")


def test_the_sdk_with_x_api_key(home, family_models):
    from support.servers import run_foreground_server

    (home / ".localrtrc").write_text(f"apiKeys: [{KEY}]\n")
    srv = run_foreground_server(home)
    try:
        with sdk(srv.url, api_key="wrong") as client:
            with pytest.raises(anthropic.AuthenticationError) as caught:
                client.messages.count_tokens(model="qwen25", messages=[ASK])
            assert caught.value.body["error"]["type"] == "authentication_error"
        # Any route takes x-api-key: the import too.
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("POST", "/v1/models/import", json.dumps(
            {"path": str(family_models["qwen25"]), "id": "qwen25"}),
            {"Content-Type": "application/json", "x-api-key": KEY})
        assert conn.getresponse().status == 200
        conn.close()
        with sdk(srv.url, api_key=KEY) as client:  # x-api-key
            reply = client.messages.create(model="qwen25", max_tokens=2, messages=[ASK])
            assert reply.usage.output_tokens <= 2
        with anthropic.Anthropic(base_url=srv.url, auth_token=KEY, max_retries=0) as client:
            assert client.messages.count_tokens(model="qwen25", messages=[ASK]).input_tokens
    finally:
        srv.stop()


def test_a_stream_cut_by_a_stopped_model_ends_with_an_error_event(live_server, slow_gguf):
    send(live_server.url, "POST", "/v1/models/import", {"path": str(slow_gguf), "id": "slow"})
    send(live_server.url, "POST", "/v1/models/slow/start", {"cpu_threads": 1, **NO_DRAFTS})
    conn = http.client.HTTPConnection("127.0.0.1", urlsplit(live_server.url).port, timeout=60)
    conn.request("POST", "/v1/messages", json.dumps(
        {"model": "slow", "max_tokens": 3000, "temperature": 0, "stream": True,
         "messages": [{"role": "user", "content": "Hello there"}]}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline() == b"event: message_start\n"
    while resp.readline() != b"event: content_block_delta\n":  # generating now
        pass
    assert send(live_server.url, "POST", "/v1/models/slow/stop")[0] == 200
    blocks = [b for b in resp.read().decode().split("\n\n") if b.strip()]
    conn.close()
    event_line, data = blocks[-1].split("\n")
    assert event_line == "event: error"
    error = json.loads(data[len("data: "):])
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "stopped" in error["error"]["message"]
    assert "event: content_block_stop" in blocks[-2]


def test_a_remote_model_speaks_anthropic_too(live_server, family_models, tmp_path):
    """The same translation over a real OpenAI-compatible upstream (llama-cpp-python's
    server), which knows nothing of Anthropic."""
    from emulators.upstreams import start_replica

    replica = start_replica(family_models["qwen25"], tmp_path / "replica.log")
    try:
        status, body = send(live_server.url, "POST", "/v1/models/remote", {
            "id": "far", "upstreams": [{"url": replica.url}]})
        assert status == 200, body
        with sdk(live_server.url) as client:
            whole = client.messages.create(model="far", max_tokens=6, extra_body=GREEDY,
                                           messages=[ASK])
            assert whole.model == "far" and whole.stop_reason == "max_tokens"
            assert whole.usage.output_tokens == 6 and whole.usage.input_tokens > 0
            with client.messages.stream(model="far", max_tokens=6, extra_body=GREEDY,
                                        messages=[ASK]) as stream:
                final = stream.get_final_message()
            assert final.content[0].text == whole.content[0].text
            assert final.stop_reason == "max_tokens"
            # llama-cpp-python's server sends no usage in a stream (stream_options is
            # asked for): the counts are 0 then, never made up.
            assert (final.usage.input_tokens, final.usage.output_tokens) in (
                (0, 0), (whole.usage.input_tokens, 6))
            counted = client.messages.count_tokens(model="far", messages=[ASK])
            assert counted.input_tokens == whole.usage.input_tokens
    finally:
        replica.stop()
