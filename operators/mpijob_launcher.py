"""Submit, follow and delete one MPIJob through the Kubernetes API clients it is given.

Like the cncf provider's `CustomObjectLauncher`: it holds no connection logic (the operator hands it
`KubernetesHook.custom_object_client` and `core_v1_client`), retries nothing but a 409 on create
(reattach when the existing job belongs to the same try), and ignores 404 on delete.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from operators import errors
from operators.mpijob_spec import (
    API_GROUP,
    API_VERSION,
    JOB_NAME_LABEL,
    KUEUE_QUEUE_LABEL,
    LAUNCHER_CONTAINER,
    PLURAL,
)
from operators.mpijob_status import Verdict, container_started, evaluate, launcher_pods

if TYPE_CHECKING:
    from kubernetes.client import CoreV1Api, CustomObjectsApi

log = logging.getLogger(__name__)

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"

ERROR_CLASSES: dict[str, type[errors.MPIJobFailed]] = {
    cls.__name__: cls
    for cls in (
        errors.MPIJobFailed,
        errors.MPIJobWorkerOOMKilled,
        errors.MPIJobImagePullFailed,
        errors.MPIJobUnschedulable,
        errors.MPIJobStartupTimeout,
        errors.MPIJobQueueTimeout,
        errors.MPIJobDeleted,
    )
}
# Failures where the job never ran: its pods would sit pending and hold quota, so they are always deleted.
def error_for(kind: str | None, message: str) -> errors.MPIJobFailed:
    """The exception for an error kind named by `mpijob_status` (or a trigger event)."""
    return ERROR_CLASSES.get(kind or "", errors.MPIJobFailed)(message)


def to_plain(obj: Any) -> Any:
    """A Kubernetes model object (sync or asyncio client) as the API's camelCase dict; dicts pass through."""
    if obj is None or isinstance(obj, dict | list | str | int | float | bool):
        return obj
    from kubernetes.client import ApiClient

    return ApiClient().sanitize_for_serialization(obj)


def _status(err: BaseException) -> int | None:
    status = getattr(err, "status", None)
    try:
        return int(status) if status is not None else None
    except (TypeError, ValueError):
        return None


def iter_log_lines(response: Any) -> Iterator[str]:
    """Lines of a streamed pod log (`_preload_content=False` response), decoded, as they arrive."""
    pending = b""
    try:
        for chunk in response.stream(amt=None, decode_content=True):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.decode("utf-8", errors="replace").rstrip("\r")
        if pending:
            yield pending.decode("utf-8", errors="replace").rstrip("\r")
    finally:
        release = getattr(response, "release_conn", None)
        if release is not None:
            release()


