"""The `kserve` target: a KServe `InferenceService` (serving.kserve.io/v1beta1, MLflow format).

The first deployment creates the service; a later one runs the new model as a canary beside the serving
one, waits for it to be Ready, optionally smoke-tests it, then promotes it and moves `@champion`. What a
canary is depends on the service's deployment mode (`status.deploymentMode`, else its annotation
`serving.kserve.io/deploymentMode`, else NIGHTSHIFT_KSERVE_DEPLOYMENT_MODE; legacy names Serverless and
RawDeployment are read as Knative and Standard):
- Knative: the predictor's `storageUri` is patched with `canaryTrafficPercent`, so the new revision takes
  that share of the traffic beside the rolled-out one; promoting removes the field (100 % to it).
- Standard (raw Deployments, which ignore `canaryTrafficPercent` and would roll out to everyone at once):
  `spec.canary` gets one entry, a predictor named `v<version>` with the new `storageUri` and
  `trafficPercent`, run as its own Deployment beside the stable one (KServe >= 0.20; the split needs its
  Gateway API routes); promoting makes it the stable predictor (name and `storageUri`) and drops
  `spec.canary`.
- any other mode (ModelMesh) has no canary: refused before anything changes.
On failure the previous predictor spec is restored and the canary removed (the previous model kept
serving meanwhile), or a service this call created is deleted.

The predictor names the ServingRuntime `nightshift-mlserver-torch` (`deploy/kserve/servingruntime.yaml`:
MLServer with its MLflow runtime and torch, built from `images/serving/Dockerfile`); KServe's stock
`kserve-mlserver` has no torch. `NIGHTSHIFT_KSERVE_RUNTIME` names another, or `""` lets KServe pick.

The storage URI is the registered version's artifact location, which KServe's storage initializer must
be able to fetch *as a directory*: `s3://`, `gs://`, `hdfs://`, `webhdfs://`, Azure Blob/File `https://`
URLs, or `pvc://<claim>/<path>`. A local store (`file://`, the embedded default), MLflow's proxied
`mlflow-artifacts:` or a plain `http(s)://` URL (the initializer downloads one file from those) is
refused before anything is created, unless `NIGHTSHIFT_KSERVE_STORAGE_MAP` rewrites its prefix (e.g.
`file:///nightshift/=pvc://nightshift-workspace/`, `mlflow-artifacts:/=s3://bucket/mlartifacts/`).

NIGHTSHIFT_KSERVE_DEPLOYMENT_MODE (Standard or Knative: the cluster's `deploy.defaultDeploymentMode` in
KServe's `inferenceservice-config` ConfigMap) is written on the services this target creates, and is the
mode of an existing service whose status and annotations do not say.

`api` is anything with the four methods of kubernetes' `CustomObjectsApi` used here (the cncf
provider's `KubernetesHook().custom_object_client` in Airflow); errors carry an HTTP `status`.
Patches are JSON merge patches, as the real client sends for dict bodies: `None` removes a field.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from nightshift import registry, tracking
from nightshift.errors import DeploymentFailed, UsageError
from nightshift.served_model import RANGE_POLICY_ENV, check_range_policy

GROUP = "serving.kserve.io"
VERSION = "v1beta1"
PLURAL = "inferenceservices"
VERSION_ANNOTATION = "nightshift.io/model-version"
# The registered model an InferenceService serves, exactly as registered: a rollout of another model whose name
# maps to the same service is refused rather than replacing it.
MODEL_ANNOTATION = "nightshift.io/model-name"
# Knative: the predictor (and version) a canary was started beside, written with the canary, removed with it.
PREVIOUS_ANNOTATION = "nightshift.io/canary-previous"
TERMINAL_REASONS = frozenset({"RevisionFailed", "ContainerCreationFailed", "RevisionMissing"})
CONFLICT_RETRIES = 5  # a 409 from a status write (spec unchanged) is retried on the object read again
ALIAS_TRIES = 3
RUNTIME_ENV = "NIGHTSHIFT_KSERVE_RUNTIME"
DEFAULT_RUNTIME = "nightshift-mlserver-torch"
STORAGE_MAP_ENV = "NIGHTSHIFT_KSERVE_STORAGE_MAP"
MODE_ENV = "NIGHTSHIFT_KSERVE_DEPLOYMENT_MODE"
MODE_ANNOTATION = "serving.kserve.io/deploymentMode"
CONTAINER_NAME = "kserve-container"  # KServe's predictor container (constants.InferenceServiceContainerName)
KNATIVE, STANDARD = "Knative", "Standard"
# KServe's names (pkg/constants: DeploymentModeType): the legacy ones still accepted, read as the current ones.
MODES = {"Knative": KNATIVE, "Serverless": KNATIVE, "Standard": STANDARD, "RawDeployment": STANDARD,
         "ModelMesh": "ModelMesh"}
# What KServe's default storage initializer fetches as a directory (its ClusterStorageContainer's URI
# formats), and pvc://, which the controller mounts instead. A generic http(s) URL is downloaded as one
# file or archive, which an MLflow model directory is not.
FETCHABLE_PREFIXES = ("s3://", "gs://", "hdfs://", "webhdfs://", "pvc://")
FETCHABLE_PATTERNS = (re.compile(r"^https://[^/]+\.blob\.core\.windows\.net/.+"),
                      re.compile(r"^https://[^/]+\.file\.core\.windows\.net/.+"))


def _status(err: Exception) -> int | None:
    status = getattr(err, "status", None)
    return int(status) if isinstance(status, int | str) and str(status).isdigit() else None


def service_name(model_name: str) -> str:
    """A DNS-1035 label (at most 45 characters, room for KServe's suffixes) for the InferenceService of
    `model_name`, one per model: a name that is already such a label is kept as it is; any other (capitals, `_`,
    `.`, too long) gets the first 8 hex digits of its SHA-256 after what is left of it, so that `churn_v2`,
    `churn.v2` and `Churn-V2`, or two long names with the same first 45 characters, get services of their own."""
    if re.fullmatch(r"[a-z]([a-z0-9-]{0,43}[a-z0-9])?", model_name):
        return model_name
    digest = hashlib.sha256(model_name.encode()).hexdigest()[:8]
    base = re.sub(r"[^a-z0-9-]+", "-", model_name.lower()).strip("-")[:36].strip("-")
    if not base or not base[0].isalpha():
        base = f"m-{base}".strip("-")[:36].strip("-")
    return f"{base}-{digest}"


def _check_percent(canary_traffic_percent: int | None) -> None:
    if canary_traffic_percent is not None and (isinstance(canary_traffic_percent, bool)
                                               or not isinstance(canary_traffic_percent, int)
                                               or not 0 <= canary_traffic_percent <= 100):
        raise UsageError(f"canary_traffic_percent must be an integer within 0..100, got {canary_traffic_percent!r}")


def parse_mode(value: str, *, where: str) -> str:
    """A KServe deployment mode by its current name; an unknown one is a UsageError naming `where`."""
    mode = MODES.get(value.strip())
    if mode is None:
        raise UsageError(f"{where} {value!r} is not a KServe deployment mode; use Standard or Knative (legacy "
                         f"names RawDeployment, Serverless), as in the cluster's inferenceservice-config ConfigMap "
                         f"(deploy.defaultDeploymentMode)")
    return mode


def configured_mode() -> str | None:
    """NIGHTSHIFT_KSERVE_DEPLOYMENT_MODE, checked; None when unset."""
    value = os.environ.get(MODE_ENV, "").strip()
    return parse_mode(value, where=MODE_ENV) if value else None


def deployment_mode(isvc: dict[str, Any], configured: str | None) -> str:
    """The mode `isvc` runs in: what the controller recorded in its status, else its annotation, else
    `configured`; DeploymentFailed when none says."""
    metadata = isvc.get("metadata") or {}
    recorded = (isvc.get("status") or {}).get("deploymentMode")
    annotated = (metadata.get("annotations") or {}).get(MODE_ANNOTATION)
    for where, value in (("status.deploymentMode", recorded), (f"annotation {MODE_ANNOTATION}", annotated)):
        if value:
            mode = MODES.get(str(value))
            if mode is None:
                raise DeploymentFailed(f"InferenceService {metadata.get('namespace')}/{metadata.get('name')} has "
                                       f"{where} {value!r}, a deployment mode this target does not know; it rolls "
                                       f"out in Standard or Knative mode")
            return mode
    if configured:
        return configured
    raise DeploymentFailed(f"cannot tell the deployment mode of InferenceService {metadata.get('namespace')}/"
                           f"{metadata.get('name')} (no status.deploymentMode, no {MODE_ANNOTATION} annotation): set "
                           f"{MODE_ENV} to Standard or Knative, the cluster's deploy.defaultDeploymentMode in "
                           f"KServe's inferenceservice-config ConfigMap")


def canary_name(version: str, stable_name: str | None) -> str:
    """The name of the Standard-mode canary predictor of `version` (a DNS label unlike the stable one's)."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"v{version}".lower()).strip("-")
    return f"{name}-b" if name == stable_name else name


def range_policy_env(range_policy: str | None) -> list[dict[str, str]] | None:
    """The predictor container's environment that sets the served model's range policy (None: the image's
    default, accept)."""
    if range_policy is None:
        return None
    return [{"name": RANGE_POLICY_ENV, "value": check_range_policy(range_policy)}]


def canary_patch(mode: str, stable: dict[str, Any], uri: str, version: str, percent: int, *,
                 previous_version: str | None = None, range_policy: str | None = None) -> dict[str, Any]:
    """The merge patch that starts `version` (at `uri`) as a canary beside the `stable` predictor (that of
    `previous_version`). The version annotation is left alone: it names what serves, and changes with the
    promotion. `range_policy` given: the canary's model container gets it in its environment."""
    _check_percent(percent)
    env = range_policy_env(range_policy)
    if mode == KNATIVE:
        # The predictor spec is overwritten with the canary's: what to restore is recorded beside it, so that a
        # re-run after an interrupted canary rolls back to the rolled-out model, not to the canary.
        record = json.dumps({"version": previous_version, "predictor": stable}, sort_keys=True)
        return {"metadata": {"annotations": {PREVIOUS_ANNOTATION: record}},
                "spec": {"predictor": {"canaryTrafficPercent": percent,
                                       "model": {"storageUri": uri, **({"env": env} if env else {})}}}}
    # Standard: a whole predictor (KServe overlays it on the stable one); the annotation says Standard, which
    # KServe's webhook requires of every spec.canary.
    # The CRD wants the canary model's container name, which KServe's webhook forbids on the stable one.
    model = {**copy.deepcopy(stable.get("model") or {}), "storageUri": uri, "name": CONTAINER_NAME,
             **({"env": env} if env else {})}
    predictor = {"name": canary_name(version, stable.get("name")), "model": model}
    return {"metadata": {"annotations": {MODE_ANNOTATION: STANDARD}},
            "spec": {"canary": [{"trafficPercent": percent, "predictor": predictor}]}}


def promote_patch(mode: str, canary: dict[str, Any], version: str | None = None) -> dict[str, Any]:
    """The merge patch that makes the canary the only model served (and, given `version`, names it in the
    version annotation). `canary` is the `spec.canary` entry (Standard) or the patched predictor (Knative)."""
    annotations: dict[str, str | None] = {VERSION_ANNOTATION: version} if version is not None else {}
    if mode == KNATIVE:
        body: dict[str, Any] = {"spec": {"predictor": {"canaryTrafficPercent": None}}}
        annotations[PREVIOUS_ANNOTATION] = None
    else:
        predictor = canary["predictor"]
        model = {key: value for key, value in predictor["model"].items() if key != "name"}
        body = {"spec": {"predictor": {"name": predictor["name"], "model": model}, "canary": None}}
    if annotations:
        body["metadata"] = {"annotations": annotations}
    return body


def predictor_service(isvc_name: str, predictor_name: str | None) -> str:
    """The Service (and Deployment) KServe's Standard mode makes for a predictor: `<isvc>-predictor` for the
    unnamed stable one, `<isvc>-<name>-predictor` for a named one or a canary (KServe's naming,
    constants.PredictorServiceName and its canary variant)."""
    return f"{isvc_name}-{predictor_name}-predictor" if predictor_name else f"{isvc_name}-predictor"


def canary_url(isvc: dict[str, Any]) -> str | None:
    """Where a smoke check reaches the canary of `isvc` (the object deploy_kserve hands to `smoke`) on its own:
    Standard mode, the canary's Service in the namespace (`http://<isvc>-<canary>-predictor.<ns>.svc`: behind a
    plain Ingress the canary takes no live traffic); Knative, the predictor's `latest`-tagged URL (KServe tags
    the canary revision), else the service's URL (the split traffic). None when it has no canary."""
    metadata = isvc.get("metadata") or {}
    spec = isvc.get("spec") or {}
    status = isvc.get("status") or {}
    if spec.get("canary"):
        service = predictor_service(str(metadata.get("name")), spec["canary"][0]["predictor"]["name"])
        return f"http://{service}.{metadata.get('namespace')}.svc"
    if "canaryTrafficPercent" in (spec.get("predictor") or {}):
        for target in ((status.get("components") or {}).get("predictor") or {}).get("traffic") or []:
            if target.get("tag") == "latest" and target.get("url"):
                return str(target["url"])
        return status.get("url")
    return None


def inference_service(name: str, namespace: str, storage_uri: str, *, model_version: str,
                      canary_traffic_percent: int | None = None, service_account: str | None = None,
                      labels: dict[str, str] | None = None, resources: dict[str, Any] | None = None,
                      runtime: str | None = None, deployment_mode: str | None = None,
                      range_policy: str | None = None, model_name: str | None = None) -> dict[str, Any]:
    """The InferenceService manifest: an MLflow-format predictor (Open Inference Protocol v2). `range_policy`:
    the served model's (accept | refuse) in its container's environment; None: the default, accept."""
    _check_percent(canary_traffic_percent)
    model: dict[str, Any] = {"modelFormat": {"name": "mlflow"}, "protocolVersion": "v2",
                             "storageUri": storage_uri}
    env = range_policy_env(range_policy)
    if env:
        model["env"] = env
    if runtime:
        model["runtime"] = runtime
    if resources:
        model["resources"] = resources
    predictor: dict[str, Any] = {"model": model}
    if canary_traffic_percent is not None:
        predictor["canaryTrafficPercent"] = canary_traffic_percent
    if service_account:
        predictor["serviceAccountName"] = service_account
    annotations = {VERSION_ANNOTATION: model_version, **({MODEL_ANNOTATION: model_name} if model_name else {})}
    if deployment_mode:
        annotations[MODE_ANNOTATION] = deployment_mode
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "nightshift", **(labels or {})},
                     "annotations": annotations},
        "spec": {"predictor": predictor},
    }


