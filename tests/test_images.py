"""Images in requests: localrt.inference.media and the dialects' translations.

Every shape a client sends (OpenAI's image_url part, Anthropic's image block, Ollama's
images, Responses' input_image) becomes contract.Image parts, checked before any
compute: data: URLs, http(s) URLs fetched from a real server on 127.0.0.1 (let in by
imageUrlHosts), sizes, counts and first bytes, each error naming the part in the
client's own terms, in its dialect's error shape, through the real SDK clients. A
vision model is support.vision's tiny random pair, imported with its mmproj.
"""

from __future__ import annotations

import base64
import http.server
import json
import threading
import time
from types import SimpleNamespace

import anthropic
import ollama
import openai
import pytest
from support.apps import bind
from support.servers import send
from support.vision import bmp, gif, jpeg, png, write_vision_pair

from localrt.engines.contract import Image
from localrt.errors import (AudioNotSupported, ImagesNotSupported, ImageTooLarge, InvalidField,
                            InvalidImage)
from localrt.inference import media as images
from localrt.dialects.openai import read_chat
from localrt.inference.chat import Chats
from localrt.inference.media import (MAX_BYTES, ImageFetchFailed, Images, ImageURLRefused,
                                      Policy)

PNG = png(8, 8, 0)
NOT_AN_IMAGE = b"GIF is what this is not"
ASK = "What is in the picture?"


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


DIRECT = {"proxy_url": "", "proxy_username": "", "proxy_password": "", "no_proxy": "",
          "verify_host_ssl": True, "verify_peer_ssl": True}


def reader(*hosts, fetch=True, resolve=None) -> Images:
    return Images(lambda: DIRECT, lambda: Policy(fetch, tuple(hosts), 8), resolve)


# --- a server of images on 127.0.0.1 ---------------------------------------------------


class ImageServer(http.server.ThreadingHTTPServer):
    daemon_threads = True


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # a body without Content-Length ends with the connection

    def log_message(self, *args):
        pass

    def do_GET(self):
        port = self.server.server_address[1]
        path = self.path
        try:
            if path == "/a.png":
                self._send(200, PNG, "image/png")
            elif path == "/text":
                self._send(200, NOT_AN_IMAGE, "text/plain")
            elif path == "/missing":
                self._send(404, b"no", "text/plain")
            elif path == "/to-a":
                self._redirect("/a.png")
            elif path == "/to-refused":  # loopback too, but not what the test allows
                self._redirect(f"http://127.0.0.2:{port}/a.png")
            elif path == "/loop":
                self._redirect("/loop")
            elif path == "/big-said":  # says its size, past the limit
                self.send_response(200)
                self.send_header("Content-Length", str(MAX_BYTES + 1))
                self.end_headers()
                self.wfile.write(PNG)
            elif path == "/big-unsaid":  # no Content-Length: the limit counts the bytes
                self.send_response(200)
                self.end_headers()
                self.wfile.write(PNG)
                block = b"\0" * (1 << 20)
                for _ in range(MAX_BYTES // len(block) + 2):
                    self.wfile.write(block)
            elif path == "/slow":
                self.send_response(200)
                self.end_headers()
                self.wfile.write(PNG)
                self.wfile.flush()
                time.sleep(3)
            else:
                self._send(404, b"", "text/plain")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped reading: what the limits do

    def _send(self, status: int, body: bytes, kind: str):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str):
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture(scope="module")
def pictures():
    server = ImageServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


# --- data: URLs and bytes ----------------------------------------------------------------


def test_data_urls_give_their_bytes_and_malformed_ones_name_the_part():
    read = reader().read
    where = "messages[0].content[1]"
    for data in (PNG, jpeg(16, 16, 0), bmp(8, 8, 0), gif(8, 8)):
        assert read(data_url(data), where) == Image(data, where)
    assert read("data:;base64," + b64(PNG).rstrip("="), where).data == PNG  # no padding
    assert read("data:image/png;base64," + b64(PNG).replace("A", "\nA", 1), where).data == PNG
    for bad, says in (("data:image/png;base64", "no comma"),
                      ("data:image/png;base64,!!!notbase64", "not valid base64"),
                      ("data:text/plain;base64," + b64(PNG), "not an image"),
                      ("data:image/png;base64,", "no bytes"),
                      (data_url(NOT_AN_IMAGE), "not an image llama.cpp reads"),
                      ("ftp://example.invalid/a.png", "data: URL or http(s)"),
                      ("", "expected an image URL")):
        with pytest.raises(InvalidImage) as err:
            read(bad, where)
        assert err.value.param == where and f"'{where}'" in err.value.message
        assert says in err.value.message and err.value.status == 400


