"""The DAG factory: one retraining DAG per pipeline declaration (pipelines/*.yaml, nightshift.pipelines).

    # dags/churn.py, beside dags/churn.yaml: the Airflow DAG of that declaration
    from nightly_tasks.factory import pipeline_dag
    dag = pipeline_dag(__file__)

`pipeline_dag` takes a `Pipeline`, the path of its YAML, or a DAG file's `__file__` (then the `.yaml`/`.yml` of
the same name beside it), and builds validate_data → stage_dataset → check_changes → train | skip_training →
evaluate → register → approve → deploy → report with the declaration's suite, data, model, gate, deployment,
schedule and training defaults. Everything a pipeline owns is named by its dag_id or model name: the run
workspaces and checkpoints (dag_id/run_id), the MLflow experiment (the dag_id), the registered model and its
`@champion`, the local model server (one per model, nightshift.deploy.local), the run ledger (dag_id), the model
search's best.json and report pages (NIGHTSHIFT_HOME/search/<dag_id>/; its search DAG: nightly_tasks.search).

One DAG file per declaration, so a bad declaration breaks its own DAG only. It does not raise at import:
`pipeline_dag` returns an `InvalidPipelineDag` whose `validate()` raises the loader's message, which Airflow's
DagBag records as that DAG file's import error in one line (`PipelineInvalid: FILE: KEY: what is wrong`), where
an exception at import time is recorded with its traceback (`dagbag_import_error_tracebacks`).

Reading a declaration imports `nightshift.pipelines` (PyYAML, jsonschema) at parse time, nothing heavier; the
tasks import the rest when they run.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import DAG, Asset, Param, get_current_context, task
from airflow.sdk.exceptions import AirflowSkipException

from nightly_tasks import steps
from nightly_tasks.adapters import GXDataGateOperator, OptionalApprovalOperator
from nightly_tasks.events import event_pipelines, events_connection, retrain_schedule
from nightshift.deploy import target_names
from nightshift.tasks import BINARY
from operators.backends import backend_choices, backend_help
from operators.horovod import ClusterConfig, ExecutionConfig, HorovodKubernetesOperator, JobConfig, TrackingConfig

if TYPE_CHECKING:
    from nightshift.pipelines import Pipeline

CRON_ENV = "NIGHTSHIFT_RETRAIN_CRON"
# Schedules Airflow takes that are no cron: with new-data events the cron goes into a CronTriggerTimetable, which
# refuses them when the DAG is parsed.
NOT_A_CRON = ("@once", "@continuous")
RETRY_DELAY_ENV = "NIGHTSHIFT_TRAIN_RETRY_DELAY_S"
DECLARATION_SUFFIXES = (".yaml", ".yml")
START_DATE = datetime(2026, 1, 1, tzinfo=UTC)
TAGS = ["nightshift", "training", "horovod", "mlflow"]

# The training parameters check_changes resolved when the run started (steps.resolve_training).
TRAINING = "ti.xcom_pull(task_ids='check_changes', key='training')"
STAGED = "ti.xcom_pull(task_ids='stage_dataset')"
# What check_changes compared with the last success: the dataset version, the code version, the parameters.
FINGERPRINT = "ti.xcom_pull(task_ids='check_changes', key='fingerprint')"

# The pipelines this process built DAGs from, by dag_id (`nightshift plan` resolves the training options as
# check_changes does, from the DAG's pipeline).
_BUILT: dict[str, Pipeline] = {}


class InvalidPipelineDag(DAG):
    """Stands for a pipeline whose declaration is invalid. Airflow's DagBag validates every DAG it finds and
    records what `validate()` raises as the DAG file's import error, as one line `TYPE: message`: here the
    loader's PipelineInvalid, naming the YAML file, the key and what is wrong. It is never bagged."""

    problem: Exception

    def validate(self) -> None:
        raise self.problem


def declaration_path(given: str | os.PathLike[str]) -> Path:
    """The declaration file `given` names: itself, or for a DAG file (`__file__` of a stub) the .yaml/.yml
    beside it with the same name."""
    path = Path(given)
    if path.suffix not in {".py", ".pyc"}:
        return path
    for suffix in DECLARATION_SUFFIXES:
        if path.with_suffix(suffix).is_file():
            return path.with_suffix(suffix)
    return path.with_suffix(DECLARATION_SUFFIXES[0])  # missing: the loader says so, naming this file


