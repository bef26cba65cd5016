"""Against a real cluster with the MPI Operator installed: runs only when KUBECONFIG is set.

NIGHTSHIFT_TRAINER_IMAGE names the trainer image the cluster can pull (default `nightshift-trainer:cpu`,
e.g. loaded into kind); NIGHTSHIFT_TEST_NAMESPACE the namespace (default `default`).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from operators import errors
from operators.horovod import HorovodKubernetesOperator
from tests.unit.operators.conftest import horovod_operator, make_context

pytestmark = [
    pytest.mark.integration,
    pytest.mark.kubernetes,
    pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs a real cluster: KUBECONFIG is not set"),
]

HELLO = "import horovod.torch as hvd; hvd.init(); print('hello from rank', hvd.rank(), 'of', hvd.size())"


@pytest.fixture
def k8s_conn(monkeypatch: pytest.MonkeyPatch) -> str:
    import json

    extra = {"kube_config_path": os.environ["KUBECONFIG"]}
    monkeypatch.setenv("AIRFLOW_CONN_NIGHTSHIFT_K8S_TEST", json.dumps({"conn_type": "kubernetes", "extra": extra}))
    return "nightshift_k8s_test"


def operator(conn_id: str, **overrides: Any) -> HorovodKubernetesOperator:
    kwargs: dict[str, Any] = {
        "task_id": "hello",
        "num_workers": 2,
        "gpus_per_worker": 0,
        "image": os.environ.get("NIGHTSHIFT_TRAINER_IMAGE", "nightshift-trainer:cpu"),
        "image_pull_policy": "IfNotPresent",
        "command": ["python", "-c", HELLO],
        "namespace": os.environ.get("NIGHTSHIFT_TEST_NAMESPACE", "default"),
        "backend": "kubernetes",
        "kubernetes_conn_id": conn_id,
        "poll_interval": 3,
        "startup_timeout": 300,
        "cleanup": "always",
    }
    kwargs.update(overrides)
    return horovod_operator(**kwargs)


def test_two_worker_job_runs_and_is_cleaned_up(k8s_conn: str, capsys: pytest.CaptureFixture[str]) -> None:
    op = operator(k8s_conn)
    result = op.execute(make_context(dag_id="k8s_it", run_id=f"it-{os.getpid()}"))  # type: ignore[arg-type]
    assert "hello from rank 1 of 2" in capsys.readouterr().out
    # cleanup="always": the job is gone or being deleted (foreground deletion sets deletionTimestamp)
    job = op.make_launcher(result["namespace"]).get(result["name"])
    assert job is None or job["metadata"].get("deletionTimestamp")


def test_deferrable_job_through_the_trigger(k8s_conn: str) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    op = operator(k8s_conn, deferrable=True)
    context = make_context(dag_id="k8s_it", run_id=f"it-deferred-{os.getpid()}")
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context)  # type: ignore[arg-type]

    async def first_event() -> dict[str, Any]:
        async for event in deferred.value.trigger.run():
            return event.payload
        raise AssertionError("the trigger yielded nothing")

    event = asyncio.run(first_event())
    assert event["status"] == "success", event
    op.execute_complete(context, event, **(deferred.value.kwargs or {}))  # type: ignore[arg-type]


def test_unpullable_image_is_reported(k8s_conn: str) -> None:
    op = operator(k8s_conn, image="registry.invalid/nightshift/none:0", image_pull_policy="Always")
    with pytest.raises(errors.MPIJobImagePullFailed, match=r"registry\.invalid"):
        op.execute(make_context(dag_id="k8s_it", run_id=f"it-pull-{os.getpid()}"))  # type: ignore[arg-type]
