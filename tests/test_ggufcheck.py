"""localrt.engines.ggufcheck: every tiny model the tests generate passes, and a mutant of
one for each rule is refused with a 400 invalid_model_file that names the file and the
rule. Each refused mutant below crashed llama.cpp (SIGABRT or SIGSEGV) when loaded in a
child process, or is one it refuses cleanly only in some versions."""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

import pytest
from emulators.ggufgen import FIM_TOKENS, write_bert_gguf, write_gguf
from support import ggufedit as ge
from support.models import write_family_models
from support.projectors import OUTPUT_TENSORS
from support.projectors import write_projector as write_header_projector
from support.vision import write_vision_pair

from localrt.engines import ggufcheck
from localrt.engines.ggufcheck import GGML_TYPES, Checked, check
from localrt.errors import InvalidModelFile


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny llama model (SentencePiece vocabulary) the mutants start from."""
    return write_gguf(tmp_path_factory.mktemp("llama") / "tiny.gguf")


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """The tiny BERT embedding model (WordPiece vocabulary)."""
    return write_bert_gguf(tmp_path_factory.mktemp("bert") / "bert.gguf")


def refused(path, *fragments) -> str:
    """The message `check` refuses `path` with; it names the file and each fragment."""
    with pytest.raises(InvalidModelFile) as err:
        check(path, param="path")
    exc = err.value
    assert exc.status == 400 and exc.code == "invalid_model_file" and exc.param == "path"
    assert exc.message.startswith(f"Invalid model file {path}: "), exc.message
    for fragment in fragments:
        assert fragment in exc.message, exc.message
    return exc.message


def mutant(source, tmp_path, change, name="mutant.gguf") -> Path:
    """`source` taken apart, changed by `change(doc)` and written to tmp_path/name."""
    doc = ge.read(source)
    change(doc)
    return ge.write(doc, tmp_path / name)


def tensor(doc, name):
    return next(t for t in doc.tensors if t.name == name)


def retype(doc, name, ggml_type):
    """Give a tensor another type, with data of that type's size."""
    t = tensor(doc, name)
    t.type = ggml_type[0]
    ge.relayout(doc, {name: ge.nbytes(t.dims, ggml_type[1], ggml_type[2])})


# --- what passes -------------------------------------------------------------------------

def test_every_generated_model_passes(tmp_path):
    files = [write_gguf(tmp_path / "f32.gguf"), write_gguf(tmp_path / "f16.gguf", file_type="F16"),
             write_gguf(tmp_path / "pooled.gguf", pooling_type=1),
             write_gguf(tmp_path / "fim.gguf", added_tokens=FIM_TOKENS),
             write_gguf(tmp_path / "script.gguf", script=["<|im_start|>"], loop=True),
             write_gguf(tmp_path / "big.gguf", n_embd=256, n_ff=512, n_layer=2),
             write_bert_gguf(tmp_path / "bert.gguf"),
             write_bert_gguf(tmp_path / "bert-cls.gguf", pooling_type=2),
             *write_family_models(tmp_path / "families").values(),
             *write_vision_pair(tmp_path / "vision"),
             *write_vision_pair(tmp_path / "vision16", file_type="F16"),
             *(write_header_projector(tmp_path / f"mmproj-{kind}.gguf", kind=kind)
               for kind in OUTPUT_TENSORS)]
    write_gguf(tmp_path / "split.gguf", split_max_tensors=3)
    files += sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(files) > 20
    for path in files:
        check(path)


def test_quantized_models_pass(quantized):
    for path in quantized.values():  # Q8_0 and Q4_0, written by llama.cpp itself
        check(path)


def test_a_rewritten_model_is_byte_for_byte_the_same(llama, tmp_path):
    # ggufedit's mutants differ from the tiny model only where a test changes them.
    assert mutant(llama, tmp_path, lambda doc: None).read_bytes() == llama.read_bytes()


