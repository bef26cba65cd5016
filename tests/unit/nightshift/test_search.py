"""Model search pieces: the space and its errors, settings, storage URLs, seeded sampling, stale trials,
the per-epoch reporter with a real ASHA pruner, best.json versions, and the trainer's per-epoch hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest

from nightshift.errors import UsageError
from nightshift.search.best import read_best, write_best
from nightshift.search.errors import SearchSpaceInvalid, StudyMismatch, TrialNotRunning
from nightshift.search.reporter import TrialReporter
from nightshift.search.space import parse_space
from nightshift.search.study import (
    OWNER_ATTR,
    PRUNED_ATTR,
    RANKS_ATTR,
    SearchSettings,
    ask_trial,
    check_storage,
    compute_hours,
    epoch_metrics,
    fail_stale,
    open_study,
    process_owner,
    study_report,
)
from nightshift.train.config import TrainConfig

ISSUE_SPACE = {"lr": {"type": "float", "low": 1e-4, "high": 0.5, "log": True},
               "batch_size": {"type": "categorical", "choices": [16, 64]},
               "momentum": {"type": "float", "low": 0.5, "high": 0.99},
               "model_kwargs.channels": {"type": "int", "low": 16, "high": 64}}


def settings(**overrides: Any) -> SearchSettings:
    values: dict[str, Any] = {"space": {"lr": {"type": "float", "low": 0.01, "high": 0.1}}, "data": "/data",
                              "max_epochs": 4, "reduction_factor": 2, "sampler": "random"}
    return SearchSettings(**{**values, **overrides})


@pytest.fixture
def storage(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'optuna.db'}"


# --- the space -----------------------------------------------------------------------------------


def test_the_issue_example_parses_into_trainer_options() -> None:
    space = parse_space(json.dumps(ISSUE_SPACE), {"model_kwargs.hidden": 32, "threads": 1})
    assert space.keys == ["lr", "batch_size", "momentum", "model_kwargs.channels"]
    options = space.train_options({"lr": 0.1, "batch_size": 16, "momentum": 0.9, "model_kwargs.channels": 20})
    assert options == {"lr": 0.1, "batch_size": 16, "momentum": 0.9, "threads": 1,
                       "model_kwargs": {"hidden": 32, "channels": 20}}
    TrainConfig(data=Path("d"), out=Path("o"), checkpoint_dir=Path("c"), **options)


def test_fixed_model_kwargs_may_be_nested_and_the_space_a_file(tmp_path: Path) -> None:
    path = tmp_path / "space.json"
    path.write_text(json.dumps({"model_kwargs.channels": {"type": "categorical", "choices": [4, 8]}}))
    space = parse_space(f"@{path}", {"model_kwargs": {"hidden": 8}})
    assert space.fixed == {"model_kwargs.hidden": 8}


@pytest.mark.parametrize(("space", "fixed", "fragments"), [
    ("not json", None, ["search space is not JSON"]),
    ("[1, 2]", None, ["must be a JSON object"]),
    ({}, None, ["search space is empty"]),
    ({"lrate": {"type": "float", "low": 0.1, "high": 1}}, None, ["'lrate'", "not a trainer option", "lr,"]),
    ({"epochs": {"type": "int", "low": 1, "high": 3}}, None, ["'epochs'", "not a trainer option"]),
    ({"lr": {"type": "normal", "low": 0.1, "high": 1}}, None, ["'lr'", "'type' must be one of"]),
    ({"lr": 0.1}, None, ["'lr'", "expected an object"]),
    ({"lr": {"type": "float", "low": 0.1, "high": 1, "scale": 2}}, None, ["'lr'", "unknown field(s) scale"]),
    ({"lr": {"type": "float", "high": 1}}, None, ["'lr'", "'low' is missing"]),
    ({"lr": {"type": "float", "low": 1, "high": 0.1}}, None, ["'lr'", "above high"]),
    ({"lr": {"type": "float", "low": 0, "high": 1, "log": True}}, None, ["'lr'", "log scale needs low > 0"]),
    ({"lr": {"type": "float", "low": 0.1, "high": 1, "log": True, "step": 0.1}}, None, ["'lr'", "together"]),
    ({"lr": {"type": "float", "low": "a", "high": 1}}, None, ["'lr'", "'low' must be a finite number"]),
    ({"batch_size": {"type": "float", "low": 8, "high": 64}}, None, ["'batch_size'", "takes an integer"]),
    ({"batch_size": {"type": "int", "low": 8.5, "high": 64}}, None, ["'batch_size'", "must be an integer"]),
    ({"batch_size": {"type": "categorical", "choices": []}}, None, ["'batch_size'", "non-empty list"]),
    ({"batch_size": {"type": "categorical", "choices": [16, 16]}}, None, ["'batch_size'", "repeats"]),
    ({"batch_size": {"type": "categorical", "choices": [[16]]}}, None, ["'batch_size'", "is not null"]),
    ({"precision": {"type": "int", "low": 1, "high": 2}}, None, ["'precision'", "categorical"]),
    ({"precision": {"type": "categorical", "choices": ["fp32", "fp8"]}}, None, ["'precision'", "fp8"]),
    ({"momentum": {"type": "float", "low": 0.5, "high": 1.5}}, None, ["'momentum'", "--momentum must be in [0, 1)"]),
    ({"batch_size": {"type": "int", "low": 0, "high": 8}}, None, ["'batch_size'", "positive integer"]),
    ({"model_kwargs.chanels": {"type": "int", "low": 4, "high": 8}}, None,
     ["'model_kwargs.chanels'", "no argument 'chanels'", "channels, hidden"]),
    ({"model_kwargs.num_classes": {"type": "int", "low": 4, "high": 8}}, None, ["'model_kwargs.num_classes'"]),
    ({"model": {"type": "categorical", "choices": ["digits_cnn", "mlp"]},
      "model_kwargs.channels": {"type": "int", "low": 4, "high": 8}}, None, ["model 'mlp' takes no argument"]),
    ({"model": {"type": "categorical", "choices": ["nope"]}}, None, ["'model'", "unknown model 'nope'"]),
    ({"lr": {"type": "float", "low": 0.01, "high": 0.1}}, {"lr": 0.1}, ["'lr' is both searched and fixed"]),
    ({"lr": {"type": "float", "low": 0.01, "high": 0.1}}, {"epochs": 3}, ["fixed option 'epochs'"]),
    ({"lr": {"type": "float", "low": 0.01, "high": 0.1}}, {"threads": -1}, ["fixed option 'threads'", "--threads"]),
    ({"lr": {"type": "float", "low": 0.01, "high": 0.1}}, {"momentum": "x"}, ["fixed option 'momentum'"]),
])
def test_a_bad_space_is_refused_naming_the_key(space: Any, fixed: Any, fragments: list[str]) -> None:
    with pytest.raises(SearchSpaceInvalid) as caught:
        parse_space(space, fixed)
    for fragment in fragments:
        assert fragment in str(caught.value)


# --- settings, storage, studies ----------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "fragment"), [
    ({"max_epochs": 0}, "--max-epochs"), ({"min_epochs": 5}, "must not exceed --max-epochs"),
    ({"reduction_factor": 1}, "--reduction-factor"), ({"pruner": "median"}, "--pruner"),
    ({"sampler": "grid"}, "--sampler"),
])
def test_settings_are_checked(overrides: dict[str, Any], fragment: str) -> None:
    with pytest.raises(UsageError, match=fragment):
        settings(**overrides)


def test_the_default_study_name_follows_the_settings() -> None:
    assert settings().default_study_name() == settings().default_study_name()
    assert settings().default_study_name() != settings(seed=1).default_study_name()


@pytest.mark.parametrize(("url", "fragment"), [("postgresql://me:secret@db/optuna", "password"),
                                               ("redis://localhost", "not a database URL")])
def test_storage_urls_with_a_password_or_not_a_database_are_refused(url: str, fragment: str) -> None:
    with pytest.raises(UsageError, match=fragment):
        check_storage(url)
    assert check_storage("postgresql+psycopg://me@db:5432/optuna")


def test_a_study_is_not_continued_with_other_settings(storage: str) -> None:
    open_study(storage, "s", settings())
    open_study(storage, "s", settings())  # the same settings continue it
    with pytest.raises(StudyMismatch, match=r"max_epochs, seed"):
        open_study(storage, "s", settings(max_epochs=5, seed=3))


def test_sampling_depends_on_seed_and_trial_number_not_on_the_process(storage: str, tmp_path: Path) -> None:
    config = settings(space=ISSUE_SPACE)
    space = parse_space(config.space)
    first = open_study(storage, "a", config)
    drawn = [ask_trial(first, space, config, owner={})[1] for _ in range(3)]
    # Another process opening another study with the same settings asks trial 1 first: it gets trial 1's values.
    other = open_study(f"sqlite:///{tmp_path / 'other.db'}", "b", config)
    ask_trial(other, space, config, owner={})
    assert ask_trial(other, space, config, owner={})[1] == drawn[1]
    assert drawn[0] != drawn[1]


def test_a_trial_whose_process_is_gone_is_marked_fail(storage: str) -> None:
    config = settings()
    space = parse_space(config.space)
    study = open_study(storage, "s", config)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    gone = {**process_owner(), "pid": int(dead.stdout), "start": 1}
    ask_trial(study, space, config, owner=gone)
    ask_trial(study, space, config, owner=process_owner())  # ours, alive: left alone
    ask_trial(study, space, config, owner={"kind": "airflow", "run_id": "r"})  # its DAG run finalises it
    assert fail_stale(study) == [0]
    states = [t["state"] for t in study_report(study, config)["trials"]]
    assert states == ["FAIL", "RUNNING", "RUNNING"]
    assert "ended without telling the study" in study_report(study, config)["trials"][0]["error"]


# --- the reporter with a real pruner ------------------------------------------------------------


def test_the_reporter_records_epochs_and_asha_prunes_a_worse_trial_at_its_rung(storage: str) -> None:
    config = settings(max_epochs=4, min_epochs=1, reduction_factor=2)
    space = parse_space(config.space)
    study = open_study(storage, "s", config)
    good, _ = ask_trial(study, space, config, owner={})
    report_good = TrialReporter(good, config.max_epochs)
    assert [report_good(e, {"val_accuracy": 0.5 + e / 10, "val_loss": 1.0}) for e in (1, 2, 3, 4)] == [False] * 4
    study.tell(good, 0.9)
    bad, _ = ask_trial(study, space, config, owner={})
    assert TrialReporter(bad, config.max_epochs)(1, {"val_accuracy": 0.1}) is True  # below the rung-0 cut
    frozen = study.get_trials()[1]
    assert frozen.state.name == "RUNNING", "the reporter never tells: whoever runs the trial does"
    assert frozen.user_attrs[PRUNED_ATTR] == 1 and frozen.intermediate_values == {1: 0.1}
    assert epoch_metrics(study.get_trials()[0])[4] == {"val_accuracy": 0.9, "val_loss": 1.0}


def test_the_reporter_never_prunes_at_the_last_epoch(storage: str) -> None:
    config = settings(max_epochs=1, min_epochs=1, reduction_factor=2)
    space = parse_space(config.space)
    study = open_study(storage, "s", config)
    first, _ = ask_trial(study, space, config, owner={})
    TrialReporter(first, 1)(1, {"val_accuracy": 0.9})
    study.tell(first, 0.9)
    second, _ = ask_trial(study, space, config, owner={})
    assert TrialReporter(second, 1)(1, {"val_accuracy": 0.1}) is False


def test_a_trainer_reporting_by_storage_must_match_the_search(storage: str, tmp_path: Path) -> None:
    config = settings(max_epochs=3)
    study = open_study(storage, "s", config)
    trial, _ = ask_trial(study, parse_space(config.space), config, owner={})

    def hook(epochs: int, number: int) -> Any:
        train = TrainConfig(data=tmp_path, out=tmp_path, checkpoint_dir=tmp_path, epochs=epochs,
                            search_storage=storage, search_study="s", search_trial=number)
        return TrialReporter.for_config(train)

    with pytest.raises(TrialNotRunning, match="trains for 3 epochs"):
        hook(5, 0)(1, {"val_accuracy": 0.5})
    with pytest.raises(TrialNotRunning, match="does not exist"):
        hook(3, 7)(1, {"val_accuracy": 0.5})
    assert hook(3, 0)(1, {"val_accuracy": 0.5}) is False
    study.tell(trial, 0.5)
    with pytest.raises(TrialNotRunning, match="is COMPLETE, not RUNNING"):
        hook(3, 0)(2, {"val_accuracy": 0.5})


def test_the_search_flags_of_the_trainer_go_together() -> None:
    with pytest.raises(UsageError, match="missing --search-study, --search-trial"):
        TrainConfig(data=Path("d"), out=Path("o"), checkpoint_dir=Path("c"), search_storage="sqlite:///x.db")
    plain = TrainConfig(data=Path("d"), out=Path("o"), checkpoint_dir=Path("c"), search_storage="sqlite:///x.db",
                        search_study="s", search_trial=0)
    assert "search_storage" not in plain.params(), "where to report is no hyperparameter"


# --- budget and best.json ------------------------------------------------------------------------------


def test_compute_hours_count_each_trial_times_its_ranks(storage: str) -> None:
    from datetime import timedelta

    config = settings()
    study = open_study(storage, "s", config)
    ask_trial(study, parse_space(config.space), config, owner={}, ranks=4)
    frozen = study.get_trials()[0]
    assert frozen.user_attrs[RANKS_ATTR] == 4 and OWNER_ATTR in frozen.user_attrs
    assert frozen.datetime_start is not None
    hours = compute_hours([frozen], now=frozen.datetime_start + timedelta(minutes=30))
    assert hours == pytest.approx(2.0)


def test_best_json_is_versioned_and_unchanged_by_a_rewrite(tmp_path: Path) -> None:
    path = tmp_path / "search" / "best.json"
    first = write_best({"study": "s", "trial": 1, "value": 0.9}, path)
    assert first["version"] == 1 and read_best(path) == first
    assert write_best({"study": "s", "trial": 1, "value": 0.9}, path)["version"] == 1
    second = write_best({"study": "t", "trial": 4, "value": 0.8}, path)
    assert second["version"] == 2 and read_best(path)["study"] == "t"  # type: ignore[index]
    assert json.loads((path.parent / "best-v1.json").read_text())["study"] == "s"
    assert sorted(p.name for p in path.parent.glob("best*")) == ["best-v1.json", "best-v2.json", "best.json"]


def test_a_search_finishing_beside_another_never_writes_over_its_version(tmp_path: Path) -> None:
    """Another search of the pipeline wrote best-v2.json and has not yet replaced best.json (v1): this one's
    best is v3, and v2 stays the other search's."""
    path = tmp_path / "search" / "best.json"
    write_best({"study": "s", "trial": 1, "value": 0.9}, path)
    other = {"study": "other", "trial": 2, "value": 0.95, "version": 2, "written_at": "then"}
    (path.parent / "best-v2.json").write_text(json.dumps(other))
    mine = write_best({"study": "mine", "trial": 7, "value": 0.8}, path)
    assert mine["version"] == 3 and read_best(path) == mine
    assert json.loads((path.parent / "best-v2.json").read_text()) == other


