"""POST /v1/audio/transcriptions and /v1/audio/translations (issue 36, item 3): the
bounded multipart/form-data parser (localrt.multipart), each form error a 400 or 413
naming what, and on real llama.cpp (support.audio's tiny qwen2a pair) the openai SDK's
client.audio.transcriptions.create in every response_format and streamed, the text
llama-cpp-python's own mtmd path gives for the same chat, with OpenAI's token usage and
the clip's seconds."""

from __future__ import annotations

import io

import openai
import pytest
from emulators.ggufgen import write_gguf
from support.apps import bind
from support.audio import (AUDIO_TOKENS_PER_CHUNK, start_ear, wav, write_audio_header,
                           write_audio_pair)
from support.vision import MARKER, prompt_tokens, raw_mtmd_reply

from localrt import multipart
from localrt.errors import HTTPError
from localrt.dialects import transcriptions

BOUNDARY = "xYzZY"


def form(fields: dict, files: dict | None = None, boundary: str = BOUNDARY) -> bytes:
    """A multipart/form-data body: text fields, then files (name -> (filename, bytes))."""
    out = []
    for name, value in fields.items():
        out.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
                   .encode() + value.encode() + b"\r\n")
    for name, (filename, data) in (files or {}).items():
        out.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
                   f'filename="{filename}"\r\nContent-Type: audio/wav\r\n\r\n'.encode()
                   + data + b"\r\n")
    out.append(f"--{boundary}--\r\n".encode())
    return b"".join(out)


CTYPE = f"multipart/form-data; boundary={BOUNDARY}"
LIMITS = multipart.Limits(file=lambda name, size: None if size <= 100 else
                          HTTPError(f"{name} too big"), field=10)


# --- the parser ------------------------------------------------------------------------


@pytest.mark.unit
def test_a_form_is_read_whole():
    got = multipart.read(form({"model": "m", "x": "é"}, {"file": ("a.wav", b"RIFF\r\n--")}),
                         CTYPE, LIMITS)
    assert got.fields == {"model": "m", "x": "é"}
    assert got.files["file"] == multipart.Upload("a.wav", "audio/wav", b"RIFF\r\n--")
    quoted = f'multipart/form-data; charset=utf-8; boundary="{BOUNDARY}"'
    assert multipart.read(form({"a": "b"}), quoted, LIMITS).fields == {"a": "b"}


@pytest.mark.unit
@pytest.mark.parametrize("body, ctype, words", [
    (form({"a": "b"}), "multipart/form-data", "names no boundary"),
    (form({"a": "b"}), "application/json", "Expected a multipart/form-data body"),
    (form({"a": "b"}, boundary="other"), CTYPE, "never appears"),
    (form({"a": "b"})[:-12], CTYPE, "no closing boundary"),
    (f"--{BOUNDARY}\r\nContent-Type: text/plain\r\n\r\nx\r\n--{BOUNDARY}--".encode(), CTYPE,
     "has no Content-Disposition"),
    (f"--{BOUNDARY}\r\nContent-Disposition: form-data\r\n\r\nx\r\n--{BOUNDARY}--".encode(),
     CTYPE, "has no name"),
    (f"--{BOUNDARY}\r\nno colon here\r\n\r\nx\r\n--{BOUNDARY}--".encode(), CTYPE,
     "without a colon"),
    (form({"a": "b"}) .replace(b"--\r\n", b"") + form({"a": "c"})[len(BOUNDARY) + 2:],
     CTYPE, "given twice"),
    (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=a\r\n\r\n".encode() + b"\xff"
     + f"\r\n--{BOUNDARY}--".encode(), CTYPE, "not UTF-8"),
    (f"--{BOUNDARY}\r\n".encode() + b"X: " + b"y" * 9000 + b"\r\n\r\n", CTYPE,
     "do not end within"),
])
def test_a_malformed_form_is_a_400_naming_what(body, ctype, words):
    with pytest.raises(HTTPError) as caught:
        multipart.read(body, ctype, LIMITS)
    assert caught.value.status == 400 and words in caught.value.message


@pytest.mark.unit
def test_a_form_array_may_repeat_its_name():
    # as the openai SDK sends timestamp_granularities=["word", "segment"]
    body = (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="t[]"\r\n\r\nword\r\n'
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="t[]"\r\n\r\nsegment\r\n'
            f'--{BOUNDARY}--\r\n').encode()
    assert multipart.read(body, CTYPE, LIMITS).fields == {"t[]": ["word", "segment"]}


