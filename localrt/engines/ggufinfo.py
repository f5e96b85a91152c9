"""Read the key/value header of a GGUF model file, without numpy or the gguf package.

Only the header is read, never tensor data, so a file of many GB opens in
milliseconds.  GGUF versions 2 and 3, little-endian only (what llama.cpp writes on
every platform we run on).  Layout: magic b"GGUF", u32 version, u64 tensor count,
u64 key/value count, then per key/value a string key, a u32 value type and the value.
Strings are a u64 byte length followed by UTF-8 bytes; arrays are a u32 element type,
a u64 count and the elements.

Vocabulary arrays (tokens, scores, merges) can hold 150k entries, so arrays longer
than `MAX_INLINE_ARRAY` come back as an `ArrayInfo` that says where they are, and
`token_at` fetches single elements from them on demand.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

__all__ = ["ArrayInfo", "GGUFError", "Projector", "Reader", "is_embedding", "is_gguf",
           "is_rerank", "model_defaults", "model_input_size", "projector", "read_metadata",
           "read_tensor_infos", "read_tensor_shapes", "token_at"]

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # version 1 used 32-bit counts and lengths
MAX_INLINE_ARRAY = 1024      # longer arrays become ArrayInfo placeholders
MAX_STRING = 1 << 30         # any longer length field is corruption, not a real string
MAX_COUNT = 1 << 31          # the same for array, key/value and tensor counts
_MAX_DEPTH = 8               # arrays of arrays; bounds recursion on hostile files
_MAX_DIMS = 4                # GGML_MAX_DIMS: a tensor info with more is corruption
_CHUNK = 1 << 16             # read size; one chunk usually holds the whole header
RANK_POOLING = 4             # <arch>.pooling_type of a reranker (LLAMA_POOLING_TYPE_RANK)

# Value type id -> (name, struct format) for fixed-size types; ids from the GGUF spec.
# If you add a type here, also check _read_value, which handles STRING and ARRAY.
_FIXED = {
    0: ("uint8", "B"), 1: ("int8", "b"), 2: ("uint16", "H"), 3: ("int16", "h"),
    4: ("uint32", "I"), 5: ("int32", "i"), 6: ("float32", "f"), 7: ("bool", "?"),
    10: ("uint64", "Q"), 11: ("int64", "q"), 12: ("float64", "d"),
}
_STRING, _ARRAY = 8, 9
_TYPE_NAMES = {**{t: name for t, (name, _) in _FIXED.items()},
               _STRING: "string", _ARRAY: "array"}
_FIXED_STRUCTS = {t: struct.Struct("<" + fmt) for t, (_, fmt) in _FIXED.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# general.file_type -> readable name; numbering is llama.cpp's llama_ftype (gguf-py's
# LlamaFileType).  Gaps (4-6, 33-35) are types llama.cpp has removed.
QUANTIZATION_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
    16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S",
    22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M",
    28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
    37: "TQ2_0", 38: "MXFP4_MOE", 39: "NVFP4", 40: "Q1_0",
}


class GGUFError(ValueError):
    """The file is not a GGUF this module can read; the message names the file."""


@dataclass(frozen=True)
class ArrayInfo:
    """A header array too long to load: its element type, length and file offset."""

    type_name: str  # element type: "string", "float32", "int32", ...
    count: int
    offset: int     # file offset of the first element


# --------------------------------------------------------------------------- reader

class Reader:
    """Buffered little-endian reads from an open file, tracking the file offset.

    One buffer of `_CHUNK` bytes serves many small reads, so walking a string array
    costs a struct unpack per string, not a system call. localrt.engines.ggufcheck
    walks whole headers with it too.
    """

    def __init__(self, f, path, offset: int = 0):
        self._f = f
        self._path = os.fspath(path)
        self._size = os.fstat(f.fileno()).st_size
        self._buf = b""
        self._pos = 0          # read position inside _buf
        self._base = offset    # file offset of _buf[0]
        f.seek(offset)

    @property
    def offset(self) -> int:
        """File offset of the next byte to be read."""
        return self._base + self._pos

    @property
    def size(self) -> int:
        """The file's size in bytes, when it was opened."""
        return self._size

    def fail(self, problem: str) -> GGUFError:
        """A GGUFError naming this file."""
        return GGUFError(f"{self._path}: {problem}")

    def _truncated(self, n: int) -> GGUFError:
        return self.fail(f"truncated GGUF header: needs {n} bytes at offset {self.offset}, "
                         f"file is {self._size} bytes")

    def _fill(self, n: int) -> None:
        avail = len(self._buf) - self._pos
        if avail >= n:
            return
        if self.offset + n > self._size:
            raise self._truncated(n)
        more = self._f.read(max(n - avail, _CHUNK))
        self._buf = self._buf[self._pos:] + more
        self._base += self._pos
        self._pos = 0
        if len(self._buf) < n:  # the file shrank under us
            raise self._truncated(n)

    def read(self, n: int) -> bytes:
        """The next `n` bytes."""
        self._fill(n)
        data = self._buf[self._pos:self._pos + n]
        self._pos += n
        return data

    def read_at(self, offset: int, n: int) -> bytes:
        """`n` bytes at a file offset, wherever the reader is; its position stays."""
        if offset + n > self._size:
            raise self.fail(f"{n} bytes at offset {offset} run past the end of the file "
                            f"({self._size} bytes)")
        resume = self._f.tell()
        try:
            self._f.seek(offset)
            data = self._f.read(n)
        finally:
            self._f.seek(resume)
        if len(data) < n:  # the file shrank under us
            raise self._truncated(n)
        return data

    def unpack(self, st: struct.Struct) -> tuple:
        """The next values in format `st`."""
        self._fill(st.size)
        values = st.unpack_from(self._buf, self._pos)
        self._pos += st.size
        return values

    def skip(self, n: int) -> None:
        """Move `n` bytes forward without reading them when they are not buffered."""
        if n <= len(self._buf) - self._pos:
            self._pos += n
            return
        target = self.offset + n
        if target > self._size:  # seek would not notice
            raise self._truncated(n)
        self._f.seek(target)
        self._buf, self._pos, self._base = b"", 0, target

    def count(self, what: str) -> int:
        """A u64 count, refused when absurd."""
        (n,) = self.unpack(_U64)
        if n > MAX_COUNT:
            raise self.fail(f"absurd {what} {n} at offset {self.offset - 8}")
        return n

    def _string_length(self) -> int:
        (n,) = self.unpack(_U64)
        if n > MAX_STRING:
            raise self.fail(f"absurd string length {n} at offset {self.offset - 8}")
        return n

    def string(self) -> str:
        """A length-prefixed string."""
        # Some converters store partial UTF-8 sequences in tokens; replace rather
        # than refuse the whole model.
        return self.read(self._string_length()).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """Move past `count` length-prefixed strings."""
        if count * 8 > self._size - self.offset:
            raise self._truncated(count * 8)
        left = count
        while left:
            # Fast path: walk every string that lies wholly inside the buffer.
            buf, pos, end = self._buf, self._pos, len(self._buf)
            while left and pos + 8 <= end:
                (n,) = _U64.unpack_from(buf, pos)
                if pos + 8 + n > end:
                    break
                pos += 8 + n
                left -= 1
            self._pos = pos
            if left:  # a string straddles the buffer's end (or is huge): slow path
                self.skip(self._string_length())
                left -= 1

    def strings(self, count: int, limit: int):
        """The next `count` length-prefixed strings, as lists of bytes (one list per
        buffer's worth, so a caller walks them at the speed of a list); a length over
        `limit` is refused before its bytes are read."""
        if count * 8 > self._size - self.offset:
            raise self._truncated(count * 8)
        left = count
        while left:
            batch = []
            buf, pos, end = self._buf, self._pos, len(self._buf)
            while left and pos + 8 <= end:  # fast path, as in skip_strings
                (n,) = _U64.unpack_from(buf, pos)
                if n > limit or pos + 8 + n > end:
                    break
                batch.append(buf[pos + 8:pos + 8 + n])
                pos += 8 + n
                left -= 1
            self._pos = pos
            if left:
                (n,) = self.unpack(_U64)
                if n > limit:
                    raise self.fail(f"a string of {n} bytes at offset {self.offset - 8}, "
                                    f"over the {limit} allowed there")
                batch.append(self.read(n))
                left -= 1
            yield batch


