"""MLflow's tracking store and Model Registry on PostgreSQL, as several Airflow workers would share them.

`MLFLOW_TRACKING_URI=postgresql://...` (a database of this module's own, dropped after; SQLAlchemy 2.1's
`postgresql://` driver is psycopg 3, the project's): a training output is logged with
`nightshift.tracking.log_training_run`, registered with `nightshift.registry.register` and found again with
`nightshift.tracking.find_training_run`; a second process on the same URI sees that version and registers
its own, which the first sees. The default store stays the SQLite file in NIGHTSHIFT_HOME.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.airflow_helpers import POSTGRES_URL, REPO, database_url, postgres_answers, postgres_database
from tests.trained_model import write_trained_output

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not postgres_answers(), reason=f"no PostgreSQL answers at {POSTGRES_URL}"),
]

EXPERIMENT = "nightly_retrain"
MODEL = "nightshift-digits"

# What a second Airflow worker does: its own process, the same tracking URI, another training output.
SECOND_WORKER = """
import json, sys
from nightshift import registry, tracking
out, run_key = sys.argv[1], sys.argv[2]
seen = registry.version_by_alias("nightshift-digits", "challenger")
found = tracking.find_training_run("nightly_retrain", "nightly_retrain/first")
run_id = tracking.log_training_run(out, experiment="nightly_retrain", tags={"nightshift.run_key": run_key})
mine = registry.register(run_id, lineage={"dag_run_id": "second"})
print(json.dumps({"seen_version": str(seen.version), "seen_run": seen.run_id, "found": found["run_id"],
                  "registered": mine["version"], "run_id": run_id, "uri": tracking.settings.mlflow_tracking_uri()}))
"""


@pytest.fixture(scope="module")
def tracking_db() -> Iterator[str]:
    with postgres_database("nightshift_test_mlflow") as name:
        yield database_url(name, driver="postgresql")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory, demo_data: Path) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("trained")
    return (write_trained_output(root / "first", demo_data, epochs=1, steps_per_epoch=5),
            write_trained_output(root / "second", demo_data, epochs=1, steps_per_epoch=5, seed=1))


def test_two_processes_share_one_registry_on_postgresql(tracking_db: str, outputs: tuple[Path, Path],
                                                        nightshift_home: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import psycopg

    from nightshift import registry, tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_db)
    first, second = outputs
    run_id = tracking.log_training_run(first, experiment=EXPERIMENT,
                                       tags={"nightshift.run_key": "nightly_retrain/first"})
    registered = registry.register(run_id, lineage={"dag_run_id": "first", "dataset_version": "abc123"})
    assert registered["version"] == "1" and registered["created"]
    found = tracking.find_training_run(EXPERIMENT, "nightly_retrain/first")
    assert found["run_id"] == run_id and found["metrics"]

    # The second process: sees version 1 and @challenger, then registers version 2.
    child = subprocess.run([sys.executable, "-c", SECOND_WORKER, str(second), "nightly_retrain/second"],
                           capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    other = json.loads(child.stdout.strip().splitlines()[-1])
    assert other["uri"] == tracking_db
    assert (other["seen_version"], other["seen_run"], other["found"]) == ("1", run_id, run_id)
    assert other["registered"] == "2" and other["run_id"] != run_id

    # ... which this process sees: the alias moved, both versions carry their lineage.
    challenger = registry.version_by_alias(MODEL, "challenger")
    assert challenger is not None
    assert (str(challenger.version), challenger.run_id) == ("2", other["run_id"])
    assert registry.get_version(MODEL, "1").tags["nightshift.dataset_version"] == "abc123"
    assert tracking.find_training_run(EXPERIMENT, "nightly_retrain/second")["run_id"] == other["run_id"]

    # It is PostgreSQL that holds them, not a SQLite file in NIGHTSHIFT_HOME.
    with psycopg.connect(tracking_db) as conn:
        rows = conn.execute("SELECT version, run_id FROM model_versions WHERE name = %s ORDER BY version",
                            (MODEL,)).fetchall()
    assert rows == [(1, run_id), (2, other["run_id"])]
    assert not (nightshift_home / "mlflow.db").exists()


def test_the_default_store_stays_the_sqlite_file(nightshift_home: Path) -> None:
    from nightshift import settings

    assert settings.mlflow_tracking_uri() == f"sqlite:///{nightshift_home / 'mlflow.db'}"
