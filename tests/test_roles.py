"""The table of model file roles (localrt.models.roles): its rows, how a file's name
finds its role, the name a file gets in a model's folder, the projector a pull picks
among a repo's files, and that the modules around it ask the table instead of spelling
a role's key. How each role goes through imports, PATCHes, pulls and starts is
tests/test_vision_models.py's, tests/test_pull_layout.py's and tests/test_vision_api.py's.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from emulators.ggufgen import write_gguf
from support.projectors import write_projector

from localrt import schemas
from localrt.cli.parser import build_parser
from localrt.errors import InvalidField
from localrt.models import roles
from localrt.models.hub import HubFile
from localrt.models.roles import ADAPTER, BESIDE, PROJECTOR, ROLES, WEIGHTS

PACKAGE = Path(roles.__file__).resolve().parent.parent


def test_the_table_has_the_weights_the_projector_and_the_adapters():
    assert [r.name for r in ROLES] == ["weights", "projector", "adapter"]
    assert BESIDE == (PROJECTOR, ADAPTER) and roles.KEYS == ("mmproj", "lora")
    assert [r.many for r in ROLES] == [False, False, True]
    assert WEIGHTS.key is None and WEIGHTS.prefix is None and WEIGHTS.pick is None
    assert len({r.name for r in ROLES}) == len(ROLES)
    assert len(set(roles.KEYS)) == len(roles.KEYS)


@pytest.mark.parametrize("role", BESIDE, ids=lambda r: r.name)
def test_each_role_beside_the_weights_is_whole(role):
    # What a row promises: a name to find its files by, a check, and its key taken by
    # an import body, a PATCH (model-yml.json, which model-update.json takes) and the
    # CLI's import and update (repeated, for a role of many files); a pick, unless
    # its files are never pulled (the adapters).
    assert role.prefix and callable(role.check)
    assert callable(role.pick) or role is ADAPTER
    assert role.key in schemas.load("model-import.json")["properties"]
    assert role.key in schemas.load("model-yml.json")["properties"]
    parser = build_parser()
    flag = f"--{role.key}"
    imported = parser.parse_args(["models", "import", "--path", "/m.gguf", flag, "/p.gguf"])
    updated = parser.parse_args(["models", "update", "m", flag, "/p.gguf"])
    given = ["/p.gguf"] if role.many else "/p.gguf"
    assert getattr(imported, role.key) == getattr(updated, role.key) == given


@pytest.mark.parametrize("path, role", [
    ("mmproj-F16.gguf", PROJECTOR),
    ("sub/MMPROJ-model-q8_0.GGUF", PROJECTOR),
    ("mmproj.gguf", PROJECTOR),
    ("model.Q4_K_M.gguf", WEIGHTS),
    ("model-mmproj.gguf", WEIGHTS),   # the prefix starts the name
    ("mmproj-notes.txt", WEIGHTS),    # a projector is a GGUF
    ("mmproj/model.gguf", WEIGHTS),   # a folder's name says nothing
    ("lora-first.gguf", ADAPTER),
    ("LoRA-x.GGUF", ADAPTER),
    ("model-lora.gguf", WEIGHTS),
])
def test_a_files_name_says_its_role(path, role):
    assert roles.role_of(path) is role


@pytest.mark.parametrize("src, taken, name", [
    ("mmproj-F16.gguf", set(), "mmproj-F16.gguf"),
    ("vision-64.gguf", set(), "mmproj-vision-64.gguf"),
    ("projector", set(), "mmproj-projector.gguf"),
    ("mmproj-F16.gguf", {"mmproj-F16.gguf"}, "mmproj-1-mmproj-F16.gguf"),
    ("mmproj-F16.gguf", {"mmproj-F16.gguf", "mmproj-1-mmproj-F16.gguf"},
     "mmproj-2-mmproj-F16.gguf"),
])
def test_a_file_gets_a_name_its_role_claims_and_no_other_file_has(src, taken, name):
    got = PROJECTOR.file_name(Path("/elsewhere") / src, taken)
    assert got == name and PROJECTOR.claims(got) and roles.role_of(got) is PROJECTOR


def hub_files(*names_and_sizes):
    return [HubFile(name, size, None) for name, size in names_and_sizes]


@pytest.mark.parametrize("listing, chosen", [
    ([("m.Q4_K_M.gguf", 9)], None),
    ([("m.Q4_K_M.gguf", 9), ("mmproj-m-Q6_K.gguf", 3)], "mmproj-m-Q6_K.gguf"),
    ([("mmproj-m-Q8_0.gguf", 4), ("mmproj-m-F16.gguf", 8), ("mmproj-m-BF16.gguf", 8)],
     "mmproj-m-F16.gguf"),
    ([("mmproj-m-Q8_0.gguf", 4), ("mmproj-m-fp16.gguf", 8)], "mmproj-m-fp16.gguf"),
    ([("mmproj-m-Q8_0.gguf", 4), ("mmproj-m-BF16.gguf", 8)], "mmproj-m-BF16.gguf"),
    ([("mmproj-m-Q4_0.gguf", 2), ("mmproj-m-Q8_0.gguf", 4)], "mmproj-m-Q8_0.gguf"),
    ([("mmproj-m-Q4_K_M.gguf", 2), ("mmproj-m-Q6_K.gguf", 3)], "mmproj-m-Q6_K.gguf"),
    ([("mmproj-b.gguf", 3), ("mmproj-a.gguf", 3)], "mmproj-a.gguf"),  # as large: by name
])
def test_a_pull_picks_one_projector(listing, chosen):
    picked = PROJECTOR.pick(hub_files(*listing))
    assert (picked and picked.path) == chosen


def test_a_record_names_its_files_beside_the_weights(tmp_path):
    record = {"path": str(tmp_path), "files": [{"path": "m.gguf"}, {"path": "mmproj.gguf"}],
              "mmproj": "mmproj.gguf"}
    assert PROJECTOR.path(record) == tmp_path / "mmproj.gguf"
    assert roles.beside(record) == {"mmproj": str(tmp_path / "mmproj.gguf")}
    assert WEIGHTS.path(record) is None
    assert roles.beside({"path": str(tmp_path), "files": [{"path": "m.gguf"}]}) == {}


def test_a_body_gives_files_by_role():
    assert roles.given({"path": "/m.gguf", "mmproj": "/p.gguf", "top_k": 2}) == \
        {PROJECTOR: "/p.gguf"}
    assert roles.given({"mmproj": None, "top_k": 2}) == {}
    # adapters with their scales (1.0 when left out); an empty list drops them
    assert roles.given({"lora": [{"path": "/a.gguf"}, {"path": "/b.gguf", "scale": 0}]}) == \
        {ADAPTER: [{"path": "/a.gguf", "scale": 1.0}, {"path": "/b.gguf", "scale": 0.0}]}
    assert roles.given({"lora": []}) == {ADAPTER: []}


def test_a_record_names_its_adapters_in_order_with_absolute_paths(tmp_path):
    record = {"path": str(tmp_path), "files": [{"path": "m.gguf"}, {"path": "lora-a.gguf"},
                                                {"path": "lora-b.gguf"}],
              "lora": [{"path": "lora-b.gguf", "scale": 0.5}, {"path": "lora-a.gguf"}]}
    assert ADAPTER.names(record) == ["lora-b.gguf", "lora-a.gguf"]
    assert roles.beside(record) == {"lora": [
        {"path": str(tmp_path / "lora-b.gguf"), "scale": 0.5},
        {"path": str(tmp_path / "lora-a.gguf"), "scale": 1.0}]}


def test_the_check_takes_a_pair_and_names_the_key(tmp_path):
    model = write_gguf(tmp_path / "tiny.gguf", name="tiny")
    good = write_projector(tmp_path / "p64.gguf", 64)
    assert PROJECTOR.check(str(good), model) == good
    with pytest.raises(InvalidField) as caught:
        PROJECTOR.check(str(write_projector(tmp_path / "p96.gguf", 96)), model)
    assert caught.value.param == "mmproj"
    assert caught.value.message.startswith("Invalid field 'mmproj': the projector ")


def test_an_update_of_a_running_model_says_it_keeps_its_file():
    assert PROJECTOR.running_note == ("; it is running with the projector it started with, "
                                      "and loads this one when it is started again")
    assert ADAPTER.running_note == ("; it is running with the adapters it started with, "
                                    "and loads these when it is started again")


# The modules that take a model's files to pieces; each asks the table for a role's key.
ASKING = ("models/imports.py", "models/pulls.py", "models/registry.py", "models/ids.py",
          "models/options.py", "inference/scheduler.py", "api.py")


@pytest.mark.parametrize("module", ASKING)
def test_no_module_but_the_table_spells_a_roles_key(module):
    tree = ast.parse((PACKAGE / module).read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    spelled = [node.lineno for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str)
               and id(node) not in docstrings
               and any(_spells(node.value, key) for key in roles.KEYS)]
    assert spelled == []


def _spells(text: str, key: str) -> bool:
    """Whether `text` names the key as a field would ("lora", "'lora'", "lora[0]"), not
    inside a route's path or a name ("/lora-adapters", "lora-adapters.json")."""
    return re.search(rf"(?<![\w/-]){re.escape(key)}(?![\w-])", text) is not None
