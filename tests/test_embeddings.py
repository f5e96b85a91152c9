"""POST /v1/embeddings through the WSGI app, on real llama.cpp.

The models are generated (tests/emulators/ggufgen.py): a tiny random llama (a decoder, pooled by
the mean of its tokens, which chats too), the same llama declaring a pooling type in
its GGUF (an embedding model made of a decoder, as Qwen3-Embedding is), and a tiny
random BERT (an encoder with its own pooling, as BERT and nomic GGUFs have). Random
weights make meaningless vectors, so the tests check shapes, scale, order, encodings,
that the same input always gives the same vector, and that a decoder running for chat
gives the vectors of llama.cpp's embedding mode.
"""

from __future__ import annotations

import base64
import threading

import gguf
import numpy as np
import pytest
from emulators.ggufgen import write_bert_gguf, write_gguf
from support.models import NO_EOS, add_model, tokens_of

from localrt.engines.llama.embedding import embedding_params
from localrt.engines.llama.params import llama_arguments
from localrt.engines.onnx import OnnxEngine

TEXTS = ["the quick brown fox", "jumps over", "the lazy dog", "a"]
N_EMBD = 64


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed")
    return {"decoder": write_gguf(root / "decoder.gguf", seed=7),
            "last": write_gguf(root / "last.gguf", seed=7,
                               pooling_type=gguf.PoolingType.LAST),
            "bert": write_bert_gguf(root / "bert.gguf", pooling_type=gguf.PoolingType.MEAN),
            "bert-cls": write_bert_gguf(root / "bert-cls.gguf",
                                        pooling_type=gguf.PoolingType.CLS)}


@pytest.fixture
def add(api, ggufs):
    """Import one of the generated models under its own name."""
    return lambda name: add_model(api, ggufs[name], name)


def embed(api, model, inputs, **extra):
    r = api("POST", "/v1/embeddings", {"model": model, "input": inputs, **extra})
    assert r.status == 200, r.body
    return r.json


def vectors(reply) -> np.ndarray:
    assert [d["index"] for d in reply["data"]] == list(range(len(reply["data"])))
    assert all(d["object"] == "embedding" for d in reply["data"])
    return np.array([d["embedding"] for d in reply["data"]], dtype=np.float32)


def running(api, model_id):
    rows = {r["id"]: r for r in api("GET", "/v1/models/status").json["data"]}
    return rows.get(model_id)


@pytest.mark.live
def test_a_decoder_embeds_with_mean_pooling_started_on_first_use(api, add):
    add("decoder")
    reply = embed(api, "decoder", "the quick brown fox")
    assert reply["object"] == "list" and reply["model"] == "decoder"
    v = vectors(reply)
    assert v.shape == (1, N_EMBD)
    assert abs(np.linalg.norm(v[0]) - 1) < 1e-5  # unit length, as OpenAI's
    assert reply["usage"]["prompt_tokens"] == reply["usage"]["total_tokens"] > 1
    row = running(api, "decoder")
    assert "embedding" not in row["options"]  # started as a chat would start it
    assert row["slots"] > 1


@pytest.mark.live
def test_usage_counts_the_tokens_read(api, add, ggufs):
    add("decoder")
    reply = embed(api, "decoder", TEXTS)
    expected = sum(len(tokens_of(ggufs["decoder"], t)) for t in TEXTS)
    assert reply["usage"] == {"prompt_tokens": expected, "total_tokens": expected}


@pytest.mark.live
def test_deterministic_and_in_order(api, add):
    add("decoder")
    batch = vectors(embed(api, "decoder", TEXTS))
    assert batch.shape == (len(TEXTS), N_EMBD)
    assert np.array_equal(batch, vectors(embed(api, "decoder", TEXTS)))
    backwards = vectors(embed(api, "decoder", TEXTS[::-1]))
    np.testing.assert_allclose(backwards[::-1], batch, atol=1e-5)
    alone = np.concatenate([vectors(embed(api, "decoder", t)) for t in TEXTS])
    np.testing.assert_allclose(alone, batch, atol=1e-5)
    # different texts, different vectors
    assert min(np.linalg.norm(batch[i] - batch[j]) for i in range(4) for j in range(i)) > 1e-3


