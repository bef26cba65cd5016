"""The DAG factory (dags/nightly_tasks/factory.py): the digits declaration gives today's nightly_retrain, a second
declaration a second DAG that shares nothing with it, and a bad declaration fails only its own DAG file, in one
line naming the YAML file and the key."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import DIGITS_YAML
from tests.dags.conftest import REPO, run_json

DAGS = REPO / "dags"
# Today's nightly_retrain, as dags/nightly_retrain.py declared it by hand before the factory.
EDGES = {
    "validate_data": ["stage_dataset"],
    "stage_dataset": ["check_changes", "evaluate", "deploy", "register"],
    "check_changes": ["skip_training", "train"],
    "skip_training": ["report"],
    "train": ["evaluate"],
    "evaluate": ["register"],
    "register": ["approve"],
    "approve": ["deploy"],
    "deploy": ["report"],
    "report": ["collect_garbage"],
    "collect_garbage": [],
}
PARAM_DEFAULTS = {
    "data_source": None, "epochs": 5, "learning_rate": None, "batch_size": None, "momentum": None,
    "model_kwargs": None, "workers": 2, "min_workers": None, "max_workers": None, "gpus_per_worker": 0, "gpus": 0,
    "queue": None, "priority": None,
    "queue_timeout": 7200, "backend": "local", "min_improvement": 0.001, "require_approval": False, "force": False,
    "deploy_target": "local",
}
ENV = ("NIGHTSHIFT_RETRAIN_CRON", "NIGHTSHIFT_BACKEND", "NIGHTSHIFT_KUEUE_QUEUE", "NIGHTSHIFT_KUEUE_PRIORITY",
       "NIGHTSHIFT_TRAIN_RETRY_DELAY_S", "NIGHTSHIFT_EVENTS_REDIS_URL", "NIGHTSHIFT_EVENTS_CONN_ID",
       "NIGHTSHIFT_EVENTS_PIPELINES")


@pytest.fixture(autouse=True)
def dag_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(str(DAGS))  # as Airflow puts the DAG folder on sys.path


def _factory() -> Any:
    from nightly_tasks import factory

    return factory


def _nightly_retrain() -> Any:
    return runpy.run_path(str(DAGS / "nightly_retrain.py"), run_name="nightly_retrain_under_test")["dag"]


def _declare(folder: Path, name: str, **changes: Any) -> Path:
    """A copy of digits.yaml as `folder/name.yaml`, with top-level keys (or dotted ones) changed."""
    data = yaml.safe_load(DIGITS_YAML.read_text())
    for key, value in changes.items():
        node = data
        *parents, last = key.split(".")
        for parent in parents:
            node = node[parent]
        node[last] = value
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _second(tmp_path: Path) -> Path:
    return _declare(tmp_path, "churn", dag_id="churn_retrain", model_name="churn-digits",
                    **{"dataset.asset": "churn", "dataset.data": {"directory": "data/churn"}, "schedule": "30 4 * * *",
                       "gate.min_improvement": 0.01, "training.epochs": 3, "deploy.require_approval": True})


def _outlets(dag: Any, task_id: str) -> list[str]:
    return [asset.uri for asset in dag.get_task(task_id).outlets]


def _cron(dag: Any) -> str | None:
    return getattr(dag.timetable, "expression", None)


def _arg(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_the_digits_declaration_gives_todays_nightly_retrain() -> None:
    dag = _nightly_retrain()
    assert type(dag).__name__ == "DAG" and dag.dag_id == "nightly_retrain"
    assert {t.task_id: sorted(t.downstream_task_ids) for t in dag.tasks} == {k: sorted(v) for k, v in EDGES.items()}
    assert {name: dag.params.get_param(name).value for name in dag.params} == PARAM_DEFAULTS
    assert _cron(dag) == "0 2 * * *"
    assert (dag.catchup, dag.max_active_runs, sorted(dag.tags)) == (False, 1, ["horovod", "mlflow", "nightshift",
                                                                             "training"])
    assert _outlets(dag, "stage_dataset") == ["nightshift://datasets/digits"]
    assert _outlets(dag, "deploy") == ["nightshift://models/nightshift-digits/champion"]
    train = dag.get_task("train")
    assert _arg(train.job.command, "--mlflow-experiment") == train.tracking.mlflow_experiment == "nightly_retrain"
    assert _arg(train.job.command, "--dataset") == "digits"
    assert train.retry_delay.total_seconds() == 60 and train.retries == 2
    assert dag.get_task("approve").subject == "Deploy the new nightshift-digits model?"
    assert dag.get_task("deploy").trigger_rule == "none_failed_min_one_success"
    assert "nightshift-digits" in dag.doc_md and "`gx:digits`" in dag.doc_md


def test_todays_environment_overrides_still_apply_to_nightly_retrain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIGHTSHIFT_RETRAIN_CRON", "none")
    monkeypatch.setenv("NIGHTSHIFT_BACKEND", "kubernetes")
    monkeypatch.setenv("NIGHTSHIFT_KUEUE_QUEUE", "team-a")
    monkeypatch.setenv("NIGHTSHIFT_TRAIN_RETRY_DELAY_S", "7")
    dag = _nightly_retrain()
    assert type(dag.timetable).__name__ == "NullTimetable" and _cron(dag) is None
    assert dag.params.get_param("backend").value == "kubernetes"
    assert dag.params.get_param("queue").value == "team-a"
    assert dag.get_task("train").retry_delay.total_seconds() == 7
    monkeypatch.setenv("NIGHTSHIFT_RETRAIN_CRON", "15 1 * * *")
    assert _cron(_nightly_retrain()) == "15 1 * * *"


def test_new_data_events_start_only_the_listed_pipelines(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NIGHTSHIFT_EVENTS_CONN_ID", "redis_events")
    factory = _factory()
    digits, other = factory.pipeline_dag(DIGITS_YAML), factory.pipeline_dag(_second(tmp_path))
    assert type(digits.timetable).__name__ == "AssetOrTimeSchedule"
    assert _cron(other) == "30 4 * * *"  # an event names a directory, not this pipeline's data
    monkeypatch.setenv("NIGHTSHIFT_EVENTS_PIPELINES", "churn_retrain")
    assert type(factory.pipeline_dag(_second(tmp_path)).timetable).__name__ == "AssetOrTimeSchedule"


def test_a_schedule_airflow_refuses_at_parse_fails_the_dag_file_naming_file_and_key(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 34 item 8: with new-data events on, `schedule: '@once'` (valid without them) became a cron timetable
    that Airflow refused at parse, naming neither file nor key; an invalid NIGHTSHIFT_RETRAIN_CRON did the same to
    every DAG."""
    factory = _factory()
    path = _declare(tmp_path, "once", dag_id="once_retrain", model_name="once", schedule="@once",
                    **{"dataset.asset": "once"})
    assert type(factory.pipeline_dag(path).timetable).__name__ == "OnceTimetable"
    monkeypatch.setenv("NIGHTSHIFT_EVENTS_CONN_ID", "redis_events")
    monkeypatch.setenv("NIGHTSHIFT_EVENTS_PIPELINES", "once_retrain")
    dag = factory.pipeline_dag(path)
    assert isinstance(dag, factory.InvalidPipelineDag), dag.timetable
    assert str(dag.problem) == (
        f"{path}: schedule: '@once' is no cron, and new-data events (NIGHTSHIFT_EVENTS_CONN_ID or "
        f"NIGHTSHIFT_EVENTS_REDIS_URL) start this pipeline on its cron or an event; give a cron, or null for events "
        f"alone")
    assert type(factory.pipeline_dag(DIGITS_YAML).timetable).__name__ == "CronTriggerTimetable"  # not listed
    monkeypatch.setenv("NIGHTSHIFT_RETRAIN_CRON", "99 99 * * *")
    dag = factory.pipeline_dag(DIGITS_YAML)
    assert isinstance(dag, factory.InvalidPipelineDag)
    assert str(dag.problem).startswith(f"{DIGITS_YAML}: NIGHTSHIFT_RETRAIN_CRON (the deployment's override of "
                                       f"schedule): '99 99 * * *' is not a valid cron expression")


