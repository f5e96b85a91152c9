"""`localrt run`: the terminal chat, driven through a pseudo-terminal as a person types
at it (the prompt, streamed replies, Ctrl-C, Ctrl-D, /exit), and through main() with
messages on stdin (the conversation kept, a model pulled first when it is not local).

The pty tests run `python -m localrt run` as a child against a real server process;
the stdin tests run main() in this process against the app on a real port. The models
are tiny GGUF files quantized by llama.cpp, with stored parameters that make replies
greedy (temperature 0), hence the same every time.
"""

from __future__ import annotations

import codecs
import io
import os
import pty
import select
import signal
import sys
import time

import pytest
from emulators.hubemu import HubEmulator
from support.cli import run
from support.models import NO_DRAFTS, NO_EOS, add_model
from support.servers import run_foreground_server, subprocess_env
from support.waiting import wait_for

from localrt.cli import ExitCode
from localrt.client import ApiError, Client

pytestmark = pytest.mark.live

PROMPT = ">>> "


class Terminal:
    """`python -m localrt ARGS` on a pseudo-terminal (its controlling one), typed at."""

    def __init__(self, home, *args):
        env = {**subprocess_env(home), "TERM": "dumb"}  # no escape codes from readline
        argv = [sys.executable, "-m", "localrt", *args]
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            try:
                os.execve(sys.executable, argv, env)
            finally:
                os._exit(127)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.screen = ""  # everything shown so far
        self._seen = 0  # how far expect() has read the screen
        self.status = None

    def send(self, keys: str) -> None:
        """Type `keys` ("\\r" is Enter, "\\x03" Ctrl-C, "\\x04" Ctrl-D)."""
        os.write(self.fd, keys.encode())

    def expect(self, text: str, timeout: float = 10) -> str:
        """Wait until `text` is shown; return what was shown before it since the last call."""
        deadline = time.monotonic() + timeout
        while True:
            at = self.screen.find(text, self._seen)
            if at >= 0:
                before, self._seen = self.screen[self._seen:at], at + len(text)
                return before
            if not self._read(min(0.1, deadline - time.monotonic())) and \
                    (time.monotonic() > deadline or not self.alive()):
                raise AssertionError(f"{text!r} was not shown (exit status {self.status}); "
                                     f"after the last match: {self.screen[self._seen:]!r}")

    def expect_more(self, count: int, timeout: float = 10) -> None:
        """Wait until `count` characters more are shown after the last match."""
        deadline = time.monotonic() + timeout
        while len(self.screen) - self._seen < count:
            if not self._read(min(0.1, deadline - time.monotonic())) and \
                    (time.monotonic() > deadline or not self.alive()):
                raise AssertionError(f"{count} characters were not shown; after the last "
                                     f"match: {self.screen[self._seen:]!r}")

    def wait(self, timeout: float = 10) -> int:
        """The exit status, once the program has ended."""
        deadline = time.monotonic() + timeout
        while self.alive():
            if not self._read(min(0.05, deadline - time.monotonic())) and \
                    time.monotonic() > deadline:
                raise AssertionError(f"still running; the screen: {self.screen[-500:]!r}")
        return self.status

    def alive(self) -> bool:
        """Whether the program is still running (its exit status is kept once it is not)."""
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
        return self.status is None

    def close(self) -> None:
        """Kill the program if it is still running; close the terminal."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)

    def _read(self, timeout: float) -> bool:
        """Add what is shown within `timeout` to the screen; False if nothing was."""
        ready, _, _ = select.select([self.fd], [], [], max(timeout, 0))
        if not ready:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the program has ended and closed the terminal
            data = b""
        if not data:
            time.sleep(0.01)  # nothing more will come; let wait() see the exit
            return False
        self.screen += self._decoder.decode(data)
        return True


@pytest.fixture
def terminals():
    """Start Terminals with this; each is killed (if need be) and closed after the test."""
    started = []

    def start(home, *args):
        started.append(Terminal(home, *args))
        return started[-1]

    yield start
    for terminal in started:
        terminal.close()


@pytest.fixture
def server(home):
    """A real server process; its pid file is where `localrt run` looks for it."""
    srv = run_foreground_server(home)
    srv.client = Client(srv.url)
    yield srv
    srv.stop()


def user(text):
    """A user message."""
    return {"role": "user", "content": text}


# Stored on each model here: greedy replies, and one CPU thread (the machine is shared).
GREEDY = {"temperature": 0, "cpu_threads": 1}


def requests_of(client, model_id):
    """The model's requests in progress, as GET /v1/models/status counts them."""
    return {row["id"]: row["requests"] for row in client.models_status()["data"]}[model_id]


