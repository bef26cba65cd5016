"""Airflow's own growth, kept to N days: its metadata rows (`airflow db clean`) and its task log files.

Both are global, not a pipeline's: `dags/nightshift_maintenance.py` runs them daily. Nightshift never imports
Airflow, so the rows are cleaned by the `airflow` command of this environment, as a child process:

- `clean_metadata(days)` runs `airflow db clean --clean-before-timestamp <now - days> --skip-archive --yes
  --error-on-cleanup-failure` (Airflow keeps the latest scheduled run of each DAG itself). It never cleans
  closer than the longest `resumable_days` of a declared pipeline: clearing a failed run to resume it needs its
  rows. The cut-off is recorded (nightshift.removals.record_db_clean): the lineage page shows the runs recorded
  before it as cleaned from Airflow instead of a link to a run page that is gone. A failure of the command (its
  exit status, or a table it could not clean) is AirflowCleanFailed with what the command said.
- `prune_logs(folder, days)` removes the files under Airflow's `base_log_folder` last written over `days` ago,
  and the folders that leaves empty. It walks with directory descriptors and never follows a link: a link in
  the folder (to a file or folder anywhere) is neither followed nor removed. A file that cannot be removed is
  LogPruneFailed naming it. A folder that is not a local absolute path (`s3://...`, a relative path), or that holds
  NIGHTSHIFT_HOME, AIRFLOW_HOME or the home folder (`/`, `~`), is LogPruneFailed before anything is removed.

Airflow 3 gives a task process no metadata database (AIRFLOW__DATABASE__SQL_ALCHEMY_CONN is replaced by a
placeholder), so the command gets the database explicitly: NIGHTSHIFT_AIRFLOW_METADATA_CONN when set (a team's
own Airflow), else the process's own setting when it has a real one, else the database scripts/airflow.sh gave
this AIRFLOW_HOME (nightshift.settings.airflow_database; only when the home holds that history: anything else is
AirflowCleanFailed, never a guess).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from nightshift import settings
from nightshift.errors import NightshiftError
from nightshift.redaction import redact

DAY = 86400.0
CONN_ENV = "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"
CLEAN_TIMEOUT_S = 3600


class AirflowCleanFailed(NightshiftError):
    """`airflow db clean` failed, or could not be run."""


class LogPruneFailed(NightshiftError):
    """A task log file or folder past its retention could not be removed."""


def airflow_command() -> str:
    """The `airflow` of this environment (beside this interpreter), else the one on PATH."""
    beside = Path(sys.executable).with_name("airflow")
    found = str(beside) if beside.is_file() else shutil.which("airflow")
    if not found:
        raise AirflowCleanFailed("no `airflow` command beside this Python or on PATH: install apache-airflow in "
                                 "this environment")
    return found


def metadata_url() -> str:
    """The metadata database `airflow db clean` works on (see the module's docstring)."""
    explicit = os.environ.get(settings.AIRFLOW_METADATA_CONN_ENV)
    if explicit:
        return explicit
    given = os.environ.get(CONN_ENV, "")
    if given and not given.startswith(settings.AIRFLOW_DB_BLOCKED):
        return given
    home = settings.airflow_home()
    if not ((home / settings.AIRFLOW_DB_MARKER).is_file() or (home / "airflow.db").is_file()):
        # Not a home scripts/airflow.sh set up: its database was given to Airflow some other way, which a task's
        # process cannot see. Guessing would clean (or make) another database and report success.
        raise AirflowCleanFailed(f"this process has no Airflow metadata database to clean (Airflow 3 hides it from "
                                 f"tasks) and AIRFLOW_HOME {home} holds none that scripts/airflow.sh chose; set "
                                 f"{settings.AIRFLOW_METADATA_CONN_ENV} to the metadata database's SQLAlchemy URL")
    return settings.airflow_database().url


def resume_floor_days(folders: Iterable[str | Path]) -> float:
    """The longest `retention.resumable_days` of the pipelines declared in `folders` and their subfolders (0 when none
    is): Airflow's DAG folder and NIGHTSHIFT_PIPELINES, as the maintenance DAG passes them, read as Airflow loads
    declarations (a stub's declaration may lie beside it in a subfolder)."""
    from nightshift.gc import declared_rules

    # An invalid declaration has no DAG, so no run to resume.
    return max([0.0, *(float(p.resumable_days) for p in declared_rules(folders).policies.values())])


def clean_metadata(days: float, *, floor_days: float = 0.0, dry_run: bool = False, now: datetime | None = None,
                   url: str | None = None) -> dict[str, Any]:
    """Run `airflow db clean` for rows older than `days`, raised to `floor_days` (resume_floor_days() of the
    declarations) when that is longer. Returns {"before", "days", "command", "output"}; AirflowCleanFailed when
    the command fails."""
    days = max(float(days), float(floor_days))
    now = now or datetime.now(UTC)
    url = url or metadata_url()
    before = now - timedelta(days=days)
    held = _held_runs(url, now - timedelta(days=float(floor_days)))
    if held:
        before = min(before, min(started for started, _ in held.values()) - timedelta(seconds=1))
    command = [airflow_command(), "db", "clean", "--clean-before-timestamp", before.isoformat(timespec="seconds"),
               "--skip-archive", "--yes", "--error-on-cleanup-failure", *(["--dry-run"] if dry_run else [])]
    env = {k: v for k, v in os.environ.items() if k != "_AIRFLOW_PROCESS_CONTEXT"}
    env[CONN_ENV] = url
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=CLEAN_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise AirflowCleanFailed(f"`airflow db clean` could not run to its end ({err}); nothing is known to be "
                                 f"cleaned: run the maintenance DAG again") from err
    output = redact((done.stdout + done.stderr).strip())
    if done.returncode != 0:
        tail = "\n".join(output.splitlines()[-15:])
        raise AirflowCleanFailed(f"`airflow db clean --clean-before-timestamp {command[4]}` exited with status "
                                 f"{done.returncode}:\n{tail}")
    if not dry_run:
        from nightshift.removals import record_db_clean

        try:
            record_db_clean(command[4], days)  # the lineage page shows these runs' Airflow links as cleaned
        except OSError as err:
            raise AirflowCleanFailed(f"`airflow db clean` removed the rows of the runs started before {command[4]}, "
                                     f"but recording it for the lineage page failed ({err}): its links to those "
                                     f"runs lead nowhere until the next clean records it") from err
    return {"before": command[4], "days": days, "command": " ".join(command[1:]), "output": output[-4000:],
            "held_by": sorted(f"{dag_id} {run_id} ({state})" for (dag_id, run_id), (_, state) in held.items())}


# A dag run whose rows stay: not finished (running, queued, deferred tasks...), or failed since the resume floor.
HELD_RUNS = """
SELECT dr.dag_id, dr.run_id, dr.state, MIN(COALESCE(ti.start_date, dr.start_date)), MIN(dr.start_date)
FROM dag_run dr LEFT JOIN task_instance ti ON ti.dag_id = dr.dag_id AND ti.run_id = dr.run_id
WHERE dr.state IS NULL OR dr.state NOT IN ('success', 'failed') OR (dr.state = 'failed' AND dr.end_date >= :resume)
GROUP BY dr.dag_id, dr.run_id, dr.state
"""


def _held_runs(url: str, resume: datetime) -> dict[tuple[str, str], tuple[datetime, str]]:
    """(dag_id, run_id) -> (the earliest start of it or of its task instances, its state) for each run `airflow db
    clean` must leave whole: it takes a dag_run and a task_instance by start_date alone, whatever their state
    (airflow/utils/db_cleanup.py), so the cut-off goes before the earliest of them."""
    from sqlalchemy import create_engine, text

    try:
        engine = create_engine(url)
        try:
            with engine.connect() as db:
                rows = db.execute(text(HELD_RUNS), {"resume": resume}).all()
        finally:
            engine.dispose()
    except Exception as err:
        raise AirflowCleanFailed(f"reading the unfinished and resumable runs of the metadata database failed "
                                 f"({type(err).__name__}: {redact(str(err))}); nothing was cleaned: which rows a "
                                 f"resume needs cannot be told") from err
    held = {}
    for dag_id, run_id, state, first_task, started in rows:
        first = min((_aware(t) for t in (first_task, started) if t is not None), default=None)
        if first is not None:
            held[(str(dag_id), str(run_id))] = (first, str(state))
    return held


def _aware(when: Any) -> datetime:
    """A timestamp from the database (SQLite gives naive UTC ones, or text) as an aware datetime."""
    value = when if isinstance(when, datetime) else datetime.fromisoformat(str(when))
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _log_root(folder: str | Path) -> Path:
    """The folder to prune: `folder` (Airflow's base_log_folder) resolved, when it is a local absolute path that
    holds none of the state a rollback, a resume or the lineage page needs; LogPruneFailed otherwise."""
    given = os.path.expanduser(str(folder))
    if "://" in given or not os.path.isabs(given):
        raise LogPruneFailed(f"[logging] base_log_folder {folder!r} is not a local absolute path (a remote logging "
                             f"URL belongs in remote_base_log_folder, and a relative one depends on the folder a "
                             f"task runs in): no task log was pruned; set it to the absolute folder the task logs "
                             f"are written to")
    # The configured folder may itself be a link (onto another disk): walk its target. Below it, no link is followed.
    root = Path(os.path.realpath(given))
    for name, kept in (("NIGHTSHIFT_HOME", settings.home()), ("AIRFLOW_HOME", settings.airflow_home()),
                       ("the home folder", Path.home())):
        if Path(os.path.realpath(kept)).is_relative_to(root):
            raise LogPruneFailed(f"[logging] base_log_folder {folder} holds {name} ({kept}): pruning every file "
                                 f"there unwritten for days would take its run ledgers, dataset versions and "
                                 f"configuration too; no task log was pruned: give the task logs a folder of their "
                                 f"own (Airflow's default is AIRFLOW_HOME/logs)")
    return root


def prune_logs(folder: str | Path, days: float, *, now: float | None = None, dry_run: bool = False) -> dict[str, Any]:
    """Remove the files under `folder` last written over `days` ago, and the folders that leaves empty; links are
    neither followed nor removed. Returns {"folder", "removed", "removed_bytes", "kept", "links"}."""
    root = _log_root(folder)
    if not root.is_dir():
        return {"folder": str(root), "removed": [], "removed_bytes": 0, "kept": 0, "links": 0}
    cutoff = (time.time() if now is None else now) - float(days) * DAY
    removed: list[str] = []
    emptied: set[str] = set()  # folders this call removed something from
    size = kept = links = 0
    # fwalk: every name is looked up relative to its folder's descriptor, and no link is followed (a folder
    # swapped for a link during the walk is not entered).
    for parent, dirs, files, dir_fd in os.fwalk(root, topdown=False, follow_symlinks=False):
        for name in files:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                links += stat.S_ISLNK(st.st_mode)
                continue
            if st.st_mtime >= cutoff:
                kept += 1
                continue
            if not dry_run:
                try:
                    os.unlink(name, dir_fd=dir_fd)
                except FileNotFoundError:
                    continue
                except OSError as err:
                    raise LogPruneFailed(f"removing task log {os.path.join(parent, name)} failed "
                                         f"({err.strerror}); fix its permissions, the maintenance DAG tries "
                                         f"again") from err
            removed.append(os.path.join(parent, name))
            emptied.add(parent)
            size += st.st_size
        for name in dirs:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode):
                links += 1
                continue
            path = os.path.join(parent, name)
            if dry_run or (st.st_mtime >= cutoff and path not in emptied):
                continue  # a new folder may be one a task is about to write its log into
            try:
                os.rmdir(name, dir_fd=dir_fd)
            except OSError as err:
                if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    continue  # files in it are kept
                raise LogPruneFailed(f"removing the empty log folder {path} failed ({err.strerror}); fix its "
                                     f"permissions, the maintenance DAG tries again") from err
            emptied.add(parent)
    return {"folder": str(root), "removed": removed, "removed_bytes": size, "kept": kept, "links": links}

