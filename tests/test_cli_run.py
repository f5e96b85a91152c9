"""`localrt run`: the terminal chat, driven through a pseudo-terminal as a person types
at it (the prompt, streamed replies, Ctrl-C, Ctrl-D, /exit, the session's commands,
several lines), and through main() with messages typed on a stdin that says it is a
terminal (the conversation kept, each command, a model pulled first when it is not
local); one prompt answered and the exit, from PROMPT words and from a pipe; a GGUF
file on disk imported and run; --verbose's readout; a pull that cannot reach the hub;
and every command's output into a pipe that its reader closed.

The pty and pipe tests run `python -m localrt` as a child against a real server process;
the main() tests run in this process against the app on a real port. The models are
tiny GGUF files quantized by llama.cpp (or generated), with stored parameters that make
replies greedy (temperature 0), hence the same every time: a reply shown is compared
with the API's reply to the request the CLI should have made.
"""

from __future__ import annotations

import codecs
import fcntl
import io
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import time

import pytest
from emulators.ggufgen import write_gguf
from emulators.hubemu import HubEmulator
from support.cli import run
from support.models import NO_DRAFTS, NO_EOS, add_model
from support.servers import run_foreground_server, subprocess_env
from support.waiting import wait_for

from localrt.cli import ExitCode
from localrt.cli.commands.pull import ON_DISK
from localrt.client import ApiError, Client

pytestmark = pytest.mark.live

PROMPT, MORE = ">>> ", "... "


class Typed(io.StringIO):
    """What a person types, as main()'s stdin: a stream that says it is a terminal."""

    def isatty(self):
        return True


class Terminal:
    """`python -m localrt ARGS` on a pseudo-terminal (its controlling one), typed at."""

    def __init__(self, home, *args):
        env = {**subprocess_env(home), "TERM": "dumb"}  # no escape codes from readline
        argv = [sys.executable, "-m", "localrt", *args]
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            try:
                # Ctrl-C reaches it as a user's would, however pytest was started: a
                # shell's background job inherits SIGINT ignored, and execve keeps it so.
                signal.signal(signal.SIGINT, signal.SIG_DFL)
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


def assistant(text):
    """An assistant message."""
    return {"role": "assistant", "content": text}


def reply_of(client, model_id, messages, **fields):
    """The API's (greedy) reply to these messages: what the CLI should show."""
    reply = client.chat({"model": model_id, "messages": messages, **fields})
    return reply["choices"][0]["message"]["content"]


def chats(server):
    """How many chat requests a thread_server has had."""
    return server.calls.count(("POST", "/v1/chat/completions"))


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
    code, out, err = run("run", "tiny", stdin=Typed("Hello there\n\nWhat next?\n/exit\n"))
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
                         stdin=Typed("Hello there\n" * 8 + "/exit\n"))
    assert code == ExitCode.OK, err
    assert "context (ctx_len) holds 128" in err
    assert err.count(PROMPT) == 9  # every message got a prompt after it, then /exit
    client.stop_model("tiny")


def test_run_pulls_a_model_that_is_not_local(settings, thread_server, quantized):
    with HubEmulator() as hub:
        hub.add_repo("org/single", {"only.gguf": quantized["Q8_0"]})
        settings.update({"modelHubUrl": hub.url})  # the server reads it at each pull
        code, out, err = run("run", "org/single", "--ctx_len", "128", "--cpu_threads", "1",
                             stdin="Hello there\n")  # piped: answered once
    assert code == ExitCode.OK, err
    assert "Model org/single is not downloaded yet; pulling it" in err
    assert "100%" in err  # the download's progress
    assert out.startswith("Model org:single:only.gguf downloaded successfully!\n") and out.endswith("\n")
    assert len(out.splitlines()) >= 2  # then the reply
    assert "Model org:single:only.gguf started successfully" in err
    assert PROMPT not in err  # no session
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


