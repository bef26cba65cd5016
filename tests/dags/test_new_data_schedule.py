"""nightly_retrain's schedule with and without "new data" events (nightly_tasks.events), and how a run an event
started finds its data source. Airflow runs in child processes, on the DAG file as the dag processor parses it.

The full path (publish-data -> triggerer -> asset event -> run on that data) runs under airflow standalone in
tests/integration/test_new_data_event.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.dags.conftest import REPO, run_json
from tests.dags.test_dag_integrity import HEAVY, PARSE_TIME_NIGHTSHIFT

DAGS = REPO / "dags"
STREAM_TRIGGER = "operators.event_triggers.RedisStreamTrigger"

SCHEDULE = """
import json, runpy, sys
sys.path.insert(0, {dags!r})
ns = runpy.run_path({dag_file!r}, run_name="dag_under_test")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
messaging = "operators.event_triggers" in sys.modules
dag = ns["dag"]
tt = dag.timetable
cond = getattr(tt, "asset_condition", None)
watchers = [{{"asset": a.uri, "name": w.name, "trigger": list(w.trigger.serialize())}}
            for a in getattr(cond, "objects", []) for w in a.watchers]
from airflow.serialization.serialized_objects import DagSerialization
serialized = json.dumps(DagSerialization.to_dict(dag), default=str)
cron = getattr(tt, "timetable", tt)
print(json.dumps({{"timetable": type(tt).__name__, "cron": getattr(cron, "expression", None),
                  "watchers": watchers, "messaging_imported": messaging, "heavy": loaded,
                  "serialized_watcher": {stream_trigger!r} in serialized,
                  "train_retry_delay_s": dag.get_task("train").retry_delay.total_seconds()}}))
