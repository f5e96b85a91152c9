"""`localrt pull` and `localrt models ...` through main([...]), against the app on a real
port (thread_server) with the hub emulator behind it."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from emulators.ggufgen import write_gguf
from support.cli import run
from support.servers import subprocess_env

from localrt import cli, schemas
from localrt.cli import ExitCode, follow, output
from localrt.fsutil import human_size
from localrt.client import Client

pytestmark = pytest.mark.live

MODEL_YML = b"name: Tiny Q8\nengine: llama-cpp\nctx_len: 128\n"


class Terminal(io.StringIO):
    """A stream that says it is a terminal; as stdin it holds the user's answers."""

    def isatty(self):
        return True


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return SimpleNamespace(small=write_gguf(root / "small.gguf", name="small",
                                            context_length=256),
                           other=write_gguf(root / "other.gguf", name="other", seed=1))


@pytest.fixture
def hub_repos(weights):
    """The repos conftest's `hub` serves in this module."""

    def add(hub):
        hub.add_repo("cortexso/tiny", {"README.md": b"# tiny\n"},
                     branches={"q8": {"model.yml": MODEL_YML, "model.gguf": weights.small}})
        hub.add_repo("org/multi", {"a.Q4_0.gguf": weights.small, "b.Q8_0.gguf": weights.other})
        hub.add_repo("org/single", {"only.gguf": weights.small})

    return add


@pytest.fixture
def settings(settings, hub):
    """The conftest settings, pointed at the hub emulator before thread_server starts."""
    settings.update({"modelHubUrl": hub.url})
    return settings


@pytest.fixture
def client(thread_server):
    return Client(thread_server.url)


