"""nightly_retrain's check_changes takes the training parameters left empty from best.json at run time."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from nightshift import ledger
from nightshift.search.best import best_path, legacy_best_path, write_best
from tests.conftest import DIGITS_YAML
from tests.dags.conftest import REPO

DAG_ID = "nightly_retrain"


def _steps() -> Any:
    if str(REPO / "dags") not in sys.path:
        sys.path.insert(0, str(REPO / "dags"))  # as Airflow puts the DAG folder on sys.path
    from nightly_tasks import steps

    return steps


class TI:
    def __init__(self) -> None:
        self.bundle_instance = SimpleNamespace(name="nightshift", version=None)
        self.pushed: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed[key] = value


def params(**given: Any) -> dict[str, Any]:
    return {"epochs": 5, "workers": 2, "learning_rate": None, "batch_size": None, "momentum": None,
            "model_kwargs": None, "force": False, **given}


def search_best() -> dict[str, Any]:
    return {"study": "model_search__manual_1", "storage": "sqlite:////s/optuna.db", "trial": 4,
            "objective": "val_accuracy", "value": 0.95, "params": {}, "data": "/d", "mlflow": {},
            "train_options": {"lr": 0.2, "batch_size": 64, "momentum": 0.8, "model_kwargs": {"channels": 24},
                              "epochs": 9}}


def digits() -> Any:
    from nightshift.pipelines import load_pipeline

    return load_pipeline(DIGITS_YAML)


def check(run_id: str, pipeline: Any = None, **given: Any) -> TI:
    ti = TI()
    _steps().check_changes(pipeline or digits(), {"hash": "md5:data"}, params(**given), DAG_ID, run_id, ti)
    return ti


def test_the_train_task_gets_best_jsons_values_and_the_run_records_where_they_came_from() -> None:
    write_best(search_best())
    ti = check("r1", batch_size=16)
    assert ti.pushed["training"] == {
        "lr": 0.2, "batch_size": 16, "momentum": 0.8, "model": "digits_cnn", "model_kwargs": {"channels": 24},
        "summary": "lr, momentum, model_kwargs from best.json v1 (study model_search__manual_1, trial 4)"}
    fingerprint = ti.pushed["fingerprint"]
    assert fingerprint["training"] == {"epochs": 5, "learning_rate": 0.2, "batch_size": 16, "workers": 2,
                                       "momentum": 0.8, "model_kwargs": {"channels": 24}}
    source = fingerprint["training_source"]
    assert source["sources"]["batch_size"] == "trigger" and source["sources"]["lr"] == "best.json"
    assert (source["best"]["study"], source["best"]["trial"], source["best"]["version"]) == (
        "model_search__manual_1", 4, 1)
    summary = _steps().report(digits(), DAG_ID, "r1", params(batch_size=16), {"fingerprint": fingerprint})
    assert ledger.read_records(DAG_ID)[-1]["training_source"] == summary["training_source"] == source


def test_without_best_json_the_fingerprint_is_the_one_runs_before_it_had() -> None:
    ti = check("r1")
    assert ti.pushed["training"]["lr"] == 0.05 and ti.pushed["training"]["model_kwargs"] == {}
    before = {"epochs": 5, "learning_rate": 0.05, "batch_size": 32, "workers": 2}  # Param defaults until now
    assert ti.pushed["fingerprint"]["training"] == before


def test_a_new_best_configuration_is_a_change_that_trains() -> None:
    ledger.append_record(DAG_ID, {"run_id": "r0", "status": "success", **check("r0").pushed["fingerprint"]})
    assert _steps().check_changes(digits(), {"hash": "md5:data"}, params(), DAG_ID, "r1", TI()) == "skip_training"
    write_best(search_best())
    assert _steps().check_changes(digits(), {"hash": "md5:data"}, params(), DAG_ID, "r2", TI()) == "train"


def test_a_malformed_best_json_fails_the_task_naming_the_file() -> None:
    from airflow.sdk.exceptions import AirflowFailException

    best_path().parent.mkdir(parents=True)
    best_path().write_text(json.dumps({**search_best(), "version": 1, "train_options": {"lr": "fast"}}))
    with pytest.raises(AirflowFailException, match=rf"{best_path()} train_options.lr must be a positive number"):
        check("r1")
    assert check("r2", learning_rate=0.1, batch_size=8, momentum=0.5, model_kwargs={}).pushed["training"]["lr"] == 0.1


def test_model_kwargs_typed_in_the_form_is_parsed_and_bad_text_fails_the_task() -> None:
    from airflow.sdk.exceptions import AirflowFailException

    assert check("r1", model_kwargs='{"channels": 8}').pushed["training"]["model_kwargs"] == {"channels": 8}
    with pytest.raises(AirflowFailException, match="the model_kwargs Param is not JSON"):
        check("r2", model_kwargs="channels=8")


def test_the_param_defaults_are_empty_so_best_json_can_fill_them() -> None:
    from nightshift_plan.plan import load_dag

    dag = load_dag()
    values = dict(dag.params.validate())
    assert {k: values[k] for k in ("learning_rate", "batch_size", "momentum", "model_kwargs")} == dict.fromkeys(
        ("learning_rate", "batch_size", "momentum", "model_kwargs"))
    for model_kwargs in ({"channels": 8}, '{"channels": 8}'):  # the REST API's object, the form's text
        values.update(learning_rate=0.1, batch_size=8, momentum=0.5, model_kwargs=model_kwargs)
        dag.params.update(values)
        dag.params.validate()  # explicit values pass the Params' schemas


def test_two_runs_never_share_a_workspace(nightshift_home: Any) -> None:
    steps = _steps()
    a, b = steps.workspace_for(DAG_ID, "a:b"), steps.workspace_for(DAG_ID, "a_b")
    assert a != b and a.parent == b.parent
    assert steps.workspace_for(DAG_ID, ".").parent == a.parent  # run id "." is not the DAG's own directory


def test_another_pipeline_trains_its_declared_model_and_ignores_a_search_of_another_dataset(
        digits_pipeline: Any) -> None:
    from dataclasses import replace

    from nightshift.pipelines import DatasetSpec, ModelSpec

    write_best(search_best())  # nightly_retrain's search of the digits dataset (the trainer's default loader)
    write_best({**search_best(), "pipeline": "churn_retrain"})  # churn's own file, but of a search of the digits
    other = replace(digits_pipeline, dag_id="churn_retrain", model_name="churn",
                    dataset=replace(digits_pipeline.dataset, loader="tabular"),
                    model=ModelSpec(name="mlp", kwargs={"hidden": 16}))
    assert isinstance(other.dataset, DatasetSpec)
    training = check("r1", other).pushed["training"]
    assert (training["model"], training["model_kwargs"], training["lr"]) == ("mlp", {"hidden": 16}, 0.05)
    assert "best.json is for dataset 'digits'" in training["summary"]
    # the digits pipeline still takes the search's values
    assert check("r2").pushed["training"]["lr"] == 0.2


@pytest.mark.parametrize("change", ["label", "task", "features", "loader_options", "model", "model_kwargs"])
def test_a_changed_declaration_trains_even_on_the_same_data_code_and_params(digits_pipeline: Any,
                                                                            change: str) -> None:
    from dataclasses import replace

    from nightshift.pipelines import ModelSpec
    from nightshift.pipelines.spec import frozen

    base = replace(digits_pipeline, dataset=replace(digits_pipeline.dataset, loader="tabular", label="churned",
                                                    features=("age", "plan", "spend")),
                   model=ModelSpec(name="mlp", kwargs=frozen({"hidden": 16})), task="binary")
    changed = {
        "label": replace(base, dataset=replace(base.dataset, label="plan")),
        "task": replace(base, task="multiclass"),
        "features": replace(base, dataset=replace(base.dataset, features=("age", "plan"))),
        "loader_options": replace(base, dataset=replace(base.dataset, options=frozen({"sep": ";"}))),
        "model": replace(base, model=ModelSpec(name="mlp2", kwargs=frozen({"hidden": 16}))),
        "model_kwargs": replace(base, model=ModelSpec(name="mlp", kwargs=frozen({"hidden": 256}))),
    }[change]
    first = check("r0", base).pushed["fingerprint"]
    _steps().report(base, DAG_ID, "r0", params(), {"fingerprint": first, "stage_dataset": {"hash": "md5:data"}})
    assert _steps().check_changes(base, {"hash": "md5:data"}, params(), DAG_ID, "r1", TI()) == "skip_training"
    assert _steps().check_changes(changed, {"hash": "md5:data"}, params(), DAG_ID, "r2", TI()) == "train"


def test_the_code_version_covers_the_declarations_folder() -> None:
    assert "pipelines" in ledger.CODE_PATHS


def test_best_json_without_a_pipeline_fills_only_nightly_retrain(digits_pipeline: Any) -> None:
    from dataclasses import replace

    # Written before searches were per pipeline: NIGHTSHIFT_HOME/search/best.json, a search of nightly_retrain's
    # digits naming no pipeline.
    write_best(search_best(), legacy_best_path())
    other = replace(digits_pipeline, dag_id="digits_copy", model_name="digits-copy")  # same loader, own pipeline
    training = check("r1", other).pushed["training"]
    assert (training["lr"], training["model_kwargs"]) == (0.05, {})
    assert "(no best.json)" in training["summary"]
    assert check("r2").pushed["training"]["lr"] == 0.2


def test_best_json_naming_a_pipeline_fills_only_that_one(digits_pipeline: Any) -> None:
    from dataclasses import replace

    write_best({**search_best(), "pipeline": "digits_copy"})
    other = replace(digits_pipeline, dag_id="digits_copy", model_name="digits-copy")
    assert check("r1", other).pushed["training"]["lr"] == 0.2
    assert check("r2").pushed["training"]["lr"] == 0.05


def test_declared_model_kwargs_win_over_best_json(digits_pipeline: Any) -> None:
    from dataclasses import replace

    from nightshift.pipelines import ModelSpec

    write_best(search_best())
    declared = replace(digits_pipeline, model=ModelSpec(name="digits_cnn", kwargs={"channels": 8}))
    training = check("r1", declared).pushed["training"]
    assert (training["model"], training["model_kwargs"], training["lr"]) == ("digits_cnn", {"channels": 8}, 0.2)
    assert check("r2", declared, model_kwargs={"channels": 4}).pushed["training"]["model_kwargs"] == {"channels": 4}


@pytest.mark.parametrize("change", ["task", "label", "model"])
def test_a_best_json_searched_for_an_older_declaration_is_not_read(digits_pipeline: Any, change: str) -> None:
    """Its search trained the declaration as it was; since then the pipeline's data, task or model changed, so
    its model and options are another problem's (the model a declaration no longer names, trained and
    registered as this pipeline's)."""
    from dataclasses import replace

    from nightshift.pipelines import ModelSpec
    from nightshift.search.pipeline import declared_training

    base = replace(digits_pipeline, dag_id="churn_retrain", model_name="churn", task="binary",
                   dataset=replace(digits_pipeline.dataset, loader="tabular", label="churned"),
                   model=ModelSpec(name="mlp", kwargs={}))
    searched = {"dataset": "tabular", "dataset_options": {"label": "churned"}, "task": "binary", "model": "mlp",
                "model_kwargs": {"hidden": 40}, "lr": 0.3, "epochs": 9}
    write_best({**search_best(), "pipeline": "churn_retrain", "train_options": searched,
                "declared": declared_training(base)})
    training = check("r1", base).pushed["training"]
    assert (training["model"], training["model_kwargs"], training["lr"]) == ("mlp", {"hidden": 40}, 0.3)
    changed = {"task": replace(base, task="regression"),
               "label": replace(base, dataset=replace(base.dataset, label="tenure")),
               "model": replace(base, model=ModelSpec(name="wide_mlp", kwargs={}))}[change]
    training = check("r2", changed).pushed["training"]
    assert (training["model"], training["model_kwargs"], training["lr"]) == (changed.model.name, {}, 0.05)
    assert "best.json is for an older declaration of churn_retrain" in training["summary"], training["summary"]
    assert f"({change if change != 'label' else 'dataset_options'} " in training["summary"], training["summary"]


