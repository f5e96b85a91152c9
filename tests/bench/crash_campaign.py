"""Crash campaign: kill -9 at random points of random operations, restart, check.

Run it from the repository root (not collected by pytest; tests/test_crash_campaign.py
runs a short one in CI):

    .venv/bin/python tests/bench/crash_campaign.py --points 1000 [--seed 1] [--keep DIR]

Each point draws an operation (from shuffled decks of all ten, so that every ten
points cover them all): pull (one stream, or pieces for a file of 64 MiB and
more), resume (a pull cancelled part-way, started again), cancel, import (a copy),
delete, config PATCH (a stream of them), engine install (onnx-runtime from the
loopback package index), model start, remote add and model settings (a stream of
PATCH /v1/models/{id}, which rewrite model.json). It brings the server to the state
the operation needs, starts it, sleeps a delay drawn from [0, 1.2 x its duration]
(measured once per operation, unkilled, the first time it is drawn), and sends
SIGKILL to the server's whole process group. Then it starts the server again on the
same home and checks every invariant:

- the server starts;
- every file localrt writes parses: the settings file (YAML), every *.json under the
  data folder (model.json, engines.json, part maps); leftover temp files of an
  atomic write are counted, not parsed;
- no half-written model is listed: every listed model's files have the size and
  sha256 its definition records, and a pulled or imported one the source's sha256;
- the settings are intact: the settings file and GET /v1/configs hold the values
  before the point, or those of one PATCH sent during it, never a mix;
- a model's settings likewise (model.json), and every model the point did not touch
  keeps its definition;
- onnx-runtime is Ready with every file of its wheels, or Not Installed;
- a killed pull, resume or cancel resumes and verifies: the pull started again ends
  in Success and the file's sha256 is the hub's, with no part file left.

Everything is on loopback: the hub emulator (tests/emulators/hubemu.py) and the package index
(tests/emulators/pkgindex.py) run in this process, the remote model's upstream is a port that
nothing listens on (an add only registers). It prints one line a point and, at the
end, the points per operation (and how many the kill hit before the operation had
ended), the corrupt states (target 0), each with what was wrong, and the time.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
for p in (str(REPO), str(TESTS)):
    if p not in sys.path:
        sys.path.insert(0, p)

import yaml  # noqa: E402
from support.servers import free_port, send  # noqa: E402

OPERATIONS = ("pull", "resume", "cancel", "import", "delete", "config", "engine", "start",
              "remote", "model settings")
SMALL = ("org/small", "small.gguf")  # one stream
BIG = ("org/big", "big.gguf")        # pieces: localrt.downloads.pieces.PIECES_FROM and more
PULL_SECONDS = 1.5   # what a throttled pull lasts, about
ENGINE = "onnx-runtime"
TINY = "tiny"        # the imported model that starts and whose settings change
VICTIM = "victim"    # the imported model a delete removes
COPIED = "copied"    # the id an import gives its copy
WINDOW = 1.2         # a kill lands in [0, WINDOW x the operation's measured duration]
PATIENCE = 120.0     # seconds any wait of the campaign may take on a busy machine
# What a model's record says about the running server, not its definition.
RUNTIME_FIELDS = ("status", "upstreams_healthy", "upstreams_total")


class Corrupt(Exception):
    """A broken invariant: a corrupt state."""


def sha256(path) -> str:
    """The sha256 of a file, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def quietly(url, method, path, body=None, timeout=60.0):
    """support.servers.send(), for a request whose server may be killed before it
    answers: None then."""
    try:
        return send(url, method, path, body, timeout)
    except (OSError, http.client.HTTPException, ValueError):
        return None


