"""The bodies of a pipeline DAG's tasks. Each calls the `nightshift` function that is also a CLI step.

Every step takes the `Pipeline` (nightshift.pipelines) its DAG was built from (nightly_tasks.factory): the model
name, the MLflow experiment, the default data, the gate and the dataset come from the declaration, never
from this module. `nightshift` (and through it GX, DVC, MLflow, torch) is imported inside each function,
never at module top, so the DAG file that imports this module parses fast.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

if TYPE_CHECKING:
    from nightshift.pipelines import Pipeline

log = logging.getLogger(__name__)

# The dataset loader whose data the DAG writes itself when the declared location is empty (nightshift demo-data).
DEMO_LOADER = "digits"


def experiment(pipeline: Pipeline) -> str:
    """The MLflow experiment of the pipeline's training runs: one per pipeline, named by its dag_id."""
    return pipeline.dag_id


def trainer_dataset_args(pipeline: Pipeline) -> list[str]:
    """The trainer flags that say which data loader, with which options, and which task the pipeline trains:
    the one place that turns the declaration's dataset and task into trainer flags (all three are part of the
    checkpoints' resume key)."""
    return ["--dataset", pipeline.dataset.loader, "--task", pipeline.task,
            "--dataset-options", json.dumps(pipeline.dataset.loader_options(), sort_keys=True)]


def evaluation_args(pipeline: Pipeline, min_improvement: float) -> dict[str, Any]:
    """The keyword arguments of nightshift.evaluate.evaluate for this pipeline: its registered model, its label
    column and its gate (with its task, which says the metrics and which way each improves), with the run's
    `min_improvement` Param (the form's default is the declaration's)."""
    gate = {**pipeline.gate.config(), "min_improvement": float(min_improvement), "task": pipeline.task}
    return {"model_name": pipeline.model_name, "gate": gate, "label_column": pipeline.dataset.label}


def default_data_dir(pipeline: Pipeline) -> Path:
    """The directory of the declared data (`dataset.data`; relative paths under NIGHTSHIFT_HOME).

    The tasks validate and stage one directory of train/validation/test.parquet: three files declared one by
    one must be those names in one directory (UsageError otherwise)."""
    from nightshift.errors import UsageError

    paths = pipeline.dataset.data.paths()
    folders = {path.parent for path in paths.values()}
    if len(folders) != 1 or any(path.name != f"{split}.parquet" for split, path in paths.items()):
        raise UsageError(f"{pipeline.source or pipeline.dag_id}: dataset.data: the DAG reads one directory of "
                         f"train/validation/test.parquet; declare `directory`, or three files of those names in "
                         f"one directory")
    return folders.pop()


def resolve_data_source(pipeline: Pipeline, data_source: str) -> Path:
    """The data directory to validate; empty means the pipeline's declared data (`dataset.data`).

    A given directory and the declared one alike must lie under the configured data roots
    (nightshift.settings.data_roots): a declaration is no way around them. Declared data that is missing is
    written when the pipeline reads the demo digits (`nightshift demo-data`), else refused.
    """
    from nightshift.settings import confined_data_source

    if data_source.strip():
        return confined_data_source(data_source.strip())
    from nightshift.datasets import SPLITS, split_path
    from nightshift.errors import UsageError

    declared = default_data_dir(pipeline)
    try:
        path = confined_data_source(declared)
    except UsageError as err:
        raise UsageError(f"{pipeline.source or pipeline.dag_id}: dataset.data: {err}") from err
    if not all(split_path(path, s).is_file() for s in SPLITS):
        if pipeline.dataset.loader != DEMO_LOADER:
            raise UsageError(f"no data_source given and the declared data {path} lacks "
                             f"{', '.join(f'{s}.parquet' for s in SPLITS)}; put the splits there or trigger "
                             f"with data_source")
        from nightshift.data.demo import write_demo_dataset

        log.info("No data_source given: writing the demo dataset to %s", path)
        write_demo_dataset(path, seed=0)
        path = confined_data_source(path)  # the written files too
    return path


def workspace_for(dag_id: str, run_id: str) -> Path:
    """The run's workspace: one directory per (DAG, run), never shared by two runs (nightshift.fsutil.safe_name)."""
    from nightshift.fsutil import safe_name
    from nightshift.settings import workspaces_dir

    return workspaces_dir() / safe_name(dag_id) / safe_name(run_id)


