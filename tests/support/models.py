"""Generated models (tests/emulators/ggufgen.py) as the tests use them: constants for their
vocabulary, quantized copies, the chat-template families, their tokenizer, and importing
one into an app or a server (`add_model`)."""

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


def add_model(api, path, model_id: str = "tiny", *, start: dict | None = None,
              stored: dict | None = None, **fields) -> str:
    """Import the model file at `path` as `model_id` (`fields`: more of the import's
    body, such as option); then PATCH `stored` parameters onto it, and with `start`
    start it with those options on one CPU thread (the machine is shared). `api` is
    support.apps.bind's (the app in process) or a real server's URL. The id."""
    request = _requester(api)
    request("POST", "/v1/models/import", {"path": str(path), "id": model_id, **fields})
    if stored:
        request("PATCH", f"/v1/models/{model_id}", stored)
    if start is not None:
        request("POST", f"/v1/models/{model_id}/start", {"cpu_threads": 1, **start})
    return model_id


def _requester(api):
    """A function that sends one request through `api` and asserts a 200."""
    if isinstance(api, str):
        from support.servers import send

        def request(method, path, body):
            status, reply = send(api, method, path, body, timeout=60)
            assert status == 200, reply
    else:
        def request(method, path, body):
            r = api(method, path, body)
            assert r.status == 200, r.body
    return request


def tokens_of(path, text: str, bos: bool = True) -> list[int]:
    """The tokens llama.cpp gives a text, with the model's BOS unless `bos` is false,
    from the model's vocabulary alone."""
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        return vocab.tokenize(text.encode(), add_bos=bos, special=False)
    finally:
        vocab.close()
