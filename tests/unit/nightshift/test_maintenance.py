"""Airflow's own growth (nightshift.maintenance): task-log retention on a real folder (old files go, new ones and
everything behind a link stay), the settings, and which database `airflow db clean` is given in a task process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from nightshift import maintenance, settings
from nightshift.errors import UsageError

DAY = 86400.0


def write(path: Path, days: float, text: str = "log line\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    then = time.time() - days * DAY
    os.utime(path, (then, then))
    return path


def test_old_task_logs_go_new_ones_stay_and_no_link_is_followed_or_removed(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    run = logs / "dag_id=nightly_retrain" / "run_id=old" / "task_id=train"
    old = write(run / "attempt=1.log", 40)
    new = write(logs / "dag_id=nightly_retrain" / "run_id=new" / "task_id=train" / "attempt=1.log", 1)
    outside = tmp_path / "outside"
    precious = write(outside / "precious.log", 400)
    (logs / "dag_id=x").mkdir()
    (logs / "dag_id=x" / "elsewhere").symlink_to(outside, target_is_directory=True)
    (logs / "old-link.log").symlink_to(precious)
    os.utime(logs / "old-link.log", (time.time() - 400 * DAY,) * 2, follow_symlinks=False)
    empty = logs / "dag_id=gone" / "run_id=r"
    empty.mkdir(parents=True)
    for folder in (empty, empty.parent):
        os.utime(folder, (time.time() - 40 * DAY,) * 2)

    dry = maintenance.prune_logs(logs, 30, dry_run=True)
    assert dry["removed"] == [str(old)] and old.is_file() and empty.is_dir()

    result = maintenance.prune_logs(logs, 30)
    assert result["removed"] == [str(old)] and result["removed_bytes"] == len("log line\n")
    assert result["kept"] == 1 and result["links"] == 2
    assert not old.exists() and not run.exists() and not run.parent.exists(), "the folders it emptied go too"
    assert new.is_file() and precious.is_file()
    assert (logs / "old-link.log").is_symlink() and (logs / "dag_id=x" / "elsewhere").is_symlink()
    assert not empty.exists() and not empty.parent.exists(), "an old empty folder goes"
    assert logs.is_dir()


def test_a_configured_log_folder_that_is_a_link_is_pruned_in_its_target(tmp_path: Path) -> None:
    """base_log_folder on another disk, reached through a link: fwalk alone yields nothing for a link."""
    old = write(tmp_path / "disk" / "logs" / "dag_id=a" / "old.log", 40)
    (tmp_path / "logs").symlink_to(tmp_path / "disk" / "logs", target_is_directory=True)
    assert maintenance.prune_logs(tmp_path / "logs", 30)["removed"] == [str(old)] and not old.exists()


def test_a_new_empty_folder_stays_a_task_may_be_about_to_write_into_it(tmp_path: Path) -> None:
    (tmp_path / "logs" / "dag_id=a" / "run_id=now").mkdir(parents=True)
    assert maintenance.prune_logs(tmp_path / "logs", 30)["removed"] == []
    assert (tmp_path / "logs" / "dag_id=a" / "run_id=now").is_dir()


def test_a_log_that_cannot_be_removed_fails_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = write(tmp_path / "logs" / "a.log", 40)

    def refuse(name: str, *, dir_fd: int | None = None) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(maintenance.os, "unlink", refuse)
    with pytest.raises(maintenance.LogPruneFailed, match=f"removing task log {old} failed \\(Permission denied\\)"):
        maintenance.prune_logs(tmp_path / "logs", 30)


def test_a_missing_log_folder_is_nothing_to_prune(tmp_path: Path) -> None:
    assert maintenance.prune_logs(tmp_path / "none", 30)["removed"] == []


@pytest.mark.parametrize("value", ["0.5", "thirty", "-3", "nan"])
def test_a_retention_that_is_not_days_is_refused_naming_the_variable(value: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIGHTSHIFT_AIRFLOW_LOG_RETENTION_DAYS", value)
    with pytest.raises(UsageError, match=f"NIGHTSHIFT_AIRFLOW_LOG_RETENTION_DAYS={value} is not a number of days"):
        settings.airflow_log_retention_days()


def test_the_settings_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NIGHTSHIFT_AIRFLOW_DB_RETENTION_DAYS", "NIGHTSHIFT_AIRFLOW_LOG_RETENTION_DAYS",
                 "NIGHTSHIFT_MAINTENANCE_SCHEDULE"):
        monkeypatch.delenv(name, raising=False)
    assert settings.airflow_db_retention_days() == settings.airflow_log_retention_days() == 30
    assert settings.maintenance_schedule() == "@daily"
    monkeypatch.setenv("NIGHTSHIFT_AIRFLOW_DB_RETENTION_DAYS", "90")
    monkeypatch.setenv("NIGHTSHIFT_MAINTENANCE_SCHEDULE", "none")
    assert settings.airflow_db_retention_days() == 90 and settings.maintenance_schedule() is None


def test_in_a_task_process_db_clean_gets_this_homes_database_not_airflows_placeholder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Airflow 3 replaces AIRFLOW__DATABASE__SQL_ALCHEMY_CONN in a task's process with a placeholder: the
    command would fail on it. It gets the database scripts/airflow.sh gives this AIRFLOW_HOME instead, or the one
    NIGHTSHIFT_AIRFLOW_METADATA_CONN names."""
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "airflow-db-not-allowed:///")
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflow-home"))
    monkeypatch.setenv("NIGHTSHIFT_AIRFLOW_DB", "sqlite")
    monkeypatch.delenv("NIGHTSHIFT_AIRFLOW_METADATA_CONN", raising=False)
    with pytest.raises(maintenance.AirflowCleanFailed, match="set NIGHTSHIFT_AIRFLOW_METADATA_CONN"):
        maintenance.metadata_url()  # a home scripts/airflow.sh never ran in: its database is not for us to guess
    (tmp_path / "airflow-home").mkdir()
    (tmp_path / "airflow-home" / "airflow.db").touch()
    assert maintenance.metadata_url() == f"sqlite:///{tmp_path / 'airflow-home' / 'airflow.db'}"
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "sqlite:////given.db")
    assert maintenance.metadata_url() == "sqlite:////given.db"
    monkeypatch.setenv("NIGHTSHIFT_AIRFLOW_METADATA_CONN", "postgresql+psycopg://team@db/airflow")
    assert maintenance.metadata_url() == "postgresql+psycopg://team@db/airflow"


