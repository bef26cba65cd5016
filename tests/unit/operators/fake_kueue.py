"""Kueue on top of the fake Kubernetes API: queues, Workloads and a job's life under admission control.

`KueueCluster` adds to `FakeCluster` what Kueue and the MPI Operator do to a queued MPIJob over time:
- Kueue makes a Workload for the job (labelled `kueue.x-k8s.io/job-uid`), keeps the job suspended while
  the Workload is pending (QuotaReserved False, with Kueue's reason), unsuspends it on admission, and on
  preemption suspends it again with the Workload Evicted (reason Preempted) until it is readmitted;
- the MPI Operator reflects that in the job's conditions (Suspended True/False with transition times)
  and creates pods only while the job runs; on eviction the pods are gone.
What the pods do is a `Kubelet`'s business: by default the job succeeds after a few polls; `ProcessKubelet`
runs the launcher's training command for real on this machine, killed on eviction and started again on
readmission, so a resume from checkpoint can be checked bit for bit.
Every Kueue object the fake serves or is given is validated strictly against the v1beta2 CRD schema.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.unit.operators import fake_kubernetes as fk

KUEUE = ("kueue.x-k8s.io", "v1beta2")
_VALIDATORS: dict[str, Any] = {}
PENDING_MESSAGE = ("couldn't assign flavors to pod set worker: insufficient unused quota for nvidia.com/gpu in "
                   "flavor gpu-a100, 8 more needed")
PREEMPTED_MESSAGE = ("Preempted to accommodate a workload (UID: wl-interactive-1) due to prioritization in the "
                     "ClusterQueue")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def validate(kind: str, obj: dict[str, Any]) -> None:
    """Strict validation against the Kueue CRD `kind` (e.g. "workloads") at v1beta2."""
    import jsonschema
    import yaml

    from tests.conftest import SHARED
    from tests.unit.operators.conftest import strict

    if kind not in _VALIDATORS:
        path = SHARED / "schemas" / f"kueue.x-k8s.io_{kind}.yaml"
        if not path.exists():
            import pytest

            pytest.skip(f"Kueue CRD schema not found at {path} (needs ../shared/schemas beside the repo)")
        crd = yaml.safe_load(path.read_text())
        version = next(v for v in crd["spec"]["versions"] if v["name"] == KUEUE[1])
        schema = strict(version["schema"]["openAPIV3Schema"])
        _VALIDATORS[kind] = jsonschema.validators.validator_for(schema)(schema)  # checked once, used often
    _VALIDATORS[kind].validate(obj)


class Kubelet:
    """What the job's pods do once admitted: here, succeed after `polls` looks."""

    def __init__(self, polls: int = 2) -> None:
        self.polls = polls
        self._seen = 0

    def start(self, job: dict[str, Any]) -> None:
        self._seen = 0

    def stop(self) -> None:
        pass

    def exit_code(self) -> int | None:
        self._seen += 1
        return 0 if self._seen > self.polls else None

    def log(self) -> list[str]:
        return ["training done"]


class ProcessKubelet(Kubelet):
    """Runs the launcher's training command (from `python` on) under a local `horovodrun` for real.

    A stand-in for the pods on one machine: the ranks share this machine's disk, which plays the shared
    volume. `stop()` kills the whole process group, as pods deleted on eviction would die.
    """

    def __init__(self, ranks: int, log_path: Path) -> None:
        super().__init__()
        self.ranks = ranks
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, job: dict[str, Any]) -> None:
        launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
        command = list(launcher["command"])
        trainer = command[command.index("python"):]
        trainer[0] = sys.executable
        horovodrun = str(Path(sys.executable).with_name("horovodrun"))
        env = {**os.environ, **{e["name"]: e["value"] for e in launcher.get("env", [])}}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [horovodrun, "-np", str(self.ranks), "-H", f"localhost:{self.ranks}", "--gloo", *trainer],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.starts += 1

    def stop(self) -> None:
        import psutil

        if self.proc is None or self.proc.poll() is not None:
            return
        tree = psutil.Process(self.proc.pid).children(recursive=True)
        for proc in [*tree]:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        psutil.wait_procs(tree, timeout=30)

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()[-50:]


