"""Issue 22 shown end to end: pipelines are declared, not forked.

A user repository in a temporary directory, outside this one, holds only what the README asks of a user: per
pipeline a declaration, a suite drawn by `nightshift suite init` (and reviewed here), and the stub DAG file. Its
data are scikit-learn's bundled tables (no download): breast cancer as a `binary` pipeline gated on accuracy,
diabetes as a `regression` pipeline gated on RMSE. Nightshift is installed from a wheel built from this checkout
into a virtualenv of its own (the project venv's dependencies, not its editable nightshift), and Airflow's DAG
folder is the user's. `airflow dags test` of each trains, gates, registers and deploys its own model; the served
model scores the test split as `evaluate` did; a worse regression model is refused and the champion stays. Bad
declarations give one line each, in `nightshift pipeline check` and as the stub's import error.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.airflow_helpers import (
    REPO,
    database_url,
    demo_module,
    postgres_answers,
    postgres_database,
    stop_model_server,
)
from tests.integration.wheel_helpers import build_wheel
from tests.tabular_data import breast_cancer, diabetes

pytestmark = pytest.mark.integration

STUB = '''# dags/{name}.py, beside dags/{name}.yaml: the Airflow DAG of that declaration
from nightly_tasks.factory import pipeline_dag
dag = pipeline_dag(__file__)
'''
# Few epochs, one worker, a small network: the test is about the wiring, not the models.
CANCER = {
    "dag_id": "cancer_retrain", "model_name": "cancer-classifier", "task": "binary",
    "dataset": {"loader": "tabular", "label": "diagnosis", "data": {"directory": "data/cancer"}},
    "model": {"name": "mlp", "kwargs": {"hidden": 16}},
    "gate": {"primary": "accuracy", "floor": 0.8},
    "suite": "suites/cancer.json",
    "training": {"epochs": 3, "workers": 1, "backend": "local"},
}
DIABETES = {
    "dag_id": "diabetes_retrain", "model_name": "diabetes-regressor", "task": "regression",
    "dataset": {"loader": "tabular", "label": "progression", "data": {"directory": "data/diabetes"}},
    "model": {"name": "mlp", "kwargs": {"hidden": 16}},
    "gate": {"primary": "rmse", "floor": 100.0},
    "suite": "suites/diabetes.json",
    "training": {"epochs": 5, "workers": 1, "backend": "local"},
}
PIPELINES = {"cancer": CANCER, "diabetes": DIABETES}
# ---- Nightshift from a wheel ------------------------------------------------------------------------------------

def wheel_venv(wheel: Path, venv: Path) -> Path:
    """A virtualenv holding `wheel` (installed --no-deps) whose other packages are the project venv's; returns
    its bin directory.

    The project venv's site-packages is added by a `.pth` path line, which, unlike a site directory, runs none
    of the `.pth` files in it: the editable finder of the checkout's nightshift is never installed. The project
    venv's console scripts (airflow, horovodrun, mlflow, uvicorn...) are copied with this venv's interpreter in
    their shebang, so no child falls back to the project venv's Python."""
    project_bin = Path(sys.executable).parent
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # Installed before the .pth exists, so pip sees no nightshift there already (the editable one's metadata).
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "--quiet", str(wheel)], check=True, capture_output=True, timeout=300)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "nightshift_project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    shebang = f"#!{project_bin / 'python'}\n"
    for script in sorted(project_bin.iterdir()):
        target = venv / "bin" / script.name
        if target.exists() or not script.is_file():
            continue
        try:
            text = script.read_text()
        except UnicodeDecodeError:  # a binary
            continue
        if text.startswith(shebang):
            target.write_text(f"#!{python}\n{text.removeprefix(shebang)}")
            target.chmod(0o755)
    return venv / "bin"


# ---- the user's repository and environment -----------------------------------------------------------------------

