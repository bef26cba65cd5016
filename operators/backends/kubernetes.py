"""The `kubernetes` backend: the job as a Kubeflow MPIJob (`operators.mpijob_launcher`), waited for here or,
when `ExecutionConfig.deferrable`, in the triggerer (`operators.triggers.MPIJobTrigger`). Both waits judge the
job's status with `operators.mpijob_status`, and both end in `cleanup`.

The operator renders the MPIJob (`BackendRun.render_mpijob`, pure) and keeps the job's name and namespace for
on_kill (`BackendRun.record_job`); this module submits, follows and deletes it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from operators.backends.base import BackendRun, TrainingBackend
from operators.errors import (
    KubernetesApiError,
    KubernetesApiUnavailable,
    MPIJobCleanupFailed,
    MPIJobFailed,
    MPIJobStartupFailure,
)
from operators.mpijob_spec import job_name as job_name_of

if TYPE_CHECKING:
    from operators.mpijob_launcher import MPIJobLauncher
    from operators.mpijob_spec import TaskIdentity

# On the last try, how long a job the task lost track of is tried to be deleted (the API was failing).
LAST_TRY_DELETE_SECONDS = 60.0


class KubernetesBackend(TrainingBackend):
    """An MPIJob per try, named after the task instance; earlier tries' jobs are deleted before it is submitted."""

    renders_mpijob = True
    supports_elastic = True  # the MPI Operator keeps /etc/mpi/discover_hosts.sh current

    def __init__(self, run: BackendRun) -> None:
        super().__init__(run)
        self._context: Mapping[str, Any] | None = None  # the try's, for the last-try rule of lost jobs
        self._launcher: MPIJobLauncher | None = None  # this try's, once made

    def launcher(self, namespace: str) -> MPIJobLauncher:
        """This try's launcher for `namespace` (one per try: it remembers the log lines it copied)."""
        if self._launcher is None or self._launcher.namespace != namespace:
            self._launcher = self.make_launcher(namespace)
        return self._launcher

    def make_launcher(self, namespace: str, *, api_retry_seconds: float | None = None) -> MPIJobLauncher:
        from operators.mpijob_launcher import MPIJobLauncher

        run = self.run
        retry = run.execution.api_retry_seconds
        return MPIJobLauncher(
            run.kubernetes_hook.custom_object_client,
            run.kubernetes_hook.core_v1_client,
            namespace,
            poll_interval=run.execution.poll_interval,
            startup_timeout=run.execution.startup_timeout,
            queue_timeout=run.execution.queue_timeout,  # type: ignore[arg-type]  # settled: a float or None
            api_retry_seconds=retry if api_retry_seconds is None else min(retry, api_retry_seconds),
            api_retry_backoff=run.execution.api_retry_backoff,
            logger=self.log,
            interrupted=lambda: run.killed,
        )

    # -- the interface ----------------------------------------------------------------------------

    def submit(self, identity: TaskIdentity, context: Mapping[str, Any]) -> dict[str, Any]:
        run = self.run
        self._context = context
        namespace = run.namespace()
        run.fit_gpus_to_nodes(discover=True)
        if queue := run.kueue_queue():
            run.check_kueue_capacity(namespace, queue)
        body = self.render(identity, namespace)
        name = body["metadata"]["name"]
        run.record_job(name, namespace)
        launcher = self.launcher(namespace)
        result = {
            "backend": self.name,
            "name": name,
            "namespace": namespace,
            "checkpoint_dir": run.checkpoint_dir(identity),
        }
        # An earlier try's job (a worker crash, a timeout) would share this try's checkpoints and MLflow run key.
        launcher.delete_earlier_tries(body, timeout=run.execution.cleanup_timeout)
        launcher.check_interrupted(f"submitting MPIJob {namespace}/{name}")
        submitted_at = time.time()
        launcher.submit(body)
        if run.killed:  # on_kill ran while the job was being created: its delete may have come first
            self._delete_quietly(launcher, name, "the task was killed while it was submitted")
            launcher.check_interrupted(f"submitting MPIJob {namespace}/{name}")
        if run.execution.deferrable:
            from operators.triggers import MPIJobTrigger

            run.defer(
                MPIJobTrigger(
                    name=name,
                    namespace=namespace,
                    submitted_at=submitted_at,
                    kubernetes_conn_id=run.cluster.kubernetes_conn_id,
                    poll_interval=run.execution.poll_interval,
                    startup_timeout=run.execution.startup_timeout,
                    queue_timeout=run.execution.queue_timeout,  # type: ignore[arg-type]
                    api_retry_seconds=run.execution.api_retry_seconds,
                    api_retry_backoff=run.execution.api_retry_backoff,
                ),
                result=result,
                context=context,
            )
        return result

    def wait(self, result: dict[str, Any], context: Mapping[str, Any]) -> None:
        self._context = context
        self.launcher(result["namespace"]).wait(result["name"])

    def complete(self, result: dict[str, Any], event: Mapping[str, Any], context: Mapping[str, Any]) -> None:
        """Resume after `MPIJobTrigger`: copy the launcher's log; raise what the event says went wrong."""
        from operators.mpijob_launcher import error_for

        self._context = context
        name, namespace = event["name"], event["namespace"]
        result.setdefault("name", name)
        result.setdefault("namespace", namespace)
        self.run.record_job(name, namespace)
        launcher = self.launcher(namespace)
        try:
            if launcher.get(name) is not None:
                launcher.stream_unread_logs(launcher.pods(name))
        except Exception as err:  # the logs are a courtesy; the event decides the outcome
            self.log.warning("Could not fetch the launcher log of MPIJob %s: %s", name, err)
        status = event.get("status")
        if status == "success":
            return
        message = str(event.get("message") or f"MPIJob {namespace}/{name} failed")
        if status == "failed":
            raise error_for(event.get("error_kind"), message)
        # "error": the trigger lost sight of the API, not of a failed job.
        if event.get("error_kind") == "KubernetesApiError":
            raise KubernetesApiError(message)
        raise KubernetesApiUnavailable(message)

    def cancel(self) -> None:
        name = self.run.job_name
        if name is None:
            return
        # Runs inside a signal handler: an exception here would surface wherever execute happened to be.
        try:
            namespace = self.run.job_namespace or self.run.namespace()
            self._delete_quietly(self.make_launcher(namespace), name, "the task was killed")
        except Exception as err:
            self.log.error("on_kill could not delete MPIJob %s: %s", name, err)

    def cleanup(self, result: dict[str, Any], *, succeeded: bool, error: BaseException | None) -> None:
        """A job that ended (well or badly) follows the `cleanup` policy; one still running (a timeout, a kill,
        an error of ours) is deleted. When the API, not the job, failed, the job may be running well: it is
        left for the next try to delete before it submits, and deleted on the last try (no next try would)."""
        name, namespace = result["name"], result["namespace"]
        if isinstance(error, KubernetesApiError):
            self._lost_track(self._context, namespace, name)
            return
        force = error is not None and not isinstance(error, MPIJobFailed)
        self._cleanup(self.launcher(namespace), name, succeeded=succeeded, error=error, force=force)

    def deferral_failed(self, context: Mapping[str, Any], error: BaseException,
                        result: Mapping[str, Any] | None = None) -> None:
        """When the deferral timed out (execution_timeout passed while the trigger waited), delete the job: a
        timed-out task leaves nothing running. When the trigger itself failed on the last try, delete it too:
        no next try would. The job is the one the deferral's `result` names (a subclass may name its jobs its own
        way), else the one this run's identity gives."""
        from airflow.sdk.exceptions import TaskDeferralTimeout

        if result and result.get("name") and result.get("namespace"):
            name, namespace = str(result["name"]), str(result["namespace"])
            self.run.record_job(name, namespace)
        else:
            name, namespace = self._job_of(context)
        if isinstance(error, TaskDeferralTimeout):
            self.log.error("Timed out while MPIJob %s/%s was followed by the triggerer: deleting it", namespace, name)
            try:
                self.make_launcher(namespace).delete(name)
            except Exception as err:
                raise MPIJobCleanupFailed(
                    f"the task timed out and MPIJob {namespace}/{name} could not be deleted ({err}); it may still "
                    f"run: delete it (kubectl delete mpijob -n {namespace} {name}) or let the next try do it"
                ) from error
            return
        self._lost_track(context, namespace, name)

    # -- helpers ----------------------------------------------------------------------------------

    def _job_of(self, context: Mapping[str, Any]) -> tuple[str, str]:
        """This try's job (name, namespace), in a fresh process: the deferral's kwargs are gone."""
        name, namespace = job_name_of(self.run.identity_of(context)), self.run.namespace()
        self.run.record_job(name, namespace)
        return name, namespace

    def _lost_track(self, context: Mapping[str, Any] | None, namespace: str, name: str) -> None:
        """The API (or the trigger), not the job, failed. With a retry left the job is left as it is (the next
        try deletes it before submitting, or follows nothing twice); on the last try it is deleted, if the
        API lets us: nothing else would ever stop it."""
        if not self.run.no_retry_left(context):
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

    def _cleanup(self, launcher: MPIJobLauncher, name: str, *, succeeded: bool, error: BaseException | None = None,
                 force: bool = False) -> None:
        cleanup = self.run.execution.cleanup
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
