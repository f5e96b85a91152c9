"""Tool calls: each model family's call syntax, the grammar that forces a call, and the
parser that turns the model's text into OpenAI tool calls, streamed or not.

A family is one row of `FAMILIES`, found in the model's Jinja chat template by a
string only that family's templates contain (as llama.cpp's common/chat.cpp finds
them). The row says how a block of calls opens and closes, the key the template
writes arguments under, the call ids the template accepts back, whether it renders
several calls in one message, and which special tokens of the syntax the engine must
print as text. Add a family by adding a row.

  hermes   Hermes 2/3, Qwen 2.5 and 3:  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
  llama3   Llama 3.1/3.2/3.3:           {"name": ..., "parameters": {...}}  (one call)
  mistral  Mistral v0.3, Nemo, Small:   [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]

The flow, as localrt.inference.chat drives it: `ToolRequest.read(...)` checks the request's
tools, tool_choice and parallel_tool_calls; the engine's check_request calls
`check_schemas` (a tool schema that cannot become a grammar, or whose grammar would
pass localrt.engines.llama.grammar's bounds, is a 400 naming it) before anything
waits; once the model is leased, `ToolRequest.plan(template)` picks the family and
gives the generation parameters: `tools` for the template, `grammar` (GBNF) when
tool_choice is "required" or names a function, and `preserved_tokens`. The plan's
`parser()` reads the reply, streamed; `read_reply` reads a whole one.

The parser reads text as it comes and gives events: ("text", s), ("call", index, id,
name) once a call's name is read, ("args", index, s) as its arguments' JSON arrives.
It holds back text that might open a call, and drops whitespace next to calls. Text
that is not a call stays text; a call whose JSON breaks before its name is read is
given back as text. A call that breaks after (cut by max_tokens, say) has been
announced in a stream already, and the stream says no more; a whole reply
(`read_reply`) gives such a block back as text, so malformed JSON never becomes a
call there.
llama_cpp is imported only to build grammars.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass

from localrt.engines.llama.grammar import Budget, converter, reason
from localrt.errors import InvalidField

# The JSON Schema of a function that gives none: an object of any arguments.
NO_PARAMETERS = {"type": "object"}


# --- the families ---------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """How one model family writes tool calls (see the module docstring)."""

    name: str
    template_marks: tuple      # a chat template holding one of these is this family's
    openers: tuple             # text that opens a block of calls
    bare: bool                 # a call may also start as a bare {"name": ... object
    array: bool                # a block holds a JSON array of calls, not one call
    closer: str                # text that ends a block (optional when reading)
    args_key: str              # the key the family's template writes arguments under
    parallel: bool             # its template renders several calls in one message
    preserved: tuple           # special tokens of the syntax, printed as text
    grammar_open: str          # a forced reply: grammar_open call (grammar_sep call)*
    grammar_sep: str           #   grammar_close
    grammar_close: str
    id_length: int = 0         # ids of exactly this many alphanumerics; 0: "call_..."

    def new_id(self) -> str:
        """A call id this family's template accepts when the call comes back."""
        if self.id_length:
            return uuid.uuid4().hex[:self.id_length]
        return "call_" + uuid.uuid4().hex[:24]


FAMILIES = (
    Family("hermes", template_marks=("<tool_call>",), openers=("<tool_call>",), bare=False,
           array=False, closer="</tool_call>", args_key="arguments", parallel=True,
           preserved=("<tool_call>", "</tool_call>"), grammar_open="<tool_call>\n",
           grammar_sep="\n</tool_call>\n<tool_call>\n", grammar_close="\n</tool_call>"),
    Family("llama3", template_marks=("<|start_header_id|>ipython<|end_header_id|>",),
           openers=("<|python_tag|>",), bare=True, array=False, closer="",
           args_key="parameters", parallel=False, preserved=("<|python_tag|>",),
           grammar_open="", grammar_sep="", grammar_close=""),
    Family("mistral", template_marks=("[TOOL_CALLS]",), openers=("[TOOL_CALLS]",),
           bare=False, array=True, closer="", args_key="arguments", parallel=True,
           preserved=("[TOOL_CALLS]",), grammar_open="[TOOL_CALLS][", grammar_sep=", ",
           grammar_close="]", id_length=9),
)


def family_of(template: str | None) -> Family | None:
    """The family whose calls a chat template renders; None when it renders none we know."""
    for family in FAMILIES:
        if template and any(mark in template for mark in family.template_marks):
            return family
    return None


# --- the request ----------------------------------------------------------------------