def test_db_clean_never_cleans_closer_than_the_longest_resumable_days(tmp_path: Path) -> None:
    import yaml

    from tests.conftest import DIGITS_YAML

    data = yaml.safe_load(DIGITS_YAML.read_text())
    data.update(dag_id="slow_retrain", model_name="slow-model", retention={"resumable_days": 45})
    data["dataset"]["asset"] = "slow"
    (tmp_path / "slow.yaml").write_text(yaml.safe_dump(data))
    assert maintenance.resume_floor_days([DIGITS_YAML.parent, tmp_path / "none"]) == 7  # pipelines/digits.yaml
    assert maintenance.resume_floor_days([DIGITS_YAML.parent, tmp_path]) == 45
    # A stub's declaration beside it in a subfolder of the DAG folder (read top level only, its 60 days were missed)
    data.update(dag_id="deep_retrain", model_name="deep-model", retention={"resumable_days": 60})
    data["dataset"]["asset"] = "deep"
    (tmp_path / "team" / "deep").mkdir(parents=True)
    (tmp_path / "team" / "deep" / "deep.yaml").write_text(yaml.safe_dump(data))
    assert maintenance.resume_floor_days([DIGITS_YAML.parent, tmp_path]) == 60


@pytest.mark.parametrize("where", ["nightshift_home", "parent", "root", "relative", "url"])
def test_a_log_folder_that_holds_nightshifts_state_or_is_not_a_local_absolute_path_is_refused(
        where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36 review: base_log_folder set to NIGHTSHIFT_HOME (or a folder above it, or '/') removed every file
    there unwritten for 30 days: the run ledger of a pipeline paused for a month (the lineage page), the dataset
    version records, DVC cache objects of registered versions. A relative folder is relative to whatever folder
    the task runs in, and s3://... is a remote logging URL, not a folder: each is refused, nothing removed."""
    home = settings.home()
    ledger_file = home / "airflow" / "paused_dag" / "runs.jsonl"
    ledger_file.parent.mkdir(parents=True)
    ledger_file.write_text("{}\n")
    os.utime(ledger_file, (time.time() - 60 * 86400,) * 2)
    monkeypatch.chdir(home)
    folder = {"nightshift_home": str(home), "parent": str(home.parent), "root": "/", "relative": "airflow",
              "url": "s3://bucket/logs"}[where]
    with pytest.raises(maintenance.LogPruneFailed, match=r"base_log_folder"):
        maintenance.prune_logs(folder, 30, dry_run=where == "root")
    assert ledger_file.is_file()


def test_a_db_clean_records_its_cut_off_for_the_lineage_page_and_a_dry_run_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36 item 1 (a): the lineage page linked the Airflow page of runs `airflow db clean` had removed; it now
    reads the last clean's cut-off (nightshift.removals.db_cleaned)."""
    import subprocess
    from datetime import UTC, datetime

    from nightshift import removals

    ran: list[list[str]] = []

    def airflow(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        ran.append(command)
        return subprocess.CompletedProcess(command, 0, "cleaned", "")

    monkeypatch.setattr(maintenance, "airflow_command", lambda: "airflow")
    monkeypatch.setattr(maintenance, "_held_runs", lambda url, resume: {})
    monkeypatch.setattr(maintenance.subprocess, "run", airflow)
    now = datetime(2026, 3, 1, tzinfo=UTC)
    maintenance.clean_metadata(30, dry_run=True, now=now, url="sqlite:///x.db")
    assert ran and removals.db_cleaned() is None
    maintenance.clean_metadata(30, now=now, url="sqlite:///x.db")
    cleaned = removals.db_cleaned()
    assert cleaned is not None and cleaned["before"] == datetime(2026, 1, 30, tzinfo=UTC) and cleaned["days"] == 30