# --- one prompt, answered once -----------------------------------------------------


def test_a_prompt_on_the_command_line_and_from_a_pipe_is_answered_once(home, server,
                                                                       quantized, terminals):
    add_model(server.url, quantized["Q8_0"], "tiny", stored={**GREEDY, "max_tokens": 12})
    # At a terminal, with the prompt's words after the options: the reply, then the exit.
    term = terminals(home, "run", "tiny", "--ctx_len", "128", "Hello", "there")
    assert term.wait(30) == ExitCode.OK
    want = reply_of(server.client, "tiny", [user("Hello there")])
    assert want.strip() and want.strip().replace("\n", "\r\n") in term.screen
    assert PROMPT not in term.screen and "Type a message" not in term.screen

    # `echo ... | localrt run tiny`: stdin's text first, then the words; stdout the reply.
    piped = subprocess.run([sys.executable, "-m", "localrt", "run", "tiny", "and", "then?"],
                           input=b"Hello\nthere\n", capture_output=True, timeout=60,
                           env=subprocess_env(home))
    assert piped.returncode == ExitCode.OK, piped.stderr
    want = reply_of(server.client, "tiny", [user("Hello\nthere and then?")])
    assert piped.stdout.decode() == want + "\n"
    assert PROMPT not in piped.stderr.decode()


def test_piped_text_is_one_prompt_and_nothing_to_send_is_a_usage_error(thread_server,
                                                                      quantized):
    client = Client(thread_server.url)
    add_model(thread_server.url, quantized["Q8_0"], "tiny", stored={**GREEDY, "max_tokens": 12})
    # A slash command piped in is no command: the text is sent as it is.
    code, out, err = run("run", "tiny", stdin="/clear the table\nplease\n")
    assert code == ExitCode.OK, err
    assert chats(thread_server) == 1 and "Cleared" not in err
    code, empty, err = run("run", "tiny", stdin=" \n")
    assert code == ExitCode.USAGE and empty == ""
    assert "Error: Nothing to answer: give a PROMPT, or text on standard input" in err
    assert chats(thread_server) == 1
    assert out == reply_of(client, "tiny", [user("/clear the table\nplease")]) + "\n"
    client.stop_model("tiny")


def test_verbose_prints_the_tokens_and_their_rates_after_each_reply(thread_server, quantized):
    client = Client(thread_server.url)
    add_model(thread_server.url, quantized["Q8_0"], "tiny", stored={**GREEDY, "max_tokens": 12})
    readout = re.compile(r"prompt tokens: (\d+)(?: \((\d+) from the prompt cache\))?"
                         r"(?:, [\d.]+ tok/s)?\nreply tokens:  (\d+), ([\d.]+) tok/s\n"
                         r"total time:    [\d.]+ s\n")
    code, out, err = run("run", "tiny", "Hello there", "--verbose", stdin="")
    assert code == ExitCode.OK, err
    usage = client.chat({"model": "tiny", "messages": [user("Hello there")]})["usage"]
    found = readout.search(err)
    assert found, err
    assert (int(found[1]), int(found[3])) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert float(found[4]) > 0

    # In a session: after each reply; /set quiet stops it, /set verbose starts it again.
    code, out, err = run("run", "tiny", "--verbose", stdin=Typed(
        "Hello there\n/set quiet\nWhat next?\n/set verbose\nAnd then?\n/exit\n"))
    assert code == ExitCode.OK, err
    assert len(readout.findall(err)) == 2 and "Set 'quiet' mode." in err
    first = reply_of(client, "tiny", [user("Hello there")])
    second = reply_of(client, "tiny", [user("Hello there"), assistant(first),
                                       user("What next?")])
    assert out.startswith(f"{first}\n{second}\n")
    usage = client.chat({"model": "tiny", "messages": [
        user("Hello there"), assistant(first), user("What next?"), assistant(second),
        user("And then?")]})["usage"]
    last = readout.findall(err)[-1]
    assert (int(last[0]), int(last[2])) == (usage["prompt_tokens"], usage["completion_tokens"])
    client.stop_model("tiny")


