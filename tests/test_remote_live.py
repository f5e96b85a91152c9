"""Remote models against real upstreams: llama-cpp-python's server (tests/emulators/upstreams.py),
two replicas on loopback, behind a real `localrt start --foreground`.

Covered: streamed and whole chats through localrt with localrt's id; a client that hangs
up closes the upstream's request (its log says so, and it is free at once); least-busy
routing under 8 concurrent clients, and max_inflight with requests waiting their turn;
a replica killed mid-stream (the stream ends with an error event, new requests go to
the other, and a connection refused before the first byte is retried there); a wrong
upstream key is a clear 502; the keys never appear in the log or a reply; the Config's
proxy and TLS flags apply to upstream connections.

The model is conftest's `slow_gguf` (random weights, hundreds of tokens a second on one
thread), so a 3000-token reply lasts seconds; each replica runs it on one thread.
Requests ban every token but the ordinary word pieces (TEXT_ONLY).
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import threading
import time

import openai
import pytest
from emulators.ggufgen import MIN_VOCAB_SIZE, write_bert_gguf
from prometheus_client.parser import text_string_to_metric_families
from support.servers import RawStream, send, subprocess_env
from support.waiting import wait_for
from emulators.upstreams import start_replica

from localrt import server as server_mod
from localrt import settings as settings_mod

pytestmark = pytest.mark.live

KEY = "upstream-key-7c41d9e2"        # what the replicas require
WRONG_KEY = "wrong-key-0b8f3a55"
# Only ordinary word pieces: replies are exactly max_tokens long (no end token), and
# always valid UTF-8. llama-cpp-python's server holds back the text of byte tokens that
# are not UTF-8 yet, re-decoding all of them at every step, so a random model's stream
# of byte tokens stalls for minutes.
TEXT_ONLY = {str(token): -100 for token in range(MIN_VOCAB_SIZE)}
HELLO = [{"role": "user", "content": "Hello there"}]
LONG = 3000


def chat_body(model, max_tokens, stream=True, **extra):
    return {"model": model, "messages": HELLO, "max_tokens": max_tokens, "temperature": 0,
            "logit_bias": TEXT_ONLY, "stream": stream, **extra}


@pytest.fixture(scope="module")
def replicas(slow_gguf, tmp_path_factory):
    """Two llama_cpp.server replicas of the same model, both requiring KEY."""
    root = tmp_path_factory.mktemp("replicas")
    found: list = [None, None]
    errors = []

    def start(i):
        try:
            found[i] = start_replica(slow_gguf, root / f"replica-{i}.log", api_key=KEY)
        except Exception as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if errors:
            raise errors[0]
        yield found
    finally:
        for replica in found:
            if replica is not None:
                replica.stop()


class Localrt:
    """`localrt start --foreground` in its own process, its output in a file."""

    def __init__(self, home):
        self.settings = settings_mod.load(environ={"HOME": str(home)})
        self.output = home / "server-output.log"
        with open(self.output, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "localrt", "start", "--foreground", "--port", "0"],
                env=subprocess_env(home), stdout=out, stderr=subprocess.STDOUT)
        self.url = server_mod.wait_started(self.settings, self.process).url

    def api(self, method, path, body=None, timeout=60):
        return send(self.url, method, path, body, timeout)

    def log_text(self) -> str:
        logs = self.settings.log_dir
        return "".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.log*"))) + \
            self.output.read_text(errors="replace")

    def status(self, model_id) -> dict:
        status, body = self.api("GET", "/v1/models/status")
        assert status == 200, body
        return {row["id"]: row for row in body["data"]}[model_id]

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def bert_replica(tmp_path_factory):
    """A llama_cpp.server replica in embedding mode, on a tiny BERT."""
    root = tmp_path_factory.mktemp("bert-replica")
    replica = start_replica(write_bert_gguf(root / "bert.gguf"), root / "replica.log",
                            api_key=KEY, n_ctx=512, extra=("--embedding", "true"))
    yield replica
    replica.stop()


@pytest.fixture(scope="module")
def localrt(tmp_path_factory):
    srv = Localrt(tmp_path_factory.mktemp("remote-home"))
    yield srv
    srv.stop()


def add_remote(srv, model_id, urls, key=KEY, **upstream):
    status, body = srv.api("POST", "/v1/models/remote", {
        "id": model_id, "upstreams": [{"url": url, "api_key": key, **upstream} for url in urls]})
    assert status == 200, body
    return body["model"]


@pytest.fixture(scope="module")
def pair(localrt, replicas):
    """A remote model on both replicas."""
    model = add_remote(localrt, "pair", [r.url for r in replicas])
    assert model["upstreams_healthy"] == model["upstreams_total"] == 2, model
    return "pair"


def inflight(srv, model_id) -> list:
    return [u["inflight"] for u in srv.status(model_id)["upstreams"]]


# --- chats ---------------------------------------------------------------------------


def test_streamed_and_whole_chats_carry_localrts_id(localrt, pair):
    with openai.OpenAI(base_url=localrt.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        whole = client.chat.completions.create(model=pair, messages=HELLO, max_tokens=24,
                                               temperature=0, logit_bias=TEXT_ONLY)
        assert whole.model == pair and whole.object == "chat.completion"
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage.completion_tokens == 24
        chunks = list(client.chat.completions.create(
            model=pair, messages=HELLO, max_tokens=24, temperature=0, logit_bias=TEXT_ONLY,
            stream=True))
    assert all(c.model == pair and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same on either replica
    assert chunks[-1].choices[0].finish_reason == "length"
    rows = localrt.status(pair)
    assert rows["engine"] == "remote" and rows["upstreams_healthy"] == 2
    assert {u["health"] for u in rows["upstreams"]} == {"healthy"}
    assert all(u["latency_ms"] is not None and u["model"] for u in rows["upstreams"])


def test_a_stream_passes_through_event_by_event(localrt, pair):
    """Not buffered: the first token arrives long before the reply ends."""
    started = time.monotonic()
    stream = RawStream(localrt.url, chat_body(pair, 600))
    arrivals, events = [], []
    for event in stream:
        arrivals.append(time.monotonic() - started)
        events.append(event)
    stream.close()
    assert events[-1] == "[DONE]"
    content = [e for e in events[:-1] if e["choices"] and e["choices"][0]["delta"].get("content")]
    first, last = arrivals[1], arrivals[-1]
    print(f"first event at {first * 1000:.0f} ms, the last at {last * 1000:.0f} ms, "
          f"{len(content)} content events")
    assert len(content) > 100
    assert first < last / 4


def test_a_client_hanging_up_stops_the_upstream(localrt, pair, replicas):
    before = [r.log_text().count("Disconnected from client") for r in replicas]
    stream = RawStream(localrt.url, chat_body(pair, LONG))
    events = iter(stream)
    first = time.monotonic()
    for _ in range(40):
        assert next(events)["choices"]
    rate = 40 / (time.monotonic() - first)
    assert sum(inflight(localrt, pair)) == 1
    stream.close()

    def told():
        now = [r.log_text().count("Disconnected from client") for r in replicas]
        return sum(now) > sum(before)

    seen = wait_for(told, 10, "no replica logged the hang-up")
    wait_for(lambda: sum(inflight(localrt, pair)) == 0, 5, "localrt still counts it")
    # The replica is free: a short reply does not wait for the rest of the long one.
    started = time.monotonic()
    status, reply = localrt.api("POST", "/v1/chat/completions", chat_body(pair, 8, False))
    took = time.monotonic() - started
    rest = (LONG - 40) / rate
    print(f"{rate:.0f} tokens/s; the upstream logged the hang-up after {seen:.2f} s; the "
          f"next reply took {took:.2f} s; the rest would have taken {rest:.1f} s")
    assert status == 200 and reply["usage"]["completion_tokens"] == 8
    assert seen + took < rest / 2


def test_least_busy_routing_under_8_concurrent_clients(localrt, pair, replicas):
    before = [r.chats() for r in replicas]
    counted = {u["url"]: u["requests"] for u in localrt.status(pair)["upstreams"]}
    results, peak = [], [0, 0]
    stop = threading.Event()

    def client():
        stream = RawStream(localrt.url, chat_body(pair, 128))
        events = list(stream)
        stream.close()
        results.append(events)

    def sample():
        while not stop.is_set():
            for i, n in enumerate(inflight(localrt, pair)):
                peak[i] = max(peak[i], n)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    clients = [threading.Thread(target=client) for _ in range(8)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(120)
    stop.set()
    sampler.join()
    assert len(results) == 8 and all(e[-1] == "[DONE]" for e in results)
    assert all(not any("error" in e for e in events[:-1]) for events in results)
    rows = localrt.status(pair)["upstreams"]
    got = [u["requests"] - counted[u["url"]] for u in rows]
    served = [r.chats() - b for r, b in zip(replicas, before)]
    print(f"forwarded {got}, served by the replicas {served}, peak in flight {peak}")
    assert sorted(served) == sorted(got) and sum(got) == 8
    # All 8 arrive at once, so they split 4 and 4 (a replica that finishes early on a
    # busy machine may take one more).
    assert max(got) - min(got) <= 2
    assert max(peak) <= 5 and min(peak) >= 2
    # Probes of busy replicas were slow, and slow is not a failure.
    assert {u["health"] for u in rows} == {"healthy"}


def test_max_inflight_makes_requests_wait_their_turn(localrt, replicas):
    add_remote(localrt, "one-each", [r.url for r in replicas], max_inflight=1)
    results, peak, stop = [], [0, 0], threading.Event()
    waiting = []

    def client():
        status, body = localrt.api("POST", "/v1/chat/completions",
                                   chat_body("one-each", 64, False), timeout=120)
        results.append((status, body))

    def sample():
        while not stop.is_set():
            row = localrt.status("one-each")
            waiting.append(row["requests"] - sum(u["inflight"] for u in row["upstreams"]))
            for i, u in enumerate(row["upstreams"]):
                peak[i] = max(peak[i], u["inflight"])
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    clients = [threading.Thread(target=client) for _ in range(6)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(120)
    stop.set()
    sampler.join()
    assert [s for s, _ in results] == [200] * 6, results
    assert all(b["model"] == "one-each" for _, b in results)
    print(f"peak in flight {peak}, most waiting {max(waiting)}")
    assert peak == [1, 1] and max(waiting) >= 2


# --- failures --------------------------------------------------------------------------


def test_a_wrong_upstream_key_is_a_clear_502(localrt, replicas):
    add_remote(localrt, "wrong-key", [replicas[0].url], key=WRONG_KEY)
    for stream in (False, True):
        status, body = localrt.api("POST", "/v1/chat/completions",
                                   chat_body("wrong-key", 4, stream))
        assert status == 502, body
        assert body["error"]["code"] == "upstream_key_refused"
        assert "refused localrt's key" in body["message"] and replicas[0].url in body["message"]
        # The upstream's own words (llama-cpp-python's server says "Invalid API key"),
        # whether the request met the refusal or a probe had met it first.
        assert "Invalid API key" in body["message"], body
        assert WRONG_KEY not in json.dumps(body)
    row = localrt.status("wrong-key")
    assert row["upstreams"][0]["health"] == "unhealthy"
    assert "Invalid API key" in row["upstreams"][0]["error"]


def test_a_replica_killed_mid_stream(localrt, replicas, slow_gguf, tmp_path):
    doomed = start_replica(slow_gguf, tmp_path / "doomed.log", api_key=KEY)
    try:
        survivor = replicas[1]
        # Listed first, the doomed replica takes the first request of each model.
        add_remote(localrt, "retry", [doomed.url, survivor.url])
        add_remote(localrt, "kill", [doomed.url, survivor.url])
        stream = RawStream(localrt.url, chat_body("kill", LONG))
        events = iter(stream)
        for _ in range(10):
            assert next(events)["choices"]
        assert inflight(localrt, "kill") == [1, 0]
        doomed.kill()
        rest = list(events)
        stream.close()
        assert rest[-1] == "[DONE]"
        error = rest[-2]["error"]
        assert error["code"] == "upstream_error" and doomed.url in error["message"]
        assert all("choices" in e for e in rest[:-2])
        row = localrt.status("kill")
        assert [u["health"] for u in row["upstreams"]] == ["unhealthy", "healthy"]
        # New requests go to the other replica.
        served = survivor.chats()
        status, reply = localrt.api("POST", "/v1/chat/completions", chat_body("kill", 8, False))
        assert status == 200 and reply["model"] == "kill"
        assert survivor.chats() == served + 1
        # "retry" still thinks the dead replica healthy (its next probe is seconds away):
        # the refused connection is retried on the survivor, before the first byte.
        assert localrt.status("retry")["upstreams"][0]["health"] == "healthy"
        status, reply = localrt.api("POST", "/v1/chat/completions", chat_body("retry", 8, False))
        assert status == 200 and reply["usage"]["completion_tokens"] == 8
        assert survivor.chats() == served + 2
        retried = localrt.status("retry")["upstreams"]
        assert retried[0]["health"] == "unhealthy" and "refused" in retried[0]["error"].lower()
    finally:
        doomed.stop()


def test_no_healthy_upstream_is_a_503(localrt, replicas):
    add_remote(localrt, "gone", ["http://127.0.0.1:9/v1"])  # discard: nothing listens
    status, body = localrt.api("POST", "/v1/chat/completions", chat_body("gone", 4, False))
    assert status == 503 and body["error"]["code"] == "no_healthy_upstream", body
    status, body = localrt.api("GET", "/v1/models/gone")
    assert body["status"] == "unavailable" and body["upstreams_healthy"] == 0


# --- transport -----------------------------------------------------------------------


def test_the_configs_proxy_carries_upstream_requests(localrt, pair, replicas, tmp_path):
    from emulators.proxyfix import proxy_available, start_proxy

    if not proxy_available():
        pytest.skip("proxy.py is not installed")
    with start_proxy(tmp_path) as proxy:
        status, body = localrt.api("PATCH", "/v1/configs", {"proxy_url": proxy.url,
                                                            "no_proxy": ""})
        assert status == 200, body
        try:
            status, reply = localrt.api("POST", "/v1/chat/completions",
                                        chat_body(pair, 8, False))
            assert status == 200 and reply["model"] == pair
            line = proxy.wait_for_log("/v1/chat/completions", timeout=10)
            assert "POST 127.0.0.1:" in line
        finally:
            localrt.api("PATCH", "/v1/configs", {"proxy_url": "",
                                                 "no_proxy": "localhost,127.0.0.1,::1"})


def test_the_configs_tls_flags_apply_to_upstreams(localrt, slow_gguf, tmp_path):
    import trustme

    cert = trustme.CA().issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    replica = start_replica(slow_gguf, tmp_path / "tls.log", api_key=KEY,
                            extra=["--ssl_keyfile", str(tmp_path / "key.pem"),
                                   "--ssl_certfile", str(tmp_path / "cert.pem")],
                            scheme="https")
    try:
        model = add_remote(localrt, "tls", [replica.url])
        assert model["upstreams_healthy"] == 0  # its certificate is not trusted
        status, body = localrt.api("POST", "/v1/chat/completions", chat_body("tls", 4, False))
        assert status == 503 and "CERTIFICATE_VERIFY_FAILED" in body["message"], body
        status, _ = localrt.api("PATCH", "/v1/configs", {"verify_peer_ssl": False,
                                                         "verify_host_ssl": False})
        assert status == 200
        try:  # the next probe, a few seconds away, brings it back
            wait_for(lambda: localrt.status("tls")["upstreams_healthy"] == 1, 15,
                     "the upstream is still out")
            status, reply = localrt.api("POST", "/v1/chat/completions",
                                        chat_body("tls", 4, False))
            assert status == 200 and reply["model"] == "tls", reply
        finally:
            localrt.api("PATCH", "/v1/configs", {"verify_peer_ssl": True,
                                                 "verify_host_ssl": True})
    finally:
        replica.stop()


# --- secrets ----------------------------------------------------------------------------


def test_completions_go_to_the_upstreams_completions(localrt, pair, replicas):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
            "logit_bias": TEXT_ONLY}
    with openai.OpenAI(base_url=localrt.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        whole = client.completions.create(model=pair, **body)
        chunks = list(client.completions.create(model=pair, stream=True, **body))
    with openai.OpenAI(base_url=replicas[0].url, api_key=KEY, max_retries=0,
                       timeout=60) as client:
        direct = client.completions.create(model="any", **body)
    assert whole.model == pair and whole.object == "text_completion"
    assert whole.choices[0].text == direct.choices[0].text  # greedy: the upstream's reply
    assert whole.usage.completion_tokens == 12
    assert all(c.model == pair for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_embeddings_go_to_the_upstreams_embeddings(localrt, bert_replica):
    add_remote(localrt, "remote-bert", [bert_replica.url])
    texts = ["a first text", "and a second"]
    with openai.OpenAI(base_url=localrt.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        got = client.embeddings.create(model="remote-bert", input=texts,
                                       encoding_format="float")
    with openai.OpenAI(base_url=bert_replica.url, api_key=KEY, max_retries=0,
                       timeout=60) as client:
        direct = client.embeddings.create(model="any", input=texts, encoding_format="float")
    assert got.model == "remote-bert"
    assert [e.embedding for e in got.data] == [e.embedding for e in direct.data]
    assert [e.index for e in got.data] == [0, 1]


def test_metrics_count_remote_models_tokens(localrt, pair):
    def counts():
        status, text = _get_text(localrt.url + "/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(text)}
        def value(name):
            return sum(s.value for s in families[name].samples
                       if s.labels.get("model") == pair and s.name.endswith("_total"))
        ttft = sum(s.value for s in families["localrt_time_to_first_token_seconds"].samples
                   if s.labels.get("model") == pair and s.name.endswith("_count"))
        return value("localrt_prompt_tokens"), value("localrt_generation_tokens"), ttft

    before = counts()
    status, reply = localrt.api("POST", "/v1/chat/completions", chat_body(pair, 7, stream=False))
    assert status == 200, reply
    stream = RawStream(localrt.url, chat_body(pair, 9))
    assert list(stream)[-1] == "[DONE]"
    stream.close()
    after = counts()
    assert after[0] - before[0] >= reply["usage"]["prompt_tokens"] > 0
    assert after[1] - before[1] == 7 + 9  # the streamed one: its events with text
    assert after[2] - before[2] == 2


def _get_text(url):
    import urllib.request
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.status, resp.read().decode()


def test_the_keys_never_appear_in_logs_or_replies(localrt, pair):
    """Last in this file: every test above has sent the keys through localrt."""
    for path in ("/v1/models", f"/v1/models/{pair}", "/v1/models/wrong-key",
                 "/v1/models/status"):
        status, body = localrt.api("GET", path)
        assert status == 200
        text = json.dumps(body)
        assert KEY not in text and WRONG_KEY not in text
    record = localrt.api("GET", f"/v1/models/{pair}")[1]
    assert all(u["api_key_set"] for u in record["upstreams"])
    definition = localrt.settings.data_dir / "models" / "remote" / pair / "model.json"
    assert stat.S_IMODE(definition.stat().st_mode) == 0o600
    assert KEY in definition.read_text()  # stored, for the next start
    log = localrt.log_text()
    assert "remote model" in log  # the log did speak of them
    assert KEY not in log and WRONG_KEY not in log