@pytest.mark.parametrize("cron", ["0 2 * * * 30", "0 2 * * MON-FRI 0 2026", "@midnight", "0\t2 * * *", "@quarterly"])
def test_a_retrain_cron_airflow_takes_is_not_refused(monkeypatch: pytest.MonkeyPatch, cron: str) -> None:
    """NIGHTSHIFT_RETRAIN_CRON is Airflow's to read, not the declaration schema's: a cron of six or seven fields
    (seconds, year), croniter's @midnight or fields apart by a tab build and validate in Airflow, and check_schedule
    (225d9f1) refused them by the schema's five-field form, failing every pipeline's DAG file at parse."""
    factory = _factory()
    monkeypatch.setenv("NIGHTSHIFT_RETRAIN_CRON", cron)
    for events in (False, True):
        if events:
            monkeypatch.setenv("NIGHTSHIFT_EVENTS_CONN_ID", "redis_events")
        dag = factory.pipeline_dag(DIGITS_YAML)
        assert not isinstance(dag, factory.InvalidPipelineDag), dag.problem
        dag.timetable.validate()
        getattr(dag.timetable, "timetable", dag.timetable).validate()  # AssetOrTimeSchedule's cron


def test_a_second_declaration_gives_a_second_dag_sharing_nothing(tmp_path: Path, nightshift_home: Path) -> None:
    from nightly_tasks import steps

    from nightshift.deploy.local import record_path
    from nightshift.ledger import ledger_path
    from operators.mpijob_spec import TaskIdentity

    factory = _factory()
    digits, churn = factory.pipeline_dag(DIGITS_YAML), factory.pipeline_dag(_second(tmp_path))
    assert churn.dag_id == "churn_retrain" and sorted(t.task_id for t in churn.tasks) == sorted(EDGES)
    assert _outlets(churn, "stage_dataset") == ["nightshift://datasets/churn"]
    assert _outlets(churn, "deploy") == ["nightshift://models/churn-digits/champion"]
    assert _cron(churn) == "30 4 * * *"
    assert {k: churn.params.get_param(k).value for k in ("epochs", "min_improvement", "require_approval")} == {
        "epochs": 3, "min_improvement": 0.01, "require_approval": True}
    assert churn.get_task("approve").subject == "Deploy the new churn-digits model?"
    trains = [dag.get_task("train") for dag in (digits, churn)]
    assert [_arg(t.job.command, "--mlflow-experiment") for t in trains] == ["nightly_retrain", "churn_retrain"]
    assert [t.tracking.mlflow_experiment for t in trains] == ["nightly_retrain", "churn_retrain"]
    # What each run writes, for the same run id: workspaces, checkpoints, the ledger, the registry, the server.
    pipelines = [factory.pipeline_for("nightly_retrain"), factory.pipeline_for("churn_retrain")]
    run_id = "scheduled__2026-06-01T02:00:00+00:00"
    workspaces = {steps.workspace_for(p.dag_id, run_id) for p in pipelines}
    checkpoints = {train.resolve_checkpoint_dir(TaskIdentity(dag_id=dag.dag_id, task_id="train", run_id=run_id,
                                                             try_number=1))
                   for dag, train in zip((digits, churn), trains, strict=True)}
    assert len(workspaces) == len(checkpoints) == 2
    assert len({ledger_path(p.dag_id) for p in pipelines}) == 2  # lineage rows, and the last-success check
    assert [steps.evaluation_args(p, 0.001)["model_name"] for p in pipelines] == ["nightshift-digits", "churn-digits"]
    assert len({record_path(p.model_name) for p in pipelines}) == 2  # one local server (and port) per model
    assert [steps.default_data_dir(p) for p in pipelines] == [nightshift_home / "demo-data" / "digits",
                                                             nightshift_home / "data" / "churn"]


