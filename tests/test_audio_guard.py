"""mtmd must never take the server down (issue 36, item 6), on real llama.cpp.

A tiny Ultravox projector 32 wide whose frames are stacked by 8, the real models'
factor, made llama.cpp abort on every 30-second chunk: clip.cpp counts 187 tokens and
its graph makes 188 (build_stack's padding is a mask that rounds up to whole stacks
only for a power of two). localrt.engines.llama.audiotokens plans each clip before mtmd
is asked; here the plan is compared with llama-cpp-python's own mtmd bindings (the
samples its decoder gives, the tokens it counts for each chunk, for qwen2a, ultravox
and voxtral at several lengths, rates and formats), and its verdict with what mtmd
really does when it encodes, in a child process: the projectors it refuses abort
there, the others encode the counted tokens. Qwen3-ASR's, LFM2-Audio's and Gemma 4's
preprocessors are compared through projectors that only count (mtmd loads them, they
cannot encode); a clip of one sample (any type) and an LFM2-Audio clip under two hops
abort mtmd before any encoder, and the plan refuses them. Such a projector is refused
at import
(the child's test clips), and a model a child vetted before the check existed answers
its clip with a 400 while the server goes on. The tokens a chat's usage reports for a
clip are mtmd's, and a clip the context cannot hold is refused before it is decoded.
"""

from __future__ import annotations

import base64
import hashlib
import signal

import openai
import pytest
from support.audio import (encode_in_child, flac, mp3_silence, mtmd_audio_chunks, wav,
                           write_audio_pair, write_audio_projector, write_counting_projector)
from support.servers import run_foreground_server, send
from support.vision import MARKER, prompt_tokens, raw_mtmd_reply

from localrt.engines import audio
from localrt.engines.llama import audiotokens
from localrt.engines.vetting import Outcome, Vetting

pytestmark = pytest.mark.live

ASK = "What is said?"
PROMPT = f"<|im_start|>user\n{ASK}\n{MARKER}<|im_end|>\n<|im_start|>assistant\n"
ABORT = "expected output 187 tokens, got 188"
# the last length of one Whisper chunk: a sample more and the clip is two
ONE_CHUNK = 479839 / 16000


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("audio-guard")


@pytest.fixture(scope="module")
def aborting(folder):
    """The pair llama.cpp aborted on: an Ultravox projector 32 wide, stacked by 8."""
    return write_audio_pair(folder / "aborting", name="tiny-ultravox",
                            projector={"kind": "ultravox", "a_embd": 32})


@pytest.fixture(scope="module")
def ultravox(folder):
    """An Ultravox pair llama.cpp takes: 40 wide, stacked by 8 (187 tokens a chunk)."""
    return write_audio_pair(folder / "ultravox", name="tiny-ultravox",
                            projector={"kind": "ultravox", "a_embd": 40})


def projectors(folder):
    """(name, mmproj) of each Whisper-encoder type the plan is compared on."""
    made = {"qwen2a": {}, "ultravox-32": {"kind": "ultravox", "stack_factor": 8},
            "ultravox-40": {"kind": "ultravox", "stack_factor": 8, "a_embd": 40},
            "voxtral-32": {"kind": "voxtral", "stack_factor": 4},
            "voxtral-40": {"kind": "voxtral", "stack_factor": 4, "a_embd": 40},
            "ultravox-7": {"kind": "ultravox", "stack_factor": 7},
            "qwen2a-1000": {"n_pos": 1000}}
    return {name: write_audio_projector(folder / f"mmproj-{name}.gguf", n_embd=64,
                                        **options)
            for name, options in made.items()}


def planned(mmproj, clip: bytes, kind: str):
    frames, rate = audio.frames(clip, kind)
    samples = audiotokens.resampled(frames, rate)
    return samples, audiotokens.plan(audiotokens.read(mmproj), samples)


def test_the_plan_counts_each_chunk_as_mtmd_does(folder, aborting):
    clips = [(wav(0.005, 1), "wav"), (wav(1.0, 2, rate=44100), "wav"),
             (wav(1.0, 3, rate=8000, channels=2), "wav"), (wav(ONE_CHUNK, 4), "wav"),
             (wav(29.99, 5), "wav"), (wav(30.0, 6, rate=22050), "wav"),
             (wav(45.0, 7), "wav"), (flac(2.0, 8), "flac"), (mp3_silence(1.0), "mp3")]
    model = aborting[0]
    for name, mmproj in projectors(folder).items():
        if name == "qwen2a-1000":
            continue  # mtmd counts its chunks as qwen2a's; only its encode differs
        mtmd = mtmd_audio_chunks(model, mmproj, [clip for clip, _ in clips])
        ours = [planned(mmproj, clip, kind) for clip, kind in clips]
        assert [(n, list(p.counted)) for n, p in ours] == mtmd, name
    # both sides of a chunk's edge, as mtmd cuts them
    assert [len(counts) for _, counts in mtmd[3:5]] == [1, 2]


