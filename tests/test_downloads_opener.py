"""The downloads opener against real parts: the hub emulator, proxy.py, and trustme TLS."""

import json
import ssl
import urllib.error

import pytest
import trustme
from emulators.ggufgen import write_gguf
from emulators.hubemu import HubEmulator
from emulators.proxyfix import need_tinyproxy, start_proxy, start_tinyproxy
from support.config import outbound_config as config

from localrt.outbound import ProxyAuthFailed, no_proxy_matches, open_url, proxy_refused
from localrt.errors import UpstreamError

pytestmark = pytest.mark.live


@pytest.fixture
def model(tmp_path):
    return write_gguf(tmp_path / "tiny.gguf")


def get(cfg, url, hub_url=None):
    with open_url(cfg, url, hub_url=hub_url) as resp:
        return resp.read()


@pytest.mark.parametrize("host, no_proxy, expected", [
    ("example.com", "example.com", True),
    ("sub.example.com", "example.com", True),
    ("sub.example.com", ".example.com", True),
    ("badexample.com", "example.com", False),
    ("example.com", "*", True),
    ("example.com", "", False),
    ("127.0.0.1", "localhost,127.0.0.1,::1", True),
    ("::1", "localhost,127.0.0.1,::1", True),
    ("10.1.2.3", "10.0.0.0/8", True),
    ("11.1.2.3", "10.0.0.0/8", False),
    ("hub.internal", "other, hub.internal:443", True),
    ("EXAMPLE.com", "example.COM", True),
])
def test_no_proxy_has_curls_meaning(host, no_proxy, expected):
    assert no_proxy_matches(host, no_proxy) is expected


def test_proxy_with_credentials_is_used(tmp_path, model):
    with HubEmulator() as hub, start_proxy(tmp_path, username="u", password="p:@w") as proxy:
        hub.add_repo("org/repo", {"tiny.gguf": model})
        cfg = config(proxy_url=proxy.url, proxy_username="u", proxy_password="p:@w")
        info = json.loads(get(cfg, f"{hub.url}/api/models/org/repo"))
        assert info["id"] == "org/repo"
        assert "via" in hub.requests_to("hub")[-1].headers  # it came through the proxy
        assert "proxy-authorization" not in hub.requests_to("hub")[-1].headers


def test_no_proxy_goes_direct(tmp_path, model):
    with HubEmulator() as hub, start_proxy(tmp_path, username="u", password="p") as proxy:
        hub.add_repo("org/repo", {"tiny.gguf": model})
        cfg = config(proxy_url=proxy.url, proxy_username="u", proxy_password="p",
                     no_proxy="localhost,127.0.0.1")
        get(cfg, f"{hub.url}/api/models/org/repo")
        assert "via" not in hub.requests_to("hub")[-1].headers


def test_wrong_proxy_password_is_a_clear_error(tmp_path, model):
    with HubEmulator() as hub, start_proxy(tmp_path, username="u", password="p") as proxy:
        hub.add_repo("org/repo", {"tiny.gguf": model})
        cfg = config(proxy_url=proxy.url, proxy_username="u", proxy_password="wrong")
        with pytest.raises(ProxyAuthFailed) as info:
            get(cfg, f"{hub.url}/api/models/org/repo")
        assert "rejected the credentials" in info.value.message
        assert "wrong" not in info.value.message  # the password is never shown
        assert not hub.requests_to("hub")


def tls_hub(cert_host="127.0.0.1"):
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(cert_host).configure_cert(server_ctx)
    return ca, HubEmulator(ssl_context=server_ctx)


def test_https_through_an_authenticating_proxy_tunnel(tmp_path, model, monkeypatch):
    ca, hub = tls_hub()
    with hub, start_proxy(tmp_path, username="u", password="p") as proxy, \
            ca.cert_pem.tempfile() as ca_file:
        monkeypatch.setenv("SSL_CERT_FILE", ca_file)
        hub.add_repo("org/repo", {"tiny.gguf": model})
        ok = config(proxy_url=proxy.url, proxy_username="u", proxy_password="p")
        assert json.loads(get(ok, f"{hub.url}/api/models/org/repo"))["id"] == "org/repo"
        assert "CONNECT" in proxy.wait_for_log("CONNECT")
        with pytest.raises(ProxyAuthFailed):
            get({**ok, "proxy_password": "bad"}, f"{hub.url}/api/models/org/repo")