@dataclass
class Lifecycle:
    """How Kueue treats one job: pending for `pending_polls` looks, then admitted; evicted once when
    `evict_when()` turns true while it runs, readmitted `readmit_polls` looks later."""

    pending_polls: int = 2
    evict_when: Callable[[], bool] | None = None
    readmit_polls: int = 2
    never_admit: bool = False
    # Someone (a person, or Kueue itself once a requeuing backoffLimitCount is reached) sets the Workload's
    # spec.active to false when this turns true: Kueue evicts it (reason InactiveWorkload), never readmits it.
    deactivate_when: Callable[[], bool] | None = None
    deactivation_message: str = "The workload is deactivated"
    active: bool = True
    kubelet: Kubelet = field(default_factory=Kubelet)
    state: str = "pending"
    polls_in_state: int = 0
    admissions: int = 0
    evictions: int = 0
    workload_conditions: list[dict[str, Any]] = field(default_factory=list)
    job_conditions: list[dict[str, Any]] = field(default_factory=list)
    pods: list[dict[str, Any]] = field(default_factory=list)
    exit_code: int | None = None


def _cond(kind: str, status: bool, reason: str, message: str = "") -> dict[str, Any]:
    return {"type": kind, "status": "True" if status else "False", "reason": reason, "message": message,
            "lastTransitionTime": _now()}


