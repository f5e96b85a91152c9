"""Outbound HTTP: one urllib opener per request, built from the Config fields.

Proxy, credentials, no_proxy and the SSL flags come only from Config (spec 2.1),
never from the environment, and are read afresh for every request, so a change
applies to the next one without a restart. The hub token is added as an
unredirected header, so it reaches the hub and never the host a redirect leads to.
(Pull tasks, resume and progress are still to come.)
"""

from __future__ import annotations

import base64
import ipaddress
import ssl
import urllib.error
import urllib.request
from typing import Mapping
from urllib.parse import quote, unquote, urlsplit

from localrt.errors import UpstreamError


class ProxyAuthFailed(UpstreamError):
    code = "proxy_auth_failed"


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
            # Sent to the proxy only: on https targets urllib moves it to the CONNECT.
            req.add_header("Proxy-Authorization", self._auth)
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


def build_opener(config: Mapping) -> urllib.request.OpenerDirector:
    """An opener honouring the proxy, no_proxy and SSL fields of `config`."""
    handlers = [urllib.request.HTTPSHandler(context=ssl_context(config))]
    if config["proxy_url"]:
        handlers.append(_ConfigProxyHandler(config["proxy_url"], config["proxy_username"],
                                            config["proxy_password"], config["no_proxy"]))
    else:
        handlers.append(urllib.request.ProxyHandler({}))  # never the environment's proxy
    return urllib.request.build_opener(*handlers)


def open_url(config: Mapping, url: str, *, hub_url: str | None = None, headers=None,
             timeout: float = 30.0):
    """Open `url`; the hub token goes to the hub's host only. Raises UpstreamError."""
    req = urllib.request.Request(url, headers=dict(headers or {}))
    token = config.get("modelhub_token")
    if token and hub_url and urlsplit(url).netloc == urlsplit(hub_url).netloc:
        req.add_unredirected_header("Authorization", f"Bearer {token}")
    try:
        return build_opener(config).open(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 407:
            exc.close()
            raise ProxyAuthFailed(_proxy_auth_message(config)) from None
        raise  # the caller knows what a 401, 403 or 404 from the hub means
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, OSError) and "407" in str(reason):
            raise ProxyAuthFailed(_proxy_auth_message(config)) from None
        if isinstance(reason, ssl.SSLCertVerificationError):
            raise UpstreamError(f"TLS certificate check failed for {_origin(url)}: "
                                f"{reason.verify_message}") from None
        raise UpstreamError(f"Cannot connect to {_origin(url)}: {reason}") from None
    except (OSError, ValueError) as exc:
        raise UpstreamError(f"Cannot connect to {_origin(url)}: {exc}") from None


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def _proxy_auth_message(config: Mapping) -> str:
    proxy = _origin(config["proxy_url"])  # never shows credentials
    if config["proxy_username"]:
        return (f"The proxy {proxy} rejected the credentials of user "
                f"{quote(config['proxy_username'])!r}; check proxy_username and proxy_password")
    return (f"The proxy {proxy} requires authentication; set proxy_username and "
            f"proxy_password")
