"""A queued MPIJob preempted by Kueue mid-training resumes from its checkpoint within the same task try.

The fake API plays Kueue and the MPI Operator (admission, eviction, readmission); the pods' work is real:
the launcher's training command runs under a local horovodrun, is killed when the job is evicted (its
pods deleted) and started again when it is readmitted. The final weights are compared bit for bit with
an uninterrupted run's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.integration.horovod_helpers import TRAIN_ARGS, assert_bitwise_equal, run, weights
from tests.unit.operators import fake_kubernetes as fk
from tests.unit.operators import fake_kueue as fq
from tests.unit.operators.conftest import horovod_operator, make_context

pytestmark = pytest.mark.integration


def test_preemption_waits_for_readmission_and_resumes_bit_for_bit(demo_data: Path, nightshift_home: Path,
                                                                  tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.nightshift.svc:5000")  # the trainer logs nothing
    data = nightshift_home / "data" / "digits"  # the shared volume is NIGHTSHIFT_HOME
    shutil.copytree(demo_data, data)
    reference = tmp_path / "reference"
    run(data, reference / "out", reference / "ckpt")

    out = nightshift_home / "workspaces" / "nightly_retrain" / "preempted" / "model"
    context = make_context(run_id="preempted")
    checkpoints = nightshift_home / "checkpoints" / "nightly_retrain" / "preempted" / "train"

    def first_checkpoint_written() -> bool:
        return any(checkpoints.glob("ckpt-*.pt"))

    kubelet = fq.ProcessKubelet(ranks=2, log_path=tmp_path / "pods.log")
    cluster = fq.KueueCluster(
        lambda name: fq.Lifecycle(pending_polls=2, evict_when=first_checkpoint_written, readmit_polls=3,
                                  kubelet=kubelet),
        local_queues=[fq.local_queue("nightly", "gpu")], cluster_queues=[fq.cluster_queue("gpu", 8)])
    op = horovod_operator(
        task_id="train", num_workers=2, gpus_per_worker=0, backend="kubernetes", image="trainer:1", namespace="ml",
        kueue_queue="nightly", poll_interval=0.2, startup_timeout=120,
        command=["python", "-m", "nightshift.train", "--data", str(data), "--out", str(out), *TRAIN_ARGS])
    op.__dict__["hook"] = fk.FakeHook(cluster)
    try:
        op.execute(context)  # type: ignore[arg-type]
    finally:
        kubelet.stop()

    assert cluster.transitions == ["running", "evicted", "running", "succeeded"], (tmp_path / "pods.log").read_text()
    assert kubelet.starts == 2 and len(cluster.created) == 1  # one job, one try, started twice by Kueue
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["resumed_from_step"], summary  # the second admission resumed, it did not start over
    assert summary["steps_run"] < summary["steps"]
    assert_bitwise_equal(weights(out), weights(reference / "out"))
