"""The KServe target against a fake CustomObjectsApi that behaves like the API server + KServe controller.

The fake keeps objects, bumps `metadata.generation` on spec changes, applies JSON merge patches (what
the real client sends for dict bodies), raises kubernetes' ApiException with 404/409, answers 422 to an
object KServe's published InferenceService CRD (v1beta1, made strict: no unknown fields) does not accept,
and moves a new revision's status through Unknown → True (or → RevisionFailed for a broken storage URI)
over successive reads. The registry is a real MLflow store.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from nightshift import registry
from nightshift.deploy import deploy, kserve
from nightshift.deploy.kserve import GROUP, PLURAL, VERSION, VERSION_ANNOTATION, deploy_kserve
from nightshift.errors import DeploymentFailed, UsageError
from nightshift.tracking import log_training_run
from tests.conftest import REPO, SHARED
from tests.trained_model import write_trained_output
from tests.unit.operators.conftest import strict

MODEL = "digits-ks"
NS = "models"
ISVC_CRD = SHARED / "schemas" / "serving.kserve.io_inferenceservices.yaml"
KSERVE_DIR = REPO / "deploy" / "kserve"


@functools.cache
def _isvc_validator() -> Callable[[dict[str, Any]], None] | None:
    """Validate against the CRD's v1beta1 schema (picked by name), strict; None without ../shared."""
    if not ISVC_CRD.exists():
        return None
    import jsonschema

    crd = yaml.safe_load(ISVC_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == VERSION]
    validator = jsonschema.Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))

    def check(obj: dict[str, Any]) -> None:
        validator.validate({k: v for k, v in obj.items() if k != "status"})

    return check


@pytest.fixture
def validate_isvc() -> Callable[[dict[str, Any]], None]:
    check = _isvc_validator()
    if check is None:
        pytest.skip(f"InferenceService CRD not found at {ISVC_CRD} (needs ../shared/schemas beside the repo)")
    return check


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


MODE_ANNOTATION = "serving.kserve.io/deploymentMode"
LEGACY_MODES = {"Serverless": "Knative", "RawDeployment": "Standard"}


