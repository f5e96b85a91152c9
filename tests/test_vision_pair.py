"""The generated vision pair (tests/support/vision.py) as real llama.cpp mtmd sees it:
it loads, an image is IMAGE_TOKENS tokens, the greedy reply follows the image (also
with quantized text models), and the image bytes the tests send are read as written."""

from __future__ import annotations

import hashlib

import jinja2
import llama_cpp
import pytest

from emulators.ggufgen import read_gguf_metadata
from support.models import quantize
from support.vision import (IMAGE_TOKENS, MARKER, bitmap_loads, bmp, gif, gif_rgb,
                            image_tokens, jpeg, jpeg_gray, pixels, png, prompt_tokens,
                            raw_mtmd_reply, write_vision_pair)

pytestmark = pytest.mark.live

BEFORE = "<|im_start|>user\n"
AFTER = "What is in this picture?<|im_end|>\n<|im_start|>assistant\n"
PROMPT = BEFORE + MARKER + AFTER


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(text model, projector) written once for the module."""
    return write_vision_pair(tmp_path_factory.mktemp("vision"))


@pytest.fixture(scope="module", params=["Q8_0", "Q4_0"])
def quantized_pair(request, pair, tmp_path_factory):
    """The pair with its text model quantized by llama.cpp."""
    model, mmproj = pair
    target = tmp_path_factory.mktemp("vision-q") / f"tiny-vision-{request.param}.gguf"
    return quantize(model, target, request.param), mmproj


def test_the_pair_is_deterministic_and_small(tmp_path):
    first = write_vision_pair(tmp_path / "a", seed=3)
    again = write_vision_pair(tmp_path / "b", seed=3)
    other = write_vision_pair(tmp_path / "c", seed=4)
    digest = [[hashlib.sha256(p.read_bytes()).hexdigest() for p in ps]
              for ps in (first, again, other)]
    assert digest[0] == digest[1]
    assert digest[0][0] != digest[2][0] and digest[0][1] != digest[2][1]
    assert first[1].name.startswith("mmproj") and first[1].suffix == ".gguf"
    assert all(p.stat().st_size < 400_000 for p in first)
    metadata = read_gguf_metadata(first[1])
    assert metadata["clip.projector_type"] == "mlp"
    assert metadata["clip.vision.projection_dim"] == \
        read_gguf_metadata(first[0])["llama.embedding_length"]


def test_the_chat_template_lets_the_marker_through(pair):
    template = read_gguf_metadata(pair[0])["tokenizer.chat_template"]
    rendered = jinja2.Environment().from_string(template).render(
        messages=[{"role": "user", "content": MARKER + "What is in this picture?"}],
        add_generation_prompt=True)
    assert rendered == PROMPT


@pytest.mark.parametrize("size", [(64, 64), (256, 256), (20, 13)])
def test_one_image_is_image_tokens_tokens_and_positions(pair, size):
    assert image_tokens(*pair, png(*size, seed=1)) == (IMAGE_TOKENS, IMAGE_TOKENS)


def _special_tokens(path, text: str, bos: bool) -> list[int]:
    """llama.cpp's tokens of a text with its special tokens parsed, as mtmd does."""
    vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        return vocab.tokenize(text.encode(), add_bos=bos, special=True)
    finally:
        vocab.close()


def test_a_prompts_count_is_its_text_and_its_image(pair):
    text = (len(_special_tokens(pair[0], BEFORE, bos=True))
            + len(_special_tokens(pair[0], AFTER, bos=False)))
    assert prompt_tokens(*pair, PROMPT, [png(64, 64, 1)]) == (text + IMAGE_TOKENS,) * 2
    two = BEFORE + MARKER + MARKER + AFTER
    assert prompt_tokens(*pair, two, [png(64, 64, 1), png(64, 64, 2)])[0] == \
        text + 2 * IMAGE_TOKENS


def test_the_reply_follows_the_image(pair):
    replies = [raw_mtmd_reply(*pair, PROMPT, [png(64, 64, seed)], 8) for seed in (1, 1, 2, 3)]
    assert replies[0] == replies[1]
    assert len(replies[0]) == 8
    assert len({tuple(r) for r in replies[1:]}) == 3
    assert raw_mtmd_reply(*pair, BEFORE + AFTER, [], 8) not in replies


def test_a_quantized_text_model_works_with_the_projector(quantized_pair):
    replies = [raw_mtmd_reply(*quantized_pair, PROMPT, [png(64, 64, seed)], 8)
               for seed in (1, 1, 2)]
    assert replies[0] == replies[1] != replies[2]


def test_png_and_bmp_give_the_pixels_written(pair):
    for data in (png(20, 13, 3), bmp(20, 13, 3)):
        assert bitmap_loads(*pair, data) == (20, 13, pixels(20, 13, 3))
    assert raw_mtmd_reply(*pair, PROMPT, [bmp(64, 64, 1)], 8) == \
        raw_mtmd_reply(*pair, PROMPT, [png(64, 64, 1)], 8)


def test_a_gif_gives_its_first_frame(pair):
    width, height, rgb = bitmap_loads(*pair, gif(20, 13, (3, 4)))
    assert (width, height) == (20, 13)
    assert rgb == gif_rgb(20, 13, 3) != gif_rgb(20, 13, 4)
    assert raw_mtmd_reply(*pair, PROMPT, [gif(64, 64, (5, 6))], 8) == \
        raw_mtmd_reply(*pair, PROMPT, [gif(64, 64, (5,))], 8)


def test_a_jpeg_gives_its_blocks(pair):
    width, height, rgb = bitmap_loads(*pair, jpeg(20, 13, 3))
    levels = jpeg_gray(20, 13, 3)
    assert (width, height) == (20, 13)
    assert rgb == bytes(levels[(y // 8) * 3 + x // 8]
                        for y in range(13) for x in range(20) for _ in range(3))


@pytest.mark.parametrize("data", [b"", b"not an image at all", png(20, 13, 3)[:60],
                                  b"GIF89a" + bytes(20)])
def test_bytes_that_are_no_image_are_refused(pair, data):
    assert bitmap_loads(*pair, data) is None
