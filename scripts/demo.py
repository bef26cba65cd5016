"""`make demo`: the demo data, then `airflow dags test nightly_retrain` twice, with a summary of each run.

State goes to NIGHTSHIFT_HOME (default ~/.nightshift); Airflow's own home (logs) to NIGHTSHIFT_HOME/airflow-home
unless AIRFLOW_HOME is set. Airflow's metadata database is the one `make airflow` (scripts/airflow.sh) uses for
the same home, chosen by nightshift.settings.airflow_database(): PostgreSQL when it answers at
NIGHTSHIFT_POSTGRES_URL, else SQLite in AIRFLOW_HOME (said so), so that the UI shows the demo's runs.
The DAGs and plugins come from this repository.
Run 1 trains with 2 Horovod workers and deploys: on emulated hosts (backend=hosts: the MPIJob a cluster would
run, across network namespaces) where this machine allows them (root, `ip netns`, sshd), else with the local
backend (horovodrun here), saying which and why; run 2 forces a retrain (local backend) on the same
data and shows the gate refusing to promote a model that is not better. Then the test rows are streamed
through a private redis-server and `nightshift score-stream` (skipped, saying why, without redis-server).
The model server keeps running.
Each run prints one line per task as it ends (state, seconds); Airflow's full output goes to a log file
under AIRFLOW_HOME/demo-logs/, whose path is printed (`--verbose` also shows it on the terminal).
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from nightshift.settings import AirflowDatabase

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DAG_ID = "nightly_retrain"
GPU_POOL_SLOTS = 16
# Task states worth a progress line: where a task ends, or a try that failed and will be retried.
SHOWN_STATES = ("success", "failed", "skipped", "upstream_failed", "removed", "up_for_retry")
POLL_SECONDS = 0.5


def nightshift_home() -> Path:
    return Path(os.environ.get("NIGHTSHIFT_HOME", Path.home() / ".nightshift")).expanduser()


def airflow_env(nightshift: Path, airflow_home: Path | None = None,
                database: AirflowDatabase | None = None) -> dict[str, str]:
    """The environment every Airflow command of this project runs in: repo dags/plugins, no examples, and the
    metadata database `database` (default: SQLite in `airflow_home`, a throwaway home's for tests)."""
    airflow_home = airflow_home or Path(os.environ.get("AIRFLOW_HOME") or nightshift / "airflow-home")
    env = dict(os.environ)
    env.update({
        "NIGHTSHIFT_HOME": str(nightshift),
        "AIRFLOW_HOME": str(airflow_home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": database.url if database else f"sqlite:///{airflow_home / 'airflow.db'}",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(airflow_home / "logs"),
        "PATH": os.pathsep.join([str(BIN), env.get("PATH", "")]),
        "GX_ANALYTICS_ENABLED": "false",
        "DVC_NO_ANALYTICS": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
    })
    return env


def demo_env(nightshift: Path) -> tuple[dict[str, str], AirflowDatabase]:
    """`make demo`'s environment, on the metadata database scripts/airflow.sh uses for the same home (made when
    missing); NightshiftError (one line) when there is none to be had."""
    from nightshift import settings

    os.environ["NIGHTSHIFT_HOME"] = str(nightshift)  # settings (and the children) read it from here
    airflow_home = settings.airflow_home()
    database = settings.airflow_database(airflow_home)
    return airflow_env(nightshift, airflow_home, database), database


def airflow(env: dict[str, str], *args: str, check: bool = True, capture: bool = True,
            timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(BIN / "airflow"), *args], env=env, text=True, timeout=timeout,
                          capture_output=capture, check=False)
    if check and proc.returncode != 0:
        tail = "\n".join(((proc.stdout or "") + (proc.stderr or "")).splitlines()[-40:])
        raise RuntimeError(f"airflow {' '.join(args)} exited {proc.returncode}:\n{tail}")
    return proc


def prepare_airflow(env: dict[str, str]) -> None:
    """Migrate the metadata DB and create the `gpu` pool the Horovod operator takes slots from."""
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    airflow(env, "db", "migrate")
    airflow(env, "pools", "set", "gpu", str(GPU_POOL_SLOTS), "Horovod training slots (GPUs, or CPU jobs)")


def run1_backend(lacking: list[str] | None = None, tracking_uri: str | None = None) -> tuple[str, str]:
    """Run 1's backend and why: `hosts` where this machine can run emulated hosts (root, `ip netns`, sshd;
    `lacking`: what it lacks, default asked of it) and the run's MLflow store is on this machine's disk (the
    hosts reach it through a service; `tracking_uri`: default the settings'); else `local`, saying why not."""
    from nightshift import settings
    from nightshift.mpijob_local.requirements import missing, served_store_problem

    lacking = missing() if lacking is None else lacking
    if lacking:
        return "local", f"emulated hosts need {'; '.join(lacking)}"
    problem = served_store_problem(tracking_uri or settings.mlflow_tracking_uri())
    if problem:
        return "local", f"backend=hosts cannot be used: {problem}"
    return "hosts", "this machine allows network namespaces (root, ip netns, sshd): one emulated host per worker"


def choose_run1_backend(wanted: str, lacking: list[str] | None = None, tracking_uri: str | None = None
                        ) -> tuple[str, str]:
    """Run 1's backend as `--backend` asks: `auto` (run1_backend's choice), `local`, or `hosts` (UsageError, one
    line, where this machine cannot run them)."""
    from nightshift.errors import UsageError

    if wanted == "local":
        return "local", "asked for with --backend local"
    backend, why = run1_backend(lacking, tracking_uri)
    if wanted == "hosts" and backend != "hosts":
        raise UsageError(f"--backend hosts: {why}; use --backend local or auto")
    return backend, why


def ledger(nightshift: Path) -> list[dict[str, Any]]:
    path = nightshift / "airflow" / DAG_ID / "runs.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class DagTestRun(NamedTuple):
    """What one `airflow dags test` gave: exit code, ledger record, seconds, progress lines, full log."""

    code: int
    record: dict[str, Any] | None
    seconds: float
    progress: list[str]
    log: Path


def _metadata_db(env: dict[str, str]) -> Path | str | None:
    """Airflow's metadata DB as the progress lines read it: a SQLite file, a libpq URL for PostgreSQL, or None
    (another database: no progress lines)."""
    conn = env.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "")
    if conn.startswith("sqlite:///"):
        return Path(conn.removeprefix("sqlite:///"))
    if conn.startswith(("postgresql:", "postgresql+")):
        from sqlalchemy.engine import make_url

        return make_url(conn).set(drivername="postgresql").render_as_string(hide_password=False)
    return None