@pytest.mark.unit
def test_a_field_or_file_over_its_limit():
    with pytest.raises(HTTPError) as caught:
        multipart.read(form({"prompt": "x" * 11}), CTYPE, LIMITS)
    assert caught.value.status == 413 and caught.value.param == "prompt"
    with pytest.raises(HTTPError, match="file too big"):
        multipart.read(form({}, {"file": ("a.wav", b"x" * 101)}), CTYPE, LIMITS)
    too_many = b"".join(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="f{i}"'
                        f'\r\n\r\nv\r\n'.encode() for i in range(multipart.MAX_PARTS + 1))
    with pytest.raises(HTTPError, match="more than 64 parts"):
        multipart.read(too_many + f"--{BOUNDARY}--".encode(), CTYPE, LIMITS)


@pytest.mark.unit
def test_subtitles_and_the_family_table():
    assert transcriptions._stamp(3723.5, ",") == "01:02:03,500"
    assert transcriptions._stamp(2.0, ".") == "00:00:02.000"
    qwen = transcriptions.FAMILIES["qwen3a"]
    assert transcriptions.split("language English<asr_text>hello there", qwen) == \
        ("English", "hello there")
    assert transcriptions.split("no marker", qwen) == (None, "no marker")
    assert transcriptions.FAMILIES["voxtral"].transcribe("en") == "lang:en[TRANSCRIBE]"
    assert transcriptions.DEFAULT.transcribe(None) == "Transcribe the audio exactly."


# --- through the app: every form error before a model starts ----------------------------


@pytest.fixture(scope="module")
def header_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("transcribe")
    return write_gguf(root / "tiny.gguf", name="tiny"), write_audio_header(
        root / "mmproj-a.gguf", 64)


@pytest.fixture
def form_api(app, header_files):
    api = bind(app)
    for model_id, mmproj in (("ear", header_files[1]), ("plain", None)):
        body = {"path": str(header_files[0]), "id": model_id}
        if mmproj:
            body["mmproj"] = str(mmproj)
        assert api("POST", "/v1/models/import", body).status == 200
    return api


def post(api, body: bytes, ctype: str = CTYPE, path="/v1/audio/transcriptions"):
    return api("POST", path, body=body, headers={"Content-Type": ctype})


# OpenAI's array fields, as its SDK sends them: read (a name repeated) and ignored
ARRAYS = b"".join(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
                  f'{value}\r\n'.encode() for name, value in (
                      ("timestamp_granularities[]", "word"),
                      ("timestamp_granularities[]", "segment"), ("include[]", "logprobs")))


@pytest.mark.unit
def test_every_form_error_names_what(form_api):
    clip = ("a.wav", wav(0.5))
    cases = [
        (post(form_api, form({"model": "ear"}, {"file": clip}), "application/json"),
         415, "unsupported_media_type", None),
        (post(form_api, form({"model": "ear"}, {"file": clip})[:-10]), 400, None, None),
        (post(form_api, form({"model": "ear"})), 400, "invalid_field", "file"),
        (post(form_api, form({}, {"file": clip})), 400, "invalid_field", "model"),
        (post(form_api, form({"model": "nope"}, {"file": clip})), 404, "model_not_found",
         None),
        (post(form_api, form({"model": "plain"}, {"file": clip})), 400,
         "audio_not_supported", "model"),
        (post(form_api, ARRAYS + form({"model": "plain"}, {"file": clip})), 400,
         "audio_not_supported", "model"),
        (post(form_api, form({"model": "ear"}, {"file": ("a.txt", b"hello")})), 400,
         "invalid_audio", "file"),
        (post(form_api, form({"model": "ear", "response_format": "xml"}, {"file": clip})),
         400, "invalid_field", "response_format"),
        (post(form_api, form({"model": "ear", "temperature": "hot"}, {"file": clip})), 400,
         "invalid_field", "temperature"),
        (post(form_api, form({"model": "ear", "stream": "true", "response_format": "srt"},
                             {"file": clip})), 400, "invalid_field", "stream"),
        (post(form_api, form({"model": "ear", "prompt": "x" * 70_000}, {"file": clip})),
         413, "payload_too_large", "prompt"),
        (post(form_api, form({"model": "ear"}, {"file": ("big.wav", wav(0.1) + bytes(
            25 * 1024 * 1024))})), 413, "audio_too_large", "file"),
    ]
    for r, status, code, param in cases:
        assert r.status == status, r.body
        if code:
            assert r.json["error"]["code"] == code, r.body
        if param:
            assert r.json["error"]["param"] == param, r.body
    assert form_api("GET", "/v1/models/status").json["data"] == []  # nothing was started


