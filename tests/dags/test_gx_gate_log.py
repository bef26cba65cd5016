"""The `validate_data` task's log on good data: no ERROR line, no progress bar, no GX import chatter.

The task runs as Airflow runs it on a worker: `supervise_task` forks the task runner, which parses
`dags/nightly_retrain.py` and executes `validate_data`; the supervisor writes the task's log file, logging
what the task wrote to stderr (e.g. tqdm's progress bars) at ERROR. Only the execution API is replaced, by
an in-memory transport that answers the calls a task makes (no API server, no metadata DB).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.dags.conftest import REPO, run_json

pytestmark = pytest.mark.integration

SUPERVISED_TASK = """
import json, uuid
import httpx
from airflow.sdk.api.client import Client
from airflow.sdk.api.datamodels._generated import BundleInfo, TaskInstance
from airflow.sdk.execution_time.supervisor import supervise_task

data_source, log_path = DATA_SOURCE, LOG_PATH
calls = []

def execution_api(request):
    calls.append([request.method, request.url.path])
    if request.url.path.endswith("/run"):  # the task's run context: the DAG run and its conf
        return httpx.Response(200, json={"max_tries": 0, "dag_run": {
            "dag_id": "nightly_retrain", "run_id": "manual__log_test", "run_type": "manual",
            "state": "running", "run_after": "2026-01-01T00:00:00Z", "logical_date": "2026-01-01T00:00:00Z",
            "start_date": "2026-01-01T00:00:00Z", "consumed_asset_events": [],
            # required from Airflow 3.3.1 on, optional before
            "data_interval_start": None, "data_interval_end": None, "end_date": None, "partition_key": None,
            "conf": {"data_source": data_source}}})
    return httpx.Response(200, json={})

ti = TaskInstance(id=uuid.uuid4(), task_id="validate_data", dag_id="nightly_retrain", run_id="manual__log_test",
                  try_number=1, map_index=-1, dag_version_id=uuid.uuid4())
code = supervise_task(ti=ti, bundle_info=BundleInfo(name="dags-folder", version=None),
                      dag_rel_path="nightly_retrain.py", token="", log_path=log_path,
                      client=Client(base_url="http://execution-api.invalid", token="",
                                    transport=httpx.MockTransport(execution_api)))
print(json.dumps({"exit_code": code, "calls": calls}))
"""


@pytest.fixture(scope="module")
def gate_log(tmp_path_factory: pytest.TempPathFactory, demo_data: Path) -> tuple[dict, list[dict]]:
    home = tmp_path_factory.mktemp("gx-gate-log")
    env = dict(os.environ)
    env.update({
        "AIRFLOW_HOME": str(home / "airflow-home"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "NIGHTSHIFT_HOME": str(home / "nightshift"),
        "NIGHTSHIFT_DATA_ROOTS": str(demo_data),
        "NIGHTSHIFT_RETRAIN_CRON": "none",
    })
    log_path = home / "validate_data.log"
    code = SUPERVISED_TASK.replace("DATA_SOURCE", repr(str(demo_data))).replace("LOG_PATH", repr(str(log_path)))
    result = run_json(code, env)
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    return result, lines


def test_gate_passes_good_data(gate_log: tuple[dict, list[dict]]) -> None:
    result, lines = gate_log
    events = [str(line.get("event", "")) for line in lines]
    assert result["exit_code"] == 0, "\n".join(events[-20:])
    passed = [e for e in events if e.startswith("GX suite passed on")]
    assert len(passed) == 3, events  # train, validation, test: GX really ran the suite
    assert any(method == "POST" and path.endswith("/validate_data/return_value")
               for method, path in result["calls"]), "the task pushed no return value"


def test_no_error_line_on_good_data(gate_log: tuple[dict, list[dict]]) -> None:
    _, lines = gate_log
    errors = [line for line in lines if str(line.get("level", "")).lower() in {"error", "critical"}]
    assert errors == [], [str(e.get("event"))[:200] for e in errors]


def test_no_progress_bars_or_gx_import_chatter(gate_log: tuple[dict, list[dict]]) -> None:
    _, lines = gate_log
    events = [str(line.get("event", "")) for line in lines]
    assert not [e for e in events if "Calculating Metrics" in e or "it/s]" in e], "a tqdm progress bar"
    assert not [e for e in events if "Skipping registering function" in e]
    gx_info = [e for line, e in zip(lines, events, strict=True)
               if str(line.get("logger", "")).startswith("great_expectations") and line.get("level") == "info"]
    assert gx_info == [], gx_info[:5]
