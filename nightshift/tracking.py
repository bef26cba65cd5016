"""MLflow tracking: one run per training task, and the servable model it logs.

The trainer's rank 0 calls `log_training_run(out_dir, ...)` once training ends. The run holds the
hyperparameters (from `model.json`), per-epoch metrics (from `metrics.jsonl`, step = epoch), the final
metrics (`metrics.json`) and a pyfunc model that takes the dataset's raw table columns (for the demo,
`pixel_0`…`pixel_63` in 0-16), so `mlflow models serve --env-manager local` answers the user's own
rows. Logging is idempotent by the tag `nightshift.run_key`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from mlflow.pyfunc import PythonModel

from nightshift import settings
from nightshift.errors import TrackingError

if TYPE_CHECKING:
    from mlflow import MlflowClient

RUN_KEY_TAG = "nightshift.run_key"
MODEL_URI_TAG = "nightshift.model_uri"
COMPLETE_TAG = "nightshift.complete"
MODEL_ARTIFACT = "model"
RUN_RECORD = "mlflow_run.json"
# Rows one request may carry. A larger batch is a client bug or an abuse; the server answers 400.
MAX_ROWS = int(os.environ.get("NIGHTSHIFT_SERVING_MAX_ROWS", "4096"))
PREDICTION_COLUMN = "predicted_label"


@dataclass(frozen=True)
class FeatureSpec:
    """The raw table columns a served model accepts, their valid range and how the trainer scaled them."""

    columns: tuple[str, ...]
    scale: float = 1.0
    low: float = -math.inf
    high: float = math.inf


FEATURE_SPECS: dict[str, FeatureSpec] = {
    "digits": FeatureSpec(columns=tuple(f"pixel_{i}" for i in range(64)), scale=16.0, low=0.0, high=16.0),
}


def feature_spec(dataset: str, input_shape: list[int] | tuple[int, ...] | None = None) -> FeatureSpec:
    """The serving columns of `dataset`; an unknown dataset gets `x_0`… over its flattened input."""
    if dataset in FEATURE_SPECS:
        return FEATURE_SPECS[dataset]
    size = int(np.prod(input_shape)) if input_shape else 0
    if size <= 0:
        raise TrackingError(f"dataset {dataset!r} has no FeatureSpec and model.json has no input_shape; "
                            f"add it to nightshift.tracking.FEATURE_SPECS")
    return FeatureSpec(columns=tuple(f"x_{i}" for i in range(size)))


def client() -> MlflowClient:
    """An MlflowClient on the configured tracking URI (also set as mlflow's global URI)."""
    import mlflow

    uri = settings.mlflow_tracking_uri()
    # mlflow.set_tracking_uri also exports MLFLOW_TRACKING_URI (and the registry one) into os.environ,
    # which would pin every later settings.mlflow_tracking_uri() of this process to the first store.
    saved = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    try:
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)


def ensure_experiment(name: str) -> str:
    """The experiment's id, creating it (with artifacts under NIGHTSHIFT_HOME for local stores)."""
    mlflow_client = client()
    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            mlflow_client.restore_experiment(experiment.experiment_id)
        return str(experiment.experiment_id)
    uri = settings.mlflow_tracking_uri()
    location = None
    if not uri.startswith(("http://", "https://", "databricks")):
        root = Path(settings.mlflow_artifact_root())
        root.mkdir(parents=True, exist_ok=True)
        location = (root / name).as_uri()
    try:
        return str(mlflow_client.create_experiment(name, artifact_location=location))
    except Exception:  # created concurrently by another task
        experiment = mlflow_client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return str(experiment.experiment_id)


# --- the served model -------------------------------------------------------------------------------


def _invalid(message: str) -> Exception:
    from mlflow.exceptions import MlflowException

    return MlflowException.invalid_parameter_value(message)


