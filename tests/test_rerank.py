"""POST /v1/rerank (and /rerank, /v1/reranking) through the WSGI app, on real llama.cpp,
and `localrt rerank` through main([...]) against the app on a real port.

The rerankers are generated (tests/emulators/ggufgen.py's write_bert_gguf with rank
pooling: a tiny random BERT cross-encoder with the classifier llama.cpp's rank pooling
reads, as a converted bge-reranker has): one as llama.cpp's WordPiece vocabularies are
by default (no EOS added: [CLS] query [SEP] document), one that adds EOS ([SEP] too:
[CLS] query [SEP] [SEP] document [SEP], as a RoBERTa reranker's <s> q </s></s> d </s>),
and one with a rerank template in its GGUF (tokenizer.chat_template.rerank). Each
pair's tokens are written out here as llama.cpp's server makes them
(tools/server's format_prompt_rerank), and the scores compared with llama-cpp-python's
own rank embedding of those tokens (llama_cpp.Llama(..., embedding=True,
pooling_type=LLAMA_POOLING_TYPE_RANK).embed). Random weights make meaningless scores,
so the tests check that they are llama.cpp's, their order, top_n, return_documents,
the token counts, and which models may rerank.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from emulators.ggufgen import write_bert_gguf, write_gguf
from support.cli import run
from support.models import add_model, tokens_of

from localrt.cli import ExitCode

RANK = int(gguf.PoolingType.RANK)
CLS, SEP = 2, 3  # write_bert_gguf's [CLS] (its BOS) and [SEP]
QUERY = "the quick brown fox"
DOCS = ["jumps over the lazy dog", "a", "the quick brown fox jumps", "hello world again",
        "fox"]
TEMPLATE = "{document}[SEP]{query}"  # documents first: unlike the default pairing
CONTEXT = 128  # write_bert_gguf's context_length


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rerank")
    return {"rerank": write_bert_gguf(root / "rerank.gguf", pooling_type=RANK, seed=3),
            "rerank-eos": write_bert_gguf(root / "rerank-eos.gguf", pooling_type=RANK,
                                          seed=4, add_eos=True),
            "rerank-template": write_bert_gguf(root / "rerank-template.gguf",
                                               pooling_type=RANK, seed=5,
                                               rerank_template=TEMPLATE),
            "bert": write_bert_gguf(root / "bert.gguf"),
            "chat": write_gguf(root / "chat.gguf")}


@pytest.fixture
def add(api, ggufs):
    """Import one of the generated models under its own name."""
    return lambda name: add_model(api, ggufs[name], name)


def rerank(api, model, query=QUERY, documents=DOCS, path="/v1/rerank", **extra):
    r = api("POST", path, {"model": model, "query": query, "documents": documents, **extra})
    assert r.status == 200, r.body
    return r.json


def pair(path, name: str, query: str, doc: str) -> list[int]:
    """The tokens llama.cpp's server reads for a query and a document of model `name`,
    written out for each of the generated rerankers."""
    q, d = tokens_of(path, query, bos=False), tokens_of(path, doc, bos=False)
    if name == "rerank":  # BOS, the query, SEP (no EOS added), the document
        return [CLS, *q, SEP, *d]
    if name == "rerank-eos":  # EOS is SEP in a vocabulary without one
        return [CLS, *q, SEP, SEP, *d, SEP]
    assert name == "rerank-template"  # the template's text, special tokens as such
    return [*d, SEP, *q]


def reference(path, pairs: list[list[int]]) -> list[float]:
    """llama-cpp-python's own rank embedding of each token list: its first number."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), embedding=True, verbose=False,
                          pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK, n_ctx=CONTEXT,
                          n_batch=CONTEXT, n_ubatch=CONTEXT, n_threads=1)
    try:
        named = {f"pair {i}": tokens for i, tokens in enumerate(pairs)}
        # Llama.embed tokenizes a text; each "text" here is a pair, already tokens
        llm.tokenize = lambda text, add_bos=True, special=False: named[text.decode()]
        return [llm.embed(name)[0] for name in named]
    finally:
        llm.close()


def scores_by_index(reply) -> list[float]:
    found = {r["index"]: r["relevance_score"] for r in reply["results"]}
    return [found[i] for i in range(len(found))]