# --- the trainer's per-epoch hook ----------------------------------------------------------------


@pytest.fixture(scope="module")
def hvd() -> Any:
    import horovod.torch as hvd

    hvd.init()
    return hvd


def fit(demo_data: Path, tmp_path: Path, hvd: Any, on_epoch: Any, epochs: int = 3) -> dict[str, Any]:
    from nightshift.datasets import load_split
    from nightshift.train.trainer import Trainer

    config = TrainConfig(data=demo_data, out=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt", model="mlp",
                         model_kwargs={"hidden": 8}, epochs=epochs, threads=1, checkpoint_every=1000)
    train, validation = load_split("digits", demo_data, "train"), load_split("digits", demo_data, "validation")
    return Trainer(config, train, validation, hvd, on_epoch=on_epoch).fit()


def test_the_trainer_stops_after_the_epoch_its_hook_asks_checkpointed(demo_data: Path, tmp_path: Path,
                                                                      hvd: Any) -> None:
    from nightshift.train.checkpoint import CheckpointStore

    seen: list[tuple[int, float]] = []

    def hook(epoch: int, metrics: dict[str, float]) -> bool:
        seen.append((epoch, metrics["val_accuracy"]))
        return epoch == 2

    summary = fit(demo_data, tmp_path, hvd, hook, epochs=3)
    assert [e for e, _ in seen] == [1, 2]
    assert summary["stopped_at_epoch"] == 2 and summary["steps_run"] == 2 * summary["steps"] // 3
    assert summary["val_accuracy"] == seen[-1][1]
    assert [c.step for c in CheckpointStore(tmp_path / "ckpt").files()] == [summary["steps_run"]]
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["stopped_at_epoch"] == 2
    assert (tmp_path / "out" / "model.pt").is_file()


