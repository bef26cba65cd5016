"""Custom Great Expectations expectations the digits suite needs and GX 1.x does not ship.

Importing this module registers them with GX (by their snake_case type name), so a suite JSON that
uses them loads with `ExpectationSuite(**json)`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pandas as pd
from great_expectations.execution_engine import PandasExecutionEngine
from great_expectations.expectations.expectation import ColumnAggregateExpectation, ColumnMapExpectation
from great_expectations.expectations.metrics import ColumnMapMetricProvider, column_condition_partial


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
    library_metadata: ClassVar[dict[str, Any]] = {"maturity": "experimental", "tags": ["nightshift"]}

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


class ColumnValuesFiniteBetween(ColumnMapMetricProvider):
    """Row condition: the value is a finite number within [min_value, max_value], for any numeric dtype."""

    condition_metric_name = "column_values.finite_between"
    condition_value_keys = ("min_value", "max_value")

    @column_condition_partial(engine=PandasExecutionEngine)
    def _pandas(cls, column: pd.Series, min_value: float, max_value: float, **kwargs: Any) -> pd.Series:
        # GX's own `column_values.between` is vectorised only for int64/float64 columns; on float32
        # it calls a Python function per value (about 10x slower than pandas on the digits table).
        values = column.to_numpy()
        inside = np.isfinite(values) & (values >= min_value) & (values <= max_value)
        return pd.Series(inside, index=column.index)


class ExpectColumnValuesToBeFiniteBetween(ColumnMapExpectation):
    """Expect each non-null value to be finite and within [min_value, max_value] (both inclusive).

    Like `expect_column_values_to_be_between`, but vectorised for every numeric dtype and explicit
    that infinity is out of range. Nulls (and NaN) are left to `expect_column_values_to_not_be_null`.
    """

    min_value: float
    max_value: float

    map_metric = "column_values.finite_between"
    success_keys = ("min_value", "max_value", "mostly")
    args_keys = ("column", "min_value", "max_value")
    library_metadata: ClassVar[dict[str, Any]] = {"maturity": "experimental", "tags": ["nightshift"]}
