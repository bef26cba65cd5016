"""The gpu pool policy (config/airflow_local_settings.py) under `airflow standalone` (scripts/airflow.sh).

The test DAGs (tests/integration/dags/gpu_pool_slots.py) take `num_workers` and `gpus_per_worker` from
params. `gpu_pool_slots` stays paused: a run triggered through the REST API gets its task instances when
it is created (the API server calls the policy), so their `pool_slots` are read without running anything.
`gpu_pool_slots_scheduled` is unpaused: the scheduler creates its run and calls the policy.
The `gpu` pool has 8 slots here.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.airflow_helpers import REPO, Api, airflow_standalone

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"
DAG_ID = "gpu_pool_slots"
SCHEDULED_DAG_ID = "gpu_pool_slots_scheduled"
POOL_SLOTS = 8


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    home = tmp_path_factory.mktemp("nightshift-pool")
    dags = home / "dags"
    dags.mkdir()
    shutil.copy(REPO / "tests" / "integration" / "dags" / "gpu_pool_slots.py", dags)
    env = {
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "NIGHTSHIFT_GPU_SLOTS": str(POOL_SLOTS),
    }
    with airflow_standalone(home, ready=[DAG_ID, SCHEDULED_DAG_ID], env=env) as running:
        yield {"api": running.api, "log": running.log, "database": running.database}


def test_a_triggered_run_takes_the_slots_its_conf_asks_for(standalone: dict[str, Any]) -> None:
    api: Api = standalone["api"]
    tis = api.task_instances(DAG_ID, api.trigger(DAG_ID, {"workers": 2, "gpus_per_worker": 3}))
    assert tis["train"]["pool"] == "gpu"
    assert tis["train"]["pool_slots"] == 6, tis["train"]
    assert tis["train"]["state"] is None  # created, waiting (the DAG is paused)
    assert tis["train_fixed"]["pool_slots"] == 2  # plain ints: the operator's own parse-time slots
    assert tis["not_horovod"]["pool_slots"] == 1  # same fields, another operator: left alone


def test_a_run_with_the_default_conf_takes_the_param_defaults(standalone: dict[str, Any]) -> None:
    api: Api = standalone["api"]
    tis = api.task_instances(DAG_ID, api.trigger(DAG_ID, {}))
    assert tis["train"]["pool_slots"] == 4, tis["train"]  # Param defaults: 2 workers x 2 GPUs
    tis = api.task_instances(DAG_ID, api.trigger(DAG_ID, {"workers": 3}))
    assert tis["train"]["pool_slots"] == 6, tis["train"]  # conf over the defaults, one key at a time


def test_a_run_asking_for_more_than_the_pool_fails_and_says_why(standalone: dict[str, Any]) -> None:
    api: Api = standalone["api"]
    run_id = api.trigger(DAG_ID, {"workers": 4, "gpus_per_worker": 4})
    tis = api.task_instances(DAG_ID, run_id)
    assert tis["train"]["pool_slots"] == 16
    assert tis["train"]["state"] == "failed", tis["train"]  # instead of `scheduled` for ever
    assert tis["train_fixed"]["state"] is None
    note = api.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")["note"] or ""
    assert f"asks for 16 slots of pool 'gpu' (4 workers x 4 GPUs per worker) but the pool has {POOL_SLOTS}" in note
    assert "airflow pools set gpu 16" in note
    # The API server's log reaches standalone's output through a pipe: give it time to arrive.
    expected = f"{DAG_ID}.train run {run_id}: train asks for 16 slots"
    deadline = time.monotonic() + 60
    while expected not in (log := standalone["log"].read_text(errors="replace")) and time.monotonic() < deadline:
        time.sleep(1)
    assert expected in log


def test_the_scheduler_sizes_a_scheduled_run_from_the_param_defaults(standalone: dict[str, Any]) -> None:
    api: Api = standalone["api"]
    api.call("PATCH", f"/dags/{SCHEDULED_DAG_ID}", {"is_paused": False})
    deadline = time.monotonic() + 120
    while not (runs := api.call("GET", f"/dags/{SCHEDULED_DAG_ID}/dagRuns")["dag_runs"]) \
            or runs[0]["state"] not in {"success", "failed"}:
        assert time.monotonic() < deadline, f"scheduled run not finished: {runs}"
        time.sleep(2)
    run = runs[0]
    assert run["run_type"] == "scheduled" and run["state"] == "failed", run
    train = api.task_instances(SCHEDULED_DAG_ID, run["dag_run_id"])["train"]
    assert train["pool_slots"] == 16 and train["state"] == "failed"  # defaults: 4 workers x 4 GPUs > 8
    assert train["try_number"] == 0  # it never ran
    assert "asks for 16 slots of pool 'gpu'" in (run["note"] or "")
    log = standalone["log"].read_text(errors="replace")
    assert any(line.startswith("scheduler") and f"{SCHEDULED_DAG_ID}.train run" in line and "asks for 16" in line
               for line in log.splitlines())
