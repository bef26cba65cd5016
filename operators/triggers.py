"""`MPIJobTrigger`: waits for an MPIJob in the triggerer, asynchronously, and never raises."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from operators.mpijob_spec import API_GROUP, API_VERSION, JOB_NAME_LABEL, KUEUE_QUEUE_LABEL, PLURAL
from operators.mpijob_status import Verdict, evaluate

if TYPE_CHECKING:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook

# on_kill's delete retries transient API failures this long at most: the triggerer gives on_kill 30 s by
# default ([triggerer] on_kill_timeout) and cancels it after.
ON_KILL_RETRY_SECONDS = 20.0
# How long on_kill waits for the task instance's state (asked of the triggerer's supervisor).
TASK_STATE_TIMEOUT = 5.0


class MPIJobTrigger(BaseTrigger):
    """Poll an MPIJob until it succeeds, fails or cannot start; yield one event saying which.

    The event payload is `{"status": "success" | "failed" | "error", "name", "namespace", "phase",
    "error_kind", "message"}`: "failed" is a verdict on the job (error_kind names the exception the
    operator raises), "error" means the trigger itself could not follow the job: error_kind
    "KubernetesApiUnavailable" (the API kept failing for api_retry_seconds) or "KubernetesApiError" (refused).

    :param submitted_at: wall-clock time (`time.time()`) of the job's creation; startup_timeout counts
        from it, so a trigger that restarts on another triggerer keeps the same deadline.
    :param api_retry_seconds: how long transient API failures (429, 5xx, a connection refused or cut) are
        retried, with backoff from `api_retry_backoff` seconds (doubling, at most 30 s, or the server's
        Retry-After), before the trigger gives up with an "error" event; any other refusal (403...) is an
        "error" event at once.
    :param max_consecutive_errors: no longer used (kept so a trigger serialised by an earlier release loads).

    `on_kill` (Airflow calls it when a person marks the deferred task failed or success, or clears it) deletes
    the job in the foreground: no worker runs the operator's on_kill for a deferred task.
    """

    def __init__(
        self,
        name: str,
        namespace: str,
        *,
        submitted_at: float,
        kubernetes_conn_id: str | None = "kubernetes_default",
        poll_interval: float = 10.0,
        startup_timeout: float = 600.0,
        cluster_context: str | None = None,
        config_file: str | None = None,
        in_cluster: bool | None = None,
        max_consecutive_errors: int | None = None,
        queue_timeout: float | None = None,
        api_retry_seconds: float = 300.0,
        api_retry_backoff: float = 1.0,
    ) -> None:
        super().__init__()
        self.name = name
        self.namespace = namespace
        self.submitted_at = submitted_at
        self.kubernetes_conn_id = kubernetes_conn_id
        self.poll_interval = poll_interval
        self.startup_timeout = startup_timeout
        self.cluster_context = cluster_context
        self.config_file = config_file
        self.in_cluster = in_cluster
        self.queue_timeout = queue_timeout
        self.api_retry_seconds = api_retry_seconds
        self.api_retry_backoff = api_retry_backoff

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "name": self.name,
                "namespace": self.namespace,
                "submitted_at": self.submitted_at,
                "kubernetes_conn_id": self.kubernetes_conn_id,
                "poll_interval": self.poll_interval,
                "startup_timeout": self.startup_timeout,
                "cluster_context": self.cluster_context,
                "config_file": self.config_file,
                "in_cluster": self.in_cluster,
                "queue_timeout": self.queue_timeout,
                "api_retry_seconds": self.api_retry_seconds,
                "api_retry_backoff": self.api_retry_backoff,
            },
        )

    def _hook(self) -> AsyncKubernetesHook:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook

        return AsyncKubernetesHook(
            conn_id=self.kubernetes_conn_id,
            in_cluster=self.in_cluster,
            config_file=self.config_file,
            cluster_context=self.cluster_context,
        )

    @contextlib.asynccontextmanager
    async def api_clients(self) -> AsyncIterator[tuple[Any, Any]]:
        """(CustomObjectsApi, CoreV1Api) of kubernetes_asyncio, on one connection for one poll."""
        from kubernetes_asyncio import client as async_client

        async with self._hook().get_conn() as connection:
            yield async_client.CustomObjectsApi(connection), async_client.CoreV1Api(connection)

    async def poll_once(self) -> Verdict:
        """Read the job and its pods once and judge them."""
        from kubernetes_asyncio.client.exceptions import ApiException

        from operators.mpijob_launcher import to_plain

        async with self.api_clients() as (custom_api, core_api):
            try:
                job: dict[str, Any] | None = dict(
                    await custom_api.get_namespaced_custom_object(
                        group=API_GROUP,
                        version=API_VERSION,
                        namespace=self.namespace,
                        plural=PLURAL,
                        name=self.name,
                    )
                )
            except ApiException as err:
                if getattr(err, "status", None) != 404:
                    raise
                job = None
            pods: list[dict[str, Any]] = []
            workload = None
            if job is not None:
                listing = await core_api.list_namespaced_pod(
                    namespace=self.namespace, label_selector=f"{JOB_NAME_LABEL}={self.name}"
                )
                pods = [to_plain(p) for p in listing.items or []]
                if KUEUE_QUEUE_LABEL in ((job.get("metadata") or {}).get("labels") or {}):
                    workload = await self._workload(custom_api, job)
        now = time.time()
        return evaluate(self.name, job, pods, elapsed=now - self.submitted_at, startup_timeout=self.startup_timeout,
                        now=now, workload=workload, queue_timeout=self.queue_timeout)

    async def _workload(self, custom_api: Any, job: dict[str, Any]) -> dict[str, Any] | None:
        """The job's Kueue Workload, or None (not created yet, or not readable: the wait is then unexplained)."""
        from kubernetes_asyncio.client.exceptions import ApiException

        from operators.mpijob_launcher import KUEUE_GROUP, KUEUE_JOB_UID_LABEL, KUEUE_VERSION

        try:
            listing = await custom_api.list_namespaced_custom_object(
                group=KUEUE_GROUP, version=KUEUE_VERSION, namespace=self.namespace, plural="workloads",
                label_selector=f"{KUEUE_JOB_UID_LABEL}={(job.get('metadata') or {}).get('uid')}")
        except ApiException as err:
            if getattr(err, "status", None) not in {403, 404}:
                raise
            return None
        items = (listing or {}).get("items") or []
        return dict(items[0]) if items else None

    async def on_kill(self) -> None:
        """The task was marked failed/success or cleared while deferred: delete its MPIJob (foreground).

        Airflow 3.3's triggerer calls this when a trigger it runs is no longer assigned to it: after a user
        action, but also when another triggerer took the trigger over because this one missed its heartbeats
        (it cannot tell the two apart; a shutdown or restart does not call it). The task instance's state tells
        them apart: still "deferred" means the trigger was only moved, and the job is kept. When the state
        cannot be read, the job is deleted: a job nobody follows would hold its GPUs for good, while a
        deleted one costs at most a try (the next one resumes from the checkpoints). Never raises.
        """
        state = await self._task_state()
        if state == "deferred":
            self.log.info("MPIJob %s/%s: its task is still deferred (the trigger moved to another triggerer): "
                          "keeping the job", self.namespace, self.name)
            return
        await self._delete(f"the task was {state or 'killed'} while deferred")

    async def _task_state(self) -> str | None:
        """The state of the task instance this trigger follows, or None when it cannot be read."""
        ti = self.task_instance
        if ti is None:
            return None
        try:
            from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance
            from asgiref.sync import sync_to_async

            map_index = getattr(ti, "map_index", -1)
            mapped = map_index is not None and map_index >= 0
            states = await asyncio.wait_for(
                sync_to_async(RuntimeTaskInstance.get_task_states)(
                    dag_id=ti.dag_id, task_ids=[ti.task_id], run_ids=[ti.run_id],
                    map_index=map_index if mapped else None),
                timeout=TASK_STATE_TIMEOUT)
            key = f"{ti.task_id}_{map_index}" if mapped else ti.task_id
            state = ((states or {}).get(ti.run_id) or {}).get(key)
            return str(getattr(state, "value", state)) if state is not None else None
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self.log.warning("MPIJob %s/%s: cannot read its task's state (%s): deleting the job to be safe",
                             self.namespace, self.name, err)
            return None

    async def _delete(self, why: str) -> None:
        """Delete the job in the foreground; 404 is fine; transient failures retried for a short while."""
        from operators.mpijob_launcher import backoff_delay, describe, is_transient

        window = min(self.api_retry_seconds, ON_KILL_RETRY_SECONDS)
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                async with self.api_clients() as (custom_api, _):
                    await custom_api.delete_namespaced_custom_object(
                        group=API_GROUP, version=API_VERSION, namespace=self.namespace, plural=PLURAL,
                        name=self.name, body={"propagationPolicy": "Foreground"})
                self.log.info("Deleted MPIJob %s/%s: %s", self.namespace, self.name, why)
                return
            except asyncio.CancelledError:
                raise
            except Exception as err:
                if getattr(err, "status", None) == 404:
                    self.log.info("MPIJob %s/%s was already gone", self.namespace, self.name)
                    return
                waited = time.monotonic() - started
                if not is_transient(err) or waited >= window:
                    self.log.error("Could not delete MPIJob %s/%s (%s): %s; delete it by hand (kubectl delete "
                                   "mpijob -n %s %s)", self.namespace, self.name, why, describe(err),
                                   self.namespace, self.name)
                    return
                delay = backoff_delay(err, attempt, self.api_retry_backoff, window - waited)
                attempt += 1
                await asyncio.sleep(delay)

    def _event(self, status: str, verdict: Verdict | None = None, message: str = "",
               error_kind: str | None = None) -> TriggerEvent:
        return TriggerEvent(
            {
                "status": status,
                "name": self.name,
                "namespace": self.namespace,
                "phase": verdict.phase if verdict else None,
                "error_kind": verdict.error_kind if verdict else error_kind,
                "message": message or (verdict.message if verdict else ""),
            }
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from operators.mpijob_launcher import backoff_delay, describe, is_transient

        last_phase, last_reason = None, None
        failing_since: float | None = None
        attempt = 0
        while True:
            try:
                verdict = await self.poll_once()
                failing_since, attempt = None, 0
            except asyncio.CancelledError:
                raise
            except Exception as err:
                where = f"MPIJob {self.namespace}/{self.name}: lost track of the job"
                if not is_transient(err):
                    yield self._event("error", message=f"{where}: the Kubernetes API answered {describe(err)}",
                                      error_kind="KubernetesApiError")
                    return
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                waited = now - failing_since
                if waited >= self.api_retry_seconds:
                    yield self._event("error", error_kind="KubernetesApiUnavailable",
                                      message=f"{where}: the Kubernetes API kept failing for "
                                                       f"{self.api_retry_seconds:g}s (last: {describe(err)})")
                    return
                delay = backoff_delay(err, attempt, self.api_retry_backoff, self.api_retry_seconds - waited)
                self.log.warning("Polling MPIJob %s failed (%s): retrying in %.1fs (for up to %gs)", self.name,
                                 describe(err), delay, self.api_retry_seconds)
                attempt += 1
                await asyncio.sleep(delay)
                continue
            if verdict.phase != last_phase:
                self.log.info("MPIJob %s/%s is %s", self.namespace, self.name, verdict.phase)
                last_phase = verdict.phase
            if not verdict.done and verdict.message and verdict.message != last_reason:
                self.log.info("%s", verdict.message)  # Kueue's reason, or an elastic worker's restarts
            last_reason = verdict.message
            if verdict.done:
                yield self._event("success" if verdict.succeeded else "failed", verdict)
                return
            await asyncio.sleep(self.poll_interval)
