"""The package's shape stays what README.rst's Development section says.

Which package may import which (LAYERS), no import cycles (lazy imports inside
functions count too), and only the adapters and the engine catalog know engines by
name. How long a module is, is a review's business: one job per module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "localrt"
# The only modules that may compare or spell out the built-in engines' names: the
# engines' adapters and the catalog.
ENGINE_NAME_OWNERS = {"localrt.engines.catalog", "localrt.engines.llama.model",
                      "localrt.engines.llama.embedding", "localrt.engines.onnx"}
ENGINE_NAMES = ("gguf-cpp", "onnx-runtime")
ENGINE_CONSTANTS = ("GGUF_ENGINE", "ONNX_ENGINE")


# Who may import whom. Each part of the package, top down, with the parts it may import
# besides itself: a request comes in through the server and the app, the route table
# and its services, and goes down through the dialects to the one request path
# (inference), which uses models and engines, and a remote model's upstreams (remote,
# which writes native requests in OpenAI's wire and reads the replies back); downloads
# serve models and engines; the HTTP core's leaves (CORE), the native vocabulary and
# the outbound opener among them, serve everyone. The CLI talks to the server only
# through the client (it may start the server). If an arrow is new, decide it here.
CORE = {"localrt", "localrt.native", "localrt.errors", "localrt.outbound", "localrt.web", "localrt.admission",
        "localrt.fsutil", "localrt.settings", "localrt.security", "localrt.config",
        "localrt.routing", "localrt.schemas", "localrt.multipart", "localrt.events",
        "localrt.metrics", "localrt.bootstrap"}
LAYERS = {
    "localrt.__main__": {"localrt.cli"},
    "localrt.cli": {"localrt.client", "localrt.server"} | CORE,
    "localrt.client": CORE,
    "localrt.server": {"localrt.app", "localrt.connections"} | CORE,
    "localrt.connections": CORE,
    "localrt.app": {"localrt.api", "localrt.services", "localrt.openapi"} | CORE,
    "localrt.api": {"localrt.services", "localrt.openapi", "localrt.dialects",
                    "localrt.models"} | CORE,
    "localrt.openapi": CORE,
    "localrt.services": {"localrt.dialects", "localrt.remote", "localrt.inference",
                         "localrt.models", "localrt.engines", "localrt.downloads"} | CORE,
    "localrt.dialects": {"localrt.inference", "localrt.models", "localrt.engines"} | CORE,
    "localrt.inference": {"localrt.remote", "localrt.models", "localrt.engines"} | CORE,
    "localrt.remote": {"localrt.models", "localrt.engines"} | CORE,
    "localrt.models": {"localrt.engines", "localrt.downloads"} | CORE,
    "localrt.engines": {"localrt.downloads"} | CORE,
    "localrt.downloads": CORE,
}
# The core's leaves, bottom up: each may import those before it.
CORE_ORDER = ("localrt.native", "localrt.errors", "localrt.outbound", "localrt.web", "localrt.admission",
              "localrt.fsutil", "localrt.settings", "localrt.security", "localrt.config",
              "localrt.routing", "localrt.schemas", "localrt.multipart", "localrt.events",
              "localrt.metrics", "localrt.bootstrap")


def part_of(name: str) -> str:
    """The part of the package a module belongs to: its subpackage, or itself."""
    parts = name.split(".")
    return ".".join(parts[:2])


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: dict) -> set[str]:
    """The package modules `name` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target not in (name, "localrt"):
                found.add(target)
    return found


def test_each_part_imports_only_the_parts_below_it():
    known = modules()
    assert {part_of(n) for n in known} == set(LAYERS) | CORE, \
        "a new part of the package: give it its place in LAYERS (or CORE)"
    wrong = []
    for name, path in known.items():
        part = part_of(name)
        for dep in sorted(imports_of(name, path, known)):
            target = part_of(dep)
            if target == part:
                continue
            if part in CORE:
                allowed = set(CORE_ORDER[:CORE_ORDER.index(part)]) | {"localrt"} \
                    if part in CORE_ORDER else set()
            else:
                allowed = LAYERS[part]
            if target not in allowed:
                wrong.append(f"{name} -> {dep}")
    assert wrong == []


def test_the_import_graph_has_no_cycles():
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    cycles = []
    state: dict[str, str] = {}  # name -> "open" while on the path, "done" after

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


@pytest.mark.parametrize("name", sorted(set(modules()) - ENGINE_NAME_OWNERS))
def test_only_the_adapters_and_the_catalog_know_engines_by_name(name):
    tree = ast.parse(modules()[name].read_text())
    seen = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value in ENGINE_NAMES:
            seen.add(node.value)
        elif isinstance(node, ast.Name) and node.id in ENGINE_CONSTANTS:
            seen.add(node.id)
        elif isinstance(node, ast.alias) and node.name in ENGINE_CONSTANTS:
            seen.add(node.name)
    assert seen == set()


# OpenAI's shapes, which only its dialect (and the remote upstreams' wire) write or read.
OPENAI_SHAPES = ("chat.completion", "chat.completion.chunk", "text_completion", "delta",
                 "choices")


def _string_literals(path: Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_the_core_speaks_native_events_not_openais_json():
    """No module of inference or engines builds or reads an OpenAI chunk or message: the
    native vocabulary (localrt.native) is theirs, and OpenAI is a dialect."""
    found = [f"{name}: {literal!r}" for name, path in modules().items()
             if part_of(name) in ("localrt.inference", "localrt.engines")
             for literal in sorted(_string_literals(path) & set(OPENAI_SHAPES))]
    assert found == []


def test_native_is_a_leaf():
    known = modules()
    assert imports_of("localrt.native", known["localrt.native"], known) == set()


def test_no_dialect_sees_the_services_or_the_scheduler():
    """Every dialect reads its body into a native request and writes the events; starting
    a model and keep-alive go through the request path."""
    known = modules()
    wrong = [f"{name} -> {dep}" for name, path in known.items()
             if part_of(name) == "localrt.dialects"
             for dep in imports_of(name, path, known)
             if dep in ("localrt.services", "localrt.inference.scheduler")]
    assert wrong == []
