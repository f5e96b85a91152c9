"""localrt.engines.ggufinfo reads GGUF headers the way the gguf package does, without its deps."""

from __future__ import annotations

import struct

import gguf
import pytest
from emulators.ggufgen import CHATML_TEMPLATE, read_gguf_metadata, write_gguf

from localrt.engines.ggufinfo import (
    QUANTIZATION_NAMES,
    ArrayInfo,
    GGUFError,
    is_gguf,
    model_defaults,
    read_metadata,
    token_at,
)

BIG_VOCAB = 5000  # over MAX_INLINE_ARRAY, so the vocabulary arrays become ArrayInfo


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    """A model whose tokens, scores and token types are too long to load."""
    return write_gguf(tmp_path_factory.mktemp("big") / "big.gguf", vocab_size=BIG_VOCAB)


def kv_end(path) -> int:
    """File offset where the key/value section ends, according to the gguf package."""
    last = list(gguf.GGUFReader(path).fields.values())[-1]
    return last.offset + sum(part.nbytes for part in last.parts)


def header(version=3, kv_count=1):
    return b"GGUF" + struct.pack("<IQQ", version, 0, kv_count)


def gguf_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


@pytest.mark.parametrize("file_type", ["F32", "F16"])
def test_metadata_matches_gguf_package(tmp_path, file_type):
    path = write_gguf(tmp_path / "m.gguf", file_type=file_type)
    assert is_gguf(path)
    assert read_metadata(path) == read_gguf_metadata(path)


def test_model_defaults(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", name="tiny", context_length=512, file_type="F16")
    assert model_defaults(path) == {
        "architecture": "llama",
        "name": "tiny",
        "context_length": 512,
        "chat_template": CHATML_TEMPLATE,
        "eos_token": "</s>",
        "bos_token": "<s>",
        "stop": ["</s>"],
        "file_type": 1,
        "quantization": "F16",
        "embedding": False,  # no pooling type, causal attention: a model that chats
        "rerank": False,  # and not a reranker (pooling rank)
    }


def test_model_defaults_leaves_out_what_is_unknown(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", chat_template=None)
    assert "chat_template" not in model_defaults(path)
    assert "parameter_count" not in model_defaults(path)


def test_quantization_names_follow_llama_cpp():
    expected = {int(t): t.name.split("_", 1)[1] for t in gguf.LlamaFileType
                if t is not gguf.LlamaFileType.GUESSED}
    assert QUANTIZATION_NAMES == expected


def test_large_arrays_become_placeholders(big_model):
    ours, theirs = read_metadata(big_model), read_gguf_metadata(big_model)
    assert ours.keys() == theirs.keys()
    tokens = ours["tokenizer.ggml.tokens"]
    assert isinstance(tokens, ArrayInfo) and (tokens.type_name, tokens.count) == (
        "string", BIG_VOCAB)
    assert ours["tokenizer.ggml.scores"].type_name == "float32"
    assert ours["tokenizer.ggml.token_type"].type_name == "int32"
    for key, value in ours.items():  # keys after the skipped arrays still read right
        if isinstance(value, ArrayInfo):
            assert value.count == len(theirs[key])
        else:
            assert value == theirs[key], key


def test_token_at_reads_one_string(big_model):
    info = read_metadata(big_model)["tokenizer.ggml.tokens"]
    tokens = read_gguf_metadata(big_model)["tokenizer.ggml.tokens"]
    for index in (0, 2, 1000, 4096, BIG_VOCAB - 1):
        assert token_at(big_model, info, index) == tokens[index]
    with pytest.raises(IndexError):
        token_at(big_model, info, BIG_VOCAB)
    with pytest.raises(TypeError):
        token_at(big_model, read_metadata(big_model)["tokenizer.ggml.scores"], 0)


def test_model_defaults_with_large_vocabulary(big_model):
    defaults = model_defaults(big_model)
    assert (defaults["eos_token"], defaults["bos_token"]) == ("</s>", "<s>")


def test_reading_stops_before_tensor_infos(tmp_path, big_model):
    # A file cut right after the key/values still reads, so neither tensor infos
    # nor tensor data are read.
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(big_model.read_bytes()[:kv_end(big_model)])
    assert read_metadata(cut) == read_metadata(big_model)
    assert model_defaults(cut) == model_defaults(big_model)


def test_bad_magic(tmp_path):
    path = tmp_path / "m.gguf"
    data = write_gguf(path).read_bytes()
    path.write_bytes(b"GGML" + data[4:])
    assert not is_gguf(path)
    with pytest.raises(GGUFError, match="magic") as err:
        read_metadata(path)
    assert str(path) in str(err.value)


def test_is_gguf_on_short_file(tmp_path):
    path = tmp_path / "short"
    path.write_bytes(b"GG")
    assert not is_gguf(path)


@pytest.mark.parametrize("version, message", [
    (struct.pack("<I", 1), "version 1"),
    (struct.pack("<I", 4), "version 4"),
    (struct.pack(">I", 3), "big-endian"),
])
def test_unsupported_versions(tmp_path, version, message):
    path = tmp_path / "m.gguf"
    data = write_gguf(path).read_bytes()
    path.write_bytes(data[:4] + version + data[8:])
    with pytest.raises(GGUFError, match=message) as err:
        read_metadata(path)
    assert str(path) in str(err.value)


def test_truncated_header(tmp_path, big_model):
    data = big_model.read_bytes()
    meta = read_metadata(big_model)
    tokens = meta["tokenizer.ggml.tokens"].offset
    scores = meta["tokenizer.ggml.scores"].offset
    end = kv_end(big_model)
    # inside: magic, version, counts, first key, the string walk, a seek-skipped array,
    # the last value
    for size in (2, 6, 12, 30, tokens + 100, scores + 100, end - 1):
        path = tmp_path / f"cut{size}.gguf"
        path.write_bytes(data[:size])
        with pytest.raises(GGUFError, match="truncated") as err:
            read_metadata(path)
        assert str(path) in str(err.value)


@pytest.mark.parametrize("body, message", [
    (struct.pack("<Q", 1 << 40), "string length"),                        # key length
    (gguf_string("k") + struct.pack("<IIQ", 9, 8, (1 << 31) + 1), "array count"),
    (gguf_string("k") + struct.pack("<I", 99), "value type"),
])
def test_absurd_values_are_refused(tmp_path, body, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(header() + body + b"\0" * 64)
    with pytest.raises(GGUFError, match=message) as err:
        read_metadata(path)
    assert str(path) in str(err.value)


def test_absurd_key_value_count(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(header(kv_count=1 << 40))
    with pytest.raises(GGUFError, match="key/value count"):
        read_metadata(path)


def test_nested_and_typed_values(tmp_path):
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_bool("b", True)
    writer.add_int8("i8", -3)
    writer.add_uint64("u64", 1 << 40)
    writer.add_float64("f64", 0.1)
    writer.add_array("nested", [[1, 2], [3]])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    ours = read_metadata(path)
    assert ours.pop("nested") == [[1, 2], [3]]  # the gguf package flattens these
    theirs = read_gguf_metadata(path)
    del theirs["nested"]
    assert ours == theirs
