"""`model_search`: an Optuna search (ASHA or Hyperband) whose trials are Horovod training jobs.

This file only wires tasks. The work lives in `nightshift.search.steps` (imported inside each task) and
in `operators` (the Horovod operator, one mapped task per trial slot).
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from typing import Any

from airflow.sdk import DAG, Asset, Param, get_current_context, task, task_group
from airflow.sdk.bases.sensor import PokeReturnValue
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from operators.horovod import ClusterConfig, HorovodKubernetesOperator, JobConfig, TrackingConfig

DAG_ID = "model_search"
# Manual and UI triggers; NIGHTSHIFT_SEARCH_CRON (e.g. "0 3 * * 6") adds a weekly search.
_CRON = os.environ.get("NIGHTSHIFT_SEARCH_CRON", "none").strip()
SCHEDULE = None if _CRON.lower() in {"", "none"} else _CRON
TRAINER_IMAGE = os.environ.get("NIGHTSHIFT_TRAINER_IMAGE", "ghcr.io/nightshift/trainer:0.1.0")
# Airflow fixes max_active_tis_per_dagrun when it parses the DAG: this is the most trials that can ever
# run at once; the `max_concurrent_trials` Param (at most this) is enforced by the study (`ask` waits).
MAX_CONCURRENT_TRIALS = int(os.environ.get("NIGHTSHIFT_SEARCH_MAX_CONCURRENT", "4"))
ASK_POKE_SECONDS = float(os.environ.get("NIGHTSHIFT_SEARCH_POKE_SECONDS", "10"))
TRIAL_RETRY_SECONDS = float(os.environ.get("NIGHTSHIFT_SEARCH_RETRY_SECONDS", "30"))
BEST_ASSET = Asset("nightshift://search/best", group="nightshift")

DEFAULT_SPACE = {
    "lr": {"type": "float", "low": 1e-3, "high": 0.5, "log": True},
    "batch_size": {"type": "categorical", "choices": [16, 64]},
    "momentum": {"type": "float", "low": 0.5, "high": 0.99},
    "model_kwargs.channels": {"type": "int", "low": 8, "high": 64},
}

DOC_MD = """
### model_search

Searches trainer options with Optuna and stops bad trials early (ASHA: asynchronous successive halving,
or Hyperband). The objective is the validation accuracy, maximised.

