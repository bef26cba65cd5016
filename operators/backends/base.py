"""The contract between `HorovodKubernetesOperator` and a training backend: `TrainingBackend`, which a backend
implements, and `BackendRun`, all that a backend gets from the operator. A backend never sees the operator.

How the operator drives a backend registered as `name` (operators.backends), for one try:

    backend = create_backend(name, run)            # the registry makes it and sets backend.name = name
    result = backend.submit(identity, context)     # starts the job; may defer instead of returning
    try:
        backend.wait(result, context)              # blocks, streams logs, raises operators.errors' errors
    except BaseException as err:
        backend.cleanup(result, succeeded=False, error=err)
        raise
    backend.cleanup(result, succeeded=True, error=None)

`cancel()` is the operator's `on_kill` (it may run in a signal handler, while `wait` blocks in another frame).

Deferral. A backend that waits in the triggerer calls `run.defer(trigger, result=..., context=...)` from
`submit`; the task leaves the worker. When the trigger fires, the operator makes a *fresh* instance of the
backend registered under `result["backend"]` (the name `run.defer` wrote there: the registered name, so a
subclass registered as "gke" is resumed as "gke", never as the class it extends), in another process, and
calls `complete(result, event, context)`, which judges the trigger's event as `wait` judges the job; then it
cleans up as above. When the deferral itself ended badly (it timed out, the trigger failed) that fresh
instance's `deferral_failed(context, error, result)` is called instead: Airflow then replaces the deferral's
kwargs with its error, so `run.defer` also keeps `result` in the task instance's XCom (key DEFERRED_XCOM) and the
operator hands it back from there. So everything `complete`, `cleanup` and `deferral_failed` need after a
deferral must be in `result` (JSON-serialisable), or be derivable from `context` (`run.identity_of(context)`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

# The XCom key under which `BackendRun.defer` keeps the deferral's result (for `deferral_failed`).
DEFERRED_XCOM = "nightshift_deferred"

if TYPE_CHECKING:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    from operators.horovod import HorovodKubernetesOperator
    from operators.horovod_config import ClusterConfig, ExecutionConfig, JobConfig, TrackingConfig
    from operators.mpijob_spec import TaskIdentity


class BackendRun:
    """What the operator hands a backend for one try: the settled configs, a logger, whether the task was
    killed, the task's checkpoint directory, the MPIJob it would submit, a way to defer and to learn whether a
    retry is left, and the Kubernetes helpers the MPIJob backends share. Made by the operator; a backend only
    reads it and calls its methods.

    :ivar backend: the registered name of the backend this run is for (what `defer` writes into the result).
    :ivar log: the task's logger: what a backend logs is the task's log.
    """

    def __init__(self, operator: HorovodKubernetesOperator, backend: str) -> None:
        self._operator = operator
        self.backend = backend
        self.log: Any = operator.log  # Airflow's task logger (info, warning, error with %-style arguments)

    # -- the job -----------------------------------------------------------------------------------

    @property
    def job(self) -> JobConfig:
        """What runs (settled: counts are ints, `num_workers` is `max_workers` for an elastic job)."""
        return self._operator.job

    @property
    def cluster(self) -> ClusterConfig:
        """Where it runs (settled)."""
        return self._operator.cluster

    @property
    def execution(self) -> ExecutionConfig:
        """How it is waited for and cleaned up (settled): timeouts, polling, `cleanup`, `deferrable`."""
        return self._operator.execution

    @property
    def tracking(self) -> TrackingConfig:
        """Where its result comes back from (the MLflow experiment and run key)."""
        return self._operator.tracking

    def use_job(self, job: JobConfig) -> None:
        """Run `job` instead in this try (a backend's own shape of it, e.g. local's one worker with every GPU);
        the MPIJob rendered afterwards has that shape."""
        self._operator.use_job(job)

    def checkpoint_dir(self, identity: TaskIdentity) -> str:
        """The task's checkpoint directory: the same for every try and every backend, so a retry resumes."""
        return self._operator.resolve_checkpoint_dir(identity)

    @staticmethod
    def identity_of(context: Mapping[str, Any]) -> TaskIdentity:
        """The task instance `context` (Airflow's task context) is for: what names the job after a deferral."""
        from operators.horovod import HorovodKubernetesOperator

        return HorovodKubernetesOperator.identity_from(context)

    # -- the task's life ---------------------------------------------------------------------------

    @property
    def killed(self) -> bool:
        """The task was killed (on_kill ran): whatever the try still does, it starts nothing more."""
        return self._operator.killed

    def no_retry_left(self, context: Mapping[str, Any] | None) -> bool:
        """This try is the task's last (nothing after it would clean up what it leaves)."""
        return self._operator.no_retry_left(context)

    def defer(self, trigger: Any, *, result: Mapping[str, Any], context: Mapping[str, Any]) -> None:
        """Hand the wait to `trigger` (an Airflow BaseTrigger) and leave the worker (raises Airflow's
        TaskDeferred). `result` travels with the deferral, its "backend" set to this run's backend, and is kept in
        the task instance's XCom for a deferral that times out or fails (Airflow then drops the kwargs); the
        deferral times out when the task's execution_timeout would have."""
        carried = {**result, "backend": self.backend}
        try:  # the job is submitted: failing here would leave it to nothing; without the XCom, a deferral that
            # times out falls back to the job name the run's identity gives
            context["ti"].xcom_push(key=DEFERRED_XCOM, value=carried)
        except Exception as err:
            self.log.warning("Could not keep the deferred job's result in XCom %s (%s): a deferral that times "
                             "out then deletes the job its run's identity names", DEFERRED_XCOM, err)
        self._operator.defer(trigger=trigger, method_name="execute_complete", kwargs={"result": carried},
                             timeout=self._operator.deferral_timeout(context))

    def record_job(self, name: str | None, namespace: str | None = None) -> None:
        """The job this try runs (or last ran) is `name` in `namespace`: kept as the operator's `job_name`."""
        self._operator.job_name, self._operator.job_namespace = name, namespace

    @property
    def job_name(self) -> str | None:
        """The job `record_job` recorded in this process (None: none yet)."""
        return self._operator.job_name

    @property
    def job_namespace(self) -> str | None:
        return self._operator.job_namespace

    # -- the MPIJob and its cluster (backends that render one) ----------------------------------------

    def render_mpijob(self, identity: TaskIdentity, namespace: str | None = None, *,
                      tracking_uri: str | None = None) -> dict[str, Any]:
        """The MPIJob the task submits for `identity` (pure, validated shape; no cluster needed), its pods
        logging to `tracking_uri` (default: the settings' cluster tracking URI)."""
        return self._operator.build_manifest(identity, namespace, tracking_uri=tracking_uri)

    @property
    def kubernetes_hook(self) -> KubernetesHook:
        """The cncf provider's hook for `cluster.kubernetes_conn_id` (made once per try)."""
        return self._operator.hook

    def namespace(self) -> str:
        """`cluster.namespace`, else the connection's namespace, else "default"."""
        return self._operator.resolve_namespace()

    def kueue_queue(self) -> str | None:
        """The Kueue LocalQueue the job goes to (None: no Kueue)."""
        return self._operator.resolve_queue()

    def fit_gpus_to_nodes(self, *, discover: bool) -> None:
        """When the job asks for `gpus` (a total), make it workers x GPUs per worker on the cluster's nodes
        (NIGHTSHIFT_GPUS_PER_NODE, else, when `discover`, the nodes' allocatable GPUs)."""
        if self.job.gpus:
            self._operator.pack(self._operator.cluster_gpus_per_node(discover=discover))

    def check_kueue_capacity(self, namespace: str, queue: str) -> None:
        """InvalidJobConfig when the queue's ClusterQueue can never admit the job."""
        self._operator.check_queue_capacity(namespace, queue)


