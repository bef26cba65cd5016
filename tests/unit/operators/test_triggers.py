from __future__ import annotations

import asyncio
import contextlib
import importlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from operators.triggers import MPIJobTrigger
from tests.unit.operators import fake_kubernetes as fk

NAME = "train-abc12345-try1"


def trigger(**overrides: Any) -> MPIJobTrigger:
    kwargs: dict[str, Any] = {
        "name": NAME,
        "namespace": "default",
        "submitted_at": time.time(),
        "poll_interval": 0.0,
        "startup_timeout": 60.0,
    }
    kwargs.update(overrides)
    return MPIJobTrigger(**kwargs)


def wired(trig: MPIJobTrigger, cluster: fk.FakeCluster, monkeypatch: pytest.MonkeyPatch) -> MPIJobTrigger:
    @contextlib.asynccontextmanager
    async def api_clients(self: MPIJobTrigger) -> AsyncIterator[tuple[Any, Any]]:
        api = fk.AsyncFakeApi(cluster)
        yield api, api

    monkeypatch.setattr(MPIJobTrigger, "api_clients", api_clients)
    return trig


def submit(cluster: fk.FakeCluster) -> None:
    body = {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": {"name": NAME, "labels": {}}}
    cluster.create_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", body)


async def collect(trig: MPIJobTrigger) -> list[dict[str, Any]]:
    return [event.payload async for event in trig.run()]


def test_serialize_round_trips_through_its_classpath() -> None:
    original = trigger(kubernetes_conn_id="k8s_prod", cluster_context="gpu", config_file="/k", in_cluster=False)
    classpath, kwargs = original.serialize()
    module, _, cls_name = classpath.rpartition(".")
    rebuilt = getattr(importlib.import_module(module), cls_name)(**kwargs)
    assert rebuilt.serialize() == (classpath, kwargs)
    assert classpath == "operators.triggers.MPIJobTrigger"
    assert kwargs["submitted_at"] == original.submitted_at


def test_success_event(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = fk.FakeCluster()
    submit(cluster)
    events = asyncio.run(collect(wired(trigger(), cluster, monkeypatch)))
    assert events == [
        {
            "status": "success",
            "name": NAME,
            "namespace": "default",
            "phase": "Succeeded",
            "error_kind": None,
            "message": f"MPIJob {NAME} succeeded",
        }
    ]


def test_oom_yields_a_failed_event_naming_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = fk.FakeCluster(fk.worker_oom)
    submit(cluster)
    (event,) = asyncio.run(collect(wired(trigger(), cluster, monkeypatch)))
    assert event["status"] == "failed"
    assert event["error_kind"] == "MPIJobWorkerOOMKilled"
    assert f"{NAME}-worker-1" in event["message"]


def test_startup_timeout_counts_from_submission(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = fk.FakeCluster(fk.unschedulable)
    submit(cluster)
    # submitted 2 minutes ago (e.g. before the triggerer restarted): the deadline is already past
    trig = wired(trigger(submitted_at=time.time() - 120, startup_timeout=60), cluster, monkeypatch)
    (event,) = asyncio.run(collect(trig))
    assert event["status"] == "failed" and event["error_kind"] == "MPIJobUnschedulable"


def test_deleted_job_yields_failed_event(monkeypatch: pytest.MonkeyPatch) -> None:
    (event,) = asyncio.run(collect(wired(trigger(), fk.FakeCluster(), monkeypatch)))
    assert event["status"] == "failed" and event["error_kind"] == "MPIJobDeleted"


def test_api_errors_become_an_error_event_never_an_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    from kubernetes.client.exceptions import ApiException

    cluster = fk.FakeCluster()
    submit(cluster)
    cluster.fail_gets_with = ApiException(status=500, reason="Internal Server Error")
    (event,) = asyncio.run(collect(wired(trigger(api_retry_seconds=0.05), cluster, monkeypatch)))
    assert event["status"] == "error"
    assert NAME in event["message"] and "lost track" in event["message"]


def test_a_blip_of_the_api_server_is_tolerated(monkeypatch: pytest.MonkeyPatch) -> None:
    from kubernetes.client.exceptions import ApiException

    cluster = fk.FakeCluster()
    submit(cluster)
    calls = {"n": 0}
    real_get = cluster.get_namespaced_custom_object

    def flaky_get(*args: Any, **kwargs: Any) -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise ApiException(status=503, reason="Service Unavailable")
        return real_get(*args, **kwargs)

    monkeypatch.setattr(cluster, "get_namespaced_custom_object", flaky_get)
    (event,) = asyncio.run(collect(wired(trigger(api_retry_backoff=0.001), cluster, monkeypatch)))
    assert event["status"] == "success"


def test_unreachable_cluster_is_an_error_event() -> None:
    # No fake: the real hook finds no kubeconfig/connection; the trigger still yields, never raises.
    trig = trigger(kubernetes_conn_id=None, config_file="/nonexistent/kubeconfig")
    (event,) = asyncio.run(collect(trig))
    assert event["status"] == "error"


def test_the_trigger_keeps_polling_through_an_outage_shorter_than_api_retry_seconds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from urllib3.exceptions import ProtocolError

    cluster = fk.FakeCluster()
    submit(cluster)
    # more errors in a row than the old limit of 3: a rolling restart of the API server
    cluster.inject("get_namespaced_custom_object", *(fk.api_error(status) for status in (503, 500, 429, 502, 504)))
    cluster.inject("list_namespaced_pod", ProtocolError("Connection aborted.", ConnectionResetError(104)))
    trig = trigger(api_retry_seconds=30.0, api_retry_backoff=0.001)
    (event,) = asyncio.run(collect(wired(trig, cluster, monkeypatch)))
    assert event["status"] == "success"


def test_an_outage_past_api_retry_seconds_is_an_error_event_naming_how_long(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = fk.FakeCluster()
    submit(cluster)
    cluster.fail_gets_with = fk.api_error(503)
    trig = trigger(api_retry_seconds=0.2, api_retry_backoff=0.01)
    started = time.monotonic()
    (event,) = asyncio.run(collect(wired(trig, cluster, monkeypatch)))
    assert time.monotonic() - started >= 0.2  # it did keep trying for api_retry_seconds
    assert event["status"] == "error" and "for 0.2s" in event["message"] and "503" in event["message"]


def test_a_permanent_api_error_is_an_error_event_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = fk.FakeCluster()
    submit(cluster)
    cluster.fail_gets_with = fk.api_error(403)
    (event,) = asyncio.run(collect(wired(trigger(api_retry_seconds=3600.0), cluster, monkeypatch)))
    assert event["status"] == "error" and "403" in event["message"]


def test_api_retry_seconds_survives_serialization() -> None:
    _classpath, kwargs = trigger(api_retry_seconds=42.0, api_retry_backoff=0.5).serialize()
    assert (kwargs["api_retry_seconds"], kwargs["api_retry_backoff"]) == (42.0, 0.5)
    assert MPIJobTrigger(**kwargs).api_retry_seconds == 42.0
