#!/usr/bin/env bash
# Start Airflow with the gpusched GPU executor, the example DAGs and the gpusched plugin.
#
#   scripts/run.sh            # UI on http://localhost:8080 (GPUSCHED_PORT to change; it listens on
#                             # 127.0.0.1 only: GPUSCHED_LISTEN=0.0.0.0 to expose it)
#
# State lives in <repo>/.airflow (GPUSCHED_AIRFLOW_HOME to change), DAGs come from <repo>/dags
# (GPUSCHED_DAGS_FOLDER to change). Airflow's database is a PostgreSQL that this script starts and
# stops itself (data in .airflow/postgres; SQLite when the PostgreSQL server binaries are absent or
# GPUSCHED_METADB=sqlite). Without NVIDIA/AMD devices
# the simulated fleet (include/fleets/default.yaml, or GPUSCHED_FLEET) stands in for hardware.
# Quotas are on: GPUSCHED_QUOTA_FILE, else $AIRFLOW_HOME/gpusched/quota.yaml, else the example for
# the example DAGs' tenants (include/quotas/example.yaml: 70/20/10 partitions, weekly budgets).
# Ctrl-C / SIGINT / SIGTERM stop Airflow cleanly (running tasks finish first; one signal is
# enough), also when the script was started in the background (`scripts/run.sh &`), where a
# non-interactive shell would otherwise leave SIGINT ignored.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GPUSCHED_VENV:-$REPO/.venv}"
PORT="${GPUSCHED_PORT:-8080}"

export AIRFLOW_HOME="${GPUSCHED_AIRFLOW_HOME:-$REPO/.airflow}"
export AIRFLOW__CORE__EXECUTOR="gpusched.airflow.executor.GPUExecutor"
DAGS_FOLDER="${GPUSCHED_DAGS_FOLDER:-$REPO/dags}"
export AIRFLOW__CORE__DAGS_FOLDER="$DAGS_FOLDER"
# plugins/ holds a shim that registers the gpusched plugin only where no installed gpusched does
# (its entry point): the plugin is registered once, with no "Plugin Import Error" for a duplicate.
export AIRFLOW__CORE__PLUGINS_FOLDER="$REPO/plugins"
export AIRFLOW__CORE__LOAD_EXAMPLES="False"
export AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="${AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION:-False}"
export AIRFLOW__API__PORT="$PORT"
# The API server (UI, REST, execution API) listens on loopback only unless told otherwise
# (GPUSCHED_LISTEN=0.0.0.0 exposes it to the network).
export AIRFLOW__API__HOST="${GPUSCHED_LISTEN:-127.0.0.1}"
case "$AIRFLOW__API__HOST" in 0.0.0.0|::) API_ADDR="127.0.0.1" ;; *:*) API_ADDR="[$AIRFLOW__API__HOST]" ;; *) API_ADDR="$AIRFLOW__API__HOST" ;; esac
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL="http://$API_ADDR:$PORT/execution/"
# GPU tasks may wait for devices longer than Airflow's default 10 minutes in "queued".
export AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT="${AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT:-3600}"
# Airflow's default parallelism (32) makes LocalExecutor keep up to 32 worker processes; size it
# to the machine instead: four task slots per CPU core.
export AIRFLOW__CORE__PARALLELISM="${AIRFLOW__CORE__PARALLELISM:-$(( $(nproc 2>/dev/null || echo 2) * 4 ))}"
# A new DAG file appears within this many seconds: the dag-processor looks for new files in the
# DAG folder this often (Airflow's default: 300 s). A changed file is re-parsed every
# [dag_processor] min_file_process_interval (30 s).
export AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="${AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL:-30}"
# Quotas (tenant budgets, the training/burst/dev = 70/20/10 partitions) are enforced only with a
# quota file: GPUSCHED_QUOTA_FILE, else $AIRFLOW_HOME/gpusched/quota.yaml, else the example
# shipped for the example DAGs' tenants (gpusched/include/quotas/example.yaml).
if [[ -z "${GPUSCHED_QUOTA_FILE:-}" && ! -f "$AIRFLOW_HOME/gpusched/quota.yaml" ]]; then
    export GPUSCHED_QUOTA_FILE="$REPO/gpusched/include/quotas/example.yaml"
fi
QUOTA_FILE="${GPUSCHED_QUOTA_FILE:-$AIRFLOW_HOME/gpusched/quota.yaml}"
export PATH="$VENV/bin:$PATH"
mkdir -p "$AIRFLOW_HOME"

