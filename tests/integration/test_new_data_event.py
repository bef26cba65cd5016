"""Retrain when new data lands, under `airflow standalone` (scripts/airflow.sh: scheduler, dag-processor,
triggerer, API server) and a private redis-server: with NIGHTSHIFT_EVENTS_REDIS_URL set and no cron, the
triggerer subscribes nightly_retrain's AssetWatcher to the channel; one `nightshift publish-data DIR` makes
exactly one asset-triggered run, whose asset event carries DIR and whose validate_data, stage_dataset and
train run on DIR's data."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.airflow_helpers import REPO, Api, airflow_database, free_port, stop_group, stop_model_server
from tests.integration.redis_helpers import RedisServer, redis_server

pytestmark = pytest.mark.integration

DAG_ID = "nightly_retrain"
NEW_DATA_URI = "nightshift://events/new-data"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[dict[str, Any]]:
    home = tmp_path_factory.mktemp("nightshift-events")
    port = free_port()
    channel = f"nightshift.new-data.test-{secrets.token_hex(4)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NIGHTSHIFT_EVENTS_", "AIRFLOW_CONN_"))}
    for name in ("MLFLOW_TRACKING_URI", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "NIGHTSHIFT_MLFLOW_UI_URL"):
        env.pop(name, None)
    env.update({
        "NIGHTSHIFT_HOME": str(home),
        "AIRFLOW_HOME": str(home / "airflow-home"),
        "AIRFLOW_PORT": str(port),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL": "5",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "NIGHTSHIFT_MLFLOW_UI_PORT": "none",
        "NIGHTSHIFT_VENV_BIN": str(BIN),
        # The event alone starts runs: no cron run can be mistaken for the event's.
        "NIGHTSHIFT_RETRAIN_CRON": "none",
        "NIGHTSHIFT_EVENTS_REDIS_URL": redis.url,
        "NIGHTSHIFT_EVENTS_CHANNEL": channel,
        "NIGHTSHIFT_EVENTS_POLL_S": "0.5",
    })
    log_path = home / "standalone.log"
    with airflow_database("nightshift_events_test") as database:
        env.update(database.env)
        with log_path.open("wb") as log:
            proc = subprocess.Popen([str(REPO / "scripts" / "airflow.sh"), "standalone"], env=env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            api = Api(f"http://127.0.0.1:{port}")
            api.wait_ready(DAG_ID, lambda: proc.poll() is None, 300,
                           lambda: log_path.read_text(errors="replace")[-3000:])
            api.call("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})
            yield {"api": api, "home": home, "env": env, "log": log_path, "channel": channel, "redis": redis}
        finally:
            try:
                stop_model_server(env)
            finally:
                stop_group(proc)


def _subscribers(redis: RedisServer, channel: str) -> int:
    import redis as redis_py

    client = redis_py.Redis.from_url(redis.url)
    try:
        return int(dict(client.pubsub_numsub(channel)).get(channel.encode(), 0))
    finally:
        client.close()


def _wait_subscribed(standalone: dict[str, Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _subscribers(standalone["redis"], standalone["channel"]) < 1:
        assert time.monotonic() < deadline, (
            f"the triggerer never subscribed to {standalone['channel']}: "
            f"{standalone['log'].read_text(errors='replace')[-3000:]}")
        time.sleep(1)


def _runs(api: Api) -> list[dict[str, Any]]:
    return list(api.call("GET", f"/dags/{DAG_ID}/dagRuns?limit=100")["dag_runs"])


def _wait_run_done(api: Api, run_id: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    state = "?"
    while time.monotonic() < deadline:
        state = api.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"]
        if state in {"success", "failed"}:
            return str(state)
        time.sleep(3)
    raise AssertionError(f"run {run_id} still {state} after {timeout:.0f}s")


def _xcom(api: Api, run_id: str, task_id: str) -> Any:
    entry = api.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value"
                            "?deserialize=true&stringify=false")
    return entry["value"]


def test_one_publish_starts_exactly_one_run_on_that_data(standalone: dict[str, Any]) -> None:
    from nightshift.data.demo import write_demo_dataset

    api: Api = standalone["api"]
    landed = standalone["home"] / "data" / "landed-1"  # under a data root (NIGHTSHIFT_HOME/data)
    write_demo_dataset(landed, seed=7)  # not the demo data a run without a source would use
    assert _runs(api) == []

    # The triggerer runs the AssetWatcher's trigger once the DAG is parsed; it subscribes to the channel.
    _wait_subscribed(standalone, timeout=300)
    proc = subprocess.run([str(BIN / "nightshift"), "publish-data", str(landed)], env=standalone["env"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["receivers"] == 1

    deadline = time.monotonic() + 180
    while not (runs := _runs(api)):
        assert time.monotonic() < deadline, f"no run after the event: {standalone['log'].read_text()[-3000:]}"
        time.sleep(2)
    run_id = runs[0]["dag_run_id"]
    assert runs[0]["run_type"] == "asset_triggered", runs[0]

    state = _wait_run_done(api, run_id, timeout=600)
    states = {t: ti["state"] for t, ti in api.task_instances(DAG_ID, run_id).items()}
    assert state == "success", f"{states}; log {standalone['log']}"
    assert states["validate_data"] == states["stage_dataset"] == states["train"] == "success", states

    # The run's triggering asset event is the one published, carrying the data source.
    events = api.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/upstreamAssetEvents")["asset_events"]
    assert [e["uri"] for e in events] == [NEW_DATA_URI]
    event = json.loads(events[0]["extra"]["payload"]["data"])
    assert event["source"] == str(landed.resolve())

    # validate_data read it (no data_source Param given), stage_dataset versioned it, train trained on that version.
    assert _xcom(api, run_id, "validate_data")["path"] == str(landed.resolve())
    staged = _xcom(api, run_id, "stage_dataset")
    assert staged["source"] == str(landed.resolve())
    answer = api.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/validate_data/logs/1",
                     headers={"Accept": "application/json"})
    assert "Started by the new-data event" in json.dumps(answer.json())
    train_log = api.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/train/logs/1",
                        headers={"Accept": "application/json"})
    assert staged["hash"] in json.dumps(train_log.json())  # the trainer's --tag nightshift.dataset_version

    # One publish, one run: nothing else was started meanwhile, and the watcher listens again for the next event.
    assert [r["dag_run_id"] for r in _runs(api)] == [run_id]
    _wait_subscribed(standalone, timeout=120)
