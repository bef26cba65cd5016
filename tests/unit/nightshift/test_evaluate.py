from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from nightshift.errors import UsageError
from nightshift.evaluate import GateConfig, decide

CHAMPION = {"accuracy": 0.90, "macro_f1": 0.90, "log_loss": 0.30}


def test_no_champion_needs_the_floor() -> None:
    gate = GateConfig(floor=0.85)
    assert decide({"accuracy": 0.86, "macro_f1": 0.8, "log_loss": 0.5}, None, gate)["passed"]
    rejected = decide({"accuracy": 0.84, "macro_f1": 0.8, "log_loss": 0.5}, None, gate)
    assert not rejected["passed"] and "misses the floor 0.8500" in rejected["reasons"][0]


def test_challenger_must_beat_champion_by_min_improvement() -> None:
    gate = GateConfig(min_improvement=0.01)
    assert decide({**CHAMPION, "accuracy": 0.911}, CHAMPION, gate)["passed"]
    tie = decide(dict(CHAMPION), CHAMPION, gate)
    assert not tie["passed"] and "a tie never replaces the champion" in tie["reasons"][0]
    short = decide({**CHAMPION, "accuracy": 0.905}, CHAMPION, gate)
    assert not short["passed"] and "improvement +0.0050 < min_improvement 0.0100" in short["reasons"][0]


@pytest.mark.parametrize("min_improvement", [0.0, 1e-12])
def test_a_tie_never_promotes_even_with_no_min_improvement(min_improvement: float) -> None:
    gate = GateConfig(min_improvement=min_improvement, guards={})
    # the same accuracy computed two ways: equal but for rounding
    champion = {**CHAMPION, "accuracy": float(np.mean([1] * 94 + [0] * 6))}
    challenger = {**CHAMPION, "accuracy": 0.94}
    for ours, theirs in ((champion, champion), (challenger, champion), (champion, challenger)):
        decision = decide(ours, theirs, gate)
        assert not decision["passed"] and "a tie never replaces the champion" in decision["reasons"][0], decision
    assert decide({**CHAMPION, "accuracy": 0.95}, champion, gate)["passed"]


@pytest.mark.parametrize(("ours", "theirs", "rows", "min_improvement"), [(94, 93, 100, 0.01), (938, 937, 1000, 0.001)])
def test_a_gain_equal_to_min_improvement_but_for_float_rounding_meets_it(
        ours: int, theirs: int, rows: int, min_improvement: float) -> None:
    def accuracy(right: int) -> float:
        return float(np.mean(np.array([1] * right + [0] * (rows - right))))

    gate = GateConfig(min_improvement=min_improvement, guards={"macro_f1": min_improvement})
    champion = {**CHAMPION, "accuracy": accuracy(theirs), "macro_f1": accuracy(ours)}
    decision = decide({**CHAMPION, "accuracy": accuracy(ours), "macro_f1": accuracy(theirs)}, champion, gate)
    assert decision["passed"], decision  # the guard lost exactly its tolerance: within it too


def test_guard_regression_beyond_tolerance_rejects_even_with_a_better_primary() -> None:
    gate = GateConfig(min_improvement=0.0, guards={"macro_f1": 0.01, "log_loss": 0.05})
    worse_f1 = decide({"accuracy": 0.95, "macro_f1": 0.88, "log_loss": 0.2}, CHAMPION, gate)
    assert not worse_f1["passed"] and any("macro_f1" in r and "beyond" in r for r in worse_f1["reasons"])
    # log loss is lower-is-better: a rise of 0.04 is within 0.05, a rise of 0.06 is not.
    assert decide({"accuracy": 0.95, "macro_f1": 0.9, "log_loss": 0.34}, CHAMPION, gate)["passed"]
    assert not decide({"accuracy": 0.95, "macro_f1": 0.9, "log_loss": 0.36}, CHAMPION, gate)["passed"]


def test_log_loss_as_primary_improves_downwards() -> None:
    gate = GateConfig(primary="log_loss", min_improvement=0.05, guards={}, floor=0.5)
    assert decide({**CHAMPION, "log_loss": 0.2}, CHAMPION, gate)["passed"]
    assert not decide({**CHAMPION, "log_loss": 0.28}, CHAMPION, gate)["passed"]
    assert decide({**CHAMPION, "log_loss": 0.4}, None, gate)["passed"]