class FakeCustomObjectsApi:
    """`default_mode` is the cluster's `deploy.defaultDeploymentMode` (inferenceservice-config ConfigMap)."""

    def __init__(self, *, ready_after: int = 2, broken: set[str] | None = None, hang: set[str] | None = None,
                 race_on_create: bool = False, default_mode: str = "Knative", deployment_generations: int = 0) -> None:
        self.default_mode = default_mode
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        # Standard mode: the Deployments the controller made, by name. `deployment_generations`: how far their
        # generations are ahead of a fresh one's (an HPA that changed spec.replicas bumps it each time).
        self.deployments: dict[str, dict[str, Any]] = {}
        self.deployment_generations = deployment_generations
        self._resource_version = 0
        self.ready_after = ready_after
        self.broken = broken or set()
        self.hang = hang or set()
        self.race_on_create = race_on_create
        self.calls: list[tuple[str, Any]] = []
        self._pending: dict[tuple[str, str], int] = {}

    def _check(self, group: str, version: str, plural: str) -> None:
        assert (group, version, plural) == (GROUP, VERSION, PLURAL)

    def _default(self, obj: dict[str, Any]) -> None:
        """KServe's defaulting webhook: legacy mode names become current ones; with a Standard or ModelMesh
        cluster default, an object without the annotation gets it (a Knative default adds none)."""
        annotations = obj["metadata"].setdefault("annotations", {})
        mode = annotations.get(MODE_ANNOTATION)
        if mode in LEGACY_MODES:
            annotations[MODE_ANNOTATION] = LEGACY_MODES[mode]
        elif mode is None and self.default_mode in {"Standard", "ModelMesh"}:
            annotations[MODE_ANNOTATION] = self.default_mode

    def _webhook(self, new: dict[str, Any], old: dict[str, Any] | None) -> None:
        """KServe's validating webhook (pkg/apis/serving/v1beta1/inference_service_validation.go), the rules a
        rollout can break."""
        def refuse(message: str) -> None:
            raise ApiException(status=400, reason=f"admission webhook denied the request: {message}")

        annotation = new["metadata"].get("annotations", {}).get(MODE_ANNOTATION)
        if old is not None:
            recorded = old.get("status", {}).get("deploymentMode")
            recorded = LEGACY_MODES.get(recorded or "", recorded)
            if recorded and annotation is not None and annotation != recorded:
                refuse(f"update rejected: deploymentMode cannot be changed from '{recorded}' to '{annotation}'")
            old_predictor, new_predictor = old["spec"]["predictor"], new["spec"]["predictor"]
            if old_predictor.get("name") != new_predictor.get("name") and \
                    old_predictor["model"]["storageUri"] == new_predictor["model"]["storageUri"]:
                refuse("predictor.name change requires a model change (e.g. storageUri)")
        if "name" in new["spec"]["predictor"]["model"]:
            refuse("the 'name' field is not allowed in standard predictor")
        canaries = new["spec"].get("canary") or []
        if canaries and annotation != "Standard":
            refuse("canary is only supported in Standard deployment mode")
        names = [c["predictor"].get("name") for c in canaries]
        if None in names or len(set(names)) != len(names) or new["spec"]["predictor"].get("name") in names:
            refuse(f"canary predictor names {names} must be set, unique and differ from the stable one")
        if sum(c["trafficPercent"] for c in canaries) > 100:
            refuse("sum of canary trafficPercent values must be <= 100")

    def _mode(self, obj: dict[str, Any]) -> str:
        annotation = obj["metadata"].get("annotations", {}).get(MODE_ANNOTATION)
        return LEGACY_MODES.get(annotation or "", annotation or self.default_mode)

    def _bump(self, obj: dict[str, Any]) -> None:
        """The API server gives every write (spec, metadata or the controller's status) a new resourceVersion."""
        self._resource_version += 1
        obj["metadata"]["resourceVersion"] = str(self._resource_version)

    def _new_revision(self, key: tuple[str, str], obj: dict[str, Any]) -> None:
        status = obj.setdefault("status", {})
        if self._mode(obj) == "Standard":  # the controller's status comes on its next pass (a read), not now
            return
        gen = obj["metadata"]["generation"]
        status["deploymentMode"] = self._mode(obj)
        predictor = status.setdefault("components", {}).setdefault("predictor", {})
        predictor["latestCreatedRevision"] = f"{key[1]}-predictor-{gen:05d}"
        status["observedGeneration"] = gen
        status["conditions"] = [{"type": "Ready", "status": "Unknown", "reason": "Deploying"}]
        self._pending[key] = self.ready_after

    def _advance(self, key: tuple[str, str]) -> None:
        if key not in self.objects:
            return
        before = copy.deepcopy(self.objects[key].get("status"))
        if self._mode(self.objects[key]) == "Standard":
            self._reconcile_standard(key)
        else:
            self._advance_knative(key)
        if self.objects[key].get("status") != before:
            self._bump(self.objects[key])

    # --- Standard (RawDeployment) mode, as KServe's controller runs it (kserve/kserve at aaac4e2,
    # pkg/controller/v1beta1/inferenceservice/components/predictor.go, pkg/apis/serving/v1beta1/
    # inference_service_status.go); one controller pass per read:
    # - every predictor (the stable one and each spec.canary entry) is a Deployment `{isvc}[-{name}]-predictor`
    #   whose generation moves only when *its* pod template changes (the template carries the service's
    #   annotations);
    # - status.observedGeneration is the stable Deployment's (PropagateRawStatus), not the service's
    #   generation, and there is no latestCreatedRevision/latestReadyRevision;
    # - Ready is the stable Deployment's Available (old pods keep it True through a rolling update), and the
    #   predictor's url is set only while it is Available;
    # - a canary is ready when its Deployment has an available replica;
    # - Deployments of the service that are neither the stable one nor a canary are deleted at once
    #   (reconcileCanaryDeployments' orphan cleanup): promotion deletes the old stable Deployment.

    def _upsert(self, owner: str, name: str, model: dict[str, Any], annotations: dict[str, str]) -> dict[str, Any]:
        uri = model["storageUri"]
        template = json.dumps({"model": {k: v for k, v in model.items() if k != "name"},
                               "annotations": annotations}, sort_keys=True)
        dep = self.deployments.get(name)
        if dep is None:
            dep = self.deployments[name] = {"owner": owner, "generation": 1 + self.deployment_generations,
                                            "template": template, "serving": None, "rollout": [uri, self.ready_after]}
        elif dep["template"] != template:  # a rolling update: the old pods serve until the new ones are ready
            dep["generation"] += 1
            dep["template"] = template
            dep["rollout"] = [uri, self.ready_after]
        if dep["rollout"] is not None:
            dep["rollout"][1] -= 1
            if dep["rollout"][1] <= 0 and dep["rollout"][0] not in self.broken | self.hang:
                dep["serving"], dep["rollout"] = dep["rollout"][0], None
        return dep

    @staticmethod
    def stable_deployment(name: str, predictor: dict[str, Any]) -> str:
        return f"{name}-{predictor['name']}-predictor" if predictor.get("name") else f"{name}-predictor"

    def _reconcile_standard(self, key: tuple[str, str]) -> None:
        obj = self.objects[key]
        name = obj["metadata"]["name"]
        annotations = dict(obj["metadata"].get("annotations") or {})
        spec = obj["spec"]
        stable_model = spec["predictor"]["model"]
        canaries = spec.get("canary") or []
        stable_name = self.stable_deployment(name, spec["predictor"])
        expected = {stable_name}
        canary_statuses = []
        for canary in canaries:  # reconcileCanaryDeployments: canaries first
            dep_name = f"{name}-{canary['predictor']['name']}-predictor"
            expected.add(dep_name)
            dep = self._upsert(name, dep_name, {**stable_model, **canary["predictor"]["model"]}, annotations)
            canary_statuses.append({"name": canary["predictor"]["name"], "trafficPercent": canary["trafficPercent"],
                                    "ready": dep["serving"] is not None})
        for dep_name in [d for d, dep in self.deployments.items() if dep["owner"] == name and d not in expected]:
            del self.deployments[dep_name]  # orphan cleanup
        stable = self._upsert(name, stable_name, stable_model, annotations)  # reconcileRawDeployment
        available = stable["serving"] is not None
        status = obj["status"]
        status["deploymentMode"] = "Standard"
        status["observedGeneration"] = stable["generation"]  # PropagateRawStatus
        status["components"] = {"predictor": {"url": f"http://{stable_name}.{key[0]}"} if available else {}}
        conditions = [{"type": "PredictorReady", "status": str(available)},
                      {"type": "Ready", "status": str(available)}]
        if canaries:
            all_ready = all(c["ready"] for c in canary_statuses)
            status["canaryStatuses"] = canary_statuses
            conditions.append({"type": "CanaryPredictorReady", "status": str(all_ready),
                               "reason": "AllCanariesReady" if all_ready else "CanariesNotReady"})
        else:
            status.pop("canaryStatuses", None)
        status["conditions"] = conditions
        status["url"] = f"http://{name}.{key[0]}.example.com"

    def serving(self, name: str = MODEL) -> str | None:
        """Standard mode: what the stable Deployment's available pods serve (None: no pod answers), after one
        controller pass."""
        self.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)
        dep = self.deployments.get(self.stable_deployment(name, self.objects[(NS, name)]["spec"]["predictor"]))
        return None if dep is None else dep["serving"]

    # --- Knative (Serverless) mode: a revision per spec change, Unknown -> True over `ready_after` reads.

    def _advance_knative(self, key: tuple[str, str]) -> None:
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
        # Knative splits traffic by canaryTrafficPercent; Standard (raw Deployments) ignores the field and
        # rolls the new model out to every request at once.
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

    def _admit(self, obj: dict[str, Any]) -> None:
        """What the API server does with the CRD's schema: 422 for an object it does not accept."""
        check = _isvc_validator()
        if check is None:
            return
        import jsonschema

        try:
            check(obj)
        except jsonschema.ValidationError as err:
            raise ApiException(status=422, reason=f"Unprocessable Entity: {err.message}") from err

    def create_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str,
                                        body: dict[str, Any]) -> dict[str, Any]:
        self._check(group, version, plural)
        self.calls.append(("create", copy.deepcopy(body)))
        body = copy.deepcopy(body)
        self._default(body)
        self._admit(body)
        self._webhook(body, None)
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
        self._bump(obj)
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
        precondition = (body.get("metadata") or {}).get("resourceVersion")
        if precondition is not None and precondition != old["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason=f'Conflict: Operation cannot be fulfilled on inferenceservices.'
                                                  f'serving.kserve.io "{name}": the object has been modified; please '
                                                  f'apply your changes to the latest version and try again')
        new = merge_patch(old, body)
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        self._default(new)
        self._admit(new)
        self._webhook(new, old)
        if new == old:  # a no-op patch writes nothing
            return copy.deepcopy(old)
        self._bump(new)
        self.objects[key] = new
        if new["spec"] != old["spec"]:
            new["metadata"]["generation"] = old["metadata"]["generation"] + 1
            self._new_revision(key, new)
        return copy.deepcopy(self.objects[key])

    def delete_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str,
                                        name: str) -> dict[str, Any]:
        self._check(group, version, plural)
        self.calls.append(("delete", name))
        if self.objects.pop((namespace, name), None) is None:
            raise ApiException(status=404, reason="Not Found")
        for dep_name in [d for d, dep in self.deployments.items() if dep["owner"] == name]:
            del self.deployments[dep_name]  # owner references: the garbage collector deletes them
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

    from nightshift import tracking

    home = tmp_path_factory.mktemp("kserve-home")
    old = os.environ.get("NIGHTSHIFT_HOME")
    os.environ["NIGHTSHIFT_HOME"] = str(home)
    # MLflow is configured once per process: a store built for a second module (test_kserve_faults shares this
    # fixture) must not register into the first module's home.
    configured, tracking._configured = tracking._configured, None
    try:
        versions = []
        for seed in (0, 1):
            out = write_trained_output(tmp_path_factory.mktemp(f"ks{seed}"), demo_data, epochs=1, seed=seed)
            run_id = log_training_run(out, experiment="kserve-unit", tags={"nightshift.run_key": f"ks{seed}"})
            versions.append(registry.register(run_id, model_name=MODEL)["version"])
    finally:
        tracking._configured = configured
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
    assert kserve.service_name("nightshift-digits") == "nightshift-digits"  # a DNS label already: kept


