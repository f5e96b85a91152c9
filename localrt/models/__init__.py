"""Models: what an id means, the registry of downloaded ones, pulls and imports.

`ids` parses and checks model ids before any I/O; `registry` owns the model
definitions on disk; `options` resolves what a model starts with (its stored
parameters, the defaults and a start request's options); `pulls` plans what a pull
downloads (candidates, quantizations, split files) and starts it; `imports` registers
local files; `roles` is the table of a model's files by role (the weights, a
projector): how each is found, pulled, imported, checked, stored and updated; `hub` is
the Hugging Face hub's API.
"""
