"""`airflow db clean` as the maintenance DAG runs it (nightshift.maintenance.clean_metadata), on a metadata database
of this module's own (PostgreSQL when it answers, else SQLite), migrated by the real `airflow db migrate`: rows
older than the retention go, recent ones stay; a command that fails fails the call with what it said."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from nightshift import maintenance
from tests.integration.airflow_helpers import REPO, airflow_database, database_url

pytestmark = [pytest.mark.integration, pytest.mark.slow]

AIRFLOW = str(Path(sys.executable).with_name("airflow"))
NOW = datetime.now(UTC)
# event -> days ago: written with Airflow's own model (the `log` table, the audit log that grows with every run)
EVENTS = {"nightshift-old": 40, "nightshift-older": 400, "nightshift-recent": 2}

ROWS = """
import json, sys
from datetime import datetime, timedelta, UTC
from airflow.models.log import Log
from airflow.utils.session import create_session
events = json.loads(sys.argv[1])
now = datetime.fromisoformat(sys.argv[2])
with create_session() as session:
    if events:
        for event, days in events.items():
            row = Log(event=event)
            row.dttm = now - timedelta(days=days)
            session.add(row)
    else:
        print(json.dumps(sorted(e for (e,) in session.query(Log.event).filter(Log.event.like("nightshift-%")))))
"""


@pytest.fixture(scope="module")
def metadata(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    home = tmp_path_factory.mktemp("airflow-home")
    with airflow_database("nightshift_maint") as db:
        url = database_url(db.name) if db.kind == "postgres" else f"sqlite:///{home / 'airflow.db'}"
        env = dict(os.environ, AIRFLOW_HOME=str(home), AIRFLOW__CORE__LOAD_EXAMPLES="False",
                   AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=url)
        subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True, timeout=600)
        yield {"env": env, "url": url, "home": home}


def rows(env: dict[str, str], events: dict[str, int] | None = None) -> list[str]:
    done = subprocess.run([sys.executable, "-c", ROWS, json.dumps(events or {}), NOW.isoformat()], env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1]) if not events else []


def test_db_clean_removes_rows_older_than_the_retention_and_keeps_recent_ones(
        metadata: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    env = metadata["env"]
    rows(env, EVENTS)
    assert rows(env) == sorted(EVENTS)
    monkeypatch.setenv("AIRFLOW_HOME", env["AIRFLOW_HOME"])
    # As in a task's process: Airflow 3 put its placeholder where the database was; the call gives the real one.
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "airflow-db-not-allowed:///")

    dry = maintenance.clean_metadata(30, url=metadata["url"], floor_days=0, dry_run=True, now=NOW)
    assert rows(env) == sorted(EVENTS) and "--dry-run" in dry["command"]

    result = maintenance.clean_metadata(30, url=metadata["url"], floor_days=0, now=NOW)
    assert result["before"] == (NOW - timedelta(days=30)).isoformat(timespec="seconds")
    assert "--skip-archive" in result["command"] and "--error-on-cleanup-failure" in result["command"]
    assert rows(env) == ["nightshift-recent"]

    # the longest resumable_days of a declared pipeline is a floor: 1 day asked, 3 days cleaned
    rows(env, {"nightshift-2d": 2})
    assert maintenance.clean_metadata(1, url=metadata["url"], floor_days=3, now=NOW)["days"] == 3
    assert rows(env) == ["nightshift-2d", "nightshift-recent"]


def test_a_db_clean_that_fails_fails_loudly_with_what_airflow_said(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    # the runs a resume needs are read first: a database that cannot be opened fails there, naming it
    with pytest.raises(maintenance.AirflowCleanFailed, match=r"exited with status [1-9]|metadata database failed"):
        maintenance.clean_metadata(30, url=f"sqlite:///{tmp_path / 'missing' / 'airflow.db'}", floor_days=0)


def test_the_maintenance_dag_cleans_and_prunes_through_airflow(metadata: dict[str, Any], tmp_path: Path) -> None:
    """`airflow dags test nightshift_maintenance`: the DAG file parses among the project's DAGs and both tasks run,
    reading Airflow's own configuration (its base_log_folder, its DAG folder's declarations)."""
    logs = tmp_path / "logs"
    old = logs / "dag_id=nightly_retrain" / "run_id=old" / "task_id=train" / "attempt=1.log"
    old.parent.mkdir(parents=True)
    old.write_text("old\n")
    then = (NOW - timedelta(days=40)).timestamp()
    os.utime(old, (then, then))
    env = dict(metadata["env"], AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "dags"),
               AIRFLOW__LOGGING__BASE_LOG_FOLDER=str(logs), NIGHTSHIFT_PIPELINES=str(REPO / "pipelines"))
    done = subprocess.run([AIRFLOW, "dags", "test", "nightshift_maintenance"], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    assert "airflow db clean before" in said and "Removed 1 log file(s)" in said, said[-4000:]
    assert not old.exists() and not old.parent.exists()


RUNS = """
import json, sys, uuid
from datetime import datetime, timedelta, UTC
from sqlalchemy import create_engine, text
engine = create_engine(sys.argv[1])
now = datetime.fromisoformat(sys.argv[2])
ago = lambda days: now - timedelta(days=days)
with engine.begin() as db:
    if sys.argv[3] == "write":
        # run_id -> (state, started days ago, ended days ago); each run has one task instance started with it
        runs = {"rv-running": ("running", 40, None), "rv-failed-lately": ("failed", 12, 1),
                "rv-failed-long-ago": ("failed", 60, 59), "rv-recent": ("success", 1, 1)}
        for run_id, (state, started, ended) in runs.items():
            db.execute(text("INSERT INTO dag_run (dag_id, run_id, run_type, run_after, start_date, end_date, state, "
                            "clear_number, span_status) VALUES ('rv_dag', :r, 'manual', :s, :s, :e, :st, 0, "
                            "'not_started')"),
                       {"r": run_id, "s": ago(started), "e": None if ended is None else ago(ended), "st": state})
            db.execute(text("INSERT INTO task_instance (id, task_id, dag_id, run_id, map_index, try_number, "
                            "max_tries, pool, pool_slots, state, start_date, span_status) VALUES (:i, 'train', "
                            "'rv_dag', :r, -1, 1, 0, 'default_pool', 1, :st, :s, 'not_started')"),
                       {"i": str(uuid.uuid4()), "r": run_id, "s": ago(started),
                        "st": "deferred" if state == "running" else state})
    else:
        found = db.execute(text("SELECT dr.run_id FROM dag_run dr JOIN task_instance ti ON ti.dag_id = dr.dag_id "
                                "AND ti.run_id = dr.run_id WHERE dr.dag_id = 'rv_dag'")).scalars()
        print(json.dumps(sorted(found)))
