"""Read pipeline declarations: YAML files checked against the published schema, then against what a schema
cannot say (a metric that fits the task, a suite file that exists inside the declaration's folder and is a
GX suite, a positive class only for a binary task, one dag_id, model name and dataset asset per pipeline across
every folder Airflow loads declarations from).

Every problem is one line, `FILE: KEY.PATH: what is wrong; what to do`. `load_pipelines` reads a whole
folder and returns the good pipelines with the problems of the others, so one bad file never hides the rest.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from nightshift.errors import UsageError
from nightshift.pipelines.spec import (
    GX_PREFIX,
    INVALID_DAG_PREFIX,
    PROJECT_DAG_IDS,
    SEARCH_DAG_SUFFIX,
    DataLocation,
    DatasetSpec,
    DeploySpec,
    GateSpec,
    ModelSpec,
    Pipeline,
    TrainingSpec,
    class_text,
    frozen,
)
from nightshift.retention import RetentionPolicy
from nightshift.tasks import BINARY, DEFAULT_GATES, DEFAULT_MIN_IMPROVEMENT, metric

SCHEMA_PATH = Path(__file__).with_name("pipeline.schema.json")
DECLARATION_SUFFIXES = (".yaml", ".yml")
PATTERNS = tuple(f"*{suffix}" for suffix in DECLARATION_SUFFIXES)
# Where declarations lie besides the DAG folder (nightshift gc reads it too), and Airflow's DAG folder.
PIPELINES_ENV = "NIGHTSHIFT_PIPELINES"
DAGS_FOLDER_ENV = "AIRFLOW__CORE__DAGS_FOLDER"
# Airflow's default [core] dags_folder is {AIRFLOW_HOME}/dags: its YAML declarations are read, no code imported.
AIRFLOW_DEFAULT_DAGS = "dags"
# A GX suite name after `gx:`: one file name in gx/expectations, never a path.
_SUITE_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
# A declaration is a page of YAML; anything far bigger is a mistake or an attack on the DAG processor.
MAX_DECLARATION_BYTES = 1024 * 1024


class PipelineInvalid(UsageError):
    """A pipeline declaration is not valid; `problems` holds one line per problem, the message the first."""

    def __init__(self, source: str, problems: Iterable[str]) -> None:
        self.source = source
        self.problems = tuple(f"{source}: {problem}" for problem in problems)
        super().__init__(self.problems[0] if self.problems else f"{source}: invalid pipeline declaration")


@cache
def schema() -> dict[str, Any]:
    """The published JSON Schema of a declaration (nightshift/pipelines/pipeline.schema.json)."""
    return dict(json.loads(SCHEMA_PATH.read_text()))


# ---- YAML --------------------------------------------------------------------------------------------------

class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently)."""


def _unique_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            continue  # an unhashable key: construct_mapping reports it
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} given twice (first on line {seen[key]}); keep one", key_node.start_mark)
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _no_alias_or_anchor(loader: _Loader, parent: Any, index: Any) -> Any:
    """Composer.compose_node refusing `&anchor` and `*alias`: an alias shares a node that the loader then
    copies everywhere it is used (ten aliases of ten aliases ... is exponential: the "billion laughs")."""
    event = loader.peek_event()
    if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
        what = f"alias *{event.anchor}" if isinstance(event, yaml.AliasEvent) else f"anchor &{event.anchor}"
        raise yaml.composer.ComposerError(None, None, f"YAML {what}: anchors and aliases are not allowed in a "
                                          f"declaration; write the value out", event.start_mark)
    return yaml.composer.Composer.compose_node(loader, parent, index)


_Loader.compose_node = _no_alias_or_anchor  # type: ignore[method-assign, assignment]


