"""A short hostile mix (tests/bench/hostile_mix.py): ten seconds of the fuzzer's
generated requests with issue 38's hostile requests mixed in, against a real `localrt
start`. The server lives, no reply is a 5xx, every request is answered, every chat of
a queue burst is a 200, and every answer held to the issue's second comes within
twice that (a generous bound for a busy machine; the bench's 60-second run holds the
second itself)."""

from __future__ import annotations

import sys

import pytest
from support import REPO

sys.path.insert(0, str(REPO / "tests" / "bench"))

import hostile_mix  # noqa: E402  (tests/bench is put on sys.path above)

pytestmark = [pytest.mark.live, pytest.mark.slow]

SECONDS = 10.0


def test_ten_seconds_of_the_hostile_mix(tmp_path):
    result = hostile_mix.run(SECONDS, seed=38, folder=tmp_path, generators=2, hostiles=2,
                             examples=5, timeout=60.0)
    table = hostile_mix.report(result)
    print(table)  # shown with -s
    assert result["alive"], table
    assert not result["fivexx"] and not result["none"] and not result["refused"], table
    assert result["slowest"] < 2 * hostile_mix.BOUND, table
    # every source sent requests, and at least one burst queued past the limit
    sources = {name.split(" (")[0] for name in result["rows"]}
    assert sources >= {"generated", *hostile_mix.Hostile.KINDS}, table
    assert result["bursts"], table
