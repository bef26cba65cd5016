"""Score the new model and the current `@champion` on the same held-out split, and decide with a gate.

Both models are scored through their MLflow pyfunc (the artifact that would be served) on the raw test
table of the staged dataset, so the evaluation sees exactly what the model server will see.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nightshift import decision_page, tracking
from nightshift.datasets import read_split_frame
from nightshift.errors import EvaluationError, UsageError
from nightshift.tasks import (
    BINARY,
    DEFAULT_GATES,
    DEFAULT_MIN_IMPROVEMENT,
    DEFAULT_POSITIVE,
    MULTICLASS,
    REGRESSION,
    check_task,
    metric,
    metric_names,
)

DEFAULT_MODEL_NAME = "nightshift-digits"
LABEL_COLUMN = "label"

# A task's gate when none is given: (primary, guards and their tolerances, floor without a champion). A
# regression metric has the target's units, so no floor fits every dataset: the first model passes.
@dataclass(frozen=True)
class GateConfig:
    """When a challenger may replace the champion, for a model of `task` (nightshift.tasks).

    `primary` must improve by at least `min_improvement` over the champion; each guard metric may regress
    by at most its tolerance; with no champion the primary metric must reach `floor` (None: no floor).
    Which way a metric improves comes from nightshift.tasks. `primary`, `guards` and `floor` left out take
    the task's defaults (DEFAULT_GATES); a metric the task does not have is refused. `positive_class` (binary
    only): the label value, as text, that F1, precision and recall are computed for; None: DEFAULT_POSITIVE.
    """

    primary: str = ""
    min_improvement: float = DEFAULT_MIN_IMPROVEMENT
    guards: dict[str, float] | None = None
    floor: float | None = None
    task: str = MULTICLASS
    positive_class: str | None = None

    def __post_init__(self) -> None:
        check_task(self.task)
        if self.positive_class is not None:
            if self.task != BINARY:
                raise UsageError(f"gate: only a binary task has a positive class, not a {self.task} task")
            object.__setattr__(self, "positive_class", str(self.positive_class))
        primary, guards, floor = DEFAULT_GATES[self.task]
        if not self.primary:
            object.__setattr__(self, "primary", primary)
        if self.guards is None:
            object.__setattr__(self, "guards", dict(guards))
        for name in (self.primary, *(self.guards or {})):
            try:
                metric(self.task, name)
            except UsageError as err:
                raise UsageError(f"gate {err}") from err
        if self.floor is None and floor is not None:
            if self.primary != primary:  # the default floor is a value of the default metric, in its units
                raise UsageError(f"gate: give a floor for primary {self.primary!r} (--floor): the task's default "
                                 f"floor ({floor:g}) is for {primary}")
            object.__setattr__(self, "floor", floor)
        if not math.isfinite(self.min_improvement) or self.min_improvement < 0:
            raise UsageError(f"min_improvement must be a finite number >= 0, got {self.min_improvement}")
        for name, tolerance in (self.guards or {}).items():
            if not math.isfinite(tolerance) or tolerance < 0:
                raise UsageError(f"guard tolerance for {name} must be >= 0, got {tolerance}")
        if self.floor is not None and not math.isfinite(self.floor):
            raise UsageError(f"floor must be a finite number, got {self.floor}")


def rounding(*values: float) -> float:
    """How far apart two metric computations of the same value can land by float rounding alone: a few ulps of
    the largest magnitude involved (0.94 - 0.93 is 0.00999999999999990 in binary floating point)."""
    return 8 * math.ulp(max([1.0, *(abs(v) for v in values)]))


def decide(challenger: dict[str, Any], champion: dict[str, Any] | None, config: GateConfig) -> dict[str, Any]:
    """The gate: {"passed": bool, "reasons": [one sentence per check]} from two metric dicts.

    Every comparison tolerates float rounding (`rounding`): a gain that equals `min_improvement` but for a few ulps
    meets it, a guard's change likewise. A tie never promotes, whatever `min_improvement` is (0 included): the
    primary metric must be better than the champion's by more than rounding."""
    reasons: list[str] = []
    passed = True
    primary = metric(config.task, config.primary)
    names = dict.fromkeys([*metric_names(config.task), primary.name, *(config.guards or {})])
    broken = [f"{name} {challenger[name]}" for name in names
              if name in challenger and not math.isfinite(float(challenger[name]))]
    if broken:  # a diverged model (NaN predictions) or an undefined metric: nothing to compare or accept
        return {"passed": False, "reasons": [f"the challenger's {', '.join(broken)} is not a finite number: "
                                             f"rejected before any other check"]}
    value = float(challenger[primary.name])
    if champion is None:
        if config.floor is None:
            reasons.append(f"no champion and no floor: {primary.name} {value:.4f} is accepted")
            return {"passed": True, "reasons": reasons}
        ok = primary.gain(value, config.floor) >= -rounding(value, config.floor)
        reasons.append(f"no champion: {primary.name} {value:.4f} {'meets' if ok else 'misses'} the floor "
                       f"{config.floor:.4f}")
        return {"passed": ok, "reasons": reasons}
    theirs = float(champion[primary.name])
    gain = primary.gain(value, theirs)
    slack = rounding(value, theirs, config.min_improvement)
    if gain <= slack:
        passed = False
        verdict = "a tie never replaces the champion" if abs(gain) <= slack else "worse than the champion"
        reasons.append(f"{primary.name} {value:.4f} vs champion {theirs:.4f}: improvement {gain:+.4f}, {verdict} "
                       f"(min_improvement {config.min_improvement:.4f})")
    else:
        ok = gain >= config.min_improvement - slack
        passed &= ok
        reasons.append(f"{primary.name} {value:.4f} vs champion {theirs:.4f}: improvement "
                       f"{gain:+.4f} {'>=' if ok else '<'} min_improvement {config.min_improvement:.4f}")
    for name, tolerance in sorted((config.guards or {}).items()):
        ours, before = float(challenger[name]), float(champion[name])
        gain = metric(config.task, name).gain(ours, before)
        ok = gain >= -tolerance - rounding(ours, before, tolerance)
        passed &= ok
        reasons.append(f"guard {name} {float(challenger[name]):.4f} vs champion "
                       f"{float(champion[name]):.4f}: change {gain:+.4f} "
                       f"{'within' if ok else 'beyond'} tolerance {tolerance:.4f}")
    return {"passed": bool(passed), "reasons": reasons}


