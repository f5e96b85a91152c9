"""GET /metrics: Prometheus text that prometheus_client's parser reads, whose counters
move with traffic (requests, chat on real llama.cpp, pulls), behind the API key, and
answered without touching an engine."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from emulators.ggufgen import write_gguf
from prometheus_client.parser import text_string_to_metric_families  # a test dependency
from support.apps import bind, call
from support.config import outbound_config
from support.models import NO_EOS, add_model
from support.servers import subprocess_env
from support.tasks import wait_task

from localrt import settings as settings_mod
from localrt.app import create_app
from localrt.downloads.tasks import Downloads, Item, Task
from localrt.events import EventBus
from localrt.metrics import CONTENT_TYPE, Metrics
from localrt.engines.probe import run_probe

USER = [{"role": "user", "content": "hello"}]
FAMILIES = {  # every family, by the name the parser gives it, and its type
    "localrt_http_requests": "counter", "localrt_http_request_duration_seconds": "histogram",
    "localrt_prompt_tokens": "counter", "localrt_generation_tokens": "counter",
    "localrt_time_to_first_token_seconds": "histogram",
    "localrt_decode_tokens_per_second": "histogram", "localrt_models_running": "gauge",
    "localrt_model_memory_bytes": "gauge",
    "localrt_sequences_active": "gauge", "localrt_sequences_queued": "gauge",
    "localrt_requests_in_progress": "gauge", "localrt_requests_queued": "gauge",
    "localrt_download_bytes": "counter", "localrt_download_tasks_active": "gauge",
    "localrt_connections_refused": "counter", "localrt_draft_tokens": "counter",
    "localrt_draft_tokens_accepted": "counter",
    "process_resident_memory_bytes": "gauge", "process_open_fds": "gauge"}


class Scrape:
    """One GET /metrics, parsed by prometheus_client."""

    def __init__(self, text: str):
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(self, name: str, **labels) -> float:
        """The sample `name` with exactly these labels; 0 when there is none."""
        found = [s.value for f in self.families.values() for s in f.samples
                 if s.name == name and s.labels == labels]
        assert len(found) <= 1, (name, labels, found)
        return found[0] if found else 0.0

    def samples(self, name: str) -> list:
        return [s for f in self.families.values() for s in f.samples if s.name == name]


def scrape(app, **headers) -> Scrape:
    r = call(app, "GET", "/metrics", headers=headers)
    assert r.status == 200, r.body
    assert r.headers["content-type"] == CONTENT_TYPE
    assert int(r.headers["content-length"]) == len(r.body)
    return Scrape(r.body.decode("utf-8"))


# --- the text --------------------------------------------------------------------------


def test_every_family_parses_with_its_type(app):
    families = scrape(app).families
    assert {name: f.type for name, f in families.items()} == FAMILIES
    assert all(f.documentation for f in families.values())


def test_label_values_are_escaped_and_histograms_are_cumulative():
    metrics = Metrics()
    odd = 'org/model:q4 "quoted" back\\slash\nnewline'
    metrics.observe_completion(odd, 12, 5, 0.2, 0.5)  # 4 tokens after the first in 0.5 s
    metrics.observe_completion(odd, 3, 1, 30.0, 0.0)  # one token: no decode rate
    metrics.observe_completion("other", 1, 0, None, None)  # no token at all: no TTFT
    s = Scrape(metrics.render())
    assert s.value("localrt_prompt_tokens_total", model=odd) == 15
    assert s.value("localrt_generation_tokens_total", model=odd) == 6
    assert s.value("localrt_prompt_tokens_total", model="other") == 1
    assert s.value("localrt_time_to_first_token_seconds_count", model=odd) == 2
    assert s.value("localrt_time_to_first_token_seconds_sum", model=odd) == 30.2
    assert s.value("localrt_time_to_first_token_seconds_bucket", model=odd, le="0.25") == 1
    assert s.value("localrt_time_to_first_token_seconds_bucket", model=odd, le="20") == 1
    assert s.value("localrt_time_to_first_token_seconds_bucket", model=odd, le="40") == 2
    assert s.value("localrt_time_to_first_token_seconds_bucket", model=odd, le="+Inf") == 2
    assert s.value("localrt_time_to_first_token_seconds_count", model="other") == 0
    assert s.value("localrt_decode_tokens_per_second_count", model=odd) == 1
    assert s.value("localrt_decode_tokens_per_second_sum", model=odd) == 8.0
    buckets = [x.value for x in s.samples("localrt_decode_tokens_per_second_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == 1


def test_sequences_come_from_the_status_rows_and_their_slots():
    rows = [{"id": "a", "requests": 3}, {"id": "b", "requests": 6, "slots": 4},
            {"id": "c", "requests": 0, "slots": 2}]
    s = Scrape(Metrics(running=lambda: rows).render())
    assert s.value("localrt_models_running") == 3
    assert [(s.value("localrt_sequences_active", model=m),
             s.value("localrt_sequences_queued", model=m)) for m in "abc"] == \
        [(1, 2), (4, 2), (0, 0)]


def test_process_memory_and_open_files(app):
    s = scrape(app)
    assert s.value("process_resident_memory_bytes") > 10 * 2 ** 20
    assert s.value("process_open_fds") >= 3


# --- requests --------------------------------------------------------------------------


def test_requests_are_counted_by_route_pattern_method_and_status(app):
    for _ in range(3):
        assert call(app, "GET", "/v1/models").status == 200
    assert call(app, "GET", "/v1/models/no-such-model").status == 404
    assert call(app, "GET", "/v1/models/org/other:q4").status == 404
    assert call(app, "DELETE", "/v1/configs").status == 405
    assert call(app, "GET", "/no/such/route").status == 404
    assert call(app, "TRACE", "/v1/models").status == 405
    assert call(app, "HEAD", "/v1/models").status == 200
    s = scrape(app)
    count = "localrt_http_requests_total"
    assert s.value(count, route="/v1/models", method="GET", status="200") == 3
    assert s.value(count, route="/v1/models/{model_id}", method="GET", status="404") == 2
    assert s.value(count, route="/v1/configs", method="DELETE", status="405") == 1
    assert s.value(count, route="unmatched", method="GET", status="404") == 1
    assert s.value(count, route="/v1/models", method="other", status="405") == 1
    assert s.value(count, route="/v1/models", method="HEAD", status="200") == 1
    # A scrape is counted once its body closes: the next scrape sees it.
    assert s.value(count, route="/metrics", method="GET", status="200") == 0
    again = scrape(app)
    assert again.value(count, route="/metrics", method="GET", status="200") == 1
    duration = "localrt_http_request_duration_seconds"
    assert again.value(f"{duration}_count", route="/v1/models", method="GET") == 3
    assert again.value(f"{duration}_bucket", route="/v1/models", method="GET", le="+Inf") == 3
    assert 0 < again.value(f"{duration}_sum", route="/v1/models", method="GET") < 3


KEY = "sk-metrics-0123456789"


def test_the_api_key_applies(home):
    (home / ".localrtrc").write_text(f"apiKeys: [{KEY}]\n")
    app = create_app(settings_mod.load())
    r = call(app, "GET", "/metrics")
    assert r.status == 401 and r.json["error"]["code"] == "unauthorized"
    s = scrape(app, Authorization=f"Bearer {KEY}")
    assert s.value("localrt_http_requests_total", route="/metrics", method="GET",
                   status="401") == 1
    assert KEY not in call(app, "GET", "/metrics",
                           headers={"Authorization": f"Bearer {KEY}"}).body.decode()


def test_a_scrape_imports_no_engine(home):
    code = ("import sys; from localrt import settings, app; from support.apps import call;"
            "a = app.create_app(settings.load()); r = call(a, 'GET', '/metrics');"
            "assert r.status == 200, r.body;"
            "print([m for m in ('llama_cpp', 'onnxruntime_genai') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(home),
                         cwd=str(Path(__file__).parent), capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


# --- chat, on real llama.cpp -------------------------------------------------------------


def chat(app, **body):
    body = {"model": "tiny", "messages": USER, "max_tokens": 8, "temperature": 0,
            "logit_bias": NO_EOS, **body}
    return call(app, "POST", "/v1/chat/completions", body)


def test_chat_moves_the_token_counters_and_the_time_to_first_token(app, quantized):
    add_model(bind(app), quantized["Q8_0"])
    r = chat(app)
    assert r.status == 200, r.body
    usage = r.json["usage"]
    assert usage["completion_tokens"] == 8
    s = scrape(app)
    assert s.value("localrt_prompt_tokens_total", model="tiny") == usage["prompt_tokens"]
    assert s.value("localrt_generation_tokens_total", model="tiny") == 8
    assert s.value("localrt_time_to_first_token_seconds_count", model="tiny") == 1
    assert 0 < s.value("localrt_time_to_first_token_seconds_sum", model="tiny") < 60
    assert s.value("localrt_decode_tokens_per_second_count", model="tiny") == 1
    assert s.value("localrt_decode_tokens_per_second_sum", model="tiny") > 0
    assert s.value("localrt_models_running") == 1
    assert s.value("localrt_sequences_active", model="tiny") == 0
    assert s.value("localrt_sequences_queued", model="tiny") == 0
    assert s.value("localrt_http_requests_total", route="/v1/chat/completions",
                   method="POST", status="200") == 1

    streamed = chat(app, stream=True, max_tokens=5)
    assert streamed.status == 200 and b"data: [DONE]" in streamed.body
    s = scrape(app)
    assert s.value("localrt_generation_tokens_total", model="tiny") == 13
    assert s.value("localrt_time_to_first_token_seconds_count", model="tiny") == 2
    assert s.value("localrt_http_requests_total", route="/v1/chat/completions",
                   method="POST", status="200") == 2


def test_text_completions_move_the_token_counters_too(app, quantized):
    add_model(bind(app), quantized["Q8_0"])
    body = {"model": "tiny", "prompt": ["one", "two"], "max_tokens": 3, "temperature": 0,
            "logit_bias": {"2": -100}}
    r = call(app, "POST", "/v1/completions", json_body=body)
    assert r.status == 200, r.body
    usage = r.json["usage"]
    assert usage["completion_tokens"] == 6
    s = scrape(app)
    assert s.value("localrt_prompt_tokens_total", model="tiny") == usage["prompt_tokens"]
    assert s.value("localrt_generation_tokens_total", model="tiny") == 6
    assert s.value("localrt_time_to_first_token_seconds_count", model="tiny") == 1
    streamed = call(app, "POST", "/v1/completions", json_body={**body, "stream": True})
    assert streamed.status == 200 and b"data: [DONE]" in streamed.body
    assert scrape(app).value("localrt_generation_tokens_total", model="tiny") == 12


class OpenStream:
    """A streamed chat whose reply has started and whose body is not read yet: its
    request holds a slot of the model until close()."""

    def __init__(self, app, body: dict):
        data = json.dumps(body).encode()
        environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/v1/chat/completions",
                   "SCRIPT_NAME": "", "QUERY_STRING": "", "CONTENT_TYPE": "application/json",
                   "CONTENT_LENGTH": str(len(data)), "wsgi.input": io.BytesIO(data),
                   "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "80", "HTTP_HOST": "127.0.0.1",
                   "wsgi.url_scheme": "http"}
        self.status = None
        self.body = app(environ, self._start)

    def _start(self, status, headers, exc_info=None):
        self.status = int(status.split()[0])

    def close(self):
        self.body.close()


def test_sequences_active_and_queued_follow_the_requests(app, quantized):
    add_model(bind(app), quantized["Q8_0"])
    assert call(app, "POST", "/v1/models/tiny/start").status == 200
    row, = call(app, "GET", "/v1/models/status").json["data"]
    slots = row.get("slots", 1)  # requests a model serves at once
    body = {"model": "tiny", "messages": USER, "max_tokens": 4, "stream": True}
    held = [OpenStream(app, body) for _ in range(slots)]
    assert all(h.status == 200 for h in held)
    waiter = threading.Thread(target=chat, args=(app,), kwargs={"max_tokens": 4})
    waiter.start()
    try:
        deadline = time.monotonic() + 20
        while call(app, "GET", "/v1/models/status").json["data"][0]["requests"] < slots + 1:
            assert time.monotonic() < deadline, "the last request never queued"
            time.sleep(0.01)
        s = scrape(app)
        assert s.value("localrt_sequences_active", model="tiny") == slots
        assert s.value("localrt_sequences_queued", model="tiny") == 1
        # The held streams are not counted until their bodies close.
        assert s.value("localrt_http_requests_total", route="/v1/chat/completions",
                       method="POST", status="200") == 0
    finally:
        for h in held:
            h.close()
        waiter.join(30)
    s = scrape(app)
    assert s.value("localrt_sequences_active", model="tiny") == 0
    assert s.value("localrt_sequences_queued", model="tiny") == 0
    assert s.value("localrt_http_requests_total", route="/v1/chat/completions",
                   method="POST", status="200") == slots + 1
    # Closed before a token came: counted, with no time to first token.
    assert s.value("localrt_time_to_first_token_seconds_count", model="tiny") == 1
    assert s.value("localrt_generation_tokens_total", model="tiny") == 4


class Untouchable:
    """Stands in for a loaded model: any use of it fails the test."""

    def __getattribute__(self, name):
        raise AssertionError(f"the scrape used the model's {name}")


def test_a_scrape_touches_no_running_model_and_probes_no_engine(home, quantized):
    scraping = False

    def probe(path, hw):
        assert not scraping, "the scrape probed an engine"
        return run_probe(path, hw)

    app = create_app(settings_mod.load(), run_probe=probe)
    try:
        add_model(bind(app), quantized["Q8_0"])
        assert call(app, "POST", "/v1/models/tiny/start").status == 200
        running = app.services.scheduler._running["tiny"]
        model, running.model = running.model, Untouchable()
        scraping = True
        try:
            s = scrape(app)
        finally:
            running.model, scraping = model, False
        assert s.value("localrt_models_running") == 1
    finally:
        app.close()


# --- downloads ---------------------------------------------------------------------------


@pytest.fixture
def hub_repos(tmp_path):
    """The repos conftest's `hub` serves in this module."""
    weights = write_gguf(tmp_path / "tiny.gguf", name="tiny")

    def add(hub):
        hub.add_repo("org/tiny", {"tiny.gguf": weights})
        hub.add_repo("org/blob", {"blob.gguf": bytes(range(256)) * (12 * 1024)})  # 3 MiB

    return add


