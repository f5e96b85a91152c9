"""Taking a GGUF apart and writing it back changed: the mutants the header checks
(localrt.engines.ggufcheck) are tested on.

`read(path)` gives a `Doc`: its key/values in file order (each with its GGUF value type
and, for an array, its element type), its tensor infos and its data section. Change
any of them and `write(doc, path)` writes the file byte for byte as given: offsets,
counts and types are written as they are in the Doc, so a test can make a file whose
header lies. `relayout(doc)` recomputes the offsets and pads the data the way the
gguf package writes them, for a change (a tensor's type or shape) that should give
a well-formed file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

# GGUF value types (the GGUF spec; gguf.GGUFValueType)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY = range(10)
UINT64, INT64, FLOAT64 = 10, 11, 12
FORMATS = {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i",
           FLOAT32: "f", BOOL: "?", UINT64: "Q", INT64: "q", FLOAT64: "d"}
# ggml tensor types the tests use: (id, block size, bytes per block)
F32, F16, I32 = (0, 1, 4), (1, 1, 2), (26, 1, 4)


@dataclass
class KV:
    """One key/value: `vtype` a GGUF value type; an array's `etype` is its elements'."""

    vtype: int
    value: object
    etype: int | None = None


@dataclass
class Tensor:
    """One tensor info: dimensions in ggml order (ne[0] first), ggml type id, offset."""

    name: str
    dims: list
    type: int
    offset: int


@dataclass
class Doc:
    """A GGUF file taken apart."""

    version: int
    kv: dict = field(default_factory=dict)          # key -> KV, in file order
    tensors: list = field(default_factory=list)     # Tensor, in file order
    data: bytes = b""                               # the data section
    tensor_count: int | None = None                 # None: len(tensors)
    kv_count: int | None = None                     # None: len(kv)

    @property
    def alignment(self) -> int:
        kv = self.kv.get("general.alignment")
        return kv.value if kv is not None and isinstance(kv.value, int) and kv.value > 0 \
            else 32


def read(path) -> Doc:
    """Take the GGUF at `path` apart."""
    data = Path(path).read_bytes()
    pos = 0

    def take(fmt):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string():
        nonlocal pos
        n = take("Q")
        raw = data[pos:pos + n]
        pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def value(vtype):
        if vtype == STRING:
            return string()
        return take(FORMATS[vtype])

    assert data[:4] == b"GGUF"
    pos = 4
    doc = Doc(take("I"))
    n_tensors, n_kv = take("Q"), take("Q")
    for _ in range(n_kv):
        key = string()
        vtype = take("I")
        if vtype == ARRAY:
            etype, count = take("I"), take("Q")
            doc.kv[key] = KV(ARRAY, [value(etype) for _ in range(count)], etype)
        else:
            doc.kv[key] = KV(vtype, value(vtype))
    for _ in range(n_tensors):
        name = string()
        n_dims = take("I")
        dims = [take("Q") for _ in range(n_dims)]
        doc.tensors.append(Tensor(name, dims, take("I"), take("Q")))
    start = -(-pos // doc.alignment) * doc.alignment
    doc.data = data[start:]
    return doc


def encode(doc: Doc) -> bytes:
    """The file's bytes."""
    out = bytearray(b"GGUF")
    out += struct.pack("<IQQ", doc.version,
                       len(doc.tensors) if doc.tensor_count is None else doc.tensor_count,
                       len(doc.kv) if doc.kv_count is None else doc.kv_count)

    def string(text):
        raw = text if isinstance(text, bytes) else text.encode("utf-8", errors="surrogateescape")
        out.extend(struct.pack("<Q", len(raw)) + raw)

    def value(vtype, v):
        if vtype == STRING:
            string(v)
        else:
            out.extend(struct.pack("<" + FORMATS[vtype], v))

    for key, kv in doc.kv.items():
        string(key)
        out.extend(struct.pack("<I", kv.vtype))
        if kv.vtype == ARRAY:
            out.extend(struct.pack("<IQ", kv.etype, len(kv.value)))
            for v in kv.value:
                value(kv.etype, v)
        else:
            value(kv.vtype, kv.value)
    for t in doc.tensors:
        string(t.name)
        out.extend(struct.pack("<I", len(t.dims)))
        for d in t.dims:
            out.extend(struct.pack("<Q", d))
        out.extend(struct.pack("<IQ", t.type, t.offset))
    pad = -len(out) % doc.alignment if doc.tensors else 0
    return bytes(out) + bytes(pad) + doc.data


def write(doc: Doc, path) -> Path:
    """Write `doc` to `path`, as it is; the Path."""
    path = Path(path)
    path.write_bytes(encode(doc))
    return path


def nbytes(dims, block: int, size: int) -> int:
    """A tensor's bytes: its elements over its type's block size, times the block's bytes."""
    n = 1
    for d in dims:
        n *= d
    return n // block * size


def relayout(doc: Doc, sizes: dict | None = None) -> Doc:
    """`doc` with offsets recomputed in table order, each tensor's data padded to the
    alignment (as the gguf package writes); `sizes` maps a tensor's name to its new
    byte size (its data is then zeros), else its old bytes are kept."""
    sizes = sizes or {}
    old = sorted(doc.tensors, key=lambda t: t.offset)
    ends = {t.name: (old[i + 1].offset if i + 1 < len(old) else len(doc.data))
            for i, t in enumerate(old)}
    data = bytearray()
    for t in doc.tensors:
        if t.name in sizes:
            chunk = bytes(sizes[t.name])
        else:
            chunk = doc.data[t.offset:ends[t.name]]
        t.offset = len(data)
        data += chunk
        data += bytes(-len(data) % doc.alignment)
    doc.data = bytes(data)
    return doc
