"""The season, night by night: the data lands, a fault strikes, the scheduler runs the night, the oracle judges it.

Each night: night n's data is linked before its run starts (night 1 before the DAG is unpaused; night n+1 as soon
as night n's run has read its data: stage_dataset succeeded, or the run failed before it could); faults that last
the whole night start before the run does (the DVC remote made read-only, the model server killed); faults of the
middle of a run strike once training runs (a rank killed, the scheduler's machine lost, PostgreSQL restarted). The
scheduler starts the run on its compressed cron (NIGHTSHIFT_RETRAIN_CRON, a tick a minute); the season waits for it
to end (a run past `night_bound` is wedged: marked failed through the REST API so that the season goes on), then
measures the disk and the metadata database, and asks the oracle (bench.season.oracle).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.season import faults, oracle
from bench.season.airflow import (
    Components,
    PrivatePostgres,
    SeasonApi,
    create_database,
    database_size,
    drop_database,
    migrate,
    postgres_bin,
    season_env,
    snapshot,
    terminate_connections,
)
from bench.season.script import Landing, Night, golden_table
from nightshift.netutil import free_port
from tests.integration.airflow_helpers import BIN, HOST, POSTGRES_URL, REPO, database_url

DAG_ID = "nightly_retrain"
MAINTENANCE_DAG = "nightshift_maintenance"
MODEL = "nightshift-digits"
TERMINAL = {"success", "failed"}
MID_RUN = {"worker_killed", "scheduler_killed", "postgres_restarted"}
STEPS_PER_CHECKPOINT = 100  # nightshift.train's checkpoint_every


@dataclass
class SeasonConfig:
    nights: list[Night]
    rows: int = 2400  # rows a night lands (train 70%): 2,400 rows train 135 steps, a checkpoint at step 100
    cron: str = "* * * * *"
    maintenance: str = "none"  # the nightshift_maintenance DAG's schedule in the season
    private_postgres: bool = True  # a PostgreSQL of the season's own where the binaries are
    night_bound: float = 1500.0  # seconds a night may run before it counts as wedged
    start_bound: float = 420.0  # seconds the scheduler has to start a night's run
    ready_bound: float = 1500.0  # seconds Airflow has to start (at a load of 20, 545 s; once over 900 s)
    dags_test: bool = False  # also time `airflow dags test` of night 1's data
    clock_nights: float | None = None  # retention on the season's clock, every window this many nights (clock.py)
    keep: bool = False  # keep the season's folder (home, landing, logs)
    log: Callable[[str], None] = print


@dataclass
class NightRow:
    night: int
    event: str
    fault: str | None
    world: str
    run_id: str | None = None
    read: int | None = None  # whose data the run read (a night number)
    decision: str = "no run"
    run_state: str | None = None  # Airflow's end state of the run
    expected: str = "?"
    wall_s: float | None = None  # the run's own start to end
    wait_s: float | None = None  # from the night's start (the previous run's end) to the run's start
    home_bytes: int = 0
    db_bytes: int | None = None
    growth_bytes: int = 0
    dvc_new_bytes: int = 0
    registered_bytes: int = 0
    beyond_bytes: int = 0
    by_folder: dict[str, int] = field(default_factory=dict)  # growth this night per entry of NIGHTSHIFT_HOME
    tasks: dict[str, str] = field(default_factory=dict)  # task: state (and tries beyond the first)
    retention: dict[str, Any] = field(default_factory=dict)  # what retention on the season's clock removed
    scores: dict[str, float | None] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(self.checks.values())


# --- measuring ------------------------------------------------------------------------------------------------


# Folders of NIGHTSHIFT_HOME whose entries are worth telling apart in a night's growth.
DETAILED = ("airflow-home", "airflow-home/logs", "gx", "gx/data_docs", "mlartifacts", "serving")


def disk_usage(folder: Path) -> tuple[int, dict[str, int]]:
    """Bytes of disk `folder` uses (allocated blocks, as du counts; each inode once), in all and per entry: each
    top entry, and each entry of the DETAILED folders (`airflow-home/logs/dag_id=...`)."""
    seen: set[tuple[int, int]] = set()
    total, per = 0, {}
    if not folder.exists():
        return 0, {}
    for entry in sorted(folder.rglob("*")):
        with contextlib.suppress(OSError):
            info = entry.lstat()
            if (info.st_dev, info.st_ino) in seen:
                continue
            seen.add((info.st_dev, info.st_ino))
            size = info.st_blocks * 512
            total += size
            parts = entry.relative_to(folder).parts
            key = parts[0]
            for depth in (2, 3, 4):
                if len(parts) > depth and "/".join(parts[:depth - 1]) in DETAILED:
                    key = "/".join(parts[:depth])
            per[key] = per.get(key, 0) + size
    return total, per


def dvc_objects(home: Path) -> dict[str, int]:
    """Every object file of the staging cache and the DVC remote: path -> bytes."""
    found = {}
    for root in (home / "dvc" / ".dvc" / "cache", home / "dvc-remote"):
        if root.is_dir():
            for path in root.rglob("*"):
                with contextlib.suppress(OSError):
                    if path.is_file() and not path.is_symlink():
                        found[str(path)] = path.lstat().st_blocks * 512
    return found


def staged_anywhere(home: Path, digests: dict[str, str]) -> list[str]:
    """Where any of these split md5s lies in the staging cache, the remote or a workspace (DVC names an object
    by its md5: files/md5/<2 hex>/<30 hex>)."""
    import hashlib

    wanted = set(digests.values())
    found = []
    for root in (home / "dvc" / ".dvc" / "cache", home / "dvc-remote"):
        for path in root.rglob("*") if root.is_dir() else ():
            if path.parent.name + path.name in wanted:
                found.append(str(path))
    for path in (home / "workspaces").rglob("*.parquet") if (home / "workspaces").is_dir() else ():
        with contextlib.suppress(OSError):
            if hashlib.md5(path.read_bytes()).hexdigest() in wanted:
                found.append(str(path))
    return found


def ledger_records(home: Path) -> list[dict[str, Any]]:
    path = home / "airflow" / DAG_ID / "runs.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def struck(fault: str | None, staged_at: float | None, read_only_at: float | None) -> tuple[str | None, str | None]:
    """(the night's fault as it struck, a note when it missed). The scheduler starts a night's run as soon as the
    last one ends (its cron tick has passed already), so it may stage before the season has made the remote
    read-only: that night is judged without the fault."""
    if fault != "dvc_remote_unwritable" or staged_at is None or read_only_at is None or staged_at >= read_only_at:
        return fault, None
    return None, (f"the fault missed: stage_dataset started at {_clock(staged_at)}, before the remote was made "
                  f"read-only ({_clock(read_only_at)}); judged without it")


def _clock(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).strftime("%H:%M:%S")


def _epoch(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


# --- the season -----------------------------------------------------------------------------------------------


class Season:
    """One season in a folder of its own (`root`): NIGHTSHIFT_HOME, the landing folder, the components' logs."""

    def __init__(self, config: SeasonConfig) -> None:
        self.config = config
        self.root = Path(tempfile.mkdtemp(prefix="nightshift-season-"))
        self.home = self.root / "home"
        self.landing = Landing(self.root / "landing", self.home / "demo-data" / "digits", config.rows)
        self.logs = self.root / "logs"
        self.logs.mkdir(parents=True)
        self.rows: list[NightRow] = []
        self.summary: dict[str, Any] = {}
        self.database = f"nightshift_season_{secrets.token_hex(4)}"
        self.pg: PrivatePostgres | None = None
        self.server = POSTGRES_URL
        self.components: Components | None = None
        self.api: SeasonApi | None = None
        self.port = free_port()
        self.served_ports: set[int] = set()
        self.scorer = oracle.GoldenScorer(f"sqlite:///{self.home / 'mlflow.db'}")
        self._golden: dict[Any, Any] = {}
        self.night_starts: dict[int, float] = {}

    def say(self, text: str) -> None:
        self.config.log(f"[season {time.strftime('%H:%M:%S')}] {text}")

    # --- setting up and tearing down -------------------------------------------------------------------------

    def setup(self) -> None:
        binaries = postgres_bin() if self.config.private_postgres else None
        if binaries is not None:
            self.pg = PrivatePostgres(binaries)
            self.pg.start()
            self.server = self.pg.url
            self.say(f"PostgreSQL of the season's own: {self.server} ({binaries})")
        else:
            self.say(f"PostgreSQL: the shared server {self.server} (the restart fault terminates the database's "
                     f"connections instead)")
        create_database(self.server, self.database)
        self.landing.write(1, self.config.nights[0])
        self.landing.switch(1)
        self.switched = {1: time.time()}
        self.remote_read_only: dict[int, float] = {}  # night: when its DVC remote was made read-only
        code = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=False).stdout.strip() or "unknown"
        self.code = snapshot(self.root / "code")
        self.say(f"code: {code} (HEAD, a snapshot in {self.code})")
        self.env = season_env(self.home, code=self.code, port=self.port, server=self.server, database=self.database,
                              landing=self.landing.root, cron=self.config.cron,
                              maintenance=self.config.maintenance, code_version=f"{code}+season")
        started = time.monotonic()
        migrate(self.env, self.code)
        self.components = Components(self.env, self.logs, self.code)
        self.components.start_all()
        self.api = SeasonApi(f"http://{HOST}:{self.port}")
        self.api.wait_ready(DAG_ID, self.components.alive, self.config.ready_bound, self.components.describe)
        self.api.call("POST", "/pools", {"name": "gpu", "slots": 16, "description": "Horovod training slots"})
        self.say(f"Airflow ready in {time.monotonic() - started:.0f} s (NIGHTSHIFT_HOME {self.home})")
        self.summary["startup_s"] = round(time.monotonic() - started, 1)
        self.api.call("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})
        if self.config.maintenance != "none":
            self.api.call("PATCH", f"/dags/{MAINTENANCE_DAG}", {"is_paused": False})

    def teardown(self) -> None:
        if self.api is not None:
            for dag in (DAG_ID, MAINTENANCE_DAG):
                with contextlib.suppress(Exception):
                    self.api.call("PATCH", f"/dags/{dag}", {"is_paused": True})
        if self.components is not None:
            self.components.stop()
        # never without the season's home: `nightshift deploy --stop` would stop ~/.nightshift's model server
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run([str(BIN / "nightshift"), "deploy", "--stop", "--model-name", MODEL],
                           env={**os.environ, **self.env, "NIGHTSHIFT_HOME": str(self.home)}, capture_output=True,
                           timeout=600, check=False)
        record = faults.serving_record(self.home, MODEL)
        if record and record.get("pid"):  # `deploy --stop` did not get to it: stop its process group here
            faults.kill_model_server(self.home, MODEL)
        with contextlib.suppress(Exception):
            faults.make_writable(self.home / "dvc-remote") if faults.mounts_under(self.root) else None
        with contextlib.suppress(Exception):
            drop_database(self.server, self.database)
        if self.pg is not None:
            self.pg.stop()

    def leftovers(self) -> dict[str, list[str]]:
        """What the season left behind once stopped: processes of its folder, ports it used, mounts, namespaces."""
        import psutil

        mine = os.getpid()
        procs = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if proc.pid != mine and faults._ours(proc, self.root):
                    procs.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
                elif proc.pid != mine and proc.environ().get("NIGHTSHIFT_HOME") == str(self.home):
                    procs.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
        ports = {self.port, *self.served_ports, *(int(self.env[k]) for k in (
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT", "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT") if k in self.env)}
        if self.pg is not None:
            ports.add(self.pg.port)
        listening = sorted({c.laddr.port for c in psutil.net_connections("tcp")
                            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports})
        return {"processes": procs, "ports": [str(p) for p in listening], "mounts": faults.mounts_under(self.root),
                "namespaces": self.namespaces_of_ours()}

    def namespaces_of_ours(self) -> list[str]:
        """Network namespaces made since the season started that hold a process of the season (others' tests
        make theirs meanwhile)."""
        import psutil

        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
        ours = []
        for name in sorted({line.split()[0] for line in listed.splitlines() if line.strip()} - set(self.netns_before)):
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                                  check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(psutil.Error, OSError, ValueError):
                    if faults._ours(psutil.Process(int(pid)), self.home):
                        ours.append(name)
                        break
        return ours

    # --- one night -----------------------------------------------------------------------------------------------

    def golden(self, world: Any) -> Any:
        if world not in self._golden:
            self._golden[world] = golden_table(world)
        return self._golden[world]

    def champion(self) -> str | None:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        uri = f"sqlite:///{self.home / 'mlflow.db'}"
        if not (self.home / "mlflow.db").exists():
            return None
        try:
            return str(MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version_by_alias(MODEL,
                                                                                                  "champion").version)
        except MlflowException:
            return None

    def version_tags(self, version: str) -> dict[str, str]:
        from mlflow import MlflowClient

        uri = f"sqlite:///{self.home / 'mlflow.db'}"
        return dict(MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version(MODEL, version).tags)

    def new_run(self, seen: set[str]) -> dict[str, Any] | None:
        assert self.api is not None
        fresh = [r for r in self.api.runs(DAG_ID) if r["dag_run_id"] not in seen]
        return fresh[-1] if fresh else None  # the oldest new one

    def read_data(self, tis: dict[str, dict[str, Any]], run: dict[str, Any]) -> bool:
        """Whether the run is done reading its data source: staged, or failed before it could stage."""
        validate, stage = tis.get("validate_data", {}).get("state"), tis.get("stage_dataset", {}).get("state")
        return (stage == "success" or validate in ("failed", "upstream_failed", "skipped")
                or stage in ("failed", "upstream_failed", "skipped") or run.get("state") in TERMINAL)

    def run_night(self, number: int, night: Night, seen: set[str], trained_on: dict[str, str] | None) -> NightRow:
        assert self.api is not None and self.components is not None
        info = self.landing.written[number]
        row = NightRow(number, night.event, night.fault, info["world"].describe())
        night_start = time.time()
        before_home, before_folders = disk_usage(self.home)
        before_dvc = dvc_objects(self.home)
        champion_before = self.champion()
        remote = self.home / "dvc-remote"
        if night.fault == "dvc_remote_unwritable":
            faults.make_read_only(remote)
            self.remote_read_only[number] = time.time()
            row.notes.append(f"{remote} mounted read-only")
        if night.fault == "model_server_killed":
            pid = faults.kill_model_server(self.home, MODEL)
            row.notes.append(f"model server pid {pid} SIGKILLed" if pid else "no model server to kill")
        if number < len(self.config.nights):
            self.landing.write(number + 1, self.config.nights[number])
        fault = FaultThread(self, night.fault) if night.fault in MID_RUN else None
        run = None
        try:
            deadline = time.monotonic() + self.config.start_bound
            while run is None and time.monotonic() < deadline:
                run = self.new_run(seen)
                if run is None:
                    time.sleep(1)
            if run is None:
                row.notes.append(f"no run started within {self.config.start_bound:.0f} s")
                row.checks["not wedged"] = False
                return row
            run_id = row.run_id = str(run["dag_run_id"])
            seen.add(run_id)
            self.say(f"night {number} ({night.event}{', ' + night.fault if night.fault else ''}): run {run_id}")
            if fault is not None:
                fault.run_id = run_id
                fault.start()
            wedged = False
            run_deadline = time.monotonic() + self.config.night_bound
            while True:
                run = self.api.run(DAG_ID, run_id)
                tis = self.api.tasks(DAG_ID, run_id)
                if (number + 1 in self.landing.written and number + 1 not in self.switched
                        and self.read_data(tis, run)):
                    self.landing.switch(number + 1)
                    self.switched[number + 1] = time.time()
                if run["state"] in TERMINAL:
                    break
                if time.monotonic() > run_deadline:
                    wedged = True
                    row.notes.append(f"still {run['state']} after {self.config.night_bound:.0f} s: marked failed "
                                     f"({ {t: ti['state'] for t, ti in tis.items()} })")
                    self.api.fail_run(DAG_ID, run_id)
                    run = self.api.run(DAG_ID, run_id)
                    break
                time.sleep(1)
            row.checks["not wedged"] = not wedged
            row.run_state = str(run.get("state"))
            start, end = _epoch(run.get("start_date")), _epoch(run.get("end_date"))
            row.wall_s = round(end - start, 1) if start and end else None
            row.wait_s = round(start - night_start, 1) if start else None
        finally:
            if fault is not None:
                fault.stop.set()
                fault.join(timeout=120)
                row.notes += fault.notes
            if night.fault == "dvc_remote_unwritable":
                faults.make_writable(remote)
        self.night_starts[number] = night_start
        row.retention = self.season_clock(number)
        if self.config.clock_nights:
            row.checks["retention ran"] = "error" not in row.retention
            if row.retention:
                row.notes.append(f"retention on the season's clock: {json.dumps(row.retention)[:400]}")
        row.notes += [text for at, text in self.components.events if night_start <= at]
        self.components.events[:] = [(at, text) for at, text in self.components.events if at < night_start]
        row.tasks = {task: str(ti.get("state")) + (f" x{ti['try_number']}" if (ti.get("try_number") or 0) > 1
                                                    else "") for task, ti in tis.items()}
        self.judge(row, night, info, tis, trained_on, champion_before, before_home, before_dvc)
        after = row.by_folder  # measure() left the totals there
        keys = sorted({*after, *before_folders})
        row.by_folder = {key: after.get(key, 0) - before_folders.get(key, 0) for key in keys
                         if after.get(key, 0) != before_folders.get(key, 0)}
        return row

    def season_clock(self, number: int) -> dict[str, Any]:
        """Retention on the season's clock (bench.season.clock) once night `number` ended: whatever is older than
        the start of the night `clock_nights` back, by every window."""
        nights = self.config.clock_nights
        if not nights or number - nights < 1:
            return {}
        done = subprocess.run([str(BIN / "python"), "-m", "bench.season.clock", "--pipeline",
                               str(self.code / "pipelines" / "digits.yaml"), "--nights", str(nights), "--since",
                               str(self.night_starts[int(number - nights)]), "--metadata-url",
                               database_url(self.database, server=self.server)],
                              env=self.env, cwd=self.code, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["?"])[-1]
            return {"error": f"exited {done.returncode}: {tail[-500:]}"}
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))

    def record_of(self, run_id: str) -> dict[str, Any] | None:
        def last() -> dict[str, Any] | None:
            found = [r for r in ledger_records(self.home) if r.get("run_id") == run_id]
            return found[-1] if found else None

        deadline = time.monotonic() + 60
        while (record := last()) is None and time.monotonic() < deadline:
            time.sleep(1)
        return record

    def judge(self, row: NightRow, night: Night, info: dict[str, Any], tis: dict[str, dict[str, Any]],
              trained_on: dict[str, str] | None, champion_before: str | None, before_home: int,
              before_dvc: dict[str, int]) -> None:
        assert row.run_id is not None
        record = self.record_of(row.run_id)
        row.decision = oracle.decision_of(record)
        # The run ends as its record says: success for a success record (its collect_garbage included), failed
        # for a failed one.
        row.checks["run state agrees"] = record is not None and row.run_state == record.get("status")
        if record is not None and row.run_state != record.get("status"):
            failed = sorted(t for t, ti in tis.items() if ti.get("state") == "failed")
            row.notes.append(f"the run ended {row.run_state} (failed: {', '.join(failed) or 'none'}), its record "
                             f"says {record.get('status')}")
        if record and record.get("status") == "failed" and record.get("reason"):
            row.notes.append(f"reason: {str(record['reason'])[:300]}")
        # Which night's data the run read: its record names the folder it staged; a run that failed before
        # staging read the folder linked when its gate started.
        read = self.night_of_folder((record or {}).get("dataset_source"))
        if read is None:
            started = _epoch(tis.get("validate_data", {}).get("start_date"))
            read = max((n for n, at in self.switched.items() if started is None or at <= started), default=None)
        row.read = read
        if read != row.night:
            row.notes.append(f"the run read night {read}'s data, not its own")
        data = self.landing.written[read] if read in self.landing.written else info
        fault, missed = struck(night.fault, _epoch(tis.get("stage_dataset", {}).get("start_date")),
                               self.remote_read_only.get(row.night))
        if missed:
            row.notes.append(missed)
        expected = oracle.expected_by_data(valid=data["valid"], digests=data["digests"], trained_on=trained_on,
                                           fault=fault)
        golden = self.golden(data["world"])
        before_score = self.scorer.score(f"models:/{MODEL}/{champion_before}", golden) if champion_before else None
        challenger = None
        if record and record.get("mlflow_run_id"):
            challenger = self.scorer.score(f"runs:/{record['mlflow_run_id']}/model", golden)
        if expected is None:
            expected = (oracle.expected_by_model(challenger, before_score) if challenger is not None
                        else "promoted|refused (no challenger to score)")
        row.expected = expected
        champion_after = self.champion()
        after_score = self.scorer.score(f"models:/{MODEL}/{champion_after}", golden) if champion_after else None
        scores = oracle.Scores(challenger, before_score, after_score)
        row.scores = {"challenger": challenger, "champion_before": before_score, "champion_after": after_score}
        row.checks["decision"] = oracle.matches(row.decision, expected)
        drop = scores.drop()
        row.checks["champion kept its score"] = drop is None or drop <= oracle.TOLERANCE
        if not data["valid"]:
            staged = tis.get("stage_dataset", {}).get("state") == "success"
            places = staged_anywhere(self.home, data["digests"])
            row.checks["bad data not staged"] = not staged and not places
            if places:
                row.notes.append(f"bad data found staged: {places[:3]}")
        row.checks["serves @champion"] = self.serves(champion_after, golden, row)
        gaps = oracle.lineage_gaps(record or {}, self.version_tags(str(record["model_version"]))
                                   if record and record.get("model_version") else None)
        row.checks["lineage complete"] = record is not None and not gaps
        if gaps:
            row.notes.append(f"lineage lacks {', '.join(gaps)}")
        self.measure(row, record, before_home, before_dvc)

    def night_of_folder(self, folder: Any) -> int | None:
        if not folder:
            return None
        resolved = str(Path(str(folder)).resolve())
        for number, written in self.landing.written.items():
            if str(Path(written["folder"]).resolve()) == resolved:
                return number
        return None

    def serves(self, champion: str | None, golden: Any, row: NightRow) -> bool:
        """The model server the serving record names answers, serves @champion, and predicts as @champion does."""
        import requests

        record = faults.serving_record(self.home, MODEL)
        if champion is None:
            return record is None
        if not record:
            row.notes.append("nothing serves: no serving record")
            return False
        self.served_ports.add(int(record["port"]))
        if str(record.get("version")) != champion:
            row.notes.append(f"the server runs v{record.get('version')}, @champion is v{champion}")
            return False
        rows = golden.head(32)
        features = rows.drop(columns=["label"])
        try:
            answer = requests.post(f"{record['url']}/invocations", timeout=30, json={"dataframe_split": {
                "columns": list(features.columns), "data": features.to_numpy().tolist()}})
            answer.raise_for_status()
            served = [int(p["predicted_label"]) for p in answer.json()["predictions"]]
        except (requests.RequestException, KeyError, ValueError) as err:
            row.notes.append(f"the model server at {record['url']} (v{champion}) does not answer: {err}")
            return False
        if served != self.scorer.predict(f"models:/{MODEL}/{champion}", rows):
            row.notes.append(f"the model server at {record['url']} answers otherwise than @champion v{champion}")
            return False
        return True

    def measure(self, row: NightRow, record: dict[str, Any] | None, before_home: int,
                before_dvc: dict[str, int]) -> None:
        row.home_bytes, row.by_folder = disk_usage(self.home)
        row.db_bytes = database_size(self.server, self.database)
        row.growth_bytes = row.home_bytes - before_home
        row.dvc_new_bytes = sum(size for path, size in dvc_objects(self.home).items() if path not in before_dvc)
        if record and record.get("model_version") and record.get("mlflow_run_id"):
            for folder in (self.home / "mlartifacts").glob(f"*/{record['mlflow_run_id']}"):
                row.registered_bytes += disk_usage(folder)[0]
        row.beyond_bytes = row.growth_bytes - row.dvc_new_bytes - row.registered_bytes

    # --- the whole season ------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
        self.netns_before = [line.split()[0] for line in listed.splitlines() if line.strip()]
        self.env: dict[str, str] = {}
        started = time.monotonic()
        try:
            try:
                self.setup()
                seen: set[str] = set()
                trained_on: dict[str, str] | None = None
                for number, night in enumerate(self.config.nights, 1):
                    row = self.run_night(number, night, seen, trained_on)
                    self.rows.append(row)
                    record = self.record_of(row.run_id) if row.run_id else None
                    if record and record.get("status") == "success" and row.read in self.landing.written:
                        trained_on = self.landing.written[row.read]["digests"]
                    self.say(format_row(row))
                self.summary["lineage_after_gc"] = self.lineage_after_gc()
                self.summary["maintenance_runs"] = self.maintenance_runs()
            finally:
                self.teardown()
                self.summary["leftovers"] = self.leftovers()
            self.summary["season_s"] = round(time.monotonic() - started, 1)
            if self.config.dags_test and self.rows:
                self.summary["dags_test"] = self.dags_test()
            self.summary.update(summarise(self.rows))
        finally:
            if self.config.keep:
                self.summary["root"] = str(self.root)
            else:
                shutil.rmtree(self.root, ignore_errors=True)
        return {"rows": [asdict(r) | {"ok": r.ok} for r in self.rows], "summary": self.summary}

    def lineage_after_gc(self) -> list[str]:
        """Every registered version's training run is still in MLflow after the season's collections."""
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        uri = f"sqlite:///{self.home / 'mlflow.db'}"
        if not (self.home / "mlflow.db").exists():
            return []
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        lost = []
        for version in client.search_model_versions(f"name = '{MODEL}'"):
            try:
                client.get_run(str(version.run_id))
                self.scorer.model(f"models:/{MODEL}/{version.version}")
            except (MlflowException, OSError) as err:
                lost.append(f"v{version.version}: {err}")
        return lost

    def maintenance_runs(self) -> dict[str, int]:
        if self.api is None or self.config.maintenance == "none":
            return {}
        states: dict[str, int] = {}
        for run in self.api.runs(MAINTENANCE_DAG):
            states[str(run["state"])] = states.get(str(run["state"]), 0) + 1
        return states

    def dags_test(self) -> dict[str, Any]:
        """`airflow dags test nightly_retrain` of night 1's data in a fresh home (SQLite, one process), timed as
        scripts/demo.py times it, beside the season's night 1."""
        from scripts import demo

        home = Path(tempfile.mkdtemp(prefix="nightshift-season-dagstest-"))
        try:
            env = demo.airflow_env(home, home / "airflow-home")
            env.update({k: self.env[k] for k in ("NIGHTSHIFT_DATA_ROOTS", "NIGHTSHIFT_GIT_COMMIT", "OMP_WAIT_POLICY",
                                                 "PYTHONPATH") if k in self.env})
            env["AIRFLOW__CORE__DAGS_FOLDER"] = str(self.code / "dags")  # the season's code, not the checkout's
            env["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(self.code / "plugins")
            env["NIGHTSHIFT_RETRAIN_CRON"] = "none"
            demo.prepare_airflow(env)
            folder = self.landing.written.get(1, {}).get("folder")
            if folder is None or not Path(folder).exists():
                return {"error": "night 1's data is gone"}
            run = demo.run_dag(env, {"data_source": folder}, progress=None, timeout=3600)
            # The DAG run itself (Airflow's run_duration), beside the whole command (start-up and exit too).
            found = re.search(r"run_duration=([0-9.]+)", run.log.read_text(errors="replace"))
            return {"seconds": round(run.seconds, 1), "run_s": round(float(found.group(1)), 1) if found else None,
                    "code": run.code, "decision": oracle.decision_of(run.record)}
        finally:
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run([str(BIN / "nightshift"), "deploy", "--stop", "--model-name", MODEL],
                               env={**os.environ, "NIGHTSHIFT_HOME": str(home)}, capture_output=True, timeout=600,
                               check=False)
            faults.kill_model_server(home, MODEL)
            shutil.rmtree(home, ignore_errors=True)


class FaultThread(threading.Thread):
    """A mid-run fault: strikes once the night's training runs (a rank killed after its first checkpoint, or
    after its first epoch when no checkpoint comes before the end; the scheduler's machine lost; PostgreSQL
    restarted), and says what it did."""

    def __init__(self, season: Season, kind: str | None) -> None:
        super().__init__(daemon=True, name=f"fault-{kind}")
        self.season, self.kind = season, kind
        self.run_id: str | None = None
        self.stop = threading.Event()
        self.notes: list[str] = []

    def _epoch_done(self) -> bool:
        """The train task's log says an epoch ended (nightshift.train logs "epoch 1/5 done: ...")."""
        assert self.run_id is not None
        logs = self.season.home / "airflow-home" / "logs" / f"dag_id={DAG_ID}" / f"run_id={self.run_id}"
        for path in logs.glob("task_id=train/attempt=*.log") if logs.is_dir() else ():
            with contextlib.suppress(OSError):
                if re.search(r"epoch \d+/\d+ done", path.read_text(errors="replace")):
                    return True
        return False

    def run(self) -> None:
        season, home = self.season, self.season.home
        assert self.run_id is not None and season.components is not None
        train_rows = season.config.rows * 0.7
        checkpointed = train_rows / 2 / 32 * 5 > STEPS_PER_CHECKPOINT  # 2 ranks, batch 32, 5 epochs
        while not self.stop.is_set():
            ranks = faults.trainer_ranks(home)
            if not ranks:
                time.sleep(0.1)
                continue
            ready = faults.checkpoints(home, DAG_ID, self.run_id) if checkpointed else self._epoch_done()
            if not ready and self.kind in ("worker_killed", "scheduler_killed"):
                time.sleep(0.05)  # after the first checkpoint: what the retry resumes from
                continue
            if self.kind == "worker_killed":
                saved = [p.name for p in faults.checkpoints(home, DAG_ID, self.run_id)]
                pid = faults.kill_rank(home)
                self.notes.append(f"rank pid {pid} SIGKILLed (checkpoints then: {saved or 'none'})")
            elif self.kind == "scheduler_killed":
                killed = season.components.kill_machine("scheduler")
                time.sleep(5)
                season.components.release("scheduler")
                self.notes.append(f"scheduler's machine lost ({killed} processes SIGKILLed, ranks among them); "
                                  f"scheduler restarted 5 s later")
            elif self.kind == "postgres_restarted":
                if season.pg is not None:
                    started = time.monotonic()
                    season.pg.restart()
                    self.notes.append(f"PostgreSQL restarted (pg_ctl restart -m fast, "
                                      f"{time.monotonic() - started:.1f} s)")
                else:
                    count = terminate_connections(season.server, season.database)
                    self.notes.append(f"emulated: {count} connections to the metadata database terminated "
                                      f"(pg_terminate_backend; the shared server is not restarted)")
            return
        self.notes.append(f"fault {self.kind} never struck: training did not run while the night did")


# --- reporting ------------------------------------------------------------------------------------------------


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.2f}"


HEADER = ("night", "data event", "fault", "decision", "oracle", "ok", "wall s", "home MB", "+MB", "beyond MB",
          "DB MB")


def cells(row: NightRow) -> list[str]:
    return [str(row.night), row.event + (f" (read night {row.read})" if row.read not in (None, row.night) else ""),
            row.fault or "-", row.decision, row.expected, "yes" if row.ok else
            "NO: " + ", ".join(k for k, v in row.checks.items() if not v),
            "-" if row.wall_s is None else f"{row.wall_s:.0f}", _mb(row.home_bytes), _mb(row.growth_bytes),
            _mb(row.beyond_bytes), _mb(row.db_bytes)]


def format_row(row: NightRow) -> str:
    return " | ".join(cells(row)) + ("\n    " + "\n    ".join(row.notes) if row.notes else "")


def table(rows: list[NightRow]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def _percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def summarise(rows: list[NightRow]) -> dict[str, Any]:
    walls = [r.wall_s for r in rows if r.wall_s is not None]
    trained = [r.wall_s for r in rows if r.wall_s is not None and r.decision in ("promoted", "refused")]
    warm = rows[min(len(rows), 5):]  # after the retention warm-up (keep_runs 5)
    db = {r.night: r.db_bytes for r in rows if r.db_bytes}
    out: dict[str, Any] = {
        "nights": len(rows),
        "faults": sum(1 for r in rows if r.fault),
        "decisions_equal_oracle": sum(1 for r in rows if r.checks.get("decision")),
        "wedged": sum(1 for r in rows if not r.checks.get("not wedged", False)),
        "lineage_incomplete": sum(1 for r in rows if not r.checks.get("lineage complete", False)),
        "nights_ok": sum(1 for r in rows if r.ok),
        "wall_median_s": statistics.median(walls) if walls else None,
        "wall_p95_s": _percentile(walls, 0.95),
        "trained_wall_median_s": statistics.median(trained) if trained else None,
        "beyond_per_night_after_warmup_mb": (round(statistics.mean(r.beyond_bytes for r in warm) / 1e6, 3)
                                             if warm else None),
        "beyond_max_after_warmup_mb": round(max(r.beyond_bytes for r in warm) / 1e6, 3) if warm else None,
    }
    if 10 in db and max(db) >= 30:
        out["db_growth_10_to_30"] = round(db[max(db)] / db[10] - 1, 3)
    return out