def storage_uri(model_name: str, version: str) -> str:
    """Where the registry keeps the version's artifacts (what the KServe storage initializer downloads)."""
    try:
        return str(tracking.client().get_model_version_download_uri(model_name, str(version)))
    except Exception as err:
        raise DeploymentFailed(f"no artifact location for {model_name} v{version} ({err})") from err


def storage_map(value: str | None = None) -> list[tuple[str, str]]:
    """`NIGHTSHIFT_KSERVE_STORAGE_MAP`: `FROM=TO` prefix rewrites, separated by whitespace or `;`."""
    value = os.environ.get(STORAGE_MAP_ENV, "") if value is None else value
    pairs = []
    for entry in re.split(r"[;\s]+", value.strip()):
        if not entry:
            continue
        source, sep, target = entry.partition("=")
        if not sep or not source or not target:
            raise UsageError(f"{STORAGE_MAP_ENV} entry {entry!r} is not FROM=TO (e.g. "
                             f"file:///nightshift/=pvc://nightshift-workspace/)")
        pairs.append((source, target))
    return pairs


def is_fetchable(uri: str) -> bool:
    """Whether KServe's storage initializer (or the PVC mount) can bring `uri` to the predictor as a folder."""
    return uri.startswith(FETCHABLE_PREFIXES) or any(p.match(uri) for p in FETCHABLE_PATTERNS)


