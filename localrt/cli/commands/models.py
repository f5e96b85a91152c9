"""`localrt models list|get|remove|update|import|add-remote|start|stop` and `localrt ps`.

`models delete` and `models rm` are `models remove` (localrt.cli.parser.MODEL_ALIASES).

`models pull` and `models run` are `pull` and `run` (localrt.cli.commands.pull, .run).
"""

from __future__ import annotations

import json
import os

from localrt.cli.context import CliError, Context, ExitCode
from localrt.cli.flags import flag_values
from localrt.cli.output import duration, table
from localrt.fsutil import human_size


def cmd_models_list(ctx: Context) -> int:
    """Print the downloaded and imported models as a table."""
    models = ctx.client().list_models()
    if not models:
        ctx.out("No models downloaded yet; `localrt pull ID` downloads one")
        return ExitCode.OK
    # cortex's columns first, so that its scripts find them where they look.
    rows = [(number, m["id"], m.get("engine", ""), m.get("version", ""),
             human_size(m.get("size", 0)), m.get("status", ""))
            for number, m in enumerate(models, 1)]
    ctx.out(table(["(Index)", "ID", "Engine", "Version", "Size", "Status"], rows))
    return ExitCode.OK


def cmd_models_get(ctx: Context) -> int:
    """Print one model's record as JSON."""
    model = ctx.client().get_model(ctx.args.model)
    ctx.out(json.dumps(model, indent=2, ensure_ascii=False))
    return ExitCode.OK


def cmd_models_remove(ctx: Context) -> int:
    """Delete a model's files and definition (`models remove`, `rm` and `delete`)."""
    ctx.client().remove_model(ctx.args.model)
    ctx.out(f"Model {ctx.args.model} deleted successfully")
    return ExitCode.OK


def cmd_models_update(ctx: Context) -> int:
    """Change a model's stored parameters with one PATCH."""
    changes = flag_values(ctx.args, ctx.args.parameters)
    if ctx.args.mmproj is not None:
        changes["mmproj"] = _absolute(ctx.args.mmproj)
    if ctx.args.lora is not None:
        changes["lora"] = [_adapter(given) for given in ctx.args.lora if given]
    if not changes:
        raise CliError("Nothing to update: give at least one option (see "
                       "`localrt models update -h`)", ExitCode.USAGE)
    reply = ctx.client().update_model(ctx.args.model, changes)
    shown = ", ".join(f"{name}={json.dumps(value, ensure_ascii=False)}"
                      for name, value in changes.items())
    ctx.out(f"Model {reply['model']['id']} updated: {shown}")
    if reply["message"] != f"Model {reply['model']['id']} updated":  # a note, as on a
        ctx.err(reply["message"])  # running model's new projector
    return ExitCode.OK


def cmd_models_import(ctx: Context) -> int:
    """Register a local GGUF file or ONNX folder, linked (the default) or copied.

    `--path`/`--id` and cortex's `--model_path`/`--model_id` are the same options.
    """
    path = _absolute(ctx.args.path)
    option = "copy" if ctx.args.copy else "symlink"
    mmproj = _absolute(ctx.args.mmproj) if ctx.args.mmproj is not None else None
    lora = [_adapter(given) for given in ctx.args.lora] if ctx.args.lora else None
    reply = ctx.client().import_model(path, ctx.args.id, option, mmproj, lora)
    # cortex's words, which its scripts look for.
    ctx.out(f"Successfully import model from '{path}' for modelID "
            f"'{reply['model']['id']}'.")
    return ExitCode.OK


def _adapter(given: str) -> dict:
    """A --lora PATH[:SCALE] as the API's {"path", "scale"} (a path may hold colons: only
    a number after the last one is a scale)."""
    path, colon, scale = given.rpartition(":")
    try:
        value = float(scale) if colon and path else None
    except ValueError:
        value = None
    if value is None:
        return {"path": _absolute(given)}
    return {"path": _absolute(path), "scale": value}


def _absolute(path: str) -> str:
    """The server resolves nothing relative to the caller's directory: an absolute path."""
    return os.path.abspath(os.path.expanduser(path))