@pytest.mark.live
def test_base64_is_the_float32_bytes_of_the_floats(api, add):
    add("decoder")
    floats = embed(api, "decoder", TEXTS, encoding_format="float")
    b64 = embed(api, "decoder", TEXTS, encoding_format="base64")
    assert b64["usage"] == floats["usage"]
    for f, b in zip(floats["data"], b64["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded.tolist() == np.array(f["embedding"], dtype=np.float32).tolist()


@pytest.mark.live
def test_token_arrays_embed_as_their_text(api, add, ggufs):
    add("decoder")
    tokens = [tokens_of(ggufs["decoder"], t) for t in TEXTS[:2]]
    by_text = vectors(embed(api, "decoder", TEXTS[:2]))
    reply = embed(api, "decoder", tokens)
    np.testing.assert_allclose(vectors(reply), by_text, atol=1e-6)
    assert reply["usage"]["prompt_tokens"] == sum(map(len, tokens))
    one = embed(api, "decoder", tokens[0])  # one token array is one input
    np.testing.assert_allclose(vectors(one), by_text[:1], atol=1e-6)
    floats = embed(api, "decoder", [float(t) for t in tokens[0]])  # JSON Schema: integers
    assert vectors(floats).tolist() == vectors(one).tolist()
    floats = embed(api, "decoder", [[float(t) for t in tokens[0]]])
    assert vectors(floats).tolist() == vectors(one).tolist()


@pytest.mark.parametrize("mode", [{"embedding": True}, {}], ids=["embedding", "chat"])
@pytest.mark.live
def test_an_input_longer_than_the_context_is_a_400_naming_input(api, add, mode):
    add("decoder")
    r = api("POST", "/v1/models/decoder/start", {**mode, "ctx_len": 32, "cpu_threads": 1})
    assert r.status == 200, r.body
    r = api("POST", "/v1/embeddings", {"model": "decoder", "input": ["ok", "word " * 100]})
    assert r.status == 400 and r.json["error"]["param"] == "input"
    assert "input[1]" in r.json["message"] and "ctx_len" in r.json["message"]
    r = api("POST", "/v1/embeddings", {"model": "decoder", "input": list(range(40))})
    assert r.status == 400 and r.json["error"]["param"] == "input"
    r = api("POST", "/v1/embeddings", {"model": "decoder", "input": [[1, 5], [1, 99999]]})
    assert r.status == 400 and r.json["error"]["param"] == "input"
    assert "99999" in r.json["message"]
    assert len(vectors(embed(api, "decoder", ["still", "works"]))) == 2


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["a", 1]}, "input"),
    ({"input": 5}, "input"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({}, "input"),
])
def test_malformed_requests_are_400s(api, add, body, param):
    add("decoder")
    r = api("POST", "/v1/embeddings", {"model": "decoder", **body})
    assert r.status == 400 and r.json["error"]["param"].startswith(param), r.body
    assert running(api, "decoder") is None  # nothing was started


def test_an_unknown_model_is_a_404(api):
    r = api("POST", "/v1/embeddings", {"model": "nope", "input": "a"})
    assert r.status == 404


@pytest.mark.live
def test_dimensions_cut_and_scale_again(api, add):
    add("decoder")
    full = vectors(embed(api, "decoder", TEXTS))
    cut = vectors(embed(api, "decoder", TEXTS, dimensions=16))
    assert cut.shape == (len(TEXTS), 16)
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expected, atol=1e-6)
    r = api("POST", "/v1/embeddings", {"model": "decoder", "input": "a", "dimensions": 65})
    assert r.status == 400 and r.json["error"]["param"] == "dimensions"


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "temperature": 0, "logit_bias": NO_EOS}


def chat(api, model, stream=False):
    r = api("POST", "/v1/chat/completions", {"model": model, **CHAT, "stream": stream})
    assert r.status == 200, r.body
    return r.body if stream else r.json["choices"][0]["message"]["content"]


@pytest.fixture
def reference(api, add, ggufs):
    """The decoder's vectors of TEXTS in llama.cpp's embedding mode (the start option
    `embedding`), under a second id; and the decoder imported for chat."""
    r = api("POST", "/v1/models/import", {"path": str(ggufs["decoder"]), "id": "only-embed"})
    assert r.status == 200, r.body
    r = api("POST", "/v1/models/only-embed/start", {"embedding": True})
    assert r.status == 200, r.body
    add("decoder")
    yield vectors(embed(api, "only-embed", TEXTS))
    assert api("POST", "/v1/models/only-embed/stop").status == 200


@pytest.mark.live
def test_a_model_running_for_chat_embeds_as_its_embedding_mode(api, reference):
    r = api("POST", "/v1/models/decoder/start", {})
    assert r.status == 200
    alone = chat(api, "decoder")
    assert np.array_equal(vectors(embed(api, "decoder", TEXTS)), reference)
    assert chat(api, "decoder") == alone  # the embedding left the chat's cache alone
    assert np.array_equal(vectors(embed(api, "decoder", TEXTS)), reference)
    # Started by an embeddings request, it chats too.
    assert api("POST", "/v1/models/decoder/stop").status == 200
    assert np.array_equal(vectors(embed(api, "decoder", TEXTS)), reference)
    assert chat(api, "decoder") == alone
    assert b'"finish_reason":"length"' in chat(api, "decoder", stream=True).replace(b" ", b"")
    assert running(api, "decoder")["requests"] == 0  # every turn was given back