def parse_yaml(text: str, source: str) -> dict[str, Any]:
    """The declaration in `text` as a dict; PipelineInvalid naming the line when it is not YAML or not a mapping,
    or when it uses anchors or aliases; PipelineInvalid when it is over MAX_DECLARATION_BYTES."""
    if len(text.encode()) > MAX_DECLARATION_BYTES:
        raise PipelineInvalid(source, [_too_big(len(text.encode()))])
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}" if mark is not None else "(top level)"
        problem = err.problem or err.context or "cannot be parsed"
        raise PipelineInvalid(source, [f"{where}: invalid YAML: {problem}; fix the syntax"]) from err
    except yaml.YAMLError as err:
        raise PipelineInvalid(source, [f"(top level): invalid YAML: {err}; fix the syntax"]) from err
    except RecursionError as err:  # a file of a few KB nested thousands deep: never a declaration
        raise PipelineInvalid(source, ["(top level): nested too deep to be a declaration; a declaration is a few "
                                       "levels deep (see the schema)"]) from err
    if data is None:
        raise PipelineInvalid(source, ["(top level): the file is empty; declare a pipeline (see the schema "
                                       f"{SCHEMA_PATH.name})"])
    if not isinstance(data, dict):
        raise PipelineInvalid(source, [f"(top level): must be a mapping of keys (dag_id, model_name, ...), got "
                                       f"{_kind(data)}"])
    return data


def _too_big(size: int) -> str:
    return (f"(top level): the file is {size} bytes, over the {MAX_DECLARATION_BYTES} a declaration may have; "
            f"declare one pipeline per file")


def _json_problems(value: Any, path: str = "") -> list[str]:
    """Where `value` (parsed YAML) holds what is no plain JSON value: a key that is not a string (YAML reads
    `yes:` as true, `1:` as an integer), a date, NaN or an infinity. The DAG passes options and model
    arguments on as JSON, and NaN compares false with everything (a tolerance of NaN never fails)."""
    where = path or "(top level)"
    if isinstance(value, Mapping):
        problems = []
        for key, item in value.items():
            if not isinstance(key, str):
                problems.append(f"{_join(path, key)}: the key {key!r} is {_kind(key)}, not a string (YAML reads "
                                f"yes/no/on/off, numbers and dates so); quote it")
            else:
                problems.extend(_json_problems(item, _join(path, key)))
        return problems
    if isinstance(value, list):
        return [line for i, item in enumerate(value) for line in _json_problems(item, f"{path}[{i}]")]
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{where}: must be a finite number, got {value}"]
    if value is None or isinstance(value, str | int | float):
        return []
    return [f"{where}: {_kind(value)} {value} is not a JSON value (YAML reads unquoted dates so); quote it"]


# ---- schema ------------------------------------------------------------------------------------------------

def _yaml_number_hint(text: str) -> str:
    """For a number YAML read as text: how to write it. YAML 1.1 (PyYAML) reads an exponent without a dot, 1e-3,
    as a string."""
    import re

    if re.fullmatch(r"[-+]?\d+[eE][-+]?\d+", text.strip()):
        mantissa, exponent = re.split("[eE]", text.strip())
        return f" (YAML reads {text} as text: write {mantissa}.0e{exponent})"
    return ""


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {value!r}".lower()
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"number {value}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


def _key_path(parts: Iterable[Any]) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _first_sentence(text: str) -> str:
    head, _, _ = text.partition(". ")
    return head.rstrip(".")


_TYPE_NAMES = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "true or false",
               "null": "null", "object": "a mapping", "array": "a list"}


def _schema_problem(error: Any) -> list[str]:
    """One line per problem of one jsonschema error."""
    path = _key_path(error.absolute_path)
    where = path or "(top level)"
    schema_node: dict[str, Any] = error.schema if isinstance(error.schema, dict) else {}
    kind = error.validator
    if kind == "additionalProperties" and isinstance(error.instance, Mapping):
        if not isinstance(error.validator_value, bool):  # a schema for the values (guards): not an unknown key
            return [f"{where}: {error.message}"]
        allowed = list(schema_node.get("properties", {}))
        extra = [key for key in error.instance if key not in allowed]
        return [f"{_join(path, key)}: unknown key; allowed keys here: {', '.join(allowed)}" for key in extra]
    if kind == "required":
        properties = schema_node.get("properties", {})
        return [f"{_join(path, key)}: missing required key; add it "
                f"({_first_sentence(properties.get(key, {}).get('description', ''))})"
                for key in error.validator_value if key not in error.instance]
    if kind == "type":
        wanted = error.validator_value if isinstance(error.validator_value, list) else [error.validator_value]
        names = " or ".join(_TYPE_NAMES.get(str(t), str(t)) for t in wanted)
        hint = ""
        if isinstance(error.instance, str) and {"number", "integer"} & {str(t) for t in wanted}:
            hint = _yaml_number_hint(error.instance)
        return [f"{where}: must be {names}, got {_kind(error.instance)}{hint}"]
    if kind == "enum":
        choices = ", ".join("null" if v is None else str(v) for v in error.validator_value)
        return [f"{where}: {_kind(error.instance)} is not allowed; use one of {choices}"]
    if kind == "pattern":
        expected = str(schema_node.get("description", f"a value matching {error.validator_value}")).rstrip(".")
        return [f"{where}: {error.instance!r} is not valid here; expected: {expected}"]
    if kind == "oneOf" and path.endswith("data"):
        return [f"{where}: give either directory, or all of train, validation and test (not both)"]
    if kind in {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}:
        sign = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}[kind]
        return [f"{where}: must be {sign} {error.validator_value}, got {error.instance}"]
    return [f"{where}: {error.message}"]