def test_each_model_gets_a_service_of_its_own() -> None:
    """Issue 34: churn_v2, churn.v2 and Churn-V2 mapped to one InferenceService, as did two long names sharing
    their first 45 characters."""
    import re

    names = ["churn_v2", "churn.v2", "Churn-V2", "churn-v2", "a" * 45 + "-one", "a" * 45 + "-two", "9lives"]
    services = [kserve.service_name(n) for n in names]
    assert len(set(services)) == len(names), services
    for service in services:
        assert re.fullmatch(r"[a-z]([a-z0-9-]*[a-z0-9])?", service) and len(service) <= 45, service


def test_a_rollout_never_replaces_the_service_of_another_model(env: FakeClock) -> None:
    api = FakeCustomObjectsApi(ready_after=1)
    _deploy(api, env, "1")  # MODEL's service, annotated with its name
    before = copy.deepcopy(api.spec())
    with pytest.raises(DeploymentFailed, match=rf"serves another model, '{MODEL}'.*nothing was changed"):
        deploy_kserve("someone-else", api=api, namespace=NS, version="1", storage=f"s3://models/{MODEL}/1",
                      name=MODEL, poll_interval=1.0, timeout=30.0, sleep=env.sleep, clock=env)
    assert api.spec() == before


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
    assert patches[1]["spec"] == {"predictor": {"canaryTrafficPercent": None}}
    # The promotion names the version it makes serve, and every patch is guarded by a resourceVersion.
    assert patches[0]["metadata"]["annotations"].get(VERSION_ANNOTATION) is None
    assert patches[1]["metadata"]["annotations"][VERSION_ANNOTATION] == "2"
    assert all(p["metadata"].get("resourceVersion") for p in patches)
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


