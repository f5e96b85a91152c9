"""Outbound HTTP: one urllib opener per request, built from the Config fields.

Proxy, credentials, no_proxy and the SSL flags come only from Config (localrt.config),
never from the environment, and are read afresh for every request, so a change
applies to the next one without a restart. The hub token is added as an
unredirected header, so it reaches the hub and never the host a redirect leads to.
Used by the downloads (localrt.downloads.fetch, localrt.downloads.pieces), the hub
client, the package index client, a chat's image fetches and the remote models'
upstreams (localrt.remote): the core's, so each of them reaches the network one way.
"""

from __future__ import annotations

import base64
import datetime
import email.utils
import http.client
import ipaddress
import math
import re
import ssl
import urllib.error
import urllib.request
from typing import Callable, Mapping
from urllib.parse import quote, unquote, urlsplit

from localrt.errors import UpstreamError

RETRY_AFTER_CAP = 30.0       # seconds: the longest Retry-After a download waits out


class ProxyAuthFailed(UpstreamError):
    code = "proxy_auth_failed"


class CertificateFailed(UpstreamError):
    code = "tls_verification_failed"


def no_proxy_matches(host: str, no_proxy: str) -> bool:
    """Whether `host` bypasses the proxy, with curl's meaning of NO_PROXY.

    Entries are comma-separated: `*` matches every host; a name matches itself
    and its subdomains (a leading dot is optional); an IP or CIDR range matches
    addresses in it. Ports on entries are ignored.
    """
    host = host.strip("[]").lower().rstrip(".")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for entry in (e.strip().lower() for e in no_proxy.split(",")):
        if not entry:
            continue
        if entry == "*":
            return True
        if entry.startswith("["):
            entry = entry[1:].split("]", 1)[0]
        elif entry.count(":") == 1:
            entry = entry.split(":", 1)[0]  # host:port
        if address is not None:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                pass
            continue
        entry = entry.lstrip(".").rstrip(".")
        if entry and (host == entry or host.endswith("." + entry)):
            return True
    return False


class _ConfigProxyHandler(urllib.request.ProxyHandler):
    """urllib's proxy handling, but with no_proxy and credentials from Config."""

    def __init__(self, proxy_url: str, username: str, password: str, no_proxy: str):
        super().__init__({"http": proxy_url, "https": proxy_url})
        self._no_proxy = no_proxy
        self._auth = None
        if username or password:
            creds = f"{username}:{password}".encode("utf-8")
            self._auth = "Basic " + base64.b64encode(creds).decode("ascii")

    def proxy_open(self, req, proxy, type):
        if req.host and no_proxy_matches(urlsplit(f"//{req.host}").hostname or "",
                                         self._no_proxy):
            return None
        hostport = unquote(urlsplit(proxy).netloc.rpartition("@")[2])
        if self._auth:
            # Sent to the proxy only: on https targets urllib moves it to the CONNECT,
            # and being unredirected it never follows a redirect to a host that
            # no_proxy sends direct (the CDN).
            req.add_unredirected_header("Proxy-Authorization", self._auth)
        req.set_proxy(hostport, urlsplit(proxy).scheme)
        return None


def ssl_context(config: Mapping) -> ssl.SSLContext:
    """The TLS context for hub and CDN connections, per verify_peer_ssl and verify_host_ssl."""
    ctx = ssl.create_default_context()
    if not config["verify_host_ssl"] or not config["verify_peer_ssl"]:
        ctx.check_hostname = False
    if not config["verify_peer_ssl"]:
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _reporting(connection_class, on_socket: Callable):
    """`connection_class`, reporting each socket it connects (a tunnel's too)."""

    class Reporting(connection_class):
        def connect(self):
            super().connect()
            on_socket(self.sock)

    return Reporting


