"""The decision page of a real evaluation (issue 38 item 2): scikit-learn tables, MLPs trained here and logged to a
real MLflow store with their per-epoch metrics, a real @champion, `nightshift.evaluate.evaluate` end to end. The
page is logged to the training run and kept where the Airflow plugin serves it, and shows what the evaluation
computed: the confusion matrices' counts, the recall deltas, each feature's drift, the training curves, the
residuals."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from nightshift import decision_page, registry, tracking
from nightshift.datasets import load_split
from nightshift.evaluate import evaluate
from nightshift.models import build_model
from nightshift.train.artifacts import save_trained_model
from tests.tabular_data import diabetes, write_splits

pytestmark = pytest.mark.slow

HOSTILE = "<script>alert(1)</script>"
_keys = itertools.count()


def fit(data: Path, out: Path, *, task: str, label: str, epochs: int, run_key: str, seed: int = 0) -> str:
    """An MLP trained full-batch on `data`'s train split, its per-epoch metrics written as the trainer writes
    them (`metrics.jsonl`), logged as an MLflow run tagged `run_key`; its run id."""
    options: dict[str, Any] = {"label": label}
    torch.manual_seed(seed)
    train, validation = (load_split("tabular", data, split, task=task, options=options)
                         for split in ("train", "validation"))
    kwargs = {"input_shape": train.input_shape, "num_classes": train.num_classes, "hidden": 16}
    model = build_model("mlp", **kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if task == "regression":
            return torch.nn.functional.mse_loss(output.reshape(-1), target)
        return torch.nn.functional.cross_entropy(output, target)

    lines = []
    for epoch in range(1, epochs + 1):
        model.train()
        opt.zero_grad()
        train_loss = loss(model(train.features), train.labels)
        train_loss.backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            output = model(validation.features)
            line = {"event": "epoch", "epoch": epoch, "step": epoch, "train_loss": float(train_loss),
                    "val_loss": float(loss(output, validation.labels))}
            if task != "regression":
                line["val_accuracy"] = float((output.argmax(1) == validation.labels).float().mean())
        lines.append(line)
    key = f"k{next(_keys)}"
    save_trained_model(out, model, model_name="mlp", model_kwargs=kwargs, dataset="tabular",
                       params={"epochs": epochs, "dataset_options": options}, train_key=key, task=task,
                       preprocessing=train.preprocessing)
    (out / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (out / "metrics.json").write_text(json.dumps({"epochs": epochs}))
    return tracking.log_training_run(out, experiment="tables", tags={"nightshift.run_key": run_key})


def crown(run_id: str, model_name: str) -> str:
    version = registry.register(run_id, model_name=model_name)["version"]
    registry.set_alias(model_name, "champion", str(version))
    return str(version)


def artifact(run_id: str, tmp_path: Path) -> str:
    local = tracking.client().download_artifacts(run_id, "evaluation/decision.html", str(tmp_path))
    return Path(local).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def wine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three cultivars; one feature renamed to a script tag (a column name is data, and must be escaped)."""
    from sklearn.datasets import load_wine

    frame = load_wine(as_frame=True).frame.rename(columns={"target": "cultivar", "proline": HOSTILE})
    return write_splits(frame, tmp_path_factory.mktemp("wine"))