"""


def test_db_clean_keeps_the_rows_of_a_run_still_running_or_still_resumable(
        metadata: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36 review: Airflow's db clean takes a dag_run and a task_instance by their start_date alone, whatever
    their state (airflow/utils/db_cleanup.py: no state filter; only the newest non-manual run of a DAG is kept).
    A run still running (its task deferred) that started 40 days ago, and a failed run that started 12 days ago
    and failed yesterday (resumable for 7 days from its last write, as gc keeps its workspace) lost their rows:
    neither could be resumed, the running one vanished under the scheduler. They stay; the finished ones go (a
    run started before the oldest held one stays too: the cut-off moves before it)."""
    def runs(what: str) -> list[str]:
        done = subprocess.run([sys.executable, "-c", RUNS, metadata["url"], NOW.isoformat(), what],
                              env=metadata["env"], capture_output=True, text=True, timeout=300, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1]) if what == "read" else []

    runs("write")
    monkeypatch.setenv("AIRFLOW_HOME", metadata["env"]["AIRFLOW_HOME"])
    result = maintenance.clean_metadata(10, url=metadata["url"], floor_days=7, now=NOW)
    assert runs("read") == ["rv-failed-lately", "rv-recent", "rv-running"]
    assert result["before"] <= (NOW - timedelta(days=40)).isoformat(timespec="seconds")
    assert result["held_by"] == ["rv_dag rv-failed-lately (failed)", "rv_dag rv-running (running)"]
