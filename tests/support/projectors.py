"""Projector GGUF headers for import, update and pull checks: a file with the keys and
tensor shapes localrt reads of a projector (clip.projector_type, clip.has_vision_encoder,
the tensor whose shape is the output size), and tiny zero data. mtmd could not run it;
a real tiny vision pair that mtmd loads is tests/support/vision.py's.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from emulators.ggufgen import write_out

# projector type -> (tensor name, numpy shape given the output size n): numpy's shape
# is ggml's ne reversed, so a weight's ne[1] is its numpy shape's first number.
OUTPUT_TENSORS = {
    "mlp": ("mm.2.weight", lambda n: (n, 8)),
    "gemma3": ("mm.input_projection.weight", lambda n: (8, n)),
    "idefics3": ("mm.model.fc.weight", lambda n: (n, 8)),
    "qwen2.5vl_merger": ("mm.2.bias", lambda n: (n,)),
}


def write_projector(path, n_embd: int = 64, kind: str = "mlp", vision: bool = True) -> Path:
    """A projector GGUF at `path` whose output size is `n_embd` (the text model's
    embedding size, 64 for tests/emulators/ggufgen.py's write_gguf); returns the Path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_string("clip.projector_type", kind)
    writer.add_bool("clip.has_vision_encoder", vision)
    writer.add_uint32("clip.vision.embedding_length", 8)
    writer.add_tensor("v.patch_embd.weight", np.zeros((8, 3, 2, 2), dtype=np.float32))
    name, shape = OUTPUT_TENSORS[kind]
    writer.add_tensor(name, np.zeros(shape(n_embd), dtype=np.float32))
    write_out(writer, path)
    return path