def test_a_hook_that_is_never_stopping_changes_nothing_and_a_failing_one_stops_the_run(
        demo_data: Path, tmp_path: Path, hvd: Any) -> None:
    from nightshift.train.trainer import EpochHookFailed

    summary = fit(demo_data, tmp_path / "a", hvd, lambda epoch, metrics: True, epochs=1)
    assert "stopped_at_epoch" not in summary, "asking to stop after the last epoch is no early stop"

    def broken(epoch: int, metrics: dict[str, float]) -> bool:
        raise ConnectionError("database went away")

    with pytest.raises(EpochHookFailed, match="after epoch 1: ConnectionError: database went away"):
        fit(demo_data, tmp_path / "b", hvd, broken, epochs=2)


def test_optuna_is_pinned_in_the_project() -> None:
    constraints = (Path(__file__).resolve().parents[3] / "constraints.txt").read_text().splitlines()
    assert f"optuna=={optuna.__version__}" in constraints
    assert os.environ.get("NIGHTSHIFT_HOME"), "the autouse fixture isolates NIGHTSHIFT_HOME"


# --- the DAG's ask step (no Airflow needed) --------------------------------------------------------


def dag_search(storage: str, config: SearchSettings, **overrides: Any) -> dict[str, Any]:
    open_study(storage, "dag", config)
    return {"storage": storage, "study": "dag", "run_id": "manual__1", "max_concurrent_trials": 2, "ranks": 1,
            "budget_hours": None, "data": "/data", "device": "cpu", "experiment": "model_search",
            "parent_run_id": "p", **overrides}


