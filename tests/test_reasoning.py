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
