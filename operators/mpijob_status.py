"""Pure reading of an MPIJob's status and its pods: is it done, did it succeed, and if not, why.

Shared by the synchronous launcher and the async trigger so both explain a failure the same way.
Inputs are plain dicts in the API's camelCase form (what `ApiClient.sanitize_for_serialization` gives).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from operators.mpijob_spec import JOB_ROLE_LABEL

# MPIJob (v2beta1) condition types, from the MPI Operator's JobCondition.
CREATED = "Created"
RUNNING = "Running"
RESTARTING = "Restarting"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
SUSPENDED = "Suspended"

# Waiting reasons that mean the image will not be pulled without a change by a person.
IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})

# Error kinds: the class names in operators.errors, so an event from the trigger maps back to an exception.
FAILED_KIND = "MPIJobFailed"
OOM_KIND = "MPIJobWorkerOOMKilled"
IMAGE_PULL_KIND = "MPIJobImagePullFailed"
UNSCHEDULABLE_KIND = "MPIJobUnschedulable"
STARTUP_TIMEOUT_KIND = "MPIJobStartupTimeout"
DELETED_KIND = "MPIJobDeleted"


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


def oom_killed(pods: Iterable[Mapping[str, Any]]) -> str | None:
    """A message naming the first container killed for exceeding its memory limit, if any."""
    for pod in pods:
        for cs in _container_statuses(pod):
            for key in ("state", "lastState"):
                terminated = (cs.get(key) or {}).get("terminated") or {}
                if terminated.get("reason") == "OOMKilled":
                    role = _role(pod) or "pod"
                    return (
                        f"{role} pod {_pod_name(pod)} container {cs.get('name', '?')} was OOMKilled "
                        f"(exit code {terminated.get('exitCode', '?')}): "
                        "raise memory_limit or lower the batch size"
                    )
    return None


def image_pull_failure(pods: Iterable[Mapping[str, Any]]) -> str | None:
    """A message naming a container whose image cannot be pulled, if any."""
    for pod in pods:
        for cs in _container_statuses(pod):
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in IMAGE_PULL_REASONS:
                detail = waiting.get("message") or ""
                return (
                    f"pod {_pod_name(pod)} cannot pull image {cs.get('image', '?')!s}: "
                    f"{waiting['reason']}{': ' + detail if detail else ''}"
                )
    return None


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


def explain_failure(name: str, mpijob: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """(error kind, message) for a job that reached Failed: the most specific cause first."""
    if oom := oom_killed(pods):
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
) -> Verdict:
    """One look at the job (None when the API answered 404) and its pods, `elapsed` seconds after submit."""
    if mpijob is None:
        return Verdict("Deleted", done=True, error_kind=DELETED_KIND, message=f"MPIJob {name} was deleted")
    current = phase(mpijob)
    if current == SUCCEEDED:
        return Verdict(current, done=True, succeeded=True, message=f"MPIJob {name} succeeded")
    if current == FAILED:
        kind, message = explain_failure(name, mpijob, pods)
        return Verdict(current, done=True, error_kind=kind, message=message)
    if oom := oom_killed(pods):
        return Verdict(current, done=True, error_kind=OOM_KIND, message=f"MPIJob {name} failed: {oom}")
    if pull := image_pull_failure(pods):
        return Verdict(current, done=True, error_kind=IMAGE_PULL_KIND, message=f"MPIJob {name}: {pull}")
    if current in {RUNNING, RESTARTING}:
        return Verdict(current)
    if elapsed >= startup_timeout:
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
