"""`airflow dags test nightly_retrain` with backend=hosts: the train task runs the kubernetes backend's MPIJob
across 2 emulated hosts (`nightshift run-mpijob` as the task's child), logs to MLflow through a service over the
task's own store, and the run registers the model. One host's processes are killed mid-training: the task's
retry resumes from the checkpoint, and the model is bit for bit the single-host yardstick's (test_run_mpijob's:
`horovodrun -np 2 -H localhost:2 --gloo`, with each rank's threads set to what a rank alone on its host takes).
Nothing of either try is left: no namespace, no process, no temporary file. Skips, like test_run_mpijob,
without root, `ip`, `unshare` or `sshd`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from nightshift.mpijob_local.requirements import missing
from tests.integration.airflow_helpers import demo_module, registered_versions, stop_model_server
from tests.integration.horovod_helpers import processes_mentioning

BIN = Path(sys.executable).parent
# 2 ranks x batch 8, 2 epochs: 158 steps; the first checkpoint (step 100) comes mid-run.
CONF = {"backend": "hosts", "workers": 2, "epochs": 2, "batch_size": 8}
THREADS = os.cpu_count() or 1  # each emulated host runs one rank: it takes every core
LACKING = missing()
pytestmark = [pytest.mark.integration] if not LACKING else [
    pytest.mark.integration, pytest.mark.skip(reason=f"emulated hosts need {'; '.join(LACKING)}")]


def run_mpijob_pids(home: Path) -> list[int]:
    """The run-mpijob processes whose claim is `home` (this test's NIGHTSHIFT_HOME), oldest first."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "run-mpijob" in argv[1:3] and f"nightshift-workspace={home}" in argv:
            found.append(int(entry.name))
    return sorted(found)


class KillWorkerHostAfterFirstCheckpoint(threading.Thread):
    """Notes every run-mpijob of this test's home; once a checkpoint exists, SIGKILLs every process of worker
    1's host (its sshd and its rank), once."""

    def __init__(self, home: Path) -> None:
        super().__init__(daemon=True)
        self.home = home
        self.seen: set[int] = set()
        self.killed: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            pids = run_mpijob_pids(self.home)
            self.seen.update(pids)
            if not self.killed and pids and any((self.home / "checkpoints").glob("**/ckpt-*.pt")):
                host = f"nsmj{pids[0]}-w1"
                victims = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True,
                                         check=False).stdout.split()
                for pid in victims:
                    with _gone():
                        os.kill(int(pid), signal.SIGKILL)
                self.killed = victims
            time.sleep(0.05)


class _gone:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> bool:
        return kind is not None and issubclass(kind, ProcessLookupError)


def without_mlflow_args(command: list[str]) -> list[str]:
    command = list(command)
    for flag in ("--mlflow-experiment", "--mlflow-run-name"):
        while flag in command:
            i = command.index(flag)
            del command[i:i + 2]
    return [arg for i, arg in enumerate(command) if not (arg == "--tag" or (i and command[i - 1] == "--tag"))]


def launcher_commands(log: str) -> list[list[str]]:
    """The launcher commands the hosts backend logged ("MPIJob NAME launcher command: [JSON]"), in order."""
    marker = "launcher command: "
    decoder = json.JSONDecoder()
    found = []
    for line in log.splitlines():
        if marker in line:
            command, _ = decoder.raw_decode(line, line.index(marker) + len(marker))
            found.append(command)
    return found