def test_a_declaration_whose_data_is_missing_is_refused_unless_it_is_the_demo(tmp_path: Path,
                                                                              nightshift_home: Path) -> None:
    from nightly_tasks import steps

    from nightshift.errors import UsageError
    from nightshift.pipelines import load_pipeline

    churn = load_pipeline(_declare(tmp_path, "tab", dag_id="tab_retrain", model_name="tab",
                                   **{"dataset.loader": "tabular", "dataset.data": {"directory": "data/tab"}}))
    with pytest.raises(UsageError, match=r"no data_source given and the declared data .*data/tab lacks"):
        steps.resolve_data_source(churn, "")



def test_declared_data_outside_the_data_roots_is_refused_as_a_data_source_would_be(
        tmp_path: Path, nightshift_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nightly_tasks import steps

    from nightshift.errors import UsageError
    from nightshift.pipelines import load_pipeline

    outside = tmp_path / "outside"
    outside.mkdir()
    for split in ("train", "validation", "test"):
        (outside / f"{split}.parquet").write_bytes(b"PAR1")
    monkeypatch.setenv("NIGHTSHIFT_DATA_ROOTS", str(nightshift_home / "data"))
    churn = load_pipeline(_declare(tmp_path, "tab", dag_id="tab_retrain", model_name="tab",
                                   **{"dataset.loader": "tabular", "dataset.data": {"directory": str(outside)}}))
    with pytest.raises(UsageError, match=r"tab.yaml: dataset.data: data_source .*outside is outside the allowed"):
        steps.resolve_data_source(churn, "")
    with pytest.raises(UsageError, match="outside the allowed"):
        steps.resolve_data_source(churn, str(outside))
    import nightshift.data.stage as staging

    seen: list[object] = []
    monkeypatch.setattr(staging, "stage_dataset", lambda *a, roots, **k: seen.append(roots) or {
        "hash": "h", "rows": 1, "path": "p"})
    steps.stage(churn, {"path": str(outside)}, "tab_retrain", "r1")
    assert seen == [[nightshift_home / "data"]]  # the declared data is no data root of its own



def test_the_min_improvement_param_takes_what_the_schema_takes(tmp_path: Path) -> None:
    from airflow.sdk.definitions.param import ParamsDict

    from nightshift.pipelines import load_pipeline

    prices = load_pipeline(_declare(tmp_path, "prices", dag_id="prices", model_name="prices", task="regression",
                                    **{"dataset.loader": "tabular", "gate": {"primary": "rmse", "floor": 50000,
                                                                             "min_improvement": 5}}))
    params = ParamsDict(_factory().pipeline_params(prices))
    assert params.validate()["min_improvement"] == 5  # 5 units of RMSE: the declared default is a valid Param
    params["min_improvement"] = 250.0
    assert params.validate()["min_improvement"] == 250.0



@pytest.mark.parametrize(("key", "changes"), [
    ("model_name", {"model_name": "shared-model", "dataset.asset": "b"}),
    ("dataset.asset", {"model_name": "b-model", "dataset.asset": "a"}),
])
def test_a_model_name_or_asset_declared_by_a_sibling_fails_the_dag_file(tmp_path: Path, key: str,
                                                                      changes: dict[str, Any]) -> None:
    factory = _factory()
    first = _declare(tmp_path, "a", dag_id="a_retrain", model_name="shared-model", **{"dataset.asset": "a"})
    second = _declare(tmp_path, "b", dag_id="b_retrain", **changes)
    for mine, theirs in ((first, second), (second, first)):
        dag = factory.pipeline_dag(mine)
        assert isinstance(dag, factory.InvalidPipelineDag)
        message = str(dag.problem)
        assert "\n" not in message and message.startswith(f"{mine}: {key}: ") and f"of {theirs};" in message
    _declare(tmp_path, "b", dag_id="b_retrain", model_name="b-model", **{"dataset.asset": "b"})
    assert not isinstance(factory.pipeline_dag(first), factory.InvalidPipelineDag)


DAGBAG = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
sys.path.insert(0, {dags!r})
bag = DagBag(dag_folder={folder!r})
print(json.dumps({{"errors": {{k: str(v) for k, v in bag.import_errors.items()}}, "dags": sorted(bag.dag_ids)}}))
"""

STUB = '''"""Airflow DAG of the pipeline declared in the YAML file of the same name beside it."""
from nightly_tasks.factory import pipeline_dag
dag = pipeline_dag(__file__)
'''
# The same, with the pipeline's model search DAG.
SEARCH_STUB = STUB + '''from nightly_tasks.search import search_dag
search = search_dag(__file__)
'''


def test_a_bad_declaration_fails_its_own_dag_file_in_one_line(tmp_path: Path, airflow_env: dict[str, str]) -> None:
    folder = tmp_path / "user-dags"
    folder.mkdir()
    _declare(folder, "good", dag_id="good_retrain", model_name="good-model", **{"dataset.asset": "good"})
    _declare(folder, "bad", dag_id="bad_retrain", model_name="bad-model",
             **{"gate.primary": "rmse", "dataset.asset": "bad"})
    for name in ("good", "bad", "missing"):
        (folder / f"{name}.py").write_text(SEARCH_STUB if name != "missing" else STUB)
    env = {k: v for k, v in airflow_env.items() if k not in ENV}
    env["AIRFLOW__CORE__DAGS_FOLDER"] = str(folder)
    out = run_json(DAGBAG.format(dags=str(DAGS), folder=str(folder)), env)
    assert out["dags"] == ["good_retrain", "good_retrain__search"]
    errors = out["errors"]
    assert set(errors) == {str(folder / "bad.py"), str(folder / "missing.py")}
    bad = errors[str(folder / "bad.py")]
    assert "\n" not in bad and "Traceback" not in bad
    assert bad.startswith(f"PipelineInvalid: {folder / 'bad.yaml'}: gate.primary: metric 'rmse' does not fit a "
                          f"multiclass task")
    missing = errors[str(folder / "missing.py")]
    assert "\n" not in missing and f"{folder / 'missing.yaml'}: (top level): cannot be read" in missing



def test_a_horovod_without_torch_fails_the_dag_files_that_train_here_naming_the_fix(
        tmp_path: Path, airflow_env: dict[str, str]) -> None:
    """Issue 37 item 4: pip's build of PyPI's Horovod sdist has no torch extension; a pipeline that trains here
    (backend local) is refused at parse time with the fix, instead of three failed tries of `train`; one that trains
    on the cluster is not (the Airflow image has no Horovod at all)."""
    import os

    from tests.fake_horovod import fake_horovod

    site = fake_horovod(tmp_path / "site", torch=False)
    folder = tmp_path / "user-dags"
    folder.mkdir()
    _declare(folder, "here", dag_id="here_retrain", model_name="here-model",
             **{"dataset.asset": "here", "training.backend": "local"})
    _declare(folder, "cluster", dag_id="cluster_retrain", model_name="cluster-model",
             **{"dataset.asset": "cluster", "training.backend": "kubernetes"})
    for name in ("here", "cluster"):
        (folder / f"{name}.py").write_text(STUB)
    env = {k: v for k, v in airflow_env.items() if k not in ENV}
    env["AIRFLOW__CORE__DAGS_FOLDER"] = str(folder)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    out = run_json(DAGBAG.format(dags=str(DAGS), folder=str(folder)), env)
    assert out["dags"] == ["cluster_retrain"]
    assert list(out["errors"]) == [str(folder / "here.py")]
    (error,) = out["errors"].values()
    assert "\n" not in error.strip() and "Traceback" not in error
    assert error.startswith(f"HorovodUnusable: {folder / 'here.yaml'}: training.backend is local and this machine's "
                            f"Horovod cannot train: Horovod 0.28.1 has no torch extension ({site / 'horovod'}")
    assert "Fix: run `nightshift doctor --build-horovod`" in error


def test_a_pipeline_gets_its_own_search_dag(tmp_path: Path) -> None:
    from nightly_tasks import search

    model_search = runpy.run_path(str(DAGS / "model_search.py"), run_name="model_search_under_test")["dag"]
    churn = search.search_dag(_second(tmp_path))
    assert (model_search.dag_id, churn.dag_id) == ("model_search", "churn_retrain__search")
    for dag in (model_search, churn):
        assert sorted(t.task_id for t in dag.tasks) == ["finish", "prepare", "trial.ask", "trial.tell", "trial.train"]
        assert dag.get_task("trial.train").tracking.mlflow_experiment == dag.dag_id
    assert _outlets(model_search, "finish") == ["nightshift://search/nightly_retrain/best"]
    assert _outlets(churn, "finish") == ["nightshift://search/churn_retrain/best"]
    assert churn.params.get_param("space").value == search.TRAINER_SPACE, "no model argument of another model"
    assert "model_kwargs.channels" in model_search.params.get_param("space").value
    assert "NIGHTSHIFT_HOME/search/churn_retrain/best.json" in churn.doc_md and "`val_accuracy`" in churn.doc_md
    bad = search.search_dag(_declare(tmp_path, "bad", **{"gate.primary": "rmse"}))
    assert isinstance(bad, _factory().InvalidPipelineDag) and bad.dag_id == "invalid_pipeline__bad__search"
    assert "gate.primary: metric 'rmse' does not fit a multiclass task" in str(bad.problem)


# A DAG file reading a declaration outside the DAG folder, as dags/nightly_retrain.py reads pipelines/digits.yaml.
ELSEWHERE_STUB = '''"""Airflow DAG of a declaration of the pipelines folder."""
from nightly_tasks.factory import pipeline_dag
dag = pipeline_dag({path!r})
'''


def test_a_model_name_declared_in_the_dag_folder_and_in_pipelines_fails_both_dag_files_only(
        tmp_path: Path, airflow_env: dict[str, str]) -> None:
    """Issue 34 item 8: only siblings were compared, so dags/ and pipelines/ could both declare nightshift-digits
    (two DAGs moving one @champion). Now each of the two DAG files fails in one line naming both declarations, and
    the other DAGs load."""
    dags, pipelines = tmp_path / "dags", tmp_path / "pipelines"
    dags.mkdir()
    pipelines.mkdir()
    demo = _declare(pipelines, "digits", dag_id="demo_retrain")  # nightshift-digits
    churn = _declare(dags, "churn", dag_id="churn_retrain", **{"dataset.asset": "churn"})  # nightshift-digits too
    _declare(dags, "good", dag_id="good_retrain", model_name="good-model", **{"dataset.asset": "good"})
    (dags / "churn.py").write_text(STUB)
    (dags / "good.py").write_text(STUB)
    (dags / "demo.py").write_text(ELSEWHERE_STUB.format(path=str(demo)))
    env = {k: v for k, v in airflow_env.items() if k not in {*ENV, "NIGHTSHIFT_PIPELINES"}}
    env["AIRFLOW__CORE__DAGS_FOLDER"] = str(dags)
    out = run_json(DAGBAG.format(dags=str(DAGS), folder=str(dags)), env)
    assert out["dags"] == ["good_retrain"]
    errors = out["errors"]
    assert set(errors) == {str(dags / "churn.py"), str(dags / "demo.py")}
    for stub, mine, theirs in (("churn.py", churn, demo), ("demo.py", demo, churn)):
        assert errors[str(dags / stub)] == (
            f"PipelineInvalid: {mine}: model_name: 'nightshift-digits' is also the model_name of {theirs.resolve()}; "
            f"give each pipeline its own model_name")


def test_a_binary_dags_doc_states_its_positive_class(tmp_path: Path) -> None:
    """Issue 34 item 10: the positive class is declarable; the default (the second sorted label) is stated."""
    from nightshift.pipelines import load_pipeline

    factory = _factory()
    binary = {"task": "binary", "dataset.loader": "tabular"}
    default = load_pipeline(_declare(tmp_path, "a", dag_id="a", model_name="a", gate={"primary": "accuracy"},
                                     **binary))
    assert ("the positive class: the second of the label's sorted values (the default; `gate.positive_class` "
            "declares another)") in factory.doc_md(default)
    fraud = load_pipeline(_declare(tmp_path, "b", dag_id="b", model_name="b",
                                   gate={"primary": "accuracy", "positive_class": "fraud"}, **binary))
    assert "F1, precision and recall are those of the positive class: `fraud` (declared)" in factory.doc_md(fraud)
    assert "positive class" not in factory.doc_md(factory.read_declaration(DIGITS_YAML))  # multiclass
