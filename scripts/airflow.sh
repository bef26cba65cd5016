#!/usr/bin/env bash
# `make airflow`: Airflow with this repository's DAGs and plugins, bound to 127.0.0.1.
#   scripts/airflow.sh standalone        # scheduler, dag-processor, triggerer, API server + UI, and the MLflow UI
#   scripts/airflow.sh dags list         # any other airflow command, in the same environment
# State: NIGHTSHIFT_HOME (default ~/.nightshift); Airflow's home (SQLite DB, logs, generated admin
# password) in $NIGHTSHIFT_HOME/airflow-home unless AIRFLOW_HOME is set. AIRFLOW_PORT (default 8080): not
# one of Airflow's own log-server ports ([logging] worker_log_server_port, trigger_log_server_port).
# DAGs from $REPO/dags unless AIRFLOW__CORE__DAGS_FOLDER is set. Every component imports the cluster
# policy in $REPO/config/airflow_local_settings.py (gpu pool slots from the run's params).
# `standalone` also serves the MLflow UI of the project's tracking store on 127.0.0.1:NIGHTSHIFT_MLFLOW_UI_PORT
# (default 5000; `none`: do not start it) for the plugin's "MLflow run" and "Model version" links, and
# stops it when Airflow exits. With NIGHTSHIFT_MLFLOW_UI_URL set, or an http(s) MLFLOW_TRACKING_URI, the
# links go there and no UI is started.
# Metadata database (NIGHTSHIFT_AIRFLOW_DB=auto|postgres|sqlite, default auto): see "Metadata database" below.
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
# NIGHTSHIFT_AIRFLOW_DB picks Airflow's metadata database:
#   auto (default)  postgres when the PostgreSQL server at NIGHTSHIFT_POSTGRES_URL answers, else sqlite
#   postgres        database NIGHTSHIFT_AIRFLOW_PG_DB on NIGHTSHIFT_POSTGRES_URL (default
#                   postgresql://postgres@127.0.0.1:5432), with the LocalExecutor unless
#                   AIRFLOW__CORE__EXECUTOR says otherwise; `standalone` creates the database when it is missing
#                   and, unless it is make airflow's own nightshift_airflow, drops it when it stops
#                   (NIGHTSHIFT_AIRFLOW_PG_KEEP=1 keeps it, =0 drops it); a
#                   database that was there before (kept, or another Airflow's) is used and left alone. The
#                   default name is nightshift_airflow for the default AIRFLOW_HOME and
#                   nightshift_airflow_<sha1 of AIRFLOW_HOME, 8 hex> for another: a database belongs to one
#                   AIRFLOW_HOME (its Fernet key, logs, passwords), and two homes never share one by accident
#   sqlite          $AIRFLOW_HOME/airflow.db (what `make demo` uses, through its own environment)
# An AIRFLOW__DATABASE__SQL_ALCHEMY_CONN set by the caller wins over all of these; nothing is created or dropped.
USER_SQL_ALCHEMY_CONN="${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-}"
export NIGHTSHIFT_POSTGRES_URL="${NIGHTSHIFT_POSTGRES_URL:-postgresql://postgres@127.0.0.1:5432}"
if [[ -n "${NIGHTSHIFT_AIRFLOW_PG_DB:-}" ]]; then
    AIRFLOW_PG_DB="$NIGHTSHIFT_AIRFLOW_PG_DB"
elif [[ "$AIRFLOW_HOME" == "$HOME/.nightshift/airflow-home" ]]; then
    AIRFLOW_PG_DB="nightshift_airflow"
else
    AIRFLOW_PG_DB="nightshift_airflow_$(printf '%s' "$AIRFLOW_HOME" | sha1sum | cut -c1-8)"
fi
# `make airflow`'s own database (the default AIRFLOW_HOME) keeps its run history between starts; a database
# made for another home (tests, throwaway homes) is dropped when its standalone stops.
AIRFLOW_PG_KEEP_DEFAULT=0
[[ "$AIRFLOW_PG_DB" == nightshift_airflow ]] && AIRFLOW_PG_KEEP_DEFAULT=1
AIRFLOW_DB_KIND=""          # postgres or sqlite, once choose_database has run
AIRFLOW_PG_DROP=""          # the database this standalone created, dropped when it stops

# pg_admin probe | check | url DB | create DB | drop DB, against the server of NIGHTSHIFT_POSTGRES_URL (a libpq
# URL, read from the environment so that a password in it never reaches a command line) with psycopg 3, the
# project's PostgreSQL driver. probe is silent; create prints "created" when it made the database.
pg_admin() {
    python - "$@" <<'EOF'
import os
import sys

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

action, name = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
server = os.environ["NIGHTSHIFT_POSTGRES_URL"]
if action == "url":  # Airflow's URL names psycopg 3, whatever SQLAlchemy's default driver for postgresql://
    print(make_url(server).set(drivername="postgresql+psycopg", database=name).render_as_string(hide_password=False))
    sys.exit(0)
try:
    conn = psycopg.connect(server, dbname="postgres", connect_timeout=3, autocommit=True)
except psycopg.OperationalError as err:
    if action != "probe":
        print(f"scripts/airflow.sh: PostgreSQL at {make_url(server)!r} does not answer: "
              f"{str(err).strip().splitlines()[0]}", file=sys.stderr)
    sys.exit(1)
with conn:
    if action in ("create", "drop"):
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None
        if action == "create" and not exists:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            print("created")
        elif action == "drop" and exists:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))
