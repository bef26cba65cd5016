"""Checks of a pipeline that the schema cannot make and a run would fail on.

`check_declaration`: the loader and the model exist (by name or import path), the model takes the declared
arguments and the loader its options (their signatures) and the declared task, and the suite lets through no
missing value the loader refuses. `check_against_data`: against the train split, from its Parquet schema (and its
label column alone): the label column is there, the suite names only columns the data has, the `tabular` features
are numeric, a declared positive class is one of the labels, and the suite holds every column a loader refusing
nulls reads to no nulls.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from nightshift.errors import UsageError
from nightshift.pipelines.spec import LOADER_TASKS, NO_MISSING_VALUES, TABULAR, Pipeline
from nightshift.tasks import BINARY, MULTICLASS

# Expectation kwargs that name columns (GX's and nightshift.data.expectations').
_COLUMN_KEYS = ("column", "column_A", "column_B")
_COLUMN_LIST_KEYS = ("column_list", "column_set")
_COLUMN_MAP_KEYS = ("column_types", "column_ranges")


# A loader's arguments its caller gives (nightshift.datasets.load_split), and a model's (the trainer, from the data).
LOADER_ARGUMENTS = ("data_dir", "split", "task")
MODEL_ARGUMENTS = ("input_shape", "num_classes")
# Null rules: the one-column GX rule and the wide one of nightshift.data.expectations; `mostly` < 1 lets nulls in.
_NOT_NULL = ("expect_column_values_to_not_be_null", "expect_columns_values_to_not_be_null")
# GX's share of non-null values: with min_value 1, a not-null rule too.
_NON_NULL_SHARE = "expect_column_proportion_of_non_null_values_to_be_between"


def _named_columns(kwargs: dict[str, Any]) -> list[str]:
    """The columns an expectation's kwargs name."""
    columns: list[str] = [str(kwargs[k]) for k in _COLUMN_KEYS if isinstance(kwargs.get(k), str)]
    for key in _COLUMN_LIST_KEYS:
        if isinstance(kwargs.get(key), list):
            columns.extend(str(c) for c in kwargs[key])
    for key in _COLUMN_MAP_KEYS:
        if isinstance(kwargs.get(key), dict):
            columns.extend(str(c) for c in kwargs[key])
    return columns


def suite_columns(suite: dict[str, Any]) -> dict[str, list[str]]:
    """{expectation type: the columns its kwargs name}, for each expectation that names any."""
    named: dict[str, list[str]] = {}
    for expectation in suite.get("expectations", []):
        columns = _named_columns(expectation.get("kwargs", {}))
        if columns:
            named.setdefault(str(expectation.get("type")), []).extend(columns)
    return named


def takes_missing_values(loader: str, factory: Any = None) -> bool:
    """Whether the dataset loader `loader` (its factory, when already found) can use a missing value in a feature
    or the label: not the built-ins (NO_MISSING_VALUES); a plugin's unless it sets `takes_missing_values = False`."""
    return loader not in NO_MISSING_VALUES and bool(getattr(factory, "takes_missing_values", True))


def loader_tasks(loader: str, factory: Any = None) -> tuple[str, ...] | None:
    """The tasks the dataset loader `loader` (its factory, when already found) loads, or None for any: a built-in's
    (LOADER_TASKS), a plugin's `tasks` attribute, else multiclass alone for a factory whose signature takes no
    `task` (nightshift.datasets.load_split passes `task=` for any other task, which it would refuse)."""
    from nightshift.plugins import keyword_arguments

    tasks = LOADER_TASKS.get(loader, getattr(factory, "tasks", None))
    if isinstance(tasks, list | tuple):
        return tuple(str(t) for t in tasks)
    named = keyword_arguments(factory) if factory is not None else None
    return (MULTICLASS,) if named is not None and "task" not in named else None


