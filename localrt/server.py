"""Running the API server: waitress in the foreground, or a detached child of `localrt start`.

The pid file `<dataFolderPath>/localrt.pid` records the pid, host and bound
port of the running server, so `--port 0` works and `localrt stop` finds it.
It is written once the port is bound and removed on a clean stop.
waitress is imported only by `serve`, so the CLI stays light.
"""

from __future__ import annotations

import errno
import json
import logging
import logging.handlers
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from localrt import security
from localrt.admission import LIMITS, threads_for
from localrt.fsutil import atomic_write, private_dir
from localrt.settings import Settings

log = logging.getLogger(__name__)

PID_NAME = "localrt.pid"
LOG_NAME = "localrt.log"
STDERR_NAME = "server-stderr.log"  # a detached server's raw stderr: crashes before logging starts
LOG_MAX_BYTES = 10 * 1024 * 1024
LOG_BACKUPS = 5
# Waitress worker threads started with the server: one for each request the kinds'
# limits admit (chats, completions, embeddings, event streams, Ollama pulls:
# localrt.admission.LIMITS), each holding its thread while it lasts, and SPARE_THREADS
# that keep the rest of the API answering when every kind is at its limit. Derived, so
# a limit raised raises it too. Up to maxQueuedRequests more start as requests wait for
# a place, one each (threads_for(LIMITS, maxQueuedRequests) in all), so SPARE_THREADS
# still answer with the queue full; only then, since each start costs about a
# millisecond (localrt.connections.Dispatcher).
THREADS = threads_for(LIMITS)
# Open files the server asks for at most: each connection is one, and poll() walks them all
# on every turn of waitress's loop, so past this many a flood would slow every reply anyway.
OPEN_FILES_CAP = 65536
STOP_DELAY = 0.2  # seconds between answering DELETE /v1/system and stopping, so the reply is sent


class PortInUse(Exception):
    """Another program holds the address the server should bind."""


class UnsafeAddress(Exception):
    """The server would listen beyond loopback with no API key to keep strangers out."""


def check_exposure(settings: Settings, host: str) -> None:
    """Raise UnsafeAddress unless `host` is loopback or API keys are set."""
    problem = security.exposure_problem(host, settings["apiKeys"])
    if problem:
        raise UnsafeAddress(problem)


