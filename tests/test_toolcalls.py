"""localrt.engines.toolcalls without a model: families from real chat templates, the request's
tool fields, the grammars, and the parser on recorded outputs of each family.

The recorded outputs are what the models write (the shapes their model cards and chat
templates show): Qwen 2.5's <tool_call> blocks, Llama 3.1's JSON calls (bare or after
<|python_tag|>), Mistral's [TOOL_CALLS] arrays. Every one is read whole and as a
stream cut into pieces of every size: a well-formed reply reads the same both ways.
"""

from __future__ import annotations

import json
import re

import pytest
from emulators.chattemplates import LLAMA31, MISTRAL_NEMO, QWEN25
from emulators.ggufgen import CHATML_TEMPLATE

from localrt.dialects.openai import read_chat
from localrt.engines import toolcalls
from localrt.errors import InvalidField

FAMILY = {f.name: f for f in toolcalls.FAMILIES}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def whole(family, text, max_calls=1 << 30):
    return toolcalls.read_reply(toolcalls.CallParser(FAMILY[family], max_calls), text)


def streamed(family, text, size, max_calls=1 << 30):
    """(content, [(name, arguments)], events) of `text` fed in pieces of `size`."""
    parser = toolcalls.CallParser(FAMILY[family], max_calls)
    events = []
    for i in range(0, len(text), size):
        events += parser.feed(text[i:i + size])
    events += parser.close()
    content = "".join(e[1] for e in events if e[0] == "text")
    calls: dict = {}
    for event in events:
        if event[0] == "call":
            assert event[1] == len(calls), "calls are announced in order"
            calls[event[1]] = [event[3], ""]
        elif event[0] == "args":
            assert event[1] in calls, "a call's name comes before its arguments"
            calls[event[1]][1] += event[2]
    return content, [tuple(c) for c in calls.values()], events


def read_everywhere(family, text, max_calls=1 << 30):
    """The reply read whole; asserts that every streamed reading agrees with it."""
    content, calls = whole(family, text, max_calls)
    for size in range(1, len(text) + 1):
        s_content, s_calls, _ = streamed(family, text, size, max_calls)
        assert (s_content, s_calls) == (content, [(n, a) for _, n, a in calls]), size
    return content, [(name, json.loads(args)) for _, name, args in calls], calls


# --- families and requests ------------------------------------------------------------


def test_each_real_template_is_its_family():
    assert toolcalls.family_of(QWEN25).name == "hermes"
    assert toolcalls.family_of(LLAMA31).name == "llama3"
    assert toolcalls.family_of(MISTRAL_NEMO).name == "mistral"
    assert toolcalls.family_of(CHATML_TEMPLATE) is None
    assert toolcalls.family_of(None) is None


def test_call_ids_are_what_each_template_takes_back():
    ids = {FAMILY["mistral"].new_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"[a-zA-Z0-9]{9}", i) for i in ids)
    assert re.fullmatch(r"call_[a-zA-Z0-9]{24}", FAMILY["hermes"].new_id())


def tool_request(body: dict):
    """The ToolRequest of a chat body's tool fields, read as OpenAI's dialect reads them."""
    request = read_chat({"model": "m", "messages": [], **body})
    return toolcalls.ToolRequest.read(request.tools, request.tool_choice,
                                      request.tool_function, request.parallel_tool_calls)


