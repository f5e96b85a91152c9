"""The chat page: its files (package data in this folder: index.html, the JavaScript
modules, the style sheet and the icon) and the headers each is served with.

The page is plain HTML, CSS and JavaScript modules with no build step, and talks only
to this server's own API (localrt-api(7)). Its Content-Security-Policy allows nothing
from another origin, no inline script and no eval, so a reply that smuggles markup in
cannot run script even where the page's own renderer had a bug.
"""

from __future__ import annotations

from importlib import resources

from localrt.errors import NotFound, shown

INDEX = "index.html"
# What a file of the folder is served as, by its suffix; no other file is served.
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# Images are the page's own, or data: and blob: URLs of pictures the user attaches.
# Media is widened by blob: alone, for the <audio> players of clips (recorded or
# attached): the page makes a blob: URL of each clip, which only its own script can do.
# The microphone needs nothing more: getUserMedia is not under the policy, and the
# AudioWorklet that records (capture.js) loads from 'self' under script-src.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; "
       "img-src 'self' data: blob:; media-src 'self' blob:; connect-src 'self'; "
       "frame-ancestors 'none'; base-uri 'none'; form-action 'none'; object-src 'none'")
# On every page response. no-cache: a browser asks again (cheaply) after an upgrade.
HEADERS = (("Content-Security-Policy", CSP), ("X-Content-Type-Options", "nosniff"),
           ("Referrer-Policy", "no-referrer"), ("X-Frame-Options", "DENY"),
           ("Cache-Control", "no-cache"))


def names() -> list[str]:
    """The files the page is made of, as the folder holds them."""
    return sorted(f.name for f in resources.files(__name__).iterdir()
                  if f.is_file() and _suffix(f.name) in MEDIA_TYPES)


def read(name: str) -> tuple[bytes, str]:
    """A file of the page and its media type; a 404 for any name the folder lacks (a
    path, "..", this module)."""
    if name not in names():
        raise NotFound(f"No such file of the chat page: {shown(name)}")
    return resources.files(__name__).joinpath(name).read_bytes(), MEDIA_TYPES[_suffix(name)]


def _suffix(name: str) -> str:
    return name[name.rfind("."):] if "." in name else ""
