"""The `kserve` target: a KServe `InferenceService` (serving.kserve.io/v1beta1, MLflow format).

The first deployment creates the service; a later one patches the predictor's `storageUri` with
`canaryTrafficPercent` so the new revision takes a share of the traffic beside the rolled-out one, waits
for Ready, optionally smoke-tests it, then promotes it (the canary field removed: 100 % to the new
revision) and moves `@champion`. On failure the previous predictor spec is restored (KServe keeps the
previously rolled-out revision serving meanwhile) or a service this call created is deleted.

The predictor names the ServingRuntime `nightshift-mlserver-torch` (`deploy/kserve/servingruntime.yaml`:
MLServer with its MLflow runtime and torch, built from `images/serving/Dockerfile`); KServe's stock
`kserve-mlserver` has no torch. `NIGHTSHIFT_KSERVE_RUNTIME` names another, or `""` lets KServe pick.

The storage URI is the registered version's artifact location, which KServe's storage initializer must
be able to fetch *as a directory*: `s3://`, `gs://`, `hdfs://`, `webhdfs://`, Azure Blob/File `https://`
URLs, or `pvc://<claim>/<path>`. A local store (`file://`, the embedded default), MLflow's proxied
`mlflow-artifacts:` or a plain `http(s)://` URL (the initializer downloads one file from those) is
refused before anything is created, unless `NIGHTSHIFT_KSERVE_STORAGE_MAP` rewrites its prefix (e.g.
`file:///nightshift/=pvc://nightshift-workspace/`, `mlflow-artifacts:/=s3://bucket/mlartifacts/`).

`api` is anything with the four methods of kubernetes' `CustomObjectsApi` used here (the cncf
provider's `KubernetesHook().custom_object_client` in Airflow); errors carry an HTTP `status`.
Patches are JSON merge patches, as the real client sends for dict bodies: `None` removes a field.
"""

from __future__ import annotations

import copy
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nightshift import registry, tracking
from nightshift.errors import DeploymentFailed, UsageError

GROUP = "serving.kserve.io"
VERSION = "v1beta1"
PLURAL = "inferenceservices"
VERSION_ANNOTATION = "nightshift.io/model-version"
TERMINAL_REASONS = frozenset({"RevisionFailed", "ContainerCreationFailed", "RevisionMissing"})
RUNTIME_ENV = "NIGHTSHIFT_KSERVE_RUNTIME"
DEFAULT_RUNTIME = "nightshift-mlserver-torch"
STORAGE_MAP_ENV = "NIGHTSHIFT_KSERVE_STORAGE_MAP"
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
    """A DNS-1035 label for the InferenceService of `model_name`."""
    name = re.sub(r"[^a-z0-9-]+", "-", model_name.lower()).strip("-")[:45].strip("-")
    if not name or not name[0].isalpha():
        name = f"m-{name}".strip("-")
    return name


