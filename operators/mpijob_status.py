"""Pure reading of an MPIJob's status and its pods: is it done, did it succeed, and if not, why.

Shared by the synchronous launcher and the async trigger so both explain a failure the same way.
Inputs are plain dicts in the API's camelCase form (what `ApiClient.sanitize_for_serialization` gives).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from operators.mpijob_spec import JOB_ROLE_LABEL

# MPIJob (v2beta1) condition types, from the MPI Operator's JobCondition.
CREATED = "Created"
RUNNING = "Running"
RESTARTING = "Restarting"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
SUSPENDED = "Suspended"

# Waiting reasons of an image that is not pulled: the first two are retried by the kubelet with a back-off (up to
# 5 minutes between tries), the last two never change without a person.
IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
PERMANENT_PULL_REASONS = frozenset({"InvalidImageName", "ErrImageNeverPull"})
# How long a pod of a job that never ran may wait on the kubelet's pull back-off (counted from when the pod was
# scheduled) before the job fails: past the back-off's 300 s cap, at least one more try failed. Kueue's
# waitForPodsReady.timeout must be longer, or Kueue requeues the job first.
IMAGE_PULL_GRACE_S = 330.0
# Once the job ran, its image existed: a worker recreated on another node that pulls again is waited for. Only a
# launcher (or, in a fixed-size job, any pod) that cannot pull for this long fails the job; an elastic job's worker
# never does (the job goes on without it, and the running message names it).
IMAGE_PULL_AFTER_RUN_S = 900.0
# An elastic job's worker container that restarted in place (restartPolicy OnFailure: an OOM kill, a crash) is an
# event, not a failure: Horovod blacklists its host for the cool-down and takes it back. More restarts than this of
# one worker container is a crash loop: the job fails, naming the last reason.
ELASTIC_RESTART_LIMIT = 5

# Error kinds: the class names in operators.errors, so an event from the trigger maps back to an exception.
FAILED_KIND = "MPIJobFailed"
OOM_KIND = "MPIJobWorkerOOMKilled"
IMAGE_PULL_KIND = "MPIJobImagePullFailed"
UNSCHEDULABLE_KIND = "MPIJobUnschedulable"
STARTUP_TIMEOUT_KIND = "MPIJobStartupTimeout"
DELETED_KIND = "MPIJobDeleted"
QUEUE_TIMEOUT_KIND = "MPIJobQueueTimeout"
DEACTIVATED_KIND = "MPIJobDeactivated"
QUEUED = "Queued"

# Kueue Workload (v1beta2) condition types.
WL_QUOTA_RESERVED = "QuotaReserved"
WL_ADMITTED = "Admitted"
WL_EVICTED = "Evicted"
WL_PREEMPTED = "Preempted"
WL_REQUEUED = "Requeued"
# Kueue's Evicted reason when spec.active turns false (WorkloadEvictedByDeactivation); newer releases spell
# the cause after it (e.g. "DeactivatedDueToRequeuingLimitExceeded"), hence the prefixes.
DEACTIVATION_REASONS = ("InactiveWorkload", "Deactivated")


@dataclass(frozen=True)
class Verdict:
    """What the caller should do after one look at the job: keep waiting, stop with success, or fail."""

    phase: str
    done: bool = False
    succeeded: bool = False
    error_kind: str | None = None
    message: str = ""

    @property
    def failed(self) -> bool:
        return self.error_kind is not None


def conditions(mpijob: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The job's conditions whose status is "True", by type."""
    found = (mpijob.get("status") or {}).get("conditions") or []
    return {c["type"]: c for c in found if c.get("status") == "True" and "type" in c}


def phase(mpijob: Mapping[str, Any]) -> str:
    """The most telling true condition: Succeeded/Failed win, then Restarting, Running, Suspended, Created."""
    true = conditions(mpijob)
    for kind in (SUCCEEDED, FAILED, RESTARTING, RUNNING, SUSPENDED, CREATED):
        if kind in true:
            return kind
    return "Pending"


def _role(pod: Mapping[str, Any]) -> str:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(JOB_ROLE_LABEL, "")


