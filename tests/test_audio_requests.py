"""Audio in chat requests (issue 36, item 2): clips read and checked by signature and
header (localrt.engines.audio), the limits (maxAudioSeconds, 25 MiB a clip,
maxMediaPerRequest with images), and every dialect's shape: OpenAI's input_audio parts,
Ollama's audio in `images`, and the 400s of Anthropic's Messages and the Responses API,
which have no audio part. The models here are imported with projector headers
(support.audio.write_audio_header); every check answers before a model starts."""

from __future__ import annotations

import base64
import struct

import pytest
from emulators.ggufgen import write_gguf
from support.apps import bind
from support.audio import flac, mp3_silence, wav, write_audio_header
from support.projectors import write_projector
from support.vision import png

from localrt.errors import AudioTooLarge, AudioTooLong, InvalidAudio
from localrt.engines import audio as clips
from localrt.inference import media
from localrt.native import Media

pytestmark = pytest.mark.unit

ASK = "What is said?"


# --- clips by their bytes -----------------------------------------------------------


def test_formats_by_signature():
    assert clips.format_of(wav(0.1)) == "wav"
    assert clips.format_of(flac(0.1)) == "flac"
    assert clips.format_of(mp3_silence(0.1)) == "mp3"
    assert clips.format_of(b"ID3\x04\x00\x00\x00\x00\x00\x00" + mp3_silence(0.1)) == "mp3"
    for other in (png(4, 4, 0), b"\xff\xd8\xff\xe0JFIF", b"RIFF\0\0\0\0AVI ", b"", b"fLa"):
        assert clips.format_of(other) is None


@pytest.mark.parametrize("seconds", [0.5, 2.0, 7.25])
def test_lengths_from_the_headers(seconds):
    assert clips.seconds(wav(seconds), "wav") == pytest.approx(seconds)
    assert clips.seconds(wav(seconds, rate=8000, channels=2), "wav") == \
        pytest.approx(seconds)
    assert clips.seconds(flac(seconds), "flac") == pytest.approx(seconds)
    frames = max(1, int(seconds * 44100 / 1152))
    assert clips.seconds(mp3_silence(seconds), "mp3") == pytest.approx(frames * 1152 / 44100)


def test_an_mp3_walk_stops_past_the_limit():
    long = mp3_silence(60.0)
    assert 10 < clips.seconds(long, "mp3", limit=10) < 10.1


@pytest.mark.parametrize("data, words", [
    (b"RIFF\0\0\0\0WAVEdata\4\0\0\0abcd", "data chunk comes before a fmt chunk"),
    (b"RIFF\0\0\0\0WAVEjunk\0\0\0\0", "no fmt and data chunks"),
    (b"fLaC\x01\0\0\x22" + bytes(34), "does not begin with a STREAMINFO block"),
    (b"fLaC\x80\0\0\x22" + bytes(34), "sample rate of 0"),
    (b"ID3\x04\0\0\0\0\0\0" + b"nothing here", "no MPEG audio frame"),
])
def test_a_malformed_header_is_invalid_audio_naming_the_part(data, words):
    with pytest.raises(InvalidAudio) as caught:
        media.clip(data, "messages[0].content[1]", 600)
    assert caught.value.param == "messages[0].content[1]"
    assert words in caught.value.message and caught.value.code == "invalid_audio"


def test_the_limits_of_a_clip():
    with pytest.raises(AudioTooLong) as caught:
        media.clip(wav(3.0), "messages[0].content[1]", 2)
    assert caught.value.status == 400 and caught.value.code == "audio_too_long"
    assert "at most 2 seconds are taken (maxAudioSeconds)" in caught.value.message
    big = wav(0.1) + bytes(media.AUDIO_MAX_BYTES)
    with pytest.raises(AudioTooLarge) as caught:
        media.clip(big, "messages[0].content[1]", 600)
    assert caught.value.status == 413 and caught.value.code == "audio_too_large"
    text = base64.b64encode(big).decode()
    with pytest.raises(AudioTooLarge):  # refused before it is decoded
        media.audio_from_base64(text, "x")
    assert media.clip(wav(2.0), "w", 2).seconds == pytest.approx(2.0)


def test_max_media_counts_images_and_clips_and_the_old_name_still_works(settings):
    assert media.Policy.of(settings).max_media == 8
    assert media.Policy.of(settings).max_audio_seconds == 600
    settings.update({"maxImagesPerRequest": 3})
    assert media.Policy.of(settings).max_media == 3
    settings.update({"maxMediaPerRequest": 5})
    assert media.Policy.of(settings).max_media == 5
    parts = [Media(b"", "image/*", f"m[{i}]") if i % 2 else Media(b"", "audio/wav", f"m[{i}]")
             for i in range(4)]
    policy = media.Policy(max_media=3)
    with pytest.raises(media.InvalidField) as caught:
        media.check("m", {"image", "audio"}, parts, policy)
    assert caught.value.param == "m[3]" and "(maxMediaPerRequest)" in caught.value.message
    assert media.check("m", {"image", "audio"}, parts[:3], policy) == 3


