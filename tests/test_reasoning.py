"""Reasoning models (issue 34), the engine's half: markers found from real chat
templates (llama.cpp's models/templates/), the reply split into thinking and answer as
it streams, thinking turned off the template's own way, a budget that ends thinking at
exactly N tokens, and a structured reply that parses after the thinking; through the
native chat (Chats.create's events) and the OpenAI chat route, on tiny llama.cpp
models whose replies are scripted.
"""

from __future__ import annotations

import json

import pytest

from emulators.chattemplates import template
from localrt.engines import reasoning
from localrt.engines.chattemplate import ChatTemplate

USER = [{"role": "user", "content": "Which is larger, 7 or 9?"}]


def render(name: str, **kwargs) -> str:
    return ChatTemplate(template(name), "</s>", "<s>", 4096).render(USER, kwargs=kwargs)


# --- markers from the template ----------------------------------------------------------

# template, syntax, whether enable_thinking switches it, whether it takes an effort,
# the state its generation prompt leaves the reply in with enable_thinking true.
FAMILIES = [
    ("Qwen-Qwen3-0.6B", "think", True, False, "before"),
    ("Qwen3.5-4B", "think", True, False, "thinking"),
    ("Qwen-QwQ-32B", "think", True, False, "thinking"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "think", True, False, "thinking"),
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "think", False, False, "thinking"),
    ("HuggingFaceTB-SmolLM3-3B", "think", True, False, "before"),
    ("GLM-4.7-Flash", "think", True, False, "thinking"),
    ("mistralai-Ministral-3-14B-Reasoning-2512", "brackets", False, False, "before"),
    ("openai-gpt-oss-120b", "harmony", False, True, "before"),
    ("google-gemma-4-31B-it", "gemma4", True, False, "before"),
]


@pytest.mark.parametrize("name, syntax, switch, effort, state", FAMILIES)
def test_markers_come_from_the_template(name, syntax, switch, effort, state):
    markers = reasoning.markers_of(template(name))
    assert markers is not None
    assert (markers.syntax.name, markers.switch, markers.effort) == (syntax, switch, effort)
    assert reasoning.state_of(markers.syntax, render(name, enable_thinking=True)) == state
    # what an engine that does not say is taken to have rendered (Plan.state)
    assert reasoning.Plan(markers).state == state
    assert reasoning.Plan(markers, think=False).state == reasoning.state_of(
        markers.syntax, render(name, enable_thinking=False))


def test_a_reasoning_models_record_has_the_reasoning_capability():
    from localrt.models.registry import capabilities

    assert capabilities({"metadata": {"chat_template": template("Qwen3.5-4B")}}) == \
        ["chat", "reasoning"]
    assert capabilities({"metadata": {"chat_template": template("Qwen-Qwen2.5-7B-Instruct")}}) \
        == ["chat"]


@pytest.mark.parametrize("name", ["Qwen-Qwen2.5-7B-Instruct",
                                  "meta-llama-Llama-3.1-8B-Instruct"])
def test_a_model_that_does_not_reason_has_no_markers(name):
    assert reasoning.markers_of(template(name)) is None


