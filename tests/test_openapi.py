"""GET /openapi.json: made from the route table and schemas/, it names every route."""

from __future__ import annotations

import re

from support.apps import call

from localrt.api import ROUTES
from localrt.openapi import TEXT_REPLIES, document_path


def resolve(doc: dict, ref: str):
    """Follow a local $ref ("#/components/...") through the document."""
    assert ref.startswith("#/"), ref
    node = doc
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def refs(node):
    """Every $ref value in a JSON value."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def test_every_route_is_in_the_document(app):
    r = call(app, "GET", "/openapi.json")
    assert r.status == 200
    doc = r.json
    assert doc["openapi"] == "3.1.0" and doc["info"]["title"] == "localrt"
    for route in ROUTES:
        path = document_path(route.pattern)
        operation = doc["paths"][path][route.method.lower()]
        assert operation["summary"] and "default" in operation["responses"]
        if route.schema:
            kind = "multipart/form-data" if route.form is not None else "application/json"
            body = operation["requestBody"]["content"][kind]["schema"]
            assert resolve(doc, body["$ref"])["title"]
        names = re.findall(r"\{(\w+)", route.pattern)
        # The path's parameters, then the query's the route reads (Route.query).
        assert [(p["name"], p["in"]) for p in operation.get("parameters", [])] == \
            [(n, "path") for n in names] + [(q, "query") for q in route.query]
    operations = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(operations) == len(set(operations)) == len(ROUTES)


def test_every_reference_resolves(app):
    doc = call(app, "GET", "/openapi.json").json
    found = list(refs(doc))
    assert "#/components/schemas/model-update/properties/ctx_len" in found
    for ref in found:
        resolve(doc, ref)
    assert not any("$id" in s or "$schema" in s for s in doc["components"]["schemas"].values())


def test_every_json_route_documents_its_reply(app):
    """A 200 reply schema for every route but those whose replies are not JSON."""
    doc = call(app, "GET", "/openapi.json").json
    for route in ROUTES:
        if route.pattern == "/v1/events" or (route.method, route.pattern) in TEXT_REPLIES:
            continue
        assert route.reply, f"{route.method} {route.pattern} names no reply schema"
        path = document_path(route.pattern)
        ok = doc["paths"][path][route.method.lower()]["responses"]["200"]
        ref = ok["content"]["application/json"]["schema"]["$ref"]
        assert resolve(doc, ref), ref
