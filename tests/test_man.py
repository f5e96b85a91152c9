"""The man pages are valid roff, cross-reference each other, and say what the code does.

- man/localrt.1 names every command and option the CLI has (checked against argparse);
- man/localrtrc.5 gives every settings key with its default and its environment
  variable (checked against the settings table);
- man/localrt-api.7 gives every route with its body's schema and fields, and every
  `error.code` the package can produce (checked against the route table, the schemas and
  an ast scan of localrt/);
- man/localrt-cortex.7 lists the differences from cortex.cpp.
"""

import argparse
import ast
import json
import re
import shutil
import subprocess

import pytest
from support import REPO

from localrt import settings
from localrt.api import ROUTES
from localrt.cli import build_parser

MAN = REPO / "man" / "localrt.1"
PAGES = sorted((REPO / "man").glob("*.[1-9]"))
_FONT = re.compile(r"\\f[BIRP]|\\f\(\w\w|\\&")
_ESCAPES = {"\\-": "-", "\\(dq": '"', "\\(aq": "'", "\\(lq": '"', "\\(rq": '"',
            "\\(em": "--", "\\(bu": "*", "\\e": "\\"}


def walk(parser, prefix=()):
    """Yield (command path, option strings) for every parser in the tree."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield prefix + (name,), []
                yield from walk(child, prefix + (name,))
        elif action.help != argparse.SUPPRESS:
            yield prefix, list(action.option_strings)


def man_text():
    # roff escapes dashes; compare on the plain text.
    return MAN.read_text().replace("\\-", "-")


def plain(roff: str) -> str:
    """Roughly the text groff prints: macro names dropped, alternating-font arguments
    joined, escapes undone, one line per input line."""
    out = []
    for line in roff.splitlines():
        if line.startswith((".\\\"", "'\\\"")):
            continue
        if line.startswith("."):
            name, _, rest = line.partition(" ")
            args = [a[1:-1] if a.startswith('"') and a.endswith('"') and len(a) > 1 else a
                    for a in re.findall(r'"[^"]*"|\S+', rest)]
            glue = "" if name in (".BR", ".RB", ".BI", ".IB", ".IR", ".RI") else " "
            line = glue.join(args) if name in (".B", ".I", ".BR", ".RB", ".BI", ".IB",
                                                ".IR", ".RI", ".SH", ".SS") else ""
        for code, char in _ESCAPES.items():
            line = line.replace(code, char)
        out.append(_FONT.sub("", line))
    return "\n".join(out)


def section(roff: str, title: str) -> str:
    """The roff source of one .SH section, up to the next .SH."""
    match = re.search(rf'^\.SH "?{re.escape(title)}"?\n(.*?)(?=^\.SH |\Z)', roff, re.M | re.S)
    assert match, f"no section {title}"
    return match.group(1)


def entries(roff: str) -> list[tuple[list[str], str]]:
    """The .TP entries of a section: (their tags, shared with .TQ ones, and their text)."""
    found = []
    for chunk in re.split(r"^\.TP\n", roff, flags=re.M)[1:]:
        lines = chunk.split("\n")
        tags = [lines[0]]
        i = 1
        while i + 1 < len(lines) and lines[i] == ".TQ":
            tags.append(lines[i + 1])
            i += 2
        found.append(([plain(t).strip() for t in tags], plain("\n".join(lines[i:]))))
    return found


# --- every page ------------------------------------------------------------------------


def test_the_pages_are_there():
    assert {p.name for p in PAGES} >= {"localrt.1", "localrtrc.5", "localrt-api.7",
                                       "localrt-cortex.7"}


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_man_page_is_valid_roff(page):
    proc = subprocess.run(["groff", "-man", "-ww", "-z", str(page)], capture_output=True,
                          text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_header_and_see_also_name_the_others(page):
    roff = page.read_text()
    name, number = page.stem, page.suffix[1:]
    assert re.match(rf"\.TH {re.escape(name.upper().replace('-', chr(92) + '-'))} {number} ",
                    roff), "the .TH line names the page and its section"
    see_also = plain(section(roff, "SEE ALSO"))
    others = [f"{p.stem}({p.suffix[1:]})" for p in PAGES if p != page]
    assert all(other in see_also for other in others), (see_also, others)


# --- localrt.1 -------------------------------------------------------------------------


def test_every_command_and_option_is_in_the_man_page():
    text = man_text()
    missing = []
    for path, options in walk(build_parser()):
        if path and f"localrt {' '.join(path)}" not in text:
            missing.append(" ".join(path))
        missing += [f"{' '.join(path)} {opt}" for opt in options if opt not in text]
    assert not missing, f"not in man/localrt.1: {missing}"


def test_the_synopsis_lists_every_command():
    synopsis = plain(section(MAN.read_text(), "SYNOPSIS"))
    missing, seen = [], set()

    def leaves(parser, prefix=()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    if id(child) in seen:  # an alias (models rm): its command is there
                        continue
                    seen.add(id(child))
                    if any(isinstance(a, argparse._SubParsersAction) for a in child._actions):
                        yield from leaves(child, prefix + (name,))
                    else:
                        yield prefix + (name,)

    for path in leaves(build_parser()):
        if not re.search(rf"^localrt {re.escape(' '.join(path))}\b", synopsis, re.M):
            missing.append(" ".join(path))
    assert not missing, f"not in localrt(1)'s SYNOPSIS: {missing}"


def test_files_section():
    text = man_text()
    assert ".SH FILES" in text and "~/.localrtrc" in text and "~/localrt/" in text


# --- localrtrc.5 -----------------------------------------------------------------------

RC = REPO / "man" / "localrtrc.5"


def shown(value) -> str:
    """A default as the page shows it: as a fresh settings file writes it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list):
        return "[" + ", ".join(value) + "]"
    return str(value) if value != "" else '""'


