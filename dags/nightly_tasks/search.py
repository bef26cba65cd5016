"""A pipeline's model search DAG: an Optuna search (ASHA or Hyperband) of one declared pipeline's training
options, each trial a Horovod training job of what that pipeline trains.

    # dags/churn.py, beside dags/churn.yaml: the Airflow DAGs of that declaration (Airflow parses only files
    # that say "airflow" and "dag"): the pipeline's, and its model search churn_retrain__search
    from nightly_tasks.factory import pipeline_dag
    from nightly_tasks.search import search_dag
    dag = pipeline_dag(__file__)
    search = search_dag(__file__)

Everything the search takes from the declaration comes from it at run time, not from this module: the data (the
declared data unless `data_source`, confined to the data roots as the pipeline's training is), the dataset loader
and its options, the task, the model and its arguments, and the objective (the task's validation metric:
val_accuracy maximised, val_rmse minimised). The result is the pipeline's own best.json
(NIGHTSHIFT_HOME/search/<dag_id>/best.json), which that pipeline's runs read and no other; the report pages lie
beside it, the study is named after the search DAG and its run, the MLflow experiment is the search DAG's id.
The demo's search DAG is `model_search` (dags/model_search.py), the same DAG under its older name.

This module only wires tasks. The work lives in `nightshift.search.steps` (imported inside each task) and in
`operators` (the Horovod operator, one mapped task per trial slot).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import DAG, Asset, Param, get_current_context, task, task_group
from airflow.sdk.bases.sensor import PokeReturnValue
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from nightly_tasks import steps
from nightly_tasks.factory import START_DATE, invalid_dag, read_declaration, trainer_image
from operators.backends import backend_choices, backend_help
from operators.horovod import ClusterConfig, HorovodKubernetesOperator, JobConfig, TrackingConfig

if TYPE_CHECKING:
    from nightshift.pipelines import Pipeline

CRON_ENV = "NIGHTSHIFT_SEARCH_CRON"
TAGS = ["nightshift", "search", "optuna", "horovod"]
# The trainer options every model takes; a pipeline's search DAG searches these unless it is given a space.
TRAINER_SPACE = {
    "lr": {"type": "float", "low": 1e-3, "high": 0.5, "log": True},
    "batch_size": {"type": "categorical", "choices": [16, 64]},
    "momentum": {"type": "float", "low": 0.5, "high": 0.99},
}

DEFAULT_ARGS = {
    "owner": "ml-platform",
    "retries": 0,
    "execution_timeout": timedelta(minutes=30),
}


# ---- what the environment of a deployment sets --------------------------------------------------------------

def schedule_cron() -> str | None:
    """NIGHTSHIFT_SEARCH_CRON (e.g. "0 3 * * 6") adds a weekly search to manual and UI triggers; unset or "none":
    none."""
    text = os.environ.get(CRON_ENV, "none").strip()
    return None if text.lower() in {"", "none"} else text


def max_concurrent_trials() -> int:
    """NIGHTSHIFT_SEARCH_MAX_CONCURRENT (4). Airflow fixes max_active_tis_per_dagrun when it parses the DAG: this
    is the most trials that can ever run at once; the `max_concurrent_trials` Param (at most this) is enforced by
    the study (`ask` waits)."""
    return int(os.environ.get("NIGHTSHIFT_SEARCH_MAX_CONCURRENT", "4"))


def ask_poke_seconds() -> float:
    return float(os.environ.get("NIGHTSHIFT_SEARCH_POKE_SECONDS", "10"))


def trial_retry_seconds() -> float:
    return float(os.environ.get("NIGHTSHIFT_SEARCH_RETRY_SECONDS", "30"))


# ---- Params and docs ----------------------------------------------------------------------------------------

def search_params(pipeline: Pipeline, space: dict[str, Any]) -> dict[str, Param]:
    most = max_concurrent_trials()
    return {
        "space": Param(space, type="object", title="Search space",
                       description="Trainer option -> Optuna distribution (float, int or categorical)."),
        "fixed": Param({}, type="object", title="Fixed options",
                       description="Trainer options every trial shares (the declaration fixes the dataset, its "
                                   "options, the task and, unless fixed or searched here, the model)."),
        "data_source": Param(None, type=["null", "string"], title="Data source",
                             description=f"Directory with train/validation/test.parquet. Empty: the declared data "
                                         f"of {pipeline.dag_id}."),
        "n_trials": Param(8, type="integer", minimum=1, maximum=256, title="Trials", description="Trials to run."),
        "max_concurrent_trials": Param(min(2, most), type="integer", minimum=1, maximum=most,
                                       title="Concurrent trials",
                                       description=f"Trials training at once (at most {most}, "
                                                   f"NIGHTSHIFT_SEARCH_MAX_CONCURRENT)."),
        "max_epochs": Param(9, type="integer", minimum=1, maximum=1000, title="Max epochs",
                            description="Epochs of a trial that is never pruned."),
        "min_epochs": Param(1, type="integer", minimum=1, maximum=1000, title="Min epochs",
                            description="Epochs before the first rung."),
        "reduction_factor": Param(3, type="integer", minimum=2, maximum=16, title="Reduction factor",
                                  description="At each rung, 1/reduction_factor of the trials go on."),
        "pruner": Param("asha", type="string", enum=["asha", "hyperband"], title="Pruner",
                        description="asha: asynchronous successive halving; hyperband."),
        "sampler": Param("tpe", type="string", enum=["tpe", "random"], title="Sampler",
                         description="TPE or random."),
        "seed": Param(0, type="integer", title="Seed", description="Sampler seed."),
        "budget_hours": Param(None, type=["null", "number"], exclusiveMinimum=0, title="Budget (GPU/CPU-hours)",
                              description="Wall time x ranks of all trials; past it no new trial starts. Empty: "
                                          "none."),
        "workers": Param(1, type="integer", minimum=1, maximum=256, title="Workers",
                         description="Workers per trial."),
        "gpus_per_worker": Param(0, type="integer", minimum=0, maximum=16, title="GPUs per worker",
                                 description="GPUs per worker; 0 trains on CPU."),
        "backend": Param("local", type="string", enum=list(backend_choices()), title="Backend",
                         description=f"Where each trial trains: {backend_help()}"),
        "storage_conn_id": Param(None, type=["null", "string"], title="Study storage connection",
                                 description="Airflow connection of a PostgreSQL database for the study (no "
                                             "password in it: use ~/.pgpass). Empty: SQLite under "
                                             "NIGHTSHIFT_HOME."),
        "study": Param(None, type=["null", "string"], title="Study name",
                       description="Continue or name a study. Empty: a study of this DAG run."),
    }


def doc_md(pipeline: Pipeline, dag_id: str) -> str:
    """The search DAG's docs, from the declaration."""
    from nightshift.tasks import validation_metric

    objective = validation_metric(pipeline.task)
    way = "maximised" if objective.higher_is_better else "minimised"
    return f"""
### {dag_id}

Searches the training options of the pipeline `{pipeline.dag_id}` with Optuna and stops bad trials early (ASHA:
asynchronous successive halving, or Hyperband). Every trial trains what `{pipeline.dag_id}` trains: its dataset
loader `{pipeline.dataset.loader}` and options, the {pipeline.task} task and the model `{pipeline.model.name}` (unless
`fixed` or `space` sets `model`). The objective is `val_{objective.name}` on the validation split, {way}.

`prepare` (checks the space, opens the study and the MLflow parent run) → for each trial slot (mapped):
`trial.ask` (asks the study for a trial; waits while `max_concurrent_trials` run; skipped once the budget
is spent) → `trial.train` (`HorovodKubernetesOperator`: the trainer reports `val_{objective.name}` to the study after
every epoch and stops at a rung when pruned: the task ends *skipped*) → `trial.tell` (COMPLETE, PRUNED or
FAIL in the study; the MLflow child run) → `finish` (best configuration to
`NIGHTSHIFT_HOME/search/{pipeline.dag_id}/best.json`, which `{pipeline.dag_id}`'s runs read and no other pipeline's;
emits `{pipeline.search_asset_uri}`; the search's pictures to
`NIGHTSHIFT_HOME/search/{pipeline.dag_id}/<study>/report.html`, which the task's extra link "Search report" opens,
also when no trial completed).

**Parameters**

| param | meaning |
|---|---|
| `space` | trainer option (`lr`, `batch_size`, `momentum`, `model_kwargs.<arg>`...) -> distribution (below) |
| `fixed` | trainer options every trial shares, e.g. `{{"model_kwargs.hidden": 64}}` |
| `data_source` | directory with train/validation/test.parquet; empty: the declared data |
| `n_trials` | trials in the study (one mapped slot each) |
| `max_concurrent_trials` | trials training at once |
| `max_epochs` | epochs of a trial that is never pruned |
| `min_epochs` | epochs before the first rung |
| `reduction_factor` | at each rung 1/reduction_factor of the trials go on |
| `pruner` | `asha` or `hyperband` |
| `sampler` | `tpe` or `random`, seeded by `seed` and the trial number |
| `seed` | sampler seed |
| `budget_hours` | compute budget in GPU-hours (CPU-hours on CPU): wall time x ranks; past it no trial starts |
| `workers` | Horovod workers per trial |
| `gpus_per_worker` | GPUs per worker (0: CPU) |
| `backend` | a training backend: {", ".join(f"`{name}`" for name in backend_choices())} |
| `storage_conn_id` | an Airflow connection (PostgreSQL) holding the study; empty: SQLite under NIGHTSHIFT_HOME |
| `study` | study name; empty: one per DAG run |

A distribution is `{{"type": "float", "low": L, "high": H}}` (optional `"log": true` or `"step": S`), the same
with `"type": "int"`, or `{{"type": "categorical", "choices": [...]}}`. A malformed space, an unknown option, or
one the declaration sets (`dataset`, `dataset_options`, `task`) fails `prepare`, naming the key.
"""


