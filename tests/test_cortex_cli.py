"""cortex.cpp's command line: its flags and names (`models import --model_id
--model_path`, `models delete`, `engines install -v/-m`), the columns `models list`
shows first, and its success lines, which a script greps on stdout while the news that
the server was started goes to stderr.

Through main([...]) in this process against the app on a real port (thread_server),
with a hub emulator and a package index of small onnxruntime-genai wheels behind it;
the server that a command starts itself is a real child process.
"""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from emulators.enginepkg import build_wheel
from emulators.ggufgen import write_gguf
from emulators.pkgindex import PackageIndex
from support.cli import run
from support.servers import subprocess_env

from localrt.cli import ExitCode
from localrt.client import Client

pytestmark = pytest.mark.live


class Terminal(io.StringIO):
    """A stream that says it is a terminal; as stdin it holds the user's answers."""

    def isatty(self):
        return True


def rows(out):
    """The cells of a bordered table's lines: [["(Index)", "ID", ...], ["1", ...]]."""
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in out.splitlines() if line.startswith("|")]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("weights") / "small.gguf", name="small")


@pytest.fixture
def hub_repos(gguf):
    """The repos conftest's `hub` serves in this module."""

    def add(hub):
        hub.add_repo("cortexso/tiny", {"README.md": b"# tiny\n"},
                     branches={"q8": {"model.yml": b"engine: llama-cpp\nversion: '2'\n",
                                      "model.gguf": gguf}})

    return add


@pytest.fixture
def index(tmp_path):
    """Two versions of a small onnxruntime-genai wheel: onnx-runtime installs in a blink."""
    root = tmp_path / "index"
    for version in ("0.17.0", "0.18.1"):
        build_wheel(root, "onnxruntime-genai", version,
                    {"onnxruntime_genai/__init__.py": f"__version__ = {version!r}\n"})
    with PackageIndex(root) as emu:
        yield emu


@pytest.fixture
def settings(settings, hub, index):
    settings.update({"modelHubUrl": hub.url, "engineIndexUrl": index.url})
    return settings


@pytest.fixture
def client(thread_server):
    return Client(thread_server.url)


# --- models ------------------------------------------------------------------------------


def test_import_with_cortexs_flags_prints_cortexs_line(thread_server, client, gguf,
                                                        tmp_path, monkeypatch):
    monkeypatch.chdir(gguf.parent)
    code, out, err = run("models", "import", "--model_id", "mine", "--model_path",
                         "small.gguf")
    assert code == ExitCode.OK, err
    assert out == f"Successfully import model from '{gguf}' for modelID 'mine'.\n"
    assert err == ""
    assert client.get_model("mine")["source"] == {"type": "import", "option": "symlink",
                                                  "path": str(gguf)}
    # localrt's own spelling prints the same line; without an id, the file names it.
    code, out, err = run("models", "import", "--path", str(gguf), "--copy")
    assert code == ExitCode.OK, err
    assert out == f"Successfully import model from '{gguf}' for modelID 'small'.\n"
    assert client.get_model("small")["source"]["option"] == "copy"


def test_import_needs_a_path(thread_server):
    before = len(thread_server.calls)
    code, out, err = run("models", "import", "--model_id", "mine")
    assert code == ExitCode.USAGE and out == ""
    assert "--path/--model_path" in err
    assert len(thread_server.calls) == before


def test_import_failure_prints_no_success_line(thread_server, tmp_path):
    code, out, err = run("models", "import", "--model_id", "x", "--model_path",
                         str(tmp_path / "missing.gguf"))
    assert code == ExitCode.ERROR and out == ""
    assert err.startswith("Error: ")


def test_list_shows_cortexs_columns_first(thread_server, client, gguf):
    client.import_model(str(gguf), "mine")
    code, out, err = run("models", "list")
    assert code == ExitCode.OK, err
    table = rows(out)
    assert table[0] == ["(Index)", "ID", "Engine", "Version", "Size", "Status"]
    assert table[1][:4] == ["1", "mine", "gguf-cpp", "1"]  # no model.yml: version 1
    client.update_model("mine", {"version": "v2.1"})
    assert rows(run("models", "list")[1])[1][:4] == ["1", "mine", "gguf-cpp", "v2.1"]