def defaults() -> dict:
    """Every key's default, with the home folder written ~."""
    from pathlib import Path

    values = {"_home": Path("~")}
    for key in settings.KEYS:
        values[key.name] = key.default(values) if callable(key.default) else key.default
    del values["_home"]
    return values


def test_every_settings_key_with_its_default_and_variable():
    keys = {tags[0]: text for tags, text in entries(section(RC.read_text(), "KEYS"))}
    assert list(keys) == [k.name for k in settings.KEYS], "one entry per key, in table order"
    for key in settings.KEYS:
        text = " ".join(keys[key.name].split())
        default = shown(defaults()[key.name])
        assert re.search(rf"Default: {re.escape(default)}(?![\w/]|\.\w)", text), \
            (key.name, default, text)
        if key.env:
            assert f"Environment: {key.env}" in text, key.name
        else:
            assert "Environment:" not in text, key.name
        if key.api:
            assert f"API name: {key.api}" in text, key.name


def environment_read_by_settings() -> set:
    """The variables settings.py reads: ENVIRONMENT, and every environ.get("X") or
    environ["X"] in its source (HOME among them)."""
    names = set(settings.ENVIRONMENT)
    tree = ast.parse((REPO / "localrt" / "settings.py").read_text())
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Subscript):
            target, key = node.value, node.slice
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "get" and node.args):
            target, key = node.func.value, node.args[0]
        if target is not None and "environ" in ast.unparse(target) \
                and isinstance(key, ast.Constant) and isinstance(key.value, str):
            names.add(key.value)
    return names


def test_every_environment_variable_of_the_settings():
    names = environment_read_by_settings()
    assert {"LOCALRT_CONFIG", "HOME"} <= names
    for page in (RC, MAN):
        documented = {tags[0] for tags, _ in entries(section(page.read_text(),
                                                              "ENVIRONMENT"))}
        assert names <= documented, (page.name, names - documented)


# --- localrt-api.7 ---------------------------------------------------------------------

API = REPO / "man" / "localrt-api.7"


def document_path(pattern: str) -> str:
    """A route pattern as GET /openapi.json writes it: {model_id:path} -> {model_id}."""
    return re.sub(r"\{(\w+):path\}", r"{\1}", pattern)


