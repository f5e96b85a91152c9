"""Other APIs' dialects, each a translation onto localrt's native chat, completions
and embeddings: Anthropic's Messages (`anthropic`), OpenAI's Responses
(`responses`) and Ollama's API (`ollama`). `common` holds what they share.
"""
