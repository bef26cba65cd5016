"""MLflow runs of a search: one parent run per study, one child run per trial (params, curves, state).

Both are found again by their `nightshift.run_key` tag (`search/<study>` and `search/<study>/<number>`),
so running a search again, or telling a trial twice, updates the runs instead of adding copies. A trial
whose trainer logged its own run with that key (a DAG trial, `--mlflow-experiment`) gets the search's
tags and state on that run.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from nightshift.search.study import SearchSettings, epoch_metrics
from nightshift.tracking import RUN_KEY_TAG, client, ensure_experiment

if TYPE_CHECKING:
    import optuna

EXPERIMENT = "nightshift-search"
PARENT_TAG = "mlflow.parentRunId"
STUDY_TAG = "nightshift.search.study"
TRIAL_TAG = "nightshift.search.trial"
STATE_TAG = "nightshift.search.state"
ROLE_TAG = "nightshift.search.role"
# Optuna's trial states as MLflow run statuses.
STATUS = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}


def parent_key(study: str) -> str:
    return f"search/{study}"


def trial_key(study: str, number: int) -> str:
    return f"search/{study}/{number}"


def _find(experiment_id: str, run_key: str) -> Any:
    runs = client().search_runs([experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'",
                                max_results=1)
    return runs[0] if runs else None


def _flat(values: dict[str, Any]) -> dict[str, str]:
    return {k: (v if isinstance(v, str) else json.dumps(v))[:6000] for k, v in values.items()}


def find_trial_run(experiment_id: str, study: str, number: int) -> str | None:
    """The id of trial `number`'s child run, if it was logged."""
    found = _find(experiment_id, trial_key(study, number))
    return str(found.info.run_id) if found is not None else None


def start_parent(experiment: str, study: str, storage: str, settings: SearchSettings) -> tuple[str, str]:
    """The parent run of `study` (created RUNNING, or reopened): (experiment id, run id)."""
    from mlflow.entities import Param

    experiment_id = ensure_experiment(experiment)
    mlflow_client = client()
    found = _find(experiment_id, parent_key(study))
    if found is not None:
        if found.info.status != "RUNNING":
            mlflow_client.update_run(found.info.run_id, status="RUNNING")
        return experiment_id, str(found.info.run_id)
    tags = {RUN_KEY_TAG: parent_key(study), STUDY_TAG: study, ROLE_TAG: "search", "nightshift.search.storage": storage}
    run = mlflow_client.create_run(experiment_id, run_name=study, tags=tags)
    values = settings.to_json()
    params = {"space": values.pop("space"), "fixed": values.pop("fixed"), **values, "objective": settings.objective,
              "direction": settings.direction}
    mlflow_client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in _flat(params).items()])
    return experiment_id, str(run.info.run_id)


def log_trial(experiment_id: str, parent_run_id: str, study: str, trial: optuna.trial.FrozenTrial,
              fixed: dict[str, Any] | None = None, objective: str = "val_accuracy") -> str:
    """The child run of a finished trial: params, per-epoch metrics (step = epoch), value (as
    `final_<objective>`) and state."""
    from mlflow.entities import Metric, Param, RunTag

    mlflow_client = client()
    state = trial.state.name
    tags = {PARENT_TAG: parent_run_id, STUDY_TAG: study, TRIAL_TAG: str(trial.number), STATE_TAG: state,
            RUN_KEY_TAG: trial_key(study, trial.number), ROLE_TAG: "trial"}
    if "nightshift.error" in trial.user_attrs:
        tags["nightshift.search.error"] = str(trial.user_attrs["nightshift.error"])[:5000]
    found = _find(experiment_id, trial_key(study, trial.number))
    if found is not None:  # logged by the trainer itself, or by an earlier tell: add the search's view
        run_id = str(found.info.run_id)
        mlflow_client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    else:
        started = int(trial.datetime_start.timestamp() * 1000) if trial.datetime_start else None
        run = mlflow_client.create_run(experiment_id, start_time=started, tags=tags,
                                       run_name=f"{study}/trial-{trial.number}")
        run_id = str(run.info.run_id)
        now = int(time.time() * 1000)
        metrics = [Metric(name, float(value), now, epoch) for epoch, values in epoch_metrics(trial).items()
                   for name, value in values.items()]
        params = {**(fixed or {}), **trial.params}
        mlflow_client.log_batch(run_id, metrics=metrics, params=[Param(k, v) for k, v in _flat(params).items()])
    summary: list[Any] = [Metric("epochs_trained", float(len(trial.intermediate_values)), int(time.time() * 1000), 0)]
    if trial.value is not None:
        summary.append(Metric(f"final_{objective}", float(trial.value), int(time.time() * 1000), 0))
    mlflow_client.log_batch(run_id, metrics=summary)
    ended = int(trial.datetime_complete.timestamp() * 1000) if trial.datetime_complete else None
    mlflow_client.set_terminated(run_id, status=STATUS.get(state, "FAILED"), end_time=ended)
    return run_id


def finish_parent(parent_run_id: str, report: dict[str, Any]) -> None:
    """Put the search's outcome on its parent run and end it."""
    from mlflow.entities import Metric, RunTag

    mlflow_client = client()
    now = int(time.time() * 1000)
    counts = {state: sum(t["state"] == state for t in report["trials"]) for state in ("COMPLETE", "PRUNED", "FAIL")}
    metrics = [Metric("trials", float(len(report["trials"])), now, 0),
               Metric("epochs_spent", float(report["epochs_spent"]), now, 0),
               *(Metric(f"trials_{state.lower()}", float(n), now, 0) for state, n in counts.items())]
    tags = []
    if report.get("best"):
        metrics.append(Metric(f"best_{report['objective']}", float(report["best"]["value"]), now, 0))
        tags.append(RunTag("nightshift.search.best_trial", str(report["best"]["trial"])))
    mlflow_client.log_batch(parent_run_id, metrics=metrics, tags=tags)
    mlflow_client.log_dict(parent_run_id, report, "search/report.json")
    mlflow_client.set_terminated(parent_run_id, status="FINISHED")
