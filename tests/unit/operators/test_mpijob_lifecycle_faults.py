"""Hostile review of dc193be (issue 20 items 4, 5, 6): MPIJob lifecycle under faults.

Each test states what Airflow 3.3 or Kubernetes does and what the operator should then have done.
They fail on dc193be: each one is a finding. The fakes are fake_kubernetes / fake_kueue; where a test
needs server or network behaviour those fakes do not model yet (a stalled log stream, a delete through
the asyncio client) it adds it in a subclass here, as the real server / urllib3 behaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from operators import errors
from operators.horovod import HorovodKubernetesOperator
from operators.mpijob_launcher import MPIJobLauncher
from operators.mpijob_spec import MPIJobConfig, TaskIdentity, build_mpijob, job_name
from operators.mpijob_status import evaluate
from operators.triggers import MPIJobTrigger
from tests.unit.operators import fake_kubernetes as fk
from tests.unit.operators.conftest import horovod_operator, make_context

COMMAND = ["python", "-m", "nightshift.train", "--data", "/workspace/data", "--out", "/workspace/model"]
CONTEXT = make_context()
NAME = job_name(HorovodKubernetesOperator.identity_from(CONTEXT))
RETRY = make_context(try_number=2)
RETRY_NAME = job_name(HorovodKubernetesOperator.identity_from(RETRY))


@pytest.fixture(autouse=True)
def cluster_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIGHTSHIFT_HOME", "/workspace")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.nightshift.svc:5000")
    monkeypatch.delenv("NIGHTSHIFT_CLUSTER_MLFLOW_URI", raising=False)
    monkeypatch.delenv("NIGHTSHIFT_SHARED_PVC", raising=False)


def operator(cluster: fk.FakeCluster | None = None, **overrides: Any) -> HorovodKubernetesOperator:
    kwargs: dict[str, Any] = {
        "task_id": "train",
        "num_workers": 2,
        "gpus_per_worker": 1,
        "image": "ghcr.io/example/trainer:1",
        "command": COMMAND,
        "backend": "kubernetes",
        "poll_interval": 0.0,
        "startup_timeout": 30.0,
    }
    kwargs.update(overrides)
    op = horovod_operator(**kwargs)
    if cluster is not None:
        op.__dict__["hook"] = fk.FakeHook(cluster)
    return op


def last_try_context(try_number: int = 1) -> dict[str, Any]:
    """A task instance with no retry left (Airflow 3's RuntimeTaskInstance carries max_tries)."""
    ctx = make_context(try_number=try_number)
    ti = ctx["ti"]
    ctx["ti"] = SimpleNamespace(**vars(ti), max_tries=try_number - 1)
    return ctx


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


# -- 1. deferred: execution_timeout never bounds the deferral -----------------------------------------------


def test_a_deferral_is_bounded_by_execution_timeout() -> None:
    """Airflow 3.3 applies execution_timeout only while a worker runs the task: a deferral's only deadline is
    the `timeout` given to defer() (execution API: trigger_timeout = defer.timeout; "TODO: HANDLE execution
    timeout later"). Without it, TaskDeferralTimeout never comes, resume_execution's delete never runs, and a
    hung job (an allreduce that never returns) runs, and the task waits, forever."""
    from airflow.sdk.exceptions import TaskDeferred

    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]))
    op = operator(cluster, deferrable=True, execution_timeout=timedelta(hours=6))
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(CONTEXT)
    timeout = deferred.value.timeout
    assert timeout is not None, "deferred with no timeout: execution_timeout=6h is never enforced while deferred"
    timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    assert timedelta(0) < timeout <= timedelta(hours=6)


# -- 2. deferred: a user marking the deferred task failed leaves the job running ----------------------------


class _AsyncApiWithDelete(fk.AsyncFakeApi):
    async def delete_namespaced_custom_object(self, **kwargs: Any) -> Any:
        return self._call(self.cluster.delete_namespaced_custom_object, **kwargs)

    async def list_namespaced_pod(self, **kwargs: Any) -> Any:
        return self._call(self.cluster.list_namespaced_pod, **kwargs)


