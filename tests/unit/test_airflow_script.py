"""scripts/airflow.sh (`make airflow`), run for real without starting Airflow.

Refusals happen before Airflow starts. For `standalone`, a stand-in `airflow` (first on PATH, through
NIGHTSHIFT_VENV_BIN) records what it is given; `mlflow` and `python` are the project's own.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nightshift.netutil import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "airflow.sh"
VENV_BIN = Path(sys.executable).parent

# `airflow` stand-in: writes its arguments and environment to FAKE_AIRFLOW_OUT (when set); `standalone` then
# waits until the MLflow UI the script started answers (when it was told of one), and exits with
# FAKE_AIRFLOW_EXIT. Other subcommands exit 0.
FAKE_AIRFLOW = """#!/usr/bin/env bash
exec "{python}" - "$@" <<'EOF'
import json, os, sys, time, urllib.request
env = {{k: v for k, v in os.environ.items() if k.startswith(("NIGHTSHIFT_", "AIRFLOW"))}}
out = {{"argv": sys.argv[1:], "env": env}}
if sys.argv[1:2] != ["standalone"]:
    if os.environ.get("FAKE_AIRFLOW_OUT"):
        with open(os.environ["FAKE_AIRFLOW_OUT"], "w") as f:
            json.dump(out, f)
    sys.exit(0)
url = os.environ.get("NIGHTSHIFT_MLFLOW_UI_URL")
if url and os.environ.get("FAKE_AIRFLOW_WAIT_FOR_MLFLOW") == "1":
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                out["mlflow_health"] = answer.status
                break
        except OSError:
            time.sleep(0.5)
with open(os.environ["FAKE_AIRFLOW_OUT"], "w") as f:
    json.dump(out, f)
sys.exit(int(os.environ.get("FAKE_AIRFLOW_EXIT", "0")))
EOF
"""


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    """A bin directory with a stand-in `airflow` and the venv's `python` and `mlflow`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "airflow").write_text(FAKE_AIRFLOW.format(python=sys.executable))
    for name in ("python", "mlflow"):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{VENV_BIN / name}" "$@"\n')
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    return bin_dir


