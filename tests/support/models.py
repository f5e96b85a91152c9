"""Generated models (tests/emulators/ggufgen.py) as the tests use them: constants for their
vocabulary, quantized copies, the chat-template families, and their tokenizer."""

from __future__ import annotations

from pathlib import Path

import gguf
from emulators.chattemplates import TEMPLATES, TOKENS
from emulators.ggufgen import EOS_ID, write_gguf

# A logit bias under which the generated models never end a reply: exactly max_tokens come.
NO_EOS = {str(EOS_ID): -100}
# The start option (or stored parameter) for a reply that must last: a random model's
# greedy reply falls into a loop, which speculative decoding drafts whole, so a
# 2000-token reply of conftest's slow_gguf would end in a blink instead of seconds.
NO_DRAFTS = {"speculative": "off"}
# The token types of chattemplates.TOKENS' added tokens, by the name it gives them.
KINDS = {"control": gguf.TokenType.CONTROL, "user": gguf.TokenType.USER_DEFINED}
FAMILIES = sorted(TEMPLATES)  # llama31, mistral_nemo, qwen25


def quantize(source: Path, target: Path, ftype_name: str) -> Path:
    """Quantize a GGUF file with llama.cpp itself (ftype_name: "Q8_0", "Q4_0")."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(),
                                          params) == 0
    return target


def write_family_models(root: Path) -> dict:
    """One tiny GGUF per family in `root`, carrying its real chat template and added
    tokens, with a 4096-token context (tools make long prompts): {family: path}."""
    return {family: write_gguf(root / f"{family}.gguf", name=family, vocab_size=400,
                               context_length=4096, chat_template=TEMPLATES[family],
                               added_tokens=[(t, KINDS[k]) for t, k in TOKENS[family]])
            for family in FAMILIES}


def tokens_of(path, text: str, bos: bool = True) -> list[int]:
    """The tokens llama.cpp gives a text, with the model's BOS unless `bos` is false,
    from the model's vocabulary alone."""
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        return vocab.tokenize(text.encode(), add_bos=bos, special=False)
    finally:
        vocab.close()
