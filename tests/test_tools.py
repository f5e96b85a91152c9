"""Tool calls on real llama.cpp: prompts from real chat templates, grammar-forced calls
read back, streamed and not, and the openai SDK's round trip against a live server.

The models are tiny random llamas (tests/emulators/ggufgen.py) that carry a real model's Jinja
chat template as tokenizer.chat_template and that family's added tokens (Qwen 2.5's
<tool_call> as a printed token, Llama 3.1's header tokens and Mistral's [TOOL_CALLS]
as special ones), with a 4096-token context: tools make long prompts. Their random
weights write gibberish, so every call here is forced (tool_choice "required" or a
named function) and its arguments have few choices (enums, booleans), which a grammar
ends quickly. The parser on what real models write is tests/test_toolcalls.py.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from emulators.chattemplates import TOKENS
from emulators.ggufgen import EOS_ID
from support.models import FAMILIES

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city", "metric"],
                   "properties": {"city": {"enum": ["Paris", "Rome"]},
                                  "metric": {"type": "boolean"}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "required": ["zone"],
                   "properties": {"zone": {"enum": ["CET", "UTC"]}}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}
ID_OF = {"mistral_nemo": r"[a-zA-Z0-9]{9}", "qwen25": r"call_\w{24}", "llama31": r"call_\w{24}"}


def token_id(family: str, text: str) -> int:
    """The id write_gguf gives an added token: after <unk> <s> </s>, 256 bytes, ChatML's 2."""
    return 261 + [t for t, _ in TOKENS[family]].index(text)


def chat(api, model, **body):
    body = {"model": model, "messages": ASK, "tools": TOOLS, "max_tokens": 120,
            "temperature": 0, **body}
    return api("POST", "/v1/chat/completions", body)


def events(app, r) -> list:
    """The chunks of a streamed reply, each checked against replies.json."""
    assert r.status == 200, r.body
    blocks = [b[6:] for b in r.body.decode().split("\n\n") if b.startswith("data: ")]
    assert blocks[-1] == "[DONE]"
    chunks = [json.loads(b) for b in blocks[:-1]]
    for chunk in chunks:
        assert not app.validators.reply_errors("chat-completion-chunk", chunk), chunk
    return chunks


def calls_of_stream(chunks) -> tuple[str, list, str]:
    """(content, [[id, name, arguments]], finish_reason) of a stream, checking that each
    call's first delta brings index, id, type and name and the later ones arguments only."""
    content, calls, finish = "", [], None
    for chunk in chunks:
        choice, = chunk["choices"]
        delta = choice["delta"]
        content += delta.get("content", "")
        for tc in delta.get("tool_calls", []):
            if tc["index"] == len(calls):
                assert set(tc) == {"index", "id", "type", "function"} and tc["type"] == "function"
                assert tc["function"]["arguments"] == ""
                calls.append([tc["id"], tc["function"]["name"], ""])
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                assert tc["index"] == len(calls) - 1
                calls[-1][2] += tc["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return content, calls, finish


# --- prompts ------------------------------------------------------------------------

HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "Ab3De5Gh7", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "metric": true}'}}]},
    {"role": "tool", "tool_call_id": "Ab3De5Gh7", "content": '{"celsius": 21}'}]


