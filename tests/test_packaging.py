"""A built wheel carries every subpackage, the schemas, the chat page's files and every man
page, and works installed."""

import shutil
import subprocess
import sys
import zipfile

import pytest
from support import REPO

pytestmark = pytest.mark.slow


def subpackages() -> list[str]:
    """Every package under localrt/: each folder with an __init__.py, as a dotted name."""
    return sorted(".".join(p.parent.relative_to(REPO).parts)
                  for p in (REPO / "localrt").rglob("__init__.py"))


def test_wheel_has_every_subpackage_the_schemas_the_page_and_man_pages(tmp_path):
    src = tmp_path / "src"
    for name in ("localrt", "schemas", "man"):
        shutil.copytree(REPO / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "setup.cfg", "README.rst"):
        shutil.copy(REPO / name, src / name)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(dist), str(src)], check=True, capture_output=True)
    wheel = next(dist.glob("localrt-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    # setup.cfg finds the packages (find:); every module of each must be in the wheel
    modules = {str(p.relative_to(REPO)) for p in (REPO / "localrt").rglob("*.py")}
    assert modules - set(names) == set()
    assert {"localrt.engines", "localrt.models", "localrt.dialects"} <= set(subpackages())
    schemas = sorted(p.name for p in (REPO / "schemas").glob("*.json"))
    for name in schemas:
        assert f"localrt/_schemas/{name}" in names
    web = sorted(p.name for p in (REPO / "localrt" / "web").iterdir()
                 if p.suffix in (".html", ".js", ".css", ".svg"))
    assert {"index.html", "app.js", "style.css"} <= set(web)
    for name in web:
        assert f"localrt/web/{name}" in names
    # what localrt.engines.builds applies to an sdist it compiles: the patches and the
    # CMake include that leaves llama.cpp's common library out (localrt.bootstrap.NO_COMMON)
    patches = sorted(p.name for p in (REPO / "localrt" / "engines" / "patches").iterdir())
    assert "llama-cpp-python-no-common.cmake" in patches
    for name in patches:
        assert f"localrt/engines/patches/{name}" in names
    assert not any(n.startswith("docs/") for n in names)  # the README's screenshot stays out
    pages = sorted((REPO / "man").glob("*.[1-9]"))
    assert {p.name for p in pages} >= {"localrt.1", "localrtrc.5", "localrt-api.7",
                                       "localrt-cortex.7"}
    for page in pages:
        # each page in its section's folder: localrt.1 in man1, localrtrc.5 in man5
        where = f".data/data/share/man/man{page.suffix[1:]}/{page.name}"
        assert any(n.endswith(where) for n in names), (where, names)

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, capture_output=True)
    # Every subpackage imports from the installed copy, not from this checkout.
    code = ("import importlib, sys; from localrt import schemas, web; "
            "print(schemas.schema_dir());"
            "print(schemas.load('config-update.json')['title'], len(web.names()), "
            "web.read('index.html')[1]);"
            "[print(importlib.import_module(name).__file__) for name in sys.argv[1:]]")
    out = subprocess.run([sys.executable, "-c", code, *subpackages()], cwd=str(tmp_path),
                         check=True, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True).stdout.splitlines()
    assert str(target / "localrt" / "_schemas") in out[0]
    assert out[1] == f"Config update {len(web)} text/html; charset=utf-8"
    assert len(out[2:]) == len(subpackages())
    for name, file in zip(subpackages(), out[2:]):
        assert file == str(target.joinpath(*name.split("."), "__init__.py")), (name, file)
