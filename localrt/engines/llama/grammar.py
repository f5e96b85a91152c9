"""JSON replies and forced tool calls for gguf-cpp: GBNF grammars from JSON Schemas,
bounded before they are built, and converted once.

llama.cpp constrains a reply with a GBNF grammar: llama-cpp-python's generic JSON one
for {"type": "json_object"}, or one converted from the JSON Schema of
{"type": "json_schema", "schema"} (and, in localrt.engines.toolcalls, from the schemas
of the tools a reply must call). A request checks it before it waits for its model
(GgufEngine.check_request) and uses it after (LlamaModel's sampler), so conversions
are cached. llama_cpp is imported only when one is needed.

The converter writes every repetition out: "minItems": 100000000 is a grammar of
gigabytes, and a "maxLength" of 100,000 nests 100,000 groups, which llama.cpp's parser
recurses through until the thread's stack ends. So a schema is walked first, in time
linear in its size and with no recursion, and refused with a 400 naming the keyword
and its path when the grammar it would make passes a bound (man/localrt-api.7 states
them): a repetition count over MAX_REPEAT, more than MAX_PROPERTIES properties in one
object, more than MAX_NODES subschemas, nesting deeper than MAX_SCHEMA_DEPTH, or an
estimated grammar larger than MAX_GRAMMAR bytes. A GBNF text itself (`check_gbnf`) is
bounded by its length and the nesting of its groups.
"""

from __future__ import annotations

import functools
import json

from localrt.errors import SHOWN, InvalidField, shown

MAX_REPEAT = 1000  # a count of minItems, maxItems, minLength, maxLength, min/maxProperties
#                    or a pattern's {n,m}; llama.cpp's parser refuses a maxLength near 1,100
MAX_PROPERTIES = 256  # of one object: the converter's time grows with the cube of them
MAX_NODES = 2048  # subschemas of one grammar: its time grows with the square of them
MAX_SCHEMA_DEPTH = 32  # subschemas inside subschemas
MAX_GRAMMAR = 1024 * 1024  # bytes of GBNF, as a schema is estimated or a grammar is given
MAX_GBNF_NESTING = 2 * MAX_REPEAT  # groups inside groups of a GBNF text

# Keywords whose value is a count the converter writes out, or may one day.
COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
# Keywords that hold subschemas: one, a list of them, or a map of names to them.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
        "propertyNames", "additionalItems", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# What one rule costs besides its name, each repetition of an item or a pattern's part
# besides the repeated name, and each of a string's characters: generous, so the
# estimate stays above what llama-cpp-python writes.
_RULE, _REPEAT, _CHAR = 48, 24, 10


def json_grammar(response_format: dict | None) -> str | None:
    """The GBNF grammar gguf-cpp constrains a JSON reply with; a 400 for a schema it cannot
    turn into one, or one past the bounds. Checked before a request waits for its model,
    too."""
    kind = (response_format or {}).get("type")
    if kind not in ("json_object", "json_schema"):
        return None
    schema = response_format.get("schema")
    if schema is None:
        from llama_cpp.llama_grammar import JSON_GBNF

        return JSON_GBNF
    Budget().spend(schema, "response_format.json_schema.schema" if kind == "json_schema"
                   else "response_format.schema")
    try:
        # Not sorted: the reply's properties come in the schema's order, as OpenAI's,
        # Ollama's and llama-server's do.
        return _schema_grammar(json.dumps(schema))
    except Exception as exc:  # the converter raises bare Exceptions for what it cannot do
        raise InvalidField(f"Invalid field 'response_format': the JSON Schema cannot be "
                           f"turned into a grammar: {reason(exc)}",
                           param="response_format") from None


@functools.lru_cache(maxsize=64)
def _schema_grammar(schema_json: str) -> str:
    """The grammar of a JSON Schema, converted once: a request checks it before it waits
    for its model and uses it after, and clients send the same schema again and again.
    As llama-cpp-python's json_schema_to_gbnf, with `converter`."""
    convert = converter()
    convert.visit(convert.resolve_refs(json.loads(schema_json), "stdin"), "")
    return convert.format_grammar()


