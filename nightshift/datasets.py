"""Datasets the trainer and evaluator load by name from a staged data directory.

A staged dataset is a directory holding one Parquet file per split: `train.parquet`,
`validation.parquet`, `test.parquet`. A dataset factory `(data_dir, split, *, task, **options)` turns a
split into tensors and says what shape a model must accept. Two are built in: `digits` (the demo) and
`tabular` (any table of numeric features and one label column, for a binary, multiclass or regression task).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from nightshift.errors import DataError, UsageError
from nightshift.plugins import Registry
from nightshift.tasks import BINARY, MULTICLASS, REGRESSION, check_task

# torch only where a split becomes tensors: the Airflow image has no torch, and its tasks read, validate and stage
# splits through this module (SPLITS, split_path, read_split_frame).
if TYPE_CHECKING:
    import torch

SPLITS = ("train", "validation", "test")


@dataclass(frozen=True)
class Split:
    """One split as tensors, plus what a model needs to know about it.

    `num_classes` is the number of outputs the model needs: the classes of a classification task, 1 for
    regression. `preprocessing` (JSON values) is what the model must carry to be served on the raw table: for
    `tabular`, the feature columns in order and their train-split statistics (see `load_tabular`).
    """

    features: torch.Tensor
    labels: torch.Tensor
    input_shape: tuple[int, ...]
    num_classes: int
    task: str = MULTICLASS
    preprocessing: dict[str, Any] | None = None

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
def load_digits(data_dir: str | Path, split: str, *, task: str = MULTICLASS) -> Split:
    """The demo: `label` 0–9 and `pixel_0`…`pixel_63` in 0–16, scaled to 0–1 as 1×8×8 images. It takes no option,
    and its signature says so: `nightshift pipeline check` reads it (a `**options` there passed any option that
    training then refused); `load_split` refuses one naming it."""
    import torch

    if task != MULTICLASS:
        raise UsageError(f"dataset 'digits' is a {MULTICLASS} task, not {task!r}")
    frame = read_split_frame(data_dir, split)
    pixel_columns = [f"pixel_{i}" for i in range(64)]
    missing = [c for c in ["label", *pixel_columns] if c not in frame.columns]
    if missing:
        raise DataError(f"{split_path(data_dir, split)} lacks columns {missing[:5]}"
                        f"{'…' if len(missing) > 5 else ''}; is this the digits dataset?")
    features = torch.from_numpy(np.ascontiguousarray(frame[pixel_columns].to_numpy(np.float32) / 16.0))
    labels = torch.from_numpy(frame["label"].to_numpy(np.int64, copy=True))
    return Split(features=features, labels=labels, input_shape=(1, 8, 8), num_classes=10)


def load_split(name: str, data_dir: str | Path, split: str, *, task: str = MULTICLASS,
               options: dict[str, Any] | None = None) -> Split:
    """Load `split` of the dataset registered as `name` from a staged directory, for `task`, with the
    dataset's `options` (keyword arguments of its factory). A factory written before tasks existed,
    `(data_dir, split)`, still loads a multiclass task without options."""
    check_task(task)
    factory = DATASETS.get(name)
    kwargs = dict(options or {})
    if task != MULTICLASS:
        kwargs["task"] = task
    try:
        loaded = factory(data_dir, split, **kwargs)
    except TypeError as err:
        if not kwargs or "unexpected keyword argument" not in str(err):
            raise
        raise UsageError(f"dataset {name!r} does not take {sorted(kwargs)} ({err})") from err
    if loaded.task != task:
        raise UsageError(f"dataset {name!r} loaded a {loaded.task} task, not the {task} task asked for")
    return loaded


# --- tabular -----------------------------------------------------------------------------------------

TABULAR_OPTIONS = ("label", "features")


@register_dataset("tabular")
def load_tabular(data_dir: str | Path, split: str, *, task: str = MULTICLASS, label: str = "label",
                 features: list[str] | None = None) -> Split:
    """A table: the `label` column is the target, the numeric `features` (default: every other column, in
    the train split's order) the input, standardised with the train split's mean and standard deviation.

    Classification (`binary`, `multiclass`): the classes are the train split's distinct labels, sorted; a
    label becomes its index among them (binary: exactly two; the second is the positive class). Regression:
    the target is standardised with the train split's mean and standard deviation too (the model predicts
    the standardised value; the served model turns it back). `preprocessing` records all of it, so that
    training, evaluation and serving see the same columns, order and scaling.
    """
    import torch

    check_task(task)
    prep = tabular_preprocessing(data_dir, task=task, label=label, features=features)
    frame = read_split_frame(data_dir, split)
    path = split_path(data_dir, split)
    values = _feature_matrix(frame, path, prep["features"], label)
    x = (values - np.asarray(prep["mean"])) / np.asarray(prep["std"])
    target = _label_column(frame, path, label)
    if task == REGRESSION:
        y = torch.from_numpy(((_numeric_target(target, path, label) - prep["target_mean"])
                              / prep["target_std"]).astype(np.float32))
        outputs = 1
    else:
        classes = np.asarray(prep["classes"], dtype=target.dtype)
        unseen = sorted({str(v) for v in pd.unique(target[~np.isin(target, classes)])})
        if unseen:
            raise DataError(f"{path}: label column {label!r} holds {unseen[:5]}, which the train split's labels "
                            f"({', '.join(map(str, prep['classes']))}) do not; a model cannot learn a class it "
                            f"never sees in training: re-split the data so train holds every class")
        y = torch.from_numpy(np.searchsorted(classes, target).astype(np.int64))
        outputs = len(classes)
    return Split(features=torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), labels=y,
                 input_shape=(len(prep["features"]),), num_classes=outputs, task=task, preprocessing=prep)


def tabular_preprocessing(data_dir: str | Path, *, task: str, label: str = "label",
                          features: list[str] | None = None) -> dict[str, Any]:
    """What a tabular model carries, from the train split: `task`, `label`, `features` (in order), their
    `mean`, `std` (0 taken as 1), `min` and `max`; `classes` (classification) or `target_mean` and
    `target_std` (regression). Plain JSON values."""
    if not isinstance(label, str) or not label:
        raise UsageError(f"dataset option label must be a column name, got {label!r}")
    if features is not None:
        if (not isinstance(features, list) or not features
                or not all(isinstance(c, str) and c for c in features)):
            raise UsageError(f"dataset option features must be a non-empty list of column names, got {features!r}")
        twice = sorted({c for c in features if features.count(c) > 1})
        if twice:
            raise UsageError(f"dataset option features names {twice} more than once")
        if label in features:
            raise UsageError(f"dataset option features names the label column {label!r}: a model would see "
                             f"its answer; leave it out")
    frame = read_split_frame(data_dir, "train")
    path = split_path(data_dir, "train")
    target = _label_column(frame, path, label)
    columns = list(features) if features is not None else [str(c) for c in frame.columns if c != label]
    if not columns:
        raise DataError(f"{path} has no feature columns besides the label {label!r}")
    values = _feature_matrix(frame, path, columns, label)
    std = values.std(axis=0)
    prep: dict[str, Any] = {
        "task": task, "label": label, "features": columns,
        "mean": values.mean(axis=0).tolist(), "std": np.where(std > 0, std, 1.0).tolist(),
        "min": values.min(axis=0).tolist(), "max": values.max(axis=0).tolist(),
    }
    if task == REGRESSION:
        y = _numeric_target(target, path, label)
        prep["target_mean"] = float(y.mean())
        prep["target_std"] = float(y.std()) or 1.0
        return prep
    classes = np.sort(pd.unique(target))
    if classes.dtype.kind == "f":
        classes = classes + 0.0  # -0.0 is the class 0.0 (as the labels are matched by value): named 0.0, not by
        #                          whichever of the two a file happens to hold first
    if task == BINARY and len(classes) != 2:
        raise DataError(f"{path}: a binary task needs exactly 2 classes in label column {label!r}, found "
                        f"{len(classes)} ({', '.join(map(str, classes[:10]))}); use task multiclass or regression")
    if len(classes) < 2:
        raise DataError(f"{path}: label column {label!r} holds one class only ({classes[0]}); a classifier "
                        f"needs at least two")
    prep["classes"] = classes.tolist()
    return prep


def _label_column(frame: pd.DataFrame, path: Path, label: str) -> np.ndarray:
    if label not in frame.columns:
        raise DataError(f"{path} has no label column {label!r} (columns: {', '.join(map(str, frame.columns[:8]))}"
                        f"{'…' if len(frame.columns) > 8 else ''}); set the dataset option label to the column "
                        f"holding the target")
    column = frame[label]
    if column.isna().any():
        raise DataError(f"{path}: label column {label!r} is empty in {int(column.isna().sum())} rows; drop or "
                        f"fill those rows before staging")
    return column.to_numpy()


def _numeric_target(target: np.ndarray, path: Path, label: str) -> np.ndarray:
    if not (np.issubdtype(target.dtype, np.number) or target.dtype == np.bool_):
        raise DataError(f"{path}: label column {label!r} is {target.dtype}, not numeric: a regression target "
                        f"must be a number (use task binary or multiclass for classes)")
    return target.astype(np.float64)


def _feature_matrix(frame: pd.DataFrame, path: Path, columns: list[str], label: str) -> np.ndarray:
    """The feature columns, in `columns` order, as float64; refuses missing, non-numeric and empty values."""
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise DataError(f"{path} lacks feature columns {missing[:5]}{'…' if len(missing) > 5 else ''}; every "
                        f"split needs the columns the model is trained on (or change the dataset option features)")
    for column in columns:
        dtype = frame[column].dtype
        if not (pd.api.types.is_numeric_dtype(dtype) or pd.api.types.is_bool_dtype(dtype)):
            raise DataError(f"{path}: feature column {column!r} is {dtype}, not numeric; encode it as numbers "
                            f"before staging, or leave it out with the dataset option features (a list of "
                            f"the columns to use; the label is {label!r})")
    values = frame[columns].to_numpy(np.float64)
    bad = ~np.isfinite(values)
    if bad.any():
        counts = bad.sum(axis=0)
        named = [f"{c} ({int(n)} rows)" for c, n in zip(columns, counts, strict=True) if n][:5]
        raise DataError(f"{path}: feature columns hold missing or infinite values: {', '.join(named)}; fill or "
                        f"drop them before staging")
    return values
