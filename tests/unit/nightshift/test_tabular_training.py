"""Tabular training end to end in this process (one Horovod rank): scikit-learn's breast-cancer table (binary)
and diabetes table (regression) train, log a pyfunc MLflow loads, and evaluate by task."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from mlflow.exceptions import MlflowException

from nightshift import tracking
from nightshift.datasets import load_split
from nightshift.errors import EvaluationError
from nightshift.evaluate import GateConfig, evaluate, regression_metrics, score
from nightshift.served_model import TorchTableClassifier
from nightshift.train.config import TrainConfig
from tests.tabular_data import breast_cancer, diabetes


@pytest.fixture(scope="module")
def hvd() -> Any:
    import horovod.torch as hvd

    hvd.init()
    return hvd


def train(hvd: Any, data: Path, out: Path, task: str, label: str, epochs: int) -> dict[str, Any]:
    from nightshift.train.trainer import Trainer

    options = {"label": label}
    config = TrainConfig(data=data, out=out / "out", checkpoint_dir=out / "ckpt", model="mlp",
                         model_kwargs={"hidden": 32}, dataset="tabular", dataset_options=options, task=task,
                         epochs=epochs, lr=0.01, threads=1, checkpoint_every=10_000)
    splits = [load_split("tabular", data, s, task=task, options=options) for s in ("train", "validation")]
    return Trainer(config, *splits, hvd).fit()


@pytest.fixture(scope="module")
def cancer(hvd: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    data = breast_cancer(tmp_path_factory.mktemp("cancer"))
    run = tmp_path_factory.mktemp("cancer-run")
    return {"data": data, "out": run / "out", "summary": train(hvd, data, run, "binary", "diagnosis", epochs=8)}


@pytest.fixture(scope="module")
def sugar(hvd: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    data = diabetes(tmp_path_factory.mktemp("diabetes"))
    run = tmp_path_factory.mktemp("diabetes-run")
    return {"data": data, "out": run / "out", "summary": train(hvd, data, run, "regression", "progression", 10)}


def test_binary_breast_cancer_trains_well_above_chance(cancer: dict[str, Any]) -> None:
    # predicting the majority class scores about 0.63 on this table
    assert cancer["summary"]["val_accuracy"] > 0.9
    test = pd.read_parquet(cancer["data"] / "test.parquet")
    answer = TorchTableClassifier(cancer["out"]).predict(test.drop(columns=["diagnosis"]))
    assert (answer["predicted_label"].to_numpy() == test["diagnosis"].to_numpy()).mean() > 0.9
    info = json.loads((cancer["out"] / "model.json").read_text())
    assert info["task"] == "binary" and info["num_classes"] == 2 and info["model_kwargs"]["input_shape"] == [30]
    assert info["preprocessing"]["features"] == [c for c in test.columns if c != "diagnosis"]
    assert info["params"]["dataset_options"] == {"label": "diagnosis"}


def test_regression_on_diabetes_beats_predicting_the_mean(sugar: dict[str, Any]) -> None:
    train_target = pd.read_parquet(sugar["data"] / "train.parquet")["progression"]
    test = pd.read_parquet(sugar["data"] / "test.parquet")
    truth = test["progression"].to_numpy(np.float64)
    answer = TorchTableClassifier(sugar["out"]).predict(test.drop(columns=["progression"]))
    model = regression_metrics(truth, answer["predicted_value"].to_numpy())
    mean = regression_metrics(truth, np.full_like(truth, train_target.mean()))
    assert model["rmse"] < 0.9 * mean["rmse"] and model["r2"] > 0.2
    # the trainer's validation metric is the RMSE in the target's units
    validation = pd.read_parquet(sugar["data"] / "validation.parquet")["progression"].to_numpy(np.float64)
    assert 0 < sugar["summary"]["val_rmse"] < regression_metrics(validation, np.full_like(validation,
                                                                 train_target.mean()))["rmse"]
    assert "val_accuracy" not in sugar["summary"]


def test_a_logged_tabular_model_is_a_pyfunc_that_keeps_its_column_contract(cancer: dict[str, Any]) -> None:
    import mlflow.pyfunc

    run_id = tracking.log_training_run(cancer["out"], experiment="tabular")
    uri = tracking.run_model_uri(run_id)
    model = mlflow.pyfunc.load_model(uri)
    assert model.metadata.metadata["nightshift.task"] == "binary"
    assert model.metadata.metadata["nightshift.label_column"] == "diagnosis"
    assert model.metadata.get_input_schema() is None  # MLflow would drop an extra column before the model saw it
    rows = pd.read_parquet(cancer["data"] / "test.parquet").drop(columns=["diagnosis"]).head(10)
    answer = model.predict(rows)
    pd.testing.assert_frame_equal(answer, model.predict(rows[list(reversed(rows.columns))]))
    with pytest.raises(MlflowException, match=r"unexpected columns \['patient_id'\]"):
        model.predict(rows.assign(patient_id=1))
    with pytest.raises(MlflowException, match=r"missing columns \['worst area'\]"):
        model.predict(rows.drop(columns=["worst area"]))
    # evaluation picks the model's columns from the table and computes the binary metrics
    metrics = score(uri, cancer["data"], task="binary", label_column="diagnosis")
    assert metrics["accuracy"] > 0.9 and metrics["roc_auc"] > 0.95 and 0 < metrics["f1"] <= 1
    assert set(metrics["per_class_recall"]) == {"0", "1"} and len(metrics["confusion_matrix"]) == 2
    with pytest.raises(EvaluationError, match="trained for a binary task, not regression"):
        score(uri, cancer["data"], task="regression", label_column="diagnosis")


def test_evaluating_a_regression_run_logs_the_regression_metrics(sugar: dict[str, Any]) -> None:
    run_id = tracking.log_training_run(sugar["out"], experiment="tabular")
    result = evaluate(run_id, data_dir=sugar["data"], model_name="diabetes", label_column="progression",
                      gate=GateConfig(task="regression"))
    assert result["passed"] and result["confusion_matrix_artifact"] is None
    # residuals: a sample of (label, prediction) pairs the decision page draws
    assert set(result["challenger"]) == {"model_uri", "rows", "drift", "rmse", "mae", "r2", "residuals"}
    logged = tracking.client().get_run(run_id).data.metrics
    assert logged["test_rmse"] == pytest.approx(result["challenger"]["rmse"])
    assert {"test_mae", "test_r2"} <= set(logged) and "test_accuracy" not in logged