def _class_names(model: Any) -> list[str] | None:
    """The class values a Nightshift classifier answers, as text (its `prob_<class>` names); None otherwise."""
    classifier = _classifier(model)
    if classifier is None or getattr(classifier, "is_regression", True):
        return None
    return [str(c) for c in classifier.classes]


_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?(e[-+][0-9]+)?")


def class_value(name: str) -> float | None:
    """The number a class name spells as Python writes a numeric label's value ('1', '0.0', '-0.0',
    '0.10000000149011612', '1e-05'), else None: a string label such as '01', '+1' or '1e3' is text, whatever
    number it looks like."""
    if not _NUMBER.fullmatch(name):
        return None
    if "." not in name and "e" not in name:
        return float(int(name)) if str(int(name)) == name else None
    value = float(name)
    return value if str(value) == name else None


def _by_value(names: list[str]) -> dict[float, str]:
    """{number: the first of `names` that spells it} for the names that are numbers (`class_value`)."""
    by_value: dict[float, str] = {}
    for name in names:
        value = class_value(name)
        if value is not None:
            by_value.setdefault(value, name)
    return by_value


def same_classes(own: list[str], names: list[str]) -> dict[str, str]:
    """{each of `own` class names: the one of `names` that is the same class}: the same text, else the same number
    (a model trained before names were normalised has '-0.0' where a newer one has '0.0'; a float32 label's class
    is '0.10000000149011612' where a float64 one's is '0.1' only if the values differ, and then they are not the
    same class). Names with no match are left out."""
    by_value = _by_value(names)
    matched: dict[str, str] = {}
    for name in own:
        if name in names:
            matched[name] = name
        elif (value := class_value(name)) is not None and value in by_value:
            matched[name] = by_value[value]
    return matched


