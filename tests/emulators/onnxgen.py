"""Test support: a tiny decoder-only model folder that onnxruntime-genai can load.

Not a test module. Tests import it as
``from emulators.onnxgen import write_onnx_model`` (tests/ is on sys.path under pytest).

``write_onnx_model(folder)`` writes the four files of an onnxruntime-genai model folder:

* ``model.onnx``: one attention layer without a causal mask (the last position attends
  to everything before it, which is all that generation reads). Inputs are ``input_ids``
  and ``attention_mask`` (int64, ``[batch, seq]`` / ``[batch, total_seq]``) and
  ``past_key_values.0.key``/``.value`` (float32, ``[batch, heads, past_seq, head_size]``);
  outputs are ``logits`` (``[batch, seq, vocab]``) and ``present.0.key``/``.value``,
  the past with this step's keys/values appended. Weights are random but seeded, so
  greedy generation (and sampling with a fixed seed) is reproducible.
* ``genai_config.json``: the decoder's input/output names, head counts and search
  defaults, with ``past_present_share_buffer`` false (the cache grows each step).
* ``tokenizer.json``: a byte-level BPE tokenizer (GPT-2 style, no merges) built with
  the ``tokenizers`` package; every byte is a token, so any text encodes. Three ChatML
  specials follow the 256 byte tokens: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``.
* ``tokenizer_config.json``: the ChatML ``chat_template`` and the bos/eos/pad tokens.

With ``script`` (token texts, e.g. ``added_tokens``, tokens the tokenizer adds as
non-special ones, as Qwen's ``<think>`` is) the model always writes that script, then
``<|im_end|>``, whatever the prompt: each token's logits are a row of a table that
points at the token after it (any other token at the script's first), as
emulators.ggufgen's scripted models do; ``chat_template`` replaces the ChatML one.

Otherwise a logit bias keeps the output readable: only printable-ASCII byte tokens can
be chosen, and the end-of-turn token ``<|im_end|>`` gets ``eos_bias`` (by default so
low that generation always runs to its token limit; pass a large positive value to make
the model stop at once). Logits beyond the tokenizer's 259 tokens (``vocab_size`` pads the
output like real models do) are never chosen.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

__all__ = ["CHATML_TEMPLATE", "SPECIAL_TOKENS", "build_tokenizer", "write_onnx_model"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|im_end|>", "<|endoftext|>"

HIDDEN, HEADS = 16, 2
HEAD_SIZE = HIDDEN // HEADS
CONTEXT_LENGTH = 512
BLOCKED = -1e4


def build_tokenizer(added=()) -> Tokenizer:
    """Return the byte-level BPE tokenizer: 256 byte tokens, then SPECIAL_TOKENS, then
    the `added` (non-special) tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    tokenizer.add_special_tokens(specials)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tokenizer


def _logit_bias(tokenizer: Tokenizer, vocab_size: int, eos_bias: float) -> np.ndarray:
    bias = np.full(vocab_size, BLOCKED, dtype=np.float32)
    for i in range(256):
        text = tokenizer.decode([i])
        if len(text) == 1 and text.isprintable() and text.isascii():
            bias[i] = 0.0
    bias[tokenizer.token_to_id(EOS_TOKEN)] = eos_bias
    return bias


def _script_table(tokenizer: Tokenizer, vocab_size: int, script: list) -> np.ndarray:
    """Each token's row of logits: the token after it in the script (after the last,
    <|im_end|>; after any other token, the script's first) far above the rest."""
    ids = [tokenizer.token_to_id(t) for t in script]
    if None in ids or len(set(ids)) < len(ids):
        raise ValueError("a script's tokens must be distinct tokens of the vocabulary")
    table = np.zeros((vocab_size, vocab_size), dtype=np.float32)
    table[:, ids[0]] = 20.0
    for token, after in zip(ids, ids[1:] + [tokenizer.token_to_id(EOS_TOKEN)]):
        table[token] = 0.0
        table[token, after] = 20.0
    return table


