"""Airflow for a season: api-server, scheduler and dag-processor through scripts/airflow.sh (the LocalExecutor on
PostgreSQL), each in a session of its own, kept running as systemd or Kubernetes would (a component that exits is
started again, and the season says so); the metadata database on a PostgreSQL instance of the season's own when
the server binaries are there (so that it can be restarted without touching anyone else's), else in a database of
its own on the shared server (NIGHTSHIFT_POSTGRES_URL).

The integration tests' helpers (tests/integration/airflow_helpers.py) give the REST client and the process-group
stops; the component set and its environment follow tests/integration/test_celery_executor.py.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nightshift.netutil import free_port, free_ports
from tests.integration.airflow_helpers import HOST, REPO, Api, stop_groups


def snapshot(into: Path) -> Path:
    """The committed code (git HEAD of this checkout) in `into`: a season runs for an hour or more, and what others
    edit in the checkout meanwhile must not reach its tasks (a half-made edit of nightshift/gc.py failed four nights'
    collect_garbage once). `season_env` puts it first on PYTHONPATH, before the editable install."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD"], capture_output=True, check=True,
                             timeout=300).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True, timeout=300)
    return into


def script(code: Path) -> str:
    return str(code / "scripts" / "airflow.sh")
COMPONENTS = {"api-server": ["api-server"], "scheduler": ["scheduler"], "dag-processor": ["dag-processor"]}
HEARTBEAT_TIMEOUT = 30  # seconds without a task heartbeat before the scheduler fails the task instance


def postgres_bin() -> Path | None:
    """The newest PostgreSQL server binaries installed (Debian's /usr/lib/postgresql/N/bin), if any."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


def _as_postgres(argv: list[str]) -> list[str]:
    """initdb and postgres refuse to run as root: run them as the `postgres` user when we are root."""
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


class PrivatePostgres:
    """A PostgreSQL instance of the season's own: initdb into a temporary folder, 127.0.0.1 on a free port, trust
    authentication; restartable (the PostgreSQL fault) and removed afterwards."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="nightshift-season-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self.port = free_port()
        self.url = f"postgresql://postgres@{HOST}:{self.port}"
        if os.geteuid() == 0:
            import pwd

            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)

    def _pg_ctl(self, *args: str, timeout: float = 120) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses={HOST} -c fsync=off"
        done = subprocess.run(_as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log),
                                            "-o", options, "-w", "-t", str(int(timeout)), *args]),
                              capture_output=True, text=True, timeout=timeout + 30, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"pg_ctl {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-1500:]}\n"
                               f"{self.log.read_text(errors='replace')[-1500:] if self.log.exists() else ''}")

    def start(self) -> None:
        done = subprocess.run(_as_postgres([str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust",
                                            "-U", "postgres", "-E", "UTF8", "--no-sync"]),
                              capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"initdb exited {done.returncode}: {done.stderr.strip()[-1500:]}")
        self._pg_ctl("start")

    def restart(self) -> None:
        self._pg_ctl("restart", "-m", "fast")

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            if (self.data / "postmaster.pid").exists():
                self._pg_ctl("stop", "-m", "fast")
        shutil.rmtree(self.root, ignore_errors=True)


