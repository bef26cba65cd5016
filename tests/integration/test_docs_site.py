"""The documentation site in headless Chromium, served from 127.0.0.1 as `mkdocs build` wrote it: the getting-started
page and the generated reference render, the search finds a variable offline, and nothing is fetched from another
origin (screenshots `$NIGHTSHIFT_ARTIFACTS/browser/docs-getting-started.png`, `docs-reference-environment.png`)."""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.integration.browser_helpers import needs_browser

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The built site, served on a free port of 127.0.0.1; its base URL."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    handler = functools.partial(_QuietHandler, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def _foreign(browser: WebDriver, origin: str) -> list[str]:
    fetched = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name);")
    return [url for url in fetched if not url.startswith(origin)]


@pytest.mark.browser
@needs_browser
def test_the_docs_site_renders_searches_offline_and_fetches_nothing_foreign(
        site: str, browser: WebDriver, artifacts: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{site}/getting-started.html")
    assert browser.title.startswith("Getting started")
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "export PATH=\"$PWD/.venv/bin:$PATH\"" in body  # the examples say how to reach `nightshift`
    assert "Where to see the result" in body
    nav = {link.text for link in browser.find_elements(By.CSS_SELECTOR, "nav.md-nav a") if link.text}
    assert {"Command line", "Environment variables", "Fault matrix", "Benchmarks"} <= nav
    browser.save_screenshot(str(artifacts / "docs-getting-started.png"))
    assert _foreign(browser, site) == []

    browser.get(f"{site}/reference/environment.html")
    headings = {h.text for h in browser.find_elements(By.CSS_SELECTOR, "article h2")}
    assert {"NIGHTSHIFT_HOME", "NIGHTSHIFT_DATA_ROOTS", "NIGHTSHIFT_RETRAIN_CRON"} <= headings
    browser.save_screenshot(str(artifacts / "docs-reference-environment.png"))

    # Material's search runs in the page (a web worker over search/search_index.json): no server, no network.
    box = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")  # in the header of a wide window
    box.click()
    box.send_keys("NIGHTSHIFT_SHARED_PVC")
    WebDriverWait(browser, 30).until(
        lambda driver: driver.find_elements(By.CSS_SELECTOR, ".md-search-result__item"),
        message="the search found nothing")
    assert _foreign(browser, site) == []