def running(api, model_id):
    rows = {r["id"]: r for r in api("GET", "/v1/models/status").json["data"]}
    return rows.get(model_id)


@pytest.mark.live
def test_a_reranker_is_a_rerank_model_in_its_capabilities(api, add):
    for name in ("rerank", "bert", "chat"):
        add(name)
    listed = {m["id"]: m["capabilities"] for m in api("GET", "/v1/models").json["data"]}
    assert listed == {"rerank": ["rerank"], "bert": ["embedding"], "chat": ["chat"]}
    record = api("GET", "/v1/models/rerank").json
    assert record["metadata"]["rerank"] is True and record["metadata"]["embedding"] is True
    assert api("GET", "/v1/models/bert").json["metadata"]["rerank"] is False
    assert api("POST", "/api/show", {"name": "rerank"}).json["capabilities"] == ["rerank"]
    assert api("POST", "/api/show", {"name": "bert"}).json["capabilities"] == ["embedding"]


@pytest.mark.parametrize("name", ["rerank", "rerank-eos", "rerank-template"])
@pytest.mark.live
def test_scores_are_llama_cpps_rank_embedding_of_the_pairs(api, add, ggufs, name):
    add(name)
    assert running(api, name) is None
    reply = rerank(api, name)
    assert running(api, name) is not None  # started by the request, as a chat starts one
    assert reply["model"] == name and reply["object"] == "list"
    pairs = [pair(ggufs[name], name, QUERY, doc) for doc in DOCS]
    expected = reference(ggufs[name], pairs)
    got = scores_by_index(reply)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    # The pairs score apart by more than the tolerance, so their order means something.
    assert np.diff(sorted(expected)).min() > 1e-3
    # Best first; the usage is every pair's tokens.
    assert [r["index"] for r in reply["results"]] == sorted(range(len(DOCS)),
                                                           key=lambda i: -expected[i])
    total = sum(map(len, pairs))
    assert reply["usage"] == {"prompt_tokens": total, "total_tokens": total}
    assert all("document" not in r for r in reply["results"])  # return_documents: false


@pytest.mark.live
def test_each_document_scores_the_same_alone_or_in_a_batch_and_every_time(api, add):
    add("rerank")
    batch = scores_by_index(rerank(api, "rerank"))
    assert scores_by_index(rerank(api, "rerank")) == batch
    alone = [rerank(api, "rerank", documents=[doc])["results"][0]["relevance_score"]
             for doc in DOCS]
    np.testing.assert_allclose(alone, batch, rtol=1e-4, atol=1e-4)
    backwards = scores_by_index(rerank(api, "rerank", documents=DOCS[::-1]))
    np.testing.assert_allclose(backwards[::-1], batch, rtol=1e-4, atol=1e-4)


@pytest.mark.live
def test_top_n_and_return_documents(api, add):
    add("rerank")
    everything = rerank(api, "rerank")["results"]
    top = rerank(api, "rerank", top_n=2, return_documents=True)["results"]
    assert [r["index"] for r in top] == [r["index"] for r in everything[:2]]
    assert [r["document"] for r in top] == [{"text": DOCS[r["index"]]} for r in top]
    assert rerank(api, "rerank", top_n=50)["results"] == everything
    assert rerank(api, "rerank", top_n=None, return_documents=False)["results"] == everything
    one = rerank(api, "rerank", top_n=1)
    assert one["results"] == everything[:1]
    assert one["usage"] == rerank(api, "rerank")["usage"]  # every document was read


@pytest.mark.live
def test_the_three_routes_answer_alike(api, add):
    add("rerank")
    replies = [rerank(api, "rerank", path=path, top_n=3)
               for path in ("/v1/rerank", "/rerank", "/v1/reranking")]
    assert replies[0] == replies[1] == replies[2]


@pytest.mark.live
def test_a_model_that_is_not_a_reranker_is_a_400_naming_it(api, add):
    add("chat")
    add("bert")
    for model in ("chat", "bert"):
        r = api("POST", "/v1/rerank", {"model": model, "query": "q", "documents": ["d"]})
        assert r.status == 400, r.body
        error = r.json["error"]
        assert error["param"] == "model" and f"model {model} is not a reranker" in \
            error["message"]
        assert running(api, model) is None  # refused before anything started


