from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from operators import errors
from operators.horovod import HorovodKubernetesOperator
from operators.mpijob_spec import TaskIdentity, checkpoint_subdir, job_name
from operators.triggers import MPIJobTrigger
from tests.unit.operators import fake_kubernetes as fk
from tests.unit.operators.conftest import horovod_operator, make_context

COMMAND = ["python", "-m", "nightshift.train", "--data", "/workspace/data", "--out", "/workspace/model"]
CONTEXT = make_context()
NAME = job_name(HorovodKubernetesOperator.identity_from(CONTEXT))
TRACKING = "http://mlflow.nightshift.svc:5000"


@pytest.fixture(autouse=True)
def cluster_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    """NIGHTSHIFT_HOME as the shared volume's path, and a tracking server the pods reach."""
    monkeypatch.setenv("NIGHTSHIFT_HOME", "/workspace")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", TRACKING)
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
        op.__dict__["hook"] = fk.FakeHook(cluster)  # what the cached_property would hold
    return op


def test_interface_pool_and_templated_fields() -> None:
    op = operator(num_workers=4, gpus_per_worker=2)
    assert (op.pool, op.pool_slots) == ("gpu", 8)
    assert operator(num_workers=3, gpus_per_worker=0).pool_slots == 1
    assert operator(pool="a100", pool_slots=2).pool == "a100"
    for name in ("image", "command", "env", "checkpoint_dir", "namespace", "volumes", "labels"):
        assert name in HorovodKubernetesOperator.template_fields
    with pytest.raises(errors.InvalidJobConfig, match="backend"):
        operator(backend="slurm")
    with pytest.raises(errors.InvalidJobConfig, match="num_workers"):
        operator(num_workers=0)
    with pytest.raises(errors.InvalidJobConfig, match="cleanup"):
        operator(cleanup="sometimes")


