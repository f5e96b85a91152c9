"""The media of a chat request (localrt.native.Media parts): which kinds the model takes,
and each part read and checked before any compute.

Every dialect turns its own shapes into Media parts (bytes, or a data: or http(s) URL,
with the dialect's own path of the part, `where`), so one place reads them all:

  KINDS     each kind of media a model may take, with the capability its record names
            it by (localrt.models.registry.capabilities): an image is "vision", a clip
            "audio", as the records and Ollama's /api/show say them.
  check     before anything else (before a model starts): a part of a kind the model
            does not take is refused, naming the model (images_not_supported for an
            image, audio_not_supported for a clip); more than maxMediaPerRequest
            images and clips together (maxImagesPerRequest is its old name) is a 400
            naming the first one too many
  Images    an image part as a contract.Image: bytes as they are; a data: URL is
            decoded; an http(s) URL is fetched (imageUrlFetch), in the request's own
            thread, before the model's turn; the bytes must start as PNG, JPEG, BMP or
            GIF do (llama.cpp decodes them later, and says invalid_image if it cannot)
  clip      an audio part as a contract.Audio: bytes, or a data: URL of them; at most
            AUDIO_MAX_BYTES (413 audio_too_large); WAV, MP3 or FLAC by signature
            (localrt.engines.audio) with a header that says how long it plays, or
            invalid_audio; no longer than maxAudioSeconds (400 audio_too_long naming
            the limit). The projector's own decoder (mtmd's) reads the samples later.

Fetches go through localrt.outbound, so the Config's proxy, no_proxy and TLS flags
apply, with at most MAX_BYTES an image and FETCH_TIMEOUT seconds all told. An address
on loopback, a link-local or private network, or one that is unspecified, multicast or
reserved is refused unless imageUrlHosts names its host or a range that holds it: the
name is resolved and checked first, and the connected socket's peer again (so a name
that resolves elsewhere the second time is caught), on every redirect, which are
followed here, at most MAX_REDIRECTS. Through a proxy the peer is the proxy, and the
proxy resolves the name: only the first check applies, and a name this host cannot
resolve is left to the proxy. Each error names the part (`where`, the dialect's own
path of it).
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import socket
import struct
import time
import urllib.error
from dataclasses import dataclass
from typing import Callable, Mapping
from urllib.parse import unquote_to_bytes, urljoin, urlsplit, urlunsplit

from localrt.engines.contract import Audio, Image
from localrt.engines.llama.media import image_format, refuse_audio, refuse_images
from localrt.errors import (AudioTooLarge, AudioTooLong, HTTPError, ImageTooLarge,
                            InvalidAudio, InvalidField, InvalidImage)
from localrt.engines import audio as clips
from localrt.models.registry import capabilities

MAX_BYTES = 20 * 1024 * 1024  # one image; what Anthropic and OpenAI take, about
AUDIO_MAX_BYTES = 25 * 1024 * 1024  # one clip; what OpenAI's transcriptions take
FETCH_TIMEOUT = 30.0          # seconds for one image's fetch, redirects included
MAX_REDIRECTS = 5
_CHUNK = 64 * 1024


class ImageURLRefused(InvalidField):
    """An image URL this server will not fetch: fetching is off (imageUrlFetch), or its
    host is on loopback or a private network that imageUrlHosts does not allow."""

    code = "image_url_refused"


class ImageFetchFailed(InvalidField):
    """An image URL that could not be fetched: no such host, no connection, an error
    status, a timeout; the message says which, with the URL."""

    code = "image_fetch_failed"


@dataclass(frozen=True)
class Policy:
    """The settings media are read under (localrtrc(5)): imageUrlFetch, imageUrlHosts,
    maxMediaPerRequest (images and clips together) and maxAudioSeconds."""

    fetch: bool = True
    hosts: tuple = ()
    max_media: int = 8
    max_audio_seconds: int = 600

    @classmethod
    def of(cls, settings) -> "Policy":
        """The policy the settings give now (read for each request: a change applies to
        the next one)."""
        most = settings["maxMediaPerRequest"] or settings["maxImagesPerRequest"]
        return cls(bool(settings["imageUrlFetch"]), tuple(settings["imageUrlHosts"]),
                   int(most), int(settings["maxAudioSeconds"]))


# --- the parts of a request -----------------------------------------------------------


# The kinds of media a model may take, each with the capability that says it takes them
# (a record's capabilities: localrt.models.registry, from its files' roles). If you add
# a kind, also give it a reader (Images.read_media) and a refusal in `check`.
KINDS = {"image": "vision", "audio": "audio"}
REFUSALS = {"image": refuse_images, "audio": refuse_audio}


def kinds(record: dict) -> set:
    """The kinds of media a model takes, by its record's capabilities."""
    own = capabilities(record)
    return {kind for kind, capability in KINDS.items() if capability in own}