def _query(db: Path | str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """A read-only query (`?` placeholders) of Airflow's metadata DB; [] while it is locked or not there yet."""
    if isinstance(db, str):
        import psycopg

        try:
            with psycopg.connect(db, connect_timeout=5) as conn:
                conn.read_only = True
                return conn.execute(sql.replace("?", "%s"), args).fetchall()
        except psycopg.Error:
            return []
    try:
        with sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True, timeout=2) as conn:
            return conn.execute(sql, args).fetchall()
    except sqlite3.Error:
        return []


def _seconds(start: str | datetime | None, end: str | datetime | None) -> float | None:
    # From the start and end dates: Airflow 3.3.0 computes `duration` wrongly on SQLite (fixed in 3.3.1).
    # SQLite gives them as text, PostgreSQL as datetimes.
    if not start or not end:
        return None
    try:
        start = start if isinstance(start, datetime) else datetime.fromisoformat(start)
        end = end if isinstance(end, datetime) else datetime.fromisoformat(end)
        return (end - start).total_seconds()
    except (ValueError, TypeError):
        return None


def progress_line(task_id: str, state: str, seconds: float | None, try_number: int | None = None) -> str:
    took = f"{seconds:7.1f}s" if seconds is not None else "       -"
    retry = f" (try {try_number}, will retry)" if state == "up_for_retry" else ""
    return f"  {task_id:<16} {state:<15} {took}{retry}"


