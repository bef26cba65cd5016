"""Smoke test of a running model server: a canary batch with known labels, scored through HTTP."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from nightshift.datasets import read_split_frame
from nightshift.errors import DeploymentFailed
from nightshift.tracking import PREDICTION_COLUMN

LABEL_COLUMN = "label"


def canary_batch(data_dir: str | Path, rows: int, split: str = "test") -> tuple[pd.DataFrame, np.ndarray]:
    """The first `rows` rows of the held-out split: (raw features, labels)."""
    frame = read_split_frame(data_dir, split).head(rows)
    if LABEL_COLUMN not in frame.columns:
        raise DeploymentFailed(f"{data_dir}/{split}.parquet has no {LABEL_COLUMN!r} column "
                               f"for the canary batch")
    return frame.drop(columns=[LABEL_COLUMN]).reset_index(drop=True), frame[LABEL_COLUMN].to_numpy(np.int64)


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
               tolerance: float) -> dict[str, Any]:
    """Predict the canary batch through the server; its accuracy must be within `tolerance` of the evaluated.

    Without an evaluated accuracy, only a well-formed answer for every row is required.
    """
    start = time.perf_counter()
    predictions = post_json(url, {"dataframe_split": {"columns": list(frame.columns),
                                                      "data": frame.to_numpy().tolist()}})
    seconds = time.perf_counter() - start
    if not isinstance(predictions, list) or len(predictions) != len(labels):
        count = len(predictions) if isinstance(predictions, list) else 0
        raise DeploymentFailed(f"smoke test: {url} answered {count} predictions "
                               f"for {len(labels)} canary rows")
    try:
        predicted = np.asarray([int(p[PREDICTION_COLUMN]) for p in predictions])
    except (KeyError, TypeError, ValueError) as err:
        raise DeploymentFailed(f"smoke test: {url} answered without {PREDICTION_COLUMN!r} ({err})") from err
    accuracy = float((predicted == labels).mean())
    result = {"rows": len(labels), "accuracy": accuracy, "expected_accuracy": expected_accuracy,
              "tolerance": tolerance, "seconds": round(seconds, 4)}
    if expected_accuracy is not None and accuracy < expected_accuracy - tolerance:
        raise DeploymentFailed(f"smoke test: canary accuracy {accuracy:.4f} on {len(labels)} rows is "
                               f"more than {tolerance} below the evaluated {expected_accuracy:.4f}")
    return result
