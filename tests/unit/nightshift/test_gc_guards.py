"""What `nightshift gc` refuses before it removes anything (review findings): a link on the way to what it
removes, a ledger it cannot read whole, a disabled policy; and that its own failure rewrites no run's record."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from nightshift import gc, ledger
from nightshift.retention import DeclaredRules, RetentionPolicy


def test_a_link_on_the_way_from_the_root_is_never_followed(tmp_path: Path) -> None:
    """A link at <checkpoints>/<dag> led the removal outside the home (both sides resolved into its target)."""
    outside = tmp_path / "outside" / "precious"
    outside.mkdir(parents=True)
    checkpoints = tmp_path / "home" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "nightly").symlink_to(tmp_path / "outside")
    with pytest.raises(gc.GcFailed, match=r"not a folder under .*nightly \(.*nightly is a link\)"):
        gc._rmtree(checkpoints / "nightly" / "precious", checkpoints / "nightly", checkpoints)
    assert outside.is_dir()
    # The configured folder itself may be a link (onto another disk): what lies under it is removed (second review:
    # a symlinked MLflow artifact root made every removal refused, failing every night's collection).
    disk = tmp_path / "disk" / "artifacts"
    (disk / "1" / "run" / "artifacts").mkdir(parents=True)
    (tmp_path / "artifacts").symlink_to(disk)
    gc._rmtree(tmp_path / "artifacts" / "1" / "run", tmp_path / "artifacts")
    assert not (disk / "1" / "run").exists() and disk.is_dir()
    real = tmp_path / "home" / "workspaces" / "nightly"
    (real / "run-1" / "data").mkdir(parents=True)
    (real / "run-1" / "data" / "link").symlink_to(outside)  # a link inside: removed as a link, its target stays
    gc._rmtree(real / "run-1", real)
    assert not (real / "run-1").exists() and outside.is_dir()
    with pytest.raises(gc.GcFailed):
        gc._rmtree(real, real)


def test_a_torn_ledger_line_takes_no_other_record_with_it_and_stops_gc(nightshift_home: Path) -> None:
    """A record torn by a full disk glued onto the next night's: both vanished, and gc took that night for killed."""
    path = ledger.append_record("p", {"run_id": "a1", "status": "success"})
    with path.open("a") as handle:
        handle.write('{"run_id": "a2", "sta')  # ENOSPC mid-record
    ledger.append_record("p", {"run_id": "a3", "status": "success"})
    assert [r["run_id"] for r in ledger.read_records("p")] == ["a1", "a3"]
    with pytest.raises(ledger.LedgerUnreadable, match="line 2 is not a run record"):
        ledger.read_records("p", strict=True)
    with pytest.raises(gc.GcFailed, match=r"line 2 is not a run record.*nothing was removed"):
        gc._ledger_facts("p")


def test_a_disabled_policy_reads_nothing(digits_pipeline: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With retention off, gc read the registry first: a registry that was down failed the night anyway."""
    def down(*args: Any) -> Any:
        raise AssertionError("the registry was read")

    monkeypatch.setattr(gc, "facts", down)
    pipeline = dataclasses.replace(digits_pipeline, retention=RetentionPolicy(enabled=False))
    assert gc.collect(pipeline)["remove"] == []


def test_a_failed_collect_garbage_leaves_the_runs_record_as_it_was(nightshift_home: Path) -> None:
    """The run deployed and was recorded a success; its housekeeping task failing then recorded it as failed."""
    from dags.nightly_tasks import steps

    ledger.append_record("nightly", {"run_id": "r1", "status": "success"})

    class TI:
        dag_id, run_id, task_id, try_number = "nightly", "r1", "collect_garbage", 2

        def xcom_pull(self, task_ids: str) -> None:
            return None

    steps.failure_summary({"ti": TI(), "exception": gc.GcFailed("removing x failed")})
    assert [r["status"] for r in ledger.read_records("nightly")] == ["success"]
    TI.task_id = "train"
    steps.failure_summary({"ti": TI(), "exception": RuntimeError("boom")})
    assert json.loads(ledger.ledger_path("nightly").read_text().splitlines()[-1])["status"] == "failed"


def test_the_dags_collect_garbage_judges_dataset_versions_by_every_declared_pipelines_rule(
        digits_pipeline: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36 item 1 (b): the pipeline's last task collected the shared dataset store with its own days alone. It
    now hands gc the rules of the declarations Airflow loads (the DAG folder, NIGHTSHIFT_PIPELINES) and its own."""
    import yaml

    from dags.nightly_tasks import steps
    from nightshift import tracking
    from tests.conftest import DIGITS_YAML

    declared = yaml.safe_load(DIGITS_YAML.read_text())
    declared.update(dag_id="churn_model", model_name="churn", retention={"data_versions_days": 60})
    declared["dataset"]["asset"] = "churn"
    (tmp_path / "dags" / "churn").mkdir(parents=True)
    (tmp_path / "dags" / "churn" / "churn.yaml").write_text(yaml.safe_dump(declared))
    (tmp_path / "dags" / "broken.yaml").write_text("dag_id: [")
    monkeypatch.setenv("AIRFLOW__CORE__DAGS_FOLDER", str(tmp_path / "dags"))
    monkeypatch.setenv("NIGHTSHIFT_PIPELINES", str(tmp_path / "none"))
    given: dict[str, Any] = {}

    def collect(pipeline: Any, **kwargs: Any) -> dict[str, Any]:
        given.update(kwargs)
        return {"remove": [], "keep": [], "removed_bytes": 0, "policy": pipeline.retention.to_dict()}

    monkeypatch.setattr(gc, "collect", collect)
    monkeypatch.setattr(tracking, "configure", lambda: None)
    steps.collect_garbage(digits_pipeline)
    assert given["rules"] == DeclaredRules({"churn_model": RetentionPolicy(data_versions_days=60),
                                            "nightly_retrain": digits_pipeline.retention},  # from beside its file
                                           unreadable=(str(tmp_path / "dags" / "broken.yaml"),))
