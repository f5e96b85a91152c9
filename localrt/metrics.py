"""Prometheus metrics: what GET /metrics says, in the text exposition format 0.0.4.

`Metrics` owns every metric of one app. Some move as things happen: the app counts
each request when its reply's body closes (`observe_request`), and chat times each
completion on a `Clock`, which counts its tokens and times when it ends
(`observe_completion`). The rest are read when a scrape comes (`render`): running
models, their sequences and their memory by device (the rows' `ram`, as the engine
accounts it, and a GPU build's `offload.devices`) from the scheduler's status rows,
download totals from `Downloads.stats`, each kind's requests in progress and waiting
for a place from its admission (localrt.admission), and this process's memory and
open files from /proc.
A scrape touches no engine.

Written by hand rather than with prometheus_client: the text format is small, the
project adds no runtime dependency for it, and the tests parse this text with
prometheus_client's own parser. Each metric is one `Counter` or `Histogram` holding
one lock; label values are bounded (route patterns, not paths; known methods; model
ids of the registry) so the number of series is too.
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Callable, Iterable, Iterator

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Request methods counted by name; any other is "other", so clients cannot grow the series.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED = "unmatched"  # the route label of a path no route has

# Seconds. Streamed chat replies last as long as their generation, so the top is high.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0, 120.0, 300.0)
# Seconds. A first request may wait for its model to load.
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
# Tokens per second.
RATE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 35.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0,
                500.0, 1000.0)


class Counter:
    """A monotonic count per combination of label values."""

    kind = "counter"

    def __init__(self, name: str, help: str, labels: tuple = ()):
        self.name, self.help, self.labels = name, help, labels
        self._lock = threading.Lock()  # guards _values
        self._values: dict[tuple, float] = {}

    def inc(self, values: tuple = (), amount: float = 1) -> None:
        """Add `amount` (>= 0) to the count of these label values."""
        with self._lock:
            self._values[values] = self._values.get(values, 0) + amount

    def samples(self) -> Iterator[tuple[str, dict, float]]:
        """(sample name, labels, value) for each count."""
        with self._lock:
            values = sorted(self._values.items())
        for key, value in values:
            yield self.name, dict(zip(self.labels, key)), value


class Histogram:
    """Observations counted into fixed buckets, with their sum, per label values."""

    kind = "histogram"

    def __init__(self, name: str, help: str, labels: tuple, buckets: tuple):
        self.name, self.help, self.labels = name, help, labels
        self.buckets = tuple(sorted(buckets))
        self._lock = threading.Lock()  # guards _values
        # label values -> [count in each bucket (not cumulative), then +Inf's], sum
        self._values: dict[tuple, tuple[list[int], list[float]]] = {}

    def observe(self, values: tuple, value: float) -> None:
        """Count one observation."""
        index = next((i for i, bound in enumerate(self.buckets) if value <= bound),
                     len(self.buckets))
        with self._lock:
            counts, total = self._values.setdefault(
                values, ([0] * (len(self.buckets) + 1), [0.0]))
            counts[index] += 1
            total[0] += value

    def samples(self) -> Iterator[tuple[str, dict, float]]:
        """The cumulative _bucket samples, then _sum and _count, for each label values."""
        with self._lock:
            values = sorted((k, (list(c), t[0])) for k, (c, t) in self._values.items())
        for key, (counts, total) in values:
            labels = dict(zip(self.labels, key))
            seen = 0
            for bound, count in zip(self.buckets + (math.inf,), counts):
                seen += count
                yield f"{self.name}_bucket", {**labels, "le": _number(bound)}, seen
            yield f"{self.name}_sum", labels, total
            yield f"{self.name}_count", labels, seen


class Gauge:
    """Values read at scrape time: (labels, value) pairs."""

    kind = "gauge"

    def __init__(self, name: str, help: str, values: Iterable[tuple[dict, float]]):
        self.name, self.help, self._values = name, help, list(values)

    def samples(self) -> Iterator[tuple[str, dict, float]]:
        """(sample name, labels, value) for each value."""
        for labels, value in self._values:
            yield self.name, labels, value


class ReadCounter(Gauge):
    """A count kept elsewhere (it only grows), read at scrape time."""

    kind = "counter"


class Metrics:
    """Every metric of one app, and the text a scrape gets.

    `running` is the scheduler's status (one row per running model, with "requests":
    those holding or waiting for a slot, and "slots": how many it serves at once, one
    when it does not say); `downloads` gives {"bytes", "active"}; `admissions` gives
    {kind: (requests in progress, requests waiting for a place)}. All are read only
    when a scrape comes.
    """

    def __init__(self, running: Callable[[], list[dict]] = list,
                 downloads: Callable[[], dict] = lambda: {"bytes": 0, "active": 0},
                 admissions: Callable[[], dict[str, tuple[int, int]]] = dict):
        self._running = running
        self._downloads = downloads
        self._admissions = admissions
        self.requests = Counter("localrt_http_requests_total",
                                "HTTP requests answered, by route pattern, method and status",
                                ("route", "method", "status"))
        self.durations = Histogram("localrt_http_request_duration_seconds",
                                   "Seconds from a request's arrival to the end of its "
                                   "reply's body", ("route", "method"), DURATION_BUCKETS)
        self.prompt_tokens = Counter("localrt_prompt_tokens_total",
                                     "Prompt tokens of chat completions, by model", ("model",))
        self.generation_tokens = Counter("localrt_generation_tokens_total",
                                         "Tokens generated by chat completions, by model",
                                         ("model",))
        self.ttft = Histogram("localrt_time_to_first_token_seconds",
                              "Seconds from a chat request's arrival to its first token, "
                              "waiting for the model included", ("model",), TTFT_BUCKETS)
        self.decode_rate = Histogram("localrt_decode_tokens_per_second",
                                     "Tokens per second of each completion after its first "
                                     "token", ("model",), RATE_BUCKETS)
        self.connections_refused = Counter(
            "localrt_connections_refused_total",
            "Connections closed as soon as they were accepted, their client address "
            "holding maxConnectionsPerClient already")
        self._families = (self.requests, self.durations, self.prompt_tokens,
                          self.generation_tokens, self.ttft, self.decode_rate,
                          self.connections_refused)
        self.connections_refused.inc((), 0)  # a scrape shows 0 before the first

    def observe_request(self, method: str, route: str | None, status: int,
                        seconds: float) -> None:
        """Count one answered request; `route` is its pattern, None when no route matched."""
        method = method if method in METHODS else "other"
        route = route or UNMATCHED
        self.requests.inc((route, method, str(status)))
        self.durations.observe((route, method), seconds)

    def observe_completion(self, model: str, prompt_tokens: int, completion_tokens: int,
                           ttft: float | None, decode_seconds: float | None) -> None:
        """Count one finished completion: its tokens, the seconds to its first token
        (None when there was none), and the seconds its later tokens took."""
        self.prompt_tokens.inc((model,), prompt_tokens)
        self.generation_tokens.inc((model,), completion_tokens)
        if ttft is not None:
            self.ttft.observe((model,), ttft)
        if decode_seconds and completion_tokens > 1:
            self.decode_rate.observe((model,), (completion_tokens - 1) / decode_seconds)

    def render(self) -> str:
        """The exposition text: each family's HELP, TYPE and samples."""
        lines = []
        for family in self._families + self._read():
            lines.append(f"# HELP {family.name} {_escape_help(family.help)}")
            lines.append(f"# TYPE {family.name} {family.kind}")
            for name, labels, value in family.samples():
                lines.append(f"{name}{_labels(labels)} {_number(value)}")
        return "\n".join(lines) + "\n"

    def _read(self) -> tuple:
        """The families read now: each source once."""
        rows, downloads, admissions = self._running(), self._downloads(), self._admissions()
        # A model generates for as many requests as it has slots; the rest wait.
        sequences = [(row["id"], row.get("requests", 0), row.get("slots") or 1)
                     for row in rows]
        return (
            Gauge("localrt_models_running", "Models loaded", [({}, len(rows))]),
            Gauge("localrt_model_memory_bytes",
                  "Bytes a running model holds on each device, as its engine accounts them "
                  "(device: cpu, or a GPU's name as GET /v1/hardware gives it)",
                  [({"model": m, "device": d}, n) for m, d, n in _memory(rows)]),
            Gauge("localrt_sequences_active", "Requests a running model is generating for",
                  [({"model": m}, min(n, slots)) for m, n, slots in sequences]),
            Gauge("localrt_sequences_queued", "Requests waiting for a running model",
                  [({"model": m}, max(n - slots, 0)) for m, n, slots in sequences]),
            Gauge("localrt_requests_in_progress",
                  "Requests of each kind holding a place: generating, streaming or "
                  "waiting for their model's turn",
                  [({"kind": k}, held) for k, (held, _) in sorted(admissions.items())]),
            Gauge("localrt_requests_queued",
                  "Requests of each kind waiting for a place, their kind at its limit "
                  "(maxQueuedRequests bounds them all together)",
                  [({"kind": k}, waiting) for k, (_, waiting) in sorted(admissions.items())]),
            ReadCounter("localrt_draft_tokens_total",
                        "Speculative decoding's draft tokens proposed, by model (since it "
                        "started)", [({"model": row["id"]}, row["speculative"]["drafted"])
                                     for row in rows if "speculative" in row]),
            ReadCounter("localrt_draft_tokens_accepted_total",
                        "Draft tokens the replies kept, by model (since it started)",
                        [({"model": row["id"]}, row["speculative"]["accepted"])
                         for row in rows if "speculative" in row]),
            ReadCounter("localrt_download_bytes_total",
                        "Bytes received by download tasks since the server started",
                        [({}, downloads["bytes"])]),
            Gauge("localrt_download_tasks_active", "Download tasks pending or downloading",
                  [({}, downloads["active"])]),
            Gauge("process_resident_memory_bytes", "Resident memory of the server process",
                  [({}, v) for v in _rss()]),
            Gauge("process_open_fds", "Open file descriptors of the server process",
                  [({}, v) for v in _open_fds()]),
        )


