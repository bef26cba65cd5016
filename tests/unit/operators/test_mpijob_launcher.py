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


def test_image_pull_failure_fails_after_the_kubelets_back_off_not_the_startup_timeout() -> None:
    from operators.mpijob_status import IMAGE_PULL_GRACE_S

    cluster = fk.FakeCluster(fk.image_pull_failure)
    clock = FakeClock()
    with pytest.raises(errors.MPIJobImagePullFailed,
                       match=r"cannot pull image nope/trainer: (ErrImagePull|ImagePullBackOff).*still after 33\ds"):
        launcher(cluster, clock, startup_timeout=3600).run(manifest())
    # one ErrImagePull is retried by the kubelet (issue 35): the job fails once the back-off had its chance
    assert IMAGE_PULL_GRACE_S <= clock.now < IMAGE_PULL_GRACE_S + 10


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


def test_error_for_maps_kinds_and_defaults() -> None:
    assert type(error_for("MPIJobWorkerOOMKilled", "m")) is errors.MPIJobWorkerOOMKilled
    assert type(error_for("SomethingElse", "m")) is errors.MPIJobFailed
    assert type(error_for(None, "m")) is errors.MPIJobFailed


# -- transient API errors (issue 20 item 5) ------------------------------------------------------------


def retrying_launcher(cluster: fk.FakeCluster, clock: FakeClock, api_retry_seconds: float = 300.0) -> MPIJobLauncher:
    return MPIJobLauncher(cluster, cluster, "default", poll_interval=5.0, startup_timeout=60.0, clock=clock,
                          sleep=clock.sleep, api_retry_seconds=api_retry_seconds)


def test_transient_api_errors_are_retried_with_backoff_while_the_job_runs() -> None:
    from urllib3.exceptions import MaxRetryError, ProtocolError

    cluster = fk.FakeCluster(lambda name: fk.succeeding(name, ["done"]))
    clock = FakeClock()
    run = retrying_launcher(cluster, clock)
    run.submit(manifest())
    cluster.inject("get_namespaced_custom_object", fk.api_error(503), fk.api_error(500),
                   fk.api_error(429, retry_after=7), MaxRetryError(None, "/apis", "connection refused"))
    cluster.inject("list_namespaced_pod", ProtocolError("Connection aborted.", ConnectionResetError(104)),
                   fk.api_error(502))
    assert run.wait(NAME).succeeded
    assert 7.0 in clock.sleeps  # the server's Retry-After is honoured
    assert cluster.deleted == []


def test_an_api_outage_longer_than_api_retry_seconds_fails_naming_it_and_keeps_the_job() -> None:
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["tick"]))
    clock = FakeClock()
    run = retrying_launcher(cluster, clock, api_retry_seconds=300)
    run.submit(manifest())
    cluster.fail_gets_with = fk.api_error(503)
    with pytest.raises(errors.KubernetesApiUnavailable, match=rf"MPIJob default/{NAME}.*300s.*503"):
        run.wait(NAME)
    assert 300 <= clock.now <= 300 + 60  # kept trying for api_retry_seconds, backing off, not much longer
    assert len(clock.sleeps) < 40 and cluster.deleted == []


def test_a_permanent_api_error_is_not_retried() -> None:
    cluster = fk.FakeCluster()
    clock = FakeClock()
    run = retrying_launcher(cluster, clock)
    run.submit(manifest())
    cluster.fail_gets_with = fk.api_error(403)
    with pytest.raises(errors.KubernetesApiError, match=r"403.*Forbidden"):
        run.wait(NAME)
    assert clock.now == 0