def test_the_trigger_deletes_the_job_when_the_user_kills_the_deferred_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """Airflow 3.3 calls BaseTrigger.on_kill() when a user marks a deferred task failed/success or clears it
    (triggerer_job_runner: "Trigger cancelled by user action, invoking on_kill"). The operator's on_kill never
    runs for a deferred task (no worker process), so MPIJobTrigger must delete the job; it inherits the no-op."""
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]))
    body = operator(cluster).build_manifest(HorovodKubernetesOperator.identity_from(CONTEXT))
    cluster.create_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", body)

    @contextlib.asynccontextmanager
    async def api_clients(self: MPIJobTrigger) -> AsyncIterator[tuple[Any, Any]]:
        api = _AsyncApiWithDelete(cluster)
        yield api, api

    monkeypatch.setattr(MPIJobTrigger, "api_clients", api_clients)
    trig = MPIJobTrigger(NAME, "default", submitted_at=time.time(), poll_interval=0.0)
    asyncio.run(trig.on_kill())
    assert ("default", NAME) not in cluster.jobs, "the user killed the task; its MPIJob still runs, unobserved"


# -- 3. sync: SIGTERM (on_kill) while the retry cleans up, then it submits anyway -----------------------------


def test_a_task_killed_while_it_deletes_earlier_tries_submits_nothing() -> None:
    """Airflow 3.3's task runner handles SIGTERM by calling on_kill() and *returning* (task_runner._on_term);
    the supervisor sends SIGKILL 5 s later. on_kill deletes self.job_name, which is this try's job, not
    submitted yet (404); execution then resumes inside delete_earlier_tries and submits the new job, which the
    SIGKILL leaves running with no task (the task was marked failed: no retry will delete it)."""
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]) if name == NAME
                             else fk.succeeding(name, ["done"]))
    cluster.delete_linger = 3
    first = operator(cluster).build_manifest(HorovodKubernetesOperator.identity_from(CONTEXT))
    cluster.create_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", first)
    cluster.get_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", NAME)
    cluster.get_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", NAME)

    op = operator(cluster)
    list_pods = cluster.list_namespaced_pod
    killed: list[bool] = []

    def sigterm_during_cleanup(*args: Any, **kwargs: Any) -> Any:
        if not killed:  # the signal arrives while the retry waits for try 1's pods to go
            killed.append(True)
            op.on_kill()
        return list_pods(*args, **kwargs)

    cluster.list_namespaced_pod = sigterm_during_cleanup  # type: ignore[method-assign]
    with contextlib.suppress(BaseException):
        op.execute(RETRY)
    assert killed
    assert RETRY_NAME not in cluster.created, (
        f"on_kill ran before {RETRY_NAME} existed, then the try went on and submitted it: {cluster.created}")


# -- 4. the last try: an API outage leaves the job running for good -----------------------------------------


def test_the_last_try_does_not_leave_its_job_running_after_an_api_outage() -> None:
    """'Left for the next try to delete' (KubernetesApiUnavailable) is only true when there is a next try.
    On the last one the job runs on (GPUs, the shared checkpoint dir, the MLflow run key) with nothing to
    delete it; here the reads fail but a delete would have gone through."""
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]))
    cluster.fail_gets_with = fk.api_error(503)
    with pytest.raises(errors.KubernetesApiUnavailable):
        operator(cluster, api_retry_seconds=0.05, api_retry_backoff=0.01, poll_interval=0.01).execute(
            last_try_context())
    assert ("default", NAME) in {(ns, n) for ns, n, _ in cluster.deleted}, (
        "no retry left and the MPIJob was not even asked to be deleted")


def test_the_last_try_does_not_leave_its_job_running_after_a_trigger_error_event() -> None:
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]))
    op = operator(cluster, deferrable=True)
    body = op.build_manifest(HorovodKubernetesOperator.identity_from(CONTEXT))
    cluster.create_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", body)
    event = {"status": "error", "name": NAME, "namespace": "default", "phase": None, "error_kind": None,
             "message": f"MPIJob default/{NAME}: lost track of the job: the Kubernetes API kept failing for 300s"}
    with pytest.raises(errors.HorovodJobError):
        op.execute_complete(last_try_context(), event)
    assert [d[1] for d in cluster.deleted] == [NAME], "no retry left; the job keeps running unobserved"