class Clock:
    """One completion's times: its request's arrival, its first text piece, the end of
    its pieces. `end(usage)` counts it in `metrics` (None: nowhere), once."""

    def __init__(self, metrics: Metrics | None, model: str):
        self.arrived = time.monotonic()
        self.first: float | None = None
        self.ended: float | None = None
        self._metrics, self._model = metrics, model

    def pieces(self, pieces: Iterable[str]) -> Iterator[str]:
        """`pieces`, noting when the first comes and when they end."""
        try:
            for piece in pieces:
                self.piece()
                yield piece
        finally:
            self.done()

    def piece(self) -> None:
        """A piece of the reply came now (the first one is the time to first token)."""
        if self.first is None:
            self.first = time.monotonic()

    def done(self) -> None:
        """The reply's pieces ended now."""
        self.ended = time.monotonic()

    def end(self, usage: dict) -> None:
        """Count the completion with its usage; a stream cut short ends here."""
        metrics, self._metrics = self._metrics, None
        if metrics is None:
            return
        first, ended = self.first, self.ended or time.monotonic()
        metrics.observe_completion(self._model, usage["prompt_tokens"],
                                   usage["completion_tokens"],
                                   None if first is None else first - self.arrived,
                                   None if first is None else ended - first)


def _memory(rows: list[dict]) -> Iterator[tuple[str, str, int]]:
    """(model, device, bytes) of each running model: its RAM as the device cpu, and each
    device its offload names (a GPU build's), from the scheduler's status rows."""
    for row in rows:
        if "ram" not in row:
            continue  # a remote model's row: nothing loaded here
        yield row["id"], "cpu", row["ram"]
        for device in (row.get("offload") or {}).get("devices", ()):
            yield row["id"], device["name"], device["bytes"]


def _rss() -> list[int]:
    """This process's resident bytes, or nothing where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return [int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")]
    except (OSError, ValueError, IndexError):
        return []


def _open_fds() -> list[int]:
    """This process's open file descriptors, or nothing where /proc is missing."""
    try:
        return [len(os.listdir("/proc/self/fd"))]
    except OSError:
        return []


def _number(value: float) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        if value.is_integer() and abs(value) < 2 ** 53:
            return str(int(value))
        return repr(value)
    return str(value)


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape_value(str(v))}"' for k, v in labels.items()) + "}"


def _escape_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")
