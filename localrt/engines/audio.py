"""Audio clips as a request carries them: which format the bytes are (by signature, as
llama.cpp's mtmd helper tells them apart before its decoder, miniaudio, reads them) and
how long they play, from the header alone.

  format    "wav" (RIFF....WAVE), "mp3" (an ID3v2 tag, or an MPEG audio frame sync),
            "flac" (fLaC); None for anything else
  seconds   a WAV's data bytes over its byte rate (fmt chunk); a FLAC's total samples
            over its sample rate (STREAMINFO); an MP3's frames walked and their samples
            summed (each frame header says its length and samples), which is what a
            decoder plays, VBR included; a ValueError says why bytes of the format
            cannot be read

  frames    (sample frames, sample rate): a WAV's data bytes over its block align, a
            FLAC's STREAMINFO, an MP3's frames' samples summed at its first frame's
            rate; what the engine plans a clip's tokens by before the decoder runs
            (localrt.engines.llama.audiotokens)

Nothing here decodes samples: the projector's decoder does, in the engine.
"""

from __future__ import annotations

import struct

FORMATS = ("wav", "mp3", "flac")
MEDIA_TYPES = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac"}
# What each media type a dialect may say is, by format (audio/x-wav, audio/mp3, ...).
FORMAT_OF_TYPE = {"audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav",
                  "audio/vnd.wave": "wav", "audio/mpeg": "mp3", "audio/mp3": "mp3",
                  "audio/flac": "flac", "audio/x-flac": "flac"}


def format_of(data: bytes) -> str | None:
    """"wav", "mp3" or "flac" by the bytes' signature; None for anything else."""
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:3] == b"ID3" or (len(data) >= 4 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0
                              and _frame(data, 0) is not None):
        return "mp3"
    return None


def seconds(data: bytes, kind: str, limit: float | None = None) -> float:
    """How long a clip of `kind` plays, in seconds; a walk of MP3 frames stops once past
    `limit`. A ValueError says what in the header is wrong."""
    if kind == "wav":
        return _wav_seconds(data)
    if kind == "flac":
        return _flac_seconds(data)
    if kind == "mp3":
        return _mp3_seconds(data, limit)
    raise ValueError(f"not a clip of a known format ({kind})")


def frames(data: bytes, kind: str) -> tuple[int, int]:
    """(sample frames, sample rate) of a clip of `kind`, from its header (an MP3's
    frames walked); a ValueError says what in the header is wrong."""
    if kind == "wav":
        size, (_, rate, _, align) = _wav_data(data)
        return size // align, rate
    if kind == "flac":
        rate, total, channels, bits = _flac_info(data)
        return total or len(data) * 8 // (channels * bits), rate
    if kind == "mp3":
        return _mp3_walk(data, None)[1:]
    raise ValueError(f"not a clip of a known format ({kind})")


def _wav_seconds(data: bytes) -> float:
    size, (byte_rate, _, _, _) = _wav_data(data)
    return size / byte_rate


