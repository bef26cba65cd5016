"""Shared by the Airflow integration tests: the project's Airflow environment (from scripts/demo.py), the
metadata database a test module runs Airflow on, and the services it may need (PostgreSQL, Redis)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HOST = "127.0.0.1"
# The server scripts/airflow.sh uses (NIGHTSHIFT_POSTGRES_URL): trust auth on the project's machines.
POSTGRES_URL = os.environ.get("NIGHTSHIFT_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432")
REDIS_URL = os.environ.get("NIGHTSHIFT_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def demo_module() -> ModuleType:
    from scripts import demo

    return demo


def stop_model_server(env: dict[str, str], model_name: str | None = None, *, bin_dir: Path = BIN) -> None:
    """Stop the local model server a run deployed for `model_name` (default: the demo's), by the PID in its
    serving record, if any; with the `nightshift` of `bin_dir` (another installation's)."""
    model = ["--model-name", model_name] if model_name else []
    subprocess.run([str(bin_dir / "nightshift"), "deploy", "--stop", *model], env=env, capture_output=True,
                   timeout=120, check=False)


def registered_versions(nightshift_home: Path, model_name: str = "nightshift-digits") -> list[str]:
    """Versions of `model_name` in the run's MLflow registry, read in a child (fresh tracking URI)."""
    code = (
        "import json\nfrom mlflow import MlflowClient\n"
        f"c = MlflowClient(tracking_uri='sqlite:///{nightshift_home / 'mlflow.db'}')\n"
        f"print(json.dumps(sorted(v.version for v in c.search_model_versions(\"name = '{model_name}'\"))))"
    )
    if not (nightshift_home / "mlflow.db").exists():
        return []
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    import json

    return [str(v) for v in json.loads(out.stdout.strip().splitlines()[-1])]


# --- processes ------------------------------------------------------------------------------------------


def stop_group(proc: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """TERM the process group we started (its leader is `proc`, started with start_new_session), then KILL
    what is left of the group."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def stop_groups(procs: Iterable[subprocess.Popen[bytes]], grace: float = 30.0) -> None:
    """stop_group for several process groups at once: TERM them all, wait for them together, KILL what is left."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    for proc in procs:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


# --- services -------------------------------------------------------------------------------------------


def postgres_answers(url: str = POSTGRES_URL) -> bool:
    import psycopg

    try:
        psycopg.connect(url, dbname="postgres", connect_timeout=3).close()
    except psycopg.OperationalError:
        return False
    return True


def redis_answers(url: str = REDIS_URL) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=3).ping())
    except redis.RedisError:
        return False


def _admin(statement: Any, url: str) -> None:
    import psycopg

    with psycopg.connect(url, dbname="postgres", connect_timeout=10, autocommit=True) as conn:
        conn.execute(statement)


def database_url(name: str, *, server: str = POSTGRES_URL, driver: str = "postgresql+psycopg") -> str:
    """A SQLAlchemy URL of database `name` on `server` (psycopg 3: SQLAlchemy's bare postgresql:// is psycopg2)."""
    from sqlalchemy.engine import make_url

    return make_url(server).set(drivername=driver, database=name).render_as_string(hide_password=False)


@contextmanager
def postgres_database(prefix: str = "nightshift_test", *, server: str = POSTGRES_URL) -> Iterator[str]:
    """A fresh database `<prefix>_<random>` on the server; yields its name; dropped afterwards, also on failure
    (WITH (FORCE): connections a killed process left open do not keep it)."""
    from psycopg import sql

    name = f"{prefix}_{secrets.token_hex(4)}"
    _admin(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)), server)
    try:
        yield name
    finally:
        _admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)), server)


def postgres_database_exists(name: str, *, server: str = POSTGRES_URL) -> bool:
    import psycopg

    with psycopg.connect(server, dbname="postgres", connect_timeout=10) as conn:
        return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None


@dataclass
class AirflowDatabase:
    """The metadata database of one test module's Airflow: what scripts/airflow.sh is told (`env`)."""

    kind: str  # postgres or sqlite
    env: dict[str, str] = field(default_factory=dict)
    name: str | None = None  # the PostgreSQL database

    def describe(self) -> str:
        return f"PostgreSQL database {self.name}" if self.kind == "postgres" else "SQLite"


def wanted_airflow_db() -> str:
    """NIGHTSHIFT_AIRFLOW_DB (auto, postgres, sqlite) resolved for the tests: auto is postgres when it answers."""
    wanted = os.environ.get("NIGHTSHIFT_AIRFLOW_DB", "auto")
    if wanted == "auto":
        return "postgres" if postgres_answers() else "sqlite"
    return wanted


@contextmanager
def airflow_database(prefix: str = "nightshift_test") -> Iterator[AirflowDatabase]:
    """PostgreSQL (a database of this caller's own, dropped afterwards) when it answers, else SQLite; as
    NIGHTSHIFT_AIRFLOW_DB says (auto by default). The database is created here, so that it is dropped here
    whatever happens to the Airflow that uses it; scripts/airflow.sh standalone drops it too when it stops."""
    if wanted_airflow_db() != "postgres":
        yield AirflowDatabase("sqlite", {"NIGHTSHIFT_AIRFLOW_DB": "sqlite"})
        return
    with postgres_database(prefix) as name:
        yield AirflowDatabase("postgres", {
            "NIGHTSHIFT_AIRFLOW_DB": "postgres",
            "NIGHTSHIFT_POSTGRES_URL": POSTGRES_URL,
            "NIGHTSHIFT_AIRFLOW_PG_DB": name,
        }, name)


