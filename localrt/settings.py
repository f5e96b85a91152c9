"""The settings file `~/.localrtrc`: one typed table, read and written in one place.

Every environment variable localrt honours is read here too (`ENVIRONMENT`).
The file is YAML (`safe_load` only). Unknown keys are kept and warned about,
never dropped. Writes are atomic and the file is mode 0600, because it holds
the proxy password and the hub token.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from localrt.fsutil import atomic_write, remove_stale_temps

log = logging.getLogger(__name__)

RC_NAME = ".localrtrc"
DEFAULT_PORT = 39281


class SettingsError(Exception):
    """The settings file cannot be used as it is; the message names the file and line."""


# --- converters: raw YAML value -> typed value, or ValueError saying why ----------


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__} (quote the value)")
    return value


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"expected a port number from 0 to 65535, got {value!r}")
    return value


def _path(value: Any) -> str:
    return os.path.expanduser(_string(value))


def _origins(value: Any) -> list | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("expected a list of origin strings")
    return list(value)


def _hub_url(value: Any) -> str:
    from urllib.parse import urlsplit

    url = _string(value).rstrip("/")
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise ValueError(f"expected an http:// or https:// URL, got {value!r}")
    return url


def _log_level(value: Any) -> str:
    level = _string(value).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError(f"expected DEBUG, INFO, WARNING or ERROR, got {value!r}")
    return level


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected a whole number of 1 or more, got {value!r}")
    return value


def _places(value: Any) -> int:
    """Requests that may wait: each holds a connection, so never more than the open
    files the server asks for (localrt.server.OPEN_FILES_CAP)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65536:
        raise ValueError(f"expected a whole number from 0 to 65536, got {value!r}")
    return value


def _mebibytes(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 30:
        raise ValueError("must be a whole number of MiB, 0 or more")
    return value


def _api_keys(value: Any) -> list:
    """A list of keys, or one key (as $LOCALRT_API_KEY gives it); none is []."""
    if value is None or value == "":
        return []
    keys = [value] if isinstance(value, str) else value
    if not isinstance(keys, list) or not all(isinstance(k, str) and k and k.isprintable()
                                             and not any(c.isspace() for c in k) for k in keys):
        raise ValueError("expected a list of keys, each a non-empty string without spaces")
    return list(keys)


def _hosts(value: Any) -> list:
    """Host names, addresses and CIDR ranges (10.0.0.0/8); none is []."""
    import ipaddress

    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(h, str) and h and h.isprintable()
                                              and not any(c.isspace() for c in h)
                                              for h in value):
        raise ValueError("expected a list of host names, addresses or CIDR ranges")
    for host in value:
        if "/" in host:
            try:
                ipaddress.ip_network(host, strict=False)
            except ValueError as exc:
                raise ValueError(f"{host!r} is not a CIDR range: {exc}") from None
    return list(value)


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or value == float("inf"):
        raise ValueError(f"expected a number of seconds above 0, got {value!r}")
    return value


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600}


def _minutes(value: Any) -> float:
    """Minutes, from a number or Ollama's style: "30s", "5m", "1h"; 0 is off.

    A number converts to itself, so the value written back to the file reads the same.
    """
    if isinstance(value, str) and value.strip()[-1:].lower() in _DURATION_UNITS:
        text = value.strip()
        try:
            minutes = float(text[:-1]) * _DURATION_UNITS[text[-1].lower()] / 60
        except ValueError:
            raise ValueError(f"expected minutes or a duration like 30s, 5m or 1h, "
                             f"got {value!r}") from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        minutes = float(value)
    else:
        raise ValueError(f"expected minutes or a duration like 30s, 5m or 1h, got {value!r}")
    if minutes < 0:
        raise ValueError(f"expected a duration of 0 (off) or more, got {value!r}")
    return minutes


@dataclass(frozen=True)
class Key:
    """One settings key: its rc name, converter, default and meaning.

    `default` is a value, or a function of the settings read so far (keys are
    resolved in table order). `api` is the Config field (localrt.config) it backs.
    """

    name: str
    convert: Callable[[Any], Any]
    default: Any
    comment: str
    api: str | None = None
    env: str | None = None  # an environment variable that overrides the file for this run
    secret: bool = False  # never shown in logs, error messages or task payloads


