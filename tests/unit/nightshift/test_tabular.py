"""The built-in `tabular` dataset, the served model's column contract, metrics by task and the gate by task."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from mlflow.exceptions import MlflowException

from nightshift.datasets import load_split
from nightshift.errors import DataError, UsageError
from nightshift.evaluate import GateConfig, classification_metrics, decide, regression_metrics
from nightshift.models import build_model
from nightshift.served_model import TorchTableClassifier
from nightshift.train.artifacts import save_trained_model
from nightshift.train.cli import add_arguments, config_from_args
from nightshift.train.config import TrainConfig
from tests.tabular_data import breast_cancer, diabetes

CANCER = {"label": "diagnosis"}
DIABETES = {"label": "progression"}


@pytest.fixture(scope="module")
def cancer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return breast_cancer(tmp_path_factory.mktemp("cancer"))


@pytest.fixture(scope="module")
def sugar(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return diabetes(tmp_path_factory.mktemp("diabetes"))


def table(tmp_path: Path, **columns: list[Any]) -> Path:
    """A tiny staged dataset whose three splits are the same table."""
    frame = pd.DataFrame(columns)
    for split in ("train", "validation", "test"):
        frame.to_parquet(tmp_path / f"{split}.parquet")
    return tmp_path


# --- the dataset ----------------------------------------------------------------------------------------


def test_the_train_split_fixes_the_columns_their_order_and_the_scaling(cancer: Path) -> None:
    train = load_split("tabular", cancer, "train", task="binary", options=CANCER)
    validation = load_split("tabular", cancer, "validation", task="binary", options=CANCER)
    frame = pd.read_parquet(cancer / "train.parquet")
    columns = [c for c in frame.columns if c != "diagnosis"]
    prep = train.preprocessing
    assert prep is not None and prep["features"] == columns and prep["label"] == "diagnosis"
    assert (train.input_shape, train.num_classes, train.task, prep["classes"]) == ((30,), 2, "binary", [0, 1])
    np.testing.assert_allclose(prep["mean"], frame[columns].mean().to_numpy())
    np.testing.assert_allclose(prep["min"], frame[columns].min().to_numpy())
    # standardised with the train split's statistics, in every split
    assert validation.preprocessing == prep
    assert float(train.features.mean(dim=0).abs().max()) < 1e-4
    assert float(train.features.std(dim=0, unbiased=False).sub(1).abs().max()) < 1e-3
    held_out = pd.read_parquet(cancer / "validation.parquet")
    expected = (held_out[columns].to_numpy() - np.asarray(prep["mean"])) / np.asarray(prep["std"])
    np.testing.assert_allclose(validation.features.numpy(), expected, rtol=1e-4, atol=1e-5)
    assert validation.labels.tolist() == held_out["diagnosis"].tolist()


def test_the_features_option_chooses_and_orders_the_columns(cancer: Path) -> None:
    chosen = ["worst area", "mean radius"]
    split = load_split("tabular", cancer, "test", task="binary", options={**CANCER, "features": chosen})
    assert split.preprocessing is not None and split.preprocessing["features"] == chosen
    assert split.input_shape == (2,)
    frame = pd.read_parquet(cancer / "test.parquet")
    raw = (split.features.numpy() * np.asarray(split.preprocessing["std"]) + np.asarray(split.preprocessing["mean"]))
    np.testing.assert_allclose(raw, frame[chosen].to_numpy(), rtol=1e-4)


def test_string_labels_become_the_indices_of_the_sorted_train_classes(tmp_path: Path) -> None:
    data = table(tmp_path, x=[1.0, 2.0, 3.0, 4.0], answer=["yes", "no", "maybe", "no"])
    split = load_split("tabular", data, "train", task="multiclass", options={"label": "answer"})
    assert split.preprocessing is not None and split.preprocessing["classes"] == ["maybe", "no", "yes"]
    assert split.labels.tolist() == [2, 1, 0, 1] and split.num_classes == 3


def test_a_non_numeric_feature_is_a_data_error_naming_the_file_the_column_and_the_remedy(tmp_path: Path) -> None:
    data = table(tmp_path, size=[1.0, 2.0], colour=["red", "blue"], label=[0, 1])
    with pytest.raises(DataError) as caught:
        load_split("tabular", data, "train", task="binary")
    message = str(caught.value)
    for fragment in (str(data / "train.parquet"), "feature column 'colour'", "not numeric", "encode it as numbers",
                     "dataset option features"):
        assert fragment in message
    # leaving it out with the option is the remedy
    split = load_split("tabular", data, "train", task="binary", options={"features": ["size"]})
    assert split.input_shape == (1,)


def test_a_missing_label_column_names_it_and_the_option(cancer: Path) -> None:
    with pytest.raises(DataError, match=r"train\.parquet has no label column 'label' .*dataset option label"):
        load_split("tabular", cancer, "train", task="binary")


def test_a_feature_the_train_split_has_but_another_split_lacks_is_named(tmp_path: Path) -> None:
    data = table(tmp_path, a=[1.0, 2.0], b=[3.0, 4.0], label=[0, 1])
    pd.DataFrame({"a": [1.0], "label": [0]}).to_parquet(data / "validation.parquet")
    with pytest.raises(DataError, match=r"validation\.parquet lacks feature columns \['b'\]"):
        load_split("tabular", data, "validation", task="binary")


@pytest.mark.parametrize(("task", "labels", "message"), [
    ("binary", [0, 1, 2, 2], "binary task needs exactly 2 classes"),
    ("multiclass", [1, 1, 1, 1], "one class only"),
    ("regression", ["a", "b", "a", "b"], "not numeric: a regression target must be a number"),
])
def test_labels_that_do_not_fit_the_task_are_refused(tmp_path: Path, task: str, labels: list[Any],
                                                     message: str) -> None:
    data = table(tmp_path, x=[1.0, 2.0, 3.0, 4.0], label=labels)
    with pytest.raises(DataError, match=message):
        load_split("tabular", data, "train", task=task)


def test_a_class_the_train_split_lacks_is_refused_in_validation(tmp_path: Path) -> None:
    data = table(tmp_path, x=[1.0, 2.0], label=[0, 1])
    pd.DataFrame({"x": [1.0], "label": [7]}).to_parquet(data / "validation.parquet")
    with pytest.raises(DataError, match=r"holds \['7'\], which the train split's labels \(0, 1\) do not"):
        load_split("tabular", data, "validation", task="binary")


def test_a_regression_target_is_standardised_with_the_train_statistics(sugar: Path) -> None:
    split = load_split("tabular", sugar, "test", task="regression", options=DIABETES)
    prep = split.preprocessing
    assert prep is not None and split.num_classes == 1 and split.labels.dtype == torch.float32
    train = pd.read_parquet(sugar / "train.parquet")["progression"]
    assert prep["target_mean"] == pytest.approx(train.mean())
    assert prep["target_std"] == pytest.approx(train.std(ddof=0))
    raw = split.labels.numpy() * prep["target_std"] + prep["target_mean"]
    np.testing.assert_allclose(raw, pd.read_parquet(sugar / "test.parquet")["progression"], rtol=1e-5)


def test_bad_options_and_tasks_are_usage_errors(cancer: Path, demo_data: Path) -> None:
    with pytest.raises(UsageError, match=r"does not take .*'lable'"):
        load_split("tabular", cancer, "train", task="binary", options={"lable": "diagnosis"})
    with pytest.raises(UsageError, match="features names the label column 'diagnosis'"):
        load_split("tabular", cancer, "train", task="binary", options={**CANCER, "features": ["diagnosis"]})
    with pytest.raises(UsageError, match=r"dataset 'digits' does not take \['label'\]"):
        load_split("digits", demo_data, "train", options={"label": "label"})
    with pytest.raises(UsageError, match="'digits' is a multiclass task, not 'regression'"):
        load_split("digits", demo_data, "train", task="regression")


# --- the served model ------------------------------------------------------------------------------------


def untrained_output(data: Path, out: Path, task: str, options: dict[str, Any]) -> Path:
    """A training output directory of an untrained MLP, with what the trainer records for `data`."""
    torch.manual_seed(0)
    split = load_split("tabular", data, "train", task=task, options=options)
    kwargs = {"input_shape": split.input_shape, "num_classes": split.num_classes, "hidden": 8}
    save_trained_model(out, build_model("mlp", **kwargs), model_name="mlp", model_kwargs=kwargs, dataset="tabular",
                       params={}, task=task, preprocessing=split.preprocessing)
    return out


@pytest.fixture(scope="module")
def served_dir(cancer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return untrained_output(cancer, tmp_path_factory.mktemp("served"), "binary", CANCER)


@pytest.fixture(scope="module")
def served(served_dir: Path) -> TorchTableClassifier:
    return TorchTableClassifier(served_dir)


@pytest.fixture(scope="module")
def test_rows(cancer: Path) -> pd.DataFrame:
    return pd.read_parquet(cancer / "test.parquet").drop(columns=["diagnosis"]).head(20)


def test_the_served_model_refuses_a_missing_column_naming_it(served: TorchTableClassifier,
                                                             test_rows: pd.DataFrame) -> None:
    with pytest.raises(MlflowException, match=r"missing columns \['mean texture'\]"):
        served.predict(test_rows.drop(columns=["mean texture"]))


def test_the_served_model_refuses_an_extra_column_naming_it(served: TorchTableClassifier,
                                                            test_rows: pd.DataFrame) -> None:
    with pytest.raises(MlflowException, match=r"unexpected columns \['patient_id'\]"):
        served.predict(test_rows.assign(patient_id=1))


def test_the_served_model_reorders_columns_and_applies_the_train_scaling(served: TorchTableClassifier, cancer: Path,
                                                                        test_rows: pd.DataFrame) -> None:
    answer = served.predict(test_rows)
    shuffled = served.predict(test_rows[list(reversed(test_rows.columns))])
    pd.testing.assert_frame_equal(answer, shuffled)
    assert list(answer.columns) == ["predicted_label", "prob_0", "prob_1"]
    # the same probabilities as the network on the split the trainer's loader standardised
    split = load_split("tabular", cancer, "test", task="binary", options=CANCER)
    with torch.no_grad():
        expected = torch.softmax(served.model(split.features[:20]), dim=1).numpy()
    np.testing.assert_allclose(answer[["prob_0", "prob_1"]].to_numpy(), expected, rtol=1e-4, atol=1e-6)


def test_serving_ranges_come_from_the_train_split(served: TorchTableClassifier, served_dir: Path, cancer: Path,
                                                  test_rows: pd.DataFrame) -> None:
    train = pd.read_parquet(cancer / "train.parquet")
    low, high = train["mean area"].min(), train["mean area"].max()
    column = list(served.features.columns).index("mean area")
    assert isinstance(served.features.low, tuple) and isinstance(served.features.high, tuple)
    assert served.features.low[column] == pytest.approx(low - (high - low))
    assert served.features.high[column] == pytest.approx(high + (high - low))
    served.predict(test_rows.assign(**{"mean area": high}))  # the train split's extreme is fine
    beyond = test_rows.assign(**{"mean area": high + 3 * (high - low)})
    # issue 34: by default (accept) a value beyond the widened range is data (a heavy tail, drift): answered, counted
    assert served.range_policy == "accept"
    before = served.rows_out_of_range
    assert len(served.predict(beyond)) == len(beyond)
    assert served.rows_out_of_range == before + len(beyond)
    # evaluation's path counts nothing and refuses nothing, whatever the policy
    strict = TorchTableClassifier(served_dir)
    strict.range_policy = "refuse"
    assert len(strict.predict(beyond, check_range=False)) == len(beyond) and strict.rows_out_of_range == 0
    with pytest.raises(MlflowException, match=r"feature mean area must lie in \["):
        strict.predict(beyond)


def test_the_serving_range_policy_comes_from_the_environment_and_a_bad_one_is_refused(
        served_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nightshift.errors import TrackingError
    from nightshift.served_model import RANGE_POLICY_ENV

    monkeypatch.setenv(RANGE_POLICY_ENV, "refuse")
    assert TorchTableClassifier(served_dir).range_policy == "refuse"
    monkeypatch.setenv(RANGE_POLICY_ENV, "clip")
    with pytest.raises(TrackingError, match=r"NIGHTSHIFT_SERVING_RANGE_POLICY='clip': use one of accept, refuse"):
        TorchTableClassifier(served_dir)


def test_a_served_regression_model_answers_the_value_in_the_targets_units(sugar: Path, tmp_path: Path) -> None:
    model = TorchTableClassifier(untrained_output(sugar, tmp_path, "regression", DIABETES))
    rows = pd.read_parquet(sugar / "test.parquet").drop(columns=["progression"]).head(5)
    answer = model.predict(rows)
    assert list(answer.columns) == ["predicted_value"]
    split = load_split("tabular", sugar, "test", task="regression", options=DIABETES)
    prep = split.preprocessing
    assert prep is not None
    with torch.no_grad():
        standardised = model.model(split.features[:5]).reshape(-1).numpy()
    np.testing.assert_allclose(answer["predicted_value"], standardised * prep["target_std"] + prep["target_mean"],
                               rtol=1e-5)
    with pytest.raises(TypeError, match="no class probabilities"):
        model.proba(rows.to_numpy(np.float32))


# --- metrics by task (hand-checked) ------------------------------------------------------------------------


def test_binary_metrics() -> None:
    labels = np.array([0, 0, 1, 1])
    positive = np.array([0.1, 0.6, 0.4, 0.8])  # predicted 0, 1, 0, 1
    metrics = classification_metrics("binary", labels, np.column_stack([1 - positive, positive]))
    assert metrics["accuracy"] == 0.5
    assert metrics["log_loss"] == pytest.approx(-(math.log(0.9) + math.log(0.4) + math.log(0.4) + math.log(0.8)) / 4)
    assert metrics["roc_auc"] == 0.75  # 3 of the 4 (positive, negative) pairs ranked right
    assert metrics["f1"] == 0.5  # TP 1, FP 1, FN 1
    assert metrics["confusion_matrix"] == [[1, 1], [1, 1]] and metrics["recall"] == [0.5, 0.5]
    assert "macro_f1" not in metrics


def test_multiclass_metrics() -> None:
    labels = np.array([0, 1, 2, 2])
    proba = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6], [0.5, 0.3, 0.2]])  # predicted 0, 1, 2, 0
    metrics = classification_metrics("multiclass", labels, proba)
    assert metrics["accuracy"] == 0.75
    assert metrics["log_loss"] == pytest.approx(-(math.log(0.7) + math.log(0.8) + math.log(0.6) + math.log(0.2)) / 4)
    assert metrics["macro_f1"] == pytest.approx((2 / 3 + 1 + 2 / 3) / 3)
    assert metrics["recall"] == [1.0, 1.0, 0.5]
    assert metrics["confusion_matrix"] == [[1, 0, 0], [0, 1, 0], [1, 0, 1]]


def test_regression_metrics() -> None:
    metrics = regression_metrics(np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.5, 2.0, 2.0, 5.0]))
    assert metrics["rmse"] == pytest.approx(0.75)  # sqrt((0.25 + 0 + 1 + 1) / 4)
    assert metrics["mae"] == pytest.approx(0.625)
    assert metrics["r2"] == pytest.approx(1 - 2.25 / 5)


# --- the gate by task ----------------------------------------------------------------------------------------

REGRESSION_CHAMPION = {"rmse": 50.0, "mae": 40.0, "r2": 0.5}


def test_an_rmse_gate_passes_a_lower_rmse_and_refuses_a_higher_one() -> None:
    gate = GateConfig(task="regression", primary="rmse", min_improvement=1.0)
    assert decide({**REGRESSION_CHAMPION, "rmse": 48.0}, REGRESSION_CHAMPION, gate)["passed"]
    small = decide({**REGRESSION_CHAMPION, "rmse": 49.5}, REGRESSION_CHAMPION, gate)
    assert not small["passed"] and "improvement +0.5000 < min_improvement 1.0000" in small["reasons"][0]
    worse = decide({**REGRESSION_CHAMPION, "rmse": 52.0}, REGRESSION_CHAMPION, gate)
    assert not worse["passed"] and "improvement -2.0000" in worse["reasons"][0]


def test_a_lower_is_better_floor_and_guard() -> None:
    gate = GateConfig(task="regression", floor=55.0, guards={"mae": 1.0}, min_improvement=0.0)
    assert decide({"rmse": 54.0, "mae": 1.0, "r2": 0.1}, None, gate)["passed"]
    assert not decide({"rmse": 56.0, "mae": 1.0, "r2": 0.1}, None, gate)["passed"]
    assert decide({**REGRESSION_CHAMPION, "rmse": 49.0, "mae": 40.9}, REGRESSION_CHAMPION, gate)["passed"]
    assert not decide({**REGRESSION_CHAMPION, "rmse": 49.0, "mae": 41.1}, REGRESSION_CHAMPION, gate)["passed"]


def test_each_task_has_its_default_gate() -> None:
    regression = GateConfig(task="regression")
    assert (regression.primary, regression.guards, regression.floor) == ("rmse", {}, None)
    first = decide({"rmse": 1e6, "mae": 1e6, "r2": -5.0}, None, regression)
    assert first["passed"] and "no floor" in first["reasons"][0]
    binary = GateConfig(task="binary")
    assert (binary.primary, binary.guards, binary.floor) == ("accuracy", {"f1": 0.01, "log_loss": 0.05}, 0.8)
    digits = GateConfig()
    assert (digits.task, digits.primary, digits.guards, digits.floor) == (
        "multiclass", "accuracy", {"macro_f1": 0.01, "log_loss": 0.05}, 0.8)


@pytest.mark.parametrize(("kwargs", "names"), [
    ({"task": "regression", "primary": "accuracy"}, ("'accuracy'", "regression")),
    ({"task": "binary", "guards": {"macro_f1": 0.01}}, ("'macro_f1'", "binary")),
    ({"task": "multiclass", "primary": "rmse"}, ("'rmse'", "multiclass")),
    ({"task": "ranking"}, ("'ranking'",)),
])
def test_a_gate_metric_that_does_not_fit_the_task_is_refused_naming_both(kwargs: dict[str, Any],
                                                                          names: tuple[str, ...]) -> None:
    with pytest.raises(UsageError) as caught:
        GateConfig(**kwargs)
    for name in names:
        assert name in str(caught.value)


# --- the trainer's configuration ------------------------------------------------------------------------------


def test_the_trainer_takes_a_task_and_dataset_options_defaulting_to_the_digits() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--data", "d", "--out", "o", "--checkpoint-dir", "c"]
    digits = config_from_args(parser.parse_args(base))
    assert (digits.dataset, digits.task, digits.dataset_options) == ("digits", "multiclass", {})
    tabular = config_from_args(parser.parse_args([*base, "--dataset", "tabular", "--task", "regression",
                                                  "--dataset-options", '{"label": "y", "features": ["a"]}']))
    assert (tabular.task, tabular.dataset_options) == ("regression", {"label": "y", "features": ["a"]})
    assert tabular.params()["task"] == "regression"
    with pytest.raises(UsageError, match="--task must be one of binary, multiclass, regression"):
        TrainConfig(data=Path("d"), out=Path("o"), checkpoint_dir=Path("c"), task="ranking")



def test_the_evaluate_command_passes_the_task_and_label_column(monkeypatch: pytest.MonkeyPatch) -> None:
    import nightshift.evaluate
    from nightshift.cli import build_parser

    seen: dict[str, Any] = {}

    def fake_evaluate(run_id: str, **kwargs: Any) -> dict[str, Any]:
        seen.update(kwargs, run_id=run_id)
        return {"passed": True}

    monkeypatch.setattr(nightshift.evaluate, "evaluate", fake_evaluate)

    def command(*extra: str) -> int:  # the subcommand itself, without the MLflow set-up of `nightshift`'s main
        args = build_parser().parse_args(["evaluate", "--run-id", "r1", "--data", "d", "--task", "regression",
                                          *extra])
        return int(args.func(args))

    assert command("--label-column", "progression") == 0
    gate = seen["gate"]
    assert (gate.task, gate.primary, gate.floor, seen["label_column"]) == ("regression", "rmse", None, "progression")
    with pytest.raises(UsageError, match="'accuracy' does not fit a regression task"):
        command("--primary", "accuracy")
    with pytest.raises(UsageError, match="only a binary task has a positive class"):
        command("--positive-class", "fraud")
    assert command("--task", "binary", "--positive-class", "fraud") == 0
    assert (seen["gate"].task, seen["gate"].positive_class) == ("binary", "fraud")


def test_the_served_model_standardises_in_float64_as_the_trainer_did(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    big = 1e8 + rng.integers(0, 2, 200)  # the signal is a 1 in a column of 1e8: float32 holds 1e8 and 1e8+1 alike
    (tmp_path / "data").mkdir()
    data = table(tmp_path / "data", big=list(big), noise=list(rng.normal(size=200)), y=list((big - 1e8).astype(int)))
    model = TorchTableClassifier(untrained_output(data, tmp_path / "out", "binary", {"label": "y"}))
    frame = pd.read_parquet(data / "test.parquet")
    split = load_split("tabular", data, "test", task="binary", options={"label": "y"})
    with torch.no_grad():
        expected = torch.softmax(model.model(split.features), dim=1).numpy()
    answer = model.predict(frame[["big", "noise"]])
    np.testing.assert_allclose(answer[["prob_0", "prob_1"]].to_numpy(), expected, rtol=1e-4, atol=1e-6)


def test_the_served_model_refuses_numbers_sent_as_text_naming_the_column(served: TorchTableClassifier,
                                                                        test_rows: pd.DataFrame) -> None:
    with pytest.raises(MlflowException, match=r"feature column mean area holds (object|str) values, not numbers"):
        served.predict(test_rows.assign(**{"mean area": test_rows["mean area"].astype(str)}))


def test_a_request_naming_a_column_twice_is_refused_naming_it(served: TorchTableClassifier,
                                                              test_rows: pd.DataFrame) -> None:
    """Issue 34 item 10: a duplicated request column was a 500 (a shape error deep in the model)."""
    twice = pd.concat([test_rows, test_rows[["mean area"]]], axis=1)
    with pytest.raises(MlflowException, match=r"columns \['mean area'\] appear more than once") as refused:
        served.predict(twice)
    assert refused.value.get_http_status_code() == 400
