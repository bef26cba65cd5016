from __future__ import annotations

import re
from typing import Any

import pytest

from operators.errors import InvalidJobConfig
from operators.mpijob_spec import (
    GPU_RESOURCE,
    MPIJobConfig,
    TaskIdentity,
    build_mpijob,
    checkpoint_subdir,
    job_name,
    safe_label_value,
    split_command,
    with_checkpoint_dir,
)

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
IDENTITY = TaskIdentity("nightly_retrain", "train", "scheduled__2026-01-01T00:00:00+00:00", 1)
COMMAND = ["python", "-m", "nightshift.train", "--data", "/workspace/data", "--out", "/workspace/model"]

CONFIGS: dict[str, dict[str, Any]] = {
    "minimal-cpu": {"num_workers": 1},
    "gpus": {"num_workers": 4, "gpus_per_worker": 8, "memory_limit": "64Gi", "cpu_request": "8"},
    "everything": {
        "num_workers": 2,
        "gpus_per_worker": 1,
        "namespace": "ml-train",
        "cpu_request": "2",
        "cpu_limit": "4",
        "memory_request": "4Gi",
        "memory_limit": "8Gi",
        "env": {"NCCL_DEBUG": "INFO", "MLFLOW_TRACKING_URI": "http://mlflow:5000"},
        "volumes": [{"name": "workspace", "persistentVolumeClaim": {"claimName": "nightshift-workspace"}}],
        "volume_mounts": [{"name": "workspace", "mountPath": "/workspace"}],
        "service_account_name": "nightshift-trainer",
        "node_selector": {"nvidia.com/gpu.product": "A100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "priority_class_name": "training",
        "image_pull_policy": "IfNotPresent",
        "image_pull_secrets": ["regcred"],
        "labels": {"team": "ml platform"},
        "annotations": {"owner": "ml-platform@example.com"},
        "clean_pod_policy": "All",
        "backoff_limit": 1,
        "ttl_seconds_after_finished": 600,
        "active_deadline_seconds": 7200,
    },
    "no-ttl": {"num_workers": 3, "ttl_seconds_after_finished": None, "clean_pod_policy": "None"},
}


def config(**overrides: Any) -> MPIJobConfig:
    return MPIJobConfig(**{"image": "ghcr.io/example/trainer:1", "command": COMMAND, **overrides})


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_built_manifest_validates_against_the_crd(name: str, validate_mpijob: Any) -> None:
    manifest = build_mpijob(config(**CONFIGS[name]), IDENTITY)
    validate_mpijob(manifest)
    assert manifest["apiVersion"] == "kubeflow.org/v2beta1" and manifest["kind"] == "MPIJob"


def test_gpu_job_shape() -> None:
    manifest = build_mpijob(config(**CONFIGS["gpus"]), IDENTITY)
    spec = manifest["spec"]
    assert spec["slotsPerWorker"] == 8
    assert spec["launcherCreationPolicy"] == "WaitForWorkersReady"
    assert spec["runPolicy"] == {
        "cleanPodPolicy": "Running",
        "backoffLimit": 0,
        "ttlSecondsAfterFinished": 3600,
    }
    worker = spec["mpiReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4
    wc = worker["template"]["spec"]["containers"][0]
    assert wc["resources"] == {"requests": {"cpu": "8"}, "limits": {"memory": "64Gi", GPU_RESOURCE: 8}}
    launcher = spec["mpiReplicaSpecs"]["Launcher"]
    assert launcher["replicas"] == 1
    lc = launcher["template"]["spec"]["containers"][0]
    assert GPU_RESOURCE not in str(lc["resources"])
    # horovodrun (Gloo) starts one rank per GPU over the operator's hostfile, then the entrypoint unchanged.
    assert lc["command"] == ["horovodrun", "--gloo", "-np", "32", "--hostfile", "/etc/mpi/hostfile",
                             "--network-interfaces", "eth0", *COMMAND]
    assert lc["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_cpu_job_runs_one_rank_per_worker_and_asks_no_gpu() -> None:
    manifest = build_mpijob(config(num_workers=3), IDENTITY)
    assert manifest["spec"]["slotsPerWorker"] == 1
    command = manifest["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("-np") + 1] == "3"
    assert GPU_RESOURCE not in str(manifest)


@pytest.mark.parametrize(("interfaces", "expected"), [("net1", ["--network-interfaces", "net1"]),
                                                      ("eth0,net1", ["--network-interfaces", "eth0,net1"]),
                                                      (None, [])])
def test_the_launcher_pins_horovodrun_to_the_pod_interfaces(interfaces: str | None, expected: list[str]) -> None:
    # A single worker host: horovodrun would otherwise count its loopback as common and may rendezvous there.
    manifest = build_mpijob(config(num_workers=1, network_interfaces=interfaces), IDENTITY)
    command = manifest["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert command[6:6 + len(expected)] == expected
    assert command[6 + len(expected):] == COMMAND


def test_everything_config_reaches_both_pod_templates() -> None:
    manifest = build_mpijob(config(**CONFIGS["everything"]), IDENTITY)
    assert manifest["metadata"]["namespace"] == "ml-train"
    for role in ("Launcher", "Worker"):
        pod = manifest["spec"]["mpiReplicaSpecs"][role]["template"]
        spec = pod["spec"]
        assert spec["serviceAccountName"] == "nightshift-trainer"
        assert spec["volumes"][0]["persistentVolumeClaim"]["claimName"] == "nightshift-workspace"
        assert spec["containers"][0]["volumeMounts"] == [{"name": "workspace", "mountPath": "/workspace"}]
        assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert spec["priorityClassName"] == "training"
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
        assert env["NCCL_DEBUG"] == "INFO" and env["PYTHONUNBUFFERED"] == "1"
        assert pod["metadata"]["labels"]["dag_id"] == "nightly_retrain"
        assert pod["metadata"]["labels"]["team"] == safe_label_value("ml platform")
    launcher = manifest["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    # horovodrun --gloo passes the launcher's env to every rank itself: no forwarding list on the command line
    assert launcher["command"][:2] == ["horovodrun", "--gloo"] and "-x" not in launcher["command"]
    assert {"MLFLOW_TRACKING_URI", "NCCL_DEBUG"} <= {e["name"] for e in launcher["env"]}


def test_labels_are_sanitised_task_identity() -> None:
    identity = TaskIdentity("a dag/with:odd chars" + "x" * 80, "group.train", "manual__2026-01-01T00:00:00+00:00", 3)
    labels = build_mpijob(config(num_workers=1), identity)["metadata"]["labels"]
    for key in ("dag_id", "task_id", "run_id", "try_number"):
        assert LABEL_VALUE.match(labels[key]) and len(labels[key]) <= 63, (key, labels[key])
    assert labels["try_number"] == "3"
    assert labels["task_id"] == "group.train"  # already valid: unchanged
    # two values that sanitise alike stay distinct
    assert safe_label_value("run:1") != safe_label_value("run-1")


@pytest.mark.parametrize(
    "task_id",
    [
        "train",
        "Train_Model",
        "9lives",
        "___",
        "group.sub_group.a_very_long_task_identifier_for_training_models",
    ],
)
def test_job_name_is_a_dns_label_unique_per_try(task_id: str) -> None:
    names = {job_name(TaskIdentity("d", task_id, "r", t)) for t in (1, 2, 3)}
    assert len(names) == 3
    for name in names:
        assert DNS_1035.match(name) and len(name) <= 40, name
    assert job_name(TaskIdentity("d", task_id, "r", 1)) == job_name(TaskIdentity("d", task_id, "r", 1))
    assert job_name(TaskIdentity("d", task_id, "r", 1)) != job_name(TaskIdentity("d", task_id, "r2", 1))
    assert job_name(TaskIdentity("d", task_id, "r", 1)) != job_name(TaskIdentity("d2", task_id, "r", 1))


def test_checkpoint_dir_ignores_the_try_and_stays_inside_its_root() -> None:
    assert checkpoint_subdir("dag", "manual__2026-01-01T00:00:00+00:00", "train").startswith(
        "dag/manual__2026-01-01T00_00_00+00_00~"
    )
    assert checkpoint_subdir("dag", "scheduled__2026-01-01", "train") == "dag/scheduled__2026-01-01/train"
    parts = checkpoint_subdir("..", "a/b", ".").split("/")
    assert len(parts) == 3 and not {".", ".."} & set(parts)
    # two runs whose ids differ only in characters a path cannot hold never share a checkpoint directory
    assert checkpoint_subdir("d", "a:b", "t") != checkpoint_subdir("d", "a_b", "t")
    assert with_checkpoint_dir(["python", "x.py"], "/ck") == ["python", "x.py", "--checkpoint-dir", "/ck"]
    assert with_checkpoint_dir(["x", "--checkpoint-dir=/mine"], "/ck") == ["x", "--checkpoint-dir=/mine"]


def test_command_splitting() -> None:
    assert split_command("python -m nightshift.train --lr '0.1'") == [
        "python",
        "-m",
        "nightshift.train",
        "--lr",
        "0.1",
    ]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_workers": 0}, "num_workers"),
        ({"gpus_per_worker": -1}, "gpus_per_worker"),
        ({"image": " "}, "image"),
        ({"command": []}, "command"),
        ({"clean_pod_policy": "Sometimes"}, "clean_pod_policy"),
        ({"namespace": "Not_A_Label"}, "namespace"),
        ({"env": {"BAD NAME": "x"}}, "env"),
        ({"env": {"N": 3}}, "env"),
        ({"image_pull_policy": "Maybe"}, "image_pull_policy"),
        ({"network_interfaces": "eth0; rm -rf /"}, "network_interfaces"),
        ({"network_interfaces": ""}, "network_interfaces"),
    ],
)
def test_invalid_config_names_the_field(overrides: dict[str, Any], field: str) -> None:
    base = {"num_workers": 1, **overrides}
    with pytest.raises(InvalidJobConfig, match=field):
        config(**base)


@pytest.mark.parametrize("priority", [None, "", "  "])
def test_a_queued_job_without_a_priority_carries_no_priority_label(priority: str | None,
                                                                    validate_mpijob: Any) -> None:
    job = build_mpijob(config(num_workers=2, queue_name="nightly", priority_class=priority), IDENTITY)
    validate_mpijob(job)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "nightly"
    assert "kueue.x-k8s.io/priority-class" not in job["metadata"]["labels"]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"queue_name": "Nightly Queue"}, "queue must be a Kueue object name"),
    ({"queue_name": "nightly", "priority_class": "Low!"}, "priority must be a Kueue object name"),
])
def test_a_bad_queue_or_priority_is_refused_naming_it(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidJobConfig, match=message):
        config(num_workers=1, **overrides)
