"""The MLflow Model Registry: versions with lineage, the `@challenger` and `@champion` aliases.

One training run yields at most one version of a registered model: `register` finds the version whose
`run_id` is that run before creating one, so a retried Airflow task returns the same version.
"""

from __future__ import annotations

from typing import Any

from nightshift import tracking
from nightshift.errors import ChallengerRejected, RegistryError
from nightshift.ledger import code_version
from nightshift.tasks import METRICS

METRIC_NAMES = tuple(dict.fromkeys(m.name for metrics in METRICS.values() for m in metrics))

CHALLENGER = "challenger"
CHAMPION = "champion"
TAG_PREFIX = "nightshift."
# Tag values are stored as strings; MLflow caps model version tag values at 5000 characters.
MAX_TAG = 5000


def _is_missing(err: Exception) -> bool:
    return getattr(err, "error_code", "") in {"RESOURCE_DOES_NOT_EXIST", "NOT_FOUND"}


def lineage_tags(run_id: str, lineage: dict[str, Any] | None,
                 evaluation: dict[str, Any] | None) -> dict[str, str]:
    """Tags for a model version: the caller's lineage, the training run's params and metrics, the gate."""
    mlflow_client = tracking.client()
    run = mlflow_client.get_run(run_id)
    tags: dict[str, str] = {f"{TAG_PREFIX}training_run_id": run_id,
                            f"{TAG_PREFIX}code_commit": code_version()}
    for key, value in (lineage or {}).items():
        if value is not None:
            tags[f"{TAG_PREFIX}{key}"] = str(value)
    for key, value in run.data.params.items():
        tags[f"param.{key}"] = str(value)
    for key, value in run.data.metrics.items():
        tags[f"metric.{key}"] = repr(float(value))
    if evaluation is not None:
        tags[f"{TAG_PREFIX}gate"] = "passed" if evaluation.get("passed") else "failed"
        tags[f"{TAG_PREFIX}gate_reasons"] = " | ".join(evaluation.get("reasons", []))
        challenger = evaluation.get("challenger") or {}
        for key in METRIC_NAMES:  # every task's scalar metrics (nightshift.tasks) the evaluation holds
            if key in challenger:
                tags[f"{TAG_PREFIX}eval.{key}"] = repr(float(challenger[key]))
        if evaluation.get("split"):
            tags[f"{TAG_PREFIX}eval.split"] = str(evaluation["split"])
        champion = evaluation.get("champion")
        tags[f"{TAG_PREFIX}eval.champion_version"] = str(champion["version"]) if champion else ""
    return {k: v[:MAX_TAG] for k, v in tags.items()}


def _version_for_run(model_name: str, run_id: str) -> Any:
    found = tracking.client().search_model_versions(f"name = '{model_name}' and run_id = '{run_id}'")
    versions = [v for v in found if v.run_id == run_id]
    return min(versions, key=lambda v: int(v.version)) if versions else None


