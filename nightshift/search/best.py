"""The best configuration a search found, where training reads its defaults: one best.json per pipeline,
`NIGHTSHIFT_HOME/search/<pipeline>/best.json` (`nightshift.search.pipeline`).

Written atomically with its pipeline and lineage (study, storage, trial, MLflow parent and trial runs, data)
and a version that grows by one whenever the content changes; every version is kept beside it as
`best-v<N>.json`. Writing the same best again changes nothing, so a retried task or a re-run search does not
bump the version. A search writes its own pipeline's file only, so two pipelines' searches never overwrite
each other's best.

`training_defaults` is how a pipeline's DAG (`nightly_retrain` and the others) reads its own file, at run time: a
training parameter the trigger left empty (null) takes best.json's value, else the declaration's model and the
trainer's built-in default; one the trigger set wins. `NIGHTSHIFT_HOME/search/best.json`, written before searches
were per pipeline (naming none), is read for nightly_retrain alone, until a search writes nightly_retrain's own.
"""

from __future__ import annotations

import fcntl
import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nightshift import settings
from nightshift.errors import UsageError
from nightshift.fsutil import atomic_write_json
from nightshift.search.errors import BestConfigInvalid
from nightshift.search.pipeline import DEFAULT_PIPELINE, search_dir

# nightly_retrain's training Params -> the trainer options they set, in the order they are reported.
RETRAIN_PARAMS = {"learning_rate": "lr", "batch_size": "batch_size", "momentum": "momentum",
                  "model_kwargs": "model_kwargs"}
# Taken from best.json together with `model_kwargs` (arguments are for their model); no Param of its own.
MODEL = "model"
# The pipeline a best.json without `pipeline` was searched for: before searches were per pipeline, every search
# was of nightly_retrain's demo digits and named no pipeline.
SEARCHED_PIPELINE = DEFAULT_PIPELINE
BEST_NAME = "best.json"


def best_path(pipeline: str = SEARCHED_PIPELINE) -> Path:
    """The best.json a search of `pipeline` writes: NIGHTSHIFT_HOME/search/<pipeline>/best.json."""
    return search_dir(pipeline) / BEST_NAME


def legacy_best_path() -> Path:
    """NIGHTSHIFT_HOME/search/best.json: where every search wrote before searches were per pipeline."""
    return settings.home() / "search" / BEST_NAME


def pipeline_best_path(pipeline: str) -> Path:
    """The best.json `pipeline`'s training reads: its own, else for nightly_retrain the one written before
    searches were per pipeline, when that exists and its own does not."""
    own = best_path(pipeline)
    if pipeline == SEARCHED_PIPELINE and not own.exists() and legacy_best_path().exists():
        return legacy_best_path()
    return own


def read_best(path: Path | None = None) -> dict[str, Any] | None:
    """The current best configuration, or None when no search has written one."""
    path = path or best_path()
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return value if isinstance(value, dict) else None


