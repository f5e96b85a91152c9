"""Vision models on real llama.cpp and mtmd: the engine's side (localrt.engines.llama.media
inside localrt.engines.llama.batch), on support.vision's tiny random pair.

The reference is llama-cpp-python's own mtmd path (support.vision.raw_mtmd_reply):
one sequence, the prompt's chunks evaluated by mtmd's helper, greedy decoding.
"""

from __future__ import annotations

import pytest
from support.models import quantize
from support.vision import (IMAGE_TOKENS, MARKER, bmp, gif, jpeg, png, prompt_tokens,
                            raw_mtmd_reply, write_vision_pair)

from localrt.engines.contract import Image
from localrt.engines.llama.model import LlamaModel
from localrt.engines.llama.media import image_format, texts_and_images
from localrt.errors import ImagesNotSupported, InvalidImage

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(text model, projector): the text model quantized to Q8_0 by llama.cpp."""
    root = tmp_path_factory.mktemp("vision")
    model, mmproj = write_vision_pair(root)
    return quantize(model, root / "tiny-vision-Q8_0.gguf", "Q8_0"), mmproj


@pytest.fixture(scope="module")
def model(pair):
    # flash attention as llama.cpp's default ("auto") has it on a CPU, as the reference's
    m = LlamaModel(str(pair[0]), {"mmproj": str(pair[1]), "ctx_len": 512, "n_parallel": 4,
                                  "flash_attn": True})
    yield m
    m.unload()


def ask(*images: bytes, text: str = "What is in the picture?") -> list:
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image", "image": Image(data, f"messages[0].content[{i + 1}]")}
              for i, data in enumerate(images)]
    return [{"role": "user", "content": parts}]


def reply(model, messages, **params) -> tuple[str, dict]:
    gen = model.generate(messages, {"temperature": 0, "max_tokens": 10, **params})
    return "".join(gen), gen.usage


def test_the_reply_is_what_llama_cpp_pythons_own_mtmd_path_gives(model, pair):
    image = png(64, 64, 1)
    messages = ask(image)
    text, _ = model._format(texts_and_images(messages, MARKER)[0])
    expected = model.detokenize(raw_mtmd_reply(*pair, text, [image], 10))
    assert reply(model, messages)[0] == expected


def test_the_same_image_gives_the_same_reply_and_another_image_another(model):
    a, b = png(64, 64, 1), png(64, 64, 2)
    sampled = {"temperature": 0.9, "seed": 7}
    assert reply(model, ask(a), **sampled)[0] == reply(model, ask(a), **sampled)[0]
    assert reply(model, ask(a))[0] != reply(model, ask(b))[0]


def test_usage_counts_the_image_tokens_and_the_next_turn_reuses_the_images_kv(model, pair):
    image = png(64, 64, 3)
    first, usage = reply(model, ask(image, text="Describe it."))
    text, _ = model._format(texts_and_images(ask(image, text="Describe it."), MARKER)[0])
    assert usage["prompt_tokens"] == prompt_tokens(*pair, text, [image])[0]
    assert usage["prompt_tokens"] > IMAGE_TOKENS
    second = ask(image, text="Describe it.") + [
        {"role": "assistant", "content": first}, {"role": "user", "content": "And more?"}]
    _, again = reply(model, second)
    # the whole first turn is cached: its text, the image's 36 positions and more
    assert again["cached_tokens"] >= usage["prompt_tokens"] - 1 > IMAGE_TOKENS


def test_bmp_jpeg_and_the_first_frame_of_a_gif_are_read(model):
    assert [image_format(x) for x in (png(8, 8, 0), jpeg(16, 16, 0), bmp(8, 8, 0),
                                      gif(8, 8))] == ["png", "jpeg", "bmp", "gif"]
    for data in (bmp(32, 32, 4), jpeg(32, 32, 4)):
        assert reply(model, ask(data))[1]["prompt_tokens"] > IMAGE_TOKENS
    assert reply(model, ask(gif(32, 32, seeds=(5, 6))))[0] == \
        reply(model, ask(gif(32, 32, seeds=(5,))))[0]


def test_bytes_that_are_no_image_are_a_400_naming_the_part(model):
    for data in (b"not an image", b"\x89PNG\r\n\x1a\n" + b"\0" * 40, b""):
        with pytest.raises(InvalidImage) as err:
            model.generate(ask(png(8, 8, 0), data), {})
        assert err.value.param == "messages[0].content[2]"
        assert "messages[0].content[2]" in err.value.message


def test_a_model_without_a_projector_refuses_images(pair):
    plain = LlamaModel(str(pair[0]), {"ctx_len": 256, "n_parallel": 1})
    try:
        with pytest.raises(ImagesNotSupported):
            plain.generate(ask(png(8, 8, 0)), {})
        assert reply(plain, [{"role": "user", "content": "hi"}])[1]["prompt_tokens"] > 0
    finally:
        plain.unload()


def test_four_streams_two_with_images_each_get_their_own_reply(pair):
    """Two image requests and two text ones share the steps; every step that evaluates
    an image also gives each text stream that is generating its next token."""
    model = LlamaModel(str(pair[0]), {"mmproj": str(pair[1]), "ctx_len": 512,
                                      "n_parallel": 4, "flash_attn": True,
                                      "caching_enabled": False})
    alone = {name: reply(model, messages, max_tokens=8)[0] for name, messages in (
        ("a", ask(png(64, 64, 10))), ("b", ask(png(64, 64, 11))),
        ("c", [{"role": "user", "content": "one"}]),
        ("d", [{"role": "user", "content": "two"}]))}
    steps = []
    batch = model._batch
    decode = batch.decode

    def recording(entries):
        steps.append([(e.seq, e.image is not None, e.reading) for e in entries])
        return decode(entries)

    batch.decode = recording
    try:
        gens = {name: model.generate(messages, {"temperature": 0, "max_tokens": 8})
                for name, messages in (
                    ("c", [{"role": "user", "content": "one"}]),
                    ("d", [{"role": "user", "content": "two"}]),
                    ("a", ask(png(64, 64, 10))), ("b", ask(png(64, 64, 11))))}
        out = {name: "" for name in gens}
        iters = {name: iter(g) for name, g in gens.items()}
        while iters:
            for name in list(iters):
                try:
                    out[name] += next(iters[name])
                except StopIteration:
                    del iters[name]
    finally:
        del batch.decode
        model.unload()
    assert out == alone
    imaging = [s for s in steps if any(image for _, image, _ in s)]
    assert len(imaging) == 2  # one image a step
    for step in imaging:
        generating = [seq for seq, image, reading in step if not reading]
        assert len(generating) >= 1  # the text streams got a token in that step too