class TaskProgress(threading.Thread):
    """Prints a line as each task instance of the new DAG run reaches a state in SHOWN_STATES.

    Reads Airflow's own metadata DB (read-only) rather than its log, whose format changes between versions.
    """

    def __init__(self, db: Path | str, after_run_row: int, emit: Callable[[str], None]) -> None:
        super().__init__(daemon=True)
        self.db, self.after_run_row, self.emit = db, after_run_row, emit
        self.lines: list[str] = []
        self.seen: dict[tuple[str, int], tuple[str, int]] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(POLL_SECONDS):
            self.poll()

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=10)
        self.poll()  # what ended since the last poll

    def poll(self) -> None:
        runs = _query(self.db, "SELECT run_id FROM dag_run WHERE dag_id = ? AND id > ? ORDER BY id LIMIT 1",
                      DAG_ID, self.after_run_row)
        if not runs:
            return
        rows = _query(self.db, "SELECT task_id, map_index, state, try_number, start_date, end_date "
                               "FROM task_instance WHERE dag_id = ? AND run_id = ? AND state IN "
                               f"({','.join('?' * len(SHOWN_STATES))}) ORDER BY end_date, task_id",
                      DAG_ID, runs[0][0], *SHOWN_STATES)
        for task_id, map_index, state, try_number, start, end in rows:
            key = (task_id, map_index)
            if self.seen.get(key) == (state, try_number):
                continue
            self.seen[key] = (state, try_number)
            line = progress_line(task_id, state, _seconds(start, end), try_number)
            self.lines.append(line)
            self.emit(line)


def new_log_path(env: dict[str, str]) -> Path:
    """Where the full log of the next `airflow dags test` goes: AIRFLOW_HOME/demo-logs/, one file per run."""
    log_dir = Path(env["AIRFLOW_HOME"]) / "demo-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir / f"{DAG_ID}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%fZ')}.log"


def run_dag(env: dict[str, str], conf: dict[str, Any], *, log_path: Path | None = None,
            progress: Callable[[str], None] | None = print, verbose: bool = False,
            timeout: float | None = 3600) -> DagTestRun:
    """`airflow dags test nightly_retrain -c CONF`: its full output goes to `log_path` (default: new_log_path),
    and to the terminal with `verbose`; one line per task goes to `progress` as the task ends."""
    nightshift = Path(env["NIGHTSHIFT_HOME"])
    log_path = log_path or new_log_path(env)
    before = len(ledger(nightshift))
    db = _metadata_db(env)
    watcher = None
    if db is not None:
        last = _query(db, "SELECT COALESCE(MAX(id), 0) FROM dag_run")
        watcher = TaskProgress(db, int(last[0][0]) if last else 0, progress or (lambda _line: None))
        watcher.start()
    start = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen([str(BIN / "airflow"), "dags", "test", DAG_ID, "-c", json.dumps(conf)], env=env,
                                text=True, stdout=subprocess.PIPE if verbose else log, stderr=subprocess.STDOUT)
        try:
            if verbose and proc.stdout is not None:
                for line in proc.stdout:
                    log.write(line)
                    sys.stdout.write(line)
            code = proc.wait(timeout=timeout)
        except BaseException:  # a timeout or Ctrl-C: no `airflow dags test` left behind
            proc.kill()
            proc.wait()
            raise
        finally:
            if watcher is not None:
                watcher.stop()
    seconds = time.monotonic() - start
    records = ledger(nightshift)[before:]
    return DagTestRun(code, records[-1] if records else None, seconds, watcher.lines if watcher else [], log_path)


def predict(url: str, data_dir: Path, rows: int = 5) -> tuple[list[int], list[int]]:
    """Ask the model server for `rows` test rows: (predicted, true labels)."""
    import pandas as pd
    import requests

    frame = pd.read_parquet(data_dir / "test.parquet").head(rows)
    labels = frame.pop("label").astype(int).tolist()
    body = {"dataframe_split": {"columns": list(frame.columns), "data": frame.to_numpy().tolist()}}
    answer = requests.post(f"{url}/invocations", json=body, timeout=30)
    answer.raise_for_status()
    predictions = answer.json()["predictions"]
    return [int(p["predicted_label"]) for p in predictions], labels


def print_summary(title: str, record: dict[str, Any] | None, seconds: float, log: Path | None = None) -> None:
    print(f"=== {title}: done in {seconds:.0f}s")
    if record is None:
        print(f"  no run record: the run did not reach its report (see {log or 'the log above'})")
        return
    print(f"  status          : {record.get('status')} - {record.get('outcome')}")
    if record.get("status") != "success":
        print(f"  failed task     : {record.get('failed_task')}: {record.get('reason')}")
        return
    print(f"  dataset version : {record.get('dataset_version')} ({record.get('dataset_rows')} rows)")
    metrics = record.get("train_metrics") or {}
    if metrics:
        shown = {k: round(v, 4) for k, v in metrics.items() if isinstance(v, (int, float))}
        print(f"  train metrics   : {json.dumps(shown)}")
    gate = record.get("gate")
    if gate:
        print(f"  gate decision   : {'PROMOTE' if gate['passed'] else 'DO NOT PROMOTE'}")
        for reason in gate["reasons"]:
            print(f"                    {reason}")
    print(f"  model version   : {record.get('model_version') or '(none registered)'}")
    print(f"  serving URL     : {record.get('serving_url') or '(unchanged)'}")