def wait_task(client, task_id, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        task = {t["id"]: t for t in client.list_pulls()}.get(task_id)
        if task and task["status"] not in ("Pending", "Downloading"):
            return task
        time.sleep(0.02)
    raise AssertionError(f"{task_id} still running")


def interrupt_on_first_progress(monkeypatch):
    """Ctrl-C once, as soon as the CLI shows the download's progress."""
    original, fired = output.Progress.update, []

    def update(self, task):
        if not fired:
            fired.append(task)
            raise KeyboardInterrupt
        return original(self, task)

    # Not monkeypatch.undo() in there: that would also undo the `home` fixture's HOME.
    monkeypatch.setattr(output.Progress, "update", update)


# --- pull ---------------------------------------------------------------------------


def test_pull_a_builtin_variant_then_list_it(thread_server, weights):
    code, out, err = run("pull", "tiny:q8")
    assert code == ExitCode.OK, err
    assert out == "Model tiny:q8 downloaded successfully!\n"
    assert "100%" in err and err.count("\n") == 1  # not a terminal: one progress line
    # The stream is open before the pull starts, so no event can be missed.
    calls = [c for c in thread_server.calls if c[1] in ("/v1/events", "/v1/models/pull")]
    assert calls == [("GET", "/v1/events"), ("POST", "/v1/models/pull")]

    code, out, err = run("models", "list")
    assert code == 0, err
    lines = out.splitlines()
    assert [c.strip() for c in lines[1].strip("|").split("|")] == \
        ["(Index)", "ID", "Engine", "Version", "Size", "Status"]
    [row] = [line for line in lines if "tiny:q8" in line]
    size = weights.small.stat().st_size + len(MODEL_YML)
    assert [c.strip() for c in row.strip("|").split("|")] == \
        ["1", "tiny:q8", "gguf-cpp", "1", human_size(size), "downloaded"]

    code, out, _ = run("models", "pull", "tiny:q8")
    assert code == 0 and out == "Model tiny:q8 is already downloaded\n"


def test_pull_polls_when_every_event_stream_slot_is_taken(thread_server, client):
    # Each pull leaves its stream's slot taken until the server next writes to it.
    for _ in range(5):
        assert run("pull", "tiny:q8")[0] == 0
    code, out, err = run("pull", "org/single")
    assert code == 0, err
    assert out == "Model org:single:only.gguf downloaded successfully!\n"
    assert ("GET", "/v1/models/pull") in thread_server.calls  # it polled


def test_a_repo_with_several_ggufs_needs_a_choice_without_a_terminal(thread_server, client):
    code, out, err = run("models", "pull", "org/multi")
    assert code == ExitCode.ERROR and out == ""
    assert "a.Q4_0.gguf" in err and "b.Q8_0.gguf" in err
    assert "--file NAME" in err and "org/multi:NAME" in err
    assert client.list_pulls() == []


def test_a_terminal_is_asked_which_file(thread_server, client):
    answers = Terminal("0\nnope\n2\n")
    screen = Terminal()
    code, out, err = run("pull", "org/multi", stdin=answers, stderr=screen)
    assert code == 0, err
    assert out == "Model org:multi:b.Q8_0.gguf downloaded successfully!\n"
    assert "1. a.Q4_0.gguf" in err and "2. b.Q8_0.gguf" in err
    assert err.count("Choose a file [1-2]: ") == 3
    assert err.count("Please answer with a number from 1 to 2") == 2
    assert "B/s" in err and "\r" in err  # a tqdm bar on the terminal
    assert [m["id"] for m in client.list_models()] == ["org:multi:b.Q8_0.gguf"]


def test_end_of_input_chooses_nothing(thread_server, client):
    code, _, err = run("pull", "org/multi", stdin=Terminal(""))
    assert code == ExitCode.ERROR and "No file chosen" in err
    assert client.list_pulls() == []


def test_file_option(thread_server, client):
    code, out, err = run("pull", "org/multi", "--file", "a.Q4_0.gguf")
    assert code == 0, err
    assert out == "Model org:multi:a.Q4_0.gguf downloaded successfully!\n"
    assert [m["id"] for m in client.list_models()] == ["org:multi:a.Q4_0.gguf"]


def test_a_failed_download_exits_1_with_the_servers_reason(thread_server, hub, client):
    hub.corrupt = True
    code, out, err = run("pull", "org/single")
    assert code == ExitCode.ERROR and out == ""
    assert "Download org:single:only.gguf failed" in err and "checksum mismatch" in err
    assert client.list_models() == []


def test_server_errors_go_through_the_one_error_path(thread_server):
    code, out, err = run("pull", "org/missing")
    assert code == ExitCode.ERROR and out == ""
    assert err.startswith("Error: ") and "No such model on the hub" in err


def test_ctrl_c_answered_y_cancels(thread_server, hub, client, monkeypatch):
    hub.delay_per_chunk = 0.2
    interrupt_on_first_progress(monkeypatch)
    code, _, err = run("pull", "org/single", stdin=Terminal("y\n"))
    assert code == ExitCode.INTERRUPTED == 130
    assert "Cancel the download? [y/N] " in err
    assert "Download org:single:only.gguf cancelled" in err
    assert wait_task(client, "org:single:only.gguf")["status"] == "Stopped"
    assert client.list_models() == []


def test_ctrl_c_without_a_terminal_cancels(thread_server, hub, client, monkeypatch):
    hub.delay_per_chunk = 0.2
    interrupt_on_first_progress(monkeypatch)
    code, _, err = run("pull", "org/single")
    assert code == 130 and "Cancel the download?" not in err
    assert "cancelled" in err
    assert wait_task(client, "org:single:only.gguf")["status"] == "Stopped"


def test_ctrl_c_answered_n_leaves_it_running_and_a_new_pull_follows_it(
        thread_server, hub, client, monkeypatch):
    hub.delay_per_chunk = 0.1
    interrupt_on_first_progress(monkeypatch)
    code, out, err = run("pull", "org/single", stdin=Terminal("n\n"))
    assert code == 130
    assert "continues in the server" in err and "localrt pull org/single" in err
    [task] = client.list_pulls()
    assert task["status"] == "Downloading"

    code, out, err = run("pull", "org/single")  # the 409 is followed, not reported
    assert code == 0, err
    assert "already downloading" in err and out.endswith(" downloaded successfully!\n")
    assert [m["id"] for m in client.list_models()] == ["org:single:only.gguf"]


def test_a_stream_that_ends_early_is_answered_from_the_task_list(thread_server, client):
    args = SimpleNamespace(config=None)
    ctx = cli.Context(args, io.StringIO(), io.StringIO())
    task = client.pull_model("org/single")["task"]
    wait_task(client, task["id"])
    assert follow.follow(ctx, client, iter([]), task, "Model m", "downloaded",
                          "localrt pull org/single") == ExitCode.OK
    assert ctx.stdout.getvalue() == "Model m downloaded\n"
    with pytest.raises(cli.CliError) as caught:
        follow.follow(ctx, client, iter([]), {"id": "org:nope:x.gguf", "items": []},
                      "Model m", "downloaded", "localrt pull x")
    assert caught.value.code == ExitCode.UNAVAILABLE


# --- models get, update, remove, import ---------------------------------------------------


def test_import_get_update_remove(thread_server, client, weights, tmp_path, monkeypatch):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "my.gguf").write_bytes(weights.small.read_bytes())
    monkeypatch.chdir(tmp_path)
    model = "team/mine:v1%"  # "/", ":" and "%" must survive the URL path
    code, out, err = run("models", "import", "--path", "w/my.gguf", "--id", model)
    assert code == 0, err
    path = tmp_path / "w" / "my.gguf"
    assert out == f"Successfully import model from '{path}' for modelID '{model}'.\n"
    code, out, err = run("models", "import", "--path", "w/my.gguf", "--copy")
    assert code == 0, err
    assert out == f"Successfully import model from '{path}' for modelID 'my'.\n"

    code, out, err = run("models", "get", model)
    assert code == 0, err
    record = json.loads(out)
    assert record["id"] == model and out.startswith('{\n  "id"')
    assert record["source"] == {"type": "import", "option": "symlink",
                                "path": str(tmp_path / "w" / "my.gguf")}
    assert client.get_model("my")["source"]["option"] == "copy"

    code, out, err = run("models", "update", model, "--ctx_len", "64", "--flash_attn", "on",
                         "--stop", "</s>", "--stop", "a,b", "--cache_type", "q8_0",
                         "--temperature", "0.25", "--name", "Mine")
    assert code == 0, err
    assert out.startswith(f"Model {model} updated: ")
    assert 'ctx_len=64, flash_attn=true, cache_type="q8_0", stop=["</s>", "a,b"]' in out
    after = client.get_model(model)
    assert (after["ctx_len"], after["flash_attn"], after["stop"], after["cache_type"],
            after["temperature"], after["name"]) == (64, True, ["</s>", "a,b"], "q8_0", 0.25,
                                                     "Mine")
    assert run("models", "update", model, "--stop", "")[0] == 0
    assert client.get_model(model)["stop"] == []

    code, out, err = run("models", "list")
    assert code == 0 and model in out and " my " in out

    code, out, err = run("models", "rm", model)
    assert code == 0 and out == f"Model {model} deleted successfully\n", err
    code, out, err = run("models", "get", model)
    assert code == ExitCode.ERROR and "not found" in err
    assert (tmp_path / "w" / "my.gguf").exists()  # an imported file is never deleted


