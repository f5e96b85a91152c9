"""GET and PATCH /v1/configs (spec 2.1, rows 1-2, rule 1)."""

import json
import threading

import jsonschema
import pytest
import yaml
from test_app import assert_error

from localrt import schemas

FIELDS = {"allowed_origins", "cors", "modelhub_token", "no_proxy", "proxy_url",
          "proxy_username", "proxy_password", "verify_host_ssl", "verify_peer_ssl",
          "verify_proxy_host_ssl", "verify_proxy_ssl"}


def test_defaults(api):
    resp = api("GET", "/v1/configs")
    assert resp.status == 200 and resp.headers["content-type"] == "application/json"
    config = resp.json
    assert set(config) == FIELDS
    jsonschema.validate(config, schemas.load("config.json"))
    assert config["allowed_origins"] == ["http://localhost:39281", "http://127.0.0.1:39281",
                                         "http://0.0.0.0:39281"]
    assert config["cors"] is True
    assert config["no_proxy"] == "localhost,127.0.0.1,::1"
    for name in ("modelhub_token", "proxy_url", "proxy_username", "proxy_password"):
        assert config[name] == ""
    for name in ("verify_host_ssl", "verify_peer_ssl", "verify_proxy_host_ssl",
                 "verify_proxy_ssl"):
        assert config[name] is True


def test_default_origins_follow_the_port(home):
    from support.apps import call

    from localrt import settings as settings_mod
    from localrt.app import create_app
    (home / ".localrtrc").write_text("apiServerPort: 4123\n")
    config = call(create_app(settings_mod.load()), "GET", "/v1/configs").json
    assert config["allowed_origins"][0] == "http://localhost:4123"


def test_patch_changes_only_given_fields_and_persists(api, home):
    before = api("GET", "/v1/configs").json
    resp = api("PATCH", "/v1/configs", json_body={"cors": False, "proxy_url": "http://p:3128"})
    assert resp.status == 200
    assert resp.json["message"] == "Configuration updated successfully"
    after = resp.json["config"]
    assert after == {**before, "cors": False, "proxy_url": "http://p:3128"}
    assert api("GET", "/v1/configs").json == after
    rc = yaml.safe_load((home / ".localrtrc").read_text())
    assert rc["cors"] is False and rc["proxyUrl"] == "http://p:3128"


def test_patch_every_field(api):
    change = {"allowed_origins": ["https://app.example:8443", "*"], "cors": False,
              "modelhub_token": "hf_abc", "no_proxy": "example.com,.internal",
              "proxy_url": "http://proxy.example:3129", "proxy_username": "u",
              "proxy_password": "p@ss word", "verify_host_ssl": False, "verify_peer_ssl": False,
              "verify_proxy_host_ssl": False, "verify_proxy_ssl": False}
    assert api("PATCH", "/v1/configs", json_body=change).json["config"] == change
    assert api("GET", "/v1/configs").json == change


def test_empty_patch_changes_nothing(api):
    before = api("GET", "/v1/configs").json
    resp = api("PATCH", "/v1/configs", json_body={})
    assert resp.status == 200 and resp.json["config"] == before


@pytest.mark.parametrize("body, field", [
    ({"cors": "yes"}, "cors"),
    ({"cors": "true"}, "cors"),
    ({"verify_peer_ssl": 1}, "verify_peer_ssl"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"cors": False, "bogus": True}, "bogus"),
    ({"allowed_origins": "http://a:1"}, "allowed_origins"),
    ({"allowed_origins": ["http://ok:1", "not an origin"]}, "allowed_origins[1]"),
    ({"allowed_origins": ["http://ok:1/path"]}, "allowed_origins[0]"),
    ({"allowed_origins": [3]}, "allowed_origins[0]"),
    ({"proxy_url": "ftp://proxy:21"}, "proxy_url"),
    ({"proxy_url": "https://proxy:3129"}, "proxy_url"),
    ({"proxy_url": "proxy:3128"}, "proxy_url"),
    ({"proxy_url": None}, "proxy_url"),
    ({"modelhub_token": 5}, "modelhub_token"),
])
def test_invalid_input_is_400_naming_the_field_and_changes_nothing(api, home, body, field):
    rc = home / ".localrtrc"
    before_file = rc.read_bytes()
    before = api("GET", "/v1/configs").json
    resp = api("PATCH", "/v1/configs", json_body=body)
    err = assert_error(resp, 400, "invalid_field")
    assert f"'{field}'" in err["message"]
    assert err["error"]["param"] == field
    assert api("GET", "/v1/configs").json == before
    assert rc.read_bytes() == before_file


@pytest.mark.parametrize("body", [[], "cors", 1, None])
def test_body_must_be_an_object(api, body):
    resp = api("PATCH", "/v1/configs", body=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"})
    assert_error(resp, 400)


@pytest.mark.parametrize("origin", ["*", "http://localhost:3000", "https://app.example.com",
                                    "http://[::1]:39281", "app://local"])
def test_valid_origins(api, origin):
    assert api("PATCH", "/v1/configs", json_body={"allowed_origins": [origin]}).status == 200


def test_concurrent_patches_of_different_fields_are_all_kept(live_server):
    import urllib.request
    fields = {"proxy_username": "u", "proxy_password": "p", "modelhub_token": "t",
              "no_proxy": "a,b", "proxy_url": "http://x:1", "cors": False,
              "verify_host_ssl": False, "verify_peer_ssl": False}
    barrier = threading.Barrier(len(fields))
    errors = []

    def patch(name, value):
        req = urllib.request.Request(live_server.url + "/v1/configs", method="PATCH",
                                     data=json.dumps({name: value}).encode(),
                                     headers={"Content-Type": "application/json"})
        barrier.wait()
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.status == 200
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=patch, args=item) for item in fields.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    with urllib.request.urlopen(live_server.url + "/v1/configs") as r:
        config = json.loads(r.read())
    for name, value in fields.items():
        assert config[name] == value
    rc = yaml.safe_load(live_server.settings.path.read_text())
    assert rc["proxyUsername"] == "u" and rc["verifyPeerSsl"] is False and rc["cors"] is False


def test_patch_while_rc_is_corrupt_is_a_clear_409_and_leaves_it(api, home):
    rc = home / ".localrtrc"
    rc.write_text("cors: [oops\n")
    body = assert_error(api("PATCH", "/v1/configs", json_body={"cors": False}), 409)
    assert str(rc) in body["message"] and "Nothing was changed" in body["message"]
    assert rc.read_text() == "cors: [oops\n"


def test_patch_when_rc_cannot_be_written_is_507(home):
    from support.apps import call

    from localrt import settings as settings_mod
    from localrt.app import create_app
    (home / "not-a-dir").write_text("")
    settings = settings_mod.load(home / "not-a-dir" / "rc", create=False)
    app = create_app(settings)
    body = assert_error(call(app, "PATCH", "/v1/configs", json_body={"cors": False}), 507,
                        "storage_error")
    assert "Nothing was changed" in body["message"]
    assert call(app, "GET", "/v1/configs").json["cors"] is True
