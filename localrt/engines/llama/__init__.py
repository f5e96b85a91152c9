"""gguf-cpp: the llama.cpp runtime, through llama-cpp-python.

`model` is the engine's adapter (`GgufEngine`) and a loaded model (`LlamaModel`), and
`params` turns start options into llama.cpp's parameters. `batch` decides what each
decode step of a model's sequences computes (continuous batching), and `decode`
computes it on the model's llama.cpp context; `drafting` proposes the drafts a step
verifies (speculative decoding), `promptcache` keeps slots' states in RAM, and `media`
reads a prompt's images through the projector (mtmd); `adapters` loads a model's LoRA
adapters and applies each request's scales. `embedding` is llama.cpp's
embedding mode, and `grammar` turns a JSON Schema into GBNF. llama_cpp is imported
only when a model loads.
"""
