"""Vision test support: a tiny random-weight vision model pair (a llama text model and
its LLaVA-style "mlp" projector, ``mmproj-*.gguf``), the images tests send it (PNG,
BMP, GIF and JPEG bytes, written with the standard library), and the reference reply
that llama-cpp-python's own mtmd bindings give for a prompt with images.

The projector is what llama.cpp's clip loader (tools/mtmd/clip.cpp) reads for
``clip.projector_type = "mlp"``: a CLIP vision tower (patch embedding convolution,
position embeddings, a pre-layernorm, two transformer blocks of which LLaVA runs all but
the last) and the two-layer GELU MLP ``mm.0``/``mm.2`` that maps each patch to the text
model's embedding size. mtmd resizes every image to ``image_size`` square (fixed-size
preprocessing, no tiles), so each image yields ``(image_size // patch_size) ** 2``
tokens and as many positions, with no begin/end tokens around them.
"""

from __future__ import annotations

import ctypes
import struct
import zlib
from pathlib import Path

import numpy as np

import gguf
from emulators.ggufgen import write_gguf, write_out

__all__ = ["IMAGE_SIZE", "PATCH_SIZE", "IMAGE_TOKENS", "MARKER", "write_vision_pair",
           "write_projector", "pixels", "png", "bmp", "gif", "gif_rgb", "jpeg",
           "jpeg_gray", "raw_mtmd_reply", "image_tokens", "prompt_tokens",
           "bitmap_loads"]

# The projector's input square and patch: one image is (48 // 8) ** 2 = 36 tokens.
IMAGE_SIZE = 48
PATCH_SIZE = 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
# mtmd_default_marker(): where an image goes in a prompt's text.
MARKER = "<__media__>"


# ---------------------------------------------------------------------------
# The model pair
# ---------------------------------------------------------------------------

def write_vision_pair(folder: Path, *, seed: int = 0, file_type: str = "F32",
                      n_embd: int = 64, context_length: int = 1024,
                      name: str = "tiny-vision", **text_options) -> tuple[Path, Path]:
    """Write a tiny text model and its projector into `folder`: (model, mmproj) paths.

    The text model is ggufgen's llama (ChatML template, which passes the media marker
    through as text) with weights scaled up so that what an image adds to the context
    changes the greedy reply; `text_options` go to write_gguf. The projector is
    ``mmproj-<name>.gguf`` (localrt treats ``mmproj*.gguf`` as projectors) and maps to
    `n_embd`, the text model's embedding size. Both are deterministic from `seed`.
    """
    folder = Path(folder)
    text_options.setdefault("weight_scale", 0.2)
    model = write_gguf(folder / f"{name}.gguf", name=name, seed=seed, n_embd=n_embd,
                       context_length=context_length, file_type=file_type,
                       **text_options)
    mmproj = write_projector(folder / f"mmproj-{name}.gguf", n_embd=n_embd, seed=seed)
    return model, mmproj


