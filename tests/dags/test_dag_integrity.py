"""DAG integrity: every DAG in dags/ imports, has no cycle, has owner, tags and retries; no heavy import at
DAG-file top level; `ruff check --select AIR` is clean; the plugin loads. Airflow runs in child processes."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dags.conftest import REPO, run_json

HEAVY = ("torch", "horovod", "great_expectations", "dvc", "dvc_data", "mlflow", "sklearn", "pandas",
         "nightshift", "kubernetes")
# What of nightshift a DAG file may import at parse time: the pipeline declaration reader (PyYAML, jsonschema) and
# what it needs (the retention policy a declaration carries: dataclasses only), and the registries the backend and
# deploy_target Params list (nightshift.plugins; nightshift.deploy's package module, which imports no target), and
# nightshift doctor's quick check of the Horovod a local-backend pipeline trains with (metadata and files only).
# Anything else of nightshift (the ML library) is imported by the tasks.
PARSE_TIME_NIGHTSHIFT = {"nightshift", "nightshift.errors", "nightshift.settings", "nightshift.tasks",
                         "nightshift.pipelines", "nightshift.pipelines.check", "nightshift.pipelines.load",
                         "nightshift.pipelines.spec", "nightshift.plugins", "nightshift.deploy",
                         "nightshift.retention", "nightshift.doctor"}

DAGBAG = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
# Airflow puts a DAG bundle's root on sys.path (the dag processor and the task runner do); so do we.
sys.path.insert(0, {dags!r})
bag = DagBag(dag_folder={dags!r})
out = {"errors": {k: str(v) for k, v in bag.import_errors.items()}, "dags": {}}
for dag_id, dag in bag.dags.items():
    tasks = {}
    for t in dag.tasks:
        tasks[t.task_id] = {"owner": t.owner, "retries": t.retries, "downstream": sorted(t.downstream_task_ids),
                            "timeout": t.execution_timeout.total_seconds() if t.execution_timeout else None,
                            "trigger_rule": str(t.trigger_rule)}
    params = {k: {"value": dag.params.get_param(k).value, "schema": dag.params.get_param(k).schema,
                  "description": dag.params.get_param(k).description} for k in dag.params}
    out["dags"][dag_id] = {"tags": sorted(dag.tags), "tasks": tasks, "catchup": dag.catchup,
                           "max_active_runs": dag.max_active_runs, "doc_md": dag.doc_md or "",
                           "default_args": {k: str(v) for k, v in dag.default_args.items()},
                           "schedule": str(getattr(dag.timetable, "_expression", dag.timetable)), "params": params,
                           "file": dag.fileloc}
print(json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def bag(tmp_path_factory: pytest.TempPathFactory) -> dict:
    import os

    home = tmp_path_factory.mktemp("airflow-home")
    env = dict(os.environ, AIRFLOW_HOME=str(home), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "dags"), AIRFLOW__CORE__PLUGINS_FOLDER=str(REPO / "plugins"),
               AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home / 'airflow.db'}",
               NIGHTSHIFT_HOME=str(home / "nightshift"))
    return run_json(DAGBAG.replace("{dags!r}", repr(str(REPO / "dags"))), env)


def _dag_files() -> list[Path]:
    return sorted(p for p in (REPO / "dags").glob("*.py") if p.name != "__init__.py")


def test_every_dag_imports_without_errors(bag: dict) -> None:
    assert bag["errors"] == {}
    assert "nightly_retrain" in bag["dags"]
    files = {Path(d["file"]).name for d in bag["dags"].values()}
    assert files == {p.name for p in _dag_files()}, "every DAG file defines at least one DAG"


def test_no_cycles(bag: dict) -> None:
    for dag_id, dag in bag["dags"].items():
        state: dict[str, int] = {}

        def visit(task_id: str, path: tuple[str, ...], dag: dict = dag, state: dict = state,
                  dag_id: str = dag_id) -> None:
            if state.get(task_id) == 1:
                raise AssertionError(f"{dag_id}: cycle {' -> '.join((*path, task_id))}")
            if state.get(task_id) == 2:
                return
            state[task_id] = 1
            for child in dag["tasks"][task_id]["downstream"]:
                visit(child, (*path, task_id))
            state[task_id] = 2

        for task_id in dag["tasks"]:
            visit(task_id, ())


def test_owner_tags_retries_timeouts(bag: dict) -> None:
    for dag_id, dag in bag["dags"].items():
        assert dag["tags"], f"{dag_id} has no tags"
        assert dag["default_args"].get("owner") not in (None, "", "airflow"), f"{dag_id} has no owner"
        assert "retries" in dag["default_args"], f"{dag_id} sets no default retries"
        for task_id, t in dag["tasks"].items():
            assert t["owner"] not in ("", "airflow"), f"{dag_id}.{task_id} has no owner"
            assert t["retries"] is not None, f"{dag_id}.{task_id} has no retries"
            if task_id != "approve":  # a human's answer has its own response_timeout
                assert t["timeout"], f"{dag_id}.{task_id} has no execution_timeout"


def test_nightly_retrain_shape_and_params(bag: dict) -> None:
    dag = bag["dags"]["nightly_retrain"]
    assert dag["catchup"] is False and dag["max_active_runs"] == 1
    assert dag["default_args"]["retry_exponential_backoff"] not in ("0", "False")
    tasks = dag["tasks"]
    chain = ["validate_data", "stage_dataset", "check_changes", "train", "evaluate", "register", "approve",
             "deploy", "report", "collect_garbage"]
    for upstream, downstream in itertools.pairwise(chain):
        assert downstream in tasks[upstream]["downstream"], f"{upstream} -> {downstream} missing"
    assert "skip_training" in tasks["check_changes"]["downstream"]
    assert "report" in tasks["skip_training"]["downstream"]
    assert tasks["deploy"]["trigger_rule"].lower().endswith("none_failed_min_one_success")
    expected = {"data_source", "epochs", "learning_rate", "batch_size", "workers", "gpus_per_worker", "backend",
                "min_improvement", "require_approval", "force", "gpus", "queue", "priority"}
    assert expected <= set(dag["params"])
    for name, param in dag["params"].items():
        assert param["description"], f"param {name} has no description"
        assert param["schema"].get("type") or param["schema"].get("enum"), f"param {name} has no type"
        assert f"`{name}`" in dag["doc_md"], f"doc_md does not explain {name}"
    assert dag["params"]["backend"]["value"] == "local" and dag["params"]["workers"]["value"] == 2


@pytest.mark.parametrize("dag_file", _dag_files(), ids=lambda p: p.name)
def test_no_heavy_import_at_dag_top_level(dag_file: Path, airflow_env: dict[str, str]) -> None:
    code = f"""
