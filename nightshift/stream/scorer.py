"""The model a consumer scores with: one registered version's pyfunc, loaded as the server loads it, and
its own input validation (`TorchTableClassifier.validate`) deciding which rows are bad.

A batch is validated once as a whole (inside the pyfunc's predict); only when that fails is each row
validated alone, so that the bad ones go to the dead-letter stream with the served model's own message
and the others are still scored. When the rows that passed validation still cannot be scored, the fault is
the model's or the machine's (out of memory, a broken version), not theirs: `score` raises ModelFailure
and the consumer leaves them pending for a retry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from nightshift.stream.errors import ModelFailure, NoChampion
from nightshift.stream.records import InputRow, Rejected

log = logging.getLogger(__name__)


@dataclass
class Scored:
    rows: list[InputRow]
    labels: list[int]
    rejected: list[Rejected]


def _message(err: Exception) -> str:
    return str(getattr(err, "message", None) or err)


class VersionScorer:
    """`model_name` version `version`, loaded through MLflow (`models:/NAME/VERSION`)."""

    def __init__(self, model_name: str, version: str) -> None:
        import mlflow.pyfunc

        from nightshift import tracking
        from nightshift.served_model import PREDICTION_COLUMN

        tracking.client()  # the configured tracking URI, as every other step
        self.model_name = model_name
        self.version = str(version)
        uri = f"models:/{model_name}/{self.version}"
        try:
            self.pyfunc = mlflow.pyfunc.load_model(uri)
        except Exception as err:
            raise NoChampion(f"cannot load {uri} ({type(err).__name__}: {err}); check the registry and its "
                             f"artifact store") from err
        self.classifier = self.pyfunc.unwrap_python_model().classifier
        self.columns: tuple[str, ...] = tuple(self.classifier.features.columns)
        self.column_set = frozenset(self.columns)
        self.prediction_column = PREDICTION_COLUMN

    def _frame(self, rows: list[InputRow]) -> Any:
        import pandas as pd

        values = np.asarray([row.values for row in rows], dtype=np.float32)
        return pd.DataFrame(values, columns=list(self.columns))

    def predict_labels(self, frame: Any) -> list[int]:
        """The pyfunc's predicted labels for a frame of feature columns (raises on invalid input)."""
        out = self.pyfunc.predict(frame)
        return [int(v) for v in out[self.prediction_column].to_numpy()]

    def score(self, rows: list[InputRow]) -> Scored:
        """Predicted labels for the rows the served model accepts; the others rejected with its reason.
        Raises ModelFailure when the model fails on rows its validation accepted."""
        if not rows:
            return Scored([], [], [])
        complete = [r for r in rows if r.complete]
        if len(complete) == len(rows):
            try:
                return Scored(rows, self.predict_labels(self._frame(rows)), [])
            except Exception as err:  # the served model's validation (an MlflowException) or its schema check
                log.debug("batch of %d failed validation as a whole (%s); validating row by row", len(rows), err)
        return self._score_row_by_row(rows)

    def _score_row_by_row(self, rows: list[InputRow]) -> Scored:
        import pandas as pd

        good: list[InputRow] = []
        rejected: list[Rejected] = []
        for row in rows:
            frame = pd.DataFrame([row.features])
            try:
                self.classifier.validate(frame)
            except MemoryError as err:
                raise ModelFailure(f"{self.model_name} v{self.version}: out of memory validating one row",
                                   rejected=rejected, valid=good) from err
            except Exception as err:  # the served model's own verdict on this row
                rejected.append(Rejected(row.entry_id, row.input_id, _message(err), row.raw_text))
                continue
            if not row.complete:  # validate accepted a row with a column missing: cannot happen, but be explicit
                rejected.append(Rejected(row.entry_id, row.input_id, "missing columns", row.raw_text))
                continue
            good.append(row)
        if not good:
            return Scored([], [], rejected)
        try:
            labels = self.predict_labels(self._frame(good))
        except Exception as err:
            raise ModelFailure(f"{self.model_name} v{self.version} failed on {len(good)} valid inputs "
                               f"({type(err).__name__}: {_message(err)[:300]})", rejected=rejected,
                               valid=good) from err
        return Scored(good, labels, rejected)

    def predict_valid(self, rows: list[InputRow]) -> list[int]:
        """Labels for rows validation already accepted (a batch being bisected after a failure); ModelFailure
        when predict raises."""
        try:
            return self.predict_labels(self._frame(rows))
        except Exception as err:
            raise ModelFailure(f"{self.model_name} v{self.version} failed on {len(rows)} valid inputs "
                               f"({type(err).__name__}: {_message(err)[:300]})") from err


def champion_version(model_name: str) -> str:
    """The version `model_name@champion` names now (one registry call)."""
    from nightshift import registry

    version = registry.version_by_alias(model_name, registry.CHAMPION)
    if version is None:
        raise NoChampion(f"{model_name} has no @champion; run the nightly_retrain DAG (or `nightshift deploy`) "
                         f"first, or pass --model-name")
    return str(version.version)
