"""A real browser for the tests: headless Chromium driven by Selenium through Debian's
chromedriver, with its own profile folder and no network of its own (no component
updates, no sync, no Selenium Manager download).

`python3 -m localrt.bootstrap --test` (so `.ci/run`) installs Debian's `chromium` and
`chromium-driver`. Without them a browser test module skips, but under CI (CI=true),
where a missing browser is a failure (`require_chromium`).
"""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def require_chromium() -> None:
    """Skip the calling test module when Chromium is missing; under CI, fail instead."""
    if os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER):
        return
    if os.environ.get("CI"):
        raise RuntimeError("CI must install chromium and chromium-driver (.ci/run does)")
    pytest.skip("chromium and chromedriver are not installed", allow_module_level=True)


def start_chromium(profile, logs: bool = False, size=(1280, 860), flags=()):
    """A headless Chromium with its profile in `profile` and the extra command-line
    `flags`; with `logs`, its console ("browser") and network ("performance") logs are
    kept for `driver.get_log`."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-default-apps", "--disable-sync", "--no-first-run",
                 "--disable-extensions", "--metrics-recording-only", "--no-default-browser-check",
                 f"--window-size={size[0]},{size[1]}", f"--user-data-dir={profile}",
                 *flags):
        options.add_argument(flag)
    if logs:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    env = {**os.environ, "HOME": str(profile), "SE_AVOID_STATS": "true", "SE_OFFLINE": "true"}
    service = Service(executable_path=CHROMEDRIVER, env=env)
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_script_timeout(30)
    return driver
