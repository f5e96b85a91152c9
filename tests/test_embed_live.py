"""Embeddings and text completions through a real server on a socket, as clients use
them: the official `openai` package (client.embeddings.create, client.completions.create)
and curl-style raw HTTP, streams read line by line.

The server is `localrt start --foreground` in its own process (conftest's live_server).
The models are generated: a tiny random llama for completions and embeddings (and,
imported a second time, for llama.cpp's embedding mode) and a tiny random BERT. Random weights make
gibberish and meaningless vectors, so the tests check shapes, encodings and that the
same request gives the same answer.
"""

from __future__ import annotations

import base64
import json
import threading
import urllib.request

import numpy as np
import openai
import pytest
from emulators.ggufgen import write_bert_gguf, write_gguf
from support.models import NO_EOS
from support.servers import send

pytestmark = pytest.mark.live

TEXTS = ["the quick brown fox", "jumps over the lazy dog", "a"]


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    return {"llama": write_gguf(root / "llama.gguf"), "bert": write_bert_gguf(root / "bert.gguf")}


@pytest.fixture
def server(live_server, ggufs):
    """The server with `llama` and `bert` imported, and the llama again as `llama-embed`."""
    for model_id, name in (("llama", "llama"), ("llama-embed", "llama"), ("bert", "bert")):
        status, body = send(live_server.url, "POST", "/v1/models/import",
                            {"path": str(ggufs[name]), "id": model_id})
        assert status == 200, body
    return live_server


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        yield client


def api(server, method, path, body=None):
    return send(server.url, method, path, body, timeout=60)


# --- embeddings ----------------------------------------------------------------------


@pytest.mark.parametrize("model", ["bert", "llama-embed"])
def test_openai_embeddings(client, model):
    # The openai package asks for base64 unless told otherwise, and decodes it.
    default = client.embeddings.create(model=model, input=TEXTS)
    floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    assert default.object == "list" and default.model == model
    assert [d.index for d in default.data] == [0, 1, 2]
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]
    assert all(len(d.embedding) == 64 for d in floats.data)
    assert all(abs(np.linalg.norm(d.embedding) - 1) < 1e-5 for d in floats.data)
    assert default.usage.prompt_tokens == default.usage.total_tokens > len(TEXTS)
    one = client.embeddings.create(model=model, input=TEXTS[1], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, floats.data[1].embedding, atol=1e-5)
    short = client.embeddings.create(model=model, input=TEXTS, dimensions=8)
    assert all(len(d.embedding) == 8 for d in short.data)


def test_openai_embedding_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="a")
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="bert", input="word " * 500)  # BERT holds 128
    assert caught.value.body["param"] == "input"
    client.completions.create(model="llama", prompt="a", max_tokens=1)  # now running
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="llama", input=[[1, 99999]])
    assert caught.value.body["param"] == "input"


def test_one_model_embeds_and_completes(server, client):
    """A decoder running for completions embeds too, as it does started in embedding
    mode (`llama-embed`, the same file), and completes after."""
    body = {"model": "llama", "prompt": "Once", "max_tokens": 8, "temperature": 0,
            "logit_bias": NO_EOS}
    text = client.completions.create(**body).choices[0].text
    status, _ = api(server, "POST", "/v1/models/llama-embed/start",
                    {"embedding": True})
    assert status == 200
    reference = client.embeddings.create(model="llama-embed", input=TEXTS,
                                         encoding_format="float")
    got = client.embeddings.create(model="llama", input=TEXTS, encoding_format="float")
    assert [d.embedding for d in got.data] == [d.embedding for d in reference.data]
    assert client.completions.create(**body).choices[0].text == text


def test_embeddings_as_curl_sends_them(server):
    status, body = api(server, "POST", "/v1/embeddings", {"model": "bert", "input": TEXTS[0]})
    assert status == 200, body
    assert body["data"][0]["object"] == "embedding" and len(body["data"][0]["embedding"]) == 64
    status, again = api(server, "POST", "/v1/embeddings",
                        {"model": "bert", "input": [TEXTS[0]], "encoding_format": "base64",
                         "user": "ignored"})
    assert status == 200
    decoded = np.frombuffer(base64.b64decode(again["data"][0]["embedding"]), "<f4")
    assert decoded.tolist() == body["data"][0]["embedding"]
    status, error = api(server, "POST", "/v1/embeddings", {"model": "bert"})
    assert status == 400 and error["error"]["param"] == "input"


def test_embeddings_while_another_model_streams(server, client):
    """A batch of embeddings and a streamed completion on another model share the
    compute lane: both finish, and the stream is what it is alone."""
    body = {"model": "llama", "prompt": "Once", "max_tokens": 64, "temperature": 0,
            "logit_bias": NO_EOS}
    alone = client.completions.create(**body).choices[0].text
    streamed = []

    def stream():
        for chunk in client.completions.create(**body, stream=True):
            streamed.append(chunk.choices[0].text)

    thread = threading.Thread(target=stream)
    thread.start()
    vectors = [client.embeddings.create(model="bert", input=TEXTS * 4) for _ in range(3)]
    thread.join(60)
    assert "".join(streamed) == alone
    assert all(len(v.data) == 12 for v in vectors)


# --- completions ---------------------------------------------------------------------


def test_openai_completions(client):
    reply = client.completions.create(model="llama", prompt="Once upon a time", max_tokens=12,
                                      temperature=0, logit_bias=NO_EOS)
    assert reply.object == "text_completion" and reply.model == "llama"
    [choice] = reply.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert reply.usage.completion_tokens == 12
    echoed = client.completions.create(model="llama", prompt="Once upon a time",
                                       max_tokens=12, temperature=0, logit_bias=NO_EOS,
                                       echo=True)
    assert echoed.choices[0].text == "Once upon a time" + choice.text
    seeded = [client.completions.create(model="llama", prompt="Once", max_tokens=12,
                                        temperature=1.5, seed=7).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="llama", prompt="a", suffix="b")
    assert caught.value.body["param"] == "suffix"
    scored = client.completions.create(model="llama", prompt="a", logprobs=2, max_tokens=3,
                                       temperature=0, logit_bias=NO_EOS)
    assert len(scored.choices[0].logprobs.tokens) == 3  # tests/test_logprobs.py has more


def test_openai_completions_streamed_with_usage(client):
    whole = client.completions.create(model="llama", prompt=["Once", "Hello"], max_tokens=10,
                                      temperature=0, logit_bias=NO_EOS)
    chunks = list(client.completions.create(
        model="llama", prompt=["Once", "Hello"], max_tokens=10, temperature=0,
        logit_bias=NO_EOS, stream=True, stream_options={"include_usage": True}))
    *pieces, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 20
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    for i in (0, 1):
        text = "".join(c.choices[0].text for c in pieces if c.choices[0].index == i)
        assert text == whole.choices[i].text
    assert [c.choices[0].finish_reason for c in pieces if c.choices[0].finish_reason] == \
        ["length", "length"]


def test_a_completion_stream_read_line_by_line(server):
    body = {"model": "llama", "prompt": "Once", "max_tokens": 8, "temperature": 0,
            "logit_bias": NO_EOS, "stream": True}
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        lines = [line.decode("utf-8") for line in resp]
    assert all(line.startswith("data: ") for line in lines[::2]), lines
    assert all(line == "\n" for line in lines[1::2]) and lines[-2] == "data: [DONE]\n"
    chunks = [json.loads(line[6:]) for line in lines[:-2:2]]
    assert all(c["object"] == "text_completion" for c in chunks)
    status, whole = api(server, "POST", "/v1/completions", {**body, "stream": False})
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
