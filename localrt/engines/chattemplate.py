"""Chat templates, rendered in a bounded sandbox (issue 38).

A GGUF's chat template (tokenizer.chat_template) is Jinja code from whoever made the
file, and a chat renders it on every request. `ChatTemplate` renders it as
llama-cpp-python's Jinja2ChatFormatter does (jinja2's ImmutableSandboxedEnvironment,
the same variables, extensions and tojson, so prompts are byte for byte the same), in
`BoundedSandbox`, within bounds:

  * internals: a template that names an attribute or item starting with "_" (the way
    to Python's internals: ''.__class__.__mro__) is refused when it is compiled, never
    run; one that reaches them another way meets the sandbox's SecurityError, refused
    the same way;
  * time: each operation the sandbox sees (attribute and item reads, calls, filters,
    the operators that make large values, every step of every loop) is counted, and
    every CHECK_EVERY of them the render checks its deadline (TIME_LIMIT), so a slow
    template stops within milliseconds of it, in the thread that renders it;
  * size: no value and no output may be larger than the render's byte bound (the
    context's worth of text, ctx_len x BYTES_PER_TOKEN, plus twice the request's own
    text, which a template may fairly render more than once); an operation whose
    result would be larger (a string or list repeated, padded, replaced, joined or
    formatted wide, a power) is refused before it runs, so memory never grows past it.

Every bound, a syntax error, a broken {% for %} and any other failure to render is
`TemplateRefused`, which the model turns into 400 invalid_chat_template naming the
model. The template's own raise_exception() (its way of refusing messages it does not
take) is `MessagesRefused`, the 400 InvalidField on 'messages' it always was.

Why counting in the rendering thread, not a subprocess: a chat renders its template on
every request, in well under a millisecond; a process per render costs tens of
milliseconds, and a standing worker per model adds a process, a protocol and a restart
path. Counting is enough because every step a template takes passes through a sandbox
hook or a loop, which this module wraps, and the only single steps that could take long
are those that build large values, which are bounded before they run. When the render
is refused, the exception unwinds it: nothing is left running after the reply.
"""

from __future__ import annotations

import functools
import re
import string
import threading
import time
from datetime import datetime
from typing import Any, Iterable

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

TIME_LIMIT = 1.0        # seconds a render may take
CHECK_EVERY = 256       # operations between two looks at the clock
BYTES_PER_TOKEN = 32    # a token's worth of text, generously (most are 3 to 5 bytes)
MAX_JSON_INDENT = 16    # tojson's indent: real templates use 2 or 4
_LOOP = "localrt_loop"  # the filter each {% for %} iterates through


class TemplateRefused(Exception):
    """A template that broke a bound or failed to render; the message says how."""


class MessagesRefused(Exception):
    """The template's raise_exception(): it does not take these messages."""


class _Budget:
    """One render's deadline and operation count."""

    __slots__ = ("deadline", "ops", "next_check", "max_bytes")

    def __init__(self, max_bytes: int, limit: float):
        self.deadline = time.monotonic() + limit
        self.ops, self.next_check, self.max_bytes = 0, CHECK_EVERY, max_bytes


def _size(value) -> int:
    """A value's size for the bound: its length (bytes of a string, at most 4 a
    character, counted as one), the bytes of an int; 0 for anything else."""
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 8
    return 0


