"""The chat page with a model that hears (issue 36, item 5): its microphone records
in the browser, the page encodes the WAV itself and sends it as an OpenAI input_audio
part, the clip shows as a player in the message and stays in the stored conversation;
its attach button takes .wav and .flac files; a model that does not hear shows no
microphone and refuses audio files with a note; a refused microphone is a note too.

Headless Chromium (support.browser) with a fake microphone that plays a clip of
support.audio (`--use-file-for-fake-audio-capture`) and grants itself
(`--use-fake-ui-for-media-stream`), against the app in this process on a real socket,
with a recorder in front of it that keeps each chat request's body as the server got
it; the models are support.audio's tiny qwen2a pair (`ear`, and its text model alone
as `deaf`) and support.vision's pair (`eye`), all on real llama.cpp.
"""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import urllib.request
import wave
from wsgiref.simple_server import make_server

import numpy as np
import pytest
from support.audio import AUDIO_TOKENS_PER_CHUNK, flac, start_ear, wav, write_audio_pair
from support.browser import require_chromium, start_chromium
from support.servers import QuietHandler, ThreadingWSGIServer, send
from test_web import (find, labelled, last_reply, open_page, pick, prompt_tokens_of, say,
                      settings_of, wait)

from localrt import settings as settings_mod
from localrt import web
from localrt.app import create_app

pytestmark = [pytest.mark.browser, pytest.mark.live]

require_chromium()

from selenium.webdriver.common.by import By  # noqa: E402