@pytest.mark.unit
def test_the_route_is_in_the_openapi_document(form_api):
    doc = form_api("GET", "/openapi.json").json
    body = doc["paths"]["/v1/audio/transcriptions"]["post"]["requestBody"]
    assert list(body["content"]) == ["multipart/form-data"]


# --- on real llama.cpp ------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # a context of 880: the clip's 750 tokens and the instruction leave a short reply,
    # which this random model (it never ends one) writes to the context's end
    return write_audio_pair(tmp_path_factory.mktemp("transcribe-pair"), context_length=880)


@pytest.fixture
def server(thread_server, pair):
    start_ear(thread_server.url, pair, cpu_threads=2)  # two threads, as the reference runs
    return thread_server


def mtmd_text(pair, clip: bytes, instruction: str, most: int = 10) -> str:
    """The text of the first `most` tokens that llama-cpp-python's own mtmd path gives
    for the chat a transcription is. This random model never ends a reply (the
    server's ends at the context's end), and its next-token scores are near ties, so
    past its first tokens the last bits of llama.cpp's sums (their batches and threads
    differ) can choose another token: the tests compare 10 tokens, as the vision tests
    do, and the rest of the reply between the server's own formats."""
    import llama_cpp

    prompt = f"<|im_start|>user\n{MARKER}\n{instruction}<|im_end|>\n<|im_start|>assistant\n"
    vocab = llama_cpp.Llama(model_path=str(pair[0]), vocab_only=True, verbose=False)
    try:
        tokens = raw_mtmd_reply(*pair, prompt, [clip], most, n_ctx=1024)
        return vocab.detokenize(tokens).decode("utf-8", errors="replace")
    finally:
        vocab.close()


@pytest.mark.live
def test_the_openai_sdk_transcribes_in_every_format(server, pair):
    clip = wav(2.0, 1)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    def ask(**extra):
        return client.audio.transcriptions.create(model="ear", file=("a.wav", clip),
                                                  **extra)

    whole = ask()
    want = whole.text
    assert want.startswith(mtmd_text(pair, clip, "Transcribe the audio exactly.").strip())
    used = whole.usage
    assert (used.type, used.input_token_details.audio_tokens, used.seconds) == \
        ("tokens", AUDIO_TOKENS_PER_CHUNK, 2.0)
    assert used.input_tokens == used.input_token_details.audio_tokens + \
        used.input_token_details.text_tokens
    # the text's tokens as mtmd counts them in the same chat (BOS and template included)
    counted, _ = prompt_tokens(*pair, f"<|im_start|>user\n{MARKER}\nTranscribe the audio "
                               f"exactly.<|im_end|>\n<|im_start|>assistant\n", [clip])
    assert used.input_token_details.text_tokens == counted - AUDIO_TOKENS_PER_CHUNK
    assert used.total_tokens == used.input_tokens + used.output_tokens > used.input_tokens
    assert ask(response_format="text") == want
    verbose = ask(response_format="verbose_json", language="en")
    assert (verbose.duration, verbose.language, verbose.task) == (2.0, "en", "transcribe")
    assert verbose.segments[0].end == 2.0
    assert verbose.segments[0].text == verbose.text != want
    assert verbose.text.startswith(
        mtmd_text(pair, clip, "Transcribe the audio exactly. It is in en.").strip())
    assert ask(response_format="verbose_json").language == "unknown"
    assert ask(response_format="srt") == f"1\n00:00:00,000 --> 00:00:02,000\n{want}\n\n"
    assert ask(response_format="vtt") == \
        f"WEBVTT\n\n00:00:00.000 --> 00:00:02.000\n{want}\n\n"
    events = list(ask(stream=True))
    assert [e.type for e in events[:-1]] == ["transcript.text.delta"] * (len(events) - 1)
    assert "".join(e.delta for e in events[:-1]).strip() == events[-1].text == want
    assert events[-1].type == "transcript.text.done"
    assert events[-1].usage.model_dump() == used.model_dump()
    other = client.audio.transcriptions.create(model="ear", file=("b.wav", wav(1.0, 3)))
    assert other.text.startswith(
        mtmd_text(pair, wav(1.0, 3), "Transcribe the audio exactly.").strip())
    assert other.text[:20] != want[:20]
    assert (other.usage.seconds, other.usage.input_token_details.audio_tokens) == \
        (1.0, AUDIO_TOKENS_PER_CHUNK)


@pytest.mark.live
def test_a_translation_asks_for_english(server, pair):
    clip = wav(2.0, 1)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    got = client.audio.translations.create(model="ear", file=("a.wav", io.BytesIO(clip)))
    assert got.text.startswith(
        mtmd_text(pair, clip, "Translate the audio into English.").strip())
