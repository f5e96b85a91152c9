"""Test support: real forward HTTP proxies on loopback (proxy.py, and Debian's tinyproxy,
which refuses a wrong password otherwise: see start_tinyproxy), plus small target servers.

The proxy is `proxy.py` from PyPI (``pip install proxy.py``, module ``proxy``), run as a
child process::

    python -m proxy --hostname 127.0.0.1 --port 0 --port-file D/proxy.port
        --num-acceptors 1 --num-workers 1 --log-level INFO --log-file D/proxy.log
        --data-dir D/data --ca-cert-dir D/data/certificates --cache-dir D/data/cache
        --pid-file D/proxy.pid [--basic-auth USER:PASS]

where D is TMP_DIR/proxypy, in its own session (process group: main + one acceptor), and
with HOME pointed at a temporary directory (proxy.py computes ``~/.proxy`` defaults at
import time and creates the cache directories there).  Only the HttpProxyPlugin (and,
with credentials, the AuthPlugin) are loaded; no dashboard, web server, events, metrics
or SSH tunnel, so it opens exactly one listening socket and makes no network lookups
of its own: it only connects to the targets clients ask for.

How to tell that a request went through the proxy: proxy.py writes one access-log line
per *client connection* when that connection closes, e.g.::

    ... server.access_log:393 - 127.0.0.1:46320 - GET 127.0.0.1:41234/file - 200 OK - 12 bytes - 1.05ms
    ... server.access_log:393 - 127.0.0.1:46330 - CONNECT 127.0.0.1:41235 - 3907 bytes - 9.8ms

Because the line is written when the connection closes (just after the client has read
its response), poll with :meth:`Proxy.wait_for_log` rather than reading once.  A request
rejected with 407 is logged as ``GET None:None/...`` (the target is not parsed).
The target can tell too: proxy.py adds "Via: 1.1 proxy.py v2.4.10" to plain-http requests
it forwards (and strips Proxy-Authorization); CONNECT-tunnelled requests arrive unchanged.

Gotcha for localrt tests: localrt's default noProxy is "localhost,127.0.0.1,::1", so a
test whose target is on 127.0.0.1 must set no_proxy to "" (or to some other host) for
downloads to go through the proxy at all.  urllib also honours the no_proxy/NO_PROXY
environment variable even with an explicit ProxyHandler: clear it in tests.
"""

from __future__ import annotations

import base64
import http.server
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional
from urllib.parse import quote

START_TIMEOUT = 20.0

ACCESS_LOG_RE = re.compile(r"server\.access_log:\d+ - (.*)$")


