"""Datasets the trainer and evaluator load by name from a staged data directory.

A staged dataset is a directory holding one Parquet file per split: `train.parquet`,
`validation.parquet`, `test.parquet`. A dataset factory turns a split into tensors and says what
shape a model must accept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from nightshift.errors import DataError
from nightshift.plugins import Registry

SPLITS = ("train", "validation", "test")


@dataclass(frozen=True)
class Split:
    """One split as tensors, plus what a model needs to know about it."""

    features: torch.Tensor
    labels: torch.Tensor
    input_shape: tuple[int, ...]
    num_classes: int

    def __len__(self) -> int:
        return int(self.labels.shape[0])


DATASETS: Registry[Split] = Registry("dataset")
register_dataset = DATASETS.register


def split_path(data_dir: str | Path, split: str) -> Path:
    return Path(data_dir) / f"{split}.parquet"


def read_split_frame(data_dir: str | Path, split: str) -> pd.DataFrame:
    """Read one split's table, with errors that name the file and what to do."""
    path = split_path(data_dir, split)
    if not Path(data_dir).is_dir():
        raise DataError(f"data directory {data_dir} does not exist; run `nightshift stage` or "
                        f"`nightshift demo-data` to create it")
    if not path.is_file():
        raise DataError(f"{path} is missing: a staged dataset holds {', '.join(s + '.parquet' for s in SPLITS)}")
    try:
        frame = pd.read_parquet(path)
    except Exception as err:  # pyarrow raises several unrelated types for unreadable files
        raise DataError(f"{path} is not a readable Parquet file ({type(err).__name__}: {err})") from err
    if frame.empty:
        raise DataError(f"{path} has no rows")
    return frame


@register_dataset("digits")
def load_digits(data_dir: str | Path, split: str) -> Split:
    """The demo: `label` 0–9 and `pixel_0`…`pixel_63` in 0–16, scaled to 0–1 as 1×8×8 images."""
    frame = read_split_frame(data_dir, split)
    pixel_columns = [f"pixel_{i}" for i in range(64)]
    missing = [c for c in ["label", *pixel_columns] if c not in frame.columns]
    if missing:
        raise DataError(f"{split_path(data_dir, split)} lacks columns {missing[:5]}"
                        f"{'…' if len(missing) > 5 else ''}; is this the digits dataset?")
    features = torch.from_numpy(np.ascontiguousarray(frame[pixel_columns].to_numpy(np.float32) / 16.0))
    labels = torch.from_numpy(frame["label"].to_numpy(np.int64, copy=True))
    return Split(features=features, labels=labels, input_shape=(1, 8, 8), num_classes=10)


def load_split(name: str, data_dir: str | Path, split: str) -> Split:
    """Load `split` of the dataset registered as `name` from a staged directory."""
    return DATASETS.get(name)(data_dir, split)
