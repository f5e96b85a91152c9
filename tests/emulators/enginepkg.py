"""Test support: a real, installable localrt custom-engine wheel, built at test time.

Not a test module. Tests import it as
``from emulators.enginepkg import build_echo_engine_wheel`` (tests/ is on sys.path
under pytest)::

    wheel = build_echo_engine_wheel(tmp_path)  # .../localrt_echo_engine-1.0.0-py3-none-any.whl
    model = write_echo_model(tmp_path / "echo.model")
    # pip install --target site wheel; then, with site on sys.path:
    #   ep, = importlib.metadata.entry_points(group="localrt.engines", name="echo")
    #   loaded = ep.load().load(str(model), {})
    #   loaded.chat([{"role": "user", "content": "hi"}], {}, stream=False)["content"]
    #   -> "echo: hi"

The wheel is written with zipfile alone (no setuptools, wheel or pip) and is
py3-none-any: one package plus a .dist-info with METADATA, WHEEL, entry_points.txt
(group ``localrt.engines``) and a RECORD whose hashes and sizes are right. Entries have
a fixed timestamp, so the same arguments give the same bytes and the same sha256.

The engine ("echo", format "ECHO") treats a model as a text file whose first line is a
prefix; chat answers the prefix followed by the last user message, word by word. See
ENGINE_SOURCE for the whole contract.
"""

from __future__ import annotations

import base64
import hashlib
import re
import string
import zipfile
from pathlib import Path

__all__ = ["ENTRY_POINT_GROUP", "ENGINE_SOURCE", "build_echo_engine_wheel",
           "write_echo_model", "wheel_filename"]

ENTRY_POINT_GROUP = "localrt.engines"

# The package's __init__.py; $version is filled in with the wheel's version.
ENGINE_SOURCE = string.Template('''\
"""localrt custom engine "echo": a model is a text file whose first line is a prefix.

chat() answers that prefix followed by the last user message, whitespace-normalised;
params["max_tokens"] (if given) cuts the answer to that many words. Built for
localrt's tests.
"""

import errno
from pathlib import Path


class EchoModel:
    """A loaded echo model."""

    def __init__(self, path, prefix, options):
        self.path = path
        self.prefix = prefix
        self.options = options  # what load() was given, for tests to inspect
        self.loaded = True

    def chat(self, messages, params, stream=False):
        """The answer as a dict, or with stream=True an iterator of word pieces."""
        if not self.loaded:
            raise RuntimeError(f"echo model {self.path} is unloaded")
        last_user = next((m for m in reversed(messages) if m.get("role") == "user"), {})
        words = self.prefix.split() + str(last_user.get("content", "")).split()
        limit = params.get("max_tokens")
        finish_reason = "stop"
        if limit is not None and len(words) > limit:
            words, finish_reason = words[:limit], "length"
        if stream:
            return (word if i == 0 else " " + word for i, word in enumerate(words))
        prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in messages)
        return {"content": " ".join(words), "finish_reason": finish_reason,
                "usage": {"prompt_tokens": prompt_tokens,
                          "completion_tokens": len(words)}}

    def unload(self):
        """Release the model; chat() raises RuntimeError afterwards."""
        self.loaded = False


class EchoEngine:
    """The engine localrt finds through the localrt.engines entry point."""

    name = "echo"
    format = "ECHO"
    description = "Echoes the last user message after the model file's first line."
    version = $version

    def load(self, model_path, options):
        """Open a model file; FileNotFoundError if it does not exist."""
        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(errno.ENOENT, "no echo model", str(path))
        with open(path, encoding="utf-8") as f:
            prefix = f.readline().strip()
        return EchoModel(str(path), prefix, dict(options))


ENGINE = EchoEngine()
''')


def _escape(name: str) -> str:
    """A project name as wheel file and .dist-info names spell it."""
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_filename(name: str = "localrt-echo-engine", version: str = "1.0.0") -> str:
    """The file name build_echo_engine_wheel gives the wheel for name and version."""
    return f"{_escape(name)}-{version}-py3-none-any.whl"


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def build_wheel(out_dir: Path, name: str, version: str, files: dict,
                entry_points: str = "") -> Path:
    """Write a py3-none-any wheel of `files` (path -> text) with a correct RECORD."""
    dist_info = f"{_escape(name)}-{version}.dist-info"
    files = {
        **files,
        f"{dist_info}/METADATA": (
            "Metadata-Version: 2.1\n"
            f"Name: {name}\n"
            f"Version: {version}\n"
            "Summary: A wheel built by localrt's tests\n"
            "Requires-Python: >=3.9\n"),
        f"{dist_info}/WHEEL": (
            "Wheel-Version: 1.0\n"
            "Generator: localrt-tests-enginepkg\n"
            "Root-Is-Purelib: true\n"
            "Tag: py3-none-any\n"),
    }
    if entry_points:
        files[f"{dist_info}/entry_points.txt"] = entry_points
    contents = {path: text.encode() for path, text in files.items()}
    record = f"{dist_info}/RECORD"
    lines = [_record_line(path, data) for path, data in contents.items()]
    contents[record] = "".join(line + "\n" for line in lines + [f"{record},,"]).encode()

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / wheel_filename(name, version)
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in contents.items():  # RECORD last, as the spec recommends
            info = zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    return wheel


def build_echo_engine_wheel(out_dir: Path, *, name: str = "localrt-echo-engine",
                            version: str = "1.0.0", data: dict | None = None) -> Path:
    """Write the echo engine wheel into out_dir and return its path; `data` (path in the
    package -> text) adds files beside its code (a big one, or many, for the disk tests)."""
    package = _escape(name)
    files = {f"{package}/__init__.py": ENGINE_SOURCE.substitute(version=repr(version))}
    files.update({f"{package}/{path}": text for path, text in (data or {}).items()})
    return build_wheel(out_dir, name, version, files,
                       f"[{ENTRY_POINT_GROUP}]\necho = {package}:ENGINE\n")


def write_echo_model(path: Path, *, prefix: str = "echo:") -> Path:
    """Write an echo model file (first line: the answer prefix) and return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{prefix}\nAn echo model for localrt's tests.\n", encoding="utf-8")
    return path