def test_a_pull_moves_the_download_bytes(settings, hub):
    settings.update({"modelHubUrl": hub.url})
    app = create_app(settings)
    try:
        before = scrape(app)
        assert before.value("localrt_download_bytes_total") == 0
        r = call(app, "POST", "/v1/models/pull", {"model": "org/tiny"})
        assert r.status == 200, r.body
        assert wait_task(lambda *a, **k: call(app, *a, **k), r.json["task"]["id"])[
            "status"] == "Success"
        s = scrape(app)
        size = hub.file("org/tiny", "tiny.gguf").size
        assert size <= s.value("localrt_download_bytes_total") < size + 64 * 1024
        assert s.value("localrt_download_tasks_active") == 0
    finally:
        app.close()


def downloads(connections: int) -> Downloads:
    return Downloads(outbound_config, EventBus(1), lambda: connections)


def blob_task(hub, folder: Path) -> Task:
    f = hub.file("org/blob", "blob.gguf")
    item = Item("blob.gguf", f"{hub.url}/org/blob/resolve/main/blob.gguf",
                folder / "blob.gguf", f.size, sha256=f.sha256)
    return Task("org/blob", "Model", [item], hub_url=hub.url)


def wait_end(d: Downloads, task: Task) -> Task:
    deadline = time.monotonic() + 30
    while task.running or d.stats()["active"]:
        assert time.monotonic() < deadline, "the task never ended"
        time.sleep(0.01)
    return task


