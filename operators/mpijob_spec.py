"""Pure builder of Kubeflow `MPIJob` (kubeflow.org/v2beta1) manifests for Horovod training.

Nothing here talks to a cluster or imports the Kubernetes client: a config dataclass and the task's
identity go in, a plain dict comes out (what `kubectl apply` would take). Names, labels and the
checkpoint directory are derived here too, so the local and Kubernetes backends agree on them.
"""

from __future__ import annotations

import copy
import hashlib
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from operators.errors import InvalidJobConfig

API_GROUP = "kubeflow.org"
API_VERSION = "v2beta1"
KIND = "MPIJob"
PLURAL = "mpijobs"

GPU_RESOURCE = "nvidia.com/gpu"
# Kueue: the LocalQueue a job waits in, and its WorkloadPriorityClass (labels Kueue reads on the job).
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
# Most workers one job may have (the DAG's `workers` Param allows as many).
MAX_WORKERS = 256
# Labels the MPI Operator (v2) puts on the pods it creates for a job.
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
JOB_ROLE_LABEL = "training.kubeflow.org/job-role"
# The Airflow deployment a job belongs to (NIGHTSHIFT_INSTANCE): two deployments sharing a namespace never
# delete, or reattach to, each other's jobs. Absent for the unnamed (default) deployment.
INSTANCE_LABEL = "nightshift.io/instance"
INSTANCE_ENV = "NIGHTSHIFT_INSTANCE"
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
LAUNCHER_CONTAINER = "launcher"
WORKER_CONTAINER = "worker"

# The MPI Operator names pods "<job>-worker-<i>" and a Service "<job>"; keep the job name short enough
# that every derived name stays a valid DNS label (63 characters).
MAX_JOB_NAME_LEN = 40
MAX_LABEL_LEN = 63

CLEAN_POD_POLICIES = ("None", "Running", "All")
IMAGE_PULL_POLICIES = ("Always", "IfNotPresent", "Never")

# Defaults match the MPI Operator's non-root example: workers run sshd for the launcher's horovodrun.
DEFAULT_SSH_AUTH_MOUNT_PATH = "/home/mpiuser/.ssh"
DEFAULT_WORKER_COMMAND = ("/usr/sbin/sshd", "-De", "-f", "/home/mpiuser/.sshd_config")
DEFAULT_LAUNCHER_RESOURCES: Mapping[str, Mapping[str, str]] = {
    "requests": {"cpu": "250m", "memory": "256Mi"},
}
# Where the MPI Operator mounts the hostfile it writes for the launcher (`<worker-fqdn> slots=N` lines).
MPI_HOSTFILE = "/etc/mpi/hostfile"
# Beside it, the script Horovod's elastic driver runs to learn the hosts: one `echo <worker-fqdn>` per worker pod
# that is running (no slots: horovodrun's `--slots-per-host` gives them), kept current by the MPI Operator.
MPI_DISCOVER_HOSTS = "/etc/mpi/discover_hosts.sh"
# An elastic job's host whose rank failed is blacklisted; without a cooldown it is never re-admitted, even when
# the discovery script lists it again. With (LO, HI) it is tried again after LO*2 + rand*LO s, growing up to HI.
ELASTIC_COOLDOWN_RANGE = (2, 120)
# The trainer's flag for its elastic mode (state committed in memory, rolled back and re-broadcast on a reset).
ELASTIC_FLAG = "--elastic"
# The pods' interface the ranks and horovodrun's driver talk over. Left to itself, horovodrun with a single
# worker host counts that host's loopback as a common interface and, about half the time (set order), puts
# its rendezvous on 127.0.0.1, which the remote rank cannot reach ("HTTP GET request failed too many
# times"); seen under `nightshift run-mpijob` (bench/RESULTS.md, issue 9).
DEFAULT_NETWORK_INTERFACES = "eth0"
NETWORK_INTERFACES = r"[A-Za-z0-9_.:@-]{1,15}(,[A-Za-z0-9_.:@-]{1,15})*"