class TorchTableClassifier:
    """Loads `model.pt` + `model.json` and classifies rows of the raw table; bad input → 400."""

    def __init__(self, model_dir: str | Path) -> None:
        from nightshift.train.artifacts import load_trained_model, read_model_info

        spec = read_model_info(model_dir)
        self.num_classes = int(spec["num_classes"])
        self.features = feature_spec(spec["dataset"], spec.get("input_shape"))
        self.model = load_trained_model(model_dir)  # weights_only load, eval mode

    def validate(self, frame: Any) -> np.ndarray:
        if not isinstance(frame, pd.DataFrame):
            raise _invalid(f"expected a table with columns {self.features.columns[0]}…"
                           f"{self.features.columns[-1]}, got {type(frame).__name__}")
        if len(frame) == 0:
            raise _invalid("the request has no rows")
        if len(frame) > MAX_ROWS:
            raise _invalid(f"the request has {len(frame)} rows; send at most {MAX_ROWS} per request")
        missing = [c for c in self.features.columns if c not in frame.columns]
        if missing:
            raise _invalid(f"missing columns {missing[:5]}{'…' if len(missing) > 5 else ''}")
        try:
            values = frame[list(self.features.columns)].to_numpy(dtype=np.float32)
        except (TypeError, ValueError) as err:
            raise _invalid(f"feature columns must be numbers ({err})") from err
        if not np.isfinite(values).all():
            raise _invalid("feature values must be finite numbers")
        if values.min() < self.features.low or values.max() > self.features.high:
            raise _invalid(f"feature values must lie in [{self.features.low:g}, {self.features.high:g}]")
        return values

    def predict_proba(self, frame: pd.DataFrame) -> np.ndarray:
        import torch

        values = self.validate(frame) / np.float32(self.features.scale)
        with torch.inference_mode():
            logits = self.model(torch.from_numpy(np.ascontiguousarray(values)))
            return torch.softmax(logits, dim=1).numpy()

    def predict(self, frame: pd.DataFrame) -> pd.DataFrame:
        proba = self.predict_proba(frame)
        out = pd.DataFrame(proba, columns=[f"prob_{k}" for k in range(self.num_classes)])
        out.insert(0, PREDICTION_COLUMN, proba.argmax(axis=1).astype(np.int64))
        return out


class NightshiftPyfunc(PythonModel):
    """The pyfunc wrapper MLflow pickles (by reference); the classifier is rebuilt from the artifacts."""

    def load_context(self, context: Any) -> None:
        self.classifier = TorchTableClassifier(context.artifacts["model_dir"])

    # No annotations here: MLflow reads predict()'s type hints as a schema and warns about these.
    def predict(self, context, model_input, params=None):
        return self.classifier.predict(model_input)


# --- logging a training run -------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise TrackingError(f"{path} is missing: is {path.parent} a finished training output?") from err
    except json.JSONDecodeError as err:
        raise TrackingError(f"{path} is not valid JSON ({err})") from err


def _epoch_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    lines = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise TrackingError(f"{path}:{number} is not a JSON line ({err})") from err
        if record.get("event") == "epoch":
            lines.append(record)
    return lines


def _numeric(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v))}


def _final_metrics(final: dict[str, Any], epochs: list[dict[str, Any]]) -> dict[str, float]:
    """Final metrics; a repeat of the last epoch's value is skipped, a different value is `final_*`."""
    last = _numeric(epochs[-1]) if epochs else {}
    out: dict[str, float] = {}
    for key, value in _numeric(final).items():
        if key not in last:
            out[key] = value
        elif last[key] != value:
            out[f"final_{key}"] = value
    return out


def flat_params(spec: dict[str, Any]) -> dict[str, str]:
    """Hyperparameters of `model.json` as MLflow params (`model`, `dataset`, `model.<k>`, `<param>`)."""
    params: dict[str, str] = {"model": str(spec.get("model")), "dataset": str(spec.get("dataset"))}
    for key, value in (spec.get("model_kwargs") or {}).items():
        params[f"model.{key}"] = json.dumps(value) if not isinstance(value, str) else value
    for key, value in (spec.get("params") or {}).items():
        params[str(key)] = json.dumps(value) if not isinstance(value, str) else value
    return {k: v[:6000] for k, v in params.items()}


def example_frame(spec: FeatureSpec, rows: int = 3) -> pd.DataFrame:
    """A deterministic input example inside the feature range."""
    low = 0.0 if math.isinf(spec.low) else spec.low
    high = 1.0 if math.isinf(spec.high) else spec.high
    grid = np.linspace(low, high, num=len(spec.columns) * rows, dtype=np.float64).reshape(rows, -1)
    return pd.DataFrame(grid, columns=list(spec.columns))


def _pip_requirements() -> list[str]:
    return [f"{name}=={metadata.version(name)}" for name in ("mlflow", "torch", "numpy", "pandas")]


