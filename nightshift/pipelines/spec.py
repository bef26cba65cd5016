"""The typed form of a pipeline declaration: what a DAG factory reads to build one retraining DAG.

Built only by `nightshift.pipelines.load` (from a validated declaration); `Pipeline.to_dict()` gives the
declaration back with every default filled in, valid against the published schema. No heavy imports: a
DAG file reads these at parse time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from nightshift.retention import RetentionPolicy
from nightshift.tasks import DEFAULT_MIN_IMPROVEMENT, Metric, metric

SPLIT_NAMES = ("train", "validation", "test")
GX_PREFIX = "gx:"
# The built-in table loader (nightshift.datasets): it takes the label and the feature columns as options.
TABULAR = "tabular"
# Loaders that cannot use a missing value in a feature or the label: `tabular` refuses any, `digits` would train on
# NaN. A plugin's loader says so with an attribute `takes_missing_values = False` (nightshift.pipelines.check).
NO_MISSING_VALUES = frozenset({TABULAR, "digits"})
# The tasks a built-in loader loads, where not every task (`tabular`: any): `digits` is the demo's ten classes. A
# plugin's loader says so with an attribute `tasks = ("regression",)` (nightshift.pipelines.check).
LOADER_TASKS = {"digits": ("multiclass",)}
# A pipeline's model search DAG is named `<dag_id>__search` (nightly_tasks.search; the demo's is model_search).
SEARCH_DAG_SUFFIX = "__search"
# The dag_ids of the project's own DAG files (dags/model_search.py, dags/nightshift_maintenance.py: their DAG_ID), and
# the prefix of the stand-in DAG the factory makes for a declaration that is not valid: no declaration may take one
# (Airflow keeps one DAG per dag_id and fails the other file).
PROJECT_DAG_IDS = ("model_search", "nightshift_maintenance")
INVALID_DAG_PREFIX = "invalid_pipeline__"


def frozen(value: Any) -> Any:
    """A read-only deep copy of JSON-like `value`: mappings become MappingProxyType, lists tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): frozen(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(frozen(v) for v in value)
    return value


def plain(value: Any) -> Any:
    """`frozen`'s inverse: plain dicts and lists, ready for JSON or YAML."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    return value


@dataclass(frozen=True)
class DataLocation:
    """Where the data lies: a directory of the three splits, or one Parquet file per split. Paths as
    declared; `paths()` resolves relative ones against NIGHTSHIFT_HOME."""

    directory: str | None = None
    train: str | None = None
    validation: str | None = None
    test: str | None = None

    def paths(self, home: str | Path | None = None) -> dict[str, Path]:
        """{split: Parquet file}: relative paths taken from `home` (default: NIGHTSHIFT_HOME)."""
        from nightshift.settings import home as nightshift_home

        base = Path(home) if home is not None else nightshift_home()

        def resolve(text: str) -> Path:
            path = Path(text).expanduser()
            return path if path.is_absolute() else base / path

        if self.directory is not None:
            return {split: resolve(self.directory) / f"{split}.parquet" for split in SPLIT_NAMES}
        return {split: resolve(str(getattr(self, split))) for split in SPLIT_NAMES}

    def to_dict(self) -> dict[str, str]:
        if self.directory is not None:
            return {"directory": self.directory}
        return {split: str(getattr(self, split)) for split in SPLIT_NAMES}


@dataclass(frozen=True)
class DatasetSpec:
    loader: str
    label: str
    data: DataLocation
    asset: str
    features: tuple[str, ...] | None = None
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def loader_options(self) -> dict[str, Any]:
        """The keyword arguments the dataset factory gets (nightshift.datasets.load_split's `options`): the
        declared options, plus `label` and `features` for the built-in `tabular` loader."""
        options = plain(self.options)
        if self.loader == TABULAR:
            options["label"] = self.label
            if self.features is not None:
                options["features"] = list(self.features)
        return options


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


def class_text(value: Any) -> str | None:
    """A declared class label as the evaluator compares labels: as text, the way a label column reads
    (`1`, `fraud`, `True`); None stays None."""
    return None if value is None else str(value)


@dataclass(frozen=True)
class GateSpec:
    """The gate a declaration gets, the task's defaults filled in for what it left out
    (nightshift.pipelines.load.gate_with_task_defaults); field names are those of nightshift.evaluate.GateConfig.
    floor None: no floor (a regression task's default). positive_class (binary only, as text): the class F1 is
    computed for; None: the second of the label's sorted values (nightshift.tasks.DEFAULT_POSITIVE)."""

    primary: str
    floor: float | None
    min_improvement: float = DEFAULT_MIN_IMPROVEMENT
    guards: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    positive_class: str | None = None

    def config(self) -> dict[str, Any]:
        """The keyword arguments of nightshift.evaluate.GateConfig."""
        return {"primary": self.primary, "min_improvement": self.min_improvement, "floor": self.floor,
                "guards": dict(self.guards), "positive_class": self.positive_class}


@dataclass(frozen=True)
class TrainingSpec:
    """The trigger form's defaults. None: the deployment's default (backend, queue) or the best model
    search's, else the trainer's (learning_rate, batch_size, momentum)."""

    epochs: int = 5
    workers: int = 2
    gpus_per_worker: int = 0
    backend: str | None = None
    queue: str | None = None
    learning_rate: float | None = None
    batch_size: int | None = None
    momentum: float | None = None


@dataclass(frozen=True)
class DeploySpec:
    target: str = "local"
    require_approval: bool = False
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class Pipeline:
    """One validated pipeline declaration.

    `suite` is as declared ('gx:NAME' or a path relative to the declaration's folder); `suite_path` is the
    suite's file, resolved and checked to exist when the declaration was loaded. `source` is the
    declaration file (None when built from a dict).
    """

    dag_id: str
    model_name: str
    task: str
    dataset: DatasetSpec
    model: ModelSpec
    gate: GateSpec
    suite: str
    suite_path: Path
    schedule: str | None = None
    description: str = ""
    training: TrainingSpec = TrainingSpec()
    deploy: DeploySpec = DeploySpec()
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    source: Path | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, base_dir: str | Path | None = None,
                  source: str | Path | None = None) -> Pipeline:
        """Validate a declaration (as parsed from YAML) and build the Pipeline; PipelineInvalid otherwise.

        `base_dir`: the folder a relative `suite` path is taken from and confined to (default: the folder
        of `source`, else the current directory)."""
        from nightshift.pipelines.load import pipeline_from_dict

        return pipeline_from_dict(data, base_dir=base_dir, source=source)

    def __deepcopy__(self, memo: dict[int, Any]) -> Pipeline:
        # Read-only all the way down (frozen dataclasses, MappingProxyType, tuples), so a copy may share it; and
        # deepcopy refuses MappingProxyType. A DAG built from a pipeline holds it in its tasks, and Airflow and
        # `nightshift plan` deep-copy tasks and DAGs.
        return self

    @property
    def primary_metric(self) -> Metric:
        """The gate's primary metric, with the way it improves (nightshift.tasks)."""
        return metric(self.task, self.gate.primary)

    @property
    def dataset_asset_uri(self) -> str:
        """The Airflow Asset `stage_dataset` emits."""
        return f"nightshift://datasets/{self.dataset.asset}"

    @property
    def champion_asset_uri(self) -> str:
        """The Airflow Asset `deploy` emits."""
        return f"nightshift://models/{self.model_name}/champion"

    @property
    def search_dag_id(self) -> str:
        """The dag_id of the pipeline's model search DAG (nightly_tasks.search.search_dag)."""
        return f"{self.dag_id}{SEARCH_DAG_SUFFIX}"

    @property
    def search_asset_uri(self) -> str:
        """The Airflow Asset the search DAG's `finish` emits when it writes the pipeline's best.json."""
        return f"nightshift://search/{self.dag_id}/best"

    def to_dict(self) -> dict[str, Any]:
        """The declaration with every default filled in: plain JSON values, valid against the schema, and
        `Pipeline.from_dict(p.to_dict(), base_dir=...)` gives `p` back."""
        return {
            "dag_id": self.dag_id,
            "description": self.description,
            "model_name": self.model_name,
            "task": self.task,
            "schedule": self.schedule,
            "dataset": {
                "loader": self.dataset.loader,
                "label": self.dataset.label,
                "features": list(self.dataset.features) if self.dataset.features is not None else None,
                "options": plain(self.dataset.options),
                "asset": self.dataset.asset,
                "data": self.dataset.data.to_dict(),
            },
            "model": {"name": self.model.name, "kwargs": plain(self.model.kwargs)},
            "gate": self.gate.config(),
            "suite": self.suite,
            "training": {name: getattr(self.training, name) for name in TrainingSpec.__dataclass_fields__},
            "deploy": {"target": self.deploy.target, "require_approval": self.deploy.require_approval,
                       "options": plain(self.deploy.options)},
            "retention": self.retention.to_dict(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)
