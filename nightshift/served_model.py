"""The served model: the pyfunc MLflow pickles, and the classifier it rebuilds from the model's artifacts.

This module travels inside every logged model (MLflow `code_paths`, see `SERVED_MODULES`), so a host
that has never seen this project (`mlflow models serve --env-manager virtualenv`, KServe's MLServer, a
plain virtualenv) loads the model with the model's own `requirements.txt` alone. Its import chain is
therefore kept to torch, numpy, pandas, mlflow and the few Nightshift modules in `SERVED_MODULES`:
nothing here may import GX, DVC, Horovod, scikit-learn or Airflow (a test checks it in a subprocess).

The classifier takes the dataset's raw table columns (for the demo, `pixel_0`…`pixel_63` in 0-16) and
answers `predicted_label` and `prob_<k>` per row; bad input is an MLflow 400.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from mlflow.pyfunc import PythonModel

from nightshift.errors import DataError, TrackingError

# Rows one request may carry. A larger batch is a client bug or an abuse; the server answers 400.
MAX_ROWS = int(os.environ.get("NIGHTSHIFT_SERVING_MAX_ROWS", "4096"))
PREDICTION_COLUMN = "predicted_label"
# Written beside model.pt/model.json in the logged model: the feature columns and the plugin modules,
# resolved when the model was logged, so serving depends on no registry or environment variable.
SERVING_INFO = "serving.json"

# The Nightshift modules the served model imports (the package's __init__ files included). They are
# copied into the model's `code/nightshift/`; tests/unit/nightshift/test_tracking.py checks that loading
# and predicting imports no other Nightshift module.
SERVED_MODULES = (
    "nightshift",
    "nightshift.errors",
    "nightshift.fsutil",
    "nightshift.plugins",
    "nightshift.models",
    "nightshift.served_model",
    "nightshift.train",
    "nightshift.train.artifacts",
)


@dataclass(frozen=True)
class FeatureSpec:
    """The raw table columns a served model accepts, their valid range and how the trainer scaled them."""

    columns: tuple[str, ...]
    scale: float = 1.0
    low: float = -math.inf
    high: float = math.inf

    def to_json(self) -> dict[str, Any]:
        """JSON has no infinity: an open bound is null."""
        return {"columns": list(self.columns), "scale": self.scale,
                "low": None if math.isinf(self.low) else self.low,
                "high": None if math.isinf(self.high) else self.high}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FeatureSpec:
        low, high = data.get("low"), data.get("high")
        return cls(columns=tuple(str(c) for c in data["columns"]), scale=float(data.get("scale", 1.0)),
                   low=-math.inf if low is None else float(low), high=math.inf if high is None else float(high))


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
                            f"add it to nightshift.served_model.FEATURE_SPECS")
    return FeatureSpec(columns=tuple(f"x_{i}" for i in range(size)))


def read_serving_info(model_dir: str | Path) -> dict[str, Any] | None:
    """`serving.json` of a logged model, or None for a training output or a model logged before it existed."""
    path = Path(model_dir) / SERVING_INFO
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path} is not valid JSON ({err})") from err
    if not isinstance(info, dict):
        raise DataError(f"{path} must hold a JSON object")
    return info


def _invalid(message: str) -> Exception:
    from mlflow.exceptions import MlflowException

    return MlflowException.invalid_parameter_value(message)


_NOT_FINITE = "feature values must be finite numbers"


class TorchTableClassifier:
    """Loads `model.pt` + `model.json` and classifies rows of the raw table; bad input → 400."""

    def __init__(self, model_dir: str | Path) -> None:
        from nightshift.train.artifacts import load_trained_model, read_model_info

        spec = read_model_info(model_dir)
        served = read_serving_info(model_dir)
        if served is not None:
            # The modules that registered the model's name at training time (NIGHTSHIFT_PLUGINS then).
            for module_name in served.get("plugins") or ():
                importlib.import_module(module_name)
            self.features = FeatureSpec.from_json(served["features"])
        else:
            self.features = feature_spec(spec["dataset"], spec.get("input_shape"))
        self.num_classes = int(spec["num_classes"])
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
        faults = set(self.invalid_rows(values).values())
        if faults:  # a value that is not finite is named first, as it always was
            raise _invalid(_NOT_FINITE if _NOT_FINITE in faults else faults.pop())
        return values

    def invalid_rows(self, values: np.ndarray) -> dict[int, str]:
        """Row index → why, for the rows of a float32 matrix (the feature columns in order) that `validate`
        refuses for their values (not finite, out of range); in row order. One vectorised pass: what a stream
        consumer checks its batches with."""
        finite = np.isfinite(values).all(axis=1)
        in_range = ((values >= self.features.low) & (values <= self.features.high)).all(axis=1)
        if finite.all() and in_range.all():
            return {}
        out_of_range = f"feature values must lie in [{self.features.low:g}, {self.features.high:g}]"
        return {int(i): _NOT_FINITE if not finite[i] else out_of_range
                for i in np.flatnonzero(~(finite & in_range))}

    def proba(self, values: np.ndarray) -> np.ndarray:
        """Class probabilities for a float32 matrix that `validate` (or `invalid_rows`) accepted."""
        import torch

        values = values / np.float32(self.features.scale)
        with torch.inference_mode():
            logits = self.model(torch.from_numpy(np.ascontiguousarray(values)))
            return torch.softmax(logits, dim=1).numpy()

    def predict_proba(self, frame: pd.DataFrame) -> np.ndarray:
        return self.proba(self.validate(frame))

    def predict(self, frame: pd.DataFrame) -> pd.DataFrame:
        proba = self.predict_proba(frame)
        out = pd.DataFrame(proba, columns=[f"prob_{k}" for k in range(self.num_classes)])
        out.insert(0, PREDICTION_COLUMN, proba.argmax(axis=1).astype(np.int64))
        return out


class NightshiftPyfunc(PythonModel):
    """The pyfunc wrapper MLflow pickles (by reference); the classifier is rebuilt from the artifacts.

    Models logged before this module existed refer to `nightshift.tracking.NightshiftPyfunc`, which
    tracking keeps as an alias of this class.
    """

    def load_context(self, context: Any) -> None:
        self.classifier = TorchTableClassifier(context.artifacts["model_dir"])

    # No annotations here: MLflow reads predict()'s type hints as a schema and warns about these.
    def predict(self, context, model_input, params=None):
        return self.classifier.predict(model_input)
