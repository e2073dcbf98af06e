"""A real headless Chromium (Debian chromium and chromium-driver) driven by selenium.

Selenium blocks, so the driver is made, used and quit on worker threads (the relay under test runs
in the test's reactor). Missing pieces skip the test locally and fail it under CI=true
(.ci/install-browser.sh installs them).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from twisted.internet import threads
from twisted.trial.unittest import TestCase

from tests.support.skips import missing

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT = 20  # seconds, generous for a loaded CI machine


def require_browser() -> None:
    """Skip (under CI=true: fail) unless Chromium, chromedriver and selenium are installed."""
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        missing("Debian chromium / chromium-driver not installed (see .ci/install-browser.sh)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing("selenium not installed (see .ci/install-browser.sh)")


def make_driver(profile: str) -> Any:
    """Blocking: a headless Chromium with its profile in C{profile}, no network beyond loopback."""
    os.environ.setdefault("SE_OFFLINE", "true")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
        f"--user-data-dir={profile}",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
    ):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))


async def start_browser(case: TestCase) -> Any:
    """A driver for C{case} (skipped without a browser), quit and its profile removed at cleanup."""
    require_browser()
    profile = tempfile.mkdtemp(prefix="relayd-chromium-")
    case.addCleanup(shutil.rmtree, profile, True)
    driver = await threads.deferToThread(make_driver, profile)
    case.addCleanup(threads.deferToThread, driver.quit)
    return driver


def wait_for(driver: Any, script: str, result: str = "return window.state") -> Any:
    """Blocking: until C{script} returns something true in the page, then what C{result} returns."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, WAIT, poll_frequency=0.05).until(lambda d: d.execute_script(script))
    return driver.execute_script(result)
