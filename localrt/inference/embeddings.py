"""Embeddings, OpenAI compatible: the request's inputs, the model's mode, the reply.

`Embeddings.create(body)` takes a request that passed schemas/embedding.json and
returns OpenAI's list of embeddings (a remote model's request goes whole to an
upstream's /v1/embeddings: localrt.inference.requests). `input` is a string, an array
of strings, an array of token ids, or an array of such arrays; each is one vector, in
the order given.

The model must be localrt.engines.contract's Embedding (it has embed()). A request for
a model that is not running starts it with its stored parameters, as a chat does. A
GGUF decoder then runs for chat and embeds too, on a context of its own pooled by the
mean of its tokens (localrt.engines.llama.embedding.EmbeddingContext): chats and embeddings
share it in either order, and the vectors are those of llama.cpp's embedding mode,
which the start option `embedding` still gives (a model that only embeds). A GGUF
embedding model (BERT, nomic-bert, ...: its GGUF declares a pooling type) always runs
in embedding mode and pools its own way; a chat with it is a 409 `embedding_model`.
A running model without embed() is a 400 when it is a reranker (its GGUF pools by
rank: localrt.inference.rerank) or its engine has no embedding mode, else
a 409 `model_not_embedding` (a custom engine's model that embeds only when started
with `embedding`). A request holds one of the model's turns, and each decode of its
batch is one job on a compute lane (`Lease.run`), so a batched model's chat steps take
turns with them and wait for one decode at most.

Vectors come scaled to unit length (L2), as OpenAI's do and llama.cpp's server scales
them; `dimensions` keeps the first N numbers and scales again (for Matryoshka models,
as OpenAI's text-embedding-3 do). `encoding_format: "base64"` sends each vector as its
little-endian float32 bytes, as OpenAI does (the openai package asks for that by
default and decodes it). numpy, which llama-cpp-python brings, is imported at the
first request.
"""

from __future__ import annotations

import base64

from localrt.engines import contract
from localrt.errors import Conflict, InvalidField
from localrt.inference.completions import read_prompt
from localrt.admission import LIMITS, Disconnected, never
from localrt.inference.requests import Kind, Local, RequestPath
from localrt.models.registry import capabilities


class ModelNotEmbedding(Conflict):
    """The model runs without embeddings: its engine computes them only in embedding
    mode (the start option `embedding`), and it was started without."""

    code = "model_not_embedding"


class Embeddings:
    """Turns embedding requests into batches on the scheduler's running models.

    At most `max_requests` are in progress (computing or waiting for their turn) at
    once: each holds a server thread (localrt.server). Past that a request waits for a
    place in line, and past the queue it is a 503 (localrt.admission). It takes the one
    path of localrt.inference.requests (untimed: /metrics counts generations only).
    """

    def __init__(self, path: RequestPath, max_requests: int = LIMITS["embedding"]):
        self._path = path
        self.kind = Kind("embedding", "/embeddings", max_requests, timed=False,
                         queue=path.queue)
        self.admission = self.kind.admission

    def create(self, body: dict, disconnected: Disconnected = never) -> dict:
        """OpenAI's {"object": "list", "data": [embedding...], "model", "usage"}."""
        return self._path.serve(self.kind, body["model"],
                                lambda local: self._create(local, body),
                                remote=lambda forward: forward(body),
                                disconnected=disconnected)

    def check_mode(self, model_id: str) -> None:
        """A 400 naming `model` when the model's engine has no embedding mode, before any
        model starts (Ollama's /api/embed starts the model first). A remote model's
        upstream says for itself."""
        record = self._path.registry.get(model_id)
        if not self._path.is_remote(record):
            _refuse_reranker(model_id, record)
            _refuse_without_mode(self._path.engines.check_options(record["engine"],
                                                                  {"embedding": True}))

    def _create(self, local: Local, body: dict) -> dict:
        model_id = local.model_id
        inputs = read_prompt(body["input"])  # the shapes of a completion's prompt
        _refuse_reranker(model_id, local.record)
        _refuse_without_mode(local.check_options({"embedding": True}))
        lease = local.lease(purpose="an embeddings request")
        try:
            if not lease.can(contract.Embedding):
                raise _not_embedding(model_id, lease)
            vectors, tokens = lease.model.embed(inputs, lease.run)
        finally:
            lease.release()
        vectors = scaled(vectors, body.get("dimensions"))
        encode = _base64 if body.get("encoding_format") == "base64" else _floats
        return {"object": "list",
                "data": [{"object": "embedding", "index": i, "embedding": encode(v)}
                         for i, v in enumerate(vectors)],
                "model": model_id,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _refuse_without_mode(problems: list) -> None:
    """A 400 before any model starts, for an engine with no embedding mode."""
    for _, why in problems:
        raise InvalidField(f"Invalid field 'model': {why}", param="model")


def scaled(vectors, dimensions: int | None):
    """The vectors (one per row) cut to `dimensions` and scaled to unit length."""
    import numpy as np

    vectors = np.asarray(vectors, dtype=np.float32)
    if dimensions is not None:
        if dimensions > vectors.shape[1]:  # JSON Schema counts 8.0 as an integer
            raise InvalidField(f"Invalid field 'dimensions': the model's embeddings have "
                               f"{vectors.shape[1]}, fewer than {dimensions}",
                               param="dimensions")
        vectors = vectors[:, :int(dimensions)]
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, np.float32(1e-12))


def _floats(vector) -> list:
    return vector.tolist()


def _base64(vector) -> str:
    return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")


def _refuse_reranker(model_id: str, record: dict) -> None:
    """A 400 before any model starts, for a reranker (its record's capabilities)."""
    if "rerank" in capabilities(record):
        raise _reranker(model_id)


def _reranker(model_id: str) -> InvalidField:
    return InvalidField(f"Invalid field 'model': model {model_id} is a reranker (its GGUF "
                        f"pools by rank): it scores documents against a query at "
                        f"POST /v1/rerank and gives no embeddings", param="model")


def _not_embedding(model_id: str, lease) -> Exception:
    """Why a running model has no embed(): it is a reranker (400), its engine cannot
    compute embeddings (400), or only in the embedding mode it was not started in (409)."""
    if lease.can(contract.Reranking):
        return _reranker(model_id)
    if lease.options.get("embedding"):
        return InvalidField(f"Invalid field 'model': engine {lease.running.engine} cannot "
                            f"compute embeddings", param="model")
    return ModelNotEmbedding(
        f"Model {model_id} is running without embeddings: engine {lease.running.engine} "
        f"computes them only in embedding mode; stop it (`localrt models stop {model_id}`) "
        f"and start it with embedding: true, or import its file again under another id "
        f"to run it both ways", param="model")
