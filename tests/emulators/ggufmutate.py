"""Test support: hostile GGUF files, mutated from the tiny generated models.

Not a test module. tests/bench/model_fuzz.py (and tests/test_model_fuzz.py, a short run
of it) feed what `mutants` yields to a running localrt, which must refuse or load each
one without dying (issue 38).

A GGUF is read here into a `Gguf`: its version, its key/values in order (strings kept as
bytes, so a mutant can hold text that is not UTF-8) and its tensors, each with its own
data. `Gguf.write()` lays it out again, as llama.cpp's writers do (tensor infos, then
padding to the alignment, then each tensor's data at an aligned offset), and returns,
beside the bytes, every numeric field it wrote (`Field`: where, how wide, what it is) and
where each region lies, so that a mutation can change one field or cut the file inside
one region and leave everything else as a real writer would have.

The mutations (`KINDS`), each a function of a random generator and a base model:

- header: the version, the tensor count or the key/value count, set to a value that is
  interesting for its width (0, 1, one off, the top bits, all ones);
- kv_type: a key/value's type id, or an array's element type, changed;
- length: a string's length or an array's count changed in place;
- tensor_table: a tensor's number of dimensions, a dimension, its type or its name's
  length changed in place;
- offset: a tensor's data offset moved (by one, to another tensor's, past the end);
- truncate: the file cut at a random point inside one region (header, key/values,
  tensor infos, padding, data);
- bytes: a few random bytes of the header, key/values or tensor infos flipped;
- vocab: the vocabulary's arrays made wrong as a whole file would be (duplicate texts,
  an empty text, emptied or missing byte tokens, text that is not UTF-8, a huge text,
  arrays of different lengths, odd token types and scores, special token ids out of
  range, another tokenizer model);
- merges: a BPE vocabulary's merges made wrong (missing, empty, naming unknown
  pieces, malformed);
- hparams: the hyperparameters made wrong (layer counts, experts, alignment with the
  layout redone for it, context and embedding lengths, head counts, the architecture);
- tensors: the tensor table made wrong consistently (a tensor dropped or named twice,
  a shape changed with its data, a weight typed I32, I8 or an unknown type with data of
  the size that type needs, so the header alone is perfect);
- template: the chat template made hostile (endless loops, huge output, Python's
  internals, broken syntax, deep recursion, huge arithmetic) or cut.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, replace

import gguf

__all__ = ["Gguf", "KINDS", "Mutant", "bpe_model", "mutants", "read"]

ALIGNMENT = 32  # GGUF's default general.alignment
_STRING, _ARRAY = 8, 9
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
          12: "d"}


@dataclass
class KV:
    """One key/value: `etype` is an array's element type (None otherwise); strings are
    bytes; an array's value is a list."""

    key: str
    vtype: int
    value: object
    etype: int | None = None


@dataclass
class Tensor:
    """One tensor: its name, ggml dimensions (innermost first), type and data bytes."""

    name: bytes
    dims: list
    ttype: int
    data: bytes


@dataclass
class Field:
    """A numeric field `write` wrote: at `offset`, `width` bytes, of kind `kind`."""

    offset: int
    width: int
    kind: str
    value: int


