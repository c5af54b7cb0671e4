#!/usr/bin/env bash
# Start one GPU host of a multi-host gpusched deployment: `gpusched agent` (registers this host's
# GPUs in the shared ledger at this host's address, heartbeats, serves /metrics) and the Celery
# worker on this host's queue gpusched@<host> (plus `default`, for tasks without GPUs). When one
# of the two ends, the other is stopped; SIGINT/SIGTERM stop both.
#
#   GPUSCHED_HOST=gpu-node-7 GPUSCHED_HOST_ADDRESS=10.0.0.7 scripts/gpu_host.sh [extra `airflow celery worker` options]
#
# Needs the deployment's settings in the environment (README, "Run on several GPU hosts"):
#   AIRFLOW__CORE__EXECUTOR                  gpusched.airflow.celery_executor.GPUCeleryExecutor
#   AIRFLOW__DATABASE__SQL_ALCHEMY_CONN      the control host's Airflow database (not SQLite)
#   AIRFLOW__CELERY__BROKER_URL              the control host's Redis
#   AIRFLOW__CELERY__RESULT_BACKEND          db+<the Airflow database URL>
#   AIRFLOW__CORE__EXECUTION_API_SERVER_URL  http(s)://<control host>:8080/execution/
#   GPUSCHED_DB_URL                          the shared ledger (not SQLite)
# and this host's own:
#   GPUSCHED_HOST            its name (default: `hostname`); its Celery queue is gpusched@<name>
#   GPUSCHED_HOST_ADDRESS    the address the other GPU hosts reach this one at: MASTER_ADDR of a
#                            multi-node gang whose rank 0 runs here (default: the first address of
#                            `hostname -I`; loopback only when set on purpose, every host on one machine)
#   GPUSCHED_METRICS_HOST    bind address of the agent's /metrics (default 127.0.0.1; this host's
#                            address or 0.0.0.0 so that Prometheus can scrape it from elsewhere)
#   GPUSCHED_METRICS_PORT    its port (default 9400; 0 = no /metrics)
# Each missing or invalid setting is one line on stderr; then it exits 2 before starting anything.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then export PATH="$PWD/.venv/bin:$PATH"; fi

errors=0
problem() { echo "gpu_host.sh: $*" >&2; errors=$((errors + 1)); }
is_loopback() {
    case "${1,,}" in
        127.*|::1|\[::1\]|::ffff:127.*|localhost|localhost.|*.localhost) return 0 ;;
        *) return 1 ;;
    esac
}
is_sqlite() { case "$1" in sqlite*) return 0 ;; *) return 1 ;; esac; }

executor=gpusched.airflow.celery_executor.GPUCeleryExecutor
declare -A fix=(
    [AIRFLOW__CORE__EXECUTOR]="set it to $executor"
    [AIRFLOW__DATABASE__SQL_ALCHEMY_CONN]="point it at the control host's Airflow database"
    [AIRFLOW__CELERY__BROKER_URL]="point it at the control host's Redis, e.g. redis://control-host:6379/0"
    [AIRFLOW__CELERY__RESULT_BACKEND]="set it to db+<the Airflow database URL>"
    [AIRFLOW__CORE__EXECUTION_API_SERVER_URL]="set it to http://<control host>:8080/execution/"
    [GPUSCHED_DB_URL]="point it at the shared ledger on the control host's PostgreSQL"
)
for name in AIRFLOW__CORE__EXECUTOR AIRFLOW__DATABASE__SQL_ALCHEMY_CONN AIRFLOW__CELERY__BROKER_URL \
        AIRFLOW__CELERY__RESULT_BACKEND AIRFLOW__CORE__EXECUTION_API_SERVER_URL GPUSCHED_DB_URL; do
    if [ -z "${!name:-}" ]; then
        problem "$name is not set; ${fix[$name]} (README: Run on several GPU hosts)"
    fi
done
case "${AIRFLOW__CORE__EXECUTOR:-$executor}" in
    *"$executor"*) ;;
    *) problem "AIRFLOW__CORE__EXECUTOR=$AIRFLOW__CORE__EXECUTOR does not name the GPU Celery executor; set it to $executor" ;;
esac
for name in AIRFLOW__DATABASE__SQL_ALCHEMY_CONN GPUSCHED_DB_URL; do
    if is_sqlite "${!name:-}"; then
        problem "$name=${!name} is a file on this host, which the other hosts cannot share; point it at the control host's PostgreSQL"
    fi