def test_an_image_past_20_mib_is_a_413_naming_the_part():
    where = "messages[2].content[0]"
    big = PNG + b"\0" * (MAX_BYTES + 1 - len(PNG))
    with pytest.raises(ImageTooLarge) as err:
        reader().read(data_url(big), where)
    assert err.value.status == 413 and err.value.code == "image_too_large"
    assert err.value.param == where and where in err.value.message
    exact = PNG + b"\0" * (MAX_BYTES - len(PNG))
    assert len(reader().read(data_url(exact), where).data) == MAX_BYTES


# --- fetches -----------------------------------------------------------------------------


@pytest.mark.live
def test_a_loopback_url_is_fetched_only_when_image_url_hosts_allows_it(pictures):
    where = "messages[0].content[0]"
    url = pictures + "/a.png"
    with pytest.raises(ImageURLRefused) as err:
        reader().read(url, where)
    assert err.value.status == 400 and err.value.param == where
    assert url in err.value.message and "imageUrlHosts" in err.value.message
    for hosts in (["127.0.0.0/8"], ["127.0.0.1"], ["10.0.0.0/8", "127.0.0.1/32"]):
        assert reader(*hosts).read(url, where) == Image(PNG, where)
    # a name: its addresses are let in with it
    localhost = url.replace("127.0.0.1", "localhost")
    with pytest.raises(ImageURLRefused):
        reader("127.0.0.2").read(localhost, where)
    assert reader("localhost").read(localhost, where).data == PNG


@pytest.mark.live
def test_each_redirect_is_checked_again(pictures):
    where = "messages[0].content[0]"
    assert reader("127.0.0.1").read(pictures + "/to-a", where).data == PNG
    with pytest.raises(ImageURLRefused) as err:
        reader("127.0.0.1").read(pictures + "/to-refused", where)
    assert "127.0.0.2" in err.value.message
    with pytest.raises(ImageFetchFailed) as err:
        reader("127.0.0.1").read(pictures + "/loop", where)
    assert "redirects" in err.value.message


@pytest.mark.live
def test_the_connected_address_is_checked_not_only_the_first_resolution(pictures):
    """A name that resolves to a public address for the check and to loopback for the
    connection (DNS rebinding) is refused at the connection."""
    where = "messages[0].content[0]"
    import ipaddress

    public = Images(lambda: DIRECT, lambda: Policy(),
                    lambda host, port: [ipaddress.ip_address("93.184.216.34")])
    url = pictures.replace("127.0.0.1", "localhost") + "/a.png"
    with pytest.raises(ImageURLRefused) as err:
        public.read(url, where)
    assert "127.0.0.1" in err.value.message or "::1" in err.value.message


@pytest.mark.live
def test_fetch_failures_are_400s_naming_the_part_and_the_url(pictures, monkeypatch):
    where = "messages[1].content[2]"
    allowed = reader("127.0.0.1")
    for path, says in (("/missing", "404"), ("/text", "not an image")):
        with pytest.raises(InvalidField) as err:
            allowed.read(pictures + path, where)
        assert err.value.status == 400 and err.value.param == where and says in \
            err.value.message
    with pytest.raises(ImageFetchFailed) as err:
        allowed.read("http://images.example.invalid/a.png", where)
    assert "images.example.invalid" in err.value.message and ".invalid" in err.value.message
    monkeypatch.setattr(images, "FETCH_TIMEOUT", 1.0)
    began = time.monotonic()
    with pytest.raises(ImageFetchFailed) as err:
        allowed.read(pictures + "/slow", where)
    assert time.monotonic() - began < 2.5 and "1 s" in err.value.message


@pytest.mark.live
def test_a_fetched_image_past_20_mib_is_a_413(pictures):
    for path in ("/big-said", "/big-unsaid"):
        with pytest.raises(ImageTooLarge) as err:
            reader("127.0.0.1").read(pictures + path, "messages[0].content[0]")
        assert err.value.status == 413


@pytest.mark.live
def test_image_url_fetch_false_refuses_every_http_url(pictures):
    with pytest.raises(ImageURLRefused) as err:
        reader("127.0.0.1", fetch=False).read(pictures + "/a.png", "messages[0].content[0]")
    assert "imageUrlFetch" in err.value.message
    assert reader(fetch=False).read(data_url(PNG), "x").data == PNG  # data: URLs still


