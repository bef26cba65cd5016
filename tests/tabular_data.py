"""Test helper: scikit-learn's bundled tables (no download) as staged tabular datasets, split 60/20/20."""

from __future__ import annotations

from pathlib import Path

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