@pytest.mark.parametrize("name, tail", [
    ("Qwen-Qwen3-0.6B", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ("Qwen3.5-4B", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ("Qwen-QwQ-32B", "<|im_start|>assistant\n<think>\n</think>"),
    ("HuggingFaceTB-SmolLM3-3B", "<|im_start|>assistant\n<think>\n\n</think>\n"),
    ("google-gemma-4-31B-it", "<|turn>model\n<|channel>thought\n<channel|>"),
])
def test_think_false_uses_the_templates_own_switch(name, tail):
    markers = reasoning.markers_of(template(name))
    plan = reasoning.Plan(markers, think=False)
    prompt = render(name, **plan.kwargs())
    assert prompt.endswith(tail)
    assert plan.prepare(prompt) == (prompt, "answer")  # closed by the template: as it is


@pytest.mark.parametrize("name, closing", [
    ("mistralai-Ministral-3-14B-Reasoning-2512", "[/INST][THINK][/THINK]"),
    ("openai-gpt-oss-120b", "<|start|>assistant<|channel|>final<|message|>"),
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "<｜Assistant｜><think>\n</think>"),
])
def test_think_false_without_a_switch_closes_the_thinking_in_the_prompt(name, closing):
    plan = reasoning.Plan(reasoning.markers_of(template(name)), think=False)
    prompt, state = plan.prepare(render(name, **plan.kwargs()))
    assert prompt.endswith(closing) and state == "answer"


def test_a_budget_of_zero_closes_an_opened_prompt():
    plan = reasoning.Plan(reasoning.markers_of(template("Qwen3.5-4B")), budget=0)
    prompt, state = plan.prepare(render("Qwen3.5-4B", **plan.kwargs()))
    assert prompt.endswith("<think>\n</think>") and state == "answer"


@pytest.mark.parametrize("effort, said", [("minimal", "low"), ("low", "low"),
                                          ("medium", "medium"), ("high", "high"),
                                          ("xhigh", "high"), ("max", "high")])
def test_effort_reaches_a_template_that_takes_one(effort, said):
    plan = reasoning.Plan(reasoning.markers_of(template("openai-gpt-oss-120b")), effort=effort)
    assert f"Reasoning: {said}\n" in render("openai-gpt-oss-120b", **plan.kwargs())


def test_template_kwargs_reach_the_template_and_win():
    plan = reasoning.Plan(reasoning.markers_of(template("Qwen-Qwen3-0.6B")), think=True,
                          template_kwargs={"enable_thinking": False})
    assert render("Qwen-Qwen3-0.6B", **plan.kwargs()).endswith("<think>\n\n</think>\n\n")


def test_history_reasoning_reaches_the_template_under_its_name():
    turn = {"role": "assistant", "content": "9.", "reasoning_content": "Nine is more.",
            "thinking": "Nine is more."}
    for name, shown in (("Qwen-Qwen3-0.6B", "<think>\nNine is more.\n</think>\n\n9."),
                        ("openai-gpt-oss-120b",
                         "<|channel|>analysis<|message|>Nine is more.<|end|>")):
        text = ChatTemplate(template(name), "</s>", "<s>", 4096).render(
            USER + [turn], generation=False)
        assert shown in text


def test_a_schemas_grammar_keeps_its_property_order():
    from localrt.engines.llama.grammar import json_grammar

    rules = json_grammar({"type": "json_schema", "schema": {
        "type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}},
        "required": ["b", "a"]}})
    assert 'root ::= "{" space b-kv "," space a-kv "}" space' in rules


def test_an_assistants_reasoning_goes_to_the_template_under_both_names():
    from localrt import native
    from localrt.inference.chat import _message

    turn = native.Message("assistant", [native.Text("9.")], reasoning="Nine is more.")
    out = _message(turn, None)
    assert (out["reasoning_content"], out["thinking"]) == ("Nine is more.",) * 2
    assert "thinking" not in _message(native.Message("assistant", [native.Text("9.")]), None)


# --- splitting the reply ------------------------------------------------------------------

def split(syntax_name: str, state: str, pieces) -> list:
    syntax = next(s for s in reasoning.SYNTAXES if s.name == syntax_name)
    splitter = reasoning.splitter(syntax, state)
    events = []
    for piece in pieces:
        events += splitter.feed(piece)
    events += splitter.close()
    merged = []
    for event in events:  # pieces of one kind, joined
        if merged and merged[-1][0] == event[0] and event[0] in ("reasoning", "answer"):
            merged[-1] = (event[0], merged[-1][1] + event[1])
        else:
            merged.append(event)
    return merged


def every_cut(text: str):
    """The text in two pieces, cut at every place."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)]


@pytest.mark.parametrize("pieces", every_cut("<think>\nSeven is less.\n</think>\n\n9 is."))
def test_a_trace_is_split_wherever_the_pieces_cut_the_markers(pieces):
    assert split("think", "before", pieces) == [("reasoning", "Seven is less."),
                                                ("answer", "9 is.")]


def test_a_prompt_that_opened_thinking_gives_a_reply_without_the_opening_tag():
    assert split("think", "thinking", ["Seven", " is less.\n</", "think>", "9"]) == \
        [("reasoning", "Seven is less."), ("answer", "9")]


def test_a_reply_that_does_not_open_thinking_is_all_answer():
    assert split("think", "before", ["  <thi", "s is text"]) == [("answer", "<this is text")]
    assert split("think", "answer", ["<think>x</think>y"]) == [("answer", "<think>x</think>y")]


def test_a_stream_that_ends_inside_thinking_ends_with_its_thinking():
    assert split("think", "before", ["<think>", "Seven", " is less.\n</thi"]) == \
        [("reasoning", "Seven is less.\n</thi")]


def test_brackets_and_gemma4():
    assert split("brackets", "before", ["[THINK]", "hmm", "[/THINK]", "Nine."]) == \
        [("reasoning", "hmm"), ("answer", "Nine.")]
    assert split("gemma4", "before", ["<|channel>", "thought\nhmm", "<channel|>", "Nine."]) \
        == [("reasoning", "hmm"), ("answer", "Nine.")]


def test_harmony_channels_and_calls():
    text = ("<|channel|>analysis<|message|>Need weather.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather "
            "<|constrain|>json<|message|>{\"city\": \"Oslo\"}")
    events = split("harmony", "before", list(text))
    assert events[0] == ("reasoning", "Need weather.")
    assert events[1][0] == "call" and events[1][1] == 0 and events[1][3] == "get_weather"
    assert "".join(e[2] for e in events[2:]) == '{"city": "Oslo"}'
    assert split("harmony", "before", ["<|channel|>analysis<|message|>a<|end|><|start|>",
                                       "assistant<|channel|>final<|message|>Nine."]) == \
        [("reasoning", "a"), ("answer", "Nine.")]
    assert split("harmony", "before", ["Plain text."]) == [("answer", "Plain text.")]


# --- following the tokens -------------------------------------------------------------------

def test_the_tracker_counts_thinking_and_forces_the_end_at_the_budget():
    texts = ["<think>", "a", "b", "c", "d", "</think>", "x"]
    syntax = reasoning.SYNTAXES[-1]
    tracker = reasoning.Tracker(syntax, "before", 3, lambda t: texts[t].encode(),
                                lambda text: [5])
    assert tracker.step(0) == [] and tracker.step(1) == []
    assert tracker.step(2) == [5]  # <think>, a, b: three tokens
    tracker.forced([5])
    assert tracker.answering and tracker.count == 3
    unbounded = reasoning.Tracker(syntax, "before", None, lambda t: texts[t].encode(), None)
    for token in range(7):
        assert unbounded.step(token) == []
    assert unbounded.count == 6 and unbounded.answering  # the model's own end counts


def test_the_tokens_that_open_the_thinking_before_a_grammars_answer():
    texts = ["<th", "ink>", "<think>", "\n", "{", " <think>", "<", "<|channel|>", "ok",
             "<|start|>", "final"]

    def piece(token):
        return texts[token].encode()

    think, harmony = reasoning.SYNTAXES[-1], reasoning.SYNTAXES[0]
    tracker = reasoning.Tracker(think, "before", None, piece, lambda text: [0, 1])
    # whitespace, the whole marker, or the first of its tokens open it; anything else
    # (another prefix of the marker among them) is the answer
    assert [t for t in range(len(texts)) if not tracker.answers(t)] == [0, 2, 3, 5]
    assert tracker.opening() is None
    tracker.step(3)  # whitespace: still at the start
    assert tracker.opening() is None and not tracker.answers(0)
    tracker.step(0)  # "<th": the model must write "ink>" next
    assert tracker.opening() == 1
    tracker.step(1)
    assert tracker.state == "thinking" and tracker.opening() is None
    # a tokenizer that does not write the marker back: only the whole marker opens it
    odd = reasoning.Tracker(think, "before", None, piece, lambda text: [6, 8])
    assert [t for t in range(len(texts)) if not odd.answers(t)] == [2, 3, 5]
    # harmony: a message's header opens with <|, and is free until its <|message|>
    tracker = reasoning.Tracker(harmony, "before", None, piece, lambda text: [7])
    assert [t for t in range(len(texts)) if not tracker.answers(t)] == [3, 7, 9]
    tracker.step(9)
    assert not tracker.answers(10) and not tracker.answers(8) and tracker.opening() is None


# --- through the native chat, on tiny scripted models --------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
JSON_REPLY = '{"b": 2, "a": 1}'
FORCED = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
# gpt-oss's template reads each tool's description
HARMONY_TOOLS = [{"type": "function", "function": {**TOOLS[0]["function"],
                                                   "description": "The weather in a city."}}]
HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
           "<|constrain|>"]  # harmony's control tokens
HARMONY_CALL = ["▁so", "▁we", "<|end|>", "<|start|>", "assistant", "<|channel|>",
                "commentary", " to=functions.get_weather ", "<|constrain|>", "json<|message|>",
                '{"city": "Oslo"}', "<|call|>"]
HARMONY_FINAL = "<|start|>assistant<|channel|>final<|message|>"  # one token
LONG = ["A1", "B2", "C3", "D4", "E5", "F6"]
# name: (template, added tokens (user-defined), script)
MODELS = {
    # Qwen3: the model opens its thinking; a call inside it is thinking, one after a call
    "qwen3": ("Qwen-Qwen3-0.6B", ["<think>", "</think>", "<tool_call>", "</tool_call>",
                                  CALL, '{"name": "get_weather", ',
                                  '"arguments": {"city": "Paris"}}'],
              ["<think>", "▁so", CALL, "▁we", "▁go", "</think>", "<tool_call>",
               '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "</tool_call>"]),
    # The end marker in two tokens
    "split": ("Qwen-Qwen3-0.6B", ["<think>", "</th", "ink>"],
              ["<think>", "▁so", "▁we", "</th", "ink>", "▁ok"]),
    # QwQ: the prompt opens the thinking; with it off the prompt ends "</think>", after
    # which this script answers at once
    "qwq": ("Qwen-QwQ-32B", ["<think>", "</think>"], ["▁so", "▁we", "</think>", "▁ok"]),
    # A JSON answer after the thinking, its keys out of alphabetical order
    "json": ("Qwen-Qwen3-0.6B", ["<think>", "</think>", JSON_REPLY],
             ["<think>", "▁so", "</think>", JSON_REPLY]),
    # A call a grammar forces, after the thinking
    "forced": ("Qwen-Qwen3-0.6B", ["<think>", "</think>", "<tool_call>\n", FORCED,
                                   "\n</tool_call>"],
               ["<think>", "▁so", "</think>", "<tool_call>\n", FORCED, "\n</tool_call>"]),
    # gpt-oss: harmony's channel tokens are control tokens; this one only analyses
    "harmony": ("openai-gpt-oss-120b", ["analysis", "assistant", "final"],
                ["<|channel|>", "analysis", "<|message|>", "▁so", "▁we", "▁go", "▁on"]),
    # A long thought whose tokens the prompt can hold as they are (drafts copy it)
    "long": ("Qwen-Qwen3-0.6B", ["<think>", "</think>", *LONG],
             ["<think>", *LONG, "</think>"]),
    # gpt-oss's forced call: the analysis (which the prompt opens), then a commentary
    # message to the function; "json<|message|>" is one token, since the <|message|>
    # that ends the prompt leads to the analysis's first token
    "harmony-call": ("openai-gpt-oss-120b", ["assistant", "commentary", HARMONY_CALL[7],
                                             "json<|message|>", HARMONY_CALL[10]],
                     HARMONY_CALL),
    # gpt-oss that answers in the final channel after its analysis
    "harmony-final": ("openai-gpt-oss-120b", ["assistant", "final<|message|>"],
                      ["▁so", "<|end|>", "<|start|>", "assistant", "<|channel|>",
                       "final<|message|>", "▁ok"]),
    # Qwen3 with thinking on: the generation prompt leaves it to the model to open its
    # thinking, and this one answers at once, with text that is no JSON and no call
    "answers": ("Qwen-Qwen3-0.6B", ["<think>", "</think>", "<tool_call>\n",
                                    "\n</tool_call>"], ["▁ok", "▁so"]),
    # SmolLM3: the same, its opening marker in two tokens; the model begins it, then
    # would go on with an answer, then thinks, then answers with JSON
    "smol": ("HuggingFaceTB-SmolLM3-3B", ["<th", "ink>", "</think>", JSON_REPLY],
             ["<th", "▁so", "</think>", JSON_REPLY]),
    # gpt-oss that analyses, then answers with JSON in the final channel
    "harmony-json": ("openai-gpt-oss-120b", ["analysis", HARMONY_FINAL, JSON_REPLY],
                     ["<|channel|>", "analysis", "<|message|>", "▁so", "<|end|>",
                      HARMONY_FINAL, JSON_REPLY]),
    # gpt-oss that answers at once in plain text, no channel
    "harmony-plain": ("openai-gpt-oss-120b", [], ["▁ok", "▁so"]),
}
CONTROL = {"harmony": HARMONY, "harmony-call": HARMONY, "harmony-final": HARMONY,
           "harmony-json": HARMONY, "harmony-plain": HARMONY}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    import gguf

    from emulators.ggufgen import write_gguf

    root = tmp_path_factory.mktemp("reasoning")
    user, control = gguf.TokenType.USER_DEFINED, gguf.TokenType.CONTROL
    return {name: write_gguf(root / f"{name}.gguf", name=name, vocab_size=1600,
                             context_length=2048, chat_template=template(kept),
                             added_tokens=[(t, control) for t in CONTROL.get(name, ())]
                             + [(t, user) for t in added], script=script)
            for name, (kept, added, script) in MODELS.items()}


@pytest.fixture
def chat(app, ggufs):
    """create(model, **request fields) -> the reply's events, the model started."""
    from localrt import native
    from support.apps import bind
    from support.models import add_model

    api = bind(app)
    for name, path in ggufs.items():
        add_model(api, path, name)

    def create(model, text="Which is larger, 7 or 9?", stream=False, **fields):
        fields.setdefault("sampling", {"temperature": 0, "max_tokens": 32})
        request = native.Request(model, [native.Message("user", [native.Text(text)])],
                                 stream=stream, **fields)
        reply = app.services.chats.create(request)
        try:
            return list(reply.events())
        finally:
            reply.close()

    def create_native(request):
        reply = app.services.chats.create(request)
        try:
            return list(reply.events())
        finally:
            reply.close()

    create.api, create.create_native = api, create_native
    return create


def folded(events):
    from localrt import native

    return native.collect(events)


@pytest.mark.live
@pytest.mark.parametrize("stream", [False, True])
def test_thinking_is_apart_and_a_call_inside_it_is_thinking(chat, stream):
    from localrt import native

    events = chat("qwen3", stream=stream, tools=TOOLS)
    whole = folded(events)
    assert whole.reasoning == f"so{CALL} we go"
    assert whole.text == ""
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == \
        [("get_weather", {"city": "Paris"})]
    assert whole.finish == "tool_calls"
    assert whole.usage.reasoning_tokens == 6  # <think>, 4 tokens, the model's </think>
    kinds = [type(e) for e in events if not isinstance(e, (native.Usage, native.Finish))]
    assert kinds.index(native.CallStart) > max(i for i, k in enumerate(kinds)
                                               if k is native.Reasoning)


@pytest.mark.live
@pytest.mark.parametrize("stream", [False, True])
def test_a_marker_split_across_two_tokens(chat, stream):
    whole = folded(chat("split", stream=stream))
    assert (whole.reasoning, whole.text, whole.finish) == ("so we", "ok", "stop")


@pytest.mark.live
def test_reasoning_format_none_leaves_the_reply_as_written(chat):
    whole = folded(chat("split", reasoning_format="none"))
    assert (whole.reasoning, whole.text) == ("", "<think> so we</think> ok")
    assert whole.usage.reasoning_tokens == 5


@pytest.mark.live
@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_cut_while_thinking_ends_with_its_thinking(chat, stream):
    whole = folded(chat("split", stream=stream,
                        sampling={"temperature": 0, "max_tokens": 3}))
    assert (whole.reasoning, whole.text, whole.finish) == ("so we", "", "length")
    assert whole.usage.reasoning_tokens == 3


@pytest.mark.live
def test_a_prompt_that_opens_the_thinking_and_think_false(chat):
    on = folded(chat("qwq"))
    assert (on.reasoning, on.text) == ("so we", "ok")
    off = folded(chat("qwq", think=False))  # the template's "</think>" ends its prompt
    assert (off.reasoning, off.text, off.usage.reasoning_tokens) == ("", "ok", 0)
    stored = folded(chat("qwq", think=None))
    assert stored.reasoning == "so we"


@pytest.mark.live
@pytest.mark.parametrize("budget, thought", [(1, ""), (2, "so"), (3, f"so{CALL}"),
                                             (4, f"so{CALL} we")])
def test_a_budget_ends_the_thinking_at_exactly_n_tokens(chat, budget, thought):
    whole = folded(chat("qwen3", reasoning_budget=budget, tools=TOOLS))
    assert whole.reasoning == thought
    assert whole.usage.reasoning_tokens == budget  # <think> and budget - 1 more
    # localrt wrote </think> (not counted); the model answers from there
    assert [c.name for c in whole.calls] == ["get_weather"]
    assert whole.usage.completion_tokens == budget + 1 + 4


@pytest.mark.live
def test_a_budget_of_zero_and_the_models_default(chat):
    assert folded(chat("qwq", reasoning_budget=0)).reasoning == ""
    api = chat.api
    assert api("PATCH", "/v1/models/qwq", {"reasoning": "off"}).status == 200
    assert folded(chat("qwq")).reasoning == ""
    assert folded(chat("qwq", think=True)).reasoning == "so we"
    assert api("PATCH", "/v1/models/qwq", {"reasoning": "auto",
                                           "reasoning_budget": 1}).status == 200
    whole = folded(chat("qwq"))
    assert (whole.reasoning, whole.text, whole.usage.reasoning_tokens) == ("so", "ok", 1)


@pytest.mark.live
@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_applies_after_the_thinking(chat, stream):
    schema = {"type": "object", "properties": {"b": {"type": "integer"},
                                               "a": {"type": "integer"}},
              "required": ["b", "a"]}
    whole = folded(chat("json", stream=stream, response_format={
        "type": "json_schema", "schema": schema, "name": "pair"}))
    assert whole.reasoning == "so"
    assert json.loads(whole.text) == {"b": 2, "a": 1}


@pytest.mark.live
def test_the_openai_chat_route_no_longer_gives_the_trace_as_content(chat):
    r = chat.api("POST", "/v1/chat/completions", {
        "model": "split", "temperature": 0,
        "messages": [{"role": "user", "content": "Which is larger?"}]})
    assert r.status == 200, r.body
    message = r.json["choices"][0]["message"]
    assert message["content"] == "ok"
    assert message["reasoning_content"] == message["reasoning"] == "so we"
    assert r.json["usage"]["completion_tokens"] == 6
    assert r.json["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5


@pytest.mark.live
def test_the_models_record_says_it_reasons(chat):
    record = chat.api("GET", "/v1/models/qwen3").json
    assert "reasoning" in record["capabilities"]
    listed = {m["id"]: m for m in chat.api("GET", "/v1/models").json["data"]}
    assert "reasoning" in listed["qwen3"]["capabilities"]


@pytest.mark.live
def test_harmony_control_tokens_are_read_and_its_budget_switches_to_final(chat):
    whole = folded(chat("harmony"))  # it never leaves the analysis channel
    assert (whole.reasoning, whole.text) == (" so we go on", "")  # bodies as written
    assert whole.usage.reasoning_tokens == 7  # the channel header's three tokens too
    raw = folded(chat("harmony", reasoning_format="none"))
    assert raw.text == "<|channel|>analysis<|message|> so we go on"
    # at 5 tokens localrt writes <|end|><|start|>assistant<|channel|>final<|message|>,
    # after which this script goes on from its <|message|>, in the final channel
    budget = folded(chat("harmony", reasoning_budget=5))
    assert (budget.reasoning, budget.text, budget.usage.reasoning_tokens) == \
        (" so we", " so we go on", 5)


@pytest.mark.live
def test_the_prompt_cache_covers_the_earlier_turns_as_the_template_renders_them(chat):
    from localrt import native

    first = folded(chat("split"))
    assert (first.reasoning, first.text) == ("so we", "ok")
    # Qwen3's template drops an earlier turn's reasoning
    answer = native.Message("assistant", [native.Text(first.text)], reasoning=first.reasoning)
    messages = [native.Message("user", [native.Text("Which is larger, 7 or 9?")]), answer,
                native.Message("user", [native.Text("And 8 or 3?")])]
    reply = chat.create_native(native.Request("split", messages,
                                              sampling={"temperature": 0}))
    second = folded(reply)
    assert second.usage.cached_tokens >= first.usage.prompt_tokens - 1
    assert (second.reasoning, second.text) == ("so we", "ok")


@pytest.mark.live
@pytest.mark.parametrize("choice", ["required", "function"])
def test_a_forced_call_applies_after_the_thinking(chat, choice):
    whole = folded(chat("forced", tools=TOOLS, tool_choice=choice,
                        tool_function="get_weather" if choice == "function" else None))
    assert whole.reasoning == "so"
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == \
        [("get_weather", {"city": "Oslo"})]
    assert whole.finish == "tool_calls"


@pytest.mark.live
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "function"])
def test_a_forced_harmony_call_applies_after_the_analysis(chat, stream, choice):
    whole = folded(chat("harmony-call", stream=stream, tools=HARMONY_TOOLS,
                        tool_choice=choice,
                        tool_function="get_weather" if choice == "function" else None))
    assert (whole.reasoning, whole.text) == (" so we", "")
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == \
        [("get_weather", {"city": "Oslo"})]
    assert whole.finish == "tool_calls"
    assert whole.usage.reasoning_tokens == 3  # the model's <|end|> counts; the prompt's
    #                                           opening of the analysis does not


