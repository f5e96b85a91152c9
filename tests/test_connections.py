"""Connection floods against a real server: a thousand idle or slow clients, the two clocks
(requestTimeout and keepAliveTimeout), and the per-address limit.

The servers are `localrt start --foreground` children (conftest), except for the
per-address limit, which applies only beyond loopback: there the server of
localrt.connections runs in a thread on 127.0.0.1 with the limit given. Every timeout
of a server comes from its settings; the tests wait for events (a connection closed,
a reply), each within PATIENCE, and never for a clock to run out.
"""

from __future__ import annotations

import contextlib
import re
import resource
import socket
import threading
import time
import urllib.request

import pytest
from support.servers import run_foreground_server

from localrt import connections, server, settings as settings_mod
from localrt.app import create_app

pytestmark = pytest.mark.live

FLOOD = 1000
PATIENCE = 30.0  # seconds any one event may take on a busy machine; none should take long
LONG = 3600      # seconds: a timeout no test outlives
# Descriptors the baseline reading may hold that a later one does not (its own
# connection, a log file rotating): the flood counts as accepted within these.
SLACK = 8
REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.fixture
def many_files():
    """This process may hold the flood's sockets; the soft limit is put back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FLOOD + 512
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the hard open-files limit is {hard}; the flood needs {need}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need if soft < need else soft, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextlib.contextmanager
def low_files_limit(limit=1024):
    """Children started inside inherit a soft open-files limit of `limit`, as on
    many machines, so a server that holds the flood must raise its own."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, limit), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def start(home, settings, **values):
    settings.update(values)
    with low_files_limit():
        return run_foreground_server(home)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=PATIENCE)