def test_a_cut_log_stream_is_reconnected_without_repeating_lines(caplog: pytest.LogCaptureFixture) -> None:
    log = ["epoch 1 step 1 loss 2.0", "epoch 1 step 2 loss 1.5", "epoch 2 step 3 loss 1.0", "done"]
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, log))
    cluster.cut_log_streams = 2  # a node lost, then a connection cut: twice in a row
    clock = FakeClock()
    run = retrying_launcher(cluster, clock)
    run.submit(manifest())
    run.check(NAME, 0)
    run.check(NAME, 0)  # running: the launcher pod is up
    launcher_pod = f"{NAME}-launcher-x7k2p"
    with caplog.at_level(logging.INFO):
        run.stream_launcher_log(launcher_pod, follow=True)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[launcher]")]
    assert lines == [f"[launcher] {line}" for line in log]
    assert cluster.log_reads == [(launcher_pod, True)] * 3


def test_a_log_stream_that_stays_cut_past_api_retry_seconds_stops_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """The log is a courtesy: past api_retry_seconds its copy stops, loudly, and the job's status goes on
    deciding (wait() polls it; the pod's log is not asked for again)."""
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["a line long enough to be cut"]))
    cluster.cut_log_streams = 10**6
    clock = FakeClock()
    run = retrying_launcher(cluster, clock, api_retry_seconds=60)
    run.submit(manifest())
    run.check(NAME, 0)
    run.check(NAME, 0)
    with caplog.at_level(logging.WARNING):
        assert run.stream_launcher_log(f"{NAME}-launcher-x7k2p", follow=True) is True
    assert any("Stopped copying the log of launcher pod" in r.getMessage() and "60s" in r.getMessage()
               for r in caplog.records)
    assert 60 <= clock.now <= 60 + 30
    reads = len(cluster.log_reads)
    run.stream_unread_logs(run.pods(NAME))
    assert len(cluster.log_reads) == reads  # given up: not read again


def test_delete_retries_transient_errors() -> None:
    cluster = fk.FakeCluster()
    clock = FakeClock()
    run = retrying_launcher(cluster, clock)
    run.submit(manifest())
    cluster.inject("delete_namespaced_custom_object", fk.api_error(500), fk.api_error(503))
    run.delete(NAME)
    assert run.get(NAME) is None


# -- earlier tries (issue 20 item 4) -------------------------------------------------------------------


def test_earlier_tries_are_deleted_in_the_foreground_and_waited_for_until_their_pods_are_gone() -> None:
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["tick"]))
    cluster.delete_linger = 4  # pods take a few reads to terminate; the job stays until they are gone
    first, second = manifest(), manifest(TaskIdentity("nightly_retrain", "train", "manual__1", 2))
    other_task = manifest(TaskIdentity("nightly_retrain", "evaluate", "manual__1", 1))
    other_run = manifest(TaskIdentity("nightly_retrain", "train", "manual__2", 1))
    for body in (first, other_task, other_run):
        cluster.create_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", body)
    for body in (first, other_task, other_run):  # all running, pods up
        cluster.get_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs",
                                             body["metadata"]["name"])
    clock = FakeClock()
    run = retrying_launcher(cluster, clock)
    removed = run.delete_earlier_tries(second, timeout=120)
    assert removed == [NAME]
    assert cluster.deleted == [("default", NAME, {"propagationPolicy": "Foreground"})]
    assert not [p for p in cluster.list_namespaced_pod("default", f"training.kubeflow.org/job-name={NAME}").items]
    assert ("default", NAME) not in cluster.jobs
    others = {other_task["metadata"]["name"], other_run["metadata"]["name"]}
    assert {name for (_, name) in cluster.jobs} == others  # another task's and another run's jobs are left alone


def test_earlier_tries_whose_pods_do_not_go_fail_loudly_naming_them() -> None:
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["tick"]))
    cluster.delete_linger = 10**6  # a node that never confirms the pods' deletion
    cluster.create_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", manifest())
    cluster.get_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", NAME)
    clock = FakeClock()
    with pytest.raises(errors.MPIJobCleanupFailed, match=rf"{NAME}-worker-0.*still there after 120s"):
        retrying_launcher(cluster, clock).delete_earlier_tries(
            manifest(TaskIdentity("nightly_retrain", "train", "manual__1", 2)), timeout=120)
    assert 120 <= clock.now <= 130
