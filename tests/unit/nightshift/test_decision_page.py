"""The decision page's builder (nightshift.decision_page) and its figures (nightshift.svg), from evaluation results
the gate itself decided (`decide`); the page of a real evaluation is test_decision_page_tables.py's."""

from __future__ import annotations

import html
import re
from dataclasses import asdict
from typing import Any

import numpy as np
import pytest

from nightshift import decision_page, svg
from nightshift.errors import UsageError
from nightshift.evaluate import GateConfig, decide

HOSTILE = "<script>alert(1)</script>"
CLASSES = ["a", "b", HOSTILE]


def result(challenger: dict[str, Any], champion: dict[str, Any] | None, gate: GateConfig, **extra: Any
           ) -> dict[str, Any]:
    """What `evaluate` returns (and `gather` adds to), with the gate's own decision."""
    return {**decide(challenger, champion, gate), "run_id": "0123456789abcdef0123456789abcdef", "model_name": "wine",
            "split": "test", "challenger": challenger, "champion": champion, "gate": asdict(gate),
            "needs_approval": False, "drift_columns": [], "worst": None, "curves": {}, **extra}


def scores(accuracy: float, log_loss: float, macro_f1: float, matrix: list[list[int]]) -> dict[str, Any]:
    counts = np.asarray(matrix)
    recall = counts.diagonal() / counts.sum(axis=1)
    return {"accuracy": accuracy, "log_loss": log_loss, "macro_f1": macro_f1, "rows": int(counts.sum()),
            "classes": CLASSES, "confusion_matrix": matrix,
            "per_class_recall": dict(zip(CLASSES, recall.tolist(), strict=True)),
            "drift": {"rows": 0.25, "columns": {HOSTILE: 0.25}}}


CHALLENGER = scores(0.95, 0.40, 0.94, [[10, 0, 0], [1, 8, 1], [0, 0, 20]])
CHAMPION = {"version": "3", **scores(0.90, 0.20, 0.89, [[9, 1, 0], [3, 6, 1], [0, 0, 20]])}


def row_of(page: str, name: str) -> str:
    (row,) = re.findall(rf"<tr><td><b>{name}</b>.*?</tr>", page)
    return row


def test_each_metric_shows_the_gates_rule_and_its_verdict() -> None:
    """accuracy gains 0.05 (primary: pass), log_loss loses 0.20 (guard 0.05: fail), macro_f1 gains (guard: pass)."""
    evaluated = result(CHALLENGER, CHAMPION, GateConfig(task="multiclass"))
    assert not evaluated["passed"]
    rows = {r["metric"]: r for r in decision_page.metric_rows(evaluated)}
    assert {name: (r["role"], r["verdict"]) for name, r in rows.items()} == {
        "accuracy": ("primary", "pass"), "log_loss": ("guard", "fail"), "macro_f1": ("guard", "pass")}
    assert rows["log_loss"]["change"] == pytest.approx(-0.20)  # lower is better: positive change = better
    assert rows["log_loss"]["reason"].startswith("guard log_loss 0.4000 vs champion 0.2000")
    page = decision_page.render(evaluated)
    log_loss = row_of(page, "log_loss")
    assert "<td class='num'>0.4000</td><td class='num'>0.2000</td><td class='num'>-0.2000</td>" in log_loss
    assert "may fall behind the champion by at most 0.0500" in log_loss and ">fail</td>" in log_loss
    assert ">pass</td>" in row_of(page, "accuracy") and "at least 0.0010" in row_of(page, "accuracy")
    assert "Refused by the gate" in page


@pytest.mark.parametrize(("ours", "theirs", "gate", "verdict"), [
    (0.91, 0.90, GateConfig(task="multiclass", guards={}), "pass"),  # improves by 0.01 >= 0.001
    (0.9005, 0.90, GateConfig(task="multiclass", guards={}), "fail"),  # below min_improvement
    (0.90, 0.90, GateConfig(task="multiclass", guards={}), "fail"),  # a tie never promotes
    (0.85, 0.90, GateConfig(task="multiclass", guards={}), "fail"),  # worse
    (0.85, None, GateConfig(task="multiclass"), "pass"),  # no champion: meets the floor 0.8
    (0.75, None, GateConfig(task="multiclass"), "fail"),  # misses it
])
def test_the_primary_verdict_is_the_gates(ours: float, theirs: float | None, gate: GateConfig, verdict: str) -> None:
    challenger = scores(ours, 0.3, 0.9, [[1, 0, 0], [0, 1, 0], [0, 0, 1]])
    champion = {"version": "1", **scores(theirs, 0.3, 0.9, [[1, 0, 0], [0, 1, 0], [0, 0, 1]])} if theirs else None
    evaluated = result(challenger, champion, gate)
    (accuracy,) = [r for r in decision_page.metric_rows(evaluated) if r["metric"] == "accuracy"]
    assert accuracy["verdict"] == verdict and evaluated["passed"] == (verdict == "pass"), accuracy
    if champion is None:  # guards are not checked without a champion
        assert {r["verdict"] for r in decision_page.metric_rows(evaluated) if r["role"] == "guard"} == {""}