SEED = 2                          # support.audio's clip 2: a 1050 Hz tone with noise
PITCH = 150 + 450 * (SEED % 13)   # as support.audio.samples picks it
# The page's policy before audio, directive by directive; audio adds media-src alone.
BEFORE = {"default-src": "'self'", "script-src": "'self'", "style-src": "'self'",
          "img-src": "'self' data: blob:", "connect-src": "'self'",
          "frame-ancestors": "'none'", "base-uri": "'none'", "form-action": "'none'",
          "object-src": "'none'"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The app on a real socket in this process; `bodies` keeps every chat request's
    JSON body as the server read it."""
    home = tmp_path_factory.mktemp("web-audio-home")
    settings = settings_mod.load(environ={"HOME": str(home)})
    app = create_app(settings)
    bodies = []

    def recording(environ, start_response):
        if environ["PATH_INFO"] == "/v1/chat/completions":
            body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            bodies.append(json.loads(body))
            environ["wsgi.input"] = io.BytesIO(body)
        return app(environ, start_response)

    httpd = make_server("127.0.0.1", 0, recording, server_class=ThreadingWSGIServer,
                        handler_class=QuietHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    pair = write_audio_pair(tmp_path_factory.mktemp("ear"))
    start_ear(url, pair, cpu_threads=1)
    assert send(url, "POST", "/v1/models/import",
                {"path": str(pair[0]), "id": "deaf"})[0] == 200  # the text model alone
    yield type("Server", (), {"url": url, "bodies": bodies})
    httpd.shutdown()
    httpd.server_close()
    app.close()


@pytest.fixture(scope="module")
def clip_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("clips") / "clip.wav"
    path.write_bytes(wav(2.0, SEED))
    return path


@pytest.fixture(scope="module")
def chromium(tmp_path_factory, clip_file):
    driver = start_chromium(tmp_path_factory.mktemp("chromium-profile"), logs=True, flags=(
        "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={clip_file}"))
    # Every page counts its calls of getUserMedia and keeps the streams they give.
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": COUNT_ASKS})
    yield driver
    driver.quit()


COUNT_ASKS = """
window.asks = [];
const ask = navigator.mediaDevices.getUserMedia.bind(navigator.mediaDevices);
navigator.mediaDevices.getUserMedia = async (constraints) => {
  const stream = await ask(constraints);
  window.asks.push(stream);
  return stream;
};
"""
# Whether the page holds the microphone: a track of a stream it was given still live.
LIVE = "return window.asks.some(s => s.getTracks().some(t => t.readyState === 'live'))"


@pytest.fixture
def browser(chromium, server):
    """The page, with nothing stored from earlier tests."""
    chromium.get(server.url + "/web/icon.svg")
    chromium.execute_script("localStorage.clear(); sessionStorage.clear();")
    chromium.get_log("browser")
    open_page(chromium, server.url)
    return chromium


def audio_parts(body) -> list[dict]:
    """The input_audio parts of a chat request's messages, in order."""
    return [part["input_audio"] for message in body["messages"]
            if isinstance(message["content"], list)
            for part in message["content"] if part.get("type") == "input_audio"]


def decoded(part) -> tuple[wave.Wave_read, np.ndarray]:
    """An input_audio part's WAV, opened, and its samples."""
    clip = wave.open(io.BytesIO(base64.b64decode(part["data"])))
    data = np.frombuffer(clip.readframes(clip.getnframes()), dtype="<i2")
    return clip, data


def loudest_hz(data: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(data.astype(np.float64)))
    return float(np.argmax(spectrum[1:]) + 1) * rate / len(data)


def players(driver):
    return driver.find_elements(By.CSS_SELECTOR, '[data-role="user"] audio.clip')


def duration_of(driver, element) -> float:
    """Seconds of the clip an <audio> element plays, once it has read its header (it
    could not under a policy that forbade its blob: URL)."""
    return wait(driver, lambda d: d.execute_script(
        "const a = arguments[0]; return a.readyState >= 1 && a.duration", element),
        30, "the player reads its clip")


def test_the_policy_is_widened_by_media_from_blob_urls_alone(server):
    with urllib.request.urlopen(server.url + "/") as resp:
        csp = resp.headers["Content-Security-Policy"]
    assert csp == web.CSP
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives == {**BEFORE, "media-src": "'self' blob:"}


def test_record_with_the_microphone_and_send(browser, server):
    """The page asks for the microphone only when its button is pressed, and lets it go
    when pressed again; the fake device's clip goes as a 16-bit PCM WAV at 16 kHz whose
    loudest pitch is the clip's, and its 750 tokens reach the prompt; the message shows
    a player; the clip stays across a reload and goes again with the next message."""
    pick(browser, "ear")
    mic = labelled(browser, "Record audio")
    assert mic.is_displayed() and mic.get_attribute("aria-pressed") == "false"
    assert labelled(browser, "Attach audio").is_displayed()
    settings_of(browser, temperature=0, max_tokens=4)
    assert browser.execute_script("return window.asks.length") == 0  # not before the press
    mic.click()
    status = find(browser, "#recording")
    wait(browser, lambda d: re.fullmatch(r"Recording 0:0[1-9]", status.text), 20,
         "a second recorded")
    assert mic.get_attribute("aria-pressed") == "true"
    assert mic.get_attribute("aria-label") == "Stop recording"
    mic.click()
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#attached audio"), 20,
         "the recording attached")
    assert not status.is_displayed() and mic.get_attribute("aria-pressed") == "false"
    assert browser.execute_script("return window.asks.length") == 1
    assert not browser.execute_script(LIVE)  # the microphone is let go

    before = prompt_tokens_of(server.url, "ear")
    sent = len(server.bodies)
    say(browser, "What is said?")
    last_reply(browser)
    assert len(server.bodies) == sent + 1
    body = server.bodies[-1]
    (part,) = audio_parts(body)
    assert part["format"] == "wav"
    clip, data = decoded(part)
    assert (clip.getnchannels(), clip.getsampwidth(), clip.getframerate()) == (1, 2, 16000)
    assert clip.getnframes() >= 16000  # a second at least
    assert abs(loudest_hz(data, 16000) - PITCH) < 20  # the fake device's clip
    text = [p for p in body["messages"][-1]["content"] if p["type"] == "text"]
    assert text == [{"type": "text", "text": "What is said?"}]
    added = prompt_tokens_of(server.url, "ear") - before
    print(f"recorded {clip.getnframes() / 16000:.2f} s, loudest at "
          f"{loudest_hz(data, 16000):.0f} Hz (the clip's {PITCH}); {added:.0f} prompt tokens")
    assert added > AUDIO_TOKENS_PER_CHUNK

    (shown,) = players(browser)
    assert shown.get_attribute("src").startswith("blob:")
    assert duration_of(browser, shown) >= 1.0
    problems = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert problems == [], problems  # no CSP violation, no script error

    # A reload shows the stored clip, and the next message sends it again; Enter while
    # the microphone records ends the recording and sends it too.
    open_page(browser, server.url)
    (shown,) = players(browser)
    assert duration_of(browser, shown) >= 1.0
    settings_of(browser, max_tokens=2)
    labelled(browser, "Record audio").click()
    wait(browser, lambda d: re.fullmatch(r"Recording 0:0[1-9]", find(d, "#recording").text),
         20, "a second recorded")
    say(browser, "Again")
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR,
                                                '[data-role="assistant"]')) == 2,
         30, "a second reply")
    last_reply(browser)
    first, second = audio_parts(server.bodies[-1])
    assert first == part and decoded(second)[0].getnframes() >= 16000
    assert len(players(browser)) == 2 and not browser.execute_script(LIVE)