@dataclass(frozen=True)
class TaskIdentity:
    """Who a job belongs to: the Airflow task instance it runs for."""

    dag_id: str
    task_id: str
    run_id: str
    try_number: int = 1
    map_index: int = -1
    # The Airflow deployment (NIGHTSHIFT_INSTANCE; "" for the unnamed one): in the labels and the job's name.
    instance: str = ""

    def __post_init__(self) -> None:
        check_instance(self.instance)


def check_instance(instance: str) -> str:
    """`instance` if it is a valid label value (<= 63 of [A-Za-z0-9_.-], alphanumeric at both ends)."""
    if len(instance) > MAX_LABEL_LEN or not LABEL_VALUE.fullmatch(instance):
        raise InvalidJobConfig(f"{INSTANCE_ENV} must be a Kubernetes label value (at most {MAX_LABEL_LEN} letters, "
                               f"digits, '-', '_' or '.', starting and ending with a letter or digit), got "
                               f"{instance!r}")
    return instance


@dataclass(frozen=True)
class MPIJobConfig:
    """Everything the MPIJob needs besides the task identity. Validated on construction."""

    image: str
    command: Sequence[str]
    num_workers: int
    gpus_per_worker: int = 0
    namespace: str = "default"
    cpu_request: str | None = None
    cpu_limit: str | None = None
    memory_request: str | None = None
    memory_limit: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    volumes: Sequence[Mapping[str, Any]] = ()
    volume_mounts: Sequence[Mapping[str, Any]] = ()
    service_account_name: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()
    priority_class_name: str | None = None
    image_pull_policy: str | None = None
    image_pull_secrets: Sequence[str] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    clean_pod_policy: str = "Running"
    backoff_limit: int = 0
    ttl_seconds_after_finished: int | None = 3600
    active_deadline_seconds: int | None = None
    launcher_resources: Mapping[str, Mapping[str, str]] = field(
        default_factory=lambda: {k: dict(v) for k, v in DEFAULT_LAUNCHER_RESOURCES.items()}
    )
    worker_command: Sequence[str] = DEFAULT_WORKER_COMMAND
    ssh_auth_mount_path: str = DEFAULT_SSH_AUTH_MOUNT_PATH
    network_interfaces: str | None = DEFAULT_NETWORK_INTERFACES
    queue_name: str | None = None
    priority_class: str | None = None
    # Elastic training: the fewest workers the job goes on with (None: a fixed-size job). `num_workers` is then
    # the most: the MPIJob has that many worker replicas and horovodrun grows and shrinks between the two.
    min_workers: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.image, str) or not self.image.strip():
            raise InvalidJobConfig("image must be a non-empty string")
        if not self.command or not all(isinstance(part, str) for part in self.command):
            raise InvalidJobConfig(f"command must be a non-empty list of strings, got {self.command!r}")
        _check_int("num_workers", self.num_workers, minimum=1)
        if self.min_workers is not None:
            _check_int("min_workers", self.min_workers, minimum=1)
            if self.min_workers > self.num_workers:
                raise InvalidJobConfig(f"min_workers ({self.min_workers}) is more than max_workers "
                                       f"({self.num_workers}): set min_workers at most max_workers")
        _check_int("gpus_per_worker", self.gpus_per_worker, minimum=0)
        _check_int("backoff_limit", self.backoff_limit, minimum=0)
        if self.ttl_seconds_after_finished is not None:
            _check_int("ttl_seconds_after_finished", self.ttl_seconds_after_finished, minimum=0)
        if self.active_deadline_seconds is not None:
            _check_int("active_deadline_seconds", self.active_deadline_seconds, minimum=1)
        if self.clean_pod_policy not in CLEAN_POD_POLICIES:
            raise InvalidJobConfig(
                f"clean_pod_policy must be one of {CLEAN_POD_POLICIES}, got {self.clean_pod_policy!r}"
            )
        if self.image_pull_policy is not None and self.image_pull_policy not in IMAGE_PULL_POLICIES:
            raise InvalidJobConfig(
                f"image_pull_policy must be one of {IMAGE_PULL_POLICIES}, got {self.image_pull_policy!r}"
            )
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", self.namespace or ""):
            raise InvalidJobConfig(f"namespace must be a DNS label, got {self.namespace!r}")
        if self.network_interfaces is not None and not re.fullmatch(NETWORK_INTERFACES, self.network_interfaces):
            raise InvalidJobConfig(f"network_interfaces must be interface names separated by commas (e.g. 'eth0' "
                                   f"or 'eth0,net1'), got {self.network_interfaces!r}")
        # Both are optional in Kueue: a blank one (a Param left empty) means none, so no label.
        for attribute in ("queue_name", "priority_class"):
            value = getattr(self, attribute)
            if isinstance(value, str) and not value.strip():
                object.__setattr__(self, attribute, None)
        for what, value in (("queue", self.queue_name), ("priority", self.priority_class)):
            if value is not None and not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?", str(value)):
                raise InvalidJobConfig(f"{what} must be a Kueue object name (a DNS subdomain of at most 63 "
                                       f"characters), got {value!r}")
        for key, value in self.env.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", str(key)):
                raise InvalidJobConfig(f"env name {key!r} is not a valid environment variable name")
            if not isinstance(value, str):
                raise InvalidJobConfig(f"env {key} must be a string, got {type(value).__name__}")
        if self.min_workers is not None and self.queue_name:
            raise InvalidJobConfig(elastic_kueue_problem(self.min_workers, self.num_workers, self.queue_name))
        if self.min_workers is not None and not self.network_interfaces:
            raise InvalidJobConfig("elastic training needs network_interfaces (e.g. 'eth0'): without it horovodrun's "
                                   "elastic driver waits for two worker hosts to find their common interfaces, "
                                   "and never starts with one; set network_interfaces to the pods' interface")

    @property
    def slots_per_worker(self) -> int:
        """One MPI slot per GPU; a CPU-only worker runs one rank."""
        return max(self.gpus_per_worker, 1)

    @property
    def total_processes(self) -> int:
        return self.num_workers * self.slots_per_worker

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None


