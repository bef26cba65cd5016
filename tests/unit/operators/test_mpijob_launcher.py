from __future__ import annotations

import logging
from typing import Any

import pytest

from operators import errors
from operators.mpijob_launcher import MPIJobLauncher, error_for
from operators.mpijob_spec import MPIJobConfig, TaskIdentity, build_mpijob, job_name
from tests.unit.operators import fake_kubernetes as fk

IDENTITY = TaskIdentity("nightly_retrain", "train", "manual__1", 1)
NAME = job_name(IDENTITY)


class FakeClock:
    """Time that moves only when the launcher sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def manifest(identity: TaskIdentity = IDENTITY) -> dict[str, Any]:
    cfg = MPIJobConfig(image="ghcr.io/example/trainer:1", command=["python", "-m", "nightshift.train"], num_workers=2)
    return build_mpijob(cfg, identity)


def launcher(cluster: fk.FakeCluster, clock: FakeClock, startup_timeout: float = 60.0) -> MPIJobLauncher:
    return MPIJobLauncher(
        cluster,
        cluster,
        "default",
        poll_interval=5.0,
        startup_timeout=startup_timeout,
        clock=clock,
        sleep=clock.sleep,
    )


def test_success_follows_conditions_and_streams_the_launcher_log(caplog: pytest.LogCaptureFixture) -> None:
    log = ["epoch 1/2 step 10 loss 1.23 samples/s 900", "resumed from checkpoint step-10 step 10", "done"]
    cluster = fk.FakeCluster(lambda name: fk.succeeding(name, log))
    clock = FakeClock()
    with caplog.at_level(logging.INFO):
        verdict = launcher(cluster, clock).run(manifest())
    assert verdict.succeeded
    text = caplog.text
    for line in log:  # every line, whole, although the fake streams 7-byte chunks
        assert f"[launcher] {line}" in text
    assert "is Created" in text and "is Running" in text and "is Succeeded" in text
    # the launcher's log was followed exactly once, while it ran
    assert cluster.log_reads == [(f"{NAME}-launcher-x7k2p", True)]
    assert cluster.deleted == []  # deleting is the operator's policy, not the launcher's


def test_conflict_on_the_same_try_reattaches() -> None:
    cluster = fk.FakeCluster()
    clock = FakeClock()
    body = manifest()
    cluster.create_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", body)
    verdict = launcher(cluster, clock).run(body)
    assert verdict.succeeded
    assert cluster.created == [NAME]  # no second job


def test_conflict_with_another_try_is_refused() -> None:
    cluster = fk.FakeCluster()
    body = manifest()
    other = manifest()
    other["metadata"]["labels"]["try_number"] = "7"
    cluster.create_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", other)
    with pytest.raises(errors.MPIJobConflict, match=NAME):
        launcher(cluster, FakeClock()).submit(body)


def test_worker_oom_is_named() -> None:
    cluster = fk.FakeCluster(fk.worker_oom)
    with pytest.raises(errors.MPIJobWorkerOOMKilled, match=rf"MPIJob {NAME}.*worker pod {NAME}-worker-1.*OOMKilled"):
        launcher(cluster, FakeClock()).run(manifest())


def test_launcher_termination_message_is_the_error() -> None:
    message = "nightshift: error: --data /workspace/data does not exist"
    cluster = fk.FakeCluster(lambda name: fk.launcher_fails(name, message))
    with pytest.raises(errors.MPIJobFailed, match=r"exited with code 2.*--data /workspace/data does not exist") as exc:
        launcher(cluster, FakeClock()).run(manifest())
    assert type(exc.value) is errors.MPIJobFailed
    # the failed launcher's log is still copied to the task log (read once, not followed)
    assert cluster.log_reads == [(f"{NAME}-launcher-x7k2p", False)]


def test_image_pull_failure_fails_fast() -> None:
    cluster = fk.FakeCluster(fk.image_pull_failure)
    clock = FakeClock()
    with pytest.raises(errors.MPIJobImagePullFailed, match=r"cannot pull image nope/trainer: ErrImagePull"):
        launcher(cluster, clock, startup_timeout=3600).run(manifest())
    assert clock.now < 3600


def test_unschedulable_past_startup_timeout() -> None:
    cluster = fk.FakeCluster(fk.unschedulable)
    clock = FakeClock()
    with pytest.raises(errors.MPIJobUnschedulable, match=r"within 30s.*Insufficient nvidia.com/gpu"):
        launcher(cluster, clock, startup_timeout=30).run(manifest())
    assert 30 <= clock.now <= 35  # waited for the timeout, polling every 5 s, not longer


def test_job_deleted_while_waiting() -> None:
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["tick"]))
    clock = FakeClock()
    run = launcher(cluster, clock)
    run.submit(manifest())
    run.check(NAME, 0)
    cluster.delete_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", NAME)
    with pytest.raises(errors.MPIJobDeleted, match=f"MPIJob {NAME} was deleted"):
        run.wait(NAME)


def test_delete_is_foreground_and_ignores_404() -> None:
    cluster = fk.FakeCluster()
    run = launcher(cluster, FakeClock())
    run.submit(manifest())
    run.delete(NAME)
    run.delete(NAME)  # already gone: no error
    assert cluster.deleted == [("default", NAME, {"propagationPolicy": "Foreground"})]
    assert run.get(NAME) is None


def test_other_api_errors_propagate() -> None:
    from kubernetes.client.exceptions import ApiException

    cluster = fk.FakeCluster()
    run = launcher(cluster, FakeClock())
    run.submit(manifest())
    cluster.fail_gets_with = ApiException(status=403, reason="Forbidden")
    with pytest.raises(ApiException):
        run.wait(NAME)


def test_error_for_maps_kinds_and_defaults() -> None:
    assert type(error_for("MPIJobWorkerOOMKilled", "m")) is errors.MPIJobWorkerOOMKilled
    assert type(error_for("SomethingElse", "m")) is errors.MPIJobFailed
    assert type(error_for(None, "m")) is errors.MPIJobFailed