def kserve_storage_uri(location: str, *, what: str = "the model") -> str:
    """The URI the InferenceService gets for artifact `location`: mapped by NIGHTSHIFT_KSERVE_STORAGE_MAP,
    then checked; a location the cluster cannot fetch is refused with what to configure."""
    uri = location
    for source, target in storage_map():
        if location.startswith(source):
            uri = target + location[len(source):]
            break
    if is_fetchable(uri):
        return uri
    mapped = f" (mapped from {location})" if uri != location else ""
    if uri.startswith("mlflow-artifacts:"):
        why = ("the tracking server proxies its artifacts; map the prefix to the server's "
               f"--artifacts-destination, e.g. {STORAGE_MAP_ENV}='mlflow-artifacts:/=s3://<bucket>/<path>/'")
    elif uri.startswith(("http://", "https://")):
        why = "KServe downloads a plain http(s) URL as one file or archive, and an MLflow model is a folder"
    else:
        why = ("it is on a disk the predictor pod does not have; put the MLflow artifacts on object storage "
               "(a tracking server with `--default-artifact-root s3://<bucket>/<path> --no-serve-artifacts`, "
               "or NIGHTSHIFT_MLFLOW_ARTIFACTS=s3://<bucket>/<path> for a local tracking store; either applies "
               "to experiments created afterwards), or, when it lies on a volume the cluster can mount, map it "
               f"with {STORAGE_MAP_ENV}='<local prefix>=pvc://<claim>/<path>'")
    raise DeploymentFailed(
        f"deploy_target=kserve refused: the artifact location of {what} is {uri}{mapped}, which KServe's "
        f"storage initializer cannot fetch ({why}). It fetches {', '.join(FETCHABLE_PREFIXES)} and Azure "
        f"Blob/File https URLs; or use deploy_target=local")


