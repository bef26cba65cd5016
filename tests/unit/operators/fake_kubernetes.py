"""A small in-process fake of the Kubernetes API as the MPIJob launcher uses it.

`FakeCluster` plays `CustomObjectsApi` (mpijobs) and `CoreV1Api` (pods, pod logs) and behaves like the
real server where the launcher depends on it: `ApiException` 409 on a duplicate create, 404 on get or
delete of a missing job, pods listed by label selector as `V1PodList` models, a pod log streamed in
chunks through a `_preload_content=False` response (400 while the container has not started).
A job's life is scripted: each `get` of the job moves it one step along its `Scenario`.

Over time, as the real server: a delete with `propagationPolicy: Foreground` keeps the job (with a
`deletionTimestamp` and the `foregroundDeletion` finalizer) until its pods are gone, and the pods
terminate for `delete_linger` API reads; a background delete removes the job at once while its pods
still terminate. Faults are injected per method (`inject`): an `ApiException` 500/503/429 or a urllib3
error raised by the next call(s), and `cut_log_streams` cuts a pod log stream mid-way (urllib3
`ProtocolError`, as when a node or a connection is lost).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from operators.mpijob_spec import JOB_NAME_LABEL, JOB_ROLE_LABEL


@dataclass
class Step:
    """The job's state for one poll: its true conditions and its pods (camelCase dicts)."""

    conditions: list[dict[str, Any]] = field(default_factory=list)
    pods: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Scenario:
    """How a job evolves: steps[i] is what the i-th get sees; the last step repeats forever."""

    steps: list[Step]
    launcher_log: list[str] = field(default_factory=list)


def condition(kind: str, reason: str = "", message: str = "") -> dict[str, Any]:
    return {
        "type": kind,
        "status": "True",
        "reason": reason or f"MPIJob{kind}",
        "message": message,
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }


def pod(
    job: str,
    role: str,
    index: int = 0,
    *,
    phase: str = "Pending",
    state: dict[str, Any] | None = None,
    last_state: dict[str, Any] | None = None,
    conditions: list[dict[str, Any]] | None = None,
    image: str = "ghcr.io/example/trainer:1",
) -> dict[str, Any]:
    name = f"{job}-launcher-x7k2p" if role == "launcher" else f"{job}-worker-{index}"
    container = "launcher" if role == "launcher" else "worker"
    status: dict[str, Any] = {"phase": phase, "conditions": conditions or []}
    if state is not None:
        status["containerStatuses"] = [
            {
                "name": container,
                "image": image,
                "imageID": "",
                "ready": "running" in state,
                "restartCount": 0,
                "state": state,
                **({"lastState": last_state} if last_state else {}),
            }
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            "creationTimestamp": f"2026-01-01T00:00:0{index}Z",
            "labels": {
                JOB_NAME_LABEL: job,
                JOB_ROLE_LABEL: role,
                "training.kubeflow.org/operator-name": "mpi-operator",
            },
        },
        "spec": {"containers": [{"name": container, "image": image}]},
        "status": status,
    }


RUNNING = {"running": {"startedAt": "2026-01-01T00:00:05Z"}}
CREATING = {"waiting": {"reason": "ContainerCreating"}}


def terminated(code: int, reason: str = "", message: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {"exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error")}
    if message:
        out["message"] = message
    return {"terminated": out}


def workers(job: str, n: int, **kwargs: Any) -> list[dict[str, Any]]:
    return [pod(job, "worker", i, **kwargs) for i in range(n)]


# -- scenarios ---------------------------------------------------------------------------------------


def started(job: str, n: int) -> list[Step]:
    """The job is created (workers pending), then runs (workers and launcher running)."""
    return [
        Step([condition("Created")], workers(job, n, state=CREATING)),
        Step(
            [condition("Created"), condition("Running")],
            [*workers(job, n, phase="Running", state=RUNNING), pod(job, "launcher", phase="Running", state=RUNNING)],
        ),
    ]


