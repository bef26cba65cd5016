"""Model search for real: `nightshift search` on the demo data (ASHA prunes, MLflow parent/child runs,
best.json), a crashing trial, a trainer reporting through the storage as a DAG trial does, PostgreSQL."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nightshift.models import MLP

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# Seed 0 of the random sampler draws lr 0.2, 0.002, 0.002, 0.2 (see test_search_draws): trials 1 and 2
# learn far less in their first epoch than trial 0, and ASHA (rungs at 1 and 2 epochs, 1/2 promoted)
# stops them there.
SPACE = {"lr": {"type": "categorical", "choices": [0.2, 0.002]},
         "model_kwargs.channels": {"type": "int", "low": 2, "high": 6}}
FIXED = {"model_kwargs.hidden": 16, "threads": 1, "log_every": 1000}
SEARCH = ["--trials", "4", "--max-epochs", "2", "--min-epochs", "1", "--reduction-factor", "2", "--sampler", "random",
          "--seed", "0", "--study", "demo"]


class ExplodingMLP(MLP):
    """The MLP, but with `explode` it raises in the middle of its first epoch."""

    def __init__(self, input_shape: tuple[int, ...] = (64,), num_classes: int = 10, hidden: int = 8,
                 explode: bool = False) -> None:
        super().__init__(input_shape, num_classes, hidden)
        self.explode, self.calls = explode, 0

    def forward(self, x: Any) -> Any:
        self.calls += 1
        if self.explode and self.calls > 10:
            raise RuntimeError("exploded on purpose")
        return super().forward(x)


def mlflow_client(home: Path) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}", registry_uri=f"sqlite:///{home / 'mlflow.db'}")


@pytest.fixture(scope="module")
def cli_search(tmp_path_factory: pytest.TempPathFactory, demo_data: Path) -> dict[str, Any]:
    home = tmp_path_factory.mktemp("search-home")
    env = {**os.environ, "NIGHTSHIFT_HOME": str(home), "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run([str(BIN / "nightshift"), "search", "--data", str(demo_data), "--space", json.dumps(SPACE),
                           "--fixed", json.dumps(FIXED), *SEARCH], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"home": home, "report": json.loads(proc.stdout), "stderr": proc.stderr}


def test_asha_prunes_the_trials_that_start_badly(cli_search: dict[str, Any]) -> None:
    trials = cli_search["report"]["trials"]
    assert [(t["number"], t["state"], t["epochs"]) for t in trials] == [
        (0, "COMPLETE", 2), (1, "PRUNED", 1), (2, "PRUNED", 1), (3, "COMPLETE", 2)]
    assert [t["params"]["lr"] for t in trials] == [0.2, 0.002, 0.002, 0.2]
    assert min(t["value"] for t in trials if t["state"] == "COMPLETE") > max(
        t["value"] for t in trials if t["state"] == "PRUNED")
    assert cli_search["report"]["epochs_spent"] == 6
    home = cli_search["home"]
    for number in (1, 2):  # a pruned trial stopped after writing its checkpoint, at the end of epoch 1
        out = home / "search" / "nightly_retrain" / "demo" / f"trial-{number}"  # no --pipeline: the demo's
        metrics = json.loads((out / "out" / "metrics.json").read_text())
        assert metrics["stopped_at_epoch"] == 1
        assert [p.name.split("-")[1] for p in (out / "checkpoints").glob("ckpt-*.pt")] == [
            f"{metrics['steps_run']:010d}"]


def test_the_report_has_the_promised_shape(cli_search: dict[str, Any]) -> None:
    report = cli_search["report"]
    assert {"study", "best", "trials"} <= set(report)
    assert report["study"] == "demo"
    assert set(report["best"]) == {"trial", "params", "value"}
    complete = [t for t in report["trials"] if t["state"] == "COMPLETE"]
    top = max(complete, key=lambda t: t["value"])
    assert report["best"] == {"trial": top["number"], "params": top["params"], "value": top["value"]}
    for trial in report["trials"]:
        assert {"number", "state", "epochs", "value"} <= set(trial)
    assert report["storage"] == f"sqlite:///{cli_search['home'] / 'search' / 'optuna.db'}"


def test_the_search_writes_its_report_page(cli_search: dict[str, Any]) -> None:
    page = cli_search["home"] / "search" / "nightly_retrain" / "demo" / "report.html"
    assert cli_search["report"]["report"] == str(page)
    text = page.read_text()
    assert re.findall(r"<tr class='(\w+)' data-trial='(\d+)'>", text) == [
        ("COMPLETE", "0"), ("PRUNED", "1"), ("PRUNED", "2"), ("COMPLETE", "3")]
    for key in ("history", "intermediate-complete", "intermediate-pruned", "importances", "parallel"):
        assert f'id="plot-{key}"' in text, key


def test_every_trial_is_an_mlflow_child_of_the_search_run(cli_search: dict[str, Any]) -> None:
    client = mlflow_client(cli_search["home"])
    parent_id = cli_search["report"]["mlflow"]["parent_run_id"]
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["nightshift.search.study"] == "demo"
    assert parent.data.params["pruner"] == "asha" and json.loads(parent.data.params["space"]) == SPACE
    assert parent.data.metrics["trials_pruned"] == 2 and parent.data.metrics["epochs_spent"] == 6
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'")
    by_trial = {int(r.data.tags["nightshift.search.trial"]): r for r in children}
    assert sorted(by_trial) == [0, 1, 2, 3]
    expected = {0: ("COMPLETE", "FINISHED", 2), 1: ("PRUNED", "KILLED", 1), 2: ("PRUNED", "KILLED", 1),
                3: ("COMPLETE", "FINISHED", 2)}
    for number, (state, status, epochs) in expected.items():
        run = by_trial[number]
        assert (run.data.tags["nightshift.search.state"], run.info.status) == (state, status)
        assert run.data.params["lr"] in ("0.2", "0.002") and run.data.params["model_kwargs.hidden"] == "16"
        curve = client.get_metric_history(run.info.run_id, "val_accuracy")
        assert [m.step for m in curve] == list(range(1, epochs + 1))
        assert {"train_loss", "val_loss"} <= set(run.data.metrics)


def test_best_json_holds_the_best_configuration_and_its_lineage(cli_search: dict[str, Any]) -> None:
    report = cli_search["report"]
    path = cli_search["home"] / "search" / "nightly_retrain" / "best.json"
    best = json.loads(path.read_text())
    assert best["version"] == 1 and report["best_file"] == {"path": str(path), "version": 1}
    assert (best["pipeline"], best["objective"]) == ("nightly_retrain", "val_accuracy")
    assert (best["study"], best["trial"], best["value"]) == ("demo", report["best"]["trial"], report["best"]["value"])
    assert best["mlflow"]["parent_run_id"] == report["mlflow"]["parent_run_id"]
    child = mlflow_client(cli_search["home"]).get_run(best["mlflow"]["trial_run_id"])
    assert child.data.tags["nightshift.search.trial"] == str(best["trial"])
    params = report["best"]["params"]
    assert best["train_options"] == {"lr": params["lr"], "epochs": 2, "threads": 1, "log_every": 1000,
                                     "model_kwargs": {"hidden": 16, "channels": params["model_kwargs.channels"]}}
    assert best["storage"] == report["storage"] and best["data"]


def test_search_draws(tmp_path: Path) -> None:
    """The configurations the seeded search above relies on, without training."""
    import optuna

    from nightshift.search.space import parse_space
    from nightshift.search.study import SearchSettings, ask_trial, open_study

    settings = SearchSettings(space=SPACE, fixed=FIXED, data="d", max_epochs=2, sampler="random", seed=0)
    space = parse_space(SPACE, FIXED)
    study = open_study(f"sqlite:///{tmp_path / 'o.db'}", "draws", settings)
    drawn = [ask_trial(study, space, settings, owner={})[1]["lr"] for _ in range(4)]
    assert drawn == [0.2, 0.002, 0.002, 0.2]
    assert optuna.__version__ == "5.0.0"


def test_a_crashing_trial_is_fail_and_the_search_goes_on(demo_data: Path, nightshift_home: Path) -> None:
    from nightshift.search.runner import SearchRequest, run_search
    from nightshift.search.study import SearchSettings

    # Seed 0 draws explode=True, then False.
    settings = SearchSettings(space={"model_kwargs.explode": {"type": "categorical", "choices": [True, False]}},
                              fixed={"model": f"{__name__}:ExplodingMLP", "threads": 1}, data=str(demo_data),
                              max_epochs=1, sampler="random", seed=0)
    report = run_search(SearchRequest(settings=settings, trials=2, study="crash"))
    assert [(t["state"], t["params"]["model_kwargs.explode"]) for t in report["trials"]] == [
        ("FAIL", True), ("COMPLETE", False)]
    assert "RuntimeError: exploded on purpose" in report["trials"][0]["error"]
    assert report["best"]["trial"] == 1
    client = mlflow_client(nightshift_home)
    failed = client.search_runs([report["mlflow"]["experiment_id"]],
                                filter_string="tags.`nightshift.search.state` = 'FAIL'")
    assert len(failed) == 1 and failed[0].info.status == "FAILED"
    assert "exploded on purpose" in failed[0].data.tags["nightshift.search.error"]


def test_a_trainer_process_reports_through_the_storage_and_stops_when_pruned(demo_data: Path,
                                                                           tmp_path: Path) -> None:
    """What a DAG trial runs: `python -m nightshift.train --search-*`, the study opened by name."""
    import optuna

    from nightshift.search.reporter import TrialReporter
    from nightshift.search.space import parse_space
    from nightshift.search.study import PRUNED_ATTR, SearchSettings, ask_trial, open_study

    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    settings = SearchSettings(space={"lr": {"type": "float", "low": 0.001, "high": 0.002}}, data=str(demo_data),
                              max_epochs=3, reduction_factor=2, sampler="random")
    study = open_study(storage, "flags", settings)
    space = parse_space(settings.space)
    better, _ = ask_trial(study, space, settings, owner={})
    for epoch in (1, 2, 3):  # through the reporter, which asks the pruner: ASHA records rungs when asked
        TrialReporter(better, 3)(epoch, {"val_accuracy": 0.99})
    study.tell(better, 0.99)
    trial, params = ask_trial(study, space, settings, owner={})
    proc = subprocess.run(
        [sys.executable, "-m", "nightshift.train", "--data", str(demo_data), "--out", str(tmp_path / "out"),
         "--checkpoint-dir", str(tmp_path / "ckpt"), "--model", "mlp", "--model-kwargs", '{"hidden": 8}',
         "--epochs", "3", "--lr", str(params["lr"]), "--threads", "1",
         "--search-storage", storage, "--search-study", "flags", "--search-trial", str(trial.number)],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the per-epoch hook asked to" in proc.stderr
    frozen = optuna.load_study(study_name="flags", storage=storage).get_trials()[1]
    assert frozen.state.name == "RUNNING" and frozen.user_attrs[PRUNED_ATTR] == 1
    assert list(frozen.intermediate_values) == [1]
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["stopped_at_epoch"] == 1


def _postgres_up() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture
def postgres_db() -> Iterator[str]:
    if not _postgres_up():
        pytest.skip("no PostgreSQL answers on 127.0.0.1:5432")
    import psycopg

    name = f"nightshift_search_{uuid.uuid4().hex[:8]}"
    with psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield f"postgresql://postgres@127.0.0.1:5432/{name}"
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_a_study_in_postgresql(postgres_db: str, demo_data: Path) -> None:
    import optuna

    from nightshift.search.runner import SearchRequest, run_search
    from nightshift.search.study import SearchSettings

    settings = SearchSettings(space={"lr": {"type": "float", "low": 0.05, "high": 0.2, "log": True}},
                              fixed={"model": "mlp", "model_kwargs.hidden": 8, "threads": 1}, data=str(demo_data),
                              max_epochs=1, sampler="tpe", seed=3)
    report = run_search(SearchRequest(settings=settings, trials=2, storage=postgres_db))
    assert report["storage"] == postgres_db and [t["state"] for t in report["trials"]] == ["COMPLETE", "COMPLETE"]
    stored = optuna.load_study(study_name=report["study"], storage=postgres_db)
    assert [t.state.name for t in stored.trials] == ["COMPLETE", "COMPLETE"]
    assert stored.best_trial.number == report["best"]["trial"]


# --- the model_search DAG ------------------------------------------------------------------------------

# Seed 4 of the random sampler draws (lr, explode) = (0.2, no), (0.002, no), (0.002, yes): one trial
# completes, one is pruned after its first epoch, one crashes (twice: the task is retried once). One
# trial at a time, so the order in which `dags test` runs the slots cannot change what ASHA sees.
DAG_CONF = {
    "space": {"lr": {"type": "categorical", "choices": [0.2, 0.002]},
              "model_kwargs.explode": {"type": "categorical", "choices": [False, True]}},
    "fixed": {"model": f"{__name__}:ExplodingMLP", "model_kwargs.hidden": 16, "threads": 1, "log_every": 1000},
    "n_trials": 3, "max_concurrent_trials": 1, "max_epochs": 2, "min_epochs": 1, "reduction_factor": 2,
    "sampler": "random", "seed": 4, "workers": 1, "backend": "local",
}


def _airflow_rows(airflow_home: Path, query: str) -> list[tuple[Any, ...]]:
    import sqlite3

    with sqlite3.connect(airflow_home / "airflow.db") as db:
        return list(db.execute(query))


@pytest.fixture(scope="module")
def dag_search(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import optuna

    from tests.integration.airflow_helpers import demo_module

    module = demo_module()
    home = tmp_path_factory.mktemp("model-search-dag")
    env = module.airflow_env(home, home / "airflow-home")
    env.update({"NIGHTSHIFT_SEARCH_POKE_SECONDS": "1", "NIGHTSHIFT_SEARCH_RETRY_SECONDS": "1",
                "NIGHTSHIFT_RETRAIN_CRON": "none",
                # The trainer ranks import ExplodingMLP from this module (PYTHONPATH reaches them).
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    module.prepare_airflow(env)
    proc = module.airflow(env, "dags", "test", "model_search", "-c", json.dumps(DAG_CONF), check=False, timeout=900)
    storage = f"sqlite:///{home / 'search' / 'optuna.db'}"
    (name,) = optuna.get_all_study_names(storage)
    tis = _airflow_rows(home / "airflow-home", "SELECT task_id, map_index, state, try_number FROM task_instance "
                                               "WHERE dag_id = 'model_search'")
    return {"home": home, "env": env, "module": module, "proc": proc, "storage": storage,
            "study": optuna.load_study(study_name=name, storage=storage), "tis": tis,
            "runs": _airflow_rows(home / "airflow-home", "SELECT state FROM dag_run WHERE dag_id = 'model_search'")}


def test_the_dag_runs_a_search_with_pruned_and_crashed_trials(dag_search: dict[str, Any]) -> None:
    proc = dag_search["proc"]
    assert proc.returncode == 0 and dag_search["runs"] == [("success",)], (proc.stdout + proc.stderr)[-4000:]
    trials = dag_search["study"].get_trials()
    assert [(t.state.name, t.params["lr"], t.params["model_kwargs.explode"]) for t in trials] == [
        ("COMPLETE", 0.2, False), ("PRUNED", 0.002, False), ("FAIL", 0.002, True)]
    assert [len(t.intermediate_values) for t in trials] == [2, 1, 0]
    assert trials[2].user_attrs["nightshift.error"] == "its training task failed (see the task's log)"


def test_each_trial_is_a_mapped_horovod_task_pruned_ones_skipped(dag_search: dict[str, Any]) -> None:
    by_slot = {t.user_attrs["nightshift.owner"]["map_index"]: t for t in dag_search["study"].get_trials()}
    states = {(task, index): (state, tries) for task, index, state, tries in dag_search["tis"]}
    expected = {"COMPLETE": ("success", 1), "PRUNED": ("skipped", 1), "FAIL": ("failed", 2)}
    for slot, trial in by_slot.items():
        assert states[("trial.train", slot)] == expected[trial.state.name], (slot, trial.state.name)
        assert states[("trial.ask", slot)][0] == "success" and states[("trial.tell", slot)][0] == "success"
    assert states[("prepare", -1)][0] == "success" and states[("finish", -1)][0] == "success"


def test_the_dag_writes_best_json_emits_the_asset_and_logs_child_runs(dag_search: dict[str, Any]) -> None:
    home, study = dag_search["home"], dag_search["study"]
    best = json.loads((home / "search" / "nightly_retrain" / "best.json").read_text())
    assert (best["study"], best["trial"], best["value"]) == (study.study_name, 0, study.best_value)
    # What nightly_retrain trains (pipelines/digits.yaml), the model as the search fixed it.
    assert {k: best["train_options"][k] for k in ("dataset", "task", "dataset_options", "model")} == {
        "dataset": "digits", "task": "multiclass", "dataset_options": {}, "model": f"{__name__}:ExplodingMLP"}
    assert best["train_options"]["lr"] == 0.2 and best["train_options"]["epochs"] == 2
    events = _airflow_rows(home / "airflow-home", "SELECT e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id "
                                                  "WHERE a.uri = 'nightshift://search/nightly_retrain/best'")
    assert len(events) == 1 and json.loads(events[0][0])["version"] == best["version"]
    client = mlflow_client(home)
    parent_id = best["mlflow"]["parent_run_id"]
    children = client.search_runs([client.get_run(parent_id).info.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'")
    states = sorted((r.data.tags["nightshift.search.trial"], r.data.tags["nightshift.search.state"], r.info.status)
                    for r in children)
    assert states == [("0", "COMPLETE", "FINISHED"), ("1", "PRUNED", "KILLED"), ("2", "FAIL", "FAILED")]
    assert client.get_run(parent_id).info.status == "FINISHED"


def test_the_dag_writes_the_report_page_its_finish_task_links(dag_search: dict[str, Any],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from nightshift.search.report_html import report_path

    monkeypatch.setenv("NIGHTSHIFT_HOME", str(dag_search["home"]))
    page = report_path(dag_search["study"].study_name)  # the folder is safe_name(study): a run id has ':' in it
    assert page.parent.parent == dag_search["home"] / "search" / "nightly_retrain"
    rows = re.findall(r"<tr class='(\w+)' data-trial='(\d+)'>", page.read_text())
    assert rows == [("COMPLETE", "0"), ("PRUNED", "1"), ("FAIL", "2")]
    # The "Search report" extra link reads this XCom of `finish`.
    (value,) = _airflow_rows(dag_search["home"] / "airflow-home",
                             "SELECT value FROM xcom WHERE dag_id = 'model_search' AND task_id = 'finish' "
                             "AND key = 'report'")[0]
    assert json.loads(value) == str(page)


def test_a_malformed_space_fails_the_first_task_naming_the_key(dag_search: dict[str, Any]) -> None:
    conf = {**DAG_CONF, "space": {"lr": {"type": "float", "low": 0.1, "high": 1}, "momentun": {"type": "float"}}}
    proc = dag_search["module"].airflow(dag_search["env"], "dags", "test", "model_search", "-c", json.dumps(conf),
                                        check=False, timeout=300)
    out = proc.stdout + proc.stderr
    assert "search space key 'momentun' is not a trainer option" in out, out[-3000:]
    runs = _airflow_rows(dag_search["home"] / "airflow-home",
                         "SELECT state FROM dag_run WHERE dag_id = 'model_search' ORDER BY id")
    assert runs[-1] == ("failed",)
    import optuna

    assert optuna.get_all_study_names(dag_search["storage"]) == [dag_search["study"].study_name], (
        "the refused search opened no study")
