"""The plugin's lineage page (`lineage_html`) and its "MLflow run" link, without an API server."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
MLFLOW_UI = "http://127.0.0.1:5999"


@pytest.fixture(scope="module")
def plugin() -> ModuleType:
    path = REPO / "plugins" / "nightshift_plugin.py"
    spec = importlib.util.spec_from_file_location("nightshift_plugin_under_test", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def mlflow_ui(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIGHTSHIFT_MLFLOW_UI_URL", MLFLOW_UI + "/")


def promoted(**extra: Any) -> dict[str, Any]:
    return {"recorded_at": "2026-11-22T02:03:41+00:00", "run_id": "scheduled__2026-11-22T02:00:00+00:00",
            "status": "success", "outcome": "promoted v1 (promoted)", "dataset_version": "a" * 32,
            "mlflow_run_id": "0123abcd", "model_version": "1", "serving_url": "http://127.0.0.1:5001",
            "deploy_status": "promoted", "gate": {"passed": True, "challenger": {"accuracy": 0.9712}}, **extra}


def refused_by_gate(nightshift_home: Path) -> dict[str, Any]:
    page = nightshift_home / "gx" / "data_docs" / "20261122T020301-ab" / "validations" / "train" / "x.html"
    return {"recorded_at": "2026-11-22T02:03:05.123456+00:00", "run_id": "manual__1", "status": "failed",
            "failed_task": "validate_data", "outcome": "failed at validate_data", "data_docs": str(page),
            "reason": "AirflowFailException: validate_data: " + "train.parquet: expect_column_values_to_be_between"
                      "(pixel_3) [pixels in 0..16] e.g. [17.0, 99.0] <script>alert(1)</script> " + "x" * 600}


def rows(page: str) -> list[str]:
    return re.findall(r"<tr class=.*?</tr>", page, flags=re.S)


def test_times_are_readable_utc(plugin: ModuleType) -> None:
    page = plugin.lineage_html([promoted(), promoted(recorded_at="2026-11-22T03:03:41+01:00")])
    first, second = rows(page)
    assert ">2026-11-22 02:03 UTC</td>" in first and ">2026-11-22 02:03 UTC</td>" in second
    assert ">2026-11-22T02:03:41+00:00<" not in page  # the raw ISO form is only a tooltip


def test_links_to_the_served_model_the_mlflow_run_and_the_airflow_run(plugin: ModuleType) -> None:
    (row,) = rows(plugin.lineage_html([promoted()]))
    assert "<a href='http://127.0.0.1:5001'>http://127.0.0.1:5001</a>" in row
    assert f"<a href='{MLFLOW_UI}/#/runs/0123abcd' title='0123abcd'>MLflow run</a>" in row
    assert "href='../dags/nightly_retrain/runs/scheduled__2026-11-22T02%3A00%3A00%2B00%3A00'" in row
    (row,) = rows(plugin.lineage_html([promoted(mlflow_experiment_id="7")]))
    assert f"href='{MLFLOW_UI}/#/experiments/7/runs/0123abcd'" in row


def test_no_links_where_there_is_nothing_to_open(plugin: ModuleType) -> None:
    skipped = {"recorded_at": "2026-11-23T02:01:00+00:00", "run_id": "r2", "status": "success",
               "outcome": "training skipped (unchanged)", "mlflow_run_id": None, "serving_url": None}
    (row,) = rows(plugin.lineage_html([skipped]))
    assert "MLflow run" not in row and "Data Docs" not in row
    assert "<td class='url'>—</td>" in row
    (row,) = rows(plugin.lineage_html([promoted(serving_url="javascript:alert(1)")]))
    assert "javascript:" not in row


def test_outcome_does_not_repeat_the_status(plugin: ModuleType) -> None:
    (row,) = rows(plugin.lineage_html([promoted()]))
    assert "promoted v1" in row and "(promoted)" not in row
    assert plugin.plain_outcome("promoted v2 (already_serving)") == "promoted v2 (already serving)"
    assert plugin.plain_outcome("not promoted (gate rejected)") == "not promoted (gate rejected)"


def test_refused_run_links_its_data_docs_and_escapes_its_reason(plugin: ModuleType, nightshift_home: Path) -> None:
    (row,) = rows(plugin.lineage_html([refused_by_gate(nightshift_home)]))
    assert "<a href='./data-docs/20261122T020301-ab/validations/train/x.html'>GX Data Docs</a>" in row
    assert "<script>" not in row and "&lt;script&gt;alert(1)&lt;/script&gt;" in row
    assert "<div class='reason'>AirflowFailException: validate_data: train.parquet" in row
    other = refused_by_gate(nightshift_home) | {"data_docs": "/etc/passwd"}
    assert "Data Docs" not in rows(plugin.lineage_html([other]))[0]  # only pages under the Data Docs root


def test_long_reasons_wrap_inside_the_frame(plugin: ModuleType) -> None:
    page = plugin.lineage_html([])
    style = page[page.index("<style>"):page.index("</style>")]
    assert re.search(r"table\{[^}]*width:100%", style)
    assert re.search(r"td\{[^}]*overflow-wrap:anywhere", style)
    assert re.search(r"td\.outcome\{[^}]*max-width:", style)


def test_mlflow_run_link_finds_the_experiment_or_lets_mlflow_find_it(plugin: ModuleType,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    xcoms = {("train", "mlflow_run_id"): "run1", ("train", "mlflow_experiment_id"): "3",
             ("report", "mlflow_run_id"): "run1"}
    monkeypatch.setattr(plugin, "_xcom", lambda ti_key, key: xcoms.get((ti_key.task_id, key)))
    link = plugin.MlflowRunLink()

    def key(task_id: str) -> SimpleNamespace:
        return SimpleNamespace(dag_id="nightly_retrain", run_id="r", task_id=task_id, map_index=-1)

    assert link.get_link(None, ti_key=key("train")) == f"{MLFLOW_UI}/#/experiments/3/runs/run1"
    assert link.get_link(None, ti_key=key("report")) == f"{MLFLOW_UI}/#/runs/run1"  # never experiment 0
    assert link.get_link(None, ti_key=key("validate_data")) == ""


def test_each_run_shows_the_commit_it_ran(plugin: ModuleType) -> None:
    html = plugin.lineage_html([{"run_id": "r1", "status": "success", "code_version": "0123456789abcdef0123",
                          "dataset_version": "d" * 32, "outcome": "promoted v1"}])
    assert "<th>code</th>" in html and "title='0123456789abcdef0123'>0123456789</td>" in html


def test_the_page_names_its_pipeline_links_its_runs_and_the_other_pipelines(plugin: ModuleType) -> None:
    page = plugin.lineage_html([promoted()], "churn.v2", ["churn.v2", "nightly_retrain", "a&b"])
    assert "<h2>churn.v2 lineage</h2>" in page and "<title>churn.v2 lineage" in page
    (row,) = rows(page)
    assert "href='../dags/churn.v2/runs/scheduled__2026-11-22T02%3A00%3A00%2B00%3A00'" in row  # its own DAG's run
    nav = page[page.index("<nav>"):page.index("</nav>")]
    assert "<strong>churn.v2</strong>" in nav
    assert "<a href='./lineage?pipeline=nightly_retrain'>nightly_retrain</a>" in nav
    assert "<a href='./lineage?pipeline=a%26b'>a&amp;b</a>" in nav  # quoted in the link, escaped in the text
    assert "<nav>" not in plugin.lineage_html([], "churn.v2", ["churn.v2"])  # no other pipeline: no list
    empty = plugin.lineage_html([], "no_such_dag", [])
    assert "No runs of no_such_dag recorded yet" in empty and "DAG id of a pipeline" in empty