def write_best(record: dict[str, Any], path: Path | None = None) -> dict[str, Any]:
    """Write `record` (without version and time) as the new best of its pipeline (default path: that pipeline's
    best.json, nightly_retrain's for a record naming none); return what is in the file now.

    Two searches of one pipeline may finish together (the CLI and the DAG): the read, the version and both writes
    happen under a lock beside the file, and a version already in the history is never written over (the next
    version is past the highest `best-v<N>.json` there), so each finished search keeps its own version."""
    path = path or best_path(record.get("pipeline") or SEARCHED_PIPELINE)
    path.parent.mkdir(parents=True, exist_ok=True)
    with (path.parent / f".{path.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        current = read_best(path)
        if current is not None and {k: v for k, v in current.items() if k not in ("version", "written_at")} == record:
            return current
        history = [int(m.group(1)) for p in path.parent.glob(f"{path.stem}-v*.json")
                   if (m := re.fullmatch(rf"{re.escape(path.stem)}-v(\d+)\.json", p.name))]
        version = max([int(current.get("version", 0)) if current else 0, *history]) + 1
        payload = {**record, "version": version, "written_at": datetime.now(UTC).isoformat(timespec="seconds")}
        atomic_write_json(path.with_name(f"{path.stem}-v{version}.json"), payload, overwrite=False)
        atomic_write_json(path, payload)
        return payload


def best_record(report: dict[str, Any], *, storage: str, data: str, max_epochs: int, train_options: dict[str, Any],
                mlflow: dict[str, Any], pipeline: str | None = None,
                declared: dict[str, Any] | None = None) -> dict[str, Any]:
    """The content of best.json for a study report whose best trial is `report["best"]`; `pipeline`: the dag_id
    of the pipeline the search was for, the only one whose training it fills (None: SEARCHED_PIPELINE, for a
    record without it); `declared`: what that pipeline's declaration trained then (SearchSettings.declared),
    which its training compares with its declaration now."""
    best = report["best"]
    return {
        **({"pipeline": pipeline} if pipeline else {}),
        **({"declared": declared} if declared is not None else {}),
        "study": report["study"],
        "storage": storage,
        "trial": best["trial"],
        "objective": report["objective"],
        "value": best["value"],
        "params": best["params"],
        # What a training run passes to the trainer to train this configuration (epochs: max_epochs).
        "train_options": {**train_options, "epochs": max_epochs},
        "data": data,
        "mlflow": mlflow,
    }


def load_best(path: Path | None = None) -> dict[str, Any] | None:
    """best.json, checked: None when no search has written one; BestConfigInvalid, naming the file and
    what is wrong, when it cannot be used."""
    path = path or best_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise _invalid(path, f"cannot be read ({err.strerror})") from err
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise _invalid(path, f"is not JSON ({err})") from err
    if not isinstance(value, dict):
        raise _invalid(path, f"must hold a JSON object, not {type(value).__name__}")
    for key, kind in (("study", str), ("trial", int), ("version", int), ("train_options", dict)):
        if not isinstance(value.get(key), kind) or isinstance(value.get(key), bool):
            raise _invalid(path, f"has no {key!r} ({kind.__name__}), got {value.get(key)!r}")
    options = value["train_options"]
    checks = {"lr": (_positive_number, "a positive number"), "batch_size": (_positive_int, "a positive integer"),
              "momentum": (_momentum, "a number in [0, 1)"), "model": (_name, "a model name"),
              "model_kwargs": (lambda v: isinstance(v, dict), "a JSON object")}
    if "pipeline" in value and not _name(value["pipeline"]):
        raise _invalid(path, f"has a 'pipeline' that is not a dag_id, got {value['pipeline']!r}")
    if "declared" in value and not isinstance(value["declared"], dict):
        raise _invalid(path, f"has a 'declared' that is not a JSON object, got {value['declared']!r}")
    for key, (valid, wanted) in checks.items():
        if key in options and not valid(options[key]):
            raise _invalid(path, f"train_options.{key} must be {wanted}, got {options[key]!r}")
    return value


def _invalid(path: Path, reason: str) -> BestConfigInvalid:
    return BestConfigInvalid(f"{path} {reason}: fix or delete it (the pipeline's next model search writes it "
                             f"again; without it training takes its built-in defaults), or trigger with every "
                             f"training parameter set ({', '.join(RETRAIN_PARAMS)})")


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _momentum(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1


def _name(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _declaration_changed(best: dict[str, Any], declared: dict[str, Any]) -> str | None:
    """What differs between the declaration best.json's search trained and `declared` ("task 'binary', now
    'regression'"), or None when it is the same."""
    import json

    from nightshift.train.config import TrainConfig

    then = best.get("declared")
    if not isinstance(then, dict):  # written before searches recorded it: what its train_options say of it
        options = best.get("train_options", {})
        defaults = {"task": TrainConfig.task, "dataset_options": {}}
        then = {key: options.get(key, default) for key, default in defaults.items()}
    for key in sorted(then.keys() & declared.keys()):
        if json.dumps(then[key], sort_keys=True) != json.dumps(declared[key], sort_keys=True):
            return f"{key} {then[key]!r}, now {declared[key]!r}"
    return None


def _model_kwargs(value: Any) -> dict[str, Any] | None:
    """The `model_kwargs` Param: null or "" (empty), a JSON object, or the text of one (the trigger form's
    text field); anything else is a UsageError naming the Param."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise UsageError(f"the model_kwargs Param is not JSON ({err}): give a JSON object such as "
                             f'{{"channels": 32}}, or leave it empty') from err
    if not isinstance(value, dict):
        raise UsageError(f"the model_kwargs Param must be a JSON object such as {{\"channels\": 32}}, got {value!r}")
    return value


def training_defaults(params: dict[str, Any], path: Path | None = None, *, model: str | None = None,
                      model_kwargs: dict[str, Any] | None = None, dataset: str | None = None,
                      pipeline: str | None = None, declared: dict[str, Any] | None = None) -> dict[str, Any]:
    """The trainer options of a pipeline run (`nightly_retrain` and the others) from its Params (`RETRAIN_PARAMS`).

    `model` and `model_kwargs`: the pipeline's declared model, which replaces the trainer's built-in one (None:
    the trainer's). `pipeline`: the pipeline's dag_id (None: SEARCHED_PIPELINE), whose own best.json is read
    (`pipeline_best_path`; `path` replaces it), and only when its search was for that pipeline (its `pipeline`,
    else SEARCHED_PIPELINE). `dataset`: the pipeline's dataset loader; best.json is read only when its search
    trained on that loader (its `train_options.dataset`, else the trainer's default): another dataset's best
    learning rate or model says nothing about this one's. `declared`: what the pipeline's declaration trains now
    (`nightshift.search.pipeline.declared_training`); best.json is read only when its search was of the same
    declaration (its `declared`; without one, the task and dataset options of its `train_options`, which a
    pipeline's search takes from the declaration): a best model and options of the pipeline as it was are
    another problem's, and its model one the declaration may no longer name. Declared `model_kwargs` that are
    not empty win over best.json's model and model arguments (only the trigger's model_kwargs Param beats them).

    A Param the trigger set wins; one left null takes best.json's value when a search wrote one, else the
    trainer's built-in default. `model` goes with `model_kwargs`: from best.json when `model_kwargs` does,
    else the built-in model. Returns `options` (lr, batch_size, momentum, model, model_kwargs), `builtin`
    (the trainer's defaults of the same), `sources` (per option: trigger, best.json or built-in), `best`
    (the file's path, version, study, trial and value, when one was read), `not_applied` (what else
    best.json holds that nightly_retrain sets itself or not at all) and `summary` (one line for logs and
    tags).
    """
    from nightshift.train.config import TrainConfig

    path = path or pipeline_best_path(pipeline or SEARCHED_PIPELINE)
    params = {**params, "model_kwargs": _model_kwargs(params.get("model_kwargs"))}
    fields = TrainConfig.__dataclass_fields__
    builtin: dict[str, Any] = {MODEL: model if model is not None else fields[MODEL].default,
                               "model_kwargs": dict(model_kwargs) if model_kwargs is not None else {}}
    for option in ("lr", "batch_size", "momentum"):
        builtin[option] = fields[option].default
    wanted = [param for param in RETRAIN_PARAMS if params.get(param) is None]
    best = load_best(path) if wanted else None
    elsewhere = None
    if best is not None and dataset is not None:
        searched = best.get("train_options", {}).get("dataset", fields["dataset"].default)
        if searched != dataset:
            best, elsewhere = None, f"dataset {searched!r}"
    if best is not None and pipeline is not None:
        searched_for = best.get("pipeline") or SEARCHED_PIPELINE
        if searched_for != pipeline:
            best, elsewhere = None, f"pipeline {searched_for!r}"
    if best is not None and declared is not None:
        changed = _declaration_changed(best, declared)
        if changed:
            best, elsewhere = None, f"an older declaration of {pipeline or SEARCHED_PIPELINE} ({changed})"
    found = dict((best or {}).get("train_options", {}))
    if model_kwargs:  # the declared model arguments are for the declared model: best.json replaces neither
        found.pop("model_kwargs", None)
        found.pop(MODEL, None)
    options: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for param, option in RETRAIN_PARAMS.items():
        if params.get(param) is not None:
            options[option], sources[option] = params[param], "trigger"
        elif option in found:
            options[option], sources[option] = found[option], "best.json"
        else:
            options[option], sources[option] = builtin[option], "built-in"
    if sources["model_kwargs"] == "best.json" and MODEL in found:
        options[MODEL], sources[MODEL] = found[MODEL], "best.json"
    else:
        options[MODEL], sources[MODEL] = builtin[MODEL], "built-in"
    options["lr"], options["batch_size"] = float(options["lr"]), int(options["batch_size"])
    options["momentum"] = float(options["momentum"])
    taken = [option for option, source in sources.items() if source == "best.json"]
    record = None
    if best is not None:
        record = {"path": str(path), **{k: best.get(k) for k in ("version", "study", "trial", "value", "storage")}}
    not_applied = {k: v for k, v in found.items() if k not in sources} if taken else {}
    if taken and record:
        summary = (f"{', '.join(taken)} from {path.name} v{record['version']} (study {record['study']}, "
                   f"trial {record['trial']})")
    elif best is None and wanted:
        why = f"{path.name} is for {elsewhere}" if elsewhere else f"no {path.name}"
        summary = f"built-in defaults for {', '.join(RETRAIN_PARAMS[p] for p in wanted)} ({why})"
    else:
        summary = "trigger values" if not wanted else "trigger values and built-in defaults"
    return {"options": options, "builtin": builtin, "sources": sources, "best": record if taken else None,
            "not_applied": not_applied, "summary": summary}