def test_the_plan_refuses_exactly_what_llama_cpp_aborts_on(folder, aborting):
    for name, mmproj in projectors(folder).items():
        verdict = audiotokens.plan(audiotokens.read(mmproj), 16000)
        child = encode_in_child(aborting[0], mmproj, 1.0)
        if verdict.problem is None:
            assert child.returncode == 0, (name, child.stderr[-2000:])
            assert child.stdout.split() == ["tokenized", "encoded", str(verdict.counted[0])], \
                name
        else:
            assert child.returncode == -signal.SIGABRT, (name, child.returncode)
            if name != "qwen2a-1000":
                assert ABORT in child.stderr, name
    refused = {name for name, mmproj in projectors(folder).items()
               if audiotokens.plan(audiotokens.read(mmproj), 16000).problem}
    assert refused == {"ultravox-32", "voxtral-32", "qwen2a-1000"}


def test_the_plan_counts_the_other_preprocessors_chunks_as_mtmd_does(folder, aborting):
    # Qwen3-ASR's 8-second windows, LFM2-Audio's one chunk, Gemma 4's 30-second pieces:
    # projectors that only count (mtmd loads them; they cannot encode)
    clips = [wav(0.02, 1), wav(1.0, 2, rate=44100), wav(7.99, 3), wav(8.0, 4),
             wav(30.0, 5), wav(30.01, 6), wav(45.0, 7), wav(61.0, 8, rate=22050)]
    for kind in ("qwen3a", "lfm2a", "gemma4a"):
        mmproj = write_counting_projector(folder / f"mmproj-count-{kind}.gguf", kind)
        mtmd = mtmd_audio_chunks(aborting[0], mmproj, clips, warmup=False)
        ours = [planned(mmproj, clip, "wav") for clip in clips]
        assert [(n, list(p.counted)) for n, p in ours] == mtmd, kind
        assert all(p.problem is None for _, p in ours), kind


def test_the_clips_mtmd_aborts_on_before_any_encoder_are_refused(folder, aborting):
    # One sample, for every type (mtmd.cpp: buf.size() > sizeof(float)), and an
    # LFM2-Audio clip under two hops (its per-feature normalization asserts)
    lfm2a = write_counting_projector(folder / "mmproj-count-lfm2a.gguf", "lfm2a")
    qwen2a = projectors(folder)["qwen2a"]
    for mmproj, samples in ((qwen2a, 1), (lfm2a, 1), (lfm2a, 300)):
        verdict = audiotokens.plan(audiotokens.read(mmproj), samples)
        assert verdict.problem is not None
        child = encode_in_child(aborting[0], mmproj, samples / 16000, encode=False)
        assert child.returncode == -signal.SIGABRT and "tokenized" not in child.stdout
        assert "GGML_ASSERT" in child.stderr
    assert audiotokens.plan(audiotokens.read(lfm2a), 320).problem is None
    assert encode_in_child(aborting[0], lfm2a, 320 / 16000, encode=False).returncode == 0