def converter():
    """A fresh JSON Schema to GBNF converter: llama-cpp-python's, with rules named in
    constant time."""
    return _converter_class()()


@functools.lru_cache(maxsize=None)
def _converter_class():
    from llama_cpp.llama_grammar import INVALID_RULE_CHARS_RE, SchemaConverter

    class Converter(SchemaConverter):
        """llama-cpp-python's SchemaConverter, but a rule whose name is taken gets its
        name and the next free number at once. Its own _add_rule tries name0, name1, ...
        in turn, so n rules of one name cost n²: properties "a!", "a?", "a#", ... are
        all named a-, and 2,000 of them took 10 s to convert."""

        def __init__(self):
            super().__init__(prop_order={}, allow_fetch=False, dotall=False,
                             raw_pattern=False)
            self._named = {}  # (name, rule) -> the name it was given
            self._tried = {}  # name -> the number its next rule starts looking from

        def _add_rule(self, name, rule):
            base = INVALID_RULE_CHARS_RE.sub("-", name)
            key = self._named.get((base, rule))
            if key is None:
                if base not in self._rules or self._rules[base] == rule:
                    key = base
                else:
                    i = self._tried.get(base, 0)
                    while f"{base}{i}" in self._rules and self._rules[f"{base}{i}"] != rule:
                        i += 1
                    self._tried[base] = i
                    key = f"{base}{i}"
                self._named[(base, rule)] = key
            self._rules[key] = rule
            return key

    return Converter


def reason(exc: BaseException, limit: int = 200) -> str:
    """What a converter's exception says, cut short: its asserts quote the whole schema
    or pattern they stopped at."""
    text = str(exc) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "…"


class Budget:
    """What one grammar may still hold, spent as its schemas are walked: a grammar of
    several schemas (a reply that calls one of several tools) spends one Budget."""

    def __init__(self):
        self.size = 0   # estimated bytes of GBNF
        self.nodes = 0  # subschemas

    def spend(self, schema, where: str) -> None:
        """Walk a JSON Schema (`where` is its field, which errors name with the path
        inside it) and add what its grammar costs; a 400 at the first bound it passes."""
        # (schema, its path, its depth, the length of the converter's name for its rule)
        stack = [(schema, where, 1, 4)]
        while stack:
            node, path, depth, name = stack.pop()
            if not isinstance(node, dict):
                continue  # true, false: no rule of their own
            self.nodes += 1
            if self.nodes > MAX_NODES:
                raise _refuse(path, f"the JSON Schema holds more than {MAX_NODES} subschemas, "
                                    f"the most a grammar may be made of")
            if depth > MAX_SCHEMA_DEPTH:
                raise _refuse(path, f"the JSON Schema nests subschemas deeper than "
                                    f"{MAX_SCHEMA_DEPTH} levels, the most a grammar's may")
            self._node(node, path, name)
            for key in _ONE:
                child = node.get(key)
                if isinstance(child, list):  # items as a tuple (draft 7)
                    stack += [(c, f"{path}.{key}[{i}]", depth + 1, name + 12)
                              for i, c in enumerate(child)]
                elif child is not None:
                    stack.append((child, f"{path}.{key}", depth + 1, name + len(key) + 1))
            for key in _LIST:
                children = node.get(key)
                if isinstance(children, list):
                    stack += [(c, f"{path}.{key}[{i}]", depth + 1, name + 12)
                              for i, c in enumerate(children)]
            for key in _MAP:
                children = node.get(key)
                if isinstance(children, dict):
                    stack += [(c, f"{path}.{key}.{_key(k)}", depth + 1, name + len(str(k)) + 1)
                              for k, c in children.items()]

    def _node(self, node: dict, path: str, name: int) -> None:
        """Spend what one subschema's own rule costs: its name, its counts written out,
        its pattern, its constants and its properties' rules."""
        cost = _RULE + 2 * name
        counts = {}
        for key in COUNTS:
            if key in node:
                counts[key] = _count(node[key])
                if counts[key] > MAX_REPEAT:
                    raise _refuse(f"{path}.{key}", f"{shown(node[key])} is more than "
                                                    f"{MAX_REPEAT}, the most a grammar may "
                                                    f"repeat a rule (it writes each one out)")
        for low, high, each in (("minItems", "maxItems", name + _REPEAT),
                                ("minLength", "maxLength", _CHAR)):
            if low in counts or high in counts:
                least = counts.get(low, 0)
                cost += (least + max(counts.get(high, least + 1) - least, 1)) * each
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            cost += _RULE + 2 * len(pattern)
            for n in _repetitions(pattern):
                if n > MAX_REPEAT:
                    raise _refuse(f"{path}.pattern", f"it repeats {n} times, more than "
                                                     f"{MAX_REPEAT}, the most a grammar may "
                                                     f"repeat a rule (it writes each one out)")
                cost += n * (name + _REPEAT)
        for key in ("const", "enum"):
            if key in node:
                cost += 2 * len(json.dumps(node[key], default=str)) + _RULE
        properties = node.get("properties")
        if isinstance(properties, dict):
            if len(properties) > MAX_PROPERTIES:
                raise _refuse(f"{path}.properties", f"the object has {len(properties)} "
                                                    f"properties, more than {MAX_PROPERTIES}, "
                                                    f"the most a grammar's may")
            # Each property's key-value rule, and for an optional one the rule of the
            # properties after it.
            cost += sum(3 * (name + len(str(k))) + 2 * _RULE for k in properties)
        self.size += cost
        if self.size > MAX_GRAMMAR:
            raise _refuse(path, f"the grammar of the JSON Schema would be larger than "
                                f"{MAX_GRAMMAR} bytes, the most one may be")


