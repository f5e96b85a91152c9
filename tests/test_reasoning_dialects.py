"""Each dialect reads what a client asks of a reasoning model's thinking into the native
request, gives an earlier turn's thinking back (Message.reasoning), and writes a reply's
Reasoning events in its own fields (issue 34, items 2, 3 and 6).

The readers are pure functions: their native Request is checked. The writers are fed
a reply's native events, as a reasoning model's reply makes them, and what they write
is read by the clients' own SDKs (openai, anthropic, ollama) and checked against the
reply schemas GET /openapi.json documents (schemas/replies.json). Through the app, the
request schemas refuse what no dialect takes, and Ollama's `think` on a model that does
not reason is Ollama's 400. tests/test_remote_reasoning.py drives the same writers
through a live server and the SDKs' HTTP clients, with a remote model's reasoning.
"""

from __future__ import annotations

import json

import anthropic
import ollama
import openai
import pydantic
import pytest

from localrt import native
from localrt.dialects import anthropic as messages_dialect
from localrt.dialects import common
from localrt.dialects import ollama as ollama_dialect
from localrt.dialects import ollama_models
from localrt.dialects import openai as openai_dialect
from localrt.dialects import responses
from localrt.errors import InvalidField
from localrt.schemas import Validators

VALIDATORS = Validators()
THINKING = ["The user greets me. ", "I should greet back."]
ANSWER = ["Hello", " there!"]
USAGE = native.Usage(prompt_tokens=11, completion_tokens=9, reasoning_tokens=5)
ASK = [{"role": "user", "content": "Hello"}]


def reply() -> native.Reply:
    """A reasoning model's reply, as its events come: the thinking, then the answer."""
    return native.Reply([*map(native.Reasoning, THINKING), *map(native.Text, ANSWER),
                         native.Finish("stop"), USAGE])


def valid(reply_schema: str, instance) -> None:
    errors = VALIDATORS.reply_errors(reply_schema, instance)
    assert not errors, (errors, instance)


# --- OpenAI chat ------------------------------------------------------------------------


def chat(**body) -> native.Request:
    return openai_dialect.read_chat({"model": "m", "messages": ASK, **body})


