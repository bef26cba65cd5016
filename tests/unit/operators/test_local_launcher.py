"""The local backend's pure parts: which environment reaches the ranks, and how many ranks fit here."""

from __future__ import annotations

import pytest

from operators.errors import InvalidJobConfig
from operators.local_launcher import check_local_capacity, child_environment

WORKER_ENV = {
    "PATH": "/venv/bin:/usr/bin",
    "HOME": "/home/airflow",
    "LC_ALL": "C.UTF-8",
    "NIGHTSHIFT_HOME": "/srv/nightshift",
    "NIGHTSHIFT_PLUGINS": "mypkg.plugins",
    "MLFLOW_TRACKING_URI": "http://127.0.0.1:5000",
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "60",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://airflow:pw@db/airflow",
    "AIRFLOW_CONN_AWS_DEFAULT": "aws://AKIA:secret@",
    "AWS_SECRET_ACCESS_KEY": "planted",
    "NIGHTSHIFT_API_TOKEN": "planted",
    "DATABASE_URL": "postgresql://u:pw@h/d",
}


def test_only_the_allowlist_reaches_the_ranks() -> None:
    env = child_environment(WORKER_ENV, {"EXTRA": "from the job"})
    assert set(env) == {"PATH", "HOME", "LC_ALL", "NIGHTSHIFT_HOME", "NIGHTSHIFT_PLUGINS", "MLFLOW_TRACKING_URI",
                        "HOROVOD_GLOO_TIMEOUT_SECONDS", "PYTHONUNBUFFERED", "EXTRA"}
    assert "planted" not in env.values()


def test_a_tracking_uri_with_a_password_is_refused() -> None:
    with pytest.raises(InvalidJobConfig, match="MLFLOW_TRACKING_URI carries a password") as raised:
        child_environment({"MLFLOW_TRACKING_URI": "https://bob:hunter2@mlflow.example"})
    assert "hunter2" not in str(raised.value)


def test_an_allowlisted_variable_holding_a_url_with_a_password_stays_behind(caplog: pytest.LogCaptureFixture) -> None:
    env = child_environment({"NIGHTSHIFT_EVENTS_REDIS_URL": "redis://:hunter2@10.0.0.5:6379/0",
                             "NIGHTSHIFT_REDIS_URL": "redis://127.0.0.1:6379/0",
                             "NIGHTSHIFT_NOTE": "see https://bob:pw@host/x", "PATH": "/usr/bin"})
    assert env["NIGHTSHIFT_REDIS_URL"] == "redis://127.0.0.1:6379/0" and env["PATH"] == "/usr/bin"
    assert "NIGHTSHIFT_EVENTS_REDIS_URL" not in env and "NIGHTSHIFT_NOTE" not in env
    assert "NIGHTSHIFT_EVENTS_REDIS_URL" in caplog.text and "hunter2" not in caplog.text


@pytest.mark.parametrize(("name", "value"), [
    ("NIGHTSHIFT_SIGNING_KEY", "planted"),
    ("NIGHTSHIFT_APIKEY", "planted"),
    ("HOROVOD_KEY", "planted"),
    ("NIGHTSHIFT_REDIS_PASS", "planted"),
    ("NIGHTSHIFT_EVENTS_REDIS_URL", "redis://10.0.0.5:6379/0?password=planted"),
    ("NIGHTSHIFT_STORE", "https://store.example/b?X-Amz-Signature=planted&X-Amz-Date=1"),
    ("NIGHTSHIFT_POSTGRES_URL", "host=db user=airflow password=planted dbname=airflow"),
    ("NIGHTSHIFT_ODBC", "Server=db;Uid=sa;Pwd=planted;"),
    ("NIGHTSHIFT_POSTGRES_DSN", "host=db password='planted' dbname=airflow"),
])
def test_a_secret_named_or_held_in_a_query_or_dsn_stays_behind(name: str, value: str,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    env = child_environment({name: value, "NIGHTSHIFT_HOME": "/srv/nightshift",
                             "NIGHTSHIFT_DATA_URL": "https://data.example/x?version=3&key_prefix=raw"})
    assert name not in env and "planted" not in " ".join(env.values())
    assert env["NIGHTSHIFT_HOME"] == "/srv/nightshift"
    assert env["NIGHTSHIFT_DATA_URL"] == "https://data.example/x?version=3&key_prefix=raw"
    assert "planted" not in caplog.text


def test_cpu_jobs_need_a_core_per_worker() -> None:
    assert check_local_capacity(2, 0, cores=2) == 2
    with pytest.raises(InvalidJobConfig, match="has 2 cores for 3 workers; ask for at most 2 workers"):
        check_local_capacity(3, 0, cores=2)


def test_gpu_jobs_run_a_rank_per_gpu_and_need_that_many_gpus() -> None:
    assert check_local_capacity(2, 4, gpus=8) == 8
    with pytest.raises(InvalidJobConfig, match=r"needs 8 GPUs \(2 workers x 4 GPUs\) but this machine has 0"):
        check_local_capacity(2, 4, gpus=0)