def pipeline_dag(declaration: Pipeline | str | os.PathLike[str]) -> DAG:
    """The retraining DAG of `declaration` (a Pipeline, a YAML path, or a stub's `__file__`); for a declaration
    that is not valid, an `InvalidPipelineDag` that fails the file's import with the loader's one line."""
    from nightshift.errors import HorovodUnusable
    from nightshift.pipelines import PipelineInvalid

    try:
        pipeline = read_declaration(declaration)
        check_declared_backend(pipeline)
        check_schedule(pipeline)
        check_local_horovod(pipeline)
    except (PipelineInvalid, HorovodUnusable) as err:
        return invalid_dag(declaration, err)
    return build_dag(pipeline)


def check_local_horovod(pipeline: Pipeline) -> None:
    """HorovodUnusable, naming the fix, when the pipeline trains here by default (backend local) and the Horovod
    installed here has no torch extension (`nightshift doctor`'s quick form: package metadata and a file probe,
    nothing imported). A machine without Horovod passes: the Airflow image has none, its runs train on the cluster;
    the train task checks everything (`nightshift doctor`'s full form) before it starts horovodrun."""
    from nightshift.doctor import quick_checks, unusable
    from nightshift.errors import HorovodUnusable

    if default_backend(pipeline) != "local":
        return
    problem = unusable(quick_checks(), ("torch",))
    if problem is not None:
        raise HorovodUnusable(f"{pipeline.source or pipeline.dag_id}: training.backend is local and this machine's "
                              f"Horovod cannot train: {problem}")


def default_backend(pipeline: Pipeline) -> str:
    """The `backend` Param's default: the declaration's training.backend, else NIGHTSHIFT_BACKEND, else local."""
    return pipeline.training.backend or os.environ.get("NIGHTSHIFT_BACKEND", "local")


def check_declared_backend(pipeline: Pipeline) -> None:
    """PipelineInvalid when the declaration's training.backend is no registered backend (the schema cannot
    list them: plugins add backends in the operators layer)."""
    from nightshift.errors import UsageError
    from nightshift.pipelines import PipelineInvalid
    from operators.backends import check_backend

    if pipeline.training.backend is None:
        return
    try:
        check_backend(pipeline.training.backend)
    except UsageError as err:
        raise PipelineInvalid(str(pipeline.source or pipeline.dag_id), [f"training.backend: {err}"]) from err


def check_schedule(pipeline: Pipeline) -> None:
    """PipelineInvalid naming the file and where the schedule came from when Airflow would refuse the DAG's
    schedule as it parses the DAG, naming neither: a NIGHTSHIFT_RETRAIN_CRON that is no valid cron (the declared
    schedule was checked when the declaration was loaded), or a preset that is no cron (@once, @continuous) where
    new-data events start the pipeline on its cron or an event (retrain_schedule makes a cron timetable of it)."""
    from nightshift.pipelines import PipelineInvalid
    from nightshift.pipelines.load import cron_problems

    override = os.environ.get(CRON_ENV)
    key = f"{CRON_ENV} (the deployment's override of schedule)" if override is not None else "schedule"
    cron = schedule_cron(pipeline)
    problems = cron_problems(cron, schema_form=False) if cron is not None and override is not None else []
    if not problems and cron in NOT_A_CRON and events_connection() is not None \
            and pipeline.dag_id in event_pipelines():
        problems = [f"{cron!r} is no cron, and new-data events (NIGHTSHIFT_EVENTS_CONN_ID or "
                    f"NIGHTSHIFT_EVENTS_REDIS_URL) start this pipeline on its cron or an event; give a cron, or null "
                    f"for events alone"]
    if problems:
        raise PipelineInvalid(str(pipeline.source or pipeline.dag_id), [f"{key}: {line}" for line in problems])


