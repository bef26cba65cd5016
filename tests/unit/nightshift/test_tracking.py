from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from mlflow.exceptions import MlflowException

from nightshift import registry, tracking
from nightshift.errors import ChallengerRejected, TrackingError
from nightshift.tracking import TorchTableClassifier, log_training_run
from tests.trained_model import write_trained_output


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, demo_data: Path) -> Path:
    return write_trained_output(tmp_path_factory.mktemp("trained"), demo_data, epochs=3)


@pytest.fixture
def logged(trained: Path, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / "out"
    out.mkdir()
    for name in ("model.pt", "model.json", "metrics.json", "metrics.jsonl"):
        (out / name).write_bytes((trained / name).read_bytes())
    run_id = log_training_run(out, experiment="unit", run_name="r",
                              tags={"nightshift.run_key": "dag/run/train"})
    return {"out": out, "run_id": run_id}


def test_run_holds_params_epoch_metrics_and_a_servable_model(logged: dict[str, Any], demo_data: Path) -> None:
    import mlflow.pyfunc

    client = tracking.client()
    run = client.get_run(logged["run_id"])
    assert run.data.params["model"] == "digits_cnn" and run.data.params["lr"] == "0.003"
    history = client.get_metric_history(logged["run_id"], "val_accuracy")
    assert [m.step for m in history] == [1, 2, 3]
    assert "step" not in run.data.metrics and "epoch" not in run.data.metrics
    assert json.loads((logged["out"] / "mlflow_run.json").read_text())["run_id"] == logged["run_id"]
    model = mlflow.pyfunc.load_model(tracking.run_model_uri(logged["run_id"]))
    columns = model.metadata.get_input_schema().input_names()
    assert columns == [f"pixel_{i}" for i in range(64)]
    frame = pd.read_parquet(demo_data / "test.parquet")
    out = model.predict(frame.drop(columns=["label"]).head(50))
    assert (out["predicted_label"].to_numpy() == frame["label"].head(50).to_numpy()).mean() > 0.7


def test_logging_is_idempotent_by_run_key(logged: dict[str, Any]) -> None:
    again = log_training_run(logged["out"], experiment="unit", tags={"nightshift.run_key": "dag/run/train"})
    assert again == logged["run_id"]
    experiment = tracking.client().get_experiment_by_name("unit")
    assert len(tracking.client().search_runs([experiment.experiment_id])) == 1


def test_a_complete_run_trained_on_other_data_is_never_reused_under_the_same_run_key(
        logged: dict[str, Any], trained: Path) -> None:
    """Issue 20.1: a DAG run cleared after its data changed logs under the same run key; the first run's
    model must not come back. The old run stays (a model version may point at it) under a renamed key."""
    out = logged["out"]
    info = json.loads((out / "model.json").read_text())
    (out / "model.json").write_text(json.dumps({**info, "train_key": "0123456789abcdef"}))  # retrained on v2
    again = log_training_run(out, experiment="unit", tags={"nightshift.run_key": "dag/run/train"})
    assert again != logged["run_id"]
    client = tracking.client()
    old = client.get_run(logged["run_id"])
    assert old.data.tags["nightshift.run_key"] == f"dag/run/train#superseded-{logged['run_id']}"
    assert client.get_run(again).data.tags["nightshift.train_key"] == "0123456789abcdef"
    assert tracking.find_training_run("unit", "dag/run/train")["run_id"] == again
    # and logging the same retrained output once more (a retry of the task) reuses the new run
    assert log_training_run(out, experiment="unit", tags={"nightshift.run_key": "dag/run/train"}) == again


def test_the_training_run_is_found_on_the_server_by_its_run_key(logged: dict[str, Any]) -> None:
    for name in ("model.pt", "metrics.json", "mlflow_run.json"):  # nothing of the output dir is read
        (logged["out"] / name).unlink()
    found = tracking.find_training_run("unit", "dag/run/train")
    assert found["run_id"] == logged["run_id"]
    assert found["model_uri"] == tracking.run_model_uri(logged["run_id"])
    assert 0 < found["metrics"]["val_accuracy"] <= 1
    with pytest.raises(TrackingError, match=r"no complete run tagged nightshift\.run_key='dag/other/train'"):
        tracking.find_training_run("unit", "dag/other/train")
    with pytest.raises(TrackingError, match="no experiment 'missing'"):
        tracking.find_training_run("missing", "dag/run/train")


def test_register_twice_yields_one_version_with_lineage(logged: dict[str, Any]) -> None:
    first = registry.register(logged["run_id"], model_name="m", lineage={"dataset_version": "md5:1",
                                                                       "dag_id": "d", "dag_run_id": "r"})
    second = registry.register(logged["run_id"], model_name="m", lineage={"dataset_version": "md5:1"})
    assert (first["version"], first["created"]) == ("1", True)
    assert (second["version"], second["created"]) == ("1", False)
    assert [str(v.version) for v in tracking.client().search_model_versions("name = 'm'")] == ["1"]
    tags = registry.get_version("m", "1").tags
    assert tags["nightshift.dataset_version"] == "md5:1" and tags["nightshift.dag_run_id"] == "r"
    assert tags["param.lr"] == "0.003" and "metric.val_accuracy" in tags
    assert str(registry.version_by_alias("m", "challenger").version) == "1"


def test_rejected_evaluation_registers_nothing(logged: dict[str, Any]) -> None:
    with pytest.raises(ChallengerRejected, match="did not pass the gate: worse"):
        registry.register(logged["run_id"], model_name="m2",
                          evaluation={"passed": False, "reasons": ["worse"]})
    assert list(tracking.client().search_model_versions("name = 'm2'")) == []


def test_missing_training_output_is_named(tmp_path: Path) -> None:
    with pytest.raises(TrackingError, match=r"model\.json is missing"):
        log_training_run(tmp_path, experiment="unit")


@pytest.mark.parametrize("frame, message", [
    (pd.DataFrame({"pixel_0": [1.0]}), "missing columns"),
    (pd.DataFrame([[99.0] * 64], columns=[f"pixel_{i}" for i in range(64)]), "must lie in"),
    (pd.DataFrame([[1.0] * 64] * 5000, columns=[f"pixel_{i}" for i in range(64)]), "at most"),
    (pd.DataFrame(columns=[f"pixel_{i}" for i in range(64)]), "no rows"),
    (pd.DataFrame([[float("nan")] * 64], columns=[f"pixel_{i}" for i in range(64)]), "finite"),
])
def test_classifier_rejects_bad_input_as_400(trained: Path, frame: pd.DataFrame, message: str) -> None:
    with pytest.raises(MlflowException, match=message) as info:
        TorchTableClassifier(trained).predict(frame)
    assert info.value.get_http_status_code() == 400


# --- the served model: its own code, installable requirements, a light import chain ------------------

# What the served model's import chain must never pull in: the training and orchestration stacks.
FORBIDDEN_IN_SERVING = ("great_expectations", "dvc", "horovod", "sklearn", "airflow")


def _local_model(run_id: str) -> Path:
    import mlflow.artifacts

    return Path(mlflow.artifacts.download_artifacts(tracking.run_model_uri(run_id)))


def _run_python(code: str, cwd: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `code` in a fresh interpreter of this venv, away from the repository; its last line is JSON."""
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "NIGHTSHIFT_PLUGINS"}}
    result = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True,
                            timeout=120, env={**base, **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


_CHAIN_CHECK = """
import json, sys
import mlflow.pyfunc
import pandas as pd
model = mlflow.pyfunc.load_model(sys.argv[1])
columns = model.metadata.get_input_schema().input_names()
out = model.predict(pd.DataFrame([[3.0] * len(columns)] * 4, columns=columns))
import nightshift
print(json.dumps({"nightshift_file": nightshift.__file__, "rows": len(out),
                  "nightshift": sorted(m for m in sys.modules if m.split(".")[0] == "nightshift"),
                  "tops": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def test_logged_model_carries_its_code_and_installable_requirements(logged: dict[str, Any]) -> None:
    import yaml

    model_dir = _local_model(logged["run_id"])
    flavor = yaml.safe_load((model_dir / "MLmodel").read_text())["flavors"]["python_function"]
    assert flavor["code"] == "code"
    shipped = sorted(str(p.relative_to(model_dir / "code")) for p in (model_dir / "code").rglob("*.py"))
    packages = {"nightshift", "nightshift.train"}
    expected = sorted(m.replace(".", "/") + ("/__init__.py" if m in packages else ".py")
                      for m in tracking.SERVED_MODULES)
    assert shipped == expected
    requirements = (model_dir / "requirements.txt").read_text().split()
    assert {r.split("==")[0] for r in requirements} == set(tracking.SERVED_REQUIREMENTS)
    assert all("==" in r and "+" not in r for r in requirements), requirements  # public versions only
    assert "torch==2.13.0" in requirements
    served = json.loads((model_dir / "artifacts" / "model_dir" / "serving.json").read_text())
    assert served["plugins"] == [] and served["features"]["columns"][0] == "pixel_0"
    assert served["features"]["high"] == 16.0


def test_importing_the_served_module_pulls_no_training_or_orchestration_stack(tmp_path: Path) -> None:
    loaded = _run_python("import json, sys, nightshift.served_model\n"
                         "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))", tmp_path)
    assert not set(FORBIDDEN_IN_SERVING) & set(loaded), set(FORBIDDEN_IN_SERVING) & set(loaded)


def test_the_loaded_model_runs_on_its_own_code_and_imports_only_served_modules(logged: dict[str, Any],
                                                                               tmp_path: Path) -> None:
    model_dir = _local_model(logged["run_id"])
    seen = _run_python(_CHAIN_CHECK, tmp_path, str(model_dir))
    assert seen["rows"] == 4
    # MLflow puts the model's code first on sys.path: the package this process imported is the model's.
    assert Path(seen["nightshift_file"]).is_relative_to(model_dir / "code")
    assert set(seen["nightshift"]) <= set(tracking.SERVED_MODULES), (
        f"the served model imports {sorted(set(seen['nightshift']) - set(tracking.SERVED_MODULES))}, which do "
        f"not travel with it: add them to SERVED_MODULES or drop the import")
    assert not set(FORBIDDEN_IN_SERVING) & set(seen["tops"])


PLUGIN = '''
from torch import nn

from nightshift.models import register_model


@register_model("acme_tiny")
class AcmeTiny(nn.Module):
    def __init__(self, input_shape=(64,), num_classes=10):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))

    def forward(self, x):
        return self.net(x)
'''


def test_a_plugin_model_travels_with_its_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import torch

    plugins = tmp_path / "plugins"
    (plugins / "acme_nets").mkdir(parents=True)
    (plugins / "acme_nets" / "__init__.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(plugins))
    monkeypatch.setenv("NIGHTSHIFT_PLUGINS", "acme_nets")
    monkeypatch.delitem(sys.modules, "acme_nets", raising=False)
    out = tmp_path / "out"
    out.mkdir()
    torch.manual_seed(0)
    torch.save(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10)).state_dict(
        prefix="net."), out / "model.pt")
    (out / "model.json").write_text(json.dumps({
        "model": "acme_tiny", "model_kwargs": {"input_shape": [64], "num_classes": 10}, "dataset": "digits",
        "input_shape": [64], "num_classes": 10, "params": {}}))
    (out / "metrics.json").write_text(json.dumps({"val_accuracy": 0.1}))
    run_id = log_training_run(out, experiment="plugins")
    model_dir = _local_model(run_id)
    assert (model_dir / "code" / "acme_nets" / "__init__.py").read_text() == PLUGIN
    served = json.loads((model_dir / "artifacts" / "model_dir" / "serving.json").read_text())
    assert served["plugins"] == ["acme_nets"]
    # Elsewhere: neither NIGHTSHIFT_PLUGINS nor the plugin's folder, only what the model carries.
    seen = _run_python(_CHAIN_CHECK, tmp_path, str(model_dir))
    assert seen["rows"] == 4 and "acme_nets" in seen["tops"]


def test_an_installed_plugin_distribution_becomes_a_requirement() -> None:
    ship, requirements = tracking._plugin_requirements({"yaml", "nightshift", "torch", "my_local_nets"})
    assert ship == ["my_local_nets"]
    assert len(requirements) == 1 and requirements[0].startswith("PyYAML==")


def test_a_model_logged_before_the_split_still_loads(trained: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch, demo_data: Path) -> None:
    """Registered versions from before pickled `nightshift.tracking.NightshiftPyfunc` and carried no code."""
    import mlflow.pyfunc
    import yaml

    class OldNightshiftPyfunc(tracking.NightshiftPyfunc):
        pass

    OldNightshiftPyfunc.__module__, OldNightshiftPyfunc.__qualname__ = "nightshift.tracking", "NightshiftPyfunc"
    with monkeypatch.context() as patch:  # pickled by reference to where the class used to live
        patch.setattr(tracking, "NightshiftPyfunc", OldNightshiftPyfunc)
        mlflow.pyfunc.save_model(tmp_path / "old", python_model=OldNightshiftPyfunc(),
                                 artifacts={"model_dir": str(trained)},
                                 pip_requirements=["mlflow", "torch==2.13.0+cpu", "numpy", "pandas"])
    old = tmp_path / "old"
    assert b"nightshift.tracking" in (old / "python_model.pkl").read_bytes()
    assert yaml.safe_load((old / "MLmodel").read_text())["flavors"]["python_function"].get("code") is None
    assert not (old / "artifacts" / "model_dir" / "serving.json").exists()
    model = mlflow.pyfunc.load_model(str(old))
    assert type(model.unwrap_python_model()) is tracking.NightshiftPyfunc
    frame = pd.read_parquet(demo_data / "test.parquet")
    out = model.predict(frame.drop(columns=["label"]).head(50))
    assert (out["predicted_label"].to_numpy() == frame["label"].head(50).to_numpy()).mean() > 0.7


def test_a_local_tracking_store_can_keep_its_artifacts_on_an_object_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """What makes a version's artifact location one KServe can fetch, without a tracking server."""
    monkeypatch.setenv("NIGHTSHIFT_MLFLOW_ARTIFACTS", "s3://models-bucket/mlartifacts/")
    experiment_id = tracking.ensure_experiment("to-s3")
    assert tracking.client().get_experiment(experiment_id).artifact_location == "s3://models-bucket/mlartifacts/to-s3"


def test_mlflow_is_configured_once_per_process(monkeypatch: pytest.MonkeyPatch, nightshift_home: Path) -> None:
    import os

    import mlflow

    first = tracking.client()  # nothing configured it: the first use does, from the settings
    assert tracking.tracking_uri() == f"sqlite:///{nightshift_home / 'mlflow.db'}"
    assert mlflow.get_tracking_uri() == tracking.tracking_uri()
    assert "MLFLOW_TRACKING_URI" not in os.environ  # the default store is not made a setting children inherit
    pointed: list[str] = []
    monkeypatch.setattr(mlflow, "set_tracking_uri", pointed.append)
    assert tracking.client() is first and tracking.client() is first
    with pytest.raises(TrackingError, match="no experiment 'absent'"):
        tracking.find_training_run("absent", "k")
    assert pointed == []  # a library call never re-points MLflow
    other = f"sqlite:///{nightshift_home / 'other.db'}"
    assert tracking.configure(other) is tracking.client() and pointed == [other]


def test_two_processes_opening_a_new_sqlite_store_make_its_tables_one_after_the_other(nightshift_home: Path) -> None:
    """Two pipelines' first runs opened NIGHTSHIFT_HOME's new store at once and both ran MLflow's migrations:
    one failed ("Online migration expected to match one row"). A client is made under the store's lock."""
    import fcntl
    import sqlite3
    import threading

    store = nightshift_home / "shared.db"
    made: list[Any] = []
    with (nightshift_home / "shared.db.init-lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process making the store
        opener = threading.Thread(target=lambda: made.append(tracking.configure(f"sqlite:///{store}")))
        opener.start()
        opener.join(1.5)
        assert opener.is_alive() and not store.exists()  # waits; creates nothing meanwhile
        fcntl.flock(lock, fcntl.LOCK_UN)
    opener.join(60)
    assert made and made[0].search_experiments()
    tables = {row[0] for row in sqlite3.connect(store).execute("SELECT name FROM sqlite_master")}
    assert {"experiments", "runs", "registered_models"} <= tables


@pytest.mark.parametrize(("uri", "file"), [
    ("sqlite:////abs/m.db", "/abs/m.db"), ("sqlite+pysqlite:////abs/m.db", "/abs/m.db"),
    ("sqlite:////abs/m.db?timeout=30", "/abs/m.db"), ("sqlite:///rel.db", "rel.db"), ("sqlite://", None),
    ("sqlite:///:memory:", None), ("postgresql://u@h/db", None), ("http://mlflow:5000", None), ("sqlite:/x", None)])
def test_the_store_file_locked_is_the_one_sqlite_opens(uri: str, file: str | None) -> None:
    assert tracking._sqlite_file(uri) == (None if file is None else Path(file))


def test_a_store_whose_lock_cannot_be_had_is_still_opened(nightshift_home: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only folder holding a store to read, or another user's lock file: the client is made unlocked."""
    import io
    import os

    uri = f"sqlite:///{nightshift_home / 'ro.db'}"
    tracking.configure(uri).create_experiment("there")

    def refusing(real: Any) -> Any:
        def refuse(path: Any, *args: Any, **kwargs: Any) -> Any:
            if str(path).endswith(".init-lock"):
                raise OSError(30, "Read-only file system", str(path))
            return real(path, *args, **kwargs)
        return refuse

    monkeypatch.setattr(os, "open", refusing(os.open))
    monkeypatch.setattr(io, "open", refusing(io.open))
    assert tracking.configure(uri).get_experiment_by_name("there") is not None


def test_no_module_sets_environment_defaults_when_imported() -> None:
    import ast

    from tests.conftest import REPO

    offenders = []
    for folder in ("nightshift", "operators", "dags", "plugins", "config"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:  # module level only: a function may set one
                if "os.environ.setdefault" in ast.unparse(node) and not isinstance(
                        node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []
