"""`nightly_retrain` under the CeleryExecutor, as production spreads tasks over machines.

Everything on 127.0.0.1, started here through scripts/airflow.sh (the project's Airflow environment), each
process in a session of its own and stopped by process group: api-server, scheduler, dag-processor and two
Celery workers (`airflow celery worker`, concurrency 1, hostnames worker-a@ and worker-b@). The metadata
database and Celery's result backend are one PostgreSQL database of this module's own (dropped after); the
broker is Redis, with a key prefix of this module's own (`[celery_broker_transport_options]
global_keyprefix`; its keys are deleted after).

One run, triggered through the REST API with a small conf, loses the worker running `train`: once the first
checkpoint exists, that worker and everything under it (the task runner, horovodrun and the ranks, which
live in sessions of their own) are SIGKILLed, as when its machine goes away. The scheduler finds the task's
heartbeat gone, Airflow retries it (after NIGHTSHIFT_TRAIN_RETRY_DELAY_S, 5 s here), the other worker runs the
retry, the trainer resumes from the checkpoint in the dag/run/task-keyed directory, and the run succeeds.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nightshift.netutil import free_ports
from tests.integration.airflow_helpers import (
    HOST,
    POSTGRES_URL,
    REDIS_URL,
    REPO,
    Api,
    database_url,
    postgres_answers,
    postgres_database,
    redis_answers,
    stop_groups,
    stop_model_server,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not postgres_answers(), reason=f"no PostgreSQL answers at {POSTGRES_URL}"),
    pytest.mark.skipif(not redis_answers(), reason=f"no Redis answers at {REDIS_URL}"),
]

DAG_ID = "nightly_retrain"
WORKERS = ("worker-a", "worker-b")
# 2 ranks x ceil(1257 / 2 / 8) = 79 steps per epoch, 237 steps: checkpoints at steps 100, 200 and the end.
CONF = {"epochs": 3, "batch_size": 8, "workers": 2, "backend": "local", "force": True, "min_improvement": 0.0}
HEARTBEAT_TIMEOUT = 20  # seconds without a task heartbeat before the scheduler fails the task instance
SCRIPT = str(REPO / "scripts" / "airflow.sh")


@dataclass
class CeleryAirflow:
    api: Api
    env: dict[str, str]
    home: Path
    procs: dict[str, subprocess.Popen[bytes]]
    logs: dict[str, Path]
    database: str

    def describe(self) -> str:
        parts = []
        for name, path in self.logs.items():
            code = self.procs[name].poll()
            parts.append(f"--- {name} ({'running' if code is None else f'exited {code}'}) {path}:\n"
                         f"{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)


def _delete_redis_keys(prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture(scope="module")
def celery_airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CeleryAirflow]:
    home = tmp_path_factory.mktemp("nightshift-celery")
    port, worker_log_port, trigger_log_port = free_ports(3)
    prefix = f"nightshift_test_{secrets.token_hex(4)}:"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Path] = {}
    with contextlib.ExitStack() as cleanup:
        name = cleanup.enter_context(postgres_database("nightshift_test_celery"))
        cleanup.callback(_delete_redis_keys, prefix)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("AIRFLOW", "MLFLOW_TRACKING_URI", "NIGHTSHIFT_MLFLOW_UI"))}
        env.update({
            "NIGHTSHIFT_HOME": str(home),
            "AIRFLOW_HOME": str(home / "airflow-home"),
            "AIRFLOW_PORT": str(port),
            "NIGHTSHIFT_AIRFLOW_DB": "postgres",
            "NIGHTSHIFT_POSTGRES_URL": POSTGRES_URL,
            "NIGHTSHIFT_AIRFLOW_PG_DB": name,
            "NIGHTSHIFT_RETRAIN_CRON": "none",
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__CELERY__BROKER_URL": REDIS_URL,
            "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__GLOBAL_KEYPREFIX": prefix,
            "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT": "3600",
            "AIRFLOW__CELERY__RESULT_BACKEND": f"db+{database_url(name)}",
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": "1",
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(worker_log_port),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(trigger_log_port),
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT),
            # The lost worker is replaced at once here: its retry need not wait the default minute
            "NIGHTSHIFT_TRAIN_RETRY_DELAY_S": "5",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        })
        migrate = subprocess.run([SCRIPT, "db", "migrate"], env=env, capture_output=True, text=True, timeout=600,
                                 check=False, stdin=subprocess.DEVNULL)
        assert migrate.returncode == 0, migrate.stderr[-3000:]

        commands = {
            "api-server": ["api-server"],
            "scheduler": ["scheduler"],
            "dag-processor": ["dag-processor"],
            **{worker: ["celery", "worker", "--concurrency", "1", "--celery-hostname", f"{worker}@%h",
                        "--skip-serve-logs", "--without-mingle", "--without-gossip"] for worker in WORKERS},
        }
        # after Airflow stops (ExitStack runs callbacks last in, first out): a deploy task still running when a
        # test gave up could start a model server after an earlier stop
        cleanup.callback(stop_model_server, env)
        cleanup.callback(lambda: stop_groups(procs.values()))
        for component, argv in commands.items():
            logs[component] = home / f"{component}.log"
            with logs[component].open("wb") as log:
                procs[component] = subprocess.Popen([SCRIPT, *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL, start_new_session=True)

        airflow = CeleryAirflow(Api(f"http://{HOST}:{port}"), env, home, procs, logs, name)
        # Readiness, not the clock: a component that exits fails at once; the bounds only catch a hang (on a
        # loaded 2-core machine the five components' start-up took over two minutes).
        airflow.api.wait_ready(DAG_ID, lambda: all(p.poll() is None for p in procs.values()), timeout=600,
                               describe=airflow.describe)
        airflow.api.call("POST", "/pools", {"name": "gpu", "slots": 16, "description": "Horovod training slots"})
        airflow.api.call("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})
        deadline = time.monotonic() + 600
        while waiting := [w for w in WORKERS if not _worker_ready(logs[w], w)]:
            exited = [w for w in waiting if procs[w].poll() is not None]
            assert not exited, f"{airflow.describe()}\nCelery worker(s) {exited} exited before they were ready"
            assert time.monotonic() < deadline, f"{airflow.describe()}\nCelery worker(s) {waiting} not ready in 600 s"
            time.sleep(1)
        yield airflow


def _worker_ready(log: Path, worker: str) -> bool:
    text = log.read_text(errors="replace")
    return f"{worker}@" in text and "ready." in text


# --- losing a worker ------------------------------------------------------------------------------------


def _ranks_under(pid: int) -> list[int]:
    """The trainer ranks (`python -m nightshift.train`) among the descendants of `pid`."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    ranks = []
    for proc in children:
        try:
            if proc.cmdline()[1:3] == ["-m", "nightshift.train"]:
                ranks.append(proc.pid)
        except psutil.Error:
            continue
    return ranks