def running_options(client, model_id):
    """The options a running model was started with."""
    return {row["id"]: row["options"] for row in client.models_status()["data"]}[model_id]


# --- on a terminal ---------------------------------------------------------------


def test_a_conversation_on_a_terminal(home, server, quantized, terminals):
    add_model(server.url, quantized["Q8_0"], "tiny", stored={**GREEDY, "max_tokens": 16})
    term = terminals(home, "run", "tiny", "--ctx_len", "128")
    assert "Model tiny started successfully" in term.expect("Type a message")
    term.expect(PROMPT)
    assert running_options(server.client, "tiny")["ctx_len"] == 128  # the flag was used

    term.send("Hello there\r")
    assert term.expect("Hello there\r\n") == ""  # the line as typed, then the reply
    reply = term.expect("\r\n" + PROMPT)
    assert reply.strip()
    term.send("And then?\r")
    term.expect("And then?\r\n")
    assert term.expect("\r\n" + PROMPT).strip()  # the conversation goes on
    term.send("/exit\r")
    assert term.wait() == ExitCode.OK
    assert requests_of(server.client, "tiny") == 0


def test_ctrl_c_stops_a_reply_and_at_the_prompt_does_not_leave(home, server, slow_gguf,
                                                             terminals):
    add_model(server.url, slow_gguf, "slow",  # a reply of seconds
              stored={**GREEDY, "max_tokens": 2000, **NO_DRAFTS})
    term = terminals(home, "run", "slow", "--ctx_len", "4096")
    term.expect(PROMPT)
    term.send("Tell me a long story\r")
    term.expect("story\r\n")
    term.expect_more(200)  # the reply is streaming
    term.send("\x03")
    term.expect(" [interrupted]\r\n" + PROMPT)
    # The CLI hung up, so the server stopped generating: the model is free.
    wait_for(lambda: requests_of(server.client, "slow") == 0, 2, "the model is busy")
    assert term.alive()

    term.send("\x03")  # at the prompt: a hint, not an exit
    term.expect("Use /exit or Ctrl-D to leave.\r\n" + PROMPT)
    assert term.alive()
    term.send("/exit\r")
    assert term.wait() == ExitCode.OK


def test_ctrl_c_while_the_reply_waits_for_the_model(home, server, slow_gguf, terminals):
    add_model(server.url, slow_gguf, "slow",
              stored={**GREEDY, "max_tokens": 2000, **NO_DRAFTS})
    term = terminals(home, "run", "slow", "--ctx_len", "4096")
    term.expect(PROMPT)
    # Another client's long reply holds the model, so the next one waits its turn.
    other = server.client.chat_stream({"model": "slow", "messages": [user("Go on")],
                                       "max_tokens": 3000, "logit_bias": NO_EOS})
    try:
        term.send("Tell me a long story\r")
        term.expect("story\r\n")
        wait_for(lambda: requests_of(server.client, "slow") == 2, 5, "the reply is not queued")
        term.send("\x03")
        term.expect(PROMPT, timeout=5)
        assert term.alive()
    finally:
        other.close()
    term.send("/exit\r")
    assert term.wait() == ExitCode.OK


def test_ctrl_d_leaves(home, server, quantized, terminals):
    add_model(server.url, quantized["Q8_0"], "tiny", stored={**GREEDY, "max_tokens": 4})
    term = terminals(home, "run", "tiny")
    term.expect(PROMPT)
    term.send("\x04")
    assert term.wait() == ExitCode.OK


