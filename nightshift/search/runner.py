"""A whole search in this process, trials one after another: what `nightshift search` runs.

Each trial is the real trainer (`nightshift.train.cli.run`) as a one-rank Horovod job in this process,
with the search's per-epoch hook. In-process rather than `horovodrun -np 1` per trial: importing torch
and Horovod and starting a job costs seconds per trial on a small machine (more than a demo trial's
training), while everything that could differ between trials (seeds, RNG states, torch threads,
determinism flags) is set again by each `Trainer`. The price is isolation: a trial that kills the
process (a segfault, the OOM killer) takes the search with it; its trial is marked FAIL by the next
search that opens the study (`fail_stale`), and SIGTERM marks it FAIL at once. Multi-rank trials are
the DAG's business (`dags/model_search.py`: a `HorovodKubernetesOperator` per trial, reporting through
the storage with `--search-*`).

`trials` is the size the study grows to: the same command run again with the same settings continues
the same study (its default name is a hash of the settings) and runs only what is missing.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from nightshift import settings as nightshift_settings
from nightshift.errors import UsageError
from nightshift.search import tracking
from nightshift.search.best import best_path, best_record, write_best
from nightshift.search.pipeline import DEFAULT_PIPELINE
from nightshift.search.report_html import write_report
from nightshift.search.space import SearchSpace, parse_space
from nightshift.search.study import (
    SearchSettings,
    ask_trial,
    check_storage,
    compute_hours,
    default_storage,
    fail_stale,
    fail_trial,
    open_study,
    process_owner,
    study_dir,
    study_report,
)

if TYPE_CHECKING:
    import optuna

log = logging.getLogger("nightshift.search")


@dataclass(frozen=True)
class SearchRequest:
    settings: SearchSettings
    trials: int
    storage: str | None = None
    study: str | None = None
    experiment: str = tracking.EXPERIMENT
    budget_hours: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1:
            raise UsageError(f"--trials must be an integer >= 1, got {self.trials!r}")
        if self.budget_hours is not None and not self.budget_hours > 0:
            raise UsageError(f"--budget-hours must be positive, got {self.budget_hours!r}")


@dataclass
class SearchContext:
    """An open search: its parsed space, study and MLflow parent run."""

    settings: SearchSettings
    space: SearchSpace
    study: optuna.Study
    storage: str
    experiment: str
    experiment_id: str
    parent_run_id: str


def trial_dir(study: str, number: int, pipeline: str = DEFAULT_PIPELINE) -> Path:
    """Where trial `number` of `study` (of `pipeline`) keeps its outputs (`out/`) and checkpoints (`checkpoints/`)."""
    return study_dir(study, pipeline) / f"trial-{number}"


def check_data(space: SearchSpace, data: str) -> None:
    """Fail before any trial when the data cannot be read (every trial would fail the same way)."""
    from nightshift.datasets import load_split
    from nightshift.train.config import TrainConfig

    dataset = str(space.fixed.get("dataset", TrainConfig.dataset))
    task = str(space.fixed.get("task", TrainConfig.task))
    options = dict(space.fixed.get("dataset_options") or {})
    for split in ("train", "validation"):
        load_split(dataset, data, split, task=task, options=options)


def open_search(settings: SearchSettings, *, storage: str | None, study: str | None,
                experiment: str = tracking.EXPERIMENT) -> SearchContext:
    """Check the space and the data, open (or create) the study and the MLflow parent run."""
    space = parse_space(settings.space, settings.fixed)
    check_data(space, settings.data)
    url = check_storage(storage or default_storage())
    name = study or settings.default_study_name()
    study_dir(name, settings.pipeline)  # a name its pipeline's folder cannot hold fails before the study exists
    opened = open_study(url, name, settings)
    stale = fail_stale(opened)
    if stale:
        log.warning("study %s: trial(s) %s were RUNNING in a process that is gone; marked FAIL", name, stale)
    experiment_id, parent_run_id = tracking.start_parent(experiment, name, url, settings)
    return SearchContext(settings=settings, space=space, study=opened, storage=url, experiment=experiment,
                         experiment_id=experiment_id, parent_run_id=parent_run_id)


def budget_report(study: optuna.Study, budget_hours: float | None, wanted: int) -> dict[str, Any] | None:
    if budget_hours is None:
        return None
    trials = study.get_trials(deepcopy=False)
    used = compute_hours(trials)
    return {"hours": budget_hours, "used_hours": round(used, 6), "exhausted": used >= budget_hours,
            "trials_not_started": max(wanted - len(trials), 0)}


def finish_search(ctx: SearchContext, budget: dict[str, Any] | None = None) -> dict[str, Any]:
    """The study's report; best.json when there is a best trial; its pictures (`report`: the HTML page);
    the parent run ended."""
    report = study_report(ctx.study, ctx.settings)
    report["storage"] = ctx.storage
    report["mlflow"] = {"experiment_id": ctx.experiment_id, "parent_run_id": ctx.parent_run_id}
    if budget is not None:
        report["budget"] = budget
    if report["best"]:
        number = report["best"]["trial"]
        trial_run = tracking.find_trial_run(ctx.experiment_id, ctx.study.study_name, number)
        record = best_record(
            report, storage=ctx.storage, data=ctx.settings.data, max_epochs=ctx.settings.max_epochs,
            train_options=ctx.space.train_options(report["best"]["params"]),
            mlflow={"tracking_uri": nightshift_settings.mlflow_tracking_uri(), "experiment": ctx.experiment,
                    "parent_run_id": ctx.parent_run_id, "trial_run_id": trial_run}, pipeline=ctx.settings.pipeline,
            declared=ctx.settings.declared)
        path = best_path(ctx.settings.pipeline)
        written = write_best(record, path)
        report["best_file"] = {"path": str(path), "version": written["version"]}
    report["report"] = str(write_report(ctx.study, ctx.settings))
    tracking.finish_parent(ctx.parent_run_id, report)
    return report


@contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit, so the running trial is told FAIL before the process ends."""
    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_trial(ctx: SearchContext, trial: optuna.Trial, params: dict[str, Any]) -> optuna.trial.FrozenTrial:
    """Train one trial with the real trainer in this process, tell the study, log its child run."""
    import optuna

    from nightshift.search.reporter import TrialReporter
    from nightshift.train.cli import run
    from nightshift.train.config import TrainConfig

    study, number = ctx.study, trial.number
    where = trial_dir(study.study_name, number, ctx.settings.pipeline)
    log.info("study %s trial %d: %s", study.study_name, number, params)
    try:
        config = TrainConfig(data=Path(ctx.settings.data), out=where / "out", checkpoint_dir=where / "checkpoints",
                             epochs=ctx.settings.max_epochs, **ctx.space.train_options(params))
        summary = run(config, on_epoch=TrialReporter(trial, ctx.settings.max_epochs, ctx.settings.objective))
    except BaseException as err:
        fail_trial(study, number, f"{type(err).__name__}: {err}")
        log.warning("study %s trial %d failed: %s: %s", study.study_name, number, type(err).__name__, err)
        tracking.log_trial(ctx.experiment_id, ctx.parent_run_id, study.study_name, _frozen(study, number),
                           ctx.space.fixed, ctx.settings.objective)
        if not isinstance(err, Exception):  # interrupted or terminated: stop the search too
            raise
        return _frozen(study, number)
    if summary.get("stopped_at_epoch"):
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        log.info("study %s trial %d pruned after epoch %d", study.study_name, number, summary["stopped_at_epoch"])
    else:
        study.tell(trial, float(summary[ctx.settings.objective]))
    frozen = _frozen(study, number)
    tracking.log_trial(ctx.experiment_id, ctx.parent_run_id, study.study_name, frozen, ctx.space.fixed,
                       ctx.settings.objective)
    return frozen


def _frozen(study: optuna.Study, number: int) -> optuna.trial.FrozenTrial:
    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
    return study._storage.get_trial(trial_id)


def run_search(request: SearchRequest) -> dict[str, Any]:
    """Run trials until the study holds `request.trials` (or the budget is spent); return the report."""
    ctx = open_search(request.settings, storage=request.storage, study=request.study, experiment=request.experiment)
    with _sigterm_as_exit():
        while len(ctx.study.get_trials(deepcopy=False)) < request.trials:
            budget = budget_report(ctx.study, request.budget_hours, request.trials)
            if budget and budget["exhausted"]:
                log.warning("study %s: the budget of %s hours is spent (%.4f used); no new trial starts",
                            ctx.study.study_name, request.budget_hours, budget["used_hours"])
                break
            trial, params = ask_trial(ctx.study, ctx.space, ctx.settings, owner=process_owner())
            run_trial(ctx, trial, params)
    return finish_search(ctx, budget_report(ctx.study, request.budget_hours, request.trials))
