"""Shared test fixtures: a temporary home per test, in-process WSGI calls, real servers.

No test touches the real home directory or a fixed port.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from types import SimpleNamespace
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.util import setup_testing_defaults
from wsgiref.validate import validator

import pytest

from localrt import settings as settings_mod
from localrt.app import App, create_app
from localrt.errors import HTTPError
from localrt.routing import dialect_of
from ggufgen import write_gguf

REPO = Path(__file__).resolve().parent.parent


PROXY_ENV = ("http_proxy", "https_proxy", "no_proxy", "all_proxy",
             "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY")

# Config fields for outbound requests, as GET /v1/configs gives them, minus the proxy.
OUTBOUND = {"proxy_url": "", "proxy_username": "", "proxy_password": "", "no_proxy": "",
            "verify_host_ssl": True, "verify_peer_ssl": True, "verify_proxy_host_ssl": True,
            "verify_proxy_ssl": True, "modelhub_token": ""}


def outbound_config(**changes) -> dict:
    return {**OUTBOUND, **changes}


@pytest.fixture(autouse=True)
def no_env_proxies(monkeypatch):
    """No test inherits the machine's proxy variables."""
    for name in PROXY_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh HOME; LOCALRT_CONFIG cleared so the rc file is $HOME/.localrtrc."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("LOCALRT_CONFIG", raising=False)
    # Servers that `localrt start` spawns must import this checkout.
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return home


@pytest.fixture
def settings(home):
    return settings_mod.load()


@pytest.fixture
def app(settings):
    return create_app(settings)


@dataclass
class Response:
    status: int
    headers: dict
    body: bytes

    @property
    def json(self):
        return json.loads(self.body)


def call(app, method, path, json_body=None, body=None, headers=None, query="") -> Response:
    """Drive the app through wsgiref.validate, with no socket."""
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "SCRIPT_NAME": "",
               "QUERY_STRING": query}
    headers = dict(headers or {})
    if json_body is not None:
        body = json.dumps(json_body).encode()
        headers.setdefault("Content-Type", "application/json")
    if body is not None:
        environ["CONTENT_LENGTH"] = str(len(body))
        environ["wsgi.input"] = io.BytesIO(body)
    for name, value in headers.items():
        key = name.upper().replace("-", "_")
        if key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            environ[key] = value
        else:
            environ["HTTP_" + key] = value
    setup_testing_defaults(environ)
    captured = {}

    def start_response(status, response_headers, exc_info=None):
        captured["status"] = int(status.split()[0])
        captured["headers"] = response_headers
        return lambda data: None

    result = validator(app)(environ, start_response)
    try:
        data = b"".join(result)
    finally:
        result.close()
    names = [k.lower() for k, _ in captured["headers"]]
    assert len(names) == len(set(names)), f"duplicate headers: {captured['headers']}"
    response = Response(captured["status"], {k.lower(): v for k, v in captured["headers"]},
                        data)
    check_documented(app, method, path, response)
    return response


def check_documented(app, method, path, response) -> None:
    """Every JSON reply a test sees matches the schema GET /openapi.json documents for it:
    the route's reply schema for a 200, schemas/error.json (or its dialect's error
    schema) for an error."""
    if not isinstance(app, App) or method in ("HEAD", "OPTIONS") or \
            not response.headers.get("content-type", "").startswith("application/json"):
        return
    if response.status >= 400:
        dialect = dialect_of(path, app.dialects)
        problems = app.validators.reply_errors(dialect.error_reply if dialect else "error",
                                               response.json)
    else:
        try:
            route, _ = app.router.match(method, path)
        except HTTPError:  # a path this app's table does not have: nothing documents it
            return
        if route.reply is None:
            return
        problems = app.validators.reply_errors(route.reply, response.json)
    assert not problems, f"{method} {path} replied {response.status} against its " \
        f"documented schema: {problems[:3]}"


def send(url, method, path, body=None, timeout=10):
    """One JSON request to a real server, as curl users make them: (status, decoded
    reply), error replies included."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def wait_task(api, task_id, timeout=20.0):
    """Poll GET /v1/models/pull until the task is no longer running; return it."""
    return _wait_ended(lambda: api("GET", "/v1/models/pull").json["data"], task_id, timeout,
                       0.02)


def wait_pull(url, task_id, timeout=30.0):
    """wait_task for a real server at `url`."""
    return _wait_ended(lambda: send(url, "GET", "/v1/models/pull")[1]["data"], task_id,
                       timeout, 0.05)


def _wait_ended(list_tasks, task_id, timeout, interval):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        task = {t["id"]: t for t in list_tasks()}.get(task_id)
        if task and task["status"] not in ("Pending", "Downloading"):
            return task
        time.sleep(interval)
    raise AssertionError(f"task {task_id} still running after {timeout}s")


def wait_bytes(api, task_id, at_least, timeout=20.0):
    """Poll GET /v1/models/pull until the task has at least `at_least` bytes; return it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tasks = {t["id"]: t for t in api("GET", "/v1/models/pull").json["data"]}
        task = tasks.get(task_id)
        if task and sum(i["downloadedBytes"] for i in task["items"]) >= at_least:
            return task
        time.sleep(0.01)
    raise AssertionError(f"task {task_id} did not reach {at_least} bytes")


