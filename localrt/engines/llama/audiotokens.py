"""What llama.cpp's mtmd makes of an audio clip, worked out before mtmd is asked
(issue 36, item 6: mtmd must never take the server down).

mtmd turns a clip into chunks and counts each chunk's tokens with clip.cpp's
clip_n_output_tokens; the encoder's graph then makes its own number of embeddings, and
where the two differ clip_encode aborts the process (GGML_ASSERT "expected output 187
tokens, got 188": an Ultravox projector 32 wide whose frames are stacked by 8, on any
30-second chunk; the real models, 1280 wide, make 187, as counted). So for a projector
type this module knows, a clip's plan is computed from its sample count alone:

  samples   what mtmd's decoder (miniaudio) gives: the clip's frames, resampled to the
            projector's rate as ma_calculate_frame_count_after_resampling counts them
  chunks    the mel frames of each chunk, as the type's preprocessor (mtmd-audio.cpp)
            cuts them: Whisper's 3000-frame chunks of a clip padded by 30 s (the last,
            partial chunk dropped), Qwen3-ASR's 800-frame windows padded to 100,
            Gemma 4's 30-second pieces, one chunk for LFM2-Audio and Granite Speech
  counted   the tokens clip_n_output_tokens says for a chunk: the clip's tokens, for
            the context check and usage
  made      the embeddings the encoder's graph makes of a chunk (models/*.cpp), where
            this module follows the graph (build_stack's padding included, which
            depends on the encoder's width); None where it only knows the count

A clip whose chunks mtmd would count one way and encode another, or that mtmd, a
preprocessor or a graph asserts on (a clip of one sample, for every type; a Whisper
projector with fewer than 1500 positions; LFM2-Audio's clip under two hops; a Gemma 4
piece of one sample), is refused with a 400 invalid_audio naming the part. The engine
checks the plan twice: from the header (localrt.engines.audio.frames) before anything
is decoded, and from the decoded bitmap's sample count before mtmd tokenizes; and it
encodes no chunk whose count is not the plan's. A projector that fails on
`TEST_SECONDS` is refused at its first load in a child (localrt.engines.vetting,
through LlamaModel.exercise_audio).

A type not in `WHISPER`, or the other tables here, has no plan: mtmd counts its clips,
and only the child's real encode of a test clip stands between it and the server. If
llama.cpp's clip.cpp or mtmd-audio.cpp change a count, change it here.
"""

from __future__ import annotations

from dataclasses import dataclass

RATE = 16000  # every audio projector type here reads 16 kHz
MIN_SAMPLES = 2  # mtmd_tokenize asserts that a clip's samples are more than one float
HOP = 160  # samples between mel frames (10 ms), for every type here
WHISPER_CHUNK = 3000  # mel frames in each Whisper chunk (30 s)
WHISPER_POSITIONS = WHISPER_CHUNK // 2  # the encoder's positions one chunk needs
# Whisper-encoder types: (frames stacked by the stack factor, an average pool of 2),
# as clip-model.h's audio_has_stack_frames and audio_has_avgpool say; "glma" stacks at
# its end and adds two tokens. "qwen2.5o" is Qwen2.5-Omni's file, read as qwen2a.
WHISPER = {"qwen2a": (False, True), "qwen2.5o": (False, True),
           "ultravox": (True, False), "voxtral": (True, True),
           "musicflamingo": (False, True), "meralion": (True, False),
           "glma": (False, False)}
STACKED = ("ultravox", "voxtral", "meralion", "glma")  # need clip.audio.projector.stack_factor
OTHERS = ("qwen3a", "lfm2a", "gemma4a", "granite_speech")
# The clips a projector must take at its first load in a child: ordinary lengths, none
# at an edge a single clip may hit (a Gemma 4 clip one sample past 30 s).
TEST_SECONDS = (1.0, 5.0, 30.0, 45.0)


@dataclass(frozen=True)
class Encoder:
    """An audio projector as its clips' arithmetic needs it, from its GGUF header:
    its type, stack factor, encoder positions (a.position_embd rows; None: no such
    tensor), Granite Speech's window and downsample rate, and its encoder's width
    (clip.audio.embedding_length: frames are stacked by their elements)."""

    type: str
    stack_factor: int = 0
    positions: int | None = None
    window: int = 0
    downsample: int = 0
    width: int = 0

    @property
    def known(self) -> bool:
        """Whether this module plans the type's clips."""
        return self.type in WHISPER or self.type in OTHERS


