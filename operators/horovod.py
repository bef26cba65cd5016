"""`HorovodKubernetesOperator`: multi-node Horovod training as a Kubeflow MPIJob, or locally with horovodrun.

The operator holds per-task state (the job's name, the local process) and chooses the backend; the
spec builder (`mpijob_spec`), the launchers (`mpijob_launcher`, `local_launcher`) and the trigger
(`triggers.MPIJobTrigger`) do the work.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from airflow.sdk import BaseOperator
from airflow.sdk.configuration import conf
from airflow.sdk.exceptions import AirflowNotFoundException

from operators.errors import InvalidJobConfig, MPIJobFailed, MPIJobStartupFailure, TrainingResultMissing
from operators.mpijob_spec import (
    GPU_RESOURCE,
    MPIJobConfig,
    TaskIdentity,
    build_mpijob,
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

    from operators.local_launcher import LocalHorovodLauncher
    from operators.mpijob_launcher import MPIJobLauncher

Backend = Literal["kubernetes", "local", "auto"]
CleanupPolicy = Literal["always", "on_success", "never"]
BACKENDS = ("kubernetes", "local", "auto")
CLEANUP_POLICIES = ("always", "on_success", "never")
GPU_POOL = "gpu"
SHARED_VOLUME = "nightshift-shared"


class HorovodKubernetesOperator(BaseOperator):
    """Run a Horovod training command on `num_workers` workers, on Kubernetes (MPIJob) or locally.

    :param num_workers: number of worker pods (Kubernetes) or local processes. Templated: an int, or a
        template such as ``"{{ params.workers }}"`` rendered and checked at execute.
    :param gpus_per_worker: GPUs each worker asks for (`nvidia.com/gpu`); also MPI slots per worker
        (templated, like `num_workers`). With plain ints the task takes `num_workers * gpus_per_worker`
        slots (at least 1) of the `gpu` pool; with templates, 1 unless the cluster policy in
        `config/airflow_local_settings.py` sizes it from the run's params.
    :param image: the trainer image (Kubernetes backend).
    :param command: the training entrypoint, as a list or one shell-like string, e.g.
        `["python", "-m", "nightshift.train", "--data", "/workspace/data", "--out", "/workspace/model"]`.
        `--checkpoint-dir` is appended unless the command passes one.
    :param checkpoint_dir: where checkpoints live; default `<checkpoint_root>/<dag_id>/<run_id>/<task_id>`
        (never the try number, so a retry resumes). `checkpoint_root` defaults to NIGHTSHIFT_HOME's
        checkpoints directory locally and to `/workspace/checkpoints` (the workspace PVC) on Kubernetes.
    :param backend: "kubernetes", "local", or "auto" (kubernetes when the `kubernetes_conn_id`
        connection exists, else local). Templated.
    :param shared_volume_claim: Kubernetes: the ReadWriteMany claim holding NIGHTSHIFT_HOME, mounted at
        in the launcher and every worker (default: NIGHTSHIFT_SHARED_PVC, else
        `nightshift-workspace`), mounted at NIGHTSHIFT_HOME's path on this worker, so that the same
        paths name the same files in Airflow and in the pods. Every absolute path in `command` must lie
        under a mount.
    :param kueue_queue: Kubernetes: the Kueue LocalQueue the job waits in (templated; None: NIGHTSHIFT_KUEUE_QUEUE;
        empty: no Kueue). The MPIJob then carries `kueue.x-k8s.io/queue-name`, is created suspended, and
        the task waits while Kueue holds it, logging why from the job's Workload; a preempted job waits
        for readmission within the same try and resumes from its checkpoint.
    :param kueue_priority: the Kueue WorkloadPriorityClass of the job (label `kueue.x-k8s.io/priority-class`).
    :param queue_timeout: seconds the job may wait in the queue (since it was last suspended) before the
        task fails with the reason it waited; None: no limit but the task's execution_timeout.
    :param gpus: the total GPUs (templated; 0: `num_workers` x `gpus_per_worker`). Packed into the fewest
        equal workers of at most one node's GPUs (NIGHTSHIFT_GPUS_PER_NODE, else the largest allocatable
        `nvidia.com/gpu` of the cluster's nodes; locally, this machine's GPUs); see `mpijob_spec.pack_gpus`.
        With a queue, a total above what its ClusterQueue can ever admit is refused before submitting.
    :param mlflow_experiment: with `mlflow_run_key`, the task's result comes from the tracking server:
        the complete MLflow run tagged `nightshift.run_key=<mlflow_run_key>` in this experiment (its id,
        model URI and metrics, also pushed as the `mlflow_run_id` / `mlflow_experiment_id` XComs).
        Pods log to NIGHTSHIFT_CLUSTER_MLFLOW_URI, else MLFLOW_TRACKING_URI, passed in their env.
    :param deferrable: on Kubernetes, wait in the triggerer (`MPIJobTrigger`) instead of a worker slot.
    :param poll_interval: seconds between status polls.
    :param startup_timeout: seconds the job may take to start running before it is failed and deleted.
    :param cleanup: delete the MPIJob when the task ends "always", "on_success" (keep failed jobs for
        inspection; ttl_seconds_after_finished removes them) or "never". Jobs that never started
        (unschedulable, image pull failure, startup timeout) are deleted unless cleanup is "never".
    :param timeout: local backend only: seconds before the horovodrun process tree is killed.
    """

    template_fields: Sequence[str] = (
        "num_workers",
        "gpus_per_worker",
        "gpus",
        "backend",
        "kueue_queue",
        "kueue_priority",
        "mlflow_run_key",
        "image",
        "command",
        "env",
        "checkpoint_dir",
        "checkpoint_root",
        "namespace",
        "labels",
        "annotations",
        "volumes",
        "volume_mounts",
        "node_selector",
        "tolerations",
        "service_account_name",
        "priority_class_name",
        "cpu_request",
        "cpu_limit",
        "memory_request",
        "memory_limit",
    )
    template_fields_renderers = {"command": "py", "env": "json", "volumes": "json", "labels": "json"}
    ui_color = "#c9e4f6"

    def __init__(
        self,
        *,
        num_workers: int | str,
        gpus_per_worker: int | str = 0,
        image: str = "",
        command: str | Sequence[str],
        cpu_request: str | None = None,
        cpu_limit: str | None = None,
        memory_request: str | None = None,
        memory_limit: str | None = None,
        namespace: str | None = None,
        service_account_name: str | None = None,
        node_selector: Mapping[str, str] | None = None,
        tolerations: Sequence[Mapping[str, Any]] | None = None,
        priority_class_name: str | None = None,
        env: Mapping[str, str] | None = None,
        volumes: Sequence[Mapping[str, Any]] | None = None,
        volume_mounts: Sequence[Mapping[str, Any]] | None = None,
        image_pull_policy: str | None = None,
        image_pull_secrets: Sequence[str] | None = None,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_root: str | None = None,
        backend: Backend | str = "auto",
        kubernetes_conn_id: str = "kubernetes_default",
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        poll_interval: float = 10.0,
        startup_timeout: float = 600.0,
        cleanup: CleanupPolicy = "on_success",
        clean_pod_policy: str = "Running",
        backoff_limit: int = 0,
        ttl_seconds_after_finished: int | None = 3600,
        active_deadline_seconds: int | None = None,
        launcher_resources: Mapping[str, Mapping[str, str]] | None = None,
        worker_command: Sequence[str] | None = None,
        ssh_auth_mount_path: str | None = None,
        timeout: float | None = None,
        shared_volume_claim: str | None = None,
        mlflow_experiment: str | None = None,
        mlflow_run_key: str | None = None,
        kueue_queue: str | None = None,
        kueue_priority: str | None = None,
        queue_timeout: float | None = None,
        gpus: int | str = 0,
        pool: str | None = None,
        pool_slots: int | None = None,
        **kwargs: Any,
    ) -> None:
        # Plain values are checked now, so a DAG with a typo fails to parse; templates are checked at execute.
        if not _is_template(backend):
            _check_backend(backend)
        if cleanup not in CLEANUP_POLICIES:
            raise InvalidJobConfig(f"cleanup must be one of {CLEANUP_POLICIES}, got {cleanup!r}")
        counts = {"num_workers": (num_workers, 1), "gpus_per_worker": (gpus_per_worker, 0), "gpus": (gpus, 0)}
        for name, (value, minimum) in counts.items():
            if not _is_template(value):
                _to_count(name, value, minimum)
        if pool_slots is None:
            templated = _is_template(num_workers) or _is_template(gpus_per_worker) or _is_template(gpus)
            if templated:
                pool_slots = 1
            else:
                pool_slots = int(gpus) or pool_slots_for(int(num_workers), int(gpus_per_worker))
        super().__init__(pool=pool or GPU_POOL, pool_slots=pool_slots, **kwargs)
        self.num_workers = num_workers
        self.gpus_per_worker = gpus_per_worker
        self.image = image
        self.command = command
        self.cpu_request = cpu_request
        self.cpu_limit = cpu_limit
        self.memory_request = memory_request
        self.memory_limit = memory_limit
        self.namespace = namespace
        self.service_account_name = service_account_name
        self.node_selector = node_selector
        self.tolerations = tolerations
        self.priority_class_name = priority_class_name
        self.env = env
        self.volumes = volumes
        self.volume_mounts = volume_mounts
        self.image_pull_policy = image_pull_policy
        self.image_pull_secrets = image_pull_secrets
        self.labels = labels
        self.annotations = annotations
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_root = checkpoint_root
        self.backend = backend
        self.kubernetes_conn_id = kubernetes_conn_id
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        self.startup_timeout = startup_timeout
        self.cleanup = cleanup
        self.clean_pod_policy = clean_pod_policy
        self.backoff_limit = backoff_limit
        self.ttl_seconds_after_finished = ttl_seconds_after_finished
        self.active_deadline_seconds = active_deadline_seconds
        self.launcher_resources = launcher_resources
        self.worker_command = worker_command
        self.ssh_auth_mount_path = ssh_auth_mount_path
        self.timeout = timeout
        self.shared_volume_claim = shared_volume_claim
        self.mlflow_experiment = mlflow_experiment
        self.mlflow_run_key = mlflow_run_key
        # Not `queue`: BaseOperator.queue is the executor's (Celery) queue.
        self.kueue_queue = kueue_queue
        self.kueue_priority = kueue_priority
        self.queue_timeout = queue_timeout
        self.gpus = gpus
        # Per-try state that on_kill needs.
        self.job_name: str | None = None
        self._job_namespace: str | None = None
        self._local: LocalHorovodLauncher | None = None

    # -- clients -----------------------------------------------------------------------------------

    @cached_property
    def hook(self) -> KubernetesHook:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

        return KubernetesHook(conn_id=self.kubernetes_conn_id)

    def make_launcher(self, namespace: str) -> MPIJobLauncher:
        from operators.mpijob_launcher import MPIJobLauncher

        return MPIJobLauncher(
            self.hook.custom_object_client,
            self.hook.core_v1_client,
            namespace,
            poll_interval=self.poll_interval,
            startup_timeout=self.startup_timeout,
            queue_timeout=self.queue_timeout,
            logger=self.log,
        )

    # -- pure derivations --------------------------------------------------------------------------

    def settle(self) -> None:
        """Convert the rendered template fields to what they stand for, naming the field that is wrong."""
        self.num_workers = _to_count("num_workers", self.num_workers, 1)
        self.gpus_per_worker = _to_count("gpus_per_worker", self.gpus_per_worker, 0)
        self.gpus = _to_count("gpus", self.gpus, 0)
        self.backend = _check_backend(str(self.backend).strip())
        self.kueue_queue = _name_or_none(self.kueue_queue)
        self.kueue_priority = _name_or_none(self.kueue_priority)

    def resolve_queue(self) -> str | None:
        """The LocalQueue: the `queue` argument, else NIGHTSHIFT_KUEUE_QUEUE; an empty one means no Kueue."""
        import os

        if self.kueue_queue is not None:
            return self.kueue_queue or None
        return os.environ.get("NIGHTSHIFT_KUEUE_QUEUE", "").strip() or None

    def pack(self, gpus_per_node: int) -> None:
        """Turn `gpus` (a total) into workers x GPUs per worker, each worker at most one node."""
        workers, per_worker = pack_gpus(int(self.gpus), gpus_per_node)
        self.log.info("%d GPUs on nodes of %d: %d worker(s) x %d GPU(s)", self.gpus, gpus_per_node, workers,
                      per_worker)
        self.num_workers, self.gpus_per_worker = workers, per_worker

    def cluster_gpus_per_node(self, *, discover: bool) -> int:
        """NIGHTSHIFT_GPUS_PER_NODE, else (when `discover`) the largest allocatable nvidia.com/gpu of a node."""
        import os

        configured = os.environ.get("NIGHTSHIFT_GPUS_PER_NODE", "").strip()
        if configured:
            return _to_count("NIGHTSHIFT_GPUS_PER_NODE", configured, 1)
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
            raise InvalidJobConfig(f"gpus={self.gpus} needs the GPUs of one node: set NIGHTSHIFT_GPUS_PER_NODE ({why})")
        return found

    def check_queue_capacity(self, namespace: str, queue: str) -> None:
        """Refuse a job its ClusterQueue can never admit (more GPUs than its quota plus what it may borrow)."""
        from kubernetes.client.exceptions import ApiException

        from operators.kueue_quota import max_admissible
        from operators.mpijob_launcher import KUEUE_GROUP, KUEUE_VERSION

        total = int(self.num_workers) * int(self.gpus_per_worker)
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
                f"the job asks for {total} GPUs ({self.num_workers} x {self.gpus_per_worker}) but ClusterQueue "
                f"{cq_name} (LocalQueue {queue}) can admit at most {limit}: ask for at most {limit} GPUs"
            )

    def resolve_backend(self) -> str:
        """The backend this run uses; "auto" looks for the Kubernetes connection."""
        if self.backend != "auto":
            return self.backend
        from airflow.sdk import BaseHook

        try:
            BaseHook.get_connection(self.kubernetes_conn_id)
        except AirflowNotFoundException:
            self.log.info("No connection %r: using the local backend", self.kubernetes_conn_id)
            return "local"
        return "kubernetes"

    def resolve_namespace(self) -> str:
        if self.namespace:
            return self.namespace
        try:
            return self.hook.get_namespace() or "default"
        except AirflowNotFoundException:
            return "default"

    @staticmethod
    def identity_from(context: Context | Mapping[str, Any]) -> TaskIdentity:
        ti = context["ti"]
        return TaskIdentity(
            dag_id=ti.dag_id,
            task_id=ti.task_id,
            run_id=ti.run_id,
            try_number=int(ti.try_number or 1),
            map_index=int(getattr(ti, "map_index", -1) if getattr(ti, "map_index", None) is not None else -1),
        )

    def resolve_checkpoint_dir(self, identity: TaskIdentity, backend: str) -> str:
        if self.checkpoint_dir:
            return str(self.checkpoint_dir)
        root = self.checkpoint_root
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

        claim = self.shared_volume_claim or settings.shared_volume_claim()
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
        optional: dict[str, Any] = {}
        if self.launcher_resources is not None:
            optional["launcher_resources"] = self.launcher_resources
        if self.worker_command is not None:
            optional["worker_command"] = tuple(self.worker_command)
        if self.ssh_auth_mount_path is not None:
            optional["ssh_auth_mount_path"] = self.ssh_auth_mount_path
        return MPIJobConfig(
            image=self.image,
            command=list(command),
            num_workers=int(self.num_workers),
            gpus_per_worker=int(self.gpus_per_worker),
            namespace=namespace,
            cpu_request=self.cpu_request,
            cpu_limit=self.cpu_limit,
            memory_request=self.memory_request,
            memory_limit=self.memory_limit,
            env=dict(self.env or {}),
            volumes=[_plain(v) for v in self.volumes or ()],
            volume_mounts=[_plain(m) for m in self.volume_mounts or ()],
            service_account_name=self.service_account_name,
            node_selector=dict(self.node_selector or {}),
            tolerations=[_plain(t) for t in self.tolerations or ()],
            priority_class_name=self.priority_class_name,
            image_pull_policy=self.image_pull_policy,
            image_pull_secrets=tuple(self.image_pull_secrets or ()),
            labels=dict(self.labels or {}),
            annotations=dict(self.annotations or {}),
            clean_pod_policy=self.clean_pod_policy,
            backoff_limit=self.backoff_limit,
            ttl_seconds_after_finished=self.ttl_seconds_after_finished,
            active_deadline_seconds=self.active_deadline_seconds,
            queue_name=self.resolve_queue(),
            priority_class=self.kueue_priority if self.resolve_queue() else None,
            **optional,
        )

    def build_manifest(self, identity: TaskIdentity, namespace: str | None = None) -> dict[str, Any]:
        """The MPIJob this task submits for `identity` (pure; no cluster needed)."""
        self.settle()
        if self.gpus:
            self.pack(self.cluster_gpus_per_node(discover=False))
        namespace = namespace or self.namespace or "default"
        checkpoint_dir = self.resolve_checkpoint_dir(identity, "kubernetes")
        command = with_checkpoint_dir(split_command(self.command), checkpoint_dir)
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
        import yaml

        identity = TaskIdentity(
            dag_id=self.dag_id if self.has_dag() else "dry-run",
            task_id=self.task_id,
            run_id="dry_run",
            try_number=1,
        )
        print(yaml.safe_dump(self.build_manifest(identity), sort_keys=False))

    # -- execution ---------------------------------------------------------------------------------

    def execute(self, context: Context) -> dict[str, Any]:
        identity = self.identity_from(context)
        self.settle()
        backend = self.resolve_backend()
        if backend == "local":
            result = self.execute_local(identity)
        else:
            result = self.execute_kubernetes(identity)
        return self.collect_results(context, result)

    def execute_local(self, identity: TaskIdentity) -> dict[str, Any]:
        from operators.local_launcher import LocalHorovodLauncher, check_local_capacity

        if self.gpus:  # this machine is the one node: one worker with all the GPUs asked for
            self.num_workers, self.gpus_per_worker, self.gpus = 1, int(self.gpus), 0
        ranks = check_local_capacity(int(self.num_workers), int(self.gpus_per_worker))
        checkpoint_dir = self.resolve_checkpoint_dir(identity, "local")
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        command = with_checkpoint_dir(split_command(self.command), checkpoint_dir)
        self.log.info("Training with %d rank(s) here (%d worker(s) x %d GPU(s)); checkpoints of this task "
                      "(every try): %s", ranks, self.num_workers, self.gpus_per_worker, checkpoint_dir)
        self._local = LocalHorovodLauncher(
            ranks,
            command,
            env=dict(self.env or {}),
            timeout=self.timeout,
            logger=self.log,
        )
        try:
            self._local.run()
        finally:
            if self._local.process is not None and self._local.process.poll() is None:
                self._local.kill()
        return {"backend": "local", "checkpoint_dir": checkpoint_dir, "num_workers": self.num_workers,
                "gpus_per_worker": self.gpus_per_worker}

    def collect_results(self, context: Context | Mapping[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        """Add the training's MLflow run (found on the tracking server by its run key) to the result."""
        if not (self.mlflow_experiment and self.mlflow_run_key):
            return result
        from nightshift.errors import TrackingError
        from nightshift.tracking import find_training_run

        try:
            run = find_training_run(str(self.mlflow_experiment), str(self.mlflow_run_key))
        except TrackingError as err:
            raise TrainingResultMissing(f"the training job succeeded but its result is not in MLflow: {err}") from err
        context["ti"].xcom_push(key="mlflow_run_id", value=run["run_id"])
        context["ti"].xcom_push(key="mlflow_experiment_id", value=run["experiment_id"])
        self.log.info("Training logged MLflow run %s (experiment %s): %s", run["run_id"], run["experiment_id"],
                      run["metrics"])
        return {**result, "mlflow_run_id": run["run_id"], "experiment_id": run["experiment_id"],
                "model_uri": run["model_uri"], "metrics": run["metrics"]}

    def execute_kubernetes(self, identity: TaskIdentity) -> dict[str, Any]:
        namespace = self.resolve_namespace()
        if self.gpus:
            self.pack(self.cluster_gpus_per_node(discover=True))
            self.gpus = 0
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
        submitted_at = time.time()
        launcher.submit(body)
        if self.deferrable:
            from operators.triggers import MPIJobTrigger

            self.defer(
                trigger=MPIJobTrigger(
                    name=name,
                    namespace=namespace,
                    submitted_at=submitted_at,
                    kubernetes_conn_id=self.kubernetes_conn_id,
                    poll_interval=self.poll_interval,
                    startup_timeout=self.startup_timeout,
                    queue_timeout=self.queue_timeout,
                ),
                method_name="execute_complete",
                kwargs={"result": result},
            )
        try:
            launcher.wait(name)
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
        error = error_for(event.get("error_kind"), str(event.get("message") or f"MPIJob {name} failed"))
        # "error": the trigger lost track of the job; do not leave it running unobserved.
        self._cleanup(launcher, name, succeeded=False, error=error, force=status != "failed")
        raise error

    def _cleanup(
        self,
        launcher: MPIJobLauncher,
        name: str,
        *,
        succeeded: bool,
        error: BaseException | None = None,
        force: bool = False,
    ) -> None:
        if self.cleanup == "never":
            self.log.info("Keeping MPIJob %s (cleanup='never')", name)
            return
        never_started = isinstance(error, MPIJobStartupFailure)
        if force or never_started or self.cleanup == "always" or (succeeded and self.cleanup == "on_success"):
            try:
                launcher.delete(name)
            except Exception as err:
                self.log.warning("Could not delete MPIJob %s: %s", name, err)
        else:
            self.log.info("Keeping failed MPIJob %s for inspection (cleanup=%r)", name, self.cleanup)

    def on_kill(self) -> None:
        if self._local is not None:
            self._local.kill()
        if self.job_name is not None:
            namespace = self._job_namespace or self.resolve_namespace()
            self.make_launcher(namespace).delete(self.job_name)


def _is_template(value: object) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def _check_backend(value: object) -> str:
    if value not in BACKENDS:
        raise InvalidJobConfig(f"backend must be one of {BACKENDS}, got {value!r}")
    return str(value)


def _to_count(name: str, value: object, minimum: int) -> int:
    """An int field given as an int or as its rendered template (a string of digits)."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
        number = int(value.strip())
    if number is None or number < minimum:
        raise InvalidJobConfig(f"{name} must be an integer >= {minimum}, got {value!r}")
    return number


def _name_or_none(value: object) -> str | None:
    """A rendered optional name: None stays None; "None" (a None param rendered by Jinja) and blanks are ""."""
    if value is None:
        return None
    text = str(value).strip()
    return "" if text in {"", "None"} else text


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
__all__ = ["HorovodKubernetesOperator", "job_name"]