def test_tool_choice_is_checked_against_the_tools():
    request = tool_request({"tools": [WEATHER, TIME]})
    assert (request.choice, request.parallel, request.forced()) == ("auto", True, [])
    named = tool_request({"tools": [WEATHER, TIME], "parallel_tool_calls": False,
                                        "tool_choice": {"type": "function",
                                                        "function": {"name": "get_time"}}})
    assert named.forced() == [(1, TIME)] and not named.parallel
    required = tool_request({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert required.forced() == [(0, WEATHER), (1, TIME)]
    assert tool_request({"tool_choice": "auto"}) is None
    for body, param in [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ]:
        with pytest.raises(InvalidField) as info:
            tool_request(body)
        assert info.value.param == param


def test_a_template_without_calls_refuses_tools_unless_they_are_not_called():
    with pytest.raises(InvalidField) as info:
        tool_request({"tools": [WEATHER]}).plan(CHATML_TEMPLATE)
    assert info.value.param == "tools" and "hermes, llama3, mistral" in info.value.message
    plan = tool_request({"tools": [WEATHER], "tool_choice": "none"}).plan(
        CHATML_TEMPLATE)
    assert plan.params() == {"tools": [WEATHER]} and plan.parser() is None
    plan = tool_request({"tools": [WEATHER], "tool_choice": "none"}).plan(QWEN25)
    assert plan.params() == {"tools": [WEATHER]} and plan.parser() is None


def test_plans_give_the_template_tools_and_force_calls_with_a_grammar():
    auto = tool_request({"tools": [WEATHER]}).plan(MISTRAL_NEMO)
    assert auto.params() == {"tools": [WEATHER], "preserved_tokens": ["[TOOL_CALLS]"]}
    required = tool_request({"tools": [WEATHER], "tool_choice": "required"})
    params = required.plan(MISTRAL_NEMO).params()
    assert params["grammar"].startswith('root ::= "[TOOL_CALLS][" call (", " call)* "]"\n')
    # Llama 3.x templates render one call per message, whatever the request allows.
    assert required.plan(LLAMA31).max_calls() == 1
    assert required.plan(LLAMA31).params()["grammar"].startswith("root ::= call\n")


@pytest.mark.parametrize("family", sorted(FAMILY))
def test_the_grammars_are_llama_cpp_grammars(family):
    from llama_cpp.llama_grammar import LlamaGrammar

    for forced, parallel in (([(0, WEATHER)], False), ([(0, WEATHER), (1, TIME)], True)):
        gbnf = toolcalls.grammar(FAMILY[family], forced, parallel)
        assert '"\\"get_weather\\""' in gbnf
        assert ('"\\"parameters\\""' in gbnf) == (family == "llama3")
        LlamaGrammar.from_string(gbnf, verbose=False)  # raises if llama.cpp cannot parse it


def test_a_schema_without_a_grammar_is_a_400_naming_the_tool():
    bad = {"type": "function", "function": {"name": "odd", "parameters": {"type": "strange"}}}
    toolcalls.check_schemas([WEATHER, bad], "auto")  # nothing is forced: no grammar needed
    toolcalls.check_schemas([WEATHER, bad], "function", "get_weather")
    for choice, name in (("required", None), ("function", "odd")):
        with pytest.raises(InvalidField) as info:
            toolcalls.check_schemas([WEATHER, bad], choice, name)
        assert info.value.param == "tools[1].function.parameters"
        assert "'odd'" in info.value.message


def test_references_inside_a_tools_parameters_resolve():
    place = {"type": "function", "function": {"name": "go", "parameters": {
        "type": "object", "required": ["to"], "properties": {"to": {"$ref": "#/$defs/city"}},
        "$defs": {"city": {"enum": ["Paris", "Rome"]}}}}}
    toolcalls.check_schemas([place], "required")
    gbnf = toolcalls.grammar(FAMILY["hermes"], [(0, place), (1, WEATHER)], True)
    assert '"\\"Paris\\""' in gbnf


# --- Hermes / Qwen 2.5 ----------------------------------------------------------------

QWEN_SINGLE = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco, '
               'CA, USA", "unit": "fahrenheit"}}\n</tool_call>')
QWEN_PARALLEL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>')


def test_qwen_single_call():
    content, calls, raw = read_everywhere("hermes", QWEN_SINGLE)
    assert content == ""
    assert calls == [("get_weather", {"city": "San Francisco, CA, USA", "unit": "fahrenheit"})]
    assert raw[0][0].startswith("call_")


def test_qwen_parallel_calls_and_text_around_them():
    content, calls, raw = read_everywhere("hermes", QWEN_PARALLEL)
    assert content == "" and [c[0] for c in calls] == ["get_weather", "get_time"]
    assert raw[0][0] != raw[1][0]
    text = "I will look both up.\n\n" + QWEN_PARALLEL + "\nOne moment."
    content, calls, _ = read_everywhere("hermes", text)
    assert content == "I will look both up.One moment."
    assert calls[1] == ("get_time", {"zone": "Europe/Paris"})


def test_qwen_with_parallel_calls_off_ends_at_the_first_call():
    content, calls, _ = read_everywhere("hermes", QWEN_PARALLEL, max_calls=1)
    assert content == "" and calls == [("get_weather", {"city": "Paris"})]


def test_qwen_malformed_json_stays_content():
    for text in ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n'
                 '</tool_call>',                                      # a brace short
                 '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>',
                 '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',   # no name
                 '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'):  # cut
        assert whole("hermes", text) == (text, []), text
    # A broken block does not take well-formed ones with it.
    broken = '<tool_call>\n{"name": "x", "arguments": [}\n</tool_call>'
    content, calls = whole("hermes", QWEN_SINGLE + "\n" + broken)
    assert content == broken and [c[1] for c in calls] == ["get_weather"]