# --- the manifests against KServe's CRD -------------------------------------------------------------


def test_every_manifest_the_target_builds_validates_strictly_against_the_crd(
        validate_isvc: Callable[[dict[str, Any]], None]) -> None:
    full = kserve.inference_service(
        "digits", "ns", "s3://b/m", model_version="3", canary_traffic_percent=20, service_account="sa",
        labels={"team": "ml"}, runtime=kserve.DEFAULT_RUNTIME,
        resources={"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}})
    validate_isvc(full)
    validate_isvc(kserve.inference_service("digits", "ns", "pvc://claim/m", model_version="1"))
    import jsonschema

    misspelt = copy.deepcopy(full)
    misspelt["spec"]["predictor"]["model"]["storageURI"] = misspelt["spec"]["predictor"]["model"].pop("storageUri")
    with pytest.raises(jsonschema.ValidationError, match="storageURI"):
        validate_isvc(misspelt)


def test_the_example_in_deploy_kserve_validates_and_names_the_nightshift_runtime(
        validate_isvc: Callable[[dict[str, Any]], None]) -> None:
    example = yaml.safe_load((KSERVE_DIR / "inferenceservice-example.yaml").read_text())
    validate_isvc(example)
    assert example["spec"]["predictor"]["model"]["runtime"] == kserve.DEFAULT_RUNTIME
    assert kserve.is_fetchable(example["spec"]["predictor"]["model"]["storageUri"])


def test_the_serving_runtime_runs_the_serving_image_with_mlservers_mlflow_runtime() -> None:
    runtime = yaml.safe_load((KSERVE_DIR / "servingruntime.yaml").read_text())
    assert (runtime["apiVersion"], runtime["kind"]) == ("serving.kserve.io/v1alpha1", "ServingRuntime")
    assert runtime["metadata"]["name"] == kserve.DEFAULT_RUNTIME
    assert runtime["metadata"]["namespace"] == "nightshift"
    assert [f["name"] for f in runtime["spec"]["supportedModelFormats"]] == ["mlflow"]
    assert "v2" in runtime["spec"]["protocolVersions"]
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"
    assert container["image"].rsplit("/", 1)[-1].startswith("nightshift-serving:")
    env = {e["name"]: e["value"] for e in container["env"]}
    # mlserver_mlflow.MLflowRuntime answering a refused request 400 (images/serving/nightshift_mlserver.py)
    assert env["MLSERVER_MODEL_IMPLEMENTATION"] == "nightshift_mlserver.NightshiftMLflowRuntime"
    assert env["MLSERVER_MODEL_URI"] == "/mnt/models" and env["MLSERVER_MODEL_NAME"] == "{{.Name}}"
    assert "docker build -f images/serving/Dockerfile" in (KSERVE_DIR / "servingruntime.yaml").read_text()
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": {"containers": [container]}}
    kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)


def test_the_predictor_names_the_runtime_unless_told_otherwise(env: FakeClock,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeCustomObjectsApi()
    _deploy(api, env, "1")
    assert api.spec()["model"]["runtime"] == "nightshift-mlserver-torch"
    monkeypatch.setenv("NIGHTSHIFT_KSERVE_RUNTIME", "")
    api = FakeCustomObjectsApi()
    _deploy(api, env, "1")
    assert "runtime" not in api.spec()["model"]
    monkeypatch.setenv("NIGHTSHIFT_KSERVE_RUNTIME", "my-runtime")
    api = FakeCustomObjectsApi()
    _deploy(api, env, "1")
    assert api.spec()["model"]["runtime"] == "my-runtime"


# --- the storage URI must be one KServe can fetch ---------------------------------------------------


@pytest.mark.parametrize(("uri", "fetchable"), [
    ("s3://mlflow/1/models/m-1/artifacts", True),
    ("gs://bucket/models/m-1/artifacts", True),
    ("pvc://nightshift-workspace/mlartifacts/1/models/m-1/artifacts", True),
    ("hdfs://nn/models/m", True),
    ("webhdfs://nn/models/m", True),
    ("https://acct.blob.core.windows.net/container/models/m", True),
    ("file:///home/me/.nightshift/mlartifacts/1/models/m-1/artifacts", False),
    ("/home/me/.nightshift/mlartifacts/1", False),
    ("mlflow-artifacts:/1/models/m-1/artifacts", False),
    ("https://mlflow.example.com/artifacts/1", False),  # downloaded as one file, not a folder
    ("models:/digits/1", False),
])
def test_which_locations_the_storage_initializer_can_fetch(uri: str, fetchable: bool) -> None:
    assert kserve.is_fetchable(uri) is fetchable


def test_a_local_artifact_store_is_refused_before_anything_is_created(env: FakeClock) -> None:
    api = FakeCustomObjectsApi()
    location = kserve.storage_uri(MODEL, "1")
    assert location.startswith("file://")  # the embedded default store
    with pytest.raises(DeploymentFailed) as info:
        deploy("kserve", MODEL, version="1", kserve_api=api, namespace=NS, name=MODEL)
    message = str(info.value)
    assert message.startswith("deploy_target=kserve refused: the artifact location of digits-ks v1 is "
                              f"{location}")
    assert "--default-artifact-root s3://" in message and "NIGHTSHIFT_KSERVE_STORAGE_MAP" in message
    assert api.calls == [] and _champion() is None


def test_a_proxied_mlflow_artifact_store_is_refused_with_how_to_map_it() -> None:
    with pytest.raises(DeploymentFailed, match=r"mlflow-artifacts:/1/m.*--artifacts-destination.*"
                                               r"NIGHTSHIFT_KSERVE_STORAGE_MAP='mlflow-artifacts:/=s3://"):
        kserve.kserve_storage_uri("mlflow-artifacts:/1/m", what="m v1")


def test_the_storage_map_turns_the_shared_workspace_into_a_pvc_uri(env: FakeClock, store: dict[str, Any],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    location = kserve.storage_uri(MODEL, "1")
    home = Path(store["home"]).as_uri() + "/"
    assert location.startswith(home)
    monkeypatch.setenv("NIGHTSHIFT_KSERVE_STORAGE_MAP", f"s3://unused/=gs://x/ ; {home}=pvc://nightshift-workspace/")
    api = FakeCustomObjectsApi()
    result = deploy_kserve(MODEL, api=api, namespace=NS, version="1", name=MODEL, poll_interval=1.0,
                           timeout=30.0, sleep=env.sleep, clock=env)
    expected = "pvc://nightshift-workspace/" + location[len(home):]
    assert result["storage_uri"] == expected and api.spec()["model"]["storageUri"] == expected
    assert _champion() == "1"
    monkeypatch.setenv("NIGHTSHIFT_KSERVE_STORAGE_MAP", f"{home}=https://files.example.com/")
    with pytest.raises(DeploymentFailed, match=r"https://files\.example\.com/\S+ \(mapped from file://"):
        deploy_kserve(MODEL, api=FakeCustomObjectsApi(), namespace=NS, version="1", name=MODEL)


def test_a_malformed_storage_map_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="'file:///nightshift/' is not FROM=TO"):
        kserve.storage_map("file:///nightshift/")
    assert kserve.storage_map(" a=b;c=d=e ") == [("a", "b"), ("c", "d=e")]


# --- the deployment mode decides what a canary is ----------------------------------------------------


def _stable_during_the_canary(api: FakeCustomObjectsApi) -> Callable[[dict[str, Any]], None]:
    """A smoke check that records what serves while the canary is being checked."""
    def smoke(isvc: dict[str, Any]) -> None:
        api.seen_by_smoke = copy.deepcopy(isvc)  # type: ignore[attr-defined]

    return smoke


def test_standard_mode_rolls_out_through_spec_canary_and_promotes_it(env: FakeClock) -> None:
    api = FakeCustomObjectsApi(default_mode="Standard")
    _deploy(api, env, "1")
    result = _deploy(api, env, "2", canary_traffic_percent=25, smoke=_stable_during_the_canary(api))
    assert result["status"] == "promoted" and result["deployment_mode"] == "Standard"
    during = api.seen_by_smoke  # type: ignore[attr-defined]
    # While the canary is checked, the stable predictor still serves v1 and v2 runs beside it.
    assert during["spec"]["predictor"]["model"]["storageUri"] == f"s3://models/{MODEL}/1"
    (canary,) = during["spec"]["canary"]
    assert canary["trafficPercent"] == 25 and canary["predictor"]["name"] == "v2"
    assert canary["predictor"]["model"]["storageUri"] == f"s3://models/{MODEL}/2"
    assert during["status"]["canaryStatuses"] == [{"name": "v2", "trafficPercent": 25, "ready": True}]
    patches = [c[1] for c in api.calls if c[0] == "patch"]
    assert not [p for p in patches if "canaryTrafficPercent" in str(p)]  # Standard ignores it: never sent
    after = api.objects[(NS, MODEL)]
    assert "canary" not in after["spec"] and api.spec()["name"] == "v2"
    assert api.spec()["model"]["storageUri"] == f"s3://models/{MODEL}/2"
    assert _champion() == "2"
    assert _deploy(api, env, "2")["status"] == "already_serving"
    third = _deploy(api, env, "1", smoke=_stable_during_the_canary(api))  # a later rollout: a new canary name
    assert third["status"] == "promoted" and api.spec()["name"] == "v1"


def test_standard_mode_rolls_back_by_removing_the_canary(env: FakeClock) -> None:
    api = FakeCustomObjectsApi(default_mode="Standard")
    _deploy(api, env, "1")

    def smoke(isvc: dict[str, Any]) -> None:
        raise DeploymentFailed("canary answered 3/10 correctly")

    with pytest.raises(DeploymentFailed, match=r"canary answered.*rolled back to v1"):
        _deploy(api, env, "2", smoke=smoke)
    after = api.objects[(NS, MODEL)]
    assert "canary" not in after["spec"] and "name" not in api.spec()
    assert api.spec()["model"]["storageUri"] == f"s3://models/{MODEL}/1"
    assert after["metadata"]["annotations"][VERSION_ANNOTATION] == "1"
    assert _champion() == "1"


def test_standard_mode_a_canary_that_never_gets_ready_times_out_and_is_removed(env: FakeClock) -> None:
    api = FakeCustomObjectsApi(default_mode="Standard", broken={f"s3://models/{MODEL}/2"})
    _deploy(api, env, "1")
    with pytest.raises(DeploymentFailed, match=r"not Ready within 30s \(last: canary v2 not ready"):
        _deploy(api, env, "2")
    assert "canary" not in api.objects[(NS, MODEL)]["spec"]
    assert api.spec()["model"]["storageUri"] == f"s3://models/{MODEL}/1" and _champion() == "1"


def test_the_legacy_mode_names_are_understood(env: FakeClock) -> None:
    for legacy, standard in (("RawDeployment", True), ("Serverless", False)):
        api = FakeCustomObjectsApi(default_mode="Knative")
        _deploy(api, env, "1")
        api.objects[(NS, MODEL)]["metadata"]["annotations"][MODE_ANNOTATION] = legacy
        api.objects[(NS, MODEL)]["status"]["deploymentMode"] = legacy  # as an older controller recorded it
        _deploy(api, env, "2", smoke=_stable_during_the_canary(api))
        during = api.seen_by_smoke["spec"]  # type: ignore[attr-defined]
        assert ("canary" in during) is standard, legacy
        assert ("canaryTrafficPercent" in during["predictor"]) is not standard, legacy


def test_a_mode_without_a_canary_is_refused_before_anything_changes(env: FakeClock) -> None:
    api = FakeCustomObjectsApi(default_mode="ModelMesh")
    _deploy(api, env, "1")
    with pytest.raises(DeploymentFailed, match=r"deployment mode ModelMesh.*no canary rollout.*Standard.*Knative"):
        _deploy(api, env, "2")
    assert [c for c in api.calls if c[0] == "patch"] == []
    assert api.spec()["model"]["storageUri"] == f"s3://models/{MODEL}/1" and _champion() == "1"


def test_the_configured_mode_is_written_on_creation_and_checked(env: FakeClock,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIGHTSHIFT_KSERVE_DEPLOYMENT_MODE", "Standard")
    api = FakeCustomObjectsApi(default_mode="Knative")
    _deploy(api, env, "1")
    assert api.objects[(NS, MODEL)]["metadata"]["annotations"][MODE_ANNOTATION] == "Standard"
    _deploy(api, env, "2")
    assert api.spec()["name"] == "v2"  # promoted from spec.canary
    monkeypatch.setenv("NIGHTSHIFT_KSERVE_DEPLOYMENT_MODE", "Raw")
    with pytest.raises(UsageError, match="NIGHTSHIFT_KSERVE_DEPLOYMENT_MODE 'Raw' is not a KServe deployment mode"):
        _deploy(FakeCustomObjectsApi(), env, "1")


def test_the_mode_of_a_service_is_its_status_then_its_annotation_then_the_setting() -> None:
    def isvc(status: str | None = None, annotation: str | None = None) -> dict[str, Any]:
        return {"metadata": {"name": "m", "namespace": "ns",
                             "annotations": {MODE_ANNOTATION: annotation} if annotation else {}},
                "status": {"deploymentMode": status} if status else {}}

    assert kserve.deployment_mode(isvc("Knative", "Standard"), None) == "Knative"
    assert kserve.deployment_mode(isvc(None, "RawDeployment"), "Knative") == "Standard"
    assert kserve.deployment_mode(isvc(), "Standard") == "Standard"
    with pytest.raises(DeploymentFailed, match=r"cannot tell the deployment mode of InferenceService ns/m.*"
                                               r"NIGHTSHIFT_KSERVE_DEPLOYMENT_MODE.*defaultDeploymentMode"):
        kserve.deployment_mode(isvc(), None)


def test_both_rollouts_build_objects_the_crd_accepts(validate_isvc: Callable[[dict[str, Any]], None]) -> None:
    stable = kserve.inference_service("digits", "ns", "s3://b/1", model_version="1", runtime=kserve.DEFAULT_RUNTIME,
                                      deployment_mode="Standard")
    validate_isvc(stable)
    predictor = stable["spec"]["predictor"]
    with_canary = merge_patch(stable, kserve.canary_patch("Standard", predictor, "s3://b/2", "2", 10))
    validate_isvc(with_canary)
    assert with_canary["spec"]["canary"][0]["predictor"]["name"] == "v2"
    validate_isvc(merge_patch(with_canary, kserve.promote_patch("Standard", with_canary["spec"]["canary"][0])))
    knative = merge_patch(stable, kserve.canary_patch("Knative", predictor, "s3://b/2", "2", 10))
    validate_isvc(knative)
    assert knative["spec"]["predictor"]["canaryTrafficPercent"] == 10


def test_the_declared_range_policy_reaches_the_predictor_container_and_its_canaries(
        validate_isvc: Callable[[dict[str, Any]], None]) -> None:
    """Issue 34: serving's range policy is declared per pipeline (deploy.options.range_policy); on KServe it is the
    predictor container's environment, on creation and in each canary, in objects the CRD accepts."""
    env = [{"name": "NIGHTSHIFT_SERVING_RANGE_POLICY", "value": "refuse"}]
    body = kserve.inference_service("digits", "ns", "s3://b/m", model_version="3", range_policy="refuse")
    validate_isvc(body)
    assert body["spec"]["predictor"]["model"]["env"] == env
    assert "env" not in kserve.inference_service("d", "ns", "s3://b/m", model_version="1")["spec"]["predictor"]["model"]
    stable = body["spec"]["predictor"]
    knative = kserve.canary_patch(kserve.KNATIVE, stable, "s3://b/n", "4", 10, range_policy="accept")
    assert knative["spec"]["predictor"]["model"]["env"] == [{**env[0], "value": "accept"}]
    standard = kserve.canary_patch(kserve.STANDARD, stable, "s3://b/n", "4", 10, range_policy="refuse")
    assert standard["spec"]["canary"][0]["predictor"]["model"]["env"] == env
    with pytest.raises(UsageError, match=r"range_policy 'clip': use one of accept, refuse"):
        kserve.inference_service("d", "ns", "s3://b/m", model_version="1", range_policy="clip")


def test_a_rolled_back_canary_of_another_model_leaves_the_service_its_owner(env: FakeClock) -> None:
    """Review: the canary patch named the canary's model on the service; a rollback left that name, and the
    model that served it was refused its next rollout."""
    from nightshift.deploy.kserve import MODEL_ANNOTATION

    api = FakeCustomObjectsApi()
    _deploy(api, env, "1")
    (obj,) = api.objects.values()
    obj["metadata"]["annotations"].pop(MODEL_ANNOTATION)  # a service created before the annotation existed

    def smoke(isvc: dict[str, Any]) -> None:
        raise DeploymentFailed("canary answered 3/10 correctly")

    with pytest.raises(DeploymentFailed, match="canary answered"):
        deploy_kserve("other-model", api=api, namespace=NS, version="1", storage="s3://models/other/1", name=MODEL,
                      poll_interval=1.0, timeout=30.0, sleep=env.sleep, clock=env, smoke=smoke)
    (obj,) = api.objects.values()
    assert obj["metadata"]["annotations"].get(MODEL_ANNOTATION) != "other-model"
    assert _deploy(api, env, "2")["status"] == "promoted"  # its own model's next rollout goes on
    (obj,) = api.objects.values()
    assert obj["metadata"]["annotations"][MODEL_ANNOTATION] == MODEL
