"""MLflow tracking: one run per training task, and the self-contained servable model it logs.

The trainer's rank 0 calls `log_training_run(out_dir, ...)` once training ends. The run holds the
hyperparameters (from `model.json`), per-epoch metrics (from `metrics.jsonl`, step = epoch), the final
metrics (`metrics.json`) and a pyfunc model (`nightshift.served_model`) that takes the dataset's raw table
columns. The model carries its inference code (MLflow `code_paths`: the Nightshift modules it imports and
the user's model plugins) and requirements a package index can install, so it loads where MLflow models
load, not only in this project's virtualenv. Logging is idempotent by the tag `nightshift.run_key`.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from nightshift import settings
from nightshift.errors import TrackingError

# The served model lives in its own module; these names stay importable from here. NightshiftPyfunc in
# particular: models logged before the split pickled it by reference as nightshift.tracking.NightshiftPyfunc.
from nightshift.served_model import (  # noqa: F401  (re-exported)
    FEATURE_SPECS,
    MAX_ROWS,
    PREDICTION_COLUMN,
    SERVED_MODULES,
    SERVING_INFO,
    VALUE_COLUMN,
    FeatureSpec,
    NightshiftPyfunc,
    TorchTableClassifier,
    feature_spec,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger(__name__)

RUN_KEY_TAG = "nightshift.run_key"
# The digest of what the output was trained with (TrainConfig.train_key): data and code versions, parameters.
TRAIN_KEY_TAG = "nightshift.train_key"
MODEL_URI_TAG = "nightshift.model_uri"
COMPLETE_TAG = "nightshift.complete"
MODEL_ARTIFACT = "model"
# What the logged model's requirements.txt pins, at the versions installed where it was logged.
# mlflow-skinny is what pyfunc loading and `mlflow models serve` need; a full `mlflow` install satisfies it.
SERVED_REQUIREMENTS = ("mlflow-skinny", "torch", "numpy", "pandas", "cloudpickle")


# The process's MLflow configuration: (tracking URI, client), set once by configure().
_configured: tuple[str, MlflowClient] | None = None


def configure(uri: str | None = None) -> MlflowClient:
    """Point this process's MLflow at the tracking store, once, where the process starts: the CLIs' main,
    the trainer, a DAG task's entry point. `uri` defaults to the settings (MLFLOW_TRACKING_URI, else
    NIGHTSHIFT_HOME's SQLite store). Sets MLflow's own URIs too, for its fluent API (`mlflow.start_run`,
    `log_model`), and returns the client every library function here then uses. Calling it again
    re-points the process (a test with a new NIGHTSHIFT_HOME does).
    """
    global _configured
    import mlflow

    uri = uri or settings.mlflow_tracking_uri()
    point_mlflow(uri)
    with _store_creation_lock(uri):
        _configured = (uri, mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri))
    return _configured[1]


def point_mlflow(uri: str) -> None:
    """MLflow's own tracking and registry URIs (its fluent API's) set to `uri`, and nothing else:
    mlflow.set_tracking_uri also exports MLFLOW_TRACKING_URI (and the registry one) into os.environ, which would
    turn the process's default into a setting the user never made (children inherit os.environ) and outlive the
    store it names."""
    import mlflow

    saved = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    try:
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def _store_creation_lock(uri: str) -> Iterator[None]:
    """For a SQLite store file: an exclusive lock (`<file>.init-lock` beside it) held while the client is made.

    Making a client over a SQLite store creates and migrates its tables when they are missing, and MLflow's
    tracking store does so unlocked: two processes opening a new store at once (two pipelines' first runs
    sharing NIGHTSHIFT_HOME's store) both run the migrations, and one fails ("Online migration expected to
    match one row ..."). Under this lock the second finds the tables made. Other stores are left to their
    servers. The store's folder is made first, as MLflow would. Where the lock cannot be had (a read-only
    folder holding a store to read, a lock file of another user's), the client is made without it."""
    path = _sqlite_file(uri)
    handle = None
    if path is not None:
        lock = path.with_name(path.name + ".init-lock")
        with suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
        for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):  # flock needs no write access to the file
            try:
                handle = os.open(lock, flags | os.O_CLOEXEC, 0o666)
                break
            except OSError:
                continue
    if handle is None:
        yield
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # releases the lock


def _sqlite_file(uri: str) -> Path | None:
    """The file of a SQLite store URI (`sqlite:///PATH`, `sqlite+pysqlite:///PATH`...); None for an in-memory
    database, another store, or a URI SQLAlchemy cannot read (left to MLflow's own error)."""
    if not uri.lower().startswith("sqlite"):
        return None
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(uri)
    except ArgumentError:
        return None
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(str(url.database))