`prepare` (checks the space, opens the study and the MLflow parent run) → for each trial slot (mapped):
`trial.ask` (asks the study for a trial; waits while `max_concurrent_trials` run; skipped once the budget
is spent) → `trial.train` (`HorovodKubernetesOperator`: the trainer reports val_accuracy to the study after
every epoch and stops at a rung when pruned: the task ends *skipped*) → `trial.tell` (COMPLETE, PRUNED or
FAIL in the study; the MLflow child run) → `finish` (best configuration to `NIGHTSHIFT_HOME/search/best.json`,
emits `nightshift://search/best`; the search's pictures to `NIGHTSHIFT_HOME/search/<study>/report.html`,
which the task's extra link "Search report" opens, also when no trial completed).

**Parameters**

| param | meaning |
|---|---|
| `space` | trainer option (`lr`, `batch_size`, `momentum`, `model_kwargs.<arg>`...) -> distribution (below) |
| `fixed` | trainer options every trial shares, e.g. `{"model_kwargs.hidden": 64}` |
| `data_source` | directory with train/validation/test.parquet; empty: the demo dataset |
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
| `backend` | `local`, `kubernetes` or `auto` |
| `storage_conn_id` | an Airflow connection (PostgreSQL) holding the study; empty: SQLite under NIGHTSHIFT_HOME |
| `study` | study name; empty: one per DAG run |

A distribution is `{"type": "float", "low": L, "high": H}` (optional `"log": true` or `"step": S`), the same
with `"type": "int"`, or `{"type": "categorical", "choices": [...]}`. A malformed space or an unknown
option fails `prepare`, naming the key.
"""

PARAMS = {
    "space": Param(DEFAULT_SPACE, type="object", title="Search space",
                   description="Trainer option -> Optuna distribution (float, int or categorical)."),
    "fixed": Param({}, type="object", title="Fixed options", description="Trainer options every trial shares."),
    "data_source": Param(None, type=["null", "string"], title="Data source",
                         description="Directory with train/validation/test.parquet. Empty: the demo dataset."),
    "n_trials": Param(8, type="integer", minimum=1, maximum=256, title="Trials", description="Trials to run."),
    "max_concurrent_trials": Param(min(2, MAX_CONCURRENT_TRIALS), type="integer", minimum=1,
                                   maximum=MAX_CONCURRENT_TRIALS, title="Concurrent trials",
                                   description=f"Trials training at once (at most {MAX_CONCURRENT_TRIALS}, "
                                               f"NIGHTSHIFT_SEARCH_MAX_CONCURRENT)."),
    "max_epochs": Param(9, type="integer", minimum=1, maximum=1000, title="Max epochs",
                        description="Epochs of a trial that is never pruned."),
    "min_epochs": Param(1, type="integer", minimum=1, maximum=1000, title="Min epochs",
                        description="Epochs before the first rung."),
    "reduction_factor": Param(3, type="integer", minimum=2, maximum=16, title="Reduction factor",
                              description="At each rung, 1/reduction_factor of the trials go on."),
    "pruner": Param("asha", type="string", enum=["asha", "hyperband"], title="Pruner",
                    description="asha: asynchronous successive halving; hyperband."),
    "sampler": Param("tpe", type="string", enum=["tpe", "random"], title="Sampler", description="TPE or random."),
    "seed": Param(0, type="integer", title="Seed", description="Sampler seed."),
    "budget_hours": Param(None, type=["null", "number"], exclusiveMinimum=0, title="Budget (GPU/CPU-hours)",
                          description="Wall time x ranks of all trials; past it no new trial starts. Empty: none."),
    "workers": Param(1, type="integer", minimum=1, maximum=256, title="Workers", description="Workers per trial."),
    "gpus_per_worker": Param(0, type="integer", minimum=0, maximum=16, title="GPUs per worker",
                             description="GPUs per worker; 0 trains on CPU."),
    "backend": Param("local", type="string", enum=["local", "kubernetes", "auto"], title="Backend",
                     description="local: horovodrun here; kubernetes: an MPIJob per trial; auto."),
    "storage_conn_id": Param(None, type=["null", "string"], title="Study storage connection",
                             description="Airflow connection of a PostgreSQL database for the study (no "
                                         "password in it: use ~/.pgpass). Empty: SQLite under NIGHTSHIFT_HOME."),
    "study": Param(None, type=["null", "string"], title="Study name",
                   description="Continue or name a study. Empty: a study of this DAG run."),
}

DEFAULT_ARGS = {
    "owner": "ml-platform",
    "retries": 0,
    "execution_timeout": timedelta(minutes=30),
}


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


with DAG(
    dag_id=DAG_ID,
    description="Search training options with Optuna (ASHA), each trial a Horovod job",
    schedule=SCHEDULE,
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    dagrun_timeout=timedelta(hours=48),
    default_args=DEFAULT_ARGS,
    params=PARAMS,
    tags=["nightshift", "search", "optuna", "horovod"],
    doc_md=DOC_MD,
) as dag:

    @task
    def prepare() -> list[int]:
        """Push the search (XCom `search`); return the trial slots to map over."""
        from nightshift.errors import UsageError
        from nightshift.search import steps

        context = get_current_context()
        params = dict(context["params"])
        try:
            search = steps.prepare(params, dag_id=context["dag"].dag_id, run_id=context["run_id"],
                                   storage=_storage(params.get("storage_conn_id")))
        except UsageError as err:  # a bad space or option: retrying cannot help
            raise AirflowFailException(str(err)) from err
        context["ti"].xcom_push(key="search", value=search)
        return list(search["slots"])

    @task_group(group_id="trial")
    def trial(slot: int) -> None:
        @task.sensor(poke_interval=ASK_POKE_SECONDS, timeout=timedelta(hours=47).total_seconds(), mode="reschedule",
                     execution_timeout=timedelta(minutes=5), retries=2)
        def ask(slot: int) -> PokeReturnValue:
            from nightshift.search import steps

            ti = get_current_context()["ti"]
            try:
                asked = steps.ask(ti.xcom_pull(task_ids="prepare", key="search"), map_index=int(ti.map_index))
            except steps.BudgetSpent as err:
                raise AirflowSkipException(str(err)) from err
            return PokeReturnValue(is_done=asked is not None, xcom_value=asked)

        asked = ask(slot)
        pulled = "ti.xcom_pull(task_ids='trial.ask', map_indexes=ti.map_index)"
        train = HorovodKubernetesOperator(
            task_id="train",
            job=JobConfig(num_workers="{{ params.workers }}", gpus_per_worker="{{ params.gpus_per_worker }}",
                          image=TRAINER_IMAGE, command="{{ " + pulled + "['command'] }}"),
            cluster=ClusterConfig(backend="{{ params.backend }}"),
            tracking=TrackingConfig(mlflow_experiment="model_search", mlflow_run_key="{{ " + pulled + "['run_key'] }}"),
            post_execute=_skip_if_pruned,
            max_active_tis_per_dagrun=MAX_CONCURRENT_TRIALS,
            execution_timeout=timedelta(hours=6),
            retries=1,  # resumes from the trial's checkpoint
            retry_delay=timedelta(seconds=TRIAL_RETRY_SECONDS),
        )

        @task(trigger_rule="all_done")
        def tell() -> dict[str, Any]:
            from nightshift.search import steps

            ti = get_current_context()["ti"]
            asked = ti.xcom_pull(task_ids="trial.ask", map_indexes=ti.map_index)
            if not asked:
                raise AirflowSkipException("this slot asked for no trial")
            trained = ti.xcom_pull(task_ids="trial.train", map_indexes=ti.map_index)
            return steps.tell(ti.xcom_pull(task_ids="prepare", key="search"), asked, trained)

        asked >> train >> tell()

    @task(trigger_rule="all_done", outlets=[BEST_ASSET])
    def finish() -> dict[str, Any]:
        from nightshift.search import steps

        context = get_current_context()
        search = context["ti"].xcom_pull(task_ids="prepare", key="search")
        if not search:  # fail the run: a search that could not start is no success
            raise AirflowFailException("prepare opened no search (see its log for why)")
        try:
            report = steps.finish(search)
        except steps.NoTrialCompleted as err:
            context["ti"].xcom_push(key="report", value=err.report)  # its pictures show why
            raise AirflowFailException(str(err)) from err
        context["outlet_events"][BEST_ASSET].extra = {
            "study": report["study"], "trial": report["best"]["trial"], "value": report["best"]["value"],
            "version": report["best_file"]["version"], "path": report["best_file"]["path"]}
        return report

    trial.expand(slot=prepare()) >> finish()