def write_projector(path: Path, *, n_embd: int = 64, seed: int = 0,
                    image_size: int = IMAGE_SIZE, patch_size: int = PATCH_SIZE,
                    v_embd: int = 32, v_head: int = 4, v_ff: int = 64,
                    v_layer: int = 2, mm_hidden: int = 64) -> Path:
    """Write a tiny random-weight LLaVA "mlp" projector (F32) whose output is `n_embd`
    wide; return its path. Weights are larger than a trained CLIP's so that pixel
    differences survive to the text model."""
    path = Path(path)
    rng = np.random.default_rng(10_000 + seed)

    def weight(*shape, scale=0.2):  # numpy shape: ggml ne reversed
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)

    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    zeros = lambda n: np.zeros(n, dtype=np.float32)  # noqa: E731

    writer = gguf.GGUFWriter(path, "clip")
    writer.add_name(path.stem)
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_audio_encoder", False)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", image_size)
    writer.add_uint32("clip.vision.patch_size", patch_size)
    writer.add_uint32("clip.vision.embedding_length", v_embd)
    writer.add_uint32("clip.vision.feed_forward_length", v_ff)
    writer.add_uint32("clip.vision.projection_dim", n_embd)
    writer.add_uint32("clip.vision.attention.head_count", v_head)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_uint32("clip.vision.block_count", v_layer)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    n_patches = (image_size // patch_size) ** 2
    # conv kernel: ggml ne {patch, patch, 3, v_embd}
    writer.add_tensor("v.patch_embd.weight", weight(v_embd, 3, patch_size, patch_size,
                                                    scale=0.5))
    writer.add_tensor("v.patch_embd.bias", zeros(v_embd))
    writer.add_tensor("v.position_embd.weight", weight(n_patches, v_embd, scale=0.1))
    writer.add_tensor("v.pre_ln.weight", ones(v_embd))
    writer.add_tensor("v.pre_ln.bias", zeros(v_embd))
    for il in range(v_layer):
        def add(what, array):
            writer.add_tensor(f"v.blk.{il}.{what}", array)

        for tensor in ("attn_q", "attn_k", "attn_v", "attn_out"):
            add(f"{tensor}.weight", weight(v_embd, v_embd))
            add(f"{tensor}.bias", zeros(v_embd))
        add("ln1.weight", ones(v_embd))
        add("ln1.bias", zeros(v_embd))
        add("ln2.weight", ones(v_embd))
        add("ln2.bias", zeros(v_embd))
        add("ffn_up.weight", weight(v_ff, v_embd))      # ggml {v_embd, v_ff}
        add("ffn_up.bias", zeros(v_ff))
        add("ffn_down.weight", weight(v_embd, v_ff))    # ggml {v_ff, v_embd}
        add("ffn_down.bias", zeros(v_embd))
    writer.add_tensor("mm.0.weight", weight(mm_hidden, v_embd, scale=0.3))
    writer.add_tensor("mm.0.bias", zeros(mm_hidden))
    writer.add_tensor("mm.2.weight", weight(n_embd, mm_hidden, scale=0.3))
    writer.add_tensor("mm.2.bias", zeros(n_embd))

    write_out(writer, path)
    return path


# ---------------------------------------------------------------------------
# Images, written with the standard library
# ---------------------------------------------------------------------------

def pixels(width: int, height: int, seed: int) -> bytes:
    """Deterministic random RGB pixels, rows top to bottom: what png() and bmp() hold."""
    import random

    return random.Random(seed).randbytes(width * height * 3)


def png(width: int, height: int, seed: int) -> bytes:
    """A random-pixel 8-bit RGB PNG (no interlace, filter 0 on every row)."""
    data = pixels(width, height, seed)
    row = width * 3
    raw = b"".join(b"\0" + data[y * row:(y + 1) * row] for y in range(height))

    def chunk(kind, body):
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))


def bmp(width: int, height: int, seed: int) -> bytes:
    """The pixels of png(width, height, seed) as a 24-bit uncompressed BMP."""
    data = pixels(width, height, seed)
    row = width * 3
    pad = b"\0" * (-row % 4)
    body = b"".join(  # bottom-up rows, BGR
        bytes(data[y * row:(y + 1) * row][i + 2 - 2 * (i % 3)] for i in range(row)) + pad
        for y in reversed(range(height)))
    header = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, len(body),
                         2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + 40 + len(body), 0, 0, 54) + header + body


