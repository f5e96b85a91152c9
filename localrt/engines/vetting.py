"""The first load of a model file happens in a child process (issue 38).

llama.cpp reads a GGUF's tensor table, vocabulary and data in native code, where a bad
file (a hub's, a colleague's, a download that broke half-way) can crash the process
that loads it. So before the server loads a file with an engine build for the first
time, a child (`python -m localrt.engines.vetting`, the same interpreter, the build's
folder first on sys.path as localrt.engines.catalog puts it in the server) loads it
through the same adapter with the same start options, then:

  * tokenizes a text that holds every byte value UTF-8 can carry, and what the model's
    own `exercise()` adds (a gguf-cpp model: the text of every special token, and the
    piece of every token; localrt.engines.llama.model);
  * renders its chat template for a short chat (a template the model refuses, or
    one localrt.engines.chattemplate bounds, is noted, and a plain prompt is used);
  * decodes a few tokens from that prompt (an embedding model embeds a text instead,
    and a reranker scores one against another);
  * with an audio projector, checks that it takes the test clips and encodes one
    (the model's own `exercise_audio()`: localrt.engines.llama.audiotokens), so that
    a projector llama.cpp's mtmd would abort on is refused here (issue 36, item 6).

Only a file a child loaded this way is ever loaded by the server (Ollama loads each
model in a runner of its own for the same reason). The child prints one JSON line per
stage on stdout, flushing each (`{"stage": "load" | "exercise" | "chat" | "audio" |
"done" | "error"}`), so the parent knows how far it got when a signal ends it; its
stderr is llama.cpp's log (warnings and errors), whose last lines are the engine's own
reason.

The parent's side is `Vetting`: it runs the child, bounded in time (`timeout_for`) and
in memory (RLIMIT_DATA: the memory this machine has free, which file-backed mappings
of the weights do not count against), and keeps each outcome in
`<dataFolderPath>/engines/vetted.json` by the files' sha256 and the build
(`<engine>/<variant>/<version>`), so a second start costs a dictionary lookup. A
pulled or copied file's sha256 is its record's; a linked import's is computed here
once and kept under `hashes` with the file's stat stamp, and computed again only when
the file changes. Outcomes that say nothing about the file are never kept: a child
killed by SIGKILL (the kernel's OOM killer, most likely) or past its time, and a clean
failure that is not llama.cpp refusing the file (a context that does not fit).

This module imports only the standard library, localrt.errors and localrt.fsutil at
the top, so the child starts fast.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import localrt
from localrt.errors import InvalidModelFile
from localrt.fsutil import read_json, write_json

log = logging.getLogger(__name__)

VETTED_FILE = "vetted.json"
TIMEOUT_BASE = 60.0            # seconds a child may take beyond reading the files
READ_RATE = 50 << 20           # bytes a second the slowest disk we allow for reads
DECODE_TOKENS = 4              # what the child decodes after the prompt
MIN_MEMORY = 1 << 30           # the child's memory bound is never below this
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello! Say a word, a | pipe and a number: 42."},
        {"role": "assistant", "content": "Word | 42"},
        {"role": "user", "content": "Again, please."}]
SHORT_PROMPT = "Hello | world 42"  # what the child decodes from when CHAT is refused
HASH_CHUNK = 8 << 20


def every_byte_text() -> str:
    """A text whose UTF-8 holds every byte value UTF-8 can carry (all but 0xC0, 0xC1
    and 0xF5-0xFF): each ASCII character, each continuation byte, each lead byte."""
    chars = [chr(i) for i in range(0x80)]
    chars += [chr(b) for b in range(0x80, 0xC0)]  # 0xC2 then each of 0x80-0xBF
    chars += [chr((b - 0xC0) << 6) for b in range(0xC2, 0xE0)]  # two-byte leads
    chars += [chr(max((b - 0xE0) << 12, 0x800)) for b in range(0xE0, 0xF0)]
    chars += [chr(max((b - 0xF0) << 18, 0x10000)) for b in range(0xF0, 0xF5)]
    return "".join(chars) + " plain words, a | pipe, digits 0123456789."


# --- the child ----------------------------------------------------------------------


def _emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _bound_memory(limit: int | None) -> None:
    """Cap this process's private writable memory (the heap, a KV cache, weights read
    without mmap) at `limit` bytes, so a file that asks llama.cpp for more than the
    machine has fails an allocation here instead of waking the OOM killer."""
    if not limit:
        return
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    except (ImportError, ValueError, OSError):
        pass  # a platform without it: the time bound still holds


def main(argv: list[str]) -> int:
    """Load, exercise and chat with the file the JSON request on stdin names:
    {"engine", "engine_dir", "model", "options", "memory"}."""
    request = json.loads(sys.stdin.read())
    _bound_memory(request.get("memory"))
    if request.get("engine_dir"):
        sys.path.insert(0, request["engine_dir"])
    from localrt.engines import contract
    from localrt.engines.catalog import CATALOG
    from localrt.errors import HTTPError

    adapter = CATALOG[request["engine"]].adapter()
    prepare = getattr(adapter, "in_child", None)
    if prepare is not None:  # the engine's log on our stderr, its asserts' too
        prepare(os.dup(2))
    _emit(stage="load")
    try:
        model = contract.generating(adapter.load(request["model"], dict(request["options"])))
    except HTTPError as exc:
        _emit(stage="error", where="load", message=exc.message, http=True)
        return 1
    except Exception as exc:  # llama.cpp refused the file, or its context did not fit
        _emit(stage="error", where="load", message=str(exc) or type(exc).__name__)
        return 1
    can = contract.capabilities(model)
    try:
        _emit(stage="exercise")
        if contract.Tokenizing in can:
            model.tokenize(every_byte_text())
        exercise = getattr(model, "exercise", None)
        if exercise is not None:
            exercise()
        _emit(stage="chat")
        note = _chat(model, can, contract, HTTPError)
        hear = getattr(model, "exercise_audio", None)
        if hear is not None:
            _emit(stage="audio")
            hear()
    except Exception as exc:
        _emit(stage="error", where="use", message=str(exc) or type(exc).__name__)
        return 1
    finally:
        try:
            model.unload()
        except Exception:
            pass
    _emit(stage="done", template=note)
    return 0


def _chat(model, can: frozenset, contract, refusal: type) -> str | None:
    """Decode a few tokens from CHAT through the model's template, or from a short
    prompt when the template or the context refuses it (an embedding model embeds a
    text instead, a reranker scores one: `can` holds its `contract` protocols); what
    refused, if anything. A refusal (`refusal`, an HTTPError) is the request's, never
    the file's."""
    params = {"max_tokens": DECODE_TOKENS, "temperature": 0.0, "seed": 0}
    try:
        _decode(model.generate(CHAT, params))
        return None
    except refusal as exc:
        if exc.code == "embedding_model":  # llama.cpp's embedding mode
            if contract.Reranking in can:
                model.rerank(SHORT_PROMPT, [SHORT_PROMPT], None)
                return None
            if contract.Embedding in can:
                model.embed([SHORT_PROMPT], None)
                return None
        note = exc.message
    try:
        _decode(model.generate([], {**params, "prompt": SHORT_PROMPT}))
    except refusal as exc:
        note += f"; and a plain prompt: {exc.message}"
    return note