def check(model_id: str, takes: set, media: list, policy: Policy) -> int:
    """How many images and clips the request's Media parts are, once the model takes
    each part's kind (`takes`, from `kinds`) and they are not too many:
    ImagesNotSupported (AudioNotSupported) for an image (a clip) a model cannot take, a
    400 naming a part of a kind no model takes here, or a 400 naming the first part
    past the limit."""
    for part in media:
        if part.kind not in takes:
            if part.kind in REFUSALS:
                raise REFUSALS[part.kind](model_id)
            raise InvalidField(f"Invalid field '{part.where}': localrt reads no "
                               f"{part.media_type} media", param=part.where)
    found = [m.where for m in media if m.kind in KINDS]
    if len(found) > policy.max_media:
        where = found[policy.max_media]
        raise InvalidField(f"Invalid field '{where}': the request has {len(found)} images "
                           f"and audio clips; at most {policy.max_media} are taken "
                           f"(maxMediaPerRequest)", param=where)
    return len(found)


# --- bytes ----------------------------------------------------------------------------


def media_type(data: bytes) -> str | None:
    """The image type the first bytes say (image/png, ...), None for anything else: the
    formats llama.cpp reads (localrt.engines.vision.image_format)."""
    kind = image_format(data)
    return None if kind is None else f"image/{kind}"


def image(data: bytes, where: str) -> Image:
    """`data` as an Image, once its size and first bytes are an image's."""
    if len(data) > MAX_BYTES:
        raise too_large(where, len(data))
    if media_type(data) is None:
        shown = "no bytes" if not data else f"bytes starting {data[:8].hex(' ')}"
        raise InvalidImage(f"Invalid field '{where}': not an image llama.cpp reads (PNG, "
                           f"JPEG, BMP or GIF): {shown}", param=where)
    return Image(data=data, where=where)


def clip(data: bytes, where: str, max_seconds: float) -> Audio:
    """`data` as an Audio clip, once its size, signature and length are a clip's that
    may be taken: AudioTooLarge, InvalidAudio or AudioTooLong naming the part."""
    if len(data) > AUDIO_MAX_BYTES:
        raise audio_too_large(where, len(data))
    kind = clips.format_of(data)
    if kind is None:
        shown = "no bytes" if not data else f"bytes starting {data[:8].hex(' ')}"
        raise InvalidAudio(f"Invalid field '{where}': not audio llama.cpp reads (WAV, MP3 "
                           f"or FLAC): {shown}", param=where)
    try:
        length = clips.seconds(data, kind, limit=max_seconds)
    except (ValueError, struct.error) as exc:
        raise InvalidAudio(f"Invalid field '{where}': a malformed {kind.upper()} clip: {exc}",
                           param=where) from None
    if length > max_seconds:
        raise AudioTooLong(f"Invalid field '{where}': the clip is {length:.1f} seconds "
                           f"long; at most {max_seconds} seconds are taken "
                           f"(maxAudioSeconds)", param=where)
    return Audio(data=data, where=where, format=kind, seconds=length)


def audio_too_large(where: str, size: int | None = None) -> AudioTooLarge:
    """The 413 of a clip past AUDIO_MAX_BYTES."""
    said = f"is {size} bytes" if size is not None else "is larger than that"
    return AudioTooLarge(f"Audio '{where}' {said}; the limit is {AUDIO_MAX_BYTES} bytes "
                         f"(25 MiB) a clip", param=where)