def free_port() -> int:
    """A loopback port nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cli_home(home):
    """A home whose rc points at a free port, with no server; any started is stopped."""
    from localrt import server
    from localrt.cli import main

    s = settings_mod.load()
    s.update({"apiServerPort": free_port()})
    yield s
    address = server.read_pid_file(s)
    if address:
        main(["stop"], stdout=io.StringIO(), stderr=io.StringIO())
        if server.pid_alive(address.pid):
            os.kill(address.pid, signal.SIGKILL)


@pytest.fixture
def hub_app(settings, hub):
    """An app pulling from the module's `hub` fixture (a HubEmulator)."""
    settings.update({"modelHubUrl": hub.url})
    app = create_app(settings)
    yield app
    app.close()


@pytest.fixture
def wsgi(app):
    """call(...) bound to this test's app."""
    return lambda *args, **kwargs: call(app, *args, **kwargs)


def subprocess_env(home: Path) -> dict:
    """The environment for a localrt child process: this checkout, this test's HOME."""
    env = dict(os.environ)
    env["HOME"] = str(home)
    env.pop("LOCALRT_CONFIG", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    port: int
    settings: settings_mod.Settings

    def stop(self, sig=signal.SIGTERM, timeout=15):
        """Signal the server, wait for it, and close its output pipes; its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()  # never leave a server behind
            self.process.wait()
            raise
        finally:
            self.process.stdout.close()
            self.process.stderr.close()


def run_foreground_server(home: Path, extra=()) -> Server:
    """`localrt start --foreground --port 0` as a child; returns once /healthz answers."""
    from localrt import server

    settings = settings_mod.load(environ={"HOME": str(home)})
    cmd = [sys.executable, "-m", "localrt", "start", "--foreground", "--port", "0", *extra]
    process = subprocess.Popen(cmd, env=subprocess_env(home), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    try:
        address = server.wait_started(settings, process)
    except RuntimeError as exc:
        raise AssertionError(f"{exc}: {process.stderr.read().decode()}") from None
    return Server(process, address.url, address.port, settings)


@pytest.fixture
def live_server(home):
    """A real server on a free port, stopped after the test."""
    srv = run_foreground_server(home)
    yield srv
    srv.stop()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args):
        pass


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


@pytest.fixture
def thread_server(settings):
    """The app on a real socket in this process, counting requests; rc points the CLI at it."""
    calls = []
    app = create_app(settings)

    def counting(environ, start_response):
        calls.append((environ["REQUEST_METHOD"], environ["PATH_INFO"]))
        return app(environ, start_response)

    httpd = make_server("127.0.0.1", 0, counting, server_class=_ThreadingWSGIServer,
                        handler_class=_QuietHandler)
    port = httpd.server_address[1]
    settings.update({"apiServerPort": port})
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port, calls=calls,
                          settings=settings)
    httpd.shutdown()
    httpd.server_close()


def quantize(source: Path, target: Path, ftype_name: str) -> Path:
    """Quantize a GGUF file with llama.cpp itself (ftype_name: "Q8_0", "Q4_0")."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(),
                                          params) == 0
    return target


@pytest.fixture(scope="session")
def quantized(tmp_path_factory):
    """Tiny GGUF models quantized by llama.cpp itself to Q8_0 and Q4_0."""
    root = tmp_path_factory.mktemp("quantized")
    source = write_gguf(root / "tiny-f32.gguf", n_embd=256, n_ff=512, context_length=256)
    return {name: quantize(source, root / f"tiny-{name}.gguf", name)
            for name in ("Q8_0", "Q4_0")}


@pytest.fixture(scope="session")
def slow_gguf(tmp_path_factory):
    """A bigger random model, quantized to Q8_0: hundreds of tokens a second, not
    thousands, so a 2000-token reply takes seconds."""
    root = tmp_path_factory.mktemp("slow")
    source = write_gguf(root / "slow-f16.gguf", name="slow", n_embd=512, n_layer=4, n_ff=1024,
                        context_length=4096, file_type="F16")
    return quantize(source, root / "slow-Q8_0.gguf", "Q8_0")


WHEELS = REPO / "tests" / ".engine-wheels"


@pytest.fixture(scope="session")
def index_dir(tmp_path_factory):
    """The real onnxruntime-genai wheels (the bootstrap's pip download) and the echo wheel."""
    if not list(WHEELS.glob("onnxruntime_genai-*.whl")):
        pytest.fail(f"{WHEELS} has no onnxruntime-genai wheel; run: python3 -m "
                    f"localrt.bootstrap --test, or python -m pip download "
                    f"--only-binary=:all: -d {WHEELS} onnxruntime-genai==0.18.0")
    root = tmp_path_factory.mktemp("index")
    for wheel in WHEELS.glob("*.whl"):
        (root / wheel.name).symlink_to(wheel)
    from enginepkg import build_echo_engine_wheel

    build_echo_engine_wheel(root)
    return root