def stage(pipeline: Pipeline, validated: dict[str, Any], dag_id: str, run_id: str) -> dict[str, Any]:
    from nightshift.data.stage import stage_dataset
    from nightshift.settings import data_roots

    workspace = workspace_for(dag_id, run_id)
    # Confined again, under the staging lock: the gate ran earlier (a retry may come hours later) and a split
    # may have been relinked out of the roots since. The declared data gets no root of its own.
    # Data changed since the gate is validated again, with the suite the gate ran.
    version = dict(stage_dataset(validated["path"], workspace, validated=validated.get("fingerprint"),
                                 roots=data_roots(), suite_file=pipeline.suite_path))
    log.info("Dataset version %s (%d rows) staged in %s", version["hash"], version["rows"], version["path"])
    return {**version, "workspace": str(workspace)}


def bundle_version(ti: Any) -> str | None:
    """The commit of the git DAG bundle this task runs from (its DAG run's `bundle_version`), else None.

    Airflow pins every task of a run to the bundle version the run was created with; a DAG-folder bundle,
    or a run with bundle versioning disabled, has none.
    """
    version = getattr(getattr(ti, "bundle_instance", None), "version", None)
    return version if isinstance(version, str) and version else None


def training_options(pipeline: Pipeline, params: dict[str, Any]) -> dict[str, Any]:
    """search.best.training_defaults for this pipeline: its model and model arguments are the defaults (declared
    model arguments win over best.json's), and best.json counts only when its search was for this pipeline as it
    is declared now (its dataset loader and options, task and model). UsageError when best.json
    or the model_kwargs Param cannot be used. Shared with `nightshift plan` (nightshift_plan.plan)."""
    from nightshift.pipelines.spec import plain
    from nightshift.search.best import training_defaults
    from nightshift.search.pipeline import declared_training

    return training_defaults(dict(params), model=pipeline.model.name, model_kwargs=plain(pipeline.model.kwargs),
                             dataset=pipeline.dataset.loader, pipeline=pipeline.dag_id,
                             declared=declared_training(pipeline))


def resolve_training(pipeline: Pipeline, params: dict[str, Any]) -> dict[str, Any]:
    """The run's trainer options: a Param left empty takes the best model search's value (best.json, read
    now, at run time), else the declaration's model or the trainer's default; a Param the trigger set wins."""
    from nightshift.errors import UsageError

    try:
        resolved = training_options(pipeline, params)
    except UsageError as err:  # a malformed best.json or model_kwargs Param: a retry reads the same
        raise AirflowFailException(f"check_changes: {err}") from err
    options, sources = resolved["options"], resolved["sources"]
    log.info("Training parameters: %s; %s", ", ".join(f"{k}={options[k]!r} ({sources[k]})" for k in options),
             resolved["summary"])
    if resolved["not_applied"]:
        log.info("best.json also holds %s, which %s sets itself (or not at all)",
                 ", ".join(f"{k}={v!r}" for k, v in resolved["not_applied"].items()), pipeline.dag_id)
    return resolved


def training_declaration(pipeline: Pipeline) -> dict[str, Any]:
    """The part of the declaration that shapes the trained model (what it predicts, from what, with which
    model): a change of any of it is a change that trains (ledger.fingerprint's `declaration`)."""
    from nightshift.pipelines.spec import plain

    return {"task": pipeline.task, "loader": pipeline.dataset.loader, "label": pipeline.dataset.label,
            "features": list(pipeline.dataset.features) if pipeline.dataset.features is not None else None,
            "loader_options": pipeline.dataset.loader_options(), "model": pipeline.model.name,
            "model_kwargs": plain(pipeline.model.kwargs)}