def test_qwen_text_that_only_looks_like_a_call_is_content():
    for text in ("Use <tool> tags, or <tool_cal> ones.", "a < b and {c}", "<tool_call>",
                 "<tool_call>\n", "Done.\n\n"):
        content, calls, _ = read_everywhere("hermes", text)
        assert (content, calls) == (text, []), text


def test_streams_hold_back_only_what_might_open_a_call():
    parser = toolcalls.CallParser(FAMILY["hermes"], 8)
    assert parser.feed("Hello <tool") == [("text", "Hello")]
    assert parser.feed("s> and more") == [("text", " <tools> and more")]
    assert parser.feed(" <tool_call>\n{\"name\": \"get_") == []
    assert parser.feed("weather\", \"arguments\": {\"ci")[0][:2] == ("call", 0)
    assert parser.feed("ty\": 1}}") == [("args", 0, 'ty": 1}')]
    assert parser.close() == []


def test_arguments_come_in_pieces_after_the_name_whatever_the_key_order():
    text = '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>'
    content, calls, _ = read_everywhere("hermes", text)
    assert calls == [("get_weather", {"city": "Paris"})]
    _, _, events = streamed("hermes", QWEN_SINGLE, 4)
    pieces = [e for e in events if e[0] == "args"]
    assert len(pieces) > 5 and "".join(p[2] for p in pieces).startswith('{"city"')


def test_a_call_without_arguments_has_an_empty_object():
    _, calls, _ = read_everywhere("hermes", '<tool_call>\n{"name": "now"}\n</tool_call>')
    assert calls == [("now", {})]


# --- Llama 3.1 ------------------------------------------------------------------------

LLAMA_SINGLE = ('{"name": "get_weather", "parameters": {"city": "San Francisco, CA", '
                '"unit": "fahrenheit"}}')


def test_llama_single_call_bare_and_after_the_python_tag():
    for text in (LLAMA_SINGLE, "<|python_tag|>" + LLAMA_SINGLE, " \n" + LLAMA_SINGLE + "\n"):
        content, calls, _ = read_everywhere("llama3", text)
        assert content == "" and calls == [
            ("get_weather", {"city": "San Francisco, CA", "unit": "fahrenheit"})], text


def test_llama_3_2s_typed_calls_and_text_before_a_call():
    text = ('Let me check that for you.\n\n{"type": "function", "name": "get_time", '
            '"parameters": {"zone": "UTC"}}')
    content, calls, _ = read_everywhere("llama3", text)
    assert content == "Let me check that for you." and calls == [("get_time", {"zone": "UTC"})]


def test_llama_json_that_is_not_a_call_is_content():
    for text in ('{"answer": 42}', '{"type": "object", "properties": {}}', "{ }",
                 'Braces { "and" } quotes', '{"name": "no arguments key"'):
        content, calls = whole("llama3", text)
        assert (content, calls) == (text, []), text
    content, calls, _ = read_everywhere("llama3", '{"answer": {"nested": [1, 2]}} done')
    assert calls == []


def test_llama_malformed_json_stays_content():
    for text in ('{"name": "get_weather", "parameters": {"city": "Paris",}}',
                 '{"name": "get_weather", "parameters": {"city": "Paris"}',
                 '{"name": 7, "parameters": {}}'):
        assert whole("llama3", text) == (text, []), text