# --- the REST API ---------------------------------------------------------------------------------------


class Api:
    """Airflow's REST API v2, logged in as SIMPLE_AUTH_MANAGER_ALL_ADMINS allows (GET /auth/token)."""

    def __init__(self, base: str) -> None:
        import requests

        self.base = base
        self.session = requests.Session()

    def login(self) -> None:
        answer = self.session.get(f"{self.base}/auth/token", timeout=30)
        answer.raise_for_status()
        self.session.headers["Authorization"] = f"Bearer {answer.json()['access_token']}"

    def _request(self, method: str, url: str, **kwargs: Any) -> Any:
        """One request; a GET (nothing changes) asked again when the server does not answer in time (a loaded
        machine: one api-server worker busy for over 30 s) or drops the connection, up to 4 times in all."""
        import requests

        for attempt in range(4):
            try:
                return self.session.request(method, url, timeout=30, **kwargs)
            except (requests.Timeout, requests.ConnectionError):
                if method != "GET" or attempt == 3:
                    raise
        raise AssertionError("unreachable")

    def get(self, path: str, **kwargs: Any) -> Any:
        return self._request("GET", f"{self.base}{path}", **kwargs)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        answer = self._request(method, f"{self.base}/api/v2{path}", json=body)
        assert answer.status_code < 300, f"{method} {path}: {answer.status_code} {answer.text[:500]}"
        return dict(answer.json())

    def trigger(self, dag_id: str, conf: dict[str, Any]) -> str:
        return str(self.call("POST", f"/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf})["dag_run_id"])

    def task_instances(self, dag_id: str, run_id: str) -> dict[str, dict[str, Any]]:
        out = self.call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")
        return {ti["task_id"]: ti for ti in out["task_instances"]}

    def wait_ready(self, dag_id: str, alive: Any, timeout: float, describe: Any = lambda: "") -> None:
        """Until the API answers and knows `dag_id`; `alive()` false (a component died) fails at once."""
        deadline = time.monotonic() + timeout
        while True:
            assert alive(), f"{describe()}\nAirflow exited before it was ready"
            try:
                self.login()
                if self.get(f"/api/v2/dags/{dag_id}").status_code == 200:
                    return
            except Exception:
                pass
            assert time.monotonic() < deadline, f"{describe()}\nAirflow not ready after {timeout:.0f} s"
            time.sleep(2)


# --- airflow standalone ---------------------------------------------------------------------------------


@dataclass
class Standalone:
    """An `airflow standalone` (scripts/airflow.sh) a test module started: its process group, REST client,
    environment, NIGHTSHIFT_HOME and log."""

    proc: subprocess.Popen[bytes]
    api: Api
    env: dict[str, str]
    home: Path
    log: Path
    database: AirflowDatabase | None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


# Unset for every standalone: what a developer's shell may hold that would point it elsewhere.
_NOT_INHERITED = ("MLFLOW_TRACKING_URI", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "NIGHTSHIFT_MLFLOW_UI_URL")


@contextmanager
def airflow_standalone(home: Path, *, ready: Iterable[str], env: dict[str, str] | None = None,
                       unset: Iterable[str] = (), unset_prefixes: tuple[str, ...] = (),
                       database_prefix: str | None = "nightshift_test", timeout: float = 600,
                       api_class: type[Api] = Api) -> Iterator[Standalone]:
    """`scripts/airflow.sh standalone` on 127.0.0.1 with NIGHTSHIFT_HOME `home`, free ports, every user an admin
    (SIMPLE_AUTH_MANAGER_ALL_ADMINS), no MLflow UI unless `env` gives NIGHTSHIFT_MLFLOW_UI_PORT; `env` on top.
    The metadata database: a PostgreSQL database of its own (`database_prefix`, dropped after) when the server
    answers, else SQLite; `database_prefix=None`: as `env` says. Ready when the API (an `api_class`) knows every
    DAG in `ready` (`timeout`: a bound for a hung start, not a speed; under a load of 8 a start took over 240 s).
    Stopped (its whole process group), then any model server a deploy task started, also on failure."""
    from nightshift.netutil import free_ports

    port, worker_log_port, trigger_log_port = free_ports(3)
    dropped = {*_NOT_INHERITED, *unset}
    full = {k: v for k, v in os.environ.items()
            if k not in dropped and not (unset_prefixes and k.startswith(unset_prefixes))}
    full.update({
        "NIGHTSHIFT_HOME": str(home),
        "AIRFLOW_HOME": str(home / "airflow-home"),
        "AIRFLOW_PORT": str(port),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(worker_log_port),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(trigger_log_port),
        "NIGHTSHIFT_MLFLOW_UI_PORT": "none",
        "NIGHTSHIFT_VENV_BIN": str(BIN),
    })
    full.update(env or {})
    log_path = home / "standalone.log"
    databases = airflow_database(database_prefix) if database_prefix else nullcontext(None)
    with databases as database:
        if database is not None:
            full.update(database.env)
        with log_path.open("wb") as log:
            proc = subprocess.Popen([str(REPO / "scripts" / "airflow.sh"), "standalone"], env=full, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            running = Standalone(proc, api_class(f"http://{HOST}:{port}"), full, home, log_path, database)
            deadline = time.monotonic() + timeout
            for dag_id in ready:
                running.api.wait_ready(dag_id, lambda: proc.poll() is None, max(1.0, deadline - time.monotonic()),
                                       running.tail)
            yield running
        finally:
            # Airflow first, then the model server: a deploy task still running could start one after the stop
            try:
                stop_group(proc)
            finally:
                stop_model_server(full)