def _validator() -> Any:
    from nightshift.deploy import target_names

    return _validator_for(target_names())


@cache
def _validator_for(targets: tuple[str, ...]) -> Any:
    """The published schema's validator, `deploy.target` taking every registered deployment target (the
    published file lists the built-ins)."""
    import copy

    import jsonschema

    checked = copy.deepcopy(schema())
    checked["properties"]["deploy"]["properties"]["target"]["enum"] = list(targets)
    return jsonschema.Draft202012Validator(checked)


def schema_problems(data: Any) -> list[str]:
    """Each way `data` breaks the published schema, one line each (without the file), sorted by key path."""
    errors = sorted(_validator().iter_errors(data), key=lambda e: (_key_path(e.absolute_path), e.validator))
    typed = {_key_path(e.absolute_path) for e in errors if e.validator == "type"}
    problems: list[str] = []
    for error in errors:
        # A value of the wrong type also fails its enum, pattern and oneOf: its type error says it all.
        if error.validator != "type" and _key_path(error.absolute_path) in typed:
            continue
        for line in _schema_problem(error):
            if line not in problems:
                problems.append(line)
    return problems


def _with_defaults(instance: Any, node: Mapping[str, Any]) -> Any:
    """`instance` with the schema's `default`s filled in for absent keys, recursively (a copy)."""
    if not isinstance(instance, Mapping):
        return instance
    properties = node.get("properties", {})
    filled = {key: _with_defaults(value, properties.get(key, {})) for key, value in instance.items()}
    for key, sub in properties.items():
        if key not in filled and "default" in sub:
            filled[key] = _with_defaults(json.loads(json.dumps(sub["default"])), sub)
    return filled


# ---- what the schema cannot say ----------------------------------------------------------------------------