class KueueCluster(fk.FakeCluster):
    """FakeCluster with Kueue: LocalQueues, ClusterQueues, nodes, and queued jobs' Workloads over time."""

    def __init__(self, lifecycle_for: Callable[[str], Lifecycle] | None = None,
                 local_queues: Sequence[dict[str, Any]] = (), cluster_queues: Sequence[dict[str, Any]] = (),
                 node_gpus: Sequence[int] = ()) -> None:
        super().__init__()
        self.lifecycle_for = lifecycle_for or (lambda name: Lifecycle())
        self.lifecycles: dict[str, Lifecycle] = {}
        for obj in local_queues:
            validate("localqueues", obj)
        for obj in cluster_queues:
            validate("clusterqueues", obj)
        self.local_queues = {(q["metadata"]["namespace"], q["metadata"]["name"]): q for q in local_queues}
        self.cluster_queues = {q["metadata"]["name"]: q for q in cluster_queues}
        self.node_gpus = list(node_gpus)
        self.transitions: list[str] = []

    # -- the job's life under Kueue ------------------------------------------------------------------

    def _queued(self, body: dict[str, Any]) -> bool:
        return "kueue.x-k8s.io/queue-name" in body["metadata"].get("labels", {})

    def _advance(self, body: dict[str, Any]) -> Lifecycle:
        name = body["metadata"]["name"]
        life = self.lifecycles.setdefault(name, self.lifecycle_for(name))
        life.polls_in_state += 1
        if life.state == "pending" and not life.job_conditions:
            life.job_conditions = [_cond("Created", True, "MPIJobCreated"), _cond("Suspended", True, "MPIJobSuspended")]
            life.workload_conditions = [_cond("QuotaReserved", False, "Pending", PENDING_MESSAGE)]
        if life.active and life.state in {"pending", "evicted", "running"} and life.deactivate_when is not None \
                and life.deactivate_when():
            self._deactivate(body, life)
        elif life.state in {"pending", "evicted"}:
            wait = life.pending_polls if life.state == "pending" else life.readmit_polls
            if not life.never_admit and life.polls_in_state > wait:
                self._admit(body, life)
        elif life.state == "running":
            code = life.kubelet.exit_code()
            if code is not None:
                self._finish(body, life, code)
            elif life.evict_when is not None and life.evictions == 0 and life.evict_when():
                self._evict(body, life)
        return life

    def _set(self, life: Lifecycle, state: str) -> None:
        self.transitions.append(state)
        life.state, life.polls_in_state = state, 0

    def _admit(self, body: dict[str, Any], life: Lifecycle) -> None:
        body["spec"]["runPolicy"]["suspend"] = False  # Kueue's doing
        life.admissions += 1
        life.workload_conditions = [_cond("QuotaReserved", True, "QuotaReserved", "Quota reserved in ClusterQueue gpu"),
                                    _cond("Admitted", True, "Admitted", "The workload is admitted")]
        life.job_conditions = [_cond("Created", True, "MPIJobCreated"), _cond("Suspended", False, "MPIJobResumed"),
                               _cond("Running", True, "MPIJobRunning")]
        job = body["metadata"]["name"]
        launcher = fk.pod(job, "launcher", phase="Running", state=fk.RUNNING)
        launcher["metadata"]["name"] = f"{job}-launcher-{life.admissions}"
        life.pods = [*fk.workers(job, 2, phase="Running", state=fk.RUNNING), launcher]
        life.kubelet.start(body)
        self._set(life, "running")

    def _evict(self, body: dict[str, Any], life: Lifecycle) -> None:
        life.kubelet.stop()  # the pods are deleted
        body["spec"]["runPolicy"]["suspend"] = True
        life.evictions += 1
        life.workload_conditions = [_cond("QuotaReserved", False, "Pending", PENDING_MESSAGE),
                                    _cond("Admitted", False, "NoReservation"),
                                    _cond("Evicted", True, "Preempted", PREEMPTED_MESSAGE),
                                    _cond("Preempted", True, "InClusterQueue", PREEMPTED_MESSAGE)]
        life.job_conditions = [_cond("Created", True, "MPIJobCreated"), _cond("Suspended", True, "MPIJobSuspended")]
        life.pods = []
        self._set(life, "evicted")

    def _deactivate(self, body: dict[str, Any], life: Lifecycle) -> None:
        """spec.active=false: what Kueue's workload controller does (evict, keep suspended, never admit)."""
        life.kubelet.stop()
        life.active = False
        body["spec"]["runPolicy"]["suspend"] = True
        life.workload_conditions = [_cond("QuotaReserved", False, "Pending", "The workload is deactivated"),
                                    _cond("Admitted", False, "NoReservation", "The workload has no reservation"),
                                    _cond("Evicted", True, "InactiveWorkload", life.deactivation_message),
                                    _cond("Requeued", False, "InactiveWorkload", life.deactivation_message)]
        life.job_conditions = [_cond("Created", True, "MPIJobCreated"), _cond("Suspended", True, "MPIJobSuspended")]
        life.pods = []
        self._set(life, "deactivated")

    def _finish(self, body: dict[str, Any], life: Lifecycle, code: int) -> None:
        job = body["metadata"]["name"]
        life.exit_code = code
        life.workload_conditions.append(_cond("Finished", True, "Succeeded" if code == 0 else "Failed"))
        ended = "Succeeded" if code == 0 else "Failed"
        life.job_conditions = [_cond("Created", True, "MPIJobCreated"), _cond(ended, True, f"MPIJob{ended}")]
        launcher = fk.pod(job, "launcher", phase=ended, state=fk.terminated(code, message="\n".join(
            life.kubelet.log()[-5:]) if code else ""))
        launcher["metadata"]["name"] = f"{job}-launcher-{life.admissions}"
        life.pods = [launcher]
        self._set(life, ended.lower())

    def workload_of(self, body: dict[str, Any], life: Lifecycle) -> dict[str, Any]:
        job = body["metadata"]["name"]
        spec = body["spec"]["mpiReplicaSpecs"]
        pod_sets = [{"name": role.lower(), "count": spec[role]["replicas"],
                     "template": {"spec": {"containers": [{"name": role.lower(), "image": "trainer"}]}}}
                    for role in ("Launcher", "Worker")]
        workload = {
            "apiVersion": "/".join(KUEUE), "kind": "Workload",
            "metadata": {"name": f"mpijob-{job}-3f2a1", "namespace": body["metadata"]["namespace"],
                         "labels": {"kueue.x-k8s.io/job-uid": body["metadata"]["uid"]}},
            "spec": {"active": life.active, "queueName": body["metadata"]["labels"]["kueue.x-k8s.io/queue-name"],
                     "podSets": pod_sets},
            "status": {"conditions": life.workload_conditions},
        }
        validate("workloads", workload)
        return workload

    # -- the API -------------------------------------------------------------------------------------

    def get_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str,
                                     **kwargs: Any) -> dict[str, Any]:
        if plural == "localqueues":
            if (namespace, name) not in self.local_queues:
                raise fk._api_error(404, "Not Found", f'localqueues.kueue.x-k8s.io "{name}" not found')
            return json.loads(json.dumps(self.local_queues[(namespace, name)]))
        with self._lock:
            job = self.jobs.get((namespace, name))
            if job is None or not self._queued(job.body) or job.deleting or self.faults.get(
                    "get_namespaced_custom_object"):
                queued = False
            else:
                queued = True
                life = self._advance(job.body)
                out = json.loads(json.dumps(job.body))
                out["status"] = {"conditions": life.job_conditions}
        if not queued:
            return super().get_namespaced_custom_object(group, version, namespace, plural, name, **kwargs)
        return out

    def get_cluster_custom_object(self, group: str, version: str, plural: str, name: str, **_: Any) -> dict[str, Any]:
        assert (group, version, plural) == (*KUEUE, "clusterqueues")
        if name not in self.cluster_queues:
            raise fk._api_error(404, "Not Found", f'clusterqueues.kueue.x-k8s.io "{name}" not found')
        return json.loads(json.dumps(self.cluster_queues[name]))

    def list_cluster_custom_object(self, group: str, version: str, plural: str, **_: Any) -> dict[str, Any]:
        assert (group, version, plural) == (*KUEUE, "clusterqueues")
        return {"items": json.loads(json.dumps(list(self.cluster_queues.values())))}

    def list_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str,
                                      label_selector: str = "", **kwargs: Any) -> dict[str, Any]:
        if plural == "mpijobs":
            return super().list_namespaced_custom_object(group, version, namespace, plural, label_selector, **kwargs)
        assert (group, version, plural) == (*KUEUE, "workloads")
        key, _, uid = label_selector.partition("=")
        assert key == "kueue.x-k8s.io/job-uid"
        with self._lock:
            items = [self.workload_of(job.body, self.lifecycles[job.body["metadata"]["name"]])
                     for (ns, _name), job in self.jobs.items()
                     if ns == namespace and job.body["metadata"].get("uid") == uid
                     and job.body["metadata"]["name"] in self.lifecycles]
        return {"items": items}

    def job_pods(self, namespace: str, name: str, job: fk._Job) -> list[dict[str, Any]]:
        if self._queued(job.body) and name in self.lifecycles:
            return self.lifecycles[name].pods
        return super().job_pods(namespace, name, job)

    def read_namespaced_pod_log(self, name: str, namespace: str, container: str | None = None,
                                follow: bool = False, _preload_content: bool = True, **kwargs: Any) -> Any:
        for life in self.lifecycles.values():
            if any(p["metadata"]["name"] == name for p in life.pods):
                data = "".join(f"{line}\n" for line in life.kubelet.log()).encode()
                return fk._Response(data) if not _preload_content else data.decode()
        return super().read_namespaced_pod_log(name, namespace, container, follow, _preload_content, **kwargs)

    def list_node(self, **_: Any) -> Any:
        items = [{"metadata": {"name": f"gpu-node-{i}"}, "status": {"allocatable": {"nvidia.com/gpu": str(n)}}}
                 for i, n in enumerate(self.node_gpus)]
        return self._serializer.deserialize(fk._Json({"apiVersion": "v1", "kind": "NodeList", "metadata": {},
                                                      "items": items}), "V1NodeList")

    def delete_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str,
                                        body: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
        if name in self.lifecycles:
            self.lifecycles[name].kubelet.stop()
        return super().delete_namespaced_custom_object(group, version, namespace, plural, name, body, **kwargs)


def local_queue(name: str, cluster_queue: str, namespace: str = "ml") -> dict[str, Any]:
    return {"apiVersion": "/".join(KUEUE), "kind": "LocalQueue", "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterQueue": cluster_queue}}


def cluster_queue(name: str, gpus: int, *, cohort: str | None = None, borrowing: int | None = None,
                  lending: int | None = None) -> dict[str, Any]:
    quota: dict[str, Any] = {"name": "nvidia.com/gpu", "nominalQuota": gpus}
    if borrowing is not None:
        quota["borrowingLimit"] = borrowing
    if lending is not None:
        quota["lendingLimit"] = lending
    spec: dict[str, Any] = {"namespaceSelector": {}, "resourceGroups": [
        {"coveredResources": ["nvidia.com/gpu"], "flavors": [{"name": "gpu-a100", "resources": [quota]}]}]}
    if cohort:
        spec["cohortName"] = cohort
    return {"apiVersion": "/".join(KUEUE), "kind": "ClusterQueue", "metadata": {"name": name}, "spec": spec}


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False