@dataclass
class UserRepo:
    root: Path
    dags: Path
    home: Path
    bin: Path
    env: dict[str, str]
    logs: Path
    first: dict[str, dict[str, Any]] = field(default_factory=dict)  # each pipeline's first run

    def run(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A command of the user's installation (its bin first), in the user's repository."""
        proc = subprocess.run([str(self.bin / args[0]), *args[1:]], env=self.env, cwd=self.root, text=True,
                              capture_output=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
        return proc

    def ledger(self, dag_id: str) -> list[dict[str, Any]]:
        path = self.home / "airflow" / dag_id / "runs.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    def dags_test(self, dag_id: str, conf: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
        """`airflow dags test DAG_ID -c CONF`: the run's ledger record (asserting it exited 0 and reported)."""
        before = len(self.ledger(dag_id))
        log_path = self.logs / f"{dag_id}-{len(list(self.logs.iterdir()))}.log"
        with log_path.open("w") as log:
            proc = subprocess.Popen([str(self.bin / "airflow"), "dags", "test", dag_id, "-c", json.dumps(conf)],
                                    env=self.env, cwd=self.root, stdout=log, stderr=subprocess.STDOUT)
            try:
                code = proc.wait(timeout=timeout)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        records = self.ledger(dag_id)[before:]
        if code != 0 or not records:  # the errors of every try (a train's are far above the log's tail)
            text = log_path.read_text(errors="replace")
            errors = [line[:400] for line in text.splitlines() if "Error" in line or "Exception" in line]
            raise AssertionError(f"airflow dags test {dag_id}: exit {code}; errors:\n" + "\n".join(errors[-40:])
                                 + f"\n... log {log_path}:\n{text[-2000:]}")
        return records[-1]


def write_declaration(folder: Path, name: str, declaration: dict[str, Any], stub: bool = True) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(declaration, sort_keys=False))
    if stub:
        (folder / f"{name}.py").write_text(STUB.format(name=name))
    return path


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UserRepo]:
    """The user's repository, data, installation and Airflow (its metadata in a PostgreSQL database of its own,
    as production's; SQLite, one run at a time, where PostgreSQL does not answer); both pipelines run once here."""
    with contextlib.ExitStack() as stack:
        database = stack.enter_context(postgres_database("nightshift_user")) if postgres_answers() else None
        yield from _user(tmp_path_factory, database)


def _user(tmp_path_factory: pytest.TempPathFactory, database: str | None) -> Iterator[UserRepo]:
    base = tmp_path_factory.mktemp("user-pipelines")
    assert not base.resolve().is_relative_to(REPO)
    bin_dir = wheel_venv(build_wheel(base / "wheel"), base / "venv")
    home, root = base / "nightshift-home", base / "user-repo"
    dags, logs = root / "dags", base / "logs"
    for folder in (dags / "suites", logs):
        folder.mkdir(parents=True)
    breast_cancer(home / "data" / "cancer")
    diabetes(home / "data" / "diabetes")
    env = demo_module().airflow_env(home, home / "airflow-home")
    env = {k: v for k, v in env.items() if k not in {"PYTHONPATH", "MLFLOW_TRACKING_URI"}}
    env.update({"PATH": os.pathsep.join([str(bin_dir), env["PATH"]]),
                "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
                "AIRFLOW__CORE__PLUGINS_FOLDER": str(root / "plugins"),
                "NIGHTSHIFT_RETRAIN_CRON": "none"})
    if database:
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = database_url(database)
    repo = UserRepo(root, dags, home, bin_dir, env, logs)
    for name, declaration in PIPELINES.items():
        repo.run("nightshift", "suite", "init", str(home / "data" / name), "--label",
                 declaration["dataset"]["label"], "--out", f"dags/suites/{name}.json")
        write_declaration(dags, name, declaration)
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True)
    repo.run("airflow", "db", "migrate")
    if database:  # the bundle row a dag-processor writes once; two first `dags test` would race to insert it
        repo.run("airflow", "dags", "reserialize")
    try:
        # Both pipelines' first runs at the same time, as two nightly schedules would (issue 22.5): each keeps its
        # own DVC version, checkpoints, experiment, registered model, champion and served model (port).
        with ThreadPoolExecutor(len(PIPELINES) if database else 1) as pool:
            runs = {name: pool.submit(repo.dags_test, declaration["dag_id"], {})
                    for name, declaration in PIPELINES.items()}
            repo.first = {name: run.result() for name, run in runs.items()}
        yield repo
    finally:  # every model server the deploys started, side by side
        with ThreadPoolExecutor() as pool:
            list(pool.map(lambda d: stop_model_server(env, d["model_name"], bin_dir=bin_dir), PIPELINES.values()))


def test_nightshift_runs_from_the_wheel_not_the_checkout(user: UserRepo) -> None:
    code = "import json, nightshift, nightly_tasks, operators; print(json.dumps([m.__file__ for m in " \
           "(nightshift, nightly_tasks, operators)]))"
    files = json.loads(user.run("python", "-c", code).stdout)
    venv = user.bin.parent.resolve()
    assert all(Path(f).resolve().is_relative_to(venv) for f in files), files
    assert not any(Path(f).resolve().is_relative_to(REPO) for f in files), files
    # the tasks hashed the installed sources for their code version: no git checkout behind them
    assert all(record["code_version"].startswith("src.") for record in user.first.values())


