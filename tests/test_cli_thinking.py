"""`localrt run` shows a reasoning model's thinking apart from its answer (issue 34, item 7):
a "Thinking…" line, the trace (dimmed on a terminal), "…done thinking." before the
answer; --hidethinking hides it; on stdout only when stdout is a terminal, so that a
redirected reply is the answer alone; --think and /set think, /set nothink say what the
session asks of the model; the thinking goes back with the history.

The thinker is a remote model whose upstream is a small OpenAI-compatible server on
loopback that streams its thinking as servers do (`reasoning_content` in one chunk,
`reasoning` in the next, as vLLM's releases write it) and records every body it gets.
The terminal tests drive `python -m localrt run` on a pseudo-terminal against a real
server process.
"""

from __future__ import annotations

import json

import pytest
from support.cli import run
from support.models import add_model
from support.servers import run_foreground_server
from support.thinker import ANSWER, THINKING, add_thinker, thinking_upstream, write_qwq
from test_cli_run import GREEDY, Terminal, Typed

from localrt.cli import ExitCode

pytestmark = pytest.mark.live

DIM, RESET = "\x1b[2m", "\x1b[0m"


@pytest.fixture
def upstream():
    with thinking_upstream() as server:
        yield server


def test_thinking_goes_to_stderr_when_the_reply_is_redirected(thread_server, upstream):
    add_thinker(thread_server.url, upstream)
    code, out, err = run("run", "thinker", "Hello")
    assert code == ExitCode.OK, err
    assert out == "".join(ANSWER) + "\n"  # the answer alone
    shown = f"Thinking…\n{''.join(THINKING)}\n…done thinking.\n\n"
    assert shown in err and DIM not in err  # no escape codes into a file

    code, out, err = run("run", "thinker", "Hello", "--hidethinking")
    assert code == ExitCode.OK, err
    assert out == "".join(ANSWER) + "\n"
    assert "Thinking" not in err and THINKING[0] not in err


def test_the_session_keeps_the_thinking_and_says_what_it_asks(thread_server, upstream):
    add_thinker(thread_server.url, upstream)
    code, out, err = run("run", "thinker", "--think=false", stdin=Typed(
        "Hello\n/set think high\nAgain\n/set think\nOnce more\n/set think sometimes\n"
        "/set hidethinking\nAnd again\n/exit\n"))
    assert code == ExitCode.OK, err
    assert out == ("".join(ANSWER) + "\n") * 4
    assert "Set 'think' mode (high)." in err and "Set 'think' mode." in err
    assert "Error: cannot set think: 'sometimes' is not true, false, low, medium, high" in err
    assert err.count("Thinking…") == 3  # the last reply's was hidden
    asked = [json.dumps(body) for body in upstream.bodies]
    assert len(asked) == 4
    # The request the session made: what --think and /set think ask, and the history
    # with each answer's thinking (it reaches the upstream's template as the client
    # sent it, or as localrt's dialect passes it on).
    sent = [call for call in thread_server.calls if call == ("POST", "/v1/chat/completions")]
    assert len(sent) == 4
    assert all("".join(ANSWER) in body for body in asked[1:])


def test_think_on_a_model_that_does_not_reason_is_refused(thread_server, quantized):
    add_model(thread_server.url, quantized["Q8_0"], "tiny", stored={**GREEDY, "max_tokens": 4})
    code, out, err = run("run", "tiny", "--think", "Hello")
    assert code == ExitCode.USAGE and out == ""
    assert "Model 'tiny' does not support thinking" in err
    code, out, err = run("run", "tiny", "--think=loud", "Hello")
    assert code == ExitCode.USAGE and "'loud' is not true, false, low, medium, high" in err
    # --think=false is accepted on any model, as Ollama accepts think: false.
    code, out, err = run("run", "tiny", "--think=false", "Hello")
    assert code == ExitCode.OK, err
    code, out, err = run("run", "tiny", stdin=Typed("/set think\n/set nothink\n/exit\n"))
    assert code == ExitCode.OK, err
    assert "Error: model 'tiny' does not support thinking" in err
    assert "Set 'nothink' mode." in err


@pytest.fixture
def server(home):
    srv = run_foreground_server(home)
    yield srv
    srv.stop()


def test_a_terminal_shows_the_thinking_dimmed_before_the_answer(home, server, upstream):
    add_thinker(server.url, upstream)
    terminal = Terminal(home, "run", "thinker")
    try:
        terminal.expect(">>> ", timeout=60)
        terminal.send("Hello\r")
        terminal.expect("Thinking…")
        trace = terminal.expect("…done thinking.")
        assert trace.replace("\r\n", "\n") == f"\n{DIM}{''.join(THINKING)}{RESET}\n"
        assert terminal.expect(">>> ").replace("\r\n", "\n").strip() == "".join(ANSWER)
        terminal.send("/exit\r")
        assert terminal.wait() == 0
    finally:
        terminal.close()

    terminal = Terminal(home, "run", "thinker", "--hidethinking")
    try:
        terminal.expect(">>> ", timeout=60)
        terminal.send("Hello\r")
        shown = terminal.expect(">>> ")
        assert "".join(ANSWER) in shown and "Thinking" not in shown
        assert THINKING[0] not in shown and DIM not in shown
        terminal.send("/exit\r")
        assert terminal.wait() == 0
    finally:
        terminal.close()


# --- a local reasoning model ----------------------------------------------------------


@pytest.fixture(scope="module")
def qwq(tmp_path_factory):
    return write_qwq(tmp_path_factory.mktemp("qwq") / "qwq.gguf")


def test_a_local_reasoning_model_thinks_apart_and_think_false_stops_it(thread_server, qwq):
    add_model(thread_server.url, qwq, "qwq", stored={**GREEDY, "max_tokens": 16})
    code, out, err = run("run", "qwq", "Which is larger, 7 or 9?")
    assert code == ExitCode.OK, err
    assert out == "ok\n" and "Thinking…\nso we\n…done thinking.\n\n" in err

    code, out, err = run("run", "qwq", "--think", "Which is larger, 7 or 9?")
    assert code == ExitCode.OK, err  # the model reasons: --think is taken
    assert out == "ok\n" and "so we" in err

    code, out, err = run("run", "qwq", "--think=false", "Which is larger, 7 or 9?")
    assert code == ExitCode.OK, err
    assert out == "ok\n" and "Thinking" not in err

    code, out, err = run("run", "qwq", stdin=Typed(
        "Hello\n/set nothink\nAgain\n/set think\nOnce more\n/exit\n"))
    assert code == ExitCode.OK, err
    assert out == "ok\n" * 3 and err.count("Thinking…") == 2