EOF
}

# Sets AIRFLOW__DATABASE__SQL_ALCHEMY_CONN (and the LocalExecutor on PostgreSQL); creates nothing.
choose_database() {
    if [[ -n "$USER_SQL_ALCHEMY_CONN" ]]; then
        export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="$USER_SQL_ALCHEMY_CONN"
        AIRFLOW_DB_KIND="given"
        return 0
    fi
    local kind="${NIGHTSHIFT_AIRFLOW_DB:-auto}"
    case "$kind" in
        auto) if pg_admin probe; then kind=postgres; else kind=sqlite; fi ;;
        postgres) pg_admin check || refuse "NIGHTSHIFT_AIRFLOW_DB=postgres but PostgreSQL does not answer" \
            "(NIGHTSHIFT_POSTGRES_URL, see above); start it, or use NIGHTSHIFT_AIRFLOW_DB=sqlite" ;;
        sqlite) ;;
        *) refuse "NIGHTSHIFT_AIRFLOW_DB=$kind is not one of auto, postgres, sqlite" ;;
    esac
    AIRFLOW_DB_KIND="$kind"
    if [[ "$kind" == postgres ]]; then
        [[ "$AIRFLOW_PG_DB" =~ ^[A-Za-z_][A-Za-z0-9_]{0,62}$ ]] \
            || refuse "NIGHTSHIFT_AIRFLOW_PG_DB=$AIRFLOW_PG_DB is not a plain PostgreSQL database name"
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="$(pg_admin url "$AIRFLOW_PG_DB")"
        export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN
        export AIRFLOW__CORE__EXECUTOR="${AIRFLOW__CORE__EXECUTOR:-LocalExecutor}"
        # The LocalExecutor keeps one worker process per parallel slot (32 by default, ~150 MB each): size it
        # to this machine's cores unless told otherwise.
        export AIRFLOW__CORE__PARALLELISM="${AIRFLOW__CORE__PARALLELISM:-$(( $(nproc) * 2 ))}"
    else
        export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="sqlite:///$AIRFLOW_HOME/airflow.db"
    fi
}

# standalone: the PostgreSQL database exists before Airflow starts; say what Airflow runs on.
prepare_database() {
    case "$AIRFLOW_DB_KIND" in
        postgres)
            local made fate
            made="$(pg_admin create "$AIRFLOW_PG_DB")" \
                || refuse "cannot create PostgreSQL database $AIRFLOW_PG_DB (see above)"
            if [[ "$made" != created ]]; then
                fate="existing, left as it is"
            elif [[ "${NIGHTSHIFT_AIRFLOW_PG_KEEP:-$AIRFLOW_PG_KEEP_DEFAULT}" == 1 ]]; then
                fate="created, kept (NIGHTSHIFT_AIRFLOW_PG_KEEP=0 drops it when Airflow stops)"
            else
                fate="created, dropped when Airflow stops"
                AIRFLOW_PG_DROP="$AIRFLOW_PG_DB"
            fi
            echo "Airflow database: PostgreSQL $AIRFLOW_PG_DB ($fate), $AIRFLOW__CORE__EXECUTOR" >&2 ;;
        sqlite) echo "Airflow database: SQLite $AIRFLOW_HOME/airflow.db" >&2 ;;
        *) echo "Airflow database: AIRFLOW__DATABASE__SQL_ALCHEMY_CONN as given" >&2 ;;
    esac
}

drop_database() {
    [[ -n "$AIRFLOW_PG_DROP" ]] || return 0
    local name="$AIRFLOW_PG_DROP"
    AIRFLOW_PG_DROP=""
    pg_admin drop "$name" || echo "scripts/airflow.sh: could not drop PostgreSQL database $name" >&2
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
                              "tracking_ref": os.environ.get("NIGHTSHIFT_DAG_BUNDLE_BRANCH") or "main",
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
from urllib.parse import urlsplit
url = urlsplit(os.environ["NIGHTSHIFT_EVENTS_REDIS_URL"].strip())
try:
    port = url.port or 6379
    db = int(url.path.strip("/") or 0)
except ValueError:
    sys.exit("NIGHTSHIFT_EVENTS_REDIS_URL: the port and the database must be numbers: redis://HOST:PORT/DB")
if url.scheme not in ("redis", "rediss") or not url.hostname:
    sys.exit("NIGHTSHIFT_EVENTS_REDIS_URL is not redis://[:password@]HOST:PORT[/DB] (or rediss://)")
extra = {"db": db, **({"ssl": True} if url.scheme == "rediss" else {})}
print(json.dumps({"conn_type": "redis", "host": url.hostname, "port": port, "login": url.username or None,
                  "password": url.password or None, "extra": extra}))')" \
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
        choose_database
        trap 'stop_mlflow_ui; drop_database' EXIT
        trap 'exit 130' INT
        trap 'exit 143' TERM
        prepare_database
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
