"""A small in-process fake of the Kubernetes API as the MPIJob launcher uses it.

`FakeCluster` plays `CustomObjectsApi` (mpijobs) and `CoreV1Api` (pods, pod logs) and behaves like the
real server where the launcher depends on it: `ApiException` 409 on a duplicate create, 404 on get or
delete of a missing job, pods listed by label selector as `V1PodList` models, a pod log streamed in
chunks through a `_preload_content=False` response (400 while the container has not started).
A job's life is scripted: each `get` of the job moves it one step along its `Scenario`.
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

    def __init__(self, data: bytes, chunk: int = 7) -> None:
        self.data = data
        self._chunk = chunk
        self.released = False

    def stream(self, amt: int | None = None, decode_content: bool = True) -> Iterator[bytes]:
        for i in range(0, len(self.data), self._chunk):
            yield self.data[i : i + self._chunk]

    def release_conn(self) -> None:
        self.released = True


class _Json:
    def __init__(self, payload: Any) -> None:
        self.data = json.dumps(payload)


def _api_error(status: int, reason: str, message: str) -> ApiException:
    err = ApiException(status=status, reason=reason)
    err.body = json.dumps({"kind": "Status", "status": "Failure", "message": message, "code": status})
    return err


@dataclass
class _Job:
    body: dict[str, Any]
    scenario: Scenario
    tick: int = -1

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
        self._lock = threading.Lock()
        self._serializer = ApiClient()

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
            if self.fail_gets_with is not None:
                raise self.fail_gets_with
            job = self.jobs.get((namespace, name))
            if job is None:
                raise _api_error(404, "Not Found", f'mpijobs.kubeflow.org "{name}" not found')
            job.tick += 1
            out = json.loads(json.dumps(job.body))
            if job.step.conditions:
                out["status"] = {"conditions": job.step.conditions}
            return out

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
            if (namespace, name) not in self.jobs:
                raise _api_error(404, "Not Found", f'mpijobs.kubeflow.org "{name}" not found')
            del self.jobs[(namespace, name)]
            self.deleted.append((namespace, name, body))
            return {"kind": "Status", "status": "Success"}

    # CoreV1Api
    def _pods(self, namespace: str) -> list[dict[str, Any]]:
        return [p for (ns, _), job in self.jobs.items() if ns == namespace for p in job.step.pods]

    def list_namespaced_pod(self, namespace: str, label_selector: str = "", **_: Any) -> Any:
        wanted = dict(part.split("=", 1) for part in label_selector.split(",") if part)
        with self._lock:
            items = [
                p for p in self._pods(namespace) if all(p["metadata"]["labels"].get(k) == v for k, v in wanted.items())
            ]
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
            self.log_reads.append((name, follow))
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
                    return _Response(data) if not _preload_content else data.decode()
        raise _api_error(404, "Not Found", f'pods "{name}" not found')


class AsyncFakeApi:
    """The same fake seen through kubernetes_asyncio-style coroutines, for the trigger."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster

    async def get_namespaced_custom_object(self, **kwargs: Any) -> dict[str, Any]:
        from kubernetes_asyncio.client.exceptions import ApiException as AsyncApiException

        try:
            return self.cluster.get_namespaced_custom_object(**kwargs)
        except ApiException as err:
            raise AsyncApiException(status=err.status, reason=err.reason) from err

    async def list_namespaced_pod(self, **kwargs: Any) -> Any:
        return self.cluster.list_namespaced_pod(**kwargs)

    async def list_namespaced_custom_object(self, **kwargs: Any) -> Any:
        return self.cluster.list_namespaced_custom_object(**kwargs)  # type: ignore[attr-defined]


class FakeHook:
    """Stands in for `KubernetesHook`: the two clients and the connection's namespace."""

    def __init__(self, cluster: FakeCluster, namespace: str | None = None) -> None:
        self.custom_object_client = cluster
        self.core_v1_client = cluster
        self._namespace = namespace

    def get_namespace(self) -> str | None:
        return self._namespace