def single_host_reference(launcher: list[str], out: Path) -> Path:
    """The job's trainer arguments under `horovodrun -np N -H localhost:N --gloo` on this one host."""
    np_ = launcher[launcher.index("-np") + 1]
    args = launcher[launcher.index("python"):]
    for flag, value in (("--out", out / "model"), ("--checkpoint-dir", out / "ckpt")):
        args[args.index(flag) + 1] = str(value)
    argv = [str(BIN / "horovodrun"), "-np", np_, "-H", f"localhost:{np_}", "--gloo", *without_mlflow_args(args),
            "--threads", str(THREADS)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out / "model" / "model.pt"


def test_dag_trains_on_emulated_hosts_and_a_killed_host_is_resumed_bit_for_bit(tmp_path: Path) -> None:
    import torch

    module = demo_module()
    home = tmp_path / "home"
    env = module.airflow_env(home, tmp_path / "airflow-home")
    for name in ("MLFLOW_TRACKING_URI", "NIGHTSHIFT_CLUSTER_MLFLOW_URI", "NIGHTSHIFT_MLFLOW_ARTIFACTS"):
        env.pop(name, None)
    env.update({"NIGHTSHIFT_RETRAIN_CRON": "none", "NIGHTSHIFT_TRAIN_RETRY_DELAY_S": "1"})
    module.prepare_airflow(env)

    killer = KillWorkerHostAfterFirstCheckpoint(home)
    killer.start()
    try:
        run = module.run_dag(env, CONF, progress=None, timeout=1200)
    finally:
        killer.stop.set()
        stop_model_server(env)
    log = run.log.read_text()
    assert run.code == 0, log[-4000:]
    assert killer.killed, f"worker 1's host was never killed (no checkpoint?)\n{log[-3000:]}"

    # The first try failed, naming the lost host; the second resumed from the checkpoint and succeeded.
    assert re.search(r"lost host \S+-worker-1 \(its processes are gone", log), log[-4000:]
    assert "resumed from checkpoint" in log and "at step 100/158" in log
    with sqlite3.connect(tmp_path / "airflow-home" / "airflow.db") as db:
        state, tries = db.execute("select state, try_number from task_instance where task_id = 'train'").fetchone()
    assert (state, tries) == ("success", 2)
    # One run-mpijob per try, as the task logged them (the /proc poll may also catch a child run-mpijob forked
    # between its fork and its exec, with the same command line).
    started = {int(pid) for pid in re.findall(r"run-mpijob \(pid (\d+)\)", log)}
    assert len(started) == 2 and started <= killer.seen, (started, killer.seen)

    # Trained across the hosts, logged to MLflow through the service, registered.
    record = run.record
    assert record and record["status"] == "success" and record["model_version"] == "1", record
    assert registered_versions(home) == ["1"]
    launchers = launcher_commands(log)
    assert len(launchers) >= 2 and all(command == launchers[0] for command in launchers)  # one per try
    command = launchers[-1]
    out = Path(command[command.index("--out") + 1])
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 158
    assert json.loads((out / "mlflow_run.json").read_text())["run_id"] == record["mlflow_run_id"]
    for i in range(2):
        assert re.search(rf"\[\S+-worker-{i}\] Accepted publickey for root from 10\.231\.0\.10", log)

    # Bit for bit the single-host yardstick's model.
    reference = single_host_reference(command, tmp_path / "reference")
    first, second = torch.load(out / "model.pt", weights_only=True), torch.load(reference, weights_only=True)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), f"parameter {name} differs"

    # Nothing left of either try: namespaces, processes, temporary files.
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    for pid in killer.seen:
        assert f"nsmj{pid}-" not in namespaces, namespaces
        assert not list(Path(tempfile.gettempdir()).glob(f"nightshift-mpijob-{pid}-*"))
        assert not processes_mentioning(f"nightshift-mpijob-{pid}-")
    assert not processes_mentioning(str(home / "mlflow.db"), str(out))
    # Each try's manifest directory (named in its run-mpijob command line; other tests' hosts runs may be
    # running beside this one, so only this run's are looked at).
    scratch = set(re.findall(r"run-mpijob (/\S+/nightshift-hosts-[^/\s]+)/mpijob\.yaml", log))
    assert len(scratch) == 2 and not [path for path in scratch if Path(path).exists()], scratch