def body_fields(schema_name: str) -> list[str]:
    """The top-level properties of a request schema, those it takes through allOf too."""
    schema = json.loads((REPO / "schemas" / schema_name).read_text())
    fields = list(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        if "$ref" in part and not part["$ref"].startswith("#"):
            fields += body_fields(part["$ref"])
    return fields


def route_entries() -> dict:
    """Each route heading of ROUTES ("POST /v1/models/pull") -> the text of its entry."""
    found = {}
    for tags, text in entries(section(API.read_text(), "ROUTES")):
        for tag in tags:
            assert tag not in found, f"{tag} is described twice"
            found[tag] = text
    return found


def test_every_route_with_its_body_fields():
    described = route_entries()
    table = {f"{r.method} {document_path(r.pattern)}": r for r in ROUTES}
    assert set(described) == set(table), (set(table) - set(described),
                                           set(described) - set(table))
    for heading, route in table.items():
        text = described[heading]
        if route.schema:
            assert route.schema in text, (heading, route.schema)
            missing = [f for f in body_fields(route.schema)
                       if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]
            assert not missing, (heading, missing)
        assert len(text.split()) >= 3, f"{heading} says nothing"


def _name(node) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def error_codes() -> dict:
    """Every error code the package can produce -> its status (None where the code only
    appears in a stream's error event or a reply's error object).

    The `code` class attributes of localrt.errors.HTTPError and every class deriving from
    it anywhere under localrt/, `code=` keyword arguments, and {"code": "..."} literals."""
    classes, extra = {}, {}
    for path in sorted((REPO / "localrt").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                attrs = {t.id: s.value.value for s in node.body if isinstance(s, ast.Assign)
                         for t in s.targets if isinstance(t, ast.Name)
                         and isinstance(s.value, ast.Constant)}
                classes.setdefault(node.name, []).append(([_name(b) for b in node.bases],
                                                          attrs))
            elif isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "code" and isinstance(kw.value, ast.Constant) \
                            and isinstance(kw.value.value, str):
                        extra[kw.value.value] = None
            elif isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values):
                    if isinstance(k, ast.Constant) and k.value == "code" \
                            and isinstance(v, ast.Constant) and isinstance(v.value, str):
                        extra[v.value] = None

    def lookup(name, attr, seen=()):
        for bases, attrs in classes.get(name, []):
            if attr in attrs:
                return attrs[attr]
            for base in bases:
                if base not in seen:
                    value = lookup(base, attr, seen + (name,))
                    if value is not None:
                        return value
        return None

    def is_http_error(name, seen=()):
        return name == "HTTPError" or any(
            is_http_error(b, seen + (name,)) for bases, _ in classes.get(name, [])
            for b in bases if b not in seen)

    codes = dict(extra)
    for name in classes:
        if is_http_error(name):
            codes[lookup(name, "code")] = lookup(name, "status")
    return codes


def test_every_error_code_with_its_status():
    codes = error_codes()
    # the scan must see the core codes and ones defined outside errors.py
    assert {"internal_error", "invalid_field", "not_found", "conflict", "model_not_found",
            "engine_not_installed", "hub_rate_limited", "tls_verification_failed"} <= set(codes)
    listed = {}
    for tags, _ in entries(section(API.read_text(), "ERRORS")):
        match = re.fullmatch(r"(\w+)(?: \((\d{3})\))?", tags[0])
        assert match, tags[0]
        listed[match.group(1)] = int(match.group(2)) if match.group(2) else None
    assert set(listed) == set(codes), (set(codes) - set(listed), set(listed) - set(codes))
    wrong = {c: (listed[c], s) for c, s in codes.items() if s is not None and listed[c] != s}
    assert not wrong, f"documented status, real status: {wrong}"


# --- localrt-cortex.7 ------------------------------------------------------------------

CORTEX = REPO / "man" / "localrt-cortex.7"


def test_every_difference_from_cortex():
    text = " ".join(plain(section(CORTEX.read_text(), "DIFFERENCES")).split())
    for phrase in (
        '{"result", "modelHandle", "message"}',   # import and PATCH keep localrt's reply
        "a 409 (conflict), where cortex answers 400",   # a taken id
        "an unknown engine is a 404",
        "is not installed is a 409",
        "WebSocket at /events",                   # cortex's events ...
        "Server-Sent Events on GET /v1/events",   # ... are SSE here
        "There is no WebSocket /events",
        '"checksum": null where cortex writes "N/A"',
        "no download_count",
        "Not built: engine update, load and unload, and the remote-engine routes",
        "models list and engines install -s",
        "A whole record sent back through PATCH is a 400",
        "Relative import paths are refused",
    ):
        assert phrase in text, phrase
