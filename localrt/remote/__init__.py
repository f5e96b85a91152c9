"""Remote models: requests served by OpenAI-compatible upstream servers.

`wire` writes a native request (localrt.native) as the chat body an upstream takes and
reads the upstream's reply back into native events.
"""