def read_declaration(declaration: Pipeline | str | os.PathLike[str]) -> Pipeline:
    """The pipeline `declaration` is or names (a YAML path, or a stub's `__file__`); PipelineInvalid when the file
    is not valid, or another declaration declares its dag_id, model_name or dataset asset: one beside it, or one in
    a folder Airflow loads declarations from (the DAG folder and its subfolders, NIGHTSHIFT_PIPELINES:
    nightshift.pipelines.declaration_folders) when the declaration lies in one of them (a DAG bundle's checkout
    is compared with the declarations beside it only: check_unique). Both files then fail, each naming the other;
    the other DAGs load."""
    from nightshift.pipelines import Pipeline, check_unique, declaration_folders, load_pipeline

    if isinstance(declaration, Pipeline):
        return declaration
    pipeline = load_pipeline(declaration_path(declaration))
    check_unique(pipeline, declaration_folders(airflow_dags_folder()))
    return pipeline


def airflow_dags_folder() -> str | None:
    """Airflow's [core] dags_folder, as this process's configuration (airflow.cfg, environment) says."""
    from airflow.sdk.configuration import conf

    return conf.get("core", "dags_folder", fallback=None) or None


def invalid_dag(declaration: Pipeline | str | os.PathLike[str], problem: Exception,
                suffix: str = "") -> InvalidPipelineDag:
    """The stand-in for a DAG of the invalid `declaration` (`suffix`: which DAG of the file), failing its import
    with `problem`."""
    from nightshift.pipelines import Pipeline
    from nightshift.pipelines.spec import INVALID_DAG_PREFIX

    name = declaration.dag_id if isinstance(declaration, Pipeline) else declaration_path(declaration).stem
    placeholder = InvalidPipelineDag(dag_id=f"{INVALID_DAG_PREFIX}{_safe_id(name)}{suffix}", schedule=None,
                                     start_date=START_DATE, tags=["nightshift"])
    placeholder.problem = problem
    return placeholder


def pipeline_for(dag_id: str) -> Pipeline | None:
    """The pipeline this process built the DAG `dag_id` from, if any."""
    return _BUILT.get(dag_id)


def _safe_id(text: str) -> str:
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in text) or "pipeline"


# ---- what the environment of a deployment sets --------------------------------------------------------------

def schedule_cron(pipeline: Pipeline) -> str | None:
    """The pipeline's cron: NIGHTSHIFT_RETRAIN_CRON when set (for every pipeline; "none": manual and UI triggers
    only), else the declaration's `schedule` (null: manual only)."""
    override = os.environ.get(CRON_ENV)
    text = (override if override is not None else pipeline.schedule or "").strip()
    return None if text.lower() in {"", "none"} else text


def train_retry_delay() -> timedelta:
    """NIGHTSHIFT_TRAIN_RETRY_DELAY_S (default 60): how long train waits before a retry resumes from the
    checkpoint (doubled at each further retry, at most 10 min); shorter where a lost worker is replaced at once."""
    text = os.environ.get(RETRY_DELAY_ENV, "").strip() or "60"
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 3600:
        raise ValueError(f"{RETRY_DELAY_ENV}={text!r} is not a number of seconds between 0 and 3600 (default 60)")
    return timedelta(seconds=seconds)


def trainer_image() -> str:
    return os.environ.get("NIGHTSHIFT_TRAINER_IMAGE", "ghcr.io/nightshift/trainer:0.1.0")


# ---- Params and docs ----------------------------------------------------------------------------------------

