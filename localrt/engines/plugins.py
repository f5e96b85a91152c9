"""Custom engines: packages in the `localrt.engines` entry-point group.

One comes from a package in localrt's own Python, or from a wheel that
localrt.engines.installs unpacked into its engine folder (`<engines>/<name>/<variant>/<version>/`,
listed in engines.json as custom). `find` finds both kinds, and `load` imports one
and checks that it is an Engine (localrt.engines.contract; localrt-api(7), "Custom
engines").
localrt.engines.catalog lists and loads them beside the built-in engines of its catalog.
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata
from pathlib import Path
from typing import Iterable

from localrt.engines import contract

ENTRY_POINT_GROUP = "localrt.engines"


class PluginError(Exception):
    """A custom engine that cannot be used; the message says why."""


def find(entry_points: Iterable, registry: dict, root: Path,
         taken: Iterable[str]) -> dict[str, tuple[object, str | None]]:
    """Custom engine name -> (entry point, folder to put on sys.path or None).

    `entry_points` are this Python's, `registry` is engines.json's "engines", and
    names in `taken` (the built-in engines) are never custom.
    """
    taken = set(taken)
    found = {ep.name: (ep, None) for ep in entry_points if ep.name not in taken}
    for name, entry in registry.items():
        active = entry.get("active")
        if not entry.get("custom") or name in taken or not active:
            continue
        folder = root / name / active["variant"] / active["version"]
        for dist in metadata.distributions(path=[str(folder)]):
            for ep in dist.entry_points.select(group=ENTRY_POINT_GROUP, name=name):
                found[name] = (ep, str(folder))
    return found


def load(name: str, ep, folder: str | None):
    """The engine object of an entry point (a class is instantiated); PluginError if unfit."""
    if folder:
        on_sys_path(folder)
    try:
        engine = ep.load()
        if isinstance(engine, type):
            engine = engine()
    except Exception as exc:
        raise PluginError(f"Engine {name} failed to load: "
                          f"{exc.__class__.__name__}: {exc}") from None
    missing = contract.missing(engine, contract.Engine)
    if missing:
        raise PluginError(f"Engine {name} ({ep.value}) lacks {', '.join(missing)}")
    return engine


def on_sys_path(folder: str) -> None:
    """Put an engine folder first on sys.path, so its modules are the ones imported."""
    if folder not in sys.path:
        sys.path.insert(0, folder)
        importlib.invalidate_caches()