# --- the session's commands --------------------------------------------------------


def test_set_system_parameters_clear_and_unknown_commands(thread_server, quantized, pictures):
    client = Client(thread_server.url)
    add_model(thread_server.url, quantized["Q8_0"], "tiny", stored={**GREEDY, "max_tokens": 12})
    _, _, gif = pictures
    typed = ["/set system You answer in French.",
             "Hello there",
             "/set parameter num_predict 3",
             "/set parameter temperature warm",
             "/set parameter num_ctx 512",
             "/set parameter nonsense 1",
             "/frobnicate now",
             "/set frobnicate",
             "What next?",
             f"{gif} What is this?",  # an image's path: a message, not a command
             "/clear",
             "What next?",
             "/bye"]
    code, out, err = run("run", "tiny", "--ctx_len", "128", stdin=Typed("\n".join(typed)))
    assert code == ExitCode.OK, err
    assert err.count(PROMPT) == len(typed)
    assert chats(thread_server) == 4  # the messages; no command reached the model
    for line in ("Set system message.", "Set parameter 'num_predict' to '3'",
                 "Error: cannot set parameter 'temperature': expected a number from 0 to 2, "
                 "got 'warm'",
                 "Error: num_ctx is set when the model starts: leave, and run it again with "
                 "--ctx_len N",
                 "Error: unknown parameter 'nonsense'; one of temperature, top_p, top_k, "
                 "min_p, seed, num_predict, max_tokens, repeat_penalty, presence_penalty, "
                 "frequency_penalty, stop",
                 "Error: unknown command '/frobnicate'; /help lists the commands",
                 "Error: unknown command '/set frobnicate'; /help lists the commands",
                 f"Added image '{gif}'", "Cleared session context"):
        assert line + "\n" in err
    refused = err.split(f"Added image '{gif}'\n")[1].splitlines()[0]
    assert refused.startswith("Error: ") and "unknown command" not in refused

    system = {"role": "system", "content": "You answer in French."}
    first = reply_of(client, "tiny", [system, user("Hello there")])
    second = reply_of(client, "tiny", [system, user("Hello there"), assistant(first),
                                       user("What next?")], max_tokens=3)
    third = reply_of(client, "tiny", [system, user("What next?")], max_tokens=3)
    assert out == f"{first}\n{second}\n{third}\n"
    # Each step shows: without the system message, or without /clear, replies differ.
    assert reply_of(client, "tiny", [user("Hello there")]) != first
    assert second != third
    client.stop_model("tiny")


def test_help_show_info_and_load(thread_server, quantized, tmp_path):
    client = Client(thread_server.url)
    add_model(thread_server.url, quantized["Q8_0"], "tiny", stored={**GREEDY, "max_tokens": 12})
    other = write_gguf(tmp_path / "other.gguf", name="other", seed=7)
    add_model(thread_server.url, other, "other", stored={**GREEDY, "max_tokens": 12})
    typed = ["/help", "/set parameter top_k 5", "/show info", "/show", "/load missing",
             "/load other", "Hello there", "/show info", "/exit"]
    code, out, err = run("run", "tiny", "--ctx_len", "128", stdin=Typed("\n".join(typed)))
    assert code == ExitCode.OK, err
    for line in ("  /set system TEXT", "  /set parameter NAME VALUE", "  /show info",
                 "  /clear", "  /load ID", "  /?, /help",
                 'Use """ to begin a message of several lines, and """ to end it.'):
        assert "\n" + line in err
    tiny_info, other_info = re.findall(r"  Model\n.*?\n\n(?:  [A-Z].*?\n\n)*", err, re.S)
    record = client.get_model("tiny")
    meta = record["metadata"]
    for line in ("    id                  tiny", "    engine              gguf-cpp",
                 f"    architecture        {meta['architecture']}",
                 f"    context length      {meta['context_length']}",
                 f"    quantization        {meta['quantization']}",
                 "  Running\n    context (ctx_len)   128",
                 "  Capabilities\n    chat", "  Session parameters\n    top_k               5"):
        assert line + "\n" in tiny_info, tiny_info
    assert "Usage: /show info\n" in err
    assert "Loading model 'missing'\nError: Couldn't find model 'missing'; `localrt pull " \
           "missing` downloads it\n" in err
    assert "Loading model 'other'\nModel other started successfully\n" in err
    assert "    id                  other\n" in other_info
    # The message after /load went to the other model, with the session's parameter.
    want = reply_of(client, "other", [user("Hello there")], top_k=5)
    assert out == want + "\n"
    assert reply_of(client, "tiny", [user("Hello there")], top_k=5) != want
    client.stop_model("tiny")
    client.stop_model("other")


