"""The pipeline a search is for, and what that decides: where its results lie, what its trials train, what
it optimises.

- Its folder, `NIGHTSHIFT_HOME/search/<pipeline>` (`search_dir`): its best.json and that file's versions
  (`nightshift.search.best`), and one folder per study with the trials' outputs and the report page
  (`study.study_dir`). The study storage is shared (SQLite `search/optuna.db`, or a PostgreSQL database); each
  study records its pipeline in its settings, so a study is never continued for another pipeline, and its best
  configuration goes to its own pipeline's best.json only.
- What every trial trains (`fixed_options`): the dataset loader and its options, the task, the model and its
  arguments, as the pipeline's declaration says: a search of a pipeline trains what that pipeline trains.
- What its best.json is for (`declared_training`): the declaration's data options, task and model as they were when
  the search ran, recorded in the search's settings and in best.json; a pipeline's training reads that best.json
  only while its declaration still says the same (`nightshift.search.best.training_defaults`).
- The objective: the task's validation metric (`nightshift.tasks.validation_metric`: val_accuracy maximised,
  val_rmse minimised), the one the trainer reports after every epoch.

A search that names no pipeline is nightly_retrain's (the demo digits): what every search was before searches
were per pipeline, and what a best.json written then (`NIGHTSHIFT_HOME/search/best.json`, no `pipeline`) is
still read for.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nightshift import settings
from nightshift.errors import UsageError
from nightshift.fsutil import safe_name
from nightshift.search.errors import SearchSpaceInvalid
from nightshift.search.space import MODEL_KWARGS, flatten_fixed
from nightshift.tasks import validation_metric

if TYPE_CHECKING:
    from nightshift.pipelines import Pipeline

DEFAULT_PIPELINE = "nightly_retrain"
# Trainer options a declaration sets that a search of the pipeline may neither search nor fix otherwise: with
# other data or another task the best configuration would say nothing about the pipeline's training.
DECLARED = ("dataset", "dataset_options", "task")
# What else lies in NIGHTSHIFT_HOME/search beside the pipelines' folders: the default study storage (and its
# journal), the asks' locks, and the best configuration written before searches were per pipeline.
_TAKEN = re.compile(r"optuna\.db.*|locks|best(-v\d+)?\.json")


def check_pipeline(pipeline: Any) -> str:
    """`pipeline` when it is a dag_id whose folder of NIGHTSHIFT_HOME/search is its own, else UsageError."""
    if not isinstance(pipeline, str) or not pipeline.strip():
        raise UsageError(f"a search names the dag_id of the pipeline it is for, got {pipeline!r}")
    if _TAKEN.fullmatch(safe_name(pipeline)):
        raise UsageError(f"pipeline {pipeline!r} cannot be searched: NIGHTSHIFT_HOME/search/{pipeline} is the "
                         f"search's own file or folder; give the pipeline another dag_id")
    return pipeline


def search_dir(pipeline: str) -> Path:
    """`NIGHTSHIFT_HOME/search/<pipeline>`: the pipeline's best.json, its versions and its studies' folders (the
    name through safe_name: one path component, never another pipeline's)."""
    return settings.home() / "search" / safe_name(check_pipeline(pipeline))


def declared_options(pipeline: Pipeline) -> dict[str, Any]:
    """The trainer options (flat keys, as a search's `fixed`) the declaration of `pipeline` sets."""
    from nightshift.pipelines.spec import plain

    options: dict[str, Any] = {"dataset": pipeline.dataset.loader,
                               "dataset_options": pipeline.dataset.loader_options(), "task": pipeline.task,
                               "model": pipeline.model.name}
    options.update({MODEL_KWARGS + key: value for key, value in plain(pipeline.model.kwargs).items()})
    return options


def declared_training(pipeline: Pipeline) -> dict[str, Any]:
    """What the declaration of `pipeline` trains (dataset, dataset_options, task, model, model_kwargs), as plain
    JSON values: a search records it with its best configuration, and training compares it with the declaration
    it reads then, so a best configuration of the pipeline as it was never trains the pipeline as it is."""
    import json

    from nightshift.pipelines.spec import plain

    return json.loads(json.dumps({"dataset": pipeline.dataset.loader,
                                  "dataset_options": pipeline.dataset.loader_options(), "task": pipeline.task,
                                  "model": pipeline.model.name, "model_kwargs": plain(pipeline.model.kwargs)},
                                 sort_keys=True))


def fixed_options(pipeline: Pipeline, space: dict[str, Any], fixed: dict[str, Any]) -> dict[str, Any]:
    """The fixed options of a search of `pipeline` with `space`: the declared ones (`declared_options`), then
    `fixed` (flat keys, or `model_kwargs` nested).

    A searched or fixed `model` replaces the declared model with its arguments, and a searched model argument
    the declared one. Searching or fixing what the declaration sets (DECLARED) is SearchSpaceInvalid naming the
    key and the declaration.
    """
    given = flatten_fixed(fixed)
    for key in DECLARED:
        if key in space or key in given:
            how = "searched" if key in space else "fixed"
            raise SearchSpaceInvalid(f"{key!r} is {how}, but {pipeline.source or pipeline.dag_id} declares it for "
                                     f"pipeline {pipeline.dag_id}: remove it (a search trains on what its pipeline "
                                     f"trains on)")
    declared = declared_options(pipeline)
    if "model" in space or "model" in given:  # the declared arguments are the declared model's
        declared = {k: v for k, v in declared.items() if k != "model" and not k.startswith(MODEL_KWARGS)}
    return {**{k: v for k, v in declared.items() if k not in space}, **given}


def objective_note(pipeline: Pipeline) -> str | None:
    """A line saying that the search optimises another metric than the pipeline's gate, else None."""
    searched = validation_metric(pipeline.task)
    if pipeline.gate.primary == searched.name:
        return None
    return (f"pipeline {pipeline.dag_id} is gated on {pipeline.gate.primary}; the search optimises val_"
            f"{searched.name}, the {pipeline.task} metric the trainer reports after every epoch")
