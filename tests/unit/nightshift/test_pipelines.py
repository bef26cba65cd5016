"""Pipeline declarations (issue 22): the schema, the one-line problems, folders, the data checks, the CLI,
and pipelines/digits.yaml against what nightly_retrain does today."""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from nightshift import tasks
from nightshift.cli import COMMAND_MODULES, _Parser
from nightshift.errors import UsageError
from nightshift.pipelines import (
    SCHEMA_PATH,
    Pipeline,
    PipelineInvalid,
    check_against_data,
    load_pipeline,
    load_pipelines,
    schema,
)

REPO = Path(__file__).resolve().parents[3]
SUITE = {"name": "cancer", "meta": {}, "notes": None, "expectations": [
    {"type": "expect_column_values_to_not_be_null", "kwargs": {"column": "mean_radius"}, "meta": {"rule": "r"}},
    {"type": "expect_column_values_to_not_be_null", "kwargs": {"column": "diagnosis"}, "meta": {"rule": "r"}},
    {"type": "expect_table_columns_to_match_set", "kwargs": {"column_set": ["mean_radius", "diagnosis"]}},
]}
DECLARATION: dict[str, Any] = {
    "dag_id": "cancer_retrain",
    "model_name": "cancer",
    "task": "binary",
    "schedule": "0 3 * * *",
    "dataset": {"loader": "tabular", "label": "diagnosis", "data": {"directory": "data/cancer"}},
    "model": {"name": "mlp", "kwargs": {"hidden": 16}},
    "gate": {"primary": "roc_auc", "min_improvement": 0.002, "floor": 0.9, "guards": {"log_loss": 0.05}},
    "suite": "suites/cancer.json",
}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A pipelines folder holding a suite at suites/cancer.json."""
    root = tmp_path / "pipelines"
    (root / "suites").mkdir(parents=True)
    (root / "suites" / "cancer.json").write_text(json.dumps(SUITE))
    return root


def declare(folder: Path, name: str = "cancer.yaml", **changes: Any) -> Path:
    """Write DECLARATION with `changes` (key=None removes the key; a dict value is merged one level)."""
    data = copy.deepcopy(DECLARATION)
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        elif isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def problems_of(path: Path) -> tuple[str, ...]:
    with pytest.raises(PipelineInvalid) as caught:
        load_pipeline(path)
    assert isinstance(caught.value, UsageError)
    assert "\n" not in str(caught.value) and str(caught.value) == caught.value.problems[0]
    assert all("\n" not in line and line.startswith(f"{path}: ") for line in caught.value.problems)
    return caught.value.problems


# ---- a good declaration --------------------------------------------------------------------------------------

def test_a_declaration_loads_with_its_defaults_and_round_trips(folder: Path) -> None:
    path = declare(folder)
    pipeline = load_pipeline(path)
    assert (pipeline.dag_id, pipeline.model_name, pipeline.task) == ("cancer_retrain", "cancer", "binary")
    assert pipeline.suite_path == (folder / "suites" / "cancer.json").resolve()
    assert pipeline.source == path
    assert pipeline.primary_metric == tasks.metric("binary", "roc_auc")
    assert pipeline.gate.config() == {"primary": "roc_auc", "min_improvement": 0.002, "floor": 0.9,
                                      "guards": {"log_loss": 0.05}, "positive_class": None}
    # defaults from the schema
    assert pipeline.training.epochs == 5 and pipeline.training.workers == 2 and pipeline.training.backend is None
    assert (pipeline.deploy.target, pipeline.deploy.require_approval) == ("local", False)
    assert pipeline.dataset.asset == "cancer_retrain"
    assert pipeline.dataset_asset_uri == "nightshift://datasets/cancer_retrain"
    assert pipeline.champion_asset_uri == "nightshift://models/cancer/champion"
    assert pipeline.dataset.loader_options() == {"label": "diagnosis"}
    # to_dict: schema-valid, JSON, and the same pipeline back
    as_dict = pipeline.to_dict()
    import jsonschema

    jsonschema.validate(as_dict, schema())
    assert json.loads(pipeline.to_json()) == as_dict
    assert Pipeline.from_dict(as_dict, source=path) == pipeline


def test_a_pipeline_is_read_only(folder: Path) -> None:
    pipeline = load_pipeline(declare(folder))
    with pytest.raises(dataclasses.FrozenInstanceError):
        pipeline.dag_id = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        pipeline.model.kwargs["hidden"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        pipeline.gate.guards["f1"] = 0.1  # type: ignore[index]


def test_data_paths_are_taken_from_nightshift_home(folder: Path, nightshift_home: Path) -> None:
    pipeline = load_pipeline(declare(folder))
    assert pipeline.dataset.data.paths()["test"] == nightshift_home / "data/cancer/test.parquet"
    split = load_pipeline(declare(folder, dataset={"data": {"train": "/srv/a.parquet", "validation": "v.parquet",
                                                            "test": "t.parquet"}}))
    assert split.dataset.data.paths() == {"train": Path("/srv/a.parquet"), "validation": nightshift_home / "v.parquet",
                                          "test": nightshift_home / "t.parquet"}


# ---- one line per problem ----------------------------------------------------------------------------------------

def test_unknown_keys_are_named_with_the_allowed_ones(folder: Path) -> None:
    path = declare(folder, colour="red", gate={"primry": "accuracy"})
    problems = problems_of(path)
    assert f"{path}: colour: unknown key; allowed keys here: dag_id, description, model_name, " in problems[0]
    assert f"{path}: gate.primry: unknown key; allowed keys here: primary, min_improvement, floor, guards, " \
           f"positive_class" in problems


def test_deploy_options_are_those_of_the_target(folder: Path) -> None:
    problems = problems_of(declare(folder, deploy={"target": "local", "options": {"namespace": "ml"}}))
    assert problems == (f"{folder / 'cancer.yaml'}: deploy.options.namespace: unknown key; allowed keys here: "
                        f"canary_rows, tolerance, startup_timeout, range_policy",)
    pipeline = load_pipeline(declare(folder, deploy={"target": "kserve", "options": {"namespace": "ml"}}))
    assert dict(pipeline.deploy.options) == {"namespace": "ml"}


def test_a_wrong_type_names_the_key_and_the_type_wanted(folder: Path) -> None:
    path = declare(folder, training={"epochs": "five"})
    assert problems_of(path) == (f"{path}: training.epochs: must be an integer, got string 'five'",)


def test_a_missing_required_key_is_named(folder: Path) -> None:
    path = declare(folder, model_name=None)
    (line,) = problems_of(path)
    assert line.startswith(f"{path}: model_name: missing required key; add it (The MLflow registered model name")


def test_several_problems_are_each_a_line(folder: Path) -> None:
    path = declare(folder, model_name=None, training={"workers": 0})
    assert problems_of(path) == (
        f"{path}: model_name: missing required key; add it (The MLflow registered model name the pipeline "
        f"registers versions under and moves @challenger and @champion on; unique across the pipelines folder)",
        f"{path}: training.workers: must be >= 1, got 0",
    )


def test_a_malformed_name_says_what_is_allowed(folder: Path) -> None:
    path = declare(folder, dag_id="my dag")
    assert problems_of(path) == (f"{path}: dag_id: 'my dag' is not valid here; expected: The Airflow DAG id of this "
                                 f"pipeline; unique across the pipelines folder. Letters, digits, '_', '.' and '-', "
                                 f"starting with a letter or digit, without '..'",)


def test_a_primary_metric_must_fit_the_task(folder: Path) -> None:
    path = declare(folder, gate={"primary": "rmse"})
    assert problems_of(path) == (f"{path}: gate.primary: metric 'rmse' does not fit a binary task; use one of "
                                 f"accuracy, log_loss, roc_auc, f1",)


def test_a_guard_metric_must_fit_the_task(folder: Path) -> None:
    path = declare(folder, task="regression", gate={"primary": "rmse", "guards": {"mae": 0.1, "macro_f1": 0.01}})
    assert problems_of(path) == (f"{path}: gate.guards.macro_f1: metric 'macro_f1' does not fit a regression task; "
                                 f"use one of rmse, mae, r2",)


def test_an_unknown_task_is_refused(folder: Path) -> None:
    path = declare(folder, task="ranking")
    assert problems_of(path) == (f"{path}: task: string 'ranking' is not allowed; use one of binary, multiclass, "
                                 f"regression",)


def test_data_is_a_directory_or_three_splits(folder: Path) -> None:
    path = declare(folder, dataset={"data": {"directory": "d", "train": "t.parquet"}})
    assert problems_of(path) == (f"{path}: dataset.data: give either directory, or all of train, validation and "
                                 f"test (not both)",)
    path = declare(folder, dataset={"data": {"directory": "../../etc"}})
    assert problems_of(path)[0].startswith(f"{path}: dataset.data.directory: '../../etc' climbs out with '..'")


def test_a_missing_suite_says_how_to_write_one(folder: Path) -> None:
    path = declare(folder, suite="suites/other.json")
    (line,) = problems_of(path)
    assert line.startswith(f"{path}: suite: 'suites/other.json': no such file ")
    assert "nightshift suite init DATA --label COL --out suites/other.json" in line


@pytest.mark.parametrize("suite", ["../outside.json", "suites/../../outside.json", "ABSOLUTE", "suites/link.json"])
def test_a_suite_may_not_leave_the_declarations_folder(folder: Path, suite: str) -> None:
    outside = folder.parent / "outside.json"
    outside.write_text(json.dumps(SUITE))
    (folder / "suites" / "link.json").symlink_to(outside)
    path = declare(folder, suite=str(outside) if suite == "ABSOLUTE" else suite)
    (line,) = problems_of(path)
    assert line.startswith(f"{path}: suite: ") and "leaves the declaration's folder" in line


def test_an_absolute_suite_inside_the_folder_is_allowed(folder: Path) -> None:
    pipeline = load_pipeline(declare(folder, suite=str(folder / "suites" / "cancer.json")))
    assert pipeline.suite_path == (folder / "suites" / "cancer.json").resolve()


@pytest.mark.parametrize(("content", "reason"), [
    ("{not json", "not readable JSON"),
    (json.dumps({"name": "x", "expectations": [{"kwargs": {}}]}), "each with a 'type' and 'kwargs'"),
    (json.dumps([1, 2]), "expected a JSON object"),
    # issue 37 review: a suite without expectations passes any data
    (json.dumps({"name": "x", "expectations": []}), "it has no expectations"),
])
def test_a_suite_must_be_a_gx_suite(folder: Path, content: str, reason: str) -> None:
    (folder / "suites" / "bad.json").write_text(content)
    path = declare(folder, suite="suites/bad.json")
    (line,) = problems_of(path)
    assert line.startswith(f"{path}: suite: ") and "is not a GX expectation suite" in line and reason in line


def test_gx_suites_are_named_in_the_projects_gx_folder(folder: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    gx = tmp_path / "gx"
    (gx / "expectations").mkdir(parents=True)
    (gx / "expectations" / "cancer.json").write_text(json.dumps(SUITE))
    monkeypatch.setenv("NIGHTSHIFT_GX_DIR", str(gx))
    assert load_pipeline(declare(folder, suite="gx:cancer")).suite_path == (gx / "expectations/cancer.json").resolve()
    for bad in ("gx:../cancer", "gx:sub/cancer", "gx:"):
        (line,) = problems_of(declare(folder, suite=bad))
        assert "is not a GX suite name" in line
    (line,) = problems_of(declare(folder, suite="gx:missing"))
    assert "GX suite 'missing' not found" in line


def test_invalid_yaml_names_the_line(folder: Path) -> None:
    path = folder / "broken.yaml"
    path.write_text("dag_id: a\nmodel_name: b\ngate: {primary: accuracy\ntask: binary\n")
    (line,) = problems_of(path)
    assert line.startswith(f"{path}: line 4: invalid YAML: ") and line.endswith("; fix the syntax")


def test_a_key_given_twice_in_yaml_is_refused(folder: Path) -> None:
    path = folder / "twice.yaml"
    path.write_text(yaml.safe_dump(DECLARATION, sort_keys=False) + "task: multiclass\n")
    (line,) = problems_of(path)
    assert line == f"{path}: line {len(path.read_text().splitlines())}: invalid YAML: key 'task' given twice " \
                   f"(first on line 3); keep one; fix the syntax"


@pytest.mark.parametrize(("text", "expected"), [("", "the file is empty"), ("- a\n- b\n", "must be a mapping")])
def test_a_declaration_must_be_a_mapping(folder: Path, text: str, expected: str) -> None:
    path = folder / "odd.yaml"
    path.write_text(text)
    (line,) = problems_of(path)
    assert line.startswith(f"{path}: (top level): {expected}")


# ---- a folder ------------------------------------------------------------------------------------------------

def test_a_bad_file_never_hides_the_others(folder: Path) -> None:
    good = declare(folder, "a.yaml")
    bad = declare(folder, "b.yml", dag_id="other", model_name="other", gate={"primary": "rmse"})
    (folder / ".hidden.yaml").write_text("not: [valid")
    (folder / "notes.txt").write_text("ignored")
    pipelines, errors = load_pipelines(folder)
    assert [p.source for p in pipelines] == [good]
    assert [e.source for e in errors] == [str(bad)]
    assert errors[0].problems[0].startswith(f"{bad}: gate.primary: metric 'rmse'")


@pytest.mark.parametrize("key", ["dag_id", "model_name"])
def test_a_dag_id_or_model_name_declared_twice_refuses_both_files(folder: Path, key: str) -> None:
    first = declare(folder, "a.yaml", **{"dag_id": "a", "model_name": "a", key: "same"})
    second = declare(folder, "b.yaml", **{"dag_id": "b", "model_name": "b", key: "same"})
    third = declare(folder, "c.yaml", dag_id="c", model_name="c")
    pipelines, errors = load_pipelines(folder)
    assert [p.source for p in pipelines] == [third]
    assert [e.problems for e in errors] == [
        (f"{first}: {key}: 'same' is also the {key} of {second}; give each pipeline its own {key}",),
        (f"{second}: {key}: 'same' is also the {key} of {first}; give each pipeline its own {key}",),
    ]



def test_a_dataset_asset_declared_twice_refuses_both_files_even_as_another_dag_id(folder: Path) -> None:
    first = declare(folder, "a.yaml", dag_id="churn", model_name="a")  # its asset defaults to its dag_id
    second = declare(folder, "b.yaml", dag_id="b", model_name="b",
                     dataset={"asset": "churn", "loader": "tabular", "label": "diagnosis",
                              "data": {"directory": "data/b"}})
    pipelines, errors = load_pipelines(folder)
    assert pipelines == [] and [e.problems for e in errors] == [
        (f"{first}: dataset.asset: 'churn' is also the dataset.asset of {second}; give each pipeline its own "
         f"dataset.asset (it defaults to the dag_id)",),
        (f"{second}: dataset.asset: 'churn' is also the dataset.asset of {first}; give each pipeline its own "
         f"dataset.asset (it defaults to the dag_id)",),
    ]


def test_cli_check_finds_clashes_across_every_path_given(tmp_path: Path) -> None:
    from nightshift.pipelines.cli import check_paths

    for name in ("p", "q"):
        (tmp_path / name / "suites").mkdir(parents=True)
        (tmp_path / name / "suites" / "cancer.json").write_text(json.dumps(SUITE))
    first = declare(tmp_path / "p", "churn.yaml", dag_id="churn", model_name="churn-model")
    second = declare(tmp_path / "q", "churn_v2.yaml", dag_id="churn_v2", model_name="churn-model")
    other = declare(tmp_path / "q", "other.yaml", dag_id="other", model_name="other")
    valid, problems = check_paths([str(tmp_path / "p"), str(tmp_path / "q")], data=False)
    assert valid == ["other"] and problems == [
        f"{first}: model_name: 'churn-model' is also the model_name of {second}; give each pipeline its own "
        f"model_name",
        f"{second}: model_name: 'churn-model' is also the model_name of {first}; give each pipeline its own "
        f"model_name",
    ]
    assert check_paths([str(first), str(first), str(other)], data=False) == (["churn", "churn", "other"], [])


def test_a_missing_folder_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        load_pipelines(tmp_path / "nope")


# ---- against the data --------------------------------------------------------------------------------------------

@pytest.fixture
def cancer_data(nightshift_home: Path) -> Path:
    directory = nightshift_home / "data" / "cancer"
    directory.mkdir(parents=True)
    frame = pd.DataFrame({"mean_radius": [1.0, 2.0, 3.0], "diagnosis": [0, 1, 0]})
    for split in ("train", "validation", "test"):
        frame.to_parquet(directory / f"{split}.parquet", index=False)
    return directory


def test_a_pipeline_that_fits_its_data_has_no_problems(folder: Path, cancer_data: Path) -> None:
    assert check_against_data(load_pipeline(declare(folder))) == []


def test_the_label_must_be_a_column_of_the_train_split(folder: Path, cancer_data: Path) -> None:
    path = declare(folder, dataset={"label": "target"})
    problems = check_against_data(load_pipeline(path))
    assert problems == [f"{path}: dataset.label: column 'target' is not in {cancer_data / 'train.parquet'} "
                        f"(columns: mean_radius, diagnosis); set dataset.label to the column holding the target"]


def test_a_suite_for_other_columns_is_named(folder: Path, cancer_data: Path) -> None:
    suite = {**SUITE, "expectations": [*SUITE["expectations"], {"type": "expect_column_values_to_be_in_set",
                                                                "kwargs": {"column": "pixel_3", "value_set": [1]}}]}
    (folder / "suites" / "cancer.json").write_text(json.dumps(suite))
    path = declare(folder)
    (line,) = check_against_data(load_pipeline(path))
    assert line.startswith(f"{path}: suite: names columns pixel_3 that ")
    assert "(in expect_column_values_to_be_in_set): a suite for other columns?" in line


def test_a_suite_for_other_columns_is_one_line_for_all_its_expectations(folder: Path, cancer_data: Path) -> None:
    other = [{"type": "expect_table_columns_to_match_set", "kwargs": {"column_set": ["bmi", "age"]}},
             {"type": "expect_columns_values_to_not_be_null", "kwargs": {"column_list": ["age", "bmi"]}},
             {"type": "expect_column_values_to_be_between", "kwargs": {"column": "mean_radius", "min_value": 0}}]
    (folder / "suites" / "cancer.json").write_text(json.dumps({**SUITE, "expectations": other}))
    path = declare(folder)
    (line,) = check_against_data(load_pipeline(path))
    assert line.startswith(f"{path}: suite: names columns age, bmi that ")
    assert ("(in expect_table_columns_to_match_set, expect_columns_values_to_not_be_null): a suite for other "
            "columns?") in line


def test_tabular_features_must_be_numeric(folder: Path, cancer_data: Path) -> None:
    frame = pd.DataFrame({"mean_radius": [1.0, 2.0], "site": ["a", "b"], "diagnosis": [0, 1]})
    frame.to_parquet(cancer_data / "train.parquet", index=False)
    path = declare(folder)
    (line,) = check_against_data(load_pipeline(path))
    assert line.startswith(f"{path}: dataset.features: column 'site' of ") and "not numeric" in line
    # the same columns through a registered loader of its own: its business, not the tabular rule's
    assert check_against_data(load_pipeline(declare(folder, dataset={"loader": "digits"}))) == []


def test_data_outside_the_data_roots_is_refused(folder: Path, tmp_path: Path) -> None:
    path = declare(folder, dataset={"data": {"directory": str(tmp_path / "elsewhere")}})
    (line,) = check_against_data(load_pipeline(path))
    assert line.startswith(f"{path}: dataset.data: ") and "outside the allowed data roots" in line


def test_missing_data_is_a_problem_not_a_crash(folder: Path, nightshift_home: Path) -> None:
    path = declare(folder)
    (line,) = check_against_data(load_pipeline(path))
    assert line.startswith(f"{path}: dataset.data: the train split ") and "does not exist" in line


# ---- the CLI -------------------------------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    """`nightshift ARGV` with only this module's subcommands (the full parser imports torch): its exit status, a
    result printed as JSON as nightshift.cli.main does."""
    from nightshift.cli import emit
    from nightshift.pipelines import cli

    assert cli.__name__ in COMMAND_MODULES
    parser = _Parser(prog="nightshift")
    cli.add_parser(parser.add_subparsers(dest="command", required=True, parser_class=_Parser))
    args = parser.parse_args(argv)
    result = args.func(args)
    if isinstance(result, int):
        return result
    emit(result)
    return 0


def test_cli_check_prints_one_line_per_problem_and_fails(folder: Path, cancer_data: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    declare(folder, "a.yaml")
    assert main(["pipeline", "check", str(folder)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["valid"], out["problems"]) == (["cancer_retrain"], [])

    bad = declare(folder, "b.yaml", dag_id="b", model_name="b", gate={"primary": "r2"}, colour="red")
    assert main(["pipeline", "check", str(folder / "a.yaml"), str(bad), str(folder / "none.yaml")]) == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0] == f"{bad}: colour: unknown key; allowed keys here: dag_id, description, model_name, task, " \
                       f"schedule, dataset, model, gate, suite, training, deploy, retention"
    assert len(lines) == 2 and lines[1].startswith(f"{folder / 'none.yaml'}: (top level): cannot be read")
    assert json.loads(captured.out)["valid"] == ["cancer_retrain"]


def test_cli_check_can_skip_the_data(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = declare(folder)
    assert main(["pipeline", "check", str(path)]) == 1  # no data yet
    assert main(["pipeline", "check", "--no-data", str(path)]) == 0
    assert capsys.readouterr().err.count("\n") == 1


# ---- the schema stays in step with the code ------------------------------------------------------------------

def test_the_schema_lists_what_the_code_knows() -> None:
    from nightshift.deploy import BUILTIN_TARGETS
    from operators.backends import BUILTIN_BACKENDS

    properties = schema()["properties"]
    assert tuple(properties["task"]["enum"]) == tasks.TASKS
    # Backends are registered in the operators layer (plugins too): the schema takes any name, and names the
    # built-ins; the DAG factory checks the name against the registry.
    backend = properties["training"]["properties"]["backend"]
    assert "enum" not in backend
    assert all(name in backend["description"] for name in (*BUILTIN_BACKENDS, "auto"))
    # The published file lists the built-in targets; the loader adds the plugins' (test_backend_registry).
    assert tuple(properties["deploy"]["properties"]["target"]["enum"]) == BUILTIN_TARGETS
    primary = properties["gate"]["properties"]["primary"]["description"]
    for task in tasks.TASKS:
        assert f"{task}: {', '.join(tasks.metric_names(task))}" in primary


def test_every_key_is_described() -> None:
    def walk(node: dict[str, Any], where: str) -> None:
        for key, sub in node.get("properties", {}).items():
            assert sub.get("description"), f"{where}{key} has no description"
            walk(sub, f"{where}{key}.")

    walk(schema(), "")


def test_the_schema_ships_in_the_wheel() -> None:
    assert SCHEMA_PATH.is_file() and SCHEMA_PATH.parent == REPO / "nightshift" / "pipelines"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "pipeline.schema.json" in project["tool"]["setuptools"]["package-data"]["nightshift.pipelines"]
    assert any(d.startswith("jsonschema") for d in project["project"]["dependencies"])


# ---- pipelines/digits.yaml is today's nightly_retrain ---------------------------------------------------------

def _assignments(path: Path) -> dict[str, ast.expr]:
    """The module-level `NAME = value` expressions of a Python file."""
    tree = ast.parse(path.read_text())
    found: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = node.value
    return found


def test_digits_yaml_declares_todays_nightly_retrain() -> None:
    # The DAG itself is built from digits.yaml (dags/nightly_retrain.py); tests/dags/test_pipeline_factory.py
    # checks that it equals the DAG written by hand before. Here: the values the library's defaults hold.
    pipeline = load_pipeline(REPO / "pipelines" / "digits.yaml")
    assert (pipeline.dag_id, pipeline.model_name, pipeline.schedule) == ("nightly_retrain", "nightshift-digits",
                                                                        "0 2 * * *")
    assert pipeline.dataset_asset_uri == "nightshift://datasets/digits"
    assert pipeline.champion_asset_uri == "nightshift://models/nightshift-digits/champion"
    assert pipeline.dataset.data.directory == "demo-data/digits"
    assert (pipeline.training.epochs, pipeline.training.workers, pipeline.training.gpus_per_worker) == (5, 2, 0)
    assert pipeline.training.backend is None and pipeline.training.queue is None
    assert (pipeline.deploy.target, pipeline.deploy.require_approval) == ("local", False)
    assert pipeline.gate.min_improvement == 0.001
    # the trainer's defaults the DAG leaves in place
    from nightshift.train.config import TrainConfig

    assert (pipeline.dataset.loader, pipeline.model.name) == (TrainConfig.dataset, TrainConfig.model)
    assert dict(pipeline.model.kwargs) == {}
    # the gate: a multiclass task's default gate (GateConfig with nothing given, nightshift evaluate's defaults)
    primary, guards, floor = tasks.DEFAULT_GATES[tasks.MULTICLASS]
    assert pipeline.gate.config() == {"primary": primary, "guards": guards, "floor": floor, "min_improvement": 0.001,
                                      "positive_class": None}
    assert pipeline.task == tasks.MULTICLASS and pipeline.dataset.label == "label"
    # the suite: the one validate_data loads (nightshift.data.validate.SUITE in gx/)
    validate = _assignments(REPO / "nightshift" / "data" / "validate.py")
    assert pipeline.suite == f"gx:{ast.literal_eval(validate['SUITE'])}"
    assert pipeline.suite_path == (REPO / "gx" / "expectations" / "digits.json").resolve()


def test_digits_yaml_fits_the_demo_datas_columns(nightshift_home: Path) -> None:
    # The demo dataset's columns (DESIGN.md; nightshift.data.demo writes them, but importing it imports torch).
    target = nightshift_home / "demo-data" / "digits"
    target.mkdir(parents=True)
    frame = pd.DataFrame({"label": [0, 1], **{f"pixel_{i}": [0.0, 16.0] for i in range(64)}})
    frame.to_parquet(target / "train.parquet", index=False)
    assert check_against_data(load_pipeline(REPO / "pipelines" / "digits.yaml")) == []
    frame.drop(columns=["pixel_63"]).to_parquet(target / "train.parquet", index=False)
    (line,) = check_against_data(load_pipeline(REPO / "pipelines" / "digits.yaml"))
    assert line.split(": ")[2].startswith("names columns pixel_63 that ")
    assert "(in expect_table_columns_to_match_set, expect_table_column_types_to_be, " in line
    assert "(5 in all))" in line


# ---- values YAML reads as no JSON, anchors, size (the hostile review) -----------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("training: {learning_rate: .nan}", "training.learning_rate: must be a finite number, got nan"),
    ("deploy: {target: local, options: {tolerance: .nan}}", "deploy.options.tolerance: must be a finite number"),
    ("model: {name: mlp, kwargs: {scale: -.inf}}", "model.kwargs.scale: must be a finite number, got -inf"),
    ("dataset: {loader: tabular, label: diagnosis, data: {directory: d}, options: {since: 2024-01-01}}",
     "dataset.options.since: date 2024-01-01 is not a JSON value"),
    ("dataset: {loader: tabular, label: diagnosis, data: {directory: d}, options: {yes: 1}}",
     "dataset.options.True: the key True is boolean true, not a string"),
    # YAML 1.1 reads an exponent without a dot as text (review rev34b: refused with no hint how to write it)
    ("gate: {primary: accuracy, floor: 0.5, min_improvement: 1e-3}",
     "gate.min_improvement: must be a number, got string '1e-3' (YAML reads 1e-3 as text: write 1.0e-3)"),
])
def test_values_that_are_no_plain_json_are_refused_on_one_line(folder: Path, text: str, expected: str) -> None:
    key = text.split(":", 1)[0]
    path = folder / "cancer.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in DECLARATION.items() if k != key) + text + "\n")
    assert any(expected in line for line in problems_of(path))


@pytest.mark.parametrize("dag_id", ["..", ".", "-x", "a..b", "_x"])
def test_a_dag_id_must_start_with_a_letter_or_digit_and_hold_no_dot_dot(folder: Path, dag_id: str) -> None:
    assert problems_of(declare(folder, dag_id=dag_id))[0].startswith(f"{folder / 'cancer.yaml'}: dag_id: ")
    load_pipeline(declare(folder, dag_id="a.b-c_1"))


def test_yaml_anchors_and_aliases_are_refused_naming_the_line(folder: Path) -> None:
    path = folder / "bomb.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in DECLARATION.items() if k != "model"}, sort_keys=False)
                    + "model:\n  name: mlp\n  kwargs:\n    l0: &l0 {a: 1}\n    l1: {k0: *l0, k1: *l0}\n")
    (line,) = problems_of(path)
    assert line.startswith(f"{path}: line {len(path.read_text().splitlines()) - 1}: invalid YAML: YAML anchor &l0")


def test_a_declaration_over_a_mebibyte_is_refused_unread(folder: Path) -> None:
    path = declare(folder)
    path.write_text(path.read_text() + "#" * (1024 * 1024) + "\n")
    (line,) = problems_of(path)
    assert "over the 1048576 a declaration may have" in line


# ---- the gate a declaration gets (issue 34: never weaker than the task's default) ------------------------------

def _gate_only(folder: Path, task: str, gate: dict[str, Any]) -> Path:
    path = declare(folder, task=task, gate=None)
    data = yaml.safe_load(path.read_text())
    data["gate"] = gate
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_gate_that_leaves_keys_out_gets_the_tasks_defaults_not_a_weaker_gate(folder: Path) -> None:
    from nightshift.evaluate import GateConfig, decide

    pipeline = load_pipeline(_gate_only(folder, "binary", {"primary": "accuracy", "floor": 0.8}))
    _, guards, _ = tasks.DEFAULT_GATES[tasks.BINARY]
    assert pipeline.gate.config() == {"primary": "accuracy", "floor": 0.8, "guards": guards,
                                      "min_improvement": tasks.DEFAULT_MIN_IMPROVEMENT, "positive_class": None}
    # what the README's user pipeline declared promoted a far worse model on main: equal accuracy, log loss
    # 0.90 against 0.12, F1 0.70 against 0.95
    champion = {"accuracy": 0.95, "log_loss": 0.12, "f1": 0.95, "roc_auc": 0.98}
    worse = {"accuracy": 0.95, "log_loss": 0.90, "f1": 0.70, "roc_auc": 0.90}
    decision = decide(worse, champion, GateConfig(task=pipeline.task, **pipeline.gate.config()))
    assert not decision["passed"], decision
    assert any("beyond tolerance" in reason for reason in decision["reasons"]), decision
    # no floor either: a classification task's default floor for its default primary metric
    assert load_pipeline(_gate_only(folder, "binary", {"primary": "accuracy"})).gate.floor == 0.8


def test_only_an_explicit_empty_guards_declares_no_guard(folder: Path) -> None:
    pipeline = load_pipeline(_gate_only(folder, "multiclass", {"primary": "accuracy", "guards": {}}))
    assert dict(pipeline.gate.guards) == {}
    assert pipeline.gate.min_improvement == tasks.DEFAULT_MIN_IMPROVEMENT


def test_a_regression_gate_needs_no_floor_and_another_primary_needs_one(folder: Path) -> None:
    regression = load_pipeline(_gate_only(folder, "regression", {"primary": "mae"}))
    assert regression.gate.floor is None and dict(regression.gate.guards) == {}
    path = _gate_only(folder, "binary", {"primary": "log_loss"})
    assert problems_of(path) == (f"{path}: gate.floor: required with primary 'log_loss': the task's default floor "
                                 f"(0.8) is for accuracy; give the value 'log_loss' must reach when there is no "
                                 f"champion yet",)


# ---- what failed only later, at Airflow's parse (issue 34 item 8) ---------------------------------------------

@pytest.mark.parametrize("schedule", ["99 99 * * *", "0 2 * *  foo", "61 * * * *"])
def test_an_invalid_cron_schedule_is_named_where_it_is_declared(folder: Path, schedule: str) -> None:
    path = declare(folder, schedule=schedule)
    assert problems_of(path) == (f"{path}: schedule: {schedule!r} is not a valid cron expression (minute hour "
                                 f"day-of-month month day-of-week, e.g. '0 2 * * *' for 02:00 every day); fix it, or "
                                 f"use a preset like '@daily'",)
    assert load_pipeline(declare(folder, schedule="*/15 2-4 * * mon-fri")).schedule == "*/15 2-4 * * mon-fri"


def test_a_declaration_nested_thousands_deep_is_refused_not_a_crash(folder: Path) -> None:
    """On main the YAML parser's RecursionError escaped the check and broke every sibling's DAG."""
    path = folder / "deep.yaml"
    path.write_text("dag_id: deep\nmodel: " + "[" * 5000 + "]" * 5000 + "\n")
    assert problems_of(path) == (f"{path}: (top level): nested too deep to be a declaration; a declaration is a few "
                                 f"levels deep (see the schema)",)


def test_a_schedule_that_never_fires_is_refused(folder: Path) -> None:
    """Review: 30 February passes croniter's syntax check and fails when the scheduler asks for the next run."""
    path = declare(folder, schedule="0 0 30 2 *")
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}: schedule: '0 0 30 2 *' never fires (") and "'0 2 28 2 *'" in problem


@pytest.mark.parametrize(("dag_id", "says"), [
    ("model_search", "is the dag_id of the project's own DAG dags/model_search.py"),
    ("nightshift_maintenance", "is the dag_id of the project's own DAG dags/nightshift_maintenance.py"),
    ("churn_retrain__search", "ends with '__search', the dag_id of pipeline 'churn_retrain''s model search DAG"),
    ("invalid_pipeline__churn", "begins with 'invalid_pipeline__', the dag_id of the stand-in DAG"),
])
def test_a_dag_id_another_dag_of_the_project_takes_is_refused(folder: Path, dag_id: str, says: str) -> None:
    """Airflow keeps one DAG per dag_id and fails the other file: a declaration named like the project's own DAGs,
    or like another pipeline's search DAG, passed pipeline check and lost to (or hid) that DAG at parse."""
    path = declare(folder, dag_id=dag_id)
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}: dag_id: {dag_id!r} {says}") and problem.endswith("; choose another dag_id")


def test_the_reserved_dag_ids_are_those_of_the_projects_dag_files() -> None:
    from nightshift.pipelines.spec import PROJECT_DAG_IDS

    found = {match for py in (REPO / "dags").glob("*.py")
             for match in re.findall(r'^DAG_ID = "([^"]+)"', py.read_text(), re.M)}
    assert set(PROJECT_DAG_IDS) == found
