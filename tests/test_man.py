"""man/localrt.1 is valid roff and names every command and option the CLI has."""

import argparse
import shutil
import subprocess

import pytest
from conftest import REPO

from localrt.cli import build_parser

MAN = REPO / "man" / "localrt.1"


def walk(parser, prefix=()):
    """Yield (command path, option strings) for every parser in the tree."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield prefix + (name,), []
                yield from walk(child, prefix + (name,))
        elif action.help != argparse.SUPPRESS:
            yield prefix, list(action.option_strings)


def man_text():
    # roff escapes dashes; compare on the plain text.
    return MAN.read_text().replace("\\-", "-")


def test_every_command_and_option_is_in_the_man_page():
    text = man_text()
    missing = []
    for path, options in walk(build_parser()):
        if path and f"localrt {' '.join(path)}" not in text:
            missing.append(" ".join(path))
        missing += [f"{' '.join(path)} {opt}" for opt in options if opt not in text]
    assert not missing, f"not in man/localrt.1: {missing}"


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
def test_man_page_is_valid_roff():
    proc = subprocess.run(["groff", "-man", "-ww", "-z", str(MAN)], capture_output=True,
                          text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_files_section():
    text = man_text()
    assert ".SH FILES" in text and "~/.localrtrc" in text and "~/localrt/" in text
