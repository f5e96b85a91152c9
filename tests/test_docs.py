"""README.rst is the first screen: valid reST (it is the package's long description),
short, and it points at the man pages that hold the reference."""

import re

import docutils.core
from support import REPO

README = REPO / "README.rst"


def test_readme_is_valid_rst():
    docutils.core.publish_string(README.read_text(), writer="null",
                                 settings_overrides={"halt_level": 2, "report_level": 2})


def test_readme_is_the_first_screen():
    lines = README.read_text().splitlines()
    assert len(lines) < 300, f"{len(lines)} lines: the reference belongs in man/"
    assert all(len(line) < 92 for line in lines), [n + 1 for n, line in enumerate(lines)
                                                    if len(line) >= 92]


def test_readme_gives_the_set_up_and_a_first_chat():
    text = README.read_text()
    for needed in ("python3 -m localrt.bootstrap\n", "python3 -m localrt.bootstrap --test",
                   "localrt run ", "curl http://127.0.0.1:39281/v1/chat/completions",
                   'base_url="http://127.0.0.1:39281/v1"', "GET /openapi.json",
                   "tests/test_layout.py"):
        assert needed in text, needed
    # the id the curl and SDK examples use is the one `localrt run` registers
    run = re.search(r"localrt run (\S+)", text).group(1)
    assert f'"model": "{run}:1b"' in text and f'model="{run}:1b"' in text


def test_readme_points_at_every_man_page():
    text = README.read_text()
    for page in sorted((REPO / "man").glob("*.[1-9]")):
        assert f"``{page.stem}({page.suffix[1:]})``" in text, page.name


def test_readme_opens_with_what_localrt_is_the_set_up_and_a_first_chat():
    """No status paragraph or install notes before the chat: those are localrt(1)'s."""
    text = README.read_text()
    assert not re.search(r"^Status\b", text, re.M)
    headings = re.findall(r"^(\S.*)\n=+$", text, re.M)
    assert headings[1:3] == ["Set up", "A first chat"], headings
    first_screen = text[:text.index("\nA first chat\n")]
    assert len(first_screen.splitlines()) < 40
    assert "localrt run " in text[:text.index("\nA chat page in the browser\n")]


def test_localrt_1_says_what_is_in_place_and_how_to_install():
    man = (REPO / "man" / "localrt.1").read_text().replace("\\-", "-")
    described = " ".join(man[man.index(".SH DESCRIPTION"):man.index(".SH GLOBAL")].split())
    assert "under way" not in described
    for part in ("chat completions", "embeddings", "tool calls", "logprobs", "Responses",
                 "Anthropic", "Ollama", "remote models", "RPC", "metrics", "engines",
                 "models"):
        assert part in described, part
    install = man[man.index(".SH INSTALLATION"):man.index(".SH GGUF")]
    for note in ("-mno-amx-tile", "--no-cache-dir", "PIP_NO_INDEX=1", "PIP_INDEX_URL"):
        assert note in install, note