def test_suite_init_drew_a_suite_for_the_users_table(user: UserRepo) -> None:
    import pandas as pd

    for name, declaration in PIPELINES.items():
        suite = json.loads((user.dags / "suites" / f"{name}.json").read_text())
        frame = pd.read_parquet(user.home / "data" / name / "train.parquet")
        kinds = {e["type"]: e["kwargs"] for e in suite["expectations"]}
        assert set(kinds["expect_table_columns_to_match_set"]["column_set"]) == set(frame.columns)
        assert kinds["expect_table_column_types_to_be"]["column_types"] == {
            c: str(t) for c, t in frame.dtypes.items()}
        label = declaration["dataset"]["label"]
        if name == "cancer":  # a label of two integer values: its set
            assert label_rule(suite, label)["value_set"] == [0, 1]
        else:  # a numeric target: its range, holding every value seen
            rule = label_rule(suite, label)
            assert rule["min_value"] <= frame[label].min() and frame[label].max() <= rule["max_value"]
        assert all(e["meta"]["rule"] for e in suite["expectations"])


def label_rule(suite: dict[str, Any], label: str) -> dict[str, Any]:
    """The kwargs of the expectation about the label column alone."""
    (kwargs,) = [e["kwargs"] for e in suite["expectations"]
                 if e["type"] in ("expect_column_values_to_be_in_set", "expect_columns_values_to_be_finite_between")
                 and (e["kwargs"].get("column") == label or e["kwargs"].get("column_list") == [label])]
    return dict(kwargs)


def score(url: str, data: Path, label: str) -> tuple[list[float], list[float]]:
    """POST the test split (label dropped) to a model server's /invocations: (predictions, true labels)."""
    import pandas as pd
    import requests

    frame = pd.read_parquet(data / "test.parquet")
    truth = frame.pop(label)
    body = {"dataframe_split": {"columns": list(frame.columns), "data": frame.to_numpy().tolist()}}
    answer = requests.post(f"{url}/invocations", json=body, timeout=60)
    assert answer.status_code == 200, answer.text[:500]
    predictions = answer.json()["predictions"]
    key = "predicted_value" if "predicted_value" in predictions[0] else "predicted_label"
    return [float(p[key]) for p in predictions], truth.astype(float).tolist()


def mlflow_client(user: UserRepo) -> Any:
    from mlflow import MlflowClient

    uri = f"sqlite:///{user.home / 'mlflow.db'}"
    # registry_uri too: MLflow's process-wide registry URI, set by any earlier test of this worker that configured
    # MLflow (nightshift.tracking.configure), would otherwise answer for the registry (and find no version here)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def assert_own_model(user: UserRepo, declaration: dict[str, Any], record: dict[str, Any]) -> None:
    """The run trained, passed the gate, registered v1 of its own model in its own experiment and serves it."""
    assert record["status"] == "success", record
    assert record["gate"]["passed"] is True and record["gate"]["champion"] is None, record["gate"]
    assert record["model_name"] == declaration["model_name"]
    assert record["model_version"] == "1" and record["deploy_status"] == "promoted", record
    client = mlflow_client(user)
    run = client.get_run(record["mlflow_run_id"])
    assert client.get_experiment(run.info.experiment_id).name == declaration["dag_id"]
    assert run.data.params["model.hidden"] == "16"
    versions = client.search_model_versions(f"name = '{declaration['model_name']}'")
    assert [(str(v.version), v.run_id) for v in versions] == [("1", record["mlflow_run_id"])]
    assert str(client.get_model_version_by_alias(declaration["model_name"], "champion").version) == "1"


def test_the_binary_pipeline_deploys_a_model_that_serves_the_accuracy_evaluate_recorded(user: UserRepo) -> None:
    record = user.first["cancer"]
    assert_own_model(user, CANCER, record)
    predicted, truth = score(record["serving_url"], user.home / "data" / "cancer", "diagnosis")
    accuracy = sum(p == t for p, t in zip(predicted, truth, strict=True)) / len(truth)
    assert accuracy == pytest.approx(record["gate"]["challenger"]["accuracy"], abs=1e-12)
    assert accuracy >= 0.8


def test_the_regression_pipeline_deploys_a_model_that_serves_the_rmse_evaluate_recorded(user: UserRepo) -> None:
    record = user.first["diabetes"]
    assert_own_model(user, DIABETES, record)
    assert rmse_served(record["serving_url"], user) == pytest.approx(record["gate"]["challenger"]["rmse"], rel=1e-5)
    assert record["gate"]["challenger"]["rmse"] <= DIABETES["gate"]["floor"]


def rmse_served(url: str, user: UserRepo) -> float:
    predicted, truth = score(url, user.home / "data" / "diabetes", "progression")
    return float(sum((p - t) ** 2 for p, t in zip(predicted, truth, strict=True)) / len(truth)) ** 0.5