def test_pull_prints_cortexs_line_and_its_version_is_listed(thread_server):
    code, out, err = run("models", "pull", "tiny:q8")
    assert code == ExitCode.OK, err
    assert out == "Model tiny:q8 downloaded successfully!\n"
    assert rows(run("models", "list")[1])[1][:4] == ["1", "tiny:q8", "gguf-cpp", "2"]


@pytest.mark.parametrize("command", ["delete", "remove", "rm"])
def test_delete_is_remove(thread_server, client, gguf, command):
    client.import_model(str(gguf), "mine")
    code, out, err = run("models", command, "mine")
    assert code == ExitCode.OK, err
    assert out == "Model mine deleted successfully\n"
    assert client.list_models() == []
    code, out, err = run("models", command, "mine")
    assert code == ExitCode.ERROR and out == "" and "not found" in err


# --- engines -----------------------------------------------------------------------------


def installed(client, engine="onnx-runtime"):
    return sorted((v["name"], v["version"]) for v in client.get_engine(engine))


def test_install_a_version_with_v_then_uninstall(thread_server, client):
    code, out, err = run("engines", "install", "onnx-runtime", "-v", "0.17.0")
    assert code == ExitCode.OK, err
    assert out == "Engine onnx-runtime downloaded successfully!\n"
    assert "onnx-runtime" in err  # the progress line
    assert installed(client) == [("linux-amd64", "v0.17.0")]
    code, out, err = run("engines", "install", "onnx-runtime", "--version", "v0.18.1")
    assert (code, out) == (ExitCode.OK, "Engine onnx-runtime downloaded successfully!\n"), err
    assert installed(client) == [("linux-amd64", "v0.17.0"), ("linux-amd64", "v0.18.1")]
    code, out, err = run("engines", "install", "onnx-runtime", "-v", "9.9.9")
    assert code == ExitCode.ERROR and out == "" and "9.9.9" in err

    code, out, err = run("engines", "uninstall", "onnx-runtime")
    assert (code, out) == (ExitCode.OK, "Engine onnx-runtime uninstalled successfully!\n"), err
    assert installed(client) == [("linux-amd64", "v0.17.0")]


def test_menu_lists_the_index_variants_before_anything_is_installed(thread_server, client):
    code, out, err = run("engines", "install", "onnx-runtime", "-m", stdin="\n")
    assert code == ExitCode.OK, err
    assert out == "Engine onnx-runtime downloaded successfully!\n"
    assert "  2. linux-amd64  v0.18.1, 1.0 KiB\n" in err and "installed" not in err
    assert installed(client) == [("linux-amd64", "v0.18.1")]


def test_menu_lists_the_variants_and_installs_the_one_chosen(thread_server, client):
    assert run("engines", "install", "onnx-runtime", "-v", "0.17.0")[0] == ExitCode.OK
    answers = Terminal("0\nlinux-amd64\n")
    code, out, err = run("engines", "install", "onnx-runtime", "--menu", stdin=answers)
    assert code == ExitCode.OK, err
    assert out == "Engine onnx-runtime downloaded successfully!\n"
    assert "Variants of onnx-runtime to install (the newest version):" in err
    menu = [line.split() for line in err.splitlines() if line.startswith("  ")]
    assert menu[0][:2] == ["1.", "recommended"] and "(default)" in menu[0]
    assert menu[1] == ["2.", "linux-amd64", "v0.18.1,", "1.0", "KiB;", "installed:",
                       "v0.17.0", "(Ready)"]
    assert err.count("Choose a variant [1-2, Enter for recommended]: ") == 2
    assert "Please answer with a number from 1 to 2" in err
    assert "Selected linux-amd64" in err
    assert installed(client) == [("linux-amd64", "v0.17.0"), ("linux-amd64", "v0.18.1")]

    # One row a variant; Enter takes the recommended one, whose newest build is there.
    code, out, err = run("engines", "install", "onnx-runtime", "-m", stdin=Terminal("\n"))
    assert code == ExitCode.OK and out == "Engine onnx-runtime downloaded successfully!\n"
    assert ("  2. linux-amd64  v0.18.1, 1.0 KiB; installed: v0.17.0 (Installed), "
            "v0.18.1 (Ready)\n") in err
    assert "  3." not in err
    # Piped answers count too; no answer at all installs nothing.
    before = len(thread_server.calls)
    code, out, err = run("engines", "install", "onnx-runtime", "-m", stdin="")
    assert code == ExitCode.ERROR and out == "" and "No variant chosen" in err
    assert not [c for c in thread_server.calls[before:] if c[0] == "POST"]