"""


def _schedule(env: dict[str, str], **settings: str) -> dict[str, Any]:
    env = {k: v for k, v in env.items()
           if not k.startswith(("NIGHTSHIFT_EVENTS_", "NIGHTSHIFT_RETRAIN_CRON", "NIGHTSHIFT_TRAIN_RETRY_DELAY_S"))}
    env.update(settings)
    code = SCHEDULE.format(dags=str(DAGS), dag_file=str(DAGS / "nightly_retrain.py"), heavy=HEAVY,
                           stream_trigger=STREAM_TRIGGER)
    return dict(run_json(code, env))


def test_without_events_the_dag_keeps_its_cron_alone(airflow_env: dict[str, str]) -> None:
    out = _schedule(airflow_env)
    assert out["timetable"] == "CronTriggerTimetable" and out["cron"] == "0 2 * * *"
    assert out["watchers"] == [] and not out["serialized_watcher"]
    assert out["train_retry_delay_s"] == 60  # NIGHTSHIFT_TRAIN_RETRY_DELAY_S's default
    assert not out["messaging_imported"], "the event trigger was imported with events off"
    assert set(out["heavy"]) <= PARSE_TIME_NIGHTSHIFT


def test_with_a_redis_url_the_cron_or_the_new_data_asset_starts_a_run(airflow_env: dict[str, str]) -> None:
    out = _schedule(airflow_env, NIGHTSHIFT_EVENTS_REDIS_URL="redis://127.0.0.1:6379/0")
    assert out["timetable"] == "AssetOrTimeSchedule" and out["cron"] == "0 2 * * *"
    assert out["watchers"] == [{
        "asset": "nightshift://events/new-data", "name": "nightshift_new_data",
        "trigger": [STREAM_TRIGGER, {"stream": "nightshift.new-data", "group": "airflow-new-data",
                                     "consumer": "airflow-triggerer", "redis_conn_id": "nightshift_events",
                                     "poll_interval": 1.0, "claim_idle_s": 60.0}],
    }]
    assert out["serialized_watcher"], "the watcher is not in the serialized DAG the scheduler reads"
    assert set(out["heavy"]) <= PARSE_TIME_NIGHTSHIFT  # still no torch, GX, MLflow at parse time


def test_without_a_cron_the_event_alone_and_a_connection_of_ones_own(airflow_env: dict[str, str]) -> None:
    out = _schedule(airflow_env, NIGHTSHIFT_RETRAIN_CRON="none", NIGHTSHIFT_EVENTS_CONN_ID="team_redis",
                    NIGHTSHIFT_EVENTS_STREAM="team.landed", NIGHTSHIFT_EVENTS_POLL_S="0.5",
                    NIGHTSHIFT_TRAIN_RETRY_DELAY_S="5")
    assert out["train_retry_delay_s"] == 5
    assert out["timetable"] == "AssetTriggeredTimetable" and out["cron"] is None
    assert out["watchers"][0]["trigger"] == [STREAM_TRIGGER, {"stream": "team.landed", "group": "airflow-new-data",
                                                              "consumer": "airflow-triggerer",
                                                              "redis_conn_id": "team_redis", "poll_interval": 0.5,
                                                              "claim_idle_s": 60.0}]


@pytest.mark.parametrize(("name", "value", "message"), [
    ("NIGHTSHIFT_EVENTS_POLL_S", "soon", "NIGHTSHIFT_EVENTS_POLL_S='soon' is not a number of seconds"),
    ("NIGHTSHIFT_EVENTS_POLL_S", "0", "NIGHTSHIFT_EVENTS_POLL_S='0' is not a number of seconds"),
    ("NIGHTSHIFT_EVENTS_STREAM", "new-*", "glob characters"),
])
def test_a_bad_events_setting_fails_the_import_naming_it(airflow_env: dict[str, str], name: str, value: str,
                                                         message: str) -> None:
    env = {**airflow_env, "NIGHTSHIFT_EVENTS_REDIS_URL": "redis://127.0.0.1:6379/0", name: value}
    code = f"import runpy, sys\nsys.path.insert(0, {str(DAGS)!r})\nrunpy.run_path({str(DAGS / 'nightly_retrain.py')!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode != 0
    assert f"EventsMisconfigured: {name}" in proc.stderr and message in proc.stderr


def test_a_bad_train_retry_delay_fails_the_import_naming_it(airflow_env: dict[str, str]) -> None:
    env = {**airflow_env, "NIGHTSHIFT_TRAIN_RETRY_DELAY_S": "a minute"}
    code = f"import runpy, sys\nsys.path.insert(0, {str(DAGS)!r})\nrunpy.run_path({str(DAGS / 'nightly_retrain.py')!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode != 0
    assert "NIGHTSHIFT_TRAIN_RETRY_DELAY_S='a minute' is not a number of seconds between 0 and 3600" in proc.stderr


EVENT_SOURCE = """
import json, sys
from datetime import UTC, datetime, timedelta
sys.path.insert(0, {dags!r})
from airflow.sdk.exceptions import AirflowFailException
from airflow.sdk.execution_time.comms import AssetEventDagRunReferenceResult
from airflow.sdk.execution_time.context import TriggeringAssetEventsAccessor
from nightly_tasks.events import NEW_DATA_URI, event_data_source

def event(data, minutes, uri=NEW_DATA_URI):
    return AssetEventDagRunReferenceResult(
        asset={{"name": uri, "uri": uri, "extra": {{}}}}, source_aliases=[],
        # required (None for a watcher's event: no task made it) from Airflow 3.3.1 on, optional before
        source_task_id=None, source_dag_id=None, source_run_id=None, source_map_index=None,
        timestamp=datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=minutes),
        extra={{"from_trigger": True, "payload": {{"type": "stream", "stream": "s", "id": "1-0", "data": data}}}})

def source(*events):
    try:
        accessor = TriggeringAssetEventsAccessor.build(events)
        return {{"source": event_data_source({{"triggering_asset_events": accessor}})}}
    except AirflowFailException as err:
        return {{"error": str(err)}}

