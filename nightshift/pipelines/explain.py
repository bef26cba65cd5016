"""`nightshift pipeline explain DECL`: the gate a declaration really gets, key by key, and where each value came from
(the declaration, the task's default, the schema's default), with the rules no key changes.

What it shows is what the DAG passes to `nightshift.evaluate` (Pipeline.gate, read by the same loader), so it
cannot drift from what a run does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nightshift.pipelines.load import load_pipeline, parse_yaml
from nightshift.pipelines.spec import Pipeline
from nightshift.tasks import BINARY, DEFAULT_GATES, DEFAULT_MIN_IMPROVEMENT, DEFAULT_POSITIVE, metric

DECLARED, TASK_DEFAULT, DEFAULT = "declaration", "task default", "default"


def _entry(value: Any, source: str, meaning: str) -> dict[str, Any]:
    return {"value": value, "from": source, "meaning": meaning}


def explain(path: str | Path, *, data: bool = True) -> dict[str, Any]:
    """The gate of the declaration `path` as a JSON-able dict; PipelineInvalid when it is not valid. `data`: read
    the train split's labels to say which class the default positive class is (binary)."""
    pipeline = load_pipeline(path)
    declared = parse_yaml(Path(path).read_text(), str(path))
    gate_declared: dict[str, Any] = declared.get("gate") or {}
    deploy_declared: dict[str, Any] = declared.get("deploy") or {}
    gate, task = pipeline.gate, pipeline.task
    default_primary = DEFAULT_GATES[task][0]
    primary = metric(task, gate.primary)
    better, bound = ("higher", "at least") if primary.higher_is_better else ("lower", "at most")

    def source(key: str) -> str:
        return DECLARED if key in gate_declared else TASK_DEFAULT

    if gate.floor is None:
        floor_meaning = "no floor: with no champion yet, the first model is accepted"
    else:
        floor_meaning = f"with no champion yet, {gate.primary} must be {bound} {gate.floor:g}"
        if "floor" not in gate_declared:
            floor_meaning += f" (the {task} default for its default primary metric {default_primary})"
    guards = dict(gate.guards)
    explained: dict[str, Any] = {
        "primary": _entry(gate.primary, DECLARED, f"must be better than the champion's ({better} is better)"),
        "min_improvement": _entry(gate.min_improvement, source("min_improvement"),
                                  f"{gate.primary} must gain at least {gate.min_improvement:g} over the champion's"
                                  + ("" if "min_improvement" in gate_declared else
                                     f" (every task's default, {DEFAULT_MIN_IMPROVEMENT:g})")),
        "floor": _entry(gate.floor, DECLARED if "floor" in gate_declared else TASK_DEFAULT, floor_meaning),
        "guards": _entry(guards, source("guards"), "; ".join(
            f"{name} may get worse than the champion's by at most {tolerance:g}" for name, tolerance in guards.items())
            or ("no guard (declared `guards: {}`)" if "guards" in gate_declared else f"no guard for a {task} task")),
    }
    if task == BINARY:
        explained["positive_class"] = _positive_class(pipeline, "positive_class" in gate_declared, data)
    approval = pipeline.deploy.require_approval
    result = {
        "dag_id": pipeline.dag_id,
        "declaration": str(pipeline.source),
        "task": task,
        "model_name": pipeline.model_name,
        "gate": explained,
        "require_approval": _entry(approval, DECLARED if "require_approval" in deploy_declared else DEFAULT,
                                   "a person approves each promotion before it is deployed" if approval else
                                   "a promotion is deployed without asking, unless the champion cannot be compared"),
        "rules": [
            f"a tie never promotes: {gate.primary} must be better than the champion's by more than float rounding, "
            f"whatever min_improvement is",
            "every comparison (primary, guards, floor) tolerates float rounding (a few ulps)",
            f"with no champion, only the floor decides ({'none' if gate.floor is None else f'{gate.floor:g}'})",
            "a champion that cannot be compared or scored on the night's data (another task or label, columns or "
            "classes gone) sends the decision to a person, whatever require_approval says",
            "a run's trigger form may change min_improvement and require_approval for that run only",
        ],
    }
    return result


def _positive_class(pipeline: Pipeline, declared: bool, data: bool) -> dict[str, Any]:
    value = pipeline.gate.positive_class
    if declared and value is not None:
        return _entry(value, DECLARED, f"F1, precision and recall are those of label {value!r}")
    entry = _entry(None, TASK_DEFAULT, "F1, precision and recall are those of the second of the label's sorted "
                                       "values")
    labels = _labels(pipeline) if data else None
    if labels is not None and len(labels) > DEFAULT_POSITIVE:
        entry["value"] = labels[DEFAULT_POSITIVE]
        entry["meaning"] += f": {labels[DEFAULT_POSITIVE]!r} of {', '.join(labels)} (the train split's labels)"
    return entry


def _labels(pipeline: Pipeline) -> list[str] | None:
    from nightshift.errors import UsageError
    from nightshift.pipelines.check import label_values
    from nightshift.settings import confined_data_source

    train = pipeline.dataset.data.paths()["train"]
    try:
        confined_data_source(train)
    except UsageError:
        return None
    return label_values(train, pipeline.dataset.label) if train.is_file() else None


def readable(result: dict[str, Any]) -> list[str]:
    """The explanation as lines for a person."""
    lines = [f"{result['dag_id']} ({result['declaration']}): a {result['task']} pipeline; the gate that promotes "
             f"a new {result['model_name']} over @champion:"]
    entries = {**result["gate"], "require_approval": result["require_approval"]}
    for key, entry in entries.items():
        lines.append(f"  {key:<17} {_shown(entry['value']):<24} ({entry['from']}) {entry['meaning']}")
    lines.extend(f"  - {rule}" for rule in result["rules"])
    return lines


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{name} {tolerance:g}" for name, tolerance in value.items()) or "{}"
    if value is None:
        return "-"
    return str(value).lower() if isinstance(value, bool) else str(value)
