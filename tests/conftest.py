"""The fixtures the tests share: a temporary home per test, the app in process (`app`,
`api`), real servers, and generated models. Helpers that are not fixtures live in
tests/support/; these are built from them.

No test touches the real home directory or a fixed port. Every fixture that builds an
app closes it (its download tasks, probes and models end with the test).

The markers (setup.cfg): a module or test says `live`, `browser` or `slow` itself, a
test that uses one of LIVE_FIXTURES is `live`, and every other test is `unit`, the fast subset
(`python -m pytest -m unit`). A `unit` test that listens on a socket or loads a model
fails, so the subset stays what its name says.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import threading
from types import SimpleNamespace
from wsgiref.simple_server import make_server

import pytest
from emulators.ggufgen import write_gguf
from support import REPO, WHEELS
from support.apps import bind
# The one hub and tiny model every module shares (tests/support/fixtures.py); a module
# overrides hub_repos, tiny_gguf or tiny_start to change what they are.
from support.fixtures import (hub, hub_repos, module_hub, tiny, tiny_gguf,  # noqa: F401
                              tiny_start)
# A small tmpfs a test fills up or makes read-only (tests/support/disks.py).
from support.disks import small_disk  # noqa: F401
# The gguf-cpp Vulkan variant, compiled (or taken from the kept wheel) once a session for
# every module that uses it (tests/support/variants.py).
from support.variants import vulkan_engine  # noqa: F401
from support.models import quantize, write_family_models
from support.servers import (QuietHandler, ThreadingWSGIServer, free_port,
                             run_foreground_server)

from localrt import settings as settings_mod
from localrt.app import create_app

# The fixtures here that run real parts (a server, an emulator, a model made and used):
# a test that uses one, directly or through a fixture of its module, is `live`.
LIVE_FIXTURES = {"live_server", "thread_server", "cli_home", "hub", "module_hub", "hub_app",
                 "quantized", "slow_gguf", "tiny", "index_dir", "family_models", "models"}
_UNIT_GUARD = pytest.StashKey()

PROXY_ENV = ("http_proxy", "https_proxy", "no_proxy", "all_proxy",
             "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY")


def pytest_collection_modifyitems(config, items):
    """Mark each test `live` or `unit` (the module docstring says how)."""
    for item in items:
        if any(item.get_closest_marker(m) for m in ("live", "browser", "slow")):
            continue
        if LIVE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.live)
        else:
            item.add_marker(pytest.mark.unit)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    """Under a `unit` test and its fixtures, listening and loading a model fail, and
    are noted in case the code under test turns the failure into a reply."""
    if item.get_closest_marker("unit"):
        from llama_cpp import _internals

        refused = []

        def refuse(what):
            def refused_call(*args, **kwargs):
                refused.append(what)
                raise AssertionError(f"a unit test {what}: mark it live (setup.cfg)")
            return refused_call

        guard = pytest.MonkeyPatch()
        item.stash[_UNIT_GUARD] = guard, refused
        guard.setattr(socket.socket, "listen", refuse("listens on a socket"))
        guard.setattr(_internals.LlamaModel, "__init__", refuse("loads a model"))
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Lift pytest_runtest_setup's guard once the test's fixtures are torn down; an
    error if the test tried what a unit test must not."""
    result = yield
    guard, refused = item.stash.get(_UNIT_GUARD, (None, []))
    if guard is not None:
        guard.undo()
    if refused:
        raise AssertionError(f"a unit test {refused[0]}: mark it live (setup.cfg)")
    return result


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
    """The app for this test's settings, closed after the test."""
    app = create_app(settings)
    yield app
    app.close()


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
    """An app pulling from `hub`."""
    settings.update({"modelHubUrl": hub.url})
    app = create_app(settings)
    yield app
    app.close()


@pytest.fixture
def api(app):
    """support.apps.call bound to this test's app (a module's own `app` fixture too).
    A module whose models live on a real server overrides it with the server's URL,
    which support.models.add_model, and so `tiny`, take too."""
    return bind(app)


@pytest.fixture
def live_server(home):
    """A real server on a free port, stopped after the test."""
    srv = run_foreground_server(home)
    yield srv
    srv.stop()


@pytest.fixture
def thread_server(settings):
    """The app on a real socket in this process, counting requests; rc points the CLI at it."""
    calls = []
    app = create_app(settings)

    def counting(environ, start_response):
        calls.append((environ["REQUEST_METHOD"], environ["PATH_INFO"]))
        return app(environ, start_response)

    httpd = make_server("127.0.0.1", 0, counting, server_class=ThreadingWSGIServer,
                        handler_class=QuietHandler)
    port = httpd.server_address[1]
    settings.update({"apiServerPort": port})
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port, calls=calls,
                          settings=settings)
    httpd.shutdown()
    httpd.server_close()
    app.close()


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
    from emulators.enginepkg import build_echo_engine_wheel

    build_echo_engine_wheel(root)
    return root


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """One tiny GGUF per chat-template family (support.models.write_family_models)."""
    return write_family_models(tmp_path_factory.mktemp("families"))


@pytest.fixture
def models(api, family_models):
    """The family models imported into this test's app, each under its family's name."""
    for family, path in family_models.items():
        r = api("POST", "/v1/models/import", {"path": str(path), "id": family,
                                              "option": "symlink"})
        assert r.status == 200, r.body
    return family_models
