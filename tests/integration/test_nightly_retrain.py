"""`airflow dags test nightly_retrain` on the demo data, twice: real Airflow, Horovod, MLflow, model server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.airflow_helpers import demo_module, registered_versions, stop_model_server

pytestmark = pytest.mark.integration

CONF = {"epochs": 5, "workers": 2, "backend": "local"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One NIGHTSHIFT_HOME and AIRFLOW_HOME for the module; the first run happens here."""
    module = demo_module()
    home = tmp_path_factory.mktemp("nightshift-dags-test")
    env = module.airflow_env(home, home / "airflow-home")
    env["NIGHTSHIFT_RETRAIN_CRON"] = "none"
    module.prepare_airflow(env)
    state: dict[str, Any] = {"module": module, "env": env, "home": home}
    try:
        code, record, seconds = module.run_dag(env, CONF, stream=False, timeout=900)
        state.update(first=(code, record, seconds))
        yield state
    finally:
        stop_model_server(env)


def test_first_run_registers_deploys_and_serves(demo: dict[str, Any]) -> None:
    code, record, _ = demo["first"]
    assert code == 0, "airflow dags test failed"
    assert record and record["status"] == "success", record
    assert record["gate"]["passed"] is True
    assert record["model_version"] == "1" and record["deploy_status"] == "promoted"
    assert record["dataset_version"] and record["mlflow_run_id"]
    assert registered_versions(demo["home"]) == ["1"]
    data = demo["home"] / "demo-data" / "digits"  # the empty data_source default wrote it here
    predicted, labels = demo["module"].predict(record["serving_url"], data, rows=20)
    assert len(predicted) == 20 and sum(p == t for p, t in zip(predicted, labels, strict=True)) >= 16


def test_second_run_on_unchanged_data_skips_training(demo: dict[str, Any]) -> None:
    first = demo["first"][1]
    code, record, _ = demo["module"].run_dag(demo["env"], CONF, stream=False, timeout=900)
    assert code == 0
    assert record and record["status"] == "success"
    if record["code_version"] == first["code_version"]:
        assert record["outcome"].startswith("training skipped"), record
        assert record["mlflow_run_id"] is None
    else:  # someone committed in between: it retrains, and the same data must not promote a copy
        assert record["serving_url"] is None, record
    assert record["model_version"] is None
    assert registered_versions(demo["home"]) == ["1"]
    ledger = Path(demo["home"]) / "airflow" / "nightly_retrain" / "runs.jsonl"
    assert len(ledger.read_text().splitlines()) == 2
