"""Reasoning models (issue 34) on the engines besides llama.cpp: onnx-runtime (the real
onnxruntime-genai, installed from the package index emulator) follows the request's
reasoning plan as gguf-cpp does (the prompt rendered with the template's variables,
the state it leaves the reply in, the budget written into the generator), and a custom
engine that says nothing is taken to have rendered its model's template as it is.
"""

from __future__ import annotations

import json

import pytest
from emulators.chattemplates import template
from emulators.enginepkg import build_wheel
from emulators.onnxgen import write_onnx_model
from test_logprobs import engines_api, install  # noqa: F401 - the fixture, and its helper

USER = [{"role": "user", "content": "Which is larger, 7 or 9?"}]


def chat(api, model, **body):
    r = api("POST", "/v1/chat/completions", {"model": model, "messages": USER,
                                             "temperature": 0, "max_tokens": 16, **body})
    assert r.status == 200, r.body
    return r.json


def streamed(api, model, **body):
    r = api("POST", "/v1/chat/completions", {"model": model, "messages": USER,
                                             "temperature": 0, "max_tokens": 16,
                                             "stream": True, **body})
    assert r.status == 200, r.body
    deltas = [json.loads(line[6:])["choices"][0]["delta"]
              for line in r.body.decode().split("\n\n")
              if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    return ("".join(d.get("reasoning_content") or "" for d in deltas),
            "".join(d.get("content") or "" for d in deltas))


@pytest.mark.live
def test_onnx_runtime_splits_a_prompt_that_opens_the_thinking_and_keeps_a_budget(
        engines_api, tmp_path):
    api = engines_api
    install(api, "/v1/engines/onnx-runtime/install")
    # QwQ's template opens the thinking in the prompt: the reply has no opening tag
    folder = write_onnx_model(tmp_path / "qwq-onnx", chat_template=template("Qwen-QwQ-32B"),
                              added_tokens=["<think>", "</think>", "so", " we", " ok"],
                              script=["so", " we", "</think>", " ok"])
    assert api("POST", "/v1/models/import", {"path": str(folder), "id": "qwq"}).status == 200
    assert api("POST", "/v1/models/qwq/start").status == 200
    assert "reasoning" in api("GET", "/v1/models/qwq").json["capabilities"]

    reply = chat(api, "qwq")
    message, usage = reply["choices"][0]["message"], reply["usage"]
    assert (message["reasoning_content"], message["content"]) == ("so we", "ok")
    assert usage["completion_tokens"] == 4
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 3  # </think> too
    assert streamed(api, "qwq") == ("so we", "ok")
    raw = chat(api, "qwq", reasoning_format="none")["choices"][0]["message"]
    assert raw["content"] == "so we</think> ok"

    # Off by the template's own switch: its prompt ends "</think>", and the model answers
    off = chat(api, "qwq", reasoning_effort="none")
    assert off["choices"][0]["message"]["content"] == "ok"
    assert not off["choices"][0]["message"].get("reasoning_content")
    assert off["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0

    # At the budget localrt appends </think> to the generator; the model answers after it
    for body in ({"thinking_budget_tokens": 1}, {"reasoning_budget_tokens": 1}):
        budget = chat(api, "qwq", **body)
        message, usage = budget["choices"][0]["message"], budget["usage"]
        assert (message["reasoning_content"], message["content"]) == ("so", "ok")
        assert usage["completion_tokens_details"]["reasoning_tokens"] == 1
        assert usage["completion_tokens"] == 3  # so, </think> (localrt's), ok
    assert streamed(api, "qwq", thinking_budget_tokens=2) == ("so we", "ok")
    # max_tokens still bounds the whole reply, the written end marker included
    cut = chat(api, "qwq", thinking_budget_tokens=1, max_tokens=2)
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["usage"]["completion_tokens"] == 2
    # The written end marker has its log-probability: certain
    scored = chat(api, "qwq", thinking_budget_tokens=1, logprobs=True, top_logprobs=1)
    entries = scored["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == ["so", "</think>", " ok"]
    assert entries[1]["logprob"] == 0.0


# A custom engine whose model has QwQ's chat template and answers as a QwQ model does
# after its prompt (no opening tag), without saying where its prompt left the thinking.
QWQ_ENGINE = '''\
"""localrt custom engine "qwq-like": a model that answers with QwQ's thinking, for tests."""

TEMPLATE = %r


class Model:
    chat_template = TEMPLATE

    def chat(self, messages, params, stream=False):
        words = ["so", " we</think>", " ok"]
        if stream:
            return iter(words)
        return {"content": "".join(words), "finish_reason": "stop",
                "usage": {"prompt_tokens": 1, "completion_tokens": len(words)}}

    def unload(self):
        pass


class Engine:
    name, format, description, version = "qwq-like", "GGUF", "QwQ's thinking", "1.0.0"

    def load(self, model_path, options):
        return Model()


ENGINE = Engine()
'''


@pytest.mark.live
def test_a_custom_engine_that_does_not_say_is_split_as_its_template_renders(
        engines_api, tmp_path):
    from emulators.ggufgen import write_gguf

    api = engines_api
    wheel = build_wheel(tmp_path / "dist", "qwq-like-engine", "1.0.0",
                        {"qwq_like_engine/__init__.py": QWQ_ENGINE % template("Qwen-QwQ-32B")},
                        "[localrt.engines]\nqwq-like = qwq_like_engine:ENGINE\n")
    install(api, "/v1/engines/install", {"wheel": str(wheel)})
    model = write_gguf(tmp_path / "tiny.gguf")
    assert api("POST", "/v1/models/import", {"path": str(model), "id": "m"}).status == 200
    r = api("POST", "/v1/models/m/start", {"engine": "qwq-like"})
    assert r.status == 200, r.body

    message = chat(api, "m")["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("so we", "ok")
    assert streamed(api, "m") == ("so we", "ok")
    # It cannot end thinking at a budget: a 400 naming the field, not a budget ignored
    r = api("POST", "/v1/chat/completions", {"model": "m", "messages": USER,
                                             "thinking_budget_tokens": 4})
    assert r.status == 400 and r.json["error"]["param"] == "reasoning_budget", r.body
    assert "cannot end thinking at a budget" in r.json["error"]["message"]
    # With thinking off the budget does not matter
    r = api("POST", "/v1/chat/completions", {"model": "m", "messages": USER,
                                             "thinking_budget_tokens": 4,
                                             "reasoning_effort": "none"})
    assert r.status == 200, r.body