@pytest.mark.live
def test_chats_and_embeddings_at_once_on_one_model(api, reference):
    """Two streams and two embedders share the model: each gets what it gets alone."""
    alone = chat(api, "decoder")
    out, errors = {}, []

    def run(name, fn):
        try:
            out[name] = [fn() for _ in range(3)]
        except Exception as exc:  # the test fails below, naming it
            errors.append((name, exc))

    jobs = {"chat0": lambda: chat(api, "decoder"), "chat1": lambda: chat(api, "decoder"),
            "embed0": lambda: vectors(embed(api, "decoder", TEXTS)),
            "embed1": lambda: vectors(embed(api, "decoder", TEXTS[::-1]))[::-1]}
    threads = [threading.Thread(target=run, args=item) for item in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(out) == 4, errors
    assert out["chat0"] == out["chat1"] == [alone] * 3
    for got in out["embed0"] + out["embed1"]:
        np.testing.assert_allclose(got, reference, atol=1e-5)
    assert np.array_equal(out["embed0"][0], reference)


@pytest.mark.live
def test_embedding_mode_makes_no_text(api, add):
    add("decoder")
    r = api("POST", "/v1/models/decoder/start", {"embedding": True, "cpu_threads": 1})
    assert r.status == 200 and r.json["options"]["embedding"] is True
    chat = {"model": "decoder", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4}
    for stream in (False, True):
        r = api("POST", "/v1/chat/completions", {**chat, "stream": stream})
        assert r.status == 409 and r.json["error"]["code"] == "embedding_model", r.body
    r = api("POST", "/v1/completions", {"model": "decoder", "prompt": "hi"})
    assert r.status == 409 and r.json["error"]["code"] == "embedding_model"
    embed(api, "decoder", "a")
    assert running(api, "decoder")["requests"] == 0  # every turn was given back


@pytest.mark.parametrize("options", [
    {"ctx_len": 64, "cpu_threads": 1},
    {"ctx_len": 64, "cpu_threads": 2, "flash_attn": True, "cache_type": "f32"},
    {}])
@pytest.mark.live
def test_a_chat_models_embedding_context_is_made_as_the_embedding_mode_makes_it(
        ggufs, options):
    """embedding_params gives, field by field, the context parameters llama_cpp.Llama
    makes for the embedding mode (LlamaEmbedder.open)."""
    import llama_cpp

    arguments, mean = llama_arguments(options), llama_cpp.LLAMA_POOLING_TYPE_MEAN
    llm = llama_cpp.Llama(model_path=str(ggufs["decoder"]), verbose=False, embedding=True,
                          pooling_type=mean,
                          **{**arguments, "n_ctx": 64, "n_batch": 64, "n_ubatch": 64})
    try:
        theirs = llm.context_params
        ours = embedding_params(llama_cpp, arguments, 64, mean)
        compared = 0
        for name, kind in ours._fields_:
            if kind.__name__.startswith(("LP_", "CFunctionType")) or name.endswith("_data"):
                continue  # callbacks and pointers: none set by either
            assert getattr(ours, name) == getattr(theirs, name), name
            compared += 1
        assert compared > 25
    finally:
        llm.close()


@pytest.mark.live
def test_a_bert_model_embeds_with_its_own_pooling(api, add, ggufs):
    add("bert")
    add("bert-cls")
    mean = vectors(embed(api, "bert", TEXTS))
    cls = vectors(embed(api, "bert-cls", TEXTS))
    assert mean.shape == cls.shape == (len(TEXTS), N_EMBD)
    assert np.abs(mean - cls).max() > 1e-3  # same weights, other pooling
    again = np.concatenate([vectors(embed(api, "bert", t)) for t in TEXTS])
    np.testing.assert_allclose(again, mean, atol=1e-5)
    # [CLS] and [SEP] around the word pieces
    reply = embed(api, "bert", "ab")
    assert reply["usage"]["prompt_tokens"] == len(tokens_of(ggufs["bert"], "ab")) >= 3


@pytest.mark.live
def test_an_embedding_model_runs_in_embedding_mode_however_it_starts(api, add):
    add("bert")
    add("last")
    add("decoder")
    for model in ("bert", "last"):
        r = api("POST", f"/v1/models/{model}/start", {"cpu_threads": 1})
        assert r.status == 200, r.body
        assert "embedding" not in r.json["options"]
        assert vectors(embed(api, model, TEXTS)).shape == (len(TEXTS), N_EMBD)
        r = api("POST", "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status == 409 and r.json["error"]["code"] == "embedding_model"
    # The llama declaring last-token pooling pools so, and the plain one by the mean.
    last = vectors(embed(api, "last", TEXTS))
    mean = vectors(embed(api, "decoder", TEXTS))
    assert np.abs(last - mean).max() > 1e-3


def test_onnx_runtime_has_no_embedding_mode():
    assert list(OnnxEngine.check_options({"embedding": True})) == [
        ("embedding", "onnx-runtime cannot compute embeddings; use a GGUF model")]
    assert list(OnnxEngine.check_options({})) == []