def pipeline_params(pipeline: Pipeline) -> dict[str, Param]:
    """The trigger form: the declaration's training, gate and deployment values as the defaults."""
    training, primary = pipeline.training, pipeline.gate.primary
    return {
        # An optional Param must accept null: the trigger form sends an emptied field as null, and a plain
        # "string" Param with an empty default keeps the Trigger button disabled.
        "data_source": Param(None, type=["null", "string"], title="Data source",
                             description="Directory with train/validation/test.parquet. Empty: the pipeline's "
                                         "declared data."),
        "epochs": Param(training.epochs, type="integer", minimum=1, maximum=1000, title="Epochs",
                        description="Training epochs."),
        # Empty (null): the pipeline's best model search's value (search/<dag_id>/best.json, read when the run
        # starts), else the trainer's default. A value given at trigger time wins.
        "learning_rate": Param(training.learning_rate, type=["null", "number"], exclusiveMinimum=0, maximum=10,
                               title="Learning rate",
                               description=f"Base learning rate, multiplied by the number of workers. Empty: the "
                                           f"best model search's (search/{pipeline.dag_id}/best.json), else 0.05."),
        "batch_size": Param(training.batch_size, type=["null", "integer"], minimum=1, maximum=65536,
                            title="Batch size",
                            description="Batch size per worker. Empty: the best model search's, else 32."),
        "momentum": Param(training.momentum, type=["null", "number"], minimum=0, exclusiveMaximum=1,
                          title="Momentum", description="SGD momentum. Empty: the best model search's, else 0.9."),
        # Object or string: the trigger form then shows a text field (JSON text is parsed by check_changes).
        "model_kwargs": Param(None, type=["null", "object", "string"], title="Model arguments",
                              description="The model's keyword arguments, a JSON object such as "
                                          '{"channels": 32}. Empty: taken from the best model search (with its '
                                          "model), else the declaration's."),
        "workers": Param(training.workers, type="integer", minimum=1, maximum=256, title="Workers",
                         description="Horovod workers (MPIJob worker pods, or local processes). Ignored when "
                                     "max_workers is set (elastic training has max_workers workers)."),
        # Elastic training (JobConfig.elastic): both empty is a fixed-size job of `workers`; both set, horovodrun's
        # elastic driver keeps training when workers are lost (down to min_workers) and takes them back.
        "min_workers": Param(None, type=["null", "integer"], minimum=1, maximum=256, title="Elastic: fewest workers",
                             description="Elastic training: the fewest workers the job goes on with when workers "
                                         "are lost (with max_workers). Empty: not elastic."),
        "max_workers": Param(None, type=["null", "integer"], minimum=1, maximum=256, title="Elastic: most workers",
                             description="Elastic training: the workers the job starts with and takes back when "
                                         "they return (with min_workers; replaces workers). Not with a Kueue "
                                         "queue (leave queue empty). Empty: not elastic."),
        "gpus_per_worker": Param(training.gpus_per_worker, type="integer", minimum=0, maximum=16,
                                 title="GPUs per worker", description="GPUs per worker; 0 trains on CPU."),
        "gpus": Param(0, type="integer", minimum=0, maximum=4096, title="GPUs in total",
                      description="Total GPUs, packed into the fewest equal workers of at most one node's GPUs "
                                  "(NIGHTSHIFT_GPUS_PER_NODE or the cluster's nodes). 0: workers x GPUs per "
                                  "worker."),
        "queue": Param(training.queue or os.environ.get("NIGHTSHIFT_KUEUE_QUEUE") or None, type=["null", "string"],
                       title="Kueue queue",
                       description="Kubernetes: the Kueue LocalQueue the MPIJob waits in for GPU quota (it is "
                                   "created suspended, admitted by Kueue, and resumes from its checkpoint after a "
                                   "preemption). Empty: no Kueue."),
        "priority": Param(os.environ.get("NIGHTSHIFT_KUEUE_PRIORITY") or None, type=["null", "string"],
                          title="Kueue priority",
                          description="A Kueue WorkloadPriorityClass, e.g. nightly-low or interactive-high "
                                      "(default NIGHTSHIFT_KUEUE_PRIORITY)."),
        # A job Kueue never admits fails the try with Kueue's reason instead of holding the run for hours.
        # At least 1: 0 would fail every job Kueue did not admit at once; empty is the way to ask for no limit.
        "queue_timeout": Param(7200, type=["null", "integer"], minimum=1, maximum=86400, title="Kueue queue timeout",
                               description="Seconds (1 to 86400) the MPIJob may wait in the Kueue queue (since it "
                                           "was last suspended) before train fails with the reason it waited. "
                                           "Empty: no limit."),
        # Scheduled runs take the default: a cluster deployment sets NIGHTSHIFT_BACKEND=kubernetes.
        "backend": Param(default_backend(pipeline), type="string",
                         enum=list(backend_choices()), title="Backend", description=backend_help()),
        # As the schema: no maximum, since rmse and mae gain in the target's units, not in [0, 1].
        "min_improvement": Param(pipeline.gate.min_improvement, type="number", minimum=0,
                                 title="Minimum improvement",
                                 description=f"{primary} gain over the champion needed to promote the new model "
                                             f"(in {primary}'s own units)."),
        "require_approval": Param(pipeline.deploy.require_approval, type="boolean", title="Require approval",
                                  description="Wait for a human approval in the UI before deploying."),
        "force": Param(False, type="boolean", title="Force training",
                       description="Train even when data, code and training params are unchanged."),
        "deploy_target": Param(pipeline.deploy.target, type="string", enum=list(target_names()),
                               title="Deploy target",
                               description="local: MLflow model server on 127.0.0.1; kserve: an InferenceService; "
                                           "any other: a plugin's (nightshift.deploy)."),
    }


