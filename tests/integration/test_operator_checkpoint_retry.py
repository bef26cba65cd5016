"""Checkpoint retries for real, under `airflow dags test`.

The first try's Horovod ranks are SIGKILLed once a checkpoint exists; Airflow retries the task (retries=1,
no delay); the second try resumes from the checkpoint in the dag/run/task-keyed directory. The final
model must equal, bit for bit, the one an uninterrupted run produces.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from operators.local_launcher import LocalHorovodLauncher
from tests.conftest import REPO

pytestmark = pytest.mark.integration

DAGS = Path(__file__).parent / "dags"
DAG_ID = "operator_checkpoint_retry"
# ~300 steps of 2 ranks: a few seconds, long after the first checkpoint at step 10.
TRAIN_ARGS = "--epochs 8 --batch-size 16 --checkpoint-every 10 --log-every 20 --threads 1 --seed 11"
AIRFLOW = str(Path(sys.executable).with_name("airflow"))


def rank_processes(root_pid: int) -> list:  # type: ignore[type-arg]
    """The trainer ranks under `root_pid` (not horovodrun, not the shells that start them)."""
    import psutil

    ranks = []
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            cmd = proc.cmdline()
        except psutil.NoSuchProcess:
            continue
        if cmd[1:3] == ["-m", "nightshift.train"]:
            ranks.append(proc)
    return ranks


class KillRanksAfterFirstCheckpoint(threading.Thread):
    """Watches the checkpoint root; when the first checkpoint appears, SIGKILLs every rank once."""

    def __init__(self, root_pid: int, checkpoint_root: Path) -> None:
        super().__init__(daemon=True)
        self.root_pid = root_pid
        self.checkpoint_root = checkpoint_root
        self.killed: list[int] = []
        self.checkpoints_at_kill: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            found = sorted(p.name for p in self.checkpoint_root.glob("**/ckpt-*.pt"))
            if found:
                ranks = rank_processes(self.root_pid)
                for proc in ranks:
                    os.kill(proc.pid, signal.SIGKILL)
                    self.killed.append(proc.pid)
                self.checkpoints_at_kill = found
                return
            time.sleep(0.02)


def airflow_env(tmp_path: Path, data: Path, out: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "NIGHTSHIFT_HOME": str(tmp_path / "home"),
        "NIGHTSHIFT_TEST_DATA": str(data),
        "NIGHTSHIFT_TEST_OUT": str(out),
        "NIGHTSHIFT_TEST_TRAIN_ARGS": TRAIN_ARGS,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
    }
    env.pop("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", None)
    return env


def step_of(checkpoint_name: str) -> int:
    return int(checkpoint_name.split("-")[1])


def test_killed_first_try_is_resumed_by_the_retry(tmp_path: Path, demo_data: Path) -> None:
    import torch

    out = tmp_path / "out"
    env = airflow_env(tmp_path, demo_data, out)
    subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True, timeout=240)
    subprocess.run(
        [AIRFLOW, "pools", "set", "gpu", "4", "GPUs of the cluster"], env=env, check=True, capture_output=True
    )

    log_path = tmp_path / "dags-test.log"
    with log_path.open("w") as log:
        airflow = subprocess.Popen(
            [AIRFLOW, "dags", "test", DAG_ID], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path
        )
        killer = KillRanksAfterFirstCheckpoint(airflow.pid, tmp_path / "home" / "checkpoints")
        killer.start()
        try:
            code = airflow.wait(timeout=300)
        finally:
            killer.stop.set()
            if airflow.poll() is None:
                airflow.kill()
                airflow.wait()
    output = log_path.read_text()
    assert code == 0, output[-4000:]
    assert len(killer.killed) == 2, f"expected to SIGKILL 2 ranks, killed {killer.killed}\n{output[-3000:]}"

    # Airflow recorded a failed first try and a successful second one.
    with sqlite3.connect(tmp_path / "airflow" / "airflow.db") as db:
        state, try_number = db.execute(
            "select state, try_number from task_instance where dag_id = ? and task_id = 'train'", (DAG_ID,)
        ).fetchone()
    assert (state, try_number) == ("success", 2), output[-3000:]

    # The checkpoints live under dag/run/task, shared by both tries.
    (run_dir,) = (tmp_path / "home" / "checkpoints" / DAG_ID).iterdir()
    assert (run_dir / "train").is_dir()

    # The second try resumed from a checkpoint at least as new as the one that triggered the kill,
    # and ran only the remaining steps.
    metrics = json.loads((out / "metrics.json").read_text())
    killed_at = max(step_of(name) for name in killer.checkpoints_at_kill)
    assert metrics["resumed_from_step"] is not None and metrics["resumed_from_step"] >= killed_at
    assert metrics["steps_run"] == metrics["steps"] - metrics["resumed_from_step"]
    assert "resumed from checkpoint" in output

    # An uninterrupted run with the same arguments ends with bitwise-equal parameters.
    baseline_out = tmp_path / "baseline-out"
    LocalHorovodLauncher(
        2,
        [
            "python", "-m", "nightshift.train",
            "--data", str(demo_data), "--out", str(baseline_out),
            "--checkpoint-dir", str(tmp_path / "baseline-ckpt"),
            *TRAIN_ARGS.split(),
        ],
        timeout=300,
    ).run()  # fmt: skip
    resumed = torch.load(out / "model.pt", weights_only=True)
    baseline = torch.load(baseline_out / "model.pt", weights_only=True)
    assert resumed.keys() == baseline.keys()
    for key in baseline:
        assert torch.equal(resumed[key], baseline[key]), key