def test_image_url_hosts_entries():
    import ipaddress

    ip = ipaddress.ip_address
    assert images.allowed("cdn.example", ip("10.1.2.3"), ["10.0.0.0/8"])
    assert images.allowed("cdn.internal.example", ip("10.1.2.3"), [".internal.example"])
    assert images.allowed("CDN.example.", ip("10.1.2.3"), ["cdn.example"])
    assert not images.allowed("cdn.example", ip("10.1.2.3"), ["192.168.0.0/16", "other"])
    assert not images.public(ip("::ffff:127.0.0.1")) and not images.public(ip("169.254.1.1"))
    assert not images.public(ip("0.0.0.0")) and not images.public(ip("224.0.0.1"))
    assert not images.public(ip("100.64.0.1")) and images.public(ip("93.184.216.34"))


# --- the normalization: chat's messages with Image parts --------------------------------


def test_a_vision_models_messages_carry_image_parts_in_order():
    chats = Chats(SimpleNamespace(queue=None), images=reader())
    files = [{"path": "seer.gguf", "size": 1}, {"path": "mmproj-seer.gguf", "size": 1}]
    local = SimpleNamespace(model_id="seer", record={"id": "seer", "engine": "gguf-cpp",
                                                     "files": files,
                                                     "mmproj": "mmproj-seer.gguf"})
    other = png(8, 8, 1)
    body = {"model": "seer", "messages": [
        {"role": "system", "content": "Look closely."},
        {"role": "user", "content": [
            {"type": "text", "text": ASK},
            {"type": "image_url", "image_url": {"url": data_url(PNG), "detail": "high"}},
            {"type": "text", "text": "And this one?"},
            {"type": "image_url", "image_url": data_url(other)}]},
        {"role": "assistant", "content": "Two squares."},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "text", "text": "b"}]}]}
    messages = chats.messages(local, read_chat(body))
    assert messages[1]["content"] == [
        {"type": "text", "text": ASK},
        {"type": "image", "image": Image(PNG, "messages[1].content[1]")},
        {"type": "text", "text": "And this one?"},
        {"type": "image", "image": Image(other, "messages[1].content[3]")}]
    assert messages[0]["content"] == "Look closely." and messages[3]["content"] == "a\nb"
    plain = SimpleNamespace(model_id="plain", record={"id": "plain", "engine": "gguf-cpp",
                                                      "files": files[:1]})
    with pytest.raises(ImagesNotSupported) as err:
        chats.messages(plain, read_chat(body))
    assert "plain" in err.value.message and err.value.code == "images_not_supported"
    assert chats.messages(plain, read_chat({"model": "plain", "messages": body["messages"][3:]}))[
        0]["content"] == "a\nb"
    many = {"model": "seer", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}] * 9}]}
    with pytest.raises(InvalidField) as err:  # counted before any is read
        chats.messages(local, read_chat(many))
    assert err.value.param == "messages[0].content[8]" and "8" in err.value.message


# --- through the app: a vision model ----------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_vision_pair(tmp_path_factory.mktemp("vision"))


@pytest.fixture
def seer(app, settings, pair):
    """The app with the pair imported as `seer`, a vision model; imageUrlHosts lets the
    module's image server (127.0.0.1) in."""
    api = bind(app)
    r = api("POST", "/v1/models/import", {"path": str(pair[0]), "id": "seer",
                                          "mmproj": str(pair[1])})
    assert r.status == 200, r.body
    settings.update({"imageUrlHosts": ["127.0.0.1"]})
    return api


def chat(api, *parts, model="seer", **extra):
    return api("POST", "/v1/chat/completions", {
        "model": model, "max_tokens": 6, "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": ASK}, *parts]}],
        **extra})


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.live
def test_a_vision_model_answers_an_image_from_a_data_url_and_from_its_url(seer, pictures):
    assert seer("GET", "/v1/models/seer").json["capabilities"] == ["chat", "vision"]
    given = chat(seer, image_part(data_url(PNG)))
    assert given.status == 200, given.body
    fetched = chat(seer, image_part(pictures + "/a.png"))
    assert fetched.status == 200, fetched.body
    assert fetched.json["choices"][0]["message"] == given.json["choices"][0]["message"]
    show = seer("POST", "/api/show", {"model": "seer"})
    assert show.json["capabilities"][:2] == ["completion", "vision"]


