"""Audio test support: a tiny random-weight audio model pair (a llama text model and its
Qwen2-Audio style "qwen2a" projector, ``mmproj-*.gguf``), and the clips tests send it
(WAV written with the standard library's wave module, FLAC and MP3 written by hand).

The projector is what llama.cpp's clip loader (tools/mtmd/clip.cpp) reads for
``clip.projector_type = "qwen2a"``: a Whisper encoder (two 1-D convolutions, the second
of stride 2, position embeddings, pre-norm transformer blocks whose key has no bias, a
post-norm), an average pool of 2 and one linear layer ``mm.a.fc`` to the text model's
embedding size. mtmd's Whisper preprocessor turns a clip into 30-second chunks of 3000
mel frames (a clip is padded by 30 s of silence first, and the last, partial chunk is
dropped), so a clip of s seconds is ``floor((16000 s + 480000) / 160 + 1) // 3000``
chunks of 3000 / 2 / 2 = 750 tokens each. Qwen2-Audio has no stack factor, so the
"expected output N tokens" abort of an Ultravox projector (issue 36, item 6) cannot
happen with it.

``write_audio_projector(kind="ultravox")`` (and "voxtral"; `write_audio_pair` passes
its `projector` options on) writes the stacking types: 32 wide and stacked by 8 (4 for
Voxtral), each chunk is counted 187 tokens by llama.cpp and made 188 by its graph,
which aborts the process; 40 wide, 187 and 187, as the real models' 1280. `mtmd_audio_chunks` and
`encode_in_child` ask llama-cpp-python's own mtmd bindings what they make of a clip.
"""

from __future__ import annotations

import io
import math
import os
import struct
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np

import gguf
from emulators.ggufgen import write_gguf, write_out

__all__ = ["AUDIO_TOKENS_PER_CHUNK", "write_audio_pair", "write_audio_projector",
           "write_audio_header", "samples", "wav", "flac",
           "mp3_silence", "audio_chunks", "mtmd_audio_chunks", "encode_in_child",
           "write_counting_projector"]

SAMPLE_RATE = 16000           # mtmd's Whisper preprocessor resamples every clip to this
AUDIO_TOKENS_PER_CHUNK = 750  # 3000 mel frames / 2 (conv stride) / 2 (average pool)


def start_ear(url: str, pair, cpu_threads: int) -> None:
    """Import the audio pair as model `ear` on the server at `url` and start it with
    flash attention (as the reference's llama.cpp default has it on a CPU) and
    `cpu_threads` threads (llama.cpp's CPU sums differ in their last bits with another
    count, and the random model's near ties show it)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    client.post("/models/import", cast_to=object,
                body={"path": str(pair[0]), "mmproj": str(pair[1]), "id": "ear"})
    client.post("/models/ear/start", cast_to=object,
                body={"flash_attn": True, "cpu_threads": cpu_threads})


def audio_chunks(seconds: float) -> int:
    """How many 30-second chunks mtmd's Whisper preprocessor makes of a clip."""
    n = int(round(seconds * SAMPLE_RATE))
    frames = (n + SAMPLE_RATE * 30) // 160 + 1
    return frames // 3000


# ---------------------------------------------------------------------------
# The model pair
# ---------------------------------------------------------------------------

def write_audio_pair(folder: Path, *, seed: int = 0, n_embd: int = 64,
                     context_length: int = 2048, name: str = "tiny-audio",
                     vision: bool = False, projector: dict | None = None,
                     **text_options) -> tuple[Path, Path]:
    """Write a tiny text model and its audio projector into `folder`: (model, mmproj).

    The text model is ggufgen's llama (ChatML) with weights scaled up so that what a
    clip adds changes the greedy reply; its context holds a clip's 750 tokens.
    `projector` goes to `write_audio_projector` (another kind, another encoder width).
    """
    folder = Path(folder)
    text_options.setdefault("weight_scale", 0.2)
    model = write_gguf(folder / f"{name}.gguf", name=name, seed=seed, n_embd=n_embd,
                       context_length=context_length, **text_options)
    mmproj = write_audio_projector(folder / f"mmproj-{name}.gguf", n_embd=n_embd,
                                   seed=seed, **(projector or {}))
    return model, mmproj


