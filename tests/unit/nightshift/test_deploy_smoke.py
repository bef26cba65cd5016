"""The deploy smoke test's canary batch and verdict follow the model's own contract (columns, label, task)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from nightshift.deploy import smoke
from nightshift.deploy.smoke import ModelContract, canary_batch, model_contract, smoke_test
from nightshift.errors import DeploymentFailed


@pytest.fixture
def data(tmp_path: Path) -> Path:
    frame = pd.DataFrame({"b": [1.0, 2.0, 3.0], "a": [4.0, 5.0, 6.0], "note": [7.0, 8.0, 9.0],
                          "kind": ["no", "yes", "yes"], "label": [0, 1, 1]})
    frame.to_parquet(tmp_path / "test.parquet")
    return tmp_path


def answer(monkeypatch: pytest.MonkeyPatch, predictions: list[dict[str, Any]]) -> None:
    monkeypatch.setattr(smoke, "post_json", lambda url, payload: predictions)


def test_the_contract_comes_from_the_models_metadata(tmp_path: Path) -> None:
    from mlflow.models import Model

    for name in ("tabular", "digits"):
        (tmp_path / name).mkdir()
    Model(metadata={"nightshift.task": "binary", "nightshift.feature_columns": ["a", "b"],
                    "nightshift.label_column": "kind"}).save(str(tmp_path / "tabular" / "MLmodel"))
    Model(metadata={"nightshift.task": "multiclass", "nightshift.feature_columns": ["pixel_0"]}).save(
        str(tmp_path / "digits" / "MLmodel"))
    assert model_contract(tmp_path / "tabular") == ModelContract(task="binary", columns=("a", "b"), label="kind")
    assert model_contract(tmp_path / "digits") == ModelContract()  # every column but `label`, as before
    with pytest.raises(DeploymentFailed, match="no readable MLmodel"):
        model_contract(tmp_path / "missing")


def test_the_canary_batch_sends_the_models_columns_only(data: Path) -> None:
    frame, labels = canary_batch(data, 2, contract=ModelContract(task="binary", columns=("a", "b"), label="kind"))
    assert list(frame.columns) == ["a", "b"] and labels.tolist() == ["no", "yes"]
    digits, digit_labels = canary_batch(data, 3)
    assert list(digits.columns) == ["b", "a", "note", "kind"] and digit_labels.dtype == np.int64
    with pytest.raises(DeploymentFailed, match=r"lacks the model's feature columns \['c'\]"):
        canary_batch(data, 2, contract=ModelContract(columns=("a", "c")))


def test_string_classes_are_compared_as_the_server_answers_them(monkeypatch: pytest.MonkeyPatch) -> None:
    answer(monkeypatch, [{"predicted_label": "no"}, {"predicted_label": "no"}])
    result = smoke_test("http://x", pd.DataFrame({"a": [1.0, 2.0]}), np.array(["no", "yes"], dtype=object),
                        expected_accuracy=None, tolerance=0.0, task="binary")
    assert result["accuracy"] == 0.5


def test_a_regression_server_must_answer_finite_values(monkeypatch: pytest.MonkeyPatch) -> None:
    frame, target = pd.DataFrame({"a": [1.0, 2.0]}), np.array([10.0, 20.0])
    answer(monkeypatch, [{"predicted_value": 13.0}, {"predicted_value": 16.0}])
    result = smoke_test("http://x", frame, target, expected_accuracy=0.9, tolerance=0.0, task="regression")
    assert result["rmse"] == pytest.approx(np.sqrt((9 + 16) / 2)) and "accuracy" not in result
    answer(monkeypatch, [{"predicted_value": 13.0}, {"predicted_value": float("nan")}])
    with pytest.raises(DeploymentFailed, match="not a finite number"):
        smoke_test("http://x", frame, target, expected_accuracy=None, tolerance=0.0, task="regression")
    answer(monkeypatch, [{"predicted_label": 1}, {"predicted_label": 2}])
    with pytest.raises(DeploymentFailed, match="without 'predicted_value'"):
        smoke_test("http://x", frame, target, expected_accuracy=None, tolerance=0.0, task="regression")
