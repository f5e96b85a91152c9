"""`localrt models start/stop` and `localrt ps` through main([...]), against the app on a
real port (thread_server), on a tiny quantized GGUF model."""

from __future__ import annotations

import pytest
from support.cli import run

from localrt.cli import ExitCode

pytestmark = pytest.mark.live


@pytest.fixture
def api(thread_server):
    """Where conftest's `tiny` goes: the app on the port the CLI talks to."""
    return thread_server.url


def test_start_ps_and_stop(tiny):
    code, out, _ = run("ps")
    assert code == ExitCode.OK and "No models are running" in out
    assert "cores" in out and "RAM:" in out
    code, out, err = run("models", "start", "tiny", "--ctx_len", "128", "--cpu_threads", "1",
                         "--flash_attn", "off")
    assert code == ExitCode.OK, err
    assert out.strip() == "Model tiny started successfully"
    code, out, _ = run("models", "start", "tiny")
    assert out.strip() == "Model tiny is already running"
    code, out, _ = run("ps")
    # the models' table first (a GPU table follows where the machine has one)
    header, row = [line for line in out.splitlines() if line.startswith("|")][:2]
    assert [c.strip() for c in header.strip("|").split("|")] == \
        ["Model", "Engine", "RAM", "VRAM", "Up time", "Context"]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0:2] == ["tiny", "gguf-cpp"] and cells[3] == "0 B" and cells[5] == "128"
    code, out, _ = run("models", "list")
    assert "running" in out
    code, out, _ = run("models", "stop", "tiny")
    assert code == ExitCode.OK and out.strip() == "Model tiny stopped successfully"
    code, _, err = run("models", "stop", "tiny")
    assert code == ExitCode.ERROR and "Model tiny is not running" in err


def test_start_refusals_are_reported(tiny):
    code, _, err = run("models", "start", "tiny", "--ctx_len", "99999")
    assert code == ExitCode.ERROR and "ctx_len" in err
    code, _, err = run("models", "start", "tiny", "--cache_type", "q9")
    assert code == ExitCode.USAGE
    code, _, err = run("models", "start", "nope")
    assert code == ExitCode.ERROR and "not found" in err