def test_the_page_of_a_night_with_a_champion(wine: Path, tmp_path: Path) -> None:
    version = crown(fit(wine, tmp_path / "champion", task="multiclass", label="cultivar", epochs=3,
                        run_key="wine_retrain/manual__1"), "wine")
    challenger = fit(wine, tmp_path / "challenger", task="multiclass", label="cultivar", epochs=40, seed=1,
                     run_key="wine_retrain/manual__2")
    result = evaluate(challenger, data_dir=wine, model_name="wine", label_column="cultivar",
                      gate={"task": "multiclass"})
    page = artifact(challenger, tmp_path / "download")
    where = decision_page.page_path("wine_retrain", challenger)
    assert result["decision_page"] == {"artifact": "evaluation/decision.html", "path": str(where)}
    assert where.read_text(encoding="utf-8") == page  # the plugin's copy is the run's artifact

    ours, theirs = result["challenger"], result["champion"]
    assert theirs is not None and theirs["version"] == version
    labels = ours["classes"]
    assert labels == ["0", "1", "2"]
    for i, j in itertools.product(range(3), range(3)):  # every cell of both matrices and of their difference
        assert f"<title>true {labels[i]}, predicted {labels[j]}: {ours['confusion_matrix'][i][j]}</title>" in page
        assert f"<title>true {labels[i]}, predicted {labels[j]}: {theirs['confusion_matrix'][i][j]}</title>" in page
        change = ours["confusion_matrix"][i][j] - theirs["confusion_matrix"][i][j]
        assert f"<title>true {labels[i]}, predicted {labels[j]}: {f'{change:+d}' if change else 0}</title>" in page
    for label in labels:
        delta = ours["per_class_recall"][label] - theirs["per_class_recall"][label]
        assert f"<title>{label} recall change: {delta:+.3f}</title>" in page

    # Every metric with the gate's verdict; the banner says the decision.
    rows = {r["metric"]: r for r in decision_page.metric_rows(result)}
    assert rows["accuracy"]["verdict"] == ("pass" if ours["accuracy"] - theirs["accuracy"] >= 0.001 else "fail")
    assert ("Passed the gate" in page) == result["passed"]

    # Drift: the KS distance of each feature between the train and the test split, the worst drawn.
    train, test = (pd.read_parquet(wine / f"{split}.parquet") for split in ("train", "test"))
    from scipy.stats import ks_2samp

    distances = {c: ks_2samp(train[c], test[c]).statistic for c in train.columns if c != "cultivar"}
    worst = min(distances, key=lambda c: (-distances[c], c))
    assert f"worst: {svg_text(worst)}" in page
    assert f"<title>{svg_text(HOSTILE)} KS distance: {distances[HOSTILE]:.3f}</title>" in page
    assert "<script" not in page.lower()

    # The training curves: the challenger's 40 epochs and the champion's 3, dashed.
    history = tracking.client().get_metric_history(challenger, "val_accuracy")
    last = max(history, key=lambda m: m.step)
    assert f"<title>val_accuracy: 40, {last.value:.6g}</title>" in page
    assert "<title>val_loss (champion): 3, " in page


def test_a_first_model_by_hand_is_logged_to_its_run_only(wine: Path, tmp_path: Path) -> None:
    """No champion, and a run no pipeline trained (its run key names no DAG): the page is in MLflow only."""
    run_id = fit(wine, tmp_path / "first", task="multiclass", label="cultivar", epochs=5, run_key="by-hand")
    result = evaluate(run_id, data_dir=wine, model_name="wine-first", label_column="cultivar",
                      gate={"task": "multiclass", "floor": 0.0})
    assert result["decision_page"]["path"] is None
    assert not (decision_page.page_path("by-hand", run_id)).exists()
    page = artifact(run_id, tmp_path)
    assert "no champion to compare with" in page and "meets the floor" in page and "Passed the gate" in page