def test_a_slot_asks_once_waits_for_room_and_builds_the_trainer_command(storage: str) -> None:
    import shlex

    from nightshift.search import steps

    config = settings(space={"lr": {"type": "float", "low": 0.01, "high": 0.1},
                             "model_kwargs.channels": {"type": "int", "low": 2, "high": 4}},
                      fixed={"model_kwargs.hidden": 8, "threads": 1})
    search = dag_search(storage, config)
    first = steps.ask(search, map_index=0)
    assert first is not None and steps.ask(search, map_index=0) == first, "a retried slot gets its trial back"
    assert steps.ask(search, map_index=1) is not None
    assert steps.ask(search, map_index=2) is None, "two trials run: the third slot waits"
    command = shlex.split(first["command"])
    assert command[:3] == ["python", "-m", "nightshift.train"]
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    assert flags["--search-study"] == "dag" and flags["--search-trial"] == "0" and flags["--epochs"] == "4"
    assert json.loads(flags["--model-kwargs"]) == {"channels": first["params"]["model_kwargs.channels"], "hidden": 8}
    assert float(flags["--lr"]) == first["params"]["lr"] and flags["--threads"] == "1"
    assert f"nightshift.run_key={first['run_key']}" in command and "mlflow.parentRunId=p" in command


def test_no_slot_starts_a_trial_once_the_budget_is_spent(storage: str) -> None:
    from nightshift.search import steps

    config = settings()
    search = dag_search(storage, config, budget_hours=1e-9)
    assert steps.ask(search, map_index=0) is not None  # nothing spent yet
    with pytest.raises(steps.BudgetSpent, match="budget of 1e-09 hours is spent"):
        steps.ask(search, map_index=1)