@dataclass
class Gguf:
    """A GGUF file's parts, which `write` lays out again."""

    version: int
    kvs: list
    tensors: list

    def get(self, key: str):
        """The value of `key`, or None."""
        return next((kv.value for kv in self.kvs if kv.key == key), None)

    def kv(self, key: str) -> KV | None:
        """The key/value named `key`, or None."""
        return next((kv for kv in self.kvs if kv.key == key), None)

    def set(self, key: str, vtype: int, value, etype: int | None = None) -> None:
        """Set `key` (in place, or added at the end)."""
        found = self.kv(key)
        if found is None:
            self.kvs.append(KV(key, vtype, value, etype))
        else:
            found.vtype, found.value, found.etype = vtype, value, etype

    def drop(self, key: str) -> None:
        """Remove `key` if it is there."""
        self.kvs = [kv for kv in self.kvs if kv.key != key]

    def copy(self) -> "Gguf":
        """A copy whose lists can be changed without changing this one."""
        return Gguf(self.version,
                    [replace(kv, value=list(kv.value) if isinstance(kv.value, list)
                             else kv.value) for kv in self.kvs],
                    [replace(t, dims=list(t.dims)) for t in self.tensors])

    def alignment(self) -> int:
        """The alignment the layout uses: general.alignment when it is a usable u32."""
        value = self.get("general.alignment")
        return value if isinstance(value, int) and 0 < value < (1 << 20) else ALIGNMENT

    def write(self) -> tuple[bytes, list, dict]:
        """(the file's bytes, its numeric Fields, {region: (start, end)})."""
        out = bytearray()
        fields: list[Field] = []
        regions: dict[str, tuple[int, int]] = {}

        def num(fmt: str, value, kind: str) -> None:
            size = struct.calcsize("<" + fmt)
            if fmt in "BHIQ":
                fields.append(Field(len(out), size, kind, int(value)))
            out.extend(struct.pack("<" + fmt, value))

        def string(raw: bytes, kind: str = "length") -> None:
            num("Q", len(raw), kind)
            out.extend(raw)

        def value(vtype: int, v, etype) -> None:
            if vtype == _STRING:
                string(v)
            elif vtype == _ARRAY:
                num("I", etype, "etype")
                num("Q", len(v), "count")
                for item in v:
                    value(etype, item, None)
            else:
                out.extend(struct.pack("<" + _FIXED[vtype], v))

        out.extend(b"GGUF")
        num("I", self.version, "version")
        num("Q", len(self.tensors), "tensor_count")
        num("Q", len(self.kvs), "kv_count")
        regions["header"] = (0, len(out))
        for kv in self.kvs:
            string(kv.key.encode(), "key_length")
            num("I", kv.vtype, "vtype")
            value(kv.vtype, kv.value, kv.etype)
        regions["kv"] = (regions["header"][1], len(out))
        align = self.alignment()
        offsets, at = [], 0
        for t in self.tensors:
            offsets.append(at)
            at += -(-len(t.data) // align) * align
        for t, offset in zip(self.tensors, offsets):
            string(t.name, "name_length")
            num("I", len(t.dims), "n_dims")
            for d in t.dims:
                num("Q", d, "dim")
            num("I", t.ttype, "ttype")
            num("Q", offset, "offset")
        regions["tensors"] = (regions["kv"][1], len(out))
        out.extend(b"\0" * (-len(out) % align))
        regions["padding"] = (regions["tensors"][1], len(out))
        start = len(out)
        for t, offset in zip(self.tensors, offsets):
            out.extend(b"\0" * (start + offset - len(out)))
            out.extend(t.data)
        regions["data"] = (start, len(out))
        return bytes(out), fields, regions


def read(path) -> Gguf:
    """The parts of a well-formed GGUF file (one the generators wrote)."""
    raw = open(path, "rb").read()
    at = 4

    def take(fmt: str):
        nonlocal at
        (v,) = struct.unpack_from("<" + fmt, raw, at)
        at += struct.calcsize("<" + fmt)
        return v

    def string() -> bytes:
        nonlocal at
        n = take("Q")
        at += n
        return raw[at - n:at]

    def value(vtype: int):
        if vtype == _STRING:
            return string(), None
        if vtype == _ARRAY:
            etype, count = take("I"), take("Q")
            return [value(etype)[0] for _ in range(count)], etype
        return take(_FIXED[vtype]), None

    version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
    kvs = []
    for _ in range(n_kv):
        key = string().decode()
        vtype = take("I")
        v, etype = value(vtype)
        kvs.append(KV(key, vtype, v, etype))
    model = Gguf(version, kvs, [])
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        infos.append((name, dims, take("I"), take("Q")))
    start = at + (-at % model.alignment())
    for name, dims, ttype, offset in infos:
        size = _nbytes(ttype, dims)
        model.tensors.append(Tensor(name, dims, ttype, raw[start + offset:start + offset + size]))
    return model


def _nbytes(ttype: int, dims: list) -> int:
    """The bytes a tensor of this type and shape takes, as ggml counts them."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
    elements = 1
    for d in dims:
        elements *= d
    return elements // block * size


@dataclass
class Mutant:
    """One hostile file: its bytes, the kind of mutation and what it did."""

    kind: str
    what: str
    data: bytes
    base: str = ""


# --- field-level mutations (one number changed where it lies) ------------------

def _interesting(rng: random.Random, width: int, value: int) -> int:
    top = (1 << (8 * width)) - 1
    picks = [0, 1, 2, 7, 8, 9, 16, 31, 32, 255, 256, 0xFFFF, 0x7FFFFFFF, 0x80000000,
             0xFFFFFFFF, 1 << 32, (1 << 62), (1 << 63) - 1, 1 << 63, top,
             value - 1, value + 1, value * 2, value + 4096, value // 2]
    return rng.choice([p for p in picks if 0 <= p <= top and p != value] or [0])


def _set_field(data: bytes, f: Field, v: int) -> bytes:
    fmt = {1: "B", 2: "H", 4: "I", 8: "Q"}[f.width]
    return data[:f.offset] + struct.pack("<" + fmt, v) + data[f.offset + f.width:]


def _field_mutation(kinds: tuple[str, ...], label: str):
    def mutate(rng: random.Random, model: Gguf) -> tuple[str, bytes]:
        data, fields, _ = model.write()
        chosen = rng.choice([f for f in fields if f.kind in kinds])
        v = _interesting(rng, chosen.width, chosen.value)
        return f"{label}: {chosen.kind} at byte {chosen.offset} {chosen.value} -> {v}", \
            _set_field(data, chosen, v)
    return mutate


def _kv_type(rng: random.Random, model: Gguf) -> tuple[str, bytes]:
    data, fields, _ = model.write()
    chosen = rng.choice([f for f in fields if f.kind in ("vtype", "etype")])
    v = rng.choice([t for t in [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 99, 0xFFFFFFFF]
                    if t != chosen.value])
    return f"{chosen.kind} at byte {chosen.offset} {chosen.value} -> {v}", \
        _set_field(data, chosen, v)


def _offset(rng: random.Random, model: Gguf) -> tuple[str, bytes]:
    data, fields, regions = model.write()
    offsets = [f for f in fields if f.kind == "offset"]
    chosen = rng.choice(offsets)
    others = [f.value for f in offsets if f is not chosen]
    size = regions["data"][1] - regions["data"][0]
    v = rng.choice([chosen.value + 1, chosen.value + 16, max(chosen.value - 32, 0),
                    rng.choice(others) if others else 0, size, size + 32, size - 32,
                    (1 << 63), (1 << 64) - 32])
    v = max(0, min(v, (1 << 64) - 1))
    return f"offset at byte {chosen.offset} {chosen.value} -> {v}", _set_field(data, chosen, v)


def _truncate(rng: random.Random, model: Gguf) -> tuple[str, bytes]:
    data, _, regions = model.write()
    name = rng.choice([r for r, (a, b) in regions.items() if b > a])
    a, b = regions[name]
    cut = rng.randrange(a, b)
    return f"cut in {name} at byte {cut} of {len(data)}", data[:cut]


def _bytes(rng: random.Random, model: Gguf) -> tuple[str, bytes]:
    data, _, regions = model.write()
    end = regions["tensors"][1]
    out = bytearray(data)
    spots = sorted(rng.randrange(4, end) for _ in range(rng.randint(1, 8)))
    for spot in spots:
        out[spot] = rng.randrange(256)
    return f"bytes flipped at {spots}", bytes(out)


# --- whole-file mutations (the file is laid out again, consistently) -------------

def _tokens(model: Gguf) -> list:
    return model.kv("tokenizer.ggml.tokens").value


def _vocab(rng: random.Random, model: Gguf) -> tuple[str, bytes]:
    m = model.copy()
    tokens = _tokens(m)
    n = len(tokens)
    byte_ids = [i for i, t in enumerate(tokens) if t.startswith(b"<0x") and len(t) == 6]
    choice = rng.randrange(14)
    if choice == 0:
        i, j = rng.sample(range(n), 2)
        tokens[j] = tokens[i]
        what = f"token {j} duplicates token {i}"
    elif choice == 1:
        i = rng.randrange(n)
        tokens[i] = b""
        what = f"token {i} empty"
    elif choice == 2 and byte_ids:
        for i in byte_ids:
            tokens[i] = b""
        what = "byte tokens emptied"
    elif choice == 3 and byte_ids:
        i = rng.choice(byte_ids)
        tokens[i] = b"<not-a-byte>"
        what = f"byte token {i} renamed"
    elif choice == 4:
        i = rng.randrange(n)
        tokens[i] = rng.choice([b"\xff\xfe", b"a\xc3", b"\xed\xa0\x80", b"\x00"])
        what = f"token {i} not UTF-8 / NUL"
    elif choice == 5:
        i = rng.randrange(n)
        tokens[i] = b"a" * rng.choice([1 << 16, 1 << 20])
        what = f"token {i} huge"
    elif choice == 6:
        key = rng.choice(["tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                          "tokenizer.ggml.token_type"])
        arr = m.kv(key)
        if arr is not None:
            arr.value = arr.value[:-rng.choice([1, 10])] if rng.random() < 0.5 \
                else arr.value + arr.value[:5]
        what = f"{key} of another length"
    elif choice == 7:
        types = m.kv("tokenizer.ggml.token_type")
        if types is not None:
            i = rng.randrange(len(types.value))
            types.value[i] = rng.choice([0, 6, 7, 99, -1])
        what = "odd token type"
    elif choice == 8:
        types = m.kv("tokenizer.ggml.token_type")
        if types is not None:
            types.value = [3] * len(types.value)
        what = "every token a control token"
    elif choice == 9:
        scores = m.kv("tokenizer.ggml.scores")
        if scores is not None:
            i = rng.randrange(len(scores.value))
            scores.value[i] = rng.choice([float("nan"), float("inf"), -float("inf"), 1e38])
        what = "odd score"
    elif choice == 10:
        key = rng.choice(["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                          "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id"])
        v = rng.choice([n, n + 1, 0x7FFFFFFF, 0xFFFFFFFF])
        m.set(key, 4, v)
        what = f"{key} = {v}"
    elif choice == 11:
        name = rng.choice([b"bert", b"gpt2", b"t5", b"rwkv", b"plamo2", b"nonesuch", b""])
        m.set("tokenizer.ggml.model", _STRING, name)
        what = f"tokenizer model {name!r}"
    elif choice == 12:
        m.drop("tokenizer.ggml.tokens")
        what = "no tokens"
    else:
        m.set("tokenizer.ggml.pre", _STRING, rng.choice([b"nonesuch", b"", b"qwen2", b"llama-bpe"]))
        what = "odd pre-tokenizer"
    return f"vocab: {what}", m.write()[0]


def _merges(rng: random.Random, model: Gguf) -> tuple[str, bytes]:
    m = model.copy()
    merges = m.kv("tokenizer.ggml.merges")
    if merges is None:  # an SPM vocabulary: give it merges it does not use
        m.set("tokenizer.ggml.merges", _ARRAY, [b"a b", b"\xff x", b"nospace"], _STRING)
        return "merges: added to an SPM vocabulary", m.write()[0]
    choice = rng.randrange(6)
    if choice == 0:
        m.drop("tokenizer.ggml.merges")
        what = "missing"
    elif choice == 1:
        merges.value = []
        what = "empty"
    elif choice == 2:
        i = rng.randrange(len(merges.value))
        merges.value[i] = rng.choice([b"nospace", b"", b" ", b"a  b", b"\xff \xfe"])
        what = f"merge {i} malformed"
    elif choice == 3:
        i = rng.randrange(len(merges.value))
        merges.value[i] = b"zzzzq qqqqz"
        what = f"merge {i} names unknown pieces"
    elif choice == 4:
        merges.value = merges.value + merges.value
        what = "merges twice"
    else:
        merges.vtype, merges.value, merges.etype = 4, 7, None
        what = "merges not an array"
    return f"merges: {what}", m.write()[0]


def _hparams(rng: random.Random, model: Gguf) -> tuple[str, bytes]:
    m = model.copy()
    arch = m.get("general.architecture").decode()
    choice = rng.randrange(11)
    if choice == 0:
        v = rng.choice([0, 513, 1000, 1 << 31, 0xFFFFFFFF])
        m.set(f"{arch}.block_count", 4, v)
        what = f"block_count {v}"
    elif choice == 1:
        m.set(f"{arch}.expert_used_count", 4, rng.choice([1, 2, 8]))
        if rng.random() < 0.5:
            m.set(f"{arch}.expert_count", 4, 0)
        what = "expert_used_count without enough experts"
    elif choice == 2:
        v = rng.choice([0, 1, 3, 16, 64, 100, 1 << 12])
        m.set("general.alignment", 4, v)
        what = f"alignment {v}"
    elif choice == 3:
        v = rng.choice([0, 1, 1 << 31, 0xFFFFFFFF])
        m.set(f"{arch}.context_length", 4, v)
        what = f"context_length {v}"
    elif choice == 4:
        v = rng.choice([0, 1, 65, 128, 1 << 20])
        m.set(f"{arch}.embedding_length", 4, v)
        what = f"embedding_length {v}"
    elif choice == 5:
        key = rng.choice([f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv"])
        v = rng.choice([0, 3, 5, 1 << 16])
        m.set(key, 4, v)
        what = f"{key} {v}"
    elif choice == 6:
        v = rng.choice([0, 1 << 20, 3])
        m.set(f"{arch}.rope.dimension_count", 4, v)
        what = f"rope dimensions {v}"
    elif choice == 7:
        v = rng.choice([float("nan"), -1.0, 0.0, float("inf")])
        m.set(f"{arch}.attention.layer_norm_rms_epsilon", 6, v)
        what = f"rms epsilon {v}"
    elif choice == 8:
        name = rng.choice([b"bert", b"gpt2", b"qwen3moe", b"nonesuch", b"", b"llama\x00x"])
        m.set("general.architecture", _STRING, name)
        what = f"architecture {name!r}"
    elif choice == 9:
        key = rng.choice([k.key for k in m.kvs if k.key.startswith(arch + ".")])
        m.drop(key)
        what = f"{key} missing"
    else:
        key = rng.choice([k.key for k in m.kvs if k.vtype == 4])
        kv = m.kv(key)
        kv.vtype, kv.value = rng.choice([(_STRING, b"12"), (6, 1.5), (7, True), (11, -1)])
        what = f"{key} of another type"
    return f"hparams: {what}", m.write()[0]


def _tensors(rng: random.Random, model: Gguf) -> tuple[str, bytes]:
    m = model.copy()
    i = rng.randrange(len(m.tensors))
    t = m.tensors[i]
    name = t.name.decode()
    choice = rng.randrange(7)
    if choice == 0:
        del m.tensors[i]
        what = f"{name} dropped"
    elif choice == 1:
        j = rng.choice([k for k in range(len(m.tensors)) if k != i])
        m.tensors[j].name = t.name
        what = f"{name} named twice"
    elif choice == 2 and len(t.dims) > 1:
        t.dims = list(reversed(t.dims))
        what = f"{name} transposed"
    elif choice in (2, 3):
        d = rng.randrange(len(t.dims))
        t.dims[d] = rng.choice([t.dims[d] * 2, max(t.dims[d] // 2, 1), 0])
        t.data = t.data[:_nbytes(t.ttype, t.dims)].ljust(_nbytes(t.ttype, t.dims), b"\0")
        what = f"{name} shape {t.dims}"
    elif choice == 4:
        t.dims = t.dims + [1] * rng.choice([1, 3])
        what = f"{name} with {len(t.dims)} dimensions"
    else:
        ttype = rng.choice([24, 25, 26, 27, 28, 1, 30, 99] if choice == 5 else [26])
        t.ttype = ttype
        try:
            size = _nbytes(ttype, t.dims)
        except (ValueError, KeyError):  # an unknown type: keep the data as it is
            size = len(t.data)
        t.data = t.data[:size].ljust(size, b"\0")
        what = f"{name} typed {ttype}"
    return f"tensors: {what}", m.write()[0]


HOSTILE_TEMPLATES = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'x' * 1000000000 }}",
    "{% for m in messages %}{{ m.content * 100000000 }}{% endfor %}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{% for %}",
    "{% for m in messages %}{{ m.content }}",
    "{{ messages | nosuchfilter }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ 10 ** 10 ** 10 }}",
    "{{ messages[99].content.x.y }}",
    "{% set x = namespace(a=[]) %}{% for i in range(100000) %}{% set _ = x.a.append(x.a) %}{% endfor %}{{ x.a }}",
    "{{ raise_exception('no') }}",
    "{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}{{ (messages|tojson) * 1000000 }}",
]


def _template(rng: random.Random, model: Gguf) -> tuple[str, bytes]:
    m = model.copy()
    current = m.get("tokenizer.chat_template") or b""
    if rng.random() < 0.7 or not current:
        text = rng.choice(HOSTILE_TEMPLATES).encode()
        what = text[:60].decode()
    else:
        cut = rng.randrange(len(current))
        text = current[:cut]
        what = f"cut at {cut} of {len(current)}"
    m.set("tokenizer.chat_template", _STRING, text)
    return f"template: {what}", m.write()[0]


KINDS = {
    "header": _field_mutation(("version", "tensor_count", "kv_count"), "header"),
    "kv_type": _kv_type,
    "length": _field_mutation(("length", "count", "key_length"), "length"),
    "tensor_table": _field_mutation(("n_dims", "dim", "ttype", "name_length"), "tensor table"),
    "offset": _offset,
    "truncate": _truncate,
    "bytes": _bytes,
    "vocab": _vocab,
    "merges": _merges,
    "hparams": _hparams,
    "tensors": _tensors,
    "template": _template,
}


def mutants(bases: dict, count: int, seed: int):
    """`count` Mutants of the models in `bases` ({name: Gguf}), the kinds dealt from
    shuffled decks so that every len(KINDS) mutants cover them all."""
    rng = random.Random(seed)
    deck: list[str] = []
    names = sorted(bases)
    for n in range(count):
        if not deck:
            deck = list(KINDS)
            rng.shuffle(deck)
        kind = deck.pop()
        base = names[n % len(names)]
        what, data = KINDS[kind](rng, bases[base])
        yield Mutant(kind, what, data, base)


# --- a BPE ("gpt2") base, so merges have something to break ---------------------

def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + \
        list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def bpe_model(spm: Gguf) -> Gguf:
    """The SPM model `spm` with a byte-level BPE vocabulary of the same size instead
    (GPT-2's tokenizer model, merges and all), its tensors kept."""
    m = spm.copy()
    n = len(_tokens(m))
    chars = _byte_chars()
    specials = [b"<|endoftext|>", b"<|im_start|>", b"<|im_end|>"]
    letters = "etaoinshrdlucmfwyp"
    merges, pieces = [], []
    for a in letters:
        for b in letters:
            if len(specials) + 256 + len(pieces) >= n:
                break
            merges.append(f"{a} {b}".encode())
            pieces.append((a + b).encode())
    tokens = specials + [c.encode() for c in chars] + pieces
    tokens += [f"Ġw{i}".encode() for i in range(n - len(tokens))]
    types = [3, 3, 3] + [1] * (n - 3)
    m.set("tokenizer.ggml.model", _STRING, b"gpt2")
    m.set("tokenizer.ggml.pre", _STRING, b"default")
    m.set("tokenizer.ggml.tokens", _ARRAY, tokens, _STRING)
    m.set("tokenizer.ggml.token_type", _ARRAY, types, 5)
    m.drop("tokenizer.ggml.scores")
    m.set("tokenizer.ggml.merges", _ARRAY, merges, _STRING)
    m.set("tokenizer.ggml.bos_token_id", 4, 0)
    m.set("tokenizer.ggml.eos_token_id", 4, 2)
    m.drop("tokenizer.ggml.unknown_token_id")
    m.set("tokenizer.ggml.add_bos_token", 7, False)
    return m

