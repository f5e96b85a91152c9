"""JSON Schemas from `schemas/`, and request validation against them.

The files live only in the top-level `schemas/` folder. An installed wheel
carries them as the package data `localrt._schemas` (see setup.cfg); a source
checkout reads the folder itself. jsonschema is imported on first use, so
the CLI never pays for it.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from pathlib import Path

from localrt.errors import SHOWN, InvalidField, shown

_CHECKOUT_DIR = Path(__file__).resolve().parent.parent / "schemas"


def schema_dir():
    """The folder holding the schema files (a Traversable or a Path)."""
    from importlib import resources

    try:
        installed = resources.files("localrt._schemas")
        if installed.joinpath("config.json").is_file():
            return installed
    except ModuleNotFoundError:
        pass
    return _CHECKOUT_DIR


def load(name: str) -> dict:
    """Read one schema file by name, e.g. `config-update.json`."""
    return json.loads(schema_dir().joinpath(name).read_text(encoding="utf-8"))


def names() -> list[str]:
    """The names of every schema file."""
    return sorted(p.name for p in schema_dir().iterdir() if p.name.endswith(".json"))


class Validators:
    """Compiled validators, one per schema file, built on first use.

    `_lock` guards `_compiled`: waitress threads may ask for the same schema at once.
    """

    def __init__(self):
        self._compiled: dict = {}
        self._lock = threading.Lock()

    def validate(self, name: str, instance) -> None:
        """Raise InvalidField naming the first offending field, if `instance` fails `name`."""
        validator = self._validator(name)
        from jsonschema.exceptions import best_match, relevance

        # A field with a wrong value in an allOf'd schema is also "unevaluated": name
        # the field's own error, and an unknown field only when nothing else is wrong.
        error = best_match(validator.iter_errors(instance),
                           key=lambda e: (e.validator != "unevaluatedProperties", relevance(e)))
        if error is not None:
            raise _describe(error)

    def reply_errors(self, reply: str, instance) -> list[str]:
        """How `instance` fails the reply schema `reply` (a replies.json `$defs` name)."""
        validator = self._validator(f"replies.json#/$defs/{reply}")
        return [f"{'/'.join(map(str, e.absolute_path)) or '(body)'}: {e.message}"
                for e in validator.iter_errors(instance)]

    def _validator(self, name: str):
        with self._lock:
            if name not in self._compiled:
                from jsonschema import Draft202012Validator

                # A file, or a reference into one ("replies.json#/$defs/model-list")
                schema = load(name) if "#" not in name else {"$ref": name}
                Draft202012Validator.check_schema(schema)
                self._compiled[name] = _validator_class()(schema, registry=_registry())
            return self._compiled[name]


@functools.lru_cache(maxsize=None)
def _validator_class():
    """Draft 2020-12, but a string longer than its schema's maxLength is not matched
    against its pattern: jsonschema checks every keyword, and maxLength already
    refuses it, so no pattern ever runs over more than the length its field allows."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import ValidationError
    from jsonschema.validators import extend

    def pattern(validator, patrn, instance, schema):
        if not validator.is_type(instance, "string") or \
                len(instance) > schema.get("maxLength", len(instance)):
            return
        if not re.search(patrn, instance):
            yield ValidationError(f"{shown(instance)} does not match {patrn!r}")

    return extend(Draft202012Validator, {"pattern": pattern})


def _registry():
    """Every schema file by its $id, so one can `$ref` another ("model-update.json#/...")."""
    from referencing import Registry, Resource

    return Registry().with_resources(
        (name, Resource.from_contents(load(name))) for name in names())


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
               int: "an integer", float: "a number", type(None): "null"}
_ARTICLES = {"object": "an object", "array": "an array", "integer": "an integer"}


def _field(path) -> str:
    """A field's name from its path (messages[0].content); a long key cut short."""
    out = ""
    for part in path:
        if isinstance(part, str) and len(part) > SHOWN:
            part = part[:SHOWN] + "…"
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _properties(schema: dict) -> set:
    """The property names a schema declares, with those of the files its allOf names."""
    names = set(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        ref = part.get("$ref", "")
        names |= _properties(load(ref) if ref.endswith(".json") else part)
    return names


MESSAGE = 300  # characters of a jsonschema message kept


def _message(error) -> str:
    """jsonschema's message with the bad value cut to a short prefix: it quotes the
    value whole ("'xxx…' is too long"), whatever its size."""
    message, whole = error.message, repr(error.instance)
    if len(whole) > SHOWN:
        message = message.replace(whole, shown(error.instance))
    return message if len(message) <= MESSAGE else message[:MESSAGE] + "…"


def _describe(error) -> InvalidField:
    """Turn a jsonschema error into a message that names the field."""
    path = list(error.absolute_path)
    schema = error.schema if isinstance(error.schema, dict) else {}
    if error.validator in ("additionalProperties", "unevaluatedProperties") and \
            isinstance(error.instance, dict):
        known = _properties(schema)
        extra = sorted(k for k in error.instance if k not in known)
        field = _field(path + extra[:1])
        return InvalidField(f"Unknown field '{field}'", param=field)
    if error.validator == "required" and isinstance(error.instance, dict):
        missing = [k for k in error.validator_value if k not in error.instance]
        field = _field(path + missing[:1])
        return InvalidField(f"Missing required field '{field}'", param=field)
    field = _field(path)
    if error.validator == "type":
        wanted = error.validator_value
        wanted = " or ".join(_ARTICLES.get(kind, kind if kind == "null" else f"a {kind}")
                             for kind in (wanted if isinstance(wanted, list) else [wanted]))
        got = _JSON_TYPES.get(type(error.instance), type(error.instance).__name__)
        detail = f"expected {wanted}, got {got}"
    else:
        detail = schema.get("x-message") or _message(error)
    if not field:
        return InvalidField(f"Invalid request body: {detail}")
    return InvalidField(f"Invalid field '{field}': {detail}", param=field)
