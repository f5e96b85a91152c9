"""Pulls through a real server process: the events stream, kill -9 and resume, a real proxy."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
from emulators.ggufgen import write_gguf
from emulators.proxyfix import need_tinyproxy, start_proxy, start_tinyproxy
from support.servers import run_foreground_server, send
from support.tasks import wait_pull

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("w") / "big.gguf", name="big", n_embd=512,
                      n_layer=2)


@pytest.fixture
def hub_repos(big):
    """The repos conftest's `hub` serves in this module."""

    def add(hub):
        hub.add_repo("org/big", {"big.gguf": big})

    return add


@pytest.fixture
def server(home, settings, hub):
    settings.update({"modelHubUrl": hub.url})
    srv = run_foreground_server(home)
    yield srv
    srv.stop(sig=signal.SIGKILL if srv.process.poll() is None else signal.SIGTERM)


def test_events_stream_carries_the_task(server, hub, big):
    hub.delay_per_chunk = 0.005  # about two seconds for the file
    events, ready = [], threading.Event()

    def listen():
        with urllib.request.urlopen(server.url + "/v1/events", timeout=30) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            ready.set()
            for line in resp:
                if line.startswith(b"data: "):
                    events.append(json.loads(line[6:]))
                    if events[-1]["type"] in ("DownloadSuccess", "DownloadError"):
                        return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    assert ready.wait(10)
    started = time.monotonic()
    status, body = send(server.url, "POST", "/v1/models/org/big/pull")
    assert status == 200
    listener.join(30)
    elapsed = time.monotonic() - started
    types = [e["type"] for e in events]
    assert types[0] == "DownloadStarted" and types[-1] == "DownloadSuccess", types
    updates = [e for e in events if e["type"] == "DownloadUpdated"]
    assert updates, types
    assert len(updates) <= elapsed * 2 + 2  # throttled to about 2 a second
    done = [i["downloadedBytes"] for e in updates for i in e["task"]["items"]]
    assert done == sorted(done)
    final = events[-1]["task"]
    assert final["id"] == "org:big:big.gguf" and final["status"] == "Success"
    assert final["items"][0]["downloadedBytes"] == big.stat().st_size


def test_kill_9_mid_download_then_the_pull_resumes(home, server, hub, big):
    hub.delay_per_chunk = 0.01
    send(server.url, "POST", "/v1/models/org/big/pull")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        _, body = send(server.url, "GET", "/v1/models/pull")
        if body["data"] and body["data"][0]["items"][0]["downloadedBytes"] > 2 * 1024 * 1024:
            break
        time.sleep(0.05)
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(10)

    hub.delay_per_chunk = 0
    hub.clear_requests()
    again = run_foreground_server(home)
    try:
        status, body = send(again.url, "GET", "/v1/models")
        assert status == 200 and body["data"] == []  # nothing half-downloaded is listed
        send(again.url, "POST", "/v1/models/org/big/pull")
        assert wait_pull(again.url, "org:big:big.gguf")["status"] == "Success"
        [get] = [r for r in hub.requests_to("cdn") if r.method == "GET"]
        resumed_at = int(get.range.split("=")[1].rstrip("-"))
        assert 2 * 1024 * 1024 <= resumed_at < big.stat().st_size
        status, model = send(again.url, "GET", "/v1/models/org:big:big.gguf")
        assert status == 200 and model["size"] == big.stat().st_size
    finally:
        again.stop()


def start_tinyproxy_or_skip(tmp_path, **credentials):
    need_tinyproxy()
    return start_tinyproxy(tmp_path, **credentials)


# proxy.py refuses a wrong password with 407; tinyproxy with 401 and a Basic challenge.
@pytest.mark.parametrize("start", [start_proxy, start_tinyproxy_or_skip],
                         ids=["proxy.py", "tinyproxy"])
def test_pull_through_a_proxy_with_credentials(tmp_path, server, hub, start):
    with start(tmp_path, username="alice", password="s3cret") as proxy:
        send(server.url, "PATCH", "/v1/configs", {"proxy_url": proxy.url,
                                                  "proxy_username": "alice",
                                                  "proxy_password": "wrong",
                                                  "no_proxy": ""})  # the hub is on loopback
        status, body = send(server.url, "POST", "/v1/models/org/big/pull")
        assert status == 502 and body["error"]["code"] == "proxy_auth_failed", body
        message = body["message"]
        assert proxy.url in message and "alice" in message and "wrong" not in message
        assert "proxy_username" in message and "proxy_password" in message
        assert not hub.requests  # the hub was never reached ...
        assert send(server.url, "GET", "/v1/models")[1]["data"] == []  # ... nor anything
        assert send(server.url, "GET", "/v1/models/pull")[1]["data"] == []  # registered

        send(server.url, "PATCH", "/v1/configs", {"proxy_password": "s3cret"})
        status, body = send(server.url, "POST", "/v1/models/org/big/pull")
        assert status == 200, body
        assert wait_pull(server.url, "org:big:big.gguf")["status"] == "Success"
        assert all("via" in r.headers for r in hub.requests)  # every request was proxied