# -- 5. sync: a broken log endpoint (kubelet unreachable) fails the task of a healthy job ---------------------


def test_a_log_endpoint_that_keeps_failing_does_not_fail_a_job_that_succeeds() -> None:
    """The job's status is readable all along; only the launcher's log is not (the API server cannot reach
    the node's kubelet: 500 'error dialing backend'). The log is a courtesy (execute_complete treats it so),
    but the sync path raises KubernetesApiUnavailable after api_retry_seconds: the task fails, the job is
    left, and the next try deletes that healthy (here: already successful) job and trains again."""
    cluster = fk.FakeCluster(lambda name: fk.succeeding(name, ["epoch 1", "done"]))
    cluster.inject("read_namespaced_pod_log", *(fk.api_error(500) for _ in range(10_000)))
    result = operator(cluster, api_retry_seconds=0.05, api_retry_backoff=0.005, poll_interval=0.001).execute(
        CONTEXT)
    assert result["name"] == NAME


# -- 6. sync: a log stream that stalls (half-open connection) hangs the task past the job's end ---------------


class _StalledResponse(fk._Response):
    """A follow stream whose connection went half-open after the last byte: no EOF, no error, until urllib3's
    read timeout (if the request set one) raises ReadTimeoutError, as urllib3 does."""

    def __init__(self, data: bytes, release: threading.Event, read_timeout: float | None) -> None:
        super().__init__(data)
        self._release = release
        self._read_timeout = read_timeout

    def stream(self, amt: int | None = None, decode_content: bool = True) -> Iterator[bytes]:
        from urllib3.exceptions import ReadTimeoutError

        yield from super().stream(amt, decode_content)
        if not self._release.wait(self._read_timeout if self._read_timeout is not None else 8.0):
            if self._read_timeout is not None:
                raise ReadTimeoutError(None, "/api/v1/namespaces/default/pods/x/log", "Read timed out.")


class _StallingCluster(fk.FakeCluster):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.release = threading.Event()

    def read_namespaced_pod_log(self, name: str, namespace: str, container: str | None = None,
                                follow: bool = False, _preload_content: bool = True, **kwargs: Any) -> Any:
        response = super().read_namespaced_pod_log(name, namespace, container, follow, _preload_content)
        if follow and not _preload_content:
            timeout = kwargs.get("_request_timeout")
            read_timeout = timeout[1] if isinstance(timeout, tuple) else timeout
            return _StalledResponse(response.data, self.release, read_timeout)
        return response


def test_a_stalled_log_stream_does_not_hang_the_wait_after_the_job_succeeded() -> None:
    """read_namespaced_pod_log(follow=True) is called without _request_timeout and the client sets no TCP
    keepalive: a connection that goes half-open (an API server replica lost behind a load balancer) blocks
    wait() forever; the job's status is never polled again, and execution_timeout later 'times out' (and
    deletes) a job that had succeeded."""
    log = ["epoch 1", "done"]
    cluster = _StallingCluster(lambda name: fk.succeeding(name, log))
    run = MPIJobLauncher(cluster, cluster, "default", poll_interval=0.01, startup_timeout=60.0)
    run.submit(build_mpijob(MPIJobConfig(image="ghcr.io/example/trainer:1", command=["python", "-m", "x"],
                                         num_workers=2), TaskIdentity("nightly_retrain", "train", "manual__1", 1)))
    name = job_name(TaskIdentity("nightly_retrain", "train", "manual__1", 1))
    outcome: list[Any] = []
    waiter = threading.Thread(target=lambda: outcome.append(run.wait(name)), daemon=True)
    waiter.start()
    waiter.join(timeout=5.0)
    stuck = waiter.is_alive()
    cluster.release.set()
    waiter.join(timeout=10.0)
    assert not stuck, "the job succeeded, and wait() was still blocked reading a stalled log stream 5 s later"
    assert outcome and outcome[0].succeeded


# -- 7. Kueue: a Workload re-activated but not yet re-admitted is declared deactivated -------------------------