class TrainingBackend(ABC):
    """Runs one try of a `HorovodKubernetesOperator`'s job somewhere. One instance per try (per process).

    A backend gets its `BackendRun` as `self.run` (and the task's logger as `self.log`) and nothing else of the
    operator. `name` is the name it is registered as, set on each instance by the registry: a class does not
    declare it, so one class may be registered under several names and a subclass under its own.

    `submit` returns the result dict the task returns (before MLflow's run is added): at least
    "checkpoint_dir", and whatever `wait`, `cleanup` and `complete` need, since after a deferral they run in
    another process on a fresh instance. The operator sets its "backend" to `name`.
    """

    name: str  # the registered name; set on the instance by operators.backends.create_backend
    # Whether a run on this backend creates the MPIJob `run.render_mpijob` renders (what `nightshift plan`
    # prints and validates); False: it creates no Kubernetes object.
    renders_mpijob: ClassVar[bool] = False
    # Whether this backend runs elastic jobs (`JobConfig.elastic`: horovodrun's elastic driver, which goes on
    # when hosts are lost and takes them back). The operator refuses an elastic job, before submitting, on a
    # backend that does not say so: a plugin backend must declare it (True) and run the elastic launcher.
    supports_elastic: ClassVar[bool] = False

    def __init__(self, run: BackendRun) -> None:
        self.run = run
        self.log = run.log

    def render(self, identity: TaskIdentity, namespace: str | None = None) -> dict[str, Any]:
        """The MPIJob this backend would run for `identity` (only where `renders_mpijob`): what `plan` prints."""
        return self.run.render_mpijob(identity, namespace)

    @abstractmethod
    def submit(self, identity: TaskIdentity, context: Mapping[str, Any]) -> dict[str, Any]:
        """Start the job for this try (`context`: Airflow's task context); return the result dict, or defer
        (`run.defer`) to wait in the triggerer."""

    @abstractmethod
    def wait(self, result: dict[str, Any], context: Mapping[str, Any]) -> None:
        """Block until the job ends, streaming its logs; raise the operator's error (operators.errors) for a job
        that did not succeed."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop the job (the task was killed); never raise."""

    @abstractmethod
    def cleanup(self, result: dict[str, Any], *, succeeded: bool, error: BaseException | None) -> None:
        """After `wait` (or `complete`) returned or raised `error`: remove what the job left, per the policy."""

    def complete(self, result: dict[str, Any], event: Mapping[str, Any], context: Mapping[str, Any]) -> None:
        """After a deferral, on a fresh instance: judge the trigger's `event` as `wait` judges the job (raise for
        a failure). `result` is what `run.defer` carried."""
        raise NotImplementedError(f"the {self.name} backend never defers: it has no trigger event to complete")

    def deferral_failed(self, context: Mapping[str, Any], error: BaseException,
                        result: Mapping[str, Any] | None = None) -> None:
        """After a deferral that ended without an event (it timed out, or the trigger failed), on a fresh
        instance; `result`: what `run.defer` carried (None when it could not be read back); `error` is re-raised
        after this returns. Default: nothing to do."""
        return None