def _machine_of(leader: int) -> set[int]:
    """What a machine running this worker holds: its process group and every descendant (horovodrun and
    the ranks live in sessions of their own)."""
    import psutil

    pids = {leader}
    with contextlib.suppress(psutil.NoSuchProcess):
        pids |= {p.pid for p in psutil.Process(leader).children(recursive=True)}
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == leader:
                pids.add(proc.pid)
    return pids


def _lose_machine(leader: int) -> set[int]:
    """Freeze everything of the worker (until nothing new appears), then SIGKILL its process group and it all."""
    stopped: set[int] = set()
    for _ in range(5):
        new = _machine_of(leader) - stopped
        if not new:
            break
        for pid in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        stopped |= new
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader, signal.SIGKILL)
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return stopped


class KillWorkerAtFirstCheckpoint(threading.Thread):
    """Finds the worker whose tree runs the trainer ranks; when the train task's first checkpoint appears,
    stops the ranks at once (SIGSTOP) and takes that worker's machine away. Then records where the ranks of
    the retry run."""

    def __init__(self, workers: dict[str, subprocess.Popen[bytes]], checkpoints: Path) -> None:
        super().__init__(daemon=True)
        self.workers = workers
        self.checkpoints = checkpoints
        self.victim: str | None = None
        self.killed: set[int] = set()
        self.checkpoints_at_kill: list[str] = []
        self.killed_at = 0.0
        self.retry_ran_on: str | None = None
        self.retry_seen_at = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        ranks: dict[str, list[int]] = {}
        polls = 0
        while not self.stop.is_set() and self.victim is None:
            # Look for the ranks every 0.1 s until they run, then for the checkpoint every 0.02 s.
            if polls % 5 == 0:
                ranks = {name: _ranks_under(proc.pid) for name, proc in self.workers.items()}
            polls += 1
            busy = [name for name, pids in ranks.items() if pids]
            if not busy:
                time.sleep(0.02)
                continue
            found = sorted(p.name for p in self.checkpoints.glob(f"{DAG_ID}/*/train/ckpt-*.pt"))
            if found:
                self.victim = busy[0]
                for pid in ranks[self.victim]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGSTOP)
                self.killed = _lose_machine(self.workers[self.victim].pid)
                self.killed_at = time.monotonic()
                self.checkpoints_at_kill = found
                self.workers[self.victim].wait(timeout=30)
                break
            time.sleep(0.02)
        while not self.stop.is_set() and self.retry_ran_on is None:
            for name, proc in self.workers.items():
                if proc.poll() is None and _ranks_under(proc.pid):
                    self.retry_ran_on, self.retry_seen_at = name, time.monotonic()
            time.sleep(0.5)


