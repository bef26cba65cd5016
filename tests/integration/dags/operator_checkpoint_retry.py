"""Test DAG: one local 2-worker Horovod training task with one retry, for the checkpoint-retry test.

Paths come from the environment the test sets (NIGHTSHIFT_TEST_DATA, NIGHTSHIFT_TEST_OUT); checkpoints
go to the operator's default, NIGHTSHIFT_HOME/checkpoints/<dag_id>/<run_id>/<task_id>.
"""

from __future__ import annotations

import os
from datetime import timedelta

from airflow.sdk import DAG

from operators.horovod import ClusterConfig, ExecutionConfig, HorovodKubernetesOperator, JobConfig

with DAG(dag_id="operator_checkpoint_retry", schedule=None, catchup=False, tags=["test"]):
    HorovodKubernetesOperator(
        task_id="train",
        job=JobConfig(
            num_workers=2,
            command=[
                "python",
                "-m",
                "nightshift.train",
                "--data",
                os.environ.get("NIGHTSHIFT_TEST_DATA", "/nonexistent"),
                "--out",
                os.environ.get("NIGHTSHIFT_TEST_OUT", "/nonexistent"),
                *os.environ.get("NIGHTSHIFT_TEST_TRAIN_ARGS", "").split(),
            ],
        ),
        cluster=ClusterConfig(backend="local"),
        execution=ExecutionConfig(timeout=600),
        retries=1,
        retry_delay=timedelta(seconds=0),
    )
