"""The WSGI layer: routing errors, content types, size limits, JSON errors, 500s."""

import json
import logging

import pytest
from support.apps import call

from localrt.app import MAX_BODY, create_app
from localrt.errors import BadRequest
from localrt.routing import Dialect, Route


def assert_error(resp, status, code=None):
    assert resp.status == status
    assert resp.headers["content-type"] == "application/json"
    body = resp.json
    assert isinstance(body["message"], str) and body["message"]
    assert body["error"]["message"] == body["message"]
    assert body["error"]["type"] and body["error"]["code"]
    if code:
        assert body["error"]["code"] == code
    return body


def test_healthz(api):
    resp = api("GET", "/healthz")
    assert resp.status == 200
    assert resp.json["status"] == "ok" and resp.json["version"]


def test_healthz_imports_no_engine(home):
    import subprocess
    import sys

    from support.servers import subprocess_env
    code = ("import sys, io; from localrt import settings, app;"
            "from support.apps import call;"
            "a = app.create_app(settings.load()); r = call(a, 'GET', '/healthz');"
            "assert r.status == 200;"
            "bad = [m for m in ('llama_cpp', 'onnxruntime_genai') if m in sys.modules];"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(home),
                         cwd=str(__import__('pathlib').Path(__file__).parent),
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_unknown_path_is_json_404(api):
    body = assert_error(api("GET", "/v1/nothing"), 404, "not_found")
    assert "/v1/nothing" in body["message"]


def test_wrong_method_is_405_with_allow(api):
    resp = api("DELETE", "/v1/configs")
    assert_error(resp, 405, "method_not_allowed")
    assert set(resp.headers["allow"].split(", ")) == {"GET", "HEAD", "PATCH"}


def test_head_has_no_body(api):
    resp = api("HEAD", "/v1/configs")
    assert resp.status == 200 and resp.body == b""


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x"])
def test_body_without_json_content_type_is_415(api, ctype):
    resp = api("PATCH", "/v1/configs", body=b'{"cors": false}', headers={"Content-Type": ctype})
    assert_error(resp, 415, "unsupported_media_type")
    assert api("GET", "/v1/configs").json["cors"] is True


def test_a_body_with_no_content_type_and_no_origin_is_read_as_json(api):
    # litellm's Ollama providers send JSON with no Content-Type; Ollama never looks
    resp = api("PATCH", "/v1/configs", body=b'{"cors": false}')
    assert resp.status == 200, resp.body
    assert api("GET", "/v1/configs").json["cors"] is False


def test_a_body_with_no_content_type_and_an_origin_is_still_415(api):
    # a browser sends Origin with every cross-site request: the check stands for them
    # (the page's own origin, so that the cross-origin check lets it through to this one)
    resp = api("PATCH", "/v1/configs", body=b'{"cors": false}',
               headers={"Origin": "http://127.0.0.1"})
    assert_error(resp, 415, "unsupported_media_type")
    assert "got none" in resp.json["message"]
    assert api("GET", "/v1/configs").json["cors"] is True


@pytest.mark.parametrize("path", ["/api/chat", "/v1/chat/completions", "/v1/messages",
                                  "/v1/responses", "/v1/models/import"])
def test_a_body_with_no_content_type_that_is_not_json_is_a_400(api, path):
    resp = api("POST", path, body=b"model=tiny&prompt=hi")
    assert resp.status == 400, resp.body


def test_cross_site_form_post_without_body_is_415(api):
    resp = api("DELETE", "/v1/system", body=b"",
                headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert_error(resp, 415)


def test_json_content_type_with_charset_is_accepted(api):
    resp = api("PATCH", "/v1/configs", body=b'{"cors": false}',
                headers={"Content-Type": "application/json; charset=utf-8"})
    assert resp.status == 200


def test_body_over_limit_is_413(api):
    big = json.dumps({"no_proxy": "x" * MAX_BODY}).encode()
    assert_error(api("PATCH", "/v1/configs", body=big,
                      headers={"Content-Type": "application/json"}), 413, "payload_too_large")


@pytest.mark.parametrize("raw", [b"{", b'{"cors": tru}', b"\xff\xfe", b'{"cors": NaN}',
                                 b"\n\n", b" "])
def test_malformed_json_is_400(api, raw):
    body = assert_error(api("PATCH", "/v1/configs", body=raw,
                             headers={"Content-Type": "application/json"}), 400, "invalid_json")
    assert "JSON" in body["message"] or "UTF-8" in body["message"]


def test_body_on_a_route_that_takes_none_is_400(api):
    assert_error(api("GET", "/v1/configs", json_body={"a": 1}), 400)


def test_unexpected_exception_is_generic_500_and_logged(settings, caplog):
    def boom(services, request):
        raise RuntimeError("secret internals")

    app = create_app(settings, routes=(Route("GET", "/boom", boom),))
    with caplog.at_level(logging.ERROR):
        resp = call(app, "GET", "/boom")
    body = assert_error(resp, 500, "internal_error")
    assert "secret internals" not in resp.body.decode()
    assert "Traceback" not in resp.body.decode()
    assert "secret internals" in caplog.text and "RuntimeError" in caplog.text
    assert body["message"]


def test_a_dialects_routes_answer_errors_in_its_shape(settings):
    """Routing, validation, handler and unexpected errors under a dialect's prefix all
    take its shape; other routes keep localrt's."""
    def bad(services, request):
        raise BadRequest("no good", param="x")

    def boom(services, request):
        raise RuntimeError("secret internals")

    shape = Dialect("/other/", lambda err: {"message": f"{err.status}: {err.message}"},
                    "message")  # the shape replies.json calls "message"
    app = create_app(settings, routes=(Route("GET", "/other/bad", bad),
                                       Route("GET", "/other/boom", boom),
                                       Route("GET", "/mine", bad)), dialects=(shape,))
    assert call(app, "GET", "/other/bad").json == {"message": "400: no good"}
    boom = call(app, "GET", "/other/boom").json["message"]
    assert boom.startswith("500: ") and "secret" not in boom
    missing = call(app, "GET", "/other/nothing")
    assert missing.status == 404 and missing.json["message"].startswith("404: ")
    assert call(app, "POST", "/other/bad").json["message"].startswith("405: ")
    assert call(app, "GET", "/mine").json["error"]["param"] == "x"


def test_two_apps_in_one_process_are_independent(tmp_path):
    from localrt import settings as settings_mod
    a = create_app(settings_mod.load(environ={"HOME": str(tmp_path / "a")}))
    b = create_app(settings_mod.load(environ={"HOME": str(tmp_path / "b")}))
    assert call(a, "PATCH", "/v1/configs", json_body={"cors": False}).status == 200
    assert call(a, "GET", "/v1/configs").json["cors"] is False
    assert call(b, "GET", "/v1/configs").json["cors"] is True


def test_stop_without_a_server_is_a_clear_error(api):
    assert_error(api("DELETE", "/v1/system"), 409)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:39281", "localhost:8080",
                                  "LOCALHOST", "[::1]:39281", "::1", "app.localhost:1",
                                  "127.1.2.3"])
def test_loopback_host_headers_are_served(api, host):
    assert api("GET", "/healthz", headers={"Host": host}).status == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:39281", "10.0.0.5",
                                  "127.0.0.1.evil.example", "localhost.evil.example:1"])
def test_other_host_headers_are_refused_on_loopback(api, host):
    """DNS rebinding: a page whose name now points at 127.0.0.1 still sends its own name."""
    r = api("POST", "/v1/models/pull", {"model": "x"}, headers={"Host": host})
    assert r.status == 403 and r.json["error"]["code"] == "forbidden"
    assert "loopback" in r.json["message"]


def test_a_server_bound_elsewhere_takes_any_host(home):
    from localrt import settings as settings_mod

    settings = settings_mod.load(environ={"HOME": str(home)})
    settings.override(apiServerHost="0.0.0.0")
    app = create_app(settings)
    assert call(app, "GET", "/healthz", headers={"Host": "box.lan:39281"}).status == 200