def test_llama_strings_with_braces_and_escapes_stay_inside_the_arguments():
    text = r'{"name": "say", "parameters": {"text": "a } \" { \\ ] [", "n": -1.5e3}}'
    _, calls, _ = read_everywhere("llama3", text)
    assert calls == [("say", {"text": 'a } " { \\ ] [', "n": -1500.0})]


# --- Mistral --------------------------------------------------------------------------

MISTRAL_V03 = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris, France", '
               '"unit": "celsius"}}]')
MISTRAL_NEMO_PARALLEL = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "Ab3De5Gh7"}, '
    '{"name": "get_time", "arguments": {"zone": "CET"}, "id": "Zz9Yy8Xx7"}]')


def test_mistral_single_and_parallel_calls():
    content, calls, raw = read_everywhere("mistral", MISTRAL_V03)
    assert content == "" and calls == [("get_weather", {"city": "Paris, France",
                                                        "unit": "celsius"})]
    assert re.fullmatch(r"[a-zA-Z0-9]{9}", raw[0][0])
    content, calls, _ = read_everywhere("mistral", MISTRAL_NEMO_PARALLEL)
    assert [c[0] for c in calls] == ["get_weather", "get_time"]
    _, calls, _ = read_everywhere("mistral", MISTRAL_NEMO_PARALLEL, max_calls=1)
    assert [c[0] for c in calls] == ["get_weather"]


def test_mistral_text_before_a_call_and_arguments_as_a_string():
    text = ('Sure, let me check.[TOOL_CALLS][{"name": "get_time", '
            '"arguments": "{\\"zone\\": \\"CET\\"}"}]')
    content, calls, _ = read_everywhere("mistral", text)
    assert content == "Sure, let me check." and calls == [("get_time", {"zone": "CET"})]


def test_mistral_malformed_json_stays_content():
    for text in ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                 '{"name": ]',
                 '[TOOL_CALLS]{"name": "get_weather", "arguments": {}}',   # not an array
                 '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city" "Paris"}}]',
                 '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa'):
        assert whole("mistral", text) == (text, []), text
    # An array cut right after a whole call keeps the call.
    _, calls, _ = read_everywhere("mistral", MISTRAL_V03[:-1])
    assert calls[0][0] == "get_weather"


def test_mistral_empty_or_trailing_comma_arrays_are_not_calls():
    assert whole("mistral", "[TOOL_CALLS][]") == ("[TOOL_CALLS][]", [])
    text = '[TOOL_CALLS][{"name": "f", "arguments": {}}, ]'
    assert whole("mistral", text) == (text, [])


# --- any text -------------------------------------------------------------------------

FRAGMENTS = ['<tool_call>', '</tool_call>', '[TOOL_CALLS]', '<|python_tag|>', '{', '}', '[',
             ']', '"', '\\', ':', ',', ' ', '\n', '"name"', '"arguments"', '"parameters"',
             '"type"', '"f"', '1', 'true', 'null', 'x', '<tool', '{"name": ', '"\\u00e9"',
             '-', '.5', '{"name": "f", "arguments": {"a": [1, "}"]}}']


@pytest.mark.parametrize("family", sorted(FAMILY))
def test_any_text_reads_without_error(family):
    """Random mixes of markers and JSON pieces: reading never raises; a reply without
    calls is its text (whitespace aside); calls' arguments are JSON objects; and a
    stream in which nothing broke says what the whole reply says."""
    import random

    rng = random.Random(family)
    for _ in range(1500):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 30)))
        content, calls = whole(family, text)
        if not calls:
            assert re.sub(r"\s", "", content) == re.sub(r"\s", "", text), text
        for _, _, arguments in calls:
            assert isinstance(json.loads(arguments), dict), text
        parser = toolcalls.CallParser(FAMILY[family], 1 << 30)
        size, events = rng.randint(1, 6), []
        for i in range(0, len(text), size):
            events += parser.feed(text[i:i + size])
        events += parser.close()
        if not parser.broken:
            assert "".join(e[1] for e in events if e[0] == "text") == content, text