if [[ ! -x "$VENV/bin/airflow" ]]; then
    echo "run.sh: no Airflow in $VENV; run scripts/setup.sh first (or set GPUSCHED_VENV)" >&2
    exit 2
fi

# A background job of a non-interactive shell starts with SIGINT ignored, and bash cannot trap a
# signal ignored on entry: re-run this script once with SIGINT at its default so `kill -INT`
# (and Ctrl-C after `fg`) stops it like SIGTERM does.
if [[ -z "${GPUSCHED_RUN_SIGINT_RESTORED:-}" ]]; then
    export GPUSCHED_RUN_SIGINT_RESTORED=1
    exec "$VENV/bin/python" -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])' \
        "$BASH" "${BASH_SOURCE[0]}" "$@"
fi

BACKEND="$("$VENV/bin/python" - <<'PY' 2>/dev/null || echo "unknown"
import logging
logging.disable(logging.WARNING)
from gpusched.hardware.detect import detect_backend
backend = detect_backend()
print(getattr(backend, "description", "") or backend.name)
backend.close()
PY
)"

# Airflow's log servers (the scheduler's, which serves the logs of running tasks to the API server,
# and the triggerer's) listen on all interfaces: Airflow 3.3 binds them to "" in
# airflow/utils/serve_logs/core.py, with no setting for the address (they answer only requests
# carrying a JWT signed with this instance's [api] secret_key). Their ports default to 8793 and
# 8794 for every instance; take those when free, else ports the kernel picks, so that a second
# instance starts beside the first (AIRFLOW__LOGGING__{WORKER,TRIGGER}_LOG_SERVER_PORT to choose).
# The same for the Prometheus endpoints (on 127.0.0.1): the agent's device telemetry on 9400
# (GPUSCHED_METRICS_PORT) and the scheduler's own metrics on 9401 (AIRFLOW__GPUSCHED__METRICS_PORT;
# docs/metrics.md), the targets deploy/prometheus/prometheus.yml scrapes.
if [[ -z "${AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT:-}" || -z "${AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT:-}"
      || -z "${GPUSCHED_METRICS_PORT:-}" || -z "${AIRFLOW__GPUSCHED__METRICS_PORT:-}" ]]; then
    read -r WORKER_LOG_PORT TRIGGER_LOG_PORT AGENT_METRICS_PORT SCHEDULER_METRICS_PORT < <("$VENV/bin/python" - 8793 8794 9400 9401 <<'PY'
import socket
import sys

held = []
for default in map(int, sys.argv[1:]):
    for port in (default, 0):  # Airflow's default when it is free, else one the kernel picks
        sock = socket.socket()
        try:
            sock.bind(("", port))  # as the log server binds: all interfaces
        except OSError:
            sock.close()
            continue
        held.append(sock)  # held until both are chosen: the two differ
        break
print(*(sock.getsockname()[1] for sock in held))
PY
)
    export AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT="${AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT:-$WORKER_LOG_PORT}"
    export AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT="${AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT:-$TRIGGER_LOG_PORT}"
    export GPUSCHED_METRICS_PORT="${GPUSCHED_METRICS_PORT:-$AGENT_METRICS_PORT}"
    export AIRFLOW__GPUSCHED__METRICS_PORT="${AIRFLOW__GPUSCHED__METRICS_PORT:-$SCHEDULER_METRICS_PORT}"
fi

echo "gpusched: AIRFLOW_HOME=$AIRFLOW_HOME"
echo "gpusched: executor gpusched.airflow.executor.GPUExecutor, DAGs from $DAGS_FOLDER"
if [[ "$BACKEND" == simulated* ]]; then
    echo "gpusched: no GPU found on this host -> using the $BACKEND"
    # On the simulated fleet the agent re-lays out idle MIG GPUs for hard-isolated tasks that no
    # existing slice holds (on real GPUs that stays the operator's choice: GPUSCHED_DYNAMIC_MIG=nvml).
    export GPUSCHED_DYNAMIC_MIG="${GPUSCHED_DYNAMIC_MIG:-local}"
else
    echo "gpusched: hardware backend: $BACKEND"
fi
echo "gpusched: dynamic MIG / partitions (GPUSCHED_DYNAMIC_MIG): ${GPUSCHED_DYNAMIC_MIG:-off}"
if [[ -f "$QUOTA_FILE" ]]; then
    echo "gpusched: quotas (tenant budgets, partition shares) from $QUOTA_FILE"
else
    echo "gpusched: no quota file at $QUOTA_FILE: budgets and partitions not enforced"
