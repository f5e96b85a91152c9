"""The proxy fixture works, and how Python's urllib behaves through a Basic-auth proxy.

Findings pinned here (proxy.py 2.4.10, CPython 3.11):

* Plain http:// through the proxy: credentials work as userinfo in the ProxyHandler URL
  ("http://user:pass@127.0.0.1:PORT") or as an explicit "Proxy-Authorization: Basic ..."
  request header.  ProxyBasicAuthHandler does NOT work: proxy.py's challenge is
  "Proxy-Authenticate: Basic" with no realm, and urllib only retries when it finds a realm.
* A missing or wrong password on plain http surfaces as urllib.error.HTTPError, code 407,
  reason "Proxy Authentication Required", headers["Proxy-Authenticate"] == "Basic".
* https:// goes through CONNECT.  The same two forms work (urllib moves the
  Proxy-Authorization header into the CONNECT request's headers and keeps it away from
  the origin); ProxyBasicAuthHandler does not.  A missing or wrong password surfaces as
  urllib.error.URLError (not HTTPError) whose .reason is
  OSError("Tunnel connection failed: 407 Proxy Authentication Required").
* proxy.py strips Proxy-Authorization before forwarding and adds "Via: 1.1 proxy.py v2.4.10"
  to plain-http requests; tunnelled (https) requests reach the target unchanged.
* urllib consults the no_proxy environment variable even with an explicit ProxyHandler.
"""

from __future__ import annotations

import socket
import ssl
import urllib.error
import urllib.request

import pytest

from emulators.proxyfix import start_proxy, start_target, tls_contexts
from support.waiting import wait_for

pytestmark = pytest.mark.live

USER = "alice"
PASSWORD = "s3cret:with@odd/chars"  # exercises percent-encoding in the userinfo form


@pytest.fixture
def proxy(tmp_path):
    with start_proxy(tmp_path, username=USER, password=PASSWORD) as p:
        yield p


@pytest.fixture
def target():
    with start_target(b"plain body") as t:
        yield t


@pytest.fixture(scope="module")
def tls():
    return tls_contexts()  # (server_context, client_context, ca)


@pytest.fixture
def https_target(tls):
    with start_target(b"secure body", ssl_context=tls[0]) as t:
        yield t


def opener(proxies, *extra):
    return urllib.request.build_opener(urllib.request.ProxyHandler(proxies), *extra)


def fetch(op, url, headers=None):
    with op.open(urllib.request.Request(url, headers=headers or {}), timeout=10) as resp:
        return resp.status, resp.read()


def via_proxy_log(proxy, marker_url):
    """A fence: a proxied request, then every access-log entry up to and including it."""
    # proxy.py logs each connection when it closes, so entries for earlier requests are
    # in the log before the marker's.
    assert fetch(opener({"http": proxy.url_with_credentials()}), marker_url)[0] == 200
    proxy.wait_for_log(marker_url.split("://", 1)[1])
    return proxy.access_log()


# -- the fixture itself -------------------------------------------------------------------


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


def test_start_and_stop(tmp_path):
    proxy = start_proxy(tmp_path, username=USER, password=PASSWORD)
    try:
        assert proxy.url == f"http://127.0.0.1:{proxy.port}"
        assert proxy.startup_s < 10
        socket.create_connection(("127.0.0.1", proxy.port), timeout=2).close()
        assert "Loaded plugin proxy.http.proxy.HttpProxyPlugin" in proxy.log_text()
        assert "Loaded plugin proxy.http.proxy.auth.AuthPlugin" in proxy.log_text()
        assert proxy.url_with_credentials().startswith("http://alice:s3cret%3Awith%40odd%2Fchars@")
    finally:
        assert proxy.stop() in (0, -15)
    # Closed once stop() returns, or a moment after: an acceptor that a SIGTERM caught
    # before proxy.py's handlers may still be exiting (it failed once so, in a full run).
    wait_for(lambda: not _listening(proxy.port), 5, "the proxy's port, closed after stop()")
    # Nothing went to the (temporary) home directory.
    assert list((tmp_path / "proxypy" / "home").iterdir()) == []


def test_context_manager_without_auth(tmp_path, target):
    with start_proxy(tmp_path) as proxy:
        assert "AuthPlugin" not in proxy.log_text()
        assert fetch(opener({"http": proxy.url}), target.url + "/open") == (200, b"plain body")
        proxy.wait_for_log(f"GET 127.0.0.1:{target.port}/open - 200 OK")
    assert proxy.process.poll() is not None


# -- (a) plain http through the proxy with credentials ---------------------------------


def test_http_userinfo_credentials(proxy, target):
    cred_url = proxy.url_with_credentials()
    op = opener({"http": cred_url, "https": cred_url})
    assert fetch(op, target.url + "/a") == (200, b"plain body")
    entry = proxy.wait_for_log(f"GET 127.0.0.1:{target.port}/a")
    assert "200 OK" in entry
    (seen,) = target.requests
    assert seen["path"] == "/a"  # origin-form: the proxy rewrote the absolute URL
    assert seen["headers"]["Via"] == "1.1 proxy.py v2.4.10"
    assert "Proxy-Authorization" not in seen["headers"]  # proxy.py strips it


def test_http_explicit_header(proxy, target):
    op = opener({"http": proxy.url})
    headers = {"Proxy-Authorization": proxy.auth_header()}
    assert fetch(op, target.url + "/hdr", headers) == (200, b"plain body")
    proxy.wait_for_log(f"GET 127.0.0.1:{target.port}/hdr - 200 OK")