def start_run(env: dict[str, str], title: str, conf: dict[str, Any], verbose: bool) -> DagTestRun:
    log_path = new_log_path(env)
    print(f"\n=== {title}\n  airflow dags test {DAG_ID}; Airflow's full log: {log_path}", flush=True)
    return run_dag(env, conf, log_path=log_path, progress=lambda line: print(line, flush=True), verbose=verbose)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--backend", choices=("auto", "hosts", "local"), default="auto",
                        help="run 1's backend: auto (emulated hosts where this machine allows them, else local), "
                             "hosts or local; run 2 is local")
    parser.add_argument("--verbose", action="store_true",
                        help="also stream Airflow's full log to the terminal (it always goes to a file)")
    args = parser.parse_args(argv)

    from nightshift.errors import NightshiftError

    nightshift = nightshift_home()
    try:
        env, database = demo_env(nightshift)
    except NightshiftError as err:
        print(f"scripts/demo.py: {err}", file=sys.stderr)
        return 2
    print(f"NIGHTSHIFT_HOME={nightshift}\nAIRFLOW_HOME={env['AIRFLOW_HOME']}\nAirflow database: {database.note} "
          "(the one `make airflow` uses for this home)", flush=True)
    data = nightshift / "demo-data" / "digits"
    subprocess.run([str(BIN / "nightshift"), "demo-data", str(data)], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    print(f"demo data: {data}", flush=True)
    prepare_airflow(env)

    base = {"data_source": str(data), "epochs": args.epochs, "workers": args.workers, "backend": "local"}
    try:
        backend, why = choose_run1_backend(args.backend)
    except NightshiftError as err:
        print(f"scripts/demo.py: {err}", file=sys.stderr)
        return 2
    print(f"run 1 backend: {backend} ({why})", flush=True)
    title = f"run 1: nightly_retrain on the demo data, backend={backend}"
    first = start_run(env, title, {**base, "backend": backend}, args.verbose)
    print_summary(title, first.record, first.seconds, first.log)
    if first.code != 0 or not first.record or first.record.get("status") != "success":
        print(f"run 1 failed (airflow dags test exited {first.code}; log: {first.log})", file=sys.stderr)
        return 1

    from nightshift.deploy.local import read_record

    serving = read_record("nightshift-digits")
    if serving:
        try:
            predicted, labels = predict(serving["url"], data)
            print(f"  prediction      : POST {serving['url']}/invocations -> {predicted} (true {labels})")
        except Exception as err:  # a record left by an earlier demo whose server is gone
            print(f"  prediction      : {serving['url']} does not answer ({err}); run "
                  f"`nightshift deploy --stop` and `make demo` again")
    else:
        print("  prediction      : nothing is serving (no model passed the gate yet)")
        print(f"run 1 promoted no model, and the rest of the demo needs a champion: see the gate's decision above "
              f"(with --epochs {args.epochs}, the model may miss the gate's floor; the default is 5)", file=sys.stderr)
        return 1

    title = "run 2: same data, force=true, backend=local (retrain; the gate decides)"
    run = start_run(env, title, {**base, "force": True}, args.verbose)
    second = run.record
    print_summary(title, second, run.seconds, run.log)
    if run.code != 0 or not second or second.get("status") != "success":
        print(f"run 2 failed (airflow dags test exited {run.code}; log: {run.log})", file=sys.stderr)
        return 1
    if second.get("serving_url"):
        print("  !! run 2 promoted a new model", file=sys.stderr)
    else:
        print("  run 2 did not promote: the new model is not better than the champion, which keeps serving.")
    print("  (Without force=true an unchanged dataset and code skip training altogether.)")

    from nightshift.errors import StreamDemoFailed
    from nightshift.stream.demo import stream_demo

    try:
        stream_demo(nightshift, data, env=env)
    except StreamDemoFailed as err:
        print(f"stream scoring failed: {err}", file=sys.stderr)
        return 1

    serving = read_record("nightshift-digits")
    if serving:
        print(f"\nThe champion v{serving['version']} keeps serving at {serving['url']} (pid {serving['pid']}).")
        print(f"Stop it with: NIGHTSHIFT_HOME={nightshift} {BIN / 'nightshift'} deploy --stop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
