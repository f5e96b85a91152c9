"""README.rst renders without errors (it is the package's long description)."""

import docutils.core
from conftest import REPO


def test_readme_is_valid_rst():
    docutils.core.publish_string((REPO / "README.rst").read_text(), writer="null",
                                 settings_overrides={"halt_level": 2, "report_level": 2})