good = json.loads({good!r})
older = dict(good, source="/somewhere/older")
print(json.dumps({{
    "one": source(event(json.dumps(good), 5)),
    "newest_of_two": source(event(json.dumps(good), 5), event(json.dumps(older), 1)),
    "other_asset_only": source(event(json.dumps(good), 5, uri="nightshift://datasets/digits")),
    "none": source(),
    "not_json": source(event("retrain please", 1)),
    "no_source": source(event(json.dumps({{"kind": "nightshift.new-data"}}), 1)),
    "manual": {{"source": event_data_source({{}})}},
}}))
"""


def test_a_run_an_event_started_reads_the_events_source(airflow_env: dict[str, str], nightshift_home: Path,
                                                        demo_data: Path) -> None:
    from nightshift.events import new_data_event

    landed = nightshift_home / "data" / "landed"
    landed.mkdir(parents=True)
    for file in demo_data.glob("*.parquet"):
        (landed / file.name).write_bytes(file.read_bytes())
    good = json.dumps(new_data_event(landed))
    out = run_json(EVENT_SOURCE.format(dags=str(DAGS), good=good), airflow_env)
    assert out["one"] == {"source": str(landed.resolve())}
    assert out["newest_of_two"] == {"source": str(landed.resolve())}
    assert out["other_asset_only"] == out["none"] == out["manual"] == {"source": None}
    assert "started by a new-data event that cannot be used" in out["not_json"]["error"]
    assert "is not JSON" in out["not_json"]["error"]
    assert "names no data source" in out["no_source"]["error"]


def _airflow_sh(base: dict[str, str], url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in base.items() if not k.startswith(("NIGHTSHIFT_EVENTS_", "AIRFLOW_CONN_"))}
    env.update({"NIGHTSHIFT_VENV_BIN": str(Path(sys.executable).parent), "NIGHTSHIFT_AIRFLOW_DB": "sqlite",
                "NIGHTSHIFT_EVENTS_REDIS_URL": url})
    env.pop("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", None)
    return subprocess.run(["bash", str(REPO / "scripts" / "airflow.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=300, check=False, stdin=subprocess.DEVNULL)


def test_airflow_sh_makes_the_triggerers_connection_from_the_url(airflow_env: dict[str, str]) -> None:
    proc = _airflow_sh(airflow_env, "redis://:s3cret@127.0.0.1:6390/3", "connections", "get", "nightshift_events",
                       "-o", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    conn = json.loads(proc.stdout)[0]
    assert (conn["conn_type"], conn["host"], str(conn["port"]), conn["password"]) == ("redis", "127.0.0.1", "6390",
                                                                                      "s3cret")
    assert str(conn["extra_dejson"]["db"]) == "3"  # the provider's RedisHook reads the database from the extra

    proc = _airflow_sh(airflow_env, "http://:s3cret@127.0.0.1:6390", "connections", "get", "nightshift_events")
    assert proc.returncode == 2
    assert "NIGHTSHIFT_EVENTS_REDIS_URL is not redis://" in proc.stderr and "s3cret" not in proc.stderr


def test_airflow_sees_the_connection_id_not_the_url_with_its_password(airflow_env: dict[str, str],
                                                                     tmp_path: Path) -> None:
    # NIGHTSHIFT_* variables reach the training ranks (the local launcher's allowlist): the password must not.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "airflow").write_text("#!/bin/sh\nenv\n")
    (fake / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for path in fake.iterdir():
        path.chmod(0o755)
    env = {k: v for k, v in airflow_env.items() if not k.startswith(("NIGHTSHIFT_EVENTS_", "AIRFLOW_CONN_"))}
    env.pop("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", None)
    env.update({"NIGHTSHIFT_VENV_BIN": str(fake), "NIGHTSHIFT_AIRFLOW_DB": "sqlite",
                "NIGHTSHIFT_EVENTS_REDIS_URL": "redis://:s3cret@127.0.0.1:6390/0"})
    proc = subprocess.run(["bash", str(REPO / "scripts" / "airflow.sh"), "version"], env=env, capture_output=True,
                          text=True, timeout=120, check=False, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    seen = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    assert seen.get("NIGHTSHIFT_EVENTS_CONN_ID") == "nightshift_events"
    assert "NIGHTSHIFT_EVENTS_REDIS_URL" not in seen
    assert [k for k, v in seen.items() if "s3cret" in v] == ["AIRFLOW_CONN_NIGHTSHIFT_EVENTS"]
