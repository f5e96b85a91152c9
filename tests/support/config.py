"""The Config fields for outbound requests, as GET /v1/configs gives them."""

from __future__ import annotations

# Config fields for outbound requests, as GET /v1/configs gives them, minus the proxy.
OUTBOUND = {"proxy_url": "", "proxy_username": "", "proxy_password": "", "no_proxy": "",
            "verify_host_ssl": True, "verify_peer_ssl": True, "verify_proxy_host_ssl": True,
            "verify_proxy_ssl": True, "modelhub_token": ""}


def outbound_config(**changes) -> dict:
    """OUTBOUND with `changes`: a Config for the code that makes outbound requests."""
    return {**OUTBOUND, **changes}