@pytest.mark.parametrize("body, think, effort", [
    ({}, None, None),
    ({"reasoning_effort": "none"}, False, None),
    ({"reasoning_effort": "high"}, True, "high"),
    ({"reasoning_effort": "minimal"}, True, "minimal"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, False, None),
    ({"chat_template_kwargs": {"enable_thinking": True}}, True, None),
    # As llama-server reads them: "none" wins over enable_thinking, and enable_thinking
    # false over a level.
    ({"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "none"},
     False, None),
    ({"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "max"},
     False, "max")])
def test_openai_reasoning_effort_turns_thinking_on_and_off(body, think, effort):
    request = chat(**body)
    assert (request.think, request.effort) == (think, effort)


def test_openai_reads_the_format_the_budget_and_the_template_kwargs():
    request = chat(reasoning_format="none", thinking_budget_tokens=64,
                   chat_template_kwargs={"enable_thinking": True, "custom": [1]})
    assert request.reasoning_format == "none" and request.reasoning_budget == 64
    assert request.template_kwargs == {"enable_thinking": True, "custom": [1]}
    assert chat(reasoning_format="deepseek").reasoning_format is None  # parsed, as default
    assert chat().reasoning_budget is None and chat().template_kwargs == {}
    # reasoning_budget_tokens wins over thinking_budget_tokens; -1 is no budget asked.
    assert chat(reasoning_budget_tokens=0, thinking_budget_tokens=9).reasoning_budget == 0
    assert chat(thinking_budget_tokens=-1).reasoning_budget is None


def test_openai_gives_an_assistants_reasoning_back():
    request = chat(messages=[
        {"role": "user", "content": "Hi", "reasoning_content": "not a user's"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "Greet."},
        {"role": "user", "content": "Sum?"},
        {"role": "assistant", "content": None, "reasoning": "Call the tool.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}])
    assert [m.reasoning for m in request.messages] == ["", "Greet.", "", "Call the tool.",
                                                       ""]


def test_openai_writes_reasoning_content_and_reasoning_whole():
    request = chat()
    body = openai_dialect.chat_completion(native.collect(reply().events()), request)
    valid("chat-completion", body)
    completion = openai.types.chat.ChatCompletion.model_validate(body)
    message = completion.choices[0].message
    assert message.content == "".join(ANSWER)
    assert message.model_extra["reasoning_content"] == "".join(THINKING)
    assert message.model_extra["reasoning"] == "".join(THINKING)
    assert completion.usage.completion_tokens_details.reasoning_tokens == 5


def test_openai_writes_reasoning_content_and_reasoning_streamed():
    request = chat(stream=True, stream_options={"include_usage": True})
    chunks = list(openai_dialect.ChatChunks(reply(), request).chunks())
    for chunk in chunks:
        valid("chat-completion-chunk", chunk)
    parsed = [openai.types.chat.ChatCompletionChunk.model_validate(c) for c in chunks]
    deltas = [c.choices[0].delta for c in parsed if c.choices]
    for name in ("reasoning_content", "reasoning"):
        assert [(d.model_extra or {}).get(name) for d in deltas if d.model_extra] == THINKING
    assert "".join(d.content or "" for d in deltas) == "".join(ANSWER)
    assert parsed[-1].usage.completion_tokens_details.reasoning_tokens == 5


# --- the Responses API ------------------------------------------------------------------


def test_responses_reasoning_effort_is_chats():
    def read(**body):
        return responses.read({"model": "m", **body}, [], [{"role": "user",
                                                            "content": "Hi"}])
    assert (read().think, read().effort) == (None, None)
    assert read(reasoning={"effort": "none"}).think is False
    request = read(reasoning={"effort": "low", "summary": "auto",
                              "generate_summary": "concise"})
    assert (request.think, request.effort) == (True, "low")
    assert read(reasoning={"summary": "auto"}).think is None
    shell = responses.response_shell({"model": "m", "reasoning": {"effort": "low"}})
    assert shell["reasoning"] == {"effort": "low", "summary": None}


def test_responses_reasoning_items_go_to_the_assistant_after_them():
    items = [{"role": "user", "content": "Weather?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Ask the tool."}]},
             {"type": "function_call", "call_id": "c1", "name": "weather",
              "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             # OpenAI's own models give a summary and encrypted content, no text.
             {"type": "reasoning", "id": "rs_2", "encrypted_content": "gAAA...",
              "summary": [{"type": "summary_text", "text": "Report it."}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Sunny."}]},
             {"type": "function_call", "call_id": "c2", "name": "weather",
              "arguments": "{}"},
             {"role": "user", "content": "Thanks"},
             {"type": "reasoning", "id": "rs_3", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Nothing follows."}]}]
    out = responses.input_messages(items, "input")
    assert [(m.role, m.reasoning, [c.id for c in m.tool_calls]) for m in out] == [
        ("user", "", []), ("assistant", "Ask the tool.", ["c1"]), ("tool", "", []),
        ("assistant", "Report it.", ["c2"]), ("user", "", [])]


def test_responses_writes_a_reasoning_item_whole_and_streamed():
    body = {"model": "m", "input": "Hello", "stream": True}
    shell = responses.response_shell(body)
    whole = responses.finished(shell, *responses.output_of(native.collect(reply().events())))
    valid("response", whole)
    parsed = openai.types.responses.Response.model_validate(whole)
    assert [i.type for i in parsed.output] == ["reasoning", "message"]
    item = parsed.output[0]
    assert item.content[0].text == "".join(THINKING) and item.encrypted_content is None
    assert whole["output"][0]["summary"] == [] and "encrypted_content" in whole["output"][0]
    assert parsed.usage.output_tokens_details.reasoning_tokens == 5

    events = [data for _, data in responses.ResponseStream(reply(), shell, []).named()]
    stream_event = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
    for event in events:
        valid("response-event", event)
        stream_event.validate_python(event)
    assert [e["type"] for e in events][:9] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done"]
    assert events[3]["part"] == {"type": "reasoning_text", "text": ""}
    assert events[2]["item"]["content"] == []  # the part comes in its own event
    assert events[8]["item"]["content"] == [{"type": "reasoning_text",
                                             "text": "".join(THINKING)}]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_responses_a_reply_cut_while_thinking_is_incomplete_with_its_thinking():
    cut = native.Reply([native.Reasoning("Let me"), native.Finish("length"), USAGE])
    shell = responses.response_shell({"model": "m", "input": "Hello"})
    events = [data for _, data in responses.ResponseStream(cut, shell, []).named()]
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["output"][0]["content"][0]["text"] == "Let me"
    assert last["response"]["output"][0]["status"] == "incomplete"


# --- Anthropic --------------------------------------------------------------------------


def messages(**body) -> native.Request:
    return messages_dialect.read({"model": "m", "max_tokens": 50, "messages": ASK, **body})


def test_anthropic_thinking_turns_thinking_on_off_and_to_the_models_default():
    enabled = messages(thinking={"type": "enabled", "budget_tokens": 1})
    assert (enabled.think, enabled.reasoning_budget) == (True, 1)  # no minimum of 1,024
    disabled = messages(thinking={"type": "disabled"})
    assert (disabled.think, disabled.reasoning_budget) == (False, None)
    for adaptive in (messages(thinking={"type": "adaptive"}), messages()):
        assert (adaptive.think, adaptive.reasoning_budget) == (None, None)
    assert messages(output_config={"effort": "high"}).effort == "high"
    counted = messages_dialect.read_count({"model": "m", "messages": ASK,
                                           "thinking": {"type": "disabled"}})
    assert counted.think is False  # the prompt counted is the one the reply would read


def test_anthropic_gives_thinking_blocks_back_and_leaves_redacted_ones_out():
    request = messages(messages=[
        *ASK, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Greet ", "signature": "sig"},
            {"type": "redacted_thinking", "data": "EmwKAhgB..."},
            {"type": "thinking", "thinking": "back."},
            {"type": "text", "text": "Hi"}]},
        {"role": "user", "content": "Again"}])
    assert [(m.role, m.text, m.reasoning) for m in request.messages] == [
        ("user", "Hello", ""), ("assistant", "Hi", "Greet back."), ("user", "Again", "")]


def test_anthropic_writes_thinking_blocks_whole_and_streamed():
    body = {"model": "m", "max_tokens": 50, "messages": ASK}
    whole = messages_dialect.message(native.collect(reply().events()), body)
    valid("anthropic-message", whole)
    parsed = anthropic.types.Message.model_validate(whole)
    assert isinstance(parsed.content[0], anthropic.types.ThinkingBlock)
    assert parsed.content[0].thinking == "".join(THINKING)
    assert parsed.content[0].signature == "" and parsed.content[1].text == "".join(ANSWER)

    events = list(messages_dialect.MessageStream(reply(), body).events())
    stream_event = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    for event in events:
        valid("anthropic-stream-event", event)
        if event["type"] != "ping":  # the SDK reads pings apart
            stream_event.validate_python(event)
    block = [e for e in events if e.get("index") == 0]
    assert block[0]["content_block"] == {"type": "thinking", "thinking": "",
                                         "signature": ""}
    assert [e["delta"] for e in block[1:-1]] == [
        *({"type": "thinking_delta", "thinking": t} for t in THINKING),
        {"type": "signature_delta", "signature": ""}]
    assert block[-1] == {"type": "content_block_stop", "index": 0}
    assert [e["content_block"]["type"] for e in events
            if e["type"] == "content_block_start"] == ["thinking", "text"]


# --- Ollama -----------------------------------------------------------------------------


PLAIN = {"id": "tiny", "metadata": {}}  # a model record whose capabilities are only chat


@pytest.mark.parametrize("think, fields", [
    (None, {}), (False, {"think": False}), (True, {"think": True}),
    ("low", {"think": True, "effort": "low"})])
def test_ollama_think_asks_a_remote_models_upstream_as_it_is(think, fields):
    assert ollama_dialect.think({"model": "thinker", "think": think}, PLAIN,
                                remote=True) == fields


def test_ollama_think_on_a_model_that_does_not_reason_is_a_400():
    assert ollama_dialect.think({"model": "tiny", "think": False}, PLAIN) == {"think": False}
    for value in (True, "high"):
        with pytest.raises(InvalidField) as refused:
            ollama_dialect.think({"model": "tiny:latest", "think": value}, PLAIN)
        assert refused.value.param == "think"
        assert '"tiny:latest" does not support thinking' in refused.value.message


def test_ollama_gives_a_messages_thinking_back():
    out = ollama_dialect.messages([*ASK, {"role": "assistant", "content": "Hi",
                                          "thinking": "Greet."},
                                   {"role": "user", "content": "Again", "thinking": "x"}])
    assert [m.reasoning for m in out] == ["", "Greet.", ""]
    request = ollama_dialect.chat_request("m", {"messages": ASK}, {"think": False})
    assert request.think is False
    generate = ollama_dialect.generate_request("m", {"prompt": "Hi"}, PLAIN,
                                               {"think": True, "effort": "high"})
    assert (generate.think, generate.effort) == (True, "high")


def test_ollama_show_says_thinking_for_a_reasoning_model():
    assert "thinking" in ollama_models.capabilities({}, "", ["chat", "reasoning"])
    assert "thinking" not in ollama_models.capabilities({}, "", ["chat"])


@pytest.mark.parametrize("chat", [True, False])
def test_ollama_writes_thinking_whole_and_streamed(chat):
    kind, field = ("ollama-chat", "message.thinking") if chat else \
        ("ollama-generate", "thinking")
    model = ollama.ChatResponse if chat else ollama.GenerateResponse

    def thinking(parsed):
        return parsed.message.thinking if chat else parsed.thinking

    translation = ollama_dialect.Translation("m", ollama_dialect.Timer(), chat)
    whole = translation.whole(reply().events())
    valid(kind, whole)
    assert thinking(model.model_validate(whole)) == "".join(THINKING), field
    lines = list(ollama_dialect.Translation("m", ollama_dialect.Timer(), chat)
                 .objects(reply().events()))
    for line in lines:
        valid(kind, line)
    parsed = [model.model_validate(line) for line in lines]
    assert [thinking(p) for p in parsed if thinking(p)] == THINKING


# --- the shared reading, and the schemas through the app --------------------------------


def test_common_thinking_and_budget():
    assert common.thinking() == {} and common.thinking(None, {"other": 1}) == {}
    assert common.budget({}) is None
    assert common.budget({"thinking_budget_tokens": 0}) == 0


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"model": "m", "messages": ASK, "reasoning_effort": "huge"},
     "reasoning_effort"),
    ("/v1/chat/completions", {"model": "m", "messages": ASK, "reasoning_format": "html"},
     "reasoning_format"),
    ("/v1/chat/completions", {"model": "m", "messages": ASK,
                              "chat_template_kwargs": {"enable_thinking": "yes"}},
     "chat_template_kwargs.enable_thinking"),
    ("/v1/chat/completions", {"model": "m", "messages": ASK,
                              "thinking_budget_tokens": -2}, "thinking_budget_tokens"),
    ("/v1/responses", {"model": "m", "input": "Hi", "reasoning": {"effort": "huge"}},
     "reasoning.effort"),
    ("/v1/messages", {"model": "m", "max_tokens": 9, "messages": ASK,
                      "thinking": {"type": "enabled"}}, "thinking"),
    ("/v1/messages", {"model": "m", "max_tokens": 9, "messages": ASK,
                      "thinking": {"type": "enabled", "budget_tokens": 0}},
     "thinking.budget_tokens"),
    ("/api/chat", {"model": "m", "messages": ASK, "think": "max"}, "think"),
    ("/api/generate", {"model": "m", "prompt": "Hi", "think": "max"}, "think")])
def test_the_schemas_refuse_what_no_dialect_takes(api, path, body, param):
    r = api("POST", path, body)
    assert r.status == 400, r.body
    assert param in json.dumps(r.json), r.json


def test_ollama_think_on_a_local_model_that_does_not_reason(api, tiny):
    refused = api("POST", "/api/chat", {"model": tiny, "messages": ASK, "think": True})
    assert refused.status == 400
    assert refused.json == {"error": "Invalid field 'think': \"tiny\" does not support "
                                     "thinking"}
    refused = api("POST", "/api/generate", {"model": tiny, "prompt": "Hi", "think": "low"})
    assert refused.status == 400 and "think" in refused.json["error"]
