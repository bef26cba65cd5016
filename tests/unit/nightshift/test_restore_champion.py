"""A night that registers nothing: the deploy task restores @champion's dead local server (dags/nightly_tasks/steps
restore_champion; the restart itself with a real server: tests/integration/test_deploy_local.py), and the night's
ledger record says so without turning a skipped night into a promotion."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def test_another_target_restores_nothing(nightshift_home: Path, digits_pipeline: Any,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from dags.nightly_tasks import steps
    from nightshift.deploy import local

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("restore_local called for the kserve target")

    monkeypatch.setattr(local, "restore_local", never)
    assert steps.restore_champion(digits_pipeline, {"path": "/nowhere"}, {"deploy_target": "kserve"}) is None


def test_a_skipped_night_whose_champion_was_restarted_stays_skipped_and_names_the_restart(
        nightshift_home: Path, digits_pipeline: Any) -> None:
    from dags.nightly_tasks import steps
    from nightshift import ledger
    from nightshift.season import decision

    restarted = {"target": "local", "status": "restarted", "model_name": "nightshift-digits", "version": "2",
                 "url": "http://127.0.0.1:40002", "previous": {"url": "http://127.0.0.1:40001", "version": "2"}}
    steps.report(digits_pipeline, "nightly_retrain", "r6", {},
                 {"stage_dataset": {"hash": "md5:x", "rows": 10}, "skip_training": {"skipped": True},
                  "deploy": restarted})
    (record,) = [json.loads(line) for line in ledger.ledger_path("nightly_retrain").read_text().splitlines()]
    assert record["outcome"] == ("training skipped (unchanged); @champion v2's server no longer answered: "
                                 "restarted")
    assert decision(record) == "skipped"
    assert record["serving_url"] == "http://127.0.0.1:40002" and record["deploy_status"] == "restarted"
    assert record["model_version"] is None  # nothing was registered tonight