def label_names(column: Any, names: list[str]) -> np.ndarray:
    """Each row's class as text, in the spelling of the class `names` (a model's `prob_<class>` names) where the
    label is a number equal to one of them: the classes were written from the training labels' values (a float32
    0.1 is '0.10000000149011612', -0.0 is 0.0 to the loader, an integer label 2 is the class '2.0' of a model trained
    on the float 2.0), while the column's own text would be '0.1', '-0.0' or '2'. Other labels (strings, numbers
    no name equals) keep their own text; an empty label is 'nan'."""
    import pandas as pd

    text = np.asarray([str(v) for v in column.astype(object).tolist()], dtype=object)
    if not (pd.api.types.is_numeric_dtype(column.dtype) and not pd.api.types.is_bool_dtype(column.dtype)):
        return text
    by_value = _by_value(names)
    if not by_value:
        return text
    values = column.to_numpy(np.float64, na_value=np.nan).tolist()
    spelled = set(names)  # a label spelled as a class is that class (two integers past 2**53 are one float)
    return np.asarray([t if t in spelled else by_value.get(v, t) for v, t in zip(values, text, strict=True)],
                      dtype=object)


def _load(model_uri: str) -> Any:
    import mlflow.pyfunc

    try:
        return mlflow.pyfunc.load_model(model_uri)
    except Exception as err:
        raise EvaluationError(f"cannot load model {model_uri} ({type(err).__name__}: {err}); check the "
                              f"artifact store") from err


def _classifier(model: Any) -> Any:
    """The served classifier inside a Nightshift pyfunc (nightshift.served_model.TorchTableClassifier), or None
    for a pyfunc of another kind."""
    try:
        python_model = model.unwrap_python_model()
    except Exception:
        return None
    return getattr(python_model, "classifier", None)


def _predict(model: Any, frame: Any, where: str = "the split") -> Any:
    """The pyfunc's answer for a raw feature table, in server-sized batches. A Nightshift model answers every
    row whatever its range (`check_range=False`): evaluation never refuses a row for being beyond the training
    data's range (a heavy tail is data, reported by `outside_training_range`); serving has its own policy."""
    import pandas as pd

    classifier = _classifier(model)

    def predict(part: Any) -> Any:
        try:
            if classifier is not None:
                return classifier.predict(part, check_range=False)
            return model.predict(part)
        except Exception as err:  # the served model's 400s (MlflowException), and anything a plugin raises
            raise EvaluationError(f"{where}: the model cannot answer its rows ({type(err).__name__}: "
                                  f"{str(err)[:300]})") from err

    parts = [predict(frame.iloc[start:start + tracking.MAX_ROWS]) for start in range(0, len(frame), tracking.MAX_ROWS)]
    return pd.concat(parts, ignore_index=True)


def outside_training_range(model: Any, frame: Any) -> dict[str, Any] | None:
    """Drift, as a figure: the share of `frame`'s rows with a value outside the range the model saw in training
    (a tabular model's train-split [min, max]; the demo's domain bounds), per column (those with any) and for
    rows with any such column; `features`: the columns the model reads. None for a model that records no range."""
    classifier = _classifier(model)
    if classifier is None or len(frame) == 0:
        return None
    prep = classifier.preprocessing or {}
    if "min" in prep and "max" in prep:
        columns = [str(c) for c in prep["features"]]
        low, high = np.asarray(prep["min"], dtype=np.float64), np.asarray(prep["max"], dtype=np.float64)
    else:
        columns = list(classifier.features.columns)
        low, high = np.asarray(classifier.features.low), np.asarray(classifier.features.high)
    if any(c not in frame.columns for c in columns):
        return None
    values = frame[columns].to_numpy(dtype=np.float64)
    outside = (values < low) | (values > high)
    shares = outside.mean(axis=0)
    return {"rows": float(outside.any(axis=1).mean()),
            "columns": {c: float(v) for c, v in zip(columns, shares, strict=True) if v > 0}, "features": columns}


