"""Checks of a pipeline against its data, from the Parquet schema of the train split alone (no rows read):
the label column is there, the suite names only columns the data has, the `tabular` features are numeric.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from nightshift.errors import UsageError
from nightshift.pipelines.spec import TABULAR, Pipeline

# Expectation kwargs that name columns (GX's and nightshift.data.expectations').
_COLUMN_KEYS = ("column", "column_A", "column_B")
_COLUMN_LIST_KEYS = ("column_list", "column_set")
_COLUMN_MAP_KEYS = ("column_types", "column_ranges")


def suite_columns(suite: dict[str, Any]) -> dict[str, list[str]]:
    """{expectation type: the columns its kwargs name}, for each expectation that names any."""
    named: dict[str, list[str]] = {}
    for expectation in suite.get("expectations", []):
        kwargs = expectation.get("kwargs", {})
        columns: list[str] = [str(kwargs[k]) for k in _COLUMN_KEYS if isinstance(kwargs.get(k), str)]
        for key in _COLUMN_LIST_KEYS:
            if isinstance(kwargs.get(key), list):
                columns.extend(str(c) for c in kwargs[key])
        for key in _COLUMN_MAP_KEYS:
            if isinstance(kwargs.get(key), dict):
                columns.extend(str(c) for c in kwargs[key])
        if columns:
            named.setdefault(str(expectation.get("type")), []).extend(columns)
    return named


def _listing(names: Iterable[str], limit: int = 8) -> str:
    names = list(names)
    return ", ".join(names[:limit]) + (f", … ({len(names)} in all)" if len(names) > limit else "")


def check_against_data(pipeline: Pipeline, *, home: str | Path | None = None,
                       roots: Sequence[str | Path] | None = None) -> list[str]:
    """Each way `pipeline` does not fit its declared data, one line each (`FILE: KEY: what; what to do`);
    empty when it fits. Reads only the train split's Parquet schema.

    `home`: what relative data paths are relative to (default NIGHTSHIFT_HOME); `roots`: where data may lie
    (default: the configured data roots, nightshift.settings.data_roots).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nightshift.settings import confined_data_source

    source = str(pipeline.source) if pipeline.source is not None else pipeline.dag_id
    problems: list[str] = []

    def problem(key: str, text: str) -> list[str]:
        problems.append(f"{source}: {key}: {text}")
        return problems

    train = pipeline.dataset.data.paths(home)["train"]
    try:
        confined_data_source(train, roots)
    except UsageError as err:
        return problem("dataset.data", str(err))
    if not train.is_file():
        return problem("dataset.data", f"the train split {train} does not exist; stage or write the data there, "
                                       f"or point dataset.data at it")
    try:
        arrow_schema = pq.read_schema(train)
    except (OSError, pa.ArrowException) as err:
        return problem("dataset.data", f"{train} is not a readable Parquet file ({err})")
    columns = list(arrow_schema.names)
    label = pipeline.dataset.label
    if label not in columns:
        problem("dataset.label", f"column {label!r} is not in {train} (columns: {_listing(columns)}); set "
                                 f"dataset.label to the column holding the target")
    features = list(pipeline.dataset.features) if pipeline.dataset.features is not None else \
        [c for c in columns if c != label]
    missing = [c for c in features if c not in columns]
    if missing:
        problem("dataset.features", f"columns {_listing(missing)} are not in {train}; list only columns it has")
    if pipeline.dataset.loader == TABULAR:
        for name in (c for c in features if c in columns):
            kind = arrow_schema.field(name).type
            if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
                problem("dataset.features", f"column {name!r} of {train} is {kind}, not numeric: the tabular "
                                            f"loader needs numbers; encode it, or leave it out of dataset.features")
    try:
        suite = json.loads(pipeline.suite_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return problem("suite", f"{pipeline.suite_path} cannot be read ({err})")
    # One line for the whole suite: a suite drawn from other data names the missing columns in most of its
    # expectations, and one line per expectation would repeat the same columns.
    absent: dict[str, None] = {}
    expectations: list[str] = []
    for expectation, named in suite_columns(suite).items():
        missing_here = [c for c in named if c not in columns]
        if missing_here:
            expectations.append(expectation)
            absent.update(dict.fromkeys(sorted(missing_here)))
    if absent:
        problem("suite", f"names columns {_listing(absent)} that {train} does not have (in "
                         f"{_listing(expectations, limit=3)}): a suite for other columns? Write one for this data "
                         f"with `nightshift suite init`")
    return problems