def gate_with_task_defaults(task: str, gate: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The gate a declaration really gets: each key it leaves out takes the task's default, as `nightshift
    evaluate` with nothing given (nightshift.tasks.DEFAULT_GATES, DEFAULT_MIN_IMPROVEMENT): the default guards
    (only an explicit `guards: {}` declares none), min_improvement 0.001, and the task's floor when the primary
    metric is the task's default one (a floor of another metric has other units: it must be declared)."""
    if task not in DEFAULT_GATES:
        return dict(gate), []  # the schema names the unknown task
    primary, guards, floor = DEFAULT_GATES[task]
    full = {"guards": dict(guards), "min_improvement": DEFAULT_MIN_IMPROVEMENT, **gate}
    problems = []
    if "floor" not in gate:
        if floor is not None and gate.get("primary") != primary:
            problems.append(f"gate.floor: required with primary {gate.get('primary')!r}: the task's default floor "
                            f"({floor:g}) is for {primary}; give the value {gate.get('primary')!r} must reach "
                            f"when there is no champion yet")
        full["floor"] = floor
    return full, problems


def _metric_problems(data: Mapping[str, Any]) -> list[str]:
    task, gate = data["task"], data["gate"]
    problems = []
    for key, name in [("gate.primary", gate["primary"]), *((f"gate.guards.{g}", g) for g in gate["guards"])]:
        try:
            metric(task, name)
        except UsageError as err:
            problems.append(f"{key}: {err}")
    for key in ("floor", "min_improvement"):
        if gate.get(key) is not None and not math.isfinite(gate[key]):
            problems.append(f"gate.{key}: must be a finite number, got {gate[key]}")
    problems.extend(f"gate.guards.{name}: tolerance must be a finite number, got {value}"
                    for name, value in gate["guards"].items() if not math.isfinite(value))
    if gate.get("positive_class") is not None and task != BINARY:
        problems.append(f"gate.positive_class: only a binary task has a positive class, this one is {task}; "
                        f"remove it")
    return problems


def _dag_id_problems(data: Mapping[str, Any]) -> list[str]:
    """A dag_id another DAG of the project takes (Airflow keeps one DAG per dag_id and fails the other file): the
    project's own DAG files', another pipeline's model search DAG's, an invalid declaration's stand-in's."""
    dag_id = data["dag_id"]
    if dag_id in PROJECT_DAG_IDS:
        taken = f"is the dag_id of the project's own DAG dags/{dag_id}.py"
    elif dag_id.endswith(SEARCH_DAG_SUFFIX):
        taken = (f"ends with {SEARCH_DAG_SUFFIX!r}, the dag_id of pipeline "
                 f"{dag_id.removesuffix(SEARCH_DAG_SUFFIX)!r}'s model search DAG")
    elif dag_id.startswith(INVALID_DAG_PREFIX):
        taken = f"begins with {INVALID_DAG_PREFIX!r}, the dag_id of the stand-in DAG of a declaration that is not valid"
    else:
        return []
    return [f"dag_id: {dag_id!r} {taken}; choose another dag_id"]


def _schedule_problems(data: Mapping[str, Any]) -> list[str]:
    """A cron schedule Airflow would refuse when it parses the DAG (naming neither file nor key), named here."""
    schedule = data.get("schedule")
    return [f"schedule: {problem}" for problem in cron_problems(schedule)] if isinstance(schedule, str) else []


def cron_problems(schedule: str, *, schema_form: bool = True) -> list[str]:
    """What Airflow would refuse in the schedule text `schedule` when it parses the DAG, naming neither file nor
    key (without the key: the caller names it): not of the schema's form (a preset it lists, or five fields), a
    cron croniter does not take, or one that never fires.

    `schema_form` False: the text is Airflow's to read as it is, not a declaration's (NIGHTSHIFT_RETRAIN_CRON, which
    the DAG factory checks with it): any cron croniter takes also passes, as Airflow takes it (six or seven fields,
    with seconds and year; croniter's own presets such as @midnight; fields apart by tabs)."""
    form = re.fullmatch(schema()["properties"]["schedule"]["pattern"], schedule) is not None
    if form and schedule.startswith("@"):
        return []
    if form or not schema_form:
        from croniter import croniter

        if croniter.is_valid(schedule):
            try:
                croniter(schedule).get_next(float)  # a day that never comes (30 February) fails only here
                return []
            except Exception as err:
                return [f"{schedule!r} never fires ({err}); name a day that exists, e.g. '0 2 28 2 *'"]
    return [f"{schedule!r} is not a valid cron expression (minute hour day-of-month month day-of-week, "
            f"e.g. '0 2 * * *' for 02:00 every day); fix it, or use a preset like '@daily'"]


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def resolve_suite(suite: str, base_dir: Path) -> Path:
    """The suite file `suite` names: 'gx:NAME' in the project's GX folder, else a path inside `base_dir`.

    UsageError (without the key, which the caller adds) when it names no file, leaves `base_dir` (through
    '..', an absolute path or a symbolic link), or is not a GX suite.
    """
    from nightshift.settings import gx_dir

    if suite.startswith(GX_PREFIX):
        name = suite.removeprefix(GX_PREFIX)
        if not name or not set(name) <= _SUITE_NAME_CHARS or name.startswith("."):
            raise UsageError(f"{suite!r} is not a GX suite name; write gx:NAME for gx/expectations/NAME.json "
                             f"(letters, digits, '_', '.', '-')")
        folder = gx_dir() / "expectations"
        path = folder / f"{name}.json"
        if not path.is_file():
            raise UsageError(f"GX suite {name!r} not found at {path}; create it (nightshift suite init) or set "
                             f"NIGHTSHIFT_GX_DIR to the project's gx/ folder")
    else:
        folder = base_dir
        given = Path(suite).expanduser()
        path = given if given.is_absolute() else base_dir / given
        if ".." in given.parts or not _inside(path, base_dir):
            raise UsageError(f"{suite!r} leaves the declaration's folder {base_dir}; keep suites inside it "
                             f"(e.g. suites/NAME.json) or name a suite of the project's gx/ folder as gx:NAME")
        if not path.is_file():
            raise UsageError(f"{suite!r}: no such file {path}; write one with `nightshift suite init DATA "
                             f"--label COL --out {suite}` or fix the path")
    _check_suite_file(path)
    return path.resolve()


