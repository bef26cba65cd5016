"""The removal log: what `nightshift gc` removed of a pipeline, when and why, one JSON line per item.

`NIGHTSHIFT_HOME/airflow/<dag_id>/removed.jsonl`, beside the run ledger. The lineage page draws a link for a run's
MLflow run and decision page; once gc removed one, the page reads it here and shows it as removed (when, and the
retention rule that let it go) instead of a link that answers 404, and the plugin's decision-page route answers
410 with the same words. It is also the answer to "where did my workspace go?". Never collected (a line per
removed item: a few hundred bytes a night). Standard library only (the Airflow plugin imports it).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nightshift.ledger import ledgers_dir
from nightshift.settings import checked_dag_id

LOG_NAME = "removed.jsonl"


def log_path(dag_id: str) -> Path:
    """NIGHTSHIFT_HOME/airflow/<dag_id>/removed.jsonl; DagIdInvalid for a dag_id that would name another folder."""
    return ledgers_dir() / checked_dag_id(dag_id) / LOG_NAME


def append(dag_id: str, entries: Iterable[dict[str, Any]]) -> None:
    """Append one line per removed item (kind, what, run_id, mlflow_run_id, size, reason), stamped `removed_at`,
    under an exclusive lock, flushed to disk."""
    now = datetime.now(UTC).isoformat(timespec="seconds")
    lines = [json.dumps({"removed_at": now, **entry}, sort_keys=True, default=str) for entry in entries]
    if not lines:
        return
    path = log_path(dag_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            end = handle.seek(0, os.SEEK_END)
            torn = end > 0 and handle.seek(end - 1) >= 0 and handle.read(1) != b"\n"
            handle.write((("\n" if torn else "") + "\n".join(lines) + "\n").encode())
            handle.flush()
            os.fsync(handle.fileno())
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def read(dag_id: str) -> list[dict[str, Any]]:
    """Every entry, oldest first; a torn line (a crash while appending) is skipped: the log only explains."""
    try:
        lines = log_path(dag_id).read_text().splitlines()
    except FileNotFoundError:
        return []
    entries = []
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def removed_links(dag_id: str) -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, MLflow run id) -> its newest removal entry, for the kinds the lineage page links: `mlflow_run` and
    `decision_page`."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for entry in read(dag_id):
        kind, run = entry.get("kind"), entry.get("mlflow_run_id")
        if kind in ("mlflow_run", "decision_page") and isinstance(run, str):
            found[(kind, run)] = entry
    return found


def readable_when(value: Any) -> str:
    """An ISO time as '2026-11-22 02:03 UTC'; anything else as it is ('an unknown date' when empty)."""
    when = str(value or "")
    try:
        moment = datetime.fromisoformat(when)
    except ValueError:
        return when or "an unknown date"
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def describe(entry: dict[str, Any]) -> str:
    """'removed by nightshift gc on 2026-11-22 02:03 UTC: <reason>'."""
    return f"removed by nightshift gc on {readable_when(entry.get('removed_at'))}: {entry.get('reason') or 'retention'}"


# ---- Airflow's own rows: the lineage page's link to a run's Airflow page -------------------------------------

DB_CLEAN_NAME = "airflow-db-clean.json"


def db_clean_path() -> Path:
    return ledgers_dir() / DB_CLEAN_NAME


def record_db_clean(before: str, days: float) -> None:
    """Say that `airflow db clean` removed the metadata rows of the runs started before `before` (ISO time): the
    lineage page then shows the older runs' Airflow links as cleaned. Written atomically."""
    from nightshift.fsutil import atomic_write_bytes

    path = db_clean_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = {"before": before, "days": days, "cleaned_at": datetime.now(UTC).isoformat(timespec="seconds")}
    atomic_write_bytes(path, (json.dumps(stamp, sort_keys=True) + "\n").encode())


def db_cleaned() -> dict[str, Any] | None:
    """The last record_db_clean's {"before", "days", "cleaned_at"} with `before` an aware datetime, or None."""
    try:
        stamp = json.loads(db_clean_path().read_text())
        before = datetime.fromisoformat(str(stamp["before"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {**stamp, "before": before if before.tzinfo else before.replace(tzinfo=UTC)}


def airflow_run_cleaned(record: dict[str, Any], cleaned: dict[str, Any] | None) -> bool:
    """Whether `airflow db clean` took the Airflow rows of the run of ledger `record`: it was recorded (so it ended,
    hence started) before the last clean's cut-off."""
    if cleaned is None:
        return False
    try:
        recorded = datetime.fromisoformat(str(record.get("recorded_at")))
    except ValueError:
        return False
    return (recorded if recorded.tzinfo else recorded.replace(tzinfo=UTC)) < cleaned["before"]