def test_a_worse_regression_model_is_refused_and_the_champion_keeps_serving(user: UserRepo) -> None:
    first = user.first["diabetes"]
    worse = user.dags_test("diabetes_retrain", {"epochs": 1, "learning_rate": 0.0001, "force": True})
    gate = worse["gate"]
    assert worse["status"] == "success" and worse["mlflow_run_id"] != first["mlflow_run_id"], worse
    assert gate["passed"] is False and worse["outcome"] == "not promoted (gate rejected)", gate
    assert gate["champion"]["version"] == "1"
    assert gate["challenger"]["rmse"] > gate["champion"]["rmse"]  # lower is better: higher is refused
    assert gate["reasons"][0].startswith("rmse ")
    assert worse["model_version"] is None and worse["serving_url"] is None
    client = mlflow_client(user)
    assert [str(v.version) for v in client.search_model_versions("name = 'diabetes-regressor'")] == ["1"]
    assert str(client.get_model_version_by_alias("diabetes-regressor", "champion").version) == "1"
    served = json.loads((user.home / "serving" / "diabetes-regressor.json").read_text())
    assert (served["version"], served["url"]) == ("1", first["serving_url"])
    assert rmse_served(first["serving_url"], user) == pytest.approx(first["gate"]["challenger"]["rmse"], rel=1e-5)
    # the other pipeline's model is untouched
    assert str(client.get_model_version_by_alias("cancer-classifier", "champion").version) == "1"


# ---- bad declarations -------------------------------------------------------------------------------------------

def bad_declarations(folder: Path, suites: Path) -> dict[str, tuple[Path, str]]:
    """Four declarations, each wrong in one way: {name: (file, the key its one line names)}."""
    shutil.copytree(suites, folder / "suites")
    unknown = {**CANCER, "dag_id": "bad_unknown_key", "model_name": "bad-1", "retries": 3}
    no_label = {**CANCER, "dag_id": "bad_label", "model_name": "bad-2",
                "dataset": {**CANCER["dataset"], "label": "outcome"}}
    metric = {**DIABETES, "dag_id": "bad_metric", "model_name": "bad-3",
              "gate": {"primary": "accuracy", "floor": 0.8}}
    suite = {**CANCER, "dag_id": "bad_suite", "model_name": "bad-4", "suite": "suites/diabetes.json"}
    return {name: (write_declaration(folder, name, declaration, stub=False), key) for name, declaration, key in (
        ("unknown_key", unknown, "retries"), ("missing_label", no_label, "dataset.label"),
        ("wrong_metric", metric, "gate.primary"), ("other_suite", suite, "suite"))}


def test_each_bad_declaration_gives_one_line_in_pipeline_check(user: UserRepo, tmp_path: Path) -> None:
    good = json.loads(user.run("nightshift", "pipeline", "check", str(user.dags)).stdout)
    compared = good.pop("compared_with")  # every folder whose declarations were checked for clashes
    assert good == {"valid": ["cancer_retrain", "diabetes_retrain"], "problems": []}
    assert str(user.dags.resolve()) in [str(Path(folder).resolve()) for folder in compared], compared
    bad = bad_declarations(tmp_path, user.dags / "suites")
    proc = user.run("nightshift", "pipeline", "check", *(str(path) for path, _ in bad.values()), check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == len(bad), lines
    for path, key in bad.values():
        (line,) = [line for line in lines if line.startswith(f"{path}: ")]
        assert line.startswith(f"{path}: {key}: "), line
    said = {name: next(line for line in lines if line.startswith(f"{path}: ")) for name, (path, _) in bad.items()}
    assert "unknown key" in said["unknown_key"]
    assert "'outcome' is not in" in said["missing_label"]
    assert "does not fit a regression task; use one of rmse, mae, r2" in said["wrong_metric"]
    assert "a suite for other columns?" in said["other_suite"]


DAGBAG = """
import json, nightly_tasks
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder={folder!r})
print(json.dumps({{"dags": sorted(bag.dag_ids), "errors": {{k: str(v) for k, v in bag.import_errors.items()}},
                  "factory": nightly_tasks.__file__}}))
"""


def test_a_bad_declaration_is_its_stubs_import_error_and_the_good_pipeline_still_loads(user: UserRepo,
                                                                                        tmp_path: Path) -> None:
    folder = tmp_path / "dags"
    folder.mkdir()
    bad = bad_declarations(folder, user.dags / "suites")
    path, _ = bad["unknown_key"]
    (folder / "unknown_key.py").write_text(STUB.format(name="unknown_key"))
    write_declaration(folder, "cancer", CANCER)
    out = json.loads(user.run("python", "-c", DAGBAG.format(folder=str(folder))).stdout.strip().splitlines()[-1])
    assert Path(out["factory"]).resolve().is_relative_to(user.bin.parent.resolve())
    assert out["dags"] == ["cancer_retrain"], out
    assert list(out["errors"]) == [str(folder / "unknown_key.py")], out["errors"]
    (error,) = out["errors"].values()
    assert error.startswith(f"PipelineInvalid: {path}: retries: unknown key; ") and "\n" not in error.strip()
