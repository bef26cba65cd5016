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


class MPIJobTrigger(BaseTrigger):
    """Poll an MPIJob until it succeeds, fails or cannot start; yield one event saying which.

    The event payload is `{"status": "success" | "failed" | "error", "name", "namespace", "phase",
    "error_kind", "message"}`: "failed" is a verdict on the job (error_kind names the exception the
    operator raises), "error" means the trigger itself could not follow the job (API unreachable...).

    :param submitted_at: wall-clock time (`time.time()`) of the job's creation; startup_timeout counts
        from it, so a trigger that restarts on another triggerer keeps the same deadline.
    :param max_consecutive_errors: API errors in a row tolerated (a blip of the API server) before
        the trigger gives up with an "error" event.
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
        max_consecutive_errors: int = 3,
        queue_timeout: float | None = None,
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
        self.max_consecutive_errors = max_consecutive_errors
        self.queue_timeout = queue_timeout

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
                "max_consecutive_errors": self.max_consecutive_errors,
                "queue_timeout": self.queue_timeout,
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

    def _event(self, status: str, verdict: Verdict | None = None, message: str = "") -> TriggerEvent:
        return TriggerEvent(
            {
                "status": status,
                "name": self.name,
                "namespace": self.namespace,
                "phase": verdict.phase if verdict else None,
                "error_kind": verdict.error_kind if verdict else None,
                "message": message or (verdict.message if verdict else ""),
            }
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        last_phase, last_reason = None, None
        errors_in_a_row = 0
        while True:
            try:
                verdict = await self.poll_once()
                errors_in_a_row = 0
            except asyncio.CancelledError:
                raise
            except Exception as err:
                errors_in_a_row += 1
                if errors_in_a_row < self.max_consecutive_errors:
                    self.log.warning("Polling MPIJob %s failed (%d in a row): %r", self.name, errors_in_a_row, err)
                    await asyncio.sleep(self.poll_interval)
                    continue
                yield self._event(
                    "error", message=f"MPIJob {self.namespace}/{self.name}: lost track of the job: {err!r}"
                )
                return
            if verdict.phase != last_phase:
                self.log.info("MPIJob %s/%s is %s", self.namespace, self.name, verdict.phase)
                last_phase = verdict.phase
            if verdict.phase == "Queued" and not verdict.done and verdict.message != last_reason:
                self.log.info("%s", verdict.message)
            last_reason = verdict.message
            if verdict.done:
                yield self._event("success" if verdict.succeeded else "failed", verdict)
                return
            await asyncio.sleep(self.poll_interval)
