"""`airflow db clean` as the maintenance DAG runs it (nightshift.maintenance.clean_metadata), on a metadata database
of this module's own (PostgreSQL when it answers, else SQLite), migrated by the real `airflow db migrate`: rows
older than the retention go, recent ones stay; a command that fails fails the call with what it said."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from nightshift import maintenance
from tests.integration.airflow_helpers import airflow_database, database_url

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
    import os

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
    with pytest.raises(maintenance.AirflowCleanFailed, match=r"exited with status [1-9]"):
        maintenance.clean_metadata(30, url=f"sqlite:///{tmp_path / 'missing' / 'airflow.db'}", floor_days=0)