def _decode(generation) -> None:
    try:
        for _ in generation:
            pass
    finally:
        generation.close()


# --- the parent ---------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What a child's load of a model's files with a build said.

    `ok`: the child loaded, exercised and decoded it. Else `reason` says why, in the
    engine's own words or as the crash; `about_file` is False when the failure says
    nothing about the file (never kept: a start is refused as a failed load, and the
    next one tries again). `template`: why the chat template refused the child's chat,
    when it did (the file still loaded)."""

    ok: bool
    reason: str = ""
    about_file: bool = True
    template: str | None = None
    seconds: float = 0.0


def timeout_for(size: int) -> float:
    """Seconds a child may take with files of `size` bytes: reading them at READ_RATE,
    and TIMEOUT_BASE more."""
    return TIMEOUT_BASE + size / READ_RATE


def free_memory() -> int | None:
    """The bytes this machine can give a child now (MemAvailable + SwapFree), never
    below MIN_MEMORY; None where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in
                    (line.split(":", 1) for line in f if ":" in line)}
    except (OSError, ValueError):
        return None
    if "MemAvailable" not in info:
        return None
    return max(info["MemAvailable"] + info.get("SwapFree", 0), MIN_MEMORY)


def run_child(engine: str, engine_dir: str | None, weights: str, options: dict,
              timeout: float) -> Outcome:
    """Run this module as a child on one model file; its Outcome."""
    env = dict(os.environ)
    # The child must import this localrt, wherever it is installed or checked out.
    root = str(Path(localrt.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env["GGML_NO_BACKTRACE"] = "1"  # ggml would run gdb on an abort: seconds, no use here
    request = {"engine": engine, "engine_dir": engine_dir, "model": weights,
               "options": options, "memory": free_memory()}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "localrt.engines.vetting"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(json.dumps(request).encode(), timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        proc.communicate()
        return Outcome(False, f"the engine did not finish loading it in {timeout:.0f} s",
                       about_file=False, seconds=round(time.monotonic() - started, 2))
    except BaseException:  # the server is stopping: the child goes with it
        _kill(proc)
        proc.wait()
        raise
    lines = []
    for line in out.decode("utf-8", "replace").splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            pass
    outcome = _outcome(proc.returncode, lines, err.decode("utf-8", "replace"))
    return Outcome(**{**asdict(outcome), "seconds": round(time.monotonic() - started, 2)})


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its session: anything it started too
    except OSError:
        pass


# Where in the child's check the engine was when it crashed, by the child's last stage.
STAGES = {"load": "reading the file", "exercise": "tokenizing with its vocabulary",
          "chat": "decoding its first tokens",
          "audio": "encoding a test clip with its audio projector"}
LOADER_ERROR = re.compile(r"error loading model:\s*(.+)")
ASSERT = re.compile(r"([\w.-]+:\d+: GGML_ASSERT\(.*\) failed)")


def _outcome(returncode: int, lines: list[dict], log_text: str) -> Outcome:
    """A child's Outcome from its exit status, its stage lines and its log."""
    last = lines[-1] if lines else {}
    if returncode == 0 and last.get("stage") == "done":
        return Outcome(True, template=last.get("template"))
    if returncode < 0:
        number = -returncode
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        where = STAGES.get(last.get("stage"), STAGES["load"])
        if number == signal.SIGKILL:  # the OOM killer's, or someone's: not the file
            return Outcome(False, f"the engine was killed (signal {number}) while loading "
                                  f"it ({name}, {where}), most likely for want of memory",
                           about_file=False)
        reason = f"the engine crashed (signal {number}) while loading it ({name}, {where})"
        said = _engine_said(log_text)
        return Outcome(False, f"{reason}: {said}" if said else reason)
    if last.get("stage") == "error":
        said = _loader_said(log_text)
        if last.get("where") == "load" and not said:
            # llama.cpp read the file, then something else failed (its context did not
            # fit, an rpc-server went away): that says nothing about the file.
            return Outcome(False, last.get("message") or "the engine failed to load it",
                           about_file=False)
        return Outcome(False, said or last.get("message") or "the engine failed on it")
    tail = (log_text.strip().splitlines() or ["no output"])[-1]
    return Outcome(False, f"the engine's check of it ended with exit status {returncode}: "
                          f"{tail[:300]}", about_file=False)


def _loader_said(log_text: str) -> str | None:
    """llama.cpp's own reason for refusing a file: its last "error loading model" line."""
    found = LOADER_ERROR.findall(log_text)
    return found[-1].strip()[:500] if found else None


def _engine_said(log_text: str) -> str | None:
    """What the engine said before it crashed: a failed assert, else its last error."""
    found = ASSERT.findall(log_text)
    if found:
        return found[-1][:500]
    return _loader_said(log_text)


class Vetting:
    """The outcome of each model file's first load in a child, by its files' sha256 and
    the engine build, kept in vetted.json (under `root`, the engines folder).

    `_lock` guards `_data` (vetted.json's content: "outcomes" and "hashes") and
    `_running` (key -> an event set when that key's child ends); it is never held while
    a child runs or a file is hashed. `_child_lock` lets one child run at a time, so
    two never compete for the memory a model needs. A second caller for a key being
    checked waits for the first one's outcome. `run` is `run_child`'s signature."""

    def __init__(self, root: Path, run: Callable[..., Outcome] | None = None):
        self._file = Path(root) / VETTED_FILE
        self._run = run or run_child
        self._lock = threading.Lock()
        self._child_lock = threading.Lock()
        data = read_json(self._file, {})
        self._data = {"outcomes": dict(data.get("outcomes") or {}),
                      "hashes": dict(data.get("hashes") or {})}
        self._running: dict[str, threading.Event] = {}
        self.children = 0  # the children this object ran, for the log and the tests

    def key(self, files: list[tuple[Path, str | None]], build: str) -> str:
        """The key of these files (path, sha256 or None) with build `build`
        (`<engine>/<variant>/<version>`): their sha256s, each computed once if need be."""
        sums = sorted(sha or self.sha256(path) for path, sha in files)
        return f"{'+'.join(sums)}|{build}"

    def known(self, key: str) -> Outcome | None:
        """The kept outcome of a key, or None when no child has said yet."""
        with self._lock:
            found = self._data["outcomes"].get(key)
        return _from_kept(found) if found is not None else None

    def vet(self, key: str, engine: str, engine_dir: str | None, weights: Path,
            options: dict, size: int) -> Outcome:
        """The outcome for `key`: the kept one, else a child's load of `weights` with
        `options` (`size`: the bytes of every file it reads, for its time bound)."""
        while True:
            with self._lock:
                found = self._data["outcomes"].get(key)
                if found is not None:
                    return _from_kept(found)
                running = self._running.get(key)
                if running is None:
                    done = self._running[key] = threading.Event()
                    break
            running.wait()  # then it is kept, or it said nothing about the file: again
        try:
            with self._child_lock:
                self.children += 1
                outcome = self._run(engine, engine_dir, str(weights), options,
                                    timeout_for(size))
            if outcome.about_file:
                with self._lock:
                    self._data["outcomes"][key] = {**asdict(outcome), "at": int(time.time()),
                                                   "file": weights.name}
                    write_json(self._file, self._data)
        finally:
            with self._lock:
                del self._running[key]
            done.set()
        level = logging.INFO if outcome.ok else logging.WARNING
        log.log(level, "first load of %s in a child (%s): %s in %.1f s", weights.name,
                key.split("|")[-1], "loaded" if outcome.ok else outcome.reason,
                outcome.seconds)
        return outcome

    def sha256(self, path: Path) -> str:
        """A file's sha256, computed once per content: kept with its stat stamp (device,
        inode, size, modification time), and computed again only when that changes."""
        real = os.path.realpath(path)
        st = os.stat(real)
        stamp = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
        with self._lock:
            kept = self._data["hashes"].get(real)
        if kept is not None and kept.get("stamp") == stamp:
            return kept["sha256"]
        h = hashlib.sha256()
        with open(real, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                h.update(chunk)
        digest = h.hexdigest()
        with self._lock:
            self._data["hashes"][real] = {"stamp": stamp, "sha256": digest}
            write_json(self._file, self._data)
        return digest


def invalid_file(model_id: str, name: str, reason: str) -> InvalidModelFile:
    """The 400 for a model whose file a child could not load: the file, the reason,
    and what to do."""
    return InvalidModelFile(f"Model {model_id}'s file {name} cannot be loaded: {reason}. "
                            f"localrt will not load it; pull or import a good copy of it",
                            param="model")


def _from_kept(found: dict) -> Outcome:
    fields = Outcome.__dataclass_fields__
    return Outcome(**{k: v for k, v in found.items() if k in fields})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