# GIF frames use a fixed 3-3-2 palette: index i is (r, g, b) below.
_GIF_PALETTE = bytes(v for i in range(256)
                     for v in ((i >> 5) * 255 // 7, ((i >> 2) & 7) * 255 // 7,
                               (i & 3) * 255 // 3))


def _gif_indexes(width: int, height: int, seed: int) -> bytes:
    import random

    return random.Random(seed).randbytes(width * height)


def gif_rgb(width: int, height: int, seed: int) -> bytes:
    """The RGB pixels of the gif() frame made from `seed`, as a decoder gives them."""
    return b"".join(_GIF_PALETTE[3 * i:3 * i + 3] for i in _gif_indexes(width, height, seed))


def gif(width: int, height: int, seeds=(0,)) -> bytes:
    """A GIF89a with one random-pixel frame per seed (an animation when there are
    several); each frame's decoded pixels are gif_rgb(width, height, seed)."""
    out = [b"GIF89a", struct.pack("<HHBBB", width, height, 0xF7, 0, 0), _GIF_PALETTE]
    if len(seeds) > 1:  # NETSCAPE looping extension, as animated GIFs carry
        out.append(b"\x21\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00")
    for seed in seeds:
        out.append(b"\x21\xf9\x04\x00\x0a\x00\x00\x00")  # graphic control: 0.1 s delay
        out.append(b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0))
        out.append(b"\x08" + _sub_blocks(_lzw_literals(_gif_indexes(width, height, seed))))
    out.append(b"\x3b")
    return b"".join(out)


def _lzw_literals(indexes: bytes) -> bytes:
    """GIF LZW data (minimum code size 8) that sends every pixel as a literal 9-bit code,
    with a clear code often enough that a decoder's table never widens the codes."""
    clear, end = 256, 257
    codes = []
    for start in range(0, len(indexes), 200):
        codes.append(clear)
        codes.extend(indexes[start:start + 200])
    codes.append(end)
    value = 0
    for k, code in enumerate(codes):  # LSB first
        value |= code << (9 * k)
    return value.to_bytes((9 * len(codes) + 7) // 8, "little")


def _sub_blocks(data: bytes) -> bytes:
    return b"".join(bytes([len(data[i:i + 255])]) + data[i:i + 255]
                    for i in range(0, len(data), 255)) + b"\0"


def jpeg_gray(width: int, height: int, seed: int) -> bytes:
    """The gray level (0..255) of each 8x8 block of jpeg(width, height, seed), row by
    row of blocks."""
    import random

    blocks = ((width + 7) // 8) * ((height + 7) // 8)
    return random.Random(seed).randbytes(blocks)


def jpeg(width: int, height: int, seed: int) -> bytes:
    """A baseline grayscale JPEG whose 8x8 blocks are flat random gray levels (each
    block's DC coefficient only): written here, so no imaging library is needed."""
    levels = jpeg_gray(width, height, seed)
    # Huffman tables: the standard luminance DC table; an AC table with only EOB.
    dc_bits = [0, 1, 5, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    dc_codes, code, symbol = {}, 0, 0
    for length, count in enumerate(dc_bits, start=1):
        for _ in range(count):
            dc_codes[symbol] = (code, length)
            code, symbol = code + 1, symbol + 1
        code <<= 1
    bits = []

    def put(value, length):
        bits.extend((value >> (length - 1 - i)) & 1 for i in range(length))

    previous = 0
    for level in levels:
        dc = (level - 128) * 8  # a flat block's DC with a quantization step of 1
        diff, previous = dc - previous, dc
        size = abs(diff).bit_length()
        put(*dc_codes[size])
        if size:
            put(diff if diff > 0 else diff + (1 << size) - 1, size)
        put(0, 1)  # EOB
    bits.extend([1] * (-len(bits) % 8))
    scan = bytearray()
    for i in range(0, len(bits), 8):
        byte = int("".join(map(str, bits[i:i + 8])), 2)
        scan.append(byte)
        if byte == 0xFF:
            scan.append(0)

    def segment(marker, body):
        return b"\xff" + bytes([marker]) + struct.pack(">H", len(body) + 2) + body

    return b"".join([
        b"\xff\xd8",
        segment(0xE0, b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0"),
        segment(0xDB, b"\0" + b"\x01" * 64),
        segment(0xC0, struct.pack(">BHHB", 8, height, width, 1) + b"\x01\x11\x00"),
        segment(0xC4, b"\x00" + bytes(dc_bits) + bytes(range(12))),
        segment(0xC4, b"\x10" + bytes([1] + [0] * 15) + b"\x00"),
        segment(0xDA, b"\x01\x01\x00\x00\x3f\x00"),
        bytes(scan),
        b"\xff\xd9",
    ])


# ---------------------------------------------------------------------------
# The reference: llama-cpp-python's own mtmd bindings
# ---------------------------------------------------------------------------

class _Mtmd:
    """A text model, a context and an mtmd context over them, freed on exit."""

    def __init__(self, model_path, mmproj_path, n_ctx=1024, n_batch=512, n_gpu_layers=0,
                 warmup=True):
        import llama_cpp
        from llama_cpp import mtmd_cpp

        self.ll, self.mtmd = llama_cpp, mtmd_cpp
        self.n_batch = n_batch
        self.model = self.ctx = self.mctx = None
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        self.model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        try:
            cparams = llama_cpp.llama_context_default_params()
            cparams.n_ctx = n_ctx
            cparams.n_batch = cparams.n_ubatch = n_batch
            cparams.n_threads = cparams.n_threads_batch = 2
            self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
            if not self.ctx:
                raise RuntimeError("llama.cpp could not make a context")
            params = mtmd_cpp.mtmd_context_params_default()
            params.use_gpu = n_gpu_layers != 0
            params.print_timings = False
            params.warmup = warmup  # off: a projector that only counts (support.audio)
            params.n_threads = 2
            self.mctx = mtmd_cpp.mtmd_init_from_file(str(mmproj_path).encode(), self.model,
                                                     params)
            if not self.mctx:
                raise RuntimeError(f"mtmd could not load {mmproj_path}")
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self.mctx:
            self.mtmd.mtmd_free(self.mctx)
        if self.ctx:
            self.ll.llama_free(self.ctx)
        if self.model:
            self.ll.llama_model_free(self.model)
        self.model = self.ctx = self.mctx = None

    def bitmap(self, data: bytes):
        """mtmd's bitmap of an image file's bytes, or None where mtmd refuses them."""
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        wrapper = self.mtmd.mtmd_helper_bitmap_init_from_buf_wrapper(
            self.mctx, buf, len(data), False, self.mtmd.mtmd_helper_init_opt_default())
        if wrapper.video_ctx:
            self.mtmd.mtmd_helper_video_free(wrapper.video_ctx)
        return wrapper.bitmap or None

    def tokenize(self, prompt: str, images: list, add_special=True):
        """mtmd's chunks of a prompt with one marker per image (the caller frees them)."""
        bitmaps = []
        try:
            for k, data in enumerate(images):
                bitmap = self.bitmap(data)
                if bitmap is None:
                    raise ValueError(f"mtmd refused image {k}")
                bitmaps.append(bitmap)
            array = (self.mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            text = prompt.encode()
            inp = self.mtmd.mtmd_input_text(text=text, text_len=len(text),
                                            add_special=add_special, parse_special=True)
            chunks = self.mtmd.mtmd_input_chunks_init()
            rc = self.mtmd.mtmd_tokenize(self.mctx, chunks, ctypes.byref(inp), array,
                                         len(bitmaps))
            if rc != 0:
                self.mtmd.mtmd_input_chunks_free(chunks)
                raise ValueError(f"mtmd_tokenize failed ({rc})")
            return chunks
        finally:
            for bitmap in bitmaps:
                self.mtmd.mtmd_bitmap_free(bitmap)


def raw_mtmd_reply(model_path, mmproj_path, prompt: str, images: list[bytes],
                   max_tokens: int, *, n_ctx: int = 1024, n_gpu_layers: int = 0) -> list[int]:
    """The greedy reply tokens (end token excluded) that llama-cpp-python's own mtmd
    bindings give for `prompt`, a fully rendered prompt with one MARKER per image:
    BOS added and special tokens parsed, as llama-server tokenizes; chunks evaluated
    on sequence 0 with the last logits; then argmax and llama_decode, one token at a
    time, until an end-of-generation token or `max_tokens`."""
    with _Mtmd(model_path, mmproj_path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers) as m:
        ll, mtmd = m.ll, m.mtmd
        chunks = m.tokenize(prompt, images)
        try:
            n_past = ll.llama_pos(0)
            rc = mtmd.mtmd_helper_eval_chunks(m.mctx, m.ctx, chunks, 0, 0, m.n_batch, True,
                                              ctypes.byref(n_past))
            if rc != 0:
                raise RuntimeError(f"mtmd_helper_eval_chunks failed ({rc})")
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
        vocab = ll.llama_model_get_vocab(m.model)
        n_vocab = ll.llama_vocab_n_tokens(vocab)
        reply = []
        while len(reply) < max_tokens:
            logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(m.ctx, -1),
                                           shape=(n_vocab,))
            token = int(np.argmax(logits))
            if ll.llama_vocab_is_eog(vocab, token):
                break
            reply.append(token)
            one = (ll.llama_token * 1)(token)
            if ll.llama_decode(m.ctx, ll.llama_batch_get_one(one, 1)) != 0:
                raise RuntimeError("llama_decode failed")
        return reply


def image_tokens(model_path, mmproj_path, image: bytes) -> tuple[int, int]:
    """(tokens, positions) one image takes in the KV cache, by mtmd_helper_get_n_tokens
    and mtmd_helper_get_n_pos (IMAGE_TOKENS and IMAGE_TOKENS for this pair)."""
    return prompt_tokens(model_path, mmproj_path, MARKER, [image], add_special=False)


def prompt_tokens(model_path, mmproj_path, prompt: str, images: list[bytes], *,
                  add_special: bool = True) -> tuple[int, int]:
    """(tokens, positions) of a whole prompt with its images, BOS included unless
    `add_special` is false: what usage.prompt_tokens counts."""
    with _Mtmd(model_path, mmproj_path, n_ctx=256) as m:
        chunks = m.tokenize(prompt, images, add_special=add_special)
        try:
            return (int(m.mtmd.mtmd_helper_get_n_tokens(chunks)),
                    int(m.mtmd.mtmd_helper_get_n_pos(chunks)))
        finally:
            m.mtmd.mtmd_input_chunks_free(chunks)


def bitmap_loads(model_path, mmproj_path, data: bytes):
    """(width, height, RGB bytes) of what mtmd_helper_bitmap_init_from_buf makes of
    `data`, or None where it returns NULL (bytes that are no image it reads)."""
    with _Mtmd(model_path, mmproj_path, n_ctx=256) as m:
        bitmap = m.bitmap(data)
        if bitmap is None:
            return None
        try:
            mtmd = m.mtmd
            n = mtmd.mtmd_bitmap_get_n_bytes(bitmap)
            rgb = ctypes.string_at(mtmd.mtmd_bitmap_get_data(bitmap), n)
            return mtmd.mtmd_bitmap_get_nx(bitmap), mtmd.mtmd_bitmap_get_ny(bitmap), rgb
        finally:
            mtmd.mtmd_bitmap_free(bitmap)