def test_update_errors(thread_server, client, weights):
    client.import_model(str(weights.small), "m")
    before = len(thread_server.calls)
    assert run("models", "update", "m")[0] == ExitCode.USAGE  # nothing to change
    code, _, err = run("models", "update", "m", "--ctx_len", "many")
    assert code == ExitCode.USAGE and "invalid int value" in err
    code, _, err = run("models", "update", "m", "--cache_type", "f8")
    assert code == ExitCode.USAGE and "invalid choice" in err
    assert len(thread_server.calls) == before  # usage errors send nothing

    code, out, err = run("models", "update", "m", "--ctx_len", "0")
    assert code == ExitCode.ERROR and out == ""
    assert err.startswith("Error: ") and "ctx_len" in err
    code, _, err = run("models", "update", "nope", "--ctx_len", "8")
    assert code == ExitCode.ERROR and "Model nope not found" in err


def test_empty_list_and_bad_import(thread_server, tmp_path):
    code, out, _ = run("models", "list")
    assert code == 0 and "No models downloaded yet" in out
    (tmp_path / "x.gguf").write_bytes(b"not gguf")
    code, _, err = run("models", "import", "--path", str(tmp_path / "x.gguf"))
    assert code == ExitCode.ERROR and "is not a GGUF file" in err