def test_a_resumed_download_counts_only_the_bytes_received(hub, tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    f = hub.file("org/blob", "blob.gguf")
    data = bytes(range(256)) * (12 * 1024)
    (folder / "blob.gguf.part").write_bytes(data[:f.size // 3])  # a third is there already
    d = downloads(1)
    try:
        task = d.start(blob_task(hub, folder))
        assert wait_end(d, task).status == "Success", task.error
        assert d.stats() == {"bytes": f.size - f.size // 3, "active": 0}
    finally:
        d.close()


def test_bytes_fetched_in_pieces_are_counted(hub, tmp_path, monkeypatch):
    monkeypatch.setattr("localrt.downloads.tasks.PIECES_FROM", 1024 * 1024)
    d = downloads(2)
    try:
        task = wait_end(d, d.start(blob_task(hub, tmp_path / "models")))
        assert task.status == "Success", task.error
        assert any(r.range for r in hub.requests_to("cdn"))  # it came in pieces
        assert d.stats() == {"bytes": hub.file("org/blob", "blob.gguf").size, "active": 0}
    finally:
        d.close()


def test_the_openapi_document_gives_the_reply_as_text(app):
    doc = call(app, "GET", "/openapi.json").json
    operation = doc["paths"]["/metrics"]["get"]
    assert operation["operationId"] == "metrics" and "Prometheus" in operation["summary"]
    content = operation["responses"]["200"]["content"]
    assert content == {"text/plain; version=0.0.4": {"schema": {"type": "string"}}}
