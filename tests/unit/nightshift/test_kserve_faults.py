"""Hostile review of the KServe rollout by deployment mode (issue 20 item 11, commit 46dc98d).

`RawKServeApi` is the suite's FakeCustomObjectsApi with KServe's Standard-mode controller modelled from its
source (kserve/kserve, pkg/controller/v1beta1/inferenceservice/components/predictor.go and
pkg/apis/serving/v1beta1/inference_service_status.go):
- every predictor (stable, and each `spec.canary` entry) is a Deployment `{isvc}[-{name}]-predictor`; its
  `metadata.generation` moves only when *its* template changes (the pod template carries the
  InferenceService's annotations: buildPredictorResources -> buildObjectMeta -> createRawDefaultDeployment);
- `status.observedGeneration` is the stable Deployment's `status.observedGeneration`
  (PropagateRawStatus: `ss.ObservedGeneration = deploymentList[0].Status.ObservedGeneration`), not the
  InferenceService's generation; Standard mode sets no latestCreatedRevision/latestReadyRevision;
- Ready is the stable Deployment's Available (old pods keep it True through a rolling update);
- a canary is ready when its Deployment has an available replica (`AvailableReplicas > 0`);
- Deployments of the service that are neither the stable nor a canary are deleted at once
  (reconcileCanaryDeployments' orphan cleanup), so promotion deletes the old stable Deployment and a
  rollback deletes the promoted one.
"""

from __future__ import annotations

import copy
from typing import Any
from urllib.parse import urlsplit

import pytest

from nightshift.deploy import kserve
from nightshift.deploy.kserve import VERSION_ANNOTATION
from nightshift.errors import DeploymentFailed
from tests.unit.nightshift import test_deploy_kserve as _base
from tests.unit.nightshift.test_deploy_kserve import (
    MODEL,
    NS,
    FakeClock,
    FakeCustomObjectsApi,
    _champion,
    _deploy,
)

# The suite's fixtures: a real MLflow store with versions 1 and 2 of MODEL, and a fake clock.
store = _base.store
env = _base.env


class RawKServeApi(FakeCustomObjectsApi):
    """Standard (RawDeployment) mode as KServe's controller runs it, one reconcile pass per read: the suite's
    FakeCustomObjectsApi, which models it (the model above moved there, so that there is one fake).
    `deployment_generations`: how far the Deployments' generations are ahead of a fresh one's (an HPA that
    changed spec.replicas bumps a Deployment's generation each time)."""

    def __init__(self, *, deployment_generations: int = 0, **kwargs: Any) -> None:
        super().__init__(default_mode="Standard", deployment_generations=deployment_generations, **kwargs)


URI = f"s3://models/{MODEL}/%s"


def test_standard_mode_a_good_model_is_promoted(env: FakeClock) -> None:
    """HIGH. In Standard mode KServe copies the stable Deployment's observedGeneration into the service's
    status. After promotion the stable Deployment is the former canary's, created at a later service
    generation, so `observedGeneration >= metadata.generation` never holds: wait_ready runs to its timeout,
    the good, smoke-tested model is rolled back, and the rollback cold-starts the old one (its Deployment
    was deleted at promotion) while the promoted one is deleted: nobody answers. Every Standard rollout."""
    api = RawKServeApi()
    _deploy(api, env, "1")
    assert api.serving() == URI % 1
    result = _deploy(api, env, "2")
    assert result["status"] == "promoted"
    assert api.serving() == URI % 2 and _champion() == "2"