def client() -> MlflowClient:
    """The client configure() made; a process that never called it (a script using the library, a unit test)
    is configured from the settings on first use. Never changes MLflow's global state afterwards."""
    return _configured[1] if _configured is not None else configure()


def tracking_uri() -> str:
    """The tracking URI this process's MLflow uses (configuring it from the settings if nothing did)."""
    client()
    assert _configured is not None
    return _configured[0]


def ensure_experiment(name: str) -> str:
    """The experiment's id, creating it; with a local tracking store its artifacts go under
    NIGHTSHIFT_MLFLOW_ARTIFACTS (default NIGHTSHIFT_HOME/mlartifacts; an `s3://`/`gs://` URI is used as is)."""
    mlflow_client = client()
    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            mlflow_client.restore_experiment(experiment.experiment_id)
        return str(experiment.experiment_id)
    uri = tracking_uri()
    location = None
    if not uri.startswith(("http://", "https://", "databricks")):
        root_setting = settings.mlflow_artifact_root()
        if "://" in root_setting:  # an object store (s3://, gs://...): what KServe can fetch from
            location = f"{root_setting.rstrip('/')}/{name}"
        else:
            root = Path(root_setting)
            root.mkdir(parents=True, exist_ok=True)
            location = (root / name).as_uri()
    try:
        return str(mlflow_client.create_experiment(name, artifact_location=location))
    except Exception:  # created concurrently by another task
        experiment = mlflow_client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return str(experiment.experiment_id)


# --- logging a training run -------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise TrackingError(f"{path} is missing: is {path.parent} a finished training output?") from err
    except json.JSONDecodeError as err:
        raise TrackingError(f"{path} is not valid JSON ({err})") from err


def _epoch_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    lines = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise TrackingError(f"{path}:{number} is not a JSON line ({err})") from err
        if record.get("event") == "epoch":
            lines.append(record)
    return lines


def _numeric(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v))}


def _final_metrics(final: dict[str, Any], epochs: list[dict[str, Any]]) -> dict[str, float]:
    """Final metrics; a repeat of the last epoch's value is skipped, a different value is `final_*`."""
    last = _numeric(epochs[-1]) if epochs else {}
    out: dict[str, float] = {}
    for key, value in _numeric(final).items():
        if key not in last:
            out[key] = value
        elif last[key] != value:
            out[f"final_{key}"] = value
    return out


def flat_params(spec: dict[str, Any]) -> dict[str, str]:
    """Hyperparameters of `model.json` as MLflow params (`model`, `dataset`, `model.<k>`, `<param>`)."""
    params: dict[str, str] = {"model": str(spec.get("model")), "dataset": str(spec.get("dataset"))}
    for key, value in (spec.get("model_kwargs") or {}).items():
        params[f"model.{key}"] = json.dumps(value) if not isinstance(value, str) else value
    for key, value in (spec.get("params") or {}).items():
        params[str(key)] = json.dumps(value) if not isinstance(value, str) else value
    return {k: v[:6000] for k, v in params.items()}


def example_frame(spec: FeatureSpec, rows: int = 3) -> pd.DataFrame:
    """A deterministic input example inside the feature range."""
    if isinstance(spec.low, tuple) or isinstance(spec.high, tuple):  # one range per column: each its own grid
        lows = np.broadcast_to(np.asarray(spec.low, dtype=np.float64), (len(spec.columns),))
        highs = np.broadcast_to(np.asarray(spec.high, dtype=np.float64), (len(spec.columns),))
        lows = np.where(np.isinf(lows), np.where(np.isinf(highs), 0.0, highs - 1.0), lows)
        highs = np.where(np.isinf(highs), lows + 1.0, highs)
        return pd.DataFrame(np.linspace(lows, highs, num=rows), columns=list(spec.columns))
    low = 0.0 if math.isinf(spec.low) else spec.low
    high = 1.0 if math.isinf(spec.high) else spec.high
    grid = np.linspace(low, high, num=len(spec.columns) * rows, dtype=np.float64).reshape(rows, -1)
    return pd.DataFrame(grid, columns=list(spec.columns))


def tabular_example(preprocessing: dict[str, Any]) -> pd.DataFrame:
    """A tabular model's input example: rows at the train split's minimum, mean and maximum of every column."""
    return pd.DataFrame([preprocessing["min"], preprocessing["mean"], preprocessing["max"]],
                        columns=[str(c) for c in preprocessing["features"]], dtype=np.float64)


