"""A remote model's reasoning reaches every dialect (issue 33, item 2; issue 34, item 2),
what a request asks of the thinking goes upstream with it, and so does a history's
earlier thinking (issue 34, items 3 and 6); OpenAI's route still passes an upstream's
own fields through untouched, the client's controls included.

The upstream is a small OpenAI-compatible server on loopback that answers as vLLM's
reasoning parsers do: the thinking in `reasoning_content` (and, as vLLM's newer
releases and Ollama write it, `reasoning`), then the answer in `content`, with vLLM's
own `stop_reason` and a field localrt does not know (`kv_transfer_params`). No
reasoning model runs here (that is issue 34's work, and vLLM needs a GPU), so it
replays those documented shapes: the chunks a client of vLLM receives.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import ollama
import openai
import pytest

pytestmark = pytest.mark.live  # an upstream server and localrt on real sockets

THINKING = ["The user greets me. ", "I should greet back."]
ANSWER = ["Hello", " there!"]


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):  # the probe: GET /v1/models
        self._json({"object": "list", "data": [{"id": "thinker", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        usage = {"prompt_tokens": 11, "completion_tokens": 9, "total_tokens": 20,
                 "prompt_tokens_details": {"cached_tokens": 4},
                 "completion_tokens_details": {"reasoning_tokens": 5}}
        if not body.get("stream"):
            self._json({"id": "chatcmpl-up", "object": "chat.completion", "created": 1,
                        "model": "thinker", "kv_transfer_params": None, "choices": [{
                            "index": 0, "finish_reason": "stop", "stop_reason": None,
                            "message": {"role": "assistant", "content": "".join(ANSWER),
                                        "reasoning_content": "".join(THINKING)}}],
                        "usage": usage})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        deltas = [{"role": "assistant", "content": ""}]
        deltas += [{"reasoning_content": t} for t in THINKING[:1]]
        deltas += [{"reasoning": t} for t in THINKING[1:]]
        deltas += [{"content": t} for t in ANSWER]
        for delta in deltas:
            self._event({"id": "chatcmpl-up", "object": "chat.completion.chunk",
                         "created": 1, "model": "thinker", "choices": [
                             {"index": 0, "delta": delta, "finish_reason": None}]})
        self._event({"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1,
                     "model": "thinker", "choices": [
                         {"index": 0, "delta": {}, "finish_reason": "stop",
                          "stop_reason": None}]})
        self._event({"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1,
                     "model": "thinker", "choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, data: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
        self.wfile.flush()

    def _json(self, data: dict) -> None:
        raw = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


@pytest.fixture
def upstream():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.bodies = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def url(thread_server, upstream):
    client = openai.OpenAI(base_url=thread_server.url + "/v1", api_key="unused")
    client.post("/models/remote", cast_to=object, body={
        "id": "thinker", "upstreams": [{"url": f"http://127.0.0.1:{upstream.server_port}/v1"}]})
    return thread_server.url


ASK = [{"role": "user", "content": "Hello"}]


def test_openai_passes_the_upstreams_own_fields_through(url, upstream):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    whole = client.chat.completions.create(model="thinker", messages=ASK, n=1)
    assert whole.model_extra["kv_transfer_params"] is None  # vLLM's own field survives
    assert whole.choices[0].message.model_extra["reasoning_content"] == "".join(THINKING)
    streamed = list(client.chat.completions.create(model="thinker", messages=ASK,
                                                   stream=True))
    assert "".join((c.choices[0].delta.model_extra or {}).get("reasoning", "")
                   for c in streamed if c.choices) == THINKING[1]


def test_anthropic_gets_thinking_blocks(url):
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as client:
        whole = client.messages.create(model="thinker", max_tokens=50, messages=ASK)
        assert [b.type for b in whole.content] == ["thinking", "text"]
        assert isinstance(whole.content[0], anthropic.types.ThinkingBlock)
        assert whole.content[0].thinking == "".join(THINKING)
        assert whole.content[0].signature == "" and whole.content[1].text == "".join(ANSWER)
        with client.messages.stream(model="thinker", max_tokens=50, messages=ASK) as stream:
            final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "".join(THINKING)
    assert final.content[1].text == "".join(ANSWER)
    # The upstream's cached tokens are the prompt cache's share, whole and streamed.
    for usage in (whole.usage, final.usage):
        assert (usage.input_tokens, usage.cache_read_input_tokens,
                usage.cache_creation_input_tokens, usage.output_tokens) == (7, 4, 0, 9)


def test_responses_gets_a_reasoning_item(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    whole = client.responses.create(model="thinker", input="Hello")
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "".join(THINKING)
    assert whole.output_text == "".join(ANSWER)
    assert whole.usage.output_tokens_details.reasoning_tokens == 5
    with client.responses.stream(model="thinker", input="Hello") as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "".join(THINKING)
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == "".join(ANSWER)


def test_ollama_gets_thinking(url):
    with ollama.Client(host=url, timeout=60) as client:
        whole = client.chat(model="thinker", messages=ASK, stream=False)
        assert whole.message.thinking == "".join(THINKING)
        assert whole.message.content == "".join(ANSWER)
        parts = list(client.chat(model="thinker", messages=ASK, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == "".join(THINKING)
    assert "".join(p.message.content or "" for p in parts) == "".join(ANSWER)
    assert parts[-1].done and parts[-1].eval_count == 9


def test_openai_passes_the_clients_controls_through(url, upstream):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    history = [*ASK, {"role": "assistant", "content": "Hi", "reasoning_content": "Greet."},
               {"role": "user", "content": "Again"}]
    extra = {"chat_template_kwargs": {"enable_thinking": False}, "thinking_budget_tokens": 9,
             "reasoning_format": "none"}
    client.chat.completions.create(model="thinker", messages=history,
                                   reasoning_effort="low", extra_body=extra)
    sent = upstream.bodies[-1]
    assert sent["reasoning_effort"] == "low" and sent["messages"][1]["reasoning_content"] \
        == "Greet."
    assert {k: sent[k] for k in extra} == extra


def test_responses_writes_reasoning_as_openai_streams_it(url, upstream):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    whole = client.responses.create(model="thinker", input="Hello",
                                    reasoning={"effort": "low", "summary": "auto"})
    assert upstream.bodies[-1]["reasoning_effort"] == "low"
    assert whole.reasoning.effort == "low"  # echoed, as OpenAI does
    item = whole.output[0]
    assert item.summary == [] and item.encrypted_content is None
    assert [c.type for c in item.content] == ["reasoning_text"]
    with client.responses.stream(model="thinker", input="Hello") as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    first = kinds.index("response.reasoning_text.delta")
    # The reasoning item's events, in OpenAI's order, before the message's.
    assert kinds[first - 2:first] == ["response.output_item.added",
                                      "response.content_part.added"]
    done = kinds.index("response.reasoning_text.done")
    assert kinds[first:done] == ["response.reasoning_text.delta"] * 2
    assert kinds[done:done + 3] == ["response.reasoning_text.done",
                                    "response.content_part.done",
                                    "response.output_item.done"]
    assert kinds[done + 3] == "response.output_item.added"  # then the message
    assert events[first - 1].part.type == "reasoning_text"
    assert events[done].text == "".join(THINKING)
    assert events[done + 2].item.type == "reasoning"
    assert events[done + 2].item.content[0].text == "".join(THINKING)
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == 5


def test_responses_gives_reasoning_items_back(url, upstream):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    first = client.responses.create(model="thinker", input="Hello", store=True)
    client.responses.create(model="thinker", input="Again", previous_response_id=first.id)
    turn = upstream.bodies[-1]["messages"]
    assert [m["role"] for m in turn] == ["user", "assistant", "user"]
    assert turn[1]["reasoning_content"] == turn[1]["reasoning"] == "".join(THINKING)
    # The same items as input: the reasoning item goes to the assistant message after it.
    client.responses.create(model="thinker", reasoning={"effort": "none"}, input=[
        {"role": "user", "content": "Hello"},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "Again"}])
    sent = upstream.bodies[-1]
    assert sent["messages"][1]["reasoning_content"] == "".join(THINKING)
    assert sent["reasoning_effort"] == "none"


def test_anthropic_streams_a_signature_after_the_thinking(url, upstream):
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as client:
        events = list(client.messages.create(
            model="thinker", max_tokens=50, messages=ASK, stream=True,
            thinking={"type": "enabled", "budget_tokens": 7}))
        assert upstream.bodies[-1]["thinking_budget_tokens"] == 7
        assert "reasoning_effort" not in upstream.bodies[-1]
        client.messages.create(model="thinker", max_tokens=50, messages=[
            *ASK, {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Greet.", "signature": ""},
                {"type": "text", "text": "Hi"}]},
            {"role": "user", "content": "Again"}], thinking={"type": "disabled"})
    sent = upstream.bodies[-1]
    assert sent["reasoning_effort"] == "none"
    assert sent["messages"][1] == {"role": "assistant", "content": "Hi",
                                   "reasoning_content": "Greet.", "reasoning": "Greet."}
    thinking = [e for e in events if getattr(e, "index", None) == 0]
    assert thinking[0].type == "content_block_start"
    assert thinking[0].content_block.type == "thinking"
    deltas = [e.delta.type for e in thinking[1:-1]]
    assert deltas == ["thinking_delta"] * 2 + ["signature_delta"]
    assert thinking[-2].delta.signature == "" and thinking[-1].type == "content_block_stop"


def test_ollama_think_and_thinking_go_upstream(url, upstream):
    with ollama.Client(host=url, timeout=60) as client:
        client.chat(model="thinker", messages=ASK, think=False)
        assert upstream.bodies[-1]["reasoning_effort"] == "none"
        client.chat(model="thinker", think="high", messages=[
            *ASK, {"role": "assistant", "content": "Hi", "thinking": "Greet."},
            {"role": "user", "content": "Again"}])
        sent = upstream.bodies[-1]
        assert sent["reasoning_effort"] == "high"
        assert sent["messages"][1]["reasoning_content"] == "Greet."
        client.chat(model="thinker", messages=ASK, think=True)
        assert "reasoning_effort" not in upstream.bodies[-1]  # on: the upstream's default
        whole = client.generate(model="thinker", prompt="Hello", think=True)
        parts = list(client.generate(model="thinker", prompt="Hello", stream=True))
    assert whole.thinking == "".join(THINKING) and whole.response == "".join(ANSWER)
    assert "".join(p.thinking or "" for p in parts) == "".join(THINKING)
    assert "".join(p.response or "" for p in parts) == "".join(ANSWER)
