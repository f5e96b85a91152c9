"""The CLI stays light: no engine, no jsonschema, no waitress for --help or config status."""

import subprocess
import sys

from support.servers import subprocess_env

HEAVY = ("llama_cpp", "onnxruntime_genai", "jsonschema", "waitress")


def loaded_after(argv, home):
    code = ("import sys, io; from localrt.cli import main;"
            f"rc = main({argv!r}, stdout=io.StringIO(), stderr=io.StringIO());"
            f"print(rc, [m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(home),
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_help_imports_nothing_heavy(home):
    assert loaded_after(["--help"], home) == "0 []"


def test_config_status_imports_nothing_heavy(live_server, home):
    assert loaded_after(["config", "status"], home) == "0 []"