def model_signature(features: FeatureSpec, example: pd.DataFrame, prediction: pd.DataFrame) -> Any:
    """The logged model's signature. A strict (tabular) model declares its outputs only: MLflow's input
    enforcement drops a column the signature does not name before the model sees it, and a tabular model
    must refuse such a column by name. Its columns are recorded in the model's metadata
    (`nightshift.feature_columns`) and `serving.json`, and its own validation checks them."""
    from mlflow.models import ModelSignature, infer_signature

    inferred = infer_signature(example, prediction)
    return ModelSignature(outputs=inferred.outputs) if features.strict else inferred


def pip_requirements() -> list[str]:
    """The served model's requirements.txt: public versions a package index has, nothing local.

    torch is pinned without its local tag (`2.13.0`, never `2.13.0+cpu`): which build, CPU or CUDA, is
    the installing side's choice, made by the index it points pip at (the serving image's
    `TORCH_VARIANT`, `https://download.pytorch.org/whl/cpu` or `.../cu128`; plain PyPI gives the CUDA
    build on Linux x86_64). `torch==2.13.0` accepts any of them.
    """
    from packaging.version import Version

    return [f"{name}=={Version(metadata.version(name)).public}" for name in SERVED_REQUIREMENTS]


def _plugin_modules(spec: dict[str, Any]) -> list[str]:
    """The modules that made the model's name buildable here: NIGHTSHIFT_PLUGINS and a `module:factory`."""
    modules = [m.strip() for m in os.environ.get("NIGHTSHIFT_PLUGINS", "").split(",") if m.strip()]
    name = str(spec.get("model") or "")
    if ":" in name:
        modules.append(name.partition(":")[0])
    return list(dict.fromkeys(modules))


