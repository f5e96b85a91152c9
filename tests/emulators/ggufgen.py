"""Test support: tiny, structurally complete llama-architecture GGUF files (and a BERT
embedding model's or reranker's, `write_bert_gguf`).

Not a test module. Tests import it as ``from emulators.ggufgen import write_gguf``
(tests/ is on sys.path under pytest).

The files are written with the ``gguf`` package (gguf-py from llama.cpp) in the same
order its converters use: header, key/values, tensor infos, tensor data.  The model has
random weights, so what it generates is gibberish, but every key and tensor that
llama.cpp's llama loader requires is present with consistent shapes:

* hyperparameters under ``llama.*`` (context/embedding/feed-forward length, block count,
  head counts, RoPE dimension count, RMS-norm epsilon) plus ``general.file_type``;
* a SentencePiece-style ("llama") vocabulary: ``<unk>``/``<s>``/``</s>``, all 256 byte
  fallback tokens ``<0x00>``..``<0xFF>`` (llama.cpp looks up ``<0x0A>`` for the newline
  token and falls back to byte tokens for unknown characters), the ChatML control
  tokens, then ordinary pieces up to ``vocab_size``;
* ``token_embd``, ``output_norm``, ``output`` and per block the attention and SwiGLU
  feed-forward weights.

Shapes: GGUF stores dimensions innermost-first (ggml ``ne``), and GGUFWriter reverses
the numpy shape when it writes the tensor info, so a numpy array of shape
``(n_vocab, n_embd)`` becomes ggml ``{n_embd, n_vocab}``, which is what llama.cpp expects
for ``token_embd.weight``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import numpy as np

import gguf

__all__ = ["CHATML_TEMPLATE", "FIM_TOKENS", "write_gguf", "write_bert_gguf",
           "read_gguf_metadata", "write_fake_blob"]

# A minimal ChatML template (the format used by Qwen, SmolLM, ...); it is what
# llama.cpp's template detection recognises as "chatml" (it looks for "<|im_start|>").
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Special token ids, fixed at the start of the vocabulary (SentencePiece convention).
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
_SPECIAL = ["<unk>", "<s>", "</s>"]
_BYTES = [f"<0x{b:02X}>" for b in range(256)]
_CHATML = ["<|im_start|>", "<|im_end|>"]
MIN_VOCAB_SIZE = len(_SPECIAL) + len(_BYTES) + len(_CHATML)
# Qwen 2.5 Coder's fill-in-the-middle tokens, which llama.cpp finds by their text; give
# them as `added_tokens` for a model that takes a suffix.
FIM_TOKENS = [(text, gguf.TokenType.CONTROL)
              for text in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")]

_FILE_TYPES = {
    "F32": (gguf.LlamaFileType.ALL_F32, np.float32),
    "F16": (gguf.LlamaFileType.MOSTLY_F16, np.float16),
}


def _normal_pieces(count: int) -> list:
    """`count` distinct ordinary SentencePiece pieces ("▁" marks a word start)."""
    alphabet = "etaoinshrdlucmfwypvbgkqjxz"
    pieces = ["▁"]
    pieces += list(alphabet) + ["▁" + c for c in alphabet]
    pieces += list("0123456789.,!?'-:;()")
    pieces += [a + b for a in alphabet for b in alphabet]  # bigrams, plenty of room
    pieces += ["▁" + a + b for a in alphabet for b in alphabet]
    if count > len(pieces):
        pieces += [f"▁tok{i}" for i in range(count - len(pieces))]
    return pieces[:count]


def _vocab(vocab_size: int, added=()):
    """Tokens, scores and token types for a SentencePiece ("llama") tokenizer.

    `added` are (text, gguf.TokenType) pairs placed after the ChatML tokens, as a real
    model's added tokens are: CONTROL ones (e.g. "[TOOL_CALLS]") or USER_DEFINED ones
    (e.g. Qwen's "<tool_call>").
    """
    added = list(added)
    if vocab_size < MIN_VOCAB_SIZE + len(added):
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE + len(added)}")
    normal = _normal_pieces(vocab_size - MIN_VOCAB_SIZE - len(added))
    tokens = _SPECIAL + _BYTES + _CHATML + [text for text, _ in added] + normal
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
             + [gguf.TokenType.BYTE] * len(_BYTES)
             + [gguf.TokenType.CONTROL] * len(_CHATML)
             + [kind for _, kind in added]
             + [gguf.TokenType.NORMAL] * len(normal))
    # SPM merges pieces by score: longer pieces get higher (less negative) scores.
    scores = [0.0] * (len(_SPECIAL) + len(_BYTES) + len(_CHATML) + len(added))
    scores += [-1000.0 + 10.0 * len(p) - i * 1e-3 for i, p in enumerate(normal)]
    return tokens, [float(s) for s in scores], [int(t) for t in types]


def write_gguf(
    path: Union[str, os.PathLike],
    *,
    name: str = "tiny",
    context_length: int = 256,
    chat_template: Optional[str] = CHATML_TEMPLATE,
    vocab_size: int = 320,
    n_embd: int = 64,
    n_layer: int = 1,
    n_head: int = 4,
    n_head_kv: Optional[int] = None,
    n_ff: Optional[int] = None,
    file_type: str = "F32",
    seed: int = 0,
    split_max_tensors: int = 0,
    added_tokens=(),
    pooling_type: Optional[int] = None,
    script=(),
    weight_scale: float = 0.02,
    loop: bool = False,
    branches=(),
) -> Path:
    """Write a tiny random-weight llama model to `path` and return it as a Path.

    `file_type` is "F32" or "F16" (2-D weights in F16; norm vectors stay F32, as
    llama.cpp's converters do).  `chat_template=None` leaves tokenizer.chat_template out.
    `n_head_kv` defaults to `n_head` (no GQA); `n_ff` defaults to 2 * n_embd.
    With the defaults the file is about 320 KB. With `split_max_tensors` the model is
    written as llama.cpp's split files, `<stem>-00001-of-0000N.gguf` beside `path`, and
    the first part's path is returned. `pooling_type` (a gguf.PoolingType) writes
    ``llama.pooling_type``, as converters do for a decoder made an embedding model.

    `script` (token texts, each a token of the vocabulary, e.g. added ones) makes a
    model that always writes that script, then its end token, whatever the prompt:
    its blocks' weights are zero, so each position's state is its own token's
    embedding, and the output maps each script token to the next (any other token to
    the first). Real llama.cpp then answers with known text, e.g. a tool call. With
    `loop` the script starts again after its last token instead of ending: a model that
    never ends a reply (its tokens must be distinct), under any sampling that keeps
    min_p. `branches`, (trigger, tokens) pairs beside a `script`, make the model write
    those tokens instead, then its end token, when the text so far ends with the
    trigger token (a template can end a prompt with one: a reply after a tool's result).

    `weight_scale` is the standard deviation of the random weights; a larger one makes
    the context (e.g. an image's embeddings) weigh more on what the model writes.
    """
    path = Path(path)
    if file_type not in _FILE_TYPES:
        raise ValueError(f"file_type must be one of {sorted(_FILE_TYPES)}")
    ftype, wdtype = _FILE_TYPES[file_type]
    n_head_kv = n_head if n_head_kv is None else n_head_kv
    n_ff = 2 * n_embd if n_ff is None else n_ff
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must divide by n_head, and n_head by n_head_kv")
    head_dim = n_embd // n_head
    n_embd_kv = head_dim * n_head_kv
    tokens, scores, types = _vocab(vocab_size, added_tokens)

    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA]  # "llama"
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    writer.add_name(name)
    writer.add_file_type(int(ftype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(vocab_size)
    writer.add_context_length(context_length)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)

    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)
    if pooling_type is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling_type))

    rng = np.random.default_rng(seed)

    def weight(*shape):  # numpy shape, i.e. reversed ggml ne; a script's blocks add nothing
        if script:
            return np.zeros(shape, dtype=wdtype)
        return (rng.standard_normal(shape, dtype=np.float32) * weight_scale).astype(wdtype)

    def norm(n):
        return np.ones(n, dtype=np.float32)

    T = gguf.TENSOR_NAMES
    M = gguf.MODEL_TENSOR
    if script:
        embd, output = _scripted(tokens, list(script), n_embd, loop, branches)
    else:
        embd, output = weight(vocab_size, n_embd), weight(vocab_size, n_embd)
    writer.add_tensor(T[M.TOKEN_EMBD] + ".weight", embd.astype(wdtype))
    writer.add_tensor(T[M.OUTPUT_NORM] + ".weight", norm(n_embd))
    writer.add_tensor(T[M.OUTPUT] + ".weight", output.astype(wdtype))
    for bid in range(n_layer):
        def add(tensor, array):
            writer.add_tensor(T[tensor].format(bid=bid) + ".weight", array)

        add(M.ATTN_NORM, norm(n_embd))
        add(M.ATTN_Q, weight(n_embd, n_embd))          # ggml {n_embd, n_head*head_dim}
        add(M.ATTN_K, weight(n_embd_kv, n_embd))       # ggml {n_embd, n_head_kv*head_dim}
        add(M.ATTN_V, weight(n_embd_kv, n_embd))
        add(M.ATTN_OUT, weight(n_embd, n_embd))
        add(M.FFN_NORM, norm(n_embd))
        add(M.FFN_GATE, weight(n_ff, n_embd))          # ggml {n_embd, n_ff}
        add(M.FFN_UP, weight(n_ff, n_embd))
        add(M.FFN_DOWN, weight(n_embd, n_ff))          # ggml {n_ff, n_embd}

    write_out(writer, path)
    if split_max_tensors:
        return sorted(path.parent.glob(f"{path.stem}-00001-of-*.gguf"))[0]
    return path


def _scripted(tokens: list, script: list, n_embd: int, loop: bool = False, branches=()):
    """(token embeddings, output weights) of a model that writes `script` then EOS (with
    `loop`, its first token again), or a branch's tokens after its trigger: each token
    that leads somewhere (a script or branch token, a trigger) points along a dimension
    of its own, any other token along dimension 0, and the output row of the token that
    follows has a large weight on that dimension."""
    ids = [tokens.index(text) for text in script]
    # (the token, the token written after it); None: any token that leads nowhere else.
    steps = [(None, ids[0])] + list(zip(ids, ids[1:] + [ids[0] if loop else EOS_ID]))
    for trigger, branch in branches:
        chain = [tokens.index(trigger)] + [tokens.index(text) for text in branch]
        steps += zip(chain, chain[1:] + [EOS_ID])
    if len(steps) > n_embd:
        raise ValueError("a script and its branches need n_embd above their length")
    if len({token for token, _ in steps}) < len(steps):
        raise ValueError("a script's and its branches' tokens must be distinct")
    embd = np.zeros((len(tokens), n_embd), dtype=np.float32)
    output = np.zeros((len(tokens), n_embd), dtype=np.float32)
    embd[:, 0] = 1.0
    for dim, (token, after) in enumerate(steps):
        if token is not None:
            embd[token] = 0.0
            embd[token, dim] = 1.0
        output[after, dim] = 10.0
    return embd, output


def write_bert_gguf(
    path: Union[str, os.PathLike],
    *,
    name: str = "tiny-bert",
    context_length: int = 128,
    vocab_size: int = 320,
    n_embd: int = 64,
    n_layer: int = 1,
    n_head: int = 4,
    n_ff: Optional[int] = None,
    pooling_type: int = 1,
    seed: int = 0,
    add_eos: Optional[bool] = None,
    rerank_template: Optional[str] = None,
) -> Path:
    """Write a tiny random-weight BERT embedding model (F32) to `path` and return it.

    What llama.cpp's BERT loader requires, as convert_hf_to_gguf.py writes a
    sentence-transformers model: ``bert.*`` hyperparameters with non-causal attention
    and a pooling type (``gguf.PoolingType``: 1 mean, 2 cls, 4 rank), a WordPiece
    ("bert") vocabulary (``[PAD]`` ``[UNK]`` ``[CLS]`` ``[SEP]`` ``[MASK]``, then pieces
    where "▁" starts a word, as the converter turns "##" pieces around), token,
    token-type and position embeddings with their norm, and per block biased
    Q/K/V/output projections, a GELU feed-forward and two layer norms.

    With rank pooling it is a reranker (a cross-encoder, as bge-reranker's converted
    GGUF is): it has the classification head llama.cpp's rank pooling reads, ``cls``
    (a dense layer, then tanh) and ``cls.output`` (one output: the score), with weights
    large enough that pairs score apart. `add_eos` writes
    ``tokenizer.ggml.add_eos_token`` (llama.cpp's default for a WordPiece vocabulary is
    false; its EOS is then [SEP]); `rerank_template` writes
    ``tokenizer.chat_template.rerank``, the prompt llama.cpp's server makes of a query
    and a document (``{query}``, ``{document}``).
    """
    path = Path(path)
    n_ff = 2 * n_embd if n_ff is None else n_ff
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    normal = _normal_pieces(vocab_size - len(special))
    types = ([gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * 3
             + [gguf.TokenType.NORMAL] * len(normal))

    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BERT])
    writer.add_name(name)
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    writer.add_context_length(context_length)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(pooling_type))
    writer.add_tokenizer_model("bert")
    writer.add_token_list(special + normal)
    writer.add_token_types([int(t) for t in types])
    writer.add_token_type_count(2)
    writer.add_pad_token_id(0)
    writer.add_unk_token_id(1)
    writer.add_bos_token_id(2)   # [CLS]: llama.cpp puts BOS first
    writer.add_sep_token_id(3)   # [SEP]: and SEP last
    writer.add_mask_token_id(4)
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)
    if add_eos is not None:
        writer.add_add_eos_token(add_eos)
    if rerank_template is not None:
        writer.add_string(gguf.Keys.Tokenizer.CHAT_TEMPLATE + ".rerank", rerank_template)

    rng = np.random.default_rng(seed)

    def weight(*shape):
        return rng.standard_normal(shape, dtype=np.float32) * 0.02

    T, M = gguf.TENSOR_NAMES, gguf.MODEL_TENSOR
    ones, zeros = np.ones(n_embd, np.float32), np.zeros(n_embd, np.float32)
    writer.add_tensor(T[M.TOKEN_EMBD] + ".weight", weight(vocab_size, n_embd))
    writer.add_tensor(T[M.TOKEN_TYPES] + ".weight", weight(2, n_embd))
    writer.add_tensor(T[M.POS_EMBD] + ".weight", weight(context_length, n_embd))
    writer.add_tensor(T[M.TOKEN_EMBD_NORM] + ".weight", ones)
    writer.add_tensor(T[M.TOKEN_EMBD_NORM] + ".bias", zeros)
    for bid in range(n_layer):
        def add(tensor, kind, array):
            writer.add_tensor(T[tensor].format(bid=bid) + "." + kind, array)

        for tensor in (M.ATTN_Q, M.ATTN_K, M.ATTN_V, M.ATTN_OUT):
            # A reranker's [CLS] must read the pair: larger values and outputs carry
            # the other tokens into it, so pairs score apart.
            scale = 10 if pooling_type == gguf.PoolingType.RANK and \
                tensor in (M.ATTN_V, M.ATTN_OUT) else 1
            add(tensor, "weight", weight(n_embd, n_embd) * scale)
            add(tensor, "bias", zeros)
        add(M.ATTN_OUT_NORM, "weight", ones)
        add(M.ATTN_OUT_NORM, "bias", zeros)
        add(M.FFN_UP, "weight", weight(n_ff, n_embd))
        add(M.FFN_UP, "bias", np.zeros(n_ff, np.float32))
        add(M.FFN_DOWN, "weight", weight(n_embd, n_ff))
        add(M.FFN_DOWN, "bias", zeros)
        add(M.LAYER_OUT_NORM, "weight", ones)
        add(M.LAYER_OUT_NORM, "bias", zeros)
    if pooling_type == gguf.PoolingType.RANK:  # the classifier: ggml {n_embd, 1} out
        writer.add_tensor(T[M.CLS] + ".weight", weight(n_embd, n_embd) * 5)
        writer.add_tensor(T[M.CLS] + ".bias", zeros)
        writer.add_tensor(T[M.CLS_OUT] + ".weight", weight(1, n_embd) * 50)
        writer.add_tensor(T[M.CLS_OUT] + ".bias", np.zeros(1, np.float32))

    write_out(writer, path)
    return path


def write_out(writer, path: Path) -> None:
    """Write a GGUFWriter's header, metadata and tensors to `path` (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def read_gguf_metadata(path: Union[str, os.PathLike]) -> dict:
    """All key/value fields of a GGUF file as plain Python values (str, int, float, list).

    Tensor infos are not included; use gguf.GGUFReader(path).tensors for those.
    """
    reader = gguf.GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def write_fake_blob(path: Union[str, os.PathLike], size: int, seed: int = 0,
                    chunk_size: int = 4 << 20) -> Path:
    """Write `size` pseudo-random bytes to `path`, one chunk at a time.

    Deterministic for a given seed and size; memory use is bounded by `chunk_size`, and
    a 1 GiB file takes a second or two (numpy's generator fills each chunk).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    remaining = size
    with open(path, "wb") as f:
        while remaining > 0:
            n = min(chunk_size, remaining)
            f.write(rng.bytes(n))
            remaining -= n
    return path