def write_audio_projector(path: Path, *, n_embd: int = 64, seed: int = 0,
                          a_embd: int = 32, a_head: int = 4, a_ff: int = 64,
                          a_layer: int = 1, n_mel: int = 16,
                          n_pos: int = 1500, fc_scale: float = 2.0,
                          kind: str = "qwen2a", stack_factor: int | None = None) -> Path:
    """Write a tiny random-weight Whisper-encoder audio projector (F32) whose output is
    `n_embd` wide; return its path. `kind` is its clip.projector_type: "qwen2a" (an
    average pool and mm.a.fc), "ultravox" (frames stacked by `stack_factor`, 8 as the
    real models have it, then norm_pre, mm.a.mlp.1, SwiGLU, norm_mid, mm.a.mlp.2) or
    "voxtral" (an average pool, frames stacked by `stack_factor`, 4 as the real model
    has it, then a GELU MLP mm.a.mlp.1 and .2)."""
    if stack_factor is None:
        stack_factor = {"ultravox": 8, "voxtral": 4}.get(kind, 0)
    path = Path(path)
    rng = np.random.default_rng(20_000 + seed)

    def weight(*shape, scale=0.2):  # numpy shape: ggml ne reversed
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)

    ones = lambda *n: np.ones(n, dtype=np.float32)  # noqa: E731
    zeros = lambda *n: np.zeros(n, dtype=np.float32)  # noqa: E731

    writer = gguf.GGUFWriter(path, "clip")
    writer.add_name(path.stem)
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    writer.add_bool("clip.has_vision_encoder", False)
    writer.add_bool("clip.has_audio_encoder", True)
    writer.add_string("clip.projector_type", kind)
    if stack_factor:
        writer.add_uint32("clip.audio.projector.stack_factor", stack_factor)
    writer.add_uint32("clip.audio.num_mel_bins", n_mel)
    writer.add_uint32("clip.audio.embedding_length", a_embd)
    writer.add_uint32("clip.audio.feed_forward_length", a_ff)
    writer.add_uint32("clip.audio.projection_dim", n_embd)
    writer.add_uint32("clip.audio.attention.head_count", a_head)
    writer.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
    writer.add_uint32("clip.audio.block_count", a_layer)

    # conv kernels: ggml ne {kernel, in, out}; biases ne {1, out}, as the converter
    # writes them (a bias broadcast over the frames)
    writer.add_tensor("a.conv1d.1.weight", weight(a_embd, n_mel, 3, scale=0.5))
    writer.add_tensor("a.conv1d.1.bias", zeros(a_embd, 1))
    writer.add_tensor("a.conv1d.2.weight", weight(a_embd, a_embd, 3, scale=0.3))
    writer.add_tensor("a.conv1d.2.bias", zeros(a_embd, 1))
    writer.add_tensor("a.position_embd.weight", weight(n_pos, a_embd, scale=0.1))
    for il in range(a_layer):
        def add(what, array):
            writer.add_tensor(f"a.blk.{il}.{what}", array)

        add("attn_q.weight", weight(a_embd, a_embd))
        add("attn_q.bias", zeros(a_embd))
        add("attn_k.weight", weight(a_embd, a_embd))  # Whisper's key has no bias
        add("attn_v.weight", weight(a_embd, a_embd))
        add("attn_v.bias", zeros(a_embd))
        add("attn_out.weight", weight(a_embd, a_embd))
        add("attn_out.bias", zeros(a_embd))
        add("ln1.weight", ones(a_embd))
        add("ln1.bias", zeros(a_embd))
        add("ln2.weight", ones(a_embd))
        add("ln2.bias", zeros(a_embd))
        add("ffn_up.weight", weight(a_ff, a_embd))
        add("ffn_up.bias", zeros(a_ff))
        add("ffn_down.weight", weight(a_embd, a_ff))
        add("ffn_down.bias", zeros(a_embd))
    writer.add_tensor("a.post_ln.weight", ones(a_embd))
    writer.add_tensor("a.post_ln.bias", zeros(a_embd))
    stacked = a_embd * max(stack_factor, 1)
    if kind == "ultravox":  # SwiGLU halves mm.a.mlp.1's output
        writer.add_tensor("mm.a.norm_pre.weight", ones(stacked))
        writer.add_tensor("mm.a.mlp.1.weight", weight(2 * a_ff, stacked))
        writer.add_tensor("mm.a.norm_mid.weight", ones(a_ff))
        writer.add_tensor("mm.a.mlp.2.weight", weight(n_embd, a_ff, scale=fc_scale))
    elif kind == "voxtral":
        writer.add_tensor("mm.a.mlp.1.weight", weight(a_ff, stacked))
        writer.add_tensor("mm.a.mlp.2.weight", weight(n_embd, a_ff, scale=fc_scale))
    else:
        writer.add_tensor("mm.a.fc.weight", weight(n_embd, a_embd, scale=fc_scale))
        writer.add_tensor("mm.a.fc.bias", zeros(n_embd))
    write_out(writer, path)
    return path


