"""`airflow standalone` (scripts/airflow.sh) on 127.0.0.1: trigger `nightly_retrain` through the REST API v2
with params, as the UI's trigger form does; once on good data (success, a model version, extra links, the
lineage page), once on corrupt data (fails at validate_data, no new model version)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.airflow_helpers import REPO, registered_versions, stop_model_server

pytestmark = pytest.mark.integration

DAG_ID = "nightly_retrain"
HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _stop_group(proc: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """TERM the process group we started (its leader is `proc`), then KILL what is left."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group (task processes, gunicorn workers)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


class Api:
    def __init__(self, base: str) -> None:
        import requests

        self.base = base
        self.session = requests.Session()

    def login(self) -> None:
        answer = self.session.get(f"{self.base}/auth/token", timeout=30)
        answer.raise_for_status()
        self.session.headers["Authorization"] = f"Bearer {answer.json()['access_token']}"

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.session.get(f"{self.base}{path}", timeout=30, **kwargs)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        answer = self.session.request(method, f"{self.base}/api/v2{path}", json=body, timeout=30)
        assert answer.status_code < 300, f"{method} {path}: {answer.status_code} {answer.text[:500]}"
        return dict(answer.json())

    def wait_run(self, run_id: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        state = "?"
        while time.monotonic() < deadline:
            state = self.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"]
            if state in {"success", "failed"}:
                return str(state)
            time.sleep(3)
        raise AssertionError(f"run {run_id} still {state} after {timeout:.0f}s")

    def task_states(self, run_id: str) -> dict[str, str]:
        out = self.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances")
        return {ti["task_id"]: ti["state"] for ti in out["task_instances"]}


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    home = tmp_path_factory.mktemp("nightshift-standalone")
    port = _free_port()
    env = dict(os.environ)
    env.update({
        "NIGHTSHIFT_HOME": str(home),
        "AIRFLOW_HOME": str(home / "airflow-home"),
        "AIRFLOW_PORT": str(port),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(_free_port()),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(_free_port()),
        "AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL": "5",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "NIGHTSHIFT_RETRAIN_CRON": "none",
    })
    env.pop("MLFLOW_TRACKING_URI", None)
    log_path = home / "standalone.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([str(REPO / "scripts" / "airflow.sh"), "standalone"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        api = Api(f"http://{HOST}:{port}")
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"standalone exited {proc.returncode}: {log_path.read_text()[-3000:]}"
            try:
                api.login()
                if api.get(f"/api/v2/dags/{DAG_ID}").status_code == 200:
                    break
            except Exception:
                pass
            assert time.monotonic() < deadline, f"standalone not ready: {log_path.read_text()[-3000:]}"
            time.sleep(2)
        api.call("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})
        yield {"api": api, "home": home, "env": env, "log": log_path}
    finally:
        try:
            stop_model_server(env)
        finally:
            _stop_group(proc)


def _trigger(api: Api, conf: dict[str, Any]) -> str:
    run = api.call("POST", f"/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})
    return str(run["dag_run_id"])


def test_trigger_with_params_through_the_rest_api_succeeds(standalone: dict[str, Any]) -> None:
    api: Api = standalone["api"]
    run_id = _trigger(api, {"epochs": 5, "workers": 2, "backend": "local", "min_improvement": 0.0})
    state = api.wait_run(run_id, timeout=420)
    states = api.task_states(run_id)
    assert state == "success", f"{states}; log {standalone['log']}"
    assert states["train"] == "success" and states["deploy"] == "success"
    assert states["approve"] == "skipped"  # require_approval defaults to off
    assert registered_versions(standalone["home"]) == ["1"]

    conf = api.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")["conf"]
    assert conf["epochs"] == 5 and conf["min_improvement"] == 0.0

    links = api.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/train/links")
    assert "/runs/" in (links.get("extra_links", links).get("MLflow run") or "")
    links = api.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/register/links")
    assert "/versions/1" in (links.get("extra_links", links).get("Model version") or "")

    page = api.get("/nightshift/lineage")
    assert page.status_code == 200 and run_id in page.text

    events = api.call("GET", "/assets/events?source_dag_id=nightly_retrain&limit=100")["asset_events"]
    mine = {e["uri"]: e["extra"] for e in events if e.get("source_run_id") == run_id}
    assert mine["nightshift://datasets/digits"]["version"]
    assert mine["nightshift://models/nightshift-digits/champion"]["model_version"] == "1"


def test_corrupt_data_fails_at_validation_without_a_new_model(standalone: dict[str, Any],
                                                              tmp_path: Path) -> None:
    import pandas as pd

    from nightshift.data.demo import write_demo_dataset

    api: Api = standalone["api"]
    bad = tmp_path / "corrupt"
    write_demo_dataset(bad, seed=0)
    frame = pd.read_parquet(bad / "train.parquet")
    frame.loc[frame.index[:25], "label"] = 42  # labels outside 0-9
    frame.to_parquet(bad / "train.parquet")
    before = registered_versions(standalone["home"])

    run_id = _trigger(api, {"data_source": str(bad), "epochs": 1, "force": True})
    assert api.wait_run(run_id, timeout=300) == "failed"
    states = api.task_states(run_id)
    assert states["validate_data"] == "failed", states
    assert all(states[t] in {"upstream_failed", None} for t in ("stage_dataset", "train", "register", "deploy"))
    assert registered_versions(standalone["home"]) == before

    answer = api.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/validate_data/logs/1",
                     headers={"Accept": "application/json"})
    assert answer.status_code == 200, answer.text[:500]
    log = json.dumps(answer.json())
    assert "failed the GX suite" in log and "label" in log
    assert "nightly_retrain FAILED" in log

    links = api.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/validate_data/links")
    docs = links.get("extra_links", links).get("GX Data Docs")
    assert docs and docs.startswith("/nightshift/data-docs/"), links
    assert api.get(docs).status_code == 200


def test_require_approval_waits_for_a_person_then_deploys(standalone: dict[str, Any]) -> None:
    api: Api = standalone["api"]
    # force: same data, so it would skip training; min_improvement 0: an equal model passes the gate.
    run_id = _trigger(api, {"epochs": 5, "force": True, "min_improvement": 0.0, "require_approval": True})
    deadline = time.monotonic() + 300
    while (state := api.task_states(run_id).get("approve")) not in {"awaiting_input", "deferred"}:
        assert state not in {"failed", "skipped", "upstream_failed", "success"}, api.task_states(run_id)
        assert time.monotonic() < deadline, f"approve still {state}"
        time.sleep(3)
    assert api.task_states(run_id)["deploy"] in {None, "scheduled", "queued", "none"}
    # Answer as a person would: after the scheduler has seen the task's first process exit. An answer
    # that lands before that executor event (under a second after the pause) races Airflow 3.3's
    # scheduler, which then fails the requeued task ("finished with state success, but ... queued").
    exited = f"Received executor event with state success for task instance TaskInstanceKey(dag_id='{DAG_ID}', " \
             f"task_id='approve', run_id='{run_id}'"
    while exited not in standalone["log"].read_text(errors="replace"):
        assert time.monotonic() < deadline, "the scheduler never saw the approve task's first process exit"
        time.sleep(1)
    api.call("PATCH", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/approve/-1/hitlDetails",
             {"chosen_options": ["Approve"], "params_input": {}})
    assert api.wait_run(run_id, timeout=300) == "success"
    states = api.task_states(run_id)
    assert states["approve"] == "success" and states["deploy"] == "success", states
    assert registered_versions(standalone["home"]) == ["1", "2"]
