"""An audio model end to end on real llama.cpp and mtmd (support.audio's tiny qwen2a
pair): the openai SDK's input_audio parts, whole and streamed, and Ollama's audio in
`images` give the greedy reply llama-cpp-python's own mtmd path gives for the same
prompt and clip; WAV and FLAC of the same samples give the same reply, another clip
another; usage counts the clips' tokens (prompt_tokens_details.audio_tokens); four
streams, two with clips, each answer as alone; a second turn reuses the clip's KV."""

from __future__ import annotations

import base64
import threading

import ollama
import openai
import pytest
from support.audio import (AUDIO_TOKENS_PER_CHUNK, flac, mp3_silence, start_ear, wav,
                           write_audio_pair)
from support.vision import MARKER, prompt_tokens, raw_mtmd_reply

pytestmark = pytest.mark.live

ASK = "What is said?"
PROMPT = f"<|im_start|>user\n{ASK}\n{MARKER}<|im_end|>\n<|im_start|>assistant\n"
# Ollama puts a message's images (and clips) before its text, as Ollama does
CLIPS_FIRST = f"<|im_start|>user\n{MARKER}\n{ASK}<|im_end|>\n<|im_start|>assistant\n"
# Clips whose first ten greedy tokens win by a clear margin (0.1 in logits at least):
# this random model has near ties elsewhere, which the last bits of llama.cpp's sums
# (batches of other sequences beside them, thread counts) may decide either way.
A, B = wav(2.0, 2), wav(1.0, 4)
C = flac(1.0, 4)  # B's samples as FLAC


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_audio_pair(tmp_path_factory.mktemp("audio-api"))


@pytest.fixture
def server(thread_server, pair):
    start_ear(thread_server.url, pair, cpu_threads=1)
    return thread_server


def expected(pair, prompt, clip) -> str:
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=str(pair[0]), vocab_only=True, verbose=False)
    try:
        return vocab.detokenize(raw_mtmd_reply(*pair, prompt, [clip], 10, n_ctx=2048)
                                ).decode("utf-8", errors="replace")
    finally:
        vocab.close()


def part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def via_openai(url, data, fmt="wav", stream=False, **extra):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="ear", max_tokens=10, temperature=0, stream=stream, **extra, messages=[
            {"role": "user", "content": [{"type": "text", "text": ASK}, part(data, fmt)]}])
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
    return reply.choices[0].message.content


def test_the_openai_sdk_gets_mtmds_reply_whole_and_streamed(server, pair):
    want = expected(pair, PROMPT, A)
    assert via_openai(server.url, A) == want
    assert via_openai(server.url, A, stream=True) == want
    assert via_openai(server.url, flac(2.0, 2), "flac") == want  # the same samples
    assert via_openai(server.url, B) == expected(pair, PROMPT, B) != want
    assert via_openai(server.url, mp3_silence(1.0), "mp3") == \
        expected(pair, PROMPT, mp3_silence(1.0))


def test_usage_counts_the_clips_tokens_whole_and_streamed(server, pair):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    two = [{"role": "user", "content": [{"type": "text", "text": ASK}, part(A),
                                        part(C, "flac")]}]
    # what mtmd counts for the same prompt: the text's tokens and each clip's chunk
    want, _ = prompt_tokens(*pair, f"<|im_start|>user\n{ASK}\n{MARKER}\n{MARKER}<|im_end|>\n"
                            f"<|im_start|>assistant\n", [A, C])
    whole = client.chat.completions.create(model="ear", max_tokens=2, temperature=0,
                                           messages=two).usage
    assert whole.prompt_tokens == want
    assert whole.prompt_tokens_details.audio_tokens == 2 * AUDIO_TOKENS_PER_CHUNK
    chunks = list(client.chat.completions.create(
        model="ear", max_tokens=2, temperature=0, messages=two, stream=True,
        stream_options={"include_usage": True}))
    streamed = chunks[-1].usage
    assert streamed.prompt_tokens == want
    assert streamed.prompt_tokens_details.audio_tokens == 2 * AUDIO_TOKENS_PER_CHUNK
    assert streamed.prompt_tokens_details.cached_tokens > 0  # cached, and still counted
    text = client.chat.completions.create(model="ear", max_tokens=2, temperature=0,
                                          messages=[{"role": "user", "content": ASK}])
    assert text.usage.prompt_tokens_details.audio_tokens == 0


def test_ollamas_images_take_a_clip(server, pair):
    with ollama.Client(host=server.url, timeout=120) as client:
        reply = client.chat(model="ear", options={"temperature": 0, "num_predict": 10},
                            messages=[{"role": "user", "content": ASK, "images": [A]}])
    assert reply.message.content == expected(pair, CLIPS_FIRST, A)


def test_four_streams_two_with_clips_each_answer_as_alone(server):
    alone = {"a": via_openai(server.url, A), "b": via_openai(server.url, B)}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    def text_reply(i, stream=False):
        reply = client.chat.completions.create(
            model="ear", max_tokens=10, temperature=0, stream=stream,
            messages=[{"role": "user", "content": f"Tell me {i}"}])
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        return reply.choices[0].message.content

    text_alone = {i: text_reply(i) for i in (1, 2)}
    out = {}

    def text(i):
        out[i] = text_reply(i, stream=True)

    def hearing(name, clip):
        out[name] = via_openai(server.url, clip, stream=True)

    threads = [threading.Thread(target=text, args=(1,)),
               threading.Thread(target=text, args=(2,)),
               threading.Thread(target=hearing, args=("a", A)),
               threading.Thread(target=hearing, args=("b", B))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {**alone, **text_alone}


def test_the_second_turn_about_a_clip_reuses_its_kv(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    turn = [{"role": "user", "content": [{"type": "text", "text": ASK},
                                         part(wav(1.5, 9))]}]
    first = client.chat.completions.create(model="ear", max_tokens=8, temperature=0,
                                           messages=turn)
    assert first.usage.prompt_tokens > AUDIO_TOKENS_PER_CHUNK
    second = client.chat.completions.create(
        model="ear", max_tokens=8, temperature=0, messages=turn + [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And who said it?"}])
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