def test_a_best_json_without_its_declaration_is_not_read_for_another_task_or_label(digits_pipeline: Any) -> None:
    """A best.json from before searches recorded their declaration: its train_options still hold the task and the
    dataset options its pipeline declared then (a search may neither search nor fix them)."""
    from dataclasses import replace

    from nightshift.pipelines import ModelSpec

    base = replace(digits_pipeline, dag_id="churn_retrain", model_name="churn", task="binary",
                   dataset=replace(digits_pipeline.dataset, loader="tabular", label="churned"),
                   model=ModelSpec(name="mlp", kwargs={}))
    searched = {"dataset": "tabular", "dataset_options": {"label": "churned"}, "task": "binary", "model": "mlp",
                "model_kwargs": {"hidden": 40}, "lr": 0.3, "epochs": 9}
    write_best({**search_best(), "pipeline": "churn_retrain", "train_options": searched})
    assert check("r1", base).pushed["training"]["lr"] == 0.3
    for changed in (replace(base, task="regression"), replace(base, dataset=replace(base.dataset, label="tenure"))):
        training = check("r2", changed).pushed["training"]
        assert (training["model"], training["model_kwargs"], training["lr"]) == ("mlp", {}, 0.05)
        assert "best.json is for an older declaration of churn_retrain" in training["summary"]
    assert check("r3").pushed["training"]["lr"] == 0.05  # nightly_retrain: not its file
