"""The best configuration a search found, where training reads its defaults: `search/best.json`.

Written atomically under NIGHTSHIFT_HOME with its lineage (study, storage, trial, MLflow parent and
trial runs, data) and a version that grows by one whenever the content changes; every version is kept
beside it as `search/best-v<N>.json`. Writing the same best again changes nothing, so a retried task or
a re-run search does not bump the version.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nightshift import settings
from nightshift.fsutil import atomic_write_json


def best_path() -> Path:
    return settings.home() / "search" / "best.json"


def read_best(path: Path | None = None) -> dict[str, Any] | None:
    """The current best configuration, or None when no search has written one."""
    path = path or best_path()
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return value if isinstance(value, dict) else None


def write_best(record: dict[str, Any], path: Path | None = None) -> dict[str, Any]:
    """Write `record` (without version and time) as the new best; return what is in the file now."""
    path = path or best_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    current = read_best(path)
    if current is not None and {k: v for k, v in current.items() if k not in ("version", "written_at")} == record:
        return current
    version = int(current.get("version", 0)) + 1 if current else 1
    payload = {**record, "version": version, "written_at": datetime.now(UTC).isoformat(timespec="seconds")}
    atomic_write_json(path.with_name(f"best-v{version}.json"), payload)
    atomic_write_json(path, payload)
    return payload


def best_record(report: dict[str, Any], *, storage: str, data: str, max_epochs: int, train_options: dict[str, Any],
                mlflow: dict[str, Any]) -> dict[str, Any]:
    """The content of best.json for a study report whose best trial is `report["best"]`."""
    best = report["best"]
    return {
        "study": report["study"],
        "storage": storage,
        "trial": best["trial"],
        "objective": report["objective"],
        "value": best["value"],
        "params": best["params"],
        # What a training run passes to the trainer to train this configuration (epochs: max_epochs).
        "train_options": {**train_options, "epochs": max_epochs},
        "data": data,
        "mlflow": mlflow,
    }
