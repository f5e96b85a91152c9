"""`localrt engines ...` through main([...]), against the app on a real port with the
package index emulator (serving the real onnxruntime-genai wheels) behind it."""

from __future__ import annotations

import pytest
from emulators.enginepkg import build_echo_engine_wheel
from emulators.pkgindex import PackageIndex
from support import WHEELS
from support.cli import run

from localrt.cli import ExitCode

pytestmark = pytest.mark.live


def rows(out):
    """The cells of a bordered table's lines: [["#", "Name", ...], ["1", ...]]."""
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in out.splitlines() if line.startswith("|")]


@pytest.fixture
def index(tmp_path):
    root = tmp_path / "index"
    root.mkdir()
    for wheel in WHEELS.glob("*.whl"):
        (root / wheel.name).symlink_to(wheel)
    with PackageIndex(root) as emu:
        yield emu


@pytest.fixture
def settings(settings, index):
    settings.update({"engineIndexUrl": index.url})
    return settings


def test_engines_list_and_get_print_tables(thread_server):
    code, out, err = run("engines", "list")
    assert code == ExitCode.OK, err
    table = rows(out)
    assert table[0] == ["#", "Name", "Supported Formats", "Version", "Variant", "Status"]
    assert table[1][:3] == ["1", "gguf-cpp", "GGUF"] and table[1][-1] == "Ready"
    assert table[2] == ["2", "onnx-runtime", "ONNX", "", "", "Not Installed"]
    code, out, _ = run("engines", "get", "gguf-cpp")
    assert rows(out)[0] == ["#", "Name", "Version", "Variant", "Status"]
    assert rows(out)[1][1] == "gguf-cpp" and rows(out)[1][4] == "Ready"
    code, out, _ = run("engines", "get", "onnx-runtime")
    assert code == ExitCode.OK and "No variant of onnx-runtime is installed" in out
    code, _, err = run("engines", "get", "nope")
    assert code == ExitCode.ERROR and "Unknown engine 'nope'" in err


def test_engines_install_and_uninstall(thread_server):
    code, out, err = run("engines", "install", "onnx-runtime")
    assert code == ExitCode.OK, err
    assert out.strip() == "Engine onnx-runtime downloaded successfully!"
    assert "onnx-runtime" in err  # the progress line
    code, out, _ = run("engines", "get", "onnx-runtime")
    assert rows(out)[1] == ["1", "onnx-runtime", "v0.18.0", "linux-amd64", "Ready"]
    # Installing it again checks its files and succeeds (issue 15: was an error).
    code, out, err = run("engines", "install", "onnx-runtime")
    assert code == ExitCode.OK and out.strip() == "Engine onnx-runtime downloaded successfully!", err
    code, _, err = run("engines", "install", "onnx-runtime", "--variant", "windows-amd64")
    assert code == ExitCode.ERROR and "cannot run here" in err
    code, out, _ = run("engines", "uninstall", "onnx-runtime")
    assert (code, out.strip()) == (ExitCode.OK, "Engine onnx-runtime uninstalled successfully!")


def test_engines_install_a_custom_wheel_by_relative_path(thread_server, tmp_path,
                                                        monkeypatch):
    wheel = build_echo_engine_wheel(tmp_path / "dist")
    monkeypatch.chdir(tmp_path)
    code, out, err = run("engines", "install", f"dist/{wheel.name}")
    assert code == ExitCode.OK, err
    assert out.strip() == "Engine echo downloaded successfully!"
    code, out, _ = run("engines", "list")
    assert any(row[1:3] == ["echo", "ECHO"] for row in rows(out))
    import sys
    sys.path[:] = [p for p in sys.path if "engines/echo" not in p]
