"""VersionScorer.score without MLflow: which rows are scored, which rejected, and that labels stay with
their rows when the vectorised checks cannot run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from nightshift.stream import records
from nightshift.stream.records import InputRow, Rejected, parse_entries
from nightshift.stream.scorer import VersionScorer

COLUMNS = ("a", "b")


class _Classifier:
    def __init__(self, vectorised_fails: bool) -> None:
        self.vectorised_fails = vectorised_fails

    def validate(self, frame: pd.DataFrame) -> Any:
        missing = [c for c in COLUMNS if c not in frame.columns]
        if missing:
            raise ValueError(f"missing columns {missing}")
        values = frame[list(COLUMNS)].to_numpy(dtype="float32")
        if not ((values >= 0) & (values <= 16)).all():
            raise ValueError("feature values must lie in [0, 16]")
        return values

    def invalid_rows(self, values: np.ndarray) -> dict[int, str]:
        if self.vectorised_fails:
            raise TypeError("a dtype the vectorised checks never saw")
        bad = ~((values >= 0) & (values <= 16)).all(axis=1)
        return {int(i): "feature values must lie in [0, 16]" for i in np.flatnonzero(bad)}


class _Scorer(VersionScorer):
    def __init__(self, vectorised_fails: bool) -> None:  # no MLflow
        self.model_name, self.version = "m", "1"
        self.classifier = _Classifier(vectorised_fails)
        self.columns, self.column_set = COLUMNS, frozenset(COLUMNS)

    def predict_labels(self, values: np.ndarray) -> list[Any]:
        return [int(v) for v in values[:, 0]]


def _rows() -> list[InputRow | Rejected]:
    payloads = [{"id": "x", "a": 3, "b": 1}, {"id": "bad", "a": 99, "b": 1}, {"id": "short", "a": 1},
                {"id": "y", "a": 7.0, "b": 2.0}]
    return parse_entries([(f"{i}-0", {b"data": json.dumps(p).encode()}) for i, p in enumerate(payloads)], COLUMNS)


@pytest.mark.parametrize("vectorised_fails", [False, True])
def test_labels_stay_with_their_rows_and_bad_rows_get_the_models_reason(vectorised_fails: bool) -> None:
    """Also when the vectorised checks raise (before: the exception escaped score() and killed the consumer)."""
    rows = [r for r in _rows() if isinstance(r, InputRow)]
    scored = _Scorer(vectorised_fails).score(rows)
    assert [(r.input_id, label) for r, label in zip(scored.rows, scored.labels, strict=True)] == [("x", 3), ("y", 7)]
    assert [(r.input_id, r.reason) for r in scored.rejected] == [
        ("bad", "feature values must lie in [0, 16]"), ("short", "missing columns ['b']")]


def test_a_decoder_failure_other_than_a_syntax_error_falls_back_to_parse_entry(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """orjson raising MemoryError (or anything but JSONDecodeError) escaped the batch parser and killed the
    consumer; parse_entry decides those inputs, as it did before the fast path."""
    def fail(_raw: Any) -> Any:
        raise MemoryError

    monkeypatch.setattr(records.orjson, "loads", fail)
    (row,) = parse_entries([("1-0", {b"data": b'{"id": 1, "a": 1, "b": 2}'})], COLUMNS)
    assert isinstance(row, InputRow) and row.input_id == 1 and list(row.values) == [1, 2]  # type: ignore[arg-type]


def test_running_out_of_memory_in_the_row_by_row_fallback_leaves_the_batch_pending() -> None:
    """The fallback's own failure is a ModelFailure with nothing settled (the consumer keeps the batch
    pending and retries it), not an exception that ends the consumer."""
    from nightshift.stream.errors import ModelFailure

    scorer = _Scorer(vectorised_fails=True)

    def out_of_memory(_frame: pd.DataFrame) -> Any:
        raise MemoryError

    scorer.classifier.validate = out_of_memory  # type: ignore[method-assign]
    with pytest.raises(ModelFailure) as failure:
        scorer.score([r for r in _rows() if isinstance(r, InputRow)])
    assert (failure.value.rejected, failure.value.valid) == ([], [])


# --- a tabular model of any task, scored as the HTTP server scores it ------------------------------------


def _tabular_classifier(tmp_path: Path, task: str, label: list[Any]) -> Any:
    """An untrained MLP over a column `meter` around 1e7 whose rows differ by less than one (float32's step
    there is 1.0) and a plain column `load`, with what the trainer records for that table."""
    import torch

    from nightshift.datasets import load_split
    from nightshift.models import build_model
    from nightshift.served_model import TorchTableClassifier
    from nightshift.train.artifacts import save_trained_model

    rng = np.random.default_rng(0)
    n = len(label)
    frame = pd.DataFrame({"meter": 1e7 + np.round(rng.uniform(0, 1, n), 3), "load": rng.normal(50, 10, n),
                          "y": label})
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train", "validation", "test"):
        frame.to_parquet(data / f"{name}.parquet")
    split = load_split("tabular", data, "train", task=task, options={"label": "y"})
    torch.manual_seed(0)
    kwargs = {"input_shape": split.input_shape, "num_classes": split.num_classes, "hidden": 8}
    save_trained_model(tmp_path / "model", build_model("mlp", **kwargs), model_name="mlp", model_kwargs=kwargs,
                       dataset="tabular", params={}, task=task, preprocessing=split.preprocessing)
    return TorchTableClassifier(tmp_path / "model"), frame.drop(columns=["y"])


class _LoadedScorer(VersionScorer):
    def __init__(self, classifier: Any) -> None:  # what __init__ takes from the pyfunc MLflow loads
        from nightshift.stream.scorer import input_dtype

        self.model_name, self.version, self.classifier = "m", "1", classifier
        self.columns = tuple(classifier.features.columns)
        self.column_set = frozenset(self.columns)
        self.dtype = input_dtype(classifier)


def _streamed(classifier: Any, frame: pd.DataFrame) -> list[Any]:
    """What score-stream writes as `prediction` for the rows of `frame`, sent as JSON in another column order."""
    entries = [(f"{i}-0", {b"data": json.dumps({"id": i, **dict(reversed(list(row.items())))}).encode()})
               for i, row in enumerate(frame.to_dict("records"))]
    rows = parse_entries(entries, tuple(classifier.features.columns))
    scored = _LoadedScorer(classifier).score([r for r in rows if isinstance(r, InputRow)])
    assert not scored.rejected and [r.input_id for r in scored.rows] == list(range(len(frame)))
    return [json.loads(records.prediction_payload(r.input_id, label, "1", 0.0))["prediction"]
            for r, label in zip(scored.rows, scored.labels, strict=True)]


def test_a_regression_model_streams_the_values_it_answers_over_http(tmp_path: Path) -> None:
    """Before: the matrix was float32, which rounds `meter` to whole numbers (standardised, several units
    apart), and the value was written cut to an integer."""
    classifier, frame = _tabular_classifier(tmp_path, "regression", [float(v) for v in range(40)])
    over_http = classifier.predict(frame)["predicted_value"].tolist()  # what the served model answers
    streamed = _streamed(classifier, frame)
    assert streamed == over_http
    assert all(type(v) is float for v in streamed) and len(set(streamed)) > 1


def test_a_classifier_with_named_classes_streams_the_classes_it_answers_over_http(tmp_path: Path) -> None:
    classifier, frame = _tabular_classifier(tmp_path, "binary", ["low", "high"] * 20)
    over_http = classifier.predict(frame)["predicted_label"].tolist()
    assert set(over_http) <= {"low", "high"}
    assert _streamed(classifier, frame) == over_http  # before: int("low") raised while writing


def test_the_digits_matrix_stays_float32_and_a_tabular_one_is_float64() -> None:
    """float64 only where the model's standardisation needs it: the digits path keeps its float32 matrix."""
    from types import SimpleNamespace

    from nightshift.stream.scorer import input_dtype

    assert input_dtype(SimpleNamespace(preprocessing=None)) is np.float32
    assert input_dtype(SimpleNamespace(preprocessing={"mean": [0.0], "std": [1.0]})) is np.float64
