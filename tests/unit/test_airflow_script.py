"""scripts/airflow.sh (`make airflow`), run for real without starting Airflow.

Refusals happen before Airflow starts. For `standalone`, a stand-in `airflow` (first on PATH, through
NIGHTSHIFT_VENV_BIN) records what it is given; `mlflow` and `python` are the project's own.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "airflow.sh"
VENV_BIN = Path(sys.executable).parent

# `airflow standalone` stand-in: writes its environment, waits until the MLflow UI the script started
# answers (when it was told of one), then exits with FAKE_AIRFLOW_EXIT. Other subcommands do nothing.
FAKE_AIRFLOW = """#!/usr/bin/env bash
[[ "$1" == standalone ]] || exit 0
exec "{python}" - "$@" <<'EOF'
import json, os, sys, time, urllib.request
env = {{k: v for k, v in os.environ.items() if k.startswith(("NIGHTSHIFT_", "AIRFLOW"))}}
out = {{"argv": sys.argv[1:], "env": env}}
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    port = str(_free_port())
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
    port = _free_port()
    out = tmp_path / "airflow-saw.json"
    env = {**script_env, "NIGHTSHIFT_VENV_BIN": str(fake_bin), "AIRFLOW_PORT": str(_free_port()),
           "NIGHTSHIFT_MLFLOW_UI_PORT": str(port), "FAKE_AIRFLOW_OUT": str(out),
           "FAKE_AIRFLOW_WAIT_FOR_MLFLOW": "1", "FAKE_AIRFLOW_EXIT": "3"}
    proc = _run(env, "standalone")
    assert proc.returncode == 3, proc.stderr  # Airflow's exit status is the script's
    seen = json.loads(out.read_text())
    assert seen["argv"] == ["standalone"]
    assert seen["env"]["NIGHTSHIFT_MLFLOW_UI_URL"] == f"http://127.0.0.1:{port}"
    assert seen.get("mlflow_health") == 200, (nightshift_home / "mlflow-ui.log").read_text()[-2000:]
    assert f"MLflow UI: http://127.0.0.1:{port}" in proc.stderr
    deadline = time.monotonic() + 15
    while _listening(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _listening(port), "the MLflow UI outlived standalone"


def test_standalone_links_to_a_tracking_server_instead(script_env: dict[str, str], fake_bin: Path,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "airflow-saw.json"
    env = {**script_env, "NIGHTSHIFT_VENV_BIN": str(fake_bin), "AIRFLOW_PORT": str(_free_port()),
           "MLFLOW_TRACKING_URI": "http://mlflow.example:5000/", "FAKE_AIRFLOW_OUT": str(out)}
    proc = _run(env, "standalone")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["env"]["NIGHTSHIFT_MLFLOW_UI_URL"] == "http://mlflow.example:5000"
    assert "no MLflow UI started" in proc.stderr
