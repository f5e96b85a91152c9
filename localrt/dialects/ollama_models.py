"""Ollama's names and listings: which model a name means, and the routes that list,
show, pull and delete models (GET /api/tags, GET /api/ps, POST /api/show, POST
/api/pull, DELETE /api/delete). localrt.dialects.ollama translates the generation
routes; both speak Ollama's shapes.

Model names (`Names.resolve`): an Ollama name is name:tag, the shape of a built-in's id
(<name>:<branch>), so a registered id is taken as it is; name:latest is name, and a
built-in's bare name (or name:latest) is its one downloaded variant. Other models keep
their localrt ids. A pull takes any localrt id; name:latest pulls name (the built-in's
default branch), and hf.co/<org>/<repo>[:<quant>] is <org>/<repo>[:<quant>].

/api/pull follows the pull's task on the event bus (EventBus.follow): its progress
becomes {status, digest, total, completed} lines, and each reply counts in the "pull"
admission until it is closed. /api/delete stops a running model first. /api/tags and
/api/ps list the registry's records and the running models in Ollama's shapes, and
/api/show gives the Modelfile localrt's record makes, with the GGUF header.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from datetime import datetime, timedelta, timezone
from typing import Callable, Iterator

from localrt.admission import ClientGone, Disconnected, never
from localrt.engines import ggufinfo, toolcalls
from localrt.errors import Conflict, HTTPError, InvalidField, UpstreamError
from localrt.models.registry import capabilities as registry_capabilities, weights_path

log = logging.getLogger(__name__)

LATEST = ":latest"
HUB_PREFIXES = ("hf.co/", "huggingface.co/")  # Ollama's names for a Hugging Face repo
FOREVER = timedelta(microseconds=(2 ** 63 - 1) // 1000)  # Go's longest Duration, as Ollama
# Ollama's options that are sampling fields of the same name.
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty",
            "presence_penalty", "frequency_penalty", "stop")
# Stored parameters as Ollama's Modelfile PARAMETERs name them (POST /api/show).
PARAMETERS = (("ctx_len", "num_ctx"), ("max_tokens", "num_predict"), *(
    (name, name) for name in SAMPLING))


class Names:
    """Ollama's model names over the registry (localrt.models.registry.Registry);
    `org()` is the hub organization built-in names come from (modelHubOrg)."""

    def __init__(self, registry, org: Callable[[], str]):
        self.registry = registry
        self._org = org

    def resolve(self, name: str) -> str:
        """The localrt id an Ollama model name means (see the module docstring); a name
        no model has comes back as it is, for the registry's 404."""
        registry = self.registry
        if registry.has(name):
            return name
        base = name[:-len(LATEST)] if name.endswith(LATEST) else name
        if registry.has(base):
            return base
        if "/" in base or ":" in base:
            return name
        repo = f"{self._org()}/{base}".lower()
        variants = sorted(r["id"] for r in registry.list()
                          if _source(r).get("type") == "hub" and
                          _source(r).get("file") is None and
                          str(_source(r).get("repo", "")).lower() == repo)
        if len(variants) > 1:
            raise InvalidField(f"Invalid field 'model': {base} has {len(variants)} "
                               f"downloaded variants ({', '.join(variants)}); name one",
                               param="model")
        return variants[0] if variants else name

    def record(self, name: str) -> dict:
        """The record of the model a name means; a 404 for none."""
        return self.registry.get(self.resolve(name))


def _source(record: dict) -> dict:
    source = record.get("source")
    return source if isinstance(source, dict) else {}


def pull_id(name: str) -> str:
    """The localrt id a pull of an Ollama model name takes."""
    for prefix in HUB_PREFIXES:
        if name.lower().startswith(prefix):
            name = name[len(prefix):]
            break
    return name[:-len(LATEST)] if name.endswith(LATEST) else name


def now() -> str:
    """The time now as Ollama writes times."""
    return _stamp(datetime.now(timezone.utc))


def _stamp(when: datetime) -> str:
    """RFC 3339 in UTC, as Ollama writes times."""
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _at(seconds: float) -> str:
    return _stamp(datetime.fromtimestamp(seconds, timezone.utc))


# --- pull and delete ---------------------------------------------------------------