def default_runtime() -> str | None:
    """The ServingRuntime the predictor names: NIGHTSHIFT_KSERVE_RUNTIME, `""` for KServe's own choice."""
    value = os.environ.get(RUNTIME_ENV, DEFAULT_RUNTIME).strip()
    return value or None


class InferenceServiceChanged(DeploymentFailed):
    """The InferenceService's spec changed under this rollout (another deploy): it stops and undoes nothing."""


def _describe(obj: dict[str, Any]) -> str:
    """What an InferenceService's spec runs, in a few words."""
    spec = obj.get("spec") or {}
    predictor = spec.get("predictor") or {}
    text = f"storageUri {(predictor.get('model') or {}).get('storageUri')}"
    if "canaryTrafficPercent" in predictor:
        text += f" at canaryTrafficPercent {predictor['canaryTrafficPercent']}"
    for entry in spec.get("canary") or []:
        model = (entry.get("predictor") or {}).get("model") or {}
        text += f", canary {model.get('storageUri')} at {entry.get('trafficPercent')} %"
    return text


def _condition_map(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type"): c for c in status.get("conditions") or []}


@dataclass
class InferenceServiceClient:
    """Get/create/patch/delete/wait for one InferenceService through a CustomObjectsApi-like `api`."""

    api: Any
    namespace: str
    name: str
    poll_interval: float = 5.0
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic

    def _args(self) -> tuple[str, str, str, str]:
        return GROUP, VERSION, self.namespace, PLURAL

    def get(self) -> dict[str, Any] | None:
        try:
            return dict(self.api.get_namespaced_custom_object(*self._args(), self.name))
        except Exception as err:
            if _status(err) == 404:
                return None
            raise self._failed("reading", err) from err

    def create(self, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Create the service; (object, created). On 409 (created meanwhile) the existing one is returned."""
        try:
            return dict(self.api.create_namespaced_custom_object(*self._args(), body)), True
        except Exception as err:
            if _status(err) == 409:
                existing = self.get()
                if existing is not None:
                    return existing, False
            raise self._failed("creating", err) from err

    def patch(self, body: dict[str, Any], based_on: dict[str, Any]) -> dict[str, Any]:
        """Apply merge patch `body` to the object as read in `based_on`, guarded by its resourceVersion: the API
        server answers 409 when anything wrote the object since. A conflict from a write that left the spec as
        `based_on` has it (the controller's status) is retried on the object read again; a changed spec (another
        rollout) raises InferenceServiceChanged and patches nothing."""
        current = based_on
        for _ in range(CONFLICT_RETRIES):
            guarded = copy.deepcopy(body)
            resource_version = (current.get("metadata") or {}).get("resourceVersion")
            if resource_version is not None:
                guarded.setdefault("metadata", {})["resourceVersion"] = resource_version
            try:
                return dict(self.api.patch_namespaced_custom_object(*self._args(), self.name, guarded))
            except Exception as err:
                if _status(err) != 409:
                    raise self._failed("patching", err) from err
                latest = self.get()
                if latest is None:
                    raise DeploymentFailed(f"InferenceService {self.namespace}/{self.name} was deleted during the "
                                           f"rollout") from err
                if latest.get("spec") != based_on.get("spec"):
                    raise self._changed(latest) from err
                current = latest
        raise DeploymentFailed(f"patching InferenceService {self.namespace}/{self.name} kept conflicting with other "
                               f"writes ({CONFLICT_RETRIES} tries)")

    def delete(self) -> None:
        try:
            self.api.delete_namespaced_custom_object(*self._args(), self.name)
        except Exception as err:
            if _status(err) != 404:
                raise self._failed("deleting", err) from err

    def _failed(self, what: str, err: Exception) -> DeploymentFailed:
        code = _status(err)
        return DeploymentFailed(f"{what} InferenceService {self.namespace}/{self.name} failed"
                                f"{f' (HTTP {code})' if code else ''}: {getattr(err, 'reason', None) or err}")

    def _changed(self, latest: dict[str, Any]) -> InferenceServiceChanged:
        return InferenceServiceChanged(f"InferenceService {self.namespace}/{self.name} was changed by another "
                                       f"rollout meanwhile (it now runs {_describe(latest)})")

    def wait_ready(self, written: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Wait until the service serves the spec of `written` (the object a write of this rollout returned, or
        the one read when nothing was written); the Ready object.

        Knative: the service observed that generation, is Ready, and its latest revision is ready. Standard
        (raw Deployments): generations say nothing there (status.observedGeneration is the stable Deployment's),
        so the status must name the expected predictor's Service as the one available (its url is set only
        while that Deployment is Available) and Ready, and each canary of the spec must be ready by name.
        A spec other than `written`'s (another rollout) raises InferenceServiceChanged."""
        spec = written.get("spec") or {}
        generation = _generation(written)
        stable = predictor_service(self.name, (spec.get("predictor") or {}).get("name"))
        canaries = [entry["predictor"]["name"] for entry in spec.get("canary") or []]
        deadline = self.clock() + timeout
        last = "no status yet"
        while True:
            obj = self.get()
            if obj is None:
                raise DeploymentFailed(f"InferenceService {self.namespace}/{self.name} disappeared while "
                                       f"waiting for it to become Ready")
            if (obj.get("spec") or {}) != spec:
                raise self._changed(obj)
            status = obj.get("status") or {}
            conditions = _condition_map(status)
            failing = [c for c in conditions.values()
                       if c.get("status") == "False" and c.get("reason") in TERMINAL_REASONS]
            if failing:
                c = failing[0]
                raise DeploymentFailed(f"InferenceService {self.namespace}/{self.name} failed: "
                                       f"{c.get('type')} {c.get('reason')}: {c.get('message', '')}")
            mode = MODES.get(str(status.get("deploymentMode") or ""))
            if mode == STANDARD:
                ready, last = self._standard_ready(status, conditions, stable, canaries)
            elif mode is not None and int(status.get("observedGeneration") or 0) >= generation:
                predictor = (status.get("components") or {}).get("predictor") or {}
                created = predictor.get("latestCreatedRevision")
                ready = conditions.get("Ready", {}).get("status") == "True" and (
                    created is None or created == predictor.get("latestReadyRevision"))
                last = f"Ready={conditions.get('Ready', {}).get('status', 'Unknown')} " \
                       f"{conditions.get('Ready', {}).get('reason', '')}".strip()
                if conditions.get("Ready", {}).get("status") == "True" and not ready:
                    last = f"revision {created} not ready"
            else:
                ready = False
            if ready:
                return obj
            if self.clock() >= deadline:
                raise DeploymentFailed(f"InferenceService {self.namespace}/{self.name} not Ready within "
                                       f"{timeout:.0f}s (last: {last})")
            self.sleep(self.poll_interval)

    @staticmethod
    def _standard_ready(status: dict[str, Any], conditions: dict[str, dict[str, Any]], stable: str,
                        canaries: list[str]) -> tuple[bool, str]:
        url = str(((status.get("components") or {}).get("predictor") or {}).get("url") or "")
        host = urlsplit(url).hostname or ""
        if not (host == stable or host.startswith((f"{stable}.", f"{stable}-"))):
            return False, f"predictor {stable} not available (status names {host or 'no available predictor'})"
        ready = conditions.get("Ready", {})
        if ready.get("status") != "True":
            return False, f"Ready={ready.get('status', 'Unknown')} {ready.get('reason', '')}".strip()
        statuses = {c.get("name"): c for c in status.get("canaryStatuses") or []}
        for name in canaries:
            if statuses.get(name, {}).get("ready") is not True \
                    or conditions.get("CanaryPredictorReady", {}).get("status") != "True":
                reason = conditions.get("CanaryPredictorReady", {}).get("reason", "no canary status yet")
                return False, f"canary {name} not ready: {reason}"
        return True, "Ready"


def _generation(obj: dict[str, Any]) -> int:
    return int((obj.get("metadata") or {}).get("generation") or 1)


def _previous(existing: dict[str, Any], mode: str) -> tuple[dict[str, Any], str | None]:
    """The predictor that serves beside any canary, and its version: the stable predictor (Standard, whose
    canary is apart in spec.canary); Knative, the predictor spec, or, while it carries canaryTrafficPercent (a
    canary left by an interrupted or concurrent rollout), the rolled-out one recorded with that canary."""
    metadata = existing.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    predictor = copy.deepcopy((existing.get("spec") or {}).get("predictor") or {})
    version = annotations.get(VERSION_ANNOTATION)
    if mode != KNATIVE or "canaryTrafficPercent" not in predictor:
        return predictor, version
    try:
        record = json.loads(annotations[PREVIOUS_ANNOTATION])
        return dict(record["predictor"]), record.get("version")
    except (KeyError, TypeError, ValueError) as err:
        raise DeploymentFailed(
            f"InferenceService {metadata.get('namespace')}/{metadata.get('name')} runs a canary "
            f"({_describe(existing)}) with no record ({PREVIOUS_ANNOTATION}) of the predictor it was rolled out "
            f"beside, so a rollback could not restore it; finish or undo that rollout first (remove "
            f"canaryTrafficPercent, or set the previous storageUri back)") from err


def _promoted(obj: dict[str, Any] | None, mode: str, uri: str, entry: dict[str, Any] | None) -> bool:
    """Whether `obj` holds the promotion of the canary (a promotion patch that failed may have landed)."""
    spec = (obj or {}).get("spec") or {}
    predictor = spec.get("predictor") or {}
    if mode == KNATIVE:
        return "canaryTrafficPercent" not in predictor and (predictor.get("model") or {}).get("storageUri") == uri
    return not spec.get("canary") and entry is not None and predictor.get("name") == entry["predictor"]["name"]


def _move_champion(model_name: str, version: str, sleep: Callable[[float], None], pause: float) -> None:
    for attempt in range(1, ALIAS_TRIES + 1):
        try:
            registry.set_alias(model_name, registry.CHAMPION, version)
            return
        except Exception:
            if attempt == ALIAS_TRIES:
                raise
            sleep(pause)


def deploy_kserve(model_name: str, *, api: Any, namespace: str, version: str | None = None,
                  alias: str = registry.CHALLENGER, name: str | None = None, storage: str | None = None,
                  canary_traffic_percent: int = 10, timeout: float = 600.0, poll_interval: float = 5.0,
                  smoke: Callable[[dict[str, Any]], None] | None = None, service_account: str | None = None,
                  runtime: str | None = None, sleep: Callable[[float], None] = time.sleep,
                  clock: Callable[[], float] = time.monotonic, range_policy: str | None = None) -> dict[str, Any]:
    """Roll `model_name` `version` (default `@alias`) out to KServe with a canary, then promote or roll back.

    `storage` overrides the storage URI read from the registry (e.g. an s3:// mirror of the artifacts);
    either must be one KServe can fetch (see `kserve_storage_uri`), else DeploymentFailed before any API
    call. `runtime` names the ServingRuntime (default: `default_runtime()`). `range_policy` (accept | refuse)
    goes into the predictor's environment (nightshift.served_model.RANGE_POLICY_ENV).
    `smoke(isvc)` may check the canary: it gets the Ready object, and `canary_url(isvc)` says where the canary
    answers on its own (raise to reject).
    Every patch is guarded by the resourceVersion it was based on; a rollout whose service another rollout
    changed meanwhile stops and undoes nothing. Before promotion a failure rolls back (the previous model kept
    serving); once the promotion landed, nothing is undone (the previous predictor no longer runs): a failure
    to become Ready or to move @champion is raised naming that state.
    Returns {"target": "kserve", "status": "created" | "promoted" | "already_serving", "model_name",
    "version", "name", "namespace", "storage_uri", "url", "previous_version", "deployment_mode"} (the mode
    is None for a service just created without NIGHTSHIFT_KSERVE_DEPLOYMENT_MODE: the cluster's default).
    """
    _check_percent(canary_traffic_percent)
    range_policy_env(range_policy)  # a bad policy is refused before any API call
    configured = configured_mode()
    if version is None:
        selected = registry.version_by_alias(model_name, alias)
        if selected is None:
            raise DeploymentFailed(f"{model_name}@{alias} does not exist; run `nightshift register` first")
        version = str(selected.version)
    version = str(version)
    uri = kserve_storage_uri(storage or storage_uri(model_name, version), what=f"{model_name} v{version}")
    isvc = InferenceServiceClient(api, namespace, name or service_name(model_name), poll_interval,
                                  sleep, clock)
    result = {"target": "kserve", "model_name": model_name, "version": version, "name": isvc.name,
              "namespace": namespace, "storage_uri": uri}

    existing = isvc.get()
    if existing is not None:
        _check_owner(existing, model_name, version, namespace, isvc.name)
    if existing is None:
        body = inference_service(isvc.name, namespace, uri, model_version=version, model_name=model_name,
                                 service_account=service_account,
                                 runtime=default_runtime() if runtime is None else runtime,
                                 deployment_mode=configured, range_policy=range_policy)
        obj, created = isvc.create(body)
        if not created:  # another rollout created it first (409): whose is it?
            _check_owner(obj, model_name, version, namespace, isvc.name)
        if created:
            try:
                ready = isvc.wait_ready(obj, timeout)
                if smoke:
                    smoke(ready)
                registry.set_alias(model_name, registry.CHAMPION, version)
            except Exception as err:
                isvc.delete()
                raise DeploymentFailed(f"{model_name} v{version} not deployed to KServe: {err}; the "
                                       f"InferenceService it created was deleted") from err
            return {**result, "status": "created", "url": (ready.get("status") or {}).get("url"),
                    "previous_version": None, "deployment_mode": configured}
        existing = obj

    mode = deployment_mode(existing, configured)
    if mode not in {KNATIVE, STANDARD}:
        raise DeploymentFailed(f"deploy_target=kserve refused: InferenceService {namespace}/{isvc.name} runs in "
                               f"deployment mode {mode}, which has no canary rollout (Knative: canaryTrafficPercent; "
                               f"Standard: spec.canary); serve {model_name} from a Standard or Knative "
                               f"InferenceService (another name), or use deploy_target=local")
    result["deployment_mode"] = mode
    old_predictor, old_version = _previous(existing, mode)
    if (old_predictor.get("model") or {}).get("storageUri") == uri:
        serving = _already_serving(isvc, existing, mode, old_predictor, version, timeout, model_name)
        registry.set_alias(model_name, registry.CHAMPION, version)
        return {**result, **serving, "previous_version": old_version}

    canary = canary_patch(mode, old_predictor, uri, version, canary_traffic_percent, previous_version=old_version,
                          range_policy=range_policy)
    entry = canary["spec"].get("canary", [None])[0]
    try:
        ours = isvc.patch(canary, existing)
    except DeploymentFailed as err:
        raise DeploymentFailed(f"{model_name} v{version} not deployed to KServe: starting its canary failed: {err}; "
                               f"nothing was changed") from err
    try:
        ready = isvc.wait_ready(ours, timeout)
        if smoke:
            smoke(ready)
    except Exception as err:
        rollback = _rollback(isvc, ours, old_predictor, old_version, mode, timeout)
        raise DeploymentFailed(f"{model_name} v{version} not promoted on KServe: {err}; {rollback}") from err
    try:
        # the service names its model once the model serves it (not with the canary: a rolled-back canary would
        # leave another model's name on the service)
        promotion = promote_patch(mode, entry or {}, version)
        promotion.setdefault("metadata", {}).setdefault("annotations", {})[MODEL_ANNOTATION] = model_name
        promoted = isvc.patch(promotion, ready)
    except DeploymentFailed as err:
        landed = None if isinstance(err, InferenceServiceChanged) else isvc.get()
        if not _promoted(landed, mode, uri, entry):
            rollback = ("this rollout undid nothing" if isinstance(err, InferenceServiceChanged)
                        else _rollback(isvc, ours, old_predictor, old_version, mode, timeout))
            raise DeploymentFailed(f"{model_name} v{version} not promoted on KServe: {err}; {rollback}") from err
        assert landed is not None
        promoted = landed
    # The promotion landed: v<version> serves everyone and the previous predictor no longer runs (Standard:
    # its Deployment is deleted). Undoing that would leave the service answering from nothing while the old
    # model starts again, so from here a failure is reported, not rolled back.
    where = f"InferenceService {namespace}/{isvc.name}"
    try:
        ready = isvc.wait_ready(promoted, timeout)
    except DeploymentFailed as err:
        raise DeploymentFailed(f"{model_name} v{version} was promoted on {where} after its canary passed, but: "
                               f"{err}. Not rolled back (the previous predictor no longer runs); @champion still "
                               f"names v{old_version}. To go back, deploy v{old_version} again (it runs as a "
                               f"canary first)") from err
    try:
        _move_champion(model_name, version, sleep, poll_interval)
    except Exception as err:
        raise DeploymentFailed(f"{model_name} v{version} serves on {where} (promoted after its canary passed), but "
                               f"moving @champion to it failed {ALIAS_TRIES} times: {err}. @champion still names "
                               f"v{old_version}, which no longer serves; the promotion was kept (undoing it would "
                               f"leave nothing serving while v{old_version} starts again). Deploy v{version} again "
                               f"once the registry answers: it finds v{version} serving and moves @champion") from err
    return {**result, "status": "promoted", "url": (ready.get("status") or {}).get("url"),
            "previous_version": old_version}


def _check_owner(existing: dict[str, Any], model_name: str, version: str, namespace: str, name: str) -> None:
    """DeploymentFailed when the InferenceService serves another model (its MODEL_ANNOTATION says so)."""
    serves = ((existing.get("metadata") or {}).get("annotations") or {}).get(MODEL_ANNOTATION)
    if serves is not None and serves != model_name:
        raise DeploymentFailed(f"{model_name} v{version} not deployed: InferenceService {namespace}/{name} serves "
                               f"another model, {serves!r} ({MODEL_ANNOTATION}); nothing was changed. Give this "
                               f"model its own service (deploy option name)")


def _already_serving(isvc: InferenceServiceClient, existing: dict[str, Any], mode: str,
                     serving: dict[str, Any], version: str, timeout: float,
                     model_name: str | None = None) -> dict[str, Any]:
    """The model already serves: remove a canary an interrupted rollout left beside it, make the version
    annotation name it, wait until it is Ready."""
    spec = existing.get("spec") or {}
    annotations = (existing.get("metadata") or {}).get("annotations") or {}
    body: dict[str, Any] = {}
    if mode == STANDARD and spec.get("canary"):
        body["spec"] = {"canary": None}
    if mode == KNATIVE and "canaryTrafficPercent" in (spec.get("predictor") or {}):
        body = _restore_body(serving, mode)
    if model_name is not None and annotations.get(MODEL_ANNOTATION) != model_name:
        body.setdefault("metadata", {}).setdefault("annotations", {})[MODEL_ANNOTATION] = model_name
    if annotations.get(VERSION_ANNOTATION) != version:
        body.setdefault("metadata", {}).setdefault("annotations", {})[VERSION_ANNOTATION] = version
    written = isvc.patch(body, existing) if body else existing
    ready = isvc.wait_ready(written, timeout)
    return {"status": "already_serving", "url": (ready.get("status") or {}).get("url")}


def _restore_body(old_predictor: dict[str, Any], mode: str) -> dict[str, Any]:
    """The merge patch that leaves the previous predictor serving alone: Standard, spec.canary removed (the
    stable predictor was never touched); Knative, the previous predictor spec put back (every field the canary
    patch touched) with no canaryTrafficPercent."""
    if mode != KNATIVE:
        return {"spec": {"canary": None}}
    restore = copy.deepcopy(old_predictor)
    restore.setdefault("canaryTrafficPercent", None)
    return {"metadata": {"annotations": {PREVIOUS_ANNOTATION: None}}, "spec": {"predictor": restore}}


def _rollback(isvc: InferenceServiceClient, ours: dict[str, Any], old_predictor: dict[str, Any],
              old_version: str | None, mode: str, timeout: float) -> str:
    """Remove this rollout's canary, only while the service still holds it (the patch is guarded by `ours`, the
    object the canary patch returned), and wait until the previous predictor is Ready alone."""
    try:
        restored = isvc.patch(_restore_body(old_predictor, mode), ours)
    except InferenceServiceChanged as err:
        return f"not rolled back: {err}; that rollout's state was left alone"
    except DeploymentFailed as err:
        return f"ROLLBACK FAILED ({err}): remove the canary of {isvc.namespace}/{isvc.name} by hand"
    try:
        isvc.wait_ready(restored, timeout)
    except DeploymentFailed as err:
        return f"rolled back to v{old_version}, but: {err}; @champion did not move"
    return f"rolled back to v{old_version}, which kept serving; @champion did not move"