def predict_proba(model_uri: str, frame: Any) -> np.ndarray:
    """Class probabilities of the pyfunc at `model_uri` for a raw feature table, in server-sized batches."""
    out = _predict(_load(model_uri), frame)
    return out[[c for c in out.columns if c.startswith("prob_")]].to_numpy(np.float64)


def input_columns(model: Any) -> list[str] | None:
    """The feature columns a logged pyfunc takes: its input signature's, else those its metadata records (a
    tabular model declares no input signature), else None (take every column but the label)."""
    schema = model.metadata.get_input_schema()
    if schema is not None and schema.has_input_names():
        return list(schema.input_names())
    recorded = (model.metadata.metadata or {}).get("nightshift.feature_columns")
    return [str(c) for c in recorded] if recorded else None


def incomparable(champion: Any, challenger: Any, *, task: str, label_column: str,
                 data_columns: Any = None) -> str | None:
    """Why the champion's scores cannot be compared with the challenger's (it was trained for another task or
    label column, or needs feature columns tonight's data lacks, as its metadata records), or None when they can.
    The champion is scored on its own columns, taken by name, from the data (`data_columns`: the evaluated
    split's columns; None: the challenger's columns stand for them): a declaration that dropped features, columns
    in another order or columns the data gained do not count. What the champion does not record is not held
    against it."""
    def recorded(model: Any) -> dict[str, Any]:
        meta = model.metadata.metadata or {}
        return {"task": meta.get("nightshift.task"), "label column": meta.get("nightshift.label_column"),
                "feature columns": input_columns(model)}

    theirs, ours = recorded(champion), {**recorded(challenger), "task": task, "label column": label_column}
    differ = [f"{key} {theirs[key]!r}, not {ours[key]!r}" for key in ("task", "label column")
              if theirs[key] is not None and ours[key] is not None and theirs[key] != ours[key]]
    available = [str(c) for c in data_columns] if data_columns is not None else ours["feature columns"]
    if theirs["feature columns"] is not None and available is not None:
        missing = [c for c in theirs["feature columns"] if c not in set(available)]
        if missing:
            differ.append(f"feature columns {missing[:5]}{'…' if len(missing) > 5 else ''} that tonight's data "
                          f"lacks")
    return "; ".join(differ) or None


