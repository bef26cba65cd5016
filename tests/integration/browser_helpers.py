"""Headless Chromium for the UI tests (test_airflow_standalone, test_search_report): the `browser` and
`artifacts` fixtures (import them into a test module to use them) and the `needs_browser` marker."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.integration.airflow_helpers import REPO

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

# Headless Chromium against the React UI: Debian's chromium and chromium-driver (`make setup` installs them
# as root), driven by selenium; nothing is downloaded at run time.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1920,1080")
BROWSER_BINARIES = {name: shutil.which(name) for name in ("chromium", "chromedriver")}
MISSING_BROWSER = [name for name, path in BROWSER_BINARIES.items() if path is None]
# A marker, not a skip inside a fixture: the module's Airflow would start before a function fixture skips.
needs_browser = pytest.mark.skipif(
    bool(MISSING_BROWSER),
    reason=f"{' and '.join(MISSING_BROWSER)} not found: apt-get install chromium chromium-driver (make setup does, "
           "as root)")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(BROWSER_BINARIES["chromium"])
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    service = Service(str(BROWSER_BINARIES["chromedriver"]), log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(options=options, service=service)  # quit() ends chromium, then chromedriver
    try:
        driver.set_page_load_timeout(60)
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def artifacts() -> Path:
    root = Path(os.environ.get("NIGHTSHIFT_ARTIFACTS") or REPO / ".artifacts")
    (root / "browser").mkdir(parents=True, exist_ok=True)
    return root / "browser"
