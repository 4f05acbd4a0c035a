"""Headless Chromium for looking at the built page from disk: the page tests (tests/test_report_browser.py)
and the report benchmark (bench/report.py) drive it.

Debian's chromium and chromium-driver (`make browser`); selenium, a dev dependency, is imported only when a
browser starts, so that nothing else in the package needs it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def missing_browser() -> list[str]:
    """Which of Debian's chromium and chromium-driver binaries are not installed (`make browser`)."""
    return [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]


@contextlib.contextmanager
def headless_chromium(profile_prefix: str) -> Iterator[Any]:
    """A selenium driver of headless Chromium with a fresh profile, no background networking, a
    1280x1000 window and the console log kept; quit, and its profile removed, on leaving."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix=profile_prefix)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--window-size=1280,1000",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = None
    try:
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        if driver is not None:
            driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
