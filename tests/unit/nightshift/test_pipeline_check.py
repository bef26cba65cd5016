"""`nightshift pipeline check` catches what a run would fail on later (issue 34 items 8 and 10): an unknown loader or
model, model arguments its signature does not take, a dag_id, model name or asset that a declaration in another
folder Airflow loads declares too, a positive class the labels do not hold, a suite letting nulls through to a loader
that refuses them; and `nightshift pipeline explain` shows the gate a declaration really gets."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from nightshift.errors import DataError
from nightshift.pipelines import PipelineInvalid, check_declaration, check_unique, declaration_folders, load_pipeline
from nightshift.pipelines.check import check_against_data
from nightshift.pipelines.cli import check_paths
from tests.unit.nightshift import test_pipelines as pipelines_tests
from tests.unit.nightshift.test_pipelines import SUITE, declare, main, problems_of

folder = pipelines_tests.folder  # the fixture: a pipelines folder holding suites/cancer.json
MODULE = __name__


def loader_taking_nulls(data_dir: str, split: str, *, task: str = "binary", sep: str = ",") -> None:
    """A plugin's loader that takes missing values (it says nothing), with an option of its own."""


def model_taking_anything(hidden: int = 8, **options: Any) -> None:
    """A plugin's model whose constructor takes any keyword argument."""


def model_of_two(input_shape: tuple[int, ...], num_classes: int, depth: int = 2, width: int = 16) -> None:
    """A plugin's model taking depth and width (input_shape and num_classes come from the data)."""


@pytest.fixture
def cancer(nightshift_home: Path) -> Path:
    """scikit-learn's breast-cancer table as the declaration's data (diagnosis 0 malignant, 1 benign)."""
    from sklearn.datasets import load_breast_cancer

    table = load_breast_cancer(as_frame=True).frame
    frame = pd.DataFrame({"mean_radius": table["mean radius"], "diagnosis": table["target"]})
    directory = nightshift_home / "data" / "cancer"
    directory.mkdir(parents=True)
    for split in ("train", "validation", "test"):
        frame.to_parquet(directory / f"{split}.parquet", index=False)
    return directory


# ---- loader, model and their arguments ---------------------------------------------------------------------------

def test_an_unknown_loader_or_model_is_named_with_the_file_key_and_known_choices(folder: Path) -> None:
    path = declare(folder, dataset={"loader": "tabluar"}, model={"name": "resnet"})
    loader, model = check_declaration(load_pipeline(path))
    assert loader.startswith(f"{path}: dataset.loader: unknown dataset 'tabluar'; known: ") and \
        "digits, tabular" in loader
    assert model.startswith(f"{path}: model.name: unknown model 'resnet'; known: ") and "digits_cnn, mlp" in model
    (line,) = check_declaration(load_pipeline(declare(folder, model={"name": "no_such.module:Net"})))
    assert line.startswith(f"{path}: model.name: cannot import model 'no_such.module:Net'")