@dataclass
class Proxy:
    process: subprocess.Popen
    port: int
    url: str  # "http://127.0.0.1:PORT", no credentials
    log_path: Path
    output_path: Path
    username: Optional[str] = None
    password: Optional[str] = None
    startup_s: float = 0.0

    # -- addresses ---------------------------------------------------------------------

    def url_with_credentials(self, username=None, password=None) -> str:
        """"http://user:pass@127.0.0.1:PORT" (percent-encoded), for urllib's ProxyHandler.

        This is the one urllib form that authenticates both plain http requests and
        CONNECT tunnels (urllib copies the header into the tunnel headers).
        """
        user = self.username if username is None else username
        pw = self.password if password is None else password
        if user is None:
            return self.url
        return f"http://{quote(user, safe='')}:{quote(pw or '', safe='')}@127.0.0.1:{self.port}"

    def auth_header(self, username=None, password=None) -> str:
        """The value of a Proxy-Authorization header: "Basic base64(user:pass)"."""
        user = self.username if username is None else username
        pw = self.password if password is None else password
        return "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode("ascii")

    # -- logs --------------------------------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def access_log(self) -> list:
        """The access-log entries so far, e.g. "127.0.0.1:5 - GET 127.0.0.1:80/x - 200 OK - ..."."""
        out = []
        for line in self.log_text().splitlines():
            m = ACCESS_LOG_RE.search(line)
            if m:
                out.append(m.group(1))
        return out

    def wait_for_log(self, needle: str, timeout: float = 5.0) -> str:
        """Wait until an access-log entry contains `needle`; return that entry."""
        deadline = time.monotonic() + timeout
        while True:
            for entry in self.access_log():
                if needle in entry:
                    return entry
            if time.monotonic() > deadline:
                raise AssertionError(f"no proxy access-log entry with {needle!r}:\n"
                                     + self.log_text()[-4000:])
            time.sleep(0.02)

    def output_text(self) -> str:
        try:
            return self.output_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -- lifetime ----------------------------------------------------------------------

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        """SIGTERM to the process group, wait; SIGKILL the group as a last resort.

        The group (main + acceptor process) is signalled, not just the main process:
        proxy.py's main joins its acceptor, which only notices shutdown on a 1 s select
        timeout, so a main-only SIGTERM costs ~1 s; and a SIGTERM that lands before
        proxy.py installs its handlers kills main at once and would orphan the acceptor.
        Returns the exit status: 0, or -15 when the signal beat proxy.py's handlers.
        """
        proc = self.process
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        return proc.returncode

    def __enter__(self) -> "Proxy":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # its own session/group: see start_new_session below
    except (ProcessLookupError, PermissionError):
        pass


def start_proxy(tmp_dir, *, username: str = None, password: str = None,
                extra_args=()) -> Proxy:
    """Start proxy.py on 127.0.0.1 on an ephemeral port; return once it accepts connections.

    With `username` (and `password`) it requires Proxy-Authorization: Basic, and answers
    "407 Proxy Authentication Required" with "Proxy-Authenticate: Basic" (no realm) when
    it is missing or wrong.  Use it as a context manager, or call .stop().
    """
    tmp = Path(tmp_dir) / "proxypy"
    tmp.mkdir(parents=True, exist_ok=True)
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    port_file = tmp / "proxy.port"
    log_path = tmp / "proxy.log"
    output_path = tmp / "proxy.out"
    for p in (port_file, log_path):
        if p.exists():
            p.unlink()
    cmd = [sys.executable, "-m", "proxy",
           "--hostname", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
           "--num-acceptors", "1", "--num-workers", "1",
           "--log-level", "INFO", "--log-file", str(log_path),
           "--data-dir", str(tmp / "data"),
           "--ca-cert-dir", str(tmp / "data" / "certificates"),
           "--cache-dir", str(tmp / "data" / "cache"),
           "--pid-file", str(tmp / "proxy.pid")]
    if username is not None:
        cmd += ["--basic-auth", f"{username}:{password or ''}"]
    cmd += list(extra_args)
    env = dict(os.environ)
    env["HOME"] = str(home)  # proxy.py's ~/.proxy defaults
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy",
                 "ALL_PROXY"):
        env.pop(name, None)
    started = time.monotonic()
    with open(output_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=str(tmp),
                                start_new_session=True)
    deadline = started + START_TIMEOUT
    port = None
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(
                    f"proxy.py exited with {proc.returncode}:\n"
                    f"{output_path.read_text(errors='replace')}\n"
                    f"{log_path.read_text(errors='replace') if log_path.exists() else ''}")
            if port is None:
                try:
                    text = port_file.read_text().split()
                    port = int(text[0]) if text else None  # the file may be half-written
                except (FileNotFoundError, ValueError):
                    port = None
            if port is not None:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                except OSError:
                    pass
                else:
                    return Proxy(proc, port, f"http://127.0.0.1:{port}", log_path,
                                 output_path, username, password,
                                 time.monotonic() - started)
            time.sleep(0.02)
        raise AssertionError("proxy.py did not start:\n" + output_path.read_text(errors="replace"))
    except BaseException:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        raise


# -- target servers ---------------------------------------------------------------------