import json, runpy, sys
sys.path.insert(0, {str(REPO / 'dags')!r})
runpy.run_path({str(dag_file)!r}, run_name="dag_under_test")
heavy = {HEAVY!r}
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
"""
    imported = set(run_json(code, airflow_env))
    assert imported <= PARSE_TIME_NIGHTSHIFT, sorted(imported - PARSE_TIME_NIGHTSHIFT)


def test_ruff_air_rules_clean() -> None:
    ruff = Path(sys.executable).with_name("ruff")
    proc = subprocess.run([str(ruff), "check", "--select", "AIR", "dags", "plugins"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_plugin_registers_links_and_lineage_app(airflow_env: dict[str, str]) -> None:
    code = """
import json
from airflow import plugins_manager
fastapi_apps, _ = plugins_manager.get_fastapi_plugins()
print(json.dumps({"errors": plugins_manager.get_import_errors(),
                  "links": sorted(link.name for link in plugins_manager.get_global_operator_extra_links()),
                  "apps": [a["url_prefix"] for a in fastapi_apps]}))
"""
    out = run_json(code, airflow_env)
    assert out["errors"] == {}
    assert {"GX Data Docs", "MLflow run", "Model version", "Search report"} <= set(out["links"])
    assert "/nightshift" in out["apps"]
