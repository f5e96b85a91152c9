"""Inference: running models and the one request path of generation.

`scheduler` loads and unloads models, and `lanes` paces who computes when; `running`
is a loaded model's record and a request's lease on it; `requests` is the path every
chat, completion and embedding takes (local or remote, decided once; a remote model's
goes to localrt.remote); `chat` and `completions` take native requests and give
native events (localrt.native), `embeddings` gives vectors, and `media` reads and
checks a chat's media parts (bytes, data: URLs, fetched URLs) for the kinds the model
takes, and `utility` answers llama-server's utility routes (tokens, a chat's prompt,
slots) on a running model. No wire format is known here: the dialects
(localrt.dialects) read and write.
"""