def _key(key) -> str:
    """A property name as a path names it: cut short when long."""
    key = str(key)
    return key if len(key) <= SHOWN else key[:SHOWN] + "…"


def _count(value) -> int:
    """A count as the converter would take it (0 for what is no number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    try:
        return max(int(value), 0) if value < float("inf") else MAX_REPEAT + 1
    except (OverflowError, ValueError):  # nan
        return 0


def _repetitions(pattern: str):
    """The count of each {n}, {n,} and {n,m} of a regular expression, as the converter
    reads it (the larger of n and m): one pass, escapes and [classes] skipped."""
    i, end = 0, len(pattern)
    while i < end:
        c = pattern[i]
        if c == "\\":
            i += 2
        elif c == "[":
            i += 1
            while i < end and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
        elif c == "{":
            close = pattern.find("}", i)
            if close < 0:
                return
            parts = [p.strip() for p in pattern[i + 1:close].split(",")]
            if any(p.isdigit() and len(p) > 9 for p in parts):  # too long to read
                yield MAX_REPEAT + 1
            elif any(p.isdigit() for p in parts):
                yield max(max(int(p) for p in parts if p.isdigit()), 1)
            i = close + 1
        else:
            i += 1


def _refuse(param: str, why: str) -> InvalidField:
    return InvalidField(f"Invalid field '{param}': {why}", param=param)


def check_gbnf(grammar: str, param: str) -> None:
    """A 400 naming `param` for a GBNF text longer than MAX_GRAMMAR or whose groups nest
    deeper than MAX_GBNF_NESTING: llama.cpp's parser recurses once a group, on the
    thread's stack. One pass; literals, [classes] and comments count for nothing."""
    if len(grammar) > MAX_GRAMMAR:
        raise InvalidField(f"Invalid field '{param}': the grammar is {len(grammar)} "
                           f"characters, more than {MAX_GRAMMAR}", param=param)
    if grammar.count("(") <= MAX_GBNF_NESTING:
        return
    depth, i, end = 0, 0, len(grammar)
    while i < end:
        c = grammar[i]
        if c in "\"[":
            close = '"' if c == '"' else "]"
            i += 1
            while i < end and grammar[i] != close:
                i += 2 if grammar[i] == "\\" else 1
        elif c == "#":
            i = grammar.find("\n", i)
            i = end if i < 0 else i
        elif c == "(":
            depth += 1
            if depth > MAX_GBNF_NESTING:
                raise InvalidField(f"Invalid field '{param}': the grammar nests groups "
                                   f"deeper than {MAX_GBNF_NESTING}", param=param)
        elif c == ")":
            depth -= 1
        i += 1