def _check_suite_file(path: Path) -> None:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"{path} is not a GX expectation suite: not readable JSON ({err})") from err
    expectations = data.get("expectations") if isinstance(data, dict) else None
    if (not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(expectations, list)
            or not all(isinstance(e, dict) and isinstance(e.get("type"), str) and isinstance(e.get("kwargs"), dict)
                       for e in expectations)):
        raise UsageError(f"{path} is not a GX expectation suite: expected a JSON object with a 'name' and a "
                         f"list of 'expectations', each with a 'type' and 'kwargs' (see gx/expectations/*.json "
                         f"or write one with `nightshift suite init`)")
    if not expectations:
        raise UsageError(f"{path} is not a GX expectation suite to gate data with: it has no expectations, so "
                         f"any data would pass; write one with `nightshift suite init`")


def _data_problems(data: Mapping[str, Any]) -> list[str]:
    return [f"dataset.data.{key}: {value!r} climbs out with '..'; give a path under NIGHTSHIFT_HOME or an "
            f"absolute path under the data roots"
            for key, value in data["dataset"]["data"].items() if ".." in Path(value).parts]


def pipeline_from_dict(data: Mapping[str, Any], *, base_dir: str | Path | None = None,
                       source: str | Path | None = None) -> Pipeline:
    """See Pipeline.from_dict."""
    label = str(source) if source is not None else "<pipeline>"
    folder = Path(base_dir) if base_dir is not None else (Path(source).parent if source is not None else Path.cwd())
    problems = _json_problems(data) or schema_problems(data)
    if problems:
        raise PipelineInvalid(label, problems)
    filled = _with_defaults(data, schema())
    filled["gate"], problems = gate_with_task_defaults(filled["task"], filled["gate"])
    problems += (_dag_id_problems(filled) + _metric_problems(filled) + _data_problems(filled)
                 + _schedule_problems(filled))
    suite_path = None
    try:
        suite_path = resolve_suite(filled["suite"], folder)
    except UsageError as err:
        problems.append(f"suite: {err}")
    if problems or suite_path is None:
        raise PipelineInvalid(label, problems)
    dataset, gate, training, deploy = filled["dataset"], filled["gate"], filled["training"], filled["deploy"]
    return Pipeline(
        dag_id=filled["dag_id"],
        model_name=filled["model_name"],
        task=filled["task"],
        description=filled["description"],
        schedule=filled["schedule"],
        dataset=DatasetSpec(
            loader=dataset["loader"], label=dataset["label"], data=DataLocation(**dataset["data"]),
            asset=dataset["asset"] or filled["dag_id"],
            features=tuple(dataset["features"]) if dataset["features"] is not None else None,
            options=frozen(dataset["options"])),
        model=ModelSpec(name=filled["model"]["name"], kwargs=frozen(filled["model"]["kwargs"])),
        gate=GateSpec(primary=gate["primary"], floor=None if gate["floor"] is None else float(gate["floor"]),
                      min_improvement=float(gate["min_improvement"]),
                      guards=frozen({k: float(v) for k, v in gate["guards"].items()}),
                      positive_class=class_text(gate.get("positive_class"))),
        suite=filled["suite"],
        suite_path=suite_path,
        training=TrainingSpec(**training),
        deploy=DeploySpec(target=deploy["target"], require_approval=deploy["require_approval"],
                          options=frozen(deploy["options"])),
        retention=RetentionPolicy(**filled["retention"]),
        source=Path(source) if source is not None else None,
    )


# ---- files and folders -------------------------------------------------------------------------------------

def load_pipeline(path: str | Path) -> Pipeline:
    """The pipeline declared in the YAML file `path`; PipelineInvalid (a UsageError) naming the file, the key
    and what to do when it is not valid."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_DECLARATION_BYTES:
            raise PipelineInvalid(str(path), [_too_big(size)])
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise PipelineInvalid(str(path), [f"(top level): cannot be read ({err}); pass a readable YAML file"]) \
            from err
    return pipeline_from_dict(parse_yaml(text, str(path)), source=path)


def declaration_files(folder: str | Path) -> list[Path]:
    """The declarations of a pipelines folder: its *.yaml and *.yml files (not hidden ones), sorted."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"pipelines folder {folder} does not exist or is not a directory")
    files = {p for pattern in PATTERNS for p in folder.glob(pattern) if not p.name.startswith(".")}
    return sorted(files)


