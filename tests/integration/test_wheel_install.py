"""Issue 37 item 3: the wheel installs into a team's own Airflow without moving it.

A fresh virtualenv holds another Airflow 3.3.x patch release than constraints.txt pins, installed as a team installs
Airflow (pinned by constraints: here this project's, less its Airflow lines). Then the wheel built from this checkout
is installed into it as the README tells a user to: with the folder of the patched Horovod wheel as `--find-links`.
pip keeps the team's Airflow (the wheel declares `apache-airflow>=3.3,<3.4`; the exact pins it had before downgraded
it), takes the patched Horovod (nightshift doctor's checks pass), and the demo DAGs, laid out as a user's repository
laid out, parse with the installed factory. Everything comes from pip's cache and the package index.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.airflow_helpers import REPO
from tests.integration.wheel_helpers import build_wheel

pytestmark = pytest.mark.slow

# Another 3.3.x patch release than constraints.txt's (3.3.2), with its core and task SDK.
TEAMS_AIRFLOW = {"apache-airflow": "3.3.1", "apache-airflow-core": "3.3.1", "apache-airflow-task-sdk": "1.3.1"}
PIP_TIMEOUT = 1200

DAGBAG = """
import json, nightly_tasks
from importlib import metadata
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder={folder!r})
print(json.dumps({{"dags": sorted(bag.dag_ids), "errors": {{k: str(v) for k, v in bag.import_errors.items()}},
                  "factory": nightly_tasks.__file__,
                  "versions": {{name: metadata.version(name) for name in {names!r}}}}}))
"""


def _pip(python: Path, *args: str) -> None:
    proc = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", "install", *args],
                          capture_output=True, text=True, timeout=PIP_TIMEOUT, check=False)
    assert proc.returncode == 0, f"pip install {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _horovod_wheel_folder() -> Path:
    """The folder of the patched Horovod wheel for this torch (cached by make setup; the README names it)."""
    proc = subprocess.run(["bash", str(REPO / "nightshift" / "horovod_build" / "horovod-wheel.sh"), sys.executable],
                          capture_output=True, text=True, timeout=1800, check=True)
    return Path(proc.stdout.strip().splitlines()[-1]).parent


@pytest.mark.timeout(2700)  # two installs of a few hundred packages from pip's cache, on 2 cores
def test_the_wheel_keeps_the_teams_airflow_takes_the_patched_horovod_and_the_dags_parse(tmp_path: Path) -> None:
    pinned = dict(line.split("==", 1) for line in (REPO / "constraints.txt").read_text().splitlines()
                  if line and not line.startswith("#"))
    assert all(pinned[name] != version for name, version in TEAMS_AIRFLOW.items()), "not another patch release"
    team = tmp_path / "team-constraints.txt"
    team.write_text("".join(f"{name}=={version}\n" for name, version in pinned.items() if name not in TEAMS_AIRFLOW))

    venv = tmp_path / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    _pip(python, "--quiet", "pip==26.3")
    _pip(python, "--quiet", "-c", str(team), f"apache-airflow=={TEAMS_AIRFLOW['apache-airflow']}")

    wheel = build_wheel(tmp_path / "wheel")
    _pip(python, "--quiet", "-c", str(team), "--find-links", str(_horovod_wheel_folder()), str(wheel))

    # In tmp_path: `-m` puts the working directory first on sys.path, and the checkout's nightshift must not be seen.
    doctor = subprocess.run([str(python), "-m", "nightshift.doctor"], capture_output=True, text=True, timeout=300,
                            check=False, cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    checks = {c["name"]: c for c in json.loads(doctor.stdout.strip().splitlines()[-1])}
    assert all(c["ok"] for c in checks.values()), checks  # the patched wheel, not pip's build of the sdist
    assert str(venv) in checks["installed"]["detail"]

    user = tmp_path / "user-repo"  # the demo DAG files and their declaration, as a user's repository holds them
    (user / "dags").mkdir(parents=True)
    for name in ("nightly_retrain.py", "model_search.py"):
        shutil.copy2(REPO / "dags" / name, user / "dags" / name)
    shutil.copytree(REPO / "pipelines", user / "pipelines")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("AIRFLOW")}
    env.update({"AIRFLOW_HOME": str(tmp_path / "airflow-home"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__DAGS_FOLDER": str(user / "dags"),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{tmp_path / 'airflow.db'}",
                "NIGHTSHIFT_HOME": str(tmp_path / "home"), "NIGHTSHIFT_GX_DIR": str(REPO / "gx"),
                "NIGHTSHIFT_RETRAIN_CRON": "none", "NIGHTSHIFT_BACKEND": "local"})
    code = DAGBAG.format(folder=str(user / "dags"), names=[*TEAMS_AIRFLOW, "nightshift", "horovod"])
    proc = subprocess.run([str(python), "-c", code], env=env, cwd=user, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["versions"] == {**TEAMS_AIRFLOW, "nightshift": "0.1.0", "horovod": "0.28.1"}  # no downgrade
    assert out["errors"] == {} and out["dags"] == ["model_search", "nightly_retrain"], out
    assert Path(out["factory"]).resolve().is_relative_to(venv.resolve())  # the installed factory, not the checkout's
