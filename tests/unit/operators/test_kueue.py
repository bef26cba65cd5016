"""Kueue from the operator's side: queue labels and suspend, the wait for admission and why, a queue
timeout, preemption without failing the task, "just say how many GPUs", and the quota check."""

from __future__ import annotations

from typing import Any

import pytest

from operators import errors
from operators.horovod import HorovodKubernetesOperator
from operators.mpijob_spec import MPIJobConfig, TaskIdentity, build_mpijob, pack_gpus
from tests.unit.operators import fake_kubernetes as fk
from tests.unit.operators import fake_kueue as fq
from tests.unit.operators.conftest import horovod_operator, make_context

COMMAND = ["python", "-m", "nightshift.train", "--data", "/workspace/data", "--out", "/workspace/model"]
CONTEXT = make_context()


@pytest.fixture(autouse=True)
def cluster_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIGHTSHIFT_HOME", "/workspace")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.nightshift.svc:5000")
    for name in ("NIGHTSHIFT_KUEUE_QUEUE", "NIGHTSHIFT_GPUS_PER_NODE", "NIGHTSHIFT_CLUSTER_MLFLOW_URI"):
        monkeypatch.delenv(name, raising=False)


def operator(cluster: fk.FakeCluster, **overrides: Any) -> HorovodKubernetesOperator:
    kwargs: dict[str, Any] = {"task_id": "train", "num_workers": 2, "gpus_per_worker": 1, "image": "trainer:1",
                              "command": COMMAND, "backend": "kubernetes", "namespace": "ml", "poll_interval": 0.0,
                              "startup_timeout": 30.0, "kueue_queue": "nightly"}
    kwargs.update(overrides)
    op = horovod_operator(**kwargs)
    op.__dict__["hook"] = fk.FakeHook(cluster)
    return op


def queues(gpus: int = 16, **kwargs: Any) -> dict[str, Any]:
    return {"local_queues": [fq.local_queue("nightly", "gpu")], "cluster_queues": [fq.cluster_queue("gpu", gpus)],
            **kwargs}


@pytest.mark.parametrize(("total", "per_node", "packed"), [
    (12, 8, (2, 6)), (16, 8, (2, 8)), (8, 8, (1, 8)), (3, 8, (1, 3)), (7, 4, (7, 1)), (24, 8, (3, 8)),
])
def test_a_total_is_packed_into_the_fewest_equal_workers_of_at_most_a_node(total: int, per_node: int,
                                                                         packed: tuple[int, int]) -> None:
    assert pack_gpus(total, per_node) == packed
    workers, each = packed
    assert workers * each == total and each <= per_node


def test_a_total_that_fits_no_whole_workers_is_refused_saying_what_would_fit() -> None:
    with pytest.raises(errors.InvalidJobConfig, match=r"do not split into at most 2 equal workers.*e\.g\. 8"):
        pack_gpus(13, 8, max_workers=2)
    with pytest.raises(errors.InvalidJobConfig, match="gpus must be a positive integer"):
        pack_gpus(0, 8)


def test_a_queued_job_is_labelled_and_created_suspended_and_its_pods_are_not_labelled() -> None:
    config = MPIJobConfig(image="t:1", command=COMMAND, num_workers=2, gpus_per_worker=4, queue_name="nightly",
                          priority_class="nightly-low")
    job = build_mpijob(config, TaskIdentity("d", "train", "r", 1))
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "nightly"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "nightly-low"
    assert job["spec"]["runPolicy"]["suspend"] is True
    for role in ("Launcher", "Worker"):
        assert "kueue.x-k8s.io/queue-name" not in job["spec"]["mpiReplicaSpecs"][role]["template"]["metadata"]["labels"]
    plain = build_mpijob(MPIJobConfig(image="t:1", command=COMMAND, num_workers=2), TaskIdentity("d", "train", "r", 1))
    assert "suspend" not in plain["spec"]["runPolicy"]
    assert "kueue.x-k8s.io/queue-name" not in plain["metadata"]["labels"]
    with pytest.raises(errors.InvalidJobConfig, match="queue must be a Kueue object name"):
        MPIJobConfig(image="t:1", command=COMMAND, num_workers=1, queue_name="Nightly Queue")