class ToolRequest:
    """A request's tools, tool_choice ("none", "auto", "required", or "function" with the
    function's name) and parallel_tool_calls, checked against each other."""

    def __init__(self, tools: list, choice: str, function: str | None, parallel: bool):
        self.tools, self.choice, self.function = tools, choice, function
        self.parallel = parallel

    @classmethod
    def read(cls, tools: list, choice: str = "auto", function: str | None = None,
             parallel: bool = True) -> "ToolRequest | None":
        """A request's tool fields (localrt.native.Request's: function tools, tool_choice
        "auto", "none", "required" or "function" with the function's name); None when it
        gives no tools."""
        tools = tools or []
        if choice == "function":
            if not any(t["function"]["name"] == function for t in tools):
                raise InvalidField(f"Invalid field 'tool_choice.function.name': no tool is "
                                   f"called {function!r}", param="tool_choice.function.name")
        elif choice == "required" and not tools:
            raise InvalidField("Invalid field 'tool_choice': \"required\" needs tools",
                               param="tool_choice")
        seen = set()
        for i, tool in enumerate(tools):
            name = tool["function"]["name"]
            if name in seen:
                raise InvalidField(f"Invalid field 'tools[{i}].function.name': two tools "
                                   f"are called {name!r}", param=f"tools[{i}].function.name")
            seen.add(name)
        if not tools:
            return None
        return cls(tools, choice, function, parallel)

    @property
    def calling(self) -> bool:
        """Whether the reply may hold calls (tool_choice is not "none")."""
        return self.choice != "none"

    def forced(self) -> list:
        """(index, tool) of the tools a grammar must offer: all of them for "required",
        the named one for a function, none otherwise."""
        if self.choice in ("none", "auto"):
            return []
        return [(i, t) for i, t in enumerate(self.tools)
                if self.choice == "required" or t["function"]["name"] == self.function]

    def plan(self, template: str | None, own: bool = False) -> "ToolPlan":
        """The plan for a model with this chat template; a 400 when tools would be called
        and the template writes no calls localrt can read. `own`: the model's reasoning
        syntax reads its calls itself (gpt-oss's harmony: localrt.engines.reasoning), so
        the template gets the tools and the reply no parser here."""
        family = None if own else family_of(template)
        if family is None and self.calling and not own:
            known = ", ".join(f.name for f in FAMILIES)
            raise InvalidField("Invalid field 'tools': the model's chat template does not "
                               f"call tools in a format localrt reads ({known}); use "
                               "tool_choice \"none\" or a model made for tool calls",
                               param="tools")
        return ToolPlan(self, family, own)


def check_schemas(tools: list | None, choice: str = "auto",
                  function: str | None = None) -> None:
    """A 400 naming the tool whose parameters cannot become a grammar, for the tools a
    grammar will force (tool_choice "required" or a function). Before anything waits."""
    request = ToolRequest.read(tools, choice, function)
    forced = request.forced() if request else []
    budget = Budget()  # one grammar offers every forced tool: their schemas share it
    for index, tool in forced:
        budget.spend(_parameters(tool), f"tools[{index}].function.parameters")
    for index, tool in forced:
        try:
            _check_parameters(json.dumps(_parameters(tool), sort_keys=True))
        except Exception as exc:  # the converter raises bare Exceptions and asserts
            raise InvalidField(
                f"Invalid field 'tools[{index}].function.parameters': the JSON Schema of "
                f"tool {tool['function']['name']!r} cannot be turned into a grammar: "
                f"{reason(exc)}", param=f"tools[{index}].function.parameters") from None


@functools.lru_cache(maxsize=64)
def _check_parameters(schema_json: str) -> None:
    """Convert once: clients send the same tools with every request."""
    convert = converter()
    convert.visit(convert.resolve_refs(json.loads(schema_json), "tool"), "tool")




def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or NO_PARAMETERS


# --- the plan -------------------------------------------------------------------------