def test_templates_render_into_the_manifest() -> None:
    op = operator(
        image="ghcr.io/example/trainer:{{ params.tag }}",
        command=["python", "-m", "nightshift.train", "--epochs", "{{ params.epochs }}"],
        env={"RUN": "{{ run_id }}"},
    )
    op.render_template_fields({"params": {"tag": "v7", "epochs": 3}, "run_id": "r1"})
    manifest = op.build_manifest(TaskIdentity("d", "train", "r1", 1))
    launcher = manifest["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    assert launcher["image"] == "ghcr.io/example/trainer:v7"
    assert launcher["command"][-4:-2] == ["--epochs", "3"]
    assert {"name": "RUN", "value": "r1"} in launcher["env"]


def test_each_setting_is_declared_once_in_a_config_and_named_when_wrong() -> None:
    from dataclasses import fields

    from operators.horovod_config import CONFIG_TYPES, ClusterConfig, ExecutionConfig, JobConfig, configs_from

    templated = {f.name for kind in CONFIG_TYPES.values() for f in fields(kind) if f.metadata.get("templated")}
    assert set(HorovodKubernetesOperator.template_fields) == templated
    assert {"num_workers", "gpus_per_worker", "gpus", "backend", "kueue_queue", "kueue_priority", "command",
            "image", "mlflow_run_key"} <= templated
    with pytest.raises(errors.InvalidJobConfig, match="num_workers must be an integer >= 1, got 0"):
        JobConfig(command=COMMAND, num_workers=0)
    with pytest.raises(errors.InvalidJobConfig, match="poll_interval must be a number >= 0"):
        ExecutionConfig(poll_interval=-1)
    with pytest.raises(errors.InvalidJobConfig, match=r"backend: unknown training backend 'slurm'; choose one of "
                                                      r"hosts, kubernetes, local, auto \(a new one is registered"):
        ClusterConfig(backend="slurm")
    with pytest.raises(errors.InvalidJobConfig, match=r"num_workers: not an operator argument; pass it in its "
                                                      r"config \(num_workers in JobConfig\)"):
        HorovodKubernetesOperator(task_id="t", job=JobConfig(command=COMMAND), num_workers=2)
    with pytest.raises(errors.InvalidJobConfig, match="cluster must be a ClusterConfig"):
        HorovodKubernetesOperator(task_id="t", job=JobConfig(command=COMMAND), cluster={"backend": "local"})
    with pytest.raises(errors.InvalidJobConfig, match="unknown setting 'workers'; the settings are: "):
        configs_from(workers=2)


def test_a_rendered_value_is_settled_into_its_config_naming_a_wrong_one() -> None:
    op = operator(num_workers="{{ params.workers }}", kueue_queue="{{ params.queue }}", backend="{{ params.b }}")
    op.render_template_fields({"params": {"workers": "3", "queue": None, "b": " local "}})
    op.settle()
    assert (op.job.num_workers, op.cluster.kueue_queue, op.cluster.backend) == (3, "", "local")
    assert op.num_workers == 3  # the template field follows its config
    op = operator(num_workers="{{ params.workers }}")
    op.render_template_fields({"params": {"workers": "many"}})
    with pytest.raises(errors.InvalidJobConfig, match=r"num_workers must be an integer >= 1, got 'many' \(rendered "
                                                      r"from the run's Param 'workers'\)"):
        op.settle()
    op = operator(gpus_per_worker="{{ params.gpus | default(-1) }}")
    op.render_template_fields({"params": {}})
    with pytest.raises(errors.InvalidJobConfig, match=r"gpus_per_worker must be an integer >= 0, got '-1' \(rendered "
                                                      r"from the template '\{\{ params.gpus \| default\(-1\) \}\}'\)"):
        op.settle()


def containers(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    specs = manifest["spec"]["mpiReplicaSpecs"]
    return [specs[role]["template"]["spec"]["containers"][0] for role in ("Launcher", "Worker")]


def test_workers_gpus_and_backend_are_templates_checked_at_execute(validate_mpijob: Any) -> None:
    op = operator(num_workers="{{ params.workers }}", gpus_per_worker="{{ params.gpus_per_worker }}",
                  backend="{{ params.backend }}")
    assert op.pool_slots == 1  # unknown at parse time: the cluster policy sizes it per run
    for name in ("num_workers", "gpus_per_worker", "backend"):
        assert name in HorovodKubernetesOperator.template_fields
    op.render_template_fields({"params": {"workers": 4, "gpus_per_worker": 8, "backend": "kubernetes"}})
    manifest = op.build_manifest(TaskIdentity("d", "train", "r1", 1))
    validate_mpijob(manifest)
    assert (op.num_workers, op.gpus_per_worker, op.backend) == (4, 8, "kubernetes")
    worker = manifest["spec"]["mpiReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4 and manifest["spec"]["slotsPerWorker"] == 8
    assert worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8


@pytest.mark.parametrize(("field", "value"), [("num_workers", "0"), ("num_workers", "two"),
                                              ("gpus_per_worker", "-1"), ("backend", "slurm")])
def test_a_bad_rendered_value_names_its_field(field: str, value: str) -> None:
    op = operator(**{field: "{{ params.x }}"})
    op.render_template_fields({"params": {"x": value}})
    with pytest.raises(errors.InvalidJobConfig, match=field):
        op.execute(CONTEXT)  # type: ignore[arg-type]


def test_pods_mount_the_shared_claim_at_nightshift_home_and_log_to_the_tracking_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIGHTSHIFT_SHARED_PVC", "team-rwx")
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "postgresql://airflow:hunter2@db/airflow")
    manifest = operator().build_manifest(TaskIdentity("d", "train", "r1", 1))
    for role in ("Launcher", "Worker"):
        pod = manifest["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]
        assert {"name": "nightshift-shared", "persistentVolumeClaim": {"claimName": "team-rwx"}} in pod["volumes"]
        assert {"name": "nightshift-shared", "mountPath": "/workspace"} in pod["containers"][0]["volumeMounts"]
    for container in containers(manifest):
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["MLFLOW_TRACKING_URI"] == TRACKING and env["NIGHTSHIFT_HOME"] == "/workspace"
        assert not [name for name in env if name.startswith("AIRFLOW")]
    assert "hunter2" not in yaml.safe_dump(manifest)
    monkeypatch.setenv("NIGHTSHIFT_CLUSTER_MLFLOW_URI", "http://mlflow.internal:5000")
    launcher = containers(operator().build_manifest(TaskIdentity("d", "train", "r1", 1)))[0]
    assert {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow.internal:5000"} in launcher["env"]


def test_the_cluster_config_names_the_interfaces_horovodrun_uses() -> None:
    launcher = containers(operator().build_manifest(TaskIdentity("d", "train", "r1", 1)))[0]
    assert launcher["command"][6:8] == ["--network-interfaces", "eth0"]
    launcher = containers(operator(network_interfaces="net1").build_manifest(TaskIdentity("d", "train", "r1", 1)))[0]
    assert launcher["command"][6:8] == ["--network-interfaces", "net1"]
    launcher = containers(operator(network_interfaces=None).build_manifest(TaskIdentity("d", "train", "r1", 1)))[0]
    assert "--network-interfaces" not in launcher["command"]


def test_a_path_the_pods_cannot_see_is_refused_before_submitting() -> None:
    op = operator(command=[*COMMAND, "--extra=/home/airflow/data.csv"])
    with pytest.raises(errors.InvalidJobConfig, match=r"cannot see /home/airflow/data.csv.*under a volume mount"):
        op.build_manifest(TaskIdentity("d", "train", "r1", 1))
    mounted = operator(command=[*COMMAND, "--extra=/data/x.csv"], volumes=[{"name": "d", "emptyDir": {}}],
                       volume_mounts=[{"name": "d", "mountPath": "/data"}])
    mounted.build_manifest(TaskIdentity("d", "train", "r1", 1))  # a volume of its own covers it


@pytest.mark.parametrize(("uri", "message"), [
    ("sqlite:////workspace/mlflow.db", "tracking server that the pods reach"),
    ("http://alice:s3cret@mlflow:5000", "carries a password"),
])
def test_a_tracking_uri_the_pods_cannot_use_is_refused(monkeypatch: pytest.MonkeyPatch, uri: str,
                                                       message: str) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(errors.InvalidJobConfig, match=message) as raised:
        operator().build_manifest(TaskIdentity("d", "train", "r1", 1))
    assert "s3cret" not in str(raised.value)


def test_the_fake_api_refuses_what_the_crd_does_not_know_as_a_strict_server_would() -> None:
    from kubernetes.client.exceptions import ApiException

    body = operator().build_manifest(TaskIdentity("d", "train", "r1", 1))
    body["spec"]["slotsPerWorkerr"] = body["spec"].pop("slotsPerWorker")
    with pytest.raises(ApiException) as raised:
        fk.FakeCluster().create_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", body)
    assert raised.value.status == 422 and "slotsPerWorkerr" in str(raised.value.body)


def test_checkpoint_dir_is_keyed_by_dag_run_task_never_try() -> None:
    op = operator()
    first = op.build_manifest(TaskIdentity("d", "train", "r1", 1))
    second = op.build_manifest(TaskIdentity("d", "train", "r1", 2))
    cmd = first["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[-2:] == ["--checkpoint-dir", "/workspace/checkpoints/d/r1/train"]
    assert cmd == second["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert first["metadata"]["name"] != second["metadata"]["name"]
    local = op.resolve_checkpoint_dir(TaskIdentity("d", "train", "r1", 2))
    assert local.endswith("checkpoints/d/r1/train")
    assert operator(checkpoint_dir="/pvc/ck").resolve_checkpoint_dir(TaskIdentity("d", "t", "r", 1)) == (
        "/pvc/ck"
    )


def test_dry_run_prints_a_valid_manifest(capsys: pytest.CaptureFixture[str], validate_mpijob: Any) -> None:
    operator(namespace="ml").dry_run()
    manifest = yaml.safe_load(capsys.readouterr().out)
    validate_mpijob(manifest)
    assert manifest["metadata"]["namespace"] == "ml"
    assert manifest["metadata"]["labels"]["task_id"] == "train"


def test_sync_success_streams_log_and_deletes(capsys: pytest.CaptureFixture[str]) -> None:
    cluster = fk.FakeCluster(lambda name: fk.succeeding(name, ["epoch 1 loss 0.5", "training done"]))
    op = operator(cluster, namespace="default")
    result = op.execute(CONTEXT)
    task_log = capsys.readouterr().out  # the task logger writes through structlog
    assert result["name"] == NAME and result["backend"] == "kubernetes"
    assert result["checkpoint_dir"] == "/workspace/checkpoints/" + checkpoint_subdir(
        "nightly_retrain", CONTEXT["run_id"], "train")  # on the shared volume, never keyed by the try
    assert "[launcher] training done" in task_log
    assert cluster.deleted == [("default", NAME, {"propagationPolicy": "Foreground"})]
    created = cluster.created
    assert created == [NAME]


def test_namespace_comes_from_the_connection_when_not_given() -> None:
    cluster = fk.FakeCluster()
    op = operator(None)
    op.__dict__["hook"] = fk.FakeHook(cluster, namespace="team-ml")
    assert op.execute(CONTEXT)["namespace"] == "team-ml"


@pytest.mark.parametrize(("cleanup", "deleted"), [("on_success", False), ("always", True), ("never", False)])
def test_failure_cleanup_follows_the_policy(cleanup: str, deleted: bool) -> None:
    cluster = fk.FakeCluster(fk.worker_oom)
    with pytest.raises(errors.MPIJobWorkerOOMKilled):
        operator(cluster, cleanup=cleanup).execute(CONTEXT)
    assert bool(cluster.deleted) is deleted


def test_a_job_that_never_started_is_deleted_even_on_success_only_policy() -> None:
    cluster = fk.FakeCluster(fk.unschedulable)
    with pytest.raises(errors.MPIJobUnschedulable, match=r"Insufficient nvidia\.com/gpu"):
        operator(cluster, startup_timeout=0.05, poll_interval=0.01).execute(CONTEXT)
    assert [d[1] for d in cluster.deleted] == [NAME]


def test_on_kill_deletes_the_running_job_in_the_foreground() -> None:
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]))
    op = operator(cluster, poll_interval=0.01)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            op.execute(CONTEXT)
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 10
    while not cluster.jobs and time.monotonic() < deadline:
        time.sleep(0.01)
    op.on_kill()
    thread.join(10)
    assert not thread.is_alive()
    if outcome and isinstance(outcome[0], pytest.skip.Exception):
        raise outcome[0]  # the fake cluster skipped in the thread: no CRD schema beside the repo
    assert cluster.deleted[0] == ("default", NAME, {"propagationPolicy": "Foreground"})
    # Killed while it followed the job: TaskInterrupted (on_kill's flag, seen first), or MPIJobDeleted when the
    # poll under way when on_kill ran already found the job gone.
    assert isinstance(outcome[0], errors.TaskInterrupted | errors.MPIJobDeleted), outcome


def test_deferrable_hands_waiting_to_the_trigger_then_finishes() -> None:
    from airflow.sdk.exceptions import TaskDeferred

    cluster = fk.FakeCluster(lambda name: fk.succeeding(name, ["epoch 1", "done"]))
    op = operator(cluster, deferrable=True, startup_timeout=120)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(CONTEXT)
    trig = deferred.value.trigger
    assert isinstance(trig, MPIJobTrigger)
    assert (trig.name, trig.namespace, trig.startup_timeout) == (NAME, "default", 120)
    assert deferred.value.method_name == "execute_complete"
    assert cluster.created == [NAME] and not cluster.deleted
    # the job runs to the end while the task is deferred
    for _ in range(4):
        cluster.get_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", NAME)
    event = {"status": "success", "name": NAME, "namespace": "default", "phase": "Succeeded", "message": ""}
    result = op.execute_complete(CONTEXT, event, **deferred.value.kwargs)
    assert result["name"] == NAME
    assert cluster.log_reads == [(f"{NAME}-launcher-x7k2p", False)]
    assert [d[1] for d in cluster.deleted] == [NAME]


def test_deferred_failure_raises_the_named_error() -> None:
    cluster = fk.FakeCluster(fk.worker_oom)
    op = operator(cluster, deferrable=True)
    cluster.create_namespaced_custom_object(
        "kubeflow.org",
        "v2beta1",
        "default",
        "mpijobs",
        op.build_manifest(HorovodKubernetesOperator.identity_from(CONTEXT)),
    )
    event = {
        "status": "failed",
        "name": NAME,
        "namespace": "default",
        "phase": "Failed",
        "error_kind": "MPIJobWorkerOOMKilled",
        "message": f"MPIJob {NAME} failed: worker pod {NAME}-worker-1 container worker was OOMKilled",
    }
    with pytest.raises(errors.MPIJobWorkerOOMKilled, match="worker-1"):
        op.execute_complete(CONTEXT, event)
    assert cluster.deleted == []  # on_success policy keeps a failed job for inspection
    error_event = {**event, "status": "error", "error_kind": None, "message": "lost track"}
    with pytest.raises(errors.KubernetesApiUnavailable, match="lost track"):  # the API failed, not the job
        op.execute_complete(CONTEXT, error_event)
    # the trigger lost sight of the API, not of a failed job: the job is not deleted (the next try deletes
    # its earlier tries' jobs before submitting)
    assert cluster.deleted == []


def test_auto_backend_uses_kubernetes_only_with_a_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    op = operator(backend="auto", kubernetes_conn_id="k8s_test")
    monkeypatch.delenv("AIRFLOW_CONN_K8S_TEST", raising=False)
    assert op.resolve_backend() == "local"
    monkeypatch.setenv("AIRFLOW_CONN_K8S_TEST", '{"conn_type": "kubernetes", "extra": {"in_cluster": true}}')
    assert op.resolve_backend() == "kubernetes"


def test_dag_import_stays_light(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys, operators.horovod\n"
        "heavy = [m for m in ('torch', 'nightshift', 'kubernetes', 'horovod') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip() == ""


# -- earlier tries, transient API errors, deferral timeouts (issue 20 items 4, 5) -------------------------

RETRY = make_context(try_number=2)
RETRY_NAME = job_name(HorovodKubernetesOperator.identity_from(RETRY))


def test_a_retry_deletes_the_earlier_tries_job_and_waits_for_its_pods_before_submitting() -> None:
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]) if name == NAME
                             else fk.succeeding(name, ["done"]))
    cluster.delete_linger = 3
    first = operator(cluster).build_manifest(HorovodKubernetesOperator.identity_from(CONTEXT))
    cluster.create_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", first)
    cluster.get_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", NAME)
    cluster.get_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", NAME)  # running
    seen_at_create: list[list[str]] = []
    create = cluster.create_namespaced_custom_object

    def watching_create(*args: Any, **kwargs: Any) -> dict[str, Any]:
        pods = cluster.list_namespaced_pod("default", "dag_id=nightly_retrain,task_id=train").items
        seen_at_create.append([p.metadata.name for p in pods] + [name for (_, name) in cluster.jobs])
        return create(*args, **kwargs)

    cluster.create_namespaced_custom_object = watching_create  # type: ignore[method-assign]
    result = operator(cluster).execute(RETRY)
    assert result["name"] == RETRY_NAME
    assert cluster.deleted[0] == ("default", NAME, {"propagationPolicy": "Foreground"})
    assert seen_at_create == [[]]  # nothing of try 1 (job or pod) was left when try 2 was submitted


def test_a_retry_whose_earlier_pods_do_not_go_fails_before_submitting() -> None:
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]))
    cluster.delete_linger = 10**6
    first = operator(cluster).build_manifest(HorovodKubernetesOperator.identity_from(CONTEXT))
    cluster.create_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", first)
    cluster.get_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", NAME)
    with pytest.raises(errors.MPIJobCleanupFailed, match=rf"earlier tr.*{NAME}.*still there after 0.05s"):
        operator(cluster, cleanup_timeout=0.05, poll_interval=0.01).execute(RETRY)
    assert cluster.created == [NAME]  # the retry submitted nothing