@pytest.mark.live
def test_a_reranker_makes_no_text_and_no_embeddings(api, add):
    add("rerank")
    r = api("POST", "/v1/chat/completions", {
        "model": "rerank", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status == 409 and r.json["error"]["code"] == "embedding_model"
    assert "reranker" in r.json["error"]["message"]
    for path, body in (("/v1/embeddings", {"input": "a"}), ("/api/embed", {"input": "a"})):
        r = api("POST", path, {"model": "rerank", **body})
        assert r.status == 400, r.body
        message = r.json["error"] if path.startswith("/api/") else r.json["error"]["message"]
        assert "model rerank is a reranker" in message and "/v1/rerank" in message
    rerank(api, "rerank")  # it still ranks
    assert running(api, "rerank")["requests"] == 0  # every turn was given back


@pytest.mark.live
def test_a_pair_longer_than_the_context_is_a_400_naming_documents(api, add):
    add("rerank")
    r = api("POST", "/v1/models/rerank/start", {"ctx_len": 32, "cpu_threads": 1})
    assert r.status == 200, r.body
    r = api("POST", "/v1/rerank", {"model": "rerank", "query": QUERY,
                                   "documents": ["short", "fox " * 40]})
    assert r.status == 400, r.body
    error = r.json["error"]
    assert error["param"] == "documents" and "documents[1]" in error["message"]
    assert "ctx_len" in error["message"]
    assert running(api, "rerank")["requests"] == 0


@pytest.mark.parametrize("body, param", [
    ({"query": "q"}, "documents"),
    ({"documents": ["d"]}, "query"),
    ({"query": "q", "documents": []}, "documents"),
    ({"query": "q", "documents": ["d", 3]}, "documents"),
    ({"query": 5, "documents": ["d"]}, "query"),
    ({"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
    ({"query": "q", "documents": ["d"], "top_n": "2"}, "top_n"),
    ({"query": "q", "documents": ["d"], "return_documents": "yes"}, "return_documents"),
])
def test_malformed_requests_are_400s(api, body, param):
    r = api("POST", "/v1/rerank", {"model": "anything", **body})
    assert r.status == 400, r.body
    assert r.json["error"]["param"].startswith(param)


def test_an_unknown_model_is_a_404(api):
    r = api("POST", "/v1/rerank", {"model": "nope", "query": "q", "documents": ["d"]})
    assert r.status == 404 and "nope" in r.json["error"]["message"]


# --- localrt rerank ----------------------------------------------------------------------


@pytest.mark.live
def test_the_cli_prints_the_ranking(thread_server, ggufs):
    add_model(thread_server.url, ggufs["rerank"], "reranker")
    add_model(thread_server.url, ggufs["chat"], "chatty")
    code, out, err = run("rerank", "--model", "reranker", QUERY, *DOCS)
    assert code == ExitCode.OK and err == "", err
    lines = [line.split("\t") for line in out.splitlines()]
    assert len(lines) == len(DOCS) and all(len(cells) == 3 for cells in lines)
    scores = [float(score) for score, _, _ in lines]
    assert scores == sorted(scores, reverse=True)
    assert [DOCS[int(index)] for _, index, _ in lines] == [doc for _, _, doc in lines]
    expected = reference(ggufs["rerank"], [pair(ggufs["rerank"], "rerank", QUERY, doc)
                                           for doc in DOCS])
    np.testing.assert_allclose(scores, sorted(expected, reverse=True), atol=1e-4)
    code, out, err = run("rerank", "--model", "reranker", "--top-n", "2", QUERY, *DOCS)
    assert code == ExitCode.OK and out.splitlines() == ["\t".join(c) for c in lines[:2]]
    code, out, err = run("rerank", "--model", "chatty", QUERY, "a document")
    assert code == ExitCode.ERROR and out == ""
    assert "chatty is not a reranker" in err
    code, _, err = run("rerank", QUERY, "a document")  # no --model
    assert code == ExitCode.USAGE
    code, _, err = run("rerank", "--model", "reranker", QUERY)  # no document
    assert code == ExitCode.USAGE