def _copy_module_source(module_name: str, dest: Path) -> Path:
    """Copy the top-level package (or single-file module) that `module_name` belongs to into `dest`."""
    top = module_name.split(".")[0]
    found = importlib.util.find_spec(top)
    if found is None:
        raise TrackingError(f"model plugin {module_name!r} cannot be found, so it cannot travel with the model")
    if found.submodule_search_locations:
        locations = list(found.submodule_search_locations)
        if len(locations) != 1:
            raise TrackingError(f"model plugin package {top!r} is a namespace package spread over {locations}; "
                                f"make it a regular package (with __init__.py) so it can travel with the model")
        target = dest / top
        shutil.copytree(locations[0], target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        return target
    if not found.origin or not found.origin.endswith(".py"):
        raise TrackingError(f"model plugin {module_name!r} is not Python source ({found.origin}); it cannot "
                            f"travel with the model: install it in the serving image instead")
    target = dest / Path(found.origin).name
    shutil.copy2(found.origin, target)
    return target


def _plugin_requirements(tops: set[str]) -> tuple[list[str], list[str]]:
    """Split plugin top-level modules into (source to ship, requirements): an installed distribution
    (torchvision, a user's pip-installed package) is a requirement at its installed version; a module
    that no distribution provides (the user's own code on PYTHONPATH) travels as source.
    """
    from packaging.version import Version

    provided = metadata.packages_distributions()
    ship, requirements = [], []
    for top in sorted(tops - {"nightshift"}):
        dists = provided.get(top)
        if dists:
            if dists[0] not in SERVED_REQUIREMENTS and top not in SERVED_REQUIREMENTS:
                requirements.append(f"{dists[0]}=={Version(metadata.version(dists[0])).public}")
        else:
            ship.append(top)
    return ship, requirements


def stage_code(dest: Path, ship: list[str]) -> list[str]:
    """Lay out the model's `code_paths` under `dest`: the Nightshift modules in SERVED_MODULES (as a
    package `nightshift/` holding only those), and the source of each top-level module in `ship`.
    """
    package = dest / "nightshift"
    root = Path(importlib.util.find_spec("nightshift").origin or "").parent  # type: ignore[union-attr]
    for module_name in SERVED_MODULES:
        found = importlib.util.find_spec(module_name)
        if found is None or not found.origin:
            raise TrackingError(f"served-model module {module_name} not found under {root}")
        relative = Path(found.origin).relative_to(root)
        (package / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(found.origin, package / relative)
    return [str(package), *(str(_copy_module_source(top, dest)) for top in ship)]


def _find_run(mlflow_client: MlflowClient, experiment_id: str, run_key: str,
              include_superseded: bool = False) -> list[Any]:
    """Runs tagged with `run_key` (and, with `include_superseded`, those whose key was renamed
    `<run_key>#superseded-<run id>`), newest first."""
    quoted = run_key
    if not include_superseded:
        return list(mlflow_client.search_runs([experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{quoted}'",
                                              max_results=10, order_by=["attributes.start_time DESC"]))
    runs = mlflow_client.search_runs([experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` LIKE '{quoted}%'",
                                     max_results=200, order_by=["attributes.start_time DESC"])
    return [run for run in runs if run.data.tags.get(RUN_KEY_TAG) == run_key
            or str(run.data.tags.get(RUN_KEY_TAG, "")).startswith(f"{run_key}#superseded-")]


def _write_record(out_dir: Path, record: dict[str, Any]) -> None:
    from nightshift.fsutil import atomic_write_json
    from nightshift.train.artifacts import RUN_RECORD

    atomic_write_json(out_dir / RUN_RECORD, record)


def log_training_run(out_dir: str | Path, *, experiment: str, run_name: str | None = None,
                     tags: dict[str, str] | None = None) -> str:
    """Log a finished training output directory as one MLflow run; return its run_id.

    With `tags["nightshift.run_key"]`, a complete run with that key *and the same train key* (the digest of
    the data version, code version and training parameters the output was trained with, `model.json`) is
    returned as is, and an incomplete one (a crash mid-logging) is deleted and logged again, so a retried
    task ends with exactly one run. A complete run with that key but another train key (a DAG run cleared
    after its data changed) is never handed back: its run key tag is renamed `<key>#superseded-<run id>`
    (the run and any model version made from it stay) and this output is logged as a new run.
    """
    import mlflow

    from nightshift.models import MODELS
    from nightshift.train.artifacts import METRICS_LOG, METRICS_SUMMARY, MODEL_FILE, MODEL_INFO

    out = Path(out_dir)
    spec = _read_json(out / MODEL_INFO)
    final = _read_json(out / METRICS_SUMMARY)
    epochs = _epoch_metrics(out / METRICS_LOG)
    if not (out / MODEL_FILE).is_file():
        raise TrackingError(f"{out / MODEL_FILE} is missing: is {out} a finished training output?")
    tags = dict(tags or {})
    train_key = str(spec.get("train_key") or "")
    if train_key:
        tags[TRAIN_KEY_TAG] = train_key
    mlflow_client = client()
    experiment_id = ensure_experiment(experiment)
    run_key = tags.get(RUN_KEY_TAG)
    if run_key:
        for run in _find_run(mlflow_client, experiment_id, run_key):
            if run.data.tags.get(COMPLETE_TAG) != "true":
                mlflow_client.delete_run(run.info.run_id)
            elif train_key and run.data.tags.get(TRAIN_KEY_TAG) == train_key:
                _write_record(out, _record(run.info.run_id, experiment_id, run.data.tags[MODEL_URI_TAG]))
                return str(run.info.run_id)
            else:
                superseded = f"{run_key}#superseded-{run.info.run_id}"
                mlflow_client.set_tag(run.info.run_id, RUN_KEY_TAG, superseded)
                log.warning("MLflow run %s has run key %s but was trained on other data, code or parameters "
                            "(train key %s, now %s): not reusing it; its run key is now %s", run.info.run_id,
                            run_key, run.data.tags.get(TRAIN_KEY_TAG, "none"), train_key or "none", superseded)

    preprocessing = spec.get("preprocessing")
    features = feature_spec(spec["dataset"], spec.get("input_shape"), preprocessing)
    classifier = TorchTableClassifier(out)
    plugins = _plugin_modules(spec)
    factory = MODELS.get(str(spec["model"]))
    ship, plugin_requirements = _plugin_requirements(
        {m.split(".")[0] for m in (*plugins, str(getattr(factory, "__module__", "nightshift")))})
    example = tabular_example(preprocessing) if preprocessing is not None else example_frame(features)
    signature = model_signature(features, example, classifier.predict(example))
    run = mlflow_client.create_run(experiment_id, run_name=run_name, tags=tags)
    run_id = str(run.info.run_id)
    try:
        with mlflow.start_run(run_id=run_id):
            mlflow.log_params(flat_params(spec))
            # A resumed training appends an epoch again: the last line for an epoch wins.
            for step, record in sorted({int(r["epoch"]): r for r in epochs}.items()):
                mlflow.log_metrics(_numeric({k: v for k, v in record.items()
                                             if k not in {"event", "epoch", "step"}}), step=step)
            mlflow.log_metrics(_final_metrics(final, epochs))
            for name in (MODEL_INFO, METRICS_SUMMARY, METRICS_LOG):
                if (out / name).is_file():
                    mlflow.log_artifact(str(out / name), artifact_path="training")
            with tempfile.TemporaryDirectory() as staging:
                model_dir, code_dir = Path(staging) / "model_dir", Path(staging) / "code"
                model_dir.mkdir()
                # Only the weights and their description go into the model: not checkpoints, not logs.
                for name in (MODEL_FILE, MODEL_INFO):
                    (model_dir / name).write_bytes((out / name).read_bytes())
                (model_dir / SERVING_INFO).write_text(json.dumps(
                    {"features": features.to_json(), "plugins": plugins}, indent=2, sort_keys=True))
                info = mlflow.pyfunc.log_model(
                    name=MODEL_ARTIFACT,
                    python_model=NightshiftPyfunc(),
                    artifacts={"model_dir": str(model_dir)},
                    code_paths=stage_code(code_dir, ship),
                    signature=signature,
                    input_example=example,
                    pip_requirements=[*pip_requirements(), *plugin_requirements],
                    metadata={"nightshift.task": classifier.task,
                              "nightshift.feature_columns": list(features.columns),
                              **({"nightshift.label_column": preprocessing["label"]} if preprocessing else {})},
                )
            mlflow.set_tags({MODEL_URI_TAG: info.model_uri, COMPLETE_TAG: "true"})
    except Exception as err:
        mlflow_client.delete_run(run_id)
        raise TrackingError(f"logging {out} to MLflow experiment {experiment!r} failed "
                            f"({type(err).__name__}: {err}); the partial run was deleted") from err
    _write_record(out, _record(run_id, experiment_id, info.model_uri))
    return run_id


def _record(run_id: str, experiment_id: str, model_uri: str) -> dict[str, Any]:
    return {"run_id": run_id, "experiment_id": experiment_id, "model_uri": model_uri,
            "tracking_uri": tracking_uri()}


def find_training_run(experiment: str, run_key: str, expect: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The complete training run tagged `nightshift.run_key=run_key`: id, experiment, model URI, metrics.

    This is how a training job's result comes back to Airflow: through the tracking server, never through
    files on the Airflow worker's disk (the job may have run on other machines). With `expect` (tags such as
    the dataset and code version the task trained for) only a run carrying every one of them is taken: the
    run holding the key if it matches, else the newest matching run that another output superseded (a stale
    try that logged last renames the current run's key; it must not hand back its own model).
    """
    mlflow_client = client()
    found = mlflow_client.get_experiment_by_name(experiment)
    where = f"experiment {experiment!r} at {tracking_uri()}"
    if found is None:
        raise TrackingError(f"no {where}")
    superseded = f"{run_key}#superseded-"
    candidates = [run for run in _find_run(mlflow_client, str(found.experiment_id), run_key,
                                           include_superseded=bool(expect))
                  if run.data.tags.get(COMPLETE_TAG) == "true"]
    holder = [run for run in candidates if run.data.tags.get(RUN_KEY_TAG) == run_key]
    if expect:
        wanted = {k: str(v) for k, v in expect.items()}
        matching = [run for run in candidates if all(run.data.tags.get(k) == v for k, v in wanted.items())
                    and (run.data.tags.get(RUN_KEY_TAG) == run_key
                         or str(run.data.tags.get(RUN_KEY_TAG, "")).startswith(superseded))]
        matching.sort(key=lambda run: (run.data.tags.get(RUN_KEY_TAG) == run_key, run.info.start_time or 0),
                      reverse=True)
        if not matching:
            there = ", ".join(f"{k}={holder[0].data.tags.get(k)!r}" for k in wanted) if holder else "no complete run"
            raise TrackingError(f"no complete run tagged {RUN_KEY_TAG}={run_key!r} with "
                                f"{', '.join(f'{k}={v!r}' for k, v in wanted.items())} in {where} ({there} holds the "
                                f"key); the training job did not log a model for this data and code: retry the task")
        holder = matching
    if not holder:
        raise TrackingError(f"no complete run tagged {RUN_KEY_TAG}={run_key!r} in {where}")
    run = holder[0]
    return {"run_id": str(run.info.run_id), "experiment_id": str(found.experiment_id),
            "model_uri": run.data.tags[MODEL_URI_TAG], "metrics": dict(run.data.metrics)}


def run_model_uri(run_id: str) -> str:
    """The model URI a complete Nightshift training run logged."""
    mlflow_client = client()
    try:
        run = mlflow_client.get_run(run_id)
    except Exception as err:
        raise TrackingError(f"MLflow run {run_id} not found in {tracking_uri()} "
                            f"({err})") from err
    uri = run.data.tags.get(MODEL_URI_TAG)
    if not uri or run.data.tags.get(COMPLETE_TAG) != "true":
        raise TrackingError(f"MLflow run {run_id} has no complete Nightshift model; re-run the training task")
    return str(uri)