def expected_prompts() -> dict:
    """What each family's template makes of ASK and of HISTORY with TOOLS, written out as
    its model card shows it (tools as JSON in the system turn, the first user turn or
    [AVAILABLE_TOOLS]; earlier calls with their arguments as JSON objects)."""
    weather, time_ = (json.dumps(t) for t in TOOLS)
    qwen = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
            "assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the "
            "user query.\n\nYou are provided with function signatures within <tools></tools> "
            f"XML tags:\n<tools>\n{weather}\n{time_}\n</tools>\n\nFor each function call, "
            "return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
            "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
            "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n")
    llama = ("<s><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
             "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
             "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, "
             "please respond with a JSON for a function call with its proper arguments that "
             "best answers the given prompt.\n\nRespond in the format {\"name\": function "
             "name, \"parameters\": dictionary of argument name and its value}.Do not use "
             "variables.\n\n" + "".join(json.dumps(t, indent=4) + "\n\n" for t in TOOLS)
             + "What is the weather in Paris?<|eot_id|>")
    mistral_tools = ", ".join(
        '{"type": "function", "function": {"name": "%s", "description": "%s", '
        '"parameters": %s}}' % (t["function"]["name"], t["function"]["description"],
                                json.dumps(t["function"]["parameters"])) for t in TOOLS)
    mistral = f"<s>[AVAILABLE_TOOLS][{mistral_tools}][/AVAILABLE_TOOLS]"
    call = '{"city": "Paris", "metric": true}'
    return {
        "qwen25": (qwen + "<|im_start|>assistant\n",
                   qwen + "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", "
                   f"\"arguments\": {call}}}\n</tool_call><|im_end|>\n<|im_start|>user\n"
                   "<tool_response>\n{\"celsius\": 21}\n</tool_response><|im_end|>\n"
                   "<|im_start|>assistant\n"),
        "llama31": (llama + "<|start_header_id|>assistant<|end_header_id|>\n\n",
                    llama + "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": "
                    f"\"get_weather\", \"parameters\": {call}}}<|eot_id|>"
                    "<|start_header_id|>ipython<|end_header_id|>\n\n"
                    + json.dumps('{"celsius": 21}') + "<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n"),
        "mistral_nemo": (mistral + "[INST]What is the weather in Paris?[/INST]",
                         mistral + "[INST]What is the weather in Paris?[/INST][TOOL_CALLS]"
                         "[{\"name\": \"get_weather\", \"arguments\": " + call + ", \"id\": "
                         "\"Ab3De5Gh7\"}]</s>[TOOL_RESULTS]{\"content\": {\"celsius\": 21}, "
                         "\"call_id\": \"Ab3De5Gh7\"}[/TOOL_RESULTS]"),
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_each_template_renders_the_tools_and_the_calls_history(api, models, family):
    import llama_cpp

    from localrt.dialects.openai import read_chat
    from localrt.engines.llama.model import GgufEngine
    from localrt.inference.chat import _message

    ask, history = expected_prompts()[family]
    model = GgufEngine().load(str(models[family]), {"ctx_len": 4096})
    try:
        messages = [_message(m, None)
                    for m in read_chat({"model": family, "messages": HISTORY}).messages]
        assert model._format(messages[:1], TOOLS)[0] == ask
        assert model._format(messages, TOOLS)[0] == history
    finally:
        model.unload()
    # And the server's prompt is that one: as many tokens.
    vocab = llama_cpp.Llama(str(models[family]), vocab_only=True, verbose=False)
    for messages, prompt in ((ASK, ask), (HISTORY, history)):
        r = chat(api, family, messages=messages, max_tokens=1, tool_choice="none")
        assert r.status == 200, r.body
        tokens = vocab.tokenize(prompt.encode(), add_bos=False, special=True)
        assert r.json["usage"]["prompt_tokens"] == len(tokens)
    vocab.close()


# --- forced calls -------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_is_read_back_streamed_and_not(app, api, models, family, choice):
    tool_choice = NAMED if choice == "named" else "required"
    r = chat(api, family, tool_choice=tool_choice, parallel_tool_calls=False)
    assert r.status == 200, r.body
    choice_, = r.json["choices"]
    assert choice_["finish_reason"] == "tool_calls"
    message = choice_["message"]
    assert message["content"] is None
    tool_call, = message["tool_calls"]
    assert re.fullmatch(ID_OF[family], tool_call["id"]) and tool_call["type"] == "function"
    name = tool_call["function"]["name"]
    assert name == "get_time" if choice == "named" else name in SCHEMAS
    arguments = json.loads(tool_call["function"]["arguments"])
    jsonschema.validate(arguments, SCHEMAS[name])

    chunks = events(app, chat(api, family, tool_choice=tool_choice, parallel_tool_calls=False,
                              stream=True))
    content, calls, finish = calls_of_stream(chunks)
    assert content == "" and finish == "tool_calls"
    (call_id, s_name, s_arguments), = calls
    assert re.fullmatch(ID_OF[family], call_id)
    # Greedy decoding: the same call, its arguments sent in several pieces.
    assert (s_name, s_arguments) == (name, tool_call["function"]["arguments"])
    pieces = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert len(pieces) > 3


def test_parallel_calls_each_come_whole(api, models):
    # The random model goes on calling until max_tokens cuts a call: that one is text.
    r = chat(api, "qwen25", tool_choice="required", max_tokens=300)
    assert r.status == 200, r.body
    choice, = r.json["choices"]
    assert choice["finish_reason"] == "length"
    calls = choice["message"]["tool_calls"]
    assert len(calls) >= 2 and len({c["id"] for c in calls}) == len(calls)
    for tool_call in calls:
        jsonschema.validate(json.loads(tool_call["function"]["arguments"]),
                            SCHEMAS[tool_call["function"]["name"]])
    assert choice["message"]["content"].startswith("<tool_call>")


def test_mistrals_special_call_token_is_read(api, models):
    # Forced to the one [TOOL_CALLS] token rather than its letters, the call still reads:
    # the engine prints that special token for the parser (preserved_tokens).
    bias = {str(token_id("mistral_nemo", "[TOOL_CALLS]")): 100}
    r = chat(api, "mistral_nemo", tool_choice="required", logit_bias=bias,
             parallel_tool_calls=False)
    assert r.status == 200, r.body
    assert r.json["choices"][0]["message"]["tool_calls"][0]["function"]["name"] in SCHEMAS
    r = chat(api, "mistral_nemo", tool_choice="required", logit_bias=bias, max_tokens=1)
    assert r.json["usage"]["completion_tokens"] == 1  # the one token, given back as text
    assert r.json["choices"][0]["message"]["content"] == "[TOOL_CALLS]"
    # Without tools the special token prints as nothing, as before.
    r = api("POST", "/v1/chat/completions", {"model": "mistral_nemo", "messages": ASK,
                                             "max_tokens": 3, "logit_bias": bias})
    assert r.json["choices"][0]["message"]["content"] == ""


def test_a_reply_that_is_text_stays_content(app, api, models):
    no_call = {str(token_id("qwen25", "<tool_call>")): -100, str(EOS_ID): -100}
    r = chat(api, "qwen25", max_tokens=12, logit_bias=no_call)
    assert r.status == 200, r.body
    choice, = r.json["choices"]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    content = choice["message"]["content"]
    assert content
    chunks = events(app, chat(api, "qwen25", max_tokens=12, logit_bias=no_call, stream=True))
    assert calls_of_stream(chunks) == (content, [], "length")


# --- what is refused ----------------------------------------------------------------


def test_tools_on_a_template_without_calls_are_a_400_unless_not_called(api, quantized):
    r = api("POST", "/v1/models/import", {"path": str(quantized["Q8_0"]), "id": "tiny",
                                          "option": "symlink"})
    assert r.status == 200
    r = chat(api, "tiny")
    assert r.status == 400 and r.json["error"]["param"] == "tools"
    r = chat(api, "tiny", tool_choice="none", max_tokens=2)
    assert r.status == 200 and "tool_calls" not in r.json["choices"][0]["message"]


def test_a_schema_without_a_grammar_is_a_400_before_the_model_starts(api, models):
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "strange"}}}
    r = chat(api, "qwen25", tools=[WEATHER, odd], tool_choice="required")
    assert r.status == 400 and r.json["error"]["param"] == "tools[1].function.parameters"
    assert "'odd'" in r.json["message"]
    assert api("GET", "/v1/models/status").json["data"] == []


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": ASK + [{"role": "tool", "content": "21"}]}, "messages[1].tool_call_id"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"type": "function"}]}]},
     "messages[1].tool_calls[0].function"),
])
def test_tool_fields_are_checked(api, models, body, param):
    r = chat(api, "qwen25", **body)
    assert r.status == 400, r.body
    assert r.json["error"]["param"] == param