# --- messages on stdin -----------------------------------------------------------


def test_run_keeps_the_conversation(thread_server, quantized):
    client = Client(thread_server.url)
    add_model(thread_server.url, quantized["Q8_0"], "tiny", stored={**GREEDY, "max_tokens": 12})
    code, out, err = run("run", "tiny", stdin="Hello there\n\nWhat next?\n/exit\n")
    assert code == ExitCode.OK, err
    assert err.count(PROMPT) == 4 and "Model tiny started successfully" in err

    # The same greedy requests, made here: the second one carries the first exchange.
    first = client.chat({"model": "tiny", "messages": [user("Hello there")]})
    first = first["choices"][0]["message"]["content"]
    second = client.chat({"model": "tiny", "messages": [
        user("Hello there"), {"role": "assistant", "content": first}, user("What next?")]})
    second = second["choices"][0]["message"]["content"]
    assert first and second
    assert out == f"{first}\n{second}\n"
    alone = client.chat({"model": "tiny", "messages": [user("What next?")]})
    assert alone["choices"][0]["message"]["content"] != second
    client.stop_model("tiny")


def test_a_conversation_that_outgrows_the_context_says_so_and_goes_on(thread_server,
                                                                      quantized):
    client = Client(thread_server.url)
    add_model(thread_server.url, quantized["Q8_0"], "tiny",
              stored={**GREEDY, "max_tokens": 30})
    code, out, err = run("run", "tiny", "--ctx_len", "128",
                         stdin="Hello there\n" * 8 + "/exit\n")
    assert code == ExitCode.OK, err
    assert "context (ctx_len) holds 128" in err
    assert err.count(PROMPT) == 9  # every message got a prompt after it, then /exit
    client.stop_model("tiny")


def test_run_pulls_a_model_that_is_not_local(settings, thread_server, quantized):
    with HubEmulator() as hub:
        hub.add_repo("org/single", {"only.gguf": quantized["Q8_0"]})
        settings.update({"modelHubUrl": hub.url})  # the server reads it at each pull
        code, out, err = run("run", "org/single", "--ctx_len", "128", "--cpu_threads", "1",
                             stdin="Hello there\n")
    assert code == ExitCode.OK, err
    assert "Model org/single is not downloaded yet; pulling it" in err
    assert "100%" in err  # the download's progress
    assert out.startswith("Model org:single:only.gguf downloaded successfully!\n") and out.endswith("\n")
    assert "Model org:single:only.gguf started successfully" in err
    assert err.count(PROMPT) == 2  # one message, then the end of input
    assert thread_server.calls.count(("POST", "/v1/chat/completions")) == 1
    client = Client(thread_server.url)
    options = running_options(client, "org:single:only.gguf")
    assert (options["ctx_len"], options["cpu_threads"]) == (128, 1)  # the flags were used
    client.stop_model("org:single:only.gguf")


# --- images ------------------------------------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))  # what the CLI reads of it: bytes it sends


@pytest.fixture
def pictures(tmp_path):
    """Image files: one in a folder whose name has a space, a JPEG named .JPG, a GIF."""
    (tmp_path / "my pics").mkdir()
    spaced = tmp_path / "my pics" / "cat (1).png"
    spaced.write_bytes(PNG)
    jpeg = tmp_path / "dog.JPG"
    jpeg.write_bytes(b"\xff\xd8\xff\xe0" + bytes(32))
    gif = tmp_path / "anim.gif"
    gif.write_bytes(b"GIF89a" + bytes(32))
    return spaced, jpeg, gif


