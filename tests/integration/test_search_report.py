"""A search report page in headless Chromium: every figure renders from the inlined plotly.js, nothing is
fetched, and the page shows the study's trials (screenshot `$NIGHTSHIFT_ARTIFACTS/browser/search-report.png`).

The study is built with Optuna directly (the page only needs a study); `nightshift search` writing it is
checked in test_search.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from nightshift.search.report_html import write_report
from tests.integration.browser_helpers import needs_browser
from tests.unit.nightshift.test_search_report import HOSTILE, SETTINGS, small_study

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

pytestmark = pytest.mark.integration

FIGURES = ("history", "intermediate-complete", "intermediate-pruned", "importances", "parallel")


def _texts(driver: WebDriver, selector: str) -> list[str]:
    return list(driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.textContent);", selector))


@pytest.mark.browser
@needs_browser
def test_the_search_report_renders_in_chromium(browser: WebDriver, artifacts: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    page = write_report(small_study(name="demo <search>"), SETTINGS)
    browser.get(page.as_uri())

    def drawn(driver: WebDriver) -> Any:  # plotly marks a drawn figure js-plotly-plot and adds its SVG layers
        return all(driver.execute_script(
            "const e = document.getElementById(arguments[0]);"
            "return !!e && e.classList.contains('js-plotly-plot') && e.querySelectorAll('svg.main-svg').length > 0;",
            f"plot-{key}") for key in FIGURES)

    WebDriverWait(browser, 60).until(drawn, message="not every figure was drawn")
    height = browser.execute_script("return document.documentElement.scrollHeight;")
    browser.set_window_size(1400, min(int(height) + 100, 8000))
    shot = artifacts / "search-report.png"
    browser.save_screenshot(str(shot))

    # The traces and axes by name: completed and pruned trials apart, both parameters in the importances
    # and the parallel coordinates.
    assert _texts(browser, "#plot-intermediate-complete .legendtext") == ["Trial 0", "Trial 2"], shot
    assert _texts(browser, "#plot-intermediate-pruned .legendtext") == ["Trial 1"], shot
    assert {"val_accuracy", "Best Value"} <= set(_texts(browser, "#plot-history .legendtext")), shot
    assert {"lr", "model"} <= set(_texts(browser, "#plot-importances .ytick text")), shot
    assert _texts(browser, "#plot-parallel .xtick text") == ["val_accuracy", "lr", "model"], shot
    assert {"digits_cnn", HOSTILE} <= set(_texts(browser, "#plot-parallel .annotation-text")), shot

    body = browser.find_element(By.TAG_NAME, "body").text
    assert browser.title == "Model search demo <search>"
    assert "4 trials: 2 COMPLETE, 1 PRUNED, 1 FAIL; 7 epochs trained." in body
    rows = [row.text.split()[:2] for row in browser.find_elements(By.CSS_SELECTOR, "#trials tr[data-trial]")]
    assert rows == [["0", "COMPLETE"], ["1", "PRUNED"], ["2", "COMPLETE"], ["3", "FAIL"]]
    assert not browser.find_elements(By.CSS_SELECTOR, "#trials img"), "a parameter value became markup"

    # Nothing was fetched: the only resource is the page itself.
    fetched = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name);")
    assert fetched == [], fetched