def audio_from_base64(text: str, where: str) -> bytes:
    """The bytes of a clip's base64 text (whitespace and missing padding forgiven),
    within AUDIO_MAX_BYTES; InvalidAudio naming the part when it is not base64."""
    if not isinstance(text, str):
        raise InvalidAudio(f"Invalid field '{where}': expected the clip as base64 text",
                           param=where)
    text = "".join(text.split())
    if len(text) // 4 * 3 > AUDIO_MAX_BYTES + 2:  # before decoding, as from_base64
        raise audio_too_large(where, len(text) // 4 * 3)
    text += "=" * (-len(text) % 4)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        try:
            return base64.b64decode(text.replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError):
            raise InvalidAudio(f"Invalid field '{where}': the audio is not valid base64",
                               param=where) from None


def too_large(where: str, size: int | None = None) -> ImageTooLarge:
    """The 413 of an image past MAX_BYTES."""
    said = f"is {size} bytes" if size is not None else "is larger than that"
    return ImageTooLarge(f"Image '{where}' {said}; the limit is {MAX_BYTES} bytes (20 MiB) "
                         f"an image", param=where)


def from_base64(text: str, where: str) -> bytes:
    """The bytes of base64 text (whitespace and missing padding forgiven), within
    MAX_BYTES; InvalidImage naming the part when it is not base64."""
    text = "".join(text.split())
    if len(text) // 4 * 3 > MAX_BYTES + 2:  # before decoding: no 100 MiB decode to refuse
        raise too_large(where, len(text) // 4 * 3)
    text += "=" * (-len(text) % 4)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        try:  # the URL-safe alphabet some clients use
            data = base64.b64decode(text.replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError):
            raise InvalidImage(f"Invalid field '{where}': the image is not valid base64",
                               param=where) from None
    return data


def from_data_url(url: str, where: str) -> bytes:
    """The bytes of a data: URL (base64, or percent-encoded); InvalidImage naming the
    part when it is malformed."""
    head, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise InvalidImage(f"Invalid field '{where}': a malformed data URL (no comma "
                           f"before the data); expected data:image/png;base64,...",
                           param=where)
    params = [p.strip().lower() for p in head.split(";")]
    if params[0] and not params[0].startswith("image/") and \
            params[0] != "application/octet-stream":
        raise InvalidImage(f"Invalid field '{where}': a data URL of {params[0]!r}, not an "
                           f"image", param=where)
    if "base64" in params[1:]:
        return from_base64(payload, where)
    if len(payload) > 3 * MAX_BYTES:
        raise too_large(where)
    return unquote_to_bytes(payload)


def data_url(b64: str) -> str:
    """A data: URL for base64 image or audio bytes (Ollama's `images`), typed by their
    first bytes, so that an upstream that wants a media type gets one, and an audio
    clip is told from an image."""
    if b64.startswith("data:"):
        return b64
    try:
        head = base64.b64decode("".join(b64[:64].split())[:48], validate=False)
    except (binascii.Error, ValueError):
        head = b""
    kind = clips.format_of(head) if head[:3] != b"\xff\xd8\xff" else None
    typed = clips.MEDIA_TYPES[kind] if kind else media_type(head)
    return f"data:{typed or 'application/octet-stream'};base64,{b64}"


# --- URLs -----------------------------------------------------------------------------


def allowed(host: str, address, hosts) -> bool:
    """Whether imageUrlHosts lets a fetch reach `address` (of the URL's `host`): an entry
    that is the host's name (or a domain above it, written .example.com), the address,
    or a CIDR range holding it."""
    name = host.strip("[]").lower().rstrip(".")
    for entry in hosts:
        entry = entry.strip().lower()
        if "/" in entry:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except (ValueError, TypeError):
                continue
            continue
        try:
            if ipaddress.ip_address(entry.strip("[]")) == address:
                return True
            continue
        except ValueError:
            pass
        entry = entry.rstrip(".")
        if entry.startswith("."):
            if name.endswith(entry) or name == entry[1:]:
                return True
        elif name == entry:
            return True
    return False


def public(address) -> bool:
    """Whether an address is on the public internet: not loopback, link-local, private,
    shared (CGNAT), unspecified, multicast or reserved."""
    if getattr(address, "ipv4_mapped", None) is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


class Images:
    """Reads image URLs into contract.Image: `read(url, where)`.

    `config()` gives the Config fields (proxy, no_proxy, TLS flags) for each fetch, as
    localrt.downloads.opener takes them; `policy()` the settings' Policy; `resolve(host,
    port)` the addresses of a name (socket.getaddrinfo's, replaced by tests).
    """

    def __init__(self, config: Callable[[], Mapping], policy: Callable[[], Policy],
                 resolve: Callable | None = None):
        self._config = config
        self.policy = policy
        self._resolve = resolve or _resolve

    def read_media(self, media) -> Image | Audio:
        """The image or clip of a Media part (localrt.native.Media): its bytes, or what
        its URL holds, checked; a 400 (or a 413) naming the part's `where` otherwise."""
        if media.kind == "audio":
            return self.read_audio(media)
        if isinstance(media.data, bytes):
            return image(media.data, media.where)
        return self.read(media.data, media.where)

    def read_audio(self, media) -> Audio:
        """The clip of an audio Media part: its bytes, or a data: URL's (base64), checked
        under the policy's maxAudioSeconds."""
        data, where = media.data, media.where
        if isinstance(data, str):
            if not data.startswith("data:"):
                raise InvalidAudio(f"Invalid field '{where}': audio is taken as base64 "
                                   f"data, not a URL", param=where)
            head, comma, payload = data[len("data:"):].partition(",")
            if not comma or "base64" not in head.lower().split(";")[1:]:
                raise InvalidAudio(f"Invalid field '{where}': a malformed data URL; "
                                   f"expected data:audio/wav;base64,...", param=where)
            data = audio_from_base64(payload, where)
        return clip(data, where, self.policy().max_audio_seconds)

    def read(self, url, where: str) -> Image:
        """The image a URL (data: or http(s)) holds, checked; a 400 (or a 413) naming
        the part otherwise."""
        if not isinstance(url, str) or not url:
            raise InvalidImage(f"Invalid field '{where}': expected an image URL (data: or "
                               f"http(s)://)", param=where)
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return image(from_data_url(url, where), where)
        if scheme in ("http", "https"):
            return image(self.fetch(url, where), where)
        raise InvalidImage(f"Invalid field '{where}': an image URL must be a data: URL or "
                           f"http(s)://, not {(scheme or url[:20])!r}", param=where)

    def fetch(self, url: str, where: str) -> bytes:
        """The body at an http(s) URL, following redirects here (each checked), within
        MAX_BYTES and FETCH_TIMEOUT."""
        from localrt.outbound import open_url

        policy = self.policy()
        if not policy.fetch:
            raise ImageURLRefused(f"Invalid field '{where}': image URLs are not fetched "
                                  f"by this server (imageUrlFetch is false); send the image "
                                  f"as a data: URL", param=where)
        config = self._config()
        deadline = time.monotonic() + FETCH_TIMEOUT
        for _ in range(MAX_REDIRECTS + 1):
            host = self._check(url, where, policy, config)
            sockets: list = []

            def on_socket(sock, host=host):
                sockets.append(sock)
                if not _proxied(config, host):
                    self._check_peer(sock, host, url, where, policy)

            try:
                response = open_url(config, url, timeout=_left(deadline, url, where),
                                    on_socket=on_socket, redirects=False,
                                    headers={"Accept": "image/*",
                                             "User-Agent": "localrt"})
            except urllib.error.HTTPError as exc:
                location = exc.headers.get("Location") if exc.headers else None
                exc.close()
                if 300 <= exc.code < 400 and location:
                    url = urljoin(url, location)
                    continue
                raise ImageFetchFailed(f"Invalid field '{where}': cannot fetch the image "
                                       f"at {shown(url)}: the server answered {exc.code} "
                                       f"{exc.reason}", param=where) from None
            except InvalidField:
                raise
            except HTTPError as exc:  # no connection, TLS, the proxy (opener's errors)
                raise ImageFetchFailed(f"Invalid field '{where}': cannot fetch the image at "
                                       f"{shown(url)}: {exc.message}", param=where) from None
            with response:
                return _body(response, sockets, deadline, url, where)
        raise ImageFetchFailed(f"Invalid field '{where}': cannot fetch the image at "
                               f"{shown(url)}: more than {MAX_REDIRECTS} redirects",
                               param=where)

    def _check(self, url: str, where: str, policy: Policy, config: Mapping) -> str:
        """The URL's host, once it and the addresses it resolves to may be fetched."""
        try:
            parts = urlsplit(url)
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise ImageFetchFailed(f"Invalid field '{where}': a malformed image URL: {exc}",
                                   param=where) from None
        if parts.scheme.lower() not in ("http", "https") or not host:
            raise ImageURLRefused(f"Invalid field '{where}': an image URL leads to "
                                  f"{shown(url)}; only http(s) URLs with a host are "
                                  f"fetched", param=where)
        name = host.rstrip(".").lower()
        if name == "invalid" or name.endswith(".invalid"):  # RFC 6761: never resolves
            raise ImageFetchFailed(f"Invalid field '{where}': cannot fetch the image at "
                                   f"{shown(url)}: {host} does not resolve (.invalid)",
                                   param=where)
        try:
            addresses = [ipaddress.ip_address(host)]
        except ValueError:
            try:
                addresses = self._resolve(host, port or (443 if parts.scheme == "https"
                                                         else 80))
            except OSError as exc:
                if _proxied(config, host):
                    return host  # the proxy resolves it
                raise ImageFetchFailed(f"Invalid field '{where}': cannot fetch the image "
                                       f"at {shown(url)}: {host} does not resolve "
                                       f"({exc.strerror or exc})", param=where) from None
        for address in addresses:
            _refuse(host, address, url, where, policy)
        return host

    def _check_peer(self, sock, host: str, url: str, where: str, policy: Policy) -> None:
        """The connected socket's peer, checked as its name's addresses were."""
        try:
            address = ipaddress.ip_address(sock.getpeername()[0].split("%", 1)[0])
        except (OSError, ValueError, IndexError):
            return
        try:
            _refuse(host, address, url, where, policy)
        except ImageURLRefused:
            sock.close()
            raise


def _refuse(host: str, address, url: str, where: str, policy: Policy) -> None:
    if not public(address) and not allowed(host, address, policy.hosts):
        raise ImageURLRefused(
            f"Invalid field '{where}': the image URL {shown(url)} leads to {address}, a "
            f"loopback, link-local or private address, which is fetched only when "
            f"imageUrlHosts allows it", param=where)


def _resolve(host: str, port: int) -> list:
    """The addresses of a host name, as a connection would try them."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]


def _proxied(config: Mapping, host: str) -> bool:
    """Whether a request to `host` goes through the Config's proxy."""
    from localrt.outbound import no_proxy_matches

    return bool(config.get("proxy_url")) and \
        not no_proxy_matches(host, config.get("no_proxy") or "")


def _left(deadline: float, url: str, where: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise ImageFetchFailed(f"Invalid field '{where}': cannot fetch the image at "
                               f"{shown(url)}: it took more than {FETCH_TIMEOUT:g} s",
                               param=where)
    return left


def _body(response, sockets: list, deadline: float, url: str, where: str) -> bytes:
    """A response's body, within MAX_BYTES (its Content-Length first) and the deadline."""
    length = response.headers.get("Content-Length")
    if length and length.strip().isdigit() and int(length) > MAX_BYTES:
        raise too_large(where, int(length))
    chunks, size = [], 0
    while True:
        left = _left(deadline, url, where)
        for sock in sockets:
            try:
                sock.settimeout(left)
            except OSError:
                pass
        try:
            chunk = response.read(_CHUNK)
        except (OSError, ValueError) as exc:
            if isinstance(exc, (socket.timeout, TimeoutError)):
                _left(deadline, url, where)
            raise ImageFetchFailed(f"Invalid field '{where}': cannot fetch the image at "
                                   f"{shown(url)}: the transfer broke off ({exc})",
                                   param=where) from None
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_BYTES:
            raise too_large(where)
        chunks.append(chunk)


def shown(url: str) -> str:
    """A URL as a message may show it: no user or password, at most 200 characters."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc.rpartition("@")[2]
        url = urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
    except ValueError:
        pass
    return url if len(url) <= 200 else url[:197] + "..."