def _ensure_registered_model(model_name: str) -> None:
    mlflow_client = tracking.client()
    try:
        mlflow_client.get_registered_model(model_name)
    except Exception as err:
        if not _is_missing(err):
            raise
        try:
            mlflow_client.create_registered_model(
                model_name, description="Registered by Nightshift; see each version's nightshift.* tags.")
        except Exception as create_err:
            if getattr(create_err, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                raise


def _describe(model_name: str, version: Any, created: bool, alias: str | None) -> dict[str, Any]:
    return {"model_name": model_name, "version": str(version.version), "run_id": version.run_id,
            "model_uri": f"models:/{model_name}/{version.version}", "source": version.source,
            "alias": alias, "created": created}


def register(run_id: str, *, model_name: str = "nightshift-digits", lineage: dict[str, Any] | None = None,
             evaluation: dict[str, Any] | None = None, alias: str = CHALLENGER,
             pending_approval: bool = False) -> dict[str, Any]:
    """Register the model of training run `run_id` with its lineage and give it `alias`.

    `lineage` holds what the DAG knows (`dataset_version`, `dataset_git_rev`, `dag_id`, `dag_run_id`, …);
    each key becomes a `nightshift.<key>` tag. With an `evaluation` (the dict `evaluate()` returned) that
    did not pass, nothing is registered and ChallengerRejected is raised, unless it awaits a person's decision
    (`needs_approval`: the champion could not be compared) and the caller says an approval step follows
    (`pending_approval`). A version already registered for
    this run is returned (`created` false) instead of a second one. On a failure after creation the new
    version is deleted, so no version without its tags or alias remains.

    Returns {"model_name", "version", "run_id", "model_uri", "source", "alias", "created"}.
    """
    awaiting = pending_approval and evaluation is not None and bool(evaluation.get("needs_approval"))
    if evaluation is not None and not evaluation.get("passed") and not awaiting:
        reasons = "; ".join(evaluation.get("reasons", []))
        raise ChallengerRejected(f"run {run_id} did not pass the gate: {reasons}")
    model_uri = tracking.run_model_uri(run_id)
    mlflow_client = tracking.client()
    try:
        existing = _version_for_run(model_name, run_id)
    except Exception as err:
        if not _is_missing(err):
            raise RegistryError(f"searching {model_name} for run {run_id} failed ({err})") from err
        existing = None
    if existing is not None:
        try:
            mlflow_client.set_registered_model_alias(model_name, alias, str(existing.version))
        except Exception as err:
            raise RegistryError(f"setting @{alias} on {model_name} v{existing.version} failed ({err}); "
                                f"retry the task") from err
        return _describe(model_name, existing, created=False, alias=alias)

    tags = lineage_tags(run_id, lineage, evaluation)
    try:
        _ensure_registered_model(model_name)
        model_id = model_uri.removeprefix("models:/") if model_uri.startswith("models:/m-") else None
        version = mlflow_client.create_model_version(model_name, source=model_uri, run_id=run_id,
                                                     tags=tags, model_id=model_id)
    except Exception as err:
        raise RegistryError(f"registering run {run_id} as {model_name} failed ({type(err).__name__}: {err}); "
                            f"check the tracking store {tracking.tracking_uri()}") from err
    try:
        mlflow_client.set_registered_model_alias(model_name, alias, str(version.version))
    except Exception as err:
        mlflow_client.delete_model_version(model_name, str(version.version))
        raise RegistryError(f"setting @{alias} on {model_name} v{version.version} failed ({err}); "
                            f"the version was deleted, retry the task") from err
    return _describe(model_name, version, created=True, alias=alias)


def version_by_alias(model_name: str, alias: str) -> Any | None:
    """The ModelVersion `model_name@alias`, or None when the model or the alias does not exist."""
    try:
        return tracking.client().get_model_version_by_alias(model_name, alias)
    except Exception as err:
        if _is_missing(err) or getattr(err, "error_code", "") == "INVALID_PARAMETER_VALUE":
            return None
        raise RegistryError(f"reading {model_name}@{alias} failed ({err})") from err


def get_version(model_name: str, version: str) -> Any:
    try:
        return tracking.client().get_model_version(model_name, str(version))
    except Exception as err:
        raise RegistryError(f"{model_name} version {version} not found ({err}); "
                            f"list versions with `mlflow models` or the MLflow UI") from err


def set_alias(model_name: str, alias: str, version: str) -> None:
    try:
        tracking.client().set_registered_model_alias(model_name, alias, str(version))
    except Exception as err:
        raise RegistryError(f"setting {model_name}@{alias} to v{version} failed ({err})") from err


def evaluated_accuracy(version: Any) -> float | None:
    """The test accuracy `evaluate` measured for a version, from its tags."""
    value = (version.tags or {}).get(f"{TAG_PREFIX}eval.accuracy")
    return float(value) if value else None
