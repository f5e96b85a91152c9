"""The Config resource: CORS, proxy, SSL flags and the hub token.

Its fields are the settings keys that carry an `api` name (localrt.settings.KEYS),
so the rc file is the only store. Types and shapes are checked by
schemas/config-update.json before `update` is called.
"""

from __future__ import annotations

from typing import Any, Mapping

from localrt.errors import Conflict, InvalidField
from localrt.fsutil import storage_error
from localrt.settings import KEYS, Settings, SettingsError

# API field name -> rc key, sorted by field name: the order replies list them in.
FIELDS = {k.api: k.name for k in sorted(KEYS, key=lambda k: k.api or "") if k.api}
LOCAL_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0")


def local_origins(port: int) -> list[str]:
    """The default `allowed_origins`: the local hosts on the API port."""
    return [f"http://{host}:{port}" for host in LOCAL_HOSTS]


class Config:
    """Reads and updates the Config fields over a Settings object."""

    def __init__(self, settings: Settings):
        self._settings = settings

    def get(self) -> dict:
        """All Config fields, with defaults filled in."""
        return self._view(self._settings.snapshot())

    def update(self, changes: Mapping[str, Any]) -> dict:
        """Persist the given fields only; return the full Config after the change."""
        if changes.get("proxy_url"):
            _check_proxy_url(changes["proxy_url"])
        try:
            values = self._settings.update({FIELDS[k]: v for k, v in changes.items()})
        except SettingsError as exc:  # hand-edited meanwhile; left as it is
            raise Conflict(f"{exc}. Nothing was changed.") from None
        except OSError as exc:  # the file stays as it was (atomic_write)
            path = self._settings.path
            raise storage_error(exc, path.parent, f"write the settings file {path}",
                                after="Nothing was changed.") from None
        return self._view(values)

    def cors_enabled(self) -> bool:
        return self._settings["cors"]

    def origin_allowed(self, origin: str) -> bool:
        """Whether CORS lets `origin` in right now (exact match, or `*`)."""
        origins = self._settings["allowedOrigins"]
        if origins is None:
            origins = local_origins(self._settings["apiServerPort"])
        return origin in origins or "*" in origins

    def _view(self, values: Mapping[str, Any]) -> dict:
        config = {name: values[key] for name, key in FIELDS.items()}
        if config["allowed_origins"] is None:
            config["allowed_origins"] = local_origins(values["apiServerPort"])
        return config


def _check_proxy_url(url: str) -> None:
    """What the schema's pattern cannot say: a host, and a port from 1 to 65535."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidField(f"Invalid field 'proxy_url': {exc}", param="proxy_url") from None
    if not parts.hostname or port == 0:
        raise InvalidField("Invalid field 'proxy_url': expected http://host[:port]",
                           param="proxy_url")
