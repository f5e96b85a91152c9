"""The real agent clients, Claude Code and Codex, installed from npm's registry once into
tests/.agent-clients (gitignored) at pinned versions, and the environment they run in
under a test: a temporary HOME, their telemetry, error reports and update checks off,
and every connection but loopback's sent to a dead proxy, so that nothing leaves the
machine.

`python3 -m localrt.bootstrap --test` (so `.ci/run`) installs nodejs and npm. Without
npm, or with npm's registry unreachable, the tests that need the clients skip, but
under CI (CI=true), where that is a failure (`require_agents`).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from support import REPO

AGENTS_DIR = REPO / "tests" / ".agent-clients"
BIN = AGENTS_DIR / "node_modules" / ".bin"
# The versions tried (issue 37's note lists them): change a pin here and the folder is
# installed again at the next run.
PINS = {"claude": "@anthropic-ai/claude-code@2.1.332", "codex": "@openai/codex@0.171.0"}
INSTALL_TIMEOUT = 900  # seconds: the two packages are about 800 MB with their binaries


def unavailable(why: str):
    """Skip the calling test; under CI, fail it: CI must run the real clients."""
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the real agent clients: {why}")
    pytest.skip(why)


def require_agents() -> Path:
    """The folder holding the pinned `claude` and `codex`, installed first if needed."""
    stamp = AGENTS_DIR / "pins.json"
    AGENTS_DIR.mkdir(exist_ok=True)
    with open(AGENTS_DIR / ".lock", "w") as lock:  # one install at a time, across processes
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _installed(stamp):
            return BIN
        npm = shutil.which("npm")
        if npm is None:
            unavailable("npm is not installed (python3 -m localrt.bootstrap --test installs "
                        "nodejs and npm)")
        # npm's cache and logs go in the folder, never in the real home directory.
        env = {**os.environ, "npm_config_cache": str(AGENTS_DIR / ".npm-cache"),
               "npm_config_update_notifier": "false", "npm_config_fund": "false",
               "npm_config_audit": "false"}
        ping = subprocess.run([npm, "ping"], capture_output=True, text=True, env=env,
                              timeout=120)
        if ping.returncode != 0:
            unavailable(f"npm's registry is unreachable: {ping.stderr.strip()[-300:]}")
        proc = subprocess.run([npm, "install", "--prefix", str(AGENTS_DIR), *PINS.values()],
                              capture_output=True, text=True, env=env,
                              timeout=INSTALL_TIMEOUT)
        if proc.returncode != 0 or not all((BIN / name).exists() for name in PINS):
            pytest.fail(f"npm install {' '.join(PINS.values())} failed "
                        f"({proc.returncode}):\n{proc.stderr[-2000:]}")
        stamp.write_text(json.dumps(PINS))
        return BIN


def _installed(stamp: Path) -> bool:
    """Whether the folder holds the pinned versions."""
    try:
        pins = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return pins == PINS and all((BIN / name).exists() for name in PINS)


def agent_env(home: Path, bin_dir: Path) -> dict:
    """The environment of a `localrt launch` that runs a real client: this checkout,
    `home` as HOME, the clients first on PATH, and nothing sent off the machine."""
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens there
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("ANTHROPIC_", "CLAUDE_", "OPENAI_", "CODEX_"))}
    env.update({"HOME": str(home), "PYTHONPATH": str(REPO),
                "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
                "HTTP_PROXY": dead, "HTTPS_PROXY": dead, "ALL_PROXY": dead,
                "http_proxy": dead, "https_proxy": dead, "all_proxy": dead,
                "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
                # Claude Code's telemetry, error reports, update checks and other traffic.
                "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
                "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                "DISABLE_BUG_COMMAND": "1", "DISABLE_COST_WARNINGS": "1"})
    env.pop("LOCALRT_CONFIG", None)
    return env