# The one table of settings; man/localrtrc.5 gives every key with its default and
# variable, in this order (tests/test_man.py checks). If you add a Config field (a key
# with `api`), also add it to schemas/config.json and schemas/config-update.json (whose
# description and x-metavar make its `localrt config` flag, and whose fields
# man/localrt-api.7 lists for PATCH /v1/configs).
KEYS: tuple[Key, ...] = (
    Key("apiServerHost", _string, "127.0.0.1", "address the API server binds"),
    Key("apiServerPort", _port, DEFAULT_PORT, "port the API server binds"),
    Key("webUi", _boolean, True, "whether GET / serves the chat page (localrt.web); "
        "false makes it a 404"),
    Key("dataFolderPath", _path, lambda s: str(s["_home"] / "localrt"),
        "models, engines and the pid file live here"),
    Key("logFolderPath", _path, lambda s: str(Path(s["dataFolderPath"]) / "logs"),
        "the server's rotating log file lives here"),
    Key("logLevel", _log_level, "INFO", "DEBUG, INFO, WARNING or ERROR"),
    Key("modelHubUrl", _hub_url, "https://huggingface.co",
        "Hugging Face-compatible hub that models are pulled from", env="LOCALRT_MODELHUB_URL"),
    Key("modelHubOrg", _string, "cortexso", "hub organization holding the built-in models"),
    Key("engineIndexUrl", _hub_url, "https://pypi.org/simple",
        "Python package index (PEP 691 or 503) engine wheels come from",
        env="LOCALRT_ENGINE_INDEX_URL"),
    Key("maxRunningModels", _positive_int, 2,
        "models loaded at once; starting one more unloads the least recently used"),
    # 512: Ollama's OLLAMA_MAX_QUEUE. One bound for all kinds (localrt.admission.Queue).
    Key("maxQueuedRequests", _places, 512,
        "chat, completion, embedding and rerank requests that may wait, all kinds "
        "together, for a place once their kind is at its limit; past that, a 503 (0: no "
        "waiting)"),
    Key("keepAlive", _minutes, 0.0,
        "unload a model idle this long: minutes, or 30s/5m/1h; 0 keeps models loaded"),
    # llama-server's --cache-ram keeps 8 GiB; a 2-core machine's models are smaller.
    Key("promptCacheMiB", _mebibytes, 2048,
        "RAM each running gguf-cpp model may keep of prompt states its slots gave up, "
        "to restore for a prompt that continues one (0: none)"),
    # 512: Ollama's OLLAMA_GPU_OVERHEAD is 0, but a desktop's own windows take about that.
    Key("gpuOverheadMiB", _mebibytes, 512,
        "MiB of each GPU's free memory that fitting a model's layers (a GPU build started "
        "without ngl) leaves to other programs"),
    Key("computeLanes", _positive_int, 1,
        "generations that compute at once, across all models; raise it only with cores "
        "for each (cpu_threads x lanes <= cores)"),
    # 8: what aria2c -x and Ollama use; a CDN caps each connection, so several fill a link.
    Key("downloadConnections", _positive_int, 8,
        "connections that fetch one file of 64 MiB or more at once; 1 fetches every file "
        "in one stream"),
    # 300: what a long reply of a big model may take before its first byte, behind a queue.
    Key("upstreamTimeout", _seconds, 300,
        "seconds a remote model's upstream has to send the first byte of a reply (and each "
        "next one); past that, a 504"),
    # nginx's client_header_timeout and keepalive_timeout, as two clocks (localrt.connections).
    Key("requestTimeout", _seconds, 10,
        "seconds a client has, from connecting or from the first byte of a request, to "
        "send the whole request; a slower one is disconnected"),
    Key("keepAliveTimeout", _seconds, 30,
        "seconds an idle connection is kept open after a reply for the next request"),
    # nginx's limit_conn: one address cannot take every connection of an exposed server.
    Key("maxConnectionsPerClient", _positive_int, 64,
        "connections one client address may hold when the server listens beyond "
        "loopback; more are closed at once"),
    # rpc-server has no authentication: nothing but loopback unless the user says so.
    Key("rpcTrustedHosts", _hosts, [],
        "hosts (names, addresses or CIDR ranges) besides loopback whose rpc-server a "
        "model may be split across (start option rpc_servers)"),
    # Image URLs in chat requests (localrt.inference.media). A request's URL is the
    # client's choice, so by default it never reaches this host or its networks.
    Key("imageUrlFetch", _boolean, True,
        "whether http(s) image URLs in chat requests are fetched; false refuses them "
        "(data: URLs are always taken)"),
    Key("imageUrlHosts", _hosts, [],
        "hosts (names, addresses or CIDR ranges) on loopback, link-local or private "
        "networks that image URLs may be fetched from"),
    Key("maxImagesPerRequest", _positive_int, 8,
        "the old name of maxMediaPerRequest, which follows it unless set itself"),
    # None: maxImagesPerRequest's value (localrt.inference.media.Policy), so that a file
    # that sets only the old name keeps working.
    Key("maxMediaPerRequest", _positive_int, None,
        "images and audio clips one chat request may carry, together"),
    Key("maxAudioSeconds", _positive_int, 600,
        "the longest audio clip a request may carry, in seconds"),
    Key("apiKeys", _api_keys, [],
        "bearer keys that clients must send; required to bind other than loopback",
        env="LOCALRT_API_KEY", secret=True),
    # None means: the local origins on the API port, so a port change keeps them right.
    Key("allowedOrigins", _origins, None, "origins allowed by CORS", api="allowed_origins"),
    Key("cors", _boolean, True, "whether CORS headers are sent", api="cors"),
    Key("modelhubToken", _string, "", "bearer token for the model hub", api="modelhub_token",
        secret=True),
    Key("noProxy", _string, "localhost,127.0.0.1,::1", "hosts that bypass the proxy",
        api="no_proxy"),
    Key("proxyUrl", _string, "", "http(s) proxy for outbound requests", api="proxy_url"),
    Key("proxyUsername", _string, "", "proxy Basic auth user", api="proxy_username"),
    Key("proxyPassword", _string, "", "proxy Basic auth password", api="proxy_password",
        secret=True),
    Key("verifyHostSsl", _boolean, True, "check the hostname of TLS peers", api="verify_host_ssl"),
    Key("verifyPeerSsl", _boolean, True, "check the certificate chain of TLS peers",
        api="verify_peer_ssl"),
    Key("verifyProxyHostSsl", _boolean, True, "check an https proxy's hostname",
        api="verify_proxy_host_ssl"),
    Key("verifyProxySsl", _boolean, True, "check an https proxy's certificate chain",
        api="verify_proxy_ssl"),
)
KEYS_BY_NAME = {k.name: k for k in KEYS}
# Hand-edited files may use the API field names; they read as the rc key.
ALIASES = {k.api: k.name for k in KEYS if k.api}

