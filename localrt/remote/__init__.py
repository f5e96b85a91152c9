"""Remote models: requests forwarded whole to OpenAI-compatible servers.

`remotes` registers remote models and forwards their chats, completions and
embeddings to an upstream (`Remotes`; the catalog's `remote` engine is its
`RemoteEngine`); `upstreams` is the upstreams' health, in-flight counts, routing and
probes; `wire` writes a native request (localrt.native) as the chat body an upstream
takes and reads its reply back into native events. Connections go out through
localrt.outbound, with the Config's proxy and TLS flags.
"""