def image_url(data: bytes, mime: str) -> dict:
    """The content part the CLI sends for an image file's bytes."""
    import base64

    return {"type": "image_url",
            "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}


def test_image_paths_in_a_line_are_found_as_ollama_finds_them(pictures, tmp_path,
                                                            monkeypatch):
    from localrt.cli.images import find_images

    spaced, jpeg, gif = pictures
    escaped = str(spaced).replace(" ", "\\ ").replace("(", "\\(").replace(")", "\\)")
    assert find_images(f"What is in {escaped}?") == ("What is in?", [str(spaced)])
    assert find_images(f"Compare '{spaced}' with \"{jpeg}\", then {gif}.") == \
        ("Compare with, then.", [str(spaced), str(jpeg), str(gif)])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert find_images("./dog.JPG and ~/anim.gif") == \
        ("and", ["./dog.JPG", str(gif)])
    for stays in (f"{tmp_path}/missing.png is not there", f"{spaced}x",
                  "see http://example.com/a.png", f"{spaced.with_suffix('.webp')}",
                  f"relative {jpeg.name} without ./", "/ alone"):
        assert find_images(stays) == (stays, [])


def test_a_line_with_images_is_a_message_with_image_url_parts(pictures):
    from localrt.cli.chat import Chat
    from localrt.cli.context import Context

    spaced, jpeg, gif = pictures
    err = io.StringIO()
    chat = Chat(Context(None, stdout=io.StringIO(), stderr=err, stdin=io.StringIO()),
                None, "m")
    content = chat._content(f"Which is cuter, '{spaced}' or {jpeg}?")
    assert content == [image_url(PNG, "image/png"), image_url(jpeg.read_bytes(), "image/jpeg"),
                       {"type": "text", "text": "Which is cuter, or?"}]
    assert err.getvalue() == f"Added image '{spaced}'\nAdded image '{jpeg}'\n"
    assert chat._content(str(gif)) == [image_url(gif.read_bytes(), "image/gif")]
    assert chat._content("no image here") == "no image here"


def test_an_image_path_on_a_terminal_is_attached_and_sent(home, server, quantized, terminals,
                                                         pictures):
    spaced, _, _ = pictures
    add_model(server.url, quantized["Q8_0"], "tiny", stored={**GREEDY, "max_tokens": 4})
    term = terminals(home, "run", "tiny", "--ctx_len", "128")
    term.expect(PROMPT)
    escaped = str(spaced).replace(" ", "\\ ").replace("(", "\\(").replace(")", "\\)")
    term.send(f"What is this? {escaped}\r")
    term.expect(f"Added image '{spaced}'\r\n")
    shown = term.expect("\r\n" + PROMPT)
    # The model has no projector: the server's answer to exactly this message.
    sent = [image_url(PNG, "image/png"), {"type": "text", "text": "What is this?"}]
    with pytest.raises(ApiError) as refused:
        server.client.chat({"model": "tiny", "messages": [user(sent)]})
    assert shown == f"Error: {refused.value}"
    term.send("Hello\r")  # the refused message left the conversation
    term.expect("Hello\r\n")
    assert not term.expect("\r\n" + PROMPT).startswith("Error")
    term.send("/exit\r")
    assert term.wait() == ExitCode.OK


def test_a_vision_model_on_a_terminal_answers_the_attached_image(home, server, terminals,
                                                                 tmp_path):
    """The reply `localrt run` shows for a line with an image path is the one the API
    gives that message (a real projector through mtmd)."""
    from support.vision import png, write_vision_pair

    model, mmproj = write_vision_pair(tmp_path / "pair")
    server.client.import_model(str(model), "eye", mmproj=str(mmproj))
    server.client.update_model("eye", {"temperature": 0, "cpu_threads": 1, "max_tokens": 6})
    picture = tmp_path / "red panda.png"
    picture.write_bytes(png(64, 64, 3))
    term = terminals(home, "run", "eye")
    term.expect(PROMPT)
    escaped = str(picture).replace(" ", "\\ ")
    term.send(f"What is this? {escaped}\r")
    term.expect(f"Added image '{picture}'\r\n")
    shown = term.expect("\r\n" + PROMPT)
    sent = [image_url(picture.read_bytes(), "image/png"),
            {"type": "text", "text": "What is this?"}]
    reply = server.client.chat({"model": "eye", "messages": [user(sent)]})
    want = reply["choices"][0]["message"]["content"]
    assert shown.replace("\r\n", "\n").strip() == want.strip()
    term.send("/exit\r")
    assert term.wait() == ExitCode.OK