done
case "${AIRFLOW__CORE__EXECUTION_API_SERVER_URL:-http://}" in
    http://*|https://*) ;;
    *) problem "AIRFLOW__CORE__EXECUTION_API_SERVER_URL=$AIRFLOW__CORE__EXECUTION_API_SERVER_URL is not an http(s) URL; set it to http://<control host>:8080/execution/" ;;
esac

host="${GPUSCHED_HOST:-$(hostname 2>/dev/null || true)}"
if [ -z "$host" ]; then
    problem "GPUSCHED_HOST is not set and \`hostname\` names no host; set it to this GPU host's name"
elif ! [[ "$host" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]]; then
    problem "GPUSCHED_HOST=$host is not a host name (letters, digits, '.', '_', '-'); set it to this GPU host's name"
fi

address="${GPUSCHED_HOST_ADDRESS:-}"
if [ -n "$address" ]; then
    case "$address" in
        0.0.0.0|::|\[::\]) problem "GPUSCHED_HOST_ADDRESS=$address is a bind address, not one other hosts can connect to; set it to this host's routable address" ;;
        *[[:space:]]*) problem "GPUSCHED_HOST_ADDRESS='$address' holds a space; set it to one address" ;;
    esac
else
    address="$(hostname -I 2>/dev/null | awk '{print $1}' || true)"
    if [ -z "$address" ]; then
        problem "GPUSCHED_HOST_ADDRESS is not set and \`hostname -I\` shows no address; set it to the address the other GPU hosts reach this one at"
    elif is_loopback "$address"; then
        problem "GPUSCHED_HOST_ADDRESS is not set and this host's first address $address is loopback, which the other GPU hosts cannot reach; set it to this host's routable address (127.0.0.1 only when every GPU host runs on this machine)"
    fi
fi

metrics_host="${GPUSCHED_METRICS_HOST:-127.0.0.1}"
if [ -z "$metrics_host" ] || [[ "$metrics_host" =~ [[:space:]] ]]; then
    problem "GPUSCHED_METRICS_HOST='$metrics_host' is not an address; set it to 127.0.0.1, this host's address or 0.0.0.0"
fi
metrics_port="${GPUSCHED_METRICS_PORT:-9400}"
if ! [[ "$metrics_port" =~ ^[0-9]{1,5}$ ]] || [ "$((10#$metrics_port))" -gt 65535 ]; then
    problem "GPUSCHED_METRICS_PORT=$metrics_port is not a port; set it to 0-65535 (0 = no /metrics)"
fi

for command in gpusched airflow; do
    if ! command -v "$command" >/dev/null 2>&1; then
        problem "\`$command\` is not on PATH; install gpusched and Airflow's Celery provider on this host, or create .venv with scripts/setup.sh"
    fi
done

if [ "$errors" -gt 0 ]; then
    exit 2
fi

export GPUSCHED_HOST="$host" GPUSCHED_HOST_ADDRESS="$address"
# Airflow's Celery configuration; the worker imports the ledger's driver once, not per GPU task.
export AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS="${AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS:-gpusched.airflow.celery_config.CELERY_CONFIG}"
# Background children of a script ignore SIGINT, so both are stopped with SIGTERM from here (the
# Celery worker's warm shutdown: running tasks finish first).
gpusched agent --host-name "$host" --address "$address" --host "$metrics_host" --port "$((10#$metrics_port))" &
agent=$!
airflow celery worker --queues "gpusched@$host,default" "$@" &
worker=$!
stop() { kill -TERM "$agent" "$worker" 2>/dev/null || true; }
trap stop INT TERM
trap 'kill -TERM "$agent" "$worker" 2>/dev/null || true' EXIT

status=0
wait -n || status=$?
if ! kill -0 "$agent" 2>/dev/null && kill -0 "$worker" 2>/dev/null; then
    echo "gpu_host.sh: the agent ended (exit $status); stopping the Celery worker" >&2
elif ! kill -0 "$worker" 2>/dev/null && kill -0 "$agent" 2>/dev/null; then
    echo "gpu_host.sh: the Celery worker ended (exit $status); stopping the agent" >&2
fi
stop
wait || true
exit "$status"
