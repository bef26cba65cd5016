"""`nightshift suite init`: a first GX expectation suite drawn from a known-good sample, for a person to review.

The suite must pass tomorrow's data when it comes from the same distribution as the sample, and refuse data
that is broken. So it judges the distribution, not the sample's extremes: every bound is the sample's own
statistic widened by how much that statistic varies between samples of the size that will be validated (a
bootstrap of the sample), plus an allowance for gradual drift, which the pipeline retrains on rather than
refuses. The suite has the format of the project's own (gx/expectations/*.json): one expectation per rule,
rules over many columns as one wide expectation (nightshift.data.expectations), each with `meta.rule` naming
the rule in words. From the sample it takes:

- schema: the columns, exactly, and each one's type;
- nulls: a column with none may have none; a column with some may have up to its null share plus NULL_SLACK
  (or four standard errors, when larger) — `mostly` is the non-null share it must keep;
- range: numeric columns finite and within the sample's extremes widened by (1.5 + 20/sqrt(n)) times the
  sample's range on each side (never below 0 for a column with no negative value, integers rounded
  outward), at least OUTLIER_MOSTLY of the values, and never fewer than OUTLIER_COUNT values, outside (a
  few new extremes are what a fresh sample brings: one in a file of 60 rows is already 1.7%);
- distribution: each numeric column's 5/25/50/75/95% quantiles and its standard deviation within their
  bootstrap spread at the size of the smallest split (Z standard errors, at least the bootstrap's own
  extremes), widened by DRIFT_ALLOWANCE of the column's 5-95% spread (the standard deviation by a factor of
  at least SPREAD_FACTOR down and SPREAD_HIGH up). A column stuck at one value, or whose units changed, fails here.
  Drift of a stated size: a quantile may also move by DRIFT_SD (a third) of the column's standard deviation in the
  file validated, so a column shifted as a whole by less than a third of its own standard deviation is judged as if
  it had not moved, whatever its shape. A share of the 5-95% range is not that: it is a third of a normal column's
  standard deviation but an eighth of a lognormal's (sigma 1.5: a quarter-sd shift moves its 5% quantile from 0.08
  to ~2.3, twice the range's allowance of 1.2), and little for a pixel 90% zeros whose 5-75% quantiles are all 0 (a
  quarter-sd shift turns every zero into 0.5-1.2). The file's standard deviation, not the sample's: a heavy tail's
  standard deviation is its tail's, and a 60-180-row file of a lognormal column has more than 4/3 of its 300-row
  sample's one time in five (up to 2.9 times; bench_suite's heavy-tailed table, 200 nights), so a third of the
  sample's still refused 7% of quarter-sd shifts of its files (the range's tenth: 25%). It is taken at most the
  upper bound of the column's spread rule, so a file cannot widen its own allowance beyond the spread that rule
  accepts (units x1000 fail on spread, range and quantiles), and a column stuck at one value has no spread and so no
  allowance. Larger moves are still refused (bench/bench_suite.py's tables): half a standard deviation on 97% of
  digits' files and columns and on most lognormal ones, two on all but digits' near-empty pixels (97% zeros, whose
  5-95% range is 0 and whose allowance is then a tenth of the sample's whole range).
  A discrete column (at most DISCRETE_VALUES distinct values in the sample: a code, a count, a flag; every
  boolean column but the label, which has no other distribution rule) has no
  quantile rule: its quantiles jump from one value to the next as the shares move, so a quantile range drawn from
  the sample's values refuses a small change of shares. Its distribution is the share of each of its values
  instead, each within SHARE_Z standard errors between samples (the smallest split's and the sample's, a share
  smoothed by one count each way so that a rare value's error is not zero) plus DRIFT_SHARE_SD of that share's own
  standard deviation sqrt(p(1 - p)) for drift: the quantile rule's drift allowance, 10% of the 5-95% range, is a
  third of a normal column's standard deviation. For a two-valued column whose values split 50/50 that is 16.7
  points plus sampling error: a change of shares that moves its mean by a quarter of its standard deviation (12.5
  points) passes, on any file size. Values the sample never held may be NEW_VALUES_SHARE of a file, or their
  Good-Turing share (that of the values the sample holds once) plus SHARE_Z standard errors when more: a count's
  tail brings values its sample missed (digits' pixel counts: up to 3.9% of a 180-row file), while a flag
  re-coded, or whose units changed, holds nothing but new values and fails here, as on its standard deviation.
  A value gone from a file that expects it PRESENT_COUNT times by its sample share fails too (a drift allowance
  of a third of a share's standard deviation is the whole share for a value of 10% or less: a flag 90% one value
  stuck at it, or a code merged into another, would pass on its shares);
  The standard deviation's upper bound is at least half the width of the column's allowed range (values the
  range rule allows never fail on their spread: a near-empty column whose sample holds one rare value would
  refuse a file holding two). A column dominated by one value (MODE_SHARE of the sample or more) has no lower
  bound on its standard deviation: such a column stuck at its common value cannot be told from a sparse one;
- the label, by task (`--task`; inferred when not given: an integer, boolean or string column of at most
  MAX_LABEL_VALUES values is a class label, anything else a quantity): a classification label's set of
  classes, every one of them in every file when the rarest is expected MIN_CLASS_COUNT times or more in the
  smallest file the row-count rule allows (then its absence has a probability under 1%; otherwise at least
  two classes, and every class a file expects PRESENT_COUNT times by its own size), and each class's share at
  least its sampling lower bound; a
  regression target only a range and a distribution like any numeric column, never a set of values;
- duplicates: the share of a file's rows that repeat another grows with the file for a table with natural
  duplicates (few discrete values): a file of m rows drawn from a distribution whose rows are equal with
  probability c (two random rows alike) expects at most (m - 1) * c of its rows to repeat another. So the rule
  bounds that share at DUPLICATE_SLACK plus (m - 1) times c's upper bound, drawn from the sample's own equal row
  pairs k of its n(n - 1)/2 (k + SHARE_Z * sqrt(k) of them), and tolerates OUTLIER_COUNT duplicated rows in any
  file. A table without duplicates (continuous features) gets DUPLICATE_SLACK whatever the size. A table whose
  natural duplicates would let the smallest split pass repeated DUPLICATE_REPEAT times gets no duplicate rule: no
  share can tell its repeated rows from its natural ones;
- row count: every file is validated by the same suite, so one range covers every split: from ROW_COUNT_LOW
  of the smallest split to ROW_COUNT_HIGH times the largest; a sample of one file (e.g. train.parquet alone)
  stands for the largest split, its statistics are drawn for a smallest split of SMALLEST_SPLIT_SHARE of it,
  and its row count's floor is MIN_ROWS rows or MIN_ROWS_SHARE of it, whichever is more (a 90/5/5 split's
  validation file passes; a truncated or empty one does not).
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
from nightshift.tasks import BINARY, MULTICLASS, REGRESSION, TASKS

NULL_SLACK = 0.05
MAX_LABEL_VALUES = 50
ROW_COUNT_LOW, ROW_COUNT_HIGH = 0.5, 10
SMALLEST_SPLIT_SHARE = 1 / 8   # a split the sample lacks: an 80/10/10 split's validation is 1/8 of train
OUTLIER_MOSTLY = 0.99
OUTLIER_COUNT = 2              # values a file may have outside the range however small it is (with mostly < 1)
MODE_SHARE = 0.95              # a column this dominated by one value gets no lower bound on its spread
MIN_CLASS_COUNT = 6            # expected count of the rarest class above which every class must be present
PRESENT_COUNT = 9              # a class a file expects this often by its own size must be in it (absent: e^-9)
DUPLICATE_REPEAT = 5           # a table whose smallest split repeated this often is not refused: no duplicate rule
DISCRETE_VALUES = 10           # a numeric column with at most this many distinct values is judged by its shares
DRIFT_SHARE_SD = 1 / 3         # a discrete value's share may drift by this much of its own standard deviation
NEW_VALUES_SHARE = 0.10        # a discrete column's values never seen in the sample may be this share of a file
MIN_ROWS, MIN_ROWS_SHARE = 10, 0.01  # row-count floor of a one-file sample
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
BOOTSTRAP = 400                # resamples of the sample, seeded: the same sample draws the same suite
BOOTSTRAP_ROWS = 2_000         # resamples larger than this are not drawn; their spread is scaled from it
Z = 6.0                        # standard errors a statistic may move: ~300 checks a night stay under 1% false
SHARE_Z = 4.5
DRIFT_ALLOWANCE = 0.10
DRIFT_SD = 1 / 3               # a continuous column's quantiles may drift by this much of the file's standard deviation
SPREAD_FACTOR = 1.5
SPREAD_HIGH = 4.0
RANGE_WIDEN = 1.5
DUPLICATE_SLACK = 0.05
SEED = 0


def _expectation(kind: str, rule: str, **kwargs: Any) -> dict[str, Any]:
    return {"type": kind, "kwargs": kwargs, "meta": {"rule": rule}, "severity": "critical"}


def _number(value: float, integer: bool) -> float | int:
    return int(value) if integer else float(value)


def _round_out(low: float, high: float) -> tuple[float, float]:
    """`low` and `high` to 6 significant digits, never moved inwards."""
    return min(float(f"{low:.6g}"), low), max(float(f"{high:.6g}"), high)


def _finite(values: pd.Series) -> np.ndarray | None:
    """The column's values as float64 without nulls, or None when it holds no value or an infinity."""
    numbers = pd.to_numeric(values.dropna(), errors="coerce").dropna().to_numpy(np.float64)
    if numbers.size == 0 or not np.isfinite(numbers).all():
        return None
    return numbers


