"""LoRA adapter GGUFs for the generated models (tests/emulators/ggufgen.py), written with
the gguf package as llama.cpp's convert_lora_to_gguf.py writes them: general.type
"adapter", adapter.type "lora", adapter.lora.alpha, and for each adapted tensor a
`<name>.lora_a` ({n_in, rank} in ggml order) and `<name>.lora_b` ({rank, n_out}).

`write_lora(path, model, boost)` adapts a scripted model's `output.weight` so that its
first reply token changes: with `boost` {state dimension: (token id, weight)}, the
logit of `token` gains `weight` x scale wherever the state points along `dimension`
(a scripted model's states are one-hot: dimension 0 is any token outside its script,
k+1 the k-th script token; ggufgen._scripted). A scripted model's base logit of the
token it writes next is 10, so a weight of 20 wins at scale 1 and loses below 0.5.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from emulators.ggufgen import read_gguf_metadata, write_out


def write_lora(path: Path, model: Path, boost: dict, *, arch: str | None = None,
               alpha: float | None = None, general_type: str = "adapter",
               tensor: str = "output.weight", rank_of_b: int | None = None) -> Path:
    """A LoRA adapter GGUF for the model GGUF at `model` (its vocabulary and embedding
    size) at `path`; the keyword arguments break it on purpose: another `arch`, no
    `alpha` when it is 0, another `general_type`, a `tensor` the model lacks, a
    lora_b whose rank (`rank_of_b`) is not lora_a's."""
    meta = read_gguf_metadata(model)
    arch = arch or meta["general.architecture"]
    n_embd = int(meta[f"{meta['general.architecture']}.embedding_length"])
    n_vocab = int(meta.get(f"{meta['general.architecture']}.vocab_size")
                  or len(meta["tokenizer.ggml.tokens"]))
    rank = max(len(boost), 1)
    a = np.zeros((rank, n_embd), dtype=np.float32)  # ggml {n_embd, rank}
    b = np.zeros((n_vocab, rank_of_b or rank), dtype=np.float32)  # ggml {rank, n_vocab}
    for j, (dimension, (token, weight)) in enumerate(sorted(boost.items())):
        a[j, dimension] = 1.0
        b[token, j] = weight
    writer = gguf.GGUFWriter(path, arch)
    writer.add_type(general_type)
    writer.add_string("adapter.type", "lora")
    if alpha != 0:
        # alpha / rank multiplies the scale (llama.cpp's get_scale): make it 1
        writer.add_float32("adapter.lora.alpha", float(rank if alpha is None else alpha))
    writer.add_tensor(f"{tensor}.lora_a", a)
    writer.add_tensor(f"{tensor}.lora_b", b)
    write_out(writer, Path(path))
    return Path(path)


def write_random_lora(path: Path, model: Path, tensor: str, n_in: int, n_out: int,
                      rank: int = 4, seed: int = 0) -> Path:
    """A LoRA adapter GGUF of random pairs for the model's `tensor` ({n_in, n_out} in
    ggml order), large enough to change what a random model computes there (an
    attention tensor's: the KV it caches)."""
    rng = np.random.default_rng(seed)
    arch = read_gguf_metadata(model)["general.architecture"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(rank))
    writer.add_tensor(f"{tensor}.lora_a", rng.standard_normal((rank, n_in), dtype=np.float32))
    writer.add_tensor(f"{tensor}.lora_b", rng.standard_normal((n_out, rank), dtype=np.float32))
    write_out(writer, Path(path))
    return Path(path)