def test_regression_residuals_are_kept_and_drawn(tmp_path: Path) -> None:
    data = diabetes(tmp_path / "diabetes")
    crown(fit(data, tmp_path / "champion", task="regression", label="progression", epochs=5,
              run_key="diabetes_retrain/r1"), "diabetes")
    challenger = fit(data, tmp_path / "challenger", task="regression", label="progression", epochs=60,
                     run_key="diabetes_retrain/r2")
    result = evaluate(challenger, data_dir=data, model_name="diabetes", label_column="progression",
                      gate={"task": "regression"})
    rows = len(pd.read_parquet(data / "test.parquet"))
    for scores in (result["challenger"], result["champion"]):
        residuals = np.asarray(scores["residuals"]["residual"])
        assert len(residuals) == rows < decision_page.RESIDUAL_POINTS  # every row of a small split
        assert math.sqrt(float((residuals ** 2).mean())) == pytest.approx(scores["rmse"])
    page = Path(result["decision_page"]["path"]).read_text(encoding="utf-8")
    assert f"challenger: residuals (rmse {result['challenger']['rmse']:.4f})" in page
    assert page.count("<circle") >= 2 * rows  # a point per row and model
    assert "confusion matrix" not in page
    evaluation = json.loads(Path(tracking.client().download_artifacts(
        challenger, "evaluation/evaluation.json", str(tmp_path))).read_text())
    assert evaluation["challenger"]["residuals"] == result["challenger"]["residuals"]


def svg_text(value: str) -> str:
    from nightshift.svg import text

    return text(value)


def test_a_champion_whose_training_run_is_gone_never_fails_the_night(wine: Path, tmp_path: Path) -> None:
    """The champion's training run removed for good (`mlflow gc`), its registered model still serving and scored:
    the page says its curves are gone; evaluate decides as before (it failed every night: no challenger could
    ever win, so the champion, and the failure, stayed)."""
    import subprocess
    import sys

    champion_run = fit(wine, tmp_path / "champion", task="multiclass", label="cultivar", epochs=3,
                       run_key="wine_gone/manual__1")
    version = crown(champion_run, "wine-gone")
    tracking.client().delete_run(champion_run)
    uri = tracking.tracking_uri()
    gc = subprocess.run([str(Path(sys.executable).parent / "mlflow"), "gc", "--backend-store-uri", uri,
                         "--tracking-uri", uri, "--run-ids", champion_run], capture_output=True, text=True, timeout=300)
    assert gc.returncode == 0, gc.stderr[-2000:]
    challenger = fit(wine, tmp_path / "challenger", task="multiclass", label="cultivar", epochs=20, seed=1,
                     run_key="wine_gone/manual__2")
    result = evaluate(challenger, data_dir=wine, model_name="wine-gone", label_column="cultivar",
                      gate={"task": "multiclass"})
    assert result["champion"] is not None and result["champion"]["version"] == version
    page = Path(result["decision_page"]["path"]).read_text(encoding="utf-8")
    assert f"the champion&#x27;s training run {champion_run} cannot be read (RESOURCE_DOES_NOT_EXIST)" in page
    assert "<title>val_loss: 20, " in page and "(champion)" not in page


def test_drift_is_shown_for_the_features_the_model_reads_only(tmp_path: Path) -> None:
    """A pipeline declaring its `features` beside a column it never reads (a row id, a load time: in a table split
    by time, wholly apart between train and test): the page's drift is the model's features', not that column's
    (it was drawn as the night's worst drifted feature)."""
    from sklearn.datasets import load_wine

    from tests.tabular_data import train

    frame = load_wine(as_frame=True).frame.rename(columns={"target": "cultivar"})
    data = write_splits(frame, tmp_path / "wine")
    for split, loaded in (("train", 0.0), ("validation", 1.0), ("test", 2.0)):
        table = pd.read_parquet(data / f"{split}.parquet")
        table["loaded_at"] = loaded
        table.to_parquet(data / f"{split}.parquet")
    features = [c for c in frame.columns if c != "cultivar"]
    run_id = train(data, tmp_path / "run", task="multiclass", label="cultivar", features=features, epochs=5)
    tracking.client().set_tag(run_id, "nightshift.run_key", "wine_features/manual__1")
    result = evaluate(run_id, data_dir=data, model_name="wine-features", label_column="cultivar",
                      gate={"task": "multiclass"})
    page = Path(result["decision_page"]["path"]).read_text(encoding="utf-8")
    assert "loaded_at" not in page
    assert f"of {len(features)} features</text>" in page
    assert result["challenger"]["drift"]["features"] == features
