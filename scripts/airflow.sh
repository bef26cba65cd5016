#!/usr/bin/env bash
# `make airflow`: Airflow with this repository's DAGs and plugins, bound to 127.0.0.1.
#   scripts/airflow.sh standalone        # scheduler, dag-processor, triggerer, API server + UI, and the MLflow UI
#   scripts/airflow.sh dags list         # any other airflow command, in the same environment
# State: NIGHTSHIFT_HOME (default ~/.nightshift); Airflow's home (logs, generated admin password, SQLite DB
# when not on PostgreSQL) in $NIGHTSHIFT_HOME/airflow-home unless AIRFLOW_HOME is set. AIRFLOW_PORT (default 8080): not
# one of Airflow's own log-server ports ([logging] worker_log_server_port, trigger_log_server_port).
# DAGs from $REPO/dags unless AIRFLOW__CORE__DAGS_FOLDER is set. Every component imports the cluster
# policy in $REPO/config/airflow_local_settings.py (gpu pool slots from the run's params).
# `standalone` also serves the MLflow UI of the project's tracking store on 127.0.0.1:NIGHTSHIFT_MLFLOW_UI_PORT
# (default 5000; `none`: do not start it) for the plugin's "MLflow run" and "Model version" links, and
# stops it when Airflow exits. With NIGHTSHIFT_MLFLOW_UI_URL set, or an http(s) MLFLOW_TRACKING_URI, the
# links go there and no UI is started.
# Metadata database (NIGHTSHIFT_AIRFLOW_DB=auto|postgres|sqlite, default auto; the same as `make demo`'s for the same
# NIGHTSHIFT_HOME): see "Metadata database" below.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${NIGHTSHIFT_VENV_BIN:-$REPO/.venv/bin}"
export NIGHTSHIFT_HOME="${NIGHTSHIFT_HOME:-$HOME/.nightshift}"
export AIRFLOW_HOME="${AIRFLOW_HOME:-$NIGHTSHIFT_HOME/airflow-home}"
PORT="${AIRFLOW_PORT:-8080}"
MLFLOW_UI_PORT="${NIGHTSHIFT_MLFLOW_UI_PORT:-5000}"

export PATH="$BIN:$PATH"
export PYTHONPATH="$REPO/config${PYTHONPATH:+:$PYTHONPATH}"
export AIRFLOW__CORE__DAGS_FOLDER="${AIRFLOW__CORE__DAGS_FOLDER:-$REPO/dags}"
export AIRFLOW__CORE__PLUGINS_FOLDER="$REPO/plugins"
export AIRFLOW__CORE__LOAD_EXAMPLES="False"
export AIRFLOW__API__HOST="127.0.0.1"
export AIRFLOW__API__PORT="$PORT"
export AIRFLOW__API__BASE_URL="http://127.0.0.1:$PORT"
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL="http://127.0.0.1:$PORT/execution/"
export GX_ANALYTICS_ENABLED=false DVC_NO_ANALYTICS=1 MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true

refuse() {  # one line a person can act on, exit 2 (a usage error)
    echo "scripts/airflow.sh: $*" >&2
    exit 2
}

