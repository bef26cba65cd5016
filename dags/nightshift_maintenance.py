"""`nightshift_maintenance`: Airflow's own growth, kept to N days, daily. `airflow db clean` removes metadata rows
(runs, task instances, XComs, logs, jobs) older than NIGHTSHIFT_AIRFLOW_DB_RETENTION_DAYS (default 30, never fewer
than the longest `resumable_days` of a declared pipeline) without archiving them, and the task log files under
Airflow's `base_log_folder` older than NIGHTSHIFT_AIRFLOW_LOG_RETENTION_DAYS (default 30) go. Both are global, hence
a DAG of their own rather than a pipeline's task; each pipeline's own leftovers are its `collect_garbage` task's.
The work is nightshift.maintenance's (imported inside the tasks).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from airflow.sdk import DAG, task

from nightshift import settings

DAG_ID = "nightshift_maintenance"

with DAG(
    dag_id=DAG_ID,
    description="airflow db clean and task-log retention (NIGHTSHIFT_AIRFLOW_*_RETENTION_DAYS, default 30)",
    schedule=settings.maintenance_schedule(),
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    default_args={"owner": "ml-platform", "retries": 1, "retry_delay": timedelta(minutes=5),
                  "execution_timeout": timedelta(hours=1)},
    tags=["nightshift", "maintenance"],
    doc_md=__doc__,
) as dag:

    @task
    def clean_metadata() -> dict[str, Any]:
        """`airflow db clean` of the rows older than the retention; fails with what the command said."""
        import logging
        import os
        from pathlib import Path

        from airflow.configuration import conf

        from nightshift.maintenance import clean_metadata as clean
        from nightshift.maintenance import resume_floor_days

        dags = Path(conf.get("core", "dags_folder"))
        declared = [dags, Path(os.environ.get("NIGHTSHIFT_PIPELINES") or dags.parent / "pipelines")]
        result = clean(settings.airflow_db_retention_days(), floor_days=resume_floor_days(declared))
        log = logging.getLogger(__name__)
        if result["held_by"]:  # a run stuck unfinished holds every row after it: say which
            log.warning("rows from %s on are kept for runs unfinished or still resumable: %s", result["before"],
                        "; ".join(result["held_by"]))
        log.info("airflow db clean before %s:\n%s", result["before"], result["output"])
        return {k: v for k, v in result.items() if k != "output"}

    @task
    def prune_task_logs() -> dict[str, Any]:
        """Remove task log files older than the retention under [logging] base_log_folder (links never followed)."""
        import logging

        from airflow.configuration import conf

        from nightshift.maintenance import prune_logs

        result = prune_logs(conf.get("logging", "base_log_folder"), settings.airflow_log_retention_days())
        logging.getLogger(__name__).info("Removed %d log file(s), %d bytes, under %s; kept %d", len(result["removed"]),
                                         result["removed_bytes"], result["folder"], result["kept"])
        return {k: v for k, v in result.items() if k != "removed"} | {"removed": len(result["removed"])}

    clean_metadata()
    prune_task_logs()
