"""`airflow dags test nightly_retrain` on the demo data, twice: real Airflow, Horovod, MLflow, model server.

Also what `make demo` shows of a run: one progress line per task as it ends, the full log in a file.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nightshift.search.best import write_best
from tests.integration.airflow_helpers import demo_module, registered_versions, stop_model_server

pytestmark = pytest.mark.integration

CONF = {"epochs": 5, "workers": 2, "backend": "local"}
# What a model search left in NIGHTSHIFT_HOME/search/best.json: the run takes the Params it leaves empty.
BEST = {"study": "demo-search", "storage": "sqlite:////x/optuna.db", "trial": 3, "objective": "val_accuracy",
        "value": 0.97, "params": {}, "data": "/d", "mlflow": {},
        "train_options": {"lr": 0.05, "momentum": 0.85, "model_kwargs": {"channels": 12}, "epochs": 9}}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One NIGHTSHIFT_HOME and AIRFLOW_HOME for the module; the first run happens here."""
    module = demo_module()
    home = tmp_path_factory.mktemp("nightshift-dags-test")
    env = module.airflow_env(home, home / "airflow-home")
    env["NIGHTSHIFT_RETRAIN_CRON"] = "none"
    module.prepare_airflow(env)
    write_best(BEST, path=home / "search" / "best.json")
    state: dict[str, Any] = {"module": module, "env": env, "home": home}
    try:
        run = module.run_dag(env, CONF, progress=None, timeout=900)
        state.update(first=(run.code, run.record, run.seconds), first_run=run)
        yield state
    finally:
        stop_model_server(env)


def test_first_run_registers_deploys_and_serves(demo: dict[str, Any]) -> None:
    code, record, _ = demo["first"]
    assert code == 0, "airflow dags test failed"
    assert record and record["status"] == "success", record
    assert record["gate"]["passed"] is True
    assert record["model_version"] == "1" and record["deploy_status"] == "promoted"
    assert record["dataset_version"] and record["mlflow_run_id"]
    assert registered_versions(demo["home"]) == ["1"]
    data = demo["home"] / "demo-data" / "digits"  # the empty data_source default wrote it here
    predicted, labels = demo["module"].predict(record["serving_url"], data, rows=20)
    assert len(predicted) == 20 and sum(p == t for p, t in zip(predicted, labels, strict=True)) >= 16


def test_first_run_took_the_empty_params_from_best_json(demo: dict[str, Any]) -> None:
    from mlflow import MlflowClient

    _, record, _ = demo["first"]
    source = record["training_source"]
    assert source["sources"] == {"lr": "best.json", "batch_size": "built-in", "momentum": "best.json",
                                 "model_kwargs": "best.json", "model": "built-in"}, source
    assert (source["best"]["study"], source["best"]["trial"], source["best"]["version"]) == ("demo-search", 3, 1)
    assert source["not_applied"] == {"epochs": 9}  # the run's own epochs Param
    assert record["training"]["momentum"] == 0.85 and record["training"]["model_kwargs"] == {"channels": 12}
    uri = demo["env"].get("MLFLOW_TRACKING_URI") or f"sqlite:///{demo['home'] / 'mlflow.db'}"
    run = MlflowClient(tracking_uri=uri, registry_uri=uri).get_run(record["mlflow_run_id"])
    assert (run.data.params["momentum"], run.data.params["model.channels"]) == ("0.85", "12")  # not the default 32
    assert run.data.tags["nightshift.training_defaults"] == (
        "lr, momentum, model_kwargs from best.json v1 (study demo-search, trial 3)")


def progress(lines: list[str]) -> dict[str, tuple[str, float | None]]:
    """{task: (state, seconds)} from the progress lines, checking their shape."""
    out = {}
    for line in lines:
        match = re.fullmatch(r"  (\w+)\s+(\w+)\s+(?:(\d+\.\d)s|-)(?: \(try \d+, will retry\))?", line)
        assert match, f"not a progress line: {line!r}"
        out[match.group(1)] = (match.group(2), float(match.group(3)) if match.group(3) else None)
    return out


def test_first_run_shows_one_line_per_task_and_keeps_the_full_log(demo: dict[str, Any]) -> None:
    run = demo["first_run"]
    tasks = progress(run.progress)
    assert set(tasks) == {"validate_data", "stage_dataset", "check_changes", "skip_training", "train", "evaluate",
                          "register", "approve", "deploy", "report", "collect_garbage"}, run.progress
    for name in ("validate_data", "stage_dataset", "train", "evaluate", "register", "deploy", "report",
                 "collect_garbage"):
        state, seconds = tasks[name]
        assert state == "success" and seconds is not None and 0 <= seconds < 900, (name, tasks[name])
    assert tasks["skip_training"][0] == "skipped" and tasks["approve"][0] == "skipped"
    assert run.progress[-1].split()[0] == "collect_garbage"  # in the order the tasks ended: retention last
    assert tasks["train"][1] > tasks["check_changes"][1]  # seconds are each task's own
    log = run.log.read_text()
    assert "[DAG TEST] end task task_id=report" in log and len(log.splitlines()) > 100