def _wav_data(data: bytes) -> tuple[int, tuple[int, int, int, int]]:
    """(the data chunk's bytes, (byte rate, sample rate, channels, block align))."""
    at, fmt = 12, None
    while at + 8 <= len(data):
        chunk, size = data[at:at + 4], struct.unpack_from("<I", data, at + 4)[0]
        body = at + 8
        if chunk == b"fmt ":
            if size < 16 or body + 16 > len(data):
                raise ValueError("its fmt chunk is cut short")
            _, channels, rate, byte_rate, align, bits = struct.unpack_from("<HHIIHH", data,
                                                                           body)
            if not channels or not rate or not byte_rate or not bits:
                raise ValueError(f"its fmt chunk says {channels} channels at {rate} Hz, "
                                 f"{bits} bits a sample")
            fmt = (byte_rate, rate, channels, align or channels * max(bits // 8, 1))
        elif chunk == b"data":
            if fmt is None:
                raise ValueError("its data chunk comes before a fmt chunk")
            # a streaming writer's size (0xFFFFFFFF or 0) means: to the end of the file
            held = len(data) - body
            size = held if size in (0, 0xFFFFFFFF) else min(size, held)
            return size, fmt
        at = body + size + (size & 1)
    raise ValueError("it has no fmt and data chunks")


def _flac_seconds(data: bytes) -> float:
    rate, total, channels, bits = _flac_info(data)
    if not total:  # unknown: the bytes as uncompressed samples bound it from above
        return len(data) * 8 / (rate * channels * bits)
    return total / rate


def _flac_info(data: bytes) -> tuple[int, int, int, int]:
    """STREAMINFO's (sample rate, total samples or 0, channels, bits a sample)."""
    if len(data) < 8 + 34 or data[4] & 0x7F != 0:
        raise ValueError("it does not begin with a STREAMINFO block")
    packed = int.from_bytes(data[18:26], "big")
    rate, total = packed >> 44, packed & ((1 << 36) - 1)
    if not rate:
        raise ValueError("its STREAMINFO gives a sample rate of 0")
    return rate, total, ((packed >> 41) & 7) + 1, ((packed >> 36) & 31) + 1


# MPEG audio frame headers: bitrates (kbit/s) by (MPEG-1?, layer), sample rates by
# version bits, samples a frame by (MPEG-1?, layer).
_BITRATES = {
    (True, 1): (0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (True, 2): (0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (True, 3): (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (False, 1): (0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (False, 2): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_BITRATES[(False, 3)] = _BITRATES[(False, 2)]
_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def _frame(data: bytes, at: int) -> tuple[int, int, int] | None:
    """The MPEG audio frame at `at`: (its length in bytes, its samples, its sample rate),
    or None where no valid frame header is."""
    if at + 4 > len(data) or data[at] != 0xFF or data[at + 1] & 0xE0 != 0xE0:
        return None
    version, layer = (data[at + 1] >> 3) & 3, 4 - ((data[at + 1] >> 1) & 3)
    rate_index, bitrate_index = (data[at + 2] >> 2) & 3, data[at + 2] >> 4
    if version == 1 or layer == 4 or rate_index == 3 or bitrate_index in (0, 15):
        return None  # reserved values, or free format, whose length no header says
    mpeg1 = version == 3
    rate = _RATES[version][rate_index]
    bitrate = _BITRATES[(mpeg1, layer)][bitrate_index] * 1000
    padding = (data[at + 2] >> 1) & 1
    if layer == 1:
        return (12 * bitrate // rate + padding) * 4, 384, rate
    per_frame = 1152 if layer == 2 or mpeg1 else 576
    return per_frame // 8 * bitrate // rate + padding, per_frame, rate


def _mp3_seconds(data: bytes, limit: float | None) -> float:
    return _mp3_walk(data, limit)[0]


def _mp3_walk(data: bytes, limit: float | None) -> tuple[float, int, int]:
    """(seconds, samples, the first frame's sample rate) of an MP3's frames."""
    at, samples_total, first_rate = 0, 0, 0
    if data[:3] == b"ID3" and len(data) >= 10:
        size = 0
        for byte in data[6:10]:  # a syncsafe integer: 7 bits a byte
            size = (size << 7) | (byte & 0x7F)
        at = 10 + size + (10 if data[5] & 0x10 else 0)
    total, walked = 0.0, 0
    while at + 4 <= len(data):
        frame = _frame(data, at)
        if frame is None:  # junk between frames: find the next sync
            found = data.find(b"\xff", at + 1)
            if found < 0:
                break
            at = found
            continue
        length, samples, rate = frame
        total += samples / rate
        samples_total += samples
        first_rate = first_rate or rate
        walked += 1
        if limit is not None and total > limit:
            break
        at += max(length, 4)
    if not walked:
        raise ValueError("it holds no MPEG audio frame")
    return total, samples_total, first_rate
