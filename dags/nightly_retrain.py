"""`nightly_retrain`: the Airflow DAG of the demo pipeline, pipelines/digits.yaml (the digits CNN), built by the
pipeline factory (nightly_tasks.factory): validate -> stage -> train (Horovod) -> evaluate -> register ->
[approve] -> deploy. Another pipeline is a declaration and a two-line DAG file like this one.
"""

from __future__ import annotations

from pathlib import Path

from nightly_tasks.factory import pipeline_dag

DECLARATION = Path(__file__).resolve().parents[1] / "pipelines" / "digits.yaml"

dag = pipeline_dag(DECLARATION)
