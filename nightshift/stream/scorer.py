"""The model a consumer scores with: one registered version's pyfunc, loaded as the server loads it, and
its own input validation (`TorchTableClassifier.validate`) deciding which rows are bad.

A batch is validated in one vectorised pass of the served model's own checks (`invalid_rows`: the rows
`validate` would refuse, with its message), so that the bad ones go to the dead-letter stream with the
served model's own message and the others are still scored; a row with a column missing is validated
alone, so that the message names the column. The rows are then scored by the served model's own
prediction on one matrix, not through the pyfunc's signature enforcement (a second, per-column check of
what was just checked, which cost as much as the model itself).

The matrix is float64 for a tabular model, which standardises its raw columns in float64 as the HTTP
server does (a column around 1e7 whose rows differ by less than one loses its signal in float32, whose
steps there are 1.0), and float32 for the others, as before (the digits' 0-16 are exact in float32, and
their model divides by 16 only). Whatever the task, the consumer writes what the served
model answers per row: the class (classification), or the value in the target's units (regression).

When the rows that passed validation still cannot be scored, the fault is
the model's or the machine's (out of memory, a broken version), not theirs: `score` raises ModelFailure
and the consumer leaves them pending for a retry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from nightshift.stream.errors import ModelFailure, NoChampion
from nightshift.stream.records import InputRow, Prediction, Rejected, id_key

log = logging.getLogger(__name__)


@dataclass
class Scored:
    rows: list[InputRow]
    labels: list[Prediction]
    rejected: list[Rejected]


def _message(err: Exception) -> str:
    return str(getattr(err, "message", None) or err)


def input_dtype(classifier: object) -> type[np.floating]:
    """The dtype of the matrix `classifier` scores: float64 for a tabular model (its standardisation runs in
    float64, as over HTTP), float32 for the others."""
    return np.float64 if getattr(classifier, "preprocessing", None) is not None else np.float32


class VersionScorer:
    """`model_name` version `version`, loaded through MLflow (`models:/NAME/VERSION`): any model `nightshift
    register` registered, scored on its own columns (`features.columns`, in its order) and task."""

    dtype: type[np.floating] = np.float32

    def __init__(self, model_name: str, version: str) -> None:
        import mlflow.pyfunc

        from nightshift import tracking

        tracking.client()  # the configured tracking URI, as every other step
        self.model_name = model_name
        self.version = str(version)
        uri = f"models:/{model_name}/{self.version}"
        try:
            self.pyfunc = mlflow.pyfunc.load_model(uri)
        except Exception as err:
            raise NoChampion(f"cannot load {uri} ({type(err).__name__}: {err}); check the registry and its "
                             f"artifact store") from err
        try:
            self.classifier = self.pyfunc.unwrap_python_model().classifier
            self.columns: tuple[str, ...] = tuple(self.classifier.features.columns)
        except Exception as err:  # another flavour, or a pyfunc of someone else's
            raise NoChampion(f"{uri} is not a model `nightshift register` registered ({type(err).__name__}: "
                             f"{err}); score-stream scores those only: pass the --model-name of one") from err
        self.column_set = frozenset(self.columns)
        self.dtype = input_dtype(self.classifier)

    def _matrix(self, rows: list[InputRow]) -> np.ndarray:
        """The complete rows' values as one matrix of `dtype`, columns in the model's order (one numpy call)."""
        return np.asarray([row.values for row in rows], dtype=self.dtype)

    def predict_labels(self, values: np.ndarray) -> list[Prediction]:
        """What the model answers for a matrix its validation accepted: the served model's prediction
        (`TorchTableClassifier.predictions`, as the pyfunc answers) without going through the pyfunc's
        signature enforcement, which re-checks by column what `invalid_rows` checked. A classifier answers
        its class values (the demo's labels 0-9); a regression model its predicted values."""
        return self.classifier.predictions(values).tolist()

    def score(self, rows: list[InputRow]) -> Scored:
        """Predictions for the rows the served model accepts; the others rejected with its reason.
        Raises ModelFailure when the model fails on rows its validation accepted."""
        if not rows:
            return Scored([], [], [])
        good: list[InputRow] = []
        rejected: list[Rejected] = []
        complete = [r for r in rows if r.complete]
        try:
            if complete:
                values = self._matrix(complete)
                faults = self.classifier.invalid_rows(values)
                if faults:
                    keep = [i for i in range(len(complete)) if i not in faults]
                    rejected = [Rejected(complete[i].entry_id, complete[i].input_id, why, complete[i].raw_text)
                                for i, why in faults.items()]
                    good, values = [complete[i] for i in keep], values[keep]
                else:
                    good = complete
            if len(complete) < len(rows):
                rejected += self._validate_alone([r for r in rows if not r.complete])[1]
                rejected.sort(key=lambda item: id_key(item.entry_id))
        except MemoryError as err:
            raise ModelFailure(f"{self.model_name} v{self.version}: out of memory validating {len(rows)} rows",
                               rejected=[], valid=[]) from err
        except Exception as err:  # the vectorised checks could not run on these rows: each row validated alone
            log.warning("validating a batch of %d at once failed (%s: %s); validating row by row", len(rows),
                        type(err).__name__, err)
            try:
                good, rejected = self._validate_alone(rows)
                values = self._matrix(good) if good else np.empty((0, len(self.columns)), dtype=self.dtype)
            except Exception as again:  # MemoryError, or what no row check explains: the batch stays pending
                raise ModelFailure(f"{self.model_name} v{self.version}: cannot validate {len(rows)} rows "
                                   f"({type(again).__name__}: {again})", rejected=[], valid=[]) from again
        if not good:
            return Scored([], [], rejected)
        try:
            labels = self.predict_labels(values)
        except Exception as err:
            raise ModelFailure(f"{self.model_name} v{self.version} failed on {len(good)} valid inputs "
                               f"({type(err).__name__}: {_message(err)[:300]})", rejected=rejected,
                               valid=good) from err
        return Scored(good, labels, rejected)

    def _validate_alone(self, rows: list[InputRow]) -> tuple[list[InputRow], list[Rejected]]:
        """Each row through the served model's `validate` alone: (the rows it accepts, the others with its
        reason). MemoryError is raised."""
        import pandas as pd

        good: list[InputRow] = []
        rejected: list[Rejected] = []
        for row in rows:
            frame = (pd.DataFrame([list(row.values)], columns=list(self.columns)) if row.complete  # type: ignore[arg-type]
                     else pd.DataFrame([row.features]))
            try:
                self.classifier.validate(frame)
            except MemoryError:
                raise
            except Exception as err:  # the served model's own verdict on this row
                rejected.append(Rejected(row.entry_id, row.input_id, _message(err), row.raw_text))
                continue
            if row.complete:
                good.append(row)
            else:
                rejected.append(Rejected(row.entry_id, row.input_id, "missing columns", row.raw_text))
        return good, rejected

    def predict_valid(self, rows: list[InputRow]) -> list[Prediction]:
        """Predictions for rows validation already accepted (a batch being bisected after a failure); ModelFailure
        when predict raises."""
        try:
            return self.predict_labels(self._matrix(rows))
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
