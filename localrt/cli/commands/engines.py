"""`localrt engines list|get|install|uninstall|use`: the inference engines."""

from __future__ import annotations

import contextlib
import os

from localrt.cli.context import CliError, Context, ExitCode
from localrt.cli.follow import follow, open_events, polled_events
from localrt.cli.menu import ask_number, list_choices
from localrt.cli.output import table
from localrt.fsutil import human_size

# What an install's success says, in cortex's words, which its scripts look for.
INSTALLED = "downloaded successfully!"


def cmd_engines_list(ctx: Context) -> int:
    """Print every engine as a table."""
    engines = ctx.client().list_engines()
    rows = [(number, e["name"], e["format"], e["version"], e["variant"], e["status"])
            for number, e in enumerate(engines, 1)]
    ctx.out(table(("#", "Name", "Supported Formats", "Version", "Variant", "Status"), rows))
    for e in engines:
        if e.get("reason"):
            ctx.err(f"{e['name']}: {e['reason']}")
    return ExitCode.OK


def cmd_engines_get(ctx: Context) -> int:
    """Print an engine's installed variants as a table."""
    name = ctx.args.engine
    variants = ctx.client().get_engine(name)
    if not variants:
        ctx.out(f"No variant of {name} is installed; `localrt engines install {name}` "
                f"installs one")
        return ExitCode.OK
    rows = [(number, v["engine"], v["version"], v["name"], v.get("status", "Installed"))
            for number, v in enumerate(variants, 1)]
    ctx.out(table(("#", "Name", "Version", "Variant", "Status"), rows))
    for v in variants:
        if v.get("reason"):
            ctx.err(f"{v['name']}: {v['reason']}")
    return ExitCode.OK


def cmd_engines_install(ctx: Context) -> int:
    """Install an engine variant, or a custom engine wheel, following its progress.

    With --menu the variant is chosen from a numbered list first.
    """
    args = ctx.args
    target = args.engine
    is_wheel = target.endswith(".whl")
    if args.menu and (is_wheel or args.variant):
        raise CliError("--menu chooses the variant of a built-in engine: give it without "
                       "--variant, and not with a wheel", ExitCode.USAGE)
    if is_wheel and "://" not in target:
        target = os.path.abspath(target)  # the server resolves paths from its own cwd
    client = ctx.client()
    variant = _choose_variant(ctx, client, target, args.version) if args.menu \
        else args.variant
    # The event stream opens first, so that no event of the install's task is missed.
    stream = open_events(client)
    with stream or contextlib.nullcontext():
        if is_wheel:
            reply = client.install_engine_wheel(target)
        else:
            reply = client.install_engine(target, args.version, variant)
        # A wheel given by URL names its engine only once it has been downloaded.
        name = reply.get("engine") or (os.path.basename(target) if is_wheel else target)
        if reply.get("note"):
            ctx.err(reply["note"])
        if "task" not in reply:  # nothing to download: the shipped build is on again
            ctx.out(f"Engine {name} {INSTALLED}")
            return ExitCode.OK
        return follow(ctx, client, stream or polled_events(client), reply["task"],
                      f"Engine {name}", INSTALLED, f"localrt engines install {args.engine}")


def _choose_variant(ctx: Context, client, engine: str, version: str | None) -> str | None:
    """Ask which variant to install: the one recommended for this machine (None, the
    default, which Enter takes), or one of the variants the package index has of
    `version` (the newest when None) that this machine runs, marked when installed."""
    offered = [r for r in client.engine_release(engine, version or "latest")
               if r.get("compatible", True)]
    installed = {}  # variant -> its installed versions
    for v in client.get_engine(engine):
        installed.setdefault(v["name"], []).append(f"{v['version']} ({v['status']})")
    rows = [("recommended", "for this machine (default)")]
    for r in offered:
        size = f", {human_size(r['size'])}" if r.get("size") else ""
        mark = f"; installed: {', '.join(installed[r['name']])}" \
            if r["name"] in installed else ""
        rows.append((r["name"], f"{r['version']}{size}{mark}"))
    if len(rows) == 1:
        ctx.err(f"The package index offers no variant of {engine} "
                f"{version or ''} to choose from; installing the one recommended for "
                f"this machine".replace("  ", " "))
        return None
    which = f"version {version}" if version else "the newest version"
    ctx.err(f"Variants of {engine} to install ({which}):")
    list_choices(ctx, rows)
    names = [name for name, _ in rows]
    chosen = ask_number(ctx, "variant", names, names, default="recommended")
    ctx.err(f"Selected {chosen}")
    return None if chosen == "recommended" else chosen


def cmd_engines_uninstall(ctx: Context) -> int:
    """Uninstall an engine variant (the active one unless told)."""
    args = ctx.args
    ctx.client().uninstall_engine(args.engine, args.version, args.variant)
    ctx.out(f"Engine {args.engine} uninstalled successfully!")  # cortex's words
    return ExitCode.OK


def cmd_engines_use(ctx: Context) -> int:
    """Choose the installed variant an engine's models load."""
    args = ctx.args
    ctx.out(ctx.client().use_engine(args.engine, args.variant, args.version)["message"])
    return ExitCode.OK