@pytest.mark.live
def test_a_forced_harmony_call_with_thinking_off_or_a_budget(chat):
    # off: the prompt is not closed into the final channel; the call comes at once
    off = folded(chat("harmony-call", tools=HARMONY_TOOLS, tool_choice="required",
                      think=False))
    assert (off.reasoning, off.text, off.usage.reasoning_tokens) == ("", "", 0)
    assert [(c.name, json.loads(c.arguments)) for c in off.calls] == \
        [("get_weather", {"city": "Oslo"})]
    # at the budget localrt writes only <|end|>: the call's grammar goes on from there
    budget = folded(chat("harmony-call", tools=HARMONY_TOOLS, tool_choice="required",
                         reasoning_budget=1))
    assert (budget.reasoning, budget.text, budget.usage.reasoning_tokens) == (" so", "", 1)
    assert [c.name for c in budget.calls] == ["get_weather"]
    assert budget.finish == "tool_calls"
    # unforced, the same model's call is read as before: no grammar, the analysis is free
    auto = folded(chat("harmony-call", tools=HARMONY_TOOLS))
    assert [c.name for c in auto.calls] == ["get_weather"]


@pytest.mark.live
def test_a_forced_harmony_call_is_a_call_even_where_the_model_would_answer(chat):
    unit = [{"type": "function", "function": {
        "name": "set_unit", "description": "The unit of temperatures.", "parameters": {
            "type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"]}}}]
    free = folded(chat("harmony-final", tools=unit))  # its prompt's last token: assistant
    assert (free.reasoning, free.text, free.calls) == ("", " ok", [])
    forced = folded(chat("harmony-final", tools=unit, tool_choice="required",
                         sampling={"temperature": 0, "max_tokens": 400}))
    assert forced.reasoning == " so" and forced.text == ""
    assert [c.name for c in forced.calls] == ["set_unit"]
    assert json.loads(forced.calls[0].arguments)["unit"] in ("c", "f")
    assert forced.finish == "tool_calls"