@pytest.fixture
def script_env(tmp_path: Path, nightshift_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIRFLOW", "NIGHTSHIFT_MLFLOW", "MLFLOW_TRACKING_URI"))}
    env.update({"NIGHTSHIFT_HOME": str(nightshift_home), "AIRFLOW_HOME": str(tmp_path / "airflow-home"),
                "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"})
    return env


def _run(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout,
                          check=False, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(("port", "server"), [("8793", "worker log server"), ("8794", "triggerer log server")])
def test_refuses_airflows_own_log_server_ports(script_env: dict[str, str], tmp_path: Path, port: str,
                                               server: str) -> None:
    proc = _run({**script_env, "AIRFLOW_PORT": port}, "standalone")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"AIRFLOW_PORT={port}" in lines[0] and server in lines[0] and "choose another" in lines[0]
    assert not (tmp_path / "airflow-home" / "airflow.db").exists(), "Airflow was set up anyway"


def test_log_server_ports_come_from_airflows_config(script_env: dict[str, str]) -> None:
    port = str(free_port())
    env = {**script_env, "AIRFLOW_PORT": port, "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": port}
    proc = _run(env, "api-server")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "trigger_log_server_port" in proc.stderr


@pytest.mark.parametrize("port", ["http", "0", "70000"])
def test_refuses_a_port_that_is_not_one(script_env: dict[str, str], port: str) -> None:
    proc = _run({**script_env, "AIRFLOW_PORT": port}, "standalone")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"scripts/airflow.sh: AIRFLOW_PORT={port} is not a TCP port (1-65535)"


def test_refuses_an_mlflow_ui_port_airflow_uses(script_env: dict[str, str]) -> None:
    proc = _run({**script_env, "AIRFLOW_PORT": "8080", "NIGHTSHIFT_MLFLOW_UI_PORT": "8080"}, "standalone")
    assert proc.returncode == 2
    assert "NIGHTSHIFT_MLFLOW_UI_PORT=8080" in proc.stderr


def test_standalone_serves_the_mlflow_ui_and_stops_it(script_env: dict[str, str], fake_bin: Path,
                                                      tmp_path: Path, nightshift_home: Path) -> None:
    port = free_port()
    out = tmp_path / "airflow-saw.json"
    env = {**script_env, "NIGHTSHIFT_VENV_BIN": str(fake_bin), "AIRFLOW_PORT": str(free_port()),
           "NIGHTSHIFT_MLFLOW_UI_PORT": str(port), "FAKE_AIRFLOW_OUT": str(out),
           "FAKE_AIRFLOW_WAIT_FOR_MLFLOW": "1", "FAKE_AIRFLOW_EXIT": "3"}
    proc = _run(env, "standalone")
    assert proc.returncode == 3, proc.stderr  # Airflow's exit status is the script's
    seen = json.loads(out.read_text())
    assert seen["argv"] == ["standalone"]
    assert seen["env"]["NIGHTSHIFT_MLFLOW_UI_URL"] == f"http://127.0.0.1:{port}"
    assert seen.get("mlflow_health") == 200, (nightshift_home / "mlflow-ui.log").read_text()[-2000:]
    assert (nightshift_home / "mlflow.db.init-lock").is_file()  # the store made under its lock before the UI
    assert f"MLflow UI: http://127.0.0.1:{port}" in proc.stderr
    deadline = time.monotonic() + 15
    while _listening(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _listening(port), "the MLflow UI outlived standalone"


def test_standalone_links_to_a_tracking_server_instead(script_env: dict[str, str], fake_bin: Path,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "airflow-saw.json"
    env = {**script_env, "NIGHTSHIFT_VENV_BIN": str(fake_bin), "AIRFLOW_PORT": str(free_port()),
           "MLFLOW_TRACKING_URI": "http://mlflow.example:5000/", "FAKE_AIRFLOW_OUT": str(out)}
    proc = _run(env, "standalone")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["env"]["NIGHTSHIFT_MLFLOW_UI_URL"] == "http://mlflow.example:5000"
    assert "no MLflow UI started" in proc.stderr


# --- the metadata database: every command, and the same one as `make demo` (issue 20, items 8 and 9) --------

POSTGRES_URL = os.environ.get("NIGHTSHIFT_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432")


def _postgres_answers() -> bool:
    import psycopg

    try:
        psycopg.connect(POSTGRES_URL, dbname="postgres", connect_timeout=3).close()
    except psycopg.OperationalError:
        return False
    return True


needs_postgres = pytest.mark.skipif(not _postgres_answers(), reason=f"no PostgreSQL answers at {POSTGRES_URL}")


def _pg_database_exists(name: str) -> bool:
    import psycopg

    with psycopg.connect(POSTGRES_URL, dbname="postgres", connect_timeout=10) as conn:
        return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None


def _drop_pg_database(name: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(POSTGRES_URL, dbname="postgres", connect_timeout=10, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _home_database(airflow_home: Path) -> str:
    """The PostgreSQL database scripts/airflow.sh names for an AIRFLOW_HOME other than the default one."""
    import hashlib

    return "nightshift_airflow_" + hashlib.sha1(str(airflow_home).encode()).hexdigest()[:8]


def _dead_postgres_url() -> str:
    return f"postgresql://postgres@127.0.0.1:{free_port()}"  # nothing listens there


@pytest.fixture
def db_env(script_env: dict[str, str], fake_bin: Path, tmp_path: Path) -> Iterator[dict[str, str]]:
    """script_env with the stand-in airflow, NIGHTSHIFT_AIRFLOW_DB=auto, and the PostgreSQL database of its
    AIRFLOW_HOME dropped afterwards (whatever made it)."""
    env = {k: v for k, v in script_env.items() if k not in ("NIGHTSHIFT_AIRFLOW_PG_DB", "NIGHTSHIFT_AIRFLOW_PG_KEEP")}
    env.update({"NIGHTSHIFT_VENV_BIN": str(fake_bin), "NIGHTSHIFT_AIRFLOW_DB": "auto",
                "NIGHTSHIFT_POSTGRES_URL": POSTGRES_URL, "FAKE_AIRFLOW_OUT": str(tmp_path / "airflow-saw.json"),
                "AIRFLOW_PORT": str(free_port())})
    try:
        yield env
    finally:
        if _postgres_answers():
            _drop_pg_database(_home_database(Path(env["AIRFLOW_HOME"])))


def _airflow_saw(env: dict[str, str]) -> dict[str, Any]:
    return dict(json.loads(Path(env["FAKE_AIRFLOW_OUT"]).read_text()))


def _demo_database(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> str:
    """The metadata database `make demo` (scripts/demo.py's main) would run on, for the same environment."""
    from scripts import demo

    for name in [k for k in os.environ if k.startswith(("AIRFLOW", "NIGHTSHIFT_"))]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith(("AIRFLOW", "NIGHTSHIFT_")):
            monkeypatch.setenv(name, value)
    demo_env, _database = demo.demo_env(Path(env["NIGHTSHIFT_HOME"]))
    return demo_env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]


@needs_postgres
@pytest.mark.parametrize("command", [["db", "migrate"], ["dags", "list"], ["api-server"]])
def test_every_command_creates_its_postgres_database(db_env: dict[str, str], command: list[str]) -> None:
    name = _home_database(Path(db_env["AIRFLOW_HOME"]))
    proc = _run(db_env, *command)
    assert proc.returncode == 0, proc.stderr
    assert _pg_database_exists(name), f"scripts/airflow.sh {' '.join(command)} left {name} uncreated"
    assert _airflow_saw(db_env)["env"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].endswith(f"/{name}")
    said = [line for line in proc.stderr.splitlines() if name in line]
    assert len(said) == 1 and "created" in said[0], proc.stderr
    again = _run(db_env, *command)  # there now: used, not made again, nothing said
    assert again.returncode == 0 and name not in again.stderr, again.stderr


@needs_postgres
def test_standalone_leaves_a_database_another_command_made(db_env: dict[str, str]) -> None:
    name = _home_database(Path(db_env["AIRFLOW_HOME"]))
    assert _run(db_env, "db", "migrate").returncode == 0
    proc = _run({**db_env, "NIGHTSHIFT_MLFLOW_UI_PORT": "none"}, "standalone")
    assert proc.returncode == 0, proc.stderr
    assert "existing, left as it is" in proc.stderr
    assert _pg_database_exists(name), "standalone dropped the database `db migrate` had made (with its history)"


@needs_postgres
def test_standalone_still_drops_the_database_it_made_for_a_throwaway_home(db_env: dict[str, str]) -> None:
    name = _home_database(Path(db_env["AIRFLOW_HOME"]))
    proc = _run({**db_env, "NIGHTSHIFT_MLFLOW_UI_PORT": "none"}, "standalone")
    assert proc.returncode == 0, proc.stderr
    assert _airflow_saw(db_env)["env"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].endswith(f"/{name}")
    assert "created, dropped when Airflow stops" in proc.stderr
    assert not _pg_database_exists(name)
    again = _run(db_env, "dags", "list")  # the home no longer claims a PostgreSQL history: made afresh
    assert again.returncode == 0 and _pg_database_exists(name), again.stderr


@needs_postgres
def test_the_demo_and_airflow_sh_use_the_same_database(db_env: dict[str, str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    assert _run(db_env, "dags", "list").returncode == 0
    script_url = _airflow_saw(db_env)["env"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    assert script_url.startswith("postgresql+psycopg://")
    assert _demo_database(db_env, monkeypatch) == script_url


@needs_postgres
def test_the_demo_first_then_airflow_sh_finds_the_demos_database(db_env: dict[str, str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    demo_url = _demo_database(db_env, monkeypatch)
    assert demo_url.endswith("/" + _home_database(Path(db_env["AIRFLOW_HOME"])))
    proc = _run(db_env, "dags", "list")
    assert proc.returncode == 0, proc.stderr
    assert _airflow_saw(db_env)["env"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == demo_url
    assert "created" not in proc.stderr  # the demo made it


@needs_postgres
def test_a_home_with_an_earlier_sqlite_history_keeps_it(db_env: dict[str, str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    airflow_home = Path(db_env["AIRFLOW_HOME"])
    airflow_home.mkdir(parents=True)
    sqlite3.connect(airflow_home / "airflow.db").close()  # what an earlier `make demo` left
    proc = _run(db_env, "dags", "list")
    assert proc.returncode == 0, proc.stderr
    url = f"sqlite:///{airflow_home / 'airflow.db'}"
    assert _airflow_saw(db_env)["env"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == url
    (line,) = [line for line in proc.stderr.splitlines() if "SQLite" in line]
    assert "NIGHTSHIFT_AIRFLOW_DB=postgres" in line, line  # how to move to PostgreSQL
    assert _demo_database(db_env, monkeypatch) == url
    assert not _pg_database_exists(_home_database(airflow_home))


def test_without_postgres_both_fall_back_to_sqlite_and_say_so(db_env: dict[str, str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**db_env, "NIGHTSHIFT_POSTGRES_URL": _dead_postgres_url()}
    proc = _run(env, "dags", "list")
    assert proc.returncode == 0, proc.stderr
    url = f"sqlite:///{Path(env['AIRFLOW_HOME']) / 'airflow.db'}"
    assert _airflow_saw(env)["env"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == url
    (line,) = [line for line in proc.stderr.splitlines() if "SQLite" in line]
    assert "does not answer" in line, proc.stderr
    assert _demo_database(env, monkeypatch) == url


@needs_postgres
def test_a_home_on_postgres_fails_loudly_when_postgres_is_down(db_env: dict[str, str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from nightshift.errors import UsageError

    name = _home_database(Path(db_env["AIRFLOW_HOME"]))
    assert _run(db_env, "db", "migrate").returncode == 0
    down = {**db_env, "NIGHTSHIFT_POSTGRES_URL": _dead_postgres_url()}
    proc = _run(down, "dags", "list")
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("scripts/airflow.sh: ") and name in line and "NIGHTSHIFT_AIRFLOW_DB=sqlite" in line, line
    with pytest.raises(UsageError, match=name):
        _demo_database(down, monkeypatch)


@needs_postgres
def test_two_commands_creating_the_database_at_once(db_env: dict[str, str]) -> None:
    name = _home_database(Path(db_env["AIRFLOW_HOME"]))
    procs = [subprocess.Popen(["bash", str(SCRIPT), "dags", "list"], env=db_env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL) for _ in range(4)]
    results = [(proc.wait(timeout=180), proc.stderr.read() if proc.stderr else "") for proc in procs]
    for proc in procs:
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert all(code == 0 for code, _ in results), results
    assert _pg_database_exists(name)


@pytest.mark.integration
def test_db_migrate_and_dags_list_on_a_fresh_home(script_env: dict[str, str]) -> None:
    """The real Airflow: a fresh NIGHTSHIFT_HOME migrates and lists the project's DAGs (on PostgreSQL where it
    answers, a database of this home's own, dropped afterwards; else SQLite)."""
    env = {k: v for k, v in script_env.items() if k not in ("NIGHTSHIFT_AIRFLOW_PG_DB", "NIGHTSHIFT_AIRFLOW_DB")}
    env["NIGHTSHIFT_POSTGRES_URL"] = POSTGRES_URL
    try:
        migrate = _run(env, "db", "migrate", timeout=600)
        assert migrate.returncode == 0, (migrate.stdout + migrate.stderr)[-3000:]
        reserialize = _run(env, "dags", "reserialize", timeout=600)  # the DAGs into that database
        assert reserialize.returncode == 0, (reserialize.stdout + reserialize.stderr)[-3000:]
        listed = _run(env, "dags", "list", "-o", "json", timeout=600)
        assert listed.returncode == 0, (listed.stdout + listed.stderr)[-3000:]
        (last,) = [line for line in listed.stdout.splitlines() if line.startswith("[")][-1:]
        assert "nightly_retrain" in {dag["dag_id"] for dag in json.loads(last)}, listed.stdout[-3000:]
    finally:
        if _postgres_answers():
            _drop_pg_database(_home_database(Path(env["AIRFLOW_HOME"])))


@pytest.mark.parametrize("url", ["http://127.0.0.1:5432", "not a url"])
def test_a_postgres_url_that_is_not_one_is_refused_in_one_line(db_env: dict[str, str], url: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from nightshift.errors import UsageError

    env = {**db_env, "NIGHTSHIFT_POSTGRES_URL": url}
    proc = _run(env, "dags", "list")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("scripts/airflow.sh: NIGHTSHIFT_POSTGRES_URL is not a PostgreSQL URL like"), \
        proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    with pytest.raises(UsageError, match="NIGHTSHIFT_POSTGRES_URL"):
        _demo_database(env, monkeypatch)