_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, counting each operation against the render's time
    and bounding each value's size (the module docstring says how). `_local.budget`
    is the render under way in this thread (None: compiling, when sizes are bounded
    by `max_bytes` and time is not counted)."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, max_bytes: int, time_limit: float = TIME_LIMIT, **kwargs):
        super().__init__(**kwargs)
        self.max_bytes = max_bytes
        self.time_limit = time_limit
        self._local = threading.local()
        self.filters = {name: self.guarded(name, f) for name, f in self.filters.items()}
        self.filters[_LOOP] = self._loop
        self.globals["lipsum"] = self.guarded("lipsum", self.globals["lipsum"])

    # --- the render's budget --------------------------------------------------

    def budget(self, max_bytes: int) -> "_Rendering":
        """A render's bounds, for a `with` around it in this thread."""
        return _Rendering(self, _Budget(max_bytes, self.time_limit))

    def _bound(self) -> int:
        budget = getattr(self._local, "budget", None)
        return budget.max_bytes if budget is not None else self.max_bytes

    def tick(self, n: int = 1) -> None:
        """Count `n` operations; TemplateRefused once the render is past its time."""
        budget = getattr(self._local, "budget", None)
        if budget is None:
            return
        budget.ops += n
        if budget.ops >= budget.next_check:
            budget.next_check = budget.ops + CHECK_EVERY
            if time.monotonic() > budget.deadline:
                raise TemplateRefused(f"it took more than {self.time_limit:g} s to render")

    def check(self, value, what: str = "a value"):
        """`value`, unless it is larger than the bound."""
        if _size(value) > self._bound():
            self.too_big(what)
        return value

    def too_big(self, what: str):
        """Refuse an operation whose result would be larger than the bound."""
        raise TemplateRefused(f"it made {what} larger than the {self._bound()} bytes a "
                              f"prompt for this model's context can hold")

    # --- the sandbox's hooks ----------------------------------------------------

    def getattr(self, obj, attribute):
        """An attribute, counted and bounded."""
        self.tick()
        return self.check(super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        """An item, counted and bounded."""
        self.tick()
        return self.check(super().getitem(obj, argument))

    def unsafe_undefined(self, obj, attribute):
        """Refuse the template: it reached for an attribute the sandbox keeps from it."""
        raise TemplateRefused(f"it reaches for Python's internals ({attribute!r} of "
                              f"{type(obj).__name__!r})")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: B902 (jinja2's names)
        """A call, counted, its arguments and result bounded; a str method's result
        bounded before it runs."""
        __self.tick()
        for value in (*args, *kwargs.values()):  # a macro that calls itself, doubling
            __self.check(value, "an argument")
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            joined = __self._str_method(owner, getattr(__obj, "__name__", ""), args)
            if joined is not None:
                return joined
        return __self.check(super().call(__context, __obj, *args, **kwargs),
                            "a call's result")

    def call_binop(self, context, operator: str, left, right):
        """*, **, % and +, their result's size bounded before they run."""
        self.tick()
        bound = self._bound()
        if operator == "*":
            if isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > 8 * bound:
                    self.too_big("a number")
            else:
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(n, int) and _size(seq) * max(n, 0) > bound:
                    self.too_big("a repeated value")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right > 0 and right * abs(left).bit_length() > 8 * bound:
                self.too_big("a number")
        elif operator == "%" and isinstance(left, str):
            self._printf(left, right)
        elif operator == "+" and _size(left) + _size(right) > bound:
            self.too_big("a joined value")
        return self.check(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value):
        """str.format and format_map, as the sandbox wraps them, with every width
        bounded before they run."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        text = value.__self__

        @functools.wraps(wrapped)
        def bounded(*args, **kwargs):
            self.tick()
            self._widths(text, [*args, *kwargs.values()])
            return self.check(wrapped(*args, **kwargs), "a formatted text")

        return bounded

    # --- what a single step could make large --------------------------------------

    def _str_method(self, text: str, name: str, args: tuple):
        """Bound a str method's result before it runs; the result when this ran it
        (join, whose items are read once), else None."""
        bound = self._bound()
        ints = [a for a in args if isinstance(a, int)]
        if name in ("ljust", "rjust", "center", "zfill") and any(i > bound for i in ints):
            self.too_big("a padded text")
        elif name == "expandtabs" and ints and text.count("\t") * ints[0] > bound:
            self.too_big("a text with its tabs expanded")
        elif name == "replace" and len(args) >= 2:
            self._replaced(text, args[0], args[1])
        elif name == "join" and args:
            items = list(args[0])
            self._joined(text, items)
            return text.join(items)
        return None

    def _replaced(self, text, old, new) -> None:
        if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
            count = text.count(old) if old else len(text) + 1
            if len(text) + count * (len(new) - len(old)) > self._bound():
                self.too_big("a replaced text")

    def _joined(self, separator, items: list) -> None:
        total = len(separator) * max(len(items) - 1, 0) if isinstance(separator, str) else 0
        total += sum(len(i) for i in items if isinstance(i, str))
        if total > self._bound():
            self.too_big("a joined text")

    def _printf(self, text: str, args) -> None:
        """Bound a printf-style format's widths (`%9999999d`, `%*d`)."""
        values = list(args) if isinstance(args, tuple) else [args]
        for width, precision in _PRINTF.findall(text):
            for n in (width, precision):
                if n == "*" and any(isinstance(v, int) and v > self._bound() for v in values):
                    self.too_big("a formatted text")
                if n.isdigit() and int(n) > self._bound():
                    self.too_big("a formatted text")

    def _widths(self, text: str, values: list) -> None:
        """Bound str.format's widths, literal or given as arguments."""
        try:
            specs = [spec for _, _, spec, _ in string.Formatter().parse(text) if spec]
        except ValueError:
            return  # format() itself says what is wrong with it
        bound = self._bound()
        for spec in specs:
            if any(int(n) > bound for n in re.findall(r"\d+", spec)):
                self.too_big("a formatted text")
            if "{" in spec and any(isinstance(v, int) and v > bound for v in values):
                self.too_big("a formatted text")

    def guarded(self, name: str, func):
        """A filter (or lipsum), counted, with what it could make large bounded before
        it runs and its result after."""
        passes = getattr(func, "jinja_pass_arg", None) is not None

        @functools.wraps(func)
        def guarded(*args, **kwargs):
            self.tick()
            given = args[1:] if passes else args
            self._filter_arguments(name, given[0] if given else None, given[1:], kwargs)
            return self.check(func(*args, **kwargs), f"the result of the filter {name}")

        return guarded

    def _filter_arguments(self, name: str, value, args: tuple, kwargs: dict) -> None:
        bound = self._bound()
        ints = [a for a in (*args, *kwargs.values())
                if isinstance(a, int) and not isinstance(a, bool)]
        if name in ("center", "wordwrap", "batch", "slice") and any(i > bound for i in ints):
            self.too_big(f"the result of the filter {name}")
        if name == "lipsum":  # n paragraphs of at most `max` words
            count = kwargs.get("n", 5) if value is None else value
            words = args[2] if len(args) > 2 else kwargs.get("max", 100)
            if isinstance(count, int) and isinstance(words, int) and count * words * 12 > bound:
                self.too_big("the result of lipsum")
        elif name == "indent":
            width = (args or (kwargs.get("width", 4),))[0]
            width = len(width) if isinstance(width, str) else width
            lines = str(value).count("\n") + 1 if isinstance(value, str) else 1
            if isinstance(width, int) and lines * width > bound:
                self.too_big("an indented text")
        elif name == "replace" and len(args) >= 2:
            self._replaced(value, args[0], args[1])
        elif name == "join":
            items = list(value) if isinstance(value, (list, tuple)) else []
            self._joined((args or (kwargs.get("d", ""),))[0], items)
        elif name == "format" and isinstance(value, str):
            self._printf(value, tuple(args) or tuple(kwargs.values()))
        elif name == "tojson":
            indent = kwargs.get("indent", args[1] if len(args) > 1 else None)
            if _size(indent) > MAX_JSON_INDENT or (isinstance(indent, int)
                                                   and indent > MAX_JSON_INDENT):
                raise TemplateRefused(f"its tojson indent is more than {MAX_JSON_INDENT}")

    def _loop(self, iterable) -> Iterable:
        """What each {% for %} iterates: its items, each step counted."""
        if isinstance(iterable, jinja2.Undefined):
            return iterable  # the loop says what is undefined, as it always has
        return _Counted(self, iterable)

    # --- compiling --------------------------------------------------------------

    def _parse(self, source, name, filename):
        """The template's tree, refused if it names Python's internals, with every
        {% for %} iterating through the counting filter."""
        tree = super()._parse(source, name, filename)
        for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter)):
            named = None
            if isinstance(node, nodes.Getattr):
                named = node.attr
            elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
                named = node.arg.value
            elif isinstance(node, nodes.Filter) and node.name == "attr" and node.args \
                    and isinstance(node.args[0], nodes.Const):
                named = node.args[0].value
            if isinstance(named, str) and named.startswith("_"):
                raise TemplateRefused(f"it reaches for Python's internals ({named!r}, line "
                                      f"{node.lineno}); it is never run")
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, _LOOP, [], [], None, None,
                                     lineno=loop.lineno)
        return tree


