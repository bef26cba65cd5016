"""The served model: the pyfunc MLflow pickles, and the classifier it rebuilds from the model's artifacts.

This module travels inside every logged model (MLflow `code_paths`, see `SERVED_MODULES`), so a host
that has never seen this project (`mlflow models serve --env-manager virtualenv`, KServe's MLServer, a
plain virtualenv) loads the model with the model's own `requirements.txt` alone. Its import chain is
therefore kept to torch, numpy, pandas, mlflow and the few Nightshift modules in `SERVED_MODULES`:
nothing here may import GX, DVC, Horovod, scikit-learn or Airflow (a test checks it in a subprocess).

The served model takes the dataset's raw table columns (for the demo, `pixel_0`…`pixel_63` in 0-16) and
answers, per row, `predicted_label` and `prob_<class>` for a classification task, `predicted_value` for
regression; bad input is an MLflow 400. A tabular model (one whose `model.json` records `preprocessing`)
takes exactly its training columns: a missing or an extra column is refused by name, columns in another
order are reordered, and the features are standardised with the train split's statistics it carries.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from mlflow.pyfunc import PythonModel

from nightshift.errors import DataError, TrackingError, UsageError

_log = logging.getLogger(__name__)

# Rows one request may carry. A larger batch is a client bug or an abuse; the server answers 400.
MAX_ROWS = int(os.environ.get("NIGHTSHIFT_SERVING_MAX_ROWS", "4096"))
PREDICTION_COLUMN = "predicted_label"
VALUE_COLUMN = "predicted_value"  # what a regression model answers
# A tabular model's learned bounds: the train split's [min, max] widened by this many times that range. What a
# value beyond them gets is the serving range policy (RANGE_POLICY_ENV): by default the row is accepted and
# counted (a heavy tail or drift is new data, which retraining is for), or refused (a unit or column mix-up).
# Evaluation never refuses a row for its range. Fixed domain bounds (the demo's pixels, 0-16) are always enforced.
RANGE_MARGIN = 1.0
RANGE_POLICY_ENV = "NIGHTSHIFT_SERVING_RANGE_POLICY"
RANGE_POLICIES = ("accept", "refuse")
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


Bound = float | tuple[float, ...]


@dataclass(frozen=True)
class FeatureSpec:
    """The raw table columns a served model accepts, their valid range and how the trainer scaled them.

    `low` and `high` are one bound for every column or a tuple, one per column. `strict`: a column not in
    `columns` is refused (a tabular model) rather than ignored (the demo). `learned`: the bounds come from the
    training data (a tabular model's, widened), so the serving range policy applies to them; else they are the
    domain's and always enforced.
    """

    columns: tuple[str, ...]
    scale: float = 1.0
    low: Bound = -math.inf
    high: Bound = math.inf
    strict: bool = False
    learned: bool = False

    def to_json(self) -> dict[str, Any]:
        """JSON has no infinity: an open bound is null."""
        out = {"columns": list(self.columns), "scale": self.scale, "low": _bound_json(self.low),
               "high": _bound_json(self.high)}
        if self.strict:
            out["strict"] = True
        if self.learned:
            out["learned"] = True
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FeatureSpec:
        return cls(columns=tuple(str(c) for c in data["columns"]), scale=float(data.get("scale", 1.0)),
                   low=_bound(data.get("low"), -math.inf), high=_bound(data.get("high"), math.inf),
                   strict=bool(data.get("strict", False)),
                   # models logged before `learned` existed: only a tabular model (strict) had learned bounds
                   learned=bool(data.get("learned", data.get("strict", False))))

    @classmethod
    def from_preprocessing(cls, prep: dict[str, Any]) -> FeatureSpec:
        """A tabular model's columns, strict, with bounds RANGE_MARGIN train ranges beyond the train split's."""
        low, high = np.asarray(prep["min"], dtype=np.float64), np.asarray(prep["max"], dtype=np.float64)
        span = np.where(high > low, high - low, np.maximum(np.abs(high), 1.0)) * RANGE_MARGIN
        return cls(columns=tuple(str(c) for c in prep["features"]), low=tuple((low - span).tolist()),
                   high=tuple((high + span).tolist()), strict=True, learned=True)


def _bound_json(bound: Bound) -> Any:
    if isinstance(bound, tuple):
        return [None if math.isinf(b) else b for b in bound]
    return None if math.isinf(bound) else bound


def _bound(value: Any, open_end: float) -> Bound:
    if isinstance(value, list):
        return tuple(open_end if b is None else float(b) for b in value)
    return open_end if value is None else float(value)


FEATURE_SPECS: dict[str, FeatureSpec] = {
    "digits": FeatureSpec(columns=tuple(f"pixel_{i}" for i in range(64)), scale=16.0, low=0.0, high=16.0),
}


def feature_spec(dataset: str, input_shape: list[int] | tuple[int, ...] | None = None,
                 preprocessing: dict[str, Any] | None = None) -> FeatureSpec:
    """The serving columns of a model: those its `preprocessing` recorded (tabular), else those of `dataset`;
    an unknown dataset gets `x_0`… over its flattened input."""
    if preprocessing is not None:
        return FeatureSpec.from_preprocessing(preprocessing)
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


_NOT_FINITE = "feature values must be finite numbers, small enough for the model once scaled (float32)"


def range_policy() -> str:
    """The serving range policy (RANGE_POLICY_ENV, default accept); a value it does not know is refused at load."""
    policy = os.environ.get(RANGE_POLICY_ENV, "").strip().lower() or "accept"
    if policy not in RANGE_POLICIES:
        raise TrackingError(f"{RANGE_POLICY_ENV}={policy!r}: use one of {', '.join(RANGE_POLICIES)}")
    return policy


def check_range_policy(policy: str) -> str:
    """A declared range policy (deploy option `range_policy`), or UsageError naming the choices."""
    if policy not in RANGE_POLICIES:
        raise UsageError(f"range_policy {policy!r}: use one of {', '.join(RANGE_POLICIES)} (accept: answer a value "
                         f"beyond the training range and count it; refuse: answer 400)")
    return policy


def served_bounds(model_dir: str | Path, policy: str = "refuse") -> FeatureSpec | None:
    """The learned bounds a downloaded model's server refuses values beyond, or None (it refuses none for their
    range: the `accept` policy; no serving.json; bounds that are the domain's, met by validated data). A model
    logged before the range policy existed (no `learned` key) carries the code that always refuses."""
    info = read_serving_info(Path(model_dir) / "artifacts" / "model_dir") or read_serving_info(model_dir)
    if info is None:
        return None
    features = FeatureSpec.from_json(info["features"])
    always_refuses = "learned" not in info["features"] and features.learned
    return features if features.learned and (policy == "refuse" or always_refuses) else None


class TorchTableClassifier:
    """Loads `model.pt` + `model.json` and predicts rows of the raw table (classes, or a value for a
    regression task); bad input → 400."""

    def __init__(self, model_dir: str | Path) -> None:
        from nightshift.train.artifacts import load_trained_model, read_model_info

        spec = read_model_info(model_dir)
        served = read_serving_info(model_dir)
        # A tabular model's columns, scaling and classes, recorded by the trainer from the train split.
        self.preprocessing: dict[str, Any] | None = spec.get("preprocessing")
        self.task = str(spec.get("task") or "multiclass")
        if served is not None:
            # The modules that registered the model's name at training time (NIGHTSHIFT_PLUGINS then).
            for module_name in served.get("plugins") or ():
                importlib.import_module(module_name)
            self.features = FeatureSpec.from_json(served["features"])
        else:
            self.features = feature_spec(spec["dataset"], spec.get("input_shape"), self.preprocessing)
        self.num_classes = int(spec["num_classes"])
        prep = self.preprocessing or {}
        # Class values in output order (the demo's are its indices 0…9), named in the `prob_<class>` columns.
        self.classes: list[Any] = list(prep.get("classes") or range(self.num_classes))
        self.model = load_trained_model(model_dir)  # weights_only load, eval mode
        # What a value beyond the learned bounds gets (RANGE_POLICY_ENV); those accepted are counted here.
        self.range_policy = range_policy()
        self.rows_out_of_range = 0

    @property
    def is_regression(self) -> bool:
        return self.task == "regression"

    def validate(self, frame: Any, *, check_range: bool = True) -> np.ndarray:
        """The feature matrix of a request; 400 for what the model cannot take. `check_range=False`
        (evaluation): no row is refused for its range, whatever the policy; non-finite values still are."""
        if not isinstance(frame, pd.DataFrame):
            raise _invalid(f"expected a table with columns {self.features.columns[0]}…"
                           f"{self.features.columns[-1]}, got {type(frame).__name__}")
        if len(frame) == 0:
            raise _invalid("the request has no rows")
        if len(frame) > MAX_ROWS:
            raise _invalid(f"the request has {len(frame)} rows; send at most {MAX_ROWS} per request")
        repeated = sorted({str(c) for c in frame.columns[frame.columns.duplicated()]})
        if repeated:  # which of the two values would be the feature is anyone's guess: a 400, not a 500
            raise _invalid(f"columns {repeated[:5]} appear more than once; send each column once")
        missing = [c for c in self.features.columns if c not in frame.columns]
        if missing:
            raise _invalid(f"missing columns {missing[:5]}{'…' if len(missing) > 5 else ''}")
        if self.features.strict:
            known = set(self.features.columns)
            extra = [str(c) for c in frame.columns if c not in known]
            if extra:
                raise _invalid(f"unexpected columns {extra[:5]}{'…' if len(extra) > 5 else ''}; this model takes "
                               f"exactly the columns it was trained on: {', '.join(self.features.columns[:8])}"
                               f"{'…' if len(self.features.columns) > 8 else ''}")
        chosen = frame[list(self.features.columns)]
        # The trainer refuses a column that is not numeric; a number sent as text must not pass here either.
        text = [str(c) for c, kind in chosen.dtypes.items()
                if not (pd.api.types.is_numeric_dtype(kind) or pd.api.types.is_bool_dtype(kind))]
        if text:
            raise _invalid(f"feature column {text[0]} holds {chosen[text[0]].dtype} values, not numbers; send "
                           f"numbers (not text) for {', '.join(text[:5])}{'…' if len(text) > 5 else ''}")
        try:
            # float64, as the trainer standardised: float32 first would lose a large-offset column's signal
            values = chosen.to_numpy(dtype=np.float64)
        except (TypeError, ValueError) as err:
            raise _invalid(f"feature columns must be numbers ({err})") from err
        faults = set(self.invalid_rows(values, check_range=check_range).values())
        if faults:  # a value that is not finite is named first, as it always was
            raise _invalid(_NOT_FINITE if _NOT_FINITE in faults else sorted(faults)[0])
        return values

    def invalid_rows(self, values: np.ndarray, *, check_range: bool = True) -> dict[int, str]:
        """Row index → why, for the rows of a numeric matrix (the feature columns in order) that `validate`
        refuses for their values (not finite, out of range); in row order. One vectorised pass: what a stream
        consumer checks its batches with. Rows beyond learned bounds are refused only under the `refuse` policy
        (and never with `check_range=False`); under `accept` they are counted (`rows_out_of_range`) and logged."""
        low, high = np.asarray(self.features.low), np.asarray(self.features.high)
        with np.errstate(over="ignore", invalid="ignore"):
            # finite, and still finite as the network gets it (scaled, float32): 9.97e36 (a fill value) is not
            finite = np.isfinite(values).all(axis=1) & np.isfinite(self._scaled(values)).all(axis=1)
        inside = (values >= low) & (values <= high)
        in_range = inside.all(axis=1)
        accepting = self.features.learned and self.range_policy == "accept"
        if not check_range or accepting:
            outside = int((finite & ~in_range).sum())
            if outside and check_range:  # accepted by the policy: counted and logged (evaluation's are not)
                self.rows_out_of_range += outside
                columns = [self.features.columns[j] for j in np.flatnonzero((~inside[finite]).any(axis=0))]
                _log.warning("%d of %d rows have values beyond the training data's range (widened) in %s; "
                             "accepted (%s=accept); %d so far", outside, len(values), ", ".join(columns[:5]),
                             RANGE_POLICY_ENV, self.rows_out_of_range)
            in_range = np.ones_like(in_range)
            inside = np.ones_like(inside)
        if finite.all() and in_range.all():
            return {}
        if low.ndim == 0 and high.ndim == 0:
            out_of_range = f"feature values must lie in [{self.features.low:g}, {self.features.high:g}]"
            return {int(i): _NOT_FINITE if not finite[i] else out_of_range
                    for i in np.flatnonzero(~(finite & in_range))}
        faults: dict[int, str] = {}
        for i in np.flatnonzero(~(finite & in_range)):
            if not finite[i]:
                faults[int(i)] = _NOT_FINITE
                continue
            j = int(np.flatnonzero(~inside[i])[0])
            faults[int(i)] = (f"feature {self.features.columns[j]} must lie in [{float(low[j]):g}, "
                              f"{float(high[j]):g}] (the training data's range, widened)")
        return faults

    def _scaled(self, values: np.ndarray) -> np.ndarray:
        """Scaled in float64, as the trainer's loader does (nightshift.datasets), then float32 for the network."""
        values = np.asarray(values, dtype=np.float64)
        if self.preprocessing is not None:
            prep = self.preprocessing
            return ((values - np.asarray(prep["mean"], dtype=np.float64))
                    / np.asarray(prep["std"], dtype=np.float64)).astype(np.float32)
        return (values / float(self.features.scale)).astype(np.float32)

    def _outputs(self, values: np.ndarray) -> np.ndarray:
        import torch

        with np.errstate(over="ignore", invalid="ignore"):
            values = self._scaled(values)
        with torch.inference_mode():
            output = self.model(torch.from_numpy(np.ascontiguousarray(values)))
            if self.is_regression:
                return output.reshape(-1).numpy()
            return torch.softmax(output, dim=1).numpy()

    def proba(self, values: np.ndarray) -> np.ndarray:
        """Class probabilities for a numeric matrix that `validate` (or `invalid_rows`) accepted."""
        if self.is_regression:
            raise TypeError("a regression model has no class probabilities; use predictions()")
        return self._outputs(values)

    def predictions(self, values: np.ndarray) -> np.ndarray:
        """What the model answers for a numeric matrix `validate` accepted: class values (the demo: labels
        0…9), or for regression the predicted value in the target's units."""
        if self.is_regression:
            prep = self.preprocessing or {}
            return (self._outputs(values).astype(np.float64) * float(prep.get("target_std", 1.0))
                    + float(prep.get("target_mean", 0.0)))
        return np.asarray(self.classes)[self.proba(values).argmax(axis=1)]

    def predict_proba(self, frame: pd.DataFrame) -> np.ndarray:
        return self.proba(self.validate(frame))

    def predict(self, frame: pd.DataFrame, *, check_range: bool = True) -> pd.DataFrame:
        values = self.validate(frame, check_range=check_range)
        if self.is_regression:
            return pd.DataFrame({VALUE_COLUMN: self.predictions(values)})
        proba = self.proba(values)
        out = pd.DataFrame(proba, columns=[f"prob_{k}" for k in self.classes])
        predicted = np.asarray(self.classes)[proba.argmax(axis=1)]
        out.insert(0, PREDICTION_COLUMN, predicted.astype(np.int64) if self.preprocessing is None else predicted)
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