def subcommand(parser, *names):
    """The argparse parser of a subcommand: subcommand(build_parser(), "models", "update")."""
    for name in names:
        [choices] = [a.choices for a in parser._actions
                     if isinstance(a, argparse._SubParsersAction)]
        parser = choices[name]
    return parser


def test_update_flags_are_the_schema():
    """`models update` has a flag for every property of schemas/model-update.json but the
    id and a remote model's upstreams, in the schema's order, typed as the schema says."""
    properties = schemas.load("model-update.json")["properties"]
    wanted = [name for name in properties if name not in ("id", "upstreams")]
    update = subcommand(cli.build_parser(), "models", "update")
    flags = {a.dest.removeprefix("param_"): a for a in update._actions
             if a.dest.startswith("param_")}
    assert list(flags) == wanted
    for name, action in flags.items():
        assert action.option_strings == [f"--{name}"], name
        spec = properties[name]
        if "$ref" in spec:
            target, _, pointer = spec["$ref"].partition("#/properties/")
            spec = schemas.load(target)["properties"][pointer]
        if "enum" in spec:
            assert list(action.choices) == spec["enum"], name
        elif spec.get("type") in ("integer", "number"):
            assert action.type is {"integer": int, "number": float}[spec["type"]], name
        elif spec.get("type") == "array":
            assert action.nargs is None and isinstance(action, argparse._AppendAction), name


def test_help_stays_light(home):
    code = ("import sys, io; from localrt.cli import main;"
            "[main(a, stdout=io.StringIO(), stderr=io.StringIO()) for a in "
            "(['--help'], ['models', 'update', '-h'], ['pull', '-h'])];"
            "print([m for m in ('tqdm', 'jsonschema') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(home),
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.fixture
def cortexso(hub, weights):
    hub.add_cortexso("llama", {"1b": {"model.gguf": weights.small},
                               "8b": {"model.gguf": weights.other, "model.yml": MODEL_YML}},
                     default="1b")
    return hub


def test_a_terminal_sees_the_variants_and_enter_takes_the_default(thread_server, client,
                                                                  cortexso, weights):
    code, out, err = run("pull", "llama", stdin=Terminal("\n"), stderr=Terminal())
    assert code == 0, err
    assert out == "Model llama:1b downloaded successfully!\n"
    assert "llama has 2 variants:" in err
    lines = [line for line in err.splitlines() if line.startswith("  ")]
    assert lines[0].split()[:2] == ["1.", "1b"] and lines[0].endswith("(default)")
    assert lines[1].split()[:2] == ["2.", "8b"] and "(default)" not in lines[1]
    sizes = {row["name"]: row["size"] for row in client.model_variants("llama")["data"]}
    assert sizes["1b"] > weights.small.stat().st_size  # the weights and the small files
    assert human_size(sizes["1b"]) in lines[0] and human_size(sizes["8b"]) in lines[1]
    assert "Choose a variant [1-2, Enter for 1b]: " in err
    assert [m["id"] for m in client.list_models()] == ["llama:1b"]


def test_a_terminal_can_choose_another_variant(thread_server, client, cortexso):
    code, out, err = run("pull", "llama", stdin=Terminal("8b\n"), stderr=Terminal())
    assert code == 0, err
    assert out == "Model llama:8b downloaded successfully!\n"
    assert client.get_model("llama:8b")["name"] == "Tiny Q8"


def test_without_a_terminal_the_default_is_taken_without_asking(thread_server, client,
                                                                cortexso):
    code, out, err = run("pull", "llama")
    assert code == 0, err
    assert out == "Model llama:1b downloaded successfully!\n" and "Choose" not in err