class ToolPlan:
    """What a leased model's generation gets for a ToolRequest, and how its reply is read."""

    def __init__(self, request: ToolRequest, family: Family | None, own: bool = False):
        self.request, self.family, self.own = request, family, own

    @property
    def parses(self) -> bool:
        """Whether the reply is read for calls."""
        return self.family is not None and self.request.calling

    def params(self) -> dict:
        """`tools`, and `grammar` and `preserved_tokens` when calls are read (a harmony
        model's forced call gets its grammar, and reads its calls itself)."""
        out = {"tools": self.request.tools}
        if self.own and self.request.forced():
            out["grammar"] = harmony_grammar(self.request.forced())
        if self.parses:
            out["preserved_tokens"] = list(self.family.preserved)
            forced = self.request.forced()
            if forced:
                out["grammar"] = grammar(self.family, forced, self.max_calls() > 1)
        return out

    def max_calls(self) -> int:
        """How many calls one reply may make."""
        return 1 << 30 if self.request.parallel and self.family.parallel else 1

    def parser(self) -> "CallParser | None":
        """A fresh parser for one reply; None when the reply is all text."""
        return CallParser(self.family, self.max_calls()) if self.parses else None


def grammar(family: Family, forced: list, parallel: bool) -> str:
    """The GBNF grammar of a reply that is only calls of the `forced` (index, tool) pairs,
    in the family's syntax."""
    convert, budget = converter(), Budget()
    calls = []
    for index, tool in forced:
        name = tool["function"]["name"]
        parameters = _resolved(convert, budget, index, tool)
        calls.append({"type": "object", "required": ["name", family.args_key],
                      "properties": {"name": {"const": name}, family.args_key: parameters}})
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    try:
        call = convert.visit(schema, "call")
    except Exception as exc:
        raise InvalidField(f"Invalid field 'tools': their JSON Schemas cannot be turned into "
                           f"a grammar: {reason(exc)}", param="tools") from None
    rules = convert.format_grammar()
    if re.search(r"^root ::=", rules, re.M):
        raise InvalidField("Invalid field 'tools': a schema defines a rule called root",
                           param="tools")
    more = f" ({_literal(family.grammar_sep)} {call})*" if parallel else ""
    root = " ".join(p for p in (_literal(family.grammar_open), call + more,
                                _literal(family.grammar_close)) if p)
    return f"root ::= {root}\n{rules}\n"


def harmony_grammar(forced: list) -> str:
    """The GBNF grammar of gpt-oss's answer when it must call one of the `forced` (index,
    tool) pairs: one commentary message to the function, its arguments the tool's JSON
    Schema, from where the analysis ends (localrt.engines.reasoning.Plan.commentary).
    The recipient is in the channel (<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>) or in the role (to=functions.NAME<|channel|>commentary
    json<|message|>, as the template writes history's calls); the model's <|call|>
    ends the reply, as a grammar that is done lets only an end token come."""
    convert, budget = converter(), Budget()
    in_channel, in_role = [], []
    for index, tool in forced:
        parameters = _resolved(convert, budget, index, tool)
        try:
            args = convert.visit(parameters, f"args-{index}")
        except Exception as exc:
            raise _bad_parameters(index, exc) from None
        name = _literal(tool["function"]["name"])
        in_channel.append(f'{name} (" <|constrain|>json" | " json")? "<|message|>" {args}')
        in_role.append(f'{name} "<|channel|>commentary" (" <|constrain|>json" | " json")? '
                       f'"<|message|>" {args}')
    rules = convert.format_grammar()
    if re.search(r"^(root|in-channel|in-role) ::=", rules, re.M):
        raise InvalidField("Invalid field 'tools': a schema defines a rule called root, "
                           "in-channel or in-role", param="tools")
    return ('root ::= "<|start|>assistant"? ("<|channel|>commentary to=functions." '
            'in-channel | " to=functions." in-role)\n'
            f"in-channel ::= {' | '.join(f'({c})' for c in in_channel)}\n"
            f"in-role ::= {' | '.join(f'({c})' for c in in_role)}\n{rules}\n")


def _resolved(convert, budget: "Budget", index: int, tool: dict) -> dict:
    """Tool `index`'s parameters' JSON Schema with its $refs resolved, counted against
    the grammar's `budget`; a 400 naming the field for one that cannot be resolved."""
    budget.spend(_parameters(tool), f"tools[{index}].function.parameters")
    try:
        return convert.resolve_refs(_parameters(tool), f"tools-{index}")
    except Exception as exc:
        raise _bad_parameters(index, exc) from None


def _bad_parameters(index: int, exc: Exception) -> InvalidField:
    """The 400 for tool `index`'s parameters that no grammar can be made of."""
    return InvalidField(f"Invalid field 'tools[{index}].function.parameters': {reason(exc)}",
                        param=f"tools[{index}].function.parameters")


def _literal(text: str) -> str:
    """A GBNF string literal ("" for none); JSON's escapes are GBNF's."""
    return json.dumps(text) if text else ""


# --- reading the reply ----------------------------------------------------------------