@pytest.mark.parametrize("kwargs", [{"primary": "auc"}, {"min_improvement": -0.1},
                                    {"guards": {"macro_f1": -1.0}}, {"guards": {"precision": 0.1}}])
def test_bad_gate_config_names_the_field(kwargs: dict[str, object]) -> None:
    with pytest.raises(UsageError):
        GateConfig(**kwargs)  # type: ignore[arg-type]


def _model(task: str, label: str | None, features: list[str]) -> object:
    from types import SimpleNamespace

    meta = {"nightshift.task": task, "nightshift.feature_columns": features,
            **({"nightshift.label_column": label} if label else {})}
    return SimpleNamespace(metadata=SimpleNamespace(metadata=meta, get_input_schema=lambda: None))


@pytest.mark.parametrize(("champion", "why"), [
    (_model("binary", "churned", ["age", "plan", "spend"]), "task 'binary', not 'regression'"),
    (_model("regression", "churned", ["age", "plan", "spend"]), "label column 'churned', not 'spend'"),
    (_model("regression", "spend", ["age", "plan", "income"]), "feature columns ['income'] that tonight's data"),
])
def test_a_champion_trained_for_another_label_task_or_features_is_no_champion(
        monkeypatch: pytest.MonkeyPatch, champion: object, why: str) -> None:
    import mlflow

    from nightshift import evaluate as ev

    challenger = _model("regression", "spend", ["age", "plan", "churned"])
    models = {"runs:/new/model": challenger, "models:/churn/3": champion}
    monkeypatch.setattr(ev.tracking, "run_model_uri", lambda run_id: "runs:/new/model")
    monkeypatch.setattr(ev, "champion_uri", lambda name: ("3", "models:/churn/3"))
    monkeypatch.setattr(ev, "_load", models.__getitem__)
    scored: list[str] = []

    def score(uri: str, *args: object, **kwargs: object) -> dict[str, object]:
        scored.append(uri)
        return {"model_uri": uri, "rows": 10, "rmse": 2.0, "mae": 1.0, "r2": 0.5}

    monkeypatch.setattr(ev, "score", score)
    monkeypatch.setattr(ev, "read_split_frame", lambda data_dir, split: pd.DataFrame(
        columns=["age", "plan", "churned", "spend"]))
    for name in ("log_metrics", "set_tags", "log_artifact"):
        monkeypatch.setattr(mlflow, name, lambda *a, **k: None)
    monkeypatch.setattr(mlflow, "start_run", lambda **k: __import__("contextlib").nullcontext())
    monkeypatch.setattr(ev.decision_page, "publish", lambda *a, **k: None)  # it reads the run: test_decision_page*
    result = ev.evaluate("new", data_dir="/d", model_name="churn", label_column="spend",
                         gate={"task": "regression", "floor": 3.0, "primary": "rmse"})
    assert scored == ["runs:/new/model"] and result["champion"] is None
    assert why in result["reasons"][0] and "champion v3 is not comparable" in result["reasons"][0]
    # the floor alone does not decide: the model passes it, and the decision goes to a person
    assert "meets the floor 3.0000" in result["reasons"][1]
    assert result["needs_approval"] and "goes to a person" in result["reasons"][-1]
    assert not result["passed"]  # not on its own: whatever reads only `passed` promotes nothing


def test_a_champion_trained_for_the_same_contract_is_scored(monkeypatch: pytest.MonkeyPatch) -> None:
    from nightshift import evaluate as ev

    same = _model("regression", "spend", ["age"])
    assert ev.incomparable(same, _model("regression", "spend", ["age"]), task="regression",
                           label_column="spend") is None
    # second hostile review: columns reordered, or columns the data gained, made the champion "no champion" and
    # let a worse challenger through on the floor alone; the champion is scored on its own columns by name
    assert ev.incomparable(_model("regression", "spend", ["plan", "age"]),
                           _model("regression", "spend", ["age", "plan"]), task="regression",
                           label_column="spend") is None
    assert ev.incomparable(_model("regression", "spend", ["age"]), _model("regression", "spend", ["age", "new"]),
                           task="regression", label_column="spend") is None
    no_label = _model("multiclass", None, ["pixel_0"])  # a digits model records no label column
    assert ev.incomparable(no_label, no_label, task="multiclass", label_column="label") is None