def load_pipelines(folder: str | Path) -> tuple[list[Pipeline], list[PipelineInvalid]]:
    """Every declaration of `folder`: (the valid pipelines, one PipelineInvalid per file that is not).

    Two files that declare the same dag_id, model_name or dataset asset are both refused, each naming the
    other (`clashes`): which one was meant is not for the loader to guess.
    """
    good: list[Pipeline] = []
    bad: dict[Path, list[str]] = {}
    errors: dict[Path, PipelineInvalid] = {}
    for file in declaration_files(folder):
        try:
            good.append(load_pipeline(file))
        except PipelineInvalid as err:
            errors[file] = err
    bad.update(clashes(good))
    for file, problems in bad.items():
        errors[file] = PipelineInvalid(str(file), problems)
    good = [p for p in good if Path(str(p.source)) not in bad]
    return good, [errors[file] for file in sorted(errors)]


# One pipeline each: a DAG, a registered model (its @champion and local server), an Airflow Asset it emits.
UNIQUE_KEYS = ("dag_id", "model_name", "dataset.asset")


def _unique_values(dag_id: Any, model_name: Any, asset: Any) -> dict[str, Any]:
    return {"dag_id": dag_id, "model_name": model_name, "dataset.asset": asset or dag_id}


def _clash(key: str, value: Any, others: Iterable[Any]) -> str:
    hint = " (it defaults to the dag_id)" if key == "dataset.asset" else ""
    return (f"{key}: {value!r} is also the {key} of {', '.join(str(o) for o in others)}; give each pipeline its "
            f"own {key}{hint}")


def clashes(pipelines: Iterable[Pipeline]) -> dict[Path, list[str]]:
    """{declaration file: one line per UNIQUE_KEYS value another of `pipelines` declares too}; a file given
    twice is one pipeline. Two pipelines of one dag_id are told so once, not again for their default asset."""
    unique = {Path(str(p.source)).resolve(): p for p in pipelines}
    found: dict[Path, list[str]] = {}
    for key in UNIQUE_KEYS:
        owners: dict[Any, list[Pipeline]] = {}
        for pipeline in unique.values():
            value = _unique_values(pipeline.dag_id, pipeline.model_name, pipeline.dataset.asset)[key]
            owners.setdefault(value, []).append(pipeline)
        for value, same in owners.items():
            for pipeline in same:
                others = [p.source for p in same if p is not pipeline
                          and (key != "dataset.asset" or p.dag_id != pipeline.dag_id)]
                if others:
                    found.setdefault(Path(str(pipeline.source)), []).append(_clash(key, value, others))
    return found


def airflow_dags_folder() -> Path:
    """The DAG folder Airflow reads when nothing else says: AIRFLOW__CORE__DAGS_FOLDER, else $AIRFLOW_HOME/dags
    (AIRFLOW_HOME: ~/airflow by default), as Airflow's own default configuration has it. The DAG factory asks
    Airflow's configuration instead (an airflow.cfg may set it)."""
    given = os.environ.get(DAGS_FOLDER_ENV, "").strip()
    if given:
        return Path(given).expanduser()
    return Path(os.environ.get("AIRFLOW_HOME", "").strip() or "~/airflow").expanduser() / AIRFLOW_DEFAULT_DAGS


def declaration_folders(dags_folder: str | Path | None = None) -> list[Path]:
    """The folders Airflow loads declarations from, whose dag_ids, model names and dataset assets must all differ:
    the DAG folder (`dags_folder`, default `airflow_dags_folder()`; a stub's declaration lies beside it, in any
    subfolder) and NIGHTSHIFT_PIPELINES (default: the `pipelines` folder beside the DAG folder, where the demo's
    declaration lies, read by dags/nightly_retrain.py). Only those that exist, each once, resolved."""
    dags = Path(dags_folder).expanduser() if dags_folder else airflow_dags_folder()
    pipelines = os.environ.get(PIPELINES_ENV, "").strip()
    candidates = [dags, Path(pipelines).expanduser() if pipelines else dags.parent / "pipelines"]
    return list(dict.fromkeys(folder.resolve() for folder in candidates if folder.is_dir()))


def _yaml_below(folder: Path) -> list[Path]:
    """The *.yaml and *.yml files of `folder` and its subfolders (not hidden ones, no __pycache__), sorted."""
    found: list[Path] = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        found.extend(Path(root) / name for name in files
                     if name.endswith(DECLARATION_SUFFIXES) and not name.startswith("."))
    return sorted(found)