class Malformed(Exception):
    """The text stopped being the JSON a call needs."""


_WS = re.compile(r"[ \t\r\n]*")
_STRING_BODY = re.compile(r'[^"\\]*')
_SCALAR_END = frozenset(",}] \t\r\n")


def _skip_ws(buf: str, pos: int) -> int:
    return _WS.match(buf, pos).end()


class _Value:
    """Finds where one JSON value ends, reading its text as it arrives."""

    __slots__ = ("start", "pos", "depth", "in_string", "kind")

    def __init__(self, buf: str, start: int):
        c = buf[start]
        if c in "{[":
            self.kind = "container"
        elif c == '"':
            self.kind = "string"
        elif c in "-0123456789tfn":
            self.kind = "scalar"
        else:
            raise Malformed(f"a JSON value cannot start with {c!r}")
        self.start = self.pos = start
        self.depth, self.in_string = 0, False

    def advance(self, buf: str) -> int | None:
        """The index just past the value once it is complete, else None."""
        i, n = self.pos, len(buf)
        if self.kind == "scalar":
            while i < n and buf[i] not in _SCALAR_END:
                i += 1
            self.pos = i
            return i if i < n else None
        while i < n:
            if self.in_string or (self.kind == "string" and i == self.start):
                if not self.in_string:
                    self.in_string, i = True, i + 1
                i = _STRING_BODY.match(buf, i).end()
                if i >= n:
                    break
                if buf[i] == "\\":
                    if i + 1 >= n:
                        break  # read the escape once its second character comes
                    i += 2
                    continue
                self.in_string, i = False, i + 1
                if self.kind == "string":
                    self.pos = i
                    return i
                continue
            c = buf[i]
            i += 1
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i
                    return i
        self.pos = i
        return None


class _Call:
    """One call's JSON object as it arrives: the name first, then the arguments' text.

    `step(buf, pos, out)` reads on from pos and returns where it stopped; it appends
    ("name", name) once the name is read and ("args", text) as the arguments' JSON comes
    (after the name, whatever order the keys are in), and sets `done` at the closing
    brace. Raises Malformed when the text cannot be a call. The text stays in `buf`
    until the call is done: positions are indexes into it.
    """

    ARGS = ("arguments", "parameters")

    def __init__(self):
        self.state = "open"  # open, first (a key or "}"), key, colon, value, next
        self.key = None
        self.value: _Value | None = None  # the key or value being read
        self.name: str | None = None
        self._args_start: int | None = None  # an arguments object's text: its start
        self._args_end: int | None = None    # and end, once read
        self._args_text: str | None = None   # arguments written as a JSON string (or none)
        self._sent = 0
        self.done = False

    def step(self, buf: str, pos: int, out: list) -> int:
        n = len(buf)
        while pos < n and not self.done:
            if self.state == "value":
                pos = self._read_value(buf, pos, out)
                if self.value is not None:
                    break
                continue
            if self.value is None:
                pos = _skip_ws(buf, pos)
                if pos >= n:
                    break
            c = buf[pos]
            if self.state == "open":
                if c != "{":
                    raise Malformed("a call is a JSON object")
                self.state, pos = "first", pos + 1
            elif self.state in ("first", "key"):
                if c == "}" and self.state == "first" and self.value is None:
                    pos = self._end(pos + 1)
                elif c == '"' or self.value is not None:
                    self.value = self.value or _Value(buf, pos)
                    end = self.value.advance(buf)
                    if end is None:
                        break
                    self.key = json.loads(buf[self.value.start:end])
                    self.value, self.state, pos = None, "colon", end
                else:
                    raise Malformed("expected a key")
            elif self.state == "colon":
                if c != ":":
                    raise Malformed("expected ':'")
                self.state, pos = "value", pos + 1
            elif c == ",":  # next
                self.state, pos = "key", pos + 1
            elif c == "}":
                pos = self._end(pos + 1)
            else:
                raise Malformed("expected ',' or '}'")
        self._send_args(buf, out)
        return pos

    def _read_value(self, buf: str, pos: int, out: list) -> int:
        """Read on in a member's value; self.value is None again once it is complete."""
        if self.value is None:
            pos = _skip_ws(buf, pos)
            if pos >= len(buf):
                return pos
            self.value = _Value(buf, pos)
            if self.key in self.ARGS:
                if self._args_end is not None or self._args_text is not None:
                    raise Malformed("a call has one set of arguments")
                if self.value.kind == "container":
                    self._args_start = pos
        value = self.value
        end = value.advance(buf)
        if end is None:
            return len(buf)
        text = buf[value.start:end]
        if self.key == "name":
            name = json.loads(text)
            if not isinstance(name, str) or not name or self.name is not None:
                raise Malformed("a call has one name, a string")
            self.name = name
            out.append(("name", name))
        elif self.key in self.ARGS:
            args = json.loads(text)
            if value.kind == "string":  # some write the arguments' JSON as a string
                self._args_text, args = args, json.loads(args)
            if not isinstance(args, dict):
                raise Malformed("arguments are a JSON object")
            if value.kind == "container":
                self._args_end = end
        self.value, self.state = None, "next"
        return end

    def _send_args(self, buf: str, out: list) -> None:
        """Hand out the arguments' text read so far, once the name has gone out."""
        if self.name is None:
            return
        if self._args_text is not None:
            text = self._args_text[self._sent:]
        elif self._args_start is not None:
            upto = self._args_end if self._args_end is not None else self.value.pos
            text = buf[self._args_start + self._sent:upto]
        else:
            return
        if text:
            self._sent += len(text)
            out.append(("args", text))

    def _end(self, pos: int) -> int:
        if self.name is None:
            raise Malformed("a call needs a name")
        if self._args_start is None and self._args_text is None:
            self._args_text = "{}"  # a call of a function that takes nothing
        self.done = True
        return pos