def test_ggml_types_are_those_of_the_ggml_localrt_ships():
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_blck_size.restype = ctypes.c_int64
    lib.ggml_type_size.restype = ctypes.c_size_t
    lib.ggml_type_name.restype = ctypes.c_char_p
    for type_id, (name, block, size) in GGML_TYPES.items():
        assert (lib.ggml_type_name(type_id).decode().upper(), lib.ggml_blck_size(type_id),
                lib.ggml_type_size(type_id)) == (name, block, size)
    removed = [t for t in range(max(GGML_TYPES)) if t not in GGML_TYPES]
    assert removed == [4, 5, 31, 32, 33, 36, 37, 38]
    for type_id in removed:
        assert lib.ggml_blck_size(type_id) == 0  # ggml's removed types


# --- the layout --------------------------------------------------------------------------

def test_files_cut_short_anywhere_are_refused(llama, tmp_path):
    data = llama.read_bytes()
    doc = ge.read(llama)
    data_start = len(data) - len(doc.data)
    for cut in (3, 10, 30, 200, 2000, data_start - 10, data_start + 5, len(data) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        refused(path)
    refused(path, "'blk.0.ffn_down.weight'", "runs past the end of the file")


def test_header_fields(llama, tmp_path):
    data = llama.read_bytes()
    for name, raw, fragment in [
            ("magic", b"GGML" + data[4:], "not a GGUF file"),
            ("v1", data[:4] + struct.pack("<I", 1) + data[8:], "GGUF version 1"),
            ("v4", data[:4] + struct.pack("<I", 4) + data[8:], "GGUF version 4"),
            ("tensors", data[:8] + struct.pack("<Q", 1 << 40) + data[16:],
             f"{1 << 40} tensors; a model has far fewer"),
            ("kvs", data[:16] + struct.pack("<Q", 1 << 40) + data[24:],
             f"{1 << 40} key/values; a model has far fewer"),
            ("tensors_fit", data[:8] + struct.pack("<Q", 1 << 17) + data[16:],
             f"{1 << 17} tensor infos cannot fit"),
            ("kvs_fit", data[:16] + struct.pack("<Q", 1 << 15) + data[24:],
             f"{1 << 15} key/values cannot fit"),
            ("key", data[:24] + struct.pack("<Q", 1 << 50) + data[32:],
             "a key of 1125899906842624 bytes at offset 24 runs past the end")]:
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(raw)
        refused(path, fragment)


def test_values(llama, tmp_path):
    def nested(doc):
        doc.kv["x.nested"] = ge.KV(ge.ARRAY, [], ge.ARRAY)

    def long_array(doc):
        doc.kv["x.list"] = ge.KV(ge.ARRAY, [1, 2, 3], ge.UINT32)

    refused(mutant(llama, tmp_path, nested), "'x.nested' holds arrays of arrays")
    path = mutant(llama, tmp_path, long_array)
    data = path.read_bytes()
    at = data.index(b"x.list") + len("x.list") + 4 + 4  # the array's count
    path.write_bytes(data[:at] + struct.pack("<Q", 1 << 29) + data[at + 8:])
    refused(path, "the array 'x.list' of 536870912 elements runs past the end")

    def many_strings(doc):
        doc.kv["x.names"] = ge.KV(ge.ARRAY, ["a"], ge.STRING)

    path = mutant(llama, tmp_path, many_strings)
    data = path.read_bytes()
    at = data.index(b"x.names") + len("x.names") + 4 + 4
    count = ggufcheck.MAX_STRINGS + 1  # each string takes 8 bytes at least: room for them
    path.write_bytes(data[:at] + struct.pack("<Q", count) + data[at + 8:])
    os.truncate(path, len(data) + 8 * count)  # sparse: 128 MiB of zeros, never written
    refused(path, f"the array 'x.names' holds {count} strings")
    data = llama.read_bytes()
    at = data.index(b"general.name") + len("general.name")
    path.write_bytes(data[:at] + struct.pack("<I", 13) + data[at + 4:])
    refused(path, "'general.name' has the unknown value type 13")


def test_duplicate_keys_and_tensor_names(llama, tmp_path):
    def two_keys(doc):
        doc.kv["aaaa.one"] = ge.KV(ge.UINT32, 1)
        doc.kv["aaaa.two"] = ge.KV(ge.UINT32, 2)

    path = mutant(llama, tmp_path, two_keys)
    path.write_bytes(path.read_bytes().replace(b"aaaa.two", b"aaaa.one"))
    refused(path, "the key 'aaaa.one' appears twice")

    def same_name(doc):
        doc.tensors[1].name = doc.tensors[0].name

    refused(mutant(llama, tmp_path, same_name), "the tensor 'token_embd.weight' appears twice")


def test_tensor_names_and_shapes(llama, tmp_path):
    def long_name(doc):
        doc.tensors[0].name = "t" * 64

    def five_dims(doc):
        doc.tensors[1].dims = [64, 1, 1, 1, 1]

    def huge(doc):
        doc.tensors[0].dims = [1 << 62, 1 << 3]

    refused(mutant(llama, tmp_path, long_name), "is 64 bytes; llama.cpp takes at most 63")
    refused(mutant(llama, tmp_path, five_dims), "'output_norm.weight' has 5 dimensions")
    refused(mutant(llama, tmp_path, huge), "'token_embd.weight' has the shape",
            "more elements than ggml can count")


def test_tensor_types(llama, tmp_path):
    for type_id in (4, 31, 38, 43, 1000):
        def unknown(doc):
            tensor(doc, "output_norm.weight").type = type_id

        refused(mutant(llama, tmp_path, unknown), f"the ggml type {type_id}, which this "
                "llama.cpp does not know")

    def k_quant(doc):  # Q4_K blocks hold 256 elements: a 64-wide row is no whole block
        tensor(doc, "output_norm.weight").type = 12

    refused(mutant(llama, tmp_path, k_quant), "typed Q4_K, whose blocks hold 256 elements, "
            "but its rows hold 64")


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "token_embd.weight",
                                  "output_norm.weight", "output.weight"])
