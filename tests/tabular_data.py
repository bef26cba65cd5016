"""Test helper: scikit-learn's bundled tables (no download) as staged tabular datasets, split 60/20/20, and a small
MLP trained on one and logged to MLflow (`train`, `crown`)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd


def write_splits(frame: pd.DataFrame, out: Path, seed: int = 0) -> Path:
    """`train`, `validation` and `test.parquet` of a seeded shuffle of `frame` under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    order = np.random.default_rng(seed).permutation(len(frame))
    first, second = int(len(frame) * 0.6), int(len(frame) * 0.8)
    for split, rows in (("train", order[:first]), ("validation", order[first:second]), ("test", order[second:])):
        frame.iloc[rows].reset_index(drop=True).to_parquet(out / f"{split}.parquet")
    return out


def breast_cancer(out: Path) -> Path:
    """Binary: 30 numeric features (names with spaces), label column `diagnosis` (0 malignant, 1 benign)."""
    from sklearn.datasets import load_breast_cancer

    return write_splits(load_breast_cancer(as_frame=True).frame.rename(columns={"target": "diagnosis"}), out)


def diabetes(out: Path) -> Path:
    """Regression: 10 numeric features in their raw units, target column `progression` (about 25-346)."""
    from sklearn.datasets import load_diabetes

    return write_splits(load_diabetes(as_frame=True, scaled=False).frame.rename(columns={"target": "progression"}),
                        out)


_keys = itertools.count()


def train(data: Path, out: Path, *, task: str, label: str, features: list[str] | None = None,
          epochs: int = 150, seed: int = 0, experiment: str = "tables") -> str:
    """An MLP trained full-batch with Adam on `data`'s train split, logged as an MLflow run; its run id."""
    import torch

    from nightshift import tracking
    from nightshift.datasets import load_split
    from nightshift.models import build_model
    from nightshift.train.artifacts import save_trained_model

    options: dict[str, Any] = {"label": label, **({"features": features} if features else {})}
    torch.manual_seed(seed)
    split = load_split("tabular", data, "train", task=task, options=options)
    kwargs = {"input_shape": split.input_shape, "num_classes": split.num_classes, "hidden": 16}
    model = build_model("mlp", **kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(split.features), split.labels).backward()
        opt.step()
    model.eval()
    key = f"k{next(_keys)}"
    save_trained_model(out, model, model_name="mlp", model_kwargs=kwargs, dataset="tabular",
                       params={"epochs": epochs, "dataset_options": options}, train_key=key, task=task,
                       preprocessing=split.preprocessing)
    (out / "metrics.json").write_text(json.dumps({"epochs": epochs}))
    (out / "metrics.jsonl").write_text("")
    return tracking.log_training_run(out, experiment=experiment, tags={"nightshift.run_key": key})


def crown(run_id: str, model_name: str) -> str:
    """Register `run_id`'s model under `model_name` and make that version @champion; the version."""
    from nightshift import registry

    version = registry.register(run_id, model_name=model_name)["version"]
    registry.set_alias(model_name, "champion", str(version))
    return str(version)