def _read_value(r: Reader, vtype: int, depth: int = 0):
    """The value of type `vtype` at the reader's position, as a plain Python value."""
    if vtype in _FIXED:
        (value,) = r.unpack(_FIXED_STRUCTS[vtype])
        return value
    if vtype == _STRING:
        return r.string()
    if vtype != _ARRAY:
        raise r.fail(f"unknown value type {vtype} at offset {r.offset - 4}")
    if depth >= _MAX_DEPTH:
        raise r.fail(f"arrays nested deeper than {_MAX_DEPTH} at offset {r.offset}")
    (etype,) = r.unpack(_U32)
    if etype not in _TYPE_NAMES:
        raise r.fail(f"unknown array element type {etype} at offset {r.offset - 4}")
    count = r.count("array count")
    if count > MAX_INLINE_ARRAY:
        info = ArrayInfo(_TYPE_NAMES[etype], count, r.offset)
        _skip_elements(r, etype, count, depth)
        return info
    if etype in _FIXED:
        fmt = _FIXED[etype][1]
        st = struct.Struct(f"<{count}{fmt}")
        return list(st.unpack(r.read(st.size)))
    return [_read_value(r, etype, depth + 1) for _ in range(count)]


def _skip_elements(r: Reader, etype: int, count: int, depth: int) -> None:
    if etype in _FIXED:
        r.skip(count * _FIXED_STRUCTS[etype].size)
    elif etype == _STRING:
        r.skip_strings(count)
    else:  # arrays of arrays: each inner array must be walked
        for _ in range(count):
            _read_value(r, _ARRAY, depth + 1)


