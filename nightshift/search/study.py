"""Optuna studies of a model search: settings, storage, sampler and pruner, ask and tell, the report.

A study lives in a real database: SQLite under NIGHTSHIFT_HOME (`search/optuna.db`) by default, or any
SQLAlchemy URL Optuna takes (PostgreSQL: `postgresql://user@host:5432/db`). The search's settings are
stored in the study (user attribute `nightshift.search`), so every process that opens it by name (the
CLI, an Airflow task, a trainer's rank 0) builds the same pruner, and a study is never continued with
other settings. The settings name the pipeline the search is for (`nightshift.search.pipeline`), and the
objective follows the task its trials train: the validation accuracy maximised, or for a regression the
validation RMSE minimised (`nightshift.tasks.validation_metric`).

Sampling is seeded per trial (`seed`, trial number): the same settings give the same configurations
whichever process asks, one after another or several at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from nightshift import processes
from nightshift import settings as nightshift_settings
from nightshift.errors import UsageError
from nightshift.search.errors import StudyMismatch
from nightshift.search.pipeline import DEFAULT_PIPELINE, check_pipeline, search_dir
from nightshift.tasks import MULTICLASS, validation_metric

if TYPE_CHECKING:
    import optuna

    from nightshift.search.space import SearchSpace

PRUNERS = ("asha", "hyperband", "none")  # none: every trial runs to max_epochs (a baseline)
SAMPLERS = ("tpe", "random")
# Trial and study user attributes.
SETTINGS_ATTR = "nightshift.search"
OWNER_ATTR = "nightshift.owner"
EPOCH_ATTR = "nightshift.epoch."  # + zero-padded epoch: that epoch's metrics
PRUNED_ATTR = "nightshift.pruned_at_epoch"
ERROR_ATTR = "nightshift.error"
RANKS_ATTR = "nightshift.ranks"
STORAGE_SCHEMES = ("sqlite", "postgresql", "mysql")


@dataclass(frozen=True)
class SearchSettings:
    """What a study searches and how; stored in the study, compared when it is opened again."""

    space: dict[str, Any]
    data: str
    max_epochs: int
    fixed: dict[str, Any] = field(default_factory=dict)
    min_epochs: int = 1
    reduction_factor: int = 3
    pruner: str = "asha"
    sampler: str = "tpe"
    seed: int = 0
    startup_trials: int = 10
    # The dag_id of the pipeline whose best.json the search writes (a study stored before it had one: the default).
    pipeline: str = DEFAULT_PIPELINE
    # What the pipeline's declaration trained when the search started (pipeline.declared_training; None: a search
    # without a declaration), written into best.json so training can tell a best of an older declaration.
    declared: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check_pipeline(self.pipeline)
        for name, minimum in (("max_epochs", 1), ("min_epochs", 1), ("reduction_factor", 2), ("startup_trials", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= {minimum}, got {value!r}")
        if self.min_epochs > self.max_epochs:
            raise UsageError(f"--min-epochs ({self.min_epochs}) must not exceed --max-epochs ({self.max_epochs})")
        if self.pruner not in PRUNERS:
            raise UsageError(f"--pruner must be one of {', '.join(PRUNERS)}, got {self.pruner!r}")
        if self.sampler not in SAMPLERS:
            raise UsageError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise UsageError(f"--seed must be an integer, got {self.seed!r}")

    @property
    def task(self) -> str:
        """What the trials train (the `task` fixed option, else the trainer's default)."""
        return str(self.fixed.get("task", MULTICLASS))

    @property
    def objective(self) -> str:
        """The metric trials report after every epoch and the study optimises: `val_accuracy`, `val_rmse`."""
        return f"val_{validation_metric(self.task).name}"

    @property
    def direction(self) -> Literal["maximize", "minimize"]:
        return "maximize" if validation_metric(self.task).higher_is_better else "minimize"

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self), sort_keys=True))

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> SearchSettings:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in value.items() if k in known})

    def default_study_name(self) -> str:
        """A name that is the same for the same settings: running the same search again continues it."""
        digest = hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()
        return f"search-{digest[:12]}"


# --- storage, sampler, pruner ---------------------------------------------------------------------


def default_storage() -> str:
    path = nightshift_settings.home() / "search" / "optuna.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def study_dir(study: str, pipeline: str = DEFAULT_PIPELINE) -> Path:
    """The folder of `study` in its pipeline's (NIGHTSHIFT_HOME/search/<pipeline>): its trials' outputs and its
    report page. UsageError for a study named as the pipeline's best.json files are."""
    from nightshift.fsutil import safe_name

    name = safe_name(study)  # injective: never another study's folder
    if re.fullmatch(r"best(-v\d+)?\.json", name):
        raise UsageError(f"study name {study!r} is the name of the pipeline's best configuration file; name the "
                         f"study otherwise")
    return search_dir(pipeline) / name