def _declared_data(pipeline: Pipeline) -> str:
    data = pipeline.dataset.data.to_dict()
    return data.get("directory") or ", ".join(f"{k}: {v}" for k, v in data.items())


def _listed(names: tuple[str, ...]) -> str:
    return ", ".join(f"`{name}`" for name in names)


def doc_md(pipeline: Pipeline) -> str:
    """The DAG's docs, from the declaration."""
    gate = pipeline.gate
    guards = ", ".join(f"{name} may lose at most {tol:g}" for name, tol in gate.guards.items()) or "no guards"
    first = f"reaches {gate.floor:g}" if gate.floor is not None else "no floor, the first model is accepted"
    gate_text = (f"`{gate.primary}` gains at least `min_improvement` (declared: {gate.min_improvement:g}) over "
                 f"`@champion`; a tie never promotes (no champion: {first}); {guards}")
    if pipeline.task == BINARY:
        positive = (f"`{gate.positive_class}` (declared)" if gate.positive_class is not None else
                    "the second of the label's sorted values (the default; `gate.positive_class` declares another)")
        gate_text += f"; F1, precision and recall are those of the positive class: {positive}"
    source = f"`{pipeline.source}`" if pipeline.source else "a Pipeline object"
    schedule = pipeline.schedule or "none (manual and UI triggers only)"
    return f"""
### {pipeline.dag_id}

{pipeline.description or "Retrains the model on the newest data and promotes it only when it beats the champion."}

Declared in {source} (schema: `nightshift/pipelines/pipeline.schema.json`; check it with `nightshift pipeline check`).

| | |
|---|---|
| model | `{pipeline.model_name}` (MLflow registry), built by `{pipeline.model.name}` |
| task | {pipeline.task} |
| data | loader `{pipeline.dataset.loader}`, label `{pipeline.dataset.label}`, default `{_declared_data(pipeline)}` |
| suite | `{pipeline.suite}` |
| gate | {gate_text} (`nightshift pipeline explain` shows where each value came from) |
| deploy | `{pipeline.deploy.target}`{" after a human approval" if pipeline.deploy.require_approval else ""} |
| MLflow experiment | `{steps.experiment(pipeline)}` |

`validate_data` (the suite, through the GX Airflow provider) → `stage_dataset` (DVC version) →
`check_changes` → `train` (`HorovodKubernetesOperator`) → `evaluate` (vs `@champion`) → `register`
(MLflow, `@challenger`) → `approve` (human in the loop, optional) → `deploy` → `report`.

When the dataset version, the code and the training parameters are the same as in the last successful
run, `skip_training` runs instead of `train` and nothing downstream of it (unless `force`).

Training parameters left empty (`learning_rate`, `batch_size`, `momentum`, `model_kwargs`) take the best
configuration of this pipeline's last model search (`NIGHTSHIFT_HOME/search/{pipeline.dag_id}/best.json`, written
by its search DAG, `{pipeline.search_dag_id}` when its DAG file adds `search_dag(__file__)`; read by
`check_changes` when the run starts; no other pipeline's), else the declaration's model and the trainer's
defaults; the MLflow tag `nightshift.training_defaults` and the lineage record say which values came from where
(and best.json's study and trial). A malformed best.json fails `check_changes`.

**Parameters** (the trigger form shows them):

| param | meaning |
|---|---|
| `data_source` | directory with `train/validation/test.parquet`; empty: the declared data |
| `epochs` | training epochs |
| `learning_rate` | base learning rate (the trainer scales it by the number of workers); empty: best.json's, else 0.05 |
| `batch_size` | batch size per worker; empty: best.json's, else 32 |
| `momentum` | SGD momentum; empty: best.json's, else 0.9 |
| `model_kwargs` | the model's arguments (a JSON object); empty: best.json's (with its model), else the declaration's |
| `workers` | Horovod workers: pods of the MPIJob, or local processes (ignored when `max_workers` is set) |
| `min_workers` | elastic training: the fewest workers it goes on with while workers are lost; empty: not elastic |
| `max_workers` | elastic training: the workers it starts with and takes back; not with a `queue`; empty: not elastic |
| `gpus_per_worker` | GPUs each worker asks for (0 = CPU); also the MPI slots per worker |
| `gpus` | total GPUs, packed into the fewest equal workers of at most one node (0: workers x GPUs per worker) |
| `queue` | Kueue LocalQueue for the MPIJob (default: declared, else `NIGHTSHIFT_KUEUE_QUEUE`; empty: no Kueue) |
| `priority` | Kueue WorkloadPriorityClass of the MPIJob |
| `queue_timeout` | seconds the MPIJob may wait for Kueue admission before `train` fails saying why (empty: no limit) |
| `backend` | where training runs: {_listed(backend_choices())} (see the form's description) |
| `min_improvement` | how much `{gate.primary}` must gain over the champion for the new model to be promoted |
| `require_approval` | wait for a person to approve in the UI (Required actions) before deploying |
| `force` | train even when data, code and parameters are unchanged since the last successful run |
| `deploy_target` | where the model is served: {_listed(target_names())} |

**Schedule**: `{schedule}` as declared, or `{CRON_ENV}` where the deployment sets it (`none`: manual only); and,
when `NIGHTSHIFT_EVENTS_REDIS_URL` (or `NIGHTSHIFT_EVENTS_CONN_ID`) is set and `NIGHTSHIFT_EVENTS_PIPELINES` names
this DAG (default: `nightly_retrain`), also each "new data" event (`nightshift publish-data DIR`, the Asset
`nightshift://events/new-data` with an AssetWatcher reading a Redis stream with a consumer group): such a run
validates, stages and trains on the event's directory.

**Retries**: a failed `train` is retried twice, each retry resuming from the checkpoint, after
`{RETRY_DELAY_ENV}` seconds (default 60, doubled for the second).

Assets: `stage_dataset` emits `{pipeline.dataset_asset_uri}` (extra: the version hash), `deploy` emits
`{pipeline.champion_asset_uri}` (extra: the model version and URL).
A failed task writes a summary of what failed and why at the end of its log.
"""