def test_the_harmony_grammar_names_the_forced_functions():
    from localrt.engines import toolcalls

    weather, time = TOOLS[0], {"type": "function", "function": {"name": "get_time"}}
    request = toolcalls.ToolRequest.read([weather, time], "function", "get_time")
    params = request.plan(template("openai-gpt-oss-120b"), own=True).params()
    root = params["grammar"].splitlines()[:3]
    assert '"get_time"' in root[1] and "get_weather" not in "\n".join(root)
    required = toolcalls.ToolRequest.read([weather, time], "required").plan(None, own=True)
    assert all(f'"{n}"' in required.params()["grammar"] for n in ("get_time", "get_weather"))
    assert "grammar" not in toolcalls.ToolRequest.read([weather], "auto").plan(
        None, own=True).params()


@pytest.mark.live
@pytest.mark.parametrize("budget", [1, 3, 6, None])
def test_a_budget_drafts_as_far_as_its_tracker_stays_quiet(chat, budget):
    # the script in the prompt: the drafter proposes what followed there
    fields = {"text": "<think>" + "".join(LONG) + "</think>", "reasoning_budget": budget}
    drafted = folded(chat("long", **fields))
    plain = folded(chat("long", speculative=False, **fields))
    thought = "".join(LONG[:budget - 1] if budget else LONG)
    assert (drafted.reasoning, drafted.text) == (plain.reasoning, plain.text) == (thought, "")
    assert drafted.usage.reasoning_tokens == plain.usage.reasoning_tokens == \
        (budget or len(LONG) + 2)
    assert drafted.usage.completion_tokens == plain.usage.completion_tokens
    assert plain.usage.accepted_prediction_tokens == 0
    if budget in (6, None):  # A1, then a draft of what followed it in the prompt
        assert drafted.usage.accepted_prediction_tokens >= 3