@pytest.mark.live
def test_every_check_is_a_clear_error_before_the_model_starts(seer, settings, pictures):
    big = PNG + b"\0" * (MAX_BYTES + 1 - len(PNG))
    cases = [
        (chat(seer, image_part(data_url(big))), 413, "image_too_large"),
        (chat(seer, image_part(data_url(NOT_AN_IMAGE))), 400, "invalid_image"),
        (chat(seer, image_part("data:image/png;base64")), 400, "invalid_image"),
        (chat(seer, image_part(pictures + "/big-said")), 413, "image_too_large"),
        (chat(seer, image_part(pictures + "/to-refused")), 400, "image_url_refused"),
        (chat(seer, image_part(pictures + "/missing")), 400, "image_fetch_failed"),
        (chat(seer, *[image_part(data_url(PNG))] * 9), 400, "invalid_field"),
    ]
    for r, status, code in cases:
        assert (r.status, r.json["error"]["code"]) == (status, code), r.body
        assert r.json["error"]["param"].startswith("messages[0].content[")
    settings.update({"imageUrlFetch": False})
    r = chat(seer, image_part(pictures + "/a.png"))
    assert (r.status, r.json["error"]["code"]) == (400, "image_url_refused")
    assert "imageUrlFetch" in r.json["error"]["message"]
    settings.update({"imageUrlFetch": True, "maxImagesPerRequest": 1, "imageUrlHosts": []})
    r = chat(seer, image_part(data_url(PNG)), image_part(data_url(PNG)))
    assert (r.status, r.json["error"]["param"]) == (400, "messages[0].content[2]")
    r = chat(seer, image_part(pictures + "/a.png"))
    assert (r.status, r.json["error"]["code"]) == (400, "image_url_refused")
    assert seer("GET", "/v1/models/status").json["data"] == []  # nothing was started


def test_each_dialect_names_the_part_as_its_client_sent_it(seer):
    bad = b64(NOT_AN_IMAGE)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(PNG)}}
    wrong = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": bad}}
    r = seer("POST", "/v1/messages", {"model": "seer", "max_tokens": 4, "system": "Be brief.",
                                      "messages": [
        {"role": "user", "content": [{"type": "text", "text": ASK}, image]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "look",
                                           "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a",
             "content": [{"type": "text", "text": "seen"}, image, wrong]}]}]})
    assert r.status == 400 and r.json["type"] == "error", r.body
    assert "'messages[2].content[0].content[2]'" in r.json["error"]["message"]
    r = seer("POST", "/v1/messages/count_tokens", {"model": "seer", "messages": [
        {"role": "user", "content": [image, wrong]}]})
    assert r.status == 400 and "'messages[0].content[1]'" in r.json["error"]["message"]
    r = seer("POST", "/api/chat", {"model": "seer", "stream": False, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": ASK, "images": [b64(PNG), bad]}]})
    assert r.status == 400 and "'messages[2].images[1]'" in r.json["error"], r.body
    r = seer("POST", "/api/generate", {"model": "seer", "prompt": ASK, "system": "Be brief.",
                                       "images": [bad], "stream": False})
    assert r.status == 400 and "'images[0]'" in r.json["error"], r.body
    r = seer("POST", "/v1/responses", {"model": "seer", "instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": ASK},
                                     {"type": "input_image", "image_url": data_url(PNG)},
                                     {"type": "input_image",
                                      "image_url": "data:image/png;base64," + bad}]}]})
    assert (r.status, r.json["error"]["param"]) == (400, "input[0].content[2]"), r.body
    assert seer("GET", "/v1/models/status").json["data"] == []


