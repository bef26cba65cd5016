"""`HorovodKubernetesOperator`: multi-node Horovod training as a Kubeflow MPIJob, or locally with horovodrun.

The operator holds per-task state (the job's name, the local process) and chooses the backend; the
spec builder (`mpijob_spec`), the launchers (`mpijob_launcher`, `local_launcher`) and the trigger
(`triggers.MPIJobTrigger`) do the work.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from datetime import UTC, datetime, timedelta
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowNotFoundException

from operators.errors import (
    InvalidJobConfig,
    KubernetesApiError,
    KubernetesApiUnavailable,
    MPIJobCleanupFailed,
    MPIJobFailed,
    MPIJobStartupFailure,
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
    is_template,
    templated_fields,
    to_count,
)
from operators.mpijob_spec import (
    GPU_RESOURCE,
    INSTANCE_ENV,
    MPIJobConfig,
    TaskIdentity,
    build_mpijob,
    check_instance,
    check_no_credentials,
    checkpoint_subdir,
    job_name,
    pack_gpus,
    paths_outside_mounts,
    pool_slots_for,
    split_command,
    with_checkpoint_dir,
)

if TYPE_CHECKING:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    from airflow.sdk import Context

    from operators.backends.hosts import HostsBackend
    from operators.local_launcher import LocalHorovodLauncher
    from operators.mpijob_launcher import MPIJobLauncher

GPU_POOL = "gpu"
SHARED_VOLUME = "nightshift-shared"
# On the last try, how long a job the task lost track of is tried to be deleted (the API was failing).
LAST_TRY_DELETE_SECONDS = 60.0
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
        if pool_slots is None:
            counts = (job.num_workers, job.gpus_per_worker, job.gpus)
            if any(is_template(value) for value in counts):
                pool_slots = 1
            else:
                pool_slots = int(job.gpus) or pool_slots_for(int(job.num_workers), int(job.gpus_per_worker))
        super().__init__(pool=pool or GPU_POOL, pool_slots=pool_slots, **kwargs)
        self.job: JobConfig = job
        self.cluster: ClusterConfig = configs["cluster"]  # type: ignore[assignment]
        self.execution: ExecutionConfig = configs["execution"]  # type: ignore[assignment]
        self.tracking: TrackingConfig = configs["tracking"]  # type: ignore[assignment]
        self._use(**configs)
        # Per-try state that on_kill needs.
        self.job_name: str | None = None
        self._job_namespace: str | None = None
        self._local: LocalHorovodLauncher | None = None
        self._hosts: HostsBackend | None = None  # ISSUE25-H4 TEMPORARY (H2's registry holds the backend)
        self._killed = False  # on_kill ran: whatever this try still does, it submits nothing more

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

    def make_launcher(self, namespace: str, *, api_retry_seconds: float | None = None) -> MPIJobLauncher:
        from operators.mpijob_launcher import MPIJobLauncher

        retry = self.execution.api_retry_seconds
        return MPIJobLauncher(
            self.hook.custom_object_client,
            self.hook.core_v1_client,
            namespace,
            poll_interval=self.execution.poll_interval,
            startup_timeout=self.execution.startup_timeout,
            queue_timeout=self.execution.queue_timeout,  # type: ignore[arg-type]  # settled: a float or None
            api_retry_seconds=retry if api_retry_seconds is None else min(retry, api_retry_seconds),
            api_retry_backoff=self.execution.api_retry_backoff,
            logger=self.log,
            interrupted=lambda: self._killed,
        )

    # -- pure derivations --------------------------------------------------------------------------

    def settle(self) -> None:
        """Each config from the rendered template fields, converted; InvalidJobConfig names a wrong field."""
        self._use(**{argument: replace(getattr(self, argument), **{name: getattr(self, name)
                                                                     for name in _TEMPLATED[argument]}).settled()
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
        self._use(job=replace(self.job, num_workers=workers, gpus_per_worker=per_worker, gpus=0))

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

    def resolve_checkpoint_dir(self, identity: TaskIdentity, backend: str) -> str:
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

    def cluster_contract(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
        """The shared volume, its mount and the env every pod gets: NIGHTSHIFT_HOME and the tracking URI."""
        from nightshift import settings

        claim = self.cluster.shared_volume_claim or settings.shared_volume_claim()
        mount_path = str(settings.home())
        uri = settings.cluster_mlflow_tracking_uri()
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

    def job_config(self, command: Sequence[str], namespace: str) -> MPIJobConfig:
        """The spec builder's config: every setting that MPIJobConfig has a field of the same name for."""
        given = {name: value for config in (self.job, self.cluster, self.execution)
                 for name, value in vars(config).items()}
        spec: dict[str, Any] = {}
        for f in fields(MPIJobConfig):
            value = given.get(f.name)
            # None: the spec's default, unless the spec's field takes None itself (ttl_seconds_after_finished).
            if f.name in given and (value is not None or "None" in str(f.type)):
                spec[f.name] = _spec_value(value)
        queue = self.resolve_queue()
        return MPIJobConfig(**{**spec, "command": list(command), "namespace": namespace, "queue_name": queue,
                               "priority_class": self.cluster.kueue_priority if queue else None})

    def build_manifest(self, identity: TaskIdentity, namespace: str | None = None) -> dict[str, Any]:
        """The MPIJob this task submits for `identity` (pure; no cluster needed)."""
        self.settle()
        if self.job.gpus:
            self.pack(self.cluster_gpus_per_node(discover=False))
        namespace = namespace or self.cluster.namespace or "default"
        checkpoint_dir = self.resolve_checkpoint_dir(identity, "kubernetes")
        command = with_checkpoint_dir(split_command(self.job.command), checkpoint_dir)
        volume, mount, env = self.cluster_contract()
        config = self.job_config(command, namespace)
        volumes = [volume, *(v for v in config.volumes if v.get("name") != SHARED_VOLUME)]
        mounts = [mount, *(m for m in config.volume_mounts if m.get("name") != SHARED_VOLUME)]
        outside = paths_outside_mounts(command, [str(m["mountPath"]) for m in mounts])
        if outside:
            raise InvalidJobConfig(
                f"the pods cannot see {', '.join(outside)}: every path in the command must lie under a volume "
                f"mount ({', '.join(str(m['mountPath']) for m in mounts)}); put the data, outputs and checkpoints "
                f"under NIGHTSHIFT_HOME on the shared claim, or add a volume for them"
            )
        config = replace(config, volumes=volumes, volume_mounts=mounts, env={**env, **config.env})
        return build_mpijob(config, identity)

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

    def execute(self, context: Context) -> dict[str, Any]:
        identity = self.identity_from(context)
        self.settle()
        backend = self.resolve_backend()
        if backend == "local":
            result = self.execute_local(identity)
        elif backend == "hosts":  # ISSUE25-H4 TEMPORARY: H2's backend registry replaces this branch
            result = self.execute_hosts(identity, context)
        else:
            result = self.execute_kubernetes(identity, context=context)
        return self.collect_results(context, result)

    def execute_local(self, identity: TaskIdentity) -> dict[str, Any]:
        from operators.local_launcher import LocalHorovodLauncher, check_local_capacity

        if self.job.gpus:  # this machine is the one node: one worker with all the GPUs asked for
            self._use(job=replace(self.job, num_workers=1, gpus_per_worker=int(self.job.gpus), gpus=0))
        job = self.job
        ranks = check_local_capacity(int(job.num_workers), int(job.gpus_per_worker))
        checkpoint_dir = self.resolve_checkpoint_dir(identity, "local")
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        command = with_checkpoint_dir(split_command(job.command), checkpoint_dir)
        self.log.info("Training with %d rank(s) here (%d worker(s) x %d GPU(s)); checkpoints of this task "
                      "(every try): %s", ranks, job.num_workers, job.gpus_per_worker, checkpoint_dir)
        self._local = LocalHorovodLauncher(
            ranks,
            command,
            env=dict(job.env or {}),
            timeout=self.execution.timeout,
            logger=self.log,
        )
        try:
            self._local.run()
        finally:
            if self._local.process is not None and self._local.process.poll() is None:
                self._local.kill()
        return {"backend": "local", "checkpoint_dir": checkpoint_dir, "num_workers": job.num_workers,
                "gpus_per_worker": job.gpus_per_worker}

    def execute_hosts(self, identity: TaskIdentity, context: Context | Mapping[str, Any]) -> dict[str, Any]:
        """ISSUE25-H4 TEMPORARY: backend=hosts through its TrainingBackend, until H2's registry drives every
        backend this way (submit, wait, cleanup; cancel from on_kill)."""
        from operators.backends.hosts import HostsBackend

        self._hosts = HostsBackend(self)
        result: dict[str, Any] = {}
        error: BaseException | None = None
        try:
            result = self._hosts.submit(identity, context)
            self._hosts.wait(result, context)
        except BaseException as err:
            error = err
            raise
        finally:
            self._hosts.cleanup(result, succeeded=error is None, error=error)
        return result

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

    def execute_kubernetes(self, identity: TaskIdentity, *, context: Context | Mapping[str, Any] | None = None
                           ) -> dict[str, Any]:
        namespace = self.resolve_namespace()
        if self.job.gpus:
            self.pack(self.cluster_gpus_per_node(discover=True))
        if queue := self.resolve_queue():
            self.check_queue_capacity(namespace, queue)
        body = self.build_manifest(identity, namespace)
        name = body["metadata"]["name"]
        self.job_name, self._job_namespace = name, namespace
        launcher = self.make_launcher(namespace)
        result = {
            "backend": "kubernetes",
            "name": name,
            "namespace": namespace,
            "checkpoint_dir": self.resolve_checkpoint_dir(identity, "kubernetes"),
        }
        # An earlier try's job (a worker crash, a timeout) would share this try's checkpoints and MLflow run key.
        launcher.delete_earlier_tries(body, timeout=self.execution.cleanup_timeout)
        launcher.check_interrupted(f"submitting MPIJob {namespace}/{name}")
        submitted_at = time.time()
        launcher.submit(body)
        if self._killed:  # on_kill ran while the job was being created: its delete may have come first
            self._delete_quietly(launcher, name, "the task was killed while it was submitted")
            launcher.check_interrupted(f"submitting MPIJob {namespace}/{name}")
        if self.execution.deferrable:
            from operators.triggers import MPIJobTrigger

            self.defer(
                trigger=MPIJobTrigger(
                    name=name,
                    namespace=namespace,
                    submitted_at=submitted_at,
                    kubernetes_conn_id=self.cluster.kubernetes_conn_id,
                    poll_interval=self.execution.poll_interval,
                    startup_timeout=self.execution.startup_timeout,
                    queue_timeout=self.execution.queue_timeout,  # type: ignore[arg-type]
                    api_retry_seconds=self.execution.api_retry_seconds,
                    api_retry_backoff=self.execution.api_retry_backoff,
                ),
                method_name="execute_complete",
                kwargs={"result": result},
                timeout=self.deferral_timeout(context),
            )
        try:
            launcher.wait(name)
        except KubernetesApiError:
            # The API, not the job, failed: the job may be running well. It is left for the next try to
            # delete before it submits; on the last try there is none, so it is deleted (if the API lets us).
            self._lost_track(context, namespace, name)
            raise
        except BaseException as err:
            # A job that ended badly follows the policy; one still running (timeout, kill) is deleted.
            self._cleanup(launcher, name, succeeded=False, error=err, force=not isinstance(err, MPIJobFailed))
            raise
        self._cleanup(launcher, name, succeeded=True)
        return result

    def execute_complete(
        self, context: Context, event: Mapping[str, Any], result: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Resume after `MPIJobTrigger`: copy the launcher's log, clean up, succeed or raise."""
        from operators.mpijob_launcher import error_for

        name, namespace = event["name"], event["namespace"]
        self.job_name, self._job_namespace = name, namespace
        launcher = self.make_launcher(namespace)
        status = event.get("status")
        try:
            if launcher.get(name) is not None:
                launcher.stream_unread_logs(launcher.pods(name))
        except Exception as err:  # the logs are a courtesy; the event decides the outcome
            self.log.warning("Could not fetch the launcher log of MPIJob %s: %s", name, err)
        if status == "success":
            self._cleanup(launcher, name, succeeded=True)
            return self.collect_results(
                context, dict(result or {"backend": "kubernetes", "name": name, "namespace": namespace}))
        message = str(event.get("message") or f"MPIJob {namespace}/{name} failed")
        if status == "failed":
            error = error_for(event.get("error_kind"), message)
            self._cleanup(launcher, name, succeeded=False, error=error)
            raise error
        # "error": the trigger lost sight of the API, not of a failed job.
        self._lost_track(context, namespace, name)
        if event.get("error_kind") == "KubernetesApiError":
            raise KubernetesApiError(message)
        raise KubernetesApiUnavailable(message)

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Context) -> Any:
        """As BaseOperator's, and when the deferral timed out (execution_timeout passed while the trigger
        waited), delete the job first: a timed-out task leaves nothing running. When the trigger itself
        failed (TaskDeferralError) on the last try, delete it too: no next try would."""
        from airflow.sdk.exceptions import TaskDeferralError, TaskDeferralTimeout

        try:
            return super().resume_execution(next_method, next_kwargs, context)
        except TaskDeferralTimeout as timeout:
            name, namespace = self._job_of(context)
            self.log.error("Timed out while MPIJob %s/%s was followed by the triggerer: deleting it", namespace, name)
            try:
                self.make_launcher(namespace).delete(name)
            except Exception as err:
                raise MPIJobCleanupFailed(
                    f"the task timed out and MPIJob {namespace}/{name} could not be deleted ({err}); it may still "
                    f"run: delete it (kubectl delete mpijob -n {namespace} {name}) or let the next try do it"
                ) from timeout
            raise
        except TaskDeferralError:
            name, namespace = self._job_of(context)
            self._lost_track(context, namespace, name)
            raise

    def _job_of(self, context: Context | Mapping[str, Any]) -> tuple[str, str]:
        """This try's job (name, namespace), in a fresh process: the deferral's kwargs are gone."""
        self.settle()
        name, namespace = job_name(self.identity_from(context)), self.resolve_namespace()
        self.job_name, self._job_namespace = name, namespace
        return name, namespace

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

    def _lost_track(self, context: Context | Mapping[str, Any] | None, namespace: str, name: str) -> None:
        """The API (or the trigger), not the job, failed. With a retry left the job is left as it is (the next
        try deletes it before submitting, or follows nothing twice); on the last try it is deleted, if the
        API lets us: nothing else would ever stop it."""
        if not self.no_retry_left(context):
            self.log.error("Lost track of MPIJob %s/%s; it is left as it is (the next try deletes it before "
                           "submitting)", namespace, name)
            return
        self.log.error("Lost track of MPIJob %s/%s on the last try: deleting it (no next try would)", namespace, name)
        self._delete_quietly(self.make_launcher(namespace, api_retry_seconds=LAST_TRY_DELETE_SECONDS), name,
                             "no retry is left")

    def _delete_quietly(self, launcher: MPIJobLauncher, name: str, why: str) -> None:
        """Best effort: delete the job, logging (not raising) a failure: the error being raised matters more."""
        try:
            launcher.delete(name)
        except Exception as err:
            self.log.error("Could not delete MPIJob %s/%s (%s): %s; delete it by hand (kubectl delete mpijob -n "
                           "%s %s)", launcher.namespace, name, why, err, launcher.namespace, name)

    def _cleanup(
        self,
        launcher: MPIJobLauncher,
        name: str,
        *,
        succeeded: bool,
        error: BaseException | None = None,
        force: bool = False,
    ) -> None:
        cleanup = self.execution.cleanup
        if cleanup == "never":
            self.log.info("Keeping MPIJob %s (cleanup='never')", name)
            return
        never_started = isinstance(error, MPIJobStartupFailure)
        if force or never_started or cleanup == "always" or (succeeded and cleanup == "on_success"):
            try:
                launcher.delete(name)
            except Exception as err:
                self.log.warning("Could not delete MPIJob %s: %s", name, err)
        else:
            self.log.info("Keeping failed MPIJob %s for inspection (cleanup=%r)", name, cleanup)

    def on_kill(self) -> None:
        # Airflow's SIGTERM handler calls this and returns: execute goes on, and must submit nothing more.
        self._killed = True
        if self._local is not None:
            self._local.kill()
        if self._hosts is not None:  # ISSUE25-H4 TEMPORARY
            self._hosts.cancel()
        if self.job_name is not None:
            # Runs inside a signal handler: an exception here would surface wherever execute happened to be.
            try:
                namespace = self._job_namespace or self.resolve_namespace()
                self._delete_quietly(self.make_launcher(namespace), self.job_name, "the task was killed")
            except Exception as err:
                self.log.error("on_kill could not delete MPIJob %s: %s", self.job_name, err)


def _spec_value(value: Any) -> Any:
    """A setting as the spec builder takes it: mappings as dicts, lists of Kubernetes objects as plain dicts."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, list | tuple):
        return [item if isinstance(item, str) else _plain(item) for item in value]
    return value


# The templated settings of each config.
_TEMPLATED = {argument: tuple(f.name for f in fields(kind) if f.metadata.get("templated"))
              for argument, kind in CONFIG_ARGUMENTS.items()}


def _redacted(uri: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    return parts._replace(netloc=f"***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")).geturl()


def _plain(obj: Any) -> dict[str, Any]:
    """A Kubernetes model object or mapping as a plain camelCase dict."""
    if isinstance(obj, Mapping):
        return dict(obj)
    from operators.mpijob_launcher import to_plain

    return dict(to_plain(obj))


# The job name for a task instance, re-exported for DAG authors and tests.
__all__ = ["ClusterConfig", "ExecutionConfig", "HorovodKubernetesOperator", "JobConfig", "TrackingConfig", "job_name"]
