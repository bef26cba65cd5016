"""VersionScorer.score without MLflow: which rows are scored, which rejected, and that labels stay with
their rows when the vectorised checks cannot run."""

from __future__ import annotations

import json
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

    def predict_labels(self, values: np.ndarray) -> list[int]:
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
