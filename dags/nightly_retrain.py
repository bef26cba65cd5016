"""`nightly_retrain`: validate -> stage -> train (Horovod) -> evaluate -> register -> [approve] -> deploy.

This file only wires tasks. The work lives in `nightly_tasks` (which imports `nightshift`, and through
it torch, GX, DVC and MLflow, inside each task) and in `operators` (the Horovod operator).
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta

from airflow.sdk import DAG, Asset, Param, get_current_context, task
from airflow.sdk.exceptions import AirflowSkipException
from nightly_tasks import steps
from nightly_tasks.adapters import GXDataGateOperator, OptionalApprovalOperator
from nightly_tasks.events import retrain_schedule

from operators.horovod import ClusterConfig, ExecutionConfig, HorovodKubernetesOperator, JobConfig, TrackingConfig

DAG_ID = "nightly_retrain"
# Users change the schedule here or with NIGHTSHIFT_RETRAIN_CRON ("none": manual and UI triggers only).
_CRON = os.environ.get("NIGHTSHIFT_RETRAIN_CRON", "0 2 * * *").strip()
CRON = None if _CRON.lower() in {"", "none"} else _CRON
# With NIGHTSHIFT_EVENTS_REDIS_URL (or NIGHTSHIFT_EVENTS_CONN_ID) set, a "new data" event (`nightshift
# publish-data DIR`) starts a run too: the cron or the event's Asset, whichever comes first (nightly_tasks.events).
SCHEDULE = retrain_schedule(CRON)


def _train_retry_delay() -> timedelta:
    """NIGHTSHIFT_TRAIN_RETRY_DELAY_S (default 60): how long train waits before a retry resumes from the
    checkpoint (doubled at each further retry, at most 10 min); shorter where a lost worker is replaced at once."""
    text = os.environ.get("NIGHTSHIFT_TRAIN_RETRY_DELAY_S", "").strip() or "60"
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 3600:
        raise ValueError(f"NIGHTSHIFT_TRAIN_RETRY_DELAY_S={text!r} is not a number of seconds between 0 and 3600 "
                         f"(default 60)")
    return timedelta(seconds=seconds)


TRAIN_RETRY_DELAY = _train_retry_delay()
TRAINER_IMAGE = os.environ.get("NIGHTSHIFT_TRAINER_IMAGE", "ghcr.io/nightshift/trainer:0.1.0")

DATASET_ASSET = Asset("nightshift://datasets/digits", group="nightshift")
CHAMPION_ASSET = Asset(f"nightshift://models/{steps.MODEL_NAME}/champion", group="nightshift")
# The training parameters check_changes resolved when the run started (steps.resolve_training).
TRAINING = "ti.xcom_pull(task_ids='check_changes', key='training')"
STAGED = "ti.xcom_pull(task_ids='stage_dataset')"
# What check_changes compared with the last success: the dataset version, the code version, the parameters.
FINGERPRINT = "ti.xcom_pull(task_ids='check_changes', key='fingerprint')"

DOC_MD = """
### nightly_retrain

Retrains the model every night on the newest data and promotes it only when it beats the champion.

`validate_data` (GX suite in `gx/`, through the GX Airflow provider) → `stage_dataset` (DVC version) →
`check_changes` → `train` (`HorovodKubernetesOperator`) → `evaluate` (vs `@champion`) → `register`
(MLflow, `@challenger`) → `approve` (human in the loop, optional) → `deploy` → `report`.

When the dataset version, the code and the training parameters are the same as in the last successful
run, `skip_training` runs instead of `train` and nothing downstream of it (unless `force`).