def test_a_call_id_the_template_refuses_is_a_400(api, models):
    history = [dict(m) for m in HISTORY]
    history[1] = {**history[1], "tool_calls": [{**history[1]["tool_calls"][0],
                                                "id": "call_1"}]}
    r = chat(api, "mistral_nemo", messages=history)
    assert r.status == 400 and r.json["error"]["param"] == "messages"
    assert "9" in r.json["message"]


def test_onnx_models_refuse_tools_before_anything_waits(api, tmp_path):
    from emulators.onnxgen import write_onnx_model

    folder = write_onnx_model(tmp_path / "onnx-model")
    api("POST", "/v1/models/import", {"path": str(folder), "id": "tiny-onnx"})
    r = chat(api, "tiny-onnx")
    assert r.status == 400 and r.json["error"]["param"] == "tools"
    assert "onnx-runtime" in r.json["message"]


# --- the openai SDK -----------------------------------------------------------------


def test_the_openai_sdk_tools_round_trip(live_server, family_models):
    """Call, tool result, final answer, as the SDK's users write it, for each family."""
    import openai

    from support.servers import send

    client = openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    with client:
        for family, path in family_models.items():
            status, body = send(live_server.url, "POST", "/v1/models/import",
                                {"path": str(path), "id": family})
            assert status == 200, body
            messages = list(ASK)
            first = client.chat.completions.create(
                model=family, messages=messages, tools=TOOLS, tool_choice="required",
                parallel_tool_calls=False, temperature=0, max_tokens=120)
            choice = first.choices[0]
            assert choice.finish_reason == "tool_calls"
            tool_call, = choice.message.tool_calls
            arguments = json.loads(tool_call.function.arguments)
            jsonschema.validate(arguments, SCHEMAS[tool_call.function.name])
            messages.append(choice.message)  # the SDK's own object goes back as it is
            messages.append({"role": "tool", "tool_call_id": tool_call.id,
                             "content": json.dumps({"result": "sunny"})})
            final = client.chat.completions.create(
                model=family, messages=messages, tools=TOOLS, tool_choice="none",
                temperature=0, max_tokens=8)
            assert final.choices[0].finish_reason in ("stop", "length")
            assert isinstance(final.choices[0].message.content, str)
            assert not final.choices[0].message.tool_calls
            assert final.usage.prompt_tokens > first.usage.prompt_tokens

            # The same first step streamed, as the SDK reads chunks.
            stream = client.chat.completions.create(
                model=family, messages=ASK, tools=TOOLS, tool_choice="required",
                parallel_tool_calls=False, temperature=0, max_tokens=120, stream=True)
            name, pieces, finish = None, [], None
            for chunk in stream:
                delta = chunk.choices[0].delta
                for tc in delta.tool_calls or []:
                    assert tc.index == 0
                    name = name or tc.function.name
                    pieces.append(tc.function.arguments or "")
                finish = chunk.choices[0].finish_reason or finish
            assert (name, "".join(pieces), finish) == (
                tool_call.function.name, tool_call.function.arguments, "tool_calls")
            send(live_server.url, "POST", f"/v1/models/{family}/stop")