def _pod_name(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("name", "?"))


def _container_statuses(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    status = pod.get("status") or {}
    return [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]


def launcher_pods(pods: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The job's launcher pods, oldest first (a restarted launcher Job makes a new pod)."""
    found = [p for p in pods if _role(p) == "launcher"]
    return sorted(found, key=lambda p: str((p.get("metadata") or {}).get("creationTimestamp") or ""))


def container_started(pod: Mapping[str, Any]) -> bool:
    """The pod's containers are running or have run, so it has a log to read."""
    if (pod.get("status") or {}).get("phase") in {"Running", "Succeeded", "Failed"}:
        return True
    return any(
        (cs.get("state") or {}).get("running") or (cs.get("state") or {}).get("terminated")
        for cs in _container_statuses(pod)
    )


def oom_killed(pods: Iterable[Mapping[str, Any]], *, current_only: bool = False) -> str | None:
    """A message naming the first container killed for exceeding its memory limit, if any (`current_only`: in
    its current state, not a past one it recovered from: an elastic worker that restarted in place)."""
    for pod in pods:
        for cs in _container_statuses(pod):
            for key in ("state",) if current_only else ("state", "lastState"):
                terminated = (cs.get(key) or {}).get("terminated") or {}
                if terminated.get("reason") == "OOMKilled":
                    role = _role(pod) or "pod"
                    return (
                        f"{role} pod {_pod_name(pod)} container {cs.get('name', '?')} was OOMKilled "
                        f"(exit code {terminated.get('exitCode', '?')}): "
                        "raise memory_limit or lower the batch size"
                    )
    return None


def pulling_since(pod: Mapping[str, Any], now: float) -> float:
    """When the pod was scheduled (its PodScheduled condition), else created: where its pulls began."""
    scheduled = _condition(pod, "PodScheduled")
    when = _time(scheduled.get("lastTransitionTime")) if scheduled and scheduled.get("status") == "True" else None
    return when or _time((pod.get("metadata") or {}).get("creationTimestamp")) or now


def image_pull_failure(pods: Iterable[Mapping[str, Any]], reasons: frozenset[str] = IMAGE_PULL_REASONS, *,
                       now: float | None = None, longer_than: float = 0.0, elapsed: float | None = None) -> str | None:
    """A message naming a container whose image cannot be pulled (waiting for one of `reasons`), if any; with
    `now`, only in a pod pulling for at least `longer_than` seconds: since it was scheduled (`pulling_since`), and
    no longer than the job's own `elapsed` time (since its submit, or Kueue's last resume)."""
    for pod in pods:
        if now is not None:
            age = now - pulling_since(pod, now)
            if (min(age, elapsed) if elapsed is not None else age) < longer_than:
                continue
        for cs in _container_statuses(pod):
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in reasons:
                detail = waiting.get("message") or ""
                return (
                    f"pod {_pod_name(pod)} cannot pull image {cs.get('image', '?')!s}: "
                    f"{waiting['reason']}{': ' + detail if detail else ''}"
                )
    return None


def is_elastic(mpijob: Mapping[str, Any]) -> bool:
    """The job runs horovodrun's elastic driver (its launcher names a host discovery script) and its workers
    restart in place (restartPolicy OnFailure), as operators.mpijob_spec renders an elastic job."""
    specs = (mpijob.get("spec") or {}).get("mpiReplicaSpecs") or {}
    worker, launcher = specs.get("Worker") or {}, specs.get("Launcher") or {}
    containers = ((launcher.get("template") or {}).get("spec") or {}).get("containers") or []
    argv = [str(a) for c in containers for a in (*(c.get("command") or []), *(c.get("args") or []))]
    return worker.get("restartPolicy") == "OnFailure" and any("--host-discovery-script" in a for a in argv)


def worker_restarts(pods: Iterable[Mapping[str, Any]]) -> list[tuple[str, int, str, bool]]:
    """(pod, restart count, last termination reason, in the kubelet's crash-loop back-off now) of each worker
    container that restarted in place."""
    found = []
    for pod in pods:
        if _role(pod) != "worker":
            continue
        for cs in _container_statuses(pod):
            count = int(cs.get("restartCount") or 0)
            if count:
                last = ((cs.get("lastState") or {}).get("terminated") or {})
                reason = str(last.get("reason") or "Error")
                if last.get("exitCode") is not None:
                    reason += f", exit code {last['exitCode']}"
                waiting = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
                found.append((_pod_name(pod), count, reason, waiting == "CrashLoopBackOff"))
    return found


def has_run(mpijob: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> bool:
    """The job runs, or its launcher started: the MPI Operator's Running condition is True (a suspended job has
    Running False, MPIJobSuspended, before any pod exists), or a launcher container started."""
    running = _condition(mpijob, RUNNING)
    return (running is not None and running.get("status") == "True") or any(
        container_started(p) for p in launcher_pods(pods))


def unschedulable(pods: Iterable[Mapping[str, Any]]) -> str | None:
    """A message naming a pod the scheduler cannot place, with the scheduler's reason, if any."""
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if (
                cond.get("type") == "PodScheduled"
                and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"
            ):
                return f"pod {_pod_name(pod)} is unschedulable: {cond.get('message') or 'no reason given'}"
    return None


def launcher_termination(pods: Iterable[Mapping[str, Any]]) -> str | None:
    """The newest failed launcher's exit code and termination message (its last log lines on error)."""
    for pod in reversed(launcher_pods(pods)):
        for cs in _container_statuses(pod):
            terminated = (cs.get("state") or {}).get("terminated") or {}
            if terminated and terminated.get("exitCode", 0) != 0:
                message = (terminated.get("message") or "").strip()
                head = f"launcher pod {_pod_name(pod)} exited with code {terminated.get('exitCode')}"
                if terminated.get("reason"):
                    head += f" ({terminated['reason']})"
                return f"{head}: {message}" if message else head
    return None


def suspended(mpijob: Mapping[str, Any]) -> bool:
    """Kueue holds the job: `runPolicy.suspend` is true (created so, or set again on preemption)."""
    return ((mpijob.get("spec") or {}).get("runPolicy") or {}).get("suspend") is True


def _time(text: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _condition(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)


def queued_since(mpijob: Mapping[str, Any], now: float) -> float:
    """When the job last became suspended: the Suspended condition, else its creation."""
    cond = _condition(mpijob, SUSPENDED)
    if cond and cond.get("status") == "True" and (since := _time(cond.get("lastTransitionTime"))):
        return since
    return _time((mpijob.get("metadata") or {}).get("creationTimestamp")) or now


def resumed_at(mpijob: Mapping[str, Any]) -> float | None:
    """When Kueue last let the job run (its Suspended condition turned False), if it ever was suspended."""
    cond = _condition(mpijob, SUSPENDED)
    if cond and cond.get("status") == "False":
        return _time(cond.get("lastTransitionTime"))
    return None


def workload_reason(workload: Mapping[str, Any] | None) -> str:
    """Why Kueue holds the job, in one line, from its Workload's conditions."""
    if workload is None:
        return ("no Workload yet: Kueue has not picked the job up (is the LocalQueue name right, and Kueue's "
                "kubeflow.org/mpijob integration enabled?)")
    name = (workload.get("metadata") or {}).get("name", "?")
    queue = (workload.get("spec") or {}).get("queueName", "?")
    evicted = _condition(workload, WL_EVICTED)
    if (evicted and evicted.get("status") == "True" and (workload.get("spec") or {}).get("active") is True
            and str(evicted.get("reason") or "").startswith(DEACTIVATION_REASONS)):
        return (f"Workload {name} was reactivated and waits in LocalQueue {queue} for quota to be readmitted "
                f"(Kueue keeps its Evicted condition, {evicted.get('reason')}, until then)")
    if evicted and evicted.get("status") == "True":
        return (f"Workload {name} was evicted ({evicted.get('reason', '?')}: {evicted.get('message', '')}); "
                f"waiting in LocalQueue {queue} to be readmitted, then it resumes from its last checkpoint")
    admitted = _condition(workload, WL_ADMITTED)
    if admitted and admitted.get("status") == "True":
        return f"Workload {name} is admitted; waiting for the job to be unsuspended"
    reserved = _condition(workload, WL_QUOTA_RESERVED)
    if reserved and reserved.get("status") == "False" and reserved.get("message"):
        return f"Workload {name} in LocalQueue {queue} is pending: {reserved['message']}"
    return f"Workload {name} in LocalQueue {queue} is pending admission"


def deactivation(workload: Mapping[str, Any] | None) -> str | None:
    """Why Kueue will never admit the job again by itself (its Workload inactive), in one line, or None.

    `spec.active` decides, as Kueue's own `IsActive` does: false (set by a person, or by Kueue once
    `waitForPodsReady`'s requeuing backoffLimitCount is reached) keeps the Workload pending until someone
    sets it true again. Kueue keeps the Evicted condition (reason InactiveWorkload...) after that, until the
    Workload gets quota again, so a reactivated Workload waiting for quota is not inactive. The Evicted
    reason is read only when `spec.active` is absent (a Workload read without its spec's defaults).
    """
    if workload is None:
        return None
    evicted = _condition(workload, WL_EVICTED) or {}
    by_deactivation = (evicted.get("status") == "True"
                       and str(evicted.get("reason") or "").startswith(DEACTIVATION_REASONS))
    active = (workload.get("spec") or {}).get("active")
    if active is True or (active is None and not by_deactivation):
        return None
    meta = workload.get("metadata") or {}
    name, namespace = meta.get("name", "?"), meta.get("namespace") or "<namespace>"
    reason = evicted.get("reason") if by_deactivation else "InactiveWorkload"
    message = (evicted.get("message") if by_deactivation else "") or "spec.active is false"
    state = "false" if active is False else "unset"
    return (f"its Kueue Workload {name} is deactivated ({reason}: {message}): spec.active is {state}, so Kueue "
            f"admits it again only once someone sets it true; reactivate it (kubectl patch workload -n {namespace} "
            f"{name} --type merge -p '{{\"spec\":{{\"active\":true}}}}') or clear the task to submit a new job")


def explain_failure(name: str, mpijob: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """(error kind, message) for a job that reached Failed: the most specific cause first (for an elastic job, an
    OOM kill it recovered from is not the cause)."""
    if oom := oom_killed(pods, current_only=is_elastic(mpijob)):
        return OOM_KIND, f"MPIJob {name} failed: {oom}"
    if pull := image_pull_failure(pods):
        return IMAGE_PULL_KIND, f"MPIJob {name} failed: {pull}"
    if launcher := launcher_termination(pods):
        return FAILED_KIND, f"MPIJob {name} failed: {launcher}"
    cond = conditions(mpijob).get(FAILED) or {}
    reason = cond.get("reason") or "Failed"
    detail = cond.get("message") or "no message from the MPI Operator"
    return FAILED_KIND, f"MPIJob {name} failed ({reason}): {detail}"


def evaluate(
    name: str,
    mpijob: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
    *,
    elapsed: float,
    startup_timeout: float,
    now: float | None = None,
    workload: Mapping[str, Any] | None = None,
    queue_timeout: float | None = None,
) -> Verdict:
    """One look at the job (None when the API answered 404) and its pods, `elapsed` seconds after submit.

    A job Kueue holds (suspended) is "Queued": it waits, saying why from its Workload, for at most
    `queue_timeout` seconds since it was last suspended; startup_timeout counts only from when Kueue
    last let it run. `now` is the wall-clock time the API's timestamps are compared with.
    """
    if mpijob is None:
        return Verdict("Deleted", done=True, error_kind=DELETED_KIND, message=f"MPIJob {name} was deleted")
    current = phase(mpijob)
    if current == SUCCEEDED:
        return Verdict(current, done=True, succeeded=True, message=f"MPIJob {name} succeeded")
    if current == FAILED:
        kind, message = explain_failure(name, mpijob, pods)
        return Verdict(current, done=True, error_kind=kind, message=message)
    if inactive := deactivation(workload):
        return Verdict(QUEUED if suspended(mpijob) else current, done=True, error_kind=DEACTIVATED_KIND,
                       message=f"MPIJob {name} was stopped: {inactive}")
    now = time.time() if now is None else now
    if suspended(mpijob):
        waited = now - queued_since(mpijob, now)
        why = workload_reason(workload)
        if queue_timeout is not None and waited >= queue_timeout:
            return Verdict(QUEUED, done=True, error_kind=QUEUE_TIMEOUT_KIND,
                           message=f"MPIJob {name} was not admitted within {queue_timeout:.0f}s: {why}")
        return Verdict(QUEUED, message=f"MPIJob {name} is queued: {why}")
    if (resumed := resumed_at(mpijob)) is not None:
        elapsed = min(elapsed, max(0.0, now - resumed))
    restarts: list[tuple[str, int, str, bool]] = []
    elastic = is_elastic(mpijob)
    if elastic:
        # A worker restarted in place is an event (logged by the caller from the message), not a failure: the
        # job goes on with the hosts left and takes the worker back. Only a crash loop (more restarts than the
        # limit and the kubelet backing off its next start), or the job's own Failed condition (above), fails it.
        restarts = worker_restarts(pods)
        looping = [r for r in restarts if r[1] > ELASTIC_RESTART_LIMIT and r[3]]
        if looping:
            pod, count, last, _ = looping[0]
            kind = OOM_KIND if last.startswith("OOMKilled") else FAILED_KIND
            return Verdict(current, done=True, error_kind=kind,
                           message=f"MPIJob {name} failed: elastic worker pod {pod} restarted {count} times, more "
                                   f"than {ELASTIC_RESTART_LIMIT} (last: {last}); a crash loop, not a lost host"
                                   + ("; raise memory_limit or lower the batch size" if kind == OOM_KIND else ""))
    elif oom := oom_killed(pods):
        return Verdict(current, done=True, error_kind=OOM_KIND, message=f"MPIJob {name} failed: {oom}")
    if not has_run(mpijob, pods):
        if pull := image_pull_failure(pods, PERMANENT_PULL_REASONS):
            return Verdict(current, done=True, error_kind=IMAGE_PULL_KIND, message=f"MPIJob {name}: {pull}")
        if pull := image_pull_failure(pods, now=now, longer_than=IMAGE_PULL_GRACE_S, elapsed=elapsed):
            return Verdict(current, done=True, error_kind=IMAGE_PULL_KIND,
                           message=f"MPIJob {name}: {pull} (still after {IMAGE_PULL_GRACE_S:.0f}s of the kubelet's "
                                   f"back-off)")
    else:
        stuck = launcher_pods(pods) if elastic else pods
        if pull := image_pull_failure(stuck, now=now, longer_than=IMAGE_PULL_AFTER_RUN_S, elapsed=elapsed):
            return Verdict(current, done=True, error_kind=IMAGE_PULL_KIND,
                           message=f"MPIJob {name}: {pull} (for more than {IMAGE_PULL_AFTER_RUN_S:.0f}s)")
    if current in {RUNNING, RESTARTING}:
        said = [f"{pod} x{count} (last: {why})" for pod, count, why, _ in restarts]
        if elastic and (pulling := image_pull_failure([p for p in pods if _role(p) == "worker"])):
            said.append(pulling)
        if said:
            return Verdict(current, message=f"MPIJob {name} runs; elastic worker restarts: {', '.join(said)}")
        return Verdict(current)
    if elapsed >= startup_timeout:
        if pull := image_pull_failure(pods):
            return Verdict(current, done=True, error_kind=IMAGE_PULL_KIND,
                           message=f"MPIJob {name} did not start within {startup_timeout:.0f}s: {pull}")
        if reason := unschedulable(pods):
            return Verdict(
                current,
                done=True,
                error_kind=UNSCHEDULABLE_KIND,
                message=f"MPIJob {name} did not start within {startup_timeout:.0f}s: {reason}",
            )
        return Verdict(
            current,
            done=True,
            error_kind=STARTUP_TIMEOUT_KIND,
            message=f"MPIJob {name} did not start within {startup_timeout:.0f}s (still {current})",
        )
    return Verdict(current)