def test_ollamas_images_are_told_apart_by_their_bytes():
    for data, kind in ((wav(0.1), "audio/wav"), (flac(0.1), "audio/flac"),
                       (mp3_silence(0.1), "audio/mpeg"), (png(4, 4, 0), "image/png")):
        url = media.data_url(base64.b64encode(data).decode())
        assert url.startswith(f"data:{kind};base64,")


# --- through the app ------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio-requests")
    model = write_gguf(root / "tiny.gguf", name="tiny")
    return {"model": model, "audio": write_audio_header(root / "mmproj-a.gguf", 64),
            "vision": write_projector(root / "mmproj-v.gguf", 64)}


@pytest.fixture
def api(app, files):
    api = bind(app)
    for model_id, mmproj in (("ear", files["audio"]), ("eye", files["vision"]),
                             ("plain", None)):
        body = {"path": str(files["model"]), "id": model_id}
        if mmproj:
            body["mmproj"] = str(mmproj)
        r = api("POST", "/v1/models/import", body)
        assert r.status == 200, r.body
    return api


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def chat(api, *parts, model="ear", **extra):
    return api("POST", "/v1/chat/completions", {
        "model": model, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": ASK}, *parts]}],
        **extra})


def error(r) -> tuple:
    return r.status, r.json["error"]["code"], r.json["error"].get("param")


def test_every_audio_check_is_a_clear_error_before_the_model_starts(api, settings):
    where = "messages[0].content[1]"
    assert error(chat(api, audio_part(b"RIFF\0\0\0\0WAVEjunk"))) == \
        (400, "invalid_audio", where)
    assert error(chat(api, audio_part(png(4, 4, 0)))) == (400, "invalid_audio", where)
    r = chat(api, {"type": "input_audio", "input_audio": {"data": "!!!", "format": "wav"}})
    assert error(r) == (400, "invalid_audio", where)
    r = chat(api, audio_part(wav(0.5), fmt="ogg"))
    assert r.status == 400 and "format" in r.json["error"]["message"]
    assert error(chat(api, audio_part(wav(0.5)), model="eye")) == \
        (400, "audio_not_supported", "model")
    r = chat(api, audio_part(wav(0.5)), model="plain")
    assert error(r) == (400, "audio_not_supported", "model")
    assert "Model plain does not take audio" in r.json["error"]["message"]
    r = chat(api, {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                      + base64.b64encode(png(4, 4, 0))
                                                      .decode()}})
    assert error(r) == (400, "images_not_supported", "model")  # an audio-only projector
    settings.update({"maxAudioSeconds": 1})
    r = chat(api, audio_part(wav(2.0)))
    assert error(r) == (400, "audio_too_long", where)
    assert "at most 1 seconds are taken (maxAudioSeconds)" in r.json["error"]["message"]
    settings.update({"maxAudioSeconds": 600, "maxMediaPerRequest": 2})
    r = chat(api, audio_part(wav(0.2)), audio_part(flac(0.2), "flac"),
             audio_part(mp3_silence(0.2), "mp3"))
    assert error(r) == (400, "invalid_field", "messages[0].content[3]")
    assert api("GET", "/v1/models/status").json["data"] == []  # nothing was started


def test_a_streamed_request_is_checked_the_same(api):
    r = chat(api, audio_part(b"fLaC" + bytes(8)), stream=True)
    assert error(r) == (400, "invalid_audio", "messages[0].content[1]")


def test_ollama_audio_in_images_is_checked_as_audio(api):
    r = api("POST", "/api/chat", {"model": "eye", "stream": False, "messages": [
        {"role": "user", "content": ASK,
         "images": [base64.b64encode(wav(0.5)).decode()]}]})
    assert r.status == 400 and "does not take audio" in r.json["error"]
    bad = b"RIFF\0\0\0\0WAVEnothing"
    r = api("POST", "/api/chat", {"model": "ear", "stream": False, "messages": [
        {"role": "user", "content": ASK, "images": [base64.b64encode(bad).decode()]}]})
    assert r.status == 400 and "messages[0].images[0]" in r.json["error"]


def test_anthropic_and_responses_have_no_audio_part(api):
    b64 = base64.b64encode(wav(0.5)).decode()
    r = api("POST", "/v1/messages", {"model": "ear", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": ASK},
                                     {"type": "input_audio", "input_audio": {
                                         "data": b64, "format": "wav"}}]}]})
    assert r.status == 400 and r.json["type"] == "error"
    assert r.json["error"]["type"] == "invalid_request_error"
    assert "the Messages API has no audio block" in r.json["error"]["message"]
    r = api("POST", "/v1/messages", {"model": "ear", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "audio/wav", "data": b64}}]}]})
    assert r.status == 400 and "cannot carry audio" in r.json["error"]["message"]
    r = api("POST", "/v1/responses", {"model": "ear", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": ASK},
                                     {"type": "input_audio", "input_audio": {
                                         "data": b64, "format": "wav"}}]}]})
    assert r.status == 400 and "audio are not supported" in r.json["error"]["message"]
