"""`run-mpijob --chaos`: a script of host failures, checked in full before the job starts.

The script is events separated by `;`, each `ACTION POD at TIME`:

- `kill POD`: every process of the pod's emulated host gets SIGKILL (a node lost); the pod is no longer running;
- `restore POD`: the pod starts again in its emulated host (same namespace, address, names and files; sshd
  again); it counts as running again once it accepts TCP connections;
- `down POD` / `up POD`: the host side of the pod's veth goes down / up (its processes live on, unreachable).

POD is a worker: `worker-N` (its index) or its full pod name (`<job>-worker-N`); the launcher cannot be a
target. TIME is seconds from the launcher's start (`30`, `30s`, `2.5s`), never negative and never before the
event above it. `restore` needs an earlier `kill` of the pod (and `up` an earlier `down`) not yet undone;
a second `kill` (or `down`) of a pod before its `restore` (or `up`) is refused too. Pure: no process here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nightshift.mpijob_local.errors import ManifestNotSupported
from nightshift.mpijob_local.manifest import LocalJob

ACTIONS = ("kill", "restore", "down", "up")
UNDOES = {"restore": "kill", "up": "down"}
_EVENT = re.compile(r"(?P<action>\S+)\s+(?P<pod>\S+)\s+at\s+(?P<time>\S+)")
_TIME = re.compile(r"(?P<seconds>\d+(?:\.\d*)?|\.\d+)s?")


@dataclass(frozen=True)
class ChaosEvent:
    """One scripted failure: what happens to which worker pod, `at_s` seconds after the launcher started."""

    action: str
    pod: str  # the full pod name
    at_s: float
    text: str  # the event as written, for the log

    @property
    def label(self) -> str:
        return f"{self.action} {self.pod}"


def _valid_pods(job: LocalJob) -> str:
    last = len(job.workers) - 1
    if last == 0:
        return f"worker-0 or {job.workers[0].name}"
    return f"worker-0..worker-{last} or {job.workers[0].name}..{job.workers[-1].name}"


def _pod(name: str, job: LocalJob, where: str) -> str:
    by_short = {f"worker-{w.index}": w.name for w in job.workers}
    full = {w.name for w in job.workers}
    if name in by_short:
        return by_short[name]
    if name in full:
        return name
    if name in ("launcher", job.launcher.name):
        raise ManifestNotSupported(f"{where}: the launcher cannot be a chaos target (its exit is the job's); "
                                   f"valid pods: {_valid_pods(job)}")
    raise ManifestNotSupported(f"{where}: no worker pod {name!r} in MPIJob {job.name}; valid pods: "
                               f"{_valid_pods(job)}")


def _seconds(text: str, where: str) -> float:
    match = _TIME.fullmatch(text)
    if not match:
        raise ManifestNotSupported(f"{where}: time {text!r} must be seconds from the launcher's start, "
                                   f">= 0, like 30s or 2.5s")
    return float(match.group("seconds"))


def parse_chaos(script: str, job: LocalJob) -> tuple[ChaosEvent, ...]:
    """The events of `script` for `job`, in order; `ManifestNotSupported` naming the first bad part."""
    parts = [part.strip() for part in script.split(";")]
    if parts and not parts[-1]:
        parts.pop()  # one trailing `;`
    if not parts:
        raise ManifestNotSupported("--chaos is empty; give events like 'kill worker-1 at 30s; "
                                   "restore worker-1 at 60s'")
    events: list[ChaosEvent] = []
    undone: dict[str, set[str]] = {"kill": set(), "down": set()}  # pods killed / down and not yet back
    for number, text in enumerate(parts, 1):
        where = f"--chaos event {number} {text!r}"
        match = _EVENT.fullmatch(text)
        if not match:
            raise ManifestNotSupported(f"{where} must look like 'ACTION POD at SECONDS' with ACTION one of "
                                       f"{', '.join(ACTIONS)} (events separated by ';')")
        action = match.group("action")
        if action not in ACTIONS:
            raise ManifestNotSupported(f"{where}: unknown action {action!r}; valid actions: {', '.join(ACTIONS)}")
        pod = _pod(match.group("pod"), job, where)
        at_s = _seconds(match.group("time"), where)
        if events and at_s < events[-1].at_s:
            raise ManifestNotSupported(f"{where}: at {at_s:g}s comes before the event above it "
                                       f"({events[-1].at_s:g}s); list the events in time order")
        if action in UNDOES and not job.elastic:
            raise ManifestNotSupported(f"{where}: '{action}' only fits an elastic job (its launcher runs horovodrun "
                                       f"with --host-discovery-script): a job that is not elastic fails when a "
                                       f"worker is lost, and the error names it; drop the '{action}' events")
        if action in UNDOES:
            before = UNDOES[action]
            if pod not in undone[before]:
                raise ManifestNotSupported(f"{where}: {pod} is not {'killed' if before == 'kill' else 'down'} "
                                           f"at that point; '{action}' needs an earlier '{before} "
                                           f"{match.group('pod')}'")
            undone[before].discard(pod)
        else:
            if pod in undone[action]:
                again = "restore" if action == "kill" else "up"
                raise ManifestNotSupported(f"{where}: {pod} is already {'killed' if action == 'kill' else 'down'}"
                                           f"; '{again} {match.group('pod')}' it first")
            undone[action].add(pod)
        events.append(ChaosEvent(action=action, pod=pod, at_s=at_s, text=text))
    return tuple(events)