@pytest.mark.live
def test_every_dialect_gives_a_vision_model_its_images(seer):
    """The same image and prompt, greedy, is the same reply whichever API sends it."""
    want = chat(seer, image_part(data_url(PNG)))
    assert want.status == 200, want.body
    text = want.json["choices"][0]["message"]["content"]
    r = seer("POST", "/v1/messages", {"model": "seer", "max_tokens": 6, "temperature": 0,
                                      "messages": [{"role": "user", "content": [
        {"type": "text", "text": ASK},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": b64(PNG)}}]}]})
    assert r.status == 200 and "".join(b["text"] for b in r.json["content"]) == text, r.body
    r = seer("POST", "/v1/responses", {"model": "seer", "max_output_tokens": 6,
                                       "temperature": 0, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": ASK},
                                     {"type": "input_image", "image_url": data_url(PNG),
                                      "detail": "auto"}]}]})
    assert r.status == 200 and r.json["output"][0]["content"][0]["text"] == text, r.body
    counted = seer("POST", "/v1/messages/count_tokens", {"model": "seer", "messages": [
        {"role": "user", "content": [{"type": "text", "text": ASK}, {
            "type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": b64(PNG)}}]}]})
    assert counted.status == 200 and \
        counted.json["input_tokens"] == want.json["usage"]["prompt_tokens"]


# --- a text-only model, through each SDK -------------------------------------------------


def test_a_text_model_refuses_images_in_every_dialects_shape(thread_server, quantized):
    url = thread_server.url
    status, body = send(url, "POST", "/v1/models/import", {"path": str(quantized["Q8_0"]),
                                                            "id": "plain"})
    assert status == 200, body
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="plain", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": ASK},
                                         image_part(data_url(PNG))]}])
    assert err.value.code == "images_not_supported" and "plain" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="plain", input=[{"role": "user", "content": [
            {"type": "input_text", "text": ASK},
            {"type": "input_image", "image_url": data_url(PNG), "detail": "auto"}]}])
    assert err.value.code == "images_not_supported"
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as claude:
        with pytest.raises(anthropic.BadRequestError) as err:
            claude.messages.create(model="plain", max_tokens=4, messages=[
                {"role": "user", "content": [
                    {"type": "image", "source": {"type": "url",
                                                 "url": "http://x.example.invalid/a.png"}},
                    {"type": "text", "text": ASK}]}])
        assert err.value.body["type"] == "error"
        assert err.value.body["error"]["type"] == "invalid_request_error"
        assert "plain does not take images" in err.value.body["error"]["message"]
    with ollama.Client(host=url, timeout=60) as local:
        for call in (lambda: local.chat(model="plain", messages=[
                         {"role": "user", "content": ASK, "images": [PNG]}]),
                     lambda: local.generate(model="plain", prompt=ASK, images=[PNG])):
            with pytest.raises(ollama.ResponseError) as err:
                call()
            assert err.value.status_code == 400 and "plain does not take images" in \
                err.value.error
        assert "vision" not in local.show("plain").capabilities
    status, body = send(url, "GET", "/v1/models/status")
    assert body["data"] == []  # refused before the model started


# --- a remote model: its upstream gets the images as they came ---------------------------


class _Upstream(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self._json({"object": "list", "data": [{"id": "up", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        if body.get("stream"):
            chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                     "model": "up", "choices": [{"index": 0, "delta": {"content": "a square"},
                                                 "finish_reason": "stop"}]}
            data = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self._json({"id": "chatcmpl-1", "object": "chat.completion", "created": 1,
                    "model": "up", "choices": [{"index": 0, "finish_reason": "stop",
                                                "message": {"role": "assistant",
                                                            "content": "a square"}}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})

    def _json(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.mark.live
def test_a_remote_models_upstream_gets_the_image_parts_as_they_came(api):
    upstream = ImageServer(("127.0.0.1", 0), _Upstream)
    upstream.bodies = []
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        r = api("POST", "/v1/models/remote", {"id": "far", "upstreams": [
            {"url": f"http://127.0.0.1:{upstream.server_address[1]}/v1", "model": "up"}]})
        assert r.status == 200, r.body
        parts = [{"type": "text", "text": ASK},
                 {"type": "image_url", "image_url": {"url": "http://10.0.0.1/a.png",
                                                     "detail": "low"}}]
        r = api("POST", "/v1/chat/completions", {"model": "far", "messages": [
            {"role": "user", "content": parts}]})
        assert r.status == 200, r.body
        assert upstream.bodies[-1]["messages"][0]["content"] == parts
        r = api("POST", "/api/chat", {"model": "far", "stream": False, "messages": [
            {"role": "user", "content": ASK, "images": [b64(PNG)]}]})
        assert r.status == 200, r.body
        assert upstream.bodies[-1]["messages"][0]["content"] == [
            image_part(data_url(PNG)), {"type": "text", "text": ASK}]
    finally:
        upstream.shutdown()
        upstream.server_close()


def test_media_of_a_kind_the_model_does_not_take_is_refused_naming_the_part():
    from localrt import native

    image = native.Media(PNG, "image/png", "messages[0].content[0]")
    sound = native.Media(b"RIFF", "audio/wav", "messages[0].content[1]")
    assert images.check("seer", {"image"}, [image], images.Policy()) == 1
    with pytest.raises(ImagesNotSupported):
        images.check("plain", set(), [image], images.Policy())
    with pytest.raises(AudioNotSupported) as err:  # issue 36: a kind of its own now
        images.check("seer", {"image"}, [image, sound], images.Policy())
    assert err.value.param == "model" and "seer does not take audio" in err.value.message
    video = native.Media(b"\0\0\0\x18ftyp", "video/mp4", "messages[0].content[2]")
    with pytest.raises(InvalidField) as err:
        images.check("seer", {"image", "audio"}, [image, sound, video], images.Policy())
    assert err.value.param == "messages[0].content[2]" and "video/mp4" in err.value.message
    # a record says "vision" for images, "audio" for clips
    assert images.KINDS == {"image": "vision", "audio": "audio"}
