"""Reranking, as llama.cpp's server serves Jina's and Cohere's API: documents scored
against a query, best first.

`Reranks.create(body)` takes a request that passed schemas/rerank.json
({model, query, documents, top_n, return_documents}) and returns
{model, object, results: [{index, relevance_score, document?}], usage}: each document's
score with the query (localrt.engines.contract's Reranking: gguf-cpp's reranker,
localrt.engines.llama.rerank, reads each pair as llama.cpp's server does), sorted by
score, highest first (ties in the documents' order), cut to `top_n`; with
`return_documents` each result carries its document as Jina and Cohere give it,
{"text": ...}. A remote model's request goes whole to its upstream's /v1/rerank.

The model must be a reranker: its record's capabilities say "rerank" (its GGUF pools by
rank: localrt.models.registry.capabilities), else the request is a 400 naming the
model before anything starts. A reranker that is not running is started with its
stored parameters, as an embeddings request starts an embedding model
(localrt.inference.embeddings, whose path this follows): a request holds one of the
model's turns, and each decode of its pairs is one job on a compute lane.
"""

from __future__ import annotations

from localrt.admission import LIMITS, Disconnected, never
from localrt.engines import contract
from localrt.errors import InvalidField
from localrt.inference.requests import Kind, Local, RequestPath
from localrt.models.registry import capabilities


class Reranks:
    """Turns rerank requests into batches on the scheduler's running rerankers.

    At most `max_requests` are in progress (computing or waiting for their turn) at
    once; past that a request waits in the requests' queue, as an embeddings request
    does (localrt.admission). Untimed: /metrics counts generations only.
    """

    def __init__(self, path: RequestPath, max_requests: int = LIMITS["rerank"]):
        self._path = path
        self.kind = Kind("rerank", "/rerank", max_requests, timed=False, queue=path.queue)
        self.admission = self.kind.admission

    def create(self, body: dict, disconnected: Disconnected = never) -> dict:
        """{"model", "object": "list", "results": [...], "usage"}, best first."""
        return self._path.serve(self.kind, body["model"],
                                lambda local: self._create(local, body),
                                remote=lambda forward: forward(body),
                                disconnected=disconnected)

    def _create(self, local: Local, body: dict) -> dict:
        model_id = local.model_id
        if "rerank" not in capabilities(local.record):  # before anything starts
            raise _not_reranker(model_id)
        documents = body["documents"]
        lease = local.lease(purpose="a rerank request")
        try:
            if not lease.can(contract.Reranking):
                raise _not_reranker(model_id)
            scores, tokens = lease.model.rerank(body["query"], documents, lease.run)
        finally:
            lease.release()
        # Best first; sorted() is stable, so ties keep the documents' order.
        ranked = sorted(range(len(documents)), key=lambda i: -scores[i])
        top_n = body.get("top_n")
        if top_n is not None:
            ranked = ranked[:int(top_n)]  # JSON Schema counts 2.0 as an integer
        results = []
        for i in ranked:
            result = {"index": i, "relevance_score": scores[i]}
            if body.get("return_documents"):
                result["document"] = {"text": documents[i]}
            results.append(result)
        return {"model": model_id, "object": "list", "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _not_reranker(model_id: str) -> InvalidField:
    """The 400 for a model that scores no documents (a chat or embedding model)."""
    return InvalidField(f"Invalid field 'model': model {model_id} is not a reranker (its "
                        f"GGUF does not pool by rank, as bge-reranker's, jina-reranker's "
                        f"and Qwen3-Reranker's do); rerank with a model whose capabilities "
                        f"list \"rerank\"", param="model")