class MPIJobLauncher:
    """Creates an MPIJob, waits for it, streams its launcher log, explains its failure, deletes it."""

    def __init__(
        self,
        custom_api: CustomObjectsApi,
        core_api: CoreV1Api,
        namespace: str,
        *,
        poll_interval: float = 10.0,
        startup_timeout: float = 600.0,
        queue_timeout: float | None = None,
        logger: logging.Logger | Any = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.custom_api = custom_api
        self.core_api = core_api
        self.namespace = namespace
        self.poll_interval = poll_interval
        self.startup_timeout = startup_timeout
        self.queue_timeout = queue_timeout
        self._workload_warning_given = False
        self.log = logger or log
        self._clock = clock
        self._sleep = sleep
        self._streamed: set[str] = set()

    # -- API calls ---------------------------------------------------------------------------------

    def submit(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Create the job; on 409 reattach to the existing one if it is this same try's, else fail."""
        from kubernetes.client.exceptions import ApiException

        name = body["metadata"]["name"]
        try:
            created = self.custom_api.create_namespaced_custom_object(
                group=API_GROUP, version=API_VERSION, namespace=self.namespace, plural=PLURAL, body=body
            )
            self.log.info("Created MPIJob %s/%s", self.namespace, name)
            return dict(created)
        except ApiException as err:
            if _status(err) != 409:
                raise
        existing = self.get(name)
        if existing is None:  # deleted between our create and get: try once more
            return dict(
                self.custom_api.create_namespaced_custom_object(
                    group=API_GROUP, version=API_VERSION, namespace=self.namespace, plural=PLURAL, body=body
                )
            )
        mine = body["metadata"].get("labels", {})
        theirs = (existing.get("metadata") or {}).get("labels") or {}
        keys = ("dag_id", "task_id", "run_id", "try_number")
        if any(mine.get(k) != theirs.get(k) for k in keys):
            raise errors.MPIJobConflict(
                f"MPIJob {self.namespace}/{name} already exists and belongs to another task try "
                f"({ {k: theirs.get(k) for k in keys} }); delete it or rename the task"
            )
        self.log.info("MPIJob %s/%s already exists for this try: reattaching", self.namespace, name)
        return existing

    def get(self, name: str) -> dict[str, Any] | None:
        """The job as a dict, or None when the API answers 404."""
        from kubernetes.client.exceptions import ApiException

        try:
            return dict(
                self.custom_api.get_namespaced_custom_object(
                    group=API_GROUP, version=API_VERSION, namespace=self.namespace, plural=PLURAL, name=name
                )
            )
        except ApiException as err:
            if _status(err) == 404:
                return None
            raise

    def pods(self, name: str) -> list[dict[str, Any]]:
        """The pods the MPI Operator created for the job, as dicts."""
        listing = self.core_api.list_namespaced_pod(namespace=self.namespace, label_selector=f"{JOB_NAME_LABEL}={name}")
        return [to_plain(p) for p in listing.items or []]

    def delete(self, name: str) -> None:
        """Delete the job and, in the foreground, its pods; a job already gone is fine."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.custom_api.delete_namespaced_custom_object(
                group=API_GROUP,
                version=API_VERSION,
                namespace=self.namespace,
                plural=PLURAL,
                name=name,
                body={"propagationPolicy": "Foreground"},
            )
            self.log.info("Deleted MPIJob %s/%s", self.namespace, name)
        except ApiException as err:
            if _status(err) != 404:
                raise
            self.log.info("MPIJob %s/%s was already gone", self.namespace, name)

    # -- following a job ---------------------------------------------------------------------------

    def workload(self, job: Mapping[str, Any]) -> dict[str, Any] | None:
        """The Kueue Workload of a queued job (found by the job-uid label Kueue puts on it), or None."""
        from kubernetes.client.exceptions import ApiException

        uid = (job.get("metadata") or {}).get("uid")
        if not uid:
            return None
        try:
            listing = self.custom_api.list_namespaced_custom_object(
                group=KUEUE_GROUP, version=KUEUE_VERSION, namespace=self.namespace, plural="workloads",
                label_selector=f"{KUEUE_JOB_UID_LABEL}={uid}")
        except ApiException as err:
            if _status(err) not in {403, 404}:
                raise
            if not self._workload_warning_given:
                self.log.warning("Cannot read Kueue Workloads in %s (%s): the wait is not explained; grant "
                                 "get/list on workloads.kueue.x-k8s.io (deploy/rbac.yaml)", self.namespace, err.reason)
                self._workload_warning_given = True
            return None
        items = (listing or {}).get("items") or []
        return dict(items[0]) if items else None

    def check(self, name: str, elapsed: float) -> tuple[Verdict, list[dict[str, Any]]]:
        """One look at the job and its pods (and, while Kueue holds it, its Workload)."""
        job = self.get(name)
        pods = self.pods(name) if job is not None else []
        workload = None
        if job is not None and KUEUE_QUEUE_LABEL in ((job.get("metadata") or {}).get("labels") or {}):
            workload = self.workload(job)
        verdict = evaluate(name, job, pods, elapsed=elapsed, startup_timeout=self.startup_timeout,
                           workload=workload, queue_timeout=self.queue_timeout)
        return verdict, pods

    def stream_launcher_log(self, pod_name: str, *, follow: bool) -> None:
        """Copy the launcher container's log into the task log, line by line (blocks until it ends)."""
        from kubernetes.client.exceptions import ApiException

        self._streamed.add(pod_name)
        self.log.info("---- log of launcher pod %s ----", pod_name)
        try:
            response = self.core_api.read_namespaced_pod_log(
                name=pod_name,
                namespace=self.namespace,
                container=LAUNCHER_CONTAINER,
                follow=follow,
                _preload_content=False,
            )
            for line in iter_log_lines(response):
                self.log.info("[launcher] %s", line)
        except ApiException as err:
            self.log.warning("Could not read the log of launcher pod %s: %s", pod_name, err.reason)
        self.log.info("---- end of log of launcher pod %s ----", pod_name)

    def stream_unread_logs(self, pods: list[dict[str, Any]]) -> None:
        """Read (without following) the log of every started launcher pod not streamed yet."""
        for pod in launcher_pods(pods):
            pod_name = pod["metadata"]["name"]
            if pod_name not in self._streamed and container_started(pod):
                self.stream_launcher_log(pod_name, follow=False)

    def wait(self, name: str, *, submitted_at: float | None = None) -> Verdict:
        """Follow the job until it ends: stream each launcher pod's log as it starts, poll between.

        Returns the final verdict on success; raises the matching `MPIJobFailed` subclass otherwise.
        """
        start = self._clock() if submitted_at is None else submitted_at
        last_phase, last_reason = None, None
        while True:
            verdict, pods = self.check(name, self._clock() - start)
            if verdict.phase != last_phase:
                self.log.info("MPIJob %s/%s is %s", self.namespace, name, verdict.phase)
                last_phase = verdict.phase
            if verdict.phase == "Queued" and not verdict.done and verdict.message != last_reason:
                self.log.info("%s", verdict.message)  # one line: why Kueue holds the job now
            last_reason = verdict.message
            if verdict.done:
                self.stream_unread_logs(pods)
                return self.finish(verdict)
            streaming = next(
                (
                    p
                    for p in launcher_pods(pods)
                    if p["metadata"]["name"] not in self._streamed and container_started(p)
                ),
                None,
            )
            if streaming is not None:
                # Follows until the launcher container exits; then look at the job again at once.
                self.stream_launcher_log(streaming["metadata"]["name"], follow=True)
                continue
            self._sleep(self.poll_interval)

    def finish(self, verdict: Verdict) -> Verdict:
        """Return a successful verdict; raise the exception a failed one stands for."""
        if verdict.succeeded:
            self.log.info("%s", verdict.message)
            return verdict
        raise error_for(verdict.error_kind, verdict.message)

    def run(self, body: Mapping[str, Any]) -> Verdict:
        """Submit `body` and follow it to the end (the synchronous path)."""
        submitted_at = self._clock()
        self.submit(body)
        return self.wait(body["metadata"]["name"], submitted_at=submitted_at)
