"""Remote models in-process: registration and its checks, records without keys, status,
start and stop, the engine row, the CLI, the upstream pool's routing, and the 504.

Forwarding to real upstreams (llama-cpp-python's server) is tests/test_remote_live.py.
Upstreams here are addresses nothing listens on, or a socket that never answers.
"""

from __future__ import annotations

import json
import socket
import stat
import threading
import time

import pytest
from support.cli import run

from localrt.cli import ExitCode
from localrt.remote.upstreams import (HEALTHY, UNHEALTHY, NoHealthyUpstream, Pool, Probe,
                                      UpstreamKeyRefused, UpstreamTimeout, parse_upstreams)

KEY = "sk-upstream-1234567890"


def dead_url() -> str:
    """An upstream URL nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def add(api, model_id="far", upstreams=None, **extra):
    upstreams = upstreams or [{"url": dead_url(), "api_key": KEY}]
    return api("POST", "/v1/models/remote", {"id": model_id, "upstreams": upstreams, **extra})


def test_an_upstreams_usage_details_reach_the_native_usage():
    from localrt import native
    from localrt.remote import wire

    completion = {"choices": [{"index": 0, "finish_reason": "stop",
                               "message": {"role": "assistant", "content": "Hi"}}],
                  "usage": {"prompt_tokens": 800, "completion_tokens": 2,
                            "prompt_tokens_details": {"cached_tokens": 40,
                                                      "audio_tokens": 750},
                            "completion_tokens_details": {"reasoning_tokens": 1}}}
    usage = native.collect(wire.reply(completion).events()).usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
            usage.audio_tokens, usage.reasoning_tokens) == (800, 2, 40, 750, 1)


# --- registration --------------------------------------------------------------------


def test_a_remote_model_is_listed_read_updated_and_deleted_like_any(api, settings):
    url = dead_url()
    r = add(api, upstreams=[{"url": url.removesuffix("/v1"), "api_key": KEY, "max_inflight": 2,
                              "model": "big-model"}])
    assert r.status == 200, r.json
    model = r.json["model"]
    assert r.json["message"] == "Model far added: 0 of 1 upstreams healthy"
    assert model["engine"] == "remote" and model["files"] == [] and model["size"] == 0
    assert model["upstreams"] == [{"url": url, "model": "big-model", "max_inflight": 2,
                                   "api_key_set": True}]  # /v1 added; the key never shown
    assert (model["upstreams_healthy"], model["upstreams_total"]) == (0, 1)
    assert model["status"] == "unavailable"

    listed = api("GET", "/v1/models").json["data"]
    assert [m["id"] for m in listed] == ["far"] and listed[0]["upstreams_total"] == 1
    got = api("GET", "/v1/models/far").json
    assert got["upstreams"] == model["upstreams"] and KEY not in json.dumps(got)

    definition = settings.data_dir / "models" / "remote" / "far" / "model.json"
    assert stat.S_IMODE(definition.stat().st_mode) == 0o600
    assert stat.S_IMODE(definition.parent.stat().st_mode) == 0o700
    assert json.loads(definition.read_text())["upstreams"][0]["api_key"] == KEY

    other = dead_url()
    r = api("PATCH", "/v1/models/far", {"upstreams": [{"url": url}, {"url": other}],
                                          "name": "Far away"})
    assert r.status == 200, r.json
    assert [u["url"] for u in r.json["model"]["upstreams"]] == [url, other]
    assert not any(u["api_key_set"] for u in r.json["model"]["upstreams"])  # replaced
    assert r.json["model"]["name"] == "Far away" and r.json["model"]["upstreams_total"] == 2
    r = api("PATCH", "/v1/models/far", {"temperature": 0.5})
    assert r.status == 200 and r.json["model"]["upstreams_total"] == 2

    r = api("DELETE", "/v1/models/far")
    assert r.status == 200 and r.json["deleted"] is True
    assert api("GET", "/v1/models").json["data"] == []
    assert not definition.parent.exists()
    assert api("GET", "/v1/models/status").json["data"] == []


@pytest.mark.parametrize("upstream,field,says", [
    ({"url": "ftp://host/v1"}, "upstreams[0].url", "OpenAI base URL"),
    ({"url": "http://user:pw@host/v1"}, "upstreams[0].url", "OpenAI base URL"),
    ({"url": "http://host:0/v1"}, "upstreams[0].url", "no credentials"),
    ({"url": "http://host/v1?x=1"}, "upstreams[0].url", "OpenAI base URL"),
    ({"url": "http://host/v1", "api_key": "has space"}, "upstreams[0].api_key", "printable"),
    ({"url": "http://host/v1", "max_inflight": 0}, "upstreams[0].max_inflight", ""),
    ({"url": "http://host/v1", "weight": 2}, "upstreams[0].weight", "Unknown field"),
])
def test_bad_upstreams_are_a_400_naming_the_field(api, upstream, field, says):
    r = add(api, upstreams=[upstream])
    assert r.status == 400 and r.json["error"]["param"] == field, r.json
    assert says in r.json["message"]
    assert "has space" not in r.json["message"] or field.endswith("api_key")


def test_registration_refusals(api, tmp_path, quantized):
    r = add(api, upstreams=[{"url": "http://h/v1"}, {"url": "http://h/v1/"}])
    assert r.status == 400 and r.json["error"]["param"] == "upstreams[1]"
    r = api("POST", "/v1/models/remote", {"id": "none", "upstreams": []})
    assert r.status == 400 and r.json["error"]["param"] == "upstreams"
    r = add(api, "remote")  # /v1/models/remote is another endpoint
    assert r.status == 400 and r.json["error"]["param"] == "id"
    assert add(api, "a/../b").status == 400
    assert add(api, "twice").status == 200
    r = add(api, "twice")
    assert r.status == 409 and r.json["error"]["param"] == "id"
    # A model that has files has no upstreams.
    assert api("POST", "/v1/models/import", {"path": str(quantized["Q8_0"]),
                                              "id": "local"}).status == 200
    r = api("PATCH", "/v1/models/local", {"upstreams": [{"url": "http://h/v1"}]})
    assert r.status == 400 and r.json["error"]["param"] == "upstreams"
    assert "not a remote model" in r.json["message"]


def test_start_and_stop_have_nothing_to_do(api):
    add(api)
    r = api("POST", "/v1/models/start", {"model": "far"})
    assert r.status == 200 and r.json["alreadyRunning"] is True and r.json["engine"] == "remote"
    assert "is remote" in r.json["message"]
    r = api("POST", "/v1/models/far/start", {"ctx_len": 512})
    assert r.status == 400 and r.json["error"]["param"] == "ctx_len"
    r = api("POST", "/v1/models/far/stop", {})
    assert r.status == 200 and "nothing was stopped" in r.json["message"]


def test_status_shows_each_upstream(api):
    add(api, upstreams=[{"url": dead_url(), "max_inflight": 3}, {"url": dead_url()}])
    [row] = api("GET", "/v1/models/status").json["data"]
    assert row["id"] == "far" and row["engine"] == "remote" and row["requests"] == 0
    assert (row["upstreams_healthy"], row["upstreams_total"]) == (0, 2)
    first = row["upstreams"][0]
    assert first["health"] == "unhealthy" and "refused" in first["error"].lower()
    assert (first["inflight"], first["max_inflight"], first["requests"]) == (0, 3, 0)


def test_no_healthy_upstream_is_a_503_and_the_key_stays_out(api):
    add(api)
    body = {"model": "far", "messages": [{"role": "user", "content": "hi"}]}
    for stream in (False, True):
        r = api("POST", "/v1/chat/completions", {**body, "stream": stream})
        assert r.status == 503 and r.json["error"]["code"] == "no_healthy_upstream", r.json
        assert r.headers["retry-after"] and KEY not in r.body.decode()


@pytest.mark.live
def test_an_upstream_that_never_answers_is_a_504(api, settings):
    settings.update({"upstreamTimeout": 0.5})
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections are accepted by the kernel, and never answered
    try:
        port = silent.getsockname()[1]
        r = add(api, upstreams=[{"url": f"http://127.0.0.1:{port}/v1"}])
        # Its probe is slow, not failed: the upstream stays usable.
        assert r.json["model"]["status"] == "running"
        started = time.monotonic()
        r = api("POST", "/v1/chat/completions",
                 {"model": "far", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status == 504 and r.json["error"]["code"] == "upstream_timeout", r.json
        assert "upstreamTimeout" in r.json["message"]
        assert time.monotonic() - started < 5
    finally:
        silent.close()


def test_the_engine_row_is_part_of_localrt(api):
    engines = {e["name"]: e for e in api("GET", "/v1/engines").json["data"]}
    assert engines["remote"]["status"] == "Ready" and engines["remote"]["format"] == "OpenAI API"
    for method in ("POST", "DELETE"):
        r = api(method, "/v1/engines/remote/install", {})
        assert r.status == 400 and "part of localrt" in r.json["message"]


# --- the CLI ----------------------------------------------------------------------------


def test_cli_add_remote_and_ps(thread_server, monkeypatch):
    url = dead_url()
    monkeypatch.setenv("UPSTREAM_KEY", KEY)
    code, out, err = run("models", "add-remote", "far", "--url", url, "--url", dead_url(),
                         "--upstream-model", "llama-70b", "--api-key-env", "UPSTREAM_KEY",
                         "--max-inflight", "4")
    assert code == ExitCode.OK, err
    assert out.strip() == "Model far added: 0 of 2 upstreams healthy"
    code, out, _ = run("models", "get", "far")
    record = json.loads(out)
    assert record["upstreams"][0] == {"url": url, "model": "llama-70b", "max_inflight": 4,
                                      "api_key_set": True}
    assert KEY not in out
    code, out, _ = run("ps")
    assert code == ExitCode.OK
    assert "Remote model" in out and url in out and "unhealthy" in out and "0/4" in out
    code, out, _ = run("models", "list")
    assert "far" in out and "remote" in out

    monkeypatch.delenv("UPSTREAM_KEY")
    code, _, err = run("models", "add-remote", "other", "--url", url, "--api-key-env",
                       "UPSTREAM_KEY")
    assert code == ExitCode.USAGE and "UPSTREAM_KEY is not set" in err
    code, _, err = run("models", "add-remote", "other", "--url", "nope")
    assert code == ExitCode.ERROR and "upstreams[0].url" in err


# --- the pool ---------------------------------------------------------------------------


def pool(*limits) -> Pool:
    p = Pool("m", [{"url": f"http://u{i}/v1", "max_inflight": n} for i, n in enumerate(limits)])
    for u in p.upstreams:
        p.probed(u, Probe(HEALTHY))
    return p


def test_the_least_busy_usable_upstream_is_chosen():
    p = pool(None, None, None)
    a, b, c = p.upstreams
    chosen = [p.acquire((), 1) for _ in range(6)]
    assert chosen == [a, b, c, a, b, c]  # equal loads alternate
    p.release(b, 5.0)
    assert p.acquire((), 1) is b  # the least busy
    p.failed(a, "connection refused")
    assert {p.acquire((), 1) for _ in range(2)} == {b, c}
    assert p.acquire([b], 1) is c  # a retry skips the upstream that failed
    assert p.counts() == (2, 3)


def test_full_upstreams_make_requests_wait_in_arrival_order():
    p = pool(1)
    first = p.acquire((), 1)
    order = []

    def wait(n):
        order.append((n, p.acquire((), 10)))
        if n < 2:  # the last one keeps it
            p.release(first, None)

    threads = []
    for n in range(3):
        threads.append(threading.Thread(target=wait, args=(n,)))
        threads[-1].start()
        time.sleep(0.05)  # arrive in this order
    assert p.status()["requests"] == 4  # one in flight, three waiting
    p.release(first, None)
    for t in threads:
        t.join(10)
    assert [n for n, _ in order] == [0, 1, 2]
    with pytest.raises(UpstreamTimeout):
        p.acquire((), 0.05)  # the last one still holds it: full for 0.05 s


def test_unusable_upstreams_are_a_503_or_a_key_refusal():
    p = pool(None, None)
    a, b = p.upstreams
    p.failed(a, "connection refused")
    p.probed(b, Probe(UNHEALTHY, "it refused localrt's key (HTTP 401: Invalid API key)", True))
    with pytest.raises(NoHealthyUpstream):
        p.acquire((), 1)
    p.failed(a, "it refused localrt's key (HTTP 403: Forbidden here)", refused_key=True)
    with pytest.raises(UpstreamKeyRefused) as caught:
        p.acquire((), 1)
    # Each upstream's own words come with the refusal, not only localrt's.
    message = caught.value.message
    assert "refused localrt's key" in message and "Invalid API key" in message
    assert "Forbidden here" in message
    p.probed(a, Probe(None))  # a slow probe changes nothing
    assert a.health == UNHEALTHY
    p.probed(a, Probe(HEALTHY, latency_ms=3.25, listed="served"))
    assert p.acquire((), 1) is a and a.upstream_model("m") == "served"
    assert a.row()["latency_ms"] == 3.2


def test_parse_upstreams_keeps_what_was_given():
    assert parse_upstreams([{"url": "HTTPS://Host:8443/openai/v1/", "api_key": "k"},
                            {"url": "http://[::1]:8000"}]) == [
        {"url": "https://Host:8443/openai/v1", "api_key": "k"}, {"url": "http://[::1]:8000/v1"}]


@pytest.mark.live
def test_a_remote_upstreams_probe_names_tinyproxys_refusal_not_the_key(tmp_path):
    # The same rule holds for remote models' upstreams, which localrt probes through
    # the proxy: tinyproxy's 401 is not the upstream refusing localrt's key.
    from support.config import outbound_config as config
    from emulators.proxyfix import need_tinyproxy, start_target, start_tinyproxy

    from localrt.remote.upstreams import Upstream, probe

    need_tinyproxy()
    with start_target(b'{"data": []}') as target, \
            start_tinyproxy(tmp_path, username="alice", password="s3cret") as proxy:
        cfg = config(proxy_url=proxy.url, proxy_username="alice", proxy_password="wrong")
        found = probe(cfg, Upstream(target.url + "/v1"))
        assert found.health == "unhealthy" and not found.refused_key, found
        assert proxy.url in found.error and "refused its credentials" in found.error
        assert not target.requests
        assert probe({**cfg, "proxy_password": "s3cret"},
                     Upstream(target.url + "/v1")).health == "healthy"
