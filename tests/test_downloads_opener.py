"""The downloads opener against real parts: the hub emulator, proxy.py, and trustme TLS."""

import json
import ssl
import urllib.error

import pytest
import trustme
from ggufgen import write_gguf
from hubemu import HubEmulator
from proxyfix import start_proxy
from support.config import outbound_config as config

from localrt.downloads.opener import ProxyAuthFailed, no_proxy_matches, open_url
from localrt.errors import UpstreamError

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
