"""The cluster contract end to end, with a real MLflow tracking server and the fake Kubernetes API.

The trainer's rank 0 logs to the server named in the pods' env; the operator then finds the run there
by its run key. Nothing is read from the Airflow worker's disk: the training output directory is gone
before the operator looks.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nightshift.netutil import free_port
from tests.trained_model import write_trained_output
from tests.unit.operators import fake_kubernetes as fk
from tests.unit.operators.conftest import horovod_operator

pytestmark = pytest.mark.integration

RUN_ID = "manual__contract"
RUN_KEY = f"nightly_retrain/{RUN_ID}"


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1 with a SQLite store and proxied artifacts of its own."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    mlflow = str(Path(sys.executable).with_name("mlflow"))
    log = (root / "server.log").open("wb")
    proc = subprocess.Popen(
        [mlflow, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "art")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    url = f"http://127.0.0.1:{port}"
    try:
        import requests

        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (root / "server.log").read_text()[-2000:]
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, "mlflow server did not start"
            time.sleep(0.5)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


class RecordingTI(SimpleNamespace):
    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed[key] = value


def test_the_result_comes_back_through_the_tracking_server(tracking_server: str, demo_data: Path,
                                                          nightshift_home: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from nightshift.tracking import log_training_run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_server)
    workspace = nightshift_home / "workspaces" / "nightly_retrain" / RUN_ID
    out = write_trained_output(workspace / "model", demo_data, epochs=1)
    cluster = fk.FakeCluster(lambda name: fk.succeeding(name, ["training done"]))
    op = horovod_operator(
        task_id="train", num_workers="{{ params.workers }}", gpus_per_worker="0", backend="kubernetes",
        image="ghcr.io/example/trainer:1", namespace="ml", poll_interval=0.0,
        command=["python", "-m", "nightshift.train", "--data", str(workspace / "data"), "--out", str(out)],
        mlflow_experiment="nightly_retrain", mlflow_run_key="{{ run_key }}")
    op.__dict__["hook"] = fk.FakeHook(cluster)
    op.render_template_fields({"params": {"workers": 2}, "run_key": RUN_KEY})

    # What rank 0 does in the pod: log to the server its env names, then the pod (and its disk view) is gone.
    submitted = op.build_manifest(op.identity_from({"ti": SimpleNamespace(
        dag_id="nightly_retrain", task_id="train", run_id=RUN_ID, try_number=1, map_index=-1)}), "ml")
    pod_env = {e["name"]: e["value"] for e in
               submitted["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["env"]}
    assert pod_env["MLFLOW_TRACKING_URI"] == tracking_server
    logged = log_training_run(out, experiment="nightly_retrain", tags={"nightshift.run_key": RUN_KEY})
    shutil.rmtree(workspace)

    ti = RecordingTI(dag_id="nightly_retrain", task_id="train", run_id=RUN_ID, try_number=1, map_index=-1,
                     pushed={})
    result = op.execute({"ti": ti, "run_id": RUN_ID})  # type: ignore[arg-type]
    assert cluster.created and result["backend"] == "kubernetes"
    assert result["mlflow_run_id"] == logged == ti.pushed["mlflow_run_id"]
    assert result["model_uri"].startswith("models:/") or result["model_uri"].startswith("runs:/")
    assert 0 < result["metrics"]["val_accuracy"] <= 1


def test_a_job_whose_pods_could_not_log_fails_with_the_reason(tracking_server: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from operators.errors import TrainingResultMissing

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_server)
    cluster = fk.FakeCluster(lambda name: fk.succeeding(name, ["training done"]))
    home = os.environ["NIGHTSHIFT_HOME"]
    op = horovod_operator(
        task_id="train", num_workers=1, backend="kubernetes", image="ghcr.io/example/trainer:1", namespace="ml",
        poll_interval=0.0, command=["python", "-m", "nightshift.train", "--out", f"{home}/out"],
        mlflow_experiment="nightly_retrain", mlflow_run_key="nightly_retrain/never-logged")
    op.__dict__["hook"] = fk.FakeHook(cluster)
    ti = RecordingTI(dag_id="nightly_retrain", task_id="train", run_id="r", try_number=1, map_index=-1, pushed={})
    with pytest.raises(TrainingResultMissing,
                       match=r"no complete run tagged nightshift\.run_key=.nightly_retrain/nev"):
        op.execute({"ti": ti, "run_id": "r"})  # type: ignore[arg-type]