def check_storage(url: str) -> str:
    """`url` when it is a database URL Optuna can use without a password in it, else UsageError.

    The URL travels on trainer command lines (where `ps` shows them) and into MLflow and best.json: give
    a PostgreSQL password through ~/.pgpass or PGPASSFILE (libpq reads it), never in the URL.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.split("+")[0]
    if scheme not in STORAGE_SCHEMES:
        raise UsageError(f"--storage {url!r} is not a database URL ({', '.join(STORAGE_SCHEMES)}), "
                         f"e.g. postgresql://user@127.0.0.1:5432/optuna or sqlite:////abs/path/optuna.db")
    if parts.password is not None:
        raise UsageError("--storage must not hold a password (it would show on trainer command lines and in "
                         "MLflow); put it in ~/.pgpass or PGPASSFILE")
    return url


def _sqlite_folder(url: str) -> str:
    """`url`, with the folder of a SQLite file created (SQLite creates the file, not its folder)."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        folder = Path(str(parsed.database)).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UsageError(f"cannot use the study storage {url}: cannot create {folder} "
                             f"({err.strerror})") from err
    return url


@contextmanager
def _storage_errors(url: str) -> Iterator[None]:
    """A database that cannot be reached or opened, as one line naming the URL."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except SQLAlchemyError as err:
        reason = str(getattr(err, "orig", None) or err).strip().splitlines()[0]
        raise UsageError(f"cannot use the study storage {url}: {reason}") from err


def build_pruner(settings: SearchSettings) -> optuna.pruners.BasePruner:
    import optuna

    if settings.pruner == "none":
        return optuna.pruners.NopPruner()
    if settings.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=settings.min_epochs, max_resource=settings.max_epochs,
                                              reduction_factor=settings.reduction_factor)
    # Asynchronous successive halving: rungs at min_epochs x reduction_factor^k epochs.
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=settings.min_epochs,
                                                  reduction_factor=settings.reduction_factor)


def trial_seed(settings: SearchSettings, number: int) -> int:
    digest = hashlib.sha256(f"{settings.seed}/{number}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def build_sampler(settings: SearchSettings, number: int = 0) -> optuna.samplers.BaseSampler:
    """The sampler for trial `number`, seeded by (seed, number): whichever process asks gets the same."""
    import optuna

    seed = trial_seed(settings, number)
    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=settings.startup_trials)


# --- opening studies ------------------------------------------------------------------------------


def open_study(storage: str, name: str, settings: SearchSettings) -> optuna.Study:
    """Create the study, or open it when it exists with the same settings (StudyMismatch otherwise)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with _storage_errors(storage):
        study = optuna.create_study(storage=_sqlite_folder(check_storage(storage)), study_name=name,
                                    direction=settings.direction, load_if_exists=True,
                                    pruner=build_pruner(settings), sampler=build_sampler(settings))
    stored = study.user_attrs.get(SETTINGS_ATTR)
    wanted = settings.to_json()
    if isinstance(stored, dict):  # with the defaults of the settings added since it was stored
        stored = SearchSettings.from_json(stored).to_json()
    if stored is None:
        study.set_user_attr(SETTINGS_ATTR, wanted)
    elif stored != wanted:
        differ = sorted(k for k in set(stored) | set(wanted) if stored.get(k) != wanted.get(k))
        raise StudyMismatch(f"study {name!r} in {storage} was created with other settings ({', '.join(differ)} "
                            f"differ): pass another --study, or the same settings to continue it")
    if [d.name for d in study.directions] != [settings.direction.upper()]:
        raise StudyMismatch(f"study {name!r} in {storage} is not a single-objective {settings.direction[:-1]}ation "
                            f"of {settings.objective}: pass another --study")
    return study


def load_study(storage: str, name: str) -> tuple[optuna.Study, SearchSettings]:
    """An existing search study with its stored settings, its pruner and sampler built from them."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with _storage_errors(storage):
            probe = optuna.load_study(study_name=name, storage=check_storage(storage))
    except KeyError as err:
        raise UsageError(f"no study {name!r} in {storage}") from err
    stored = probe.user_attrs.get(SETTINGS_ATTR)
    if not isinstance(stored, dict):
        raise UsageError(f"study {name!r} in {storage} is not a Nightshift search (no {SETTINGS_ATTR!r} attribute)")
    settings = SearchSettings.from_json(stored)
    study = optuna.load_study(study_name=name, storage=probe._storage, pruner=build_pruner(settings),
                              sampler=build_sampler(settings))
    return study, settings


# --- ask and tell ----------------------------------------------------------------------------------


def process_owner() -> dict[str, Any]:
    """Who runs a trial asked by this process: host, pid and the process's start time (pid reuse)."""
    return {"kind": "process", **processes.identity(os.getpid())}