def default_args() -> dict[str, Any]:
    return {
        "owner": "ml-platform",
        "retries": 2,
        "retry_delay": timedelta(seconds=30),
        "retry_exponential_backoff": 2.0,
        "max_retry_delay": timedelta(minutes=10),
        "execution_timeout": timedelta(minutes=30),
        "on_failure_callback": steps.failure_summary,
    }


def train_command(pipeline: Pipeline) -> list[str]:
    """The trainer's command line; templates filled from the run's params and its earlier tasks' XComs."""
    return [
        "python", "-m", "nightshift.train",
        "--data", "{{ ti.xcom_pull(task_ids='stage_dataset')['path'] }}",
        "--out", "{{ ti.xcom_pull(task_ids='stage_dataset')['workspace'] }}/model",
        *steps.trainer_dataset_args(pipeline),
        "--epochs", "{{ params.epochs }}",
        # Params left empty were resolved by check_changes (best.json, else the declaration and the trainer).
        "--batch-size", "{{ " + TRAINING + "['batch_size'] }}",
        "--lr", "{{ " + TRAINING + "['lr'] }}",
        "--momentum", "{{ " + TRAINING + "['momentum'] }}",
        "--model", "{{ " + TRAINING + "['model'] }}",
        "--model-kwargs", "{{ " + TRAINING + "['model_kwargs'] | tojson }}",
        # A worker that asked for GPUs must train on them: without one it fails at once, naming the host.
        "--device", "{{ 'cuda' if params.gpus_per_worker | int > 0 or params.gpus | int > 0 else 'cpu' }}",
        "--mlflow-experiment", steps.experiment(pipeline),
        "--mlflow-run-name", "{{ run_id }}",
        "--tag", "nightshift.run_key={{ dag.dag_id }}/{{ run_id }}",
        "--tag", "nightshift.dag_run_id={{ run_id }}",
        "--tag", "nightshift.dataset_version={{ ti.xcom_pull(task_ids='stage_dataset')['hash'] }}",
        # The code this run is pinned to (the git DAG bundle's commit, see nightshift.ledger.code_version):
        # part of the checkpoints' resume key, with the data's content hash and the parameters.
        "--code-version", "{{ " + FINGERPRINT + "['code_version'] }}",
        "--tag", "nightshift.code_version={{ " + FINGERPRINT + "['code_version'] }}",
        "--tag", "nightshift.training_defaults={{ " + TRAINING + "['summary'] }}",
        "--tag", "nightshift.training_options={{ " + TRAINING + " | tojson }}",
    ]