def value_range(values: pd.Series, integer: bool) -> tuple[float | int, float | int] | None:
    """The allowed range of a numeric column from its finite sample values (see the module's rules), or None
    when it has no finite value or holds an infinity (then no range is checked)."""
    numbers = _finite(values)
    if numbers is None:
        return None
    smallest, largest = float(numbers.min()), float(numbers.max())
    spread = largest - smallest
    widen = RANGE_WIDEN + 20.0 / math.sqrt(numbers.size)
    margin = widen * spread if spread > 0 else (0.1 * abs(smallest) or 1.0)
    low, high = _round_out(smallest - margin, largest + margin)
    if smallest >= 0:
        low = max(low, 0.0)
    if integer:
        low, high = math.floor(low), math.ceil(high)
    return _number(low, integer), _number(high, integer)


def _resample_size(sample: int, validated: float) -> tuple[int, float]:
    """(rows per bootstrap resample, the factor that scales its spread) for a statistic compared between a
    sample of `sample` rows and a file of `validated` rows: both vary, so the effective size is smaller."""
    effective = 1.0 / (1.0 / max(validated, 1.0) + 1.0 / sample)
    rows = max(2, min(BOOTSTRAP_ROWS, round(effective)))
    return rows, math.sqrt(rows / effective)


def distribution_bounds(values: np.ndarray, validated: float, rng: np.random.Generator,
                        allowed_width: float = 0.0) -> tuple[list[list[float]], list[float]] | None:
    """([low, high] of each of QUANTILES, [low, high] of the standard deviation) a file of `validated` rows
    from the distribution of `values` keeps (see the module's rules); None for a constant column.
    `allowed_width` is the width of the column's allowed range: the standard deviation may reach half of it."""
    if values.size < 2 or values.min() == values.max():
        return None
    rows, scale = _resample_size(values.size, validated)
    resamples = values[rng.integers(0, values.size, size=(BOOTSTRAP, rows))]
    quantiles = np.quantile(resamples, QUANTILES, axis=1).T           # (BOOTSTRAP, quantiles)
    observed = np.quantile(values, QUANTILES)
    error = quantiles.std(axis=0) * scale
    width = float(observed[-1] - observed[0]) or float(values.max() - values.min())
    allowance = DRIFT_ALLOWANCE * width
    low = np.minimum(observed - Z * error, quantiles.min(axis=0)) - allowance
    high = np.maximum(observed + Z * error, quantiles.max(axis=0)) + allowance
    ranges = [list(_round_out(float(lo), float(hi))) for lo, hi in zip(low, high, strict=True)]

    stdev = float(values.std(ddof=1))
    spreads = resamples.std(axis=1, ddof=1)
    stretch = math.log(SPREAD_FACTOR)
    if (spreads > 0).all():
        stretch = max(stretch, Z * float(np.log(spreads).std()) * scale)
        low_stdev = min(stdev * math.exp(-stretch), float(spreads.min()))
    else:
        low_stdev = 0.0  # resamples with a single value: a column this sparse may be constant in a small file
    _, counts = np.unique(values, return_counts=True)
    if counts.max() >= MODE_SHARE * values.size:
        low_stdev = 0.0  # dominated by one value: stuck at it and sparse look the same
    # upwards at least SPREAD_HIGH: one outlier of a heavy tail in a small file inflates it that much; and at
    # least half the allowed range, which values the range rule lets through can reach
    high_stdev = max(stdev * max(math.exp(stretch), SPREAD_HIGH), float(spreads.max()), allowed_width / 2)
    return ranges, list(_round_out(low_stdev, high_stdev))


