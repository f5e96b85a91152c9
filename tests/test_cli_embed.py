"""`localrt embed` through main([...]), against the app on a real port (thread_server),
on a tiny generated llama: each text's vector as a JSON array, one line each."""

from __future__ import annotations

import json

import pytest
from emulators.ggufgen import write_gguf
from support.cli import run

from localrt.cli import ExitCode

pytestmark = pytest.mark.live


@pytest.fixture
def api(thread_server):
    """Where conftest's `tiny` goes: the app on the port the CLI talks to."""
    return thread_server.url


@pytest.fixture
def tiny_gguf(tmp_path):
    """A tiny llama in F32, whose vectors have its 64 dimensions."""
    return write_gguf(tmp_path / "tiny.gguf")


def test_embed_prints_one_json_array_per_text(tiny, thread_server):
    code, out, err = run("embed", "tiny", "hello world", "a second text")
    assert code == ExitCode.OK, err
    lines = out.splitlines()
    assert len(lines) == 2 and err == ""
    vectors = [json.loads(line) for line in lines]
    assert [len(v) for v in vectors] == [64, 64] and vectors[0] != vectors[1]
    assert abs(sum(x * x for x in vectors[0]) - 1) < 1e-4
    code, again, _ = run("embed", "tiny", "a second text")  # alone, not in a batch
    assert max(abs(x - y) for x, y in zip(json.loads(again), vectors[1])) < 1e-5
    code, out, _ = run("embed", "tiny", "hello world", "--dimensions", "8")
    assert code == ExitCode.OK and len(json.loads(out)) == 8
    code, out, _ = run("ps")
    assert "tiny" in out


def test_embed_errors(tiny):
    code, _, err = run("embed", "nope", "text")
    assert code == ExitCode.ERROR and "nope" in err
    code, _, err = run("models", "start", "tiny", "--cpu_threads", "1")
    assert code == ExitCode.OK, err
    code, out, err = run("embed", "tiny", "text")  # running for chat, it embeds too
    assert code == ExitCode.OK and len(json.loads(out)) == 64, err
    code, out, err = run("embed", "tiny", "word " * 300)  # its context holds 256
    assert code == ExitCode.ERROR and out == ""
    assert "ctx_len" in err
    code, _, err = run("embed", "tiny")
    assert code == ExitCode.USAGE
