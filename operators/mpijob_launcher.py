"""Submit, follow and delete one MPIJob through the Kubernetes API clients it is given.

Like the cncf provider's `CustomObjectLauncher`: it holds no connection logic (the operator hands it
`KubernetesHook.custom_object_client` and `core_v1_client`), reattaches on a 409 on create when the
existing job belongs to the same try, and ignores 404 on delete. What the API server (or the network
before it) may answer for a while — 429, 5xx, a connection refused, cut or timed out — is retried with
backoff (at least the server's Retry-After) for `api_retry_seconds` before it fails the step with
`KubernetesApiUnavailable`; any other refusal fails it at once with `KubernetesApiError`. Every request has a
(connect, read) timeout. The launcher's log is a courtesy: a log stream that keeps breaking stops being
copied, with a warning, and never fails the task; one that goes silent is reopened after a look at the job.
`interrupted()` (the operator's on_kill ran) stops the cleanup of earlier tries and the wait.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from operators import errors
from operators.mpijob_spec import (
    API_GROUP,
    API_VERSION,
    INSTANCE_LABEL,
    JOB_NAME_LABEL,
    KUEUE_QUEUE_LABEL,
    LAUNCHER_CONTAINER,
    PLURAL,
    earlier_tries_selector,
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
        errors.MPIJobDeactivated,
    )
}
# Answers that mean "not now": the API server overloaded or restarting, a gateway before it timing out.
TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
MAX_BACKOFF = 30.0
# Every request gives up connecting after CONNECT_TIMEOUT and reading after READ_TIMEOUT seconds of silence:
# a connection gone half-open (an API server replica lost behind a load balancer) never blocks the task.
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 60.0
MIN_LOG_READ_TIMEOUT = 1.0

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


def is_transient(err: BaseException) -> bool:
    """A failure that retrying later may fix: 429/5xx answers, connections refused, reset, cut or timed out.

    Works for both the sync client (urllib3) and kubernetes_asyncio (aiohttp) exceptions.
    """
    if type(err).__name__ == "ApiException":
        status = _status(err)
        return not status or status in TRANSIENT_STATUSES  # status 0: no HTTP answer at all
    if isinstance(err, ConnectionError | TimeoutError):
        return True
    import socket

    if isinstance(err, socket.gaierror):  # the API server's name does not resolve (DNS blip)
        return True
    module = type(err).__module__.split(".")[0]
    if module == "urllib3":  # ProtocolError, MaxRetryError, ReadTimeoutError, NewConnectionError...
        return True
    if module == "aiohttp":
        import aiohttp

        return isinstance(err, aiohttp.ClientError) and not isinstance(err, aiohttp.ClientResponseError)
    return False


def describe(err: BaseException) -> str:
    """An API failure in a few words: "503 Service Unavailable: <the server's message>", or the exception."""
    if type(err).__name__ == "ApiException":
        import json

        detail = ""
        try:
            detail = json.loads(getattr(err, "body", None) or "{}").get("message") or ""
        except (ValueError, AttributeError):
            detail = ""
        head = f"{getattr(err, 'status', '?')} {getattr(err, 'reason', '') or ''}".strip()
        return f"{head}: {detail}" if detail else head
    return f"{type(err).__name__}: {err}"


def retry_after(err: BaseException) -> float | None:
    """The seconds a 429/503 answer's Retry-After header asks for, if any (a finite number; an HTTP date,
    "nan" or "inf" is ignored)."""
    headers = getattr(err, "headers", None) or {}
    try:
        value = headers.get("Retry-After") or headers.get("retry-after")
        seconds = float(value) if value is not None else None
    except (TypeError, ValueError, AttributeError):
        return None
    return seconds if seconds is not None and math.isfinite(seconds) else None


def backoff_delay(err: BaseException, attempt: int, first: float, remaining: float) -> float:
    """How long to wait before retry `attempt` (0-based): `first` doubling up to 30 s, or longer when the
    server's Retry-After asks for more (a Retry-After of 0 or less never makes the retries spin); never past
    the end of the retry window."""
    delay = min(MAX_BACKOFF, first * 2**attempt)
    asked = retry_after(err)
    if asked is not None:
        delay = max(delay, asked)
    return max(0.0, min(delay, remaining))


def _is_read_timeout(err: BaseException) -> bool:
    """A read that got no byte within its read timeout (urllib3 ReadTimeoutError, or the socket's own)."""
    from urllib3.exceptions import ReadTimeoutError

    return isinstance(err, ReadTimeoutError | TimeoutError)


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
        api_retry_seconds: float = 300.0,
        api_retry_backoff: float = 1.0,
        log_read_timeout: float | None = None,
        logger: logging.Logger | Any = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        interrupted: Callable[[], bool] = lambda: False,
    ) -> None:
        self.custom_api = custom_api
        self.core_api = core_api
        self.namespace = namespace
        self.poll_interval = poll_interval
        self.startup_timeout = startup_timeout
        self.queue_timeout = queue_timeout
        self.api_retry_seconds = api_retry_seconds
        self.api_retry_backoff = api_retry_backoff
        self._workload_warning_given = False
        self.log = logger or log
        self._clock = clock
        self._sleep = sleep
        # A followed log stream silent this long is closed and the job looked at (None: poll_interval, >= 1 s).
        self.log_read_timeout = (max(MIN_LOG_READ_TIMEOUT, poll_interval) if log_read_timeout is None
                                 else log_read_timeout)
        self.interrupted = interrupted
        self._streamed: set[str] = set()  # launcher pods whose log is done with
        self._copied: dict[str, int] = {}  # lines of each launcher pod's log copied so far

    # -- API calls ---------------------------------------------------------------------------------

    def call(self, what: str, method: Callable[..., Any], *, expected: frozenset[int] = frozenset(),
             **kwargs: Any) -> Any:
        """`method(**kwargs)`, retrying transient failures for `api_retry_seconds`.

        An ApiException whose status is in `expected` is raised as it is (the caller handles it); any other
        refusal becomes a KubernetesApiError naming `what` and the server's answer.
        """
        kwargs.setdefault("_request_timeout", (CONNECT_TIMEOUT, READ_TIMEOUT))
        failing_since: float | None = None
        attempt = 0
        while True:
            try:
                return method(**kwargs)
            except Exception as err:
                if not is_transient(err):
                    if type(err).__name__ == "ApiException":
                        if _status(err) in expected:
                            raise
                        raise errors.KubernetesApiError(
                            f"{what}: the Kubernetes API answered {describe(err)}; check the connection's "
                            f"permissions (deploy/rbac.yaml) and the object, then clear the task"
                        ) from err
                    raise
                now = self._clock()
                failing_since = now if failing_since is None else failing_since
                waited = now - failing_since
                if waited >= self.api_retry_seconds:
                    raise errors.KubernetesApiUnavailable(
                        f"{what}: the Kubernetes API kept failing for {self.api_retry_seconds:g}s (last: "
                        f"{describe(err)}); the job was left as it is (the next try deletes it before submitting)"
                    ) from err
                delay = backoff_delay(err, attempt, self.api_retry_backoff, self.api_retry_seconds - waited)
                self.log.warning("%s failed (%s): retrying in %.1fs (for up to %gs)", what, describe(err), delay,
                                 self.api_retry_seconds)
                self._sleep(delay)
                attempt += 1

    def _custom(self, what: str, verb: str, *, expected: frozenset[int] = frozenset(), **kwargs: Any) -> Any:
        method = getattr(self.custom_api, f"{verb}_namespaced_custom_object")
        return self.call(what, method, expected=expected, group=API_GROUP, version=API_VERSION,
                         namespace=self.namespace, plural=PLURAL, **kwargs)

    def submit(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Create the job; on 409 reattach to the existing one if it is this same try's, else fail."""
        from kubernetes.client.exceptions import ApiException

        name = body["metadata"]["name"]
        what = f"creating MPIJob {self.namespace}/{name}"
        try:
            created = self._custom(what, "create", expected=frozenset({409}), body=body)
            self.log.info("Created MPIJob %s/%s", self.namespace, name)
            return dict(created)
        except ApiException as err:
            if _status(err) != 409:
                raise
        existing = self.get(name)
        if existing is None:  # deleted between our create and get: try once more
            return dict(self._custom(what, "create", body=body))
        mine = body["metadata"].get("labels", {})
        theirs = (existing.get("metadata") or {}).get("labels") or {}
        keys = ("dag_id", "task_id", "run_id", "try_number", INSTANCE_LABEL)
        if any(mine.get(k) != theirs.get(k) for k in keys):
            raise errors.MPIJobConflict(
                f"MPIJob {self.namespace}/{name} already exists and belongs to another task try or Airflow "
                f"deployment ({ {k: theirs.get(k) for k in keys} }); delete it or rename the task"
            )
        self.log.info("MPIJob %s/%s already exists for this try: reattaching", self.namespace, name)
        return existing

    def get(self, name: str) -> dict[str, Any] | None:
        """The job as a dict, or None when the API answers 404."""
        from kubernetes.client.exceptions import ApiException

        try:
            return dict(self._custom(f"reading MPIJob {self.namespace}/{name}", "get", expected=frozenset({404}),
                                     name=name))
        except ApiException:  # 404: the only status `expected` lets through
            return None

    def pods(self, name: str) -> list[dict[str, Any]]:
        """The pods the MPI Operator created for the job, as dicts."""
        return self.pods_selected(f"{JOB_NAME_LABEL}={name}", f"listing the pods of MPIJob {self.namespace}/{name}")

    def pods_selected(self, selector: str, what: str) -> list[dict[str, Any]]:
        listing = self.call(what, self.core_api.list_namespaced_pod, namespace=self.namespace,
                            label_selector=selector)
        return [to_plain(p) for p in listing.items or []]

    def delete(self, name: str) -> None:
        """Delete the job and, in the foreground, its pods; a job already gone is fine."""
        from kubernetes.client.exceptions import ApiException

        try:
            self._custom(f"deleting MPIJob {self.namespace}/{name}", "delete", expected=frozenset({404}), name=name,
                         body={"propagationPolicy": "Foreground"})
            self.log.info("Deleted MPIJob %s/%s", self.namespace, name)
        except ApiException:  # 404
            self.log.info("MPIJob %s/%s was already gone", self.namespace, name)

    def delete_earlier_tries(self, body: Mapping[str, Any], *, timeout: float) -> list[str]:
        """Delete every other MPIJob of this task instance (same dag, run, task and map index: its earlier
        tries), and wait until they and their pods are gone, for at most `timeout` seconds.

        An earlier try's job shares this try's checkpoint directory and MLflow run key: left running (or
        queued, holding quota) it would write beside the new one. Returns the names deleted; raises
        MPIJobCleanupFailed naming what is still there after `timeout`.
        """
        labels = (body.get("metadata") or {}).get("labels") or {}
        name = body["metadata"]["name"]
        selector = earlier_tries_selector(labels)
        listing = self._custom(f"listing the earlier tries' MPIJobs of {labels.get('task_id')}", "list",
                               label_selector=selector)
        earlier = sorted(j["metadata"]["name"] for j in (listing or {}).get("items") or []
                         if j["metadata"]["name"] != name)
        if not earlier:
            return []
        self.log.info("Deleting the MPIJob(s) of earlier tries of this task before submitting %s: %s", name,
                      ", ".join(earlier))
        what = f"deleting the earlier tries of task {labels.get('task_id')} before submitting {name}"
        for old in earlier:
            self.check_interrupted(what)
            self.delete(old)
        deadline = self._clock() + timeout
        while True:
            self.check_interrupted(what)
            jobs_left, pods_left = self._left_of(earlier, selector, name)
            if not jobs_left and not pods_left:
                self.log.info("The earlier tries' MPIJob(s) and their pods are gone")
                return earlier
            if self._clock() >= deadline:
                raise errors.MPIJobCleanupFailed(
                    f"earlier tries of task {labels.get('task_id')} (run {labels.get('run_id')}): MPIJob(s) "
                    f"{', '.join(jobs_left) or 'none'} and pod(s) {', '.join(pods_left) or 'none'} in namespace "
                    f"{self.namespace} still there after {timeout:g}s; {name} was not submitted (they would share "
                    f"its checkpoints): check `kubectl get pods -n {self.namespace}` (a pod stuck Terminating on a "
                    f"lost node needs `kubectl delete pod --force`), then clear the task"
                )
            self._sleep(self.poll_interval)

    def _left_of(self, earlier: list[str], selector: str, mine: str) -> tuple[list[str], list[str]]:
        """The earlier jobs still listed, and their pods (by job name, and by the task's labels)."""
        listing = self._custom("listing the earlier tries' MPIJobs", "list", label_selector=selector)
        jobs_left = sorted(j["metadata"]["name"] for j in (listing or {}).get("items") or []
                           if j["metadata"]["name"] in earlier)
        pods = {p["metadata"]["name"]: p for p in self.pods_selected(selector, "listing the earlier tries' pods")
                if ((p.get("metadata") or {}).get("labels") or {}).get(JOB_NAME_LABEL) != mine}
        for old in earlier:
            pods.update({p["metadata"]["name"]: p for p in self.pods(old)})
        return jobs_left, sorted(pods)

    # -- following a job ---------------------------------------------------------------------------

    def workload(self, job: Mapping[str, Any]) -> dict[str, Any] | None:
        """The Kueue Workload of a queued job (found by the job-uid label Kueue puts on it), or None."""
        from kubernetes.client.exceptions import ApiException

        uid = (job.get("metadata") or {}).get("uid")
        if not uid:
            return None
        try:
            listing = self.call(
                f"reading the Kueue Workload of MPIJob {self.namespace}/{job['metadata'].get('name')}",
                self.custom_api.list_namespaced_custom_object, expected=frozenset({403, 404}),
                group=KUEUE_GROUP, version=KUEUE_VERSION, namespace=self.namespace, plural="workloads",
                label_selector=f"{KUEUE_JOB_UID_LABEL}={uid}")
        except ApiException as err:
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

    def stream_launcher_log(self, pod_name: str, *, follow: bool) -> bool:
        """Copy the launcher container's log into the task log, line by line (blocks until it ends).

        The log is a courtesy; the job's status decides the outcome. A stream cut mid-way (a node lost, a
        connection reset) is opened again, skipping the lines already copied, for as long as
        `api_retry_seconds` passes without a new line; then the copy of this pod's log stops with a warning.
        A pod gone or a container not started (404, 400) ends the copy with a warning too. A followed stream
        silent for `log_read_timeout` (a quiet launcher, or a connection gone half-open) returns False: the
        caller looks at the job, then calls again to go on where it stopped.

        Returns True when this pod's log is done with (ended, or given up).
        """
        if pod_name not in self._copied:
            self._copied[pod_name] = 0
            self.log.info("---- log of launcher pod %s ----", pod_name)
        attempt = 0
        failing_since: float | None = None
        while True:
            before = self._copied[pod_name]
            try:
                response = self.core_api.read_namespaced_pod_log(
                    name=pod_name,
                    namespace=self.namespace,
                    container=LAUNCHER_CONTAINER,
                    follow=follow,
                    _preload_content=False,
                    _request_timeout=(CONNECT_TIMEOUT, self.log_read_timeout),
                )
                for index, line in enumerate(iter_log_lines(response)):
                    if index >= self._copied[pod_name]:
                        self.log.info("[launcher] %s", line)
                        self._copied[pod_name] += 1
                break
            except Exception as err:
                if follow and _is_read_timeout(err):
                    return False  # silence is no failure: the caller checks the job, then reconnects
                if not is_transient(err):
                    if type(err).__name__ != "ApiException":
                        raise
                    self.log.warning("Could not read the log of launcher pod %s: %s", pod_name, describe(err))
                    break
                now = self._clock()
                if self._copied[pod_name] > before:  # the stream worked for a while: a new outage starts now
                    failing_since, attempt = None, 0
                failing_since = now if failing_since is None else failing_since
                waited = now - failing_since
                if waited >= self.api_retry_seconds:
                    self.log.warning(
                        "Stopped copying the log of launcher pod %s/%s: it kept failing for %gs (last: %s); the "
                        "job is still followed by its status", self.namespace, pod_name, self.api_retry_seconds,
                        describe(err))
                    break
                delay = backoff_delay(err, attempt, self.api_retry_backoff, self.api_retry_seconds - waited)
                self.log.warning("The log stream of launcher pod %s broke after %d line(s) (%s): reconnecting in "
                                 "%.1fs", pod_name, self._copied[pod_name], describe(err), delay)
                self._sleep(delay)
                attempt += 1
        self._streamed.add(pod_name)
        self.log.info("---- end of log of launcher pod %s ----", pod_name)
        return True

    def stream_unread_logs(self, pods: list[dict[str, Any]]) -> None:
        """Read (without following) the rest of the log of every started launcher pod not done with yet."""
        for pod in launcher_pods(pods):
            pod_name = pod["metadata"]["name"]
            if pod_name not in self._streamed and container_started(pod):
                self.stream_launcher_log(pod_name, follow=False)

    def wait(self, name: str, *, submitted_at: float | None = None) -> Verdict:
        """Follow the job until it ends: stream each launcher pod's log as it starts, poll between.

        Returns the final verdict on success; raises the matching `MPIJobFailed` subclass otherwise, or
        `TaskInterrupted` once `interrupted()` (the task was killed) is true.
        """
        start = self._clock() if submitted_at is None else submitted_at
        last_phase, last_reason = None, None
        while True:
            self.check_interrupted(f"following MPIJob {self.namespace}/{name}")
            verdict, pods = self.check(name, self._clock() - start)
            if verdict.phase != last_phase:
                self.log.info("MPIJob %s/%s is %s", self.namespace, name, verdict.phase)
                last_phase = verdict.phase
            if not verdict.done and verdict.message and verdict.message != last_reason:
                # one line: why Kueue holds the job now, or an elastic worker's restarts (an event, counted)
                self.log.info("%s", verdict.message)
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
                # Follows until the launcher container exits, or the stream goes silent for
                # log_read_timeout; either way look at the job again at once (and go on reading after).
                self.stream_launcher_log(streaming["metadata"]["name"], follow=True)
                continue
            self._sleep(self.poll_interval)

    def check_interrupted(self, what: str) -> None:
        """Raise TaskInterrupted when the task was killed (its on_kill ran) while this launcher worked."""
        if self.interrupted():
            raise errors.TaskInterrupted(f"{what}: the task was killed (on_kill); stopped here")

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