def share_bounds(values: np.ndarray, validated: float, integer: bool) -> tuple[list[list[float | int]], float]:
    """([value, low, high, sample share] of each distinct value, the largest share of values never seen) that a file of
    `validated` values from the distribution of the discrete column `values` keeps (see the module's rules)."""
    distinct, counts = np.unique(values, return_counts=True)
    size = values.size
    effective = 1.0 / (1.0 / max(validated, 1.0) + 1.0 / size)

    def error(count: float) -> float:  # a share's standard error, smoothed by one count each way
        smoothed = (count + 1.0) / (size + 2.0)
        return SHARE_Z * math.sqrt(smoothed * (1.0 - smoothed) / effective)

    found: list[list[float | int]] = []
    for value, count in zip(distinct, counts, strict=True):
        share = count / size
        slack = error(float(count)) + DRIFT_SHARE_SD * math.sqrt(share * (1.0 - share))
        low, high = max(0.0, share - slack), min(1.0, share + slack)
        found.append([_number(value, integer), math.floor(low * 10_000) / 10_000, math.ceil(high * 10_000) / 10_000,
                      math.floor(share * 10_000) / 10_000])
    # values never seen: Good-Turing's estimate of their share (the values seen once), plus its error
    singletons = float((counts == 1).sum())
    unseen = min(1.0, max((singletons + 1.0) / (size + 2.0) + error(singletons), NEW_VALUES_SHARE))
    return found, math.ceil(unseen * 10_000) / 10_000