# Every environment variable localrt reads. If you add one, document it in the
# ENVIRONMENT sections of man/localrtrc.5 and man/localrt.1 (tests/test_man.py checks).
ENVIRONMENT = {
    "LOCALRT_CONFIG": "path of the settings file, instead of ~/.localrtrc",
    **{k.env: f"overrides {k.name} for this run" for k in KEYS if k.env},
}


def rc_path(explicit: str | os.PathLike | None = None,
            environ: Mapping[str, str] | None = None) -> Path:
    """Where the settings file is: --config, then $LOCALRT_CONFIG, then ~/.localrtrc."""
    environ = os.environ if environ is None else environ
    if explicit:
        return Path(explicit).expanduser()
    if environ.get("LOCALRT_CONFIG"):
        return Path(environ["LOCALRT_CONFIG"]).expanduser()
    return _home(environ) / RC_NAME


def _home(environ: Mapping[str, str]) -> Path:
    return Path(environ["HOME"]) if environ.get("HOME") else Path.home()


class Settings:
    """The settings file's typed values, its unknown keys, and run-time overrides.

    `_lock` guards `_values`, `_unknown` and the file itself: an update re-reads
    the file, merges, and writes it while holding the lock, so concurrent updates
    of different keys never lose each other, and hand edits made meanwhile survive.
    """

    def __init__(self, path: Path, values: dict, unknown: dict, home: Path):
        self.path = path
        self._home = home
        self._values = values
        self._unknown = unknown
        self._overrides: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> Any:
        if name in self._overrides:
            return self._overrides[name]
        return self._values[name]

    def snapshot(self) -> dict:
        """All typed values, overrides applied."""
        with self._lock:
            return {**self._values, **self._overrides}

    def override(self, **values: Any) -> None:
        """Set values for this run only (`start --port`); they are never written."""
        for name, value in values.items():
            self._overrides[name] = KEYS_BY_NAME[name].convert(value)

    def update(self, changes: Mapping[str, Any]) -> dict:
        """Convert and persist `changes` (rc key -> value); return the new values."""
        converted = {}
        for name, value in changes.items():
            key = KEYS_BY_NAME[name]  # callers pass table keys only; a KeyError is a bug
            converted[name] = key.convert(value)
        with self._lock:
            if self.path.exists():
                values, unknown = _parse(self.path, self._home)
            else:
                values, unknown = dict(self._values), dict(self._unknown)
            values.update(converted)
            atomic_write(self.path, _render(values, unknown))
            self._values, self._unknown = values, unknown
            return {**values, **self._overrides}

    @property
    def data_dir(self) -> Path:
        return Path(self["dataFolderPath"])

    @property
    def log_dir(self) -> Path:
        return Path(self["logFolderPath"])