def score(model_uri: str, data_dir: str | Path, split: str = "test", *, task: str = MULTICLASS,
          label_column: str = LABEL_COLUMN, model: Any = None, classes: list[str] | None = None,
          positive_class: str | None = None) -> dict[str, Any]:
    """The metrics of `task` (nightshift.tasks) of one model on one split, through its pyfunc (`model`: the
    pyfunc already loaded from `model_uri`). Classification also gives per-class recall and the confusion
    matrix (rows: true class, columns: predicted), over `classes` (class values as text, in order) when given:
    the classes of both models compared, so that both are scored over the same set (a class this model lacks
    gets probability 0); else over the model's own. A true label the model does not know is an EvaluationError.
    Binary: F1, precision and recall are those of `positive_class` (as text; None: the second class, in order),
    which must be one of the classes. `drift` is the share of rows beyond the model's training range
    (`outside_training_range`)."""
    import pandas as pd

    check_task(task)
    path = f"{data_dir}/{split}.parquet"
    frame = read_split_frame(data_dir, split)
    if label_column not in frame.columns:
        raise EvaluationError(f"{path} has no {label_column!r} column to score against; pass the label column "
                              f"the model was trained with")
    model = model if model is not None else _load(model_uri)
    trained_for = (model.metadata.metadata or {}).get("nightshift.task")
    if trained_for and trained_for != task:
        raise EvaluationError(f"model {model_uri} was trained for a {trained_for} task, not {task}; evaluate "
                              f"it with task {trained_for}")
    columns = input_columns(model) or [c for c in frame.columns if c != label_column]
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise EvaluationError(f"{path} lacks the model's feature columns {missing[:5]}; is this the dataset "
                              f"the model was trained on?")
    out = _predict(model, frame[columns], path)
    bad = [str(c) for c in out.columns if pd.api.types.is_numeric_dtype(out[c]) and not np.isfinite(
        out[c].to_numpy(np.float64)).all()]
    if bad:
        finite = np.isfinite(out[[c for c in out.columns if pd.api.types.is_numeric_dtype(out[c])]]
                             .to_numpy(np.float64)).all(axis=1)
        broken = int((~finite).sum())
        why = ("every row: the model itself is broken, e.g. it diverged in training (NaN weights; a learning rate "
               "too high?), so it must not be served" if broken == len(out) else
               "a feature value too large for the network, e.g. a fill value like 9.97e36?")
        raise EvaluationError(f"{path}: model {model_uri} answers values that are not finite numbers in {bad[:3]} "
                              f"for {broken} of {len(out)} rows ({why})")
    head = {"model_uri": model_uri, "rows": len(frame), "drift": outside_training_range(model, frame)}
    if task == REGRESSION:
        if tracking.VALUE_COLUMN not in out.columns:
            raise EvaluationError(f"model {model_uri} answers no {tracking.VALUE_COLUMN!r}: it is not a "
                                  f"regression model")
        target = frame[label_column].to_numpy(np.float64)
        if len(target) and np.all(target == target[0]):
            raise EvaluationError(f"{path}: the target column {label_column!r} has no variance (every value is "
                                  f"{target[0]:g}): R² is undefined and every model scores alike; evaluate on a "
                                  f"split whose target varies")
        predicted = out[tracking.VALUE_COLUMN].to_numpy(np.float64)
        return {**head, **regression_metrics(target, predicted),
                "residuals": decision_page.residual_sample(target, predicted)}
    prob_columns = [c for c in out.columns if str(c).startswith("prob_")]
    if not prob_columns:
        raise EvaluationError(f"model {model_uri} answers no class probabilities (prob_*): is it a regression "
                              f"model? evaluate it with task regression")
    own = [str(c)[len("prob_"):] for c in prob_columns]
    names = list(classes) if classes is not None else own
    empty = int(frame[label_column].isna().sum())
    if empty:
        raise EvaluationError(f"{path}: label column {label_column!r} is empty in {empty} rows; a split to score "
                              f"needs every label (drop or fill those rows before staging)")
    spelled = same_classes(own, names)  # each class the model answers, as the compared classes spell it
    lacking = [c for c in own if c not in spelled]
    if lacking:
        raise EvaluationError(f"model {model_uri} answers classes {lacking[:5]} outside the compared classes "
                              f"{names[:10]}")
    index = {name: i for i, name in enumerate(names)}
    truth = label_names(frame[label_column], names)
    unseen = sorted(set(truth) - set(names))
    if unseen:
        raise EvaluationError(f"{path}: label column {label_column!r} holds {unseen[:5]}, classes the model "
                              f"does not know ({', '.join(own)})")
    positive = DEFAULT_POSITIVE
    if task == BINARY and positive_class is not None:
        declared = same_classes([str(positive_class)], names).get(str(positive_class))  # 1 is the class 1.0
        if declared is None:
            raise EvaluationError(f"the positive class {str(positive_class)!r} is none of the classes "
                                  f"{', '.join(names)}; declare one of them (gate.positive_class)")
        positive = index[declared]
    labels = np.asarray([index[t] for t in truth], dtype=np.int64)
    proba = np.zeros((len(frame), len(names)), dtype=np.float64)
    for column, name in zip(prob_columns, own, strict=True):
        proba[:, index[spelled[name]]] = out[column].to_numpy(np.float64)
    metrics = classification_metrics(task, labels, proba, positive=positive)
    recall = metrics.pop("recall")
    if task == BINARY:
        metrics["positive_class"] = names[positive]
    return {**head, **metrics, "classes": names, "per_class_recall": dict(zip(names, recall, strict=True))}