fi
echo "gpusched: new DAG files appear within ${AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL} s;" \
     "Airflow's log servers on ports $AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT and $AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT (all interfaces)"
if [[ "$AIRFLOW__GPUSCHED__METRICS_PORT" != "0" ]]; then
    echo "gpusched: scheduler metrics on http://127.0.0.1:$AIRFLOW__GPUSCHED__METRICS_PORT/metrics"
fi
echo "gpusched: Airflow UI at http://localhost:$PORT  (user admin; password in"
echo "          $AIRFLOW_HOME/simple_auth_manager_passwords.json.generated once started)"

# Airflow's metadata database. On SQLite the API server deadlocks itself under load: its audit
# log row (every REST write, e.g. POST dagRuns) is inserted from its event loop while one of its own
# request threads holds SQLite's one write lock and needs that loop to commit, so everything stalls
# for the lock wait and the request fails (gpusched/airflow/metadb.py). PostgreSQL locks rows, so the
# main job runs on a PostgreSQL of its own (data in $AIRFLOW_HOME/postgres, or GPUSCHED_PGDATA; a
# Unix socket only, started and stopped with the job); SQLite is the fallback where the server
# binaries are absent, or with GPUSCHED_METADB=sqlite. A database configured by the user (in the
# environment or airflow.cfg) is left as configured.
METADB="${GPUSCHED_METADB:-postgres}"
case "$METADB" in
    postgres|sqlite) ;;
    *) echo "run.sh: GPUSCHED_METADB='$METADB' is not valid; accepted: postgres (default), sqlite" >&2; exit 2 ;;
esac
PGDATA_DIR=""
halt_metadb() {  # after Airflow has stopped (and on any exit of this script)
    if [[ -n "$PGDATA_DIR" ]]; then
        bash "$REPO/scripts/start_postgres.sh" --halt "$PGDATA_DIR" || true
        PGDATA_DIR=""
    fi
}
trap halt_metadb EXIT
DB_KIND="$("$VENV/bin/python" -m gpusched.airflow.metadb kind)" \
    || { echo "run.sh: cannot read Airflow's database settings (python -m gpusched.airflow.metadb kind failed above)" >&2; exit 2; }
if [[ "$DB_KIND" == default && "$METADB" == postgres ]]; then
    PGDATA_DIR="${GPUSCHED_PGDATA:-$AIRFLOW_HOME/postgres}"
    set +e
    DB_URL="$(bash "$REPO/scripts/start_postgres.sh" --keep "$PGDATA_DIR" airflow 2>"$AIRFLOW_HOME/postgres-start.log")"
    started=$?
    if [[ $started -eq 3 && -z "${GPUSCHED_PGDATA:-}" ]]; then
        # Run as root, the server runs as the postgres user, which cannot reach this AIRFLOW_HOME
        # (e.g. under /root): keep the cluster in its home instead, one per AIRFLOW_HOME.
        PGDATA_DIR="$(getent passwd postgres | cut -d: -f6)/gpusched/$(printf '%s' "$AIRFLOW_HOME" | cksum | cut -d' ' -f1)"
        DB_URL="$(bash "$REPO/scripts/start_postgres.sh" --keep "$PGDATA_DIR" airflow 2>"$AIRFLOW_HOME/postgres-start.log")"
        started=$?
    fi
    set -e
    if [[ $started -eq 0 ]]; then
        export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="$DB_URL"
        export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC="$DB_URL"  # psycopg 3 is async too
        echo "gpusched: Airflow database: PostgreSQL, data in $PGDATA_DIR ($DB_URL; GPUSCHED_METADB=sqlite for SQLite)"
    elif [[ $started -eq 2 ]]; then  # no server binaries (or no postgres user to run them as root)
        PGDATA_DIR=""
        echo "gpusched: Airflow database: SQLite ($AIRFLOW_HOME/airflow.db): no PostgreSQL to start" \
             "($(head -n 1 "$AIRFLOW_HOME/postgres-start.log"); scripts/setup.sh installs it);" \
             "the API server may stall for a minute under load"
    else
        echo "run.sh: could not start PostgreSQL in $PGDATA_DIR for Airflow's database:" >&2
        tail -n 20 "$AIRFLOW_HOME/postgres-start.log" >&2
        echo "run.sh: fix the above, or set GPUSCHED_METADB=sqlite to run on SQLite" >&2
        PGDATA_DIR=""
        exit 2
    fi
