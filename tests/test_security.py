"""API keys, binding beyond loopback, and secrets kept out of what users see."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from support.apps import call
from support.servers import run_foreground_server, subprocess_env

from localrt import security
from localrt import settings as settings_mod
from localrt.app import create_app
from localrt.cli import main

KEY = "sk-local-1234567890abcdef"


@pytest.fixture
def keyed(home):
    """An app whose settings file holds two API keys."""
    (home / ".localrtrc").write_text(f"apiKeys: [{KEY}, second-key-xyz]\n")
    app = create_app(settings_mod.load())
    yield app
    app.close()


def test_without_keys_no_authorization_is_needed(api):
    assert api("GET", "/v1/models").status == 200


@pytest.mark.parametrize("path", ["/v1/models", "/v1/configs", "/v1/engines", "/openapi.json",
                                  "/v1/models/status", "/v1/models/pull", "/no/such/route"])
def test_with_keys_every_endpoint_needs_one(keyed, path):
    r = call(keyed, "GET", path)
    assert r.status == 401
    assert r.json["error"]["code"] == "unauthorized"
    assert "Authorization: Bearer" in r.json["message"]
    assert r.headers["www-authenticate"].startswith("Bearer")


@pytest.mark.parametrize("header", [f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer ",
                                    f"Basic {KEY}", KEY, "Bearer second-key"])
def test_a_wrong_key_is_refused(keyed, header):
    r = call(keyed, "GET", "/v1/models", headers={"Authorization": header})
    assert r.status == 401
    assert r.json["error"]["code"] == "unauthorized"
    assert KEY not in r.body.decode()


@pytest.mark.parametrize("header", [f"Bearer {KEY}", f"bearer {KEY}", "Bearer second-key-xyz"])
def test_any_configured_key_is_accepted(keyed, header):
    assert call(keyed, "GET", "/v1/models", headers={"Authorization": header}).status == 200


def test_a_write_with_a_wrong_key_changes_nothing(keyed):
    r = call(keyed, "PATCH", "/v1/configs", {"cors": False},
             headers={"Authorization": "Bearer nope"})
    assert r.status == 401
    r = call(keyed, "GET", "/v1/configs", headers={"Authorization": f"Bearer {KEY}"})
    assert r.json["cors"] is True


def test_healthz_and_cors_preflights_need_no_key(keyed):
    assert call(keyed, "GET", "/healthz").status == 200
    preflight = call(keyed, "OPTIONS", "/v1/models", headers={
        "Origin": "http://localhost:39281", "Access-Control-Request-Method": "GET",
        "Access-Control-Request-Headers": "authorization"})
    assert preflight.status == 204
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert call(keyed, "OPTIONS", "/v1/models").status == 401  # not a preflight


def test_the_environment_key_overrides_the_file(home, monkeypatch):
    monkeypatch.setenv("LOCALRT_API_KEY", "from-the-environment")
    app = create_app(settings_mod.load())
    assert call(app, "GET", "/v1/models").status == 401
    assert call(app, "GET", "/v1/models",
                headers={"Authorization": "Bearer from-the-environment"}).status == 200


@pytest.mark.parametrize("bad", ["[a b]", "['']", "[1]", "{a: b}"])
def test_bad_keys_in_the_file_are_a_settings_error(home, bad):
    (home / ".localrtrc").write_text(f"apiKeys: {bad}\n")
    with pytest.raises(settings_mod.SettingsError, match="apiKeys"):
        settings_mod.load()


def test_keys_are_not_part_of_the_config_api(keyed):
    r = call(keyed, "GET", "/v1/configs", headers={"Authorization": f"Bearer {KEY}"})
    assert KEY not in r.body.decode()


def test_key_comparison():
    assert security.key_accepted(f"Bearer {KEY}", [KEY])
    assert security.key_accepted(f"  Bearer   {KEY} ", ["other", KEY])
    assert not security.key_accepted(None, [KEY])
    assert not security.key_accepted(f"Bearer {KEY}", [])
    assert not security.key_accepted("Bearer ключ", ["ключ2"])
    assert security.key_accepted("Bearer ключ", ["ключ"])
    # x-api-key, as Anthropic's clients send it, alone or beside a wrong bearer.
    assert security.key_accepted(None, [KEY], KEY)
    assert security.key_accepted("Bearer wrong", [KEY], f" {KEY} ")
    assert not security.key_accepted(None, [KEY], "wrong")
    assert not security.key_accepted(None, [], "")


# --- binding -----------------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7"])
def test_binding_beyond_loopback_without_a_key_refuses_to_start(home, host):
    out, err = io.StringIO(), io.StringIO()
    code = main(["start", "--foreground", "--host", host, "--port", "0"], stdout=out, stderr=err)
    assert code == 4
    assert f"Refusing to listen on {host}" in err.getvalue()
    assert "apiKeys" in err.getvalue() and "LOCALRT_API_KEY" in err.getvalue()
    assert not (home / "localrt" / "localrt.pid").exists()


def test_binding_beyond_loopback_from_the_settings_file_is_refused_too(home):
    (home / ".localrtrc").write_text("apiServerHost: 0.0.0.0\napiServerPort: 0\n")
    r = subprocess.run([sys.executable, "-m", "localrt", "start"], env=subprocess_env(home),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 4 and "Refusing to listen on 0.0.0.0" in r.stderr


def test_a_keyed_server_on_all_addresses_serves_the_cli_and_curl(home):
    (home / ".localrtrc").write_text(f"apiKeys: [{KEY}]\n")
    srv = run_foreground_server(home, ["--host", "0.0.0.0"])
    try:
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(srv.url + "/v1/models", timeout=10)
        assert exc.value.code == 401
        assert json.loads(exc.value.read())["error"]["code"] == "unauthorized"
        req = urllib.request.Request(srv.url + "/v1/models",
                                     headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.loads(resp.read())["object"] == "list"
        # The CLI reads the key from the settings file, as the server does.
        env = {**subprocess_env(home)}
        r = subprocess.run([sys.executable, "-m", "localrt",
                            "models", "list"], env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        # A CLI with another key gets the server's refusal, not a crash.
        env["LOCALRT_API_KEY"] = "wrong-key"
        r = subprocess.run([sys.executable, "-m", "localrt",
                            "models", "list"], env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 1 and "API key was not accepted" in r.stderr
    finally:
        srv.stop()


# --- secrets -----------------------------------------------------------------------

TOKEN, PASSWORD, URL_PASSWORD = "hf_tok3n_ABCDEF", "pr0xy-pa55word", "in-url-pw-42"


def test_error_bodies_never_carry_secrets(home):
    from localrt.errors import UpstreamError
    from localrt.routing import Route

    def leaky(services, request):
        raise UpstreamError(f"upstream said: token {TOKEN}, password {PASSWORD}, key {KEY}, "
                            f"via http://alice:{URL_PASSWORD}@proxy.lan:3128/x")

    (home / ".localrtrc").write_text(f"apiKeys: [{KEY}]\nmodelhubToken: {TOKEN}\n"
                                     f"proxyPassword: {PASSWORD}\n")
    app = create_app(settings_mod.load(), routes=[Route("GET", "/leak", leaky)])
    r = call(app, "GET", "/leak", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status == 502
    text = r.body.decode()
    for secret in (TOKEN, PASSWORD, KEY, URL_PASSWORD):
        assert secret not in text
    assert "http://***@proxy.lan:3128/x" in r.json["message"]


def test_log_lines_never_carry_secrets(home):
    import logging

    from localrt import server

    (home / ".localrtrc").write_text(f"modelhubToken: {TOKEN}\nproxyPassword: {PASSWORD}\n")
    settings = settings_mod.load()
    root = logging.getLogger()
    before = list(root.handlers)
    server.setup_logging(settings, console=False)
    try:
        log = logging.getLogger("localrt.test")
        log.warning("token %s in an argument", TOKEN)
        try:
            raise RuntimeError(f"proxy http://bob:{URL_PASSWORD}@p:1 said {PASSWORD}")
        except RuntimeError:
            log.exception("failed")
        settings.update({"modelhubToken": "hf_changed_LATER"})
        log.warning("the new token hf_changed_LATER")
    finally:
        for handler in root.handlers[len(before):]:
            handler.close()
            root.removeHandler(handler)
    text = (settings.log_dir / server.LOG_NAME).read_text()
    assert "token *** in an argument" in text and "RuntimeError: proxy http://***@p:1" in text
    for secret in (TOKEN, PASSWORD, URL_PASSWORD, "hf_changed_LATER"):
        assert secret not in text


@pytest.mark.live
def test_a_failed_pull_shows_no_secret_in_tasks_events_or_the_log(home, settings, tmp_path):
    """A real server, a hub that refuses the token, a proxy that refuses the password."""
    from emulators.hubemu import HubEmulator
    from emulators.proxyfix import start_proxy

    from localrt import server

    with HubEmulator() as hub, start_proxy(tmp_path, username="alice", password="right") as proxy:
        hub.add_repo("org/gated", {"m.gguf": b"GGUF" + bytes(60)}, gated_token="the-real-token")
        settings.update({"modelHubUrl": hub.url, "modelhubToken": TOKEN,
                         "apiKeys": [KEY]})
        srv = run_foreground_server(home)
        auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

        def api(method, path, body=None):
            req = urllib.request.Request(srv.url + path, method=method, headers=auth,
                                         data=None if body is None else json.dumps(body).encode())
            try:
                with urllib.request.urlopen(req, timeout=20) as resp:
                    return resp.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.read().decode()

        try:
            seen = [api("POST", "/v1/models/org/gated/pull")]  # the hub refuses the token
            proxied = f"http://alice:{URL_PASSWORD}@127.0.0.1:{proxy.port}"
            seen.append(api("PATCH", "/v1/configs", {
                "proxy_url": proxied, "proxy_username": "alice", "proxy_password": PASSWORD,
                "no_proxy": ""}))
            seen.append(api("POST", "/v1/models/org/gated/pull"))  # the proxy refuses
            seen.append(api("GET", "/v1/models/pull"))
        finally:
            srv.stop()
    assert "token" in seen[0]
    assert "proxy" in seen[2].lower()
    log_text = (settings.log_dir / server.LOG_NAME).read_text()
    for text in [*seen[:1], *seen[2:], log_text]:
        for secret in (TOKEN, PASSWORD, KEY, URL_PASSWORD):
            assert secret not in text, text


# --- file modes --------------------------------------------------------------------


def test_the_rc_file_definitions_and_data_folders_are_private(home, monkeypatch, tmp_path):
    """0600 files and 0700 folders, whatever the umask, parents included."""
    import os
    import stat

    from emulators.ggufgen import write_gguf

    old = os.umask(0o002)
    try:
        data = home / "deep" / "data"  # two folders that do not exist yet
        (home / ".localrtrc").write_text(f"dataFolderPath: {data}\n")
        settings = settings_mod.load()
        settings.update({"cors": True})  # rewrites the rc file
        app = create_app(settings)
        model = write_gguf(tmp_path / "m.gguf", name="m")
        r = call(app, "POST", "/v1/models/import", {"path": str(model), "id": "m"})
        assert r.status == 200, r.json
    finally:
        os.umask(old)

    def mode(p):
        return stat.S_IMODE(os.stat(p).st_mode)

    assert mode(home / ".localrtrc") == 0o600
    definitions = [p for p in data.rglob("*") if p.is_file() and p.suffix in (".json", ".yml")]
    assert definitions and all(mode(p) == 0o600 for p in definitions), definitions
    folders = [home / "deep", data, *[p for p in data.rglob("*") if p.is_dir()]]
    assert all(mode(p) == 0o700 for p in folders), {str(p): oct(mode(p)) for p in folders}