def test_the_queue_defaults_to_the_environment_and_empty_means_no_kueue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIGHTSHIFT_KUEUE_QUEUE", "team-a")
    cluster = fq.KueueCluster()
    assert operator(cluster, kueue_queue=None).resolve_queue() == "team-a"
    op = operator(cluster, kueue_queue="{{ params.queue or '' }}")
    op.render_template_fields({"params": {"queue": None}})
    op.settle()
    assert op.resolve_queue() is None
    assert "suspend" not in op.build_manifest(TaskIdentity("d", "train", "r", 1))["spec"]["runPolicy"]


def test_the_task_waits_while_kueue_holds_the_job_and_says_why_once(capsys: pytest.CaptureFixture[str]) -> None:
    cluster = fq.KueueCluster(lambda name: fq.Lifecycle(pending_polls=4), **queues())
    result = operator(cluster).execute(CONTEXT)  # type: ignore[arg-type]
    assert result["backend"] == "kubernetes"
    queued = [line for line in capsys.readouterr().out.splitlines() if "is queued" in line]
    assert len(queued) == 1, queued  # one line per reason, not one per poll
    assert "insufficient unused quota for nvidia.com/gpu in flavor gpu-a100" in queued[0]
    assert "LocalQueue nightly" in queued[0]
    assert cluster.transitions == ["running", "succeeded"]


def test_a_queue_timeout_ends_the_wait_with_the_reason_and_deletes_the_job() -> None:
    cluster = fq.KueueCluster(lambda name: fq.Lifecycle(never_admit=True), **queues())
    op = operator(cluster, queue_timeout=0.0)
    with pytest.raises(errors.MPIJobQueueTimeout, match=r"not admitted within 0s: .*insufficient unused quota"):
        op.execute(CONTEXT)  # type: ignore[arg-type]
    assert [d[1] for d in cluster.deleted] == [op.job_name]  # it would hold its place in the queue


def test_a_preempted_job_waits_for_readmission_in_the_same_try(capsys: pytest.CaptureFixture[str]) -> None:
    polls = {"n": 0}

    def evict_on_second_running_poll() -> bool:
        polls["n"] += 1
        return polls["n"] >= 2

    kubelet = fq.Kubelet(polls=4)
    cluster = fq.KueueCluster(lambda name: fq.Lifecycle(pending_polls=1, evict_when=evict_on_second_running_poll,
                                                        kubelet=kubelet), **queues())
    operator(cluster).execute(CONTEXT)  # type: ignore[arg-type]
    assert cluster.transitions == ["running", "evicted", "running", "succeeded"]
    life = next(iter(cluster.lifecycles.values()))
    assert (life.admissions, life.evictions) == (2, 1)
    assert len(cluster.created) == 1  # the same job, the same try: no failure, no retry
    evicted = [line for line in capsys.readouterr().out.splitlines() if "was evicted (Preempted" in line]
    assert evicted and "resumes from its last checkpoint" in evicted[0]


def test_gpus_are_packed_from_the_nodes_and_checked_against_the_cluster_queue() -> None:
    cluster = fq.KueueCluster(**queues(gpus=16, node_gpus=[8, 8, 4]))
    op = operator(cluster, gpus=12)
    op.execute(CONTEXT)  # type: ignore[arg-type]
    (job,) = cluster.submitted
    workers = job["spec"]["mpiReplicaSpecs"]["Worker"]
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert (workers["replicas"], limits["nvidia.com/gpu"], job["spec"]["slotsPerWorker"]) == (2, 6, 6)
    too_many = operator(fq.KueueCluster(**queues(gpus=8, node_gpus=[8])), gpus=16)
    with pytest.raises(errors.InvalidJobConfig, match=r"asks for 16 GPUs .* ClusterQueue gpu .* at most 8"):
        too_many.execute(CONTEXT)  # type: ignore[arg-type]
    assert not too_many.hook.custom_object_client.created  # refused before submitting


