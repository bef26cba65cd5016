"""Custom Great Expectations expectations the project's suites need and GX 1.x does not ship in a wide form.

Importing this module registers them with GX (by their snake_case type name), so a suite JSON that
uses them loads with `ExpectationSuite(**json)`.

Why wide expectations: GX pays a fixed cost per expectation (pydantic configs, a metric graph, a result
object), so 64 copies of a column rule cost ~64x that overhead before any data is read. The rules that
apply to many columns are therefore one expectation each over a `column_list`, computed by one table
metric in vectorised numpy (a min/max reduction per column when the data is clean; the exact row mask
only for a column that fails). The duplicate-row rule hashes each row once
(`pandas.util.hash_pandas_object`) and compares values only among rows whose hashes collide.

A failure still names each column: these expectations return `result["details"]["columns"]`, a mapping
from every failing column to its own `unexpected_count`, `partial_unexpected_list` (sample values),
`partial_unexpected_index_list` (their rows) or `observed_value`; `nightshift.data.validate` reports one
failure per column from it.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

import numpy as np
import pandas as pd
from great_expectations.core.metric_domain_types import MetricDomainTypes
from great_expectations.execution_engine import PandasExecutionEngine
from great_expectations.expectations.expectation import BatchExpectation, ColumnAggregateExpectation
from great_expectations.expectations.metrics.metric_provider import metric_value
from great_expectations.expectations.metrics.table_metric_provider import TableMetricProvider

# Sample values kept per failing column by the metrics; the result format's `partial_unexpected_count`
# (default 20) trims them further.
MAX_SAMPLE = 20
DEFAULT_PARTIAL_COUNT = 20
LIBRARY_METADATA: dict[str, Any] = {"maturity": "experimental", "tags": ["nightshift"]}
# Values outside the range a column of any size may have when `mostly` < 1: (1 - mostly) of a small file is
# less than one value, and one new extreme of a heavy tail in a file of 60 rows is already 1.7% of it.
OUTSIDE_FLOOR = 2


class ExpectColumnValueSharesToBeAtLeast(ColumnAggregateExpectation):
    """Expect every value of `value_set` to make up at least `min_share` of the column's non-null values.

    Class balance for a labelled dataset: a value that is missing has share 0 and fails too.
    The observed value is the smallest share; `details` lists the values below `min_share`.
    """

    value_set: list[Any]
    min_share: float

    metric_dependencies = ("column.value_counts",)
    success_keys = ("value_set", "min_share")
    args_keys = ("column", "value_set", "min_share")
    library_metadata: ClassVar[dict[str, Any]] = LIBRARY_METADATA

    def _validate(
        self,
        metrics: dict[str, Any],
        runtime_configuration: dict[str, Any] | None = None,
        execution_engine: Any = None,
    ) -> dict[str, Any]:
        counts = metrics["column.value_counts"]
        total = int(counts.sum())
        shares = {
            value: (int(counts[value]) / total if total and value in counts.index else 0.0)
            for value in self.value_set
        }
        below = {str(value): round(share, 4) for value, share in shares.items() if share < self.min_share}
        return {
            "success": not below,
            "result": {
                "observed_value": round(min(shares.values()), 4) if shares else None,
                "details": {"below_min_share": below, "min_share": self.min_share},
            },
        }


class ExpectColumnClassesToBePresent(ColumnAggregateExpectation):
    """Expect every class of `class_shares` ([[class, share], ...]) that a file of this size expects at least
    `min_count` times (its share times the column's non-null values) to be present.

    A label's class set by the file's size: a class merged into another, or lost, is refused in a file large
    enough that its absence is improbable (exp(-min_count)), and not in a file too small to be sure of it.
    The observed value lists the missing classes with the count each was expected.
    """

    class_shares: list[list[Any]]
    min_count: float

    metric_dependencies = ("column.value_counts",)
    success_keys = ("class_shares", "min_count")
    args_keys = ("column", "class_shares", "min_count")
    library_metadata: ClassVar[dict[str, Any]] = LIBRARY_METADATA

    def _validate(
        self,
        metrics: dict[str, Any],
        runtime_configuration: dict[str, Any] | None = None,
        execution_engine: Any = None,
    ) -> dict[str, Any]:
        counts = metrics["column.value_counts"]
        total = int(counts.sum())
        missing = {str(value): round(share * total, 1) for value, share in self.class_shares
                   if share * total >= self.min_count and not (value in counts.index and int(counts[value]))}
        return {
            "success": not missing,
            "result": {
                "observed_value": f"classes missing (expected count): {missing}" if missing else "every class "
                                  "expected present",
                "details": {"missing": missing, "labels": total, "min_count": self.min_count},
            },
        }


# ---- metrics: one pass over the listed columns, reporting only the columns that fail ---------------------

def _table(execution_engine: PandasExecutionEngine, domain_kwargs: dict[str, Any]) -> pd.DataFrame:
    frame, _, _ = execution_engine.get_compute_domain(domain_kwargs, domain_type=MetricDomainTypes.TABLE)
    return frame


def _sample(frame: pd.DataFrame, values: Any, bad: np.ndarray) -> dict[str, Any]:
    """Count, sample values and their row labels for the rows where `bad` holds."""
    positions = np.flatnonzero(bad)
    head = positions[:MAX_SAMPLE]
    sample = [None if v is pd.NA else v for v in np.asarray(values)[head].tolist()]
    return {
        "unexpected_count": int(positions.size),
        "partial_unexpected_list": sample,
        "partial_unexpected_index_list": frame.index[head].tolist(),
    }


def _numeric(series: pd.Series) -> np.ndarray | None:
    """The column as a numpy array of numbers (nulls as NaN), or None when its dtype is not numeric."""
    if not pd.api.types.is_numeric_dtype(series.dtype) or pd.api.types.is_bool_dtype(series.dtype):
        return None
    if isinstance(series.dtype, np.dtype):
        return series.to_numpy()
    return series.to_numpy(dtype="float64", na_value=np.nan)  # nullable extension dtypes (Int64, Float32...)


class ColumnListNulls(TableMetricProvider):
    """For each column of `column_list` with null or NaN values: their count and a sample (rows, values)."""

    metric_name = "column_list.nulls"
    value_keys = ("column_list",)

    @metric_value(engine=PandasExecutionEngine)
    def _pandas(cls, execution_engine: PandasExecutionEngine, metric_domain_kwargs: dict[str, Any],
                metric_value_kwargs: dict[str, Any], metrics: dict[str, Any],
                runtime_configuration: dict[str, Any]) -> dict[str, Any]:
        frame = _table(execution_engine, metric_domain_kwargs)
        columns = metric_value_kwargs["column_list"]
        failing: dict[str, Any] = {}
        for column in columns:
            if column not in frame.columns:
                failing[column] = {"observed_value": "missing column"}
                continue
            series = frame[column]
            if pd.api.types.is_integer_dtype(series.dtype) and isinstance(series.dtype, np.dtype):
                continue  # a numpy integer column cannot hold a null
            nulls = series.isna().to_numpy()
            if nulls.any():
                failing[column] = _sample(frame, series.to_numpy(), nulls)
        return {"element_count": len(frame) * len(columns), "columns": failing}


class ColumnListOutsideFiniteBetween(TableMetricProvider):
    """For each column of `column_list` with non-null values that are infinite or outside
    [min_value, max_value]: their count and a sample. NaN is left to the null rule."""

    metric_name = "column_list.outside_finite_between"
    value_keys = ("column_list", "min_value", "max_value")

    @metric_value(engine=PandasExecutionEngine)
    def _pandas(cls, execution_engine: PandasExecutionEngine, metric_domain_kwargs: dict[str, Any],
                metric_value_kwargs: dict[str, Any], metrics: dict[str, Any],
                runtime_configuration: dict[str, Any]) -> dict[str, Any]:
        frame = _table(execution_engine, metric_domain_kwargs)
        low, high = metric_value_kwargs["min_value"], metric_value_kwargs["max_value"]
        columns = metric_value_kwargs["column_list"]
        failing: dict[str, Any] = {}
        for column in columns:
            if column not in frame.columns:
                failing[column] = {"observed_value": "missing column"}
                continue
            values = _numeric(frame[column])
            if values is None:
                failing[column] = {"observed_value": f"not numeric: {frame[column].dtype}"}
                continue
            if values.size == 0:
                continue
            with np.errstate(invalid="ignore"):
                # Fast path, two reductions: finite extremes inside the bounds mean every value is
                # finite and inside (a NaN makes min/max NaN, an infinity makes them infinite).
                smallest, largest = values.min(), values.max()
                if np.isfinite(smallest) and np.isfinite(largest) and low <= smallest and largest <= high:
                    continue
                inside = np.isfinite(values) & (values >= low) & (values <= high)
                bad = ~inside & ~np.isnan(values)
            if bad.any():
                failing[column] = {**_sample(frame, values, bad), "non_null": int((~np.isnan(values)).sum()),
                                   "infinite": int(np.isinf(values).sum())}
        return {"element_count": len(frame) * len(columns), "columns": failing}


def _quantile_ranges(values: np.ndarray, ranges: list[list[float]], allowance: float = 0.0) -> np.ndarray:
    """For each [low, high] of `ranges`, widened by `allowance` on each side: whether the quantile is outside it
    (one row per quantile)."""
    bounds = np.asarray(ranges, dtype=np.float64)
    return (values < bounds[:, 0] - allowance) | (values > bounds[:, 1] + allowance)


def drift_allowance(stdev: float, drift_stdev: float, cap: float | None) -> float:
    """How far a file's quantiles may move beyond their ranges: `drift_stdev` of the file's own standard deviation
    `stdev`, that standard deviation taken at most `cap` (the largest the spread rule allows; None: no cap)."""
    if not drift_stdev or not np.isfinite(stdev):
        return 0.0
    return drift_stdev * (stdev if cap is None else min(stdev, cap))


class ColumnsQuantilesOutside(TableMetricProvider):
    """For each column of `column_ranges` whose `quantiles` (of its finite values) fall outside their
    [low, high], each widened by `drift_stdev` times the column's standard deviation in this file (ddof 1, at most
    `stdev_caps[column]`): the observed quantiles, the ranges they left and that widening. One np.nanquantile
    (and one np.nanstd) over the whole block."""

    metric_name = "columns.quantiles_outside"
    value_keys = ("quantiles", "column_ranges", "drift_stdev", "stdev_caps")

    @metric_value(engine=PandasExecutionEngine)
    def _pandas(cls, execution_engine: PandasExecutionEngine, metric_domain_kwargs: dict[str, Any],
                metric_value_kwargs: dict[str, Any], metrics: dict[str, Any],
                runtime_configuration: dict[str, Any]) -> dict[str, Any]:
        frame = _table(execution_engine, metric_domain_kwargs)
        quantiles = [float(q) for q in metric_value_kwargs["quantiles"]]
        wanted: dict[str, list[list[float]]] = metric_value_kwargs["column_ranges"]
        drift = float(metric_value_kwargs.get("drift_stdev") or 0.0)
        caps: dict[str, float] = metric_value_kwargs.get("stdev_caps") or {}
        failing: dict[str, Any] = {}
        present = []
        for column in wanted:
            if column not in frame.columns:
                failing[column] = {"observed_value": "missing column"}
            elif _numeric(frame[column]) is None:
                failing[column] = {"observed_value": f"not numeric: {frame[column].dtype}"}
            else:
                present.append(column)
        if present and len(frame):
            block = frame[present].to_numpy(dtype=np.float64, na_value=np.nan, copy=True)
            with np.errstate(invalid="ignore"):
                block[~np.isfinite(block)] = np.nan  # infinities are the range rule's, NaN the null rule's
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # an all-null column: NaN quantiles
                    observed = np.nanquantile(block, quantiles, axis=0)
                    spreads = np.nanstd(block, axis=0, ddof=1) if drift else np.zeros(len(present))
            for index, column in enumerate(present):
                values = observed[:, index]
                if np.isnan(values).all():
                    continue  # no finite value: nothing to compare (the null rule speaks for an empty column)
                allowance = drift_allowance(float(spreads[index]), drift, caps.get(column))
                outside = _quantile_ranges(values, wanted[column], allowance)
                if outside.any():
                    failing[column] = {
                        "observed_value": {f"q{q:g}": round(float(values[i]), 6) for i, q in enumerate(quantiles)},
                        "outside": {f"q{q:g}": wanted[column][i] for i, q in enumerate(quantiles) if outside[i]},
                        **({"drift_allowance": round(allowance, 6)} if drift else {}),
                    }
        return {"columns": failing}


class ColumnsStdevOutside(TableMetricProvider):
    """For each column of `column_ranges` whose standard deviation (finite values, ddof 1) is outside its
    [low, high]: the observed standard deviation."""

    metric_name = "columns.stdev_outside"
    value_keys = ("column_ranges",)

    @metric_value(engine=PandasExecutionEngine)
    def _pandas(cls, execution_engine: PandasExecutionEngine, metric_domain_kwargs: dict[str, Any],
                metric_value_kwargs: dict[str, Any], metrics: dict[str, Any],
                runtime_configuration: dict[str, Any]) -> dict[str, Any]:
        frame = _table(execution_engine, metric_domain_kwargs)
        wanted: dict[str, list[float]] = metric_value_kwargs["column_ranges"]
        failing: dict[str, Any] = {}
        for column, (low, high) in wanted.items():
            if column not in frame.columns:
                failing[column] = {"observed_value": "missing column"}
                continue
            values = _numeric(frame[column])
            if values is None:
                failing[column] = {"observed_value": f"not numeric: {frame[column].dtype}"}
                continue
            finite = values[np.isfinite(values)]
            if finite.size < 2:
                continue
            stdev = float(np.std(finite, ddof=1))
            if not low <= stdev <= high:
                failing[column] = {"observed_value": round(stdev, 6), "expected": [low, high]}
        return {"columns": failing}


class ColumnsValueSharesOutside(TableMetricProvider):
    """For each column of `column_shares` ({column: [[value, low, high], ...]}) whose finite values hold a listed
    value in a share outside its [low, high], or values not listed in a share above `new_values[column]`: the
    shares observed (a boolean column's values are 0 and 1). A listed value with a fourth element, its sample share,
    is also outside when absent from a file whose finite values expect it `present_count` times or more (0: never).
    A column without finite values is not judged (the null rule speaks for it)."""

    metric_name = "columns.value_shares_outside"
    value_keys = ("column_shares", "new_values", "present_count")

    @metric_value(engine=PandasExecutionEngine)
    def _pandas(cls, execution_engine: PandasExecutionEngine, metric_domain_kwargs: dict[str, Any],
                metric_value_kwargs: dict[str, Any], metrics: dict[str, Any],
                runtime_configuration: dict[str, Any]) -> dict[str, Any]:
        frame = _table(execution_engine, metric_domain_kwargs)
        wanted: dict[str, list[list[float]]] = metric_value_kwargs["column_shares"]
        new_values: dict[str, float] = metric_value_kwargs["new_values"]
        failing: dict[str, Any] = {}
        for column, listed in wanted.items():
            if column not in frame.columns:
                failing[column] = {"observed_value": "missing column"}
                continue
            series = frame[column]
            values = (series.to_numpy(dtype="float64", na_value=np.nan) if pd.api.types.is_bool_dtype(series.dtype)
                      else _numeric(series))  # a boolean flag: False 0, True 1
            if values is None:
                failing[column] = {"observed_value": f"not numeric: {series.dtype}"}
                continue
            finite = values[np.isfinite(values)]
            if finite.size == 0:
                continue
            present_count = float(metric_value_kwargs.get("present_count") or 0.0)
            shares = {entry[0]: float((finite == entry[0]).mean()) for entry in listed}
            outside = {f"{value:g}": round(shares[value], 4) for value, low, high, *seen in listed
                       if not low <= shares[value] <= high
                       or (present_count and seen and shares[value] == 0 and seen[0] * finite.size >= present_count)}
            unseen = 1.0 - sum(shares.values())
            limit = new_values.get(column, 1.0)
            if unseen > limit + 1e-12:
                outside["values never seen"] = round(unseen, 4)
            if outside:
                failing[column] = {"observed_value": outside,
                                   "expected": {**{f"{value:g}": [low, high] for value, low, high, *_ in listed},
                                                "values never seen": [0.0, limit]}}
        return {"columns": failing}


class CompoundColumnsDuplicatesByHash(TableMetricProvider):
    """Rows whose values in `column_list` equal another row's: their count and sample (row, first copy).

    One 64-bit hash per row finds the candidates; only rows whose hashes collide are compared value by
    value, so a hash collision can never count as a duplicate."""

    metric_name = "compound_columns.duplicates_by_hash"
    value_keys = ("column_list",)

    @metric_value(engine=PandasExecutionEngine)
    def _pandas(cls, execution_engine: PandasExecutionEngine, metric_domain_kwargs: dict[str, Any],
                metric_value_kwargs: dict[str, Any], metrics: dict[str, Any],
                runtime_configuration: dict[str, Any]) -> dict[str, Any]:
        frame = _table(execution_engine, metric_domain_kwargs)
        columns = list(metric_value_kwargs["column_list"])
        missing = [c for c in columns if c not in frame.columns]
        if missing:
            return {"rows": len(frame), "missing": missing}
        table = frame if list(frame.columns) == columns else frame[columns]
        hashes = pd.util.hash_pandas_object(table, index=False).to_numpy()
        candidates = pd.Series(hashes).duplicated(keep=False).to_numpy()
        result: dict[str, Any] = {"rows": len(frame), "unexpected_count": 0, "examples": []}
        if not candidates.any():
            return result
        positions = np.flatnonzero(candidates)
        exact = table.iloc[positions].duplicated(keep=False).to_numpy()
        duplicated = positions[exact]
        result["unexpected_count"] = int(duplicated.size)
        repeats = positions[table.iloc[positions].duplicated(keep="first").to_numpy()][:MAX_SAMPLE]
        for position in repeats:
            same_hash = np.flatnonzero(hashes == hashes[position])
            first = next(p for p in same_hash if table.iloc[p].equals(table.iloc[position]))
            row, original = frame.index[[position, first]].tolist()
            result["examples"].append({"row": row, "duplicate_of": original})
        return result


# ---- expectations --------------------------------------------------------------------------------------

def _partial_count(runtime_configuration: dict[str, Any] | None) -> int:
    result_format = (runtime_configuration or {}).get("result_format")
    if isinstance(result_format, dict):
        return int(result_format.get("partial_unexpected_count", DEFAULT_PARTIAL_COUNT))
    return DEFAULT_PARTIAL_COUNT


def _per_column_result(found: dict[str, Any], runtime_configuration: dict[str, Any] | None,
                       describe: str) -> dict[str, Any]:
    """GX's result for a wide expectation: a summary, plus each failing column in `details.columns`."""
    keep = _partial_count(runtime_configuration)
    failing: dict[str, dict[str, Any]] = found["columns"]
    columns = {
        column: {key: (value[:keep] if key.startswith("partial_") else value) for key, value in entry.items()}
        for column, entry in failing.items()
    }
    summary = {column: entry.get("unexpected_count", entry.get("observed_value"))
               for column, entry in failing.items()}
    result: dict[str, Any] = {
        "observed_value": f"{describe}: {summary}" if failing else f"no {describe}",
        "details": {"columns": columns},
    }
    unexpected = sum(int(entry.get("unexpected_count", 0)) for entry in failing.values())
    if found.get("element_count") is not None:
        elements = int(found["element_count"])
        result.update(element_count=elements, unexpected_count=unexpected,
                      unexpected_percent=100.0 * unexpected / elements if elements else 0.0)
    return {"success": not failing, "result": result}


class ExpectColumnsValuesToNotBeNull(BatchExpectation):
    """Expect no null or NaN value in any column of `column_list` (one pass, one result).

    The wide form of `expect_column_values_to_not_be_null`; each failing column is named in
    `details.columns` with its null count and sample rows. A listed column that is absent fails.
    """

    column_list: list[str]

    metric_dependencies = ("column_list.nulls",)
    success_keys = ("column_list",)
    args_keys = ("column_list",)
    library_metadata: ClassVar[dict[str, Any]] = LIBRARY_METADATA

    def _validate(self, metrics: dict[str, Any], runtime_configuration: dict[str, Any] | None = None,
                  execution_engine: Any = None) -> dict[str, Any]:
        return _per_column_result(metrics["column_list.nulls"], runtime_configuration,
                                  "columns with nulls")


class ExpectColumnsValuesToBeFiniteBetween(BatchExpectation):
    """Expect every non-null value of every column of `column_list` to be finite and within
    [min_value, max_value] (both inclusive).

    With `mostly` below 1, max((1 - mostly) * n, OUTSIDE_FLOOR) of a column's n non-null values may be outside
    (never an infinity); `mostly` 1 (the default) tolerates none.

    The wide form of `expect_column_values_to_be_between` for numeric columns of any dtype, explicit
    that infinity is out of range; NaN is left to the null rule. Each failing column is named in
    `details.columns` with its count and sample values; a non-numeric or absent column fails.
    """

    column_list: list[str]
    min_value: float
    max_value: float
    mostly: float = 1.0

    metric_dependencies = ("column_list.outside_finite_between",)
    success_keys = ("column_list", "min_value", "max_value", "mostly")
    args_keys = ("column_list", "min_value", "max_value")
    library_metadata: ClassVar[dict[str, Any]] = LIBRARY_METADATA

    def _validate(self, metrics: dict[str, Any], runtime_configuration: dict[str, Any] | None = None,
                  execution_engine: Any = None) -> dict[str, Any]:
        found = metrics["column_list.outside_finite_between"]
        if self.mostly < 1.0:
            # A few values outside the range are tolerated (a sample's extremes are not the population's);
            # an infinity never is.
            failing = {column: entry for column, entry in found["columns"].items()
                       if "non_null" not in entry or entry["infinite"]
                       or entry["unexpected_count"] > max((1.0 - self.mostly) * entry["non_null"],
                                                          OUTSIDE_FLOOR)}
            found = {**found, "columns": failing}
        share = "" if self.mostly >= 1.0 else (f" for more than {1 - self.mostly:.0%} of values (or "
                                                f"{OUTSIDE_FLOOR})")
        return _per_column_result(found, runtime_configuration, f"columns with values not finite within "
                                                                f"[{self.min_value}, {self.max_value}]{share}")


class ExpectColumnsQuantilesToBeBetween(BatchExpectation):
    """Expect, for every column of `column_ranges`, each of its `quantiles` (over its finite values) to lie in
    that column's [low, high] for the quantile ({column: [[low, high] per quantile]}), widened on each side by
    `drift_stdev` times the column's standard deviation in the file validated, that standard deviation taken at
    most `stdev_caps[column]` when given (0, the default: no widening).

    The wide form of `expect_column_quantile_values_to_be_between`: one quantile computation over all the
    columns. It sees a column whose distribution moved or whose units changed, or that is stuck at one value;
    each failing column is named in `details.columns` with its observed quantiles, the ranges they left and
    the widening (`drift_allowance`). With `drift_stdev`, a file whose column moved as a whole by less than that
    many of its own standard deviations is judged as if it had not moved (gradual drift; see
    nightshift.data.suite_init for why the file's standard deviation, capped, and not the sample's).
    """

    quantiles: list[float]
    column_ranges: dict[str, list[list[float]]]
    drift_stdev: float = 0.0
    stdev_caps: dict[str, float] = {}

    metric_dependencies = ("columns.quantiles_outside",)
    success_keys = ("quantiles", "column_ranges", "drift_stdev", "stdev_caps")
    args_keys = ("quantiles", "column_ranges")
    library_metadata: ClassVar[dict[str, Any]] = LIBRARY_METADATA

    def _validate(self, metrics: dict[str, Any], runtime_configuration: dict[str, Any] | None = None,
                  execution_engine: Any = None) -> dict[str, Any]:
        return _per_column_result(metrics["columns.quantiles_outside"], runtime_configuration,
                                  "columns with quantiles out of range")


class ExpectColumnsStdevToBeBetween(BatchExpectation):
    """Expect the standard deviation of every column of `column_ranges` ({column: [low, high]}) to lie in
    its range (finite values, ddof 1; a column with fewer than two is not judged).

    The wide form of `expect_column_stdev_to_be_between`: a column stuck at one value has 0, one whose units
    changed has the old spread times the factor. Each failing column is named in `details.columns`.
    """

    column_ranges: dict[str, list[float]]

    metric_dependencies = ("columns.stdev_outside",)
    success_keys = ("column_ranges",)
    args_keys = ("column_ranges",)
    library_metadata: ClassVar[dict[str, Any]] = LIBRARY_METADATA

    def _validate(self, metrics: dict[str, Any], runtime_configuration: dict[str, Any] | None = None,
                  execution_engine: Any = None) -> dict[str, Any]:
        return _per_column_result(metrics["columns.stdev_outside"], runtime_configuration,
                                  "columns with a standard deviation out of range")


class ExpectColumnsValueSharesToBeBetween(BatchExpectation):
    """Expect, for every column of `column_shares` ({column: [[value, low, high(, sample share)], ...]}), each listed
    value to make up a share of the column's finite values within its [low, high], and values not listed at most
    `new_values[column]` of them (a column it does not name: no bound); with `present_count`, a value whose sample
    share times the file's finite values is at least that to be present.

    The distribution rule of a discrete column (a flag, a code, a small count), whose quantiles jump from value to
    value as its shares move. Each failing column is named in `details.columns` with the shares out of bounds.
    """

    column_shares: dict[str, list[list[float]]]
    new_values: dict[str, float]
    present_count: float = 0.0

    metric_dependencies = ("columns.value_shares_outside",)
    success_keys = ("column_shares", "new_values", "present_count")
    args_keys = ("column_shares", "new_values")
    library_metadata: ClassVar[dict[str, Any]] = LIBRARY_METADATA

    def _validate(self, metrics: dict[str, Any], runtime_configuration: dict[str, Any] | None = None,
                  execution_engine: Any = None) -> dict[str, Any]:
        return _per_column_result(metrics["columns.value_shares_outside"], runtime_configuration,
                                  "columns with value shares out of range")


class ExpectTableColumnTypesToBe(BatchExpectation):
    """Expect each column of `column_types` ({column: dtype name}) to have exactly that dtype.

    The wide form of `expect_column_type_to_be`: one lookup of the table's dtypes; each mismatched or
    absent column is named in `details.columns` with the type it has.
    """

    column_types: dict[str, str]

    metric_dependencies = ("table.column_types",)
    success_keys = ("column_types",)
    args_keys = ("column_types",)
    library_metadata: ClassVar[dict[str, Any]] = LIBRARY_METADATA

    def _validate(self, metrics: dict[str, Any], runtime_configuration: dict[str, Any] | None = None,
                  execution_engine: Any = None) -> dict[str, Any]:
        actual = {str(entry["name"]): str(entry["type"]) for entry in metrics["table.column_types"]}
        failing = {
            column: {"observed_value": actual.get(column, "missing column"), "expected": expected}
            for column, expected in self.column_types.items()
            if actual.get(column) != expected
        }
        return _per_column_result({"columns": failing}, runtime_configuration, "columns of another type")


class ExpectCompoundColumnsToBeUniqueByHash(BatchExpectation):
    """Expect at least `mostly` of the rows to be unique over `column_list` (a row is unexpected when
    another row has the same values in those columns, as in `expect_compound_columns_to_be_unique`).

    `pair_rate`: the share of pairs of rows that are equal in data without fault (natural duplicates of a
    discrete table); a file of n rows then expects at most (n - 1) * pair_rate of its rows to repeat another, and
    `mostly` is lowered by that much. `tolerate`: duplicated rows any file may hold whatever its size.

    Hash-based: one 64-bit hash per row, then an exact comparison among rows whose hashes collide.
    The sample lists duplicated rows with the row they repeat.
    """

    column_list: list[str]
    mostly: float = 1.0
    pair_rate: float = 0.0
    tolerate: int = 0

    metric_dependencies = ("compound_columns.duplicates_by_hash",)
    success_keys = ("column_list", "mostly", "pair_rate", "tolerate")
    args_keys = ("column_list", "mostly")
    library_metadata: ClassVar[dict[str, Any]] = LIBRARY_METADATA

    def _validate(self, metrics: dict[str, Any], runtime_configuration: dict[str, Any] | None = None,
                  execution_engine: Any = None) -> dict[str, Any]:
        found = metrics["compound_columns.duplicates_by_hash"]
        if found.get("missing"):
            return {"success": False, "result": {"observed_value": f"missing columns: {found['missing']}"}}
        rows, duplicated = int(found["rows"]), int(found["unexpected_count"])
        share = duplicated / rows if rows else 0.0
        return {
            "success": rows == 0 or duplicated <= self.tolerate
            or (rows - duplicated) / rows >= self.mostly - (rows - 1) * self.pair_rate,
            "result": {
                "observed_value": f"{duplicated} duplicated rows ({share:.2%} of {rows})",
                "element_count": rows,
                "unexpected_count": duplicated,
                "unexpected_percent": 100.0 * share,
                "partial_unexpected_list": found["examples"][:_partial_count(runtime_configuration)],
            },
        }