@dataclass(frozen=True)
class Address:
    """Where a server listens, and its pid when known."""

    host: str
    port: int
    pid: int | None = None

    @property
    def url(self) -> str:
        """The base URL a client connects to (a wildcard bind is reached on loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"


def pid_path(settings: Settings) -> Path:
    return settings.data_dir / PID_NAME


def read_pid_file(settings: Settings) -> Address | None:
    """The running server's address from the pid file; None (and the file removed) if stale."""
    path = pid_path(settings)
    try:
        data = json.loads(path.read_text())
        address = Address(str(data["host"]), int(data["port"]), int(data["pid"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        log.warning("%s is unreadable; ignoring it", path)
        return None
    if not pid_alive(address.pid):
        _unlink(path)
        return None
    return address


def locate(settings: Settings) -> Address:
    """Where this settings file's server is, or would be."""
    return read_pid_file(settings) or Address(settings["apiServerHost"], settings["apiServerPort"])


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (zombies count as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def healthy(address: Address, timeout: float = 1.0) -> bool:
    """Whether a localrt server answers /healthz at this address."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(address.url + "/healthz", timeout=timeout) as resp:
            return json.loads(resp.read()).get("status") == "ok"
    except (OSError, ValueError, AttributeError):
        return False


def check_port_free(host: str, port: int) -> None:
    """Raise PortInUse if something already listens on host:port."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as waitress binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(f"Port {port} on {host} is already in use by another program. "
                                f"Stop it, or choose another port with --port or "
                                f"apiServerPort in the settings file") from None
            raise


def setup_logging(settings: Settings, console: bool,
                  more_secrets: Callable[[], Iterable[str]] = tuple) -> None:
    """Log to a rotating file under logFolderPath, and to stderr when `console`;
    `more_secrets()` (the remote models' upstream keys) are redacted too."""
    log_dir = settings.log_dir
    private_dir(log_dir)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers: list[logging.Handler] = [logging.handlers.RotatingFileHandler(
        log_dir / LOG_NAME, maxBytes=LOG_MAX_BYTES, backupCount=LOG_BACKUPS, encoding="utf-8")]
    if console:
        handlers.append(logging.StreamHandler(sys.stderr))
    root = logging.getLogger()
    # The hub token, the proxy password and the API keys never reach a log line.
    redacting = security.RedactingFilter(
        lambda: [*security.secrets_of(settings.snapshot()), *more_secrets()])
    for handler in handlers:
        handler.addFilter(redacting)
        handler.setFormatter(fmt)
        root.addHandler(handler)
    root.setLevel(settings["logLevel"])
    # waitress warns "Task queue depth is N" on every queued request under load;
    # at ~100 lines a second it would rotate the useful log away.
    logging.getLogger("waitress.queue").setLevel(logging.ERROR)


def raise_open_files_limit() -> int:
    """Raise this process's open-files limit from its soft to its hard limit, so a
    machine whose default is 1024 still holds a flood of connections; the limit now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = OPEN_FILES_CAP if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_CAP)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s",
                        soft, target, exc)
    return OPEN_FILES_CAP if soft == resource.RLIM_INFINITY else soft


class _Stop(SystemExit):
    """Raised in the main thread by SIGTERM, to leave waitress's loop.

    A SystemExit, because waitress's loop swallows any other exception raised
    inside its socket handlers, and the signal can land there.
    """


def serve(settings: Settings, host: str | None = None, port: int | None = None,
          console: bool = True) -> None:
    """Run the API server in this process until SIGTERM, SIGINT or DELETE /v1/system.

    Raises PortInUse if the address is taken. Engines are unloaded and the pid
    file removed on the way out.
    """
    from localrt import connections
    from localrt.app import create_app

    host = settings["apiServerHost"] if host is None else host
    port = settings["apiServerPort"] if port is None else port
    check_exposure(settings, host)
    app = None  # its remote models' upstream keys are secrets once it exists
    setup_logging(settings, console, lambda: app.services.remotes.secrets() if app else ())
    private_dir(settings.data_dir)

    def request_stop():
        time.sleep(STOP_DELAY)
        os.kill(os.getpid(), signal.SIGTERM)

    open_files = raise_open_files_limit()
    app = create_app(settings, shutdown=request_stop)
    try:
        server = connections.make_server(
            app, host, port, THREADS, open_files, settings["requestTimeout"],
            settings["keepAliveTimeout"], connections.per_client_limit(settings, host),
            app.services.metrics.connections_refused.inc,
            queued=settings["maxQueuedRequests"])
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(f"Port {port} on {host} is already in use by another program") from None
        raise
    bound = int(server.effective_port)
    settings.override(apiServerHost=host, apiServerPort=bound)
    pid_file = pid_path(settings)
    atomic_write(pid_file, json.dumps({"pid": os.getpid(), "host": host, "port": bound}).encode())

    def on_term(signum, frame):
        raise _Stop()

    previous = signal.signal(signal.SIGTERM, on_term)
    log.info("localrt serving on %s (pid %d)", Address(host, bound).url, os.getpid())
    try:
        server.run()  # returns on SystemExit (our _Stop) and KeyboardInterrupt
    finally:
        signal.signal(signal.SIGTERM, previous)
        log.info("localrt stopping")
        server.close()
        app.close()  # ends event streams and downloads, which hold worker threads
        server.task_dispatcher.shutdown(timeout=5)
        _unlink_if_ours(pid_file)
        log.info("localrt stopped")


def spawn(settings: Settings, host: str, port: int) -> subprocess.Popen:
    """Start `localrt start --foreground` as a detached child process."""
    private_dir(settings.log_dir)
    cmd = [sys.executable, "-m", "localrt", "--config", str(settings.path),
           "start", "--foreground", "--host", host, "--port", str(port)]
    with open(settings.log_dir / STDERR_NAME, "wb") as err:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                start_new_session=True, close_fds=True)


def wait_started(settings: Settings, child: subprocess.Popen, timeout: float = 20.0) -> Address:
    """Wait until the child answers /healthz; raise RuntimeError with its stderr if it dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(_child_error(settings, child.returncode))
        address = read_pid_file(settings)
        if address and address.pid == child.pid and healthy(address, timeout=0.5):
            return address
        time.sleep(0.01)
    child.kill()
    child.wait()
    raise RuntimeError(f"The server did not answer within {timeout:.0f} s; "
                       f"see {settings.log_dir / LOG_NAME}")


def wait_stopped(address: Address, timeout: float = 15.0) -> bool:
    """Wait until the server's process is gone and its port is free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = address.pid is not None and pid_alive(address.pid)
        if not alive and not _port_open(address):
            return True
        time.sleep(0.02)
    return False


def _port_open(address: Address) -> bool:
    try:
        with socket.create_connection(_connect_target(address), timeout=0.2):
            return True
    except OSError:
        return False


def _connect_target(address: Address):
    host = address.url.split("//", 1)[1].rsplit(":", 1)[0].strip("[]")
    return host, address.port


def _child_error(settings: Settings, code: int) -> str:
    try:
        text = (settings.log_dir / STDERR_NAME).read_text(errors="replace").strip()
    except OSError:
        text = ""
    lines = [line for line in text.splitlines() if line.strip()]
    detail = lines[-1] if lines else f"it exited with status {code}"
    return f"The server failed to start: {detail}"


def _unlink_if_ours(path: Path) -> None:
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
