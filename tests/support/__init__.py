"""What the tests share that is not a pytest fixture, one module a topic:

- `apps`: the app in process, through WSGI (`call`, `bind`, `events`);
- `servers`: real servers and sockets (`send`, `run_foreground_server`, `RawStream`);
- `tasks`: waiting for download tasks (`wait_task`, `wait_pull`, `wait_bytes`);
- `waiting`: waiting for a condition, never for a fixed time (`wait_for`);
- `cli`: the CLI through `main([...])` (`run`);
- `models`: generated models and their constants (`NO_EOS`, `quantize`, `tokens_of`),
  and importing one (`add_model`);
- `config`: the Config fields for outbound requests (`outbound_config`);
- `browser`: headless Chromium through Selenium (`require_chromium`, `start_chromium`).
- `disks`: a small tmpfs to fill up or make read-only (the `small_disk` fixture).
- `agents`: the real Claude Code and Codex from npm's registry (`require_agents`), and
  the environment they run in (`agent_env`).

Tests import them (`from support.apps import call`). tests/conftest.py holds the
fixtures and builds them from these modules. The generators and emulators
(ggufgen, hubemu, pkgindex, ...) are tests/emulators/.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The real engine wheels the tests' package index serves (localrt.bootstrap --test
# downloads them).
WHEELS = REPO / "tests" / ".engine-wheels"
