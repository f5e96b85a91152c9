"""Images and audio into a gguf-cpp model: its projector (mmproj) through llama.cpp's
mtmd.

A model whose record names a projector (localrt.models.roles.PROJECTOR) loads
it as a `Projector` beside the text model, on the GPU when the text model uses one.
A chat with images (localrt.engines.contract.Image parts) becomes one prompt:

  * Each image part becomes the projector's media marker in its message's text, so
    the chat template sees text only (as llama-server does); the marker is random per
    load, so no text a user writes can stand for an image.
  * mtmd_tokenize splits the rendered prompt into text tokens and image chunks. The
    prompt localrt.engines.batching reads is one item per position: a text token (an
    int), or for the k-th position of an image ("image", its SHA-256, k). Two prompts
    with the same image at the same place share those items, so the slots' prompt
    cache reuses an image's KV as it reuses text, and never half an image
    (`whole_images`).
  * An audio clip (a contract.Audio part, {"type": "audio"}) goes the same way: a
    marker in the text, a bitmap mtmd's helper decodes from the clip's bytes (WAV, MP3,
    FLAC, by miniaudio, resampled to the projector's rate), and chunks whose positions
    are items ("image", its SHA-256, k) too: "image" names any media chunk's position.
  * Before mtmd reads a clip, its chunks and tokens are planned
    (localrt.engines.llama.audiotokens): from its header, for the context check, and
    from the decoded samples, before mtmd tokenizes; a clip mtmd would abort on is a
    400 invalid_audio naming the part, and no audio chunk whose token count is not the
    plan's is ever encoded.
  * The batcher evaluates an image chunk (`evaluate`: mtmd's encode, then its
    embeddings decoded into the sequence's own KV) as one step's work for one
    sequence, beside the text the other sequences decode in that step.

llama_cpp.mtmd_cpp is imported only when a projector loads.
"""

from __future__ import annotations

import ctypes
import os
import secrets
from dataclasses import dataclass, field

from localrt.engines.contract import Audio, Image
from localrt.engines.llama import audiotokens
from localrt.errors import (AudioNotSupported, ImagesNotSupported, InvalidAudio,
                            InvalidField, InvalidImage)

IMAGE = "image"  # the first item of an image position in a prompt
# The formats llama.cpp reads (stb_image, as mtmd builds it), by their first bytes.
# Nothing else reaches mtmd: its helper would try bytes it cannot read as audio, then
# as video through an ffprobe child process.
FORMATS = ((b"\x89PNG\r\n\x1a\n", "png"), (b"\xff\xd8\xff", "jpeg"), (b"BM", "bmp"),
           (b"GIF87a", "gif"), (b"GIF89a", "gif"))


def audio_format(data: bytes) -> str | None:
    """"wav", "mp3" or "flac" by the bytes' signature (as mtmd's helper tells a clip
    from an image); None for anything else."""
    from localrt.engines.audio import format_of

    return format_of(data)


def image_format(data: bytes) -> str | None:
    """"png", "jpeg", "bmp" or "gif" by the bytes' signature; None for anything else."""
    return next((name for magic, name in FORMATS if data.startswith(magic)), None)


def image_item(item) -> tuple | None:
    """An image position's item ("image", digest, k), or None for a text token."""
    return item if isinstance(item, tuple) else None


def whole_images(prompt: list, keep: int) -> int:
    """`keep` moved back to the start of the image it would cut in two, if any: a
    cached prefix ends between images, never inside one."""
    if 0 < keep < len(prompt):
        item = image_item(prompt[keep])
        if item is not None:
            keep -= item[2]
    return keep


MEDIA = ("image", "audio")  # the content parts that become a media marker


def has_images(messages: list) -> bool:
    """Whether any message's content holds an image or audio part."""
    return any(isinstance(m.get("content"), list)
               and any(p.get("type") in MEDIA for p in m["content"]) for m in messages)