# The tensors mtmd's loader asks of each type that has its own preprocessor, with no
# encoder blocks: what a projector needs to be loaded and to count clips.
_COUNTING = {
    "qwen3a": {"a.conv2d.1.weight": (8, 1, 3, 3), "a.conv2d.1.bias": (8,),
               "a.conv2d.2.weight": (8, 8, 3, 3), "a.conv2d.2.bias": (8,),
               "a.conv2d.3.weight": (8, 8, 3, 3), "a.conv2d.3.bias": (8,),
               "a.conv_out.weight": (8, 16), "a.position_embd.weight": (1500, 8),
               "mm.a.mlp.1.weight": (8, 8), "mm.a.mlp.1.bias": (8,),
               "mm.a.mlp.2.weight": ("n_embd", 8), "mm.a.mlp.2.bias": ("n_embd",)},
    "lfm2a": {**{f"a.conv1d.{i}.weight": (8, 8) for i in (0, 2, 3, 5, 6)},
              **{f"a.conv1d.{i}.bias": (8,) for i in (0, 2, 3, 5, 6)},
              "a.pre_encode.out.weight": (8, 8), "a.pre_encode.out.bias": (8,),
              "a.position_embd.weight": (16, "n_embd"),
              **{f"mm.a.mlp.{i}.weight": (8, 8) for i in (0, 1, 3)},
              **{f"mm.a.mlp.{i}.bias": (8,) for i in (0, 1, 3)}},
    "gemma4a": {"a.conv1d.0.weight": (8, 1, 3, 3), "a.conv1d.1.weight": (8, 8, 3, 3),
                "a.input_projection.weight": (8, 8),
                "mm.a.input_projection.weight": ("n_embd", 8)},
}


def write_counting_projector(path: Path, kind: str, n_embd: int = 64) -> Path:
    """A projector of `kind` ("qwen3a", "lfm2a", "gemma4a") with no encoder blocks and
    zero tensors: mtmd loads it (warmup off) and counts a clip's chunks with the type's
    own preprocessor, which is all it is for; it cannot encode."""
    path = Path(path)
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_string("clip.projector_type", kind)
    writer.add_bool("clip.has_vision_encoder", False)
    writer.add_bool("clip.has_audio_encoder", True)
    for key, value in (("num_mel_bins", 128), ("embedding_length", 8),
                       ("feed_forward_length", 8), ("projection_dim", n_embd),
                       ("attention.head_count", 1), ("block_count", 0)):
        writer.add_uint32(f"clip.audio.{key}", value)
    writer.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
    for name, shape in _COUNTING[kind].items():
        shape = tuple(n_embd if n == "n_embd" else n for n in shape)
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    write_out(writer, path)
    return path