@pytest.mark.parametrize("challenger", [{"rmse": float("nan"), "mae": 1.0, "r2": 0.5},
                                        {"rmse": 1.0, "mae": float("inf"), "r2": 0.5},
                                        {"rmse": 1.0, "mae": 1.0, "r2": float("nan")}])
def test_a_non_finite_challenger_metric_fails_the_gate_first(challenger: dict[str, float]) -> None:
    bad = next(k for k, v in challenger.items() if v != v or v == float("inf"))
    for champion in (None, {"rmse": 9.0, "mae": 9.0, "r2": 0.0}):
        decision = decide(challenger, champion, GateConfig(task="regression", primary="r2", guards={}))
        assert not decision["passed"] and decision["reasons"][0].startswith(f"the challenger's {bad} ")


def test_r2_of_a_constant_target_is_nan_and_evaluation_refuses_such_a_split(
        monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    import math

    import numpy as np
    import pandas as pd

    from nightshift import evaluate as ev
    from nightshift.errors import EvaluationError

    assert math.isnan(ev.regression_metrics(np.full(5, 3.0), np.full(5, 3.5))["r2"])
    frame = pd.DataFrame({"x": [1.0, 2.0, 3.0], "y": [3.0, 3.0, 3.0]})
    monkeypatch.setattr(ev, "read_split_frame", lambda data_dir, split: frame)
    model = _model("regression", "y", ["x"])
    monkeypatch.setattr(ev, "_predict", lambda m, f, *where: pd.DataFrame({ev.tracking.VALUE_COLUMN: [3.0, 3.0, 3.0]}))
    with pytest.raises(EvaluationError, match="target column 'y' has no variance"):
        ev.score("m", "/d", task="regression", label_column="y", model=model)


def test_the_default_floor_belongs_to_the_default_primary_metric() -> None:
    """Review of issue 34: `nightshift evaluate --primary log_loss` took accuracy's floor 0.8 as a log loss bound,
    and a coin-flip model (log loss 0.69) met it."""
    with pytest.raises(UsageError, match=r"give a floor for primary 'log_loss' \(--floor\)"):
        GateConfig(primary="log_loss")
    assert GateConfig(primary="accuracy").floor == 0.8
    assert GateConfig(task="regression", primary="mae").floor is None


def _cancer_scores() -> tuple[np.ndarray, np.ndarray]:
    """Breast-cancer labels (0 malignant, 1 benign) and a logistic regression's probability of each, on half the
    table, fitted on the other half."""
    from sklearn.datasets import load_breast_cancer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    features, labels = load_breast_cancer(return_X_y=True)
    model = make_pipeline(StandardScaler(), LogisticRegression(C=0.01)).fit(features[::2], labels[::2])
    return labels[1::2], model.predict_proba(features[1::2])


def test_the_binary_positive_class_is_declarable_and_defaults_to_the_second_label(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 34 item 10: F1 was always the second sorted label's ("legit" in a fraud table, "benign" here)."""
    from sklearn.metrics import f1_score, precision_score, recall_score

    from nightshift import evaluate as ev
    from nightshift.errors import EvaluationError

    labels, proba = _cancer_scores()
    predicted = proba.argmax(axis=1)
    frame = pd.DataFrame({"x": np.zeros(len(labels)), "diagnosis": labels})
    monkeypatch.setattr(ev, "read_split_frame", lambda data_dir, split: frame)
    monkeypatch.setattr(ev, "_predict", lambda m, f, *where: pd.DataFrame({"prob_0": proba[:, 0],
                                                                          "prob_1": proba[:, 1]}))
    model = _model("binary", "diagnosis", ["x"])

    def scored(positive_class: str | None) -> dict[str, object]:
        return ev.score("m", "/d", task="binary", label_column="diagnosis", model=model,
                        positive_class=positive_class)

    default, malignant = scored(None), scored("0")
    assert default["positive_class"] == "1" and malignant["positive_class"] == "0"
    for result, positive in ((default, 1), (malignant, 0)):
        assert result["f1"] == pytest.approx(f1_score(labels, predicted, pos_label=positive))
        assert result["positive_precision"] == pytest.approx(precision_score(labels, predicted, pos_label=positive))
        assert result["positive_recall"] == pytest.approx(recall_score(labels, predicted, pos_label=positive))
    assert malignant["f1"] != default["f1"]
    assert malignant["roc_auc"] == pytest.approx(default["roc_auc"])  # the same ranking, either way round
    with pytest.raises(EvaluationError, match=r"the positive class 'malignant' is none of the classes 0, 1"):
        scored("malignant")
    # the gate carries it (as the DAG passes a declaration's gate), for a binary task only
    assert GateConfig(task="binary", positive_class=0).positive_class == "0"  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="only a binary task has a positive class"):
        GateConfig(task="multiclass", positive_class="3")


def test_evaluate_scores_with_the_gates_positive_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """The DAG passes a declaration's gate as a dict (nightly_tasks.steps.evaluation_args): its positive class
    reaches the scoring."""
    from nightshift import evaluate as ev

    class Scored(Exception):
        pass

    def score(uri: str, *args: object, positive_class: object = None, **kwargs: object) -> dict[str, object]:
        raise Scored(positive_class)

    monkeypatch.setattr(ev.tracking, "run_model_uri", lambda run_id: "runs:/new/model")
    monkeypatch.setattr(ev, "_load", lambda uri: _model("binary", "diagnosis", ["x"]))
    monkeypatch.setattr(ev, "score", score)
    with pytest.raises(Scored) as scored:
        ev.evaluate("new", data_dir="/d", model_name="cancer", label_column="diagnosis",
                    gate={"task": "binary", "positive_class": "0", "primary": "accuracy", "floor": 0.8,
                          "min_improvement": 0.001, "guards": {}})
    assert scored.value.args == ("0",)


REPO = Path(__file__).resolve().parents[3]


def evaluations_of_a_table_without_a_model_name(text: str) -> list[str]:
    """The `nightshift evaluate` commands of a page (lines joined at a trailing backslash) that evaluate a table of
    one's own (`--task` or `--label-column`) and leave `--model-name` out: they face `nightshift-digits@champion`."""
    commands = re.findall(r"\bnightshift evaluate\b[^\n`]*", re.sub(r"\\\n\s*", " ", text))
    return [c for c in commands if re.search(r"--(task|label-column)\b", c) and "--model-name" not in c]


def test_every_documented_evaluation_of_a_table_names_its_registered_model() -> None:
    """Issue 34 item 10: the README's tabular `nightshift evaluate` example named no model, so a reader's table was
    gated against the demo's digits champion."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    found = {page.name: evaluations_of_a_table_without_a_model_name(page.read_text()) for page in pages}
    assert not any(found.values()), found
    assert any(re.search(r"nightshift evaluate .*--task .*--model-name", page.read_text()) for page in pages)
    assert evaluations_of_a_table_without_a_model_name(  # the README's example before 8b28fbf
        "nightshift evaluate --out OUT --data DIR --task binary --label-column diagnosis\n")



def test_label_names_match_a_class_by_its_text_first_then_by_value() -> None:
    """Numbers are matched by value (float32 labels, -0.0, an integer 2 of a model trained on 2.0), but a label
    spelled as a class is that class: two integers past 2**53 are one float and must stay two classes."""
    import pandas as pd

    from nightshift.evaluate import label_names, same_classes

    big = [2**60, 2**60 + 1]
    assert list(label_names(pd.Series(big), [str(b) for b in big])) == [str(b) for b in big]
    assert list(label_names(pd.Series([0.0, -0.0, 1.0]), ["0.0", "1.0"])) == ["0.0", "0.0", "1.0"]
    assert list(label_names(pd.Series([1, 2]), ["1.0", "2.0"])) == ["1.0", "2.0"]
    assert list(label_names(pd.Series([0.1], dtype="float32"), ["0.10000000149011612"])) == ["0.10000000149011612"]
    assert list(label_names(pd.Series(["a", "b"]), ["a"])) == ["a", "b"]
    assert list(label_names(pd.Series([True, False]), ["1.0", "0.0"])) == ["True", "False"]  # no bool as number
    assert same_classes(["-0.0", "1.0", "x"], ["0.0", "1.0"]) == {"-0.0": "0.0", "1.0": "1.0"}
    # only numbers as Python writes a label's value: string classes that look like numbers stay text (review
    # rev-labels2: '01' was the class '1', '١' the class '1')
    assert same_classes(["01", "+1", "1e3", "١", "1"], ["1", "1000.0"]) == {"1": "1"}
    assert list(label_names(pd.Series([1.0, 2.0]), ["01", "2"])) == ["1.0", "2"]