@pytest.mark.live
def test_the_end_marker_localrt_writes_has_its_logprob(chat):
    whole = folded(chat("split", reasoning_budget=2, logprobs=1))  # was an IndexError
    assert (whole.reasoning, whole.text) == ("so", "ok")
    pieces = [e.piece for e in whole.logprobs]
    assert b"".join(pieces) == "<think> so</think> ok".encode()
    written = [e for e in whole.logprobs if e.piece in (b"</th", b"ink>")]
    assert [(e.logprob, len(e.top)) for e in written] == [(0.0, 1), (0.0, 1)]


# --- a reply that may open its thinking, under a grammar -----------------------------------

UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
UNIT_TOOLS = [{"type": "function", "function": {
    "name": "set_unit", "description": "The unit of temperatures.", "parameters": UNIT}}]


@pytest.mark.live
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", ["answers", "harmony-plain"])
def test_a_model_that_answers_at_once_keeps_to_the_schema_from_its_first_token(
        chat, model, stream):
    # Qwen3's and gpt-oss's prompts leave it to the model to open its thinking; these
    # write " ok so" at once: with a schema, that first token must already be the grammar's
    free = folded(chat(model, stream=stream))
    assert (free.reasoning, free.text.split()) == ("", ["ok", "so"])
    whole = folded(chat(model, stream=stream, response_format={
        "type": "json_schema", "schema": UNIT, "name": "unit"},
        sampling={"temperature": 0, "max_tokens": 400}))
    assert (whole.reasoning, whole.usage.reasoning_tokens) == ("", 0)
    assert list(json.loads(whole.text)) == ["unit"]
    assert json.loads(whole.text)["unit"] in ("c", "f")
    assert whole.finish == "stop"