def test_several_lines_are_one_message(thread_server, quantized):
    client = Client(thread_server.url)
    add_model(thread_server.url, quantized["Q8_0"], "tiny", stored={**GREEDY, "max_tokens": 12})
    typed = '"""\nfirst line\n\nsecond line"""\n"""one line"""\n/set system """Be\nbrief."""\n' \
            '"""Hi\nthere"""\n/exit\n'
    code, out, err = run("run", "tiny", stdin=Typed(typed))
    assert code == ExitCode.OK, err
    assert err.count(MORE) == 5 and err.count(PROMPT) == 5
    first = reply_of(client, "tiny", [user("first line\n\nsecond line")])
    second = reply_of(client, "tiny", [user("first line\n\nsecond line"), assistant(first),
                                       user("one line")])
    third = reply_of(client, "tiny", [
        {"role": "system", "content": "Be\nbrief."}, user("first line\n\nsecond line"),
        assistant(first), user("one line"), assistant(second), user("Hi\nthere")])
    assert out == f"{first}\n{second}\n{third}\n"
    assert reply_of(client, "tiny", [user("first line second line")]) != first
    client.stop_model("tiny")


def test_commands_and_several_lines_on_a_terminal(home, server, quantized, terminals):
    add_model(server.url, quantized["Q8_0"], "tiny", stored={**GREEDY, "max_tokens": 12})
    term = terminals(home, "run", "tiny", "--ctx_len", "128", "--verbose")
    term.expect(PROMPT)
    term.send("/?\r")
    assert "/set parameter NAME VALUE" in term.expect(PROMPT)
    term.send("/nonsense\r")
    assert term.expect(PROMPT).endswith(
        "Error: unknown command '/nonsense'; /help lists the commands\r\n")
    term.send('"""\r')
    term.expect('"""\r\n' + MORE)
    term.send("first line\r")
    term.expect("first line\r\n" + MORE)
    term.send('second line"""\r')
    term.expect('second line"""\r\n')
    shown = term.expect("prompt tokens: ")  # the reply, then --verbose's readout
    assert re.match(r"\d+.*\r\nreply tokens:  \d+, [\d.]+ tok/s\r\ntotal time:    [\d.]+ s\r\n$",
                    term.expect(PROMPT), re.S)
    want = reply_of(server.client, "tiny", [user("first line\nsecond line")])
    assert shown.replace("\r\n", "\n").strip() == want.strip()
    term.send("/clear\r")
    assert term.expect(PROMPT).endswith("Cleared session context\r\n")
    term.send("/exit\r")
    assert term.wait() == ExitCode.OK


# --- a GGUF file on disk -------------------------------------------------------------


def test_run_a_gguf_file_imports_it_asking_nothing_and_chats(thread_server, quantized,
                                                            tmp_path, monkeypatch):
    client = Client(thread_server.url)
    (tmp_path / "mine.gguf").symlink_to(quantized["Q8_0"])
    monkeypatch.chdir(tmp_path)
    path = str(tmp_path / "mine.gguf")
    code, out, err = run("run", "./mine.gguf", "--ctx_len", "128", "--cpu_threads", "1",
                         "Hello there", stdin="")
    assert code == ExitCode.OK, err
    assert f"Imported {path} as model mine\n" in err and out.strip()
    assert client.get_model("mine")["source"] == {"type": "import", "path": path,
                                                  "option": "symlink"}
    client.update_model("mine", {**GREEDY, "max_tokens": 12})

    # Again, a session: the model imported before, nothing asked, the chat goes on.
    code, out, err = run("run", "mine.gguf", stdin=Typed("Hello there\n/exit\n"))
    assert code == ExitCode.OK, err
    assert "Imported" not in err and err.count(PROMPT) == 2
    assert out == reply_of(client, "mine", [user("Hello there")]) + "\n"
    assert [m["id"] for m in client.list_models()] == ["mine"]

    # Another file of that name: its id is taken, and the error says what to do.
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "mine.gguf").symlink_to(quantized["Q4_0"])
    code, out, err = run("run", "./elsewhere/mine.gguf", "Hi", stdin="")
    assert code == ExitCode.ERROR and out == ""
    assert ("Error: A model with id mine already exists; `localrt models import --path "
            f"{tmp_path}/elsewhere/mine.gguf --id NEW_ID` imports the file under another "
            "id\n") in err
    client.stop_model("mine")


# --- failures around the chat ------------------------------------------------------


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_pull_that_cannot_reach_the_hub_says_how_to_import_a_file(settings, thread_server):
    hub = f"http://127.0.0.1:{closed_port()}"
    settings.update({"modelHubUrl": hub})
    for argv, stdin in ((("pull", "org/repo"), ""), (("run", "org/repo", "Hello"), "")):
        code, out, err = run(*argv, stdin=stdin)
        assert code == ExitCode.ERROR, err
        lines = err.splitlines()
        assert lines[-2].startswith("Error: ") and hub in lines[-2], err
        assert lines[-1] == ON_DISK
    assert "`localrt run ./model.gguf`" in ON_DISK and "models import --path" in ON_DISK


def test_every_command_ends_quietly_when_its_output_pipe_closes(home, server, quantized):
    """`localrt models list | head -1` with more models than a pipe holds, then each
    command into a pipe whose reader has already left: no traceback, exit 141."""
    for n in range(60):  # a table of about 15 kB (the vetting is cached after the first)
        server.client.import_model(str(quantized["Q8_0"]), f"model-{n:02d}-" + "x" * 200)
    env = subprocess_env(home)
    read, write = os.pipe()
    fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 4096)  # one page: the table overflows it
    cli = subprocess.Popen([sys.executable, "-m", "localrt", "models", "list"], stdout=write,
                           stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    head = subprocess.Popen(["head", "-1"], stdin=read, stdout=subprocess.PIPE)
    os.close(read)
    os.close(write)
    first = head.communicate(timeout=60)[0]
    err = cli.communicate(timeout=60)[1]
    assert first.startswith(b"+-") and first.count(b"\n") == 1
    assert (cli.returncode, err) == (ExitCode.BROKEN_PIPE, b"")

    add_model(server.url, quantized["Q8_0"], "tiny", stored={**GREEDY, "max_tokens": 12})
    for argv in (["--help"], ["models", "list"], ["models", "get", "tiny"], ["ps"],
                 ["config"], ["run", "tiny", "Hello there"]):
        read, write = os.pipe()
        os.close(read)
        done = subprocess.run([sys.executable, "-m", "localrt", *argv], stdout=write,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
                              timeout=60)
        os.close(write)
        assert done.returncode == ExitCode.BROKEN_PIPE, (argv, done.stderr)
        assert b"Traceback" not in done.stderr and b"Exception" not in done.stderr, argv
        assert b"Error" not in done.stderr, argv