def test_attach_a_wav_and_a_flac_file(browser, server, tmp_path):
    """The attach button takes a .wav file and a .flac file: their bytes go unchanged as
    input_audio parts of their formats, alone in a message without text, and the
    tokens of both reach the prompt; a file that is not audio is refused."""
    pick(browser, "ear")
    settings_of(browser, temperature=0, max_tokens=4)
    chooser = find(browser, "#attach-file")
    assert {".wav", ".mp3", ".flac"} <= set(chooser.get_attribute("accept").split(","))
    assert labelled(browser, "Attach audio").is_displayed()
    spoken, sung = tmp_path / "spoken.wav", tmp_path / "sung.flac"
    spoken.write_bytes(wav(1.0, 4))
    sung.write_bytes(flac(1.0, 6))
    browser.execute_script("arguments[0].hidden = false", chooser)
    for n, clip in enumerate((spoken, sung), 1):
        chooser.send_keys(str(clip))
        wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#attached audio")) == n,
             10, f"{clip.name} attached")
    notes = tmp_path / "notes.wav"  # by its name audio, by its bytes not
    notes.write_bytes(b"not a RIFF file at all")
    chooser.send_keys(str(notes))
    wait(browser, lambda d: find(d, "#error").is_displayed(), 10, "the note")
    assert find(browser, "#error-text").text == \
        "notes.wav is not a WAV, MP3 or FLAC file (by its bytes)"
    assert len(browser.find_elements(By.CSS_SELECTOR, "#attached audio")) == 2

    before = prompt_tokens_of(server.url, "ear")
    say(browser, "")  # the clips alone
    last_reply(browser)
    (message,) = server.bodies[-1]["messages"]
    assert message["content"] == [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip.read_bytes())
                                                .decode(), "format": fmt}}
        for clip, fmt in ((spoken, "wav"), (sung, "flac"))]
    assert prompt_tokens_of(server.url, "ear") - before > 2 * AUDIO_TOKENS_PER_CHUNK
    assert len(players(browser)) == 2
    assert duration_of(browser, players(browser)[0]) == pytest.approx(1.0, abs=0.01)
    assert browser.find_element(By.CSS_SELECTOR, "#conversations .current .title").text \
        == "Audio clip"
    browser.save_screenshot(str(tmp_path / "audio.png"))


def test_a_model_that_does_not_hear_has_no_microphone(browser, server, tmp_path):
    """A text model shows neither button; a vision model's attach button refuses a clip
    with a note, and picking it drops a clip attached for a model that hears."""
    from support.vision import write_vision_pair

    model, mmproj = write_vision_pair(tmp_path / "pair")
    assert send(server.url, "POST", "/v1/models/import",
                {"path": str(model), "mmproj": str(mmproj), "id": "eye"})[0] == 200
    send(server.url, "PATCH", "/v1/models/eye", {"cpu_threads": 1, "n_parallel": 1})
    open_page(browser, server.url)
    pick(browser, "deaf")
    assert not labelled(browser, "Record audio").is_displayed()
    assert not find(browser, "#attach").is_displayed()

    clip = tmp_path / "clip.wav"
    clip.write_bytes(wav(1.0, 4))
    pick(browser, "ear")
    chooser = find(browser, "#attach-file")
    browser.execute_script("arguments[0].hidden = false", chooser)
    chooser.send_keys(str(clip))
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#attached audio"), 10,
         "the clip attached")
    pick(browser, "eye")
    assert labelled(browser, "Attach image").is_displayed()
    assert not labelled(browser, "Record audio").is_displayed()
    assert not find(browser, "#attached").is_displayed()
    assert find(browser, "#error-text").text == \
        "eye takes no audio: the attached clip was removed"

    find(browser, "#error-close").click()
    assert "image/*" == chooser.get_attribute("accept")
    chooser.send_keys(str(clip))  # past the chooser's filter, as "All files" can
    wait(browser, lambda d: find(d, "#error").is_displayed(), 10, "the note")
    assert find(browser, "#error-text").text == \
        "clip.wav is audio, and eye takes no audio: pick a model whose capabilities " \
        "include audio"
    assert not find(browser, "#attached").is_displayed()
    sent = len(server.bodies)
    say(browser, "Hello")
    last_reply(browser)
    assert audio_parts(server.bodies[sent]) == []


def test_a_refused_microphone_is_a_note(server, clip_file, tmp_path):
    """A browser that does not let the page have the microphone (headless Chromium
    without the fake prompt refuses it) gives a note, and nothing is recorded."""
    driver = start_chromium(tmp_path / "profile", flags=(
        "--use-fake-device-for-media-stream", f"--use-file-for-fake-audio-capture={clip_file}"))
    try:
        open_page(driver, server.url)
        pick(driver, "ear")
        mic = labelled(driver, "Record audio")
        mic.click()
        wait(driver, lambda d: find(d, "#error").is_displayed(), 20, "the note")
        assert find(driver, "#error-text").text == \
            "The browser was not allowed to use the microphone"
        assert mic.get_attribute("aria-pressed") == "false" and mic.is_enabled()
        assert not find(driver, "#recording").is_displayed()
        assert not find(driver, "#attached").is_displayed()
    finally:
        driver.quit()