def test_a_reactivated_workload_waiting_for_quota_is_not_a_deactivated_one() -> None:
    """Kueue keeps the Evicted condition (True, reason InactiveWorkload/Deactivated...) after a person sets
    spec.active back to true; only SetQuotaReservation (re-admission) turns it False ("reset Evicted condition
    if present"). Kueue itself tells them apart with IsActive (spec.active). The operator fails the job with
    MPIJobDeactivated although it is active again and only waits for quota."""
    from tests.unit.operators.fake_kueue import validate

    workload = {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {"name": "mpijob-train-3f2a1", "namespace": "ml",
                     "labels": {"kueue.x-k8s.io/job-uid": "uid-0"}},
        "spec": {"active": True, "queueName": "team",
                 "podSets": [{"name": "launcher", "count": 1,
                              "template": {"spec": {"containers": [{"name": "l", "image": "t"}]}}}]},
        "status": {"conditions": [
            {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": "insufficient quota",
             "lastTransitionTime": "2026-01-01T00:00:00Z"},
            {"type": "Evicted", "status": "True", "reason": "InactiveWorkload",
             "message": "The workload is deactivated", "lastTransitionTime": "2026-01-01T00:00:00Z"},
        ]},
    }
    validate("workloads", workload)
    job = {"metadata": {"name": "train", "creationTimestamp": "2026-01-01T00:00:00Z"},
           "spec": {"runPolicy": {"suspend": True}},
           "status": {"conditions": [{"type": "Suspended", "status": "True", "reason": "MPIJobSuspended",
                                      "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}
    verdict = evaluate("train", job, [], elapsed=5.0, startup_timeout=600.0, workload=workload,
                       now=1767225605.0)
    assert not verdict.done, f"an active Workload waiting for quota was failed: {verdict.message}"


# -- 8. Retry-After: 0 (or negative / NaN) makes the retry loop spin --------------------------------------------


@pytest.mark.parametrize("retry_after", ["0", "-5", "nan"])
def test_a_zero_retry_after_does_not_make_the_retries_spin(retry_after: str) -> None:
    """A proxy or an overloaded API server answering 429 with Retry-After: 0 gets re-asked with no delay at
    all, hundreds of times a second for api_retry_seconds (the trigger does the same in the event loop)."""
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["tick"]))
    clock = FakeClock()
    run = MPIJobLauncher(cluster, cluster, "default", poll_interval=5.0, clock=clock, sleep=clock.sleep)
    body = build_mpijob(MPIJobConfig(image="ghcr.io/example/trainer:1", command=["python", "-m", "x"],
                                     num_workers=2), TaskIdentity("nightly_retrain", "train", "manual__1", 1))
    run.submit(body)
    faults = []
    # 10 answers: with backoff (1, 2, 4 ... 30 s) they fit in api_retry_seconds (300 s), so get() succeeds;
    # 50, as first written, outlast the window once the retries no longer spin (KubernetesApiUnavailable).
    for _ in range(10):
        err = fk.api_error(429)
        err.headers = {"Retry-After": retry_after}
        faults.append(err)
    cluster.inject("get_namespaced_custom_object", *faults)
    run.get(body["metadata"]["name"])
    assert min(clock.sleeps) > 0, f"retried with no delay after 'Retry-After: {retry_after}' ({clock.sleeps[:5]})"


# -- 9. the trigger's 'error' event is re-raised as a job failure ---------------------------------------------


def test_a_trigger_error_event_is_raised_as_an_api_error_not_as_a_failed_job() -> None:
    """The docstring of the change: KubernetesApiUnavailable / an 'error' event leave the job to the next
    try. Yet execute_complete raises MPIJobFailed ("The MPIJob reached the Failed condition") for it: the
    job did not fail, and anything keyed on the exception type (callbacks, alerting) reads it wrong."""
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]))
    event = {"status": "error", "name": NAME, "namespace": "default", "phase": None, "error_kind": None,
             "message": "lost track: the Kubernetes API kept failing for 300s (last: 503 Service Unavailable)"}
    with pytest.raises(errors.HorovodJobError) as raised:
        operator(cluster, deferrable=True).execute_complete(CONTEXT, event)
    assert isinstance(raised.value, errors.KubernetesApiError), type(raised.value).__name__