def check_changes(pipeline: Pipeline, staged: dict[str, Any], params: dict[str, Any], dag_id: str, run_id: str,
                  ti: Any) -> str:
    """Branch: "train", or "skip_training" when data, code, training params and the training-relevant
    declaration (`training_declaration`) match the last success.

    Pushes `training`: the trainer options the `train` task passes (`resolve_training`)."""
    from nightshift import ledger as lineage

    resolved = resolve_training(pipeline, params)
    options = resolved["options"]
    current = lineage.fingerprint(staged["hash"], {**params, "learning_rate": options["lr"],
                                                   "batch_size": options["batch_size"]}, bundle_version(ti),
                                 declaration=training_declaration(pipeline))
    # Options the fingerprint has no field for count where they differ from the trainer's defaults, so a run
    # without them compares equal to the runs before them.
    current["training"].update({k: options[k] for k in ("momentum", "model", "model_kwargs")
                                if options[k] != resolved["builtin"][k]})
    current["training_source"] = {k: resolved[k] for k in ("summary", "sources", "best", "not_applied")}
    previous = lineage.last_successful(dag_id, exclude_run_id=run_id)
    ti.xcom_push(key="fingerprint", value=current)
    ti.xcom_push(key="previous_run", value=previous)
    ti.xcom_push(key="training", value={**options, "summary": resolved["summary"]})
    if params.get("force"):
        log.info("force is on: training whatever changed")
        return "train"
    if lineage.unchanged_since(previous, current):
        log.info("Dataset %s, code %s, declaration and training params are unchanged since run %s: skipping training",
                 current["dataset_version"], current["code_version"], previous and previous.get("run_id"))
        return "skip_training"
    changed = [k for k in lineage.FINGERPRINT_KEYS if not previous or previous.get(k) != current.get(k)]
    log.info("Training: %s", "no earlier successful run" if not previous else f"changed {', '.join(changed)}")
    return "train"


def skip_training(previous: dict[str, Any] | None) -> dict[str, Any]:
    prev = previous or {}
    message = (f"Training skipped: dataset {prev.get('dataset_version')} and code {prev.get('code_version')} "
               f"are unchanged since run {prev.get('run_id')}; the champion keeps serving. "
               f"Trigger with force=true to retrain anyway.")
    log.info(message)
    return {"skipped": True, "reason": message, "previous_run": prev.get("run_id")}


def evaluate(pipeline: Pipeline, trained: dict[str, Any], staged: dict[str, Any],
             params: dict[str, Any]) -> dict[str, Any]:
    from nightshift.evaluate import evaluate as run_evaluation
    from nightshift.tasks import metric_names
    from nightshift.tracking import configure

    configure()  # each task is a process of its own: its entry point configures MLflow
    result = run_evaluation(trained["mlflow_run_id"], data_dir=staged["path"],
                            **evaluation_args(pipeline, params["min_improvement"]))
    champion = result.get("champion")
    names = [k for k in metric_names(pipeline.task) if k in result["challenger"]]
    decision = {
        "passed": bool(result["passed"]),
        "reasons": list(result["reasons"]),
        "run_id": result["run_id"],
        "split": result["split"],
        "primary": result["gate"]["primary"],  # the season view's metric (nightshift.season)
        "challenger": {k: result["challenger"][k] for k in names},
        "champion": ({"version": champion["version"], **{k: champion[k] for k in names}} if champion else None),
        # the champion could not be compared or scored: the approval step asks a person (adapters)
        "needs_approval": bool(result.get("needs_approval")),
        "rows_outside_train_range": (result["challenger"].get("drift") or {}).get("rows"),
    }
    log.info("Gate %s: %s", "PASSED" if decision["passed"] else "REJECTED", "; ".join(decision["reasons"]))
    return decision


def register(pipeline: Pipeline, decision: dict[str, Any], staged: dict[str, Any], dag_id: str, run_id: str,
             ti: Any) -> dict[str, Any]:
    if not decision["passed"] and not decision.get("needs_approval"):
        raise AirflowSkipException(f"Not registered: the gate rejected the new model "
                                   f"({'; '.join(decision['reasons'])}); the champion keeps serving")
    from nightshift.ledger import code_version
    from nightshift.registry import register as register_version
    from nightshift.tracking import configure

    configure()
    code = code_version(bundle_version(ti))
    lineage_tags = {"dataset_version": staged["hash"], "dataset_git_rev": staged.get("git_rev"),
                    "dataset_source": staged.get("source"), "dag_id": dag_id, "dag_run_id": run_id,
                    "code_version": code, "code_commit": code}
    # needs_approval: registered as @challenger for the approval step that follows (adapters), which decides
    version = register_version(decision["run_id"], model_name=pipeline.model_name, lineage=lineage_tags,
                               evaluation=decision, pending_approval=bool(decision.get("needs_approval")))
    ti.xcom_push(key="model_version", value={"name": version["model_name"], "version": version["version"]})
    log.info("Registered %s v%s (@%s)", version["model_name"], version["version"], version["alias"])
    return version


