"""Where Nightshift keeps its state outside the repository, overridable by environment variables.

`NIGHTSHIFT_HOME` (default `~/.nightshift`) holds, unless set one by one:
- the MLflow tracking store `mlflow.db` and artifacts `mlartifacts/` (`MLFLOW_TRACKING_URI` wins),
- the DVC remote `dvc-remote/` (`NIGHTSHIFT_DVC_REMOTE`),
- per-run workspaces `workspaces/` and checkpoints `checkpoints/`,
- the local serving record `serving/`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("NIGHTSHIFT_HOME", Path.home() / ".nightshift")).expanduser()


def gx_dir() -> Path:
    """The GX file context kept in git: `NIGHTSHIFT_GX_DIR`, else `gx/` next to the `nightshift` package."""
    override = os.environ.get("NIGHTSHIFT_GX_DIR")
    return Path(override) if override else Path(__file__).resolve().parents[1] / "gx"


def data_roots() -> list[Path]:
    """Where a run's `data_source` may lie: NIGHTSHIFT_DATA_ROOTS (paths separated by ':'), else the demo
    data and `data/` under NIGHTSHIFT_HOME."""
    configured = [Path(p).expanduser() for p in os.environ.get("NIGHTSHIFT_DATA_ROOTS", "").split(os.pathsep) if p]
    return configured or [home() / "demo-data", home() / "data"]


def confined_data_source(data_source: str | Path, roots: Sequence[str | Path] | None = None) -> Path:
    """`data_source` resolved (symlinks too), or UsageError when it, or anything under it, lies outside every
    data root: each file and directory below a directory source is resolved too, so a `train.parquet` that
    links out of the roots is refused like the directory would be, and so is a link that loops.

    `roots`: the allowed roots; `data_roots()` when not given.

    A trigger form is a way in for anyone who may trigger the DAG: it must not make the worker read
    (and report sample values of) files it was never meant to serve as training data.
    """
    from nightshift.errors import UsageError
    from nightshift.redaction import redact

    shown = redact(str(data_source))  # a URL typed into the trigger form may carry a key: never echo it

    def resolved(entry: Path, name: str) -> Path:
        try:
            return entry.resolve()
        except (RuntimeError, OSError) as err:  # Python 3.11 raises RuntimeError for a symlink loop
            raise UsageError(f"data_source {shown}: {name} is a symbolic link loop or cannot be resolved "
                             f"({err}); remove or fix the link") from err

    path = resolved(Path(data_source).expanduser(), shown)
    configured = [Path(root).expanduser() for root in roots] if roots is not None else data_roots()
    allowed_roots = [root.resolve() for root in configured]
    allowed = ", ".join(str(root) for root in configured)
    if not any(path.is_relative_to(root) for root in allowed_roots):
        raise UsageError(f"data_source {shown} is outside the allowed data roots ({allowed}); put the data "
                         f"under one of them, or add its directory to NIGHTSHIFT_DATA_ROOTS")
    if path.is_dir():
        # os.walk does not descend into symlinked directories: each link is judged by where it resolves to.
        for parent, dirs, files in os.walk(path):
            for name in sorted([*dirs, *files]):
                entry = Path(parent) / name
                target = resolved(entry, str(entry.relative_to(path)))
                if not any(target.is_relative_to(root) for root in allowed_roots):
                    raise UsageError(f"data_source {shown}: {entry.relative_to(path)} is a link to {target}, "
                                     f"outside the allowed data roots ({allowed}); copy the file under a data root "
                                     f"instead of linking to it")
    return path


def mlflow_tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home() / 'mlflow.db'}"


def mlflow_artifact_root() -> str:
    return os.environ.get("NIGHTSHIFT_MLFLOW_ARTIFACTS") or str(home() / "mlartifacts")


def dvc_remote() -> str:
    return os.environ.get("NIGHTSHIFT_DVC_REMOTE") or str(home() / "dvc-remote")


def dvc_remote_exclusive() -> bool:
    """NIGHTSHIFT_DVC_REMOTE_EXCLUSIVE=1: the DVC remote holds only what this machine's staging pushed, so `nightshift
    gc` may remove dataset versions from it. Unset (the default), gc collects the staging cache only: a remote is
    often shared (the repository's `.dvc/config` names `~/.nightshift/dvc-remote`, the default remote, and the
    demo's `dvc repro` output has the very `.dir` that staging it gives), and an object removed there is lost to
    every `dvc pull` that names it, which no registry or ledger of this machine can tell."""
    from nightshift.errors import UsageError

    given = os.environ.get("NIGHTSHIFT_DVC_REMOTE_EXCLUSIVE", "").strip()
    if given not in ("", "0", "1"):
        raise UsageError(f"NIGHTSHIFT_DVC_REMOTE_EXCLUSIVE={given} is not 0 or 1; set 1 only when nothing but this "
                         f"machine's staging pushes to NIGHTSHIFT_DVC_REMOTE")
    return given == "1"


def workspaces_dir() -> Path:
    return Path(os.environ.get("NIGHTSHIFT_WORKSPACES") or home() / "workspaces")


def checkpoints_dir() -> Path:
    return Path(os.environ.get("NIGHTSHIFT_CHECKPOINTS") or home() / "checkpoints")


# A DAG id that may name a folder: Airflow's characters (letters, digits, '_', '.', '-'; at most 250), starting
# with a letter, a digit or '_', so never '.', '..' or an option, and without '/', so it never leaves its parent.
DAG_ID_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,249}")


def checked_dag_id(dag_id: object) -> str:
    """`dag_id` unchanged, or DagIdInvalid: it is joined into paths (the run ledger, Data Docs), and a page
    takes it from a query parameter."""
    from nightshift.errors import DagIdInvalid

    if not isinstance(dag_id, str) or not DAG_ID_PATTERN.fullmatch(dag_id):
        shown = repr(dag_id) if len(repr(dag_id)) <= 80 else repr(dag_id)[:77] + "..."
        raise DagIdInvalid(f"{shown} is not a DAG id: use 1 to 250 letters, digits, '_', '.' or '-', starting "
                           f"with a letter, a digit or '_' (e.g. nightly_retrain)")
    return dag_id


def data_docs_dir() -> Path:
    """The GX Data Docs site: validation pages, one folder per validation."""
    return home() / "gx" / "data_docs"


PIPELINE_DOCS = "pipelines"  # data_docs/pipelines/<dag_id>/: the pages of that DAG's runs


def pipeline_data_docs_dir(dag_id: str) -> Path:
    """The Data Docs of one DAG's validations: the plugin serves them to those who may read that DAG's runs
    (a page holds sample values of the DAG's data); pages outside `pipelines/` (`nightshift validate`'s, and
    those written before pages had an owner) count as `nightly_retrain`'s."""
    return data_docs_dir() / PIPELINE_DOCS / checked_dag_id(dag_id)


def serving_dir() -> Path:
    return Path(os.environ.get("NIGHTSHIFT_SERVING") or home() / "serving")


# --- the cluster contract ----------------------------------------------------------------------------
# On Kubernetes, NIGHTSHIFT_HOME lies on one ReadWriteMany volume mounted at the same path in the
# Airflow workers and in every trainer pod: workspaces (the staged dataset version, the trained
# model) and checkpoints are then the same files on both sides. Results come back through MLflow.

DEFAULT_SHARED_CLAIM = "nightshift-workspace"


def shared_volume_claim() -> str:
    """The PersistentVolumeClaim (ReadWriteMany) holding NIGHTSHIFT_HOME on the cluster."""
    return os.environ.get("NIGHTSHIFT_SHARED_PVC") or DEFAULT_SHARED_CLAIM


def cluster_mlflow_tracking_uri() -> str:
    """The tracking URI trainer pods log to: NIGHTSHIFT_CLUSTER_MLFLOW_URI (an in-cluster address of the
    same server), else the one this process uses."""
    return os.environ.get("NIGHTSHIFT_CLUSTER_MLFLOW_URI") or mlflow_tracking_uri()


# What the libraries Nightshift drives would otherwise send home. Set (unless the user set them) by the
# entry points and right before GX or DVC is first used, never as a side effect of an import.
NO_TELEMETRY = {"GX_ANALYTICS_ENABLED": "false", "DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
                "DO_NOT_TRACK": "true"}


def no_telemetry() -> None:
    for name, value in NO_TELEMETRY.items():
        os.environ.setdefault(name, value)


# --- Airflow's metadata database -------------------------------------------------------------------------
# One decision, taken here for `scripts/airflow.sh` (every command) and `make demo` alike, so that the same
# NIGHTSHIFT_HOME (its AIRFLOW_HOME) gets the same metadata database from both. NIGHTSHIFT_AIRFLOW_DB:
#   auto (default)  PostgreSQL (database airflow_pg_database_name() on NIGHTSHIFT_POSTGRES_URL) when the server
#                   answers, made when missing; SQLite $AIRFLOW_HOME/airflow.db when it does not answer (said so),
#                   or when the home already has a SQLite history and no PostgreSQL database (said so: its runs
#                   stay in view). A home whose history is on PostgreSQL (AIRFLOW_DB_MARKER) fails instead of
#                   starting a second history on SQLite while the server is down.
#   postgres        PostgreSQL, made when missing; an error when the server does not answer.
#   sqlite          SQLite $AIRFLOW_HOME/airflow.db.
# An AIRFLOW__DATABASE__SQL_ALCHEMY_CONN the user set wins over all of these; nothing is made.

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432"
AIRFLOW_DB_MARKER = "nightshift-airflow-db"  # in AIRFLOW_HOME: the PostgreSQL database this home's history is in
_PG_NAME = r"[A-Za-z_][A-Za-z0-9_]{0,62}"


def airflow_home() -> Path:
    """AIRFLOW_HOME, else NIGHTSHIFT_HOME/airflow-home, as an absolute path."""
    return Path(os.path.abspath(Path(os.environ.get("AIRFLOW_HOME") or home() / "airflow-home").expanduser()))


def postgres_server_url() -> str:
    """The PostgreSQL server Airflow's metadata database lives on (a libpq URL; its database part is ignored)."""
    return os.environ.get("NIGHTSHIFT_POSTGRES_URL") or DEFAULT_POSTGRES_URL


def airflow_pg_database_name(airflow_home: Path) -> str:
    """NIGHTSHIFT_AIRFLOW_PG_DB, else `nightshift_airflow` for the default AIRFLOW_HOME and
    `nightshift_airflow_<sha1 of AIRFLOW_HOME, 8 hex>` for another: a database belongs to one AIRFLOW_HOME (its
    Fernet key, logs, passwords), and two homes never share one by accident."""
    import hashlib
    import re

    from nightshift.errors import UsageError

    given = os.environ.get("NIGHTSHIFT_AIRFLOW_PG_DB")
    if given:
        if not re.fullmatch(_PG_NAME, given):
            raise UsageError(f"NIGHTSHIFT_AIRFLOW_PG_DB={given} is not a plain PostgreSQL database name "
                             "(letters, digits, _; at most 63)")
        return given
    where = os.path.abspath(Path(airflow_home).expanduser())
    if where == os.path.abspath(Path.home() / ".nightshift" / "airflow-home"):
        return "nightshift_airflow"
    return "nightshift_airflow_" + hashlib.sha1(where.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class AirflowDatabase:
    """Airflow's metadata database for one AIRFLOW_HOME: `url` is AIRFLOW__DATABASE__SQL_ALCHEMY_CONN."""

    kind: str  # postgres, sqlite, or given (AIRFLOW__DATABASE__SQL_ALCHEMY_CONN as the user set it)
    url: str
    name: str | None = None  # the PostgreSQL database
    created: bool = False  # this call made the PostgreSQL database
    note: str = ""  # what it is, and why when it is not the obvious choice (one line)
    noteworthy: bool = False  # a fallback, a kept SQLite history, or a database just made: worth saying


def _pg_shown(server: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(server).set(database=None).render_as_string(hide_password=True)


def _pg_error(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def airflow_database(where: Path | None = None) -> AirflowDatabase:
    """The metadata database for the AIRFLOW_HOME `where` (default: airflow_home()), as NIGHTSHIFT_AIRFLOW_DB says; a
    PostgreSQL database is made when missing (two callers at once both get it, one of them `created`).
    UsageError (one line: what, and what to do) when it cannot be had."""
    from nightshift.errors import UsageError

    where = Path(where) if where is not None else airflow_home()
    given = os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN")
    if given and not given.startswith(AIRFLOW_DB_BLOCKED):
        return AirflowDatabase("given", given, note="AIRFLOW__DATABASE__SQL_ALCHEMY_CONN as given")
    sqlite_file = Path(os.path.abspath(where.expanduser())) / "airflow.db"
    sqlite_url = f"sqlite:///{sqlite_file}"
    wanted = os.environ.get("NIGHTSHIFT_AIRFLOW_DB") or "auto"
    if wanted not in ("auto", "postgres", "sqlite"):
        raise UsageError(f"NIGHTSHIFT_AIRFLOW_DB={wanted} is not one of auto, postgres, sqlite")
    if wanted == "sqlite":
        return AirflowDatabase("sqlite", sqlite_url, note=f"SQLite {sqlite_file}")
    name = airflow_pg_database_name(where)
    server = postgres_server_url()
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(server)
        if url.get_backend_name() != "postgresql":
            raise ValueError(f"it names {url.get_backend_name()}")
        url = url.set(drivername="postgresql+psycopg", database=name)
    except (ArgumentError, ValueError) as err:
        raise UsageError(f"NIGHTSHIFT_POSTGRES_URL is not a PostgreSQL URL like {DEFAULT_POSTGRES_URL}: "
                         f"{_pg_error(err)}") from None
    shown = _pg_shown(server)
    marker = where / AIRFLOW_DB_MARKER
    import psycopg
    from psycopg import errors, sql

    try:
        conn = psycopg.connect(server, dbname="postgres", connect_timeout=3, autocommit=True)
    except psycopg.Error as err:
        if wanted == "postgres":
            raise UsageError(f"NIGHTSHIFT_AIRFLOW_DB=postgres but PostgreSQL at {shown} does not answer "
                             f"({_pg_error(err)}); start it, or use NIGHTSHIFT_AIRFLOW_DB=sqlite") from None
        if marker.is_file():
            raise UsageError(f"this home's Airflow history is in PostgreSQL database {marker.read_text().strip()} "
                             f"at {shown}, which does not answer ({_pg_error(err)}); start PostgreSQL, or set "
                             f"NIGHTSHIFT_AIRFLOW_DB=sqlite to run on SQLite {sqlite_file} (a separate "
                             "history)") from None
        return AirflowDatabase("sqlite", sqlite_url, noteworthy=True,
                               note=f"SQLite {sqlite_file} (PostgreSQL at {shown} does not answer: "
                                    f"{_pg_error(err)})")
    created = False
    try:
        with conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None
            if not exists and wanted == "auto" and sqlite_file.exists() and not marker.is_file():
                return AirflowDatabase(
                    "sqlite", sqlite_url, noteworthy=True,
                    note=f"SQLite {sqlite_file} (this home's history; PostgreSQL answers at {shown}: "
                         f"NIGHTSHIFT_AIRFLOW_DB=postgres starts a new history in database {name})")
            if not exists:
                try:
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
                    created = True
                except (errors.DuplicateDatabase, errors.UniqueViolation):
                    pass  # another command made it meanwhile
    except psycopg.Error as err:
        raise UsageError(f"cannot make PostgreSQL database {name} at {shown}: {_pg_error(err)}; create it "
                         f"(CREATE DATABASE {name}), or point NIGHTSHIFT_POSTGRES_URL at a role that may") from None
    where.mkdir(parents=True, exist_ok=True)
    marker.write_text(name + "\n")
    return AirflowDatabase("postgres", url.render_as_string(hide_password=False), name, created,
                           note=f"PostgreSQL database {name} at {shown}" + (" (created)" if created else ""),
                           noteworthy=created)


def airflow_database_for_shell() -> None:
    """For scripts/airflow.sh: airflow_database() as four lines (kind name created noteworthy; url; note), or
    its error on one line of stderr and exit status 2."""
    import sys

    from nightshift.errors import NightshiftError

    try:
        db = airflow_database()
    except NightshiftError as err:
        print(f"scripts/airflow.sh: {err}", file=sys.stderr)
        sys.exit(2)
    print(db.kind, db.name or "-", int(db.created), int(db.noteworthy))
    print(db.url)
    print(db.note)


def drop_airflow_pg_database(name: str, where: Path | None = None) -> None:
    """Drop PostgreSQL database `name` (made for a throwaway AIRFLOW_HOME `where`, default airflow_home()) and
    forget it there, so that the home no longer claims a PostgreSQL history."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(postgres_server_url(), dbname="postgres", connect_timeout=10, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    marker = (Path(where) if where is not None else airflow_home()) / AIRFLOW_DB_MARKER
    if marker.is_file() and marker.read_text().strip() == name:
        marker.unlink()


# --- Airflow's own growth (dags/nightshift_maintenance.py runs nightshift.maintenance daily) ----------------------
# NIGHTSHIFT_AIRFLOW_DB_RETENTION_DAYS   metadata rows (`airflow db clean`) older than this go (default 30; never
#                                        fewer than the longest resumable_days of a declared pipeline)
# NIGHTSHIFT_AIRFLOW_LOG_RETENTION_DAYS  task log files under Airflow's base_log_folder older than this go (30)
# NIGHTSHIFT_MAINTENANCE_SCHEDULE        the maintenance DAG's schedule (default @daily; "none": by hand only)
# NIGHTSHIFT_AIRFLOW_METADATA_CONN       the metadata database URL for `airflow db clean` where the task's process
#                                        cannot know it (Airflow 3 hides it from tasks; see nightshift.maintenance)
AIRFLOW_DB_BLOCKED = "airflow-db-not-allowed"  # what Airflow 3 puts in a task process's SQL_ALCHEMY_CONN
AIRFLOW_METADATA_CONN_ENV = "NIGHTSHIFT_AIRFLOW_METADATA_CONN"
DEFAULT_AIRFLOW_RETENTION_DAYS = 30.0


def _days(env: str, default: float) -> float:
    from nightshift.errors import UsageError

    given = os.environ.get(env, "").strip()
    if not given:
        return default
    try:
        value = float(given)
    except ValueError:
        value = float("nan")
    if not value >= 1:
        raise UsageError(f"{env}={given} is not a number of days of at least 1; unset it for {default:g} days")
    return value


def airflow_db_retention_days() -> float:
    return _days("NIGHTSHIFT_AIRFLOW_DB_RETENTION_DAYS", DEFAULT_AIRFLOW_RETENTION_DAYS)


def airflow_log_retention_days() -> float:
    return _days("NIGHTSHIFT_AIRFLOW_LOG_RETENTION_DAYS", DEFAULT_AIRFLOW_RETENTION_DAYS)


def maintenance_schedule() -> str | None:
    given = os.environ.get("NIGHTSHIFT_MAINTENANCE_SCHEDULE", "").strip() or "@daily"
    return None if given.lower() == "none" else given
