#!/usr/bin/env bash
# `make airflow`: Airflow with this repository's DAGs and plugins, bound to 127.0.0.1.
#   scripts/airflow.sh standalone        # scheduler, dag-processor, triggerer, API server + UI
#   scripts/airflow.sh dags list         # any other airflow command, in the same environment
# State: NIGHTSHIFT_HOME (default ~/.nightshift); Airflow's home (SQLite DB, logs, generated admin
# password) in $NIGHTSHIFT_HOME/airflow-home unless AIRFLOW_HOME is set. AIRFLOW_PORT (default 8080).
# DAGs from $REPO/dags unless AIRFLOW__CORE__DAGS_FOLDER is set. Every component imports the cluster
# policy in $REPO/config/airflow_local_settings.py (gpu pool slots from the run's params).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${NIGHTSHIFT_VENV_BIN:-$REPO/.venv/bin}"
export NIGHTSHIFT_HOME="${NIGHTSHIFT_HOME:-$HOME/.nightshift}"
export AIRFLOW_HOME="${AIRFLOW_HOME:-$NIGHTSHIFT_HOME/airflow-home}"
PORT="${AIRFLOW_PORT:-8080}"

export PATH="$BIN:$PATH"
export PYTHONPATH="$REPO/config${PYTHONPATH:+:$PYTHONPATH}"
export AIRFLOW__CORE__DAGS_FOLDER="${AIRFLOW__CORE__DAGS_FOLDER:-$REPO/dags}"
export AIRFLOW__CORE__PLUGINS_FOLDER="$REPO/plugins"
export AIRFLOW__CORE__LOAD_EXAMPLES="False"
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-sqlite:///$AIRFLOW_HOME/airflow.db}"
export AIRFLOW__API__HOST="127.0.0.1"
export AIRFLOW__API__PORT="$PORT"
export AIRFLOW__API__BASE_URL="http://127.0.0.1:$PORT"
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL="http://127.0.0.1:$PORT/execution/"
export GX_ANALYTICS_ENABLED=false DVC_NO_ANALYTICS=1 MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true

mkdir -p "$AIRFLOW_HOME"
if [[ "${1:-}" == "standalone" ]]; then
    airflow db migrate >/dev/null
    airflow pools set gpu "${NIGHTSHIFT_GPU_SLOTS:-16}" "Horovod training slots (GPUs, or CPU jobs)" >/dev/null
    echo "Airflow UI: http://127.0.0.1:$PORT  (AIRFLOW_HOME=$AIRFLOW_HOME; the admin password is printed below" \
         "and kept in \$AIRFLOW_HOME)" >&2
    echo "Lineage page: http://127.0.0.1:$PORT/nightshift/lineage" >&2
fi
exec airflow "$@"