def test_a_projector_llama_cpp_aborts_on_is_refused_at_import(api, aborting, ultravox):
    r = api("POST", "/v1/models/import", {"path": str(aborting[0]),
                                          "mmproj": str(aborting[1]), "id": "deaf"})
    assert r.status == 400 and r.json["error"]["code"] == "invalid_model_file", r.body
    message = r.json["message"]
    assert "mmproj-tiny-ultravox.gguf cannot take a 1-second clip" in message
    assert "count 187 tokens" in message and "turns into 188" in message
    assert api("GET", "/v1/models").json["data"] == []
    # The same type 40 wide takes the test clips: the child encoded one.
    r = api("POST", "/v1/models/import", {"path": str(ultravox[0]),
                                          "mmproj": str(ultravox[1]), "id": "ear"})
    assert r.status == 200 and r.json["model"]["vetting"]["ok"] is True, r.body


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_clip_that_aborted_llama_cpp_is_a_400_and_the_server_goes_on(home, settings,
                                                                        aborting):
    # A model whose files a localrt without this check vetted (its child decoded text
    # only) is kept as loadable in vetted.json, and the server loads it; its clips used
    # to abort the server. The outcome is kept through Vetting's own `run` hook.
    from localrt.app import create_app

    app = create_app(settings)
    try:
        build = app.services.engines.build("gguf-cpp")[0]
    finally:
        app.close()
    vetting = Vetting(settings.data_dir / "engines", run=lambda *a: Outcome(True))
    key = vetting.key([(path, _sha256(path)) for path in aborting], build)
    assert vetting.vet(key, "gguf-cpp", None, aborting[0], {}, 0).ok
    server = run_foreground_server(home)
    try:
        url = server.url
        status, reply = send(url, "POST", "/v1/models/import",
                             {"path": str(aborting[0]), "mmproj": str(aborting[1]),
                              "id": "deaf"}, timeout=60)
        assert status == 200, reply
        assert send(url, "POST", "/v1/models/deaf/start", {"cpu_threads": 1},
                    timeout=60)[0] == 200
        clip = base64.b64encode(wav(1.0, 3)).decode()
        status, reply = send(url, "POST", "/v1/chat/completions", {
            "model": "deaf", "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "text", "text": ASK},
                {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}}]}]},
            timeout=60)
        assert status == 400, reply
        assert reply["error"]["code"] == "invalid_audio"
        assert reply["error"]["param"] == "messages[0].content[1]"
        assert "llama.cpp aborts on that" in reply["error"]["message"]
        assert send(url, "GET", "/healthz")[0] == 200
        # A clip of one sample aborted mtmd with any audio projector.
        one = base64.b64encode(wav(1 / 16000, 3)).decode()
        status, reply = send(url, "POST", "/v1/chat/completions", {
            "model": "deaf", "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": one, "format": "wav"}},
                {"type": "text", "text": ASK}]}]}, timeout=60)
        assert status == 400 and reply["error"]["code"] == "invalid_audio", reply
        assert reply["error"]["param"] == "messages[0].content[0]"
        assert "holds 1 sample" in reply["error"]["message"]
        status, reply = send(url, "POST", "/v1/chat/completions", {
            "model": "deaf", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert status == 200, reply
        assert server.process.poll() is None
    finally:
        server.stop()


def _chat(url, clip: bytes):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model="ear", max_tokens=6, temperature=0, messages=[{"role": "user", "content": [
            {"type": "text", "text": ASK},
            {"type": "input_audio", "input_audio": {
                "data": base64.b64encode(clip).decode(), "format": "wav"}}]}])


def test_usage_counts_a_clips_tokens_as_mtmd_does(thread_server, ultravox):
    url = thread_server.url
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    client.post("/models/import", cast_to=object, body={
        "path": str(ultravox[0]), "mmproj": str(ultravox[1]), "id": "ear"})
    client.post("/models/ear/start", cast_to=object,
                body={"flash_attn": True, "cpu_threads": 1})
    for seconds in (1.0, 31.0):
        clip = wav(seconds, 5)
        reply = _chat(url, clip)
        tokens, _ = prompt_tokens(*ultravox, PROMPT, [clip])
        assert reply.usage.prompt_tokens == tokens, seconds
    assert reply.usage.prompt_tokens > 2 * 187  # two chunks of 187
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=str(ultravox[0]), vocab_only=True, verbose=False)
    try:
        want = vocab.detokenize(raw_mtmd_reply(*ultravox, PROMPT, [wav(1.0, 5)], 6,
                                               n_ctx=2048)).decode("utf-8", "replace")
    finally:
        vocab.close()
    assert _chat(url, wav(1.0, 5)).choices[0].message.content == want


def test_a_clip_the_context_cannot_hold_is_refused_before_it_is_decoded(api, ultravox):
    r = api("POST", "/v1/models/import", {"path": str(ultravox[0]),
                                          "mmproj": str(ultravox[1]), "id": "ear"})
    assert r.status == 200, r.body
    assert api("POST", "/v1/models/ear/start", {"cpu_threads": 1, "ctx_len": 256}).status \
        == 200
    body = {"model": "ear", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {
            "data": base64.b64encode(wav(31.0, 5)).decode(), "format": "wav"}},
        {"type": "text", "text": ASK}]}]}
    r = api("POST", "/v1/chat/completions", body)
    assert r.status == 400 and r.json["error"]["param"] == "messages", r.body
    assert "the prompt's audio is 374 tokens" in r.json["error"]["message"]
    assert "holds 256" in r.json["error"]["message"]


def test_qwen2a_pairs_plan_is_its_chunks(folder):
    """The qwen2a pair's plan: 750 tokens a 30-second chunk, a clip padded by 30 s."""
    mmproj = write_audio_pair(folder / "qwen2a")[1]
    encoder = audiotokens.read(mmproj)
    assert (encoder.type, encoder.positions, encoder.width) == ("qwen2a", 1500, 32)
    assert audiotokens.plan(encoder, 16000).counted == (750,)
    assert audiotokens.plan(encoder, 479840).counted == (750, 750)