def _is_numeric(series: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(series.dtype) and not pd.api.types.is_bool_dtype(series.dtype)


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def _shown(named: list[str]) -> str:
    return ", ".join(named) if len(named) <= 4 else f"{named[0]}..{named[-1]} ({len(named)} columns)"


def _check_frames(frames: list[tuple[str, pd.DataFrame]], label: str) -> list[str]:
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
    return columns


def label_task(values: pd.Series, label: str, task: str | None) -> str:
    """The task the label serves: `task` when given (checked against the values), else inferred."""
    if task is not None and task not in TASKS:
        raise UsageError(f"unknown task {task!r}; pass --task as one of {', '.join(TASKS)}")
    distinct = values.dropna().nunique()
    if task == REGRESSION:
        if not _is_numeric(values):
            raise DataError(f"label column {label!r} is {values.dtype}, not numeric: a regression target must be "
                            f"a number")
        return task
    if task is not None:
        if distinct > MAX_LABEL_VALUES:
            raise DataError(f"label column {label!r} holds {distinct} distinct values: too many classes for a "
                            f"{task} task (at most {MAX_LABEL_VALUES}); pass --task regression for a quantity")
        return task
    dtype = values.dtype
    discrete = (pd.api.types.is_integer_dtype(dtype) or pd.api.types.is_bool_dtype(dtype)
                or pd.api.types.is_string_dtype(dtype) or isinstance(dtype, pd.CategoricalDtype))
    if discrete and distinct <= MAX_LABEL_VALUES:
        return BINARY if distinct <= 2 else MULTICLASS
    if not _is_numeric(values):
        raise DataError(f"label column {label!r} holds {distinct} distinct {dtype} values; a suite can only "
                        f"check a set of at most {MAX_LABEL_VALUES} labels or a numeric range")
    return REGRESSION


def build_suite(frames: list[tuple[str, pd.DataFrame]], label: str, name: str, *,
                task: str | None = None) -> dict[str, Any]:
    """The suite (as its JSON object) for tables like `frames` ((file name, table) pairs of one sample);
    `task` (binary, multiclass, regression) says what the label is, inferred from it when None."""
    columns = _check_frames(frames, label)
    table = pd.concat([frame for _, frame in frames], ignore_index=True)
    rows = [len(frame) for _, frame in frames]
    task = label_task(table[label], label, task)
    # Every file is validated by the same suite: the smallest split is what a statistic must hold for.
    smallest = min(rows) if len(frames) > 1 else max(1, math.floor(rows[0] * SMALLEST_SPLIT_SHARE))
    rng = np.random.default_rng(SEED)
    expectations = [
        _expectation("expect_table_columns_to_match_set", f"schema: exactly the {len(columns)} columns of the "
                     f"sample", column_set=columns),
        _expectation("expect_table_column_types_to_be", "schema: each column keeps the sample's type",
                     column_types={c: str(table[c].dtype) for c in columns}),
        *_null_expectations(table, columns, smallest),
        *_range_expectations(table, [c for c in columns if c != label]),
    ]
    numeric = [c for c in columns if _is_numeric(table[c]) and (c != label or task == REGRESSION)]
    quantiles: dict[str, list[list[float]]] = {}
    stdevs: dict[str, list[float]] = {}
    shares: dict[str, list[list[float | int]]] = {}
    new_values: dict[str, float] = {}
    for column in numeric:
        values = _finite(table[column])
        if values is None:
            continue
        validated = smallest * values.size / len(table)  # a file's non-null values
        integer = pd.api.types.is_integer_dtype(table[column].dtype)
        allowed = value_range(table[column], integer)
        width = float(allowed[1] - allowed[0]) if allowed is not None else 0.0
        bounds = distribution_bounds(values, validated, rng, width)
        if bounds is None:
            continue
        stdevs[column] = bounds[1]
        if np.unique(values).size <= DISCRETE_VALUES:
            shares[column], new_values[column] = share_bounds(values, validated, integer)
        else:
            quantiles[column] = bounds[0]
    for column in (c for c in columns if c != label and pd.api.types.is_bool_dtype(table[c].dtype)):
        values = table[column].dropna().to_numpy(np.float64)  # a flag the loader trains on: False 0, True 1
        if values.size:
            shares[column], new_values[column] = share_bounds(values, smallest * values.size / len(table), True)
    if quantiles:
        expectations.append(_expectation(
            "expect_columns_quantiles_to_be_between",
            f"distribution: the 5/25/50/75/95% quantiles of {_shown(list(quantiles))} within their spread "
            f"between samples of {math.floor(smallest):,} rows, plus {DRIFT_ALLOWANCE:.0%} of the 5-95% range "
            f"and {DRIFT_SD:.2g} of the file's standard deviation (at most the spread rule's bound) for drift",
            quantiles=list(QUANTILES), column_ranges=quantiles, drift_stdev=round(DRIFT_SD, 6),
            stdev_caps={column: stdevs[column][1] for column in quantiles}))
    if shares:
        half = DRIFT_SHARE_SD * 0.5
        expectations.append(_expectation(
            "expect_columns_value_shares_to_be_between",
            f"distribution of discrete columns: the share of each value of {_shown(list(shares))} (at most "
            f"{DISCRETE_VALUES} distinct values) within its spread between samples of {math.floor(smallest):,} "
            f"rows, plus {DRIFT_SHARE_SD:.2g} of its own standard deviation for drift (±{100 * half:.1f} points for a "
            f"value of half the rows); values the sample never held up to {NEW_VALUES_SHARE:.0%}", column_shares=shares,
            new_values=new_values, present_count=PRESENT_COUNT))
    if stdevs:
        expectations.append(_expectation(
            "expect_columns_stdev_to_be_between",
            f"spread: the standard deviation of {_shown(list(stdevs))} within its spread between samples, at "
            f"least /{SPREAD_FACTOR:g}..x{SPREAD_FACTOR:g} and up to half the allowed range (not stuck at one "
            f"value, units unchanged; no lower bound for a column {MODE_SHARE:.0%} one value)",
            column_ranges=stdevs))
    if len(frames) > 1:
        low_rows = max(1, math.floor(smallest * ROW_COUNT_LOW))
    else:  # a real small split (90/5/5) is 1/18 of train or less; a truncated or empty file is still refused
        low_rows = max(1, min(MIN_ROWS, math.floor(rows[0] * ROW_COUNT_LOW)),
                       math.floor(rows[0] * MIN_ROWS_SHARE))
    high_rows = math.ceil(max(rows) * ROW_COUNT_HIGH)
    expectations.extend(_label_expectations(table[label], label, task, smallest, rng, low_rows))
    expectations.extend(_duplicate_expectation(table, columns, smallest))
    seen = f"the sample's files have {min(rows):,}..{max(rows):,}" if len(rows) > 1 else \
        f"one file of {rows[0]:,} rows, the smallest split at least {low_rows:,} rows"
    expectations.append(_expectation("expect_table_row_count_to_be_between",
                                     f"row count: every split within {low_rows:,}..{high_rows:,} ({seen})",
                                     min_value=low_rows, max_value=high_rows))
    try:
        version = metadata.version("great-expectations")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "name": name,
        "expectations": expectations,
        "meta": {"great_expectations_version": version, "nightshift": {"task": task, "label": label},
                 "notes": f"Drawn by `nightshift suite init` from a sample of {sum(rows):,} rows in "
                          f"{len(frames)} file(s) (label {label!r}, task {task}). Review every rule before "
                          f"relying on it."},
        "notes": None,
    }