def write_audio_header(path, n_embd: int = 64, kind: str = "qwen2a",
                       vision: bool = False) -> Path:
    """A projector GGUF header that declares an audio encoder (and a vision one with
    `vision`) whose output is `n_embd`, with tiny zero data: for the import, pull and
    capability checks (mtmd could not run it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_string("clip.projector_type", kind)
    writer.add_bool("clip.has_audio_encoder", True)
    writer.add_bool("clip.has_vision_encoder", vision)
    writer.add_uint32("clip.audio.num_mel_bins", 16)
    writer.add_uint32("clip.audio.embedding_length", 8)
    writer.add_tensor("a.conv1d.1.weight", np.zeros((8, 16, 3), dtype=np.float32))
    writer.add_tensor("mm.a.fc.weight", np.zeros((n_embd, 8), dtype=np.float32))
    if vision:
        writer.add_uint32("clip.vision.embedding_length", 8)
        writer.add_tensor("v.patch_embd.weight", np.zeros((8, 3, 2, 2), dtype=np.float32))
        writer.add_tensor("mm.2.weight", np.zeros((n_embd, 8), dtype=np.float32))
    write_out(writer, path)
    return path


# ---------------------------------------------------------------------------
# The reference: llama-cpp-python's own mtmd bindings
# ---------------------------------------------------------------------------

def mtmd_audio_chunks(model, mmproj, clips: list[bytes],
                      warmup: bool = True) -> list[tuple[int, list[int]]]:
    """For each clip: (the samples mtmd's helper decodes from it, the tokens mtmd counts
    for each of its audio chunks); nothing is encoded (`warmup` False for a
    `write_counting_projector` one)."""
    from support.vision import MARKER, _Mtmd

    out = []
    with _Mtmd(model, mmproj, n_ctx=256, warmup=warmup) as m:
        mtmd = m.mtmd
        for clip in clips:
            bitmap = m.bitmap(clip)
            try:
                samples = mtmd.mtmd_bitmap_get_nx(bitmap)
            finally:
                mtmd.mtmd_bitmap_free(bitmap)
            chunks = m.tokenize(MARKER, [clip], add_special=False)
            try:
                counts = []
                for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                    chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                    if mtmd.mtmd_input_chunk_get_type(chunk) == \
                            mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO:
                        counts.append(int(mtmd.mtmd_input_chunk_get_n_tokens(chunk)))
                out.append((samples, counts))
            finally:
                mtmd.mtmd_input_chunks_free(chunks)
    return out


def encode_clip(model, mmproj, seconds: float, encode: bool = True) -> None:
    """Tokenize a clip of `seconds` (wav(seconds, 1)) with mtmd (llama-cpp-python's
    bindings), printing "tokenized", then with `encode` encode each audio chunk,
    printing "encoded N" for each: run by `encode_in_child`."""
    from support.vision import MARKER, _Mtmd

    with _Mtmd(model, mmproj, n_ctx=256, warmup=encode) as m:
        mtmd = m.mtmd
        chunks = m.tokenize(MARKER, [wav(seconds, 1)], add_special=False)
        print("tokenized", flush=True)
        try:
            for i in range(mtmd.mtmd_input_chunks_size(chunks) if encode else 0):
                chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO:
                    if mtmd.mtmd_encode_chunk(m.mctx, chunk) != 0:
                        raise RuntimeError("mtmd_encode_chunk failed")
                    print("encoded", mtmd.mtmd_input_chunk_get_n_tokens(chunk), flush=True)
        finally:
            mtmd.mtmd_input_chunks_free(chunks)


def encode_in_child(model, mmproj, seconds: float = 1.0,
                    encode: bool = True) -> subprocess.CompletedProcess:
    """`encode_clip` in a child process (an abort of llama.cpp's ends the child only):
    its return code, stdout ("tokenized", "encoded N" lines) and stderr (llama.cpp's
    log)."""
    tests = str(Path(__file__).resolve().parent.parent)
    code = (f"import sys; sys.path[:0] = [{tests!r}]; from support.audio import "
            f"encode_clip; encode_clip({str(model)!r}, {str(mmproj)!r}, {seconds!r}, "
            f"{encode!r})")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "GGML_NO_BACKTRACE": "1"})


# ---------------------------------------------------------------------------
# Clips
# ---------------------------------------------------------------------------

def samples(seconds: float, seed: int, rate: int = SAMPLE_RATE) -> list[int]:
    """Deterministic 16-bit mono samples: a tone whose pitch the seed picks, with noise."""
    import random

    rnd = random.Random(seed)
    pitch = 150 + 450 * (seed % 13)  # seeds far apart in pitch, so mels differ
    n = int(round(seconds * rate))
    return [max(-32768, min(32767, int(12000 * math.sin(2 * math.pi * pitch * i / rate)
                                       + rnd.randint(-3000, 3000))))
            for i in range(n)]


def wav(seconds: float, seed: int = 0, rate: int = SAMPLE_RATE, channels: int = 1) -> bytes:
    """A 16-bit PCM WAV of samples(seconds, seed) (each channel the same)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        data = samples(seconds, seed, rate)
        w.writeframes(b"".join(struct.pack("<h", s) * channels for s in data))
    return out.getvalue()


def _crc8(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = ((crc << 1) ^ 0x07) & 0xFF if crc & 0x80 else (crc << 1) & 0xFF
    return crc


def _crc16(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x8005) & 0xFFFF if crc & 0x8000 else (crc << 1) & 0xFFFF
    return crc


def flac(seconds: float, seed: int = 0, rate: int = SAMPLE_RATE) -> bytes:
    """A mono 16-bit FLAC of samples(seconds, seed): STREAMINFO, then frames of 4096
    samples, each one VERBATIM subframe (valid FLAC, only not compressed)."""
    data = samples(seconds, seed, rate)
    block = 4096
    total = len(data)
    info = struct.pack(">HH", block, block)
    info += (0).to_bytes(3, "big") + (0).to_bytes(3, "big")  # min/max frame size unknown
    # sample rate (20 bits), channels-1 (3), bits-1 (5), total samples (36)
    packed = (rate << 44) | (0 << 41) | (15 << 36) | total
    info += packed.to_bytes(8, "big") + bytes(16)  # MD5 left zero: unknown
    out = [b"fLaC", bytes([0x80]) + len(info).to_bytes(3, "big"), info]
    for number, start in enumerate(range(0, total, block)):
        chunk = data[start:start + block]
        # sync 0xFFF8 (fixed block size), block size code 7 (16-bit size-1 at the end),
        # sample rate from STREAMINFO (0), mono (0), 16 bits (4)
        head = bytearray(b"\xff\xf8")
        head.append((7 << 4) | 0)
        head.append((0 << 4) | (4 << 1))
        head += _utf8_number(number)
        head += struct.pack(">H", len(chunk) - 1)
        head.append(_crc8(bytes(head)))
        body = bytes([0x02]) + b"".join(struct.pack(">h", s) for s in chunk)  # VERBATIM
        frame = bytes(head) + body
        out.append(frame + struct.pack(">H", _crc16(frame)))
    return b"".join(out)


def _utf8_number(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    return chr(n).encode("utf-8")


def mp3_silence(seconds: float) -> bytes:
    """An MPEG-1 Layer III stream of silent frames (44.1 kHz, 128 kbit/s, mono): each a
    header and an all-zero side info and main data, which a decoder reads as silence."""
    frames = max(1, int(seconds * 44100 / 1152))
    size = 144 * 128000 // 44100  # 417 bytes a frame, no padding
    frame = b"\xff\xfb\x90\xc4" + bytes(size - 4)
    return frame * frames