Training parameters left empty (`learning_rate`, `batch_size`, `momentum`, `model_kwargs`) take the best
configuration of the last `model_search` (`NIGHTSHIFT_HOME/search/best.json`, read by `check_changes` when the
run starts), else the trainer's defaults; the MLflow tag `nightshift.training_defaults` and the lineage record
say which values came from where (and best.json's study and trial). A malformed best.json fails `check_changes`.

**Parameters** (the trigger form shows them):

| param | meaning |
|---|---|
| `data_source` | directory with `train/validation/test.parquet`; empty: the demo dataset in `NIGHTSHIFT_HOME` |
| `epochs` | training epochs |
| `learning_rate` | base learning rate (the trainer scales it by the number of workers); empty: best.json's, else 0.05 |
| `batch_size` | batch size per worker; empty: best.json's, else 32 |
| `momentum` | SGD momentum; empty: best.json's, else 0.9 |
| `model_kwargs` | the model's arguments (a JSON object); empty: best.json's (with its model), else none |
| `workers` | Horovod workers: pods of the MPIJob, or local processes |
| `gpus_per_worker` | GPUs each worker asks for (0 = CPU); also the MPI slots per worker |
| `gpus` | total GPUs, packed into the fewest equal workers of at most one node (0: workers x GPUs per worker) |
| `queue` | Kueue LocalQueue for the MPIJob (default `NIGHTSHIFT_KUEUE_QUEUE`; empty: no Kueue) |
| `priority` | Kueue WorkloadPriorityClass of the MPIJob |
| `queue_timeout` | seconds the MPIJob may wait for Kueue admission before `train` fails saying why (empty: no limit) |
| `backend` | `local` (horovodrun on the worker machine), `kubernetes` (an MPIJob), or `auto` |
| `min_improvement` | how much test accuracy the new model must gain over the champion to be promoted |
| `require_approval` | wait for a person to approve in the UI (Required actions) before deploying |
| `force` | train even when data, code and parameters are unchanged since the last successful run |
| `deploy_target` | `local` (MLflow model server on 127.0.0.1, blue/green) or `kserve` |

**Schedule**: `NIGHTSHIFT_RETRAIN_CRON` (default `0 2 * * *`), and, when `NIGHTSHIFT_EVENTS_REDIS_URL` (or
`NIGHTSHIFT_EVENTS_CONN_ID`) is set,
also each "new data" event (`nightshift publish-data DIR`, the Asset `nightshift://events/new-data` with an
AssetWatcher reading a Redis stream with a consumer group): such a run validates, stages and trains on the
event's directory.

**Retries**: a failed `train` is retried twice, each retry resuming from the checkpoint, after
`NIGHTSHIFT_TRAIN_RETRY_DELAY_S` seconds (default 60, doubled for the second).

Assets: `stage_dataset` emits `nightshift://datasets/digits` (extra: the version hash), `deploy` emits
`nightshift://models/nightshift-digits/champion` (extra: the model version and URL).
A failed task writes a summary of what failed and why at the end of its log.
"""

PARAMS = {
    # An optional Param must accept null: the trigger form sends an emptied field as null, and a plain
    # "string" Param with an empty default keeps the Trigger button disabled.
    "data_source": Param(None, type=["null", "string"], title="Data source",
                         description="Directory with train/validation/test.parquet. Empty: the demo dataset."),
    "epochs": Param(5, type="integer", minimum=1, maximum=1000, title="Epochs", description="Training epochs."),
    # Empty (null): the best model search's value (search/best.json, read when the run starts), else the
    # trainer's default. A value given at trigger time wins.
    "learning_rate": Param(None, type=["null", "number"], exclusiveMinimum=0, maximum=10, title="Learning rate",
                           description="Base learning rate, multiplied by the number of workers. Empty: the "
                                       "best model search's (search/best.json), else 0.05."),
    "batch_size": Param(None, type=["null", "integer"], minimum=1, maximum=65536, title="Batch size",
                        description="Batch size per worker. Empty: the best model search's, else 32."),
    "momentum": Param(None, type=["null", "number"], minimum=0, exclusiveMaximum=1, title="Momentum",
                      description="SGD momentum. Empty: the best model search's, else 0.9."),
    # Object or string: the trigger form then shows a text field (JSON text is parsed by check_changes).
    "model_kwargs": Param(None, type=["null", "object", "string"], title="Model arguments",
                          description="The model's keyword arguments, a JSON object such as "
                                      '{"channels": 32}. Empty: taken from the best model search (with its '
                                      "model), else none."),
    "workers": Param(2, type="integer", minimum=1, maximum=256, title="Workers",
                     description="Horovod workers (MPIJob worker pods, or local processes)."),
    "gpus_per_worker": Param(0, type="integer", minimum=0, maximum=16, title="GPUs per worker",
                             description="GPUs per worker; 0 trains on CPU."),
    "gpus": Param(0, type="integer", minimum=0, maximum=4096, title="GPUs in total",
                  description="Total GPUs, packed into the fewest equal workers of at most one node's GPUs "
                              "(NIGHTSHIFT_GPUS_PER_NODE or the cluster's nodes). 0: workers x GPUs per worker."),
    "queue": Param(os.environ.get("NIGHTSHIFT_KUEUE_QUEUE") or None, type=["null", "string"], title="Kueue queue",
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
                           description="Seconds (1 to 86400) the MPIJob may wait in the Kueue queue (since it was "
                                       "last suspended) before train fails with the reason it waited. Empty: no "
                                       "limit."),
    # Scheduled runs take the default: a cluster deployment sets NIGHTSHIFT_BACKEND=kubernetes.
    "backend": Param(os.environ.get("NIGHTSHIFT_BACKEND", "local"), type="string",
                     enum=["local", "kubernetes", "auto"], title="Backend",
                     description="local: horovodrun here; kubernetes: an MPIJob; auto: kubernetes when "
                                 "the kubernetes_default connection exists."),
    "min_improvement": Param(0.001, type="number", minimum=0, maximum=1, title="Minimum improvement",
                             description="Accuracy gain over the champion needed to promote the new model."),
    "require_approval": Param(False, type="boolean", title="Require approval",
                              description="Wait for a human approval in the UI before deploying."),
    "force": Param(False, type="boolean", title="Force training",
                   description="Train even when data, code and training params are unchanged."),
    "deploy_target": Param("local", type="string", enum=["local", "kserve"], title="Deploy target",
                           description="local: MLflow model server on 127.0.0.1; kserve: an InferenceService."),
}

DEFAULT_ARGS = {
    "owner": "ml-platform",
    "retries": 2,
    "retry_delay": timedelta(seconds=30),
    "retry_exponential_backoff": 2.0,
    "max_retry_delay": timedelta(minutes=10),
    "execution_timeout": timedelta(minutes=30),
    "on_failure_callback": steps.failure_summary,
}

with DAG(
    dag_id=DAG_ID,
    description="Validate, version, train with Horovod, evaluate, register and deploy the model nightly",
    schedule=SCHEDULE,
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    dagrun_timeout=timedelta(hours=12),
    default_args=DEFAULT_ARGS,
    params=PARAMS,
    tags=["nightshift", "training", "horovod", "mlflow"],
    doc_md=DOC_MD,
) as dag:
    validate = GXDataGateOperator(task_id="validate_data", data_source="{{ params.data_source or '' }}",
                                  execution_timeout=timedelta(minutes=20))

    @task(outlets=[DATASET_ASSET])
    def stage_dataset(validated: dict) -> dict:
        context = get_current_context()
        staged = steps.stage(validated, context["dag"].dag_id, context["run_id"])
        context["outlet_events"][DATASET_ASSET].extra = {
            "version": staged["hash"], "rows": staged["rows"], "source": staged["source"]}
        return staged

    @task.branch
    def check_changes(staged: dict) -> str:
        context = get_current_context()
        return steps.check_changes(staged, context["params"], context["dag"].dag_id, context["run_id"],
                                   context["ti"])

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
            image=TRAINER_IMAGE,
            command=[
                "python", "-m", "nightshift.train",
                "--data", "{{ ti.xcom_pull(task_ids='stage_dataset')['path'] }}",
                "--out", "{{ ti.xcom_pull(task_ids='stage_dataset')['workspace'] }}/model",
                "--epochs", "{{ params.epochs }}",
                # Params left empty were resolved by check_changes (best.json, else the trainer's defaults).
                "--batch-size", "{{ " + TRAINING + "['batch_size'] }}",
                "--lr", "{{ " + TRAINING + "['lr'] }}",
                "--momentum", "{{ " + TRAINING + "['momentum'] }}",
                "--model", "{{ " + TRAINING + "['model'] }}",
                "--model-kwargs", "{{ " + TRAINING + "['model_kwargs'] | tojson }}",
                # A worker that asked for GPUs must train on them: without one it fails at once, naming the host.
                "--device", "{{ 'cuda' if params.gpus_per_worker | int > 0 or params.gpus | int > 0 else 'cpu' }}",
                "--mlflow-experiment", steps.EXPERIMENT,
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
            ],
        ),
        cluster=ClusterConfig(
            backend="{{ params.backend }}",
            kueue_queue="{{ params.queue or '' }}",
            kueue_priority="{{ params.priority or '' }}",
        ),
        execution=ExecutionConfig(queue_timeout="{{ params.queue_timeout }}"),
        # The result is the run that trained on this try's data and code with these options, never one a stale
        # try logged under the same run key (nightshift.tracking.find_training_run).
        tracking=TrackingConfig(mlflow_experiment=steps.EXPERIMENT, mlflow_run_key="{{ dag.dag_id }}/{{ run_id }}",
                                mlflow_expect_tags={
                                    "nightshift.dataset_version": "{{ " + STAGED + "['hash'] }}",
                                    "nightshift.code_version": "{{ " + FINGERPRINT + "['code_version'] }}",
                                    "nightshift.training_options": "{{ " + TRAINING + " | tojson }}",
                                }),
        execution_timeout=timedelta(hours=6),
        retry_delay=TRAIN_RETRY_DELAY,
    )

    @task
    def evaluate(trained: dict, staged: dict) -> dict:
        return steps.evaluate(trained, staged, get_current_context()["params"])

    @task
    def register(decision: dict, staged: dict) -> dict:
        context = get_current_context()
        return steps.register(decision, staged, context["dag"].dag_id, context["run_id"], context["ti"])

    decision = evaluate(train.output, staged)
    registered = register(decision, staged)

    approve = OptionalApprovalOperator(
        task_id="approve",
        subject="Deploy the new nightshift-digits model?",
        body="{{ ti.xcom_pull(task_ids='evaluate')['reasons'] | join('\n') }}",
        defaults="Reject",
        response_timeout=timedelta(hours=12),
        execution_timeout=None,
        retries=0,
    )

    @task(trigger_rule="none_failed_min_one_success", outlets=[CHAMPION_ASSET], retries=1)
    def deploy(staged: dict) -> dict:
        context = get_current_context()
        # Pulled, not passed: when the gate rejected the model, `register` is skipped and has no XCom, and
        # an XComArg argument would log an "XCom not found" error for a run that went as designed.
        registered = context["ti"].xcom_pull(task_ids="register") or None
        if not registered:
            raise AirflowSkipException("nothing registered to deploy")
        result = steps.deploy(registered, staged, context["params"])
        context["outlet_events"][CHAMPION_ASSET].extra = {
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
        return steps.report(context["dag"].dag_id, context["run_id"], dict(context["params"]), results)

    branch >> [train, skipped]
    registered >> approve >> deployed
    [skipped, deployed] >> report()
