"""The steps of a pipeline's search DAG (`model_search` for nightly_retrain, nightly_tasks.search) as plain
functions (no Airflow): prepare, ask, tell, finish.

`prepare` takes what the pipeline's declaration fixes (data loader and options, task, model, objective:
`nightshift.search.pipeline`), checks the space and opens the study and the MLflow parent run; each trial
slot then `ask`s the study for a trial (ask-and-tell through the storage; an identical retry gets the same trial back),
a `HorovodKubernetesOperator` runs `trial_command` (the trainer reporting to the trial by
`--search-*`), and `tell` gives the study the outcome: COMPLETE with the last epoch's objective
(val_accuracy, val_rmse), PRUNED when the trainer stopped at a rung, FAIL when the training task failed.
`finish` fails what a dead task left RUNNING, writes the pipeline's best.json and the report page and ends
the parent run. The DAG turns `BudgetSpent` and a pruned trial into skipped tasks.
"""

from __future__ import annotations

import fcntl
import logging
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nightshift import settings as nightshift_settings
from nightshift.errors import NightshiftError
from nightshift.search import tracking
from nightshift.search.pipeline import declared_training, fixed_options, objective_note
from nightshift.search.runner import SearchContext, budget_report, finish_search, open_search, trial_dir
from nightshift.search.space import load_json_object, parse_space
from nightshift.search.study import (
    OWNER_ATTR,
    PRUNED_ATTR,
    SearchSettings,
    ask_trial,
    compute_hours,
    fail_trial,
    load_study,
    trial_summary,
)

if TYPE_CHECKING:
    from nightshift.pipelines import Pipeline

log = logging.getLogger("nightshift.search")

# Trainer options as `python -m nightshift.train` flags (model_kwargs and dataset_options go as one JSON object).
FLAGS = {"lr": "--lr", "batch_size": "--batch-size", "momentum": "--momentum", "seed": "--seed", "model": "--model",
         "precision": "--precision", "compression": "--compression", "dataset": "--dataset", "threads": "--threads",
         "device": "--device", "checkpoint_every": "--checkpoint-every", "keep_checkpoints": "--keep-checkpoints",
         "log_every": "--log-every", "task": "--task", "dataset_options": "--dataset-options"}


class BudgetSpent(NightshiftError):
    """The search's compute budget is spent: no new trial starts."""


class NoTrialCompleted(NightshiftError):
    """A search ended without one COMPLETE trial, so there is no best configuration."""

    def __init__(self, message: str, report: str | None = None) -> None:
        super().__init__(message)
        self.report = report  # the search's report page, written all the same


def default_study_name(dag_id: str, run_id: str) -> str:
    from nightshift.fsutil import safe_name

    return f"{dag_id}__{safe_name(run_id)}"


def prepare(params: dict[str, Any], *, pipeline: Pipeline, data: Path, dag_id: str, run_id: str,
            storage: str | None) -> dict[str, Any]:
    """Check the search of `pipeline` (space, options, `data`: the run's data directory, resolved and confined
    by the DAG as its training's), open its study and parent run (MLflow experiment: the search DAG's id, `dag_id`);
    what every trial needs."""
    space = load_json_object(params["space"], "search space")
    settings = SearchSettings(
        space=space, fixed=fixed_options(pipeline, space, load_json_object(params.get("fixed") or {}, "fixed options")),
        data=str(data), max_epochs=int(params["max_epochs"]), min_epochs=int(params["min_epochs"]),
        reduction_factor=int(params["reduction_factor"]), pruner=str(params.get("pruner", "asha")),
        sampler=str(params.get("sampler", "tpe")), seed=int(params.get("seed", 0)), pipeline=pipeline.dag_id,
        declared=declared_training(pipeline))
    note = objective_note(pipeline)
    if note:
        log.warning("%s", note)
    study = params.get("study") or default_study_name(dag_id, run_id)
    ctx = open_search(settings, storage=storage, study=study, experiment=dag_id)
    gpus = int(params.get("gpus_per_worker", 0))
    budget = params.get("budget_hours")
    return {
        "study": ctx.study.study_name, "storage": ctx.storage, "experiment": ctx.experiment,
        "experiment_id": ctx.experiment_id, "parent_run_id": ctx.parent_run_id, "data": str(data),
        "slots": list(range(int(params["n_trials"]))), "max_concurrent_trials": int(params["max_concurrent_trials"]),
        "budget_hours": float(budget) if budget else None, "ranks": int(params.get("workers", 1)) * max(gpus, 1),
        "device": "cuda" if gpus > 0 else "cpu", "run_id": run_id,
    }


