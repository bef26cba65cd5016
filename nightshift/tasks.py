"""What a model predicts (its task) and the metrics each task is judged by, with the way each improves.

One table for the pipeline declarations (which metric may gate which task), the evaluator (which metrics to
compute) and the gate (which direction is better). No heavy imports: the DAG factory reads it at parse time.
"""

from __future__ import annotations

from dataclasses import dataclass

from nightshift.errors import UsageError

BINARY = "binary"
MULTICLASS = "multiclass"
REGRESSION = "regression"
TASKS = (BINARY, MULTICLASS, REGRESSION)


@dataclass(frozen=True)
class Metric:
    name: str
    higher_is_better: bool

    def gain(self, new: float, old: float) -> float:
        """How much better `new` is than `old` (positive = better), whatever the metric's direction."""
        return new - old if self.higher_is_better else old - new


_UP, _DOWN = True, False
METRICS: dict[str, tuple[Metric, ...]] = {
    BINARY: (Metric("accuracy", _UP), Metric("log_loss", _DOWN), Metric("roc_auc", _UP), Metric("f1", _UP)),
    MULTICLASS: (Metric("accuracy", _UP), Metric("log_loss", _DOWN), Metric("macro_f1", _UP)),
    REGRESSION: (Metric("rmse", _DOWN), Metric("mae", _DOWN), Metric("r2", _UP)),
}


# Each task's gate when a declaration or `nightshift evaluate` leaves it out: (primary metric, guard metrics and
# how far each may regress, floor for a first model (None: none)).
# How much the primary metric must gain over the champion's when a gate does not say (nightshift evaluate, a
# declaration without gate.min_improvement).
DEFAULT_MIN_IMPROVEMENT = 0.001
DEFAULT_GATES: dict[str, tuple[str, dict[str, float], float | None]] = {
    MULTICLASS: ("accuracy", {"macro_f1": 0.01, "log_loss": 0.05}, 0.8),
    BINARY: ("accuracy", {"f1": 0.01, "log_loss": 0.05}, 0.8),
    REGRESSION: ("rmse", {}, None),
}

# A binary task's positive class when its gate names none: the index, among the label's sorted values, of the class
# F1, precision and recall are computed for: the second (1 of 0/1, True of False/True, yes of no/yes).
DEFAULT_POSITIVE = 1

# The metric the trainer reports on the validation split after every epoch, as `val_<name>`
# (nightshift.train.trainer.Trainer.evaluate): what a model search of a pipeline of the task optimises.
VALIDATION_METRICS = {BINARY: "accuracy", MULTICLASS: "accuracy", REGRESSION: "rmse"}


def check_task(task: str) -> str:
    if task not in METRICS:
        raise UsageError(f"unknown task {task!r}; use one of {', '.join(TASKS)}")
    return task


def metric_names(task: str) -> tuple[str, ...]:
    return tuple(m.name for m in METRICS[check_task(task)])


def validation_metric(task: str) -> Metric:
    """The metric the trainer reports for `task` after every epoch (as `val_<name>`), with its direction."""
    return metric(task, VALIDATION_METRICS[check_task(task)])


def metric(task: str, name: str) -> Metric:
    """The metric `name` of `task`, or a UsageError naming the metrics that task has."""
    for candidate in METRICS[check_task(task)]:
        if candidate.name == name:
            return candidate
    raise UsageError(f"metric {name!r} does not fit a {task} task; use one of {', '.join(metric_names(task))}")