def _null_expectations(table: pd.DataFrame, columns: list[str], smallest: float) -> list[dict[str, Any]]:
    null_share = {c: float(table[c].isna().mean()) for c in columns}
    never_null = [c for c in columns if null_share[c] == 0]
    found = []
    if never_null:
        found.append(_expectation("expect_columns_values_to_not_be_null", "nulls: no nulls or NaN (none in the "
                                  "sample)", column_list=never_null))
    for column in (c for c in columns if null_share[c] > 0):
        share = null_share[column]
        slack = max(NULL_SLACK, 4 * math.sqrt(share * (1 - share) / max(smallest, 1)))
        mostly = round(max(0.0, 1 - share - slack), 4)
        found.append(_expectation(
            "expect_column_values_to_not_be_null",
            f"nulls: {column} at most {1 - mostly:.0%} nulls (the sample has {share:.1%})",
            column=column, mostly=mostly))
    return found


def _range_expectations(table: pd.DataFrame, columns: list[str]) -> list[dict[str, Any]]:
    ranges: dict[tuple[float | int, float | int], list[str]] = {}
    for column in columns:
        if not _is_numeric(table[column]):
            continue
        bounds = value_range(table[column], pd.api.types.is_integer_dtype(table[column].dtype))
        if bounds is not None:
            ranges.setdefault(bounds, []).append(column)
    return [_expectation("expect_columns_values_to_be_finite_between",
                         f"range: {_shown(named)} finite and, but for {1 - OUTLIER_MOSTLY:.0%} of values (at "
                         f"least {OUTLIER_COUNT}), within {low}..{high} (the sample's extremes widened by its "
                         f"range)", column_list=named,
                         min_value=low, max_value=high, mostly=OUTLIER_MOSTLY)
            for (low, high), named in ranges.items()]