def _step_of(checkpoint: str) -> int:
    return int(checkpoint.split("-")[1])


def _workloads(log: Path, task_id: str) -> list[int]:
    """Try numbers of `task_id` workloads this Celery worker logged it executes."""
    tries = []
    for line in log.read_text(errors="replace").splitlines():
        if "Executing workload in Celery" in line and f"task_id='{task_id}'" in line:
            match = re.search(r"try_number=(\d+)", line)
            if match:
                tries.append(int(match.group(1)))
    return tries


def test_a_worker_lost_mid_training_is_retried_on_the_other_and_resumes(celery_airflow: CeleryAirflow) -> None:
    import psutil

    airflow, api = celery_airflow, celery_airflow.api
    workers = {name: airflow.procs[name] for name in WORKERS}
    killer = KillWorkerAtFirstCheckpoint(workers, airflow.home / "checkpoints")
    killer.start()
    started = time.monotonic()
    run_id = api.trigger(DAG_ID, CONF)
    states: list[tuple[float, str | None, int]] = []  # train's (seconds since trigger, state, try) as they change
    state = "queued"
    deadline = started + 600  # a bound for a hung run, not a speed: under load the run took 270-300 s
    try:
        while state not in {"success", "failed"}:
            assert time.monotonic() < deadline, f"run still {state}: {states}\n{airflow.describe()}"
            state = str(api.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"])
            train = api.task_instances(DAG_ID, run_id).get("train", {})
            now = (round(time.monotonic() - started, 1), train.get("state"), int(train.get("try_number") or 0))
            if not states or states[-1][1:] != now[1:]:
                states.append(now)
            time.sleep(2)
    finally:
        killer.stop.set()
        killer.join(timeout=10)
    tis = api.task_instances(DAG_ID, run_id)
    summary = {
        "run": state, "train": states, "victim": killer.victim, "killed_pids": len(killer.killed),
        "checkpoints_at_kill": killer.checkpoints_at_kill, "retry_ran_on": killer.retry_ran_on,
        "kill_to_retry_ranks_s": round(killer.retry_seen_at - killer.killed_at, 1) if killer.retry_seen_at else None,
        "run_s": round(time.monotonic() - started, 1),
        "workloads": {w: {t: _workloads(airflow.logs[w], t) for t in tis} for w in WORKERS},
    }
    print("\n".join(f"{key}: {json.dumps(value)}" for key, value in summary.items()))
    assert killer.victim is not None, f"train never ran with a checkpoint to kill at: {summary}\n{airflow.describe()}"
    assert state == "success", f"{summary}\n{ {t: ti['state'] for t, ti in tis.items()} }\n{airflow.describe()}"

    # The lost machine: nothing of it is left.
    assert workers[killer.victim].poll() is not None
    assert not [pid for pid in killer.killed if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE], "processes of the killed worker live on"

    # Airflow retried train once: try 1 on the lost worker, try 2 on the other.
    survivor = next(w for w in WORKERS if w != killer.victim)
    assert (tis["train"]["state"], tis["train"]["try_number"]) == ("success", 2), tis["train"]
    assert 1 in _workloads(airflow.logs[killer.victim], "train")
    assert _workloads(airflow.logs[survivor], "train") == [2]
    assert killer.retry_ran_on == survivor
    assert "up_for_retry" in [train_state for _, train_state, _ in states], states
    for task in ("validate_data", "stage_dataset", "evaluate", "register", "deploy"):
        assert tis[task]["state"] == "success", (task, tis[task])

    # The retry resumed from the first try's checkpoint and ran only the remaining steps.
    workspace = airflow.home / "workspaces" / DAG_ID
    (metrics_path,) = workspace.glob("*/model/metrics.json")
    metrics = json.loads(metrics_path.read_text())
    killed_at_step = max(_step_of(name) for name in killer.checkpoints_at_kill)
    assert metrics["resumed_from_step"] is not None and metrics["resumed_from_step"] >= killed_at_step, metrics
    assert metrics["steps_run"] == metrics["steps"] - metrics["resumed_from_step"], metrics
    logs = airflow.home / "airflow-home" / "logs"
    (retry_log,) = logs.glob(f"dag_id={DAG_ID}/run_id=*/task_id=train/attempt=2.log")
    assert "resumed from checkpoint" in retry_log.read_text(errors="replace")
