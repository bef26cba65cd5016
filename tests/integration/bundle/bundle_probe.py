"""`bundle_probe`: the tiny DAG that tests/integration/test_dag_bundle.py pushes, with a copy of `dags/`, into
a git repository served to Airflow as a GitDagBundle. Its tasks run the real `nightly_tasks.steps` code that
records which code a run ran (check_changes' fingerprint, the report), and return what they saw. `MARK` is
what the test's second commit changes; `hold` keeps a run in flight until the test releases it.
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from pathlib import Path

from airflow.sdk import DAG, get_current_context, task
from nightly_tasks import steps

import nightshift
from nightshift.pipelines import load_pipeline

# The demo pipeline's declaration, from the nightshift checkout the probe runs with (the steps take a pipeline).
DIGITS = Path(nightshift.__file__).resolve().parents[1] / "pipelines" / "digits.yaml"

MARK = "first"
RELEASE_FILE = "release-bundle-probe"

with DAG(
    dag_id="bundle_probe",
    description=f"DAG bundle probe ({MARK})",
    schedule=None,
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    tags=["nightshift-test"],
) as dag:

    @task
    def check() -> str:
        context = get_current_context()
        return steps.check_changes(load_pipeline(DIGITS), {"hash": "md5:probe"}, {"epochs": 1},
                                   context["dag"].dag_id, context["run_id"], context["ti"])

    @task
    def hold() -> None:
        release = Path(os.environ["NIGHTSHIFT_HOME"]) / RELEASE_FILE
        deadline = time.monotonic() + 300
        while not release.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{release} never appeared")
            time.sleep(1)

    @task
    def report() -> dict:
        context = get_current_context()
        ti = context["ti"]
        fingerprint = ti.xcom_pull(task_ids="check", key="fingerprint")
        summary = steps.report(load_pipeline(DIGITS), context["dag"].dag_id, context["run_id"], {},
                               {"fingerprint": fingerprint})
        return {"mark": MARK, "bundle_version": steps.bundle_version(ti), "code_version": summary["code_version"]}

    check() >> hold() >> report()
