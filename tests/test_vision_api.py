"""A vision model through the real SDKs, the hub's two repo shapes and the CLI, on real
llama.cpp and mtmd (support.vision's tiny pair, the text model quantized to Q8_0).

Every dialect: the same image and seed give the same reply, two images two replies,
and the greedy reply is what llama-cpp-python's own mtmd path gives. Then four streams
at once (two with images), a second turn that reuses the image's KV, and pulls of a
cortexso branch and of an org/repo with several projectors, which start as vision
models.
"""

from __future__ import annotations

import base64
import threading

import anthropic
import ollama
import openai
import pytest
from support.models import quantize
from support.vision import MARKER, png, raw_mtmd_reply, write_projector, write_vision_pair

ASK = "What is in this picture?"
PROMPT = f"<|im_start|>user\n{ASK}\n{MARKER}<|im_end|>\n<|im_start|>assistant\n"
# Ollama puts a message's images before its text, as Ollama does
IMAGES_FIRST = f"<|im_start|>user\n{MARKER}\n{ASK}<|im_end|>\n<|im_start|>assistant\n"
A, B = png(64, 64, 21), png(64, 64, 22)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-api")
    model, mmproj = write_vision_pair(root)
    return quantize(model, root / "eye-Q8_0.gguf", "Q8_0"), mmproj


@pytest.fixture
def server(thread_server, pair):
    r = openai.OpenAI(base_url=thread_server.url + "/v1", api_key="unused")
    r.post("/models/import", cast_to=object,
           body={"path": str(pair[0]), "mmproj": str(pair[1]), "id": "eye"})
    # flash attention as the reference's llama.cpp default has it on a CPU
    r.post("/models/eye/start", cast_to=object, body={"flash_attn": True})
    return thread_server


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def via_openai(url, image, **extra) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="eye", max_tokens=10, **{"temperature": 0, **extra}, messages=[
            {"role": "user", "content": [
                {"type": "text", "text": ASK},
                {"type": "image_url", "image_url": {"url": data_url(image),
                                                    "detail": "low"}}]}])
    return reply.choices[0].message.content


def via_responses(url, image, **extra) -> str:
    seed = extra.pop("seed", None)  # not a Responses field: localrt takes it beside them
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    reply = client.responses.create(
        model="eye", max_output_tokens=10, **{"temperature": 0, **extra},
        extra_body={"seed": seed} if seed is not None else None, input=[
            {"role": "user", "content": [
                {"type": "input_text", "text": ASK},
                {"type": "input_image", "image_url": data_url(image), "detail": "auto"}]}])
    return reply.output_text


def via_anthropic(url, image, **extra) -> str:
    # this SDK takes no temperature (nor seed, localrt's): both go beside its fields
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as client:
        reply = client.messages.create(
            model="eye", max_tokens=10, extra_body={"temperature": 0, **extra}, messages=[
                {"role": "user", "content": [
                    {"type": "text", "text": ASK},
                    {"type": "image", "source": {
                        "type": "base64", "media_type": "image/png",
                        "data": base64.b64encode(image).decode()}}]}])
    return "".join(block.text for block in reply.content)


def via_ollama(url, image, **extra) -> str:
    options = {"temperature": 0, "num_predict": 10, **extra}
    with ollama.Client(host=url, timeout=120) as client:
        reply = client.chat(model="eye", options=options, messages=[
            {"role": "user", "content": ASK, "images": [image]}])
    return reply.message.content


DIALECTS = [via_openai, via_responses, via_anthropic, via_ollama]


@pytest.mark.parametrize("send", DIALECTS, ids=lambda f: f.__name__)
def test_each_sdk_gets_the_reply_mtmd_gives_and_images_make_the_difference(server, pair,
                                                                        send):
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=str(pair[0]), vocab_only=True, verbose=False)
    try:
        prompt = IMAGES_FIRST if send is via_ollama else PROMPT
        expected = vocab.detokenize(raw_mtmd_reply(*pair, prompt, [A], 10)).decode(
            "utf-8", errors="replace")
    finally:
        vocab.close()
    assert send(server.url, A) == expected
    assert send(server.url, B) != expected
    sampled = {"temperature": 0.9, "seed": 5}
    assert send(server.url, A, **sampled) == send(server.url, A, **sampled)