def elastic_kueue_problem(min_workers: int, max_workers: int, queue: str) -> str:
    """Why an elastic job is not put in a Kueue queue, and what to do (one line)."""
    return (f"elastic training (min_workers={min_workers}, max_workers={max_workers}) cannot wait in Kueue queue "
            f"{queue!r}: Kueue admits the job's full size (max_workers) as one unit and does not resize it as "
            f"workers come and go; set kueue_queue to \"\" (the Param 'queue' empty) or clear min_workers and "
            f"max_workers for a fixed-size job")


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidJobConfig(f"{name} must be an integer >= {minimum}, got {value!r}")


def split_command(command: str | Sequence[str]) -> list[str]:
    """A command given as one shell-like string or as a list, as a list of arguments."""
    if isinstance(command, str):
        return shlex.split(command)
    return [str(part) for part in command]


def pack_gpus(total: int, gpus_per_node: int, *, max_workers: int = MAX_WORKERS) -> tuple[int, int]:
    """(workers, GPUs per worker) for `total` GPUs on nodes of `gpus_per_node`: the fewest workers.

    An MPIJob's workers are identical (one pod template), so the total is split into equal workers, each
    no larger than a node: the smallest worker count w with total % w == 0 and total / w <= gpus_per_node.
    12 GPUs on 8-GPU nodes: 2 workers of 6; 16: 2 of 8; 7 on 4-GPU nodes: 7 of 1 (7 is prime).
    A total needing more than `max_workers` workers, or a node size below 1, is refused.
    """
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise InvalidJobConfig(f"gpus must be a positive integer, got {total!r}")
    if gpus_per_node < 1:
        raise InvalidJobConfig(f"GPUs per node must be at least 1, got {gpus_per_node!r}")
    smallest = -(-total // gpus_per_node)
    for workers in range(smallest, min(total, max_workers) + 1):
        if total % workers == 0:
            return workers, total // workers
    raise InvalidJobConfig(
        f"{total} GPUs do not split into at most {max_workers} equal workers of at most {gpus_per_node} GPUs; "
        f"ask for a multiple of a smaller number, e.g. {gpus_per_node * (total // gpus_per_node)}"
    )


def safe_label_value(value: str) -> str:
    """`value` as a valid Kubernetes label value: <= 63 chars of [A-Za-z0-9_.-], alphanumeric at both ends.

    A value that had to change gets a short hash of the original, so two different values never collide.
    """
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "-", value)
    cleaned = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", cleaned)
    if cleaned == value and len(cleaned) <= MAX_LABEL_LEN:
        return cleaned
    digest = hashlib.sha256(value.encode()).hexdigest()[:8]
    head = cleaned[: MAX_LABEL_LEN - len(digest) - 1].rstrip("-_.")
    return f"{head}-{digest}" if head else digest


