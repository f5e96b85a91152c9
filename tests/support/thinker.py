"""Test support: models that think. A remote one, as an OpenAI-compatible server on
loopback, and a local one, a scripted GGUF with QwQ's chat template (`write_qwq`).

Not a test module. The remote one's chat completions stream the thinking as servers write it
(`reasoning_content` in one chunk, `reasoning` in the next, as vLLM's releases do),
after `pause` seconds the answer, and record every body they get (`bodies`).
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from localrt.client import Client

THINKING = ["The user greets me. ", "I should greet back."]
ANSWER = ["Hello", " there!"]


class _Upstream(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):  # the probe: GET /v1/models
        raw = json.dumps({"object": "list", "data": [{"id": "thinker"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self._delta({"role": "assistant", "content": ""})
        self._delta({"reasoning_content": THINKING[0]})
        self._delta({"reasoning": THINKING[1]})
        time.sleep(self.server.pause)
        for text in ANSWER:
            self._delta({"content": text})
        self._event({"id": "up", "object": "chat.completion.chunk", "created": 1,
                     "model": "thinker",
                     "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        self.wfile.write(b"data: [DONE]\n\n")

    def _delta(self, delta: dict) -> None:
        self._event({"id": "up", "object": "chat.completion.chunk", "created": 1,
                     "model": "thinker",
                     "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})

    def _event(self, data: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
        self.wfile.flush()


@contextmanager
def thinking_upstream(pause: float = 0.0):
    """The upstream, serving on a free loopback port until the block ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    server.bodies, server.pause = [], pause
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def add_thinker(url: str, upstream) -> None:
    """Register the remote model `thinker` on the localrt at `url`, served by `upstream`."""
    Client(url)._request("POST", "/v1/models/remote", {
        "id": "thinker", "upstreams": [{"url": f"http://127.0.0.1:{upstream.server_port}/v1"}]})


def write_qwq(path):
    """A scripted model with QwQ's template: its prompt opens the thinking, so its reply
    "so we</think> ok" is the thinking "so we" and the answer "ok"; with thinking off,
    the template ends the prompt with "</think>" and the script answers "ok" at once."""
    import gguf
    from emulators.chattemplates import template
    from emulators.ggufgen import write_gguf

    user = gguf.TokenType.USER_DEFINED
    return write_gguf(path, name="qwq", vocab_size=1600, context_length=1024,
                      chat_template=template("Qwen-QwQ-32B"),
                      added_tokens=[(t, user) for t in ("<think>", "</think>")],
                      script=["▁so", "▁we", "</think>", "▁ok"])