@pytest.mark.parametrize("ggml_type", [ge.I32, (28, 1, 8), (9, 32, 36), (24, 1, 1)],
                         ids=["I32", "F64", "Q8_1", "I8"])
def test_weights_llama_cpp_cannot_compute_with(llama, tmp_path, name, ggml_type):
    path = mutant(llama, tmp_path, lambda doc: retype(doc, name, ggml_type))
    refused(path, f"the tensor {name!r} is typed {GGML_TYPES[ggml_type[0]][0]}, which "
            "llama.cpp cannot compute with")


def test_weights_of_a_type_it_computes_with_pass(llama, tmp_path):
    check(mutant(llama, tmp_path, lambda doc: retype(doc, "blk.0.attn_q.weight", ge.F16)))
    check(mutant(llama, tmp_path, lambda doc: retype(doc, "output.weight", (30, 1, 2))))


def test_alignment(llama, tmp_path):
    def aligned(value, vtype=ge.UINT32, relayout=False):
        def change(doc):
            doc.kv["general.alignment"] = ge.KV(vtype, value)
            if relayout:
                ge.relayout(doc)
        return mutant(llama, tmp_path, change)

    refused(aligned(16), "general.alignment 16 is below 32")
    refused(aligned(1), "general.alignment 1 is below 32")
    refused(aligned(0), "general.alignment 0 is not a power of two")
    refused(aligned(48), "general.alignment 48 is not a power of two")
    refused(aligned(32, ge.UINT64), "general.alignment is a uint64")
    check(aligned(64, relayout=True))
    check(aligned(32))


def test_tensor_offsets(llama, tmp_path):
    def misaligned(doc):
        doc.tensors[1].offset += 4

    def overlapping(doc):
        doc.tensors[2].offset = doc.tensors[1].offset

    def gap(doc):
        doc.tensors[1].offset += 32

    refused(mutant(llama, tmp_path, misaligned), "'output_norm.weight' starts at data offset "
            "81924, which is not a multiple of the alignment 32")
    refused(mutant(llama, tmp_path, overlapping), "'output.weight' at data offset 81920 "
            "overlaps the tensor 'output_norm.weight' before it, whose data runs to "
            "offset 82176")
    refused(mutant(llama, tmp_path, gap), "'output_norm.weight' starts at data offset 81952, "
            "not at 81920")


# --- the limits --------------------------------------------------------------------------