def test_http_proxy_basic_auth_handler_does_not_authenticate(proxy, target):
    # proxy.py sends "Proxy-Authenticate: Basic" without realm=; urllib's
    # AbstractBasicAuthHandler only retries when it parses a realm, so the 407 stands.
    mgr = urllib.request.HTTPPasswordMgrWithDefaultRealm()
    mgr.add_password(None, proxy.url, USER, PASSWORD)
    op = opener({"http": proxy.url}, urllib.request.ProxyBasicAuthHandler(mgr))
    with pytest.raises(urllib.error.HTTPError) as info:
        fetch(op, target.url + "/pbah")
    assert info.value.code == 407
    assert target.requests == []


# -- (b) wrong / missing password on plain http ------------------------------------------


@pytest.mark.parametrize("password", ["wrong", None])
def test_http_wrong_password_is_407_http_error(proxy, target, password):
    url = proxy.url_with_credentials(password="wrong") if password else proxy.url
    op = opener({"http": url, "https": url})
    with pytest.raises(urllib.error.HTTPError) as info:
        fetch(op, target.url + "/b")
    err = info.value
    assert err.code == 407
    assert err.reason == "Proxy Authentication Required"
    assert err.headers["Proxy-Authenticate"] == "Basic"
    assert err.read() == b"Proxy Authentication Required"
    err.close()
    assert target.requests == []
    proxy.wait_for_log("GET None:None/b")  # rejected before the target was parsed


# -- (c) https through a CONNECT tunnel --------------------------------------------------


def test_https_connect_userinfo_credentials(proxy, https_target, tls):
    cred_url = proxy.url_with_credentials()
    op = opener({"http": cred_url, "https": cred_url},
                urllib.request.HTTPSHandler(context=tls[1]))
    assert fetch(op, https_target.url + "/c") == (200, b"secure body")
    proxy.wait_for_log(f"CONNECT 127.0.0.1:{https_target.port}")
    (seen,) = https_target.requests
    assert seen["path"] == "/c"
    # Tunnelled: the proxy cannot touch the headers, and urllib kept
    # Proxy-Authorization on the CONNECT only.
    assert "Via" not in seen["headers"]
    assert "Proxy-Authorization" not in seen["headers"]


def test_https_connect_explicit_header(proxy, https_target, tls):
    op = opener({"https": proxy.url}, urllib.request.HTTPSHandler(context=tls[1]))
    headers = {"Proxy-Authorization": proxy.auth_header()}
    assert fetch(op, https_target.url + "/c2", headers) == (200, b"secure body")
    proxy.wait_for_log(f"CONNECT 127.0.0.1:{https_target.port}")
    assert "Proxy-Authorization" not in https_target.requests[0]["headers"]


def test_https_certificate_is_checked_through_the_tunnel(proxy, https_target):
    # Without trusting the test CA the TLS handshake (end to end, through CONNECT) fails.
    op = opener({"https": proxy.url_with_credentials()},
                urllib.request.HTTPSHandler(context=ssl.create_default_context()))
    with pytest.raises(urllib.error.URLError) as info:
        fetch(op, https_target.url + "/untrusted")
    assert isinstance(info.value.reason, ssl.SSLCertVerificationError)


@pytest.mark.parametrize("how", ["wrong-userinfo", "no-credentials", "basic-auth-handler",
                                 "wrong-header"])
def test_https_connect_bad_credentials_is_tunnel_oserror(proxy, https_target, tls, how):
    handlers = [urllib.request.HTTPSHandler(context=tls[1])]
    headers = {}
    url = proxy.url
    if how == "wrong-userinfo":
        url = proxy.url_with_credentials(password="wrong")
    elif how == "basic-auth-handler":
        mgr = urllib.request.HTTPPasswordMgrWithDefaultRealm()
        mgr.add_password(None, proxy.url, USER, PASSWORD)
        handlers.append(urllib.request.ProxyBasicAuthHandler(mgr))
    elif how == "wrong-header":
        headers = {"Proxy-Authorization": proxy.auth_header(password="wrong")}
    op = opener({"https": url}, *handlers)
    with pytest.raises(urllib.error.URLError) as info:
        fetch(op, https_target.url + "/bad", headers)
    err = info.value
    assert not isinstance(err, urllib.error.HTTPError)  # no status code, no headers
    assert type(err.reason) is OSError
    assert str(err.reason) == "Tunnel connection failed: 407 Proxy Authentication Required"
    assert https_target.requests == []
    proxy.wait_for_log("CONNECT None:None")


# -- (d) direct, bypassing the proxy -----------------------------------------------------


def test_without_proxy_handler_goes_direct(proxy, target):
    op = opener({})  # an empty ProxyHandler: no environment proxies either
    assert fetch(op, target.url + "/direct") == (200, b"plain body")
    (seen,) = target.requests
    assert "Via" not in seen["headers"]
    entries = via_proxy_log(proxy, target.url + "/fence")
    assert len(entries) == 1 and "/fence" in entries[0]
    assert target.requests[1]["headers"]["Via"] == "1.1 proxy.py v2.4.10"


def test_no_proxy_environment_overrides_explicit_proxy_handler(proxy, target, monkeypatch):
    # urllib's ProxyHandler.proxy_open calls proxy_bypass(host), which reads no_proxy
    # from the environment, even when the proxies dict was given explicitly.
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    op = opener({"http": proxy.url_with_credentials()})
    assert fetch(op, target.url + "/bypassed") == (200, b"plain body")
    assert "Via" not in target.requests[0]["headers"]
    monkeypatch.delenv("no_proxy")  # so that the fence goes through the proxy
    entries = via_proxy_log(proxy, target.url + "/fence")
    assert len(entries) == 1 and "/fence" in entries[0]  # /bypassed never reached it
