"""JSON replies for gguf-cpp: the GBNF grammar of a response_format, converted once.

llama.cpp constrains a reply with a GBNF grammar: llama-cpp-python's generic JSON one
for {"type": "json_object"}, or one converted from the JSON Schema of
{"type": "json_schema", "schema"}. A request checks it before it waits for its model
(GgufEngine.check_request) and uses it after (LlamaModel's sampler), so conversions
are cached. llama_cpp is imported only when one is needed.
"""

from __future__ import annotations

import functools
import json

from localrt.errors import InvalidField


def json_grammar(response_format: dict | None) -> str | None:
    """The GBNF grammar gguf-cpp constrains a JSON reply with; a 400 for a schema it cannot
    turn into one. Checked before a request waits for its model, too."""
    kind = (response_format or {}).get("type")
    if kind not in ("json_object", "json_schema"):
        return None
    from llama_cpp.llama_grammar import JSON_GBNF

    schema = response_format.get("schema")
    if schema is None:
        return JSON_GBNF
    try:
        return _schema_grammar(json.dumps(schema, sort_keys=True))
    except Exception as exc:  # the converter raises bare Exceptions for what it cannot do
        raise InvalidField(f"Invalid field 'response_format': the JSON Schema cannot be "
                           f"turned into a grammar: {exc}", param="response_format") from None


@functools.lru_cache(maxsize=64)
def _schema_grammar(schema_json: str) -> str:
    """The grammar of a JSON Schema, converted once: a request checks it before it waits
    for its model and uses it after, and clients send the same schema again and again."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    return json_schema_to_gbnf(schema_json)