def _read_header(r: Reader, tensors: bool = False):
    """The key/values; with `tensors`, (key/values, {tensor name: (shape in ggml order,
    ggml type)})."""
    magic = r.read(4)
    if magic != MAGIC:
        raise r.fail(f"not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
    raw = r.read(4)
    (version,) = _U32.unpack(raw)
    if version not in SUPPORTED_VERSIONS:
        if struct.unpack(">I", raw)[0] in SUPPORTED_VERSIONS:
            raise r.fail("big-endian GGUF files are not supported")
        raise r.fail(f"unsupported GGUF version {version} (supported: 2, 3)")
    tensor_count = r.count("tensor count")
    kv_count = r.count("key/value count")
    metadata = {}
    for _ in range(kv_count):
        key = r.string()
        (vtype,) = r.unpack(_U32)
        metadata[key] = _read_value(r, vtype)
    if not tensors:
        return metadata
    # Each tensor's info: its name, u32 dimension count, u64 dimensions (ggml's ne:
    # the innermost first), u32 type, u64 data offset.
    shapes = {}
    for _ in range(tensor_count):
        name = r.string()
        (n_dims,) = r.unpack(_U32)
        if n_dims > _MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {n_dims} dimensions (at most {_MAX_DIMS})")
        shape = tuple(r.unpack(_U64)[0] for _ in range(n_dims))
        (ggml_type,) = r.unpack(_U32)
        r.skip(8)  # the data offset
        shapes[name] = (shape, ggml_type)
    return metadata, shapes


def _strings_at(path, info: ArrayInfo, indices) -> dict:
    """Elements `indices` of the string array `info`, in one pass over the file."""
    if info.type_name != "string":
        raise TypeError(f"not a string array: {info}")
    wanted = sorted(set(indices))
    for i in wanted:
        if not 0 <= i < info.count:
            raise IndexError(f"index {i} out of range for {info.count} strings")
    found = {}
    with open(path, "rb") as f:
        r = Reader(f, path, info.offset)
        at = 0
        for i in wanted:
            r.skip_strings(i - at)
            found[i] = r.string()
            at = i + 1
    return found


# --------------------------------------------------------------------------- public

def is_gguf(path) -> bool:
    """True when the file starts with the GGUF magic."""
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def read_metadata(path) -> dict:
    """All header key/values; arrays longer than MAX_INLINE_ARRAY become ArrayInfo."""
    with open(path, "rb") as f:
        return _read_header(Reader(f, path))


def read_tensor_shapes(path) -> tuple[dict, dict]:
    """(header key/values, {tensor name: dimensions in ggml order, ne[0] first}): the
    tensor infos that follow the key/values, never the tensor data."""
    md, infos = read_tensor_infos(path)
    return md, {name: shape for name, (shape, _) in infos.items()}


def read_tensor_infos(path) -> tuple[dict, dict]:
    """(header key/values, {tensor name: (dimensions in ggml order, ggml type id)})."""
    with open(path, "rb") as f:
        return _read_header(Reader(f, path), tensors=True)


def token_at(path, info: ArrayInfo, index: int) -> str:
    """Element `index` of the string array `info` (e.g. tokenizer.ggml.tokens)."""
    return _strings_at(path, info, [index])[index]


def model_defaults(path) -> dict:
    """What a model registry wants from a GGUF; a key is present only when known."""
    md = read_metadata(path)
    out = {}

    def take(out_key, md_key, kind):
        value = md.get(md_key)
        # bool is an int subclass; a bool context length is not a context length
        if isinstance(value, kind) and not isinstance(value, bool):
            out[out_key] = value

    take("architecture", "general.architecture", str)
    take("name", "general.name", str)
    if "architecture" in out:
        take("context_length", f"{out['architecture']}.context_length", int)
    take("chat_template", "tokenizer.chat_template", str)

    ids = {}
    for role in ("eos", "bos"):
        value = md.get(f"tokenizer.ggml.{role}_token_id")
        if isinstance(value, int) and not isinstance(value, bool):
            ids[role] = value
    texts = _token_texts(path, md.get("tokenizer.ggml.tokens"), ids.values())
    for role, token_id in ids.items():
        if token_id in texts:
            out[f"{role}_token"] = texts[token_id]
    if "eos_token" in out:
        out["stop"] = [out["eos_token"]]

    take("file_type", "general.file_type", int)
    if out.get("file_type") in QUANTIZATION_NAMES:
        out["quantization"] = QUANTIZATION_NAMES[out["file_type"]]
    take("parameter_count", "general.parameter_count", int)
    out["embedding"] = is_embedding(md)
    out["rerank"] = is_rerank(md)
    return out


def declares_pooling(md: dict) -> bool:
    """Whether a GGUF's header says how it pools (`<arch>.pooling_type` above 0, which is
    LLAMA_POOLING_TYPE_NONE)."""
    pooling = md.get(f"{md.get('general.architecture', '')}.pooling_type")
    return isinstance(pooling, int) and not isinstance(pooling, bool) and pooling > 0


def is_embedding(md: dict) -> bool:
    """Whether a GGUF's header makes it an embedding model: it declares how it pools
    or has non-causal attention (an encoder, such as BERT). The registry's capabilities
    and localrt.engines.llama.embedding.embedding_pooling (which loads such a model in
    llama.cpp's embedding mode) both ask this."""
    arch = md.get("general.architecture", "")
    return declares_pooling(md) or md.get(f"{arch}.attention.causal") is False


def is_rerank(md: dict) -> bool:
    """Whether a GGUF's header makes it a reranker: it pools by rank (llama.cpp's
    LLAMA_POOLING_TYPE_RANK: bge-reranker, jina-reranker, Qwen3-Reranker), scoring a
    query and a document read together. The registry's capabilities ask this."""
    pooling = md.get(f"{md.get('general.architecture', '')}.pooling_type")
    return pooling == RANK_POOLING and not isinstance(pooling, bool)


def model_input_size(md: dict) -> int | None:
    """The size of the embeddings a text model takes in (llama.cpp's n_embd_inp): its
    `<arch>.embedding_length`, times one more than its deepstack layers (Qwen3-VL), or
    None when the header does not say."""
    arch = md.get("general.architecture", "")
    n_embd = md.get(f"{arch}.embedding_length")
    if not isinstance(n_embd, int) or isinstance(n_embd, bool) or n_embd <= 0:
        return None
    deepstack = md.get(f"{arch}.n_deepstack_layers")
    if isinstance(deepstack, int) and not isinstance(deepstack, bool) and deepstack > 0:
        return n_embd * (1 + deepstack)
    return n_embd


def _token_texts(path, tokens, ids) -> dict:
    """Token id -> text for the ids that exist in `tokens` (a list or an ArrayInfo)."""
    if isinstance(tokens, list):
        return {i: tokens[i] for i in ids if 0 <= i < len(tokens) and isinstance(tokens[i], str)}
    if isinstance(tokens, ArrayInfo) and tokens.type_name == "string":
        return _strings_at(path, tokens, [i for i in ids if 0 <= i < tokens.count])
    return {}


# --------------------------------------------------------------------------- projectors

@dataclass(frozen=True)
class Projector:
    """What a projector GGUF (mmproj) says of itself, from its header alone."""

    type: str                # clip.projector_type (or clip.vision.projector_type)
    vision: bool             # clip.has_vision_encoder
    output_size: int | None  # the embeddings it gives the text model; None: not known here
    audio: bool = False      # clip.has_audio_encoder
    audio_type: str = ""     # clip.projector_type (or clip.audio.projector_type)
    audio_output_size: int | None = None  # its audio encoder's, as output_size


# Where each vision projector type's output size is, as llama.cpp's clip_n_mmproj_embd
# (tools/mtmd/clip.cpp) reads it: (tensor, dimension in ggml order), the first present
# wins. A type not here is checked by llama.cpp when the model starts, not at import.
# If llama.cpp adds a projector type, add it here.
_MLP2 = (("mm.2.weight", 1),)
_MERGER = (("mm.2.bias", 0),)
_INPUT_PROJ0 = (("mm.input_projection.weight", 0),)
_PROJECTOR_OUTPUT = {
    "mlp": (("mm.3.bias", 0), ("mm.2.weight", 1)),  # mm.3 makes it MLP_NORM (Yi's llava)
    "ldp": (("mm.model.mb_block.1.block.2.1.bias", 0),),
    "ldpv2": (("mm.model.peg.0.bias", 0),),
    "resampler": (("resampler.proj.weight", 0),),  # MiniCPM-V
    "adapter": (("adapter.linear.dense_4h_to_h.weight", 1),),  # GLM-Edge
    "qwen2vl_merger": _MERGER, "qwen2.5vl_merger": _MERGER, "qwen2.5o": _MERGER,
    "exaone4_5": _MERGER, "youtuvl": _MERGER, "ling3vl": _MERGER,
    "gemma3": _INPUT_PROJ0, "gemma3nv": _INPUT_PROJ0,
    "gemma4v": (("mm.input_projection.weight", 1),),
    "gemma4uv": (("mm.input_projection.weight", 1),),
    "idefics3": (("mm.model.fc.weight", 1),),  # SmolVLM
    "pixtral": _MLP2, "phi4": _MLP2, "lightonocr": _MLP2, "dots_ocr": _MLP2,
    "lfm2": _MLP2, "kimivl": _MLP2, "paddleocr": _MLP2, "kimik25": _MLP2,
    "internvl": (("mm.3.weight", 1),), "nemotron_v2_vl": (("mm.3.weight", 1),),
}
# The same for audio projector types (clip_n_mmproj_embd's audio cases); "qwen2.5o" is
# Qwen2.5-Omni's file with both encoders, whose audio half llama.cpp reads as qwen2a.
_AUDIO_MLP2 = (("mm.a.mlp.2.weight", 1),)
_AUDIO_OUTPUT = {
    "qwen2a": (("mm.a.fc.weight", 1),), "qwen2.5o": (("mm.a.fc.weight", 1),),
    "ultravox": _AUDIO_MLP2, "voxtral": _AUDIO_MLP2, "qwen3a": _AUDIO_MLP2,
    "musicflamingo": _AUDIO_MLP2, "meralion": (("mm.a.mlp.3.weight", 1),),
}


def _output_size(table: dict, kind: str, shapes: dict) -> int | None:
    for tensor, dim in table.get(kind, ()):
        shape = shapes.get(tensor)
        if shape is not None and len(shape) > dim:
            return int(shape[dim])
    return None


def projector(path) -> Projector:
    """A projector GGUF's type, whether it encodes images and audio, and the output
    size of each encoder.

    Raises GGUFError when the file is not a GGUF, or is one without a projector type
    (a text model, say): the message says which.
    """
    md, shapes = read_tensor_shapes(path)
    common = md.get("clip.projector_type")
    kind = common or md.get("clip.vision.projector_type")
    audio_kind = common or md.get("clip.audio.projector_type")
    if not isinstance(kind, str) or not kind:
        kind = audio_kind
    if not isinstance(kind, str) or not kind:
        raise GGUFError(f"{os.fspath(path)}: not a projector GGUF (it has no "
                        f"clip.projector_type)")
    vision = md.get("clip.has_vision_encoder") is True
    audio = md.get("clip.has_audio_encoder") is True
    audio_kind = audio_kind if isinstance(audio_kind, str) and audio_kind else kind
    return Projector(kind, vision,
                     _output_size(_PROJECTOR_OUTPUT, kind, shapes) if vision else None,
                     audio, audio_kind if audio else "",
                     _output_size(_AUDIO_OUTPUT, audio_kind, shapes) if audio else None)
