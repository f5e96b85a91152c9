"""Inference: running models and the one request path of generation.

`scheduler` loads and unloads models, and `lanes` paces who computes when; `running`
is a loaded model's record and a request's lease on it; `requests` is the path every
chat, completion and embedding takes (local or remote, decided once; a remote model's
goes to localrt.remote); `chat`, `completions` and `embeddings` are OpenAI's native
APIs on it, and `images` reads and checks a chat's images (data: URLs, fetched URLs).
"""
