"""`HorovodKubernetesOperator`: multi-node Horovod training on a backend chosen by name: a Kubeflow MPIJob,
horovodrun on this machine, emulated hosts, or a plugin's (`operators.backends`).

The operator holds per-task state (the job's name, this try's backend), settles its configs and builds the
MPIJob (pure); the backend (`operators.backends.<name>`, a `TrainingBackend`) submits, waits, cancels and
cleans up, with the launchers (`mpijob_launcher`, `local_launcher`) and the trigger (`triggers.MPIJobTrigger`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, replace
from datetime import UTC, datetime, timedelta
from functools import cached_property
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowNotFoundException

from operators.errors import (
    InvalidJobConfig,
    TrainingResultMissing,
)
from operators.horovod_config import (
    CONFIG_TYPES,
    SETTING_GROUPS,
    ClusterConfig,
    ExecutionConfig,
    JobConfig,
    TrackingConfig,
    field_renderers,
    mpijob_config,
    plain_objects,
    templated_fields,
    to_count,
)
from operators.mpijob_spec import (
    GPU_RESOURCE,
    INSTANCE_ENV,
    TaskIdentity,
    build_mpijob,
    check_instance,
    check_no_credentials,
    checkpoint_subdir,
    job_name,
    pack_gpus,
    paths_outside_mounts,
    split_command,
    with_checkpoint_dir,
)

if TYPE_CHECKING:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    from airflow.sdk import Context

    from operators.backends.base import BackendRun, TrainingBackend

GPU_POOL = "gpu"
SHARED_VOLUME = "nightshift-shared"
# The operator's settings, by concern (operators.horovod_config): its keyword argument -> the config's type.
CONFIG_ARGUMENTS: dict[str, type[Any]] = dict(CONFIG_TYPES)


class HorovodKubernetesOperator(BaseOperator):
    """Run a Horovod training command on `num_workers` workers, on Kubernetes (MPIJob) or locally.

    :param job: what runs (`JobConfig`: command, workers, GPUs, image, env, checkpoints, resources).
    :param cluster: where (`ClusterConfig`: backend, namespace, shared volume, Kueue, pod fields); default
        `ClusterConfig()`: the "auto" backend.
    :param execution: how it is waited for and cleaned up (`ExecutionConfig`: deferrable, polling, timeouts,
        cleanup, the MPIJob's run policy); default `ExecutionConfig()`.
    :param tracking: where its result comes back from (`TrackingConfig`: MLflow experiment and run key).

    Every field of these configs is documented in `operators.horovod_config`. The templated ones (`num_workers`,
    `gpus_per_worker`, `gpus`, `backend`, `kueue_queue`, `image`, `command`, ...) are this operator's template
    fields, attributes of the same names: a template such as ``"{{ params.workers }}"`` is rendered, then
    converted and checked at execute (`settle`), with an error naming the field.
    """

    template_fields: Sequence[str] = templated_fields()
    template_fields_renderers = field_renderers()
    ui_color = "#c9e4f6"

    def __init__(
        self,
        *,
        job: JobConfig,
        cluster: ClusterConfig | None = None,
        execution: ExecutionConfig | None = None,
        tracking: TrackingConfig | None = None,
        pool: str | None = None,
        pool_slots: int | None = None,
        **kwargs: Any,
    ) -> None:
        misplaced = sorted(set(kwargs) & SETTING_GROUPS.keys())
        if misplaced:
            where = ", ".join(f"{name} in {CONFIG_ARGUMENTS[SETTING_GROUPS[name]].__name__}" for name in misplaced)
            raise InvalidJobConfig(f"{', '.join(misplaced)}: not an operator argument; pass it in its config ({where})")
        configs = {"job": job, "cluster": cluster or ClusterConfig(), "execution": execution or ExecutionConfig(),
                   "tracking": tracking or TrackingConfig()}
        for argument, config in configs.items():
            if not isinstance(config, CONFIG_ARGUMENTS[argument]):
                raise InvalidJobConfig(f"{argument} must be a {CONFIG_ARGUMENTS[argument].__name__} "
                                       f"(operators.horovod_config), got {type(config).__name__}")
        if pool_slots is None:  # templated counts: 1 until the cluster policy sizes it per run
            pool_slots = job.pool_slots() or 1
        super().__init__(pool=pool or GPU_POOL, pool_slots=pool_slots, **kwargs)
        self.job: JobConfig = job
        self.cluster: ClusterConfig = configs["cluster"]  # type: ignore[assignment]
        self.execution: ExecutionConfig = configs["execution"]  # type: ignore[assignment]
        self.tracking: TrackingConfig = configs["tracking"]  # type: ignore[assignment]
        self._use(**configs)
        # Per-try state that on_kill needs.
        self.job_name: str | None = None
        self.job_namespace: str | None = None
        self._backend: TrainingBackend | None = None  # this try's, once chosen
        self._killed = False  # on_kill ran: whatever this try still does, it submits nothing more

    @property
    def killed(self) -> bool:
        """on_kill ran in this process: whatever this try still does, it submits nothing more."""
        return self._killed

    def use_job(self, job: JobConfig) -> None:
        """Run `job` (settled) in this try instead: a backend's shape of it (operators.backends.base.BackendRun)."""
        self._use(job=job)

    def _use(self, **configs: Any) -> None:
        """Hold these configs, and their templated fields as the attributes Airflow renders."""
        for argument, config in configs.items():
            setattr(self, argument, config)
            for name in _TEMPLATED[argument]:
                setattr(self, name, getattr(config, name))

    # -- clients -----------------------------------------------------------------------------------

    @cached_property
    def hook(self) -> KubernetesHook:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

        return KubernetesHook(conn_id=self.cluster.kubernetes_conn_id)

    # -- pure derivations --------------------------------------------------------------------------

    def settle(self) -> None:
        """Each config from the rendered template fields, converted; InvalidJobConfig names a wrong field."""
        self._use(**{argument: getattr(self, argument).settled({name: getattr(self, name)
                                                                 for name in _TEMPLATED[argument]})
                     for argument in CONFIG_ARGUMENTS})

    def resolve_queue(self) -> str | None:
        """The LocalQueue: `kueue_queue`, else NIGHTSHIFT_KUEUE_QUEUE; an empty one means no Kueue."""
        import os

        if self.cluster.kueue_queue is not None:
            return self.cluster.kueue_queue or None
        return os.environ.get("NIGHTSHIFT_KUEUE_QUEUE", "").strip() or None

    def pack(self, gpus_per_node: int) -> None:
        """Turn `gpus` (a total) into workers x GPUs per worker, each worker at most one node."""
        total = int(self.job.gpus)
        workers, per_worker = pack_gpus(total, gpus_per_node)
        self.log.info("%d GPUs on nodes of %d: %d worker(s) x %d GPU(s)", total, gpus_per_node, workers, per_worker)
        self.use_job(replace(self.job, num_workers=workers, gpus_per_worker=per_worker, gpus=0))

    def cluster_gpus_per_node(self, *, discover: bool) -> int:
        """NIGHTSHIFT_GPUS_PER_NODE, else (when `discover`) the largest allocatable nvidia.com/gpu of a node."""
        import os

        configured = os.environ.get("NIGHTSHIFT_GPUS_PER_NODE", "").strip()
        if configured:
            return to_count("NIGHTSHIFT_GPUS_PER_NODE", configured, 1)
        found, why = 0, "the cluster is not asked when planning"
        if discover:
            from kubernetes.client.exceptions import ApiException

            why = "no node of the cluster has allocatable nvidia.com/gpu"
            try:
                for node in self.hook.core_v1_client.list_node().items or []:
                    allocatable = (node.status.allocatable or {}) if node.status else {}
                    found = max(found, int(allocatable.get(GPU_RESOURCE, 0) or 0))
            except ApiException as err:  # listing nodes needs a ClusterRole many teams do not get
                why = f"the nodes cannot be listed ({err.status} {err.reason})"
        if found < 1:
            raise InvalidJobConfig(f"gpus={self.job.gpus} needs the GPUs of one node: set NIGHTSHIFT_GPUS_PER_NODE "
                                   f"({why})")
        return found

    def check_queue_capacity(self, namespace: str, queue: str) -> None:
        """Refuse a job its ClusterQueue can never admit (more GPUs than its quota plus what it may borrow)."""
        from kubernetes.client.exceptions import ApiException

        from operators.kueue_quota import max_admissible
        from operators.mpijob_launcher import KUEUE_GROUP, KUEUE_VERSION

        total = int(self.job.num_workers) * int(self.job.gpus_per_worker)
        if total < 1:
            return
        api = self.hook.custom_object_client
        try:
            local = api.get_namespaced_custom_object(group=KUEUE_GROUP, version=KUEUE_VERSION, namespace=namespace,
                                                     plural="localqueues", name=queue)
            cq_name = local["spec"]["clusterQueue"]
            cluster_queue = api.get_cluster_custom_object(group=KUEUE_GROUP, version=KUEUE_VERSION,
                                                          plural="clusterqueues", name=cq_name)
            cohort = (cluster_queue.get("spec") or {}).get("cohortName")
            peers = []
            if cohort:
                listing = api.list_cluster_custom_object(group=KUEUE_GROUP, version=KUEUE_VERSION,
                                                         plural="clusterqueues")
                peers = [q for q in listing.get("items") or [] if (q.get("spec") or {}).get("cohortName") == cohort
                         and q["metadata"]["name"] != cq_name]
        except ApiException as err:
            if err.status == 404:
                raise InvalidJobConfig(
                    f"Kueue LocalQueue {queue!r} (or its ClusterQueue) not found in namespace {namespace}: "
                    f"`kubectl get localqueues -n {namespace}` lists the queues, deploy/kueue/ creates them"
                ) from err
            self.log.warning("Cannot read Kueue queue %s (%s): submitting without the quota check", queue, err.reason)
            return
        limit = max_admissible(cluster_queue, GPU_RESOURCE, peers)
        if limit is not None and total > limit:
            raise InvalidJobConfig(
                f"the job asks for {total} GPUs ({self.job.num_workers} x {self.job.gpus_per_worker}) but ClusterQueue "
                f"{cq_name} (LocalQueue {queue}) can admit at most {limit}: ask for at most {limit} GPUs"
            )

    def check_elastic(self, backend: TrainingBackend) -> None:
        """Refuse, before anything is submitted, an elastic job (settled `elastic`) that `backend` cannot run: a
        backend that cannot resize a job (`supports_elastic`), or a Kueue queue on one that creates the MPIJob
        (Kueue admits the job's full size, max_workers, as one unit and does not resize it)."""
        elastic = self.job.elastic_range()
        if elastic is None:
            return
        if not backend.supports_elastic:
            from operators.backends import elastic_backends

            raise InvalidJobConfig(
                f"backend={_name_of(backend)} cannot run elastic training (min_workers={elastic[0]}, max_workers="
                f"{elastic[1]}): use a backend that can ({', '.join(elastic_backends())}), or clear min_workers "
                f"and max_workers for a fixed-size job")
        if backend.renders_mpijob and (queue := self.resolve_queue()):
            from operators.mpijob_spec import elastic_kueue_problem

            raise InvalidJobConfig(elastic_kueue_problem(*elastic, queue))

    def resolve_backend(self) -> str:
        """The backend this run uses; "auto" looks for the Kubernetes connection."""
        if self.cluster.backend != "auto":
            return str(self.cluster.backend)
        from airflow.sdk import BaseHook

        try:
            BaseHook.get_connection(self.cluster.kubernetes_conn_id)
        except AirflowNotFoundException:
            self.log.info("No connection %r: using the local backend", self.cluster.kubernetes_conn_id)
            return "local"
        return "kubernetes"

    def resolve_namespace(self) -> str:
        if self.cluster.namespace:
            return self.cluster.namespace
        try:
            return self.hook.get_namespace() or "default"
        except AirflowNotFoundException:
            return "default"

    @staticmethod
    def identity_from(context: Context | Mapping[str, Any]) -> TaskIdentity:
        """The task instance the job runs for, and the Airflow deployment (NIGHTSHIFT_INSTANCE) it belongs to."""
        import os

        ti = context["ti"]
        return TaskIdentity(
            instance=check_instance(os.environ.get(INSTANCE_ENV, "").strip()),
            dag_id=ti.dag_id,
            task_id=ti.task_id,
            run_id=ti.run_id,
            try_number=int(ti.try_number or 1),
            map_index=int(getattr(ti, "map_index", -1) if getattr(ti, "map_index", None) is not None else -1),
        )

    def resolve_checkpoint_dir(self, identity: TaskIdentity) -> str:
        """The task's checkpoint directory (`checkpoint_dir`, else under `checkpoint_root` or NIGHTSHIFT_HOME's
        checkpoints): keyed by dag, run, task (and map index), never by try or backend, so every try resumes."""
        if self.job.checkpoint_dir:
            return str(self.job.checkpoint_dir)
        root = self.job.checkpoint_root
        if not root:
            # NIGHTSHIFT_HOME's checkpoints: on this machine, or on the shared volume that holds it.
            from nightshift.settings import checkpoints_dir

            root = str(checkpoints_dir())
        sub = checkpoint_subdir(identity.dag_id, identity.run_id, identity.task_id)
        if identity.map_index >= 0:
            sub += f"/{identity.map_index}"
        return f"{str(root).rstrip('/')}/{sub}"

    def cluster_contract(self, tracking_uri: str | None = None
                         ) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
        """The shared volume, its mount and the env every pod gets: NIGHTSHIFT_HOME and the tracking URI
        (`tracking_uri`, else the settings' cluster one)."""
        from nightshift import settings

        claim = self.cluster.shared_volume_claim or settings.shared_volume_claim()
        mount_path = str(settings.home())
        uri = tracking_uri or settings.cluster_mlflow_tracking_uri()
        if not uri.startswith(("http://", "https://")):
            raise InvalidJobConfig(
                f"backend=kubernetes needs an MLflow tracking server that the pods reach, and the tracking URI "
                f"is {_redacted(uri)!r}: set MLFLOW_TRACKING_URI (or NIGHTSHIFT_CLUSTER_MLFLOW_URI, its "
                f"in-cluster address) to http(s)://..."
            )
        check_no_credentials("the MLflow tracking URI", uri)
        volume = {"name": SHARED_VOLUME, "persistentVolumeClaim": {"claimName": claim}}
        mount = {"name": SHARED_VOLUME, "mountPath": mount_path}
        return volume, mount, {"NIGHTSHIFT_HOME": mount_path, "MLFLOW_TRACKING_URI": uri}

    def build_manifest(self, identity: TaskIdentity, namespace: str | None = None, *,
                       tracking_uri: str | None = None) -> dict[str, Any]:
        """The MPIJob this task submits for `identity` (pure; no cluster needed); its pods log to
        `tracking_uri` (default: the settings' cluster tracking URI)."""
        self.settle()
        if self.job.gpus:
            self.pack(self.cluster_gpus_per_node(discover=False))
        namespace = namespace or self.cluster.namespace or "default"
        checkpoint_dir = self.resolve_checkpoint_dir(identity)
        command = with_checkpoint_dir(split_command(self.job.command), checkpoint_dir)
        volume, mount, env = self.cluster_contract(tracking_uri)
        volumes = [volume, *(v for v in plain_objects(self.cluster.volumes or ()) if v.get("name") != SHARED_VOLUME)]
        mounts = [mount, *(m for m in plain_objects(self.cluster.volume_mounts or ())
                           if m.get("name") != SHARED_VOLUME)]
        if self.job.elastic_range() is not None:
            self._check_elastic_paths(command, str(mount["mountPath"]))
        outside = paths_outside_mounts(command, [str(m["mountPath"]) for m in mounts])
        if outside:
            raise InvalidJobConfig(
                f"the pods cannot see {', '.join(outside)}: every path in the command must lie under a volume "
                f"mount ({', '.join(str(m['mountPath']) for m in mounts)}); put the data, outputs and checkpoints "
                f"under NIGHTSHIFT_HOME on the shared claim, or add a volume for them"
            )
        config = mpijob_config(self.job, self.cluster, self.execution, command=command, namespace=namespace,
                               queue_name=self.resolve_queue(), volumes=volumes, volume_mounts=mounts,
                               env={**env, **(self.job.env or {})})
        return build_mpijob(config, identity)

    @staticmethod
    def _check_elastic_paths(command: Sequence[str], shared: str) -> None:
        """An elastic job's data, outputs and checkpoints on the shared claim, as absolute paths: rank 0 moves to
        another host when its host is lost, and a relative path (each pod's working directory) or another volume
        (a pod's own) would split the outputs and checkpoints across hosts."""
        bad = []
        for flag in ("--data", "--out", "--checkpoint-dir"):
            for i, arg in enumerate(command):
                value = arg.split("=", 1)[1] if arg.startswith(f"{flag}=") else (
                    command[i + 1] if arg == flag and i + 1 < len(command) else None)
                if value is not None and not PurePosixPath(value).is_relative_to(shared):
                    bad.append(f"{flag} {value}")
        if bad:
            raise InvalidJobConfig(
                f"an elastic job's data, outputs and checkpoints must be on the shared claim, as absolute paths "
                f"under {shared}: {', '.join(bad)} would be each host's own (rank 0 moves to another host when "
                f"its host is lost); put them under NIGHTSHIFT_HOME ({shared})")

    def dry_run(self) -> None:
        """Print the MPIJob this task would submit, as YAML, without a cluster or a task instance."""
        import os

        import yaml

        identity = TaskIdentity(
            dag_id=self.dag_id if self.has_dag() else "dry-run",
            task_id=self.task_id,
            run_id="dry_run",
            try_number=1,
            instance=check_instance(os.environ.get(INSTANCE_ENV, "").strip()),
        )
        print(yaml.safe_dump(self.build_manifest(identity), sort_keys=False))

    # -- execution ---------------------------------------------------------------------------------

    def backend_run(self, name: str) -> BackendRun:
        """What this task hands the backend registered as `name` (operators.backends.base): never itself."""
        from operators.backends.base import BackendRun

        return BackendRun(self, name)

    def make_backend(self, name: str) -> TrainingBackend:
        """This try's instance of the backend registered as `name` (operators.backends), known by that name."""
        from operators.backends import UnknownBackend, create_backend

        try:
            return create_backend(name, self.backend_run(name))
        except UnknownBackend as err:
            raise InvalidJobConfig(str(err)) from err

    def execute(self, context: Context) -> dict[str, Any]:
        identity = self.identity_from(context)
        self.settle()
        backend = self._backend = self.make_backend(self.resolve_backend())
        self.check_elastic(backend)
        result = {**backend.submit(identity, context), "backend": backend.name}  # a deferring backend defers here
        self._follow(backend, result, lambda: backend.wait(result, context))
        return self.collect_results(context, result)

    def execute_complete(
        self, context: Context, event: Mapping[str, Any], result: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Resume after the backend's trigger: a fresh instance of the backend registered under the result's
        "backend" (the name BackendRun.defer wrote) judges the event and cleans up; succeed (with the MLflow run)
        or raise."""
        if result is not None and result.get("backend"):
            name = str(result["backend"])
        else:
            self.settle()
            name = self.resolve_backend()
        backend = self._backend = self.make_backend(name)
        done = {"backend": name, **dict(result or {})}
        self._follow(backend, done, lambda: backend.complete(done, event, context))
        return self.collect_results(context, done)

    def collect_results(self, context: Context | Mapping[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        """Add the training's MLflow run (found on the tracking server by its run key) to the result."""
        experiment, run_key = self.tracking.mlflow_experiment, self.tracking.mlflow_run_key
        if not (experiment and run_key):
            return result
        from nightshift.errors import TrackingError
        from nightshift.tracking import configure, find_training_run

        configure()  # the task's process: its one MLflow use
        try:
            expect = {str(k): str(v) for k, v in (self.tracking.mlflow_expect_tags or {}).items()}
            run = find_training_run(str(experiment), str(run_key), expect=expect or None)
        except TrackingError as err:
            raise TrainingResultMissing(f"the training job succeeded but its result is not in MLflow: {err}") from err
        context["ti"].xcom_push(key="mlflow_run_id", value=run["run_id"])
        context["ti"].xcom_push(key="mlflow_experiment_id", value=run["experiment_id"])
        self.log.info("Training logged MLflow run %s (experiment %s): %s", run["run_id"], run["experiment_id"],
                      run["metrics"])
        return {**result, "mlflow_run_id": run["run_id"], "experiment_id": run["experiment_id"],
                "model_uri": run["model_uri"], "metrics": run["metrics"]}

    @staticmethod
    def _follow(backend: TrainingBackend, result: dict[str, Any], wait: Callable[[], None]) -> None:
        """Wait for the job; then the backend cleans up, told how it ended."""
        try:
            wait()
        except BaseException as err:
            backend.cleanup(result, succeeded=False, error=err)
            raise
        backend.cleanup(result, succeeded=True, error=None)

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Context) -> Any:
        """As BaseOperator's; when the deferral itself ended badly (it timed out: execution_timeout passed
        while the trigger waited; or the trigger failed), the backend that deferred is told first (kubernetes
        deletes the job where nothing else would)."""
        from airflow.sdk.exceptions import TaskDeferralError, TaskDeferralTimeout

        try:
            return super().resume_execution(next_method, next_kwargs, context)
        except (TaskDeferralTimeout, TaskDeferralError) as err:
            # The backend that deferred, as its result names it: "auto" resolved again could now answer otherwise.
            # Airflow replaces the deferral's kwargs with the error when it times out or the trigger fails: the
            # result is read back from the XCom run.defer kept it in.
            result = (next_kwargs or {}).get("result") or self._deferred_result(context)
            deferred = (result or {}).get("backend")
            self.settle()
            backend = self._backend = self.make_backend(str(deferred) if deferred else self.resolve_backend())
            backend.deferral_failed(context, err, result)  # an on_kill meanwhile cancels this backend's job
            raise

    def _deferred_result(self, context: Context) -> dict[str, Any] | None:
        from operators.backends.base import DEFERRED_XCOM

        ti = context["ti"]
        try:
            value = ti.xcom_pull(task_ids=ti.task_id, key=DEFERRED_XCOM, map_indexes=ti.map_index)
        except Exception as err:  # the job's name is then derived from the run, as before
            self.log.warning("Could not read back the deferred job's result (XCom %s): %s", DEFERRED_XCOM, err)
            return None
        return dict(value) if isinstance(value, Mapping) else None

    def deferral_timeout(self, context: Context | Mapping[str, Any] | None) -> timedelta | None:
        """What is left of execution_timeout (from the try's start_date): Airflow applies only the deferral's
        own timeout while a task is deferred, never execution_timeout."""
        if self.execution_timeout is None:
            return None
        ti = (context or {}).get("ti")
        started = getattr(ti, "start_date", None)
        used = timedelta(0)
        if isinstance(started, datetime):
            started = started if started.tzinfo else started.replace(tzinfo=UTC)
            used = max(timedelta(0), datetime.now(UTC) - started)
        return max(self.execution_timeout - used, timedelta(seconds=1))

    @staticmethod
    def no_retry_left(context: Context | Mapping[str, Any] | None) -> bool:
        """This try is the last (try_number > max_tries); False when the task instance does not say."""
        ti = (context or {}).get("ti")
        max_tries = getattr(ti, "max_tries", None)
        if ti is None or max_tries is None:
            return False
        return int(getattr(ti, "try_number", 1) or 1) > int(max_tries)

    def on_kill(self) -> None:
        # Airflow's SIGTERM handler calls this and returns: execute goes on, and must submit nothing more.
        self._killed = True
        if self._backend is not None:
            self._backend.cancel()

# The templated settings of each config.
_TEMPLATED = {argument: tuple(f.name for f in fields(kind) if f.metadata.get("templated"))
              for argument, kind in CONFIG_ARGUMENTS.items()}


def _name_of(backend: TrainingBackend) -> str:
    """The backend's registered name; its class's for one made outside the registry (nightshift plan)."""
    return getattr(backend, "name", None) or type(backend).__name__


def _redacted(uri: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    return parts._replace(netloc=f"***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")).geturl()


# The job name for a task instance, re-exported for DAG authors and tests.
__all__ = ["ClusterConfig", "ExecutionConfig", "HorovodKubernetesOperator", "JobConfig", "TrackingConfig", "job_name"]
