"""Follow-ups of the lifecycle review (test_mpijob_lifecycle_faults.py): the cases its fixes had to decide.

A trigger moved to another triggerer keeps its job, a deferral's timeout is what is left of execution_timeout,
a trigger that failed on the last try leaves nothing running, a quiet launcher is no error, two Airflow
deployments in one namespace keep to their own jobs, and queue_timeout 0 is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from operators import errors
from operators.horovod import HorovodKubernetesOperator
from operators.mpijob_launcher import MPIJobLauncher
from operators.mpijob_spec import INSTANCE_LABEL, TaskIdentity, job_name
from operators.mpijob_status import workload_reason
from operators.triggers import MPIJobTrigger
from tests.unit.operators import fake_kubernetes as fk
from tests.unit.operators.conftest import make_context
from tests.unit.operators.test_mpijob_lifecycle_faults import (  # cluster_contract: its autouse fixture
    CONTEXT,
    NAME,
    RETRY,
    _AsyncApiWithDelete,
    cluster_contract,  # noqa: F401
    last_try_context,
    operator,
)


def submitted(cluster: fk.FakeCluster, context: dict[str, Any] = CONTEXT) -> str:
    body = operator(cluster).build_manifest(HorovodKubernetesOperator.identity_from(context))
    cluster.create_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", body)
    return str(body["metadata"]["name"])


# -- the trigger's on_kill: a user action, or a trigger moved to another triggerer ---------------------------


@pytest.fixture
def trigger_on(monkeypatch: pytest.MonkeyPatch) -> Any:
    def make(cluster: fk.FakeCluster, state: Any) -> MPIJobTrigger:
        @contextlib.asynccontextmanager
        async def api_clients(self: MPIJobTrigger) -> AsyncIterator[tuple[Any, Any]]:
            api = _AsyncApiWithDelete(cluster)
            yield api, api

        def get_task_states(**kwargs: Any) -> dict[str, Any]:
            if isinstance(state, BaseException):
                raise state
            return {kwargs["run_ids"][0]: {"train": state}}

        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

        monkeypatch.setattr(MPIJobTrigger, "api_clients", api_clients)
        monkeypatch.setattr(RuntimeTaskInstance, "get_task_states", staticmethod(get_task_states))
        trig = MPIJobTrigger(NAME, "default", submitted_at=time.time(), poll_interval=0.0, api_retry_backoff=0.001)
        ti = CONTEXT["ti"]
        trig.task_instance = SimpleNamespace(dag_id=ti.dag_id, task_id=ti.task_id, run_id=ti.run_id,
                                             map_index=-1, try_number=1)  # type: ignore[assignment]
        return trig

    return make


def test_on_kill_keeps_the_job_when_the_task_is_still_deferred(trigger_on: Any) -> None:
    """Airflow 3.3 also calls on_kill (with the user-action message) when another triggerer took the trigger
    over (this one missed its heartbeats): the task instance is then still deferred, and followed there."""
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]))
    submitted(cluster)
    asyncio.run(trigger_on(cluster, "deferred").on_kill())
    assert ("default", NAME) in cluster.jobs and cluster.deleted == []


@pytest.mark.parametrize("state", ["failed", "success", None, RuntimeError("supervisor gone")])
def test_on_kill_deletes_the_job_after_a_user_action_or_when_it_cannot_tell(trigger_on: Any, state: Any) -> None:
    """Marked failed / success, cleared (no state), or the state unreadable: deleted, in the foreground."""
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]))
    submitted(cluster)
    asyncio.run(trigger_on(cluster, state).on_kill())
    assert cluster.deleted == [("default", NAME, {"propagationPolicy": "Foreground"})]


def test_on_kill_never_raises(trigger_on: Any) -> None:
    cluster = fk.FakeCluster()
    trig = trigger_on(cluster, "failed")
    asyncio.run(trig.on_kill())  # 404: the job is already gone
    submitted(cluster)
    cluster.inject("delete_namespaced_custom_object", fk.api_error(403))
    asyncio.run(trig.on_kill())  # refused: logged, not raised
    cluster.inject("delete_namespaced_custom_object", *(fk.api_error(503) for _ in range(3)))
    asyncio.run(trig.on_kill())  # transient: retried (briefly), then deleted
    assert ("default", NAME) not in cluster.jobs


# -- the deferral's timeout ------------------------------------------------------------------------------


def test_the_deferral_timeout_is_what_is_left_of_execution_timeout() -> None:
    op = operator(None, execution_timeout=timedelta(hours=6))
    ti = SimpleNamespace(**vars(CONTEXT["ti"]), start_date=datetime.now(UTC) - timedelta(hours=2))
    timeout = op.deferral_timeout({"ti": ti})
    assert timeout is not None and timedelta(hours=3, minutes=59) < timeout <= timedelta(hours=4)
    ti.start_date = datetime.now(UTC) - timedelta(hours=7)  # already past: the shortest deferral
    assert op.deferral_timeout({"ti": ti}) == timedelta(seconds=1)
    assert operator(None).deferral_timeout({"ti": ti}) is None  # no execution_timeout, no deadline


# -- the last try: a trigger that failed (TaskDeferralError) -----------------------------------------------


@pytest.mark.parametrize("last", [True, False])
def test_a_failed_trigger_on_the_last_try_deletes_the_job(last: bool) -> None:
    from airflow.sdk.bases.operator import TRIGGER_FAIL_REPR
    from airflow.sdk.exceptions import TaskDeferralError

    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]))
    submitted(cluster)
    context = last_try_context() if last else {**CONTEXT, "ti": SimpleNamespace(**vars(CONTEXT["ti"]), max_tries=2)}
    with pytest.raises(TaskDeferralError):
        operator(cluster, deferrable=True).resume_execution(TRIGGER_FAIL_REPR, {"error": "Trigger failure"},
                                                            context)  # type: ignore[arg-type]
    assert [d[1] for d in cluster.deleted] == ([NAME] if last else [])


def test_an_error_event_for_a_refusal_raises_kubernetes_api_error() -> None:
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]))
    event = {"status": "error", "name": NAME, "namespace": "default", "phase": None,
             "error_kind": "KubernetesApiError", "message": f"MPIJob default/{NAME}: the API answered 403"}
    with pytest.raises(errors.KubernetesApiError) as raised:
        operator(cluster, deferrable=True).execute_complete(CONTEXT, event)  # type: ignore[arg-type]
    assert not isinstance(raised.value, errors.KubernetesApiUnavailable)


# -- a quiet launcher: its followed log stream times out, and goes on without repeating a line ---------------


class _QuietResponse(fk._Response):
    """The log so far, then no byte within the read timeout: urllib3 raises ReadTimeoutError."""

    def stream(self, amt: int | None = None, decode_content: bool = True) -> Iterator[bytes]:
        from urllib3.exceptions import ReadTimeoutError

        yield from super().stream(amt, decode_content)
        raise ReadTimeoutError(None, "/api/v1/namespaces/default/pods/x/log", "Read timed out.")


class _QuietCluster(fk.FakeCluster):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeouts: list[Any] = []

    def read_namespaced_pod_log(self, name: str, namespace: str, container: str | None = None,
                                follow: bool = False, _preload_content: bool = True, **kwargs: Any) -> Any:
        response = super().read_namespaced_pod_log(name, namespace, container, follow, _preload_content)
        self.timeouts.append(kwargs.get("_request_timeout"))
        return _QuietResponse(response.data) if follow and not _preload_content else response


def test_a_quiet_log_stream_is_reopened_after_a_status_check_without_repeating_lines(
        caplog: pytest.LogCaptureFixture) -> None:
    log = ["epoch 1", "epoch 2"]
    cluster = _QuietCluster(lambda name: fk.running_forever(name, log))
    run = MPIJobLauncher(cluster, cluster, "default", poll_interval=0.0, log_read_timeout=30.0)
    name = submitted(cluster)
    run.check(name, 0)
    run.check(name, 0)
    pod = f"{name}-launcher-x7k2p"
    with caplog.at_level(logging.INFO):
        assert run.stream_launcher_log(pod, follow=True) is False  # silent: the caller looks at the job
        assert run.stream_launcher_log(pod, follow=True) is False
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[launcher]")]
    assert lines == [f"[launcher] {line}" for line in log]
    assert cluster.timeouts == [(10.0, 30.0)] * 2  # (connect, read) on every log request
    assert sum("---- log of launcher pod" in r.getMessage() for r in caplog.records) == 1


# -- Kueue: a reactivated Workload says so -------------------------------------------------------------------


def test_a_reactivated_workload_says_it_waits_for_quota() -> None:
    workload = {"metadata": {"name": "wl"}, "spec": {"active": True, "queueName": "team"},
                "status": {"conditions": [{"type": "Evicted", "status": "True", "reason": "InactiveWorkload",
                                           "message": "The workload is deactivated"}]}}
    assert "reactivated" in workload_reason(workload) and "deactivated" not in workload_reason(workload)


# -- two Airflow deployments in one namespace ----------------------------------------------------------------


def test_a_retry_deletes_only_its_own_deployments_earlier_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]) if "try1" in name
                             else fk.succeeding(name, ["done"]))
    monkeypatch.setenv("NIGHTSHIFT_INSTANCE", "green")
    green = submitted(cluster)
    monkeypatch.delenv("NIGHTSHIFT_INSTANCE")
    unnamed = submitted(cluster)
    monkeypatch.setenv("NIGHTSHIFT_INSTANCE", "blue")
    blue = submitted(cluster)
    assert len({green, unnamed, blue}) == 3 and unnamed == NAME  # the unnamed deployment keeps its names
    assert cluster.jobs[("default", blue)].body["metadata"]["labels"][INSTANCE_LABEL] == "blue"
    retry = operator(cluster).execute(RETRY)  # type: ignore[arg-type]
    assert retry["name"] == job_name(HorovodKubernetesOperator.identity_from(RETRY)) not in {green, unnamed, blue}
    assert [d[1] for d in cluster.deleted] == [blue, retry["name"]]  # blue's try 1, then its own (succeeded)
    assert ("default", green) in cluster.jobs and ("default", unnamed) in cluster.jobs


@pytest.mark.parametrize("instance", ["-blue", "a" * 64, "blue green", "ü"])
def test_an_instance_that_is_no_label_value_is_refused(monkeypatch: pytest.MonkeyPatch, instance: str) -> None:
    monkeypatch.setenv("NIGHTSHIFT_INSTANCE", instance)
    with pytest.raises(errors.InvalidJobConfig, match="NIGHTSHIFT_INSTANCE"):
        HorovodKubernetesOperator.identity_from(make_context())
    with pytest.raises(errors.InvalidJobConfig, match="NIGHTSHIFT_INSTANCE"):
        job_name(TaskIdentity("d", "t", "r", 1, instance=instance))


# -- queue_timeout 0 ---------------------------------------------------------------------------------------


def test_the_queue_timeout_param_refuses_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """0 would fail every job Kueue did not admit on the first look; empty is how to ask for no limit."""
    from airflow.sdk.exceptions import ParamValidationError

    from tests.conftest import REPO

    monkeypatch.setenv("NIGHTSHIFT_HOME", "/workspace")
    monkeypatch.syspath_prepend(str(REPO / "dags"))
    sys.modules.pop("nightly_retrain", None)
    import nightly_retrain

    param = nightly_retrain.dag.params.get_param("queue_timeout")
    with pytest.raises(ParamValidationError):
        param.resolve(0)
    assert param.resolve(1) == 1 and param.resolve(None) is None
