"""Retrain when new data lands, under `airflow standalone` (scripts/airflow.sh: scheduler, dag-processor,
triggerer, API server) and a private redis-server: with NIGHTSHIFT_EVENTS_REDIS_URL set and no cron, the
triggerer reads the new-data stream with nightly_retrain's AssetWatcher; one `nightshift publish-data DIR`
makes exactly one asset-triggered run, whose asset event carries DIR and whose validate_data, stage_dataset
and train run on DIR's data. A burst of events, and events published while the triggerer is stopped, each
make exactly one asset event."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest

from nightshift.netutil import free_port
from tests.integration.airflow_helpers import REPO, Api, airflow_standalone, stop_group
from tests.integration.redis_helpers import RedisServer, redis_server

pytestmark = pytest.mark.integration

DAG_ID = "nightly_retrain"
NEW_DATA_URI = "nightshift://events/new-data"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[dict[str, Any]]:
    stream = f"nightshift.new-data.test-{secrets.token_hex(4)}"
    env = {
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        # The event alone starts runs: no cron run can be mistaken for the event's.
        "NIGHTSHIFT_RETRAIN_CRON": "none",
        "NIGHTSHIFT_EVENTS_REDIS_URL": redis.url,
        "NIGHTSHIFT_EVENTS_STREAM": stream,
        "NIGHTSHIFT_EVENTS_POLL_S": "0.5",
    }
    extra: list[subprocess.Popen[bytes]] = []  # a triggerer a test started in place of the standalone's
    with airflow_standalone(tmp_path_factory.mktemp("nightshift-events"), ready=[DAG_ID], env=env,
                            unset_prefixes=("NIGHTSHIFT_EVENTS_", "AIRFLOW_CONN_"),
                            database_prefix="nightshift_events_test") as running:
        try:
            running.api.call("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})
            yield {"api": running.api, "home": running.home, "env": running.env, "log": running.log,
                   "stream": stream, "redis": redis, "proc": running.proc, "extra": extra}
        finally:
            for started in extra:
                stop_group(started)


def _unacknowledged(standalone: dict[str, Any]) -> int | None:
    """Entries of the stream the watcher's consumer group has not acknowledged (delivered or not), or None
    before the group exists."""
    import redis as redis_py

    from nightshift.events import unacknowledged

    client = redis_py.Redis.from_url(standalone["redis"].url)
    try:
        return unacknowledged(client, standalone["stream"]) if client.exists(standalone["stream"]) else None
    finally:
        client.close()


def _wait(condition: Callable[[], bool], timeout: float, describe: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, describe()
        time.sleep(1)


def _runs(api: Api) -> list[dict[str, Any]]:
    return list(api.call("GET", f"/dags/{DAG_ID}/dagRuns?limit=100")["dag_runs"])


def _wait_run_done(api: Api, run_id: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    state = "?"
    while time.monotonic() < deadline:
        state = api.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"]
        if state in {"success", "failed"}:
            return str(state)
        time.sleep(3)
    raise AssertionError(f"run {run_id} still {state} after {timeout:.0f}s")


def _xcom(api: Api, run_id: str, task_id: str) -> Any:
    entry = api.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value"
                            "?deserialize=true&stringify=false")
    return entry["value"]


def test_one_publish_starts_exactly_one_run_on_that_data(standalone: dict[str, Any]) -> None:
    from nightshift.data.demo import write_demo_dataset

    api: Api = standalone["api"]
    landed = standalone["home"] / "data" / "landed-1"  # under a data root (NIGHTSHIFT_HOME/data)
    write_demo_dataset(landed, seed=7)  # not the demo data a run without a source would use
    assert _runs(api) == []

    # Published perhaps before the triggerer runs the AssetWatcher's trigger: the stream keeps it until then.
    proc = subprocess.run([str(BIN / "nightshift"), "publish-data", str(landed)], env=standalone["env"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stream"] == standalone["stream"]

    deadline = time.monotonic() + 300
    while not (runs := _runs(api)):
        assert time.monotonic() < deadline, f"no run after the event: {standalone['log'].read_text()[-3000:]}"
        time.sleep(2)
    run_id = runs[0]["dag_run_id"]
    assert runs[0]["run_type"] == "asset_triggered", runs[0]

    state = _wait_run_done(api, run_id, timeout=600)
    states = {t: ti["state"] for t, ti in api.task_instances(DAG_ID, run_id).items()}
    assert state == "success", f"{states}; log {standalone['log']}"
    assert states["validate_data"] == states["stage_dataset"] == states["train"] == "success", states

    # The run's triggering asset event is the one published, carrying the data source.
    events = api.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/upstreamAssetEvents")["asset_events"]
    assert [e["uri"] for e in events] == [NEW_DATA_URI]
    event = json.loads(events[0]["extra"]["payload"]["data"])
    assert event["source"] == str(landed.resolve())

    # validate_data read it (no data_source Param given), stage_dataset versioned it, train trained on that version.
    assert _xcom(api, run_id, "validate_data")["path"] == str(landed.resolve())
    staged = _xcom(api, run_id, "stage_dataset")
    assert staged["source"] == str(landed.resolve())
    answer = api.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/validate_data/logs/1",
                     headers={"Accept": "application/json"})
    assert "Started by the new-data event" in json.dumps(answer.json())
    train_log = api.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/train/logs/1",
                        headers={"Accept": "application/json"})
    assert staged["hash"] in json.dumps(train_log.json())  # the trainer's --tag nightshift.dataset_version

    # One publish, one run: nothing else was started meanwhile, and the entry was acknowledged.
    assert [r["dag_run_id"] for r in _runs(api)] == [run_id]
    assert events[0]["extra"]["payload"]["id"] == json.loads(proc.stdout)["id"]
    assert _unacknowledged(standalone) == 0


# --- durability: a burst, and events published while the triggerer is stopped --------------------------------


def _new_data_events(api: Api) -> list[dict[str, Any]]:
    """The new-data asset's events. Airflow 3.3.0 to 3.3.2 answer GET /assets/events with 500 while a run an
    event created is queued (its start_date is NULL, which the response model refuses: apache/airflow#71360, fixed
    on main for 3.4); the scheduler starts such a run in its next loops, so a 500 is asked again for up to 120 s."""
    assets = api.call("GET", "/assets?uri_pattern=nightshift://events/new-data")["assets"]
    (asset,) = [a for a in assets if a["uri"] == NEW_DATA_URI]
    deadline = time.monotonic() + 120
    while (answer := api.get(f"/api/v2/assets/events?asset_id={asset['id']}&limit=100")).status_code == 500:
        assert time.monotonic() < deadline, f"GET /assets/events: 500 for 120 s: {answer.text[:500]}"
        time.sleep(1)
    assert answer.status_code == 200, f"GET /assets/events: {answer.status_code} {answer.text[:500]}"
    return list(answer.json()["asset_events"])


def _landing(home: Path, name: str) -> Path:
    """A data source under the data roots whose files are not Parquet: the run an event starts fails at
    validate_data at once instead of training (what is counted here is asset events, not runs)."""
    out = home / "data" / name
    out.mkdir(parents=True)
    for split in ("train", "validation", "test"):
        (out / f"{split}.parquet").write_bytes(f"not parquet: {name}/{split}".encode())
    return out


def _standalone_triggerer(standalone: dict[str, Any]) -> Any:
    """The `airflow triggerer` process the standalone started (not its forked trigger runner)."""
    import psutil

    found = []
    for child in psutil.Process(standalone["proc"].pid).children(recursive=True):
        try:
            if "triggerer" in child.cmdline() and "triggerer" not in child.parent().cmdline():
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    assert len(found) == 1, f"expected one triggerer under the standalone, found {found}"
    return found[0]


def _stopped(process: Any) -> bool:
    """Exited: gone, or a zombie its parent (the standalone, which never waits for it) has not reaped."""
    import psutil

    try:
        return bool(process.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def test_a_burst_and_events_sent_while_the_triggerer_is_down_each_make_one_asset_event(
        standalone: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    from nightshift import events

    api: Api = standalone["api"]
    home: Path = standalone["home"]
    for name in ("NIGHTSHIFT_HOME", "NIGHTSHIFT_DATA_ROOTS", "NIGHTSHIFT_EVENTS_REDIS_URL", "NIGHTSHIFT_EVENTS_STREAM"):
        if name in standalone["env"]:
            monkeypatch.setenv(name, standalone["env"][name])
        else:
            monkeypatch.delenv(name, raising=False)
    before = {e["id"] for e in _new_data_events(api)}
    sources = [_landing(home, f"burst-{i:02d}") for i in range(25)]

    def recorded() -> list[dict[str, Any]]:
        return [e for e in _new_data_events(api) if e["id"] not in before]

    def describe() -> str:
        return (f"{len(recorded())} new asset events, {_unacknowledged(standalone)} entries unacknowledged; "
                f"log: {standalone['log'].read_text(errors='replace')[-3000:]}")

    # 20 events back to back (well within one second): the pub/sub watcher lost all but about one of them.
    ids = [events.publish(source)["id"] for source in sources[:20]]
    _wait(lambda: len(recorded()) >= 20 and _unacknowledged(standalone) == 0, 300, describe)

    # Stop the standalone's triggerer (by its PID, with its trigger runner), then publish 5 more.
    triggerer = _standalone_triggerer(standalone)
    children = triggerer.children(recursive=True)
    os.kill(triggerer.pid, signal.SIGTERM)
    _wait(lambda: _stopped(triggerer), 120, lambda: f"the triggerer did not stop on SIGTERM: {triggerer}")
    for child in children:  # what it started and left behind (its log server), by PID
        with suppress(psutil.NoSuchProcess):
            child.terminate()
    _wait(lambda: all(_stopped(c) for c in children), 60, lambda: f"the triggerer's processes live on: {children}")
    ids += [events.publish(source)["id"] for source in sources[20:]]
    assert len(recorded()) == 20  # no triggerer runs: nothing can have read them
    assert _unacknowledged(standalone) == 5

    # A triggerer of our own (the standalone does not restart its own) reads them from the stream.
    log_path = home / "triggerer.log"
    env = {**standalone["env"], "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port())}
    with log_path.open("wb") as log:
        standalone["extra"].append(subprocess.Popen(
            [str(REPO / "scripts" / "airflow.sh"), "triggerer"], env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True))
    _wait(lambda: len(recorded()) >= 25 and _unacknowledged(standalone) == 0, 300,
          lambda: f"{describe()}\ntriggerer: {log_path.read_text(errors='replace')[-3000:]}")

    # Every entry acknowledged, so none can come again: exactly one asset event per event, with its directory.
    got = recorded()
    assert len(got) == 25, [e["extra"]["payload"]["id"] for e in got]
    assert Counter(e["extra"]["payload"]["id"] for e in got) == Counter(ids)
    by_id = {e["extra"]["payload"]["id"]: json.loads(e["extra"]["payload"]["data"])["source"] for e in got}
    assert [by_id[i] for i in ids] == [str(s.resolve()) for s in sources]