def _names_any(text: str, values: Iterable[Any]) -> bool:
    """Whether YAML `text` holds one of the name `values` as a whole scalar: not inside a longer name (a scalar
    that went on with a letter, digit, '_', '.' or '-' would be another value)."""
    names = [re.escape(v) for v in values if isinstance(v, str)]
    return bool(names) and re.search(rf"(?<![\w.-])(?:{'|'.join(names)})(?![\w.-])", text) is not None


def _declared_keys(path: Path, wanted: Iterable[Any]) -> dict[str, Any] | None:
    """UNIQUE_KEYS of the declaration in `path`, only parsed, not validated (None for a file that is not one: a
    declaration that does not parse is its own DAG file's problem, another YAML file is none of ours), or None when
    it cannot declare any of the `wanted` values. Every DAG file of a declaration reads every YAML file of the DAG
    folder (a dbt project's too) at each parse, and the pure-Python parser takes ~6 ms for a page and seconds for
    a big file: text holding none of the values as a whole name, and no escape (`\\`) that could spell one, is
    not parsed. Only a regular file is read (a FIFO would block the parse, a link to /dev/zero never end)."""
    try:
        status = path.stat()
        if not stat.S_ISREG(status.st_mode) or status.st_size > MAX_DECLARATION_BYTES:
            return None
        text = path.read_text()
        if "\\" not in text and not _names_any(text, wanted):
            return None
        data = parse_yaml(text, str(path))
    except (PipelineInvalid, OSError, UnicodeDecodeError):
        return None
    dataset = data.get("dataset")
    keys = _unique_values(data.get("dag_id"), data.get("model_name"),
                          dataset.get("asset") if isinstance(dataset, dict) else None)
    return keys if isinstance(keys["dag_id"], str) else None


def declared_elsewhere(pipeline: Pipeline, folders: Iterable[str | Path], *, siblings: bool = True,
                       skip: Iterable[str | Path] = ()) -> list[str]:
    """One line (`KEY: what; what to do`, naming the other file) per dag_id, model_name or dataset asset of
    `pipeline` that another declaration declares too: one beside it (`siblings`) or in `folders` or any of their
    subfolders. Files in `skip` (and `pipeline`'s own) are not read. Two DAGs would share one @champion, trigger
    each other's consumers, or one would hide the other."""
    if pipeline.source is None:
        return []
    source = Path(pipeline.source)
    seen = {Path(p).resolve() for p in (source, *skip)}
    files = [*(declaration_files(source.parent) if siblings else []),
             *(file for folder in folders for file in _yaml_below(Path(folder)))]
    mine = _unique_values(pipeline.dag_id, pipeline.model_name, pipeline.dataset.asset)
    problems: list[str] = []
    for other in files:
        try:
            resolved = other.resolve()
        except (OSError, RuntimeError):  # a symlink loop (RuntimeError before Python 3.13): no declaration
            continue
        if resolved in seen:
            continue
        seen.add(resolved)
        theirs = _declared_keys(other, mine.values())
        if theirs is None:
            continue
        if theirs["dag_id"] == mine["dag_id"]:  # one DAG id: its model and asset clash too, said once
            problems.append(_clash("dag_id", mine["dag_id"], [other]))
            continue
        problems.extend(_clash(key, mine[key], [other]) for key in ("model_name", "dataset.asset")
                        if theirs[key] == mine[key])
    return problems


def check_unique(pipeline: Pipeline, folders: Iterable[str | Path] = ()) -> None:
    """PipelineInvalid naming both files when a declaration beside `pipeline`'s file, or in `folders` (the folders
    Airflow loads declarations from: `declaration_folders()`), declares its dag_id, model_name or dataset asset.

    `folders` count only when `pipeline`'s file lies in one of them: otherwise they are another copy of the
    project, not the tree this DAG file was loaded from (a GitDagBundle parses its own checkout of the repository
    while [core] dags_folder still names the working copy, whose declarations are the same ones), and only the
    declarations beside it are compared."""
    if pipeline.source is None:
        return
    source = Path(pipeline.source).resolve()
    folders = [Path(folder).resolve() for folder in folders]
    problems = declared_elsewhere(pipeline, folders if any(source.is_relative_to(f) for f in folders) else [])
    if problems:
        raise PipelineInvalid(str(pipeline.source), problems)