def test_borrowing_in_a_cohort_raises_what_the_queue_can_admit() -> None:
    cohort = {"local_queues": [fq.local_queue("nightly", "gpu")],
              "cluster_queues": [fq.cluster_queue("gpu", 8, cohort="pool", borrowing=8),
                                 fq.cluster_queue("research", 16, cohort="pool")]}
    operator(fq.KueueCluster(**cohort), gpus=16, kueue_queue="nightly").check_queue_capacity("ml", "nightly")
    with pytest.raises(errors.InvalidJobConfig, match="at most 16"):
        op = operator(fq.KueueCluster(**cohort), num_workers=3, gpus_per_worker=8)
        op.settle()
        op.check_queue_capacity("ml", "nightly")


def test_an_unknown_local_queue_is_refused_before_submitting() -> None:
    cluster = fq.KueueCluster(**queues())
    with pytest.raises(errors.InvalidJobConfig, match=r"LocalQueue 'nightlyy' .* not found in namespace ml"):
        operator(cluster, kueue_queue="nightlyy").execute(CONTEXT)  # type: ignore[arg-type]
    assert not cluster.created


def test_gpus_without_a_node_size_say_what_to_set() -> None:
    with pytest.raises(errors.InvalidJobConfig, match=r"set NIGHTSHIFT_GPUS_PER_NODE .no node of the cluster"):
        operator(fq.KueueCluster(**queues(node_gpus=[0])), gpus=4).execute(CONTEXT)  # type: ignore[arg-type]
    forbidden = fq.KueueCluster(**queues(node_gpus=[8]))
    forbidden.list_node = lambda **_: (_ for _ in ()).throw(fk._api_error(403, "Forbidden", "nodes is forbidden"))
    with pytest.raises(errors.InvalidJobConfig, match=r"set NIGHTSHIFT_GPUS_PER_NODE \(the nodes cannot be listed"):
        operator(forbidden, gpus=4).execute(CONTEXT)  # type: ignore[arg-type]


@pytest.mark.parametrize(("lifecycle", "status", "kind"), [
    (fq.Lifecycle(pending_polls=3), "success", None),
    (fq.Lifecycle(never_admit=True), "failed", "MPIJobQueueTimeout"),
])
def test_the_deferred_wait_follows_kueue_too(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                             lifecycle: fq.Lifecycle, status: str, kind: str | None) -> None:
    import asyncio
    import contextlib
    import time
    from collections.abc import AsyncIterator

    from operators.triggers import MPIJobTrigger

    cluster = fq.KueueCluster(lambda name: lifecycle, **queues())
    body = operator(cluster).build_manifest(TaskIdentity("d", "train", "r", 1), "ml")
    cluster.create_namespaced_custom_object("kubeflow.org", "v2beta1", "ml", "mpijobs", body)

    @contextlib.asynccontextmanager
    async def api_clients(self: MPIJobTrigger) -> AsyncIterator[tuple[Any, Any]]:
        api = fk.AsyncFakeApi(cluster)
        yield api, api

    monkeypatch.setattr(MPIJobTrigger, "api_clients", api_clients)
    trig = MPIJobTrigger(name=body["metadata"]["name"], namespace="ml", submitted_at=time.time(), poll_interval=0.0,
                         queue_timeout=0.0 if kind else None)

    async def collect() -> list[dict[str, Any]]:
        return [event.payload async for event in trig.run()]

    (event,) = asyncio.run(collect())
    assert (event["status"], event["error_kind"]) == (status, kind)
    if kind:
        assert "insufficient unused quota for nvidia.com/gpu" in event["message"]
    else:
        queued = [line for line in capsys.readouterr().out.splitlines() if "is queued" in line]
        assert len(queued) == 1 and "LocalQueue nightly" in queued[0]


