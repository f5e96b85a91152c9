"""Command-line flags made from the request schemas, and their value types.

The schemas are the one list of what can be set: a property of model-update.json
becomes a `models update` flag, one of model-start.json a `models start` and `run`
flag, one of config-update.json a `config` flag. Each new flag must also be added
to man/localrt.1 (tests/test_man.py checks). The schemas are read as plain JSON,
so jsonschema stays unloaded.
"""

from __future__ import annotations

import argparse
import json

from localrt.errors import shown
from localrt.security import SECRET_FIELDS


def on_off(value: str) -> bool:
    """An on|off (or true|false) flag value."""
    words = {"on": True, "off": False, "true": True, "false": False}
    try:
        return words[value.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}") from None


def port(value: str) -> int:
    """A port number flag value, 0 to 65535."""
    try:
        number = int(value)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {value!r}")
    return number


def positive_int(value: str) -> int:
    """A count flag value, 1 or more."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of 1 or more, got {value!r}")
    return number


def comma_list(value: str) -> list:
    """A comma-separated flag value as a list, blanks dropped ('' is the empty list)."""
    return [part.strip() for part in value.split(",") if part.strip()]


def model_update_options(schema: str = "model-update.json", skip=("id", "upstreams")):
    """(flag, argparse keywords) for each property of a schema: stored model parameters.

    The schema is the one list of parameters: a property added there becomes a
    `models update` (or, in model-start.json, `models start`) flag here, and must be
    added to man/localrt.1; tests/test_man.py checks.
    """
    from localrt import schemas  # plain JSON reading; jsonschema stays unloaded

    for name, spec in schemas.load(schema)["properties"].items():
        # Ids cannot change; start's model id is an argument; a remote model's upstreams
        # are objects, which `models add-remote` sets.
        if name in skip:
            continue
        if "$ref" in spec:  # "model-update.json#/properties/ctx_len"
            target, _, pointer = spec["$ref"].partition("#/properties/")
            spec = schemas.load(target)["properties"][pointer]
        kind = spec.get("type")
        options = {"dest": f"param_{name}", "help": _parameter_help(name, spec)}
        if "enum" in spec:
            options.update(choices=spec["enum"], metavar="VALUE")
        elif kind == "integer":
            options.update(type=int, metavar="N")
        elif kind == "number":
            options.update(type=float, metavar="X")
        elif kind == "boolean":
            options.update(type=on_off, metavar="on|off")
        elif kind == "array":  # of strings: one flag per element
            options.update(action="append", metavar="TEXT")
        elif kind == "string":
            options.update(metavar="TEXT")
        else:
            options.update(type=json.loads, metavar="JSON")
        yield f"--{name}", options


def config_options(schema: str = "config-update.json"):
    """(flag, argparse keywords) for each Config field: the `config` command's options.

    A field's `description` is its help and `x-metavar` names its value; a boolean
    takes on|off, an array one comma-separated flag.
    """
    from localrt import schemas  # plain JSON reading; jsonschema stays unloaded

    for name, spec in schemas.load(schema)["properties"].items():
        text = _lower_first(spec.get("description") or name.replace("_", " "))
        options = {"dest": f"param_{name}", "metavar": spec.get("x-metavar", "TEXT")}
        if spec.get("type") == "boolean":
            options.update(type=on_off, metavar="on|off")
        elif spec.get("type") == "array":  # of strings
            options.update(type=_checked(spec.get("items") or {}, comma_list))
            text = "comma-separated " + text
        else:
            options.update(type=_checked(spec, str, quoted=name not in SECRET_FIELDS))
        yield f"--{name}", {**options, "help": text.replace("%", "%%")}


def _checked(spec: dict, read, quoted: bool = True):
    """A flag type that reads a value with `read` (a string, or a list of them) and checks
    each string as the schema's maxLength and pattern would, so a bad value is a usage
    error (exit 2) and nothing is sent. The schemas' patterns are linear, and no longer
    string is matched against one. The error quotes the value unless it is a secret."""
    import re

    def check(value: str):
        out = read(value)
        for text in out if isinstance(out, list) else [out]:
            if len(text) > spec.get("maxLength", len(text)) or \
                    "pattern" in spec and not re.search(spec["pattern"], text):
                why = spec.get("x-message") or "is not a valid value"
                raise argparse.ArgumentTypeError(f"{shown(text)} {why}" if quoted else
                                                 f"the value {why}")
        return out

    check.__name__ = read.__name__  # argparse names the type in its errors
    return check


def flag_values(args: argparse.Namespace, names) -> dict:
    """The values of the schema flags named that were given ('' drops out of a list)."""
    values = {}
    for name in names:
        value = getattr(args, f"param_{name}")
        if value is not None:
            values[name] = [v for v in value if v] if isinstance(value, list) else value
    return values


def _parameter_help(name: str, spec: dict) -> str:
    text = _lower_first(spec.get("description") or name.replace("_", " "))
    if "minimum" in spec and "maximum" in spec:
        text += f"; {spec['minimum']} to {spec['maximum']}"
    if "enum" in spec:
        text += "; one of " + ", ".join(spec["enum"])
    if spec.get("type") == "array":
        text += "; repeat the flag for several, or give '' alone for none"
    return text.replace("%", "%%")  # argparse %-formats help


def _lower_first(text: str) -> str:
    """"Context length" -> "context length", but "CPU threads" stays."""
    return text[:1].lower() + text[1:] if text[1:2].islower() else text