def test_tinyproxys_401_for_a_wrong_password_is_the_proxys_error(tmp_path, model):
    # tinyproxy answers a wrong password on a plain-http request with 401 and
    # WWW-Authenticate: Basic realm="Tinyproxy", not 407: the hub never saw it.
    need_tinyproxy()
    with HubEmulator() as hub, \
            start_tinyproxy(tmp_path, username="alice", password="s3cret") as proxy:
        hub.add_repo("org/repo", {"tiny.gguf": model})
        ok = config(proxy_url=proxy.url, proxy_username="alice", proxy_password="s3cret")
        assert json.loads(get(ok, f"{hub.url}/api/models/org/repo"))["id"] == "org/repo"
        assert "tinyproxy" in hub.requests_to("hub")[-1].headers["via"]
        hub.clear_requests()
        with pytest.raises(ProxyAuthFailed) as info:
            get({**ok, "proxy_password": "wrong"}, f"{hub.url}/api/models/org/repo",
                hub_url=hub.url)
        message = info.value.message
        assert proxy.url in message and "rejected the credentials" in message
        assert "'alice'" in message and "proxy_username" in message \
            and "proxy_password" in message
        assert "wrong" not in message and "s3cret" not in message
        with pytest.raises(ProxyAuthFailed, match="requires authentication"):  # its 407
            get({**ok, "proxy_username": "", "proxy_password": ""},
                f"{hub.url}/api/models/org/repo")
        assert not hub.requests_to("hub")


def test_tinyproxys_401_to_a_tunnel_is_the_proxys_error(tmp_path, model, monkeypatch):
    need_tinyproxy()
    ca, hub = tls_hub()
    with hub, start_tinyproxy(tmp_path, username="alice", password="s3cret") as proxy, \
            ca.cert_pem.tempfile() as ca_file:
        monkeypatch.setenv("SSL_CERT_FILE", ca_file)
        hub.add_repo("org/repo", {"tiny.gguf": model})
        ok = config(proxy_url=proxy.url, proxy_username="alice", proxy_password="s3cret")
        assert json.loads(get(ok, f"{hub.url}/api/models/org/repo"))["id"] == "org/repo"
        hub.clear_requests()
        with pytest.raises(ProxyAuthFailed, match="rejected the credentials"):
            get({**ok, "proxy_password": "wrong"}, f"{hub.url}/api/models/org/repo")
        assert not hub.requests_to("hub")


@pytest.mark.parametrize("status, headers, url, proxys", [
    (407, {}, "http://hub.example/x", True),
    (401, {"WWW-Authenticate": 'Basic realm="Tinyproxy"'}, "http://hub.example/x", True),
    (403, {"Proxy-Authenticate": "Basic"}, "http://hub.example/x", True),
    # The hub's own refusals: a bearer challenge, its X-Error-Code, or no challenge.
    (401, {"WWW-Authenticate": 'Bearer realm="hub"'}, "http://hub.example/x", False),
    (401, {"WWW-Authenticate": "Basic", "X-Error-Code": "GatedRepo"},
     "http://hub.example/x", False),
    (401, {}, "http://hub.example/x", False),
    (403, {"WWW-Authenticate": "Basic"}, "http://hub.example/x", False),
    # A request no_proxy sent direct never met the proxy.
    (401, {"WWW-Authenticate": "Basic"}, "http://direct.example/x", False),
])
def test_which_refusals_are_the_proxys(status, headers, url, proxys):
    import email.message

    message = email.message.Message()
    for name, value in headers.items():
        message[name] = value
    cfg = config(proxy_url="http://proxy.example:3128", no_proxy="direct.example")
    assert proxy_refused(cfg, url, status, message) is proxys


def test_verify_peer_ssl(model):
    ca, hub = tls_hub()  # the CA is not trusted here
    with hub:
        hub.add_repo("org/repo", {"tiny.gguf": model})
        with pytest.raises(UpstreamError, match="certificate"):
            get(config(), f"{hub.url}/api/models/org/repo")
        assert get(config(verify_peer_ssl=False), f"{hub.url}/api/models/org/repo")


def test_verify_host_ssl(model, monkeypatch):
    ca, hub = tls_hub(cert_host="hub.example")  # trusted, but for another name
    with hub, ca.cert_pem.tempfile() as ca_file:
        monkeypatch.setenv("SSL_CERT_FILE", ca_file)
        hub.add_repo("org/repo", {"tiny.gguf": model})
        with pytest.raises(UpstreamError, match="certificate"):
            get(config(), f"{hub.url}/api/models/org/repo")
        assert get(config(verify_host_ssl=False), f"{hub.url}/api/models/org/repo")


def test_token_reaches_the_hub_and_not_the_cdn(model):
    with HubEmulator() as hub:
        hub.add_repo("org/gated", {"tiny.gguf": model}, gated_token="hf_secret")
        cfg = config(modelhub_token="hf_secret")
        body = get(cfg, f"{hub.url}/org/gated/resolve/main/tiny.gguf", hub_url=hub.url)
        assert body == model.read_bytes()
        assert hub.requests_to("hub")[-1].headers["authorization"] == "Bearer hf_secret"
        cdn = hub.requests_to("cdn")
        assert cdn and all("authorization" not in r.headers for r in cdn)
        with pytest.raises(urllib.error.HTTPError) as info:  # no token: the hub says 401
            get(config(), f"{hub.url}/org/gated/resolve/main/tiny.gguf", hub_url=hub.url)
        assert info.value.code == 401
        info.value.close()


def test_an_https_proxy_from_a_hand_edited_rc_is_refused_not_ignored():
    cfg = config(proxy_url="https://proxy.example:3129")
    with pytest.raises(UpstreamError, match="https:// proxy URLs are not supported"):
        get(cfg, "http://127.0.0.1:9/")
