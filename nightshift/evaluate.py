"""Score the new model and the current `@champion` on the same held-out split, and decide with a gate.

Both models are scored through their MLflow pyfunc (the artifact that would be served) on the raw test
table of the staged dataset, so the evaluation sees exactly what the model server will see.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nightshift import tracking
from nightshift.datasets import read_split_frame
from nightshift.errors import EvaluationError, UsageError

DEFAULT_MODEL_NAME = "nightshift-digits"
LABEL_COLUMN = "label"
# Metrics where a lower value is better; every other metric is higher-is-better.
LOWER_IS_BETTER = frozenset({"log_loss"})
SCALAR_METRICS = ("accuracy", "macro_f1", "log_loss")


@dataclass(frozen=True)
class GateConfig:
    """When a challenger may replace the champion.

    `primary` must improve by at least `min_improvement` over the champion; each guard metric may regress
    by at most its tolerance; with no champion the primary metric must reach `floor`.
    """

    primary: str = "accuracy"
    min_improvement: float = 0.001
    guards: dict[str, float] = field(default_factory=lambda: {"macro_f1": 0.01, "log_loss": 0.05})
    floor: float = 0.8

    def __post_init__(self) -> None:
        for name in (self.primary, *self.guards):
            if name not in SCALAR_METRICS:
                raise UsageError(f"gate metric {name!r} is unknown; use one of {', '.join(SCALAR_METRICS)}")
        if not math.isfinite(self.min_improvement) or self.min_improvement < 0:
            raise UsageError(f"min_improvement must be a finite number >= 0, got {self.min_improvement}")
        for name, tolerance in self.guards.items():
            if not math.isfinite(tolerance) or tolerance < 0:
                raise UsageError(f"guard tolerance for {name} must be >= 0, got {tolerance}")


def _gain(metric: str, new: float, old: float) -> float:
    """How much better `new` is than `old` (positive = better), whatever the metric's direction."""
    return old - new if metric in LOWER_IS_BETTER else new - old


def decide(challenger: dict[str, Any], champion: dict[str, Any] | None, config: GateConfig) -> dict[str, Any]:
    """The gate: {"passed": bool, "reasons": [one sentence per check]} from two metric dicts."""
    reasons: list[str] = []
    passed = True
    primary = config.primary
    value = float(challenger[primary])
    if champion is None:
        ok = (value <= config.floor) if primary in LOWER_IS_BETTER else (value >= config.floor)
        passed &= ok
        reasons.append(f"no champion: {primary} {value:.4f} {'meets' if ok else 'misses'} the floor "
                       f"{config.floor:.4f}")
        return {"passed": passed, "reasons": reasons}
    gain = _gain(primary, value, float(champion[primary]))
    ok = gain >= config.min_improvement
    passed &= ok
    reasons.append(f"{primary} {value:.4f} vs champion {float(champion[primary]):.4f}: improvement "
                   f"{gain:+.4f} {'>=' if ok else '<'} min_improvement {config.min_improvement:.4f}")
    for metric, tolerance in sorted(config.guards.items()):
        gain = _gain(metric, float(challenger[metric]), float(champion[metric]))
        ok = gain >= -tolerance
        passed &= ok
        reasons.append(f"guard {metric} {float(challenger[metric]):.4f} vs champion "
                       f"{float(champion[metric]):.4f}: change {gain:+.4f} "
                       f"{'within' if ok else 'beyond'} tolerance {tolerance:.4f}")
    return {"passed": bool(passed), "reasons": reasons}


def predict_proba(model_uri: str, frame: Any) -> np.ndarray:
    """Class probabilities of the pyfunc at `model_uri` for a raw feature table, in server-sized batches."""
    import mlflow.pyfunc

    try:
        model = mlflow.pyfunc.load_model(model_uri)
    except Exception as err:
        raise EvaluationError(f"cannot load model {model_uri} ({type(err).__name__}: {err}); check the "
                              f"artifact store") from err
    parts = []
    for start in range(0, len(frame), tracking.MAX_ROWS):
        out = model.predict(frame.iloc[start:start + tracking.MAX_ROWS])
        parts.append(out[[c for c in out.columns if c.startswith("prob_")]].to_numpy(np.float64))
    return np.concatenate(parts)


def score(model_uri: str, data_dir: str | Path, split: str = "test") -> dict[str, Any]:
    """Accuracy, macro-F1, log loss, per-class recall and the confusion matrix of one model on one split."""
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, log_loss, recall_score

    frame = read_split_frame(data_dir, split)
    if LABEL_COLUMN not in frame.columns:
        raise EvaluationError(f"{data_dir}/{split}.parquet has no {LABEL_COLUMN!r} column to score against")
    labels = frame[LABEL_COLUMN].to_numpy(np.int64)
    proba = predict_proba(model_uri, frame.drop(columns=[LABEL_COLUMN]))
    classes = list(range(proba.shape[1]))
    predicted = proba.argmax(axis=1)
    recall = recall_score(labels, predicted, labels=classes, average=None, zero_division=0)
    return {
        "model_uri": model_uri,
        "rows": len(labels),
        "accuracy": float(accuracy_score(labels, predicted)),
        "macro_f1": float(f1_score(labels, predicted, labels=classes, average="macro", zero_division=0)),
        "log_loss": float(log_loss(labels, proba / proba.sum(axis=1, keepdims=True), labels=classes)),
        "per_class_recall": {str(k): float(r) for k, r in zip(classes, recall, strict=True)},
        "confusion_matrix": confusion_matrix(labels, predicted, labels=classes).tolist(),
    }


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
             gate: GateConfig | dict[str, Any] | None = None) -> dict[str, Any]:
    """Score the model of training run `run_id` and the current champion; log and return the decision.

    Returns {"passed", "reasons", "run_id", "model_name", "split", "challenger": metrics,
    "champion": metrics + "version" or None, "gate": config, "confusion_matrix_artifact"}. The test
    metrics (prefixed `test_`), the confusion-matrix PNG and `evaluation.json` go to the training run.
    """
    import mlflow

    if isinstance(gate, dict):  # plain arguments from a DAG: {"primary": ..., "min_improvement": ...}
        gate = GateConfig(**gate)
    gate = gate or GateConfig()
    model_uri = tracking.run_model_uri(run_id)
    challenger = score(model_uri, data_dir, split)
    champion: dict[str, Any] | None = None
    current = champion_uri(model_name)
    if current is not None:
        version, uri = current
        champion = {"version": version, **score(uri, data_dir, split)}
    decision = decide(challenger, champion, gate)
    result: dict[str, Any] = {
        **decision, "run_id": run_id, "model_name": model_name, "split": split,
        "challenger": challenger, "champion": champion, "gate": asdict(gate),
        "confusion_matrix_artifact": f"evaluation/confusion_matrix_{split}.png",
    }
    metrics = {f"{split}_{k}": challenger[k] for k in SCALAR_METRICS}
    metrics.update({f"{split}_recall_class_{k}": v for k, v in challenger["per_class_recall"].items()})
    try:
        with mlflow.start_run(run_id=run_id):
            mlflow.log_metrics(metrics)
            mlflow.set_tags({"nightshift.gate": "passed" if decision["passed"] else "failed",
                             "nightshift.gate_reasons": " | ".join(decision["reasons"])[:5000]})
            with tempfile.TemporaryDirectory() as tmp:
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