def nulls_let_through(suite: dict[str, Any], columns: Iterable[str] | None) -> list[tuple[str, list[str]]]:
    """(expectation, the columns it lets nulls into) for each expectation of `suite` that allows a null in one of
    `columns` (None: any column): a not-null rule with `mostly` below 1, or a rule expecting nulls."""
    wanted = None if columns is None else set(columns)
    found = []
    for expectation in suite.get("expectations", []):
        kind, kwargs = str(expectation.get("type")), expectation.get("kwargs", {})
        mostly = kwargs.get("mostly")
        lenient = kind in _NOT_NULL and isinstance(mostly, int | float) and not isinstance(mostly, bool) \
            and mostly < 1
        if lenient or kind == "expect_column_values_to_be_null":
            named = [c for c in _named_columns(kwargs) if wanted is None or c in wanted]
            if named:
                rule = (expectation.get("meta") or {}).get("rule")
                what = (f"{kind} (mostly {mostly})" if lenient else kind) + (f" [{rule}]" if rule else "")
                found.append((what, named))
    return found


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def nulls_unguarded(suite: dict[str, Any], columns: Iterable[str]) -> list[str]:
    """The `columns` that no strict not-null rule of `suite` covers (no `mostly`, or `mostly` 1; or a share of
    non-null values of at least 1): a suite that says nothing of nulls in a column lets them through as surely as
    a lenient rule does."""
    covered: set[str] = set()
    for expectation in suite.get("expectations", []):
        kind, kwargs = str(expectation.get("type")), expectation.get("kwargs", {})
        mostly, least = kwargs.get("mostly"), kwargs.get("min_value")
        if (kind in _NOT_NULL and (mostly is None or (_number(mostly) and mostly >= 1))) \
                or (kind == _NON_NULL_SHARE and _number(least) and least >= 1):
            covered.update(_named_columns(kwargs))
    return [c for c in columns if c not in covered]


def check_declaration(pipeline: Pipeline) -> list[str]:
    """Each way `pipeline` names what a run cannot build, one line each (`FILE: KEY: what; what to do`): an unknown
    loader or model (naming the known ones), a model argument or loader option its signature does not take (a
    `**kwargs` takes any), a suite that lets nulls into a column the loader refuses them in. Reads no data;
    imports the model registry (torch) and NIGHTSHIFT_PLUGINS."""
    from nightshift.datasets import DATASETS
    from nightshift.models import MODELS
    from nightshift.plugins import keyword_arguments

    source = str(pipeline.source) if pipeline.source is not None else pipeline.dag_id
    problems: list[str] = []
    loader = _factory(DATASETS, pipeline.dataset.loader, f"{source}: dataset.loader", problems)
    if loader is not None:
        options = keyword_arguments(loader, supplied=LOADER_ARGUMENTS)
        problems.extend(_unknown_arguments(source, "dataset.options", f"loader {pipeline.dataset.loader!r}",
                                           pipeline.dataset.options, options, "option"))
        tasks = loader_tasks(pipeline.dataset.loader, loader)
        if tasks is not None and pipeline.task not in tasks:
            problems.append(f"{source}: task: loader {pipeline.dataset.loader!r} loads a {' or '.join(tasks)} task "
                            f"only, not {pipeline.task}; declare task {' or '.join(tasks)}, or a loader for a "
                            f"{pipeline.task} task (e.g. {TABULAR})")
    model = _factory(MODELS, pipeline.model.name, f"{source}: model.name", problems)
    if model is not None:
        problems.extend(f"{source}: model.kwargs.{name}: set by the trainer from the data ({', '.join(MODEL_ARGUMENTS)}"
                        f"); remove it" for name in pipeline.model.kwargs if name in MODEL_ARGUMENTS)
        problems.extend(_unknown_arguments(source, "model.kwargs", f"model {pipeline.model.name!r}",
                                           {k: v for k, v in pipeline.model.kwargs.items()
                                            if k not in MODEL_ARGUMENTS},
                                           keyword_arguments(model, supplied=MODEL_ARGUMENTS), "argument"))
    if not takes_missing_values(pipeline.dataset.loader, loader):
        problems.extend(_null_problems(pipeline, source))
    return problems