def classification_metrics(task: str, labels: np.ndarray, proba: np.ndarray,
                           positive: int = DEFAULT_POSITIVE) -> dict[str, Any]:
    """Class indices and probabilities → the task's metrics, `recall` per class and `confusion_matrix`.
    Binary: F1, `positive_precision` and `positive_recall` are the positive class's, index `positive` (default: the
    second of the sorted class values); ROC AUC ranks its probability (the same either way round)."""
    from sklearn.metrics import (
        accuracy_score,
        confusion_matrix,
        f1_score,
        log_loss,
        precision_score,
        recall_score,
        roc_auc_score,
    )

    classes = list(range(proba.shape[1]))
    proba = proba / proba.sum(axis=1, keepdims=True)
    predicted = proba.argmax(axis=1)
    out: dict[str, Any] = {
        "accuracy": float(accuracy_score(labels, predicted)),
        "log_loss": float(log_loss(labels, proba, labels=classes)),
    }
    if task == BINARY:
        if len(np.unique(labels)) < 2:
            raise EvaluationError("the split holds one class only: ROC AUC is undefined; evaluate on a split "
                                  "with both classes")
        out["roc_auc"] = float(roc_auc_score(labels == positive, proba[:, positive]))
        out["f1"] = float(f1_score(labels, predicted, pos_label=positive, average="binary", zero_division=0))
        out["positive_precision"] = float(precision_score(labels, predicted, pos_label=positive, average="binary",
                                                          zero_division=0))
        out["positive_recall"] = float(recall_score(labels, predicted, pos_label=positive, average="binary",
                                                    zero_division=0))
    else:
        out["macro_f1"] = float(f1_score(labels, predicted, labels=classes, average="macro", zero_division=0))
    out["recall"] = [float(r) for r in recall_score(labels, predicted, labels=classes, average=None,
                                                    zero_division=0)]
    out["confusion_matrix"] = confusion_matrix(labels, predicted, labels=classes).tolist()
    return out


