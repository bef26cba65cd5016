"""`make demo` on the metadata database scripts/airflow.sh would choose (nightshift.settings.airflow_database):
its per-task progress lines on PostgreSQL, and two processes making a home's database at once."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.test_airflow_script import (
    POSTGRES_URL,
    _drop_pg_database,
    _home_database,
    _pg_database_exists,
    needs_postgres,
)

pytestmark = needs_postgres


@pytest.fixture
def pg_database() -> Iterator[str]:
    import psycopg
    from psycopg import sql

    name = f"nightshift_test_{secrets.token_hex(4)}"
    with psycopg.connect(POSTGRES_URL, dbname="postgres", connect_timeout=10, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        _drop_pg_database(name)


def test_progress_lines_from_a_postgres_metadata_db(pg_database: str) -> None:
    import psycopg
    from sqlalchemy.engine import make_url

    from scripts import demo

    with psycopg.connect(POSTGRES_URL, dbname=pg_database, autocommit=True) as conn:
        conn.execute("CREATE TABLE dag_run (id INTEGER PRIMARY KEY, dag_id TEXT, run_id TEXT)")
        conn.execute("CREATE TABLE task_instance (dag_id TEXT, run_id TEXT, task_id TEXT, map_index INT, "
                     "state TEXT, try_number INT, start_date TIMESTAMPTZ, end_date TIMESTAMPTZ)")
        conn.execute("INSERT INTO dag_run VALUES (1, 'nightly_retrain', 'old'), (2, 'nightly_retrain', 'new')")
        conn.execute("INSERT INTO task_instance VALUES "
                     "('nightly_retrain', 'old', 'train', -1, 'success', 1, '2026-01-01 00:00:00+00', "
                     "'2026-01-01 00:01:00+00'), "
                     "('nightly_retrain', 'new', 'validate_data', -1, 'success', 1, '2026-11-22 02:00:59.5+00', "
                     "'2026-11-22 02:01:14.25+00'), "
                     "('nightly_retrain', 'new', 'train', -1, 'running', 1, '2026-11-22 02:01:20+00', NULL)")
    # The URL Airflow is given (SQLAlchemy's, naming psycopg 3), as scripts/airflow.sh and the demo set it.
    url = make_url(POSTGRES_URL).set(drivername="postgresql+psycopg", database=pg_database)
    env = {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": url.render_as_string(hide_password=False)}
    db = demo._metadata_db(env)
    assert db is not None, "the demo shows no progress on PostgreSQL"
    last = demo._query(db, "SELECT COALESCE(MAX(id), 0) FROM dag_run")
    assert last == [(2,)]
    lines: list[str] = []
    watcher = demo.TaskProgress(db, 1, lines.append)
    watcher.poll()
    watcher.poll()
    assert [line.split() for line in lines] == [["validate_data", "success", "14.8s"]]


def test_two_processes_making_the_database_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nightshift import settings

    airflow_home = tmp_path / "airflow-home"
    name = _home_database(airflow_home)
    for var in ("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "NIGHTSHIFT_AIRFLOW_PG_DB"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AIRFLOW_HOME", str(airflow_home))
    monkeypatch.setenv("NIGHTSHIFT_AIRFLOW_DB", "auto")
    monkeypatch.setenv("NIGHTSHIFT_POSTGRES_URL", POSTGRES_URL)
    start = threading.Barrier(6)
    results: list[object] = []

    def make() -> None:
        start.wait()
        try:
            results.append(settings.airflow_database())
        except Exception as err:  # reported by the assertion below
            results.append(err)

    threads = [threading.Thread(target=make) for _ in range(6)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not [r for r in results if isinstance(r, Exception)], results
        assert len(results) == 6 and {r.url for r in results} == {results[0].url}  # type: ignore[attr-defined]
        assert sum(r.created for r in results) == 1, results  # type: ignore[attr-defined]
        assert _pg_database_exists(name)
    finally:
        _drop_pg_database(name)