def test_hyperband_opened_by_name_prunes_like_the_process_that_created_it(storage: str) -> None:
    """A trainer process opens the study by name: the pruner it builds from the stored settings must
    decide as the creating process's would (Hyperband assigns brackets by study name and trial number)."""
    from nightshift.search.study import load_study

    config = settings(pruner="hyperband", max_epochs=8, min_epochs=1, reduction_factor=2)
    space = parse_space(config.space)
    study = open_study(storage, "hb", config)
    answers = []
    for number in range(8):
        trial, _ = ask_trial(study, space, config, owner={})
        opened, _ = load_study(storage, "hb")
        by_name = TrialReporter(optuna.trial.Trial(opened, trial._trial_id), config.max_epochs)
        value = 0.9 if number == 0 else 0.1 + number / 100
        pruned = next((e for e in range(1, 9) if by_name(e, {"val_accuracy": value})), None)
        answers.append(pruned)
        if pruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, value)
    assert answers[0] is None and any(answers[1:]), answers
    assert [t.state.name for t in study.get_trials()].count("PRUNED") == sum(a is not None for a in answers)


def test_a_sqlite_folder_is_created_and_an_unusable_storage_is_one_line(tmp_path: Path) -> None:
    study = open_study(f"sqlite:///{tmp_path / 'new' / 'folder' / 'optuna.db'}", "s", settings())
    assert study.study_name == "s" and (tmp_path / "new" / "folder" / "optuna.db").is_file()
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(UsageError, match=r"cannot use the study storage sqlite:///.*: cannot create"):
        open_study(f"sqlite:///{tmp_path / 'file' / 'optuna.db'}", "s", settings())


