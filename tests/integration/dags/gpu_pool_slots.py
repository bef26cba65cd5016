"""Test DAGs for the gpu pool policy (config/airflow_local_settings.py), used by test_gpu_pool_slots.py.

`gpu_pool_slots` is triggered through the REST API while paused: Airflow creates its task instances when the
run is created (in the API server), so their `pool_slots` can be read without running anything.
`gpu_pool_slots_scheduled` is a one-off scheduled run whose task instances the scheduler creates; its
default params ask for more slots than the test's pool has. Nothing here is meant to train.
"""

from __future__ import annotations

from datetime import UTC, datetime

from airflow.sdk import DAG, BaseOperator, Param

from operators.horovod import ClusterConfig, HorovodKubernetesOperator, JobConfig

COMMAND = ["python", "-c", "pass"]


class CountsOperator(BaseOperator):
    """A non-Horovod task with the same templated fields: the policy must leave its pool slots alone."""

    template_fields = ("num_workers", "gpus_per_worker")

    def __init__(self, *, num_workers: str, gpus_per_worker: str, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.num_workers = num_workers
        self.gpus_per_worker = gpus_per_worker

    def execute(self, context: object) -> None:
        """Nothing to do."""


def horovod_dag(dag_id: str, schedule: str | None, workers: int, gpus_per_worker: int, *, controls: bool) -> DAG:
    with DAG(
        dag_id=dag_id,
        schedule=schedule,
        start_date=datetime(2026, 1, 1, tzinfo=UTC),
        catchup=False,
        tags=["test"],
        params={
            "workers": Param(workers, type="integer", minimum=1),
            "gpus_per_worker": Param(gpus_per_worker, type="integer", minimum=0),
        },
    ) as dag:
        HorovodKubernetesOperator(
            task_id="train",
            job=JobConfig(num_workers="{{ params.workers }}", gpus_per_worker="{{ params['gpus_per_worker'] }}",
                          command=COMMAND),
            cluster=ClusterConfig(backend="local"),
            pool="gpu",
        )
        if controls:  # a plain-int Horovod task and a look-alike that is not one
            HorovodKubernetesOperator(task_id="train_fixed", job=JobConfig(num_workers=1, gpus_per_worker=2,
                                      command=COMMAND), cluster=ClusterConfig(backend="local"))
            CountsOperator(task_id="not_horovod", num_workers="{{ params.workers }}",
                           gpus_per_worker="{{ params.gpus_per_worker }}", pool="gpu")
    return dag


horovod_dag("gpu_pool_slots", None, workers=2, gpus_per_worker=2, controls=True)
horovod_dag("gpu_pool_slots_scheduled", "@once", workers=4, gpus_per_worker=4, controls=False)