def test_confusion_matrices_side_by_side_with_their_difference_and_the_recall_deltas() -> None:
    page = decision_page.render(result(CHALLENGER, CHAMPION, GateConfig(task="multiclass")))
    # A cell: its count as text, and its tooltip naming the true and the predicted class (escaped).
    assert "<title>true b, predicted a: 1</title>" in page  # the challenger's
    assert "<title>true b, predicted a: 3</title>" in page  # the champion's
    assert "<title>true b, predicted a: -2</title>" in page  # the difference: two fewer mistakes
    assert "<title>true b, predicted b: +2</title>" in page
    assert "champion v3: confusion matrix" in page and "difference (challenger − champion)" in page
    # Recall of b: 8/10 vs 6/10 -> +0.200; of a: 1.0 vs 0.9 -> +0.100.
    assert "<title>b recall change: +0.200</title>" in page and "<title>a recall change: +0.100</title>" in page


def test_without_a_champion_the_challenger_is_shown_alone() -> None:
    page = decision_page.render(result(CHALLENGER, None, GateConfig(task="multiclass")))
    assert "challenger: confusion matrix" in page and "difference" not in page
    assert "per-class recall (no champion to compare with)" in page and "no champion to compare with" in page


def test_names_from_the_data_are_escaped_everywhere() -> None:
    columns = [{"column": HOSTILE, "distance": 0.5, "outside": 0.25, "outside_champion": 0.0}]
    worst = {"column": HOSTILE, "edges": [0.0, 1.0, 2.0], "train": [0.5, 0.5], "tonight": [0.0, 1.0]}
    evaluated = result(CHALLENGER, CHAMPION, GateConfig(task="multiclass"), drift_columns=columns, worst=worst,
                       reasons=[f"a reason quoting {HOSTILE}"], model_name=HOSTILE)
    page = decision_page.render(evaluated)
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert f'<meta http-equiv="Content-Security-Policy" content="{html.escape(decision_page.CSP)}">' in page


def test_drift_bars_and_the_worst_feature_drawn() -> None:
    columns = [{"column": f"f{i}", "distance": 1 - i / 30, "outside": 0.0, "outside_champion": 0.1}
               for i in range(25)]
    worst = {"column": "f0", "edges": [0.0, 1.0, 2.0], "train": [0.75, 0.25], "tonight": [0.25, 0.75]}
    page = decision_page.render(result(CHALLENGER, CHAMPION, GateConfig(task="multiclass"), drift_columns=columns,
                                       worst=worst))
    assert "the 20 most drifted of 25 features" in page
    assert "<title>f0 KS distance: 1.000</title>" in page and "<title>f19 KS distance: 0.367</title>" in page
    assert "<title>f20 KS distance" not in page  # drawn: the worst 20; listed: all
    assert "<td>f24</td>" in page
    assert "worst: f0" in page and "<title>training split: 0.5, 0.75</title>" in page
    assert "<title>test split: 1.5, 0.75</title>" in page


def test_training_curves_of_both_runs() -> None:
    curves = {"challenger": {"val_loss": [[1, 0.9], [2, 0.5]], "val_accuracy": [[1, 0.6], [2, 0.8]]},
              "champion": {"val_loss": [[1, 1.0], [2, 0.7]]}}
    page = decision_page.render(result(CHALLENGER, CHAMPION, GateConfig(task="multiclass"), curves=curves))
    assert "<title>val_loss: 2, 0.5</title>" in page and "<title>val_loss (champion): 2, 0.7</title>" in page
    assert "<title>val_accuracy: 2, 0.8</title>" in page
    assert "stroke-dasharray" in page  # the champion's run dashed
    empty = decision_page.render(result(CHALLENGER, CHAMPION, GateConfig(task="multiclass")))
    assert "logged no per-epoch metrics" in empty


