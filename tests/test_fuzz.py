"""Fuzz every endpoint of a running server from its own GET /openapi.json (schemathesis).

The bar (issue 6): no 5xx, every 4xx carries the error JSON, and every reply
matches the schema the document gives for it. Each operation gets FUZZ_EXAMPLES
generated requests (valid and invalid ones); set LOCALRT_FUZZ_EXAMPLES for a
longer run.

The server is a real `localrt start --foreground` child with its own HOME. Its hub
is the hub emulator and its package index an empty loopback index, so nothing
reaches the internet whatever a generated request asks for.

A generated model id is never a model the server has, so the routes that run a model
(completions, embeddings, responses, Anthropic's messages and count_tokens, and
llama-server's utility routes on a running one) are fuzzed once more against a server
with models, their `model` fixed to one of them in the document: every other field is
generated.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import schemathesis  # a test dependency (setup.cfg's test extra)
from emulators.ggufgen import FIM_TOKENS, write_bert_gguf, write_gguf
from emulators.hubemu import HubEmulator
from hypothesis import HealthCheck, given, settings
from emulators.pkgindex import PackageIndex
from schemathesis import checks
from support.fuzzing import GENERATES
from support.servers import run_foreground_server

from localrt.api import DIALECTS, ROUTES
from localrt.openapi import NDJSON, document_path
from localrt.routing import dialect_of
from localrt.schemas import Validators

pytestmark = [pytest.mark.live, pytest.mark.slow]

FUZZ_EXAMPLES = int(os.environ.get("LOCALRT_FUZZ_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    from localrt import settings as settings_mod

    home = tmp_path_factory.mktemp("fuzz-home")
    weights = write_gguf(tmp_path_factory.mktemp("w") / "tiny.gguf", name="tiny")
    index_dir = tmp_path_factory.mktemp("index")  # an index with no packages
    with HubEmulator() as hub, PackageIndex(index_dir) as index:
        hub.add_repo("org/tiny", {"tiny.gguf": weights})
        settings = settings_mod.load(environ={"HOME": str(home)})
        settings.update({"modelHubUrl": hub.url, "engineIndexUrl": index.url})
        srv = run_foreground_server(home)
        try:
            yield srv
        finally:
            srv.stop(sig=signal.SIGTERM)


BASELINE_CONFIG = {"proxy_url": "", "no_proxy": "localhost,127.0.0.1,::1",
                   "modelhub_token": "", "verify_peer_ssl": True, "verify_host_ssl": True}


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


def _send(api_schema, method, path, body):
    import requests

    base = api_schema.get_base_url()
    requests.request(method, base + path, json=body, timeout=30).raise_for_status()


# DELETE /v1/system stops the server under test, and GET /v1/events never ends
# (it is a stream of events); both have their own tests.
NOT_FUZZED = {("DELETE", "/v1/system"), ("GET", "/v1/events")}
OPERATIONS = sorted({(r.method, document_path(r.pattern))
                     for r in ROUTES} - NOT_FUZZED)
# Invalid requests can only be made where there is something to break: a body
# (any string is a valid path parameter).
BREAKABLE = {(r.method, document_path(r.pattern))
             for r in ROUTES if r.schema}
# A valid POST /v1/models/remote registers upstreams that localrt then probes: random
# host names would be looked up in DNS. Its invalid bodies are fuzzed; valid ones are
# tests/test_remote.py's, on loopback.
ONLY_NEGATIVE = {("POST", "/v1/models/remote")}
CASES = [(m, p, mode) for m, p in OPERATIONS for mode in ("positive", "negative")
         if (mode == "positive" and (m, p) not in ONLY_NEGATIVE) or (m, p) in BREAKABLE]


VALIDATORS = Validators()


def error_json_on_4xx(ctx, response, case):
    """Every 4xx is JSON with the error body: a message, and an error object with a code;
    on a dialect's routes (api.DIALECTS), that API's error body, with a message."""
    if 400 <= response.status_code < 500:
        body = response.json()
        dialect = dialect_of(case.operation.path, DIALECTS)
        if dialect is not None:
            assert not VALIDATORS.reply_errors(dialect.error_reply, body), body
            assert any(isinstance(v, str) and v for v in _strings(body)), body
            return
        assert isinstance(body.get("message"), str) and body["message"], body
        assert isinstance(body.get("error"), dict) and body["error"].get("code"), body


def _strings(body):
    """The string values of an error body, one level down: where its message is."""
    for value in body.values():
        yield from (value.values() if isinstance(value, dict) else [value])


@schemathesis.deserializer(NDJSON)
def _ndjson(ctx, response):
    """A newline-delimited JSON reply as the array of its lines, as the document gives it."""
    return [json.loads(line) for line in response.content.decode("utf-8").splitlines()]


def negative_data_rejection(ctx, response, case):
    """schemathesis' check that a request breaking the schema is refused, with a 413 (a
    body over the route's limit, which a generated list of 2,048 long strings can be:
    it is refused before it is read) counted as refused too."""
    if response.status_code == 413:
        return None
    return checks.negative_data_rejection(ctx, response, case)


CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance,
          negative_data_rejection, error_json_on_4xx]


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {x}" for m, p, x in CASES])
def test_fuzz(api_schema, method, path, mode):
    """FUZZ_EXAMPLES requests that follow the schema (or break it), each checked."""
    operation = api_schema[path][method]
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    calls = []

    @given(case=strategy)
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        calls.append(case)
        try:
            case.call_and_validate(timeout=60, checks=CHECKS)
        finally:
            if (method, path) == ("PATCH", "/v1/configs"):
                # A valid proxy that does not exist makes later pulls fail with a 502,
                # which is right for them, but not what the other operations test.
                _send(api_schema, "PATCH", "/v1/configs", BASELINE_CONFIG)
            if (method, path) == ("POST", "/v1/models/remote"):
                _remove_remote_models(api_schema)

    run()
    assert calls
    print(f"fuzz {method} {path} {mode}: {len(calls)} requests")  # shown with -s



def _remove_remote_models(api_schema):
    """A case generated as negative can still be a valid registration (a full run once
    left the remote model "0"): its upstream never answers, so every later chat or
    response on that id would rightly be a 503, which is not what those operations test."""
    import requests
    from urllib.parse import quote

    base = api_schema.get_base_url()
    for model in requests.get(base + "/v1/models", timeout=30).json()["data"]:
        if model.get("engine") == "remote":
            requests.delete(base + "/v1/models/" + quote(model["id"], safe=""),
                            timeout=30).raise_for_status()


# Routes that run a model, and the model each is fuzzed with (test_fuzz_with_a_model).
WITH_A_MODEL = {"/v1/completions": ("completion", "tiny"), "/v1/embeddings": ("embedding", "bert"),
                "/v1/responses": ("response-create", "tiny"),
                "/v1/messages": ("anthropic-messages", "tiny"),
                "/v1/messages/count_tokens": ("anthropic-count-tokens", "tiny"),
                "/api/chat": ("ollama-chat", "tiny"), "/api/generate": ("ollama-generate", "tiny"),
                "/api/embed": ("ollama-embed", "bert"),
                # llama-server's utility routes read a running model (the fixture starts it)
                "/tokenize": ("tokenize", "tiny"), "/detokenize": ("detokenize", "tiny"),
                "/apply-template": ("apply-template", "tiny")}


@pytest.fixture(scope="module")
def model_schema(tmp_path_factory):
    """The document of a server with a tiny llama (with FIM tokens) and a tiny BERT, each
    route's `model` fixed to one of them, for each generation mode. The llama's ctx_len is 64, so that no reply
    is long and a busy machine answers every request in time."""
    from localrt import openapi

    home = tmp_path_factory.mktemp("fuzz-models-home")
    weights = tmp_path_factory.mktemp("fuzz-models")
    srv = run_foreground_server(home)
    try:
        for model_id, path in (("tiny", write_gguf(weights / "tiny.gguf",
                                                   added_tokens=FIM_TOKENS)),
                               ("bert", write_bert_gguf(weights / "bert.gguf"))):
            _send_to(srv.url, "POST", "/v1/models/import", {"path": str(path), "id": model_id})
        _send_to(srv.url, "PATCH", "/v1/models/tiny", {"ctx_len": 64})
        # The utility routes start no model: each would be a 409 without it running.
        _send_to(srv.url, "POST", "/v1/models/tiny/start", {"cpu_threads": 1})
        schemas = {}
        for mode in ("positive", "negative"):
            doc = openapi.document(ROUTES, DIALECTS)
            components = doc["components"]["schemas"]
            for schema, model_id in WITH_A_MODEL.values():
                components[schema]["properties"]["model"] = {"const": model_id}
            # Ollama's routes only load the model when a request has nothing to generate
            # or embed: the valid requests all have something (invalid ones break the
            # server's own schema).
            for schema, field, shape in GENERATES if mode == "positive" else ():
                components[schema]["required"] = ["model", field]
                components[schema]["properties"][field] = {
                    **components[schema]["properties"][field], **shape}
            schemas[mode] = schemathesis.openapi.from_dict(doc)
            schemas[mode].config.update(base_url=srv.url)
        yield schemas
    finally:
        srv.stop(sig=signal.SIGTERM)


def _send_to(url, method, path, body):
    import requests

    requests.request(method, url + path, json=body, timeout=30).raise_for_status()


@pytest.mark.parametrize("path,mode", [(p, m) for p in WITH_A_MODEL
                                       for m in ("positive", "negative")])
def test_fuzz_with_a_model(model_schema, path, mode):
    """FUZZ_EXAMPLES requests to a route that runs a model, on a real one, each checked."""
    operation = model_schema[mode][path]["POST"]
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    calls = []

    @given(case=strategy)
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        calls.append(case)
        case.call_and_validate(timeout=120, checks=CHECKS)

    run()
    assert calls