def test_standard_mode_a_rollback_after_promotion_keeps_a_model_serving(env: FakeClock,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """HIGH (Standard). The promotion went through (the canary's Deployment now serves everyone, the old
    stable Deployment deleted as an orphan), then moving @champion fails (MLflow unreachable). _rollback puts
    the old predictor back with one patch and does not wait: KServe deletes the promoted Deployment and
    creates the old one from nothing, so no pod answers until v1 loads again."""
    api = RawKServeApi(deployment_generations=50)  # an HPA has scaled it: observedGeneration is ahead
    _deploy(api, env, "1")
    real = kserve.registry.set_alias

    def set_alias(model: str, alias: str, version: str) -> None:
        if version == "2":
            raise RuntimeError("MLflow tracking server unreachable")
        real(model, alias, version)

    monkeypatch.setattr(kserve.registry, "set_alias", set_alias)
    with pytest.raises(DeploymentFailed, match="MLflow tracking server unreachable"):
        _deploy(api, env, "2")
    assert _champion() == "1"
    assert api.serving() is not None, "after the rollback no Deployment of the service has an available pod"


@pytest.mark.parametrize("mode", ["Standard", "Knative"])
def test_a_failed_rollout_does_not_undo_a_concurrent_successful_one(env: FakeClock, mode: str) -> None:
    """MEDIUM. Two deploys of the same version at once (an Airflow zombie and its retry, or the CLI beside
    the DAG). B promotes v2 and moves @champion; A, whose own smoke check then fails, "rolls back" to the
    predictor it read before B ran: v1 serves while @champion says v2. The patches carry no
    resourceVersion, so nothing notices the service changed under A."""
    api = FakeCustomObjectsApi(default_mode=mode)
    _deploy(api, env, "1")

    def smoke_a(isvc: dict[str, Any]) -> None:
        assert _deploy(api, env, "2")["status"] == "promoted"  # B, start to end
        raise DeploymentFailed("A's smoke request timed out")

    with pytest.raises(DeploymentFailed, match="A's smoke request timed out"):
        _deploy(api, env, "2", smoke=smoke_a)
    serving = api.spec()["model"]["storageUri"]
    assert serving == URI % _champion(), f"@champion is v{_champion()} but the service serves {serving}"


class Killed(BaseException):
    """The task killed mid-rollout (SIGKILL after Airflow's SIGTERM, which only calls on_kill): no except
    clause runs."""


def _kill_during_the_canary(api: FakeCustomObjectsApi, clock: FakeClock, version: str) -> None:
    def sleep(seconds: float) -> None:
        raise Killed()

    with pytest.raises(Killed):
        kserve.deploy_kserve(MODEL, api=api, namespace=NS, version=version, storage=URI % version, name=MODEL,
                             poll_interval=1.0, timeout=30.0, sleep=sleep, clock=clock)


def test_knative_a_rerun_that_fails_after_an_interrupted_canary_removes_that_canary(env: FakeClock) -> None:
    """MEDIUM (Knative; the Standard path removes spec.canary and is fine). A rollout of v2 killed while its
    canary runs leaves storageUri=v2 with canaryTrafficPercent. The re-run reads that as "the previous
    predictor"; when the re-run's smoke check rejects v2, _rollback "restores" it: the rejected v2 keeps its
    10 % of live traffic for good, and the error says "rolled back to v2"."""
    api = FakeCustomObjectsApi(default_mode="Knative")
    _deploy(api, env, "1")
    _kill_during_the_canary(api, env, "2")

    def reject(isvc: dict[str, Any]) -> None:
        raise DeploymentFailed("canary answered 3/10 correctly")

    with pytest.raises(DeploymentFailed, match="canary answered"):
        _deploy(api, env, "2", smoke=reject)
    predictor = api.spec()
    assert "canaryTrafficPercent" not in predictor and predictor["model"]["storageUri"] == URI % 1, predictor
    assert _champion() == "1"


def test_the_version_annotation_says_what_serves_after_an_interrupted_rollout(env: FakeClock) -> None:
    """LOW. The canary patch writes nightshift.io/model-version=<new> before the new version serves anyone
    but its canary. Killed there, the service says v2 while v1 serves; the next deploy of v1 takes the
    already_serving path (Standard: it removes the leftover canary) and never rewrites it, and reports
    previous_version 2. (Knative: the re-run of v1 goes through a canary and rewrites it.)"""
    api = FakeCustomObjectsApi(default_mode="Standard")
    _deploy(api, env, "1")
    _kill_during_the_canary(api, env, "2")
    result = _deploy(api, env, "1")
    annotations = api.objects[(NS, MODEL)]["metadata"]["annotations"]
    assert api.spec()["model"]["storageUri"] == URI % 1
    assert annotations[VERSION_ANNOTATION] == "1", (result["status"], annotations)


def test_standard_a_leftover_canary_is_not_taken_for_the_new_one(env: FakeClock) -> None:
    """Checked, nothing found: a canary left by an interrupted v2 rollout is replaced by the next rollout's
    (spec.canary is atomic; its name differs per version) and a re-run of v2 recovers and promotes."""
    api = FakeCustomObjectsApi(default_mode="Standard")
    _deploy(api, env, "1")
    _kill_during_the_canary(api, env, "2")
    assert [c["predictor"]["name"] for c in api.objects[(NS, MODEL)]["spec"]["canary"]] == ["v2"]
    assert _deploy(api, env, "2")["status"] == "promoted"
    after = copy.deepcopy(api.objects[(NS, MODEL)])
    assert "canary" not in after["spec"] and api.spec()["model"]["storageUri"] == URI % 2 and _champion() == "2"


# --- checks of the fixes ------------------------------------------------------------------------------------


def test_the_smoke_check_reaches_the_standard_canary_on_its_own_service(env: FakeClock) -> None:
    """Finding 6: behind a plain Ingress a Standard canary takes no live traffic; smoke gets the Ready object
    and canary_url(isvc) names the canary's own Service, `<isvc>-v<version>-predictor` in the namespace, whose
    Deployment serves the new model."""
    api = FakeCustomObjectsApi(default_mode="Standard")
    _deploy(api, env, "1")
    seen: list[str | None] = []

    def smoke(isvc: dict[str, Any]) -> None:
        url = kserve.canary_url(isvc)
        seen.append(url)
        host = urlsplit(url or "").hostname or ""
        service, namespace = host.split(".")[:2]
        assert namespace == NS and api.deployments[service]["serving"] == URI % 2
        assert api.serving() == URI % 1  # the stable Service still answers with v1

    assert _deploy(api, env, "2", smoke=smoke)["status"] == "promoted"
    assert seen == [f"http://{MODEL}-v2-predictor.{NS}.svc"]


def test_knative_a_rerun_of_the_serving_version_removes_an_interrupted_canary(env: FakeClock) -> None:
    """Finding 4: a v2 canary killed mid-rollout, then v1 deployed again: v1 is what rolled out (recorded with
    the canary), so the leftover canary is removed and nothing else starts."""
    api = FakeCustomObjectsApi(default_mode="Knative")
    _deploy(api, env, "1")
    _kill_during_the_canary(api, env, "2")
    result = _deploy(api, env, "1")
    predictor = api.spec()
    assert result["status"] == "already_serving" and result["previous_version"] == "1"
    assert "canaryTrafficPercent" not in predictor and predictor["model"]["storageUri"] == URI % 1
    assert kserve.PREVIOUS_ANNOTATION not in api.objects[(NS, MODEL)]["metadata"]["annotations"]
    assert _champion() == "1"


def test_knative_a_canary_with_no_record_of_what_it_replaced_is_refused(env: FakeClock) -> None:
    """A canary started by hand (or by an older Nightshift) says nothing about the predictor beside it: rolling
    out over it could only "roll back" to that canary, so the rollout is refused before any change."""
    api = FakeCustomObjectsApi(default_mode="Knative")
    _deploy(api, env, "1")
    predictor = api.objects[(NS, MODEL)]["spec"]["predictor"]
    predictor["canaryTrafficPercent"] = 10
    predictor["model"]["storageUri"] = "s3://elsewhere/x"
    patches = len([c for c in api.calls if c[0] == "patch"])
    with pytest.raises(DeploymentFailed, match=r"runs a canary .* no record"):
        _deploy(api, env, "2")
    assert len([c for c in api.calls if c[0] == "patch"]) == patches and _champion() == "1"


def test_a_conflict_from_a_status_write_is_retried_and_a_stale_write_is_refused(env: FakeClock) -> None:
    """Finding 3: every patch carries the resourceVersion it was based on. The controller's status writes move
    it (the rollback below is based on the canary patch's answer, many status writes old) and are retried on
    the object read again; a patch based on an object whose spec another writer changed gets 409 and raises."""
    api = FakeCustomObjectsApi(default_mode="Standard")
    _deploy(api, env, "1")

    def reject(isvc: dict[str, Any]) -> None:
        raise DeploymentFailed("canary answered 3/10 correctly")

    with pytest.raises(DeploymentFailed, match="rolled back to v1"):
        _deploy(api, env, "2", smoke=reject)
    patches = [c[1] for c in api.calls if c[0] == "patch"]
    assert patches[-1]["spec"] == {"canary": None} and patches[-2]["spec"] == {"canary": None}  # 409, then again
    client = kserve.InferenceServiceClient(api, NS, MODEL)
    stale = client.get()
    assert stale is not None
    client.patch({"metadata": {"labels": {"team": "ml"}}, "spec": {"predictor": {"minReplicas": 2}}}, stale)
    with pytest.raises(kserve.InferenceServiceChanged, match="changed by another rollout"):
        client.patch({"spec": {"canary": None}}, stale)