def test_regression_shows_residuals_not_confusion_matrices() -> None:
    target, predicted = np.array([10.0, 20.0, 30.0]), np.array([12.0, 18.0, 30.0])
    sample = decision_page.residual_sample(target, predicted)
    assert sample == {"predicted": [12.0, 18.0, 30.0], "residual": [-2.0, 2.0, 0.0]}
    ours = {"rmse": 1.63, "mae": 1.33, "r2": 0.9, "rows": 3, "residuals": sample}
    theirs = {"version": "2", "rmse": 2.0, "mae": 1.5, "r2": 0.8, "rows": 3, "residuals": sample}
    page = decision_page.render(result(ours, theirs, GateConfig(task="regression")))
    assert "challenger: residuals (rmse 1.6300)" in page and "champion v2: residuals (rmse 2.0000)" in page
    assert "<title>challenger: 12, -2</title>" in page and "confusion" not in page
    assert ">pass</td>" in row_of(page, "rmse")


def test_the_residual_sample_is_bounded_and_evenly_spaced() -> None:
    target = np.arange(10_000, dtype=np.float64)
    sample = decision_page.residual_sample(target, target - 1)
    assert len(sample["predicted"]) == decision_page.RESIDUAL_POINTS
    assert sample["predicted"][0] == -1 and sample["predicted"][-1] == 9998 and set(sample["residual"]) == {1.0}


def test_ks_distance_is_scipys_statistic() -> None:
    from scipy.stats import ks_2samp

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=300), rng.normal(0.3, 1.2, size=200)
    assert decision_page.ks_distance(a, b) == pytest.approx(ks_2samp(a, b).statistic)
    assert decision_page.ks_distance(a, a) == 0.0
    assert decision_page.ks_distance(np.zeros(5), np.ones(5)) == 1.0
    assert np.isnan(decision_page.ks_distance(np.array([np.nan]), a))


def test_page_path_takes_only_ids(nightshift_home: Any) -> None:
    path = decision_page.page_path("wine_retrain", "0123abcd")
    assert path == nightshift_home / "decisions" / "wine_retrain" / "0123abcd" / "decision.html"
    for dag_id, run_id in (("..", "x"), ("a/b", "x"), ("ok", ".."), ("ok", "a/b"), ("ok", "")):
        with pytest.raises(UsageError, match="is not"):
            decision_page.page_path(dag_id, run_id)