def _label_expectations(values: pd.Series, label: str, task: str, smallest: float,
                        rng: np.random.Generator, fewest_rows: int) -> list[dict[str, Any]]:
    """The label's rules; `smallest` is the split its statistics are drawn for, `fewest_rows` the fewest rows
    a file may have (the row-count rule's floor)."""
    if task == REGRESSION:
        bounds = value_range(values, pd.api.types.is_integer_dtype(values.dtype))
        if bounds is None:
            raise DataError(f"label column {label!r} has no finite values, or infinite ones; fix the sample")
        low, high = bounds
        return [_expectation("expect_columns_values_to_be_finite_between",
                             f"label: {label} (a regression target) finite and, but for "
                             f"{1 - OUTLIER_MOSTLY:.0%} of values (at least {OUTLIER_COUNT}), within {low}..{high}",
                             column_list=[label], min_value=low, max_value=high,
                             mostly=OUTLIER_MOSTLY)]
    counts = values.dropna().value_counts()
    value_set = sorted((_plain(v) for v in counts.index), key=lambda v: (str(type(v)), v))
    shown = ", ".join(map(str, value_set[:10])) + (", …" if len(value_set) > 10 else "")
    shares = counts / counts.sum()
    rarest = float(shares.min())
    # every class present when even the smallest allowed file expects MIN_CLASS_COUNT of the rarest (its
    # absence then has a probability under e^-6, 0.25%); else only that the label is not stuck at one class
    fewest_labels = fewest_rows * counts.sum() / len(values)
    every = rarest * fewest_labels >= MIN_CLASS_COUNT
    min_classes = len(value_set) if every else min(2, len(value_set))
    why = (f"the rarest expected {rarest * fewest_labels:.0f} times in a file of {fewest_rows:,} rows" if every
           else f"a {task} label")
    found = [
        _expectation("expect_column_values_to_be_in_set",
                     f"labels: one of the sample's {len(value_set)} classes ({shown})", column=label,
                     value_set=value_set),
        _expectation("expect_column_unique_value_count_to_be_between",
                     f"labels: at least {min_classes} distinct classes in every file ({why})", column=label,
                     min_value=min_classes, max_value=len(value_set)),
    ]
    if not every and len(value_set) > 1:  # then by the file's size: a larger file must hold every class it expects
        found.append(_expectation(
            "expect_column_classes_to_be_present",
            f"labels: every class a file expects at least {PRESENT_COUNT} times (its sample share times the "
            f"file's labels) is present", column=label,
            class_shares=[[_plain(v), math.floor(float(shares[v]) * 10_000) / 10_000] for v in counts.index],
            min_count=PRESENT_COUNT))
    rows = max(smallest * counts.sum() / len(values), 1.0)
    lower = rarest - SHARE_Z * math.sqrt(rarest * (1 - rarest) / rows) - DRIFT_ALLOWANCE * rarest
    if lower >= 0.005 and len(value_set) > 1:
        min_share = math.floor(lower * 1000) / 1000
        found.append(_expectation(
            "expect_column_value_shares_to_be_at_least",
            f"class balance: every class at least {min_share:.1%} of a file's labels (the rarest has "
            f"{rarest:.1%} of the sample)", column=label, value_set=value_set, min_share=min_share))
    return found