def regression_metrics(target: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
    """RMSE, MAE (the target's units) and R² (1 - residual / total sum of squares; NaN when the target has no
    variance, so the gate refuses it rather than every model scoring alike)."""
    residual = target - predicted
    total = float(((target - target.mean()) ** 2).sum())
    return {"rmse": float(np.sqrt((residual ** 2).mean())), "mae": float(np.abs(residual).mean()),
            "r2": 1.0 - float((residual ** 2).sum()) / total if total > 0 else math.nan}


def confusion_png(matrix: list[list[int]], path: Path, title: str) -> Path:
    """Draw a confusion matrix with its counts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = np.asarray(matrix)
    fig, ax = plt.subplots(figsize=(6, 5))
    image = ax.imshow(counts, cmap="Blues")
    fig.colorbar(image, ax=ax)
    ax.set(xlabel="predicted", ylabel="true", title=title,
           xticks=range(counts.shape[1]), yticks=range(counts.shape[0]))
    for (i, j), n in np.ndenumerate(counts):
        ax.text(j, i, str(n), ha="center", va="center", fontsize=7,
                color="white" if n > counts.max() / 2 else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def champion_uri(model_name: str) -> tuple[str, str] | None:
    """(version, model URI) of `model_name@champion`, or None when there is no champion yet."""
    from mlflow.exceptions import MlflowException

    mlflow_client = tracking.client()
    try:
        version = mlflow_client.get_model_version_by_alias(model_name, "champion")
    except MlflowException as err:
        if err.error_code in {"RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"}:
            return None
        raise
    return str(version.version), f"models:/{model_name}/{version.version}"


def evaluate(run_id: str, *, data_dir: str | Path, model_name: str = DEFAULT_MODEL_NAME, split: str = "test",
             gate: GateConfig | dict[str, Any] | None = None, label_column: str = LABEL_COLUMN) -> dict[str, Any]:
    """Score the model of training run `run_id` and the current champion; log and return the decision.

    The gate's `task` says which metrics are computed. Returns {"passed", "reasons", "run_id", "model_name",
    "split", "challenger": metrics, "champion": metrics + "version" or None, "gate": config,
    "needs_approval", "confusion_matrix_artifact" (None for regression)}. The test metrics (prefixed
    `<split>_`), the share of rows beyond the training range (`<split>_rows_outside_train_range`), the
    confusion-matrix PNG (classification), `evaluation.json` and the decision page (nightshift.decision_page:
    `decision_page` says where) go to the training run.

    A champion is compared only with a challenger that can stand in for it: the same task and label column, its
    feature columns in tonight's data, every class it knew still known to the challenger; both are then scored on
    the same split over the same classes. When it cannot be compared or cannot be scored on tonight's data (a
    class it never saw, a label re-encoded, columns gone), the reasons say exactly why, the floor alone does not
    decide: `needs_approval` sends the decision to a person (the pipeline's approval step, whatever
    `require_approval` says), and no such night fails or repeats itself.
    """

    if isinstance(gate, dict):  # plain arguments from a DAG: {"primary": ..., "min_improvement": ..., "task": ...}
        gate = GateConfig(**gate)
    gate = gate or GateConfig()
    task = gate.task
    model_uri = tracking.run_model_uri(run_id)
    challenger_model = _load(model_uri)
    challenger = score(model_uri, data_dir, split, task=task, label_column=label_column, model=challenger_model,
                       positive_class=gate.positive_class,
                       classes=_with_unseen_labels(challenger_model, data_dir, split, task, label_column))
    champion: dict[str, Any] | None = None
    for_a_person: list[str] = []
    current = champion_uri(model_name)
    if current is not None:
        try:
            champion, why_not = _champion_scores(current, challenger_model, challenger, data_dir, split, task,
                                                 label_column, gate.positive_class)
        except Exception as err:  # whatever it is, a champion that cannot be read never wedges the pipeline
            champion, why_not = None, [f"champion v{current[0]} cannot be scored on tonight's data "
                                       f"({type(err).__name__}: {str(err)[:300]})"]
        for_a_person.extend(why_not)
    decision = decide(challenger, champion, gate)
    needs_approval = bool(for_a_person) and bool(decision["passed"])
    if for_a_person:
        # Not passed on its own: whatever reads only `passed` (nightshift register, a script) promotes nothing.
        decision["passed"] = False
        decision["reasons"] = [
            *for_a_person, *decision["reasons"],
            "the decision goes to a person: approve or reject the new model in the approval step" if needs_approval
            else "the challenger is rejected on its own; nothing to approve"]
    decision["needs_approval"] = needs_approval
    result = _log_evaluation(decision, run_id=run_id, model_name=model_name, split=split, task=task,
                             challenger=challenger, champion=champion, gate=gate)
    result["decision_page"] = decision_page.publish(result, data_dir=data_dir, label_column=label_column)
    return result


# A challenger is scored over labels it never saw only while those are under half of the split's rows (a rare class
# tonight's training split lacked); half or more, and the labels are taken as encoded anew: an error naming them.
MIN_KNOWN_LABELS = 0.5


def _with_unseen_labels(model: Any, data_dir: str | Path, split: str, task: str, label_column: str
                        ) -> list[str] | None:
    """For a multiclass challenger: its classes and then any label of the split it never saw (tonight's training
    split lacked a rare class that the test split holds), so that it is scored over both, each row of such a class
    a miss, and a champion that knew the class is not compared with it (a person decides). None otherwise (its own
    classes; score() then refuses labels it does not know, naming them): a binary task, empty labels, or unknown
    labels on half the rows or more."""
    own = _class_names(model) if task == MULTICLASS else None
    if own is None:
        return None
    frame = read_split_frame(data_dir, split)
    if label_column not in frame.columns or frame[label_column].isna().any():
        return None  # score() names what is wrong
    truth = label_names(frame[label_column], own)
    known = np.isin(truth, np.asarray(own, dtype=object))
    if known.mean() <= MIN_KNOWN_LABELS:  # not a rare class: labels encoded anew, or another table (score() says so)
        return None
    extra = sorted(set(truth[~known]))
    return [*own, *extra] if extra else None


def _champion_scores(current: tuple[str, str], challenger_model: Any, challenger: dict[str, Any],
                     data_dir: str | Path, split: str, task: str, label_column: str,
                     positive_class: str | None = None) -> tuple[dict[str, Any] | None, list[str]]:
    """(the champion's scores, or None with the reasons a person must decide instead)."""
    version, uri = current
    for_a_person: list[str] = []
    champion: dict[str, Any] | None = None
    champion_model = _load(uri)
    frame = read_split_frame(data_dir, split)
    why = incomparable(champion_model, challenger_model, task=task, label_column=label_column,
                       data_columns=frame.columns)
    known = _class_names(champion_model) if "classes" in challenger and not why else None
    if known is not None:
        unseen = sorted(set(label_names(frame[label_column], known)) - set(known))
        answers = _class_names(challenger_model) or list(challenger["classes"])  # its own, not the compared set
        dropped = [c for c in known if c not in same_classes(known, answers)]
        if unseen:
            for_a_person.append(f"champion v{version} cannot be scored on tonight's data ({label_column!r} "
                                f"holds {unseen[:5]}, classes it does not know: it knows {known[:10]}; a new "
                                f"class, or labels encoded anew?)")
        elif dropped:
            why = (f"the challenger cannot answer class(es) {dropped[:5]} that the champion knew (tonight's "
                   f"training data has no row of them)")
    if why:
        for_a_person.append(f"champion v{version} is not comparable ({why})")
    if not for_a_person:
        try:
            champion = {"version": version, **score(uri, data_dir, split, task=task, label_column=label_column,
                                                   model=champion_model, classes=challenger.get("classes"),
                                                   positive_class=positive_class)}
        except EvaluationError as err:
            for_a_person.append(f"champion v{version} cannot be scored on tonight's data ({err})")
    broken = [k for k in metric_names(task) if champion and k in champion and not math.isfinite(float(champion[k]))]
    if broken:
        for_a_person.append(f"champion v{version} scores {', '.join(broken)} that are not finite numbers on "
                            f"tonight's data: nothing to compare with")
        champion = None
    return champion, for_a_person


def _log_evaluation(decision: dict[str, Any], *, run_id: str, model_name: str, split: str, task: str,
                    challenger: dict[str, Any], champion: dict[str, Any] | None, gate: GateConfig) -> dict[str, Any]:
    """The evaluation's result, logged to the training run (metrics, tags, confusion matrix, evaluation.json)."""
    import mlflow

    needs_approval = bool(decision.get("needs_approval"))
    drift = challenger.get("drift") or {}
    classification = task != REGRESSION
    result: dict[str, Any] = {
        **decision, "run_id": run_id, "model_name": model_name, "split": split,
        "challenger": challenger, "champion": champion, "gate": asdict(gate),
        "confusion_matrix_artifact": f"evaluation/confusion_matrix_{split}.png" if classification else None,
    }
    metrics = {f"{split}_{k}": challenger[k] for k in metric_names(task)}
    if drift:
        metrics[f"{split}_rows_outside_train_range"] = drift["rows"]
    if classification:
        metrics.update({f"{split}_recall_class_{k}": v for k, v in challenger["per_class_recall"].items()})
        metrics.update({f"{split}_{k}": challenger[k] for k in ("positive_precision", "positive_recall")
                        if k in challenger})
    try:
        with mlflow.start_run(run_id=run_id):
            mlflow.log_metrics(metrics)
            mlflow.set_tags({"nightshift.gate": "passed" if decision["passed"] else "failed",
                             "nightshift.gate_reasons": " | ".join(decision["reasons"])[:5000],
                             "nightshift.needs_approval": str(needs_approval).lower(),
                             **({"nightshift.positive_class": str(challenger["positive_class"])}
                                if "positive_class" in challenger else {}),
                             "nightshift.outside_train_range": json.dumps(drift.get("columns", {}))[:5000]})
            with tempfile.TemporaryDirectory() as tmp:
                if classification:
                    png = confusion_png(challenger["confusion_matrix"],
                                        Path(tmp) / f"confusion_matrix_{split}.png",
                                        f"{model_name} run {run_id[:8]} on {split}")
                    mlflow.log_artifact(str(png), artifact_path="evaluation")
                report = Path(tmp) / "evaluation.json"
                report.write_text(json.dumps(result, indent=2, sort_keys=True))
                mlflow.log_artifact(str(report), artifact_path="evaluation")
    except Exception as err:
        raise EvaluationError(f"logging the evaluation to MLflow run {run_id} failed "
                              f"({type(err).__name__}: {err})") from err
    return result