# -- a deactivated Workload (issue 20 item 6) ----------------------------------------------------------


def test_a_deactivated_workload_fails_at_once_naming_the_reason() -> None:
    from operators.mpijob_launcher import MPIJobLauncher

    message = "The workload is deactivated due to exceeding the maximum number of re-queuing retries"
    cluster = fq.KueueCluster(lambda name: fq.Lifecycle(never_admit=True, deactivate_when=lambda: True,
                                                        deactivation_message=message), **queues())
    body = operator(cluster).build_manifest(TaskIdentity("d", "train", "r", 1), "ml")
    now = {"t": 0.0}

    def sleep(seconds: float) -> None:
        now["t"] += seconds

    run = MPIJobLauncher(cluster, cluster, "ml", poll_interval=5.0, queue_timeout=3600.0, clock=lambda: now["t"],
                         sleep=sleep)
    with pytest.raises(errors.MPIJobDeactivated, match=r"deactivated \(InactiveWorkload: .*re-queuing retries\).*"
                                                       r"kubectl patch workload"):
        run.run(body)
    assert now["t"] < 60  # not the hour of queue_timeout


def test_a_running_job_whose_workload_is_deactivated_fails_without_waiting() -> None:
    polls = {"n": 0}

    def after_two_running_polls() -> bool:
        polls["n"] += 1
        return polls["n"] > 4

    cluster = fq.KueueCluster(lambda name: fq.Lifecycle(pending_polls=1, deactivate_when=after_two_running_polls,
                                                        kubelet=fq.Kubelet(polls=10**6)), **queues())
    with pytest.raises(errors.MPIJobDeactivated, match="InactiveWorkload"):
        operator(cluster, queue_timeout=1.0).execute(CONTEXT)  # type: ignore[arg-type]
    assert "deactivated" in cluster.transitions


def test_the_trigger_reports_a_deactivated_workload_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import contextlib
    import time
    from collections.abc import AsyncIterator

    from operators.triggers import MPIJobTrigger

    cluster = fq.KueueCluster(lambda name: fq.Lifecycle(never_admit=True, deactivate_when=lambda: True), **queues())
    body = operator(cluster).build_manifest(TaskIdentity("d", "train", "r", 1), "ml")
    cluster.create_namespaced_custom_object("kubeflow.org", "v2beta1", "ml", "mpijobs", body)

    @contextlib.asynccontextmanager
    async def api_clients(self: MPIJobTrigger) -> AsyncIterator[tuple[Any, Any]]:
        api = fk.AsyncFakeApi(cluster)
        yield api, api

    monkeypatch.setattr(MPIJobTrigger, "api_clients", api_clients)
    trig = MPIJobTrigger(name=body["metadata"]["name"], namespace="ml", submitted_at=time.time(), poll_interval=0.01,
                         queue_timeout=0.5)

    async def collect() -> list[dict[str, Any]]:
        return [event.payload async for event in trig.run()]

    (event,) = asyncio.run(collect())
    assert (event["status"], event["error_kind"]) == ("failed", "MPIJobDeactivated")
    assert "InactiveWorkload" in event["message"]


@pytest.mark.parametrize(("rendered", "seconds"), [("7200", 7200.0), ("None", None), ("", None), ("90.5", 90.5)])
def test_queue_timeout_is_a_template_settled_into_seconds(rendered: str, seconds: float | None) -> None:
    op = operator(fq.KueueCluster(**queues()), queue_timeout="{{ params.queue_timeout }}")
    op.render_template_fields({"params": {"queue_timeout": rendered}})
    op.settle()
    assert op.execution.queue_timeout == seconds


def test_a_bad_queue_timeout_names_the_field() -> None:
    op = operator(fq.KueueCluster(**queues()), queue_timeout="{{ params.queue_timeout }}")
    op.render_template_fields({"params": {"queue_timeout": "soon"}})
    with pytest.raises(errors.InvalidJobConfig, match=r"queue_timeout must be a number of seconds >= 0.*'soon'"):
        op.settle()