def _duplicate_expectation(table: pd.DataFrame, columns: list[str], smallest: float) -> list[dict[str, Any]]:
    """The duplicate-row rule for files like the sample `table` (see the module's rules), or none for a table
    whose natural duplicates would hide its smallest split repeated DUPLICATE_REPEAT times."""
    rows = len(table)
    groups = table.value_counts(dropna=False).to_numpy(np.float64) if rows > 1 else np.zeros(0)
    pairs = float((groups * (groups - 1) / 2).sum())
    rate = (pairs + SHARE_Z * math.sqrt(pairs)) / (rows * (rows - 1) / 2) if rows > 1 else 0.0
    rate = math.ceil(rate * 1e8) / 1e8
    repeated = DUPLICATE_REPEAT * max(math.floor(smallest), 1)
    if DUPLICATE_SLACK + (repeated - 1) * rate >= 1.0:
        return []
    grows = f" plus (rows - 1) x {rate:.3g} (its {pairs:.0f} equal pairs of rows)" if rate else ""
    return [_expectation("expect_compound_columns_to_be_unique_by_hash",
                         f"duplicates: at most {DUPLICATE_SLACK:.0%}{grows} of a file's rows repeat another, and "
                         f"{OUTLIER_COUNT} in any file (the sample's {rows:,} rows: "
                         f"{float(table.duplicated(keep=False).mean()):.1%})", column_list=columns,
                         mostly=round(1 - DUPLICATE_SLACK, 4), pair_rate=rate, tolerate=OUTLIER_COUNT)]