def _find_run(mlflow_client: MlflowClient, experiment_id: str, run_key: str) -> Any:
    runs = mlflow_client.search_runs([experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'",
                                     max_results=10)
    return runs


def _write_record(out_dir: Path, record: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".mlflow_run.", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle, indent=2, sort_keys=True)
    os.replace(tmp, out_dir / RUN_RECORD)


def log_training_run(out_dir: str | Path, *, experiment: str, run_name: str | None = None,
                     tags: dict[str, str] | None = None) -> str:
    """Log a finished training output directory as one MLflow run; return its run_id.

    With `tags["nightshift.run_key"]`, a complete run with that key is returned as is, and an incomplete
    one (a crash mid-logging) is deleted and logged again, so a retried task ends with exactly one run.
    """
    import mlflow
    from mlflow.models import infer_signature

    out = Path(out_dir)
    spec = _read_json(out / "model.json")
    final = _read_json(out / "metrics.json")
    epochs = _epoch_metrics(out / "metrics.jsonl")
    if not (out / "model.pt").is_file():
        raise TrackingError(f"{out / 'model.pt'} is missing: is {out} a finished training output?")
    tags = dict(tags or {})
    mlflow_client = client()
    experiment_id = ensure_experiment(experiment)
    run_key = tags.get(RUN_KEY_TAG)
    if run_key:
        for run in _find_run(mlflow_client, experiment_id, run_key):
            if run.data.tags.get(COMPLETE_TAG) == "true":
                _write_record(out, _record(run.info.run_id, experiment_id, run.data.tags[MODEL_URI_TAG]))
                return str(run.info.run_id)
            mlflow_client.delete_run(run.info.run_id)

    features = feature_spec(spec["dataset"], spec.get("input_shape"))
    classifier = TorchTableClassifier(out)
    example = example_frame(features)
    signature = infer_signature(example, classifier.predict(example))
    run = mlflow_client.create_run(experiment_id, run_name=run_name, tags=tags)
    run_id = str(run.info.run_id)
    try:
        with mlflow.start_run(run_id=run_id):
            mlflow.log_params(flat_params(spec))
            # A resumed training appends an epoch again: the last line for an epoch wins.
            for step, record in sorted({int(r["epoch"]): r for r in epochs}.items()):
                mlflow.log_metrics(_numeric({k: v for k, v in record.items()
                                             if k not in {"event", "epoch", "step"}}), step=step)
            mlflow.log_metrics(_final_metrics(final, epochs))
            for name in ("model.json", "metrics.json", "metrics.jsonl"):
                if (out / name).is_file():
                    mlflow.log_artifact(str(out / name), artifact_path="training")
            with tempfile.TemporaryDirectory() as staging:
                # Only the weights and their description go into the model: not checkpoints, not logs.
                for name in ("model.pt", "model.json"):
                    (Path(staging) / name).write_bytes((out / name).read_bytes())
                info = mlflow.pyfunc.log_model(
                    name=MODEL_ARTIFACT,
                    python_model=NightshiftPyfunc(),
                    artifacts={"model_dir": staging},
                    signature=signature,
                    input_example=example,
                    pip_requirements=_pip_requirements(),
                )
            mlflow.set_tags({MODEL_URI_TAG: info.model_uri, COMPLETE_TAG: "true"})
    except Exception as err:
        mlflow_client.delete_run(run_id)
        raise TrackingError(f"logging {out} to MLflow experiment {experiment!r} failed "
                            f"({type(err).__name__}: {err}); the partial run was deleted") from err
    _write_record(out, _record(run_id, experiment_id, info.model_uri))
    return run_id


def _record(run_id: str, experiment_id: str, model_uri: str) -> dict[str, Any]:
    return {"run_id": run_id, "experiment_id": experiment_id, "model_uri": model_uri,
            "tracking_uri": settings.mlflow_tracking_uri()}


def find_training_run(experiment: str, run_key: str) -> dict[str, Any]:
    """The complete training run tagged `nightshift.run_key=run_key`: id, experiment, model URI, metrics.

    This is how a training job's result comes back to Airflow: through the tracking server, never through
    files on the Airflow worker's disk (the job may have run on other machines).
    """
    mlflow_client = client()
    found = mlflow_client.get_experiment_by_name(experiment)
    where = f"experiment {experiment!r} at {settings.mlflow_tracking_uri()}"
    if found is None:
        raise TrackingError(f"no {where}")
    runs = [run for run in _find_run(mlflow_client, str(found.experiment_id), run_key)
            if run.data.tags.get(COMPLETE_TAG) == "true"]
    if not runs:
        raise TrackingError(f"no complete run tagged {RUN_KEY_TAG}={run_key!r} in {where}")
    run = runs[0]
    return {"run_id": str(run.info.run_id), "experiment_id": str(found.experiment_id),
            "model_uri": run.data.tags[MODEL_URI_TAG], "metrics": dict(run.data.metrics)}


def run_model_uri(run_id: str) -> str:
    """The model URI a complete Nightshift training run logged."""
    mlflow_client = client()
    try:
        run = mlflow_client.get_run(run_id)
    except Exception as err:
        raise TrackingError(f"MLflow run {run_id} not found in {settings.mlflow_tracking_uri()} "
                            f"({err})") from err
    uri = run.data.tags.get(MODEL_URI_TAG)
    if not uri or run.data.tags.get(COMPLETE_TAG) != "true":
        raise TrackingError(f"MLflow run {run_id} has no complete Nightshift model; re-run the training task")
    return str(uri)
