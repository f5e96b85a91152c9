"""The crash campaign (tests/bench/crash_campaign.py) in its short form: a dozen kill -9
points, each of the ten kinds of operation at least once, with a fixed seed, and no
corrupt state after any of them. The benchmark runs the same code for 1,000 points."""

import importlib.util
import io
import re
import sys

import pytest
from support import REPO

pytestmark = [pytest.mark.live, pytest.mark.slow]

POINTS = 12
SEED = 20261127


def load_campaign():
    """tests/bench/crash_campaign.py as a module (tests/bench is no package)."""
    path = REPO / "tests" / "bench" / "crash_campaign.py"
    spec = importlib.util.spec_from_file_location("crash_campaign", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("crash_campaign", module)  # its dataclasses look themselves up
    spec.loader.exec_module(sys.modules["crash_campaign"])
    return sys.modules["crash_campaign"]


def test_a_short_crash_campaign_leaves_no_corrupt_state(tmp_path, index_dir):
    campaign = load_campaign()
    out = io.StringIO()
    corrupt = campaign.run(POINTS, SEED, out=out, root=tmp_path / "campaign",
                           wheels=index_dir)
    report = out.getvalue()
    print(report)
    assert corrupt == 0, report
    assert len(re.findall(r"^#\d+ ", report, re.M)) == POINTS, report