def inference_service(name: str, namespace: str, storage_uri: str, *, model_version: str,
                      canary_traffic_percent: int | None = None, service_account: str | None = None,
                      labels: dict[str, str] | None = None, resources: dict[str, Any] | None = None,
                      runtime: str | None = None) -> dict[str, Any]:
    """The InferenceService manifest: an MLflow-format predictor (Open Inference Protocol v2)."""
    if canary_traffic_percent is not None and not 0 <= canary_traffic_percent <= 100:
        raise UsageError(f"canary_traffic_percent must be within 0..100, got {canary_traffic_percent}")
    model: dict[str, Any] = {"modelFormat": {"name": "mlflow"}, "protocolVersion": "v2",
                             "storageUri": storage_uri}
    if runtime:
        model["runtime"] = runtime
    if resources:
        model["resources"] = resources
    predictor: dict[str, Any] = {"model": model}
    if canary_traffic_percent is not None:
        predictor["canaryTrafficPercent"] = canary_traffic_percent
    if service_account:
        predictor["serviceAccountName"] = service_account
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "nightshift", **(labels or {})},
                     "annotations": {VERSION_ANNOTATION: model_version}},
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

    def patch(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return dict(self.api.patch_namespaced_custom_object(*self._args(), self.name, body))
        except Exception as err:
            raise self._failed("patching", err) from err

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

    def wait_ready(self, generation: int, timeout: float) -> dict[str, Any]:
        """Wait until the service has observed `generation`, is Ready, and its latest revision is ready."""
        deadline = self.clock() + timeout
        last = "no status yet"
        while True:
            obj = self.get()
            if obj is None:
                raise DeploymentFailed(f"InferenceService {self.namespace}/{self.name} disappeared while "
                                       f"waiting for it to become Ready")
            status = obj.get("status") or {}
            conditions = {c.get("type"): c for c in status.get("conditions") or []}
            ready = conditions.get("Ready", {})
            predictor = (status.get("components") or {}).get("predictor") or {}
            observed = int(status.get("observedGeneration") or 0)
            if observed >= generation:
                created = predictor.get("latestCreatedRevision")
                revision_ready = created is None or created == predictor.get("latestReadyRevision")
                if ready.get("status") == "True" and revision_ready:
                    return obj
                failing = [c for c in conditions.values()
                           if c.get("status") == "False" and c.get("reason") in TERMINAL_REASONS]
                if failing:
                    c = failing[0]
                    raise DeploymentFailed(f"InferenceService {self.namespace}/{self.name} failed: "
                                           f"{c.get('type')} {c.get('reason')}: {c.get('message', '')}")
                last = f"Ready={ready.get('status', 'Unknown')} {ready.get('reason', '')}".strip()
            if self.clock() >= deadline:
                raise DeploymentFailed(f"InferenceService {self.namespace}/{self.name} not Ready within "
                                       f"{timeout:.0f}s (last: {last})")
            self.sleep(self.poll_interval)


def _generation(obj: dict[str, Any]) -> int:
    return int((obj.get("metadata") or {}).get("generation") or 1)


def deploy_kserve(model_name: str, *, api: Any, namespace: str, version: str | None = None,
                  alias: str = registry.CHALLENGER, name: str | None = None, storage: str | None = None,
                  canary_traffic_percent: int = 10, timeout: float = 600.0, poll_interval: float = 5.0,
                  smoke: Callable[[dict[str, Any]], None] | None = None, service_account: str | None = None,
                  runtime: str | None = None, sleep: Callable[[float], None] = time.sleep,
                  clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Roll `model_name` `version` (default `@alias`) out to KServe with a canary, then promote or roll back.

    `storage` overrides the storage URI read from the registry (e.g. an s3:// mirror of the artifacts);
    either must be one KServe can fetch (see `kserve_storage_uri`), else DeploymentFailed before any API
    call. `runtime` names the ServingRuntime (default: `default_runtime()`).
    `smoke(isvc)` may check the canary (it gets the Ready object; raise to reject).
    Returns {"target": "kserve", "status": "created" | "promoted" | "already_serving", "model_name",
    "version", "name", "namespace", "storage_uri", "url", "previous_version"}.
    """
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
    if existing is None:
        body = inference_service(isvc.name, namespace, uri, model_version=version,
                                 service_account=service_account,
                                 runtime=default_runtime() if runtime is None else runtime)
        obj, created = isvc.create(body)
        if created:
            try:
                ready = isvc.wait_ready(_generation(obj), timeout)
                if smoke:
                    smoke(ready)
                registry.set_alias(model_name, registry.CHAMPION, version)
            except Exception as err:
                isvc.delete()
                raise DeploymentFailed(f"{model_name} v{version} not deployed to KServe: {err}; the "
                                       f"InferenceService it created was deleted") from err
            return {**result, "status": "created", "url": (ready.get("status") or {}).get("url"),
                    "previous_version": None}
        existing = obj

    old_predictor = copy.deepcopy((existing.get("spec") or {}).get("predictor") or {})
    old_version = ((existing.get("metadata") or {}).get("annotations") or {}).get(VERSION_ANNOTATION)
    old_uri = (old_predictor.get("model") or {}).get("storageUri")
    if old_uri == uri and "canaryTrafficPercent" not in old_predictor:
        ready = isvc.wait_ready(_generation(existing), timeout)
        registry.set_alias(model_name, registry.CHAMPION, version)
        return {**result, "status": "already_serving", "url": (ready.get("status") or {}).get("url"),
                "previous_version": old_version}

    canary = {"metadata": {"annotations": {VERSION_ANNOTATION: version}},
              "spec": {"predictor": {"canaryTrafficPercent": canary_traffic_percent,
                                     "model": {"storageUri": uri}}}}
    try:
        patched = isvc.patch(canary)
        ready = isvc.wait_ready(_generation(patched), timeout)
        if smoke:
            smoke(ready)
        promoted = isvc.patch({"spec": {"predictor": {"canaryTrafficPercent": None}}})
        ready = isvc.wait_ready(_generation(promoted), timeout)
        registry.set_alias(model_name, registry.CHAMPION, version)
    except Exception as err:
        rollback = _rollback(isvc, old_predictor, old_version)
        raise DeploymentFailed(f"{model_name} v{version} not promoted on KServe: {err}; {rollback}") from err
    return {**result, "status": "promoted", "url": (ready.get("status") or {}).get("url"),
            "previous_version": old_version}


def _rollback(isvc: InferenceServiceClient, old_predictor: dict[str, Any], old_version: str | None) -> str:
    """Put the previous predictor spec back (every field the canary patch touched), pinned at 100 %."""
    restore = copy.deepcopy(old_predictor)
    restore.setdefault("canaryTrafficPercent", None)
    try:
        isvc.patch({"metadata": {"annotations": {VERSION_ANNOTATION: old_version}},
                    "spec": {"predictor": restore}})
    except DeploymentFailed as err:
        return f"ROLLBACK FAILED ({err}): restore {isvc.namespace}/{isvc.name} by hand"
    return f"rolled back to v{old_version}, whose revision kept serving; @champion did not move"