def pull(pulls, downloads, events, admission, body: dict,
         disconnected: Disconnected = never):
    """POST /api/pull: Lines of progress, or {"status": "success"} once done with
    stream false. A pull of a model downloading already follows that download; one
    downloaded already succeeds at once. The download goes on if the client leaves.
    The reply holds a place in the "pull" `admission` (a 503 past its limit) until it
    is closed, and stops following once `disconnected()`. `pulls` starts the download
    (localrt.models.pulls), `events` (the event bus) follows it, `downloads` knows its
    task."""
    model_id = pull_id(body.get("model") or body.get("name"))
    admission.enter()  # before the download starts: a refused pull starts nothing
    try:
        try:
            started = pulls.pull(model_id)
        except Conflict as exc:
            if not exc.extra.get("taskId"):
                raise
            started = {"task": {"id": exc.extra["taskId"]}}
        task_id = (started.get("task") or {}).get("id")
        followed = iter(()) if task_id is None else events.follow(task_id, disconnected)
        # Listening first, then the task as it stands: nothing it did is missed.
        task = None if task_id is None else downloads.find(task_id)
    except BaseException:
        admission.leave()
        raise

    def close():
        try:
            getattr(followed, "close", lambda: None)()
        finally:
            admission.leave()

    objects = progress(task_id, task, followed)
    if body.get("stream") is False:
        try:
            for obj in objects:
                if "error" in obj:
                    if disconnected():
                        raise ClientGone(f"The client disconnected while it followed the "
                                         f"pull of {model_id}")
                    raise _pull_error(obj["error"])
            return {"status": "success"}
        finally:
            close()
    return Lines(objects, close)


class Lines:
    """A newline-delimited JSON reply body: one line per object; close(), which the
    server calls once, ends the objects and runs `on_close` (it frees the model)."""

    content_type = "application/x-ndjson"

    def __init__(self, objects: Iterator[dict], on_close: Callable[[], None]):
        self._objects = objects
        self._on_close = on_close
        self._closed = False

    def __iter__(self) -> Iterator[bytes]:
        for obj in self._objects:
            yield json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n"

    def close(self) -> None:
        """End the reply: the generation stops if it still runs."""
        if self._closed:
            return
        self._closed = True
        try:
            close = getattr(self._objects, "close", None)
            if close is not None:
                close()
        finally:
            self._on_close()


def progress(task_id: str | None, task: dict | None, events: Iterator[dict]) -> Iterator[dict]:
    """A pull's lines, as Ollama's: "pulling manifest", each file's bytes as they
    change, then "success"; an {"error"} line ends a pull that failed. `task` is the
    task as it stood once `events` (the event bus's, of this task) began."""
    yield {"status": "pulling manifest"}
    seen: dict = {}
    try:
        while task_id is not None:
            if task is None:
                yield {"error": f"The download {task_id} is no longer known"}
                return
            for item in task["items"]:
                done = (item.get("downloadedBytes") or 0, item.get("bytes") or 0)
                if seen.get(item["id"]) != done:
                    seen[item["id"]] = done
                    checksum = item.get("checksum")
                    yield {"status": f"pulling {item['id']}",
                           "digest": f"sha256:{checksum}" if checksum else item["id"],
                           "total": done[1], "completed": done[0]}
            if task["status"] not in ("Pending", "Downloading"):
                break
            event = next(events, None)
            if event is None:  # the server is stopping, or this listener fell behind
                yield {"error": f"The download {task_id} is no longer followed; "
                                f"GET /v1/models/pull shows how it goes on"}
                return
            task = event["task"]
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()
    if task is not None and task["status"] != "Success":
        yield {"error": task.get("error") or f"The download ended: {task['status']}"}
        return
    yield {"status": "verifying sha256 digest"}
    yield {"status": "writing manifest"}
    yield {"status": "success"}


def _pull_error(message: str) -> HTTPError:
    return UpstreamError(f"The pull failed: {message}")


def delete(path, names: Names, body: dict) -> dict:
    """DELETE /api/delete: the model's files and definition; a running model is stopped
    first (a reply it is giving ends). `path` is the request path
    (localrt.inference.requests.RequestPath)."""
    model_id = names.resolve(body.get("model") or body.get("name"))
    path.remove(model_id, "to delete it (DELETE /api/delete)")
    return {"status": "success"}


# --- models as Ollama lists them ---------------------------------------------------


def tags(names: Names) -> dict:
    """GET /api/tags: every downloaded model."""
    return {"models": [model_row(r) for r in names.registry.list()]}


def ps(path, names: Names) -> dict:
    """GET /api/ps: the running models, with when they unload and their memory."""
    models = []
    registry = names.registry
    for row in path.running():
        if not registry.has(row["id"]):  # deleted meanwhile
            continue
        expires = row.get("expiresAt")
        models.append({**model_row(registry.get(row["id"])),
                       "expires_at": _at(expires) if expires is not None else
                       _stamp(datetime.now(timezone.utc) + FOREVER),
                       "size": row["ram"] + row["vram"], "size_vram": row["vram"],
                       "context_length": int(row["options"].get("ctx_len") or 0)})
    return {"models": models}


