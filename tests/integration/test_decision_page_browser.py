"""The decision page of a night and the season view, in headless Chromium (issue 38 items 2 and 3).

Three nights of a real pipeline's evaluations on scikit-learn's wine table (a real MLflow store, real
`nightshift.evaluate.evaluate`, a real @champion): a first model, a weaker challenger refused, a stronger one
promoted; the ledger records them as the DAG's `report` does, with a skipped and a failed night between. The
plugin's app serves the pages over HTTP (uvicorn, its real headers: the browser enforces their CSP), logged in
as a reader of every DAG (the auth itself: test_plugin_app.py, test_plugin_auth.py). Screenshots are kept in the
test's tmp dir and `$NIGHTSHIFT_ARTIFACTS/browser` (paths printed).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

from nightshift import ledger, registry
from nightshift.decision_page import page_path
from nightshift.evaluate import evaluate
from nightshift.tasks import metric_names
from tests.integration.browser_helpers import artifacts, browser, needs_browser
from tests.unit.nightshift.test_decision_page_tables import HOSTILE, fit
from tests.unit.test_lineage_page import plugin
from tests.unit.test_plugin_app import auth

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

__all__ = ["artifacts", "auth", "browser", "plugin"]  # fixtures, used by name

pytestmark = pytest.mark.integration
DAG_ID = "wine_retrain"


CODE_VERSION = "4ed7884c0ffee5eed4ed7884c0ffee5eed4ed788"  # the DAG bundle's commit, as check_changes records it


def night(result: dict[str, Any], day: int, outcome: str, dataset: str, version: str | None = None
          ) -> dict[str, Any]:
    """The ledger record the DAG's `report` writes for a night that evaluated (dags/nightly_tasks/steps.py): with
    the registered `version` and where it is served when the night promoted."""
    names = metric_names("multiclass")
    champion = result["champion"]
    return {"recorded_at": f"2026-11-{day:02d}T02:03:00+00:00", "run_id": f"scheduled__2026-11-{day:02d}",
            "status": "success", "outcome": outcome, "dataset_version": dataset, "mlflow_run_id": result["run_id"],
            "code_version": CODE_VERSION, "model_name": "wine", "model_version": version,
            "serving_url": "http://127.0.0.1:5001" if version else None,
            "deploy_status": "started" if version else None,
            "gate": {"passed": result["passed"], "reasons": result["reasons"], "run_id": result["run_id"],
                     "primary": result["gate"]["primary"],
                     "challenger": {k: result["challenger"][k] for k in names},
                     "champion": {"version": champion["version"], **{k: champion[k] for k in names}}
                     if champion else None,
                     "rows_outside_train_range": (result["challenger"].get("drift") or {}).get("rows")}}


@pytest.fixture
def season(tmp_path: Path) -> dict[str, Any]:
    """Three real evaluations and two nights without one, in the pipeline's ledger."""
    from sklearn.datasets import load_wine

    from tests.tabular_data import write_splits

    frame = load_wine(as_frame=True).frame.rename(columns={"target": "cultivar", "proline": HOSTILE})
    data = write_splits(frame, tmp_path / "wine")
    gate = {"task": "multiclass", "floor": 0.3}

    def evaluated(name: str, epochs: int, seed: int) -> dict[str, Any]:
        run_id = fit(data, tmp_path / name, task="multiclass", label="cultivar", epochs=epochs, seed=seed,
                     run_key=f"{DAG_ID}/{name}")
        return evaluate(run_id, data_dir=data, model_name="wine", label_column="cultivar", gate=gate)

    first = evaluated("first", 8, 0)
    registry.set_alias("wine", "champion", registry.register(first["run_id"], model_name="wine")["version"])
    weaker = evaluated("weaker", 3, 1)
    stronger = evaluated("stronger", 60, 2)
    assert not weaker["passed"] and stronger["passed"], (weaker["reasons"], stronger["reasons"])
    records = [night(first, 1, "promoted v1 (promoted)", "a1" * 16, "1"),
               {"recorded_at": "2026-11-02T02:03:00+00:00", "run_id": "scheduled__2026-11-02", "status": "success",
                "outcome": "training skipped (unchanged)", "dataset_version": "a1" * 16},
               night(weaker, 3, "not promoted (gate rejected)", "b2" * 16),
               {"recorded_at": "2026-11-04T02:03:00+00:00", "run_id": "scheduled__2026-11-04", "status": "failed",
                "failed_task": "train", "outcome": "failed at train", "reason": "MPIJobFailed: worker-1 OOMKilled"},
               night(stronger, 5, "promoted v2 (promoted)", "c3" * 16, "2")]
    for record in records:
        ledger.append_record(DAG_ID, record)
    return {"stronger": stronger, "records": records}