def hparams(llama, tmp_path, **values):
    """The tiny model with llama.<name> set (uint32) for each of `values`; None deletes."""
    def change(doc):
        for name, value in values.items():
            key = "llama." + name.replace("__", ".")
            if value is None:
                doc.kv.pop(key, None)
            else:
                doc.kv[key] = ge.KV(ge.UINT32, value)
    return mutant(llama, tmp_path, change)


def test_layers(llama, tmp_path):
    refused(hparams(llama, tmp_path, block_count=600), "llama.block_count is 600; llama.cpp "
            "takes 1 to 512 layers (LLAMA_MAX_LAYERS)")
    refused(hparams(llama, tmp_path, block_count=0), "llama.block_count is 0")
    refused(hparams(llama, tmp_path, nextn_predict_layers=2),
            "llama.nextn_predict_layers is 2, more than the model's 1 layers")
    check(hparams(llama, tmp_path, block_count=512))  # llama.cpp's own limit: it says why


def test_experts(llama, tmp_path):
    refused(hparams(llama, tmp_path, expert_used_count=2),
            "llama.expert_used_count is 2 but the model has no experts")
    refused(hparams(llama, tmp_path, expert_count=2, expert_used_count=4),
            "llama.expert_used_count is 4; a model with 2 experts")
    refused(hparams(llama, tmp_path, expert_count=4), "llama.expert_used_count is 0")
    refused(hparams(llama, tmp_path, expert_count=2048, expert_used_count=2),
            "llama.expert_count is 2048; llama.cpp takes at most 1024")
    refused(hparams(llama, tmp_path, expert_count=4, expert_used_count=2,
                    expert_group_count=4), "llama.expert_group_count 4")
    refused(hparams(llama, tmp_path, expert_group_count=2),
            "llama.expert_group_count is 2 but the model has no experts")
    # llama.cpp then looks for the experts' tensors, and says they are missing
    check(hparams(llama, tmp_path, expert_count=4, expert_used_count=2))
    check(hparams(llama, tmp_path, expert_count=8, expert_used_count=2, expert_group_count=4,
                  expert_group_used_count=2))
    check(hparams(llama, tmp_path, expert_count=0, expert_used_count=0))


# --- the vocabulary ----------------------------------------------------------------------

def tokens(doc):
    return doc.kv["tokenizer.ggml.tokens"].value


def test_token_texts(llama, tmp_path):
    def duplicate(doc):
        tokens(doc)[301] = tokens(doc)[300]

    def not_utf8(doc):
        tokens(doc)[300] = b"\xc3".decode("utf-8", "surrogateescape")

    def long(doc):
        tokens(doc)[300] = "x" * (ggufcheck.MAX_TOKEN_BYTES + 1)

    def empties(doc):  # llama.cpp names each empty token apart
        tokens(doc)[300] = tokens(doc)[301] = ""

    text = tokens(ge.read(llama))[300]
    refused(mutant(llama, tmp_path, duplicate), f"holds the token {text!r} twice (the second "
            f"time as token 301)")
    refused(mutant(llama, tmp_path, not_utf8), "token 300 of the vocabulary, '\\\\xc3', is "
            "not valid UTF-8")
    refused(mutant(llama, tmp_path, long), "a string of 16385 bytes", "over the 16384 allowed")
    check(mutant(llama, tmp_path, empties))


def test_a_duplicate_found_across_read_buffers(tmp_path):
    # 5000 tokens span several of the reader's buffers: the repeat is found whichever
    # buffer each copy is in.
    big = write_gguf(tmp_path / "big.gguf", vocab_size=5000)

    def far_apart(doc):
        tokens(doc)[4990] = tokens(doc)[300]

    refused(mutant(big, tmp_path, far_apart), "(the second time as token 4990)")