# --- one pipeline's search: what it trains, what it optimises, where it writes -----------------------


@pytest.fixture
def diabetes(digits_pipeline: Any) -> Any:
    """A user's regression pipeline (as tests/integration/test_user_pipelines.py declares it)."""
    from dataclasses import replace

    from nightshift.pipelines import GateSpec, ModelSpec
    from nightshift.pipelines.spec import frozen

    return replace(digits_pipeline, dag_id="diabetes_retrain", model_name="diabetes-regressor", task="regression",
                   dataset=replace(digits_pipeline.dataset, loader="tabular", label="progression",
                                   options=frozen({"sep": ","})),
                   model=ModelSpec(name="mlp", kwargs=frozen({"hidden": 16})),
                   gate=GateSpec(primary="rmse", floor=100.0))


def test_a_regression_search_minimises_val_rmse(storage: str) -> None:
    config = settings(fixed={"task": "regression"}, pipeline="diabetes_retrain", max_epochs=2)
    assert (config.objective, config.direction) == ("val_rmse", "minimize")
    assert (settings().objective, settings().direction) == ("val_accuracy", "maximize")
    study = open_study(storage, "rmse", config)
    assert study.direction == optuna.study.StudyDirection.MINIMIZE
    space = parse_space(config.space, config.fixed)
    for rmse in (60.0, 40.0):
        trial, _ = ask_trial(study, space, config, owner={})
        reporter = TrialReporter(trial, config.max_epochs, config.objective)
        assert [reporter(e, {"val_rmse": rmse + 10 / e, "val_loss": 1.0}) for e in (1, 2)] == [False, False]
        study.tell(trial, rmse + 5)
    report = study_report(study, config)
    assert (report["best"]["trial"], report["objective"], report["direction"]) == (1, "val_rmse", "minimize")
    with pytest.raises(ValueError, match="epoch 1 has no val_rmse to report"):
        TrialReporter(ask_trial(study, space, config, owner={})[0], 2, config.objective)(1, {"val_accuracy": 0.5})
    with pytest.raises(StudyMismatch, match="fixed, pipeline"):  # a classification search of the same name
        open_study(storage, "rmse", settings(max_epochs=2))