def task_labels(identity: TaskIdentity) -> dict[str, str]:
    """Labels that let a retry or `on_kill` find what this task instance created."""
    labels = {
        "dag_id": safe_label_value(identity.dag_id),
        "task_id": safe_label_value(identity.task_id),
        "run_id": safe_label_value(identity.run_id),
        "try_number": str(identity.try_number),
        "app.kubernetes.io/managed-by": "airflow",
        "app.kubernetes.io/component": "horovod-training",
    }
    if identity.map_index >= 0:
        labels["map_index"] = str(identity.map_index)
    if identity.instance:
        labels[INSTANCE_LABEL] = identity.instance
    return labels


def earlier_tries_selector(labels: Mapping[str, str]) -> str:
    """The label selector of every job (and pod) of this task instance, whatever the try, in this deployment."""
    selector = ",".join(f"{key}={labels[key]}" for key in ("dag_id", "run_id", "task_id"))
    selector += f",map_index={labels['map_index']}" if "map_index" in labels else ",!map_index"
    instance = labels.get(INSTANCE_LABEL)
    return selector + (f",{INSTANCE_LABEL}={instance}" if instance else f",!{INSTANCE_LABEL}")


def job_name(identity: TaskIdentity) -> str:
    """A name unique per task try and valid as a DNS-1035 label, readable from the task id.

    The hash covers dag, run, task and map index, so two runs of one task never share a name; the try
    number is spelled out so a retry creates a new job and `kubectl get mpijobs` shows which try is which.
    """
    key = f"{identity.dag_id}\x00{identity.run_id}\x00{identity.task_id}\x00{identity.map_index}"
    if identity.instance:  # the unnamed deployment keeps the names it always had
        key += f"\x00{identity.instance}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    suffix = f"-{digest}-try{identity.try_number}"
    slug = re.sub(r"[^a-z0-9]+", "-", identity.task_id.lower()).strip("-")
    if not slug or not slug[0].isalpha():
        slug = f"hvd-{slug}".rstrip("-")
    slug = slug[: MAX_JOB_NAME_LEN - len(suffix)].rstrip("-")
    return f"{slug}{suffix}"


def checkpoint_subdir(dag_id: str, run_id: str, task_id: str) -> str:
    """The checkpoint directory of a task relative to a root: dag/run/task, never the try number."""
    from nightshift.fsutil import safe_name

    return "/".join(safe_name(part) for part in (dag_id, run_id, task_id))


def with_checkpoint_dir(command: Sequence[str], checkpoint_dir: str | None) -> list[str]:
    """The command with `--checkpoint-dir DIR` appended unless it already passes one."""
    args = list(command)
    passed = any(a == "--checkpoint-dir" or a.startswith("--checkpoint-dir=") for a in args)
    if checkpoint_dir is None or passed:
        return args
    return [*args, "--checkpoint-dir", checkpoint_dir]


def paths_outside_mounts(command: Sequence[str], mount_paths: Sequence[str]) -> list[str]:
    """Absolute paths among the command's arguments (not the program itself) that no mount covers.

    `--flag=/path` counts as `/path`. A pod sees only its image and its volumes: a path of the Airflow
    worker's disk in a trainer's command names nothing, or something else, in the pod.
    """
    mounts = [PurePosixPath(m) for m in mount_paths]
    outside = []
    for arg in list(command)[1:]:
        value = arg.split("=", 1)[1] if arg.startswith("--") and "=" in arg else arg
        if value.startswith("/") and not any(PurePosixPath(value).is_relative_to(m) for m in mounts):
            outside.append(value)
    return outside