def test_four_streams_two_with_images_each_complete_with_their_own_reply(server):
    alone = {"a": via_openai(server.url, A), "b": via_openai(server.url, B)}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    text_alone = {i: client.chat.completions.create(
        model="eye", max_tokens=10, temperature=0,
        messages=[{"role": "user", "content": f"Tell me {i}"}]).choices[0].message.content
        for i in (1, 2)}
    out, arrivals = {}, {}

    def text(i):
        stream = client.chat.completions.create(
            model="eye", max_tokens=10, temperature=0, stream=True,
            messages=[{"role": "user", "content": f"Tell me {i}"}])
        out[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def seeing(name, image):
        out[name] = via_openai(server.url, image)

    threads = [threading.Thread(target=text, args=(1,)), threading.Thread(target=text, args=(2,)),
               threading.Thread(target=seeing, args=("a", A)),
               threading.Thread(target=seeing, args=("b", B))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {**alone, **text_alone}


def test_the_second_turn_about_an_image_reuses_its_kv(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    turn = [{"role": "user", "content": [
        {"type": "text", "text": ASK},
        {"type": "image_url", "image_url": {"url": data_url(png(64, 64, 30))}}]}]
    first = client.chat.completions.create(model="eye", max_tokens=8, temperature=0,
                                           messages=turn)
    second = client.chat.completions.create(
        model="eye", max_tokens=8, temperature=0, messages=turn + [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And its colours?"}])
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1  # the image's 36 positions among them
    assert first.usage.prompt_tokens > 36


def test_pulled_vision_models_of_both_repo_shapes_start_as_vision_models(hub_app, hub):
    """A cortexso branch with mmproj.gguf, and an org/repo with several mmproj-*.gguf,
    of which the F16 one comes along; each answers an image."""
    from support.apps import bind
    from support.tasks import wait_task

    api = bind(hub_app)
    answers = []
    for name, projector in (("eye", "mmproj.gguf"), ("org/eye-GGUF", "mmproj-eye-f16.gguf")):
        r = api("POST", "/v1/models/pull", {"model": name})
        assert r.status == 200, r.body
        if "task" in r.json:
            assert wait_task(api, r.json["task"]["id"])["status"] == "Success"
        model = api("GET", f"/v1/models/{r.json['model']}").json
        assert model["mmproj"] == projector and model["capabilities"] == ["chat", "vision"]
        reply = api("POST", "/v1/chat/completions", {
            "model": model["id"], "max_tokens": 8, "temperature": 0, "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": ASK},
                    {"type": "image_url", "image_url": {"url": data_url(A)}}]}]})
        assert reply.status == 200, reply.body
        answers.append(reply.json["choices"][0]["message"]["content"])
        api("POST", f"/v1/models/{model['id']}/stop")
    assert answers[0] == answers[1]  # the same pair, whichever way it came


# A cortexso branch's model.yml, as the real hub's carry one: its prompt_template is the
# model's own ChatML (cortex's {system_message} and {prompt}).
MODEL_YML = ("model: seer\nname: seer\nengine: llama-cpp\nctx_len: 1024\n"
             "prompt_template: \"{system_message}<|im_start|>user\\n{prompt}<|im_end|>\\n"
             "<|im_start|>assistant\\n\"\n")


def test_a_pulled_vision_model_with_a_prompt_template_takes_images_where_the_parts_were(
        hub_app, hub, pair):
    """The mend of issue 33: a cortexso vision branch's prompt_template has no place for
    images; the images go where their parts were, inside {prompt}, so the model sees the
    prompt its own template would give: the reply is mtmd's for it, in every dialect."""
    import llama_cpp

    from support.apps import bind
    from support.tasks import wait_task

    api = bind(hub_app)
    r = api("POST", "/v1/models/pull", {"model": "seer"})
    assert r.status == 200, r.body
    assert wait_task(api, r.json["task"]["id"])["status"] == "Success"
    model_id = r.json["model"]
    model = api("GET", f"/v1/models/{model_id}").json
    assert model["prompt_template"].startswith("{system_message}<|im_start|>user")
    assert model["capabilities"] == ["chat", "vision"]
    vocab = llama_cpp.Llama(model_path=str(pair[0]), vocab_only=True, verbose=False)
    try:
        expected = vocab.detokenize(raw_mtmd_reply(*pair, PROMPT, [A], 8)).decode(
            "utf-8", errors="replace")
    finally:
        vocab.close()
    reply = api("POST", "/v1/chat/completions", {
        "model": model_id, "max_tokens": 8, "temperature": 0, "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": ASK},
                {"type": "image_url", "image_url": {"url": data_url(A)}}]}]})
    assert reply.status == 200, reply.body
    assert reply.json["choices"][0]["message"]["content"] == expected
    reply = api("POST", "/v1/messages", {
        "model": model_id, "max_tokens": 8, "temperature": 0, "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": ASK},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(A).decode()}}]}]})
    assert reply.status == 200, reply.body
    assert "".join(b["text"] for b in reply.json["content"]) == expected
    api("POST", f"/v1/models/{model_id}/stop")


@pytest.fixture(scope="module")
def other_projector(tmp_path_factory):
    """A second projector for the pair's text model, which pulls must not take."""
    return write_projector(tmp_path_factory.mktemp("hub") / "mmproj-q8.gguf", n_embd=64, seed=9)


@pytest.fixture
def hub_repos(pair, other_projector):
    """The repos conftest's `hub` serves in this module."""

    def add(hub):
        hub.add_cortexso("eye", {"2b": {"model.gguf": pair[0], "mmproj.gguf": pair[1]}},
                         default="2b")
        hub.add_cortexso("seer", {"2b": {"model.gguf": pair[0], "mmproj.gguf": pair[1],
                                         "model.yml": MODEL_YML.encode()}}, default="2b")
        hub.add_repo("org/eye-GGUF", {"eye-Q8_0.gguf": pair[0],
                                      "mmproj-eye-Q8_0.gguf": other_projector,
                                      "mmproj-eye-f16.gguf": pair[1]})

    return add
