"""The tiny onnxruntime-genai model folder from onnxgen, checked without onnxruntime.

The graph is run with onnx's pure-numpy reference evaluator; loading it with
onnxruntime-genai itself is tested where localrt installs that engine.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator
from emulators.onnxgen import EOS_TOKEN, HEAD_SIZE, HEADS, SPECIAL_TOKENS, write_onnx_model
from tokenizers import Tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_onnx_model(tmp_path_factory.mktemp("tiny") / "model", vocab_size=300, seed=1)


def run(folder, ids, past=None):
    """One forward step: (logits, present key, present value) for ids after past (key, value)."""
    if past is None:
        past = (np.zeros((1, HEADS, 0, HEAD_SIZE), np.float32),) * 2
    ids = np.array([ids], np.int64)
    mask = np.ones((1, past[0].shape[2] + ids.shape[1]), np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask,
             "past_key_values.0.key": past[0], "past_key_values.0.value": past[1]}
    return ReferenceEvaluator(str(folder / "model.onnx")).run(None, feeds)


def test_writes_the_files(folder):
    names = {p.name for p in folder.iterdir()}
    assert names == {"model.onnx", "genai_config.json", "tokenizer.json", "tokenizer_config.json"}
    onnx.checker.check_model(str(folder / "model.onnx"), full_check=True)


def test_genai_config_matches_the_graph(folder):
    config = json.loads((folder / "genai_config.json").read_text())
    model = onnx.load(str(folder / "model.onnx"))
    decoder = config["model"]["decoder"]
    assert {i.name for i in model.graph.input} == {
        decoder["inputs"]["input_ids"], decoder["inputs"]["attention_mask"],
        decoder["inputs"]["past_key_names"] % 0, decoder["inputs"]["past_value_names"] % 0}
    assert {o.name for o in model.graph.output} == {
        decoder["outputs"]["logits"],
        decoder["outputs"]["present_key_names"] % 0, decoder["outputs"]["present_value_names"] % 0}
    assert config["search"]["past_present_share_buffer"] is False
    assert config["model"]["vocab_size"] == 300


def test_tokenizer_round_trips_text_and_knows_the_specials(folder):
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = "Hello, world! {json: [1, 2]} ~`\tnaïve"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["eos_token"] == EOS_TOKEN
    assert "<|im_start|>" in config["chat_template"]
    for token in SPECIAL_TOKENS:
        assert tokenizer.encode(token).ids == [tokenizer.token_to_id(token)]


def test_forward_pass_shapes_and_cache(folder):
    logits, key, value = run(folder, [10, 20, 30])
    assert logits.shape == (1, 3, 300)
    assert key.shape == value.shape == (1, HEADS, 3, HEAD_SIZE)
    step_logits, step_key, _ = run(folder, [40], past=(key, value))
    assert step_key.shape == (1, HEADS, 4, HEAD_SIZE)
    # With the cache, the last position sees the same context as a full pass.
    full_logits, _, _ = run(folder, [10, 20, 30, 40])
    np.testing.assert_allclose(step_logits[0, -1], full_logits[0, -1], rtol=1e-5, atol=1e-5)


def test_greedy_choice_is_printable_ascii(folder):
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    logits, _, _ = run(folder, tokenizer.encode("Hi there").ids)
    for row in logits[0]:
        text = tokenizer.decode([int(row.argmax())])
        assert len(text) == 1 and text.isprintable() and text.isascii()


def test_same_seed_same_files_other_seed_other_weights(tmp_path):
    a = write_onnx_model(tmp_path / "a", seed=3)
    b = write_onnx_model(tmp_path / "b", seed=3)
    c = write_onnx_model(tmp_path / "c", seed=4)
    for name in ("model.onnx", "genai_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.onnx").read_bytes() != (c / "model.onnx").read_bytes()


def test_eos_bias_makes_the_model_stop(tmp_path):
    folder = write_onnx_model(tmp_path / "eos", eos_bias=1e4)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    logits, _, _ = run(folder, [10, 20])
    assert int(logits[0, -1].argmax()) == tokenizer.token_to_id(EOS_TOKEN)


def test_vocab_size_must_cover_the_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        write_onnx_model(tmp_path / "small", vocab_size=100)