# ---- the DAG ------------------------------------------------------------------------------------------------

def search_dag(declaration: Pipeline | str | os.PathLike[str], *, dag_id: str | None = None,
               space: dict[str, Any] | None = None) -> DAG:
    """The model search DAG of `declaration` (a Pipeline, a YAML path, or a stub's `__file__`): `dag_id` (default
    `<pipeline dag_id>__search`), searching `space` by default (TRAINER_SPACE). For a declaration that is not
    valid, an `InvalidPipelineDag` that fails the file's import with the loader's one line."""
    from nightshift.pipelines import PipelineInvalid
    from nightshift.pipelines.spec import SEARCH_DAG_SUFFIX

    try:
        pipeline = read_declaration(declaration)
    except PipelineInvalid as err:
        return invalid_dag(declaration, err, suffix=SEARCH_DAG_SUFFIX)
    return build_search_dag(pipeline, dag_id=dag_id or pipeline.search_dag_id, space=space or TRAINER_SPACE)


def _storage(conn_id: str | None) -> str | None:
    if not conn_id:
        return None
    from airflow.sdk import BaseHook

    uri = BaseHook.get_connection(conn_id).get_uri()
    return "postgresql://" + uri.removeprefix("postgres://") if uri.startswith("postgres://") else uri


def _skip_if_pruned(context: Any, result: Any) -> None:
    """post_execute of a trial: a trainer that stopped at a rung was pruned, which is a skip, not a success."""
    stopped = ((result or {}).get("metrics") or {}).get("stopped_at_epoch")
    if stopped:
        raise AirflowSkipException(f"pruned by the study after epoch {int(stopped)}")