@dataclass
class Target:
    """A loopback HTTP(S) server that answers every GET with `body` and records requests."""
    httpd: http.server.ThreadingHTTPServer
    thread: threading.Thread
    url: str
    port: int
    requests: list = field(default_factory=list)  # dicts: client, method, path, headers

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)

    def __enter__(self) -> "Target":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_target(body: bytes = b"hello from target", *, ssl_context: ssl.SSLContext = None
                 ) -> Target:
    """Serve GET -> 200 `body` on 127.0.0.1:0; https when `ssl_context` (a server context)."""
    requests = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            requests.append({"client": self.client_address, "method": "GET",
                             "path": self.path, "headers": dict(self.headers.items())})
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    scheme = "http"
    if ssl_context is not None:
        httpd.socket = ssl_context.wrap_socket(httpd.socket, server_side=True)
        scheme = "https"
    port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    return Target(httpd, thread, f"{scheme}://127.0.0.1:{port}", port, requests)


def tls_contexts():
    """(server_context, client_context, ca) from trustme; the cert covers 127.0.0.1 and localhost."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return server, client, ca


def proxy_available() -> bool:
    """Whether proxy.py is importable (tests can skip without it)."""
    import importlib.util

    return importlib.util.find_spec("proxy") is not None


# -- Debian's tinyproxy -----------------------------------------------------------------

TINYPROXY = shutil.which("tinyproxy") or "/usr/bin/tinyproxy"


def need_tinyproxy() -> None:
    """Skip the calling test when tinyproxy is not installed, except under CI, which
    installs it (`python3 -m localrt.bootstrap --test`)."""
    import pytest

    if not os.path.exists(TINYPROXY):
        if os.environ.get("CI"):
            raise RuntimeError("CI must install tinyproxy (python3 -m localrt.bootstrap --test)")
        pytest.skip("tinyproxy is not installed")


@dataclass
class Tinyproxy:
    """A running tinyproxy; `url` has no credentials."""
    process: subprocess.Popen
    port: int
    url: str
    log_path: Path

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "Tinyproxy":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_tinyproxy(tmp_dir, *, username: str = None, password: str = None) -> Tinyproxy:
    """Start Debian's tinyproxy in the foreground on a free loopback port; return once it
    accepts connections.

    With `username` its config has `BasicAuth username password`. tinyproxy 1.11 then
    answers a request without credentials "407 Proxy Authentication Required", but a
    plain-http request with wrong ones "401 Unauthorized" with `WWW-Authenticate: Basic
    realm="Tinyproxy"`, and a CONNECT with wrong ones a 401 too. With no ConnectPort
    line it tunnels to any port.
    """
    tmp = Path(tmp_dir) / "tinyproxy"
    tmp.mkdir(parents=True, exist_ok=True)
    with socket.socket() as probe:  # tinyproxy cannot bind port 0 and say which it got
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    lines = [f"Port {port}", "Listen 127.0.0.1", "Timeout 60", "MaxClients 50",
             "LogLevel Info", f'LogFile "{tmp / "tinyproxy.log"}"',
             f'PidFile "{tmp / "tinyproxy.pid"}"']
    if username is not None:
        lines.append(f"BasicAuth {username} {password or ''}")
    conf = tmp / "tinyproxy.conf"
    conf.write_text("\n".join(lines) + "\n")
    out = tmp / "tinyproxy.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen([TINYPROXY, "-d", "-c", str(conf)], stdin=subprocess.DEVNULL,
                                stdout=sink, stderr=subprocess.STDOUT, cwd=str(tmp))
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"tinyproxy exited with {proc.returncode}:\n"
                                 f"{out.read_text(errors='replace')}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            time.sleep(0.02)
            continue
        return Tinyproxy(proc, port, f"http://127.0.0.1:{port}", tmp / "tinyproxy.log")
    proc.kill()
    proc.wait()
    raise AssertionError("tinyproxy did not start:\n" + out.read_text(errors="replace"))