def cmd_models_add_remote(ctx: Context) -> int:
    """Register a remote model: its upstreams are OpenAI-compatible servers.

    The key is read from the environment variable --api-key-env names, so it never
    shows in the shell's history or the process list.
    """
    args = ctx.args
    upstream = {}
    if args.upstream_model:
        upstream["model"] = args.upstream_model
    if args.max_inflight is not None:
        upstream["max_inflight"] = args.max_inflight
    if args.api_key_env:
        key = os.environ.get(args.api_key_env)
        if not key:
            raise CliError(f"${args.api_key_env} is not set; it should hold the upstream's "
                           f"API key", ExitCode.USAGE)
        upstream["api_key"] = key
    reply = ctx.client().add_remote_model(args.model, [{"url": url, **upstream}
                                                       for url in args.url])
    ctx.out(reply["message"])
    return ExitCode.OK


def cmd_models_start(ctx: Context) -> int:
    """Load a model, with its stored parameters and the options given."""
    reply = ctx.client().start_model(ctx.args.model, start_options(ctx))
    ctx.out(reply["message"])
    return ExitCode.OK


def start_options(ctx: Context) -> dict:
    """The start options given as flags (`models start`, `run`)."""
    return flag_values(ctx.args, ctx.args.start_options)


def context_for(record: dict, need: int) -> int:
    """The ctx_len to start a model with so that `need` tokens fit (`launch`, `run`): the
    stored ctx_len or `need`, whichever is more, but never past the context it was
    trained on."""
    wanted = max(need, record.get("ctx_len") or 0)
    trained = (record.get("metadata") or {}).get("context_length")
    return min(wanted, trained) if isinstance(trained, int) and trained > 0 else wanted


def cmd_models_stop(ctx: Context) -> int:
    """Unload a running model."""
    ctx.out(ctx.client().stop_model(ctx.args.model)["message"])
    return ExitCode.OK


def cmd_ps(ctx: Context) -> int:
    """Print the running models, and the machine they run on, its GPUs included."""
    status = ctx.client().models_status()
    rows = [(m["id"], m["engine"], human_size(m["ram"]), human_size(m["vram"]),
             duration(m["uptime"]), m["options"].get("ctx_len", ""))
            for m in status["data"]]
    if rows:
        ctx.out(table(["Model", "Engine", "RAM", "VRAM", "Up time", "Context"], rows))
        for m in status["data"]:  # the RAM or VRAM above includes it
            if m.get("kvCache"):
                ctx.out(f"{m['id']}: {m.get('slots', 1)} x {m['options'].get('ctx_len', '?')} "
                        f"tokens of KV cache, {human_size(m['kvCache'])}")
            offload = m.get("offload")
            if offload and (offload["devices"] or offload["ngl"] not in ("fit", 0)):
                on = ", ".join(f"{d['name']} {human_size(d['bytes'])}"
                               for d in offload["devices"]) or "no device"
                ctx.out(f"{m['id']}: {offload['layers']}/{offload['of']} layers on {on} "
                        f"(ngl {offload['ngl']})")
    else:
        ctx.out("No models are running; `localrt run ID` starts one and chats with it")
    upstreams = [(m["id"], u["url"], u["health"],
                  f"{u['inflight']}/{u['max_inflight'] or '-'}",
                  "" if u.get("latency_ms") is None else f"{u['latency_ms']:.0f} ms",
                  u.get("error", ""))
                 for m in status["data"] for u in m.get("upstreams", ())]
    if upstreams:
        ctx.out(table(["Remote model", "Upstream", "Health", "In flight", "Latency", "Error"],
                      upstreams))
    hw = status.get("hardware") or {}
    gpus = ctx.client().hardware()["gpus"]
    if hw:
        gpu = f"CUDA {hw['cuda']}" if hw.get("cuda") else "no GPU" if not gpus else \
            f"{len(gpus)} GPU{'s' if len(gpus) > 1 else ''}"
        ctx.out(f"CPU: {hw.get('cpu') or 'unknown'} ({hw.get('cores')} cores, "
                f"{hw.get('cpuLevel') or 'no AVX'}); RAM: {human_size(hw.get('ramAvailable', 0))} "
                f"free of {human_size(hw.get('ramTotal', 0))}; {gpu}")
    if gpus:
        ctx.out(table(["GPU", "Name", "Type", "Backend", "Version", "Free", "Total"],
                      [(g["id"], g["name"], g["type"], g["backend"], g["version"],
                        human_size(g["free_vram"] << 20), human_size(g["total_vram"] << 20))
                       for g in gpus]))
    return ExitCode.OK
