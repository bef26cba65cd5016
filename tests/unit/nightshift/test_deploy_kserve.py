"""The KServe target against a fake CustomObjectsApi that behaves like the API server + KServe controller.

The fake keeps objects, bumps `metadata.generation` on spec changes, applies JSON merge patches (what
the real client sends for dict bodies), raises kubernetes' ApiException with 404/409, and moves a new
revision's status through Unknown → True (or → RevisionFailed for a broken storage URI) over successive
reads. The registry is a real MLflow store.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from nightshift import registry
from nightshift.deploy import kserve
from nightshift.deploy.kserve import GROUP, PLURAL, VERSION, VERSION_ANNOTATION, deploy_kserve
from nightshift.errors import DeploymentFailed, UsageError
from nightshift.tracking import log_training_run
from tests.trained_model import write_trained_output

MODEL = "digits-ks"
NS = "models"


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class FakeCustomObjectsApi:
    def __init__(self, *, ready_after: int = 2, broken: set[str] | None = None, hang: set[str] | None = None,
                 race_on_create: bool = False) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.ready_after = ready_after
        self.broken = broken or set()
        self.hang = hang or set()
        self.race_on_create = race_on_create
        self.calls: list[tuple[str, Any]] = []
        self._pending: dict[tuple[str, str], int] = {}

    def _check(self, group: str, version: str, plural: str) -> None:
        assert (group, version, plural) == (GROUP, VERSION, PLURAL)

    def _new_revision(self, key: tuple[str, str], obj: dict[str, Any]) -> None:
        gen = obj["metadata"]["generation"]
        status = obj.setdefault("status", {})
        predictor = status.setdefault("components", {}).setdefault("predictor", {})
        predictor["latestCreatedRevision"] = f"{key[1]}-predictor-{gen:05d}"
        status["observedGeneration"] = gen
        status["conditions"] = [{"type": "Ready", "status": "Unknown", "reason": "Deploying"}]
        self._pending[key] = self.ready_after

    def _advance(self, key: tuple[str, str]) -> None:
        if key not in self._pending:
            return
        self._pending[key] -= 1
        if self._pending[key] > 0:
            return
        obj = self.objects[key]
        predictor = obj["spec"]["predictor"]
        uri = predictor["model"]["storageUri"]
        status = obj["status"]
        revisions = status["components"]["predictor"]
        if uri in self.hang:
            return
        del self._pending[key]
        if uri in self.broken:
            status["conditions"] = [{"type": "PredictorReady", "status": "False", "reason": "RevisionFailed",
                                     "message": "container exited: cannot load model"},
                                    {"type": "Ready", "status": "False", "reason": "RevisionFailed"}]
            return
        revisions["latestReadyRevision"] = revisions["latestCreatedRevision"]
        if "canaryTrafficPercent" not in predictor:
            revisions["latestRolledoutRevision"] = revisions["latestCreatedRevision"]
        status["conditions"] = [{"type": "PredictorReady", "status": "True"},
                                {"type": "Ready", "status": "True"}]
        status["url"] = f"http://{key[1]}.{key[0]}.example.com"

    def get_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str,
                                     name: str) -> dict[str, Any]:
        self._check(group, version, plural)
        self.calls.append(("get", name))
        key = (namespace, name)
        if key not in self.objects:
            raise ApiException(status=404, reason="Not Found")
        self._advance(key)
        return copy.deepcopy(self.objects[key])

    def create_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str,
                                        body: dict[str, Any]) -> dict[str, Any]:
        self._check(group, version, plural)
        self.calls.append(("create", copy.deepcopy(body)))
        key = (namespace, body["metadata"]["name"])
        if self.race_on_create and key not in self.objects:
            self.race_on_create = False
            other = copy.deepcopy(body)
            other["metadata"]["annotations"][VERSION_ANNOTATION] = "0"
            other["spec"]["predictor"]["model"]["storageUri"] = "s3://elsewhere/v0"
            self._store(key, other)
        if key in self.objects:
            raise ApiException(status=409, reason="AlreadyExists")
        return self._store(key, copy.deepcopy(body))

    def _store(self, key: tuple[str, str], obj: dict[str, Any]) -> dict[str, Any]:
        obj["metadata"]["generation"] = 1
        self.objects[key] = obj
        self._new_revision(key, obj)
        return copy.deepcopy(obj)

    def patch_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str,
                                       body: dict[str, Any]) -> dict[str, Any]:
        self._check(group, version, plural)
        self.calls.append(("patch", copy.deepcopy(body)))
        key = (namespace, name)
        if key not in self.objects:
            raise ApiException(status=404, reason="Not Found")
        old = self.objects[key]
        new = merge_patch(old, body)
        if new["spec"] != old["spec"]:
            new["metadata"]["generation"] = old["metadata"]["generation"] + 1
            self.objects[key] = new
            self._new_revision(key, new)
        else:
            self.objects[key] = new
        return copy.deepcopy(self.objects[key])

    def delete_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str,
                                        name: str) -> dict[str, Any]:
        self._check(group, version, plural)
        self.calls.append(("delete", name))
        if self.objects.pop((namespace, name), None) is None:
            raise ApiException(status=404, reason="Not Found")
        return {"status": "Success"}

    def spec(self, name: str = MODEL) -> dict[str, Any]:
        return self.objects[(NS, name)]["spec"]["predictor"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, demo_data: Path) -> dict[str, Any]:
    """A real MLflow store with two registered versions of MODEL (built once for the module)."""
    import os

    home = tmp_path_factory.mktemp("kserve-home")
    old = os.environ.get("NIGHTSHIFT_HOME")
    os.environ["NIGHTSHIFT_HOME"] = str(home)
    try:
        versions = []
        for seed in (0, 1):
            out = write_trained_output(tmp_path_factory.mktemp(f"ks{seed}"), demo_data, epochs=1, seed=seed)
            run_id = log_training_run(out, experiment="kserve-unit", tags={"nightshift.run_key": f"ks{seed}"})
            versions.append(registry.register(run_id, model_name=MODEL)["version"])
    finally:
        if old is None:
            os.environ.pop("NIGHTSHIFT_HOME")
        else:
            os.environ["NIGHTSHIFT_HOME"] = old
    return {"home": home, "versions": versions}


@pytest.fixture
def env(store: dict[str, Any], nightshift_home: Path, monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(store["home"]))
    client = registry.tracking.client()
    for alias in ("champion",):
        try:
            client.delete_registered_model_alias(MODEL, alias)
        except Exception:
            pass
    return FakeClock()


def _deploy(api: FakeCustomObjectsApi, clock: FakeClock, version: str, **kwargs: Any) -> dict[str, Any]:
    return deploy_kserve(MODEL, api=api, namespace=NS, version=version,
                         storage=f"s3://models/{MODEL}/{version}", name=MODEL, poll_interval=1.0,
                         timeout=30.0, sleep=clock.sleep, clock=clock, **kwargs)


def _champion() -> str | None:
    found = registry.version_by_alias(MODEL, "champion")
    return None if found is None else str(found.version)


def test_manifest_is_an_mlflow_v1beta1_inference_service() -> None:
    body = kserve.inference_service("digits", "ns", "s3://b/m", model_version="3", canary_traffic_percent=20)
    assert body["apiVersion"] == "serving.kserve.io/v1beta1" and body["kind"] == "InferenceService"
    predictor = body["spec"]["predictor"]
    assert predictor["canaryTrafficPercent"] == 20
    assert predictor["model"] == {"modelFormat": {"name": "mlflow"}, "protocolVersion": "v2",
                                  "storageUri": "s3://b/m"}
    assert body["metadata"]["annotations"][VERSION_ANNOTATION] == "3"
    with pytest.raises(UsageError):
        kserve.inference_service("d", "ns", "s3://b/m", model_version="1", canary_traffic_percent=101)
    assert kserve.service_name("Nightshift_Digits.v2") == "nightshift-digits-v2"


def test_storage_uri_comes_from_the_registry(env: FakeClock) -> None:
    uri = kserve.storage_uri(MODEL, "1")
    assert uri.startswith("file://") or uri.startswith("models:/") or "://" in uri


def test_first_deployment_creates_waits_for_ready_and_moves_champion(env: FakeClock) -> None:
    api = FakeCustomObjectsApi(ready_after=3)
    result = _deploy(api, env, "1")
    assert result["status"] == "created" and result["url"].startswith("http://")
    assert [c[0] for c in api.calls].count("get") >= 3  # polled through Unknown until Ready
    assert "canaryTrafficPercent" not in api.spec()
    assert _champion() == "1"


def test_canary_then_promotion(env: FakeClock) -> None:
    api = FakeCustomObjectsApi()
    _deploy(api, env, "1")
    result = _deploy(api, env, "2", canary_traffic_percent=25)
    assert result["status"] == "promoted" and result["previous_version"] == "1"
    patches = [c[1] for c in api.calls if c[0] == "patch"]
    assert patches[0]["spec"]["predictor"] == {"canaryTrafficPercent": 25,
                                               "model": {"storageUri": f"s3://models/{MODEL}/2"}}
    assert patches[1] == {"spec": {"predictor": {"canaryTrafficPercent": None}}}
    assert "canaryTrafficPercent" not in api.spec()
    assert api.spec()["model"]["storageUri"] == f"s3://models/{MODEL}/2"
    assert _champion() == "2"
    again = _deploy(api, env, "2")
    assert again["status"] == "already_serving"


def test_failed_canary_rolls_back_and_champion_stays(env: FakeClock) -> None:
    api = FakeCustomObjectsApi(broken={f"s3://models/{MODEL}/2"})
    _deploy(api, env, "1")
    with pytest.raises(DeploymentFailed, match=r"RevisionFailed.*rolled back to v1"):
        _deploy(api, env, "2")
    spec = api.spec()
    assert spec["model"]["storageUri"] == f"s3://models/{MODEL}/1" and "canaryTrafficPercent" not in spec
    assert api.objects[(NS, MODEL)]["metadata"]["annotations"][VERSION_ANNOTATION] == "1"
    assert _champion() == "1"


def test_canary_never_ready_times_out_and_rolls_back(env: FakeClock) -> None:
    api = FakeCustomObjectsApi(hang={f"s3://models/{MODEL}/2"})
    _deploy(api, env, "1")
    with pytest.raises(DeploymentFailed, match="not Ready within 30s"):
        _deploy(api, env, "2")
    assert api.spec()["model"]["storageUri"] == f"s3://models/{MODEL}/1"
    assert _champion() == "1"


def test_failed_smoke_check_rolls_back(env: FakeClock) -> None:
    api = FakeCustomObjectsApi()
    _deploy(api, env, "1")

    def smoke(isvc: dict[str, Any]) -> None:
        raise DeploymentFailed("canary answered 3/10 correctly")

    with pytest.raises(DeploymentFailed, match="canary answered"):
        _deploy(api, env, "2", smoke=smoke)
    assert api.spec()["model"]["storageUri"] == f"s3://models/{MODEL}/1"
    assert _champion() == "1"


def test_failed_first_deployment_deletes_what_it_created(env: FakeClock) -> None:
    api = FakeCustomObjectsApi(broken={f"s3://models/{MODEL}/1"})
    with pytest.raises(DeploymentFailed, match="was deleted"):
        _deploy(api, env, "1")
    assert api.objects == {}
    assert _champion() is None


def test_409_on_create_rolls_out_over_the_existing_service(env: FakeClock) -> None:
    api = FakeCustomObjectsApi(race_on_create=True)
    result = _deploy(api, env, "1")
    assert result["status"] == "promoted" and result["previous_version"] == "0"
    assert api.spec()["model"]["storageUri"] == f"s3://models/{MODEL}/1"


def test_delete_ignores_404_and_other_errors_name_the_object(env: FakeClock) -> None:
    api = FakeCustomObjectsApi()
    client = kserve.InferenceServiceClient(api, NS, "gone")
    client.delete()  # nothing there: fine
    assert client.get() is None

    class Forbidden(FakeCustomObjectsApi):
        def get_namespaced_custom_object(self, *args: Any) -> dict[str, Any]:
            raise ApiException(status=403, reason="Forbidden")

    with pytest.raises(DeploymentFailed, match=r"reading InferenceService models/gone failed \(HTTP 403\)"):
        kserve.InferenceServiceClient(Forbidden(), NS, "gone").get()