@dataclass
class Server:
    """`localrt start --foreground` in its own process group."""

    process: subprocess.Popen
    url: str

    def kill(self) -> None:
        """SIGKILL the whole process group (a probe or engine child too), and reap it."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a while."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Point:
    """One kill point: what ran, when the kill came, and what was found after."""

    n: int
    op: str
    delay: float = 0.0
    ended: bool | None = None  # the operation had ended before the kill (None: unknown)
    note: str = ""
    problems: list[str] = field(default_factory=list)


class Campaign:
    """The servers, emulators and files of one campaign, and its kill points."""

    def __init__(self, root: Path, seed: int, out, wheels: Path | None = None):
        from emulators.ggufgen import write_gguf
        from emulators.hubemu import HubEmulator
        from emulators.pkgindex import PackageIndex
        from support import WHEELS

        from localrt import settings as settings_mod

        self.root = root
        self.rng = random.Random(seed)
        self.out = out
        self.home = root / "home"
        self.home.mkdir(parents=True)
        self.log = open(root / "servers.log", "ab")
        files = root / "files"
        files.mkdir()
        benchlib_dir = str(Path(__file__).resolve().parent)
        if benchlib_dir not in sys.path:
            sys.path.insert(0, benchlib_dir)
        from benchlib import make_weights

        self.sources = {
            SMALL: write_gguf(files / "small.gguf", name="small", n_embd=512, n_layer=2),
            BIG: make_weights(files / "big.gguf", 66 << 20, "big"),
        }
        self.tiny = write_gguf(files / "tiny.gguf", name="tiny", n_embd=256, n_layer=2)
        self.copy_source = write_gguf(files / "copy.gguf", name="copy", n_embd=512, n_layer=3)
        self.sha = {p: sha256(p) for p in [*self.sources.values(), self.tiny, self.copy_source]}
        self.hub = HubEmulator()
        for (repo, name), path in self.sources.items():
            self.hub.add_repo(repo, {name: path})
        index_dir = root / "index"
        index_dir.mkdir()
        wheels = wheels or WHEELS
        self.wheels = list(Path(wheels).glob("onnxruntime_genai-*.whl"))
        if not self.wheels:
            raise SystemExit(f"{wheels} has no onnxruntime-genai wheel; run: python3 -m "
                             f"localrt.bootstrap --test")
        for wheel in Path(wheels).glob("*.whl"):
            (index_dir / wheel.name).symlink_to(wheel.resolve())
        self.index = PackageIndex(index_dir).start()
        self.settings = settings_mod.load(environ={"HOME": str(self.home)})
        self.settings.update({"modelHubUrl": self.hub.url, "engineIndexUrl": self.index.url})
        self.dead_port = free_port()
        self.durations: dict[str, float] = {}
        self.config_state = self._config_file_state()
        self.tokens = itertools.count(1)
        self.definitions: dict[str, dict] = {}  # id -> GET /v1/models/{id}, as last seen
        self.points: list[Point] = []
        self.srv: Server | None = None
        self.restarts = 0
        self._hashes: dict[tuple, str] = {}

    # --- servers ------------------------------------------------------------------

    def start_server(self) -> Server:
        """Start the server on the campaign's home; raise Corrupt if it does not answer."""
        from localrt import server

        env = dict(os.environ, HOME=str(self.home))
        env.pop("LOCALRT_CONFIG", None)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.Popen([sys.executable, "-m", "localrt", "start", "--foreground",
                                 "--port", "0"], env=env, stdout=self.log, stderr=self.log,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            address = server.wait_started(self.settings, proc, timeout=PATIENCE)
        except (RuntimeError, OSError) as exc:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise Corrupt(f"the server did not start: {exc}") from None
        self.restarts += 1
        return Server(proc, address.url)

    def close(self) -> None:
        """Stop the server and the emulators."""
        if self.srv:
            self.srv.stop()
        self.hub.stop()
        self.index.stop()
        self.log.close()

    # --- the campaign ---------------------------------------------------------------

    def run(self, points: int, minutes: float | None = None) -> None:
        """Run `points` kill points, printing a line each; none starts after `minutes`."""
        deadline = time.monotonic() + 60 * minutes if minutes else None
        self.srv = self.start_server()
        self.check(Point(0, "first start"))
        deck: list[str] = []
        for n in range(1, points + 1):
            if deadline and time.monotonic() > deadline:
                self.say(f"the {minutes} minutes are up: {n - 1} points of {points}")
                break
            if not deck:  # shuffled decks: every ten points cover the ten operations
                deck = self.rng.sample(OPERATIONS, len(OPERATIONS))
            op = deck.pop()
            point = Point(n, op)
            began = time.monotonic()
            try:
                if op not in self.durations:
                    self.durations[op] = self.calibrate(op)
                    self.say(f"  {op}: an unkilled run takes {self.durations[op]:.2f} s")
                self.kill_point(point)
            except Corrupt as exc:
                point.problems.append(str(exc))
            except Exception as exc:  # the campaign's own failure: say so, go on
                point.problems.append(f"campaign error: {exc!r}")
            self.points.append(point)
            where = {True: "after the end", False: "inside", None: "?"}[point.ended]
            corrupt = "  CORRUPT: " + "; ".join(point.problems) if point.problems else ""
            self.say(f"#{n:<5} {time.monotonic() - began:5.1f} s {op:<15} kill at "
                     f"{point.delay:5.2f} s {where:<14} {point.note}{corrupt}")
            if self.srv is None or self.srv.process.poll() is not None:
                try:
                    self.srv = self.start_server()
                except Corrupt as exc:
                    self.say(f"cannot go on: {exc}")
                    break

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def kill_point(self, point: Point) -> None:
        """Set up, start, kill, restart and check one point."""
        op = point.op
        act = getattr(self, "op_" + op.replace(" ", "_"))
        setup = act(self.srv.url)  # brings the state, returns the starter and its check
        point.delay = self.rng.uniform(0.0, WINDOW * self.durations[op])
        started = time.monotonic()
        done = threading.Event()
        context = {}

        def starter():
            try:
                setup.start(context)
            finally:
                done.set()

        thread = threading.Thread(target=starter, daemon=True)
        thread.start()
        time.sleep(max(0.0, started + point.delay - time.monotonic()))
        # A stream of PATCHes never ends by itself: its kill is always inside it.
        point.ended = False if setup.stop else \
            setup.ended(context) if setup.ended else done.is_set()
        self.srv.kill()
        thread.join(timeout=PATIENCE)
        self.hub.max_bytes_per_second = None
        self.index.throttle = 0.0
        self.srv = None
        self.srv = self.start_server()
        self.check(point, setup.changes(context) if setup.changes else None)
        if setup.after:
            setup.after(point, context)

    # --- the invariants ---------------------------------------------------------------

    def check(self, point: Point, changes: dict | None = None) -> None:
        """Every invariant on the server just started; raise Corrupt for the first broken.

        `changes`: what the point may have changed, {"config": set of states} and
        {model id: set of (seed, top_k)}; everything else must be as it was."""
        changes = changes or {}
        url = self.srv.url
        self.check_files(point)
        # The settings: as before the point, or one PATCH of it, in the file and the API.
        state = self._config_file_state()
        allowed = {self.config_state} | changes.get("config", set())
        if state not in allowed:
            raise Corrupt(f"the settings file holds {state}, neither the state before "
                          f"{self.config_state} nor one PATCH's")
        status, config = send(url, "GET", "/v1/configs")
        if status != 200 or (config["proxy_username"], config["no_proxy"]) != state:
            raise Corrupt(f"GET /v1/configs says {config}, the file {state}")
        self.config_state = state
        # The models: whole, as recorded, and as the sources.
        status, listed = send(url, "GET", "/v1/models")
        if status != 200:
            raise Corrupt(f"GET /v1/models answered {status}: {listed}")
        models = {m["id"]: m for m in listed["data"]}
        for model in models.values():
            for f in model["files"]:
                path = os.path.join(model["path"], f["path"])
                try:
                    size = os.path.getsize(path)
                except OSError:
                    raise Corrupt(f"model {model['id']} is listed without {path}") from None
                if size != f["size"]:
                    raise Corrupt(f"model {model['id']}: {path} has {size} bytes, "
                                  f"not {f['size']}")
                if f.get("sha256") and self.sha256(path) != f["sha256"]:
                    raise Corrupt(f"model {model['id']}: {path} is not its recorded sha256")
            want = self._source_sha(model["id"])
            if want and model["files"] and \
                    self.sha256(os.path.join(model["path"], model["files"][0]["path"])) != want:
                raise Corrupt(f"model {model['id']} is listed, its file not the source's")
        for model_id, definition in list(self.definitions.items()):
            now = send(url, "GET", f"/v1/models/{quote(model_id, safe='')}")
            if now[0] == 404:
                if model_id not in changes:
                    raise Corrupt(f"model {model_id} is gone, and the point did not touch it")
                del self.definitions[model_id]
                continue
            if model_id in changes:
                allowed = changes[model_id]
                got = (now[1].get("seed"), now[1].get("top_k"))
                before = (definition.get("seed"), definition.get("top_k"))
                if allowed is not None and got not in allowed | {before}:
                    raise Corrupt(f"model {model_id} holds (seed, top_k) {got}, neither "
                                  f"as before nor one PATCH's")
            elif _stored(now[1]) != _stored(definition):
                changed = sorted(k for k in {**now[1], **definition}
                                 if now[1].get(k) != definition.get(k))
                raise Corrupt(f"model {model_id}'s definition changed: {changed}")
            self.definitions[model_id] = now[1]
        for model_id in models:
            if model_id not in self.definitions:
                self.definitions[model_id] = send(url, "GET",
                                                  f"/v1/models/{quote(model_id, safe='')}")[1]
        # The engine: whole or absent.
        self.engine_status(url)
        # Nothing running after a start.
        status, running = send(url, "GET", "/v1/models/status")
        running = [m for m in running["data"] if m.get("engine") != "remote"]  # never loaded
        if running:
            raise Corrupt(f"models running right after a start: {running}")

    def check_files(self, point: Point) -> None:
        """Every file localrt wrote parses; temp files of atomic writes are counted."""
        try:
            data = yaml.safe_load(self.settings.path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise Corrupt(f"the settings file does not parse: {exc}") from None
        if not isinstance(data, dict) or data.get("modelHubUrl") != self.hub.url:
            raise Corrupt(f"the settings file lost its values: {data!r:.300}")
        temps = 0
        for dirpath, _, filenames in os.walk(self.settings.data_dir):
            for name in filenames:
                path = Path(dirpath) / name
                if name.startswith(".") and name.endswith(".tmp"):
                    temps += 1
                elif name.endswith(".json") or name.endswith(".map"):
                    try:
                        json.loads(path.read_bytes())
                    except (OSError, ValueError) as exc:
                        raise Corrupt(f"{path} does not parse: {exc}") from None
                elif name.endswith(".yml") or name.endswith(".yaml"):
                    try:
                        yaml.safe_load(path.read_text())
                    except (OSError, yaml.YAMLError) as exc:
                        raise Corrupt(f"{path} does not parse: {exc}") from None
        if temps:
            point.note += f" ({temps} temp files left)"

    def engine_status(self, url) -> str:
        """onnx-runtime's status; Corrupt unless Ready with every wheel file, or absent."""
        status, engines = send(url, "GET", "/v1/engines")
        onnx = {e["name"]: e for e in engines["data"]}[ENGINE]
        if onnx["status"] not in ("Ready", "Not Installed"):
            raise Corrupt(f"{ENGINE} is {onnx['status']} after a restart")
        if onnx["status"] == "Ready":
            _, variants = send(url, "GET", f"/v1/engines/{ENGINE}")
            [ready] = [v for v in variants if v["status"] == "Ready"]
            folder = self.settings.data_dir / "engines" / ENGINE / ready["name"] / \
                ready["version"].lstrip("v")
            for wheel in self.wheels:
                with zipfile.ZipFile(wheel) as zf:
                    for info in zf.infolist():
                        if info.is_dir() or ".data/" in info.filename:
                            continue
                        path = folder / info.filename
                        if not path.exists() or path.stat().st_size != info.file_size:
                            raise Corrupt(f"{ENGINE} is Ready without the whole {path}")
        return onnx["status"]

    def sha256(self, path) -> str:
        """sha256(path), remembered while the file's inode, size and mtime stay the same
        (a write of any kind changes the mtime), so each point does not hash every model."""
        st = os.stat(path)
        key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in self._hashes:
            self._hashes[key] = sha256(path)
        return self._hashes[key]

    def _config_file_state(self) -> tuple:
        data = yaml.safe_load(self.settings.path.read_text())
        return data.get("proxyUsername", ""), data.get("noProxy", "")

    def _source_sha(self, model_id: str) -> str | None:
        for (repo, name), path in self.sources.items():
            if model_id == f"{repo.replace('/', ':')}:{name}":
                return self.sha[path]
        return {TINY: self.sha[self.tiny], VICTIM: self.sha[self.copy_source],
                COPIED: self.sha[self.copy_source]}.get(model_id)

    # --- what the operations need ---------------------------------------------------------

    def absent(self, url, model_id) -> None:
        """Delete `model_id` if it is listed."""
        status, _ = send(url, "GET", f"/v1/models/{quote(model_id, safe='')}")
        if status == 200:
            status, body = send(url, "DELETE", f"/v1/models/{quote(model_id, safe='')}")
            if status != 200:
                raise RuntimeError(f"cannot delete {model_id}: {body}")
            self.definitions.pop(model_id, None)

    def imported(self, url, model_id, path, option="symlink") -> None:
        """Import `path` as `model_id` unless it is listed."""
        status, _ = send(url, "GET", f"/v1/models/{quote(model_id, safe='')}")
        if status != 200:
            status, body = send(url, "POST", "/v1/models/import",
                                {"path": str(path), "id": model_id, "option": option})
            if status != 200:
                raise RuntimeError(f"cannot import {model_id}: {body}")
            self.definitions[model_id] = send(url, "GET",
                                              f"/v1/models/{quote(model_id, safe='')}")[1]

    def throttle(self, repo) -> None:
        """Cap the hub so that a pull of `repo` lasts about PULL_SECONDS."""
        size = self.sources[repo].stat().st_size
        connections = 8 if repo == BIG else 1  # downloadConnections' default, in pieces
        self.hub.max_bytes_per_second = size / PULL_SECONDS / connections

    def pull_task(self, url, task_id) -> dict | None:
        _, tasks = send(url, "GET", "/v1/models/pull")
        return {t["id"]: t for t in tasks["data"]}.get(task_id)

    def wait_task(self, url, task_id, until=lambda t: t["status"] not in
                  ("Pending", "Downloading")) -> dict:
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:
            task = self.pull_task(url, task_id)
            if task and until(task):
                return task
            time.sleep(0.02)
        raise RuntimeError(f"task {task_id} did not get there in {PATIENCE} s")

    def pull_done(self, url, repo) -> None:
        """Pull `repo` unthrottled to its end: a resumed download must complete and verify."""
        model_id = f"{repo[0].replace('/', ':')}:{repo[1]}"
        status, body = send(url, "POST", f"/v1/models/{repo[0]}/pull")
        if "task" in body:
            task = self.wait_task(url, body["task"]["id"])
            if task["status"] != "Success":
                raise Corrupt(f"the pull started again ended {task['status']}: "
                              f"{task.get('error')}")
        elif status not in (200, 409):
            raise Corrupt(f"the pull started again answered {status}: {body}")
        status, model = send(url, "GET", f"/v1/models/{quote(model_id, safe='')}")
        if status != 200:
            raise Corrupt(f"{model_id} is not listed after its pull: {model}")
        path = Path(model["path"]) / model["files"][0]["path"]
        if self.sha256(path) != self.sha[self.sources[repo]]:
            raise Corrupt(f"{path} is not the hub's file after the pull")
        leftovers = [p.name for p in path.parent.iterdir() if ".part" in p.name]
        if leftovers:
            raise Corrupt(f"part files left after a complete pull: {leftovers}")
        self.definitions[model_id] = model

    # --- the operations: each sets up and returns its Act -------------------------------

    def calibrate(self, op) -> float:
        """Run `op` once, unkilled, on the running server; the seconds it took to end."""
        act = getattr(self, "op_" + op.replace(" ", "_"))(self.srv.url)
        context = {}
        started = time.monotonic()
        thread = threading.Thread(target=act.start, args=(context,), daemon=True)
        thread.start()
        ended = act.ended or (lambda ctx: not thread.is_alive())
        deadline = started + PATIENCE
        while not ended(context):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{op} did not end in {PATIENCE} s")
            time.sleep(0.01)
        took = time.monotonic() - started
        if act.stop:
            act.stop(context)
        thread.join(timeout=PATIENCE)
        self.hub.max_bytes_per_second = None
        self.index.throttle = 0.0
        if act.after:
            act.after(Point(0, op), context)
        # What the unkilled run changed is the state before the next point.
        self.config_state = self._config_file_state()
        for model_id in list(self.definitions):
            status, now = send(self.srv.url, "GET", f"/v1/models/{quote(model_id, safe='')}")
            if status == 200:
                self.definitions[model_id] = now
            else:
                del self.definitions[model_id]
        return took

    def op_pull(self, url) -> "Act":
        repo, model_id = self._fresh_pull(url)

        def start(ctx):
            ctx["reply"] = quietly(url, "POST", f"/v1/models/{repo[0]}/pull")

        return Act(start, ended=self._pull_ended(url, model_id),
                   changes=lambda ctx: {model_id: None},
                   after=lambda point, ctx: self._after_pull(point, repo))

    def _fresh_pull(self, url) -> tuple:
        """A repo to pull (the small one twice as often), not downloaded yet, its
        transfer throttled: (repo, the model id its pull registers)."""
        repo = self.rng.choice((SMALL, SMALL, BIG))
        model_id = f"{repo[0].replace('/', ':')}:{repo[1]}"
        self.absent(url, model_id)
        self.throttle(repo)
        return repo, model_id

    def _pull_part_way(self, url, repo, low: float) -> str:
        """Start pulling `repo` and wait until a random share of it (`low` to 0.8) is
        downloaded, or the task ended: its task id."""
        status, body = send(url, "POST", f"/v1/models/{repo[0]}/pull")
        task_id = body["task"]["id"]
        size = self.sources[repo].stat().st_size
        at = self.rng.uniform(low, 0.8) * size
        self.wait_task(url, task_id, lambda t: t["status"] != "Downloading" or
                       sum(i["downloadedBytes"] for i in t["items"]) >= at)
        return task_id

    def _pull_ended(self, url, model_id):
        def ended(ctx):
            status = quietly(url, "GET", f"/v1/models/{quote(model_id, safe='')}", timeout=5)
            return bool(status and status[0] == 200)
        return ended

    def _after_pull(self, point, repo) -> None:
        parts = [p for p in self.settings.data_dir.rglob("*.part")]
        point.note += f"part {'kept' if parts else 'none'};"
        self.pull_done(self.srv.url, repo)

    def op_resume(self, url) -> "Act":
        repo, model_id = self._fresh_pull(url)
        task_id = self._pull_part_way(url, repo, 0.1)
        send(url, "DELETE", "/v1/models/pull", {"taskId": task_id})
        self.wait_task(url, task_id)

        def start(ctx):
            ctx["reply"] = quietly(url, "POST", f"/v1/models/{repo[0]}/pull")

        return Act(start, ended=self._pull_ended(url, model_id),
                   changes=lambda ctx: {model_id: None},
                   after=lambda point, ctx: self._after_pull(point, repo))

    def op_cancel(self, url) -> "Act":
        repo, model_id = self._fresh_pull(url)
        task_id = self._pull_part_way(url, repo, 0.05)

        def start(ctx):
            ctx["reply"] = quietly(url, "DELETE", "/v1/models/pull", {"taskId": task_id})

        def ended(ctx):
            task = quietly(url, "GET", "/v1/models/pull", timeout=5)
            if not task:
                return False
            task = {t["id"]: t for t in task[1]["data"]}.get(task_id)
            return bool(task and task["status"] not in ("Pending", "Downloading"))

        return Act(start, ended=ended, changes=lambda ctx: {model_id: None},
                   after=lambda point, ctx: self._after_pull(point, repo))

    def op_import(self, url) -> "Act":
        self.absent(url, COPIED)

        def start(ctx):
            ctx["reply"] = quietly(url, "POST", "/v1/models/import",
                                   {"path": str(self.copy_source), "id": COPIED,
                                    "option": "copy"})

        return Act(start, changes=lambda ctx: {COPIED: None})

    def op_delete(self, url) -> "Act":
        self.imported(url, VICTIM, self.copy_source, option="copy")

        def start(ctx):
            ctx["reply"] = quietly(url, "DELETE", f"/v1/models/{VICTIM}")

        def after(point, ctx):
            # The model is whole (checked) or gone; a delete started again completes.
            status, body = send(self.srv.url, "DELETE", f"/v1/models/{VICTIM}")
            if status not in (200, 404):
                raise Corrupt(f"the delete started again answered {status}: {body}")
            self.definitions.pop(VICTIM, None)
            folder = self.settings.data_dir / "models"
            left = [p for p in folder.rglob("*") if VICTIM in p.name]
            point.note += f" {len(left)} stray files;" if left else ""

        return Act(start, changes=lambda ctx: {VICTIM: None}, after=after)

    def op_config(self, url) -> "Act":
        return self._patch_stream(url, "config")

    def op_model_settings(self, url) -> "Act":
        self.imported(url, TINY, self.tiny)
        return self._patch_stream(url, TINY)

    def _patch_stream(self, url, what) -> "Act":
        """Two clients PATCHing, each PATCH with a token no other uses; the Act ends
        (for a calibration) after 20 PATCHes."""
        sent: set = set()
        stop = threading.Event()
        count = [0]

        def patch_forever():
            while not stop.is_set():
                n = next(self.tokens)
                if what == "config":
                    body, path = {"proxy_username": f"user{n}", "no_proxy": f"host{n}"}, \
                        "/v1/configs"
                    sent.add((f"user{n}", f"host{n}"))
                else:
                    body, path = {"seed": n, "top_k": n}, f"/v1/models/{what}"
                    sent.add((n, n))
                if quietly(url, "PATCH", path, body, timeout=10) is None:
                    return
                count[0] += 1

        def start(ctx):
            workers = [threading.Thread(target=patch_forever, daemon=True) for _ in range(2)]
            ctx["workers"] = workers
            for w in workers:
                w.start()
            for w in workers:
                w.join()

        def stop_workers(ctx):
            stop.set()
            for w in ctx.get("workers", ()):
                w.join(timeout=PATIENCE)

        def changes(ctx):
            stop_workers(ctx)
            return {what: set(sent)}

        return Act(start, ended=lambda ctx: count[0] >= 20, changes=changes,
                   stop=stop_workers)

    def op_engine(self, url) -> "Act":
        if self.engine_status(url) == "Ready":
            status, body = send(url, "DELETE", f"/v1/engines/{ENGINE}/install", {})
            if status != 200:
                raise RuntimeError(f"cannot uninstall {ENGINE}: {body}")
        self.index.throttle = 0.002  # 64 KiB chunks: about a second for the wheels

        def start(ctx):
            ctx["reply"] = quietly(url, "POST", f"/v1/engines/{ENGINE}/install", {})

        def ended(ctx):
            engines = quietly(url, "GET", "/v1/engines", timeout=5)
            return bool(engines) and {e["name"]: e for e in engines[1]["data"]}[ENGINE][
                "status"] == "Ready"

        return Act(start, ended=ended)

    def op_start(self, url) -> "Act":
        self.imported(url, TINY, self.tiny)

        def start(ctx):
            ctx["reply"] = quietly(url, "POST", f"/v1/models/{TINY}/start", {})

        def after(point, ctx):
            status, body = send(self.srv.url, "POST", "/v1/chat/completions", {
                "model": TINY, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            if status != 200:
                raise Corrupt(f"a chat with the model after the kill answered {status}: {body}")
            send(self.srv.url, "POST", f"/v1/models/{TINY}/stop", {})

        return Act(start, after=after)

    def op_remote(self, url) -> "Act":
        model_id = f"remote{self.rng.randrange(4)}"
        self.absent(url, model_id)

        def start(ctx):
            ctx["reply"] = quietly(url, "POST", "/v1/models/remote", {
                "id": model_id, "upstreams": [
                    {"url": f"http://127.0.0.1:{self.dead_port}/v1", "model": "m"}]})

        def after(point, ctx):
            status, model = send(self.srv.url, "GET", f"/v1/models/{model_id}")
            if status == 200 and [u["url"] for u in model.get("upstreams", ())] != \
                    [f"http://127.0.0.1:{self.dead_port}/v1"]:
                raise Corrupt(f"remote model {model_id} lost its upstream: {model}")

        return Act(start, changes=lambda ctx: {model_id: None}, after=after)

    # --- the figures ----------------------------------------------------------------------

    def summary(self, seconds: float) -> int:
        """Print the figures; the number of corrupt states."""
        corrupt = [p for p in self.points if p.problems]
        self.say("")
        self.say(f"{'operation':<15} {'points':>6} {'inside':>6} {'after':>6} {'corrupt':>7}"
                 f" {'run (s)':>8}")
        for op in OPERATIONS:
            mine = [p for p in self.points if p.op == op]
            self.say(f"{op:<15} {len(mine):>6} {sum(p.ended is False for p in mine):>6} "
                     f"{sum(bool(p.ended) for p in mine):>6} "
                     f"{sum(bool(p.problems) for p in mine):>7} "
                     f"{self.durations.get(op, 0):>8.2f}")
        self.say(f"{'all':<15} {len(self.points):>6} "
                 f"{sum(p.ended is False for p in self.points):>6} "
                 f"{sum(bool(p.ended) for p in self.points):>6} {len(corrupt):>7}")
        self.say(f"corrupt states: {len(corrupt)}; server starts: {self.restarts}; "
                 f"{seconds:.0f} s, {seconds / max(1, len(self.points)):.2f} s a point")
        for p in corrupt:
            self.say(f"  #{p.n} {p.op} (kill at {p.delay:.2f} s): {'; '.join(p.problems)}")
        return len(corrupt)


@dataclass
class Act:
    """An operation ready to start: `start(ctx)` runs it (in a thread, killed part-way);
    `ended(ctx)` says whether it has ended (default: start returned); `changes(ctx)` what
    it may have changed, for the check; `after(point, ctx)` checks more once restarted;
    `stop(ctx)` ends a calibration run of an operation that runs until stopped."""

    start: callable
    ended: callable = None
    changes: callable = None
    after: callable = None
    stop: callable = None


def _stored(record: dict) -> dict:
    """A model's record less what it says about the running server."""
    return {k: v for k, v in record.items() if k not in RUNTIME_FIELDS}


def run(points: int, seed: int, out=sys.stdout, root: Path | None = None,
        wheels: Path | None = None, minutes: float | None = None) -> int:
    """The campaign in `root` (a temporary folder if None); the number of corrupt states."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="localrt-crash-") as tmp:
        root = Path(root) if root else Path(tmp)
        campaign = Campaign(root, seed, out, wheels)
        print(f"crash campaign: {points} points, seed {seed}, in {root}", file=out, flush=True)
        try:
            campaign.run(points, minutes)
        finally:
            campaign.close()
        return campaign.summary(time.monotonic() - started)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it")
    parser.add_argument("--minutes", type=float,
                        help="start no point after this many minutes (the count says how many "
                        "ran)")
    args = parser.parse_args(argv)
    # A SIGTERM (timeout, kill) unwinds, so the last server is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    return 1 if run(args.points, args.seed, root=args.keep, minutes=args.minutes) else 0


if __name__ == "__main__":
    sys.exit(main())
