"""The demo dataset: scikit-learn's bundled handwritten digits as Parquet splits (no download)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from nightshift.datasets import SPLITS, split_path
from nightshift.errors import UsageError

DIGITS_ROWS = 1797
FRACTIONS = {"train": 0.7, "validation": 0.15, "test": 0.15}


def digits_frame(rows: int = DIGITS_ROWS, seed: int = 0) -> pd.DataFrame:
    """The digits table: `label` (int64) and `pixel_0`…`pixel_63` (float32, 0..16).

    Fewer rows than the 1,797 bundled images: a seeded sample. More: the images repeated with small
    seeded noise (clipped to 0..16), so the table stays free of duplicate rows.
    """
    from sklearn.datasets import load_digits

    if rows < 10:
        raise UsageError(f"--rows must be at least 10 (one per class), got {rows}")
    bunch = load_digits()
    pixels = bunch.data.astype(np.float32)
    labels = bunch.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    if rows <= len(labels):
        index = rng.permutation(len(labels))[:rows]
        pixels, labels = pixels[index], labels[index]
    else:
        index = rng.integers(0, len(labels), size=rows)
        index[: len(labels)] = np.arange(len(labels))
        noise = rng.normal(0.0, 0.5, size=(rows, pixels.shape[1])).astype(np.float32)
        noise[: len(labels)] = 0.0
        pixels = np.clip(pixels[index] + noise, 0.0, 16.0).astype(np.float32)
        labels = labels[index]
    frame = pd.DataFrame(pixels, columns=[f"pixel_{i}" for i in range(pixels.shape[1])])
    frame.insert(0, "label", labels)
    return frame


def split_frame(frame: pd.DataFrame, seed: int = 0) -> dict[str, pd.DataFrame]:
    """A seeded, label-stratified train/validation/test split."""
    from sklearn.model_selection import train_test_split

    rest_share = FRACTIONS["validation"] + FRACTIONS["test"]
    train, rest = train_test_split(frame, test_size=rest_share, random_state=seed, stratify=frame["label"])
    validation, test = train_test_split(
        rest, test_size=FRACTIONS["test"] / rest_share, random_state=seed, stratify=rest["label"]
    )
    return {"train": train, "validation": validation, "test": test}


def write_demo_dataset(out: str | Path, rows: int = DIGITS_ROWS, seed: int = 0) -> dict[str, int]:
    """Write the demo dataset's splits to `out/{train,validation,test}.parquet`; return rows per split."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    parts = split_frame(digits_frame(rows, seed), seed)
    for name in SPLITS:
        tmp = split_path(out, name).with_suffix(".parquet.tmp")
        parts[name].reset_index(drop=True).to_parquet(tmp, index=False)
        tmp.replace(split_path(out, name))
    return {name: len(parts[name]) for name in SPLITS}
