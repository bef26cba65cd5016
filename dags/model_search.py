"""`model_search`: the Airflow DAG of the demo pipeline's model search (pipelines/digits.yaml, `nightly_retrain`,
the digits CNN), built by the search DAG factory (nightly_tasks.search): an Optuna search (ASHA or Hyperband) whose
trials are Horovod training jobs, writing NIGHTSHIFT_HOME/search/nightly_retrain/best.json. Another pipeline's
search DAG is one more line in its DAG file (`search_dag(__file__)`, named `<dag_id>__search`).
"""

from __future__ import annotations

from pathlib import Path

from nightly_tasks.search import TRAINER_SPACE, search_dag

DAG_ID = "model_search"
DECLARATION = Path(__file__).resolve().parents[1] / "pipelines" / "digits.yaml"
# The trainer options, and the digits CNN's width.
DEFAULT_SPACE = {**TRAINER_SPACE, "model_kwargs.channels": {"type": "int", "low": 8, "high": 64}}

dag = search_dag(DECLARATION, dag_id=DAG_ID, space=DEFAULT_SPACE)
