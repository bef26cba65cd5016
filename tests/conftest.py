from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(autouse=True)
def nightshift_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own NIGHTSHIFT_HOME, so no test touches ~/.nightshift or another's state."""
    home = tmp_path_factory.mktemp("nightshift-home")
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracking = sys.modules.get("nightshift.tracking")
    if tracking is not None:  # a process configures MLflow once: this test's process starts afresh, on this home
        monkeypatch.setattr(tracking, "_configured", None)
    return home


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo digits dataset, written once per session; tests must not modify it."""
    from nightshift.data.demo import write_demo_dataset

    out = tmp_path_factory.mktemp("demo-data")
    write_demo_dataset(out, seed=0)
    return out


@pytest.fixture
def airflow_env(tmp_path: Path, nightshift_home: Path) -> dict[str, str]:
    """A throwaway AIRFLOW_HOME with this repo's dags and plugins; Airflow is only ever imported in children."""
    env = dict(os.environ)
    env.update({
        "AIRFLOW_HOME": str(tmp_path / "airflow-home"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{tmp_path / 'airflow.db'}",
        "NIGHTSHIFT_HOME": str(nightshift_home),
    })
    return env