def create_database(server: str, name: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(server, dbname="postgres", connect_timeout=10, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def drop_database(server: str, name: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(server, dbname="postgres", connect_timeout=10, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def database_size(server: str, name: str) -> int | None:
    """pg_database_size of `name`; None while the server does not answer (a restart)."""
    import psycopg

    try:
        with psycopg.connect(server, dbname="postgres", connect_timeout=5) as conn:
            row = conn.execute("SELECT pg_database_size(%s)", (name,)).fetchone()
    except psycopg.Error:
        return None
    return int(row[0]) if row else None


def terminate_connections(server: str, name: str) -> int:
    """Every connection to database `name` terminated (pg_terminate_backend): what a restart does to its clients,
    where the server itself is shared and must not be restarted."""
    import psycopg

    with psycopg.connect(server, dbname="postgres", connect_timeout=10, autocommit=True) as conn:
        rows = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                            "AND pid <> pg_backend_pid()", (name,)).fetchall()
    return len(rows)


@dataclass
class Components:
    """Airflow's components as processes of their own, restarted when one exits (say so in `events`)."""

    env: dict[str, str]
    logs_dir: Path
    code: Path  # the snapshot the components run (snapshot())
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    events: list[tuple[float, str]] = field(default_factory=list)
    held: set[str] = field(default_factory=set)  # components a fault has down on purpose: not restarted
    restarts: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _watcher: threading.Thread | None = None

    def log(self, name: str) -> Path:
        return self.logs_dir / f"{name}.log"

    def start(self, name: str) -> None:
        with self.log(name).open("ab") as out:
            self.procs[name] = subprocess.Popen([script(self.code), *COMPONENTS[name]], env=self.env, stdout=out,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                start_new_session=True)

    def start_all(self) -> None:
        for name in COMPONENTS:
            self.start(name)
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="season-supervisor")
        self._watcher.start()

    def alive(self) -> bool:
        return all(proc.poll() is None for name, proc in self.procs.items() if name not in self.held)

    def _watch(self) -> None:
        while not self._stop.wait(2.0):
            with self._lock:
                for name, proc in list(self.procs.items()):
                    code = proc.poll()
                    if code is None or name in self.held or self._stop.is_set():
                        continue
                    tail = self.log(name).read_text(errors="replace").strip().splitlines()[-1:] or [""]
                    self.events.append((time.time(), f"{name} exited {code} ({tail[0][-160:]}); restarted"))
                    self.restarts += 1
                    self.start(name)

    def kill_machine(self, name: str) -> int:
        """SIGKILL component `name` with everything under it (its process group, every descendant: task
        processes, horovodrun and the ranks, which live in sessions of their own), frozen first so that nothing
        new escapes: what losing the machine or container it runs in does. Held down until `release`."""
        from bench.season.faults import lose_machine

        with self._lock:
            self.held.add(name)
            killed = lose_machine(self.procs[name].pid)
            self.procs[name].wait(timeout=30)
        return len(killed)

    def release(self, name: str) -> None:
        with self._lock:
            self.start(name)
            self.held.discard(name)

    def describe(self) -> str:
        parts = []
        for name in self.procs:
            code = self.procs[name].poll()
            text = self.log(name).read_text(errors="replace")[-1500:] if self.log(name).exists() else ""
            parts.append(f"--- {name} ({'running' if code is None else f'exited {code}'}):\n{text}")
        return "\n".join(parts)

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
        stop_groups(self.procs.values(), grace=30)


def season_env(home: Path, *, code: Path, port: int, server: str, database: str, landing: Path, cron: str,
               maintenance: str, code_version: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The components' environment: this project's Airflow (scripts/airflow.sh) with the season's home, database,
    schedule and data roots; nothing of the caller's AIRFLOW_*/NIGHTSHIFT_*/MLflow settings."""
    from tests.integration.airflow_helpers import BIN

    # Two log-server ports distinct from each other and from the API server's
    worker_log_port, trigger_log_port = [p for p in free_ports(3) if p != port][:2]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIRFLOW", "NIGHTSHIFT_", "MLFLOW_TRACKING_URI", "PYTHONPATH"))}
    env.update({
        # The snapshot's packages before the editable install's (which is the live checkout); the ranks get it
        # too (PYTHONPATH is on operators/local_launcher.py's allowlist).
        "PYTHONPATH": os.pathsep.join([str(code), str(code / "dags")]),
        "NIGHTSHIFT_HOME": str(home),
        "AIRFLOW_HOME": str(home / "airflow-home"),
        "AIRFLOW_PORT": str(port),
        "NIGHTSHIFT_VENV_BIN": str(BIN),
        "NIGHTSHIFT_AIRFLOW_DB": "postgres",
        "NIGHTSHIFT_POSTGRES_URL": server,
        "NIGHTSHIFT_AIRFLOW_PG_DB": database,
        # The schedule compressed: a night every minute (a run that overruns delays the next: max_active_runs=1).
        "NIGHTSHIFT_RETRAIN_CRON": cron,
        "NIGHTSHIFT_MAINTENANCE_SCHEDULE": maintenance,
        # The landing folder (each night's data) and the declared data's folder, whose link points into it.
        "NIGHTSHIFT_DATA_ROOTS": os.pathsep.join([str(landing), str(home / "demo-data")]),
        # Nothing but this season's staging pushes to its remote: gc may collect there too.
        "NIGHTSHIFT_DVC_REMOTE_EXCLUSIVE": "1",
        # One code version all season, whatever is committed meanwhile: an unchanged night is unchanged.
        "NIGHTSHIFT_GIT_COMMIT": code_version,
        "NIGHTSHIFT_TRAIN_RETRY_DELAY_S": "5",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(worker_log_port),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(trigger_log_port),
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT),
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
    })
    env.update(extra or {})
    return env


def migrate(env: dict[str, str], code: Path) -> None:
    done = subprocess.run([script(code), "db", "migrate"], env=env, capture_output=True, text=True, timeout=900,
                          check=False, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"airflow db migrate exited {done.returncode}: {done.stderr[-3000:]}")


class SeasonApi(Api):
    """The REST API with the calls a season makes; each GET asked again while the API server restarts."""

    def get_json(self, path: str, wait: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + wait
        while True:
            try:
                answer = self.get(f"/api/v2{path}")
                if answer.status_code == 401:
                    self.login()
                    answer = self.get(f"/api/v2{path}")
                if answer.status_code < 300:
                    return dict(answer.json())
                problem = f"{answer.status_code} {answer.text[:300]}"
            except Exception as err:  # the API server is being restarted, or the database is
                problem = f"{type(err).__name__}: {err}"
            if time.monotonic() > deadline:
                raise RuntimeError(f"GET {path}: {problem}")
            time.sleep(2)
            with contextlib.suppress(Exception):
                self.login()

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        return list(self.get_json(f"/dags/{dag_id}/dagRuns?order_by=-run_after&limit=20")["dag_runs"])

    def run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        return self.get_json(f"/dags/{dag_id}/dagRuns/{run_id}")

    def tasks(self, dag_id: str, run_id: str) -> dict[str, dict[str, Any]]:
        out = self.get_json(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")
        return {ti["task_id"]: ti for ti in out["task_instances"]}

    def fail_run(self, dag_id: str, run_id: str) -> None:
        self.call("PATCH", f"/dags/{dag_id}/dagRuns/{run_id}", {"state": "failed"})