def describe(suite: dict[str, Any]) -> list[str]:
    """One line per expectation, for a person to review: its type and its rule."""
    return [f"{e['type']}: {e['meta']['rule']}" for e in suite["expectations"]]


def init_suite(data: str | Path, label: str, out: str | Path, *, force: bool = False,
               name: str | None = None, task: str | None = None, nulls: bool = True,
               loader: str = "the pipeline's") -> dict[str, Any]:
    """Draw a suite from the sample `data` (a Parquet file or a directory of them) and write it to `out`
    atomically; UsageError when `out` exists and `force` is not set. Returns what was written.

    `nulls` False: the pipeline's `loader` takes no missing value, so a sample holding any is a DataError naming
    its columns, never a suite that lets nulls through to a training that refuses them."""
    from nightshift.data.validate import parquet_files, read_table

    out = Path(out)
    if out.exists() and not force:
        raise UsageError(f"{out} exists; pass --force to replace it, or choose another --out")
    if not out.parent.is_dir():
        raise UsageError(f"the folder of {out} does not exist; create it first")
    frames = [(file.name, read_table(file)) for file in parquet_files(data)]
    if not nulls:
        # Only what such a loader reads: the label and numbers (tabular refuses any other column as a feature, so
        # a free-text column with gaps is left out of dataset.features, and its nulls harm no training).
        counts = pd.concat([frame[[column for column, kind in frame.dtypes.items() if column == label or
                                   pd.api.types.is_numeric_dtype(kind) or pd.api.types.is_bool_dtype(kind)]]
                            .isna().sum() for _, frame in frames], axis=1).sum(axis=1)
        named = [f"{column} ({int(n)} rows)" for column, n in counts.items() if n]
        if named:
            raise DataError(f"the sample has missing values in {', '.join(named[:8])}"
                            f"{', …' if len(named) > 8 else ''}, and the {loader} loader takes none: a suite drawn "
                            f"from it would let nulls through that training then refuses. Fill or drop them (in "
                            f"the sample and in the data the pipeline gets), or pass --loader with one that takes "
                            f"missing values")
    suite = build_suite(frames, label, name or out.stem, task=task)
    try:
        atomic_write_json(out, suite, overwrite=force)
    except FileExistsError as err:
        raise UsageError(f"{out} appeared while the suite was drawn; pass --force to replace it") from err
    return {"out": str(out), "suite": suite["name"], "rows": sum(len(f) for _, f in frames),
            "files": [file for file, _ in frames], "task": suite["meta"]["nightshift"]["task"],
            "expectations": describe(suite)}
