"""What the fuzzers (tests/test_fuzz.py, tests/bench/hostile_mix.py) generate Ollama's
model routes from: the field of each route's schema that must hold something for the
request to reach the model, made required, and what it must be beyond its schema
(not empty)."""

from __future__ import annotations

GENERATES = [
    ("ollama-chat", "messages", {"type": "array", "minItems": 1, "maxItems": 8}),
    ("ollama-generate", "prompt", {"type": "string", "minLength": 1, "maxLength": 500}),
    ("ollama-embed", "input", {"anyOf": [
        {"type": "string", "minLength": 1, "maxLength": 500},
        {"type": "array", "minItems": 1, "maxItems": 8,
         "items": {"type": "string", "maxLength": 500}}]}),
]
