"""Inference engines: what loads a model and computes its tokens.

The catalog (`catalog`) lists the built-in engines, their variants and their status;
each engine is an adapter behind one contract (`contract`): `llama` (gguf-cpp, with
its embedding mode in `embedding` and its JSON grammars in `grammar`) and `onnx`, both
on the engine-neutral `generation`. What a generation carries besides text is here
too: `toolcalls` (each model family's call syntax, its grammar and parser) and
`logprobs` (the model's own log-probabilities); `ggufinfo` reads a GGUF header.
`batching` shares a model's decode steps between its requests; `installs`, `builds`,
`releases` and `wheels` install engine variants from a package index; `probe` and
`hardware` say what this machine's build can run; `rpc` splits a model across hosts;
`plugins` finds custom engines. Nothing here knows HTTP, models' ids or requests.
"""