def test_menu_with_a_version_installs_that_version_of_the_variant(thread_server, client):
    assert run("engines", "install", "onnx-runtime", "-v", "0.18.1")[0] == ExitCode.OK
    code, out, err = run("engines", "install", "onnx-runtime", "-m", "-v", "0.17.0",
                         stdin="2\n")
    assert code == ExitCode.OK, err
    assert "(version 0.17.0)" in err
    assert out == "Engine onnx-runtime downloaded successfully!\n"
    assert installed(client) == [("linux-amd64", "v0.17.0"), ("linux-amd64", "v0.18.1")]


def test_menu_is_for_a_builtin_engines_variant(thread_server, tmp_path):
    before = len(thread_server.calls)
    code, _, err = run("engines", "install", "onnx-runtime", "-m", "--variant", "x")
    assert code == ExitCode.USAGE and "--menu" in err
    code, _, err = run("engines", "install", str(tmp_path / "e-1.0-py3-none-any.whl"), "-m")
    assert code == ExitCode.USAGE and "--menu" in err
    assert len(thread_server.calls) == before


def test_the_shipped_gguf_cpp_build_comes_back_from_the_menu(thread_server, client):
    code, out, err = run("engines", "uninstall", "gguf-cpp")
    assert (code, out) == (ExitCode.OK, "Engine gguf-cpp uninstalled successfully!\n"), err
    code, out, err = run("engines", "install", "gguf-cpp", "-m", stdin="\n")
    assert code == ExitCode.OK, err
    assert out == "Engine gguf-cpp downloaded successfully!\n"
    assert "active again" in err
    assert client.list_engines()[0]["status"] == "Ready"


# --- a command that starts the server ----------------------------------------------------




def test_the_started_line_goes_to_stderr_and_stdout_keeps_the_result(cli_home, home, gguf):
    # A child process, so that nothing the spawned server writes could reach its stdout.
    proc = subprocess.run([sys.executable, "-m", "localrt", "models", "import",
                           "--model_id", "mine", "--model_path", str(gguf)],
                          env=subprocess_env(home), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == ExitCode.OK, proc.stderr
    assert proc.stdout == f"Successfully import model from '{gguf}' for modelID 'mine'.\n"
    port = cli_home["apiServerPort"]
    assert proc.stderr == (f"The localrt server was not running; started it at "
                           f"http://127.0.0.1:{port}\n")
    # It keeps running: the next command finds it and says nothing on stderr.
    code, out, err = run("models", "delete", "mine")
    assert (code, out, err) == (ExitCode.OK, "Model mine deleted successfully\n", "")
    assert run("stop")[0] == ExitCode.OK


def test_in_process_the_started_line_is_on_stderr_too(cli_home, gguf):
    code, out, err = run("models", "list")
    assert code == ExitCode.OK, err
    assert out == "No models downloaded yet; `localrt pull ID` downloads one\n"
    assert err.startswith("The localrt server was not running; started it at ")
    assert err.count("\n") == 1