elif [[ "$DB_KIND" == other ]]; then
    echo "gpusched: Airflow database: as configured (AIRFLOW__DATABASE__SQL_ALCHEMY_CONN / airflow.cfg)"
fi
# SQLite (the fallback, or configured): WAL and the ledger's 60 s lock wait, so a component waits
# for another's write instead of failing at once with "database is locked".
if [[ -z "$PGDATA_DIR" && "$("$VENV/bin/python" -m gpusched.airflow.metadb)" == sqlite ]]; then
    export AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS="gpusched.airflow.metadb.SQLITE_CONNECT_ARGS"
    export AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC="gpusched.airflow.metadb.SQLITE_CONNECT_ARGS"
    if [[ "$DB_KIND" != default || "$METADB" == sqlite ]]; then
        echo "gpusched: Airflow database: SQLite (WAL, 60 s lock wait)"
    fi
fi

# Airflow writes airflow.cfg on its first command with a 24-character [api_auth] jwt_secret, under
# the 64 bytes PyJWT wants of an HS512 key: every process then warns "The HMAC key is 24 bytes
# long". On the first start (no airflow.cfg yet) write it here as Airflow would, with a longer key
# (64 random bytes); a key already in use is the user's and stays.
if [[ -z "${AIRFLOW__API_AUTH__JWT_SECRET:-}" && ! -e "${AIRFLOW_CONFIG:-$AIRFLOW_HOME/airflow.cfg}" ]]; then
    "$VENV/bin/python" - <<'PY'
import base64, pathlib, re, secrets

from airflow import configuration

cfg = pathlib.Path(configuration.AIRFLOW_CONFIG)
configuration.write_default_airflow_configuration_if_needed()
key = base64.b64encode(secrets.token_bytes(64)).decode()
cfg.write_text(re.sub(r"(?m)^(jwt_secret\s*=).*$", lambda m: f"{m.group(1)} {key}", cfg.read_text(), count=1))
PY
fi

# Job control gives Airflow its own process group. SIGINT is what stops standalone cleanly, but
# it arrives ignored when this script runs as a background job of a non-interactive shell (and
# ignored signals survive exec), so restore its default before exec'ing Airflow.
set -m
"$VENV/bin/python" -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])' \
    "$VENV/bin/airflow" standalone &
AIRFLOW_PID=$!
set +m

# The telemetry agent samples the devices into the ledger, applies the alert rules (cordon on
# Xid/ECC, stop leaking tasks) and serves Prometheus metrics. GPUSCHED_AGENT=0 leaves it out.
AGENT_PID=""
if [[ "${GPUSCHED_AGENT:-1}" != "0" ]]; then
    "$VENV/bin/gpusched" agent --interval "${GPUSCHED_AGENT_INTERVAL:-10}" \
        --port "${GPUSCHED_METRICS_PORT:-9400}" >"$AIRFLOW_HOME/gpusched-agent.log" 2>&1 &
    AGENT_PID=$!
    echo "gpusched: telemetry agent pid $AGENT_PID, metrics on http://127.0.0.1:${GPUSCHED_METRICS_PORT:-9400}/metrics"
fi

stop() {
    trap - INT TERM
    if [[ -n "$AGENT_PID" ]]; then kill -TERM "$AGENT_PID" 2>/dev/null || true; fi
    echo "gpusched: stopping Airflow (pid $AIRFLOW_PID); running tasks finish first ..."
    # SIGINT to standalone's parent stops all its components; SIGTERM would leave children.
    kill -INT "$AIRFLOW_PID" 2>/dev/null || true
    local waited=0
    while kill -0 "$AIRFLOW_PID" 2>/dev/null && (( waited < ${GPUSCHED_STOP_TIMEOUT:-90} )); do
        sleep 1
        waited=$((waited + 1))
    done
    if kill -0 "$AIRFLOW_PID" 2>/dev/null; then
        echo "gpusched: Airflow did not stop in time; terminating its process group" >&2
        kill -TERM -- "-$AIRFLOW_PID" 2>/dev/null || true
        sleep 3
        kill -KILL -- "-$AIRFLOW_PID" 2>/dev/null || true
    fi
    wait "$AIRFLOW_PID" 2>/dev/null || true
    halt_metadb
    echo "gpusched: stopped"
}
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM

set +e
wait "$AIRFLOW_PID"
status=$?
if [[ -n "$AGENT_PID" ]]; then kill -TERM "$AGENT_PID" 2>/dev/null || true; wait "$AGENT_PID" 2>/dev/null; fi
halt_metadb
exit "$status"
