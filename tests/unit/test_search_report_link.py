"""The plugin's "Search report" link and its list of search reports (plugins/nightshift_plugin.py)."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tests.unit.test_lineage_page import plugin

__all__ = ["plugin"]  # the shared fixture, used here by name


def key(dag_id: str = "model_search", task_id: str = "finish") -> SimpleNamespace:
    return SimpleNamespace(dag_id=dag_id, run_id="manual__1", task_id=task_id, map_index=-1)


def test_the_finish_task_links_to_its_report(plugin: ModuleType, nightshift_home: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    page = nightshift_home / "search" / "model_search__manual__1 x" / "report.html"
    xcoms: dict[tuple[str, str], Any] = {("finish", "report"): str(page)}
    monkeypatch.setattr(plugin, "_xcom", lambda ti_key, name: xcoms.get((ti_key.task_id, name)))
    link = plugin.SearchReportLink()
    assert link.name == "Search report"
    assert link.get_link(None, ti_key=key()) == "/nightshift/search/model_search__manual__1%20x/report.html"
    assert link.get_link(None, ti_key=key(task_id="prepare")) == ""  # no report XCom: no link
    assert link.get_link(None, ti_key=key(dag_id="nightly_retrain")) == ""
    xcoms[("finish", "report")] = str(nightshift_home / "search" / "best.json")  # only report pages
    assert link.get_link(None, ti_key=key()) == ""
    xcoms[("finish", "report")] = "/etc/report.html"  # only under NIGHTSHIFT_HOME/search
    assert link.get_link(None, ti_key=key()) == ""
    # A user pipeline's search DAG (nightly_tasks.search), its page in the pipeline's folder.
    xcoms[("finish", "report")] = str(nightshift_home / "search" / "diabetes_retrain" / "s 1" / "report.html")
    assert link.get_link(None, ti_key=key(dag_id="diabetes_retrain__search")) == (
        "/nightshift/search/diabetes_retrain/s%201/report.html")


def test_the_list_of_reports_is_newest_first_and_escaped(plugin: ModuleType, nightshift_home: Path) -> None:
    assert "No search has written a report yet." in plugin.search_index_html(plugin.search_reports())
    for age, name in enumerate(["nightly_retrain/newest", "<b>older", "diabetes_retrain/oldest"]):
        page = nightshift_home / "search" / name / "report.html"
        page.parent.mkdir(parents=True)
        page.write_text("<html></html>")
        os.utime(page, (1_800_000_000 - age * 60, 1_800_000_000 - age * 60))
    (nightshift_home / "search" / "optuna.db").write_text("")
    index = plugin.search_index_html(plugin.search_reports())
    assert index.index("newest") < index.index("&lt;b&gt;older") and "<b>older" not in index
    assert "href='../search/%3Cb%3Eolder/report.html'" in index and "2027-01-15 08:00 UTC" in index
    assert plugin.search_reports(limit=1) == [nightshift_home / "search" / "nightly_retrain" / "newest" / "report.html"]
    assert index.index("&lt;b&gt;older") < index.index("diabetes_retrain/oldest"), "the pipelines' pages are listed"
    assert "href='../search/diabetes_retrain/oldest/report.html'" in index