def deploy(pipeline: Pipeline, registered: dict[str, Any], staged: dict[str, Any],
           params: dict[str, Any]) -> dict[str, Any]:
    """Deploy the registered version to the run's `deploy_target`, with the declaration's `deploy.options`
    when that is the declared target (they are that target's options)."""
    from nightshift.deploy import deploy as run_deploy
    from nightshift.errors import DeploymentFailed
    from nightshift.pipelines.spec import plain
    from nightshift.tracking import configure

    configure()
    target = params.get("deploy_target", pipeline.deploy.target)
    options = plain(pipeline.deploy.options) if target == pipeline.deploy.target else {}
    api = None
    if target == "kserve":
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

        api = KubernetesHook(conn_id="kubernetes_default").custom_object_client
    try:
        result = run_deploy(target, registered["model_name"], version=registered["version"],
                            data_dir=staged["path"], kserve_api=api, **options)
    except DeploymentFailed as err:
        raise AirflowFailException(f"deploy: {err}") from err
    log.info("Deployed %s v%s: %s", registered["model_name"], registered["version"], result.get("url"))
    return {k: v for k, v in result.items() if k not in {"smoke"}} | {"smoke": _brief(result.get("smoke"))}


def restore_champion(pipeline: Pipeline, staged: dict[str, Any], params: dict[str, Any]) -> dict[str, Any] | None:
    """A night that registers nothing: the local target's `@champion` server is started again when it no longer
    answers (nightshift.deploy.local.restore_local); None when it answers, when there is no champion, or for another
    target (KServe's controller restarts its own pods)."""
    from nightshift.deploy.local import restore_local
    from nightshift.errors import DeploymentFailed
    from nightshift.pipelines.spec import plain
    from nightshift.tracking import configure

    target = params.get("deploy_target", pipeline.deploy.target)
    if target != "local":
        return None
    configure()
    options = plain(pipeline.deploy.options) if target == pipeline.deploy.target else {}
    try:
        result = restore_local(pipeline.model_name, data_dir=staged["path"], **options)
    except DeploymentFailed as err:  # retried (the task's retry): a deployment holding the lock, a port race
        raise DeploymentFailed(f"deploy: @champion's local server had to be started again and was not: "
                               f"{err}") from err
    if result is not None:
        log.warning("%s @champion v%s restarted at %s: %s (was %s)", pipeline.model_name, result["version"],
                    result["url"], result["reason"], result["previous"].get("url"))
        result = {k: v for k, v in result.items() if k != "smoke"} | {"smoke": _brief(result.get("smoke"))}
    return result


def _brief(smoke: Any) -> Any:
    if not isinstance(smoke, dict):
        return smoke
    return {k: v for k, v in smoke.items() if not isinstance(v, (list, dict))}


def report(pipeline: Pipeline, dag_id: str, run_id: str, params: dict[str, Any],
           results: dict[str, Any]) -> dict[str, Any]:
    """The run's summary: logged, appended to the ledger (the lineage page, the next run's change check)."""
    from nightshift import ledger as lineage

    staged = results.get("stage_dataset") or {}
    fingerprint = results.get("fingerprint") or {}
    trained, decision = results.get("train"), results.get("evaluate")
    registered, deployed = results.get("register"), results.get("deploy")
    restarted = deployed if (deployed or {}).get("status") == "restarted" else None
    if restarted:
        deployed = None
    if results.get("skip_training"):
        outcome = "training skipped (unchanged)"
    elif decision and not decision["passed"]:
        outcome = "not promoted (gate rejected)"
    elif registered and not deployed:
        outcome = "registered, not deployed (approval rejected or pending)"
    elif deployed:
        outcome = f"promoted v{deployed.get('version')} ({deployed.get('status')})"
    else:
        outcome = "no model"
    if restarted:
        outcome += f"; @champion v{restarted.get('version')} restarted ({restarted.get('reason')})"
        deployed = restarted
    summary = {
        "dag_id": dag_id, "run_id": run_id, "status": "success", "outcome": outcome,
        "dataset_version": staged.get("hash"), "dataset_rows": staged.get("rows"),
        "dataset_source": staged.get("source"),
        "code_version": fingerprint.get("code_version"), "training": fingerprint.get("training"),
        "declaration": fingerprint.get("declaration"),
        "training_source": fingerprint.get("training_source"),
        "mlflow_run_id": (trained or {}).get("mlflow_run_id"),
        "train_metrics": (trained or {}).get("metrics"),
        "gate": decision,
        "model_version": (registered or {}).get("version"), "model_name": pipeline.model_name,
        "serving_url": (deployed or {}).get("url"), "deploy_status": (deployed or {}).get("status"),
        "params": dict(params),
        # The rule its dataset versions are judged by in the shared store, also when gc cannot find the declaration.
        "retention": pipeline.retention.to_dict(),
    }
    lineage.append_record(dag_id, summary)
    lines = [f"{dag_id} {run_id}: {outcome}",
             f"  dataset version : {summary['dataset_version']} ({summary['dataset_rows']} rows)",
             f"  code version    : {summary['code_version']}"]
    if decision:
        lines.append(f"  gate            : {'passed' if decision['passed'] else 'rejected'} - "
                     f"{'; '.join(decision['reasons'])}")
    if registered:
        lines.append(f"  model version   : {pipeline.model_name} v{registered.get('version')}")
    if deployed:
        lines.append(f"  serving         : {deployed.get('url')} ({deployed.get('status')})")
    log.info("\n".join(lines))
    return summary


