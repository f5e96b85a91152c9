"""The CLI in process, through main([...]) with its streams passed in."""

from __future__ import annotations

import io

from localrt.cli import main


def run(*argv, stdin="", stderr=None):
    """main(argv) with `stdin` as the typed text (a string, or a stream such as a fake
    terminal) and `stderr` a stream to write to (a fresh one if None); (exit code,
    stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO() if stderr is None else stderr
    stdin = io.StringIO(stdin) if isinstance(stdin, str) else stdin
    code = main(list(argv), stdout=out, stderr=err, stdin=stdin)
    return code, out.getvalue(), err.getvalue()
