"""The settings of a `HorovodKubernetesOperator`, declared once, as small frozen dataclasses by concern:

- `JobConfig`: what runs — the command, workers and GPUs, the image, env, checkpoints, resources;
- `ClusterConfig`: where it runs — the backend, the Kubernetes namespace, pods' placement, Kueue;
- `ExecutionConfig`: how it is waited for and cleaned up — deferral, polling, timeouts, retries of the job;
- `TrackingConfig`: where its result comes back from — the MLflow experiment and run key.

Each field's metadata (`meta`) says whether it is a template field (the operator exposes it as an attribute
of that name, which Airflow renders and serialises) and how its rendered value is converted at execute
(`settle`: e.g. "4" -> 4, naming the field when the value is wrong). A plain value is checked when
the config is made, so a DAG with a typo fails to parse; a template is checked once rendered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

from operators.counts import COUNT_MINIMUMS, count_problem, param_name, parse_count, pool_slots
from operators.errors import InvalidJobConfig
from operators.mpijob_spec import (
    DEFAULT_LAUNCHER_RESOURCES,
    DEFAULT_NETWORK_INTERFACES,
    DEFAULT_SSH_AUTH_MOUNT_PATH,
    DEFAULT_WORKER_COMMAND,
    MAX_WORKERS,
    MPIJobConfig,
)

CleanupPolicy = Literal["always", "on_success", "never"]
CLEANUP_POLICIES = ("always", "on_success", "never")

Settle = Callable[[str, Any], Any]


def meta(*, templated: bool = False, settle: Settle | None = None, renderer: str | None = None) -> dict[str, Any]:
    """A config field's metadata: `templated` makes it an operator template field (`renderer`: how the UI
    shows it); `settle(name, value)` converts and checks a value (a rendered template at execute), raising
    InvalidJobConfig that names the field."""
    return {"templated": templated, "settle": settle, "renderer": renderer}


def is_template(value: object) -> bool:
    """A Jinja template, or a mapping holding one (e.g. `elastic`'s ``{"max_workers": "{{ params.max_workers }}"}``)."""
    if isinstance(value, Mapping):
        return any(is_template(item) for item in value.values())
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def template_source(template: object) -> str:
    """What a person changes when a rendered `template` is wrong: the run's Param(s) it reads, else the template."""
    if isinstance(template, Mapping):
        params = [name for item in template.values() if (name := param_name(item))]
        if params:
            return f"the run's Param{'s' if len(params) > 1 else ''} {', '.join(repr(p) for p in params)}"
    elif (param := param_name(template)) is not None:
        return f"the run's Param {param!r}"
    return f"the template {template!r}"


# --- conversions of rendered values -------------------------------------------------------------------


def to_count(name: str, value: object, minimum: int) -> int:
    """An int field given as an int or as its rendered template (a string of digits) (`operators.counts`)."""
    number = parse_count(value, minimum)
    if number is None:
        raise InvalidJobConfig(count_problem(name, value, minimum))
    return number


def count(minimum: int) -> Settle:
    return lambda name, value: to_count(name, value, minimum)


def count_of(field_name: str) -> Settle:
    """The settle of a Horovod count field (`num_workers`, ...), with its minimum from `operators.counts`."""
    return count(COUNT_MINIMUMS[field_name])


def one_of(choices: Sequence[str]) -> Settle:
    def check(name: str, value: object) -> str:
        text = value.strip() if isinstance(value, str) else value
        if text not in choices:
            raise InvalidJobConfig(f"{name} must be one of {tuple(choices)}, got {value!r}")
        return str(text)

    return check


def a_backend(name: str, value: object) -> str:
    """A training backend's name (operators.backends' registry: built-ins, entry points, NIGHTSHIFT_PLUGINS'
    modules) or "auto"."""
    from nightshift.errors import UsageError
    from operators.backends import check_backend

    try:
        return check_backend(value)
    except UsageError as err:
        raise InvalidJobConfig(f"{name}: {err}") from err


def name_or_none(name: str, value: object) -> str | None:
    """A rendered optional name: None stays None; "None" (a None param rendered by Jinja) and blanks are ""."""
    if value is None:
        return None
    text = str(value).strip()
    return "" if text in {"", "None"} else text


def optional_number(minimum: float) -> Settle:
    def check(name: str, value: object) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
            raise InvalidJobConfig(f"{name} must be a number >= {minimum} (or None), got {value!r}")
        return float(value)

    return check


def optional_seconds(minimum: float) -> Settle:
    """A number of seconds or None, given as a number or as its rendered template ("7200"; "None" or blank
    for a Param left empty)."""

    def check(name: str, value: object) -> float | None:
        if isinstance(value, str):
            text = value.strip()
            if text in {"", "None"}:
                return None
            try:
                value = float(text)
            except ValueError:
                raise InvalidJobConfig(f"{name} must be a number of seconds >= {minimum:g} (or empty for no "
                                       f"limit), got {value!r}") from None
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
            raise InvalidJobConfig(f"{name} must be a number of seconds >= {minimum:g} (or empty for no limit), "
                                   f"got {value!r}")
        return float(value)

    return check


def number(minimum: float) -> Settle:
    def check(name: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
            raise InvalidJobConfig(f"{name} must be a number >= {minimum}, got {value!r}")
        return float(value)

    return check


ELASTIC_KEYS = ("min_workers", "max_workers")
_EMPTY = (None, "", "None", "null")


def an_elastic(name: str, value: object) -> dict[str, int] | None:
    """Elastic training's range: None (a fixed-size job), or ``{"min_workers": MIN, "max_workers": MAX}`` with
    1 <= MIN <= MAX <= 256, each an int or its rendered template; both empty ("None": Params left empty) is None."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) - set(ELASTIC_KEYS):
        raise InvalidJobConfig(f"{name} must be None or {{'min_workers': MIN, 'max_workers': MAX}}, got {value!r}")
    given = {key: (item.strip() if isinstance(item, str) else item) for key, item in value.items()}
    empty = [key for key in ELASTIC_KEYS if given.get(key) in _EMPTY]
    if len(empty) == len(ELASTIC_KEYS):
        return None
    if empty:
        (missing,), (other,) = empty, [key for key in ELASTIC_KEYS if key not in empty]
        raise InvalidJobConfig(f"elastic training needs both min_workers and max_workers, and {missing} is empty "
                               f"({other}={given[other]!r}): set {missing}, or clear {other} for a fixed-size job")
    counts: dict[str, int] = {}
    for key in ELASTIC_KEYS:
        number = parse_count(given[key], -(10**18))
        if number is None:
            raise InvalidJobConfig(f"{key} must be an integer, got {given[key]!r}")
        counts[key] = number
    low, high = counts["min_workers"], counts["max_workers"]
    if low < 1:
        raise InvalidJobConfig(f"min_workers must be at least 1, got {low}: the fewest workers elastic training "
                               f"goes on with (clear min_workers and max_workers for a fixed-size job)")
    if high > MAX_WORKERS:
        raise InvalidJobConfig(f"max_workers must be at most {MAX_WORKERS}, got {high}")
    if low > high:
        raise InvalidJobConfig(f"min_workers ({low}) is more than max_workers ({high}): set min_workers at most "
                               f"max_workers")
    return counts


def boolean(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidJobConfig(f"{name} must be True or False, got {value!r}")
    return value


def _default_deferrable() -> bool:
    from airflow.sdk.configuration import conf

    return conf.getboolean("operators", "default_deferrable", fallback=False)


# --- the configs ---------------------------------------------------------------------------------------


class _Settings:
    """Checks plain values on construction; `settled()` converts every field after rendering."""

    def __post_init__(self) -> None:
        plain = {}
        for name, settle, value in self._settles():
            if not is_template(value):
                plain[name] = settle(name, value)
        self._check_together(plain)

    def _check_together(self, values: Mapping[str, Any]) -> None:
        """Check settings against each other; `values`: the settled ones (a template's is absent until it is)."""
        return None

    def _settles(self) -> Iterator[tuple[str, Settle, Any]]:
        for f in fields(self):  # type: ignore[arg-type]
            if f.metadata.get("settle") is not None:
                yield f.name, f.metadata["settle"], getattr(self, f.name)

    def settled(self: _S, rendered: Mapping[str, Any] | None = None) -> _S:
        """This config with each field converted (InvalidJobConfig names a bad one).

        `rendered`: the rendered values of this config's templates (the operator's template fields after
        Airflow rendered them); a bad one is reported with its template (the Param of ``{{ params.NAME }}``),
        which is what a person changes.
        """
        rendered = dict(rendered or {})
        values: dict[str, Any] = {}
        for name, settle, value in self._settles():
            try:
                values[name] = settle(name, rendered.get(name, value))
            except InvalidJobConfig as err:
                if name not in rendered or not is_template(value):
                    raise
                raise InvalidJobConfig(f"{err} (rendered from {template_source(value)})") from err
        self._check_together(values)
        return dataclasses.replace(self, **{**rendered, **values, **self._derived(values)})  # type: ignore[type-var]

    def _derived(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Fields a settled config takes from others (`values`: every field settled)."""
        return {}


_S = TypeVar("_S", bound=_Settings)


@dataclass(frozen=True)
class JobConfig(_Settings):
    """What runs.

    :param command: the training entrypoint, as a list or one shell-like string, e.g.
        `["python", "-m", "nightshift.train", "--data", "/workspace/data", "--out", "/workspace/model"]`.
        `--checkpoint-dir` is appended unless the command passes one.
    :param num_workers: worker pods (Kubernetes) or local processes: an int, or a template such as
        ``"{{ params.workers }}"``.
    :param gpus_per_worker: GPUs each worker asks for (`nvidia.com/gpu`); also MPI slots per worker. With
        plain ints the task takes `num_workers * gpus_per_worker` slots (at least 1) of the `gpu` pool; with
        templates, 1 unless the cluster policy in `config/airflow_local_settings.py` sizes it from the params.
    :param gpus: the total GPUs (0: `num_workers` x `gpus_per_worker`), packed into the fewest equal workers of
        at most one node's GPUs (NIGHTSHIFT_GPUS_PER_NODE, else the largest allocatable `nvidia.com/gpu` of the
        cluster's nodes; locally, this machine's GPUs); see `mpijob_spec.pack_gpus`. With a Kueue queue, a
        total above what its ClusterQueue can ever admit is refused before submitting.
    :param image: the trainer image (Kubernetes backend).
    :param env: extra environment of the training processes.
    :param checkpoint_dir: where checkpoints live; default `<checkpoint_root>/<dag_id>/<run_id>/<task_id>`
        (never the try number, so a retry resumes). `checkpoint_root` defaults to NIGHTSHIFT_HOME's
        checkpoints directory (on Kubernetes, the shared volume that holds it).
    :param cpu_request: ... and the other resources: each worker container's requests and limits.
    :param elastic: None (default): a fixed-size job of `num_workers`. Or ``{"min_workers": MIN, "max_workers":
        MAX}`` (each an int or a template such as ``"{{ params.max_workers }}"``; both rendered empty is None):
        Horovod elastic training. The job starts with MAX workers (MPIJob worker replicas; `gpu` pool slots
        MAX x `gpus_per_worker`); when workers are lost it goes on with the ranks left, down to MIN, and takes
        a worker back when it returns, without restarting the job. The launcher runs horovodrun's elastic
        driver over the MPI Operator's `/etc/mpi/discover_hosts.sh` and the command gets `--elastic`
        (`mpijob_spec.launcher_command`). `num_workers` is ignored: the job has MAX workers. Refused before
        anything is submitted: MIN < 1, MIN > MAX, MAX > 256, `gpus` (a total; give `gpus_per_worker`), a
        backend that cannot resize a job (`TrainingBackend.supports_elastic`: kubernetes, hosts, and local on
        this one machine), and a Kueue queue: Kueue admits a job's full size (MAX) as one unit and does not
        resize it as workers come and go, so an elastic job runs without Kueue (`kueue_queue=""`).
    """

    command: str | Sequence[str] = field(metadata=meta(templated=True, renderer="py"))
    num_workers: int | str = field(default=1, metadata=meta(templated=True, settle=count_of("num_workers")))
    gpus_per_worker: int | str = field(default=0, metadata=meta(templated=True, settle=count_of("gpus_per_worker")))
    gpus: int | str = field(default=0, metadata=meta(templated=True, settle=count_of("gpus")))
    image: str = field(default="", metadata=meta(templated=True))
    env: Mapping[str, str] | None = field(default=None, metadata=meta(templated=True, renderer="json"))
    checkpoint_dir: str | None = field(default=None, metadata=meta(templated=True))
    checkpoint_root: str | None = field(default=None, metadata=meta(templated=True))
    cpu_request: str | None = field(default=None, metadata=meta(templated=True))
    cpu_limit: str | None = field(default=None, metadata=meta(templated=True))
    memory_request: str | None = field(default=None, metadata=meta(templated=True))
    memory_limit: str | None = field(default=None, metadata=meta(templated=True))
    elastic: Mapping[str, int | str | None] | None = field(
        default=None, metadata=meta(templated=True, settle=an_elastic, renderer="json"))

    def pool_slots(self) -> int | None:
        """The `gpu` pool slots this job takes (`operators.counts.pool_slots`; an elastic job's `max_workers`
        workers); None while a count is a template (known per run: the cluster policy sizes it from the run's
        params)."""
        given = {name: getattr(self, name) for name in COUNT_MINIMUMS}
        if any(is_template(value) for value in (*given.values(), self.elastic)):
            return None
        counts = {name: to_count(name, value, COUNT_MINIMUMS[name]) for name, value in given.items()}
        elastic = an_elastic("elastic", self.elastic)
        if elastic is not None:
            counts["num_workers"] = elastic["max_workers"]
        return pool_slots(**counts)

    def elastic_range(self) -> tuple[int, int] | None:
        """(min_workers, max_workers) of a settled elastic job; None for a fixed-size one."""
        elastic = an_elastic("elastic", self.elastic)
        return None if elastic is None else (elastic["min_workers"], elastic["max_workers"])

    def _check_together(self, values: Mapping[str, Any]) -> None:
        elastic, gpus = values.get("elastic"), values.get("gpus")
        if elastic is not None and gpus:
            raise InvalidJobConfig(f"gpus={gpus} (a total, packed into workers) cannot be combined with elastic "
                                   f"training (min_workers/max_workers): set gpus_per_worker and max_workers "
                                   f"instead, and gpus to 0")

    def _derived(self, values: Mapping[str, Any]) -> dict[str, Any]:
        # An elastic job has max_workers workers, whatever num_workers says (it is ignored).
        elastic = values.get("elastic")
        return {} if elastic is None else {"num_workers": elastic["max_workers"]}


@dataclass(frozen=True)
class ClusterConfig(_Settings):
    """Where it runs.

    :param backend: a training backend's name (`operators.backends`: "local", "kubernetes", "hosts", or one a
        plugin registers), or "auto" (kubernetes when the `kubernetes_conn_id` connection exists, else local).
    :param namespace: the MPIJob's namespace (default: the connection's, else "default").
    :param shared_volume_claim: the ReadWriteMany claim holding NIGHTSHIFT_HOME (default: NIGHTSHIFT_SHARED_PVC,
        else `nightshift-workspace`), mounted in the launcher and every worker at NIGHTSHIFT_HOME's path on
        this worker, so that the same paths name the same files in Airflow and in the pods. Every absolute
        path in the command must lie under a mount.
    :param kueue_queue: the Kueue LocalQueue the job waits in (None: NIGHTSHIFT_KUEUE_QUEUE; empty: no Kueue).
        The MPIJob then carries `kueue.x-k8s.io/queue-name`, is created suspended, and the task waits while
        Kueue holds it, logging why from the job's Workload; a preempted job waits for readmission within
        the same try and resumes from its checkpoint.
    :param kueue_priority: the Kueue WorkloadPriorityClass of the job (label `kueue.x-k8s.io/priority-class`).
    The pod fields (service account, node selector, tolerations, priority class, volumes, labels,
    annotations, image pull policy and secrets, the launcher's resources, the workers' sshd command and the
    ssh mount) go into the MPIJob as the MPI Operator documents them (`mpijob_spec.MPIJobConfig`).
    :param network_interfaces: the pods' interface(s) horovodrun and the ranks use (`--network-interfaces`;
        default "eth0", a pod's interface under the common CNIs; e.g. "net1" for a Multus network). None lets
        horovodrun choose, which with a single worker can pick the loopback and fail the rendezvous.
    """

    backend: str = field(default="auto", metadata=meta(templated=True, settle=a_backend))
    kubernetes_conn_id: str = "kubernetes_default"
    namespace: str | None = field(default=None, metadata=meta(templated=True))
    shared_volume_claim: str | None = None
    kueue_queue: str | None = field(default=None, metadata=meta(templated=True, settle=name_or_none))
    kueue_priority: str | None = field(default=None, metadata=meta(templated=True, settle=name_or_none))
    service_account_name: str | None = field(default=None, metadata=meta(templated=True))
    node_selector: Mapping[str, str] | None = field(default=None, metadata=meta(templated=True))
    tolerations: Sequence[Mapping[str, Any]] | None = field(default=None, metadata=meta(templated=True))
    priority_class_name: str | None = field(default=None, metadata=meta(templated=True))
    volumes: Sequence[Mapping[str, Any]] | None = field(default=None,
                                                        metadata=meta(templated=True, renderer="json"))
    volume_mounts: Sequence[Mapping[str, Any]] | None = field(default=None, metadata=meta(templated=True))
    labels: Mapping[str, str] | None = field(default=None, metadata=meta(templated=True, renderer="json"))
    annotations: Mapping[str, str] | None = field(default=None, metadata=meta(templated=True))
    image_pull_policy: str | None = None
    image_pull_secrets: Sequence[str] | None = None
    launcher_resources: Mapping[str, Mapping[str, str]] | None = None
    worker_command: Sequence[str] | None = None
    ssh_auth_mount_path: str | None = None
    network_interfaces: str | None = DEFAULT_NETWORK_INTERFACES


@dataclass(frozen=True)
class ExecutionConfig(_Settings):
    """How the job is waited for and cleaned up.

    :param deferrable: on Kubernetes, wait in the triggerer (`MPIJobTrigger`) instead of a worker slot
        (default: `[operators] default_deferrable`).
    :param poll_interval: seconds between status polls.
    :param startup_timeout: seconds the job may take to start running before it is failed and deleted.
    :param queue_timeout: seconds the job may wait in the Kueue queue (since it was last suspended) before the
        task fails with the reason it waited; None: no limit but the task's execution_timeout. A template
        (e.g. ``"{{ params.queue_timeout }}"``; a rendered "None" or blank is no limit). A Workload Kueue
        deactivated (spec.active false) fails the task at once, whatever this is. 0 fails a job as soon as it is
        seen queued (nightly_retrain's Param takes at least 1).
    :param api_retry_seconds: how long transient Kubernetes API failures (429, 5xx, a connection refused or
        cut) are retried with backoff before the task fails (a launcher log stream that keeps breaking only
        stops being copied); a job is deleted when it failed or the task is cancelled or timed out, and
        because the API was unreachable only on the last try (`try_number > max_tries`: no next try would).
        `api_retry_backoff`: the first wait between retries (seconds; it doubles, up to 30 s, or the server's
        Retry-After).
    :param cleanup_timeout: a new try first deletes its task's earlier tries' MPIJobs (same dag, run, task)
        and waits this many seconds at most for them and their pods to be gone; past it the try fails
        without submitting (they would share its checkpoints and MLflow run key), whatever `cleanup` is.
    :param timeout: local backend only: seconds before the horovodrun process tree is killed.
    :param cleanup: delete the MPIJob when the task ends "always", "on_success" (keep failed jobs for
        inspection; ttl_seconds_after_finished removes them) or "never". Jobs that never started
        (unschedulable, image pull failure, startup timeout) are deleted unless cleanup is "never".
    :param clean_pod_policy: ... `backoff_limit`, `ttl_seconds_after_finished`, `active_deadline_seconds`: the
        MPIJob's run policy.
    """

    deferrable: bool = field(default_factory=_default_deferrable, metadata=meta(settle=boolean))
    poll_interval: float = field(default=10.0, metadata=meta(settle=number(0)))
    startup_timeout: float = field(default=600.0, metadata=meta(settle=number(0)))
    queue_timeout: float | str | None = field(default=None, metadata=meta(templated=True,
                                                                          settle=optional_seconds(0)))
    api_retry_seconds: float = field(default=300.0, metadata=meta(settle=number(0)))
    api_retry_backoff: float = field(default=1.0, metadata=meta(settle=number(0)))
    cleanup_timeout: float = field(default=300.0, metadata=meta(settle=number(0)))
    timeout: float | None = field(default=None, metadata=meta(settle=optional_number(0)))
    cleanup: CleanupPolicy | str = field(default="on_success", metadata=meta(settle=one_of(CLEANUP_POLICIES)))
    clean_pod_policy: str = "Running"
    backoff_limit: int = 0
    ttl_seconds_after_finished: int | None = 3600
    active_deadline_seconds: int | None = None


@dataclass(frozen=True)
class TrackingConfig(_Settings):
    """Where the result comes back from: with both set, the complete MLflow run tagged
    `nightshift.run_key=<mlflow_run_key>` in `mlflow_experiment` (its id, model URI and metrics, also pushed
    as the `mlflow_run_id` / `mlflow_experiment_id` XComs). Pods log to NIGHTSHIFT_CLUSTER_MLFLOW_URI, else
    MLFLOW_TRACKING_URI, passed in their env."""

    mlflow_experiment: str | None = None
    mlflow_run_key: str | None = field(default=None, metadata=meta(templated=True))
    # Tags the run must carry (e.g. the dataset and code version this try trained for): a run logged under the
    # same key by a stale try, on other data, is never taken as this task's result.
    mlflow_expect_tags: Mapping[str, str] | None = field(default=None,
                                                          metadata=meta(templated=True, renderer="json"))


def mpijob_config(job: JobConfig, cluster: ClusterConfig, execution: ExecutionConfig, *, command: Sequence[str],
                  namespace: str, queue_name: str | None, volumes: Sequence[Mapping[str, Any]],
                  volume_mounts: Sequence[Mapping[str, Any]], env: Mapping[str, str]) -> MPIJobConfig:
    """The spec builder's input from the operator's settled configs, field by field.

    The configs must be settled (`settled()`: counts are ints, Kueue names are strings); the builder checks
    what only it knows (the namespace, the Kueue names, the pod fields). A setting left None takes the
    MPIJob default (`mpijob_spec.DEFAULT_*`); `network_interfaces`, `ttl_seconds_after_finished` and
    `active_deadline_seconds` take None itself (horovodrun chooses; no TTL; no deadline). The command,
    namespace, queue, volumes, mounts and env are the operator's, worked out at execute (the checkpoint
    directory, the connection's namespace, NIGHTSHIFT_KUEUE_QUEUE, the shared volume and its env).
    """
    elastic = job.elastic_range()
    return MPIJobConfig(
        image=job.image,
        command=list(command),
        num_workers=_settled_int(job, "num_workers") if elastic is None else elastic[1],
        min_workers=None if elastic is None else elastic[0],
        gpus_per_worker=_settled_int(job, "gpus_per_worker"),
        namespace=namespace,
        cpu_request=job.cpu_request,
        cpu_limit=job.cpu_limit,
        memory_request=job.memory_request,
        memory_limit=job.memory_limit,
        env=dict(env),
        volumes=plain_objects(volumes),
        volume_mounts=plain_objects(volume_mounts),
        service_account_name=cluster.service_account_name,
        node_selector=dict(cluster.node_selector or {}),
        tolerations=plain_objects(cluster.tolerations or ()),
        priority_class_name=cluster.priority_class_name,
        image_pull_policy=cluster.image_pull_policy,
        image_pull_secrets=list(cluster.image_pull_secrets or ()),
        labels=dict(cluster.labels or {}),
        annotations=dict(cluster.annotations or {}),
        clean_pod_policy=execution.clean_pod_policy,
        backoff_limit=execution.backoff_limit,
        ttl_seconds_after_finished=execution.ttl_seconds_after_finished,
        active_deadline_seconds=execution.active_deadline_seconds,
        launcher_resources=dict(cluster.launcher_resources if cluster.launcher_resources is not None
                                else DEFAULT_LAUNCHER_RESOURCES),
        worker_command=list(cluster.worker_command if cluster.worker_command is not None
                            else DEFAULT_WORKER_COMMAND),
        ssh_auth_mount_path=(cluster.ssh_auth_mount_path if cluster.ssh_auth_mount_path is not None
                             else DEFAULT_SSH_AUTH_MOUNT_PATH),
        network_interfaces=cluster.network_interfaces,
        queue_name=queue_name,
        priority_class=cluster.kueue_priority if queue_name else None,
    )


def plain_objects(objects: Sequence[Any]) -> list[dict[str, Any]]:
    """Kubernetes objects (volumes, mounts, tolerations) given as mappings or client models, as plain
    camelCase dicts, as the manifest holds them."""
    plain: list[dict[str, Any]] = []
    for obj in objects:
        if isinstance(obj, Mapping):
            plain.append(dict(obj))
        else:
            from operators.mpijob_launcher import to_plain

            plain.append(dict(to_plain(obj)))
    return plain


def _settled_int(config: _Settings, name: str) -> int:
    """A count field of a settled config (a programming error, not a user's, if it is still a template)."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{type(config).__name__}.{name} is {value!r}: settle the config (settled()) first")
    return value


CONFIG_TYPES: dict[str, type[_Settings]] = {
    "job": JobConfig, "cluster": ClusterConfig, "execution": ExecutionConfig, "tracking": TrackingConfig,
}


def templated_fields() -> tuple[str, ...]:
    """Every templated field of the configs: the operator's `template_fields`."""
    return tuple(f.name for kind in CONFIG_TYPES.values() for f in fields(kind)  # type: ignore[arg-type]
                 if f.metadata.get("templated"))


def field_renderers() -> dict[str, str]:
    return {f.name: f.metadata["renderer"] for kind in CONFIG_TYPES.values()
            for f in fields(kind) if f.metadata.get("renderer")}  # type: ignore[arg-type]


# Which config (the operator's keyword argument) holds each setting.
SETTING_GROUPS: dict[str, str] = {f.name: group for group, kind in CONFIG_TYPES.items()
                                  for f in fields(kind)}  # type: ignore[arg-type]


def configs_from(**settings: Any) -> dict[str, _Settings]:
    """The four configs from settings given by field name (`num_workers=2, backend="local", ...`), as the
    operator's keyword arguments; an unknown name is an error that lists the known ones."""
    grouped: dict[str, dict[str, Any]] = {group: {} for group in CONFIG_TYPES}
    for name, value in settings.items():
        if name not in SETTING_GROUPS:
            raise InvalidJobConfig(f"unknown setting {name!r}; the settings are: {', '.join(sorted(SETTING_GROUPS))}")
        grouped[SETTING_GROUPS[name]][name] = value
    return {group: CONFIG_TYPES[group](**values) for group, values in grouped.items()}