def texts_and_images(messages: list, marker: str) -> tuple[list, list]:
    """The messages with each image or audio part as `marker` in its content's text,
    and the media (Image, Audio) in prompt order."""
    images, out = [], []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            pieces = []
            for part in content:
                if part.get("type") in MEDIA:
                    images.append(part[part["type"]])
                    pieces.append(marker)
                else:
                    pieces.append(part.get("text", ""))
            message = {**message, "content": "\n".join(pieces)}
        out.append(message)
    return out, images


@dataclass
class Prompt:
    """A tokenized prompt with images: its items (see the module's docstring), the
    mtmd chunk of each image by the index of its first position (owned: free()), and
    its token count (an image's tokens may be more than its positions)."""

    items: list
    chunks: dict = field(default_factory=dict)
    n_tokens: int = 0
    audio_tokens: int = 0  # of n_tokens, those of audio chunks (a transcription's usage)
    thinking: str | None = None  # a reasoning reply's state at its start (reasoning.Plan)


class Projector:
    """A loaded projector: the mtmd context made with the text model."""

    def __init__(self, llama_cpp, path: str, text_model, options: dict):
        from llama_cpp import _logger, mtmd_cpp

        # mtmd logs through llama-cpp-python's logger, as llama.cpp does (errors only).
        mtmd_cpp.mtmd_log_set(_logger.llama_log_callback, None)
        mtmd_cpp.mtmd_helper_log_set(_logger.llama_log_callback, None)
        self._mtmd, self._ll = mtmd_cpp, llama_cpp
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu = options.get("ngl", -1) != 0  # where the text model's layers go
        params.print_timings = False
        params.warmup = False
        threads = options.get("cpu_threads")
        if threads:
            params.n_threads = threads
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
                                  if options.get("flash_attn")
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self.marker = f"<__image_{secrets.token_hex(8)}__>"
        self._marker = self.marker.encode()
        params.media_marker = self._marker  # kept alive by self._marker
        self.ctx = mtmd_cpp.mtmd_init_from_file(path.encode(), text_model, params)
        if not self.ctx:
            raise ValueError(f"llama.cpp's mtmd could not load the projector {path}")
        self.vision = bool(mtmd_cpp.mtmd_support_vision(self.ctx))
        self.audio = bool(mtmd_cpp.mtmd_support_audio(self.ctx))
        if not self.vision and not self.audio:
            self.close()
            raise ValueError(f"the projector {path} has no vision or audio encoder")
        self.path = path
        self.encoder = audiotokens.Encoder("")  # no plan: mtmd alone counts the clips
        if self.audio and mtmd_cpp.mtmd_get_audio_sample_rate(self.ctx) == audiotokens.RATE:
            try:
                self.encoder = audiotokens.read(path)
            except (OSError, ValueError):
                pass  # mtmd read the file; the header reader is the stricter one

    def plan(self, clip: Audio, samples: int | None = None):
        """The audiotokens.Plan of a clip: from `samples` (the decoded count), else from
        its header; None where the projector's type has no plan. A 400 invalid_audio
        naming the part for a clip mtmd cannot take."""
        if samples is None:
            from localrt.engines.audio import frames

            try:
                count, rate = frames(clip.data, clip.format)
            except ValueError:
                return None  # the decoder says what is wrong with it
            samples = audiotokens.resampled(count, rate)
        planned = audiotokens.plan(self.encoder, samples)
        if planned is not None and planned.problem is not None:
            raise InvalidAudio(f"Invalid field '{clip.where}': llama.cpp's mtmd cannot take "
                               f"this clip: {planned.problem}", param=clip.where)
        return planned

    def audio_tokens(self, images: list) -> int:
        """The tokens the clips among `images` take, planned from their headers before
        anything is decoded (0 for a clip without a plan); invalid_audio as plan()."""
        total = 0
        for clip in images:
            if isinstance(clip, Audio) and self.audio:
                planned = self.plan(clip)
                total += planned.tokens if planned is not None else 0
        return total

    def test_clips(self) -> None:
        """For a projector's first load in a child (localrt.engines.vetting): a
        ValueError naming the projector when its plan refuses a test clip
        (audiotokens.TEST_SECONDS)."""
        if not self.audio:
            return
        for seconds, samples in zip(audiotokens.TEST_SECONDS, audiotokens.test_samples()):
            planned = audiotokens.plan(self.encoder, samples)
            if planned is not None and planned.problem is not None:
                raise ValueError(f"its projector {os.path.basename(self.path)} cannot take "
                                 f"a {seconds:g}-second clip: {planned.problem}")

    def tokenize(self, text: str, images: list, add_special: bool) -> Prompt:
        """The prompt of a rendered text holding one marker per image or clip; a 400
        invalid_image (invalid_audio) naming the part for bytes llama.cpp cannot read as
        an image (a clip), images_not_supported (audio_not_supported) where the
        projector has no encoder for it."""
        mtmd = self._mtmd
        bitmaps, expected = [], []  # expected: (part, tokens) of each planned audio chunk
        try:
            for image in images:
                buf = (ctypes.c_uint8 * len(image.data)).from_buffer_copy(image.data)
                bitmap = None
                if isinstance(image, Audio):
                    if not self.audio:
                        raise refuse_audio()
                    # only bytes whose signature is a clip's: mtmd's helper would try
                    # others as an image, then as video through a child process
                    if audio_format(image.data) is not None:
                        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(
                            self.ctx, buf, len(image.data), False)
                    if not bitmap:
                        raise InvalidAudio(f"Invalid field '{image.where}': llama.cpp "
                                           f"cannot decode it as audio (WAV, MP3 or FLAC)",
                                           param=image.where)
                    bitmaps.append(bitmap)
                    mtmd.mtmd_bitmap_set_id(bitmap, image.digest.encode())
                    planned = self.plan(image, mtmd.mtmd_bitmap_get_nx(bitmap))
                    expected.append((image.where, planned and planned.counted))
                    continue
                if not self.vision:
                    raise refuse_images()
                if image_format(image.data) is not None:
                    bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.ctx, buf,
                                                                  len(image.data), False)
                if not bitmap:
                    raise InvalidImage(f"Invalid field '{image.where}': llama.cpp cannot "
                                       f"read it as an image (PNG, JPEG, BMP or GIF)",
                                       param=image.where)
                bitmaps.append(bitmap)
                mtmd.mtmd_bitmap_set_id(bitmap, image.digest.encode())
            return self._chunks(text, bitmaps, add_special, expected)
        finally:
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)

    def _chunks(self, text: str, bitmaps: list, add_special: bool,
                expected: list) -> Prompt:
        """The Prompt of mtmd's chunks; `expected` holds (part, planned counts or None)
        for each clip in order, and an audio chunk mtmd counts otherwise is refused
        before anything encodes it."""
        mtmd = self._mtmd
        clips = iter(expected)
        # The clip whose chunks come now and its planned counts not yet met (None: no
        # plan); a clip's chunks come together, text (its marker's newline, or the
        # template's) between two clips.
        where, counts, in_clip = None, None, False
        data = text.encode("utf-8")
        source = mtmd.mtmd_input_text(data, len(data), add_special, True)
        array = (mtmd.mtmd_bitmap_p_ctypes * max(len(bitmaps), 1))(*bitmaps)
        chunks = mtmd.mtmd_input_chunks_init()
        prompt = Prompt([])
        try:
            code = mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(source), array,
                                      len(bitmaps))
            if code != 0:
                raise InvalidField(f"Invalid field 'messages': llama.cpp's mtmd could not "
                                   f"tokenize the prompt with its images (status {code})",
                                   param="messages")
            for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                kind = mtmd.mtmd_input_chunk_get_type(chunk)
                if kind != mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO:
                    in_clip = False
                if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t()
                    tokens = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    prompt.items.extend(tokens[:n.value])
                    prompt.n_tokens += n.value
                    continue
                if kind not in (mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE,
                                mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO):
                    raise InvalidField("Invalid field 'messages': only images, audio and "
                                       "text are read", param="messages")
                digest = (mtmd.mtmd_input_chunk_get_id(chunk) or b"").decode()
                start = len(prompt.items)
                prompt.chunks[start] = mtmd.mtmd_input_chunk_copy(chunk)
                prompt.items.extend((IMAGE, digest, k)
                                    for k in range(mtmd.mtmd_input_chunk_get_n_pos(chunk)))
                n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
                prompt.n_tokens += n
                if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO:
                    prompt.audio_tokens += n
                    if not in_clip:  # this chunk begins the next clip
                        where, counts = next(clips, (None, None))
                        counts, in_clip = None if counts is None else list(counts), True
                    if counts is not None and (not counts or counts.pop(0) != n):
                        raise InvalidAudio(f"Invalid field '{where}': llama.cpp's mtmd "
                                           f"counts {n} tokens for a chunk of this clip "
                                           f"where localrt planned otherwise; localrt "
                                           f"does not encode it", param=where)
        except BaseException:
            self.free(prompt)
            raise
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
        if prompt.items and image_item(prompt.items[-1]) is not None:
            self.free(prompt)  # the last prompt position gives the first reply token
            raise InvalidField("Invalid field 'messages': the prompt ends with an image or "
                               "a clip; the chat template must put text after it",
                               param="messages")
        return prompt

    def evaluate(self, chunk, lctx, pos: int, seq: int, n_batch: int) -> None:
        """Encode an image chunk and decode its embeddings into sequence `seq` from
        position `pos` (no logits: text always follows an image)."""
        after = self._ll.llama_pos(0)
        code = self._mtmd.mtmd_helper_eval_chunk_single(self.ctx, lctx, chunk, pos, seq,
                                                        n_batch, False, ctypes.byref(after))
        if code != 0:
            raise RuntimeError(f"llama.cpp's mtmd could not evaluate an image (status {code})")

    def free(self, prompt: Prompt) -> None:
        """Free the prompt's image chunks."""
        self.free_chunks(prompt.chunks)

    def free_chunks(self, chunks: dict) -> None:
        """Free image chunks (a Prompt's, or a sequence's once it is done)."""
        for chunk in chunks.values():
            self._mtmd.mtmd_input_chunk_free(chunk)
        chunks.clear()

    def close(self) -> None:
        if self.ctx:
            self._mtmd.mtmd_free(self.ctx)
            self.ctx = None


def refuse_images(model_id: str | None = None) -> ImagesNotSupported:
    """The error for images sent to a model without a projector (localrt.inference.media
    gives it before the model starts; the engine, should one reach it anyway)."""
    name = f"Model {model_id}" if model_id else "This model"
    return ImagesNotSupported(f"{name} does not take images: it has no vision projector "
                              f"(mmproj); send text only, or use a vision model",
                              param="model")


def refuse_media(messages: list):
    """The error for a model without a projector given media: audio_not_supported where
    the messages hold a clip, else images_not_supported."""
    audio = any(isinstance(m.get("content"), list)
                and any(p.get("type") == "audio" for p in m["content"]) for m in messages)
    return refuse_audio() if audio else refuse_images()


def refuse_audio(model_id: str | None = None) -> AudioNotSupported:
    """The error for audio sent to a model without an audio projector (a vision-only
    projector, or none; an ONNX model)."""
    name = f"Model {model_id}" if model_id else "This model"
    return AudioNotSupported(f"{name} does not take audio: it has no audio projector "
                             f"(an mmproj with an audio encoder); send text only, or use "
                             f"an audio model", param="model")