def _owner_alive(owner: dict[str, Any]) -> bool:
    if owner.get("kind") != "process" or not processes.on_this_host(owner):
        return True  # not ours to judge: another machine, or an Airflow task (its DAG run finalises it)
    return processes.start_ticks(int(owner["pid"])) == owner.get("start")


def ask_trial(study: optuna.Study, space: SearchSpace, settings: SearchSettings, *, owner: dict[str, Any],
              ranks: int = 1) -> tuple[optuna.Trial, dict[str, Any]]:
    """A new RUNNING trial and its parameters, sampled with the trial's own seed."""
    trial = study.ask()
    # Optuna samples when a parameter is suggested (relative parameters too, lazily), so the sampler
    # seeded for this trial number is in place before any value is drawn.
    study.sampler = build_sampler(settings, trial.number)
    try:
        params = space.suggest(trial)
        trial.set_user_attr(OWNER_ATTR, owner)
        trial.set_user_attr(RANKS_ATTR, ranks)
    except BaseException as err:
        fail_trial(study, trial.number, f"asking for parameters failed: {type(err).__name__}: {err}")
        raise
    return trial, params


def fail_trial(study: optuna.Study, number: int, reason: str) -> None:
    """Mark trial `number` FAIL with `reason` (nothing when it already finished)."""
    import optuna

    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
    if study._storage.get_trial(trial_id).state.is_finished():
        return
    study._storage.set_trial_user_attr(trial_id, ERROR_ATTR, reason[:2000])
    study.tell(number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)


def fail_stale(study: optuna.Study) -> list[int]:
    """Mark FAIL the RUNNING trials whose process on this machine is gone (killed, out of memory)."""
    import optuna

    failed = []
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        owner = trial.user_attrs.get(OWNER_ATTR)
        if isinstance(owner, dict) and not _owner_alive(owner):
            fail_trial(study, trial.number, f"its process {owner.get('pid')} on {owner.get('host')} ended "
                                            f"without telling the study")
            failed.append(trial.number)
    return failed


def epoch_metrics(trial: optuna.trial.FrozenTrial) -> dict[int, dict[str, float]]:
    """The metrics of every epoch the trainer reported, by epoch."""
    return {int(k[len(EPOCH_ATTR):]): v for k, v in sorted(trial.user_attrs.items())
            if k.startswith(EPOCH_ATTR) and isinstance(v, dict)}


# --- the report ------------------------------------------------------------------------------------


def trial_summary(trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    """`number`, `state`, `epochs` (trained) and `value`: the final objective (val_accuracy, val_rmse) of a
    COMPLETE trial, the last one a PRUNED trial reported, none for FAIL."""
    value: float | None = None
    if trial.state.name == "COMPLETE":
        value = trial.value
    elif trial.state.name == "PRUNED" and trial.intermediate_values:
        value = trial.intermediate_values[max(trial.intermediate_values)]
    summary: dict[str, Any] = {"number": trial.number, "state": trial.state.name,
                               "epochs": len(trial.intermediate_values), "value": value, "params": trial.params}
    if ERROR_ATTR in trial.user_attrs:
        summary["error"] = trial.user_attrs[ERROR_ATTR]
    return summary


def compute_hours(trials: list[optuna.trial.FrozenTrial], now: datetime | None = None) -> float:
    """Wall time of every trial (running ones until `now`) times its ranks, in hours."""
    total = 0.0
    for trial in trials:
        if trial.datetime_start is None:
            continue
        end = trial.datetime_complete or now or datetime.now()
        total += max((end - trial.datetime_start).total_seconds(), 0.0) * int(trial.user_attrs.get(RANKS_ATTR, 1))
    return total / 3600


def study_report(study: optuna.Study, settings: SearchSettings) -> dict[str, Any]:
    """What `nightshift search` prints: the study, its best trial and every trial."""
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    best = None
    if complete:
        top = study.best_trial
        best = {"trial": top.number, "params": top.params, "value": top.value}
    return {
        "study": study.study_name,
        "pipeline": settings.pipeline,
        "objective": settings.objective,
        "direction": settings.direction,
        "best": best,
        "trials": [trial_summary(t) for t in trials],
        "epochs_spent": sum(len(t.intermediate_values) for t in trials),
        "max_epochs": settings.max_epochs,
        "pruner": settings.pruner,
        "sampler": settings.sampler,
        "compute_hours": round(compute_hours(trials), 6),
    }