is_port() {
    [[ "$1" =~ ^[0-9]+$ ]] && (( 10#$1 >= 1 && 10#$1 <= 65535 ))
}

# The API server would start on a port Airflow's own log servers also bind: standalone then says it is
# ready while the UI answers with the log server (or not at all). Ports are read from Airflow's config
# (environment, airflow.cfg, defaults 8793 and 8794), before anything starts.
check_ports() {
    is_port "$PORT" || refuse "AIRFLOW_PORT=$PORT is not a TCP port (1-65535)"
    local worker trigger
    read -r worker trigger < <(python -c 'from airflow.configuration import conf
print(conf.get("logging", "worker_log_server_port"), conf.get("logging", "trigger_log_server_port"))') || true
    is_port "${worker:-}" && is_port "${trigger:-}" \
        || refuse "cannot read Airflow's [logging] worker_log_server_port and trigger_log_server_port (see above)"
    [[ "$((10#$PORT))" == "$worker" ]] && refuse "AIRFLOW_PORT=$PORT is the port of Airflow's worker log" \
        "server ([logging] worker_log_server_port); choose another AIRFLOW_PORT, e.g. 8080"
    [[ "$((10#$PORT))" == "$trigger" ]] && refuse "AIRFLOW_PORT=$PORT is the port of Airflow's triggerer log" \
        "server ([logging] trigger_log_server_port); choose another AIRFLOW_PORT, e.g. 8080"
    if [[ "$MLFLOW_UI_PORT" != "none" ]]; then
        is_port "$MLFLOW_UI_PORT" || refuse "NIGHTSHIFT_MLFLOW_UI_PORT=$MLFLOW_UI_PORT is not a TCP port" \
            "(1-65535, or none)"
        case "$((10#$MLFLOW_UI_PORT))" in
            "$((10#$PORT))" | "$worker" | "$trigger")
                refuse "NIGHTSHIFT_MLFLOW_UI_PORT=$MLFLOW_UI_PORT is taken by Airflow (API server $PORT, log servers" \
                    "$worker and $trigger); choose another, e.g. 5000" ;;
        esac
    fi
    return 0
}

listening() {  # something accepts connections on 127.0.0.1:$1
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# --- Metadata database --------------------------------------------------------------------------------
# Every command runs on the metadata database nightshift.settings.airflow_database() chooses for this
# AIRFLOW_HOME, the one `make demo` chooses too (NIGHTSHIFT_AIRFLOW_DB=auto|postgres|sqlite, default auto):
#   auto (default)  PostgreSQL when the server at NIGHTSHIFT_POSTGRES_URL (default postgresql://postgres@127.0.0.1:5432)
#                   answers; SQLite $AIRFLOW_HOME/airflow.db when it does not (said so), or when this home already
#                   has a SQLite history and no PostgreSQL database (said so). A home whose history is on
#                   PostgreSQL refuses to start a second one on SQLite while the server is down.
#   postgres        PostgreSQL; a one-line error when the server does not answer.
#   sqlite          $AIRFLOW_HOME/airflow.db.
# The PostgreSQL database is NIGHTSHIFT_AIRFLOW_PG_DB, default nightshift_airflow for the default AIRFLOW_HOME and
# nightshift_airflow_<sha1 of AIRFLOW_HOME, 8 hex> for another (a database belongs to one AIRFLOW_HOME: its Fernet
# key, logs, passwords). Any command makes it when missing (two at once are fine), with the LocalExecutor unless
# AIRFLOW__CORE__EXECUTOR says otherwise. `standalone` drops a database it made itself when it stops, unless it is
# make airflow's own nightshift_airflow (NIGHTSHIFT_AIRFLOW_PG_KEEP=1 keeps it, =0 drops it); a database that was
# there before (kept, made by another command or `make demo`, or another Airflow's) is used and left alone.
# An AIRFLOW__DATABASE__SQL_ALCHEMY_CONN set by the caller wins over all of these; nothing is created or dropped.
AIRFLOW_DB_KIND=""          # postgres, sqlite or given, once choose_database has run
AIRFLOW_PG_DB=""            # the PostgreSQL database
AIRFLOW_PG_CREATED=0        # 1: this command made it
AIRFLOW_DB_NOTE=""          # what it is (and why, when it is not the obvious choice)
AIRFLOW_PG_DROP=""          # the database this standalone made, dropped when it stops

# Sets AIRFLOW__DATABASE__SQL_ALCHEMY_CONN (and the LocalExecutor on PostgreSQL), making the PostgreSQL database
# when missing; says so in one line when it made one or fell back to SQLite. A refusal (one line) exits 2.
choose_database() {
    local out noteworthy url
    out="$(python -c 'from nightshift import settings; settings.airflow_database_for_shell()')" || exit 2
    { read -r AIRFLOW_DB_KIND AIRFLOW_PG_DB AIRFLOW_PG_CREATED noteworthy; read -r url; read -r AIRFLOW_DB_NOTE; } \
        <<<"$out"
    export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="$url"
    if [[ "$AIRFLOW_DB_KIND" == postgres ]]; then
        export AIRFLOW__CORE__EXECUTOR="${AIRFLOW__CORE__EXECUTOR:-LocalExecutor}"
        # The LocalExecutor keeps one worker process per parallel slot (32 by default, ~150 MB each): size it
        # to this machine's cores unless told otherwise.
        export AIRFLOW__CORE__PARALLELISM="${AIRFLOW__CORE__PARALLELISM:-$(( $(nproc) * 2 ))}"
    fi
    if [[ "${1:-}" != standalone && "$noteworthy" == 1 ]]; then
        echo "Airflow database: $AIRFLOW_DB_NOTE" >&2
    fi
    return 0
}

# standalone: say what Airflow runs on, and whether the database goes when it stops.
announce_database() {
    local fate="" keep_default=0
    [[ "$AIRFLOW_PG_DB" == nightshift_airflow ]] && keep_default=1
    if [[ "$AIRFLOW_DB_KIND" == postgres ]]; then
        if [[ "$AIRFLOW_PG_CREATED" != 1 ]]; then
            fate=" (existing, left as it is)"
        elif [[ "${NIGHTSHIFT_AIRFLOW_PG_KEEP:-$keep_default}" == 1 ]]; then
            fate=": created, kept (NIGHTSHIFT_AIRFLOW_PG_KEEP=0 drops it when Airflow stops)"
        else
            fate=": created, dropped when Airflow stops"
            AIRFLOW_PG_DROP="$AIRFLOW_PG_DB"
        fi
        fate="$fate, $AIRFLOW__CORE__EXECUTOR"
    fi
    echo "Airflow database: ${AIRFLOW_DB_NOTE% (created)}$fate" >&2
}

drop_database() {
    [[ -n "$AIRFLOW_PG_DROP" ]] || return 0
    local name="$AIRFLOW_PG_DROP"
    AIRFLOW_PG_DROP=""
    python -c 'import sys
from nightshift import settings
settings.drop_airflow_pg_database(sys.argv[1])' "$name" \
        || echo "scripts/airflow.sh: could not drop PostgreSQL database $name" >&2
}
# --- end of metadata database ------------------------------------------------------------------------

MLFLOW_UI_PID=""

# The MLflow UI over the project's tracking store (nightshift.settings), in a session of its own so that
# stopping it by its PID stops its server processes too.
start_mlflow_ui() {
    local uri artifacts
    { read -r uri; read -r artifacts; } < <(python -c 'from nightshift import settings
print(settings.mlflow_tracking_uri()); print(settings.mlflow_artifact_root())')
    if [[ -n "${NIGHTSHIFT_MLFLOW_UI_URL:-}" ]]; then
        echo "MLflow links: $NIGHTSHIFT_MLFLOW_UI_URL (NIGHTSHIFT_MLFLOW_UI_URL; no MLflow UI started)" >&2
        return 0
    fi
    if [[ "$uri" == http://* || "$uri" == https://* ]]; then
        export NIGHTSHIFT_MLFLOW_UI_URL="${uri%/}"
        echo "MLflow links: $NIGHTSHIFT_MLFLOW_UI_URL (the tracking server; no MLflow UI started)" >&2
        return 0
    fi
    export NIGHTSHIFT_MLFLOW_UI_URL="http://127.0.0.1:$MLFLOW_UI_PORT"
    if [[ "$MLFLOW_UI_PORT" == "none" ]]; then
        unset NIGHTSHIFT_MLFLOW_UI_URL
        echo "MLflow UI: not started (NIGHTSHIFT_MLFLOW_UI_PORT=none); MLflow links expect" \
             "http://127.0.0.1:5000 (run: mlflow ui --backend-store-uri $uri)" >&2
        return 0
    fi
    if listening "$MLFLOW_UI_PORT"; then
        echo "MLflow UI: port $MLFLOW_UI_PORT is in use, not starting one; MLflow links go to" \
             "$NIGHTSHIFT_MLFLOW_UI_URL (set NIGHTSHIFT_MLFLOW_UI_PORT to another port to get this project's)" >&2
        return 0
    fi
    mkdir -p "$NIGHTSHIFT_HOME" "$artifacts"
    # The store made (its tables, under its lock: nightshift.tracking) before the UI opens it: `mlflow ui` migrates
    # a new store unlocked, racing the first task that uses it.
    python -c 'from nightshift import tracking; tracking.configure()'
    local log="$NIGHTSHIFT_HOME/mlflow-ui.log"
    # Job execution (GenAI jobs, ~8 huey worker processes) is not needed to browse runs and models.
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid mlflow ui --host 127.0.0.1 --port "$MLFLOW_UI_PORT" --workers 1 --backend-store-uri "$uri" \
        --default-artifact-root "$artifacts" --no-serve-artifacts >"$log" 2>&1 </dev/null &
    MLFLOW_UI_PID=$!
    echo "MLflow UI: $NIGHTSHIFT_MLFLOW_UI_URL  (store $uri; log $log; pid $MLFLOW_UI_PID)" >&2
}

stop_mlflow_ui() {
    [[ -n "$MLFLOW_UI_PID" ]] || return 0
    local pid="$MLFLOW_UI_PID"
    MLFLOW_UI_PID=""
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || return 0
    for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.2
    done
    kill -KILL -- "-$pid" 2>/dev/null || true
}

# --- DAG bundle: runs pinned to a commit ---------------------------------------------------------------
# NIGHTSHIFT_DAG_BUNDLE=git: the DAGs come from a git repository through the git provider's GitDagBundle
# instead of $REPO/dags. The dag-processor fetches the branch every NIGHTSHIFT_DAG_BUNDLE_REFRESH seconds
# (default 60); each DAG run records the commit it was created at (its bundle_version) and every task of
# the run executes that commit's files. NIGHTSHIFT_DAG_BUNDLE_REPO: the repository's URL or path (default:
# this checkout); NIGHTSHIFT_DAG_BUNDLE_BRANCH (default: main); NIGHTSHIFT_DAG_BUNDLE_SUBDIR: the DAG
# folder in it (default: dags). The repository is Airflow's git connection nightshift_git: set
# AIRFLOW_CONN_NIGHTSHIFT_GIT yourself (or use a secrets backend) for one that needs credentials; a URL
# with a password in it is refused here. Clones live in $AIRFLOW_HOME/dag-bundles.
case "${NIGHTSHIFT_DAG_BUNDLE:-folder}" in
    folder) ;;
    git)
        bundle_repo="${NIGHTSHIFT_DAG_BUNDLE_REPO:-$REPO}"
        [[ "$bundle_repo" =~ ^https?://[^/]*@ ]] && refuse "NIGHTSHIFT_DAG_BUNDLE_REPO has credentials in it;" \
            "put them in the nightshift_git connection (AIRFLOW_CONN_NIGHTSHIFT_GIT) instead"
        [[ -d "$bundle_repo" ]] && bundle_repo="$(cd "$bundle_repo" && pwd)"  # a path: absolute
        [[ "${NIGHTSHIFT_DAG_BUNDLE_REFRESH:-60}" =~ ^[0-9]+$ ]] \
            || refuse "NIGHTSHIFT_DAG_BUNDLE_REFRESH=$NIGHTSHIFT_DAG_BUNDLE_REFRESH is not a number of seconds"
        export AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_STORAGE_PATH="${AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_STORAGE_PATH:-$AIRFLOW_HOME/dag-bundles}"
        { read -r bundle_conn; read -r bundle_list; } < <(BUNDLE_REPO="$bundle_repo" python -c 'import json, os
print(json.dumps({"conn_type": "git", "host": os.environ["BUNDLE_REPO"]}))
print(json.dumps([{"name": "nightshift", "classpath": "airflow.providers.git.bundles.git.GitDagBundle",
                   "kwargs": {"git_conn_id": "nightshift_git",
                              # The branch of the repository the dag-processor follows (default: main).
                              "tracking_ref": os.environ.get("NIGHTSHIFT_DAG_BUNDLE_BRANCH") or "main",
                              # The DAG folder inside the repository (default: dags; set empty: its top level).
                              "subdir": os.environ.get("NIGHTSHIFT_DAG_BUNDLE_SUBDIR", "dags") or None,
                              "refresh_interval": int(os.environ.get("NIGHTSHIFT_DAG_BUNDLE_REFRESH") or 60)}}]))')
        export AIRFLOW_CONN_NIGHTSHIFT_GIT="${AIRFLOW_CONN_NIGHTSHIFT_GIT:-$bundle_conn}"
        export AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST="$bundle_list"
        ;;
    *) refuse "NIGHTSHIFT_DAG_BUNDLE=$NIGHTSHIFT_DAG_BUNDLE: expected git, or folder (the default: $REPO/dags)" ;;
esac
# --- end of the DAG bundle block ------------------------------------------------------------------------

# --- New-data events ------------------------------------------------------------------------------------
# NIGHTSHIFT_EVENTS_REDIS_URL (redis://[:password@]host:port[/db], rediss:// for TLS): nightly_retrain also runs
# on each "new data" event (`nightshift publish-data DIR`); its AssetWatcher's trigger, run by the triggerer,
# connects through the Airflow connection nightshift_events, made here from that URL (in the environment as
# AIRFLOW_CONN_NIGHTSHIFT_EVENTS, never on a command line) unless AIRFLOW_CONN_NIGHTSHIFT_EVENTS is set already.
# NIGHTSHIFT_EVENTS_CONN_ID instead names a connection defined elsewhere (a secrets backend); nothing is made.
# Airflow then sees NIGHTSHIFT_EVENTS_CONN_ID=nightshift_events, not the URL: a NIGHTSHIFT_* variable reaches the
# training ranks (operators/local_launcher.py's allowlist), and the URL may hold the Redis password.
if [[ -n "${NIGHTSHIFT_EVENTS_REDIS_URL:-}" && -z "${NIGHTSHIFT_EVENTS_CONN_ID:-}" \
      && -z "${AIRFLOW_CONN_NIGHTSHIFT_EVENTS:-}" ]]; then
    events_conn="$(python -c 'import json, os, sys
from urllib.parse import unquote, urlsplit
url = urlsplit(os.environ["NIGHTSHIFT_EVENTS_REDIS_URL"].strip())
try:
    port = url.port or 6379
    db = int(url.path.strip("/") or 0)
except ValueError:
    sys.exit("NIGHTSHIFT_EVENTS_REDIS_URL: the port and the database must be numbers: redis://HOST:PORT/DB")
if url.scheme not in ("redis", "rediss") or not url.hostname:
    sys.exit("NIGHTSHIFT_EVENTS_REDIS_URL is not redis://[:password@]HOST:PORT[/DB] (or rediss://)")
extra = {"db": db, **({"ssl": True} if url.scheme == "rediss" else {})}
print(json.dumps({"conn_type": "redis", "host": url.hostname, "port": port, "login": unquote(url.username or "") or None,
                  "password": unquote(url.password or "") or None, "extra": extra}))')" \
        || refuse "NIGHTSHIFT_EVENTS_REDIS_URL cannot be used (see above)"
    export AIRFLOW_CONN_NIGHTSHIFT_EVENTS="$events_conn"
    unset events_conn
fi
if [[ -n "${NIGHTSHIFT_EVENTS_REDIS_URL:-}" ]]; then
    export NIGHTSHIFT_EVENTS_CONN_ID="${NIGHTSHIFT_EVENTS_CONN_ID:-nightshift_events}"
    unset NIGHTSHIFT_EVENTS_REDIS_URL
fi
# --- end of new-data events ------------------------------------------------------------------------------

mkdir -p "$AIRFLOW_HOME"
case "${1:-}" in
    standalone)
        check_ports
        trap 'stop_mlflow_ui; drop_database' EXIT
        trap 'exit 130' INT
        trap 'exit 143' TERM
        choose_database standalone
        announce_database
        airflow db migrate >/dev/null
        airflow pools set gpu "${NIGHTSHIFT_GPU_SLOTS:-16}" "Horovod training slots (GPUs, or CPU jobs)" >/dev/null
        start_mlflow_ui
        echo "Airflow UI: http://127.0.0.1:$PORT  (AIRFLOW_HOME=$AIRFLOW_HOME; the admin password is printed" \
             "below and kept in \$AIRFLOW_HOME)" >&2
        echo "Lineage page: http://127.0.0.1:$PORT/nightshift/lineage" >&2
        # Not exec: the MLflow UI is stopped when Airflow exits. Airflow runs in the foreground, so Ctrl-C
        # reaches it (it stops its components), then the EXIT trap stops the MLflow UI.
        status=0
        airflow "$@" || status=$?
        exit "$status"
        ;;
    api-server)
        check_ports
        ;;
esac
choose_database
exec airflow "$@"