def open_fds(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics", timeout=PATIENCE) as resp:
        return int(re.search(rb"^process_open_fds (\d+)", resp.read(), re.M)[1])


def wait_held(url: str, at_least: int) -> None:
    """Wait until the server holds `at_least` open files: the flood is accepted."""
    deadline = time.monotonic() + PATIENCE
    while open_fds(url) < at_least:
        assert time.monotonic() < deadline, "the server never accepted the flood"
        time.sleep(0.1)


def answer_times(url: str, count: int) -> list[float]:
    """Seconds each of `count` GET /v1/models took, one after another, all answered 200."""
    times = []
    for _ in range(count):
        started = time.monotonic()
        with urllib.request.urlopen(url + "/v1/models", timeout=PATIENCE) as resp:
            assert resp.status == 200
            resp.read()
        times.append(time.monotonic() - started)
        time.sleep(0.1)
    return times


def closed(sock: socket.socket) -> bool:
    """Wait for the server to close `sock` (what it sent before is skipped)."""
    sock.settimeout(PATIENCE)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        return False
    return True


def still_open(sock: socket.socket) -> bool:
    """Whether `sock` is open now: what it has to read ends in no end of stream."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.settimeout(PATIENCE)


def request(sock: socket.socket) -> bytes:
    """GET /v1/models on an open keep-alive connection; the status line."""
    sock.sendall(REQUEST)
    reader = sock.makefile("rb")
    status = reader.readline()
    length = 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    reader.read(length)
    reader.close()
    return status


def test_a_thousand_idle_connections_do_not_deny_service(home, settings, many_files):
    srv = start(home, settings, requestTimeout=LONG)
    flood = []
    try:
        baseline = open_fds(srv.url)
        flood = [connect(srv.port) for _ in range(FLOOD)]
        wait_held(srv.url, baseline + FLOOD - SLACK)
        times = answer_times(srv.url, 20)
        print(f"\nGET /v1/models with {FLOOD} idle connections: worst {max(times):.3f} s, "
              f"median {sorted(times)[len(times) // 2]:.3f} s")
        assert all(still_open(s) for s in flood[:: FLOOD // 10])  # the flood was not dropped
    finally:
        for s in flood:
            s.close()
        srv.stop()


def test_a_thousand_slow_clients_do_not_deny_service(home, settings, many_files):
    srv = start(home, settings, requestTimeout=LONG)
    flood, stop = [], threading.Event()

    def dribble():  # each connection sends its request line one byte a second
        sent = 0
        while not stop.wait(1.0) and sent < len(REQUEST) - 1:
            for s in flood:
                s.send(REQUEST[sent:sent + 1])
            sent += 1

    try:
        baseline = open_fds(srv.url)
        flood = [connect(srv.port) for _ in range(FLOOD)]
        wait_held(srv.url, baseline + FLOOD - SLACK)
        sender = threading.Thread(target=dribble, daemon=True)
        sender.start()
        times = answer_times(srv.url, 40)
        print(f"\nGET /v1/models with {FLOOD} slow connections: worst {max(times):.3f} s, "
              f"median {sorted(times)[len(times) // 2]:.3f} s")
        assert sender.is_alive()  # the flood kept dribbling all along
        stop.set()
        sender.join(PATIENCE)
        assert all(still_open(s) for s in flood[:: FLOOD // 10])
    finally:
        stop.set()
        for s in flood:
            s.close()
        srv.stop()


def test_request_timeout_closes_idle_and_slow_clients_but_not_kept_alive_ones(home, settings):
    srv = start(home, settings, requestTimeout=1, keepAliveTimeout=LONG)
    kept = connect(srv.port)
    idle = slow = None
    stop = threading.Event()
    try:
        assert request(kept).startswith(b"HTTP/1.1 200")
        idle, slow = connect(srv.port), connect(srv.port)  # connected after kept's reply

        def dribble():  # faster than any idle timeout, never a whole request
            for i in range(len(REQUEST) - 1):
                if stop.wait(0.2):
                    return
                try:
                    slow.send(REQUEST[i:i + 1])
                except OSError:
                    return

        threading.Thread(target=dribble, daemon=True).start()
        assert closed(idle) and closed(slow)
        # Had kept's clock been requestTimeout from its reply, it would be closed by now.
        assert request(kept).startswith(b"HTTP/1.1 200")
    finally:
        stop.set()
        for s in (kept, idle, slow):
            if s is not None:
                s.close()
        srv.stop()


def test_keep_alive_timeout_closes_idle_connections_after_a_reply(home, settings):
    srv = start(home, settings, requestTimeout=LONG, keepAliveTimeout=1)
    waiting = connect(srv.port)
    kept = connect(srv.port)
    try:
        assert request(kept).startswith(b"HTTP/1.1 200")
        assert closed(kept)
        # waiting connected before kept's reply and sent nothing: its clock is requestTimeout.
        assert request(waiting).startswith(b"HTTP/1.1 200")
    finally:
        waiting.close()
        kept.close()
        srv.stop()


def test_a_stream_nobody_reads_neither_blocks_the_server_nor_is_swept(home, settings):
    srv = start(home, settings, requestTimeout=1, keepAliveTimeout=1)
    stream = connect(srv.port)
    idle = None
    try:
        stream.sendall(b"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # never read
        idle = connect(srv.port)
        answer_times(srv.url, 3)
        assert closed(idle)  # a sweep has run since the stream began
        assert still_open(stream)  # the request being served has no clock
    finally:
        stream.close()
        if idle is not None:
            idle.close()
        srv.stop()


@contextlib.contextmanager
def thread_server(app, per_client):
    """localrt.connections' server on loopback in a thread, with a per-address limit."""
    from waitress import wasyncore

    srv = connections.make_server(app, "127.0.0.1", 0, 4, 1024, LONG, LONG, per_client,
                                  app.services.metrics.connections_refused.inc)
    loop = threading.Thread(target=srv.run, daemon=True)
    loop.start()
    try:
        yield srv
    finally:
        srv.trigger.pull_trigger(lambda: wasyncore.close_all(srv._map))  # ends the loop
        loop.join(PATIENCE)
        srv.task_dispatcher.shutdown()


def refused_count(sock) -> str:
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    text = b""
    while chunk := sock.recv(65536):
        text += chunk
    return re.search(rb"^localrt_connections_refused_total (\S+)", text, re.M)[1].decode()


def test_one_client_address_holds_at_most_its_share(settings):
    app = create_app(settings)
    with thread_server(app, per_client=3) as srv:
        port = int(srv.effective_port)
        held = [connect(port) for _ in range(3)]
        for s in held:  # answered: each is accepted and counted
            assert request(s).startswith(b"HTTP/1.1 200")
        extra = connect(port)
        assert closed(extra)
        held.pop().close()
        deadline = time.monotonic() + PATIENCE
        while True:  # the closed one frees its place once the server sees it go
            again = connect(port)
            if not closed_at_once(again):
                break
            assert time.monotonic() < deadline, "the closed connection's place never came back"
        assert refused_count(again) != "0"
        for s in held:
            s.close()
    app.close()


def closed_at_once(sock) -> bool:
    """Whether the server closes `sock` before answering a request on it."""
    try:
        return not request(sock)
    except OSError:
        return True


def test_the_per_address_limit_applies_beyond_loopback_only(settings):
    settings.update({"maxConnectionsPerClient": 5})
    assert connections.per_client_limit(settings, "127.0.0.1") is None
    assert connections.per_client_limit(settings, "::1") is None
    assert connections.per_client_limit(settings, "0.0.0.0") == 5
    assert connections.per_client_limit(settings, "192.0.2.7") == 5


def test_connection_limit_follows_the_open_files_limit():
    assert connections.connection_limit(65536) > 60000
    assert connections.connection_limit(1024) >= connections.MIN_CONNECTIONS
    assert connections.connection_limit(10) == connections.MIN_CONNECTIONS


def test_the_open_files_limit_is_raised_to_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip("the hard open-files limit leaves nothing to raise")
    with low_files_limit(256):
        raised = server.raise_open_files_limit()
        now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    expected = server.OPEN_FILES_CAP if hard == resource.RLIM_INFINITY \
        else min(hard, server.OPEN_FILES_CAP)
    assert raised == now == expected


def test_the_new_settings_have_their_defaults(home):
    s = settings_mod.load()
    assert (s["requestTimeout"], s["keepAliveTimeout"], s["maxConnectionsPerClient"]) == \
        (10, 30, 64)