def check_no_credentials(what: str, uri: str) -> None:
    """Refuse a URI with a password in it: it would be written into manifests, env and command lines."""
    if urlsplit(uri).password is not None:
        raise InvalidJobConfig(
            f"{what} carries a password; give the trainer its credentials through a Kubernetes Secret or "
            f"MLflow's credentials file (~/.mlflow/credentials), not in the URI"
        )


def launcher_command(config: MPIJobConfig) -> list[str]:
    """What the launcher pod runs: `horovodrun --gloo` over the hostfile the MPI Operator mounts, then the entrypoint.

    Gloo, not MPI, so the same command runs with a Horovod built without MPI (Gloo only). horovodrun reads the
    operator's `host slots=N` hostfile, reaches the workers over ssh with the image's client configuration
    (port, identity: `images/trainer/ssh_config`), and passes the launcher's environment to every rank
    itself, so the container env (MLFLOW_TRACKING_URI, NIGHTSHIFT_HOME, ...) needs no forwarding list.

    An elastic job (`min_workers` set) runs horovodrun's elastic driver instead: it learns the hosts from the
    operator's `discover_hosts.sh` (the running worker pods, S slots each), starts with all of them, goes on
    with at least `min_workers` when hosts are lost, re-admits a host after a cooldown, and the entrypoint gets
    `--elastic` (the trainer's elastic mode) unless it passes it:

        horovodrun --gloo -np MAX*S --min-np MIN*S --max-np MAX*S --slots-per-host S
            --host-discovery-script /etc/mpi/discover_hosts.sh --blacklist-cooldown-range 2 120
            [--network-interfaces ...] <command> --elastic
    """
    if config.min_workers is None:
        argv = ["horovodrun", "--gloo", "-np", str(config.total_processes), "--hostfile", MPI_HOSTFILE]
    else:
        argv = elastic_horovodrun_options(config.min_workers, config.num_workers, config.slots_per_worker,
                                          MPI_DISCOVER_HOSTS)
    if config.network_interfaces:
        argv += ["--network-interfaces", config.network_interfaces]
    command = list(config.command)
    return [*argv, *(with_elastic_flag(command) if config.min_workers is not None else command)]


def elastic_horovodrun_options(min_workers: int, max_workers: int, slots: int, discovery_script: str,
                               *, horovodrun: str = "horovodrun") -> list[str]:
    """horovodrun and its elastic options for `min_workers`..`max_workers` hosts of `slots` ranks each, the hosts
    listed by `discovery_script` (one `host` or `host:slots` a line)."""
    low, high = ELASTIC_COOLDOWN_RANGE
    return [horovodrun, "--gloo", "-np", str(max_workers * slots), "--min-np", str(min_workers * slots),
            "--max-np", str(max_workers * slots), "--slots-per-host", str(slots),
            "--host-discovery-script", discovery_script, "--blacklist-cooldown-range", str(low), str(high)]


def with_elastic_flag(command: Sequence[str]) -> list[str]:
    """The trainer command with `--elastic` appended unless it passes it."""
    args = list(command)
    return args if ELASTIC_FLAG in args else [*args, ELASTIC_FLAG]


def _env_list(env: Mapping[str, str]) -> list[dict[str, str]]:
    merged = {"PYTHONUNBUFFERED": "1", **env}
    return [{"name": key, "value": value} for key, value in merged.items()]


def _resources(requests: Mapping[str, str | None], limits: Mapping[str, str | int | None]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    req = {k: v for k, v in requests.items() if v is not None}
    lim = {k: v for k, v in limits.items() if v is not None}
    if req:
        out["requests"] = req
    if lim:
        out["limits"] = lim
    return out


def _pod_spec(config: MPIJobConfig, container: dict[str, Any]) -> dict[str, Any]:
    # Deep copies: the launcher's and the workers' templates share no object (YAML would print anchors).
    if config.image_pull_policy:
        container["imagePullPolicy"] = config.image_pull_policy
    if config.volume_mounts:
        container["volumeMounts"] = copy.deepcopy([dict(m) for m in config.volume_mounts])
    spec: dict[str, Any] = {"containers": [container]}
    if config.volumes:
        spec["volumes"] = copy.deepcopy([dict(v) for v in config.volumes])
    if config.service_account_name:
        spec["serviceAccountName"] = config.service_account_name
    if config.node_selector:
        spec["nodeSelector"] = dict(config.node_selector)
    if config.tolerations:
        spec["tolerations"] = copy.deepcopy([dict(t) for t in config.tolerations])
    if config.priority_class_name:
        spec["priorityClassName"] = config.priority_class_name
    if config.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in config.image_pull_secrets]
    return spec


