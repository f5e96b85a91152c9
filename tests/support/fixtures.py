"""The shared fixtures of a hub and a tiny model, which tests/conftest.py takes in: one
`hub` (the hub emulator, serving what a module's `hub_repos` adds), one `module_hub`
for a module's long-lived server, and one `tiny` (the quantized tiny model imported
where `api` points, started with `tiny_start`). A module overrides `hub_repos`,
`tiny_gguf` or `tiny_start`, never `hub` or `tiny` themselves.
"""

from __future__ import annotations

import pytest
from emulators.hubemu import HubEmulator
from support.models import add_model


@pytest.fixture
def hub_repos():
    """What `hub` serves: a function that adds repos to a HubEmulator. Nothing here; a
    module overrides this fixture with its own repos."""
    return lambda hub: None


@pytest.fixture
def hub(hub_repos):
    """The hub emulator (tests/emulators/hubemu.py) for this test, serving the module's
    `hub_repos`; stopped after the test."""
    with HubEmulator() as emu:
        hub_repos(emu)
        yield emu


@pytest.fixture(scope="module")
def module_hub():
    """A hub emulator for a module's long-lived server, which adds its repos to it."""
    with HubEmulator() as emu:
        yield emu


@pytest.fixture
def tiny_gguf(quantized):
    """The file `tiny` imports: the Q8_0 model; a module may override it."""
    return quantized["Q8_0"]


@pytest.fixture
def tiny_start():
    """The start options of `tiny`: None leaves it imported, not started. A module that
    wants it running overrides this fixture (one CPU thread is added)."""
    return None


@pytest.fixture
def tiny(api, tiny_gguf, tiny_start):
    """`tiny_gguf` imported as "tiny" (linked) where `api` points, started with
    `tiny_start` when that is not None; the id, "tiny"."""
    return add_model(api, tiny_gguf, "tiny", start=tiny_start, option="symlink")