def test_ticks_are_round_numbers() -> None:
    assert svg.ticks(0.0, 1.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert svg.ticks(0.9504, 0.9682, 4) == pytest.approx([0.955, 0.96, 0.965])  # a close season: 3 ticks, not 1
    assert svg.ticks(-3.0, 7.0) == [-2.0, 0.0, 2.0, 4.0, 6.0]
    assert svg.ticks(5.0, 5.0) == [5.0]


def test_a_feature_with_values_near_the_largest_float_never_fails_the_page(tmp_path: Any) -> None:
    """A sentinel of ±1.8e308 in the most drifted column: no histogram spans it (np.histogram refused the bins and
    evaluate failed, every night the data held it); the table still lists the column, and an axis that wide
    draws (svg.ticks raised OverflowError)."""
    import pandas as pd

    top = float(np.finfo(np.float64).max)
    pd.DataFrame({"x": [*np.ones(50), -top, top], "y": np.arange(52.0)}).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame({"x": [*np.full(50, 2.0), -top, top], "y": np.arange(52.0)}).to_parquet(tmp_path / "test.parquet")
    columns, worst = decision_page.column_drift(tmp_path, "test", "y", {"challenger": {}, "champion": None})
    assert [c["column"] for c in columns] == ["x"] and columns[0]["distance"] > 0.9 and worst is None
    assert svg.ticks(-top, top) == [-top]
    drawn = svg.plot([svg.Series("s", [(-top, 0.0), (top, 1.0)], "#000")], title="wide")
    assert drawn.startswith("<svg") and drawn.endswith("</svg>")


def test_a_metric_that_is_not_a_number_fails_where_the_gate_failed_it() -> None:
    """A diverged challenger: decide rejects it for its NaN log_loss before any other check; that row (a guard)
    and no other says fail (the page showed no verdict at all, as if nothing had been checked)."""
    challenger = {**CHALLENGER, "log_loss": float("nan")}
    evaluated = result(challenger, CHAMPION, GateConfig(task="multiclass"))
    assert not evaluated["passed"] and evaluated["reasons"][0].startswith("the challenger's log_loss nan")
    rows = {r["metric"]: r for r in decision_page.metric_rows(evaluated)}
    assert {name: r["verdict"] for name, r in rows.items()} == {"accuracy": "", "log_loss": "fail", "macro_f1": ""}
    assert rows["log_loss"]["reason"] == evaluated["reasons"][0]
    assert ">fail</td>" in row_of(decision_page.render(evaluated), "log_loss")


def test_a_share_outside_a_range_no_model_recorded_is_unknown_not_zero(tmp_path: Any) -> None:
    """A champion (or challenger) that records no training range (its drift None: a pyfunc of another kind): its
    share of rows outside it is shown as unknown (—); it read 0.000, as if no row were outside."""
    import pandas as pd

    pd.DataFrame({"x": np.arange(20.0), "y": np.arange(20.0)}).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame({"x": np.arange(10.0, 30.0), "y": np.arange(20.0)}).to_parquet(tmp_path / "test.parquet")
    challenger = {"drift": {"rows": 0.5, "columns": {"x": 0.5}, "features": ["x"]}}
    columns, _ = decision_page.column_drift(tmp_path, "test", "y", {"challenger": challenger,
                                                                     "champion": {"version": "1", "drift": None}})
    assert [(c["column"], c["outside"], c["outside_champion"]) for c in columns] == [("x", 0.5, None)]
    columns, _ = decision_page.column_drift(tmp_path, "test", "y", {"challenger": {"drift": None}, "champion": None})
    assert [(c["column"], c["outside"], c["outside_champion"]) for c in columns] == [("x", None, None)]


def test_a_figure_that_cannot_be_drawn_never_fails_the_night(monkeypatch: pytest.MonkeyPatch, tmp_path: Any
                                                              ) -> None:
    """A drawing bug (a figure raising on a night's data; here stood in for): the page keeps the decision and
    the metrics and says the figures failed; a drift this code cannot compute is a note. Before, publish raised,
    evaluate failed, and with the champion unchanged the same data failed every night after."""
    evaluated = result(CHALLENGER, CHAMPION, GateConfig(task="multiclass"))

    def broken(*args: Any, **kwargs: Any) -> str:
        raise ZeroDivisionError("a drawing bug")

    monkeypatch.setattr(svg, "heatmap", broken)
    page = decision_page.render(evaluated)
    assert "Refused by the gate" in page and ">fail</td>" in row_of(page, "log_loss")
    assert "The figures could not be drawn (ZeroDivisionError: a drawing bug)" in page

    def unmeasurable(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("a column no test had")

    monkeypatch.setattr(decision_page, "column_drift", unmeasurable)
    monkeypatch.setattr(decision_page, "training_curves", lambda run_id: {})
    gathered = decision_page.gather({**evaluated, "champion": None}, data_dir=tmp_path, label_column="y")
    assert "it could not be computed (ValueError: a column no test had)" in gathered["drift_note"]


def test_the_training_split_is_read_one_column_at_a_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The drift reads each feature of the training split on its own: a training split larger than the
    evaluate task's memory never comes whole (it was read whole, text columns and all: evaluate, and the
    night, died where the training pod had had the memory). A saved pandas index is no feature."""
    import pandas as pd
    import pyarrow.parquet as pq

    frame = pd.DataFrame({"a": np.arange(30.0), "b": np.arange(30.0) ** 2, "note": ["x"] * 30, "y": [0, 1] * 15},
                         index=pd.Index(np.arange(100, 130), name="row"))
    frame.to_parquet(tmp_path / "train.parquet")
    frame.assign(a=frame["a"] + 10).to_parquet(tmp_path / "test.parquet")
    asked: list[Any] = []
    read = pq.ParquetFile.read

    def recorded(self: Any, columns: Any = None, **kwargs: Any) -> Any:
        asked.append(columns)
        return read(self, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read", recorded)
    monkeypatch.setattr(pd, "read_parquet", lambda *a, **k: pytest.fail(f"a split read whole: {a}"))
    columns, worst = decision_page.column_drift(tmp_path, "test", "y", {"challenger": {"drift": None}})
    assert [c["column"] for c in columns] == ["a", "b"] and worst is not None and worst["column"] == "a"
    assert asked and all(isinstance(c, list) and len(c) == 1 for c in asked), asked