def load(path: str | os.PathLike | None = None,
         environ: Mapping[str, str] | None = None,
         create: bool = True) -> Settings:
    """Read the settings file, creating it with defaults if it does not exist yet."""
    environ = os.environ if environ is None else environ
    home = _home(environ)
    path = rc_path(path, environ)
    remove_stale_temps(path)  # a kill mid-write left them beside the file, in the home folder
    if path.exists():
        values, unknown = _parse(path, home)
        for name in unknown:
            log.warning("%s: unknown key %r is kept but not used", path, name)
    else:
        values, unknown = _resolve({}, home, path), {}
        if create:
            try:
                atomic_write(path, _render(values, {}))
            except OSError as exc:
                raise SettingsError(f"{path}: cannot create the settings file: {exc}") from None
    settings = Settings(path, values, unknown, home)
    for key in KEYS:
        if key.env and environ.get(key.env):
            try:
                settings.override(**{key.name: environ[key.env]})
            except ValueError as exc:
                raise SettingsError(f"${key.env}: {exc}") from None
    return settings


def _parse(path: Path, home: Path) -> tuple[dict, dict]:
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{path}: cannot read the settings file: {exc}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        raw = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise SettingsError(f"{where}: the settings file is not valid YAML: "
                            f"{exc.problem or exc}. Fix or remove it; it was left as it is.") from None
    except yaml.YAMLError as exc:
        raise SettingsError(f"{path}: the settings file is not valid YAML: {exc}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SettingsError(f"{path}:1: the settings file must be a mapping of keys to values")
    lines = {}
    if isinstance(node, yaml.MappingNode):
        lines = {k.value: k.start_mark.line + 1 for k, _ in node.value
                 if isinstance(k, yaml.ScalarNode)}
    known, unknown = {}, {}
    for name, value in raw.items():
        target = ALIASES.get(name, name)
        if target in KEYS_BY_NAME:
            if target in known and target != name:
                continue  # the rc key wins over its alias
            known[target] = value
        else:
            unknown[name] = value
    return _resolve(known, home, path, lines), unknown


def _resolve(raw: dict, home: Path, path: Path, lines: Mapping[str, int] | None = None) -> dict:
    """Convert `raw` key by key, filling defaults in table order."""
    lines = lines or {}
    values: dict[str, Any] = {"_home": home}
    for key in KEYS:
        if key.name in raw:
            try:
                values[key.name] = key.convert(raw[key.name])
            except ValueError as exc:
                line = lines.get(key.name) or lines.get(key.api or "")
                where = f"{path}:{line}" if line else str(path)
                raise SettingsError(f"{where}: {key.name}: {exc}") from None
        else:
            values[key.name] = key.default(values) if callable(key.default) else key.default
    del values["_home"]
    return values


def _render(values: Mapping[str, Any], unknown: Mapping[str, Any]) -> bytes:
    import yaml

    data = {k.name: values[k.name] for k in KEYS if values.get(k.name) is not None}
    data.update(unknown)
    header = "# localrt settings. See localrtrc(5). Unknown keys are kept.\n"
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)
    return (header + body).encode("utf-8")