def succeeding(job: str, log: list[str], n: int = 2) -> Scenario:
    return Scenario(
        steps=[
            Step(),
            *started(job, n),
            Step(
                [
                    condition("Created"),
                    condition("Succeeded", message=f"MPIJob default/{job} successfully completed."),
                ],
                [pod(job, "launcher", phase="Succeeded", state=terminated(0))],
            ),
        ],
        launcher_log=log,
    )


def running_forever(job: str, log: list[str], n: int = 2) -> Scenario:
    return Scenario(
        steps=[
            *started(job, n),
        ],
        launcher_log=log,
    )


def worker_oom(job: str, n: int = 2) -> Scenario:
    dying = workers(job, n, phase="Running", state=RUNNING)
    dying[1] = pod(job, "worker", 1, phase="Failed", state=terminated(137, "OOMKilled"))
    launcher_failed = pod(
        job,
        "launcher",
        phase="Failed",
        state=terminated(1, message="mpirun noticed that process rank 1 exited"),
    )
    return Scenario(
        steps=[
            *started(job, n),
            Step(
                [condition("Created"), condition("Failed", message=f"MPIJob default/{job} has failed")],
                [*dying, launcher_failed],
            ),
        ],
        launcher_log=[
            "epoch 1 step 3 loss 2.1",
            "mpirun noticed that process rank 1 exited on signal 9 (Killed)",
        ],
    )


def launcher_fails(job: str, message: str, n: int = 2) -> Scenario:
    return Scenario(
        steps=[
            Step([condition("Created")], workers(job, n, state=CREATING)),
            Step(
                [condition("Created"), condition("Failed", message=f"MPIJob default/{job} has failed")],
                [
                    *workers(job, n, phase="Running", state=RUNNING),
                    pod(job, "launcher", phase="Failed", state=terminated(2, message=message)),
                ],
            ),
        ],
        launcher_log=[message],
    )


def unschedulable(job: str, n: int = 2) -> Scenario:
    cond = [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
        }
    ]
    return Scenario(steps=[Step([condition("Created")], workers(job, n, conditions=cond))])