@contextmanager
def _study_lock(study: str) -> Iterator[None]:
    """Serialise asks of one study across tasks sharing NIGHTSHIFT_HOME (count running, then ask)."""
    path = nightshift_settings.home() / "search" / "locks" / f"{study.replace('/', '_')}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ask(search: dict[str, Any], *, map_index: int) -> dict[str, Any] | None:
    """Trial slot `map_index`'s trial and its trainer command; None while `max_concurrent_trials` trials
    run. BudgetSpent when the budget is spent. A slot that already asked gets its trial back."""
    study, settings = load_study(search["storage"], search["study"])
    space = parse_space(settings.space, settings.fixed)
    owner = {"kind": "airflow", "run_id": search["run_id"], "map_index": map_index}
    with _study_lock(search["study"]):
        trials = study.get_trials(deepcopy=False)
        mine = [t for t in trials if t.user_attrs.get(OWNER_ATTR) == owner]
        if mine:
            number, params = mine[0].number, mine[0].params
        else:
            budget = search.get("budget_hours")
            used = compute_hours(trials)
            if budget and used >= budget:
                raise BudgetSpent(f"the budget of {budget} hours is spent ({used:.4f} used): trial slot "
                                  f"{map_index} starts no trial")
            if sum(t.state.name == "RUNNING" for t in trials) >= search["max_concurrent_trials"]:
                return None
            trial, params = ask_trial(study, space, settings, owner=owner, ranks=search["ranks"])
            number = trial.number
    command = trial_command(search, settings, number, space.train_options(params))
    return {"number": number, "params": params, "command": shlex.join(command),
            "run_key": tracking.trial_key(search["study"], number)}


def trial_command(search: dict[str, Any], settings: SearchSettings, number: int,
                  options: dict[str, Any]) -> list[str]:
    """The trainer command of trial `number` (the operator adds --checkpoint-dir, kept across retries)."""
    study = search["study"]
    command = ["python", "-m", "nightshift.train", "--data", search["data"],
               "--out", str(trial_dir(study, number, settings.pipeline) / "out"), "--epochs", str(settings.max_epochs),
               "--device", search["device"]]
    for key, value in options.items():
        if key == "model_kwargs":
            command += ["--model-kwargs", _json(value)]
        elif isinstance(value, dict):
            command += [FLAGS[key], _json(value)]
        elif key == "device":
            command[command.index("--device") + 1] = str(value)
        else:
            command += [FLAGS[key], str(value)]
    tags = {"nightshift.run_key": tracking.trial_key(study, number), tracking.PARENT_TAG: search["parent_run_id"],
            tracking.STUDY_TAG: study, tracking.TRIAL_TAG: str(number), tracking.ROLE_TAG: "trial"}
    command += ["--mlflow-experiment", search["experiment"], "--mlflow-run-name", f"{study}/trial-{number}"]
    for key, value in tags.items():
        command += ["--tag", f"{key}={value}"]
    command += ["--search-storage", search["storage"], "--search-study", study, "--search-trial", str(number)]
    return command


def _json(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True)


def tell(search: dict[str, Any], asked: dict[str, Any], trained: dict[str, Any] | None) -> dict[str, Any]:
    """Tell the study how trial `asked["number"]` ended (`trained`: the training task's result, None when
    it did not succeed) and log its MLflow child run; the trial's summary."""
    import optuna

    study, settings = load_study(search["storage"], search["study"])
    number = int(asked["number"])
    frozen = study.get_trials(deepcopy=False)[number]
    if not frozen.state.is_finished():
        if frozen.user_attrs.get(PRUNED_ATTR) is not None:
            study.tell(number, state=optuna.trial.TrialState.PRUNED)
        elif trained is None:
            fail_trial(study, number, "its training task failed (see the task's log)")
        elif settings.max_epochs in frozen.intermediate_values:
            study.tell(number, frozen.intermediate_values[settings.max_epochs])
        else:
            fail_trial(study, number, f"training succeeded but reported no {settings.objective} for epoch "
                                      f"{settings.max_epochs}")
    frozen = study.get_trials(deepcopy=False)[number]
    tracking.log_trial(search["experiment_id"], search["parent_run_id"], search["study"], frozen, settings.fixed,
                       settings.objective)
    return trial_summary(frozen)


def finish(search: dict[str, Any]) -> dict[str, Any]:
    """Fail the trials this run left RUNNING, then report, write best.json and end the parent run."""
    study, settings = load_study(search["storage"], search["study"])
    for trial in study.get_trials(deepcopy=False):
        owner = trial.user_attrs.get(OWNER_ATTR) or {}
        if trial.state.name == "RUNNING" and owner.get("run_id") == search["run_id"]:
            fail_trial(study, trial.number, "its DAG run ended without telling the study")
            tracking.log_trial(search["experiment_id"], search["parent_run_id"], search["study"],
                               study.get_trials(deepcopy=False)[trial.number], settings.fixed, settings.objective)
    ctx = SearchContext(settings=settings, space=parse_space(settings.space, settings.fixed), study=study,
                        storage=search["storage"], experiment=search["experiment"],
                        experiment_id=search["experiment_id"], parent_run_id=search["parent_run_id"])
    report = finish_search(ctx, budget_report(study, search.get("budget_hours"), len(search["slots"])))
    if report["best"] is None:
        raise NoTrialCompleted(f"study {search['study']}: no trial completed "
                               f"({', '.join(t['state'] for t in report['trials']) or 'none started'}); "
                               f"its pictures: {report['report']}", report=report["report"])
    return report

