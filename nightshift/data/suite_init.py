"""`nightshift suite init`: a first GX expectation suite drawn from a known-good sample, for a person to review.

The suite has the format of the project's own (gx/expectations/*.json): one expectation per rule, the rules
over many columns as one wide expectation (nightshift.data.expectations), each with `meta.rule` saying it in
words. From the sample it takes:

- the columns, exactly, and each one's type;
- nulls: a column with none may have none; a column with some may have up to its observed null share plus
  NULL_SLACK (5 percentage points) — `mostly` is the non-null share it must keep;
- value ranges of numeric columns, widened by RANGE_MARGIN (10%) of the observed range on each side (10% of
  the value, or 1 for 0, when the column is constant), integer bounds rounded outward, and never below 0 for
  a column whose sample has no negative value; columns with the same bounds share one expectation;
- the label: its set of values when it is an integer, boolean or string column of at most MAX_LABEL_VALUES
  values, else its range like any numeric column;
- the row count of each file: from half the smallest file's rows to ten times the largest's.
"""

from __future__ import annotations

import math
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from nightshift.errors import DataError, UsageError
from nightshift.fsutil import atomic_write_json

RANGE_MARGIN = 0.10
NULL_SLACK = 0.05
MAX_LABEL_VALUES = 50
ROW_COUNT_LOW, ROW_COUNT_HIGH = 0.5, 10


def _expectation(kind: str, rule: str, **kwargs: Any) -> dict[str, Any]:
    return {"type": kind, "kwargs": kwargs, "meta": {"rule": rule}, "severity": "critical"}


def _number(value: float, integer: bool) -> float | int:
    return int(value) if integer else float(value)


def value_range(values: pd.Series, integer: bool) -> tuple[float | int, float | int] | None:
    """The allowed range of a numeric column from its finite sample values (see the module's rules), or None
    when it has no finite value or holds an infinity (then no range is checked)."""
    numbers = pd.to_numeric(values.dropna(), errors="coerce").dropna().to_numpy(np.float64)
    if numbers.size == 0 or not np.isfinite(numbers).all():
        return None
    smallest, largest = float(numbers.min()), float(numbers.max())
    spread = largest - smallest
    margin = RANGE_MARGIN * spread if spread > 0 else (RANGE_MARGIN * abs(smallest) or 1.0)
    low, high = float(f"{smallest - margin:.6g}"), float(f"{largest + margin:.6g}")
    low, high = min(low, smallest), max(high, largest)  # rounding never moves a bound inside the sample
    if smallest >= 0:
        low = max(low, 0.0)
    if integer:
        low, high = math.floor(low), math.ceil(high)
    return _number(low, integer), _number(high, integer)


def _is_numeric(series: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(series.dtype) and not pd.api.types.is_bool_dtype(series.dtype)


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def build_suite(frames: list[tuple[str, pd.DataFrame]], label: str, name: str) -> dict[str, Any]:
    """The suite (as its JSON object) for tables like `frames` ((file name, table) pairs of one sample)."""
    if not frames:
        raise DataError("no tables to draw a suite from")
    first_name, first = frames[0]
    columns = [str(c) for c in first.columns]
    types = {c: str(first[c].dtype) for c in columns}
    for file, frame in frames[1:]:
        if [str(c) for c in frame.columns] != columns:
            raise DataError(f"{file} has columns {list(frame.columns)[:8]}, {first_name} has {columns[:8]}: a "
                            f"sample's files must share their columns")
        other = {c: str(frame[c].dtype) for c in columns}
        if other != types:
            changed = [c for c in columns if other[c] != types[c]]
            raise DataError(f"{file} and {first_name} differ in the types of {changed[:8]}; a sample's files "
                            f"must agree")
    if label not in columns:
        raise UsageError(f"label column {label!r} is not in {first_name} (columns: {', '.join(columns[:8])}"
                         f"{'…' if len(columns) > 8 else ''}); pass --label with the target column")
    table = pd.concat([frame for _, frame in frames], ignore_index=True)
    rows = [len(frame) for _, frame in frames]
    expectations = [
        _expectation("expect_table_columns_to_match_set", f"schema: exactly the {len(columns)} columns of the "
                     f"sample", column_set=columns),
        _expectation("expect_table_column_types_to_be", "schema: each column keeps the sample's type",
                     column_types=types),
    ]
    null_share = {c: float(table[c].isna().mean()) for c in columns}
    never_null = [c for c in columns if null_share[c] == 0]
    if never_null:
        expectations.append(_expectation("expect_columns_values_to_not_be_null", "no nulls or NaN "
                                          "(none in the sample)", column_list=never_null))
    for column in (c for c in columns if null_share[c] > 0):
        mostly = round(max(0.0, 1 - null_share[column] - NULL_SLACK), 4)
        expectations.append(_expectation(
            "expect_column_values_to_not_be_null",
            f"{column}: at most {1 - mostly:.0%} nulls (the sample has {null_share[column]:.1%})",
            column=column, mostly=mostly))
    ranges: dict[tuple[float | int, float | int], list[str]] = {}
    for column in columns:
        if column == label or not _is_numeric(table[column]):
            continue
        bounds = value_range(table[column], pd.api.types.is_integer_dtype(table[column].dtype))
        if bounds is not None:
            ranges.setdefault(bounds, []).append(column)
    for (low, high), named in ranges.items():
        shown = ", ".join(named) if len(named) <= 4 else f"{named[0]}..{named[-1]} ({len(named)} columns)"
        expectations.append(_expectation("expect_columns_values_to_be_finite_between",
                                         f"{shown} finite and within {low}..{high} (the sample's range plus "
                                         f"{RANGE_MARGIN:.0%})", column_list=named, min_value=low, max_value=high))
    expectations.append(_label_expectation(table[label], label))
    low_rows = max(1, math.floor(min(rows) * ROW_COUNT_LOW))
    high_rows = math.ceil(max(rows) * ROW_COUNT_HIGH)
    expectations.append(_expectation("expect_table_row_count_to_be_between",
                                     f"row count within {low_rows:,}..{high_rows:,} (the sample's files have "
                                     f"{min(rows):,}..{max(rows):,})", min_value=low_rows, max_value=high_rows))
    try:
        version = metadata.version("great-expectations")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "name": name,
        "expectations": expectations,
        "meta": {"great_expectations_version": version,
                 "notes": f"Drawn by `nightshift suite init` from a sample of {sum(rows):,} rows in "
                          f"{len(frames)} file(s) (label {label!r}). Review every rule before relying on it."},
        "notes": None,
    }


