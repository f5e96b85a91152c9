"""litellm's `ollama/` and `ollama_chat/` providers against a real server (issue 37, item 2).

They post JSON to /api/generate and /api/chat with no Content-Type header; Ollama never
looks, and localrt reads such a body as JSON when no Origin came with it (a browser
sends Origin with every cross-site request, which stay refused). Each request is also
sent once more as a raw socket sees it, to show the header really is absent.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading

import pytest
from emulators.ggufgen import write_gguf
from support.servers import run_foreground_server, send

# litellm fetches a price list from GitHub at import unless told to use its own copy;
# tests never reach the internet.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
litellm = pytest.importorskip("litellm")  # a test dependency (setup.cfg's test extra)

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("litellm-home")
    weights = write_gguf(tmp_path_factory.mktemp("w") / "tiny.gguf", name="tiny")
    srv = run_foreground_server(home)
    try:
        status, body = send(srv.url, "POST", "/v1/models/import",
                            {"path": str(weights), "id": "tiny"})
        assert status == 200, body
        yield srv
    finally:
        srv.stop(sig=signal.SIGTERM)


class Recorder:
    """A loopback relay to the server that keeps each request's head, as sent."""

    def __init__(self, port: int):
        self.heads: list[bytes] = []
        self._target = port
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self._target))
        first = client.recv(65536)
        self.heads.append(first.split(b"\r\n\r\n", 1)[0])

        def pump(src, dst):
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        upstream.sendall(first)
        threading.Thread(target=pump, args=(upstream, client), daemon=True).start()
        pump(client, upstream)

    def close(self) -> None:
        self._sock.close()


@pytest.fixture
def relay(server):
    recorder = Recorder(server.port)
    yield recorder
    recorder.close()


@pytest.mark.parametrize("provider, path", [("ollama", "/api/generate"),
                                            ("ollama_chat", "/api/chat")])
@pytest.mark.parametrize("stream", [False, True])
def test_litellms_ollama_providers_get_an_answer(relay, provider, path, stream):
    reply = litellm.completion(model=f"{provider}/tiny", api_base=relay.url, stream=stream,
                               messages=[{"role": "user", "content": "Say hello."}],
                               max_tokens=8, temperature=0)
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in reply)
    else:
        text = reply.choices[0].message.content
    assert text
    heads = [h for h in relay.heads if h.startswith(b"POST " + path.encode())]
    assert heads, relay.heads
    # litellm really sends these with no Content-Type: the case the server now reads
    assert all(b"\r\ncontent-type:" not in h.lower() for h in heads), heads


def _raw(server, path: str, body: bytes, headers: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.putrequest("POST", path)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            conn.putheader(name, value)
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.parametrize("path, body", [
    ("/api/chat", {"model": "tiny", "stream": False, "options": {"num_predict": 4},
                   "messages": [{"role": "user", "content": "hi"}]}),
    ("/api/generate", {"model": "tiny", "stream": False, "prompt": "hi",
                       "options": {"num_predict": 4}}),
    ("/v1/chat/completions", {"model": "tiny", "max_tokens": 4,
                              "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4,
                      "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": "tiny", "max_output_tokens": 4, "input": "hi"}),
])
def test_every_dialect_reads_an_untyped_json_body_and_refuses_it_with_an_origin(
        server, path, body):
    data = json.dumps(body).encode()
    status, reply = _raw(server, path, data, {})
    assert status == 200, reply
    origin = f"http://127.0.0.1:{server.port}"  # the page's own origin: past the CORS check
    status, reply = _raw(server, path, data, {"Origin": origin})
    assert status == 415, reply