@pytest.fixture
def served(plugin: ModuleType, auth: Any) -> Iterator[str]:
    """The plugin's app on a free local port, its user a reader of every DAG; its base URL."""
    import uvicorn
    from airflow.api_fastapi.core_api.security import get_user

    app = plugin.create_app()
    app.dependency_overrides[get_user] = lambda: SimpleNamespace(username="reviewer", readable=None)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not (server.started and server.servers):
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def screenshot(driver: WebDriver, tmp_path: Path, artifacts: Path, name: str) -> Path:
    height = driver.execute_script("return document.documentElement.scrollHeight;")
    driver.set_window_size(1500, min(int(height) + 100, 8000))
    shot = tmp_path / name
    driver.save_screenshot(str(shot))
    shutil.copy(shot, artifacts / name)
    print(f"screenshot: {shot} (and {artifacts / name})")
    return shot


def texts(driver: WebDriver, selector: str) -> list[str]:
    return list(driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.textContent);", selector))


@pytest.mark.browser
@needs_browser
def test_the_decision_page_and_the_season_view_in_chromium(browser: WebDriver, served: str, season: dict[str, Any],
                                                           tmp_path: Path, artifacts: Path) -> None:
    from selenium.webdriver.common.by import By

    stronger = season["stronger"]
    run_id = stronger["run_id"]
    assert page_path(DAG_ID, run_id).is_file()

    # The season view: the chart above the table, a decision mark per night, the data bands.
    browser.get(f"{served}/lineage?pipeline={DAG_ID}")
    shot = screenshot(browser, tmp_path, artifacts, "season-view.png")
    chart = browser.find_element(By.CSS_SELECTOR, "svg.season")
    assert chart.size["width"] > 800 and chart.size["height"] > 250, shot
    marks = texts(browser, "svg.season g.decisions title")
    assert [m.split("\n")[0].split(": ")[-1] for m in marks] == ["promoted", "skipped", "refused", "failed",
                                                                 "promoted"], shot
    assert f"champion v1 accuracy {stronger['champion']['accuracy']:.4f}" in marks[4], shot
    assert len(texts(browser, "svg.season title")) >= 5 + 3, shot  # marks, points, bands, drift bars
    assert "accuracy night by night" in chart.text, shot
    # The table under it: each promoted night's model version and where it was served, as the report records them.
    rows = [[cell.text for cell in row.find_elements(By.TAG_NAME, "td")]
            for row in browser.find_elements(By.CSS_SELECTOR, "table tr") if row.find_elements(By.TAG_NAME, "td")]
    assert [(row[6], row[9]) for row in rows] == [("v2", "http://127.0.0.1:5001"), ("—", "—"), ("—", "—"),
                                                  ("—", "—"), ("v1", "http://127.0.0.1:5001")], (rows, shot)
    assert rows[0][3] == CODE_VERSION[:10], (rows, shot)

    # Its link to the night's decision page, followed as a reviewer would.
    links = browser.find_elements(By.LINK_TEXT, "Decision page")
    assert len(links) == 3, shot
    links[0].click()  # newest first: the stronger challenger's night
    assert browser.current_url == f"{served}/decisions/{DAG_ID}/{run_id}/decision.html"
    shot = screenshot(browser, tmp_path, artifacts, "decision-page.png")
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "Passed the gate" in body and f"run {run_id[:12]}" in body, shot
    verdicts = {row.find_element(By.TAG_NAME, "b").text: row.find_elements(By.TAG_NAME, "td")[-1].text
                for row in browser.find_elements(By.CSS_SELECTOR, "table tr") if row.find_elements(By.TAG_NAME, "b")}
    assert verdicts["accuracy"] == "pass", (verdicts, shot)
    figures = browser.find_elements(By.CSS_SELECTOR, "div.figures svg")
    assert len(figures) >= 7 and all(f.size["width"] > 100 for f in figures), shot
    cells = texts(browser, "div.figures svg title")
    matrix = stronger["challenger"]["confusion_matrix"]
    assert f"true 1, predicted 1: {matrix[1][1]}" in cells, shot
    assert any(t.startswith(f"{HOSTILE} KS distance") for t in cells), shot  # the column name, as text
    assert not browser.find_elements(By.TAG_NAME, "script"), "a column name became markup"
    fetched = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name);")
    assert fetched == [], fetched  # nothing but the page itself