def _label_expectation(values: pd.Series, label: str) -> dict[str, Any]:
    dtype = values.dtype
    distinct = pd.unique(values.dropna())
    discrete = (pd.api.types.is_integer_dtype(dtype) or pd.api.types.is_bool_dtype(dtype)
                or pd.api.types.is_string_dtype(dtype) or isinstance(dtype, pd.CategoricalDtype))
    if discrete and len(distinct) <= MAX_LABEL_VALUES:
        value_set = sorted((_plain(v) for v in distinct), key=lambda v: (str(type(v)), v))
        shown = ", ".join(map(str, value_set[:10])) + (", …" if len(value_set) > 10 else "")
        return _expectation("expect_column_values_to_be_in_set",
                            f"labels are one of the sample's {len(value_set)} values ({shown})", column=label,
                            value_set=value_set)
    if not _is_numeric(values):
        raise DataError(f"label column {label!r} holds {len(distinct)} distinct {dtype} values; a suite can only "
                        f"check a set of at most {MAX_LABEL_VALUES} labels or a numeric range")
    bounds = value_range(values, pd.api.types.is_integer_dtype(dtype))
    if bounds is None:
        raise DataError(f"label column {label!r} has no finite values, or infinite ones; fix the sample")
    low, high = bounds
    return _expectation("expect_columns_values_to_be_finite_between",
                        f"label {label} finite and within {low}..{high} (the sample's range plus "
                        f"{RANGE_MARGIN:.0%})", column_list=[label], min_value=low, max_value=high)


def describe(suite: dict[str, Any]) -> list[str]:
    """One line per expectation, for a person to review: its type and its rule."""
    return [f"{e['type']}: {e['meta']['rule']}" for e in suite["expectations"]]


def init_suite(data: str | Path, label: str, out: str | Path, *, force: bool = False,
               name: str | None = None) -> dict[str, Any]:
    """Draw a suite from the sample `data` (a Parquet file or a directory of them) and write it to `out`
    atomically; UsageError when `out` exists and `force` is not set. Returns what was written."""
    from nightshift.data.validate import parquet_files, read_table

    out = Path(out)
    if out.exists() and not force:
        raise UsageError(f"{out} exists; pass --force to replace it, or choose another --out")
    if not out.parent.is_dir():
        raise UsageError(f"the folder of {out} does not exist; create it first")
    frames = [(file.name, read_table(file)) for file in parquet_files(data)]
    suite = build_suite(frames, label, name or out.stem)
    try:
        atomic_write_json(out, suite, overwrite=force)
    except FileExistsError as err:
        raise UsageError(f"{out} appeared while the suite was drawn; pass --force to replace it") from err
    return {"out": str(out), "suite": suite["name"], "rows": sum(len(f) for _, f in frames),
            "files": [file for file, _ in frames], "expectations": describe(suite)}