# Text that may still grow into the start of a bare call object: {"name": or {"type":
_BARE = re.compile(r'\{\s*"(?:name|type)"\s*:')
_BARE_PARTIAL = re.compile(
    r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?|t(?:y(?:p(?:e(?:"\s*)?)?)?)?)?)?')
_SPACE = " \t\r\n"


class CallParser:
    """Reads one reply's text as it comes: feed(text) and close() give events (see the
    module docstring). `calls` counts the calls announced; `broken` holds the blocks
    that broke after announcing a call, with their text, for a whole reply to give back.
    """

    def __init__(self, family: Family, max_calls: int):
        self._family, self._max = family, max_calls
        self._buf = ""        # text not settled: held back, or the block being read
        self._pos = 0         # in a block: where reading goes on
        self._state = "text"  # text, open, items, call, sep, close, broken, done
        self._gap = ""        # the whitespace dropped before the block's opener
        self._body = 0        # where the block's opener ends
        self._call: _Call | None = None
        self._after_block = False
        self._block = -1      # the block being read, counted from 0
        self._announced = False  # whether it has announced a call
        self.calls = 0
        self.block_of: dict[int, int] = {}  # call index -> its block
        self.broken: dict[int, str] = {}    # block -> its text

    def feed(self, text: str) -> list:
        """The events that `text` (after what came before) settles."""
        events: list = []
        self._buf += text
        self._run(events, final=False)
        return events

    def close(self) -> list:
        """The events of the end of the reply."""
        events: list = []
        self._run(events, final=True)
        self._buf = ""
        return events

    def _run(self, events: list, final: bool) -> None:
        while True:
            state = self._state
            if state == "done":
                self._buf = ""
                return
            if state == "broken":
                self.broken[self._block] += self._buf
                self._buf = ""
                return
            if state == "text":
                if not self._text(events, final):
                    return
                continue
            try:
                if not self._read_block(events, final):
                    return
            except (Malformed, ValueError):
                self._break(events)

    def _text(self, events: list, final: bool) -> bool:
        """Send the text that cannot open a call; True when a block starts."""
        buf = self._buf
        if self._after_block:  # whitespace after a block is not content
            buf = buf.lstrip(_SPACE)
            self._after_block = not buf
        start, body = self._find(buf)
        if start >= 0:
            text = buf[:start].rstrip(_SPACE)
            if text:
                events.append(("text", text))
            self._gap = buf[len(text):start]
            self._buf, self._pos, self._body = buf[start:], body - start, body - start
            self._block += 1
            self._announced = False
            self._state = "open"
            if self._family.bare and body == start:
                self._call, self._state = _Call(), "call"
            return True
        if final:
            hold = len(buf.rstrip(_SPACE)) if self.calls else len(buf)
        else:
            hold = self._held(buf)
        if hold:
            events.append(("text", buf[:hold]))
        self._buf = "" if final else buf[hold:]
        return False

    def _find(self, buf: str) -> tuple[int, int]:
        """(start, end) of the first call opener in buf; (-1, -1) when there is none."""
        best = (-1, -1)
        for opener in self._family.openers:
            i = buf.find(opener)
            if i >= 0 and (best[0] < 0 or i < best[0]):
                best = (i, i + len(opener))
        if self._family.bare:
            match = _BARE.search(buf)
            if match and (best[0] < 0 or match.start() < best[0]):
                best = (match.start(), match.start())
        return best

    def _held(self, buf: str) -> int:
        """Where the text that might still open a call (and the whitespace before it) starts."""
        n = cut = len(buf)
        for opener in self._family.openers:
            for k in range(min(len(opener) - 1, n), 0, -1):
                if opener.startswith(buf[n - k:]):
                    cut = min(cut, n - k)
                    break
        if self._family.bare:
            j = buf.rfind("{")
            if j >= 0 and _BARE_PARTIAL.fullmatch(buf, j):
                cut = min(cut, j)
        return len(buf[:cut].rstrip(_SPACE))

    def _read_block(self, events: list, final: bool) -> bool:
        """Read on in the block; True when it ended and text follows."""
        buf, family = self._buf, self._family
        while True:
            state = self._state
            if state == "call":
                out: list = []
                self._pos = self._call.step(buf, self._pos, out)
                self._announce(out, events)
                if not self._call.done:
                    break
                self._state = "sep" if family.array else "close"
                if self.calls >= self._max:  # the reply ends at its last allowed call
                    return self._end_block(self._pos, last=True)
                continue
            pos = _skip_ws(buf, self._pos)
            if pos >= len(buf) and state != "close":
                break
            c = buf[pos] if pos < len(buf) else ""
            if state == "open" and family.array:
                if c != "[":
                    raise Malformed("a block of calls is a JSON array")
                self._pos, self._state = pos + 1, "items"
            elif state in ("open", "items"):
                if state == "items" and c == "]":  # [] or [..., ]: no call, or bad JSON
                    raise Malformed("expected a call")
                self._call, self._pos, self._state = _Call(), pos, "call"
            elif state == "sep":
                if c == ",":
                    self._pos, self._state = pos + 1, "items"
                elif c == "]":
                    return self._end_block(pos + 1)
                else:
                    raise Malformed("expected ',' or ']'")
            else:  # close: the closer is optional
                closer, rest = family.closer, buf[pos:]
                if closer and rest.startswith(closer):
                    return self._end_block(pos + len(closer))
                if closer and closer.startswith(rest) and not final:
                    break  # it may be coming
                return self._end_block(self._pos)
        if not final:
            return False
        if self._state == "sep":  # an array whose "]" never came: its calls are whole
            return self._end_block(self._pos)
        if self._announced:  # the reply ended inside a call
            self.broken[self._block] = buf
        else:
            self._give_back(events, len(buf))
        self._buf, self._state = "", "done"
        return False

    def _announce(self, out: list, events: list) -> None:
        for kind, value in out:
            if kind == "name":
                index = self.calls
                self.calls += 1
                self.block_of[index] = self._block
                self._announced = True
                events.append(("call", index, self._family.new_id(), value))
            else:
                events.append(("args", self.calls - 1, value))

    def _end_block(self, pos: int, last: bool = False) -> bool:
        self._buf = self._buf[pos:]
        self._pos, self._call, self._after_block = 0, None, True
        self._state = "done" if last or self.calls >= self._max else "text"
        return self._state == "text"

    def _break(self, events: list) -> None:
        """The block's JSON broke: before a call was announced its opener is text again
        (and what follows is read afresh); after, the rest of the reply is the block's."""
        if self._announced:
            self.broken[self._block] = self._buf
            self._buf, self._state = "", "broken"
        else:
            self._give_back(events, max(self._body, 1))
            self._state = "text"

    def _give_back(self, events: list, upto: int) -> None:
        events.append(("text", self._gap + self._buf[:upto]))
        self._buf, self._gap, self._call = self._buf[upto:], "", None
        self._after_block = False


def read_reply(parser: CallParser, text: str) -> tuple[str, list]:
    """A whole reply's content and its calls as (id, name, arguments); the blocks that
    broke after announcing a call are content again."""
    events = parser.feed(text) + parser.close()
    content, calls, given_back = [], [], set()
    for event in events:
        if event[0] == "text":
            content.append(event[1])
            continue
        block = parser.block_of[event[1]]
        if block in parser.broken:
            if block not in given_back:
                given_back.add(block)
                content.append(parser.broken[block])
        elif event[0] == "call":
            calls.append([event[2], event[3], ""])
        else:
            calls[-1][2] += event[2]
    return "".join(content), [tuple(c) for c in calls]
