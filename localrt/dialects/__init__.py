"""The dialects: each API localrt speaks, a reader of its bodies into native requests
(localrt.native) and a writer of the native events in its wire format. OpenAI's chat
and text completions (`openai`), Anthropic's Messages (`anthropic`), OpenAI's
Responses (`responses`) and Ollama's API (`ollama` for generation, `ollama_models`
for its names and listings), and OpenAI's speech to text (`transcriptions`, a chat
with the clip). `common` holds what they share.
"""