@pytest.mark.live
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "function"])
def test_a_forced_call_from_a_model_that_answers_at_once(chat, stream, choice):
    whole = folded(chat("answers", stream=stream, tools=UNIT_TOOLS, tool_choice=choice,
                        tool_function="set_unit" if choice == "function" else None,
                        sampling={"temperature": 0, "max_tokens": 400}))
    assert (whole.reasoning, whole.text) == ("", "")
    assert [c.name for c in whole.calls] == ["set_unit"]
    assert json.loads(whole.calls[0].arguments)["unit"] in ("c", "f")
    assert whole.finish == "tool_calls"


@pytest.mark.live
@pytest.mark.parametrize("stream", [False, True])
def test_a_model_that_begins_its_opening_marker_thinks_then_answers_by_the_schema(
        chat, stream):
    schema = {"type": "object", "properties": {"b": {"type": "integer"},
                                               "a": {"type": "integer"}},
              "required": ["b", "a"]}
    fields = {"response_format": {"type": "json_schema", "schema": schema, "name": "pair"}}
    # "<think>" is "<th" "ink>" here: once the model wrote "<th", it writes "ink>" (it
    # would have gone on with " so", which would have been an answer the grammar never
    # saw), thinks freely ("<th", " so", which it writes next), and answers by the schema
    whole = folded(chat("smol", stream=stream, **fields))
    assert whole.reasoning == "<th so"
    assert json.loads(whole.text) == {"b": 2, "a": 1}
    assert whole.usage.reasoning_tokens == 5  # <th, ink>, <th, so, </think>
    # gpt-oss analyses, then answers in the final channel: the grammar starts there
    harmony = folded(chat("harmony-json", stream=stream, **fields))
    assert (harmony.reasoning, json.loads(harmony.text)) == (" so", {"b": 2, "a": 1})
    # Qwen3 that opens its thinking with one token: free, as before
    qwen = folded(chat("json", stream=stream, **fields))
    assert (qwen.reasoning, json.loads(qwen.text)) == ("so", {"b": 2, "a": 1})
