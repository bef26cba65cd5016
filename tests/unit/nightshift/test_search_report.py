"""The search report page (nightshift.search.report_html) of a small study built with Optuna directly."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from nightshift.search.report_html import render_report, report_path, write_report
from nightshift.search.study import SearchSettings

optuna = pytest.importorskip("optuna")

HOSTILE = "</script><img src=x onerror=alert(1)>"
SETTINGS = SearchSettings(space={}, data="/d", max_epochs=3, min_epochs=1, reduction_factor=2, sampler="random")


def small_study(name: str = "demo", trials: list[tuple[str, float, str, list[float]]] | None = None) -> Any:
    """Trials as (state, lr, model, val_accuracy per epoch): two complete, one pruned, one failed by default."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution
    from optuna.trial import TrialState, create_trial

    trials = trials if trials is not None else [
        ("COMPLETE", 0.2, "digits_cnn", [0.5, 0.8, 0.9]),
        ("PRUNED", 0.002, HOSTILE, [0.1]),
        ("COMPLETE", 0.05, HOSTILE, [0.4, 0.6, 0.7]),
        ("FAIL", 0.3, "digits_cnn", []),
    ]
    study = optuna.create_study(direction="maximize", study_name=name)
    distributions = {"lr": FloatDistribution(1e-3, 0.5, log=True),
                     "model": CategoricalDistribution(["digits_cnn", HOSTILE])}
    for state, lr, model, values in trials:
        study.add_trial(create_trial(
            state=TrialState[state], params={"lr": lr, "model": model}, distributions=distributions,
            value=values[-1] if state == "COMPLETE" else None,
            intermediate_values={epoch: v for epoch, v in enumerate(values, start=1)}))
    return study


def figure_data(page: str, key: str) -> str:
    """The JSON argument of Plotly.newPlot for the figure `plot-<key>` (its traces)."""
    match = re.search(r'Plotly\.newPlot\(\s*"plot-' + re.escape(key) + r'",\s*(\[.*?\]),\s*\{', page, re.S)
    assert match, f"no figure plot-{key} on the page"
    return match.group(1)


def test_the_page_has_every_figure_and_a_row_per_trial_with_state_and_params() -> None:
    page = render_report(small_study(), SETTINGS)
    for key in ("history", "intermediate-complete", "intermediate-pruned", "importances", "parallel"):
        assert f'id="plot-{key}"' in page, key
    rows = re.findall(r"<tr class='(\w+)' data-trial='(\d+)'>", page)
    assert rows == [("COMPLETE", "0"), ("PRUNED", "1"), ("COMPLETE", "2"), ("FAIL", "3")]
    assert "<th>lr</th><th>model</th>" in page and "<th>val_accuracy</th>" in page
    assert "4 trials: 2 COMPLETE, 1 PRUNED, 1 FAIL; 7 epochs trained." in page
    assert "Best: trial 0, val_accuracy 0.9 (lr=0.2, model=digits_cnn)." in page


def test_pruned_and_completed_trials_are_drawn_apart() -> None:
    page = render_report(small_study(), SETTINGS)
    complete, pruned = figure_data(page, "intermediate-complete"), figure_data(page, "intermediate-pruned")
    assert "0.9" in complete and "0.7" in complete and "0.1" not in complete
    assert "0.1" in pruned and "0.9" not in pruned and "0.7" not in pruned
    # The legends name the study's trials, not those of the copy each figure is drawn from.
    assert re.findall(r'"name":"(Trial[^"]*)"', complete) == ["Trial 0", "Trial 2"]
    assert re.findall(r'"name":"(Trial[^"]*)"', pruned) == ["Trial 1"]


def test_everything_from_the_study_is_escaped() -> None:
    page = render_report(small_study(name="<b>study</b>"), SETTINGS)
    assert "<b>study</b>" not in page and "&lt;b&gt;study&lt;/b&gt;" in page
    assert HOSTILE not in page  # neither in the table nor in the figures' JSON
    assert "&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;" in page
    # One script for plotly.js and one per figure: nothing from the study closed a script early.
    assert page.count("<script") == page.count("</script>") == 1 + 5


def test_the_page_loads_nothing_from_anywhere() -> None:
    page = render_report(small_study(), SETTINGS)
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=|<img[^>]+src=http", page)
    assert '<meta http-equiv="Content-Security-Policy" content="default-src &#x27;none&#x27;;' in page
    assert page.index("<script>") < page.index('id="plot-history"')  # plotly.js inline, before any figure


def test_figures_that_cannot_be_drawn_say_why() -> None:
    one = small_study(trials=[("COMPLETE", 0.2, "digits_cnn", [0.5, 0.8, 0.9]), ("PRUNED", 0.002, "digits_cnn", [0.1])])
    page = render_report(one, SETTINGS)
    assert "parameter importances need at least 2 completed trials; this study has 1" in page
    assert 'id="plot-importances"' not in page and 'id="plot-history"' in page
    none = render_report(small_study(trials=[("PRUNED", 0.002, "digits_cnn", [0.1])]), SETTINGS)
    assert "no trial has completed yet" in none and "there is no best configuration" in none
    assert "no COMPLETE trial reported an intermediate value" in none and 'id="plot-intermediate-pruned"' in none
    empty = render_report(small_study(trials=[]), SETTINGS)
    assert "No trials yet." in empty and "0 trials: none yet" in empty


def test_the_report_is_written_under_the_study_folder_of_its_pipeline(nightshift_home: Path) -> None:
    path = write_report(small_study(name="s1"), SETTINGS)
    assert path == nightshift_home / "search" / "nightly_retrain" / "s1" / "report.html"
    assert path.read_text().startswith("<!doctype")
    for name in ("..", ".", "a/../../b"):
        assert nightshift_home / "search" / "nightly_retrain" in report_path(name).parents, name
    regression = SearchSettings(space={}, fixed={"task": "regression"}, data="/d", max_epochs=3,
                                pipeline="diabetes_retrain")
    study = optuna.create_study(direction="minimize", study_name="s1")
    page = write_report(study, regression)
    assert page == nightshift_home / "search" / "diabetes_retrain" / "s1" / "report.html"
    assert "Pipeline <b>diabetes_retrain</b>. Objective: <b>val_rmse</b>, minimised." in page.read_text()


@pytest.mark.integration  # an MLflow store of its own: tens of seconds
def test_a_dag_search_without_a_completed_trial_still_writes_its_report(nightshift_home: Path) -> None:
    from nightshift.search import steps, tracking
    from nightshift.search.study import default_storage, open_study

    config = SearchSettings(space={"lr": {"type": "float", "low": 0.01, "high": 0.1}}, data="/d", max_epochs=2)
    storage = default_storage()
    study = open_study(storage, "dag", config)
    experiment_id, parent_run_id = tracking.start_parent("model_search", "dag", storage, config)
    trial = study.ask()
    trial.suggest_float("lr", 0.01, 0.1)
    trial.report(0.3, 1)
    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    search = {"storage": storage, "study": "dag", "run_id": "manual__1", "experiment": "model_search",
              "experiment_id": experiment_id, "parent_run_id": parent_run_id, "budget_hours": None, "slots": [0]}
    with pytest.raises(steps.NoTrialCompleted) as caught:
        steps.finish(search)
    page = nightshift_home / "search" / "nightly_retrain" / "dag" / "report.html"
    assert caught.value.report == str(page) and f"its pictures: {page}" in str(caught.value)
    assert "no trial has completed yet" in page.read_text() and "data-trial='0'" in page.read_text()
