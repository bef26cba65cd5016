"""The gate's comparison on scikit-learn's real tables (issue 34): real models logged to MLflow, a real
@champion, `nightshift.evaluate.evaluate` end to end. A night whose data or declaration moved must be compared
with the champion whenever the champion can stand in for it, never wedge the pipeline, and go to a person (not to
the floor alone) when the champion cannot be compared or scored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from nightshift import registry, tracking
from nightshift.evaluate import evaluate
from nightshift.served_model import RANGE_POLICY_ENV
from tests.tabular_data import breast_cancer, crown, train, write_splits


def copy_data(data: Path, out: Path, change: Any = None) -> Path:
    """`data`'s splits under `out`, each frame passed through `change(frame, split)` when given."""
    out.mkdir(parents=True)
    for split in ("train", "validation", "test"):
        frame = pd.read_parquet(data / f"{split}.parquet")
        (change(frame, split) if change else frame).to_parquet(out / f"{split}.parquet")
    return out


@pytest.fixture(scope="module")
def cancer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return breast_cancer(tmp_path_factory.mktemp("cancer"))


def test_a_declaration_that_dropped_features_still_faces_the_champion_on_its_own_columns(
        cancer: Path, tmp_path: Path) -> None:
    """On main the champion (all 30 columns) was "not comparable" with a challenger declared on 4 of them, and
    the challenger went through on the floor alone."""
    crown(train(cancer, tmp_path / "champion", task="binary", label="diagnosis"), "cancer")
    few = ["mean radius", "mean texture", "mean smoothness", "mean symmetry"]
    challenger = train(cancer, tmp_path / "few", task="binary", label="diagnosis", features=few, epochs=20)
    result = evaluate(challenger, data_dir=cancer, model_name="cancer", label_column="diagnosis",
                      gate={"task": "binary", "primary": "accuracy", "floor": 0.5})
    assert result["champion"] is not None and not result["needs_approval"], result["reasons"]
    assert result["champion"]["accuracy"] > result["challenger"]["accuracy"]
    assert not result["passed"] and "vs champion" in result["reasons"][0]


