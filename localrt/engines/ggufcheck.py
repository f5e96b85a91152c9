"""Check a GGUF model file whole, in Python, before any native code reads it (issue 38).

llama.cpp reads a GGUF's header, tensor table and vocabulary inside the server's
process, where a file that breaks one of its assumptions can end the process (an
assert, a segfault) instead of failing cleanly. `check(path)` walks the same header
first and refuses such a file with a 400 `invalid_model_file` naming the file and the
rule it breaks. It reads the header, the tensor table and the vocabulary's arrays,
never tensor data, streaming the arrays: a 150k-token vocabulary with its 150k merges
takes about a tenth of a second, whatever the file's size. `Checked` keeps each file's outcome by path,
size and modification time, so a second start of a model costs a stat.

The rules (each refused file names the one it breaks):
  * layout: every count, length, offset and size lies inside the file, and counts of
    keys, tensors and strings in an array are below limits far beyond any real
    model's (MAX_KEYS, MAX_TENSORS, MAX_STRINGS); GGUF version 2 or 3; keys and tensor
    names unique; no arrays of arrays; tensor names shorter than GGML_MAX_NAME; at most
    GGML_MAX_DIMS dimensions;
  * alignment: general.alignment a uint32 power of two of at least 32 (ggml maps
    tensor data from the file and needs it on 32 bytes: 1 or 16 abort the process);
  * tensors: a ggml type this llama.cpp knows, rows a whole number of its blocks, the
    data laid out as llama.cpp demands (each tensor at its aligned offset, right after
    the one before it: none overlaps another), and inside the file; a weight or bias
    typed as llama.cpp cannot compute with (integers, F64, Q8_1, Q8_K: a segfault at
    the first decode) is refused;
  * limits: `<arch>.block_count` 1 to LLAMA_MAX_LAYERS, nextn_predict_layers at most
    that; expert_count at most LLAMA_MAX_EXPERTS, expert_used_count only with experts,
    at least one and at most expert_count; expert groups as llama.cpp asserts them;
  * vocabulary: tokenizer.ggml.tokens an array of strings, each valid UTF-8, at most
    MAX_TOKEN_BYTES and unique (empty ones apart, which llama.cpp renames); scores,
    token types, merges and the precompiled charsmap of the types and lengths
    llama.cpp reads them as; a tokenizer model that matches the vocabulary: a
    SentencePiece one ("llama") has the 256 byte tokens its fallback needs
    (<0x00>..<0xFF>, or the character itself for ASCII), a WordPiece one ("bert") has
    no byte tokens (which make a SentencePiece vocabulary), an RWKV one has its
    newline token, and a model without a vocabulary ("none") cannot be chatted with.

Each rule is one that a mutant of a tiny generated model broke to crash llama.cpp
(SIGABRT or SIGSEGV) in a child process, or one llama.cpp refuses cleanly only in
some versions; tests/test_ggufcheck.py has a mutant for each.

The limits are those of the llama.cpp localrt ships (llama-cpp-python's vendor tree):
if its llama.cpp raises one (LLAMA_MAX_LAYERS, LLAMA_MAX_EXPERTS) or adds a ggml
type, change GGML_TYPES and the constants below with it.
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass

from localrt.engines.ggufinfo import MAGIC, GGUFError, Reader
from localrt.errors import InvalidModelFile

__all__ = ["Checked", "check", "tensor_nbytes"]

MAX_LAYERS = 512           # LLAMA_MAX_LAYERS (src/llama-hparams.h)
MAX_EXPERTS = 1024         # LLAMA_MAX_EXPERTS of the llama.cpp localrt ships
TENSOR_ALIGNMENT = 32      # ggml's TENSOR_ALIGNMENT: a mapped tensor must start on it
DEFAULT_ALIGNMENT = 32     # GGUF_DEFAULT_ALIGNMENT, without general.alignment
MAX_NAME = 64              # GGML_MAX_NAME, the terminating NUL included
MAX_DIMS = 4               # GGML_MAX_DIMS
MAX_STRING = 1 << 30       # GGUF_MAX_STRING_LENGTH
MAX_ARRAY = 1 << 30        # GGUF_MAX_ARRAY_ELEMENTS
MAX_TOKEN_BYTES = 16384    # a token text longer than this is corruption, not a token
# Counts far beyond any real model's (tens of keys, a few thousand tensors, a vocabulary
# or merges of a million or two), which bound the walk's time on a hostile file.
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 18
MAX_STRINGS = 1 << 24      # elements of one string array
MAX_VALUE_READ = 4096      # longer string values (a chat template) are skipped, not read
CACHE_SIZE = 1024          # outcomes Checked remembers

# ggml type id -> (name, elements per block, bytes per block), ggml.h's ggml_type as the
# llama.cpp localrt ships has them; the ids missing here (4, 5, 31-33, 36-38) are types
# ggml has removed.
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18), 42: ("Q2_0", 64, 18),
}
# Types ggml's CPU backend has no dot product or row lookup for: a weight or bias so
# typed crashes llama.cpp when the model first computes (Q8_1 and Q8_K are what ggml
# quantizes activations to, never weights).
NOT_WEIGHTS = {9, 15, 24, 25, 26, 27, 28}

# GGUF value types (gguf.h's gguf_type): id -> struct format; STRING and ARRAY apart.
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
          11: "q", 12: "d"}
_STRUCTS = {t: struct.Struct("<" + f) for t, f in _FIXED.items()}
_UINT32, _INT32, _FLOAT32, _UINT8, _INT8, _STRING, _ARRAY = 4, 5, 6, 0, 1, 8, 9
_INTEGERS = {0, 1, 2, 3, 4, 5, 10, 11}
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32",
               6: "float32", 7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64",
               12: "float64"}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_BYTE_TOKEN = 6             # llama_token_type's BYTE
_NO_VOCABULARY = ("none", "no_vocab")
# Vocabulary keys and the element types llama.cpp reads them as.
_TOKENS = "tokenizer.ggml.tokens"
_VOCAB_ARRAYS = {
    "tokenizer.ggml.scores": ((_FLOAT32, _INT32), True),   # (types, as long as the tokens)
    "tokenizer.ggml.token_type": ((_INT32,), True),
    "tokenizer.ggml.merges": ((_STRING,), False),
    "tokenizer.ggml.precompiled_charsmap": ((_UINT8, _INT8), False),
}


@dataclass(frozen=True)
class _Array:
    """A header array: its element type, its length and where its elements start."""

    etype: int
    count: int
    offset: int


@dataclass
class _Vocabulary:
    """What the walk over tokenizer.ggml.tokens found: the count and every text."""

    count: int
    texts: set


# --------------------------------------------------------------------------- public

def check(path, param: str | None = None) -> None:
    """Raise InvalidModelFile (400 invalid_model_file, naming `param`) unless the GGUF at
    `path` keeps every rule of this module; reads its header, never its tensor data.
    OSError when the file cannot be read."""
    try:
        with open(path, "rb") as f:
            _check(Reader(f, path))
    except GGUFError as exc:  # its message starts with the path
        raise InvalidModelFile(f"Invalid model file {exc}", param=param) from None


class Checked:
    """`check`'s outcomes, by a file's path, size, modification time and inode, so that
    a model's second start costs a stat, not a read of its header."""

    def __init__(self):
        self._lock = threading.Lock()  # guards _outcomes
        self._outcomes: dict[tuple, str | None] = {}  # file identity -> message, or None: good

    def check(self, path, param: str | None = None) -> None:
        """`check(path, param)`, or its outcome for the file as it is now."""
        st = os.stat(path)
        key = (os.fspath(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
        with self._lock:
            known = key in self._outcomes
            message = self._outcomes.get(key)
        if not known:
            try:
                check(path)
            except InvalidModelFile as exc:
                message = exc.message
            with self._lock:
                if len(self._outcomes) >= CACHE_SIZE:
                    self._outcomes.pop(next(iter(self._outcomes)))
                self._outcomes[key] = message
        if message is not None:
            raise InvalidModelFile(message, param=param)


# --------------------------------------------------------------------------- the walk

def _check(r: Reader) -> None:
    if r.read(4) != MAGIC:
        raise r.fail("not a GGUF file (it does not start with GGUF)")
    (version,) = r.unpack(_U32)
    if version not in (2, 3):
        raise r.fail(f"GGUF version {version}; llama.cpp reads versions 2 and 3")
    (n_tensors,) = r.unpack(_U64)
    (n_kv,) = r.unpack(_U64)
    left = r.size - r.offset
    if n_kv > MAX_KEYS:
        raise r.fail(f"{n_kv} key/values; a model has far fewer (at most {MAX_KEYS} are read)")
    if n_tensors > MAX_TENSORS:
        raise r.fail(f"{n_tensors} tensors; a model has far fewer (at most {MAX_TENSORS} "
                     f"are read)")
    if n_kv * 13 > left:  # a key/value takes at least 13 bytes: key length, type, a byte
        raise r.fail(f"{n_kv} key/values cannot fit in the {left} bytes after the header")
    if n_tensors * 24 > left:  # a tensor info at least 24: name length, dims, type, offset
        raise r.fail(f"{n_tensors} tensor infos cannot fit in the {left} bytes after "
                     f"the header")
    values, vocabulary = _read_values(r, n_kv)
    alignment = _alignment(r, values)
    _check_tensors(r, n_tensors, alignment)
    _check_limits(r, values)
    _check_vocabulary(r, values, vocabulary)


def _read_values(r: Reader, n_kv: int) -> tuple[dict, _Vocabulary | None]:
    """key -> (value type, value): a scalar's value, a short string's text (None for a
    long one, which is skipped), an _Array; and the vocabulary, checked as it streams by."""
    values, vocabulary = {}, None
    for _ in range(n_kv):
        at = r.offset
        raw = _string(r, "a key")
        key = raw.decode("utf-8", errors="replace")
        if not raw:
            raise r.fail(f"an empty key at offset {at}")
        if key in values:
            raise r.fail(f"the key {key!r} appears twice")
        (vtype,) = r.unpack(_U32)
        if vtype in _FIXED:
            (value,) = r.unpack(_STRUCTS[vtype])
        elif vtype == _STRING:
            value = _short_string(r, f"the value of {key}")
        elif vtype == _ARRAY:
            value = _array(r, key)
            if key == _TOKENS and value.etype == _STRING:
                vocabulary = _Vocabulary(value.count, _walk_tokens(r, value.count))
            else:
                _skip_elements(r, value)
        else:
            raise r.fail(f"the key {key!r} has the unknown value type {vtype}")
        values[key] = (vtype, value)
    return values, vocabulary


def _string(r: Reader, what: str) -> bytes:
    (n,) = r.unpack(_U64)
    if n > MAX_STRING or n > r.size - r.offset:
        raise r.fail(f"{what} of {n} bytes at offset {r.offset - 8} runs past the end of "
                     f"the file ({r.size} bytes)")
    return r.read(n)


def _short_string(r: Reader, what: str) -> str | None:
    """A string value's text, or None for one too long to be a name (it is skipped)."""
    (n,) = r.unpack(_U64)
    if n > MAX_STRING or n > r.size - r.offset:
        raise r.fail(f"{what} ({n} bytes at offset {r.offset - 8}) runs past the end of "
                     f"the file ({r.size} bytes)")
    if n > MAX_VALUE_READ:
        r.skip(n)
        return None
    return r.read(n).decode("utf-8", errors="replace")


def _array(r: Reader, key: str) -> _Array:
    (etype,) = r.unpack(_U32)
    (count,) = r.unpack(_U64)
    if etype == _ARRAY:
        raise r.fail(f"the key {key!r} holds arrays of arrays, which llama.cpp cannot read")
    if etype not in _FIXED and etype != _STRING:
        raise r.fail(f"the array {key!r} has the unknown element type {etype}")
    least = count * (_STRUCTS[etype].size if etype in _FIXED else 8)
    if count > MAX_ARRAY or least > r.size - r.offset:
        raise r.fail(f"the array {key!r} of {count} elements runs past the end of the "
                     f"file ({r.size} bytes)")
    if etype == _STRING and count > MAX_STRINGS:
        raise r.fail(f"the array {key!r} holds {count} strings; a model's hold far fewer "
                     f"(at most {MAX_STRINGS} are read)")
    return _Array(etype, count, r.offset)


def _skip_elements(r: Reader, array: _Array) -> None:
    if array.etype in _FIXED:
        r.skip(array.count * _STRUCTS[array.etype].size)
    else:  # each length is checked against the file's end
        r.skip_strings(array.count)


def _walk_tokens(r: Reader, count: int) -> set:
    """The token texts, each checked: at most MAX_TOKEN_BYTES, valid UTF-8, unique (but
    for empty ones, which llama.cpp names apart). A buffer's worth at a time: one set
    of them and one decode of them all, joined by a NUL, which leaves any sequence a
    token does not finish unfinished; a batch that fails is walked token by token."""
    texts, index = set(), 0
    for batch in r.strings(count, MAX_TOKEN_BYTES):
        fresh = set(batch)
        if len(fresh) == len(batch) and texts.isdisjoint(fresh) \
                and _utf8(b"\0".join(batch)):
            texts |= fresh
            index += len(batch)
            continue
        for raw in batch:
            if raw and raw in texts:
                raise r.fail(f"the vocabulary holds the token {_shown(raw)} twice (the "
                             f"second time as token {index}); llama.cpp aborts on such a "
                             f"vocabulary")
            if not _utf8(raw):
                raise r.fail(f"token {index} of the vocabulary, {_shown(raw)}, is not "
                             f"valid UTF-8")
            texts.add(raw)
            index += 1
    return texts


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _shown(raw: bytes) -> str:
    """A token's text for a message: quoted, and cut short."""
    text = raw.decode("utf-8", errors="backslashreplace")
    return repr(text if len(text) <= 40 else text[:40] + "...")


def _alignment(r: Reader, values: dict) -> int:
    if "general.alignment" not in values:
        return DEFAULT_ALIGNMENT
    vtype, value = values["general.alignment"]
    if vtype != _UINT32:
        raise r.fail(f"general.alignment is a {_TYPE_NAMES.get(vtype)}; llama.cpp reads "
                     f"it as a uint32")
    if value <= 0 or value & (value - 1):
        raise r.fail(f"general.alignment {value} is not a power of two")
    if value < TENSOR_ALIGNMENT:
        raise r.fail(f"general.alignment {value} is below {TENSOR_ALIGNMENT}, the "
                     f"alignment ggml needs of the tensor data it maps from the file "
                     f"(llama.cpp aborts on it)")
    return value


def _check_tensors(r: Reader, n_tensors: int, alignment: int) -> None:
    """The tensor table: names, shapes and types, then the data layout."""
    infos, names = [], set()
    for _ in range(n_tensors):
        raw = _string(r, "a tensor name")
        name = raw.decode("utf-8", errors="replace")
        if len(raw) >= MAX_NAME:
            raise r.fail(f"the tensor name {_shown(raw)} is {len(raw)} bytes; llama.cpp "
                         f"takes at most {MAX_NAME - 1}")
        if raw in names:
            raise r.fail(f"the tensor {name!r} appears twice")
        names.add(raw)
        (n_dims,) = r.unpack(_U32)
        if n_dims > MAX_DIMS:
            raise r.fail(f"the tensor {name!r} has {n_dims} dimensions; ggml has at most "
                         f"{MAX_DIMS}")
        dims = [r.unpack(_U64)[0] for _ in range(n_dims)]
        (ttype,) = r.unpack(_U32)
        (offset,) = r.unpack(_U64)
        infos.append((name, dims, ttype, offset))
    data_start = -(-r.offset // alignment) * alignment if n_tensors else r.offset
    if data_start > r.size:
        raise r.fail(f"the tensor data would start at offset {data_start}, past the end "
                     f"of the file ({r.size} bytes)")
    expected, before = 0, None
    for name, dims, ttype, offset in infos:
        nbytes = _nbytes(r, name, dims, ttype)
        if offset % alignment:
            raise r.fail(f"the tensor {name!r} starts at data offset {offset}, which is "
                         f"not a multiple of the alignment {alignment}")
        if offset < expected:
            raise r.fail(f"the tensor {name!r} at data offset {offset} overlaps the tensor "
                         f"{before!r} before it, whose data runs to offset {expected}")
        if offset > expected:
            raise r.fail(f"the tensor {name!r} starts at data offset {offset}, not at "
                         f"{expected} where the tensor before it ends; llama.cpp reads "
                         f"tensors laid out one after the other")
        end = data_start + offset + nbytes
        if end > r.size:
            raise r.fail(f"the tensor {name!r} ({nbytes} bytes at offset "
                         f"{data_start + offset}) runs past the end of the file "
                         f"({r.size} bytes)")
        if ttype in NOT_WEIGHTS and name.endswith((".weight", ".bias")):
            raise r.fail(f"the tensor {name!r} is typed {GGML_TYPES[ttype][0]}, which "
                         f"llama.cpp cannot compute with (it crashes at the first decode)")
        expected = offset + -(-nbytes // alignment) * alignment
        before = name


def _nbytes(r: Reader, name: str, dims: list, ttype: int) -> int:
    """A tensor's bytes, once its type is known and its shape fits it."""
    try:
        return tensor_nbytes(name, dims, ttype)
    except ValueError as exc:
        raise r.fail(str(exc)) from None


def tensor_nbytes(name: str, dims: list, ttype: int) -> int:
    """The bytes of the data of tensor `name` of shape `dims` and ggml type `ttype` (its
    type's block size times its blocks): the one count of them, which the checks here and
    localrt.engines.memory's estimate share. ValueError naming the tensor for a type this
    llama.cpp does not know or a shape the type cannot hold."""
    if ttype not in GGML_TYPES:
        raise ValueError(f"the tensor {name!r} has the ggml type {ttype}, which this "
                         f"llama.cpp does not know")
    type_name, block, size = GGML_TYPES[ttype]
    elements = 1
    for d in dims:
        elements *= d
    if elements >= 1 << 63 or any(d >= 1 << 63 for d in dims):
        raise ValueError(f"the tensor {name!r} has the shape {dims}, of more elements "
                         f"than ggml can count")
    if dims and dims[0] % block:
        raise ValueError(f"the tensor {name!r} is typed {type_name}, whose blocks hold "
                         f"{block} elements, but its rows hold {dims[0]}")
    return elements // block * size


def _check_limits(r: Reader, values: dict) -> None:
    """The counts llama.cpp asserts on as it reads the hyperparameters."""
    _, arch = values.get("general.architecture", (None, None))
    if not isinstance(arch, str):
        return

    def number(name):  # llama.cpp reads these as uint32; another type it refuses itself
        vtype, value = values.get(f"{arch}.{name}", (None, None))
        return value if vtype in _INTEGERS else None

    layers = number("block_count")
    if layers is not None and not 1 <= layers <= MAX_LAYERS:
        raise r.fail(f"{arch}.block_count is {layers}; llama.cpp takes 1 to {MAX_LAYERS} "
                     f"layers (LLAMA_MAX_LAYERS)")
    for name in ("nextn_predict_layers", "posnet.block_count", "convnext.block_count"):
        n = number(name)
        if n is not None and layers is not None and n > layers:
            raise r.fail(f"{arch}.{name} is {n}, more than the model's {layers} layers "
                         f"({arch}.block_count)")
    experts, used = number("expert_count") or 0, number("expert_used_count") or 0
    groups, groups_used = number("expert_group_count") or 0, \
        number("expert_group_used_count") or 0
    if experts > MAX_EXPERTS:
        raise r.fail(f"{arch}.expert_count is {experts}; llama.cpp takes at most "
                     f"{MAX_EXPERTS} experts (LLAMA_MAX_EXPERTS)")
    if experts == 0 and (used or groups):
        what = "expert_used_count" if used else "expert_group_count"
        raise r.fail(f"{arch}.{what} is {used or groups} but the model has no experts "
                     f"({arch}.expert_count is missing or 0)")
    if experts and not 0 < used <= experts:
        raise r.fail(f"{arch}.expert_used_count is {used}; a model with {experts} experts "
                     f"({arch}.expert_count) uses 1 to {experts} of them")
    if experts and groups and (groups >= experts or (groups > 1 and (
            experts % groups or not 0 < groups_used < groups))):
        raise r.fail(f"{arch}.expert_group_count {groups} (used: {groups_used}) does not "
                     f"divide the model's {experts} experts into groups llama.cpp can use")


def _check_vocabulary(r: Reader, values: dict, vocabulary: _Vocabulary | None) -> None:
    _, model = values.get("tokenizer.ggml.model", (None, None))
    if model in _NO_VOCABULARY:
        raise r.fail(f"the model has no vocabulary (tokenizer.ggml.model is {model!r}), "
                     f"so no text can be tokenized for it (llama.cpp aborts)")
    if _TOKENS in values and vocabulary is None:
        vtype, value = values[_TOKENS]
        kind = _TYPE_NAMES[value.etype] if vtype == _ARRAY else _TYPE_NAMES.get(vtype)
        raise r.fail(f"{_TOKENS} is an array of {kind}, not of strings")
    count = vocabulary.count if vocabulary else 0
    for key, (etypes, as_long) in _VOCAB_ARRAYS.items():
        if key not in values:
            continue
        vtype, value = values[key]
        if vtype != _ARRAY or value.etype not in etypes:
            kind = _TYPE_NAMES[value.etype] if vtype == _ARRAY else _TYPE_NAMES.get(vtype)
            wanted = " or ".join(_TYPE_NAMES[t] for t in etypes)
            raise r.fail(f"{key} is {'an array of ' if vtype == _ARRAY else 'a '}{kind}; "
                         f"llama.cpp reads an array of {wanted}")
        if as_long and value.count < count:
            raise r.fail(f"{key} has {value.count} entries for the {count} tokens of the "
                         f"vocabulary")
    if "tokenizer.ggml.precompiled_charsmap" in values:
        _check_charsmap(r, values["tokenizer.ggml.precompiled_charsmap"][1])
    if vocabulary is None or not isinstance(model, str):
        return
    texts = vocabulary.texts
    if model == "llama":
        for b in range(256):
            if f"<0x{b:02X}>".encode() not in texts and not (b < 0x80 and bytes([b]) in texts):
                raise r.fail(f"tokenizer.ggml.model is 'llama' (SentencePiece), but the "
                             f"vocabulary lacks the byte token <0x{b:02X}> that SentencePiece "
                             f"falls back to (llama.cpp aborts when a text needs it)")
    elif model == "bert":
        byte = _first_byte_token(r, values, count)
        if byte is not None:
            raise r.fail(f"tokenizer.ggml.model is 'bert' (WordPiece), but the vocabulary "
                         f"is SentencePiece's: token {byte} is a byte token, which "
                         f"WordPiece cannot decode (llama.cpp aborts)")
    elif model == "rwkv" and b"\\n" not in texts and b"\n" not in texts:
        raise r.fail("tokenizer.ggml.model is 'rwkv', but the vocabulary has no newline "
                     "token, as an RWKV vocabulary has (llama.cpp aborts)")


def _first_byte_token(r: Reader, values: dict, count: int) -> int | None:
    """The id of the first token typed BYTE (tokenizer.ggml.token_type), or None."""
    if "tokenizer.ggml.token_type" not in values or not count:
        return None
    array = values["tokenizer.ggml.token_type"][1]
    types = r.read_at(array.offset, count * 4)
    pattern = struct.pack("<i", _BYTE_TOKEN)
    at = types.find(pattern)
    while at != -1 and at % 4:  # a match across two entries is no entry's value
        at = types.find(pattern, at + 1)
    return None if at == -1 else at // 4


def _check_charsmap(r: Reader, array) -> None:
    """A T5 (UGM) vocabulary's precompiled charsmap starts with the size of its first
    part, which llama.cpp trusts."""
    if array.count < 4:
        raise r.fail(f"tokenizer.ggml.precompiled_charsmap has {array.count} bytes, too few "
                     f"to hold its own size")
    (blob,) = _U32.unpack(r.read_at(array.offset, 4))
    if blob + 4 >= array.count:
        raise r.fail(f"tokenizer.ggml.precompiled_charsmap says it holds {blob} bytes but "
                     f"has {array.count - 4}")
