"""The season's oracle: what each night should have ended in, judged without the pipeline's gate.

The gate (nightshift.evaluate) scores the challenger and the champion on the night's own test split. The oracle
never reads the gate's numbers or its decision. It knows what the season script wrote (bench.season.script):

- a night whose data breaks the dataset's documented contract (a schema break, NaNs, a class gone, values beyond
  0..16) must be refused by the data gate: `failed:validate_data`, and none of its bytes staged;
- a night whose bytes are those the last successful run trained on must skip training: `skipped`;
- a night whose DVC remote is unwritable cannot version its data: `failed:stage_dataset`, with its reason;
- any other night trains, and the oracle scores the night's challenger and the champion it ran against on the
  golden table (400 digits images no night ever holds, seen in that night's world, true labels) with its own code
  (the models' MLflow pyfunc, accuracy counted here): `promoted` when the challenger is better by at least BAND,
  `refused` when worse by at least BAND, either (`promoted|refused`) in between, where two judges scoring on two
  tables of a few hundred rows may disagree. With no champion yet, `promoted` when the challenger reaches the
  gate's floor on the golden table.

Faults change none of this: the pipeline is meant to recover from each (retries, resumes, restarts), so a night
with a fault is expected to end as the same night without it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

# How far apart the golden table's accuracy gain and the gate's may land by sampling alone: the sd of an accuracy
# difference between two models disagreeing on 5% of 400 rows is ~0.011, and the gate's test split adds as much.
BAND = 0.03
# The most the champion's golden accuracy may drop at a promotion: the gate promotes on a gain of 0.001 on a
# test split of ~360 rows, so a promotion within sampling noise of the champion is by design; beyond this it is not.
TOLERANCE = 0.03
FLOOR = 0.8  # the gate's floor for a first model (pipelines/digits.yaml)
EITHER = "promoted|refused"


def expected_by_data(*, valid: bool, digests: dict[str, str], trained_on: dict[str, str] | None,
                     fault: str | None) -> str | None:
    """The decision the night's data and fault alone say, or None when the models decide (`expected_by_model`).

    `trained_on`: the split digests of the data the last successful run read (None before any)."""
    if not valid:
        return "failed:validate_data"
    if trained_on is not None and digests == trained_on:
        return "skipped"
    if fault == "dvc_remote_unwritable":
        return "failed:stage_dataset"
    return None


def expected_by_model(challenger: float, champion: float | None) -> str:
    """From golden-table accuracies: promoted, refused, or either within BAND."""
    if champion is None:
        return "promoted" if challenger >= FLOOR else "refused"
    gain = challenger - champion
    if gain >= BAND:
        return "promoted"
    if gain <= -BAND:
        return "refused"
    return EITHER


def matches(actual: str, expected: str) -> bool:
    return actual in expected.split("|")


def decision_of(record: dict[str, Any] | None) -> str:
    """The night's decision from its ledger record: nightshift.season's kinds, a failure with its task."""
    from nightshift.season import decision

    if record is None:
        return "no record"
    kind = decision(record)
    return f"failed:{record.get('failed_task')}" if kind == "failed" else kind


# A record of each kind holds these (dags/nightly_tasks/steps.py report and failure_summary): the lineage page,
# the change check and retention read them.
COMPLETE = {
    "any": ("dag_id", "run_id", "status", "outcome", "recorded_at"),
    "success": ("dataset_version", "dataset_source", "dataset_rows", "code_version", "training", "model_name"),
    "trained": ("mlflow_run_id", "train_metrics", "gate"),
    "promoted": ("model_version", "serving_url", "deploy_status"),
    "failed": ("failed_task", "reason"),
}


def lineage_gaps(record: dict[str, Any], version_tags: dict[str, str] | None = None) -> list[str]:
    """What a night's ledger record (and its registered version's tags) lack; [] when the lineage row is whole."""
    wanted = list(COMPLETE["any"])
    decision = decision_of(record)
    if record.get("status") == "success":
        wanted += COMPLETE["success"]
        if decision in ("promoted", "refused"):
            wanted += COMPLETE["trained"]
        if decision == "promoted":
            wanted += COMPLETE["promoted"]
    else:
        wanted += COMPLETE["failed"]
    gaps = [key for key in wanted if record.get(key) in (None, "", [], {})]
    if decision == "promoted":
        tags = version_tags or {}
        for key, value in (("nightshift.dataset_version", record.get("dataset_version")),
                           ("nightshift.dag_run_id", record.get("run_id"))):
            if tags.get(key) != value:
                gaps.append(f"version tag {key}={tags.get(key)!r}, record says {value!r}")
    return gaps


@dataclass
class Scores:
    """Golden-table accuracies of a night's models (None where there is no such model)."""

    challenger: float | None = None
    champion_before: float | None = None
    champion_after: float | None = None

    def drop(self) -> float | None:
        """How much the champion's golden accuracy fell this night (a promotion's doing; 0 when it did not move)."""
        if self.champion_before is None or self.champion_after is None:
            return None
        return self.champion_before - self.champion_after


def accuracy(predicted: Any, labels: Any) -> float:
    import numpy as np

    predicted, labels = np.asarray(predicted).astype(int), np.asarray(labels).astype(int)
    if len(predicted) != len(labels) or not len(labels):
        return math.nan
    return float((predicted == labels).mean())


class GoldenScorer:
    """Scores MLflow models (pyfunc, as served) on golden tables; models are loaded once each."""

    def __init__(self, tracking_uri: str) -> None:
        self.tracking_uri = tracking_uri
        self._models: dict[str, Any] = {}
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no bar per model loaded

    def model(self, uri: str) -> Any:
        if uri not in self._models:
            import warnings

            import mlflow

            from nightshift.tracking import point_mlflow

            # not mlflow.set_tracking_uri alone: it exports MLFLOW_TRACKING_URI, which pointed every later test of
            # the same pytest worker at this season's store, deleted with the season (rehearsal 14: 31 tests of
            # test_deploy_kserve/test_kserve_faults, "attempt to write a readonly database")
            point_mlflow(self.tracking_uri)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # MLflow's advice on type hints, once per model
                self._models[uri] = mlflow.pyfunc.load_model(uri)
        return self._models[uri]

    def predict(self, uri: str, table: Any) -> Any:
        import warnings

        features = table.drop(columns=["label"])
        model = self.model(uri)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            out = model.predict(features)
        column = out["predicted_label"] if hasattr(out, "columns") else out
        return [int(v) for v in column]

    def score(self, uri: str, table: Any) -> float:
        return accuracy(self.predict(uri, table), table["label"])