def test_a_heavy_tailed_test_value_is_scored_and_reported_as_drift_never_refused(
        cancer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On main one test value beyond the train range (widened by one range) made `evaluate` raise, every night
    that the champion's range was exceeded. Evaluation refuses no row for its range, whatever serving's policy."""
    monkeypatch.setenv(RANGE_POLICY_ENV, "refuse")
    crown(train(cancer, tmp_path / "champion", task="binary", label="diagnosis"), "cancer")

    def heavy_tail(frame: pd.DataFrame, split: str) -> pd.DataFrame:
        if split == "test":
            frame.loc[0, "mean area"] = frame["mean area"].max() * 1000.0
            frame.loc[1, "worst area"] = np.exp(30.0)  # a lognormal tail's far end
        return frame

    tonight = copy_data(cancer, tmp_path / "tonight", heavy_tail)
    challenger = train(tonight, tmp_path / "challenger", task="binary", label="diagnosis", seed=1)
    result = evaluate(challenger, data_dir=tonight, model_name="cancer", label_column="diagnosis",
                      gate={"task": "binary", "primary": "accuracy", "floor": 0.5})
    rows = len(pd.read_parquet(tonight / "test.parquet"))
    drift = result["challenger"]["drift"]  # a small table's test split has other rows beyond the train range too
    assert drift["columns"]["mean area"] >= 1 / rows and drift["columns"]["worst area"] >= 1 / rows, drift
    assert 2 / rows <= drift["rows"] < 0.5
    assert result["champion"] is not None and result["champion"]["drift"]["rows"] >= 2 / rows
    run = tracking.client().get_run(challenger)
    assert run.data.metrics["test_rows_outside_train_range"] == pytest.approx(drift["rows"])
    assert "worst area" in run.data.tags["nightshift.outside_train_range"]


def test_a_champion_that_cannot_be_scored_on_a_relabelled_night_goes_to_a_person(
        cancer: Path, tmp_path: Path) -> None:
    """The champion learnt no/yes; tonight's label is 0/1: it cannot be scored. On main every such night failed."""
    words = copy_data(cancer, tmp_path / "words", lambda frame, split: frame.assign(
        diagnosis=frame["diagnosis"].map({0: "no", 1: "yes"})))
    version = crown(train(words, tmp_path / "champion", task="binary", label="diagnosis"), "cancer")
    challenger = train(cancer, tmp_path / "challenger", task="binary", label="diagnosis")
    result = evaluate(challenger, data_dir=cancer, model_name="cancer", label_column="diagnosis",
                      gate={"task": "binary", "primary": "accuracy", "floor": 0.8})
    assert result["champion"] is None and not result["passed"] and result["needs_approval"], result["reasons"]
    assert result["reasons"][0].startswith(f"champion v{version} cannot be scored on tonight's data (")
    assert "('diagnosis' holds ['0', '1'], classes it does not know: it knows ['no', 'yes']" in result["reasons"][0]
    assert "goes to a person" in result["reasons"][-1]


def test_a_night_that_lost_a_class_is_not_compared_with_a_champion_that_knew_it(tmp_path: Path) -> None:
    """Wine, 3 classes; tonight has no row of class 2. The challenger cannot answer it: a person decides."""
    from sklearn.datasets import load_wine

    wine = load_wine(as_frame=True).frame.rename(columns={"target": "cultivar"})
    everything = write_splits(wine, tmp_path / "wine")
    version = crown(train(everything, tmp_path / "champion", task="multiclass", label="cultivar"), "wine")
    lost = write_splits(wine[wine["cultivar"] != 2].reset_index(drop=True), tmp_path / "lost")
    challenger = train(lost, tmp_path / "challenger", task="multiclass", label="cultivar")
    result = evaluate(challenger, data_dir=lost, model_name="wine", label_column="cultivar",
                      gate={"task": "multiclass", "primary": "accuracy", "floor": 0.8})
    assert result["champion"] is None and result["needs_approval"], result["reasons"]
    assert result["reasons"][0] == (f"champion v{version} is not comparable (the challenger cannot answer "
                                    f"class(es) ['2'] that the champion knew (tonight's training data has no row "
                                    f"of them))")



def test_a_refusing_servers_canary_batch_holds_only_rows_it_takes(cancer: Path, tmp_path: Path) -> None:
    """Deploy's smoke test never fails for a row's range: under range_policy refuse the canary batch leaves out
    the rows beyond the downloaded model's learned bounds (read from its serving.json)."""
    import mlflow

    from nightshift.deploy.smoke import canary_batch, model_contract
    from nightshift.served_model import served_bounds

    run_id = train(cancer, tmp_path / "model", task="binary", label="diagnosis", epochs=5)
    local = Path(mlflow.artifacts.download_artifacts(tracking.run_model_uri(run_id), dst_path=str(tmp_path / "dl")))
    bounds = served_bounds(local)
    assert bounds is not None and bounds.learned and "mean area" in bounds.columns

    def tail(frame: pd.DataFrame, split: str) -> pd.DataFrame:
        if split == "test":
            frame.loc[0, "mean area"] = frame["mean area"].max() * 1000.0
        return frame

    tonight = copy_data(cancer, tmp_path / "tonight", tail)
    taken, _ = canary_batch(tonight, 5, contract=model_contract(local), within=bounds)
    everything, _ = canary_batch(tonight, 5, contract=model_contract(local))
    assert everything["mean area"].iloc[0] > 1e5 and (taken["mean area"] < 1e5).all() and len(taken) == 5


@pytest.mark.parametrize("broken", ["nan", "text", "fill"])
def test_a_champion_whose_column_went_bad_goes_to_a_person_and_never_wedges(cancer: Path, tmp_path: Path,
                                                                            broken: str) -> None:
    """Review of issue 34: tonight 'mean smoothness' has NaNs, text, or a fill value (9.97e36, beyond float32 once
    scaled); the declaration dropped it, the champion still uses it. On the first fix the served model's 400
    (MlflowException) or a NaN from the network escaped `evaluate` every night."""
    crown(train(cancer, tmp_path / "champion", task="binary", label="diagnosis"), "cancer")
    value: Any = {"nan": np.nan, "text": "n/a", "fill": 9.97e36}[broken]

    def spoil(frame: pd.DataFrame, split: str) -> pd.DataFrame:
        if split == "test":
            frame["mean smoothness"] = frame["mean smoothness"].astype(str if broken == "text" else float)
            frame.loc[3, "mean smoothness"] = value
        return frame

    tonight = copy_data(cancer, tmp_path / "tonight", spoil)
    others = [c for c in pd.read_parquet(cancer / "train.parquet").columns if c not in {"diagnosis", "mean smoothness"}]
    challenger = train(tonight, tmp_path / "challenger", task="binary", label="diagnosis", features=others)
    result = evaluate(challenger, data_dir=tonight, model_name="cancer", label_column="diagnosis",
                      gate={"task": "binary", "primary": "accuracy", "floor": 0.8})
    assert result["needs_approval"] and not result["passed"] and result["champion"] is None, result["reasons"]
    assert result["reasons"][0].startswith("champion v1 cannot be scored on tonight's data ("), result["reasons"]
    assert "test.parquet" in result["reasons"][0]


def test_a_served_model_refuses_a_value_too_large_for_it_whatever_the_range_policy(cancer: Path,
                                                                                   tmp_path: Path) -> None:
    """Accepting values beyond the training range must not let 9.97e36 reach the network (NaN answers)."""
    import mlflow.pyfunc
    from mlflow.exceptions import MlflowException

    run_id = train(cancer, tmp_path / "model", task="binary", label="diagnosis", epochs=5)
    classifier = mlflow.pyfunc.load_model(tracking.run_model_uri(run_id)).unwrap_python_model().classifier
    rows = pd.read_parquet(cancer / "test.parquet").drop(columns=["diagnosis"]).head(3)
    assert classifier.range_policy == "accept" and np.isfinite(
        classifier.predict(rows.assign(**{"mean area": 1e9})).filter(like="prob_").to_numpy()).all()
    with pytest.raises(MlflowException, match="small enough for the model once scaled"):
        classifier.predict(rows.assign(**{"mean smoothness": 9.97e36}))
    assert classifier.invalid_rows(rows.assign(**{"mean smoothness": 9.97e36}).to_numpy(np.float64))


def test_a_decision_for_a_person_promotes_nothing_outside_airflow(cancer: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`nightshift evaluate` exits 3, and `register` refuses the evaluation unless an approval step follows."""
    from nightshift.errors import ChallengerRejected
    from nightshift.serving_cli import _evaluate

    words = copy_data(cancer, tmp_path / "words", lambda frame, split: frame.assign(
        diagnosis=frame["diagnosis"].map({0: "no", 1: "yes"})))
    crown(train(words, tmp_path / "champion", task="binary", label="diagnosis"), "cancer")
    challenger = train(cancer, tmp_path / "challenger", task="binary", label="diagnosis")
    import argparse

    args = argparse.Namespace(guard=None, primary="accuracy", min_improvement=0.001, floor=0.8, task="binary",
                              run_id=challenger, out=None, data=str(cancer), model_name="cancer", split="test",
                              label_column="diagnosis", positive_class=None)
    assert _evaluate(args) == 3
    result = json.loads(capsys.readouterr().out)
    with pytest.raises(ChallengerRejected):
        registry.register(challenger, model_name="cancer", evaluation=result)
    assert registry.register(challenger, model_name="cancer", evaluation=result, pending_approval=True)["version"]


def wine_table(label: str) -> pd.DataFrame:
    from sklearn.datasets import load_wine

    return load_wine(as_frame=True).frame.rename(columns={"target": label})


def test_float_labels_are_matched_by_value_not_by_their_text(cancer: Path, tmp_path: Path) -> None:
    """Review rev34b: float32 class labels (0.1, 0.2, 0.3) made every night fail at evaluate, the first one too
    (the model's classes are written from the values, '0.10000000149011612', the column's text is '0.1'); a float
    0/1 label whose zeros came as -0.0 (np.round(-0.2)), which the loader takes as 0.0, failed the same way."""
    wine = wine_table("grade")
    wine["grade"] = ((wine["grade"] + 1) / 10).astype("float32")
    grades = write_splits(wine, tmp_path / "grades")
    result = evaluate(train(grades, tmp_path / "first", task="multiclass", label="grade"), data_dir=grades,
                      model_name="grades", label_column="grade", gate={"task": "multiclass", "floor": 0.5})
    assert result["passed"] and len(result["challenger"]["classes"]) == 3, result["reasons"]

    floats = copy_data(cancer, tmp_path / "floats", lambda frame, split: frame.assign(
        diagnosis=frame["diagnosis"].astype("float64")))
    crown(train(floats, tmp_path / "champion", task="binary", label="diagnosis"), "floats")
    tonight = copy_data(floats, tmp_path / "tonight", lambda frame, split: frame.assign(
        diagnosis=np.where(frame["diagnosis"] == 0, np.round(-0.2), frame["diagnosis"])))
    assert "-0.0" in set(pd.read_parquet(tonight / "test.parquet")["diagnosis"].astype(str))
    result = evaluate(train(tonight, tmp_path / "challenger", task="binary", label="diagnosis", seed=1),
                      data_dir=tonight, model_name="floats", label_column="diagnosis",
                      gate={"task": "binary", "primary": "accuracy", "floor": 0.5})
    assert result["champion"] is not None and not result["needs_approval"], result["reasons"]
    assert sorted(result["challenger"]["classes"]) == ["0.0", "1.0"]


def test_a_rare_class_only_in_tonights_test_split_goes_to_a_person_not_a_failed_night(tmp_path: Path) -> None:
    """Review rev34b: a 4% class that tonight's train split lacks but its test split holds made the challenger's
    scoring raise, so the night failed and the champion, which knew the class, was never weighed."""
    wine = wine_table("cultivar")
    rare = wine[wine.cultivar == 2].sample(6, random_state=0)
    good = write_splits(pd.concat([wine[wine.cultivar != 2], rare]).sample(frac=1, random_state=1)
                        .reset_index(drop=True), tmp_path / "good")
    crown(train(good, tmp_path / "champion", task="multiclass", label="cultivar"), "wine")
    tr, va, te = (pd.read_parquet(good / f"{s}.parquet") for s in ("train", "validation", "test"))
    moved, back = tr[tr.cultivar == 2], te[te.cultivar != 2].iloc[:int((tr.cultivar == 2).sum())]
    night = tmp_path / "night"
    night.mkdir()
    for split, frame in (("train", pd.concat([tr[tr.cultivar != 2], back])), ("validation", va[va.cultivar != 2]),
                         ("test", pd.concat([te.drop(back.index), moved]))):
        frame.reset_index(drop=True).to_parquet(night / f"{split}.parquet")
    assert len(moved) and not (pd.read_parquet(night / "train.parquet").cultivar == 2).any()
    result = evaluate(train(night, tmp_path / "challenger", task="multiclass", label="cultivar", seed=1),
                      data_dir=night, model_name="wine", label_column="cultivar",
                      gate={"task": "multiclass", "primary": "accuracy", "floor": 0.5})
    assert not result["passed"] and result["champion"] is None
    assert any("cannot answer class(es) ['2']" in r for r in result["reasons"]), result["reasons"]
    assert result["needs_approval"] == (result["challenger"]["accuracy"] >= 0.5)
    # scored over tonight's classes too: the rare class's rows are misses, not a crash
    assert result["challenger"]["classes"] == ["0", "1", "2"]
    assert result["challenger"]["per_class_recall"]["2"] == 0.0


def test_a_diverged_challenger_fails_naming_the_model_not_the_data(cancer: Path, tmp_path: Path) -> None:
    """Review rev34b: a model with NaN weights (what a learning rate of 10 does) failed evaluate with a hint that
    blamed the data (a feature too large for the network). Every row's answer is not finite: the message says the
    model is broken."""
    import torch

    from nightshift.datasets import load_split
    from nightshift.errors import EvaluationError
    from nightshift.models import build_model
    from nightshift.train.artifacts import save_trained_model

    options = {"label": "diagnosis"}
    split = load_split("tabular", cancer, "train", task="binary", options=options)
    kwargs = {"input_shape": split.input_shape, "num_classes": split.num_classes, "hidden": 16}
    model = build_model("mlp", **kwargs)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(float("nan"))
    model.eval()
    out = tmp_path / "nan"
    save_trained_model(out, model, model_name="mlp", model_kwargs=kwargs, dataset="tabular",
                       params={"epochs": 1, "dataset_options": options}, train_key="k-nan", task="binary",
                       preprocessing=split.preprocessing)
    (out / "metrics.json").write_text(json.dumps({"epochs": 1}))
    (out / "metrics.jsonl").write_text("")
    run = tracking.log_training_run(out, experiment="tables", tags={"nightshift.run_key": "k-nan"})
    with pytest.raises(EvaluationError, match=r"for (\d+) of \1 rows \(every row: the model itself is broken"):
        evaluate(run, data_dir=cancer, model_name="nan", label_column="diagnosis",
                 gate={"task": "binary", "primary": "accuracy", "floor": 0.5})


def test_labels_in_another_encoding_are_an_error_that_names_them_not_a_quiet_zero(cancer: Path,
                                                                                   tmp_path: Path) -> None:
    """Review rev-labels of 4ed7884: a challenger is scored over labels it never saw only while they are a minority
    of the split's rows. Labels all unknown (a float32 model, float64 labels: other values) scored 0 and were
    rejected quietly every night; empty labels crashed at logging. An integer label is the class of the same
    float value."""
    from nightshift.errors import EvaluationError

    wine = wine_table("grade")
    wine["grade"] = ((wine["grade"] + 1) / 10).astype("float32")
    grades = write_splits(wine, tmp_path / "grades")
    run = train(grades, tmp_path / "f32", task="multiclass", label="grade")
    wider = copy_data(grades, tmp_path / "f64", lambda frame, split: frame.assign(
        grade=frame["grade"].astype(str).astype("float64") if split == "test" else frame["grade"]))
    with pytest.raises(EvaluationError, match=r"holds \['0.1', '0.2', '0.3'\], classes the model does not know"):
        evaluate(run, data_dir=wider, model_name="grades", label_column="grade", gate={"task": "multiclass"})

    holes = copy_data(grades, tmp_path / "holes", lambda frame, split: frame.assign(
        grade=frame["grade"].where(frame.index > 2) if split == "test" else frame["grade"]))
    with pytest.raises(EvaluationError, match=r"label column 'grade' is empty in 3 rows"):
        evaluate(run, data_dir=holes, model_name="grades", label_column="grade", gate={"task": "multiclass"})

    floats = copy_data(cancer, tmp_path / "floats", lambda frame, split: frame.assign(
        diagnosis=frame["diagnosis"].astype("float64" if split != "test" else "int64")))
    result = evaluate(train(floats, tmp_path / "float-model", task="multiclass", label="diagnosis"),
                      data_dir=floats, model_name="cancer-floats", label_column="diagnosis",
                      gate={"task": "multiclass", "floor": 0.5})
    assert result["challenger"]["classes"] == ["0.0", "1.0"] and result["challenger"]["accuracy"] > 0.8


def test_a_champion_named_minus_zero_before_names_were_normalised_is_still_compared(
        cancer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review rev-labels of 4ed7884: a champion registered before float classes were named 0.0 (its class '-0.0')
    was 'dropped' by every new challenger (class '0.0'), so no night compared with it again."""
    import nightshift.datasets as datasets

    floats = copy_data(cancer, tmp_path / "floats", lambda frame, split: frame.assign(
        diagnosis=frame["diagnosis"].astype("float64")))
    normalised = datasets.tabular_preprocessing

    def before(*args: Any, **kwargs: Any) -> dict[str, Any]:
        prep = normalised(*args, **kwargs)
        prep["classes"] = [-0.0 if c == 0 else c for c in prep["classes"]]
        return prep

    monkeypatch.setattr(datasets, "tabular_preprocessing", before)
    crown(train(floats, tmp_path / "champion", task="binary", label="diagnosis"), "floats")
    monkeypatch.setattr(datasets, "tabular_preprocessing", normalised)
    weaker = train(floats, tmp_path / "weaker", task="binary", label="diagnosis", seed=1, epochs=3)
    result = evaluate(weaker, data_dir=floats, model_name="floats", label_column="diagnosis",
                      gate={"task": "binary", "primary": "accuracy", "floor": 0.5})
    assert result["champion"] is not None and not result["needs_approval"], result["reasons"]
    assert result["champion"]["classes"] == ["0.0", "1.0"]
    assert not result["passed"] and "vs champion" in result["reasons"][0]


def test_a_binary_positive_class_is_matched_by_value_and_half_unknown_labels_are_an_error(
        cancer: Path, tmp_path: Path) -> None:
    """Review rev-labels2: `positive_class: 1` against float labels (classes 0.0 and 1.0) failed every night ("none
    of the classes"); a split whose labels are half unknown was scored as if a rare class, though half or more
    unknown is documented as labels encoded anew."""
    from nightshift.errors import EvaluationError

    floats = copy_data(cancer, tmp_path / "floats", lambda frame, split: frame.assign(
        diagnosis=frame["diagnosis"].astype("float64")))
    run = train(floats, tmp_path / "model", task="binary", label="diagnosis")
    result = evaluate(run, data_dir=floats, model_name="positive", label_column="diagnosis",
                      gate={"task": "binary", "primary": "f1", "floor": 0.5, "positive_class": "1"})
    assert result["challenger"]["positive_class"] == "1.0" and result["passed"], result["reasons"]

    wine = wine_table("cultivar")
    data = write_splits(wine[wine.cultivar != 2], tmp_path / "two")
    two = train(data, tmp_path / "two-model", task="multiclass", label="cultivar")
    test = pd.read_parquet(data / "test.parquet")
    half = pd.concat([test.iloc[:10], wine[wine.cultivar == 2].iloc[:10]]).reset_index(drop=True)
    half.to_parquet(data / "test.parquet")
    with pytest.raises(EvaluationError, match=r"holds \['2'\], classes the model does not know"):
        evaluate(two, data_dir=data, model_name="half", label_column="cultivar", gate={"task": "multiclass"})
    half.iloc[:11].to_parquet(data / "test.parquet")  # 10 known of 11: a rare class, scored as misses
    result = evaluate(two, data_dir=data, model_name="half", label_column="cultivar", gate={"task": "multiclass"})
    assert result["challenger"]["per_class_recall"]["2"] == 0.0