class _HTTPHandler(urllib.request.HTTPHandler):
    """http:// through a connection that reports its socket as soon as it has one."""

    def __init__(self, on_socket: Callable):
        super().__init__()
        self._connection = _reporting(http.client.HTTPConnection, on_socket)

    def http_open(self, req):
        return self.do_open(self._connection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    """https:// with the TLS context of `config`, through a connection that reports its
    socket as soon as it has one (if `on_socket` is given).

    The context is made only when an https URL is opened: making one reads the
    system's CA store (about 15 ms), and a download in pieces opens many URLs.
    """

    def __init__(self, config: Mapping, on_socket: Callable | None):
        super().__init__()
        self._config = config
        self._connection = http.client.HTTPSConnection if on_socket is None else \
            _reporting(http.client.HTTPSConnection, on_socket)

    def https_open(self, req):
        return self.do_open(self._connection, req, context=ssl_context(self._config))


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is the answer itself (an HTTPError with its 3xx status)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


def build_opener(config: Mapping, on_socket: Callable | None = None,
                 redirects: bool = True) -> urllib.request.OpenerDirector:
    """An opener honouring the proxy, no_proxy and SSL fields of `config`.

    `on_socket(sock)` is called with each connected socket, so that a cancel can shut
    it down even before the response headers arrive.
    """
    handlers = [_HTTPSHandler(config, on_socket)]
    if on_socket is not None:
        handlers.append(_HTTPHandler(on_socket))
    if urlsplit(config["proxy_url"]).scheme.lower() == "https":
        # The API refuses these (schemas/config-update.json); this catches a hand-edited rc.
        raise UpstreamError("https:// proxy URLs are not supported; set proxy_url to the "
                            "proxy's http:// address")
    if config["proxy_url"]:
        handlers.append(_ConfigProxyHandler(config["proxy_url"], config["proxy_username"],
                                            config["proxy_password"], config["no_proxy"]))
    else:
        handlers.append(urllib.request.ProxyHandler({}))  # never the environment's proxy
    if not redirects:
        handlers.append(_NoRedirects())
    return urllib.request.build_opener(*handlers)


def open_url(config: Mapping, url: str, *, hub_url: str | None = None, headers=None,
             timeout: float = 30.0, on_socket: Callable | None = None, method: str = "GET",
             redirects: bool = True):
    """Open `url`; the hub token goes to the hub's host only. Raises UpstreamError.

    With `redirects` False a 3xx comes back as an HTTPError carrying its status.
    """
    req = urllib.request.Request(url, headers=dict(headers or {}), method=method)
    token = config.get("modelhub_token")
    if token and hub_url and urlsplit(url).netloc == urlsplit(hub_url).netloc:
        req.add_unredirected_header("Authorization", f"Bearer {token}")
    try:
        return build_opener(config, on_socket, redirects).open(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        if proxy_refused(config, url, exc.code, exc.headers):
            exc.close()
            raise ProxyAuthFailed(_proxy_auth_message(config)) from None
        raise  # the caller knows what a 401, 403 or 404 from the hub means
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, OSError) and _TUNNEL_REFUSED.search(str(reason)):
            raise ProxyAuthFailed(_proxy_auth_message(config)) from None
        if isinstance(reason, ssl.SSLCertVerificationError):
            raise CertificateFailed(f"TLS certificate check failed for {origin(url)}: "
                                    f"{reason.verify_message}") from None
        raise UpstreamError(f"Cannot connect to {origin(url)}: {reason}") from None
    except (OSError, ValueError) as exc:
        raise UpstreamError(f"Cannot connect to {origin(url)}: {exc}") from None


# http.client's words when a proxy answers CONNECT with an error; a 401 or 407 to a
# CONNECT is the proxy's own, as the target was never reached.
_TUNNEL_REFUSED = re.compile(r"Tunnel connection failed: 40[17]\b")


def proxy_refused(config: Mapping, url: str, status: int, headers) -> bool:
    """Whether an error answer to `url` is the proxy refusing its credentials, never the
    target's: a 407; an answer that challenges for proxy credentials (some proxies refuse
    with 401 or 403 plus Proxy-Authenticate); or, from a request that went through the
    proxy, a 401 challenging for credentials other than a bearer token, which neither
    the hub nor an upstream asks for (tinyproxy answers a wrong password so, with
    `WWW-Authenticate: Basic realm="Tinyproxy"`)."""
    if status == 407:
        return True
    if not config["proxy_url"] or headers is None or \
            no_proxy_matches(urlsplit(url).hostname or "", config["no_proxy"]):
        return False
    if headers.get("Proxy-Authenticate"):
        return True
    challenge = headers.get("WWW-Authenticate", "").strip().lower()
    return status == 401 and bool(challenge) and not challenge.startswith("bearer") \
        and not headers.get("X-Error-Code")  # huggingface.co's own answers carry one


def origin(url: str) -> str:
    """scheme://host[:port] of `url`: what a message may show of it."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def _proxy_auth_message(config: Mapping) -> str:
    proxy = origin(config["proxy_url"])  # never shows credentials
    if config["proxy_username"]:
        return (f"The proxy {proxy} rejected the credentials of user "
                f"{quote(config['proxy_username'])!r}; check proxy_username and proxy_password")
    return (f"The proxy {proxy} requires authentication; set proxy_username and "
            f"proxy_password")


def retry_after_seconds(headers, cap: float = RETRY_AFTER_CAP) -> float | None:
    """The wait a Retry-After header asks for, in seconds up to `cap`; None if it has none."""
    value = headers.get("Retry-After") if headers is not None else None
    if not value:
        return None
    try:
        seconds = float(value.strip())  # RFC 9110: delay-seconds ...
        if not math.isfinite(seconds):
            return None
    except ValueError:
        try:  # ... or an HTTP date
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.timezone.utc)
        seconds = (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    return min(max(seconds, 0.0), cap)