def test_a_plugin_module_failing_at_import_is_a_problem_line_not_a_crash(
        folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model module with a syntax error (or raising at import) crashed pipeline check with a traceback, and the
    other declarations went unchecked."""
    (tmp_path / "broken_net.py").write_text("def net(:\n")
    (tmp_path / "raising_loader.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = declare(folder, model={"name": "broken_net:net"}, dataset={"loader": "raising_loader:load"})
    loader, model = check_declaration(load_pipeline(path))
    assert loader == (f"{path}: dataset.loader: cannot import 'raising_loader:load': RuntimeError: no GPU here; "
                      f"fix the plugin module")
    assert model.startswith(f"{path}: model.name: cannot import 'broken_net:net': SyntaxError: ")


def test_model_arguments_its_constructor_does_not_take_are_named_with_those_it_takes(folder: Path) -> None:
    path = declare(folder, model={"name": "mlp", "kwargs": {"hidden": 16, "width": 3, "num_classes": 2}})
    assert check_declaration(load_pipeline(path)) == [
        f"{path}: model.kwargs.num_classes: set by the trainer from the data (input_shape, num_classes); remove it",
        f"{path}: model.kwargs.width: model 'mlp' takes no argument 'width' (its signature); it takes hidden",
    ]
    plugin = declare(folder, model={"name": f"{MODULE}:model_of_two", "kwargs": {"depth": 3, "hidden": 4}})
    assert check_declaration(load_pipeline(plugin)) == [
        f"{plugin}: model.kwargs.hidden: model '{MODULE}:model_of_two' takes no argument 'hidden' (its signature); "
        f"it takes depth, width"]
    anything = declare(folder, model={"name": f"{MODULE}:model_taking_anything", "kwargs": {"anything": 1}})
    assert check_declaration(load_pipeline(anything)) == []  # a **kwargs constructor takes any argument


def test_loader_options_its_signature_does_not_take_are_named(folder: Path) -> None:
    path = declare(folder, dataset={"options": {"sep": ";"}})
    assert check_declaration(load_pipeline(path)) == [
        f"{path}: dataset.options.sep: loader 'tabular' takes no option 'sep' (its signature); it takes features, "
        f"label"]
    plugin = declare(folder, dataset={"loader": f"{MODULE}:loader_taking_nulls", "options": {"sep": ";"}})
    assert check_declaration(load_pipeline(plugin)) == []


def test_the_digits_loader_takes_no_option_and_check_says_so(folder: Path) -> None:
    """Its `**options` made the signature check pass any option, which training then refused."""
    path = declare(folder, task="multiclass", gate={"primary": "accuracy", "floor": 0.8, "guards": {}},
                   dataset={"loader": "digits", "label": "label", "options": {"label": "label"}})
    assert check_declaration(load_pipeline(path)) == [
        f"{path}: dataset.options.label: loader 'digits' takes no option 'label' (its signature); it takes no option"]


def loader_of_regression(data_dir: str, split: str, *, task: str = "regression") -> None:
    """A plugin's loader that loads regression tasks only, and says so."""


loader_of_regression.tasks = ("regression",)  # type: ignore[attr-defined]


def test_a_task_the_loader_does_not_load_is_named(folder: Path) -> None:
    """The digits loader loads a multiclass task only: a binary declaration of it passed pipeline check and failed
    in training ("dataset 'digits' is a multiclass task, not 'binary'")."""
    path = declare(folder, dataset={"loader": "digits", "label": "label"})
    assert check_declaration(load_pipeline(path)) == [
        f"{path}: task: loader 'digits' loads a multiclass task only, not binary; declare task multiclass, or a "
        f"loader for a binary task (e.g. tabular)"]
    plugin = declare(folder, dataset={"loader": f"{MODULE}:loader_of_regression"})
    assert check_declaration(load_pipeline(plugin)) == [
        f"{plugin}: task: loader '{MODULE}:loader_of_regression' loads a regression task only, not binary; declare "
        f"task regression, or a loader for a binary task (e.g. tabular)"]
    assert check_declaration(load_pipeline(declare(folder))) == []  # tabular loads any task


def loader_before_tasks(data_dir: str, split: str) -> None:
    """A plugin's loader as docs/how-to/own-model.md writes one, `(data_dir, split)`: load_split gives it no `task`
    for a multiclass task and `task=` for any other, which its signature refuses."""


def test_a_loader_whose_signature_takes_no_task_loads_a_multiclass_task_only(folder: Path) -> None:
    """A binary declaration of such a loader passed pipeline check and failed in training ("dataset ... does not
    take ['task']")."""
    name = f"{MODULE}:loader_before_tasks"
    path = declare(folder, dataset={"loader": name})
    assert check_declaration(load_pipeline(path)) == [
        f"{path}: task: loader '{name}' loads a multiclass task only, not binary; declare task multiclass, or a "
        f"loader for a binary task (e.g. tabular)"]
    multiclass = declare(folder, dataset={"loader": name}, task="multiclass",
                         gate={"primary": "accuracy", "floor": 0.8, "guards": {}})
    assert check_declaration(load_pipeline(multiclass)) == []
    # one taking `task`, or any keyword (**options), may load any task
    assert check_declaration(load_pipeline(declare(folder, dataset={"loader": f"{MODULE}:loader_taking_nulls"}))) \
        == []


# ---- nulls the loader refuses --------------------------------------------------------------------------------------

LENIENT = {"type": "expect_column_values_to_not_be_null", "kwargs": {"column": "mean_radius", "mostly": 0.9},
           "meta": {"rule": "nulls: mean_radius at most 10% nulls"}}


def test_a_suite_letting_nulls_into_a_column_the_loader_refuses_them_in_is_named(folder: Path) -> None:
    (folder / "suites" / "cancer.json").write_text(json.dumps({**SUITE, "expectations": [
        *SUITE["expectations"], LENIENT,
        {"type": "expect_column_values_to_be_null", "kwargs": {"column": "diagnosis"}}]}))
    path = declare(folder)
    lenient, expected = check_declaration(load_pipeline(path))
    assert lenient.startswith(f"{path}: suite: expect_column_values_to_not_be_null (mostly 0.9) [nulls: mean_radius "
                              f"at most 10% nulls] lets nulls into mean_radius, which the 'tabular' loader refuses")
    assert "Drop its `mostly` (no null allowed)" in lenient
    assert expected.startswith(f"{path}: suite: expect_column_values_to_be_null lets nulls into diagnosis")
    # not a contradiction: a column the model does not use, or a loader that takes missing values
    assert check_declaration(load_pipeline(declare(folder, dataset={"features": ["other"]}))) == [expected]
    assert check_declaration(load_pipeline(declare(folder, dataset={"loader": f"{MODULE}:loader_taking_nulls"}))) \
        == []


def test_a_suite_with_no_null_rule_for_a_column_the_loader_reads_is_named(folder: Path, cancer: Path) -> None:
    """A suite saying nothing of nulls in a column lets them through as surely as a lenient rule: validation passed
    such data and the tabular loader refused it in training, and pipeline check said nothing."""
    silent = {**SUITE, "expectations": [e for e in SUITE["expectations"] if e["kwargs"].get("column") != "diagnosis"]}
    (folder / "suites" / "cancer.json").write_text(json.dumps(silent))
    path = declare(folder)
    assert check_against_data(load_pipeline(path)) == [
        f"{path}: suite: no rule holds diagnosis to no nulls, which the 'tabular' loader refuses (any missing value "
        f"in a feature or the label): such data would pass validation and fail training. Add a not-null rule for "
        f"them (expect_columns_values_to_not_be_null; `nightshift suite init` draws one)"]
    # a loader that takes missing values, or a strict rule for every column it reads: nothing to say
    assert check_against_data(load_pipeline(declare(folder, dataset={"loader": f"{MODULE}:loader_taking_nulls"}))) \
        == []
    strict = {"type": "expect_columns_values_to_not_be_null", "kwargs": {"column_list": ["diagnosis", "mean_radius"]}}
    (folder / "suites" / "cancer.json").write_text(json.dumps({**silent, "expectations": [
        *silent["expectations"], strict]}))
    assert check_against_data(load_pipeline(declare(folder))) == []


def test_a_not_null_rule_written_as_a_share_of_non_null_values_holds_the_column(folder: Path, cancer: Path) -> None:
    """GX's expect_column_proportion_of_non_null_values_to_be_between with min_value 1 refuses any null or NaN as
    surely as expect_column_values_to_not_be_null; pipeline check said no rule held the column and exited 1."""
    share = {"type": "expect_column_proportion_of_non_null_values_to_be_between",
             "kwargs": {"column": "diagnosis", "min_value": 1.0}}
    others = [e for e in SUITE["expectations"] if e["kwargs"].get("column") != "diagnosis"]
    (folder / "suites" / "cancer.json").write_text(json.dumps({**SUITE, "expectations": [*others, share]}))
    assert check_against_data(load_pipeline(declare(folder))) == []
    # a share below 1 lets nulls in: still named
    lenient = {**share, "kwargs": {"column": "diagnosis", "min_value": 0.95}}
    (folder / "suites" / "cancer.json").write_text(json.dumps({**SUITE, "expectations": [*others, lenient]}))
    (line,) = check_against_data(load_pipeline(declare(folder)))
    assert "no rule holds diagnosis to no nulls" in line


def test_suite_init_for_a_loader_refusing_nulls_never_draws_a_suite_letting_them_through(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sklearn.datasets import load_breast_cancer

    frame = load_breast_cancer(as_frame=True).frame.rename(columns=lambda c: c.replace(" ", "_"))
    frame.loc[::20, "mean_radius"] = None
    data = tmp_path / "sample.parquet"
    frame.to_parquet(data, index=False)
    out = tmp_path / "suite.json"
    with pytest.raises(DataError, match=r"missing values in mean_radius \(29 rows\), and the tabular loader takes "
                                        r"none: a suite drawn from it would let nulls through"):
        main(["suite", "init", str(data), "--label", "target", "--out", str(out)])
    assert not out.exists()
    assert main(["suite", "init", str(data), "--label", "target", "--out", str(out),
                 "--loader", f"{MODULE}:loader_taking_nulls"]) == 0
    suite = json.loads(out.read_text())
    assert any(e["kwargs"].get("column") == "mean_radius" and e["kwargs"].get("mostly", 1) < 1
               for e in suite["expectations"])


def test_suite_init_for_a_loader_refusing_nulls_takes_gaps_in_a_column_it_cannot_read(tmp_path: Path) -> None:
    """A free-text column can be no feature of the tabular loader (it is left out of dataset.features): its nulls
    refused the whole sample, and no suite could be drawn for a table holding such a column."""
    from sklearn.datasets import load_breast_cancer

    frame = load_breast_cancer(as_frame=True).frame.rename(columns=lambda c: c.replace(" ", "_"))
    frame["notes"] = ["seen twice" if i % 7 else None for i in range(len(frame))]
    data = tmp_path / "sample.parquet"
    frame.to_parquet(data, index=False)
    out = tmp_path / "suite.json"
    assert main(["suite", "init", str(data), "--label", "target", "--out", str(out)]) == 0
    frame.loc[::20, "mean_radius"] = None
    frame.to_parquet(data, index=False)
    with pytest.raises(DataError, match=r"missing values in mean_radius \(29 rows\), and the tabular loader"):
        main(["suite", "init", str(data), "--label", "target", "--out", str(out), "--force"])


# ---- the positive class ----------------------------------------------------------------------------------------

def test_a_declared_positive_class_must_be_one_of_the_labels(folder: Path, cancer: Path) -> None:
    assert check_against_data(load_pipeline(declare(folder, gate={"positive_class": 0}))) == []
    path = declare(folder, gate={"positive_class": "malignant"})
    assert check_against_data(load_pipeline(path)) == [
        f"{path}: gate.positive_class: 'malignant' is not a label of {cancer / 'train.parquet'}: its labels are 0, 1; "
        f"declare one of them as it is written there"]


def test_a_positive_class_yaml_read_as_a_boolean_is_told_to_be_quoted(folder: Path, cancer: Path) -> None:
    """`positive_class: yes` over no/yes labels: YAML reads yes as true, and the check said only that 'True' is not
    a label, naming a value nobody wrote."""
    frame = pd.read_parquet(cancer / "train.parquet")
    frame["diagnosis"] = frame["diagnosis"].map({0: "no", 1: "yes"})
    frame.to_parquet(cancer / "train.parquet", index=False)
    path = folder / "cancer.yaml"
    path.write_text(declare(folder).read_text().replace("primary: roc_auc", "primary: roc_auc\n  positive_class: yes"))
    (line,) = check_against_data(load_pipeline(path))
    assert line.startswith(f"{path}: gate.positive_class: 'True' is not a label of ") and line.endswith(
        "(YAML reads an unquoted yes, no, on, off, true or false as a boolean: quote it, e.g. 'yes')")
    path.write_text(path.read_text().replace("positive_class: yes", "positive_class: 'yes'"))
    assert check_against_data(load_pipeline(path)) == []


def test_only_a_binary_task_has_a_positive_class(folder: Path) -> None:
    path = declare(folder, task="multiclass", gate={"primary": "accuracy", "positive_class": 1})
    assert problems_of(path) == (f"{path}: gate.positive_class: only a binary task has a positive class, this one "
                                 f"is multiclass; remove it",)
    pipeline = load_pipeline(declare(folder, gate={"positive_class": True}))
    assert pipeline.gate.positive_class == "True" and pipeline.gate.config()["positive_class"] == "True"


# ---- every folder Airflow loads declarations from ----------------------------------------------------------------

@pytest.fixture
def dags(tmp_path: Path, folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A DAG folder beside the pipelines folder (`folder`), with a suite of its own."""
    monkeypatch.delenv("NIGHTSHIFT_PIPELINES", raising=False)
    root = tmp_path / "dags"
    (root / "suites").mkdir(parents=True)
    (root / "suites" / "cancer.json").write_text(json.dumps(SUITE))
    return root


def test_a_model_name_declared_in_the_dag_folder_and_in_pipelines_refuses_both(folder: Path, dags: Path) -> None:
    """Only siblings were compared: dags/ and pipelines/ could both declare nightshift-digits."""
    demo = declare(folder, "digits.yaml", dag_id="nightly_retrain", model_name="nightshift-digits")
    churn = declare(dags, "churn.yaml", dag_id="churn", model_name="nightshift-digits")
    folders = declaration_folders(dags)
    assert folders == [dags.resolve(), folder.resolve()]
    for mine, theirs in ((churn, demo), (demo, churn)):
        line = (f"{mine}: model_name: 'nightshift-digits' is also the model_name of {theirs.resolve()}; give each "
                f"pipeline its own model_name")
        assert check_paths([str(mine)], data=False, folders=folders) == ([], [line])
        with pytest.raises(PipelineInvalid) as caught:
            check_unique(load_pipeline(mine), folders)
        assert caught.value.problems == (line,)
    declare(dags, "churn.yaml", dag_id="churn", model_name="churn")
    check_unique(load_pipeline(demo), folders)


def test_a_dag_id_or_asset_in_any_subfolder_or_in_nightshift_pipelines_clashes(
        folder: Path, dags: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    team = dags / "team"
    (team / "suites").mkdir(parents=True)
    (team / "suites" / "cancer.json").write_text(json.dumps(SUITE))
    other = declare(team, "cancer.yaml", model_name="cancer-v2")  # the same dag_id, cancer_retrain
    mine = declare(folder, "cancer.yaml")
    (dags / "values.yaml").write_text("replicas: 2\n")  # YAML that is no declaration
    (dags / "broken.yaml").write_text("dag_id: [\n")  # a declaration that does not parse: its own DAG's problem
    with pytest.raises(PipelineInvalid, match=f"dag_id: 'cancer_retrain' is also the dag_id of {team.resolve()}/"):
        check_unique(load_pipeline(mine), declaration_folders(dags))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("NIGHTSHIFT_PIPELINES", str(elsewhere))
    assert declaration_folders(dags) == [dags.resolve(), elsewhere.resolve()]
    other.unlink()
    (elsewhere / "suites").mkdir()
    (elsewhere / "suites" / "cancer.json").write_text(json.dumps(SUITE))
    asset = declare(elsewhere, "b.yaml", dag_id="b", model_name="b", dataset={"asset": "cancer_retrain"})
    with pytest.raises(PipelineInvalid, match=f"dataset.asset: 'cancer_retrain' is also the dataset.asset of "
                                              f"{asset.resolve()}"):
        check_unique(load_pipeline(declare(dags, "a.yaml")), declaration_folders(dags))


def test_cli_check_compares_with_the_dag_folder_it_is_given(folder: Path, dags: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    mine = declare(folder, "cancer.yaml")
    theirs = declare(dags, "other.yaml", dag_id="other", model_name="cancer")
    assert main(["pipeline", "check", "--no-data", str(mine), "--dags-folder", str(dags)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["compared_with"] == [str(dags.resolve()), str(folder.resolve())]
    assert out["problems"] == [f"{mine}: model_name: 'cancer' is also the model_name of {theirs.resolve()}; give "
                               f"each pipeline its own model_name"]


def test_a_dag_bundles_own_checkout_of_the_declarations_is_no_clash(folder: Path, dags: Path, tmp_path: Path) -> None:
    """A GitDagBundle parses its own checkout of the repository while [core] dags_folder still names the working
    copy (scripts/airflow.sh with NIGHTSHIFT_DAG_BUNDLE=git): the bundle's copy of a declaration clashed with the
    working copy's, and every DAG the bundle serves failed to import. A declaration outside the DAG folder's tree
    is compared with the declarations beside it only."""
    declare(folder, "cancer.yaml")
    bundle = tmp_path / "dag-bundles" / "nightshift" / "versions" / "0123abc"
    shutil.copytree(folder, bundle / "pipelines")
    copy = load_pipeline(bundle / "pipelines" / "cancer.yaml")
    check_unique(copy, declaration_folders(dags))
    declare(bundle / "pipelines", "twin.yaml", dag_id="twin")  # beside it, the same model name: still a clash
    with pytest.raises(PipelineInvalid, match=r"model_name: 'cancer' is also the model_name of .*twin\.yaml"):
        check_unique(copy, declaration_folders(dags))


def test_yaml_in_the_dag_folder_that_cannot_name_the_pipelines_values_is_not_parsed(
        folder: Path, dags: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every declared DAG file reads every YAML file of the DAG folder at each parse: a dbt project's schema.yml of
    0.5 MB cost 5.5 s of parsing per DAG file, 500 declarations 2.9 s. Only a file holding one of the values (or an
    escape that could spell one) is parsed."""
    from nightshift.pipelines import load as load_module

    mine = load_pipeline(declare(folder, "cancer.yaml"))
    (dags / "dbt").mkdir()
    (dags / "dbt" / "schema.yml").write_text(yaml.safe_dump({"version": 2, "models": [{"name": f"m{i}"}
                                                                                      for i in range(50)]}))
    (dags / "churn.yaml").write_text("dag_id: churn\nmodel_name: churn\n")
    (dags / "escaped.yaml").write_text('dag_id: esc\nmodel_name: "canc\\x65r"\n')  # "cancer", spelled with an escape
    parsed: list[str] = []
    real = load_module.parse_yaml

    def spy(text: str, source: str) -> dict[str, Any]:
        parsed.append(Path(source).name)
        return real(text, source)

    monkeypatch.setattr(load_module, "parse_yaml", spy)
    with pytest.raises(PipelineInvalid, match=r"model_name: 'cancer' is also the model_name of .*escaped\.yaml"):
        check_unique(mine, declaration_folders(dags))
    assert parsed == ["escaped.yaml"]


def test_a_symlink_loop_in_the_dag_folder_breaks_no_dag(folder: Path, dags: Path) -> None:
    """`a.yml -> b.yml -> a.yml` anywhere in the DAG folder raised RuntimeError (Symlink loop) out of every declared
    DAG file's clash check: every such DAG failed to import, with a traceback naming no declaration."""
    mine = load_pipeline(declare(folder, "cancer.yaml"))
    (dags / "a.yml").symlink_to("b.yml")
    (dags / "b.yml").symlink_to("a.yml")
    check_unique(mine, declaration_folders(dags))


def test_a_fifo_in_the_dag_folder_is_never_read(folder: Path, dags: Path) -> None:
    """Only regular files are read: a FIFO named *.yaml blocked the parse of every declared DAG file (and a link
    to /dev/zero read forever). Here a writer waits on the FIFO with a clashing declaration: reading it would
    report the clash."""
    mine = load_pipeline(declare(folder, "cancer.yaml"))
    fifo = dags / "pipe.yaml"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "w") as out:
            out.write("dag_id: other\nmodel_name: cancer\n")

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        check_unique(mine, declaration_folders(dags))
    finally:
        release = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets the writer through when nothing read it
        writer.join(timeout=30)
        os.close(release)


# ---- pipeline explain --------------------------------------------------------------------------------------------

def test_explain_shows_each_gate_key_and_where_it_came_from(folder: Path, cancer: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = pipelines_tests._gate_only(folder, "binary", {"primary": "accuracy"})  # every other gate key left out
    declared = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**declared, "deploy": {"require_approval": True}}))
    assert main(["pipeline", "explain", str(path)]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    values = {key: (entry["value"], entry["from"]) for key, entry in result["gate"].items()}
    assert values == {"primary": ("accuracy", "declaration"), "min_improvement": (0.001, "task default"),
                      "floor": (0.8, "task default"), "guards": ({"f1": 0.01, "log_loss": 0.05}, "task default"),
                      "positive_class": ("1", "task default")}
    assert result["require_approval"] == {"value": True, "from": "declaration",
                                          "meaning": "a person approves each promotion before it is deployed"}
    assert "second of the label's sorted values: '1' of 0, 1" in result["gate"]["positive_class"]["meaning"]
    assert any(rule.startswith("a tie never promotes") for rule in result["rules"])
    lines = captured.err.splitlines()
    assert lines[0] == (f"cancer_retrain ({path}): a binary pipeline; the gate that promotes a new cancer over "
                        f"@champion:")
    assert any(line.split()[:3] == ["guards", "f1", "0.01,"] and "(task default)" in line for line in lines)


def test_explain_of_a_declared_gate_and_no_guards(folder: Path) -> None:
    from nightshift.pipelines.explain import explain

    result = explain(declare(folder, gate={"guards": {}, "positive_class": 0}), data=False)
    assert result["gate"]["guards"] == {"value": {}, "from": "declaration", "meaning": "no guard (declared `guards: "
                                                                                      "{}`)"}
    assert result["gate"]["positive_class"]["value"] == "0" and result["gate"]["floor"]["value"] == 0.9
    assert result["require_approval"]["from"] == "default"
    with pytest.raises(PipelineInvalid):
        explain(declare(folder, gate={"primary": "rmse"}))


def test_explain_of_an_invalid_declaration_names_every_problem(folder: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The first problem alone asked for a floor for rmse, when rmse is no metric of a binary task at all."""
    path = declare(folder, gate={"primary": "rmse", "floor": None})
    path.write_text(path.read_text().replace("  floor: null\n", ""))
    assert main(["pipeline", "explain", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: gate.primary: metric 'rmse' does not fit a binary task" in err
    assert len(err.splitlines()) == len(problems_of(path)) >= 2