def collect_garbage(pipeline: Pipeline) -> dict[str, Any]:
    """The pipeline's last task: `nightshift gc` for this pipeline with its declared retention (nightshift.gc).
    It runs after a run that completed, when its ledger record is written; a failure fails the task (GcFailed)."""
    from nightly_tasks.factory import airflow_dags_folder
    from nightshift.gc import collect, declared_rules, policy_folders
    from nightshift.tracking import configure

    configure()
    # The dataset store is shared: each version is judged by the rule of every pipeline that used it.
    rules = declared_rules(policy_folders([pipeline], dags_folder=airflow_dags_folder()))
    result = collect(pipeline, rules=rules)
    for entry in result["remove"]:
        log.info("Removed %s %s (%d bytes): %s", entry["kind"], entry["what"], entry["size"], entry["reason"])
    log.info("Retention %s: removed %d item(s), %d bytes; kept %d", result["policy"], len(result["remove"]),
             result["removed_bytes"], len(result["keep"]))
    return {"removed": len(result["remove"]), "removed_bytes": result["removed_bytes"], "kept": len(result["keep"])}


def failure_summary(context: Any) -> None:
    """on_failure_callback: say in the task log what failed and why, and record the failed run."""
    ti = context.get("ti") or context.get("task_instance")
    error = context.get("exception")
    dag_id = getattr(ti, "dag_id", "?")
    run_id = getattr(ti, "run_id", "?")
    task_id = getattr(ti, "task_id", "?")
    reason = f"{type(error).__name__}: {error}" if error is not None else "unknown (see the log above)"
    hints = {
        "validate_data": "the data failed its expectation suite or could not be read; fix the data source",
        "stage_dataset": "DVC could not version or materialise the data",
        "train": "the Horovod job failed (the MPIJob's or horovodrun's reason is above); checkpoints are kept "
                 "and a retry resumes",
        "evaluate": "the new model or the champion could not be scored",
        "register": "the MLflow registry refused the version",
        "deploy": "the new version did not become healthy or answer correctly; the previous one keeps serving",
        "collect_garbage": "retention could not read or remove something (nothing it could not read was removed); "
                           "the run itself completed, its ledger record stands; `nightshift gc --dry-run` shows "
                           "the plan",
    }
    gate = None
    try:
        gate = ti.xcom_pull(task_ids="evaluate")
    except Exception:  # the summary must not fail on a missing XCom
        gate = None
    lines = [
        "=" * 72,
        f"{dag_id} FAILED: run {run_id}, task {task_id} (try {getattr(ti, 'try_number', '?')})",
        f"  why   : {reason}",
        f"  means : {hints.get(task_id, 'see the error above')}",
    ]
    if gate:
        lines.append(f"  gate  : {'passed' if gate.get('passed') else 'rejected'} - "
                     f"{'; '.join(gate.get('reasons', []))}")
    lines.append("=" * 72)
    log.error("\n".join(lines))
    if task_id == "collect_garbage":
        return  # housekeeping after the run's own record (success or not) was written: that record stands
    try:
        from nightshift import ledger as lineage

        lineage.append_record(dag_id, {"dag_id": dag_id, "run_id": run_id, "status": "failed",
                                       "failed_task": task_id, "reason": reason[:2000],
                                       "outcome": f"failed at {task_id}"})
    except OSError as err:
        log.warning("Could not record the failed run in the ledger: %s", err)