class _Counted:
    """An iterable whose every step counts against the render (it keeps len() for
    loop.length, when the items have one)."""

    __slots__ = ("_env", "_items")

    def __init__(self, env: BoundedSandbox, items):
        self._env, self._items = env, items

    def __iter__(self):
        tick = self._env.tick
        for item in self._items:
            tick()
            yield item

    def __len__(self):
        return len(self._items)


class _Rendering:
    """A render's budget set for this thread while the `with` lasts."""

    def __init__(self, env: BoundedSandbox, budget: _Budget):
        self._env, self._budget = env, budget

    def __enter__(self):
        self._env._local.budget = self._budget
        return self._budget

    def __exit__(self, *exc):
        self._env._local.budget = None


class IgnoreGenerationTags(jinja2.ext.Extension):
    """Hugging Face's {% generation %} tag, passed through (as Transformers and
    llama-cpp-python read it)."""

    tags = {"generation"}

    def parse(self, parser):
        """The tag's body, as if the tag were not there."""
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None,
            sort_keys: bool = False) -> str:
    """tojson as Transformers' chat templates have it (not jinja2's HTML-safe one)."""
    import json

    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(f: str) -> str:
    return datetime.now().strftime(f)


def _text_size(value) -> int:
    """The characters of every string in a request's messages or tools."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_size(v) for v in value)
    return 0


class ChatTemplate:
    """A GGUF's chat template, compiled once, rendered within bounds: `render` gives
    the prompt for messages (and tools) as llama-cpp-python's Jinja2ChatFormatter
    would, or raises TemplateRefused or MessagesRefused. `context` is the model's
    context in tokens (ctx_len), which bounds a prompt's size."""

    def __init__(self, template: str, eos_token: str, bos_token: str, context: int,
                 time_limit: float = TIME_LIMIT):
        self.eos_token, self.bos_token = eos_token, bos_token
        self.max_bytes = max(context, 1) * BYTES_PER_TOKEN
        self._env = BoundedSandbox(self.max_bytes, time_limit, loader=jinja2.BaseLoader(),
                                   trim_blocks=True, lstrip_blocks=True,
                                   extensions=[IgnoreGenerationTags,
                                               jinja2.ext.loopcontrols])
        self._env.filters["tojson"] = self._env.guarded("tojson", _tojson)
        try:
            self._template = self._env.from_string(template)
        except TemplateRefused:
            raise
        except Exception as exc:  # a syntax error, an unknown filter or tag
            raise TemplateRefused(f"it does not compile: {_said(exc)}") from None

    def render(self, messages: list, tools: list | None = None, *,
               generation: bool = True, kwargs: dict | None = None) -> str:
        """The prompt for `messages` and `tools`, with the generation prompt unless
        `generation` is false; `kwargs` are more variables for the template
        (chat_template_kwargs: enable_thinking, reasoning_effort, ...), never in place
        of those it is always given."""
        def raise_exception(message: str):
            raise MessagesRefused(message)

        # A template may fairly render the request's own text more than once.
        max_bytes = self.max_bytes + 2 * _text_size([messages, tools, kwargs])
        given = dict(messages=messages, eos_token=self.eos_token, bos_token=self.bos_token,
                     raise_exception=raise_exception, add_generation_prompt=generation,
                     functions=None, function_call=None, tools=tools, tool_choice=None,
                     strftime_now=_strftime_now)
        given = {**{k: v for k, v in (kwargs or {}).items() if k not in given}, **given}
        env = self._env
        with env.budget(max_bytes):
            try:
                out, size = [], 0
                for chunk in self._template.generate(**given):
                    env.tick()
                    size += len(chunk)
                    if size > max_bytes:
                        env.too_big("a prompt")
                    out.append(chunk)
                return "".join(out)
            except (TemplateRefused, MessagesRefused):
                raise
            except SecurityError as exc:
                raise TemplateRefused(f"it reaches for Python's internals: {_said(exc)}") \
                    from None
            except RecursionError:
                raise TemplateRefused("it recursed too deeply") from None
            except MemoryError:
                raise TemplateRefused("it ran out of memory") from None
            except Exception as exc:  # a broken loop, an undefined used, a type error
                raise TemplateRefused(f"it failed to render: {_said(exc)}") from None


def _said(exc: Exception) -> str:
    """An exception's own words, short (a template's error can quote its input)."""
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 300 else text[:300] + "..."