def test_a_pipelines_search_trains_what_its_declaration_says(diabetes: Any) -> None:
    from nightshift.search.pipeline import fixed_options

    lr = {"lr": {"type": "float", "low": 0.01, "high": 0.1}}
    declared = {"dataset": "tabular", "dataset_options": {"sep": ",", "label": "progression"}, "task": "regression",
                "model": "mlp", "model_kwargs.hidden": 16}
    assert fixed_options(diabetes, lr, {"threads": 1}) == {**declared, "threads": 1}
    wider = fixed_options(diabetes, {**lr, "model_kwargs.hidden": {"type": "int", "low": 8, "high": 64}}, {})
    assert "model_kwargs.hidden" not in wider, "a searched model argument replaces the declared one"
    other = fixed_options(diabetes, lr, {"model": "digits_cnn", "model_kwargs": {"channels": 4}})
    assert (other["model"], other["model_kwargs.channels"], "model_kwargs.hidden" in other) == ("digits_cnn", 4, False)
    digits = {"dataset": {"type": "categorical", "choices": ["digits"]}}
    for space, fixed, key in ((lr, {"task": "binary"}, "task"), ({**lr, **digits}, {}, "dataset"),
                              (lr, {"dataset_options": {}}, "dataset_options")):
        with pytest.raises(SearchSpaceInvalid, match=f"'{key}' is .* declares it for pipeline diabetes_retrain"):
            fixed_options(diabetes, space, fixed)


def test_a_pipelines_trials_train_its_task_and_data_in_its_folder(storage: str, diabetes: Any,
                                                                 nightshift_home: Path) -> None:
    import shlex

    from nightshift.search import steps
    from nightshift.search.pipeline import fixed_options

    space = {"lr": {"type": "float", "low": 0.01, "high": 0.1}}
    config = settings(space=space, fixed=fixed_options(diabetes, space, {}), pipeline="diabetes_retrain")
    first = steps.ask(dag_search(storage, config), map_index=0)
    assert first is not None
    command = shlex.split(first["command"])
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    assert (flags["--task"], flags["--dataset"], flags["--model"]) == ("regression", "tabular", "mlp")
    assert json.loads(flags["--dataset-options"]) == {"label": "progression", "sep": ","}
    assert json.loads(flags["--model-kwargs"]) == {"hidden": 16}
    assert Path(flags["--out"]) == nightshift_home / "search" / "diabetes_retrain" / "dag" / "trial-0" / "out"
    TrainConfig(data=Path("d"), out=Path("o"), checkpoint_dir=Path("c"),
                **parse_space(config.space, config.fixed).train_options(first["params"]))


def test_two_pipelines_never_share_a_study_folder_or_a_study(storage: str, nightshift_home: Path) -> None:
    from nightshift.search.report_html import report_path
    from nightshift.search.study import study_dir

    assert study_dir("s", "cancer_retrain") == nightshift_home / "search" / "cancer_retrain" / "s"
    assert report_path("s", "diabetes_retrain") == nightshift_home / "search" / "diabetes_retrain" / "s" / "report.html"
    assert study_dir("s") == nightshift_home / "search" / "nightly_retrain" / "s", "no pipeline: the demo's"
    assert settings(pipeline="a").default_study_name() != settings(pipeline="b").default_study_name()
    open_study(storage, "shared", settings(pipeline="cancer_retrain"))
    with pytest.raises(StudyMismatch, match=r"\(pipeline differ\)"):
        open_study(storage, "shared", settings(pipeline="diabetes_retrain"))
    for bad in ("best.json", "best-v3.json"):
        with pytest.raises(UsageError, match="name of the pipeline's best configuration file"):
            study_dir(bad, "cancer_retrain")
    for taken in ("optuna.db", "locks", "best.json", ""):
        with pytest.raises(UsageError):
            settings(pipeline=taken)


def test_a_study_stored_before_searches_had_a_pipeline_continues_as_nightly_retrains(storage: str) -> None:
    from nightshift.search.study import SETTINGS_ATTR, load_study

    study = open_study(storage, "old", settings())
    stored = {k: v for k, v in settings().to_json().items() if k != "pipeline"}
    study.set_user_attr(SETTINGS_ATTR, stored)  # as an older Nightshift stored it
    open_study(storage, "old", settings())
    assert load_study(storage, "old")[1].pipeline == "nightly_retrain"


