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
