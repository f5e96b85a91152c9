"""Audio in the terminal (issue 36, item 4): `localrt run` attaches a .wav, .mp3 or
.flac path typed in a message as an input_audio part (a pty session on the tiny qwen2a
pair shows the API's own reply to that message), and `localrt transcribe` prints the
transcription in every format, a long clip streamed with a progress line."""

from __future__ import annotations

import base64
import io
import json

import pytest
from support.audio import flac, mp3_silence, wav, write_audio_pair
from support.cli import run
from test_cli_run import PROMPT, server, terminals, user  # noqa: F401 (fixtures)

from localrt.cli import ExitCode
from localrt.cli.images import find_images


@pytest.fixture
def clips(tmp_path):
    folder = tmp_path / "my clips"
    folder.mkdir()
    paths = {"wav": folder / "a b.wav", "mp3": folder / "c.mp3", "flac": folder / "d.FLAC"}
    paths["wav"].write_bytes(wav(0.5, 2))
    paths["mp3"].write_bytes(mp3_silence(0.5))
    paths["flac"].write_bytes(flac(0.5, 2))
    return paths


def audio_part(data: bytes, fmt: str) -> dict:
    return {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


@pytest.mark.unit
def test_clip_paths_in_a_line_become_input_audio_parts(clips):
    from localrt.cli.chat import Chat
    from localrt.cli.context import Context

    escaped = str(clips["wav"]).replace(" ", "\\ ")
    assert find_images(f"What is said in {escaped}?") == ("What is said in?",
                                                          [str(clips["wav"])])
    err = io.StringIO()
    chat = Chat(Context(None, stdout=io.StringIO(), stderr=err, stdin=io.StringIO()),
                None, "m")
    flac_path = str(clips["flac"]).replace(" ", "\\ ")
    content = chat._content(f"Compare {escaped} with '{clips['mp3']}' and {flac_path}")
    assert content == [audio_part(clips["wav"].read_bytes(), "wav"),
                       audio_part(clips["mp3"].read_bytes(), "mp3"),
                       audio_part(clips["flac"].read_bytes(), "flac"),
                       {"type": "text", "text": "Compare with and"}]
    assert err.getvalue().splitlines() == [f"Added audio '{clips[k]}'"
                                           for k in ("wav", "mp3", "flac")]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # a context of 880: the clip's 750 tokens leave a short reply, which this random
    # model (it never ends one) writes to the context's end
    return write_audio_pair(tmp_path_factory.mktemp("audio-cli"), context_length=880)


@pytest.mark.live
def test_an_audio_model_on_a_terminal_answers_the_attached_clip(home, server, terminals,
                                                                pair, clips):
    server.client.import_model(str(pair[0]), "ear", mmproj=str(pair[1]))
    server.client.update_model("ear", {"temperature": 0, "cpu_threads": 1, "max_tokens": 6})
    term = terminals(home, "run", "ear")
    term.expect(PROMPT)
    escaped = str(clips["wav"]).replace(" ", "\\ ")
    term.send(f"What is said? {escaped}\r")
    term.expect(f"Added audio '{clips['wav']}'\r\n")
    shown = term.expect("\r\n" + PROMPT)
    sent = [audio_part(clips["wav"].read_bytes(), "wav"),
            {"type": "text", "text": "What is said?"}]
    reply = server.client.chat({"model": "ear", "messages": [user(sent)]})
    assert shown.replace("\r\n", "\n").strip() == \
        reply["choices"][0]["message"]["content"].strip()
    term.send("/exit\r")
    assert term.wait() == ExitCode.OK


@pytest.mark.live
def test_transcribe_prints_every_format(thread_server, pair, tmp_path):
    from localrt.client import Client

    client = Client(thread_server.url)
    client.import_model(str(pair[0]), "ear", mmproj=str(pair[1]))
    client.update_model("ear", {"cpu_threads": 1})
    clip = tmp_path / "talk.wav"
    clip.write_bytes(wav(2.0, 2))
    code, text, err = run("transcribe", str(clip), "--model", "ear")
    assert code == ExitCode.OK, err
    whole = client.transcribe("ear", clip.read_bytes(), "talk.wav", response_format="json")
    assert text == whole["text"] + "\n" and whole["text"]
    code, out, _ = run("transcribe", str(clip), "--model", "ear", "--format", "json")
    assert json.loads(out) == whole
    code, out, _ = run("transcribe", str(clip), "--model", "ear", "--format", "srt")
    assert out == f"1\n00:00:00,000 --> 00:00:02,000\n{whole['text']}\n\n"
    code, out, _ = run("transcribe", str(clip), "--model", "ear", "--format", "vtt")
    assert out == f"WEBVTT\n\n00:00:00.000 --> 00:00:02.000\n{whole['text']}\n\n"
    # a long clip (1 MiB or more: 10 s of 48 kHz stereo here, one 30 s chunk for the
    # model's context) streams, with a line on stderr saying so
    long = tmp_path / "long.wav"
    long.write_bytes(wav(10.0, 2, rate=48000, channels=2))
    code, out, err = run("transcribe", str(long), "--model", "ear")
    assert code == ExitCode.OK, err
    assert err.startswith("Transcribing long.wav (1.8 MiB)...")
    assert out.strip() == client.transcribe("ear", long.read_bytes(), "long.wav",
                                            response_format="json")["text"]
    code, _, err = run("transcribe", str(tmp_path / "none.wav"), "--model", "ear")
    assert code != ExitCode.OK and "Cannot read" in err
    notaudio = tmp_path / "notes.wav"
    notaudio.write_text("hello")
    code, _, err = run("transcribe", str(notaudio), "--model", "ear")
    assert code != ExitCode.OK and "not audio llama.cpp reads" in err