def image_pull_failure(job: str, n: int = 2) -> Scenario:
    pulling = {"waiting": {"reason": "ErrImagePull", "message": 'pull access denied for "nope/trainer"'}}
    backoff = {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "nope/trainer"'}}
    return Scenario(
        steps=[
            Step([condition("Created")], workers(job, n, state=CREATING)),
            Step([condition("Created")], workers(job, n, state=pulling, image="nope/trainer")),
            Step([condition("Created")], workers(job, n, state=backoff, image="nope/trainer")),
        ]
    )


# -- the fake API ------------------------------------------------------------------------------------


class _Response:
    """What `_preload_content=False` returns: a urllib3-like response streamed in chunks."""

    def __init__(self, data: bytes, chunk: int = 7, cut_after: int | None = None) -> None:
        self.data = data
        self._chunk = chunk
        self.released = False
        self.cut_after = cut_after  # bytes sent before the connection breaks (None: never)

    def stream(self, amt: int | None = None, decode_content: bool = True) -> Iterator[bytes]:
        from urllib3.exceptions import ProtocolError

        for i in range(0, len(self.data), self._chunk):
            if self.cut_after is not None and i >= self.cut_after:
                raise ProtocolError("Connection broken: IncompleteRead(0 bytes read)", ConnectionResetError(104))
            yield self.data[i : i + self._chunk]

    def release_conn(self) -> None:
        self.released = True


class _Json:
    def __init__(self, payload: Any) -> None:
        self.data = json.dumps(payload)


def selects(selector: str, labels: dict[str, str]) -> bool:
    """A label selector as the API server reads it: `k=v`, `k==v`, `k!=v`, `k` and `!k`, comma-separated."""
    for part in filter(None, (p.strip() for p in selector.split(","))):
        if "!=" in part:
            key, value = part.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in part:
            key, value = part.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif part.startswith("!"):
            if part[1:] in labels:
                return False
        elif part not in labels:
            return False
    return True


def _api_error(status: int, reason: str, message: str) -> ApiException:
    err = ApiException(status=status, reason=reason)
    err.body = json.dumps({"kind": "Status", "status": "Failure", "message": message, "code": status})
    return err


REASONS = {429: "Too Many Requests", 500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable",
           504: "Gateway Timeout", 403: "Forbidden"}


def api_error(status: int, retry_after: int | None = None) -> ApiException:
    """What the API server (or the load balancer before it) answers when it cannot serve a request now."""
    err = _api_error(status, REASONS.get(status, "Error"), f"the server answered {status}")
    if retry_after is not None:
        err.headers = {"Retry-After": str(retry_after)}
    return err


@dataclass
class _Job:
    body: dict[str, Any]
    scenario: Scenario
    tick: int = -1
    deleting: bool = False

    @property
    def step(self) -> Step:
        steps = self.scenario.steps
        return steps[min(max(self.tick, 0), len(steps) - 1)]


_STRICT_VALIDATOR: list[Any] = []


def _validate_strictly(body: dict[str, Any]) -> None:
    """422 Invalid, as an API server with `fieldValidation=Strict` answers, for what the CRD does not accept."""
    import jsonschema
    import yaml

    from tests.unit.operators.conftest import MPIJOB_CRD, strict

    if not _STRICT_VALIDATOR:
        if not MPIJOB_CRD.exists():
            import pytest

            pytest.skip(f"MPIJob CRD schema not found at {MPIJOB_CRD} (needs ../shared/schemas beside the repo)")
        crd = yaml.safe_load(MPIJOB_CRD.read_text())
        version = next(v for v in crd["spec"]["versions"] if v["name"] == "v2beta1")
        schema = strict(version["schema"]["openAPIV3Schema"])
        _STRICT_VALIDATOR.append(jsonschema.validators.validator_for(schema)(schema))
    try:
        _STRICT_VALIDATOR[0].validate(body)
    except jsonschema.ValidationError as err:
        raise _api_error(422, "Unprocessable Entity", f"MPIJob.kubeflow.org is invalid: {err.message}") from err


class FakeCluster:
    """CustomObjectsApi + CoreV1Api in one object, with scripted MPIJobs. Thread-safe."""

    def __init__(self, scenario_for: Callable[[str], Scenario] | None = None) -> None:
        self.scenario_for = scenario_for or (lambda name: succeeding(name, ["hello from rank 0"]))
        self.jobs: dict[tuple[str, str], _Job] = {}
        self.deleted: list[tuple[str, str, dict[str, Any] | None]] = []
        self.created: list[str] = []
        self.submitted: list[dict[str, Any]] = []  # every body accepted, as created
        self.log_reads: list[tuple[str, bool]] = []
        self.fail_gets_with: ApiException | None = None
        self.delete_linger = 0  # API reads a deleted job's pods take to terminate
        self.terminating: list[list[Any]] = []  # [pod, reads left]
        self.faults: dict[str, list[BaseException]] = {}
        self.cut_log_streams = 0  # the next log streams that break mid-way
        self._lock = threading.Lock()
        self._serializer = ApiClient()

    # -- faults and time -------------------------------------------------------------------------------

    def inject(self, method: str, *faults: BaseException) -> None:
        """The next calls of `method` raise these, one each, in order (then it works again)."""
        self.faults.setdefault(method, []).extend(faults)

    def _fault(self, method: str) -> None:
        pending = self.faults.get(method)
        if pending:
            raise pending.pop(0)

    def _tick(self) -> None:
        """One API read passes: terminating pods get closer to gone; a job deleted in the foreground
        goes once its pods are gone (the garbage collector removes the foregroundDeletion finalizer)."""
        for entry in self.terminating:
            entry[1] -= 1
        self.terminating = [entry for entry in self.terminating if entry[1] > 0]
        left = {p["metadata"]["labels"].get(JOB_NAME_LABEL) for p, _ in self.terminating}
        for key, job in list(self.jobs.items()):
            if job.deleting and key[1] not in left:
                del self.jobs[key]

    def job_pods(self, namespace: str, name: str, job: _Job) -> list[dict[str, Any]]:
        """The pods the MPI Operator keeps for this job now."""
        return job.step.pods

    def _labelled_pods(self, namespace: str, name: str, job: _Job) -> list[dict[str, Any]]:
        """The job's pods with their replica template's labels, as the MPI Operator creates them."""
        specs = (job.body.get("spec") or {}).get("mpiReplicaSpecs") or {}
        out = []
        for p in self.job_pods(namespace, name, job):
            role = "Launcher" if p["metadata"]["labels"].get(JOB_ROLE_LABEL) == "launcher" else "Worker"
            template = ((specs.get(role) or {}).get("template") or {}).get("metadata") or {}
            labelled = {**p, "metadata": {**p["metadata"], "labels": {**(template.get("labels") or {}),
                                                                      **p["metadata"]["labels"]}}}
            out.append(labelled)
        return out

    # CustomObjectsApi
    def create_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, body: dict[str, Any], **_: Any
    ) -> dict[str, Any]:
        assert (group, version, plural) == ("kubeflow.org", "v2beta1", "mpijobs")
        _validate_strictly(body)
        name = body["metadata"]["name"]
        with self._lock:
            if (namespace, name) in self.jobs:
                raise _api_error(409, "Conflict", f'mpijobs.kubeflow.org "{name}" already exists')
            stored = json.loads(json.dumps(body))
            stored["metadata"].update({"uid": f"uid-{len(self.created)}", "resourceVersion": "1"})
            self.jobs[(namespace, name)] = _Job(stored, self.scenario_for(name))
            self.created.append(name)
            self.submitted.append(json.loads(json.dumps(stored)))
            return json.loads(json.dumps(stored))

    def get_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str, **_: Any
    ) -> dict[str, Any]:
        with self._lock:
            self._fault("get_namespaced_custom_object")
            if self.fail_gets_with is not None:
                raise self.fail_gets_with
            self._tick()
            job = self.jobs.get((namespace, name))
            if job is None:
                raise _api_error(404, "Not Found", f'mpijobs.kubeflow.org "{name}" not found')
            if not job.deleting:
                job.tick += 1
            out = json.loads(json.dumps(job.body))
            if job.step.conditions:
                out["status"] = {"conditions": job.step.conditions}
            return out

    def list_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, label_selector: str = "", **_: Any
    ) -> dict[str, Any]:
        assert (group, version, plural) == ("kubeflow.org", "v2beta1", "mpijobs")
        with self._lock:
            self._fault("list_namespaced_custom_object")
            self._tick()
            items = [json.loads(json.dumps(job.body)) for (ns, _), job in self.jobs.items()
                     if ns == namespace and selects(label_selector, job.body["metadata"].get("labels") or {})]
        return {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJobList", "metadata": {}, "items": items}

    def delete_namespaced_custom_object(
        self,
        group: str,
        version: str,
        namespace: str,
        plural: str,
        name: str,
        body: dict[str, Any] | None = None,
        **_: Any,
    ) -> dict[str, Any]:
        with self._lock:
            self._fault("delete_namespaced_custom_object")
            job = self.jobs.get((namespace, name))
            if job is None:
                raise _api_error(404, "Not Found", f'mpijobs.kubeflow.org "{name}" not found')
            self.deleted.append((namespace, name, body))
            if job.deleting:  # deleting again what is being deleted: the object as it is, no change
                return json.loads(json.dumps(job.body))
            pods = [json.loads(json.dumps(p)) for p in self._labelled_pods(namespace, name, job)]
            for p in pods:
                p["metadata"]["deletionTimestamp"] = "2026-01-01T00:10:00Z"
            if self.delete_linger > 0:
                self.terminating += [[p, self.delete_linger] for p in pods]
            foreground = (body or {}).get("propagationPolicy") == "Foreground"
            if foreground and pods and self.delete_linger > 0:
                job.deleting = True
                job.body["metadata"].update({"deletionTimestamp": "2026-01-01T00:10:00Z",
                                             "finalizers": ["foregroundDeletion"]})
                return json.loads(json.dumps(job.body))
            del self.jobs[(namespace, name)]
            return {"kind": "Status", "status": "Success"}

    # CoreV1Api
    def _pods(self, namespace: str) -> list[dict[str, Any]]:
        return [p for (ns, name), job in self.jobs.items() if ns == namespace and not job.deleting
                for p in self._labelled_pods(ns, name, job)]

    def list_namespaced_pod(self, namespace: str, label_selector: str = "", **_: Any) -> Any:
        with self._lock:
            self._fault("list_namespaced_pod")
            self._tick()
            pods = [*self._pods(namespace),
                    *(p for p, _ in self.terminating if p["metadata"].get("namespace", namespace) == namespace)]
            items = [p for p in pods if selects(label_selector, p["metadata"]["labels"])]
            payload = {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
        return self._serializer.deserialize(_Json(payload), "V1PodList")

    def read_namespaced_pod_log(
        self,
        name: str,
        namespace: str,
        container: str | None = None,
        follow: bool = False,
        _preload_content: bool = True,
        **_: Any,
    ) -> Any:
        with self._lock:
            self._fault("read_namespaced_pod_log")
            self.log_reads.append((name, follow))
            cut = None
            if self.cut_log_streams > 0 and follow:
                self.cut_log_streams -= 1
                cut = -1  # half of the log, then the connection breaks
            for job in self.jobs.values():
                for p in job.step.pods:
                    if p["metadata"]["name"] != name:
                        continue
                    statuses = p["status"].get("containerStatuses") or []
                    if not any("running" in s["state"] or "terminated" in s["state"] for s in statuses):
                        raise _api_error(
                            400, "Bad Request", f'container "{container}" in pod "{name}" is waiting to start'
                        )
                    data = "".join(f"{line}\n" for line in job.scenario.launcher_log).encode()
                    cut_after = len(data) // 2 if cut is not None else None
                    return _Response(data, cut_after=cut_after) if not _preload_content else data.decode()
        raise _api_error(404, "Not Found", f'pods "{name}" not found')


class AsyncFakeApi:
    """The same fake seen through kubernetes_asyncio-style coroutines, for the trigger."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster

    @staticmethod
    def _call(method: Callable[..., Any], **kwargs: Any) -> Any:
        from kubernetes_asyncio.client.exceptions import ApiException as AsyncApiException

        try:
            return method(**kwargs)
        except ApiException as err:
            raise AsyncApiException(status=err.status, reason=err.reason) from err

    async def get_namespaced_custom_object(self, **kwargs: Any) -> dict[str, Any]:
        return self._call(self.cluster.get_namespaced_custom_object, **kwargs)  # type: ignore[no-any-return]

    async def list_namespaced_pod(self, **kwargs: Any) -> Any:
        return self._call(self.cluster.list_namespaced_pod, **kwargs)

    async def list_namespaced_custom_object(self, **kwargs: Any) -> Any:
        return self._call(self.cluster.list_namespaced_custom_object, **kwargs)


class FakeHook:
    """Stands in for `KubernetesHook`: the two clients and the connection's namespace."""

    def __init__(self, cluster: FakeCluster, namespace: str | None = None) -> None:
        self.custom_object_client = cluster
        self.core_v1_client = cluster
        self._namespace = namespace

    def get_namespace(self) -> str | None:
        return self._namespace
