"""Smoke test of a running model server: a canary batch with known labels, scored through HTTP.

What the batch holds comes from the logged model itself (`model_contract`): a tabular model's feature
columns, label column and task are in its MLmodel metadata; the demo's model takes every column but `label`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from nightshift.datasets import read_split_frame
from nightshift.errors import DeploymentFailed
from nightshift.tracking import PREDICTION_COLUMN, VALUE_COLUMN

LABEL_COLUMN = "label"


@dataclass(frozen=True)
class ModelContract:
    """What a logged model takes and answers: its task, feature columns (None: every column but the label)
    and the label column of its dataset."""

    task: str = "multiclass"
    columns: tuple[str, ...] | None = None
    label: str = LABEL_COLUMN


def model_contract(model_dir: str | Path) -> ModelContract:
    """The contract recorded in a downloaded model's MLmodel metadata (tracking.log_training_run)."""
    from mlflow.models import Model

    try:
        metadata = Model.load(str(Path(model_dir) / "MLmodel")).metadata or {}
    except Exception as err:
        raise DeploymentFailed(f"{model_dir} holds no readable MLmodel ({type(err).__name__}: {err})") from err
    columns = metadata.get("nightshift.feature_columns")
    return ModelContract(task=str(metadata.get("nightshift.task") or "multiclass"),
                         columns=tuple(columns) if columns and metadata.get("nightshift.label_column") else None,
                         label=str(metadata.get("nightshift.label_column") or LABEL_COLUMN))


def canary_batch(data_dir: str | Path, rows: int, split: str = "test", contract: ModelContract | None = None,
                 within: Any = None) -> tuple[pd.DataFrame, np.ndarray]:
    """The first `rows` rows of the held-out split: (raw features, labels). `within` (a served model's learned
    FeatureSpec, when its server refuses values beyond them): only rows inside those bounds, so that the smoke
    test judges the server's answers, never a row's range."""
    contract = contract or ModelContract()
    frame = read_split_frame(data_dir, split)
    if within is not None and all(c in frame.columns for c in within.columns):
        values = frame[list(within.columns)].to_numpy(dtype=np.float64)
        inside = ((values >= np.asarray(within.low)) & (values <= np.asarray(within.high))).all(axis=1)
        if not inside.any():
            raise DeploymentFailed(f"{data_dir}/{split}.parquet has no row inside the model's training range "
                                   f"(widened) for the canary batch, which its server (range_policy refuse) "
                                   f"would take; deploy with range_policy accept, or retrain")
        frame = frame[inside]
    frame = frame.head(rows)
    if contract.label not in frame.columns:
        raise DeploymentFailed(f"{data_dir}/{split}.parquet has no {contract.label!r} column "
                               f"for the canary batch")
    labels = frame[contract.label].to_numpy()
    if contract.columns is None:
        features = frame.drop(columns=[contract.label])
    else:
        missing = [c for c in contract.columns if c not in frame.columns]
        if missing:
            raise DeploymentFailed(f"{data_dir}/{split}.parquet lacks the model's feature columns {missing[:5]} "
                                   f"for the canary batch")
        features = frame[list(contract.columns)]
    if contract.task != "regression" and np.issubdtype(labels.dtype, np.integer):
        labels = labels.astype(np.int64)
    return features.reset_index(drop=True), labels


def post_json(url: str, payload: dict[str, Any], timeout: float = 30.0) -> Any:
    import requests

    try:
        response = requests.post(f"{url}/invocations", json=payload, timeout=timeout)
    except requests.RequestException as err:
        raise DeploymentFailed(f"POST {url}/invocations failed ({type(err).__name__}: {err})") from err
    if response.status_code != 200:
        raise DeploymentFailed(f"POST {url}/invocations answered {response.status_code}: "
                               f"{response.text[:300]}")
    return response.json()["predictions"]


def smoke_test(url: str, frame: pd.DataFrame, labels: np.ndarray, *, expected_accuracy: float | None,
               tolerance: float, task: str = "multiclass") -> dict[str, Any]:
    """Predict the canary batch through the server; its accuracy must be within `tolerance` of the evaluated.

    Without an evaluated accuracy, only a well-formed answer for every row is required. A regression model
    must answer a finite `predicted_value` for every row; its RMSE on the batch is reported, not judged.
    """
    start = time.perf_counter()
    predictions = post_json(url, {"dataframe_split": {"columns": list(frame.columns),
                                                      "data": frame.to_numpy().tolist()}})
    seconds = time.perf_counter() - start
    if not isinstance(predictions, list) or len(predictions) != len(labels):
        count = len(predictions) if isinstance(predictions, list) else 0
        raise DeploymentFailed(f"smoke test: {url} answered {count} predictions "
                               f"for {len(labels)} canary rows")
    if task == "regression":
        try:
            values = np.asarray([float(p[VALUE_COLUMN]) for p in predictions])
        except (KeyError, TypeError, ValueError) as err:
            raise DeploymentFailed(f"smoke test: {url} answered without {VALUE_COLUMN!r} ({err})") from err
        if not np.isfinite(values).all():
            raise DeploymentFailed(f"smoke test: {url} answered a {VALUE_COLUMN} that is not a finite number")
        rmse = math.sqrt(float(((values - labels.astype(np.float64)) ** 2).mean()))
        return {"rows": len(labels), "rmse": rmse, "seconds": round(seconds, 4)}
    try:
        if np.issubdtype(labels.dtype, np.integer):
            hits = np.asarray([int(p[PREDICTION_COLUMN]) for p in predictions]) == labels
        else:  # class values of a tabular model (strings, floats): compared as JSON gives them back
            hits = np.asarray([str(p[PREDICTION_COLUMN]) for p in predictions]) == labels.astype(str)
    except (KeyError, TypeError, ValueError) as err:
        raise DeploymentFailed(f"smoke test: {url} answered without {PREDICTION_COLUMN!r} ({err})") from err
    accuracy = float(hits.mean())
    result = {"rows": len(labels), "accuracy": accuracy, "expected_accuracy": expected_accuracy,
              "tolerance": tolerance, "seconds": round(seconds, 4)}
    if expected_accuracy is not None and accuracy < expected_accuracy - tolerance:
        raise DeploymentFailed(f"smoke test: canary accuracy {accuracy:.4f} on {len(labels)} rows is "
                               f"more than {tolerance} below the evaluated {expected_accuracy:.4f}")
    return result
