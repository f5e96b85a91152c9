"""CORS (issue: foundation, part 5). Changes apply without a restart."""

import pytest
from test_app import assert_error

ALLOWED = "http://localhost:39281"


def test_allowed_origin_gets_acao_and_vary(api):
    resp = api("GET", "/v1/configs", headers={"Origin": ALLOWED})
    assert resp.status == 200
    assert resp.headers["access-control-allow-origin"] == ALLOWED
    assert "Origin" in resp.headers["vary"]


def test_errors_carry_cors_headers_too(api):
    resp = api("GET", "/v1/none", headers={"Origin": ALLOWED})
    assert resp.status == 404
    assert resp.headers["access-control-allow-origin"] == ALLOWED


def test_disallowed_origin_gets_no_acao(api):
    resp = api("GET", "/v1/configs", headers={"Origin": "http://evil.example"})
    assert resp.status == 200
    assert "access-control-allow-origin" not in resp.headers


def test_preflight_allowed(api):
    resp = api("OPTIONS", "/v1/configs", headers={
        "Origin": ALLOWED, "Access-Control-Request-Method": "PATCH",
        "Access-Control-Request-Headers": "content-type"})
    assert resp.status == 204 and resp.body == b""
    assert resp.headers["access-control-allow-origin"] == ALLOWED
    methods = resp.headers["access-control-allow-methods"].split(", ")
    assert {"GET", "PATCH"} <= set(methods)
    assert "content-type" in resp.headers["access-control-allow-headers"].lower()


def test_preflight_disallowed_is_403(api):
    resp = api("OPTIONS", "/v1/configs", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "PATCH"})
    assert_error(resp, 403)
    assert "access-control-allow-origin" not in resp.headers


def test_preflight_on_unknown_path_is_404(api):
    resp = api("OPTIONS", "/v1/nothing", headers={
        "Origin": ALLOWED, "Access-Control-Request-Method": "GET"})
    assert_error(resp, 404)


def test_star_allows_any_origin(api):
    assert api("PATCH", "/v1/configs", json_body={"allowed_origins": ["*"]}).status == 200
    resp = api("GET", "/v1/configs", headers={"Origin": "https://anything.example"})
    assert resp.headers["access-control-allow-origin"] == "https://anything.example"


def test_changes_apply_at_once(api):
    origin = "http://localhost:3000"
    assert "access-control-allow-origin" not in api(
        "GET", "/v1/configs", headers={"Origin": origin}).headers
    api("PATCH", "/v1/configs", json_body={"allowed_origins": [origin]})
    assert api("GET", "/v1/configs", headers={"Origin": origin}).headers[
        "access-control-allow-origin"] == origin
    assert "access-control-allow-origin" not in api(
        "GET", "/v1/configs", headers={"Origin": ALLOWED}).headers


@pytest.mark.parametrize("origins", [[ALLOWED], ["*"]])
def test_cors_off_sends_no_cors_headers_at_all(api, origins):
    api("PATCH", "/v1/configs", json_body={"cors": False, "allowed_origins": origins})
    for method, headers in (("GET", {"Origin": ALLOWED}),
                            ("OPTIONS", {"Origin": ALLOWED,
                                         "Access-Control-Request-Method": "PATCH"})):
        resp = api(method, "/v1/configs", headers=headers)
        assert not any(h.startswith("access-control-") for h in resp.headers), resp.headers
        assert "vary" not in resp.headers


def test_cross_site_unsafe_requests_without_preflight_are_refused(api):
    # A form or a no-body fetch() from another site needs no preflight.
    for headers in ({"Origin": "http://evil.example"}, {"Origin": "null"}):
        resp = api("POST", "/v1/models/tiny/pull", headers=headers)
        assert resp.status == 403 and "allowed_origins" in resp.json["message"]
    resp = api("DELETE", "/v1/system", headers={"Origin": "http://evil.example"})
    assert resp.status == 403
    api("PATCH", "/v1/configs", json_body={"cors": False})
    resp = api("POST", "/v1/models/tiny/pull", headers={"Origin": ALLOWED})
    assert resp.status == 403  # with cors off no other origin may act


def test_same_origin_and_allowed_origins_may_act(api):
    resp = api("PATCH", "/v1/configs", json_body={"cors": True},
                headers={"Origin": ALLOWED})
    assert resp.status == 200
    resp = api("PATCH", "/v1/configs", json_body={"cors": True},
                headers={"Origin": "http://127.0.0.1", "Host": "127.0.0.1"})
    assert resp.status == 200