# ---- the DAG ------------------------------------------------------------------------------------------------

def build_dag(pipeline: Pipeline) -> DAG:
    """The retraining DAG of a valid `pipeline`."""
    dataset_asset = Asset(pipeline.dataset_asset_uri, group="nightshift")
    champion_asset = Asset(pipeline.champion_asset_uri, group="nightshift")
    _BUILT[pipeline.dag_id] = pipeline

    with DAG(
        dag_id=pipeline.dag_id,
        description=pipeline.description or "Validate, version, train with Horovod, evaluate, register and deploy "
                                            "the model",
        # With NIGHTSHIFT_EVENTS_REDIS_URL (or NIGHTSHIFT_EVENTS_CONN_ID) set, a "new data" event (`nightshift
        # publish-data DIR`) starts a run too: the cron or the event's Asset, whichever comes first.
        schedule=retrain_schedule(schedule_cron(pipeline), pipeline.dag_id),
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        dagrun_timeout=timedelta(hours=12),
        default_args=default_args(),
        params=pipeline_params(pipeline),
        tags=list(TAGS),
        doc_md=doc_md(pipeline),
    ) as dag:
        validate = GXDataGateOperator(task_id="validate_data", pipeline=pipeline,
                                      data_source="{{ params.data_source or '' }}",
                                      execution_timeout=timedelta(minutes=20))

        @task(outlets=[dataset_asset])
        def stage_dataset(validated: dict) -> dict:
            context = get_current_context()
            staged = steps.stage(pipeline, validated, context["dag"].dag_id, context["run_id"])
            context["outlet_events"][dataset_asset].extra = {
                "version": staged["hash"], "rows": staged["rows"], "source": staged["source"]}
            return staged

        @task.branch
        def check_changes(staged: dict) -> str:
            context = get_current_context()
            return steps.check_changes(pipeline, staged, context["params"], context["dag"].dag_id,
                                       context["run_id"], context["ti"])

        @task
        def skip_training() -> dict:
            ti = get_current_context()["ti"]
            return steps.skip_training(ti.xcom_pull(task_ids="check_changes", key="previous_run"))

        staged = stage_dataset(validate.output)
        branch = check_changes(staged)
        skipped = skip_training()

        # Workers, GPUs and backend come from the run's params (template fields, checked at execute); the
        # cluster policy in config/airflow_local_settings.py sizes the task's `gpu` pool slots from them.
        # Every path below lies in NIGHTSHIFT_HOME, which on Kubernetes is the shared volume the pods mount;
        # the result comes back from MLflow (the run tagged with the run key), not from this machine's disk.
        train = HorovodKubernetesOperator(
            task_id="train",
            job=JobConfig(
                num_workers="{{ params.workers }}",
                gpus_per_worker="{{ params.gpus_per_worker }}",
                gpus="{{ params.gpus }}",
                image=trainer_image(),
                command=train_command(pipeline),
                elastic={"min_workers": "{{ params.min_workers }}", "max_workers": "{{ params.max_workers }}"},
            ),
            cluster=ClusterConfig(
                backend="{{ params.backend }}",
                kueue_queue="{{ params.queue or '' }}",
                kueue_priority="{{ params.priority or '' }}",
            ),
            execution=ExecutionConfig(queue_timeout="{{ params.queue_timeout }}"),
            # The result is the run that trained on this try's data and code with these options, never one a
            # stale try logged under the same run key (nightshift.tracking.find_training_run).
            tracking=TrackingConfig(mlflow_experiment=steps.experiment(pipeline),
                                    mlflow_run_key="{{ dag.dag_id }}/{{ run_id }}",
                                    mlflow_expect_tags={
                                        "nightshift.dataset_version": "{{ " + STAGED + "['hash'] }}",
                                        "nightshift.code_version": "{{ " + FINGERPRINT + "['code_version'] }}",
                                        "nightshift.training_options": "{{ " + TRAINING + " | tojson }}",
                                    }),
            execution_timeout=timedelta(hours=6),
            retry_delay=train_retry_delay(),
        )

        @task
        def evaluate(trained: dict, staged: dict) -> dict:
            return steps.evaluate(pipeline, trained, staged, get_current_context()["params"])

        @task
        def register(decision: dict, staged: dict) -> dict:
            context = get_current_context()
            return steps.register(pipeline, decision, staged, context["dag"].dag_id, context["run_id"],
                                  context["ti"])

        decision = evaluate(train.output, staged)
        registered = register(decision, staged)

        approve = OptionalApprovalOperator(
            task_id="approve",
            subject=f"Deploy the new {pipeline.model_name} model?",
            body="{{ ti.xcom_pull(task_ids='evaluate')['reasons'] | join('\n') }}",
            defaults="Reject",
            response_timeout=timedelta(hours=12),
            execution_timeout=None,
            retries=0,
        )

        @task(trigger_rule="none_failed_min_one_success", outlets=[champion_asset], retries=1)
        def deploy(staged: dict) -> dict:
            context = get_current_context()
            # Pulled, not passed: when the gate rejected the model, `register` is skipped and has no XCom, and
            # an XComArg argument would log an "XCom not found" error for a run that went as designed.
            registered = context["ti"].xcom_pull(task_ids="register") or None
            if not registered:
                # Nothing new to serve; but @champion's local server may have died since (killed, OOM, reboot)
                result = steps.restore_champion(pipeline, staged, context["params"])
                if result is None:
                    raise AirflowSkipException("nothing registered to deploy; @champion (if any) is served")
                context["outlet_events"][champion_asset].extra = {
                    "model_version": result.get("version"), "url": result.get("url"), "status": result["status"]}
                return result
            result = steps.deploy(pipeline, registered, staged, context["params"])
            context["outlet_events"][champion_asset].extra = {
                "model_version": result.get("version"), "url": result.get("url"), "status": result.get("status")}
            return result

        deployed = deploy(staged)

        @task(trigger_rule="none_failed", retries=0)
        def report() -> dict:
            context = get_current_context()
            ti = context["ti"]
            results = {name: ti.xcom_pull(task_ids=name)
                       for name in ("stage_dataset", "skip_training", "train", "evaluate", "register", "deploy")}
            results["fingerprint"] = ti.xcom_pull(task_ids="check_changes", key="fingerprint")
            return steps.report(pipeline, context["dag"].dag_id, context["run_id"], dict(context["params"]),
                                results)

        # The pipeline's last task, not a maintenance DAG: the policy is the pipeline's own (its declaration), it
        # never runs while the same pipeline trains (max_active_runs=1), and its removals show in that run's log.
        @task(retries=1, execution_timeout=timedelta(minutes=30))
        def collect_garbage() -> dict:
            return steps.collect_garbage(pipeline)

        branch >> [train, skipped]
        registered >> approve >> deployed
        [skipped, deployed] >> report() >> collect_garbage()
    return dag