def test_the_cli_searches_for_the_pipeline_it_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from nightshift.cli import main
    from nightshift.search import runner
    from tests.conftest import DIGITS_YAML

    asked: list[Any] = []
    monkeypatch.setattr(runner, "run_search", lambda request: asked.append(request) or {})
    declaration = yaml.safe_load(DIGITS_YAML.read_text())
    declaration.update(dag_id="diabetes_retrain", model_name="diabetes-regressor", task="regression",
                       gate={"primary": "rmse", "floor": 100.0}, model={"name": "mlp", "kwargs": {"hidden": 16}})
    declaration["dataset"].update(loader="tabular", label="progression", asset="diabetes")
    path = tmp_path / "diabetes.yaml"
    path.write_text(yaml.safe_dump(declaration))
    search = ["search", "--data", str(tmp_path), "--trials", "2", "--max-epochs", "2",
              "--space", '{"lr": {"type": "float", "low": 0.01, "high": 0.1}}']
    assert main([*search, "--pipeline", str(path)]) == 0 and main(search) == 0
    mine, default = (request.settings for request in asked)
    assert (mine.pipeline, mine.objective, mine.direction) == ("diabetes_retrain", "val_rmse", "minimize")
    assert mine.fixed == {"dataset": "tabular", "dataset_options": {"label": "progression"}, "task": "regression",
                          "model": "mlp", "model_kwargs.hidden": 16}
    assert mine.declared == {"dataset": "tabular", "dataset_options": {"label": "progression"}, "task": "regression",
                             "model": "mlp", "model_kwargs": {"hidden": 16}}, "best.json records the declaration"
    assert (default.pipeline, default.objective, default.fixed) == ("nightly_retrain", "val_accuracy", {})
    assert default.declared is None
    capsys.readouterr()
    assert main([*search, "--pipeline", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: (top level): cannot be read" in capsys.readouterr().err


def test_best_json_records_the_declaration_its_search_trained(storage: str, diabetes: Any, nightshift_home: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """So that the pipeline's training, once its declaration changed, no longer takes that search's model."""
    from nightshift.search import runner, steps
    from nightshift.search.best import best_path, training_defaults
    from nightshift.search.pipeline import declared_training

    opened: list[SearchSettings] = []
    monkeypatch.setattr(steps, "open_search", lambda config, **_: opened.append(config) or (_ for _ in ()).throw(
        UsageError("stop here")))
    params = {"space": {"lr": {"type": "float", "low": 0.01, "high": 0.1}}, "max_epochs": 2, "min_epochs": 1,
              "reduction_factor": 2}
    with pytest.raises(UsageError, match="stop here"):
        steps.prepare(params, pipeline=diabetes, data=Path("/d"), dag_id="diabetes_retrain__search", run_id="r",
                      storage=storage)
    config = opened[0]
    assert config.declared == declared_training(diabetes)
    study = open_study(storage, "done", config)
    trial, _ = ask_trial(study, parse_space(config.space, config.fixed), config, owner={})
    study.tell(trial, 50.0)
    monkeypatch.setattr(runner.tracking, "find_trial_run", lambda *_: "t")
    monkeypatch.setattr(runner.tracking, "finish_parent", lambda *_: None)
    monkeypatch.setattr(runner, "write_report", lambda *_: nightshift_home / "report.html")
    ctx = runner.SearchContext(settings=config, space=parse_space(config.space, config.fixed), study=study,
                               storage=storage, experiment="e", experiment_id="1", parent_run_id="p")
    runner.finish_search(ctx)
    assert read_best(best_path("diabetes_retrain"))["declared"] == declared_training(diabetes)
    unset = {"learning_rate": None, "batch_size": None, "momentum": None, "model_kwargs": None}
    assert training_defaults(unset, pipeline="diabetes_retrain", dataset="tabular",
                             declared=declared_training(diabetes))["sources"]["lr"] == "best.json"
    moved = {**declared_training(diabetes), "dataset_options": {"label": "age", "sep": ","}}
    resolved = training_defaults(unset, pipeline="diabetes_retrain", dataset="tabular", declared=moved)
    assert resolved["sources"]["lr"] == "built-in" and "(dataset_options {" in resolved["summary"]