def _factory(registry: Any, name: str, where: str, problems: list[str]) -> Any:
    """`registry`'s factory `name`, or None with a problem line: an unknown name, or a plugin module that fails to
    import in any way (a SyntaxError or an error raised at import crashed the whole check with a traceback)."""
    try:
        return registry.get(name)
    except UsageError as err:
        problems.append(f"{where}: {err}")
    except Exception as err:
        problems.append(f"{where}: cannot import {name!r}: {type(err).__name__}: {err}; fix the plugin module")
    return None


def _unknown_arguments(source: str, key: str, owner: str, given: Iterable[str], accepted: list[str] | None,
                       what: str) -> list[str]:
    if accepted is None:
        return []
    takes = f"it takes {', '.join(accepted)}" if accepted else f"it takes no {what}"
    return [f"{source}: {key}.{name}: {owner} takes no {what} {name!r} (its signature); {takes}"
            for name in given if name not in accepted]


def _null_problems(pipeline: Pipeline, source: str) -> list[str]:
    try:
        suite = json.loads(pipeline.suite_path.read_text())
    except (OSError, json.JSONDecodeError):
        return []  # check_against_data says so
    dataset = pipeline.dataset
    columns = None if dataset.features is None else [*dataset.features, dataset.label]
    return [f"{source}: suite: {expectation} lets nulls into {_listing(named)}, which the {dataset.loader!r} loader "
            f"refuses (any missing value in a feature or the label): such data would pass validation and fail "
            f"training. Drop its `mostly` (no null allowed) and fill or drop missing values before the data arrives"
            f", or use a loader that takes them"
            for expectation, named in nulls_let_through(suite, columns)]


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
    if pipeline.task == BINARY and pipeline.gate.positive_class is not None and label in columns:
        labels = label_values(train, label)
        if labels is not None and pipeline.gate.positive_class not in labels:
            boolean = pipeline.gate.positive_class in ("True", "False")
            problem("gate.positive_class", f"{pipeline.gate.positive_class!r} is not a label of {train}: its labels "
                                           f"are {_listing(labels)}; declare one of them as it is written there"
                                           + (" (YAML reads an unquoted yes, no, on, off, true or false as a "
                                              "boolean: quote it, e.g. 'yes')" if boolean else ""))
    if pipeline.dataset.loader == TABULAR:
        for name in (c for c in features if c in columns):
            kind = arrow_schema.field(name).type
            if not _numeric(kind):
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
    elif not takes_missing_values(pipeline.dataset.loader, _loader_factory(pipeline.dataset.loader)):
        # The columns such a loader reads that the data has: the label, and the numeric features (a text column is
        # named above when it is a tabular feature, and no loader of numbers reads it). A column a lenient rule lets
        # nulls into is check_declaration's line.
        numeric = [c for c in features if c in columns and _numeric(arrow_schema.field(c).type)]
        read = [*numeric, *([label] if label in columns else [])]
        lenient = {c for _, named in nulls_let_through(suite, read) for c in named}
        unguarded = [c for c in nulls_unguarded(suite, read) if c not in lenient]
        if unguarded:
            problem("suite", f"no rule holds {_listing(unguarded)} to no nulls, which the {pipeline.dataset.loader!r} "
                             f"loader refuses (any missing value in a feature or the label): such data would pass "
                             f"validation and fail training. Add a not-null rule for them "
                             f"(expect_columns_values_to_not_be_null; `nightshift suite init` draws one)")
    return problems


def _numeric(kind: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind))


def _loader_factory(name: str) -> Any:
    """The loader's factory when it is a plugin's (whether it takes missing values is its attribute), else None:
    a built-in's answer is known by name, and an unknown or broken one is check_declaration's line."""
    if name in NO_MISSING_VALUES:
        return None
    from nightshift.datasets import DATASETS

    try:
        return DATASETS.get(name)
    except Exception:
        return None


def label_values(path: Path, label: str) -> list[str] | None:
    """The distinct values of column `label` of the Parquet file `path`, sorted by value as the trainer orders
    classes, as text (as a declaration names them); None when they cannot be read."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        values = pq.read_table(path, columns=[label]).column(0).drop_null().unique().to_numpy(zero_copy_only=False)
        return [str(v) for v in np.sort(values)]
    except (OSError, KeyError, TypeError, pa.ArrowException):
        return None