def build_search_dag(pipeline: Pipeline, *, dag_id: str, space: dict[str, Any]) -> DAG:
    """The search DAG of a valid `pipeline`."""
    best_asset = Asset(pipeline.search_asset_uri, group="nightshift")
    most = max_concurrent_trials()

    with DAG(
        dag_id=dag_id,
        description=f"Search training options of {pipeline.dag_id} with Optuna (ASHA), each trial a Horovod job",
        schedule=schedule_cron(),
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        dagrun_timeout=timedelta(hours=48),
        default_args=DEFAULT_ARGS,
        params=search_params(pipeline, space),
        tags=list(TAGS),
        doc_md=doc_md(pipeline, dag_id),
    ) as dag:

        @task
        def prepare() -> list[int]:
            """Push the search (XCom `search`); return the trial slots to map over."""
            from nightshift.errors import UsageError
            from nightshift.search import steps as search_steps

            context = get_current_context()
            params = dict(context["params"])
            try:  # the data as the pipeline's training takes it: declared, or a data_source under the data roots
                data = steps.resolve_data_source(pipeline, params.get("data_source") or "")
                search = search_steps.prepare(params, pipeline=pipeline, data=data, dag_id=context["dag"].dag_id,
                                              run_id=context["run_id"], storage=_storage(params.get("storage_conn_id")))
            except UsageError as err:  # a bad space, option or data: retrying cannot help
                raise AirflowFailException(str(err)) from err
            context["ti"].xcom_push(key="search", value=search)
            return list(search["slots"])

        @task_group(group_id="trial")
        def trial(slot: int) -> None:
            @task.sensor(poke_interval=ask_poke_seconds(), timeout=timedelta(hours=47).total_seconds(),
                         mode="reschedule", execution_timeout=timedelta(minutes=5), retries=2)
            def ask(slot: int) -> PokeReturnValue:
                from nightshift.search import steps as search_steps

                ti = get_current_context()["ti"]
                try:
                    asked = search_steps.ask(ti.xcom_pull(task_ids="prepare", key="search"),
                                             map_index=int(ti.map_index))
                except search_steps.BudgetSpent as err:
                    raise AirflowSkipException(str(err)) from err
                return PokeReturnValue(is_done=asked is not None, xcom_value=asked)

            asked = ask(slot)
            pulled = "ti.xcom_pull(task_ids='trial.ask', map_indexes=ti.map_index)"
            train = HorovodKubernetesOperator(
                task_id="train",
                job=JobConfig(num_workers="{{ params.workers }}", gpus_per_worker="{{ params.gpus_per_worker }}",
                              image=trainer_image(), command="{{ " + pulled + "['command'] }}"),
                cluster=ClusterConfig(backend="{{ params.backend }}"),
                tracking=TrackingConfig(mlflow_experiment=dag_id, mlflow_run_key="{{ " + pulled + "['run_key'] }}"),
                post_execute=_skip_if_pruned,
                max_active_tis_per_dagrun=most,
                execution_timeout=timedelta(hours=6),
                retries=1,  # resumes from the trial's checkpoint
                retry_delay=timedelta(seconds=trial_retry_seconds()),
            )

            @task(trigger_rule="all_done")
            def tell() -> dict[str, Any]:
                from nightshift.search import steps as search_steps

                ti = get_current_context()["ti"]
                asked = ti.xcom_pull(task_ids="trial.ask", map_indexes=ti.map_index)
                if not asked:
                    raise AirflowSkipException("this slot asked for no trial")
                trained = ti.xcom_pull(task_ids="trial.train", map_indexes=ti.map_index)
                return search_steps.tell(ti.xcom_pull(task_ids="prepare", key="search"), asked, trained)

            asked >> train >> tell()

        @task(trigger_rule="all_done", outlets=[best_asset])
        def finish() -> dict[str, Any]:
            from nightshift.search import steps as search_steps

            context = get_current_context()
            search = context["ti"].xcom_pull(task_ids="prepare", key="search")
            if not search:  # fail the run: a search that could not start is no success
                raise AirflowFailException("prepare opened no search (see its log for why)")
            try:
                report = search_steps.finish(search)
            except search_steps.NoTrialCompleted as err:
                context["ti"].xcom_push(key="report", value=err.report)  # its pictures show why
                raise AirflowFailException(str(err)) from err
            context["outlet_events"][best_asset].extra = {
                "pipeline": pipeline.dag_id, "study": report["study"], "trial": report["best"]["trial"],
                "value": report["best"]["value"], "version": report["best_file"]["version"],
                "path": report["best_file"]["path"]}
            return report

        trial.expand(slot=prepare()) >> finish()
    return dag
