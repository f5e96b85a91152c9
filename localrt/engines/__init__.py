"""Inference engines: what loads a model and computes its tokens, and their installs.

The catalog (`catalog`) lists the built-in engines, their variants and their status,
and keeps one adapter object per engine; each adapter is behind one contract
(`contract`): `llama` (gguf-cpp, the llama.cpp runtime, a package of its own) and
`onnx`, both on the engine-neutral `generation`. What a generation carries besides
text is here too: `toolcalls` (each model family's call syntax, its grammar and
parser) and `logprobs` (the model's own log-probabilities); `ggufinfo` reads a GGUF
header. `installs`, `builds`, `releases` and `wheels` install engine variants from a
package index; `probe` and `hardware` say what this machine's build can run, and
`gpus` reads its GPUs (NVML, the Vulkan loader) in a child; `memory` counts what a GGUF
model needs before it loads and refuses what the machine cannot hold; `rpc` splits a
model across hosts; `plugins` finds custom engines. Nothing here knows HTTP, models'
ids or requests.
"""