@dataclass(frozen=True)
class Plan:
    """A clip's chunks as mtmd makes them: each chunk's mel frames, the tokens mtmd
    counts for it, and `problem`, why mtmd cannot take the clip (None: it can)."""

    frames: tuple
    counted: tuple
    problem: str | None = None

    @property
    def tokens(self) -> int:
        """The clip's tokens, as mtmd counts them."""
        return sum(self.counted)


def read(path) -> Encoder:
    """The Encoder of a projector GGUF with an audio encoder (a GGUFError when the
    file cannot be read)."""
    from localrt.engines import ggufinfo

    md, shapes = ggufinfo.read_tensor_shapes(path)
    kind = md.get("clip.audio.projector_type") or md.get("clip.projector_type") or ""
    position = shapes.get("a.position_embd.weight")

    def number(key: str) -> int:
        value = md.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    return Encoder(str(kind), number("clip.audio.projector.stack_factor"),
                   int(position[1]) if position and len(position) > 1 else None,
                   number("clip.audio.projector.window_size"),
                   number("clip.audio.projector.downsample_rate"),
                   number("clip.audio.embedding_length"))


def resampled(frames: int, rate_in: int, rate_out: int = RATE) -> int:
    """The samples miniaudio's decoder gives for `frames` at `rate_in` read at
    `rate_out` (ma_calculate_frame_count_after_resampling, as mtmd's helper sizes its
    buffer by ma_decoder_get_length_in_pcm_frames)."""
    if not frames or not rate_in or not rate_out:
        return 0
    if rate_in == rate_out:
        return frames
    out = frames * rate_out // rate_in
    guess = out * (rate_in % rate_out) + out * (rate_in // rate_out) // rate_out
    return out + 1 if guess <= frames else out


def _cdiv(a: int, b: int) -> int:
    """C's integer division (toward zero), as the preprocessors compute."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def plan(encoder: Encoder, samples: int) -> Plan | None:
    """The Plan of a clip of `samples` samples at RATE; None for a type not planned
    here. An empty clip has no plan (mtmd refuses it itself, cleanly); one of a single
    sample is refused for every type (mtmd asserts on it before any preprocessor)."""
    if samples <= 0:
        return None
    if samples < MIN_SAMPLES:
        return Plan((), (), f"it holds {samples} sample at {RATE} Hz, and llama.cpp's mtmd "
                            f"aborts on fewer than {MIN_SAMPLES}")
    if not encoder.known:
        return None
    problem = _encoder_problem(encoder)
    frames = _chunks(encoder, samples)
    if problem is None and (not frames or min(frames) < 1):
        problem = (f"it is too short for the {encoder.type} audio encoder "
                   f"({samples} samples at {RATE} Hz)")
    counted = tuple(counted_tokens(encoder, n) for n in frames)
    if problem is None:
        for n, count in zip(frames, counted):
            made = made_tokens(encoder, n)
            if made is not None and made != count:
                problem = (f"llama.cpp's mtmd would count {count} tokens for a chunk of "
                           f"{n} mel frames that the {encoder.type} encoder (stack factor "
                           f"{encoder.stack_factor}) turns into {made}; llama.cpp aborts "
                           f"on that, so localrt does not encode it")
                break
    return Plan(tuple(frames), counted, problem)


def _encoder_problem(encoder: Encoder) -> str | None:
    """Why the projector cannot take any clip, by its header alone; None if it can."""
    kind = encoder.type
    if kind in STACKED and encoder.stack_factor <= 0:
        return f"the {kind} projector has no clip.audio.projector.stack_factor"
    if kind in WHISPER and (encoder.positions or 0) < WHISPER_POSITIONS:
        return (f"the {kind} projector's encoder has {encoder.positions or 0} positions "
                f"and each 30-second chunk needs {WHISPER_POSITIONS}")
    if kind == "qwen3a" and (encoder.positions or 0) < 13:
        return f"the qwen3a projector's encoder has {encoder.positions or 0} positions of 13"
    if kind == "granite_speech" and (encoder.window <= 0 or encoder.downsample <= 0):
        return "the granite_speech projector has no projector window or downsample rate"
    return None


def _chunks(encoder: Encoder, n: int) -> list[int]:
    """The mel frames of each chunk mtmd's preprocessor for the type makes of n
    samples (mtmd-audio.cpp)."""
    kind = encoder.type
    if kind in WHISPER:
        n = max(n, 201)  # padded to half an FFT window and one sample
        total = (n + RATE * 30) // HOP + 1  # 30 s of silence after, reflection around
        return [WHISPER_CHUNK] * (total // WHISPER_CHUNK)
    if kind == "qwen3a":
        total = n // HOP + 1
        return [-(-min(800, total - at) // 100) * 100 for at in range(0, total, 800)]
    if kind in ("lfm2a", "granite_speech"):
        if kind == "lfm2a" and n // HOP <= 1:
            return [0]  # its per-feature normalization asserts on fewer than two frames
        total = n // HOP + 1
        return [total if kind == "lfm2a" else total // 2]  # granite stacks frame pairs
    if kind == "gemma4a":
        out = []
        for at in range(0, n, RATE * 30):
            piece = min(RATE * 30, n - at)
            frames = _cdiv(piece + 160 - 321, HOP) + 1
            padded = max((frames - 1) * HOP + 512 - piece, 160) + piece
            out.append(min(_cdiv(padded - 512, HOP) + 1, frames))
        return out
    return []


def counted_tokens(encoder: Encoder, n: int) -> int:
    """The tokens clip.cpp's clip_n_output_tokens counts for a chunk of n mel frames."""
    kind = encoder.type
    if kind in WHISPER and kind != "glma":
        stacked, pooled = WHISPER[kind]
        if stacked:
            n = -(-n // encoder.stack_factor)  # CLIP_ALIGN, then divided
        n //= 2
        return n // 2 if pooled else n
    if kind == "glma":
        return n // 2 // encoder.stack_factor + 2
    if kind == "qwen3a":
        return n // 100 * 13
    if kind == "lfm2a":
        return (((n + 1) // 2 + 1) // 2 + 1) // 2
    if kind == "gemma4a":
        for _ in range(2):
            n = _cdiv(n - 1, 2) + 1
        return n
    if kind == "granite_speech":
        return -(-n // encoder.window) * (encoder.window // encoder.downsample)
    raise ValueError(f"no token count for audio projector type {kind}")


def made_tokens(encoder: Encoder, n: int) -> int | None:
    """The embeddings the type's encoder graph makes of a chunk of n mel frames
    (models/whisper-enc.cpp, models/qwen3a.cpp); None where this module does not
    follow the graph."""
    kind = encoder.type
    if kind in WHISPER:
        n = (n - 1) // 2 + 1  # the second convolution: kernel 3, stride 2, padding 1
        stacked, pooled = WHISPER[kind]
        if pooled:
            n //= 2  # an average pool of 2, in the transformer's end
        if stacked or kind == "glma":
            n = _stacked_rows(n, encoder.width, encoder.stack_factor)
        return n + 2 if kind == "glma" else n
    if kind == "qwen3a":  # three convolutions of stride 2 on each 100-frame piece
        return n // 100 * 13
    return None


def _stacked_rows(rows: int, width: int, factor: int) -> int:
    """The rows clip.cpp's build_stack makes of `rows` frames `width` wide, stacked by
    `factor`: it pads their elements with GGML_PAD, a mask that rounds up to a multiple
    only for a power of two (a width of 1280 and a factor of 8 give 187 rows of 1500
    frames; a width of 32, 188), and then divides."""
    if factor <= 1:
        return rows
    total, stride = rows * width, width * factor
    padded = (total + stride - 1) & ~(stride - 1)
    return padded // stride


def test_samples() -> list[int]:
    """The samples of each test clip a projector must take (TEST_SECONDS at RATE)."""
    return [int(seconds * RATE) for seconds in TEST_SECONDS]


def test_clip(seconds: float) -> bytes:
    """A 16-bit mono WAV at RATE of a 440 Hz tone: the clip a child encodes."""
    import io
    import math
    import struct
    import wave

    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * 440
                                                                     * i / RATE)))
                               for i in range(int(seconds * RATE))))
    return out.getvalue()
