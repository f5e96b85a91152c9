"""A local reasoning model's thinking through every dialect, end to end, read by the
clients' own SDKs (issue 34, items 2 and 3): openai (chat and Responses, whole and
streamed), anthropic (ThinkingBlock), ollama (message.thinking, and thinking on
/api/generate); and each dialect's way of turning thinking off.

The model is a scripted GGUF with QwQ's real chat template (support.thinker.write_qwq):
its prompt opens the thinking, so its reply is the thinking "so we" and the answer "ok";
with thinking off, the template closes the thinking in the prompt and it answers "ok".
"""

from __future__ import annotations

import anthropic
import ollama
import openai
import pytest
from support.models import add_model
from support.thinker import write_qwq

pytestmark = pytest.mark.live

ASK = [{"role": "user", "content": "Which is larger, 7 or 9?"}]
THOUGHT, ANSWER = "so we", "ok"


@pytest.fixture(scope="module")
def qwq(tmp_path_factory):
    return write_qwq(tmp_path_factory.mktemp("qwq") / "qwq.gguf")


@pytest.fixture
def url(thread_server, qwq):
    add_model(thread_server.url, qwq, "qwq",
              stored={"temperature": 0, "cpu_threads": 1, "max_tokens": 16})
    return thread_server.url


def test_openai_chat(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    whole = client.chat.completions.create(model="qwq", messages=ASK)
    message = whole.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == THOUGHT
    assert message.model_extra["reasoning"] == THOUGHT
    assert whole.usage.completion_tokens_details.reasoning_tokens == 3  # so, we, </think>
    chunks = list(client.chat.completions.create(model="qwq", messages=ASK, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert "".join((d.model_extra or {}).get("reasoning_content") or ""
                   for d in deltas) == THOUGHT
    off = client.chat.completions.create(model="qwq", messages=ASK, reasoning_effort="none")
    assert off.choices[0].message.content == ANSWER
    assert not off.choices[0].message.model_extra.get("reasoning_content")
    raw = client.chat.completions.create(model="qwq", messages=ASK,
                                         extra_body={"reasoning_format": "none"})
    assert raw.choices[0].message.content == " so we</think> ok"


def test_openai_responses(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    whole = client.responses.create(model="qwq", input=ASK[0]["content"])
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == THOUGHT
    assert whole.output_text == ANSWER
    assert whole.usage.output_tokens_details.reasoning_tokens == 3
    with client.responses.stream(model="qwq", input=ASK[0]["content"]) as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == THOUGHT and final.output_text == ANSWER
    off = client.responses.create(model="qwq", input=ASK[0]["content"],
                                  reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"]


def test_anthropic_messages(url):
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as client:
        whole = client.messages.create(model="qwq", max_tokens=16, messages=ASK)
        assert [b.type for b in whole.content] == ["thinking", "text"]
        assert whole.content[0].thinking == THOUGHT and whole.content[0].signature == ""
        assert whole.content[1].text == ANSWER
        with client.messages.stream(model="qwq", max_tokens=16, messages=ASK) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"]
        assert final.content[0].thinking == THOUGHT
        off = client.messages.create(model="qwq", max_tokens=16, messages=ASK,
                                     thinking={"type": "disabled"})
        assert [b.type for b in off.content] == ["text"] and off.content[0].text == ANSWER
        # A history's thinking block goes back to the template (QwQ's drops it).
        again = client.messages.create(model="qwq", max_tokens=16, messages=[
            *ASK, {"role": "assistant", "content": [
                {"type": "thinking", "thinking": THOUGHT, "signature": ""},
                {"type": "text", "text": ANSWER}]},
            {"role": "user", "content": "And 3 or 2?"}])
        assert again.content[-1].text == ANSWER


def test_ollama(url):
    with ollama.Client(host=url, timeout=60) as client:
        whole = client.chat(model="qwq", messages=ASK)
        assert (whole.message.thinking, whole.message.content) == (THOUGHT, ANSWER)
        parts = list(client.chat(model="qwq", messages=ASK, stream=True))
        assert "".join(p.message.thinking or "" for p in parts) == THOUGHT
        assert "".join(p.message.content or "" for p in parts) == ANSWER
        off = client.chat(model="qwq", messages=ASK, think=False)
        assert (off.message.thinking or "", off.message.content) == ("", ANSWER)
        generated = client.generate(model="qwq", prompt=ASK[0]["content"])
        assert (generated.thinking, generated.response) == (THOUGHT, ANSWER)
        shown = client.show("qwq")
        assert "thinking" in shown.capabilities