def model_row(record: dict) -> dict:
    """A model as /api/tags lists it."""
    return {"name": record["id"], "model": record["id"], "modified_at": _at(record["created"]),
            "size": record["size"], "digest": digest(record), "details": details(record)}


def digest(record: dict) -> str:
    """A sha256 naming the model's content: localrt keeps no manifest to take one from,
    so it is the digest of its id and its files' paths, sizes and sha256s."""
    files = [[f["path"], f["size"], f.get("sha256")] for f in record.get("files") or []]
    text = json.dumps([record["id"], files], sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def details(record: dict) -> dict:
    """Ollama's details: the format, the GGUF's architecture, size and quantization."""
    meta = record.get("metadata") or {}
    family = str(meta.get("architecture") or "")
    count = meta.get("parameter_count")
    return {"parent_model": "", "format": _format(record), "family": family,
            "families": [family] if family else None,
            "parameter_size": _parameters(count) if isinstance(count, int) else "",
            "quantization_level": str(meta.get("quantization") or "")}


def _format(record: dict) -> str:
    if "upstreams" in record:
        return "remote"
    path = weights_path(record)
    return path.suffix.lstrip(".").lower() if path is not None else ""


def _parameters(count: int) -> str:
    """A parameter count as Ollama writes it: 7.6B, 494.0M, 22.7K."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


def show(names: Names, body: dict) -> dict:
    """POST /api/show: the Modelfile localrt's record makes, its parameters, template,
    details and GGUF metadata."""
    record = names.record(body.get("model") or body.get("name"))
    model_id = record["id"]
    template = str((record.get("metadata") or {}).get("chat_template") or "")
    info = model_info(record)
    parameters = [(ollama, record[name]) for name, ollama in PARAMETERS
                  if record.get(name) is not None]
    lines = [(k, json.dumps(s)) for k, v in parameters if k == "stop" for s in v] + \
        [(k, json.dumps(v)) for k, v in parameters if k != "stop"]
    path = weights_path(record)
    modelfile = ["# Modelfile generated by localrt (for reading: localrt takes none)",
                 f"FROM {path if path is not None else model_id}"]
    if template:
        modelfile.append(f'TEMPLATE """{template}"""')
    modelfile += [f"PARAMETER {k} {v}" for k, v in lines]
    return {"modelfile": "\n".join(modelfile) + "\n",
            "parameters": "\n".join(f"{k:<30} {v}" for k, v in lines),
            "template": template, "details": details(record), "model_info": info,
            "capabilities": capabilities(info, template, registry_capabilities(record)),
            "modified_at": _at(record["created"])}


def model_info(record: dict) -> dict:
    """The GGUF header's keys and values; the vocabulary's arrays are empty lists, as
    Ollama gives them unless asked, and the chat template is `template`."""
    path = weights_path(record)
    if path is None or path.suffix.lower() != ".gguf":
        return {}
    try:
        meta = ggufinfo.read_metadata(path)
    except (ggufinfo.GGUFError, OSError) as exc:
        log.warning("model %s: its GGUF header cannot be read: %s", record["id"], exc)
        return {}
    out = {}
    for key, value in meta.items():
        if key == "tokenizer.chat_template":
            continue
        if isinstance(value, ggufinfo.ArrayInfo) or key in (
                "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.scores"):
            value = []
        out[key] = _finite(value)
    return out


def _finite(value):
    """A header value as JSON can hold it: NaN and infinities become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def capabilities(info: dict, template: str, own: list = ()) -> list:
    """What a model does, as Ollama names it: rerank (a GGUF header that pools by rank,
    localrt.engines.ggufinfo.is_rerank: it answers POST /v1/rerank), embedding (a GGUF
    header that makes it an embedding model, localrt.engines.ggufinfo.is_embedding, or
    what localrt.models.registry.capabilities, `own`, calls one), else completion, vision
    and audio when `own` says so (a projector's encoders), tools when its template calls
    tools in a family localrt reads, insert when its vocabulary has fill-in-the-middle
    tokens, thinking when `own` says it reasons (its template marks its thinking: it takes
    `think`)."""
    if ggufinfo.is_rerank(info) or "rerank" in own:
        return ["rerank"]
    if ggufinfo.is_embedding(info) or ("embedding" in own and "chat" not in own):
        return ["embedding"]
    out = ["completion"]
    out.extend(c for c in ("vision", "audio") if c in own)
    if template and toolcalls.family_of(template) is not None:
        out.append("tools")
    if "tokenizer.ggml.fim_pre_token_id" in info:
        out.append("insert")
    if "reasoning" in own:
        out.append("thinking")
    return out