def test_progress_lines_come_from_airflows_task_states(tmp_path: Path) -> None:
    module = demo_module()
    db = tmp_path / "airflow.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE dag_run (id INTEGER PRIMARY KEY, dag_id TEXT, run_id TEXT)")
        conn.execute("CREATE TABLE task_instance (dag_id TEXT, run_id TEXT, task_id TEXT, map_index INT, "
                     "state TEXT, try_number INT, start_date TEXT, end_date TEXT)")
        conn.executemany("INSERT INTO dag_run VALUES (?, ?, ?)", [(1, "nightly_retrain", "old"),
                                                                   (2, "nightly_retrain", "new")])
        conn.executemany("INSERT INTO task_instance VALUES (?, ?, ?, -1, ?, ?, ?, ?)", [
            ("nightly_retrain", "old", "train", "success", 1, "2026-01-01 00:00:00", "2026-01-01 00:01:00"),
            ("nightly_retrain", "new", "validate_data", "success", 1, "2026-11-22 02:00:59.500000",
             "2026-11-22 02:01:14.250000"),
            ("nightly_retrain", "new", "skip_training", "skipped", 0, None, "2026-11-22 02:01:20"),
            ("nightly_retrain", "new", "train", "running", 1, "2026-11-22 02:01:20", None),
        ])
    lines: list[str] = []
    watcher = module.TaskProgress(db, 1, lines.append)
    watcher.poll()
    watcher.poll()  # nothing new: nothing printed twice
    assert progress(lines) == {"validate_data": ("success", 14.8), "skip_training": ("skipped", None)}
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE task_instance SET state = 'up_for_retry', end_date = '2026-11-22 02:02:00' "
                     "WHERE run_id = 'new' AND task_id = 'train'")
    watcher.poll()
    assert lines[-1].startswith("  train") and "up_for_retry" in lines[-1] and "(try 1, will retry)" in lines[-1]


def test_second_run_on_unchanged_data_skips_training(demo: dict[str, Any]) -> None:
    first = demo["first"][1]
    run = demo["module"].run_dag(demo["env"], CONF, progress=None, timeout=900)
    code, record = run.code, run.record
    assert code == 0
    assert record and record["status"] == "success"
    tasks = progress(run.progress)
    assert tasks["report"][0] == "success"
    if record["code_version"] == first["code_version"]:
        assert record["outcome"].startswith("training skipped"), record
        assert record["mlflow_run_id"] is None
        assert tasks["skip_training"][0] == "success" and tasks["train"][0] == "skipped", run.progress
    else:  # someone committed in between: it retrains, and the same data must not promote a copy
        assert record["serving_url"] is None, record
    assert record["model_version"] is None
    assert registered_versions(demo["home"]) == ["1"]
    ledger = Path(demo["home"]) / "airflow" / "nightly_retrain" / "runs.jsonl"
    assert len(ledger.read_text().splitlines()) == 2


# `airflow dags test` names each run after the time it starts; Airflow's DAG.test with a fixed run_after gives
# the run the same id again, deleting the earlier run as clearing it would, and runs every task anew.
SAME_RUN_AGAIN = """
import json, sys
from datetime import datetime
sys.path.insert(0, sys.argv[1])
from nightly_retrain import dag
when = datetime.fromisoformat(sys.argv[2])
run = dag.test(run_after=when, logical_date=when, run_conf=json.loads(sys.argv[3]))
print("RUN_ID", run.run_id, run.state)
"""


def run_same_run(demo: dict[str, Any], conf: dict[str, Any], when: str, log: Path) -> tuple[int, dict[str, Any]]:
    import json
    import subprocess
    import sys

    from tests.integration.airflow_helpers import REPO

    before = len(demo["module"].ledger(demo["home"]))
    with log.open("w") as out:
        code = subprocess.run([sys.executable, "-c", SAME_RUN_AGAIN, str(REPO / "dags"), when, json.dumps(conf)],
                              env=demo["env"], stdout=out, stderr=subprocess.STDOUT, timeout=900).returncode
    records = demo["module"].ledger(demo["home"])[before:]
    return code, records[-1] if records else {}


def test_a_run_cleared_after_its_data_was_fixed_trains_on_the_fixed_data(demo: dict[str, Any], tmp_path: Path) -> None:
    """Issue 20.1 end to end: the same DAG run (same run id, so the same workspace, checkpoint directory and
    MLflow run key) run again after its data changed in place must train on the new bytes, not hand back the
    first model under the new dataset version."""
    import pandas as pd
    from mlflow import MlflowClient

    data = demo["home"] / "data" / "cleared"
    data.mkdir(parents=True)
    demo_data = demo["home"] / "demo-data" / "digits"
    for split in ("train", "validation", "test"):
        (data / f"{split}.parquet").write_bytes((demo_data / f"{split}.parquet").read_bytes())
    conf = {"epochs": 1, "workers": 1, "backend": "local", "data_source": str(data), "force": True}
    when = "2026-01-01T00:00:00+00:00"
    code, one = run_same_run(demo, conf, when, tmp_path / "first.log")
    assert code == 0 and one.get("status") == "success", (tmp_path / "first.log").read_text()[-3000:]
    frame = pd.read_parquet(data / "train.parquet")
    frame.iloc[: len(frame) * 4 // 5].to_parquet(data / "train.parquet")  # the data is fixed in place
    code, two = run_same_run(demo, conf, when, tmp_path / "again.log")
    log = (tmp_path / "again.log").read_text()
    assert code == 0 and two.get("status") == "success", log[-3000:]
    assert two["run_id"] == one["run_id"]  # the same DAG run, run again
    assert two["dataset_version"] != one["dataset_version"]
    assert two["mlflow_run_id"] != one["mlflow_run_id"]  # not the first run's model under the new version
    uri = demo["env"].get("MLFLOW_TRACKING_URI") or f"sqlite:///{demo['home'] / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    trained = client.get_run(two["mlflow_run_id"])
    assert trained.data.tags["nightshift.dataset_version"] == two["dataset_version"]
    assert trained.data.metrics["steps_run"] > 0  # it trained, not resumed a finished checkpoint
    superseded = client.get_run(one["mlflow_run_id"]).data.tags["nightshift.run_key"]
    assert superseded.startswith(f"nightly_retrain/{one['run_id']}#superseded-")
    assert "not resuming" in log  # the trainer said why it set the old checkpoints aside