def test_a_transient_api_outage_does_not_delete_the_running_job() -> None:
    cluster = fk.FakeCluster(lambda name: fk.succeeding(name, ["epoch 1", "done"]))
    cluster.inject("get_namespaced_custom_object", fk.api_error(503), fk.api_error(500), fk.api_error(504))
    cluster.inject("list_namespaced_pod", fk.api_error(502))
    cluster.cut_log_streams = 1
    result = operator(cluster, api_retry_seconds=30.0, api_retry_backoff=0.001,
                      poll_interval=0.001).execute(CONTEXT)
    assert result["name"] == NAME
    assert cluster.deleted == [("default", NAME, {"propagationPolicy": "Foreground"})]  # on success, once


def test_an_api_outage_past_api_retry_seconds_fails_the_task_but_keeps_the_job() -> None:
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]))
    cluster.fail_gets_with = fk.api_error(503)
    with pytest.raises(errors.KubernetesApiUnavailable, match=rf"{NAME}.*0.05s"):
        operator(cluster, api_retry_seconds=0.05, api_retry_backoff=0.01, poll_interval=0.01).execute(CONTEXT)
    assert cluster.deleted == []  # not the job's failure: the next try deletes it before submitting


def test_a_deferral_timeout_deletes_the_job() -> None:
    from airflow.sdk.bases.operator import TRIGGER_FAIL_REPR, TriggerFailureReason
    from airflow.sdk.exceptions import TaskDeferralTimeout, TaskDeferred

    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]))
    with pytest.raises(TaskDeferred):
        operator(cluster, deferrable=True).execute(CONTEXT)
    resumed = operator(cluster, deferrable=True)  # a fresh worker process: no state but the context
    with pytest.raises(TaskDeferralTimeout):
        resumed.resume_execution(TRIGGER_FAIL_REPR, {"error": TriggerFailureReason.TRIGGER_TIMEOUT}, CONTEXT)
    assert cluster.deleted == [("default", NAME, {"propagationPolicy": "Foreground"})]


def test_a_sync_timeout_deletes_the_job() -> None:
    from airflow.sdk.exceptions import AirflowTaskTimeout

    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]))
    cluster.inject("get_namespaced_custom_object", fk.api_error(503), AirflowTaskTimeout("Timeout, PID: 1"))
    with pytest.raises(AirflowTaskTimeout):
        operator(cluster, poll_interval=0.001, api_retry_backoff=0.001).execute(CONTEXT)
    assert [d[1] for d in cluster.deleted] == [NAME]