def build_mpijob(config: MPIJobConfig, identity: TaskIdentity, *, name: str | None = None) -> dict[str, Any]:
    """The MPIJob manifest for `config`, run on behalf of `identity`."""
    name = name or job_name(identity)
    labels = {**{k: safe_label_value(str(v)) for k, v in config.labels.items()}, **task_labels(identity)}
    env = _env_list(config.env)
    gpu_limit: dict[str, str | int | None] = {GPU_RESOURCE: config.gpus_per_worker or None}

    launcher_container: dict[str, Any] = {
        "name": LAUNCHER_CONTAINER,
        "image": config.image,
        "command": launcher_command(config),
        "env": env,
        # On failure the launcher's last log lines become its termination message: the error we report.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": {k: dict(v) for k, v in config.launcher_resources.items()},
    }
    worker_container: dict[str, Any] = {
        "name": WORKER_CONTAINER,
        "image": config.image,
        "command": list(config.worker_command),
        "env": _env_list(config.env),
        "resources": _resources(
            {"cpu": config.cpu_request, "memory": config.memory_request},
            {"cpu": config.cpu_limit, "memory": config.memory_limit, **gpu_limit},
        ),
    }

    def pod_metadata() -> dict[str, Any]:
        meta: dict[str, Any] = {"labels": dict(labels)}
        if config.annotations:
            meta["annotations"] = dict(config.annotations)
        return meta

    run_policy: dict[str, Any] = {
        "cleanPodPolicy": config.clean_pod_policy,
        "backoffLimit": config.backoff_limit,
    }
    job_labels = dict(labels)
    if config.queue_name:
        # Created suspended: Kueue unsuspends the job when its Workload is admitted (and suspends it
        # again when it is preempted); the MPI Operator creates pods only while it is not suspended.
        # The queue labels go on the job only: on the pods they would ask Kueue's pod integration to
        # queue each pod on its own.
        run_policy["suspend"] = True
        job_labels[KUEUE_QUEUE_LABEL] = config.queue_name
        if config.priority_class:
            job_labels[KUEUE_PRIORITY_LABEL] = config.priority_class
    if config.ttl_seconds_after_finished is not None:
        run_policy["ttlSecondsAfterFinished"] = config.ttl_seconds_after_finished
    if config.active_deadline_seconds is not None:
        run_policy["activeDeadlineSeconds"] = config.active_deadline_seconds

    metadata: dict[str, Any] = {"name": name, "namespace": config.namespace, "labels": job_labels}
    if config.annotations:
        metadata["annotations"] = dict(config.annotations)
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": metadata,
        "spec": {
            "slotsPerWorker": config.slots_per_worker,
            "launcherCreationPolicy": "WaitForWorkersReady",
            "mpiImplementation": "OpenMPI",
            "sshAuthMountPath": config.ssh_auth_mount_path,
            "runPolicy": run_policy,
            "mpiReplicaSpecs": {
                "Launcher": {
                    "replicas": 1,
                    "restartPolicy": "Never",
                    "template": {"metadata": pod_metadata(), "spec": _pod_spec(config, launcher_container)},
                },
                "Worker": {
                    "replicas": config.num_workers,
                    # Elastic: a worker whose container fails (OOM, a crashed sshd) is restarted in its pod by the
                    # kubelet and listed in discover_hosts.sh again once Running; the MPI Operator recreates
                    # only worker pods that are gone, so with Never a failed one would never come back.
                    "restartPolicy": "OnFailure" if config.elastic else "Never",
                    "template": {"metadata": pod_metadata(), "spec": _pod_spec(config, worker_container)},
                },
            },
        },
    }
