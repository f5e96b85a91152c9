"""Every package localrt imports is declared in setup.cfg, or is an engine's, imported lazily.

Each import in localrt/ is one of: the standard library, localrt itself, a
distribution in setup.cfg's install_requires, or the module a built-in engine's
adapter loads (localrt.engines.catalog, EngineSpec.module), which only a function
body may import, so that localrt runs without that engine installed. And every
declared distribution is imported somewhere, so none is declared for nothing.
"""

from __future__ import annotations

import ast
import configparser
import re
import sys
from pathlib import Path

from support import REPO

from localrt.engines.catalog import CATALOG

PACKAGE = REPO / "localrt"
# A distribution whose import name is not its own name, lower-cased with - as _.
IMPORT_NAMES = {"pyyaml": "yaml", "llama-cpp-python": "llama_cpp"}


def declared() -> dict[str, str]:
    """install_requires as {import name: distribution name}."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    out = {}
    for line in cfg["options"]["install_requires"].strip().splitlines():
        dist = re.match(r"[A-Za-z0-9._-]+", line.strip()).group(0)
        out[IMPORT_NAMES.get(dist.lower(), dist.lower().replace("-", "_"))] = dist
    return out


def engine_modules() -> set[str]:
    """The top-level modules the built-in engines' adapters import, other than localrt."""
    return {spec.module.split(".")[0] for spec in CATALOG.values()} - {"localrt"}


def imports() -> list[tuple[str, int, str, bool]]:
    """(file, line, top-level module, inside a function) for each absolute import."""
    found = []

    def visit(node: ast.AST, path: Path, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0:
                names = [child.module]
            else:
                names = []
            for name in names:
                found.append((str(path.relative_to(REPO)), child.lineno, name.split(".")[0],
                              in_function))
            visit(child, path, in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    for path in sorted(PACKAGE.rglob("*.py")):
        visit(ast.parse(path.read_text(encoding="utf-8")), path, False)
    return found


def test_every_import_is_stdlib_localrt_declared_or_a_lazy_engine_module():
    allowed, engines = set(declared()), engine_modules()
    wrong = []
    for where, line, module, in_function in imports():
        if module in sys.stdlib_module_names or module == "localrt" or module in allowed:
            continue
        if module in engines and in_function:
            continue
        why = "an engine's module, imported outside a function" if module in engines \
            else "not declared in setup.cfg install_requires"
        wrong.append(f"{where}:{line}: {module}: {why}")
    assert wrong == []


def test_every_declared_dependency_is_imported():
    used = {module for _, _, module, _ in imports()}
    unused = {dist for module, dist in declared().items() if module not in used}
    assert unused == set()


def test_the_engine_modules_are_known():
    # Guards the test above: a catalog without these would allow nothing lazily.
    assert engine_modules() >= {"llama_cpp", "onnxruntime_genai"}