def test_vocabulary_arrays(llama, tmp_path):
    def set_array(key, values, etype):
        return lambda doc: doc.kv.__setitem__(key, ge.KV(ge.ARRAY, values, etype))

    cases = [
        (set_array("tokenizer.ggml.tokens", list(range(320)), ge.INT32),
         "tokenizer.ggml.tokens is an array of int32, not of strings"),
        (set_array("tokenizer.ggml.scores", ["x"] * 320, ge.STRING),
         "tokenizer.ggml.scores is an array of string; llama.cpp reads an array of float32 "
         "or int32"),
        (set_array("tokenizer.ggml.scores", [0.0] * 10, ge.FLOAT32),
         "tokenizer.ggml.scores has 10 entries for the 320 tokens"),
        (set_array("tokenizer.ggml.token_type", [1] * 10, ge.INT32),
         "tokenizer.ggml.token_type has 10 entries for the 320 tokens"),
        (set_array("tokenizer.ggml.merges", [1, 2], ge.INT32),
         "tokenizer.ggml.merges is an array of int32; llama.cpp reads an array of string"),
        (set_array("tokenizer.ggml.precompiled_charsmap", [1], ge.UINT8),
         "precompiled_charsmap has 1 bytes, too few"),
        (set_array("tokenizer.ggml.precompiled_charsmap", [255, 255, 0, 0, 1, 2], ge.UINT8),
         "precompiled_charsmap says it holds 65535 bytes but has 2"),
        (lambda doc: doc.kv.__setitem__("tokenizer.ggml.scores", ge.KV(ge.FLOAT32, 0.5)),
         "tokenizer.ggml.scores is a float32; llama.cpp reads an array of float32")]
    for change, fragment in cases:
        refused(mutant(llama, tmp_path, change), fragment)


@pytest.mark.parametrize("byte", [0x7C, 0x00, 0xC3, 0xFF])
def test_sentencepiece_needs_every_byte_token(llama, tmp_path, byte):
    def emptied(doc):  # the crash: '|' (0x7C) tokenized with <0x7C> emptied
        tokens(doc)[3 + byte] = ""

    refused(mutant(llama, tmp_path, emptied), "tokenizer.ggml.model is 'llama' "
            f"(SentencePiece), but the vocabulary lacks the byte token <0x{byte:02X}>")


def test_an_ascii_byte_may_be_its_own_character(llama, tmp_path):
    def pipe_itself(doc):  # llama.cpp falls back to the text "|" when <0x7C> is missing
        tokens(doc)[3 + 0x7C] = "zz"
        tokens(doc)[300] = "|"

    check(mutant(llama, tmp_path, pipe_itself))


def test_tokenizer_model_matches_the_vocabulary(llama, bert, tmp_path):
    def model(name):
        return lambda doc: setattr(doc.kv["tokenizer.ggml.model"], "value", name)

    refused(mutant(llama, tmp_path, model("bert")), "tokenizer.ggml.model is 'bert' "
            "(WordPiece), but the vocabulary is SentencePiece's: token 3 is a byte token")
    refused(mutant(llama, tmp_path, model("rwkv")), "'rwkv', but the vocabulary has no "
            "newline token")
    refused(mutant(llama, tmp_path, model("none")), "has no vocabulary "
            "(tokenizer.ggml.model is 'none')")
    refused(mutant(bert, tmp_path, model("llama")), "lacks the byte token <0x00>")

    def one_byte_token(doc):
        doc.kv["tokenizer.ggml.token_type"].value[100] = 6

    refused(mutant(bert, tmp_path, one_byte_token), "token 100 is a byte token")
    check(mutant(llama, tmp_path, model("t5")))  # these llama.cpp loads and tokenizes with
    check(mutant(llama, tmp_path, model("plamo2")))


# --- the cache ---------------------------------------------------------------------------

def test_checked_keeps_outcomes_by_path_size_and_mtime(llama, tmp_path):
    good = tmp_path / "m.gguf"
    good.write_bytes(llama.read_bytes())
    bad = hparams(llama, tmp_path, block_count=600).read_bytes()
    assert len(bad) == len(good.read_bytes())
    checked = Checked()
    checked.check(good)
    stat = good.stat()
    good.write_bytes(bad)  # the same size, and the same mtime again: the same file to it
    os.utime(good, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    checked.check(good)
    os.utime(good, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # now it looks again
    with pytest.raises(InvalidModelFile, match="block_count is 600") as err:
        checked.check(good, param="model")
    assert err.value.param == "model"
    with pytest.raises(InvalidModelFile, match="block_count is 600"):
        checked.check(good)  # a refusal is kept too