def _graph(rng: np.random.Generator, vocab_size: int, bias: np.ndarray,
           table: np.ndarray | None = None) -> onnx.GraphProto:
    def weight(name, *shape, scale=1.0):
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        return numpy_helper.from_array(data, name)

    def const(name, values, dtype=np.int64):
        return numpy_helper.from_array(np.array(values, dtype=dtype), name)

    inits = [
        weight("embed", vocab_size, HIDDEN),
        *(weight(w, HIDDEN, HIDDEN, scale=HIDDEN ** -0.5) for w in ("wq", "wk", "wv", "wo")),
        weight("lm_head", HIDDEN, vocab_size, scale=2.0 if table is None else 0.0),
        numpy_helper.from_array(bias, "logit_bias"),
        const("heads_shape", [0, 0, HEADS, HEAD_SIZE]),
        const("hidden_shape", [0, 0, HIDDEN]),
        const("mask_axes", [1, 2]),
        const("scale", HEAD_SIZE ** -0.5, np.float32),
        const("one", 1.0, np.float32),
        const("mask_value", -BLOCKED, np.float32),
    ]
    node = helper.make_node
    nodes = [node("Gather", ["embed", "input_ids"], ["x"])]
    for name, out in (("q", "q"), ("k", "k_new"), ("v", "v_new")):  # [B,S,D] -> [B,H,S,head]
        nodes += [
            node("MatMul", ["x", "w" + name], [name + "_flat"]),
            node("Reshape", [name + "_flat", "heads_shape"], [name + "_heads"]),
            node("Transpose", [name + "_heads"], [out], perm=[0, 2, 1, 3]),
        ]
    nodes += [
        node("Concat", ["past_key_values.0.key", "k_new"], ["present.0.key"], axis=2),
        node("Concat", ["past_key_values.0.value", "v_new"], ["present.0.value"], axis=2),
        node("Transpose", ["present.0.key"], ["k_t"], perm=[0, 1, 3, 2]),
        node("MatMul", ["q", "k_t"], ["scores_raw"]),
        node("Mul", ["scores_raw", "scale"], ["scores_scaled"]),
        # attention_mask 1/0 -> additive 0/-1e4, broadcast to [B, 1, 1, T]
        node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        node("Sub", ["mask_f", "one"], ["mask_off"]),
        node("Mul", ["mask_off", "mask_value"], ["mask_add"]),
        node("Unsqueeze", ["mask_add", "mask_axes"], ["mask_4d"]),
        node("Add", ["scores_scaled", "mask_4d"], ["scores"]),
        node("Softmax", ["scores"], ["probs"], axis=-1),
        node("MatMul", ["probs", "present.0.value"], ["ctx_heads"]),
        node("Transpose", ["ctx_heads"], ["ctx_t"], perm=[0, 2, 1, 3]),
        node("Reshape", ["ctx_t", "hidden_shape"], ["ctx"]),
        node("MatMul", ["ctx", "wo"], ["attn_out"]),
        node("Add", ["x", "attn_out"], ["h_sum"]),
        node("Tanh", ["h_sum"], ["h"]),
        node("MatMul", ["h", "lm_head"], ["logits_raw"]),
        node("Add", ["logits_raw", "logit_bias"], ["logits"] if table is None
             else ["logits_biased"]),
    ]
    if table is not None:  # a scripted model: each token's row of the table
        inits.append(numpy_helper.from_array(table, "script"))
        nodes += [node("Gather", ["script", "input_ids"], ["script_rows"]),
                  node("Add", ["logits_biased", "script_rows"], ["logits"])]
    kv = ["batch_size", HEADS, "past_sequence_length", HEAD_SIZE]
    present = ["batch_size", HEADS, "total_sequence_length", HEAD_SIZE]
    value = helper.make_tensor_value_info
    inputs = [
        value("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        value("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
        value("past_key_values.0.key", TensorProto.FLOAT, kv),
        value("past_key_values.0.value", TensorProto.FLOAT, kv),
    ]
    outputs = [
        value("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", vocab_size]),
        value("present.0.key", TensorProto.FLOAT, present),
        value("present.0.value", TensorProto.FLOAT, present),
    ]
    return helper.make_graph(nodes, "tiny_decoder", inputs, outputs, inits)


def _genai_config(vocab_size: int, ids: dict) -> dict:
    decoder = {
        "filename": "model.onnx",
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "head_size": HEAD_SIZE, "hidden_size": HIDDEN,
        "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "num_hidden_layers": 1,
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                   "past_key_names": "past_key_values.%d.key",
                   "past_value_names": "past_key_values.%d.value"},
        "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value"},
    }
    model = {"type": "llama", "vocab_size": vocab_size, "context_length": CONTEXT_LENGTH,
             "bos_token_id": ids[BOS_TOKEN], "eos_token_id": ids[EOS_TOKEN],
             "pad_token_id": ids[PAD_TOKEN], "decoder": decoder}
    search = {"max_length": CONTEXT_LENGTH, "min_length": 0, "do_sample": False,
              "num_beams": 1, "num_return_sequences": 1,
              "temperature": 1.0, "top_k": 50, "top_p": 1.0,
              "repetition_penalty": 1.0, "past_present_share_buffer": False}
    return {"model": model, "search": search}


def _tokenizer_config(ids: dict, template: str = CHATML_TEMPLATE) -> dict:
    added = {str(ids[t]): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                           "normalized": False, "single_word": False} for t in SPECIAL_TOKENS}
    return {"tokenizer_class": "GPT2Tokenizer", "add_bos_token": False,
            "add_prefix_space": False, "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN, "unk_token": None,
            "model_max_length": CONTEXT_LENGTH, "added_tokens_decoder": added,
            "chat_template": template}


def write_onnx_model(folder: Path, *, vocab_size: int = 320, seed: int = 0,
                     eos_bias: float = BLOCKED, chat_template: str = CHATML_TEMPLATE,
                     added_tokens=(), script=()) -> Path:
    """Write model.onnx, genai_config.json and the tokenizer files into folder; return
    folder (a scripted model with `script`: see the module docstring)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(added_tokens)
    if vocab_size < tokenizer.get_vocab_size():
        raise ValueError(f"vocab_size must be at least {tokenizer.get_vocab_size()}")
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    table = None
    if script:
        table = _script_table(tokenizer, vocab_size, list(script))
        bias = np.where(np.arange(vocab_size) < tokenizer.get_vocab_size(), 0.0,
                        BLOCKED).astype(np.float32)
    else:
        bias = _logit_bias(tokenizer, vocab_size, eos_bias)
    graph = _graph(np.random.default_rng(seed), vocab_size, bias, table)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="localrt-tests", ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(folder / "model.onnx"))
    tokenizer.save(str(folder / "tokenizer.json"))
    for name, data in (("genai_config.json", _genai_config(vocab_size, ids)),
                       ("tokenizer_config.json", _tokenizer_config(ids, chat_template))):
        (folder / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return folder
