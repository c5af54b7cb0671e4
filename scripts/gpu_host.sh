#!/usr/bin/env bash
# Start one GPU host of a multi-host gpusched deployment: `gpusched agent` (registers this host's
# GPUs in the shared ledger and heartbeats) and the Celery worker on this host's queue
# gpusched@<host> (plus `default`, for tasks without GPUs). Stops the agent when the worker ends.
#
#   GPUSCHED_HOST=gpu-node-7 scripts/gpu_host.sh [extra `airflow celery worker` options]
#
# Needs the deployment's settings in the environment (README, "Run on several GPU hosts"):
# AIRFLOW__CORE__EXECUTOR, AIRFLOW__DATABASE__SQL_ALCHEMY_CONN, AIRFLOW__CELERY__BROKER_URL,
# AIRFLOW__CELERY__RESULT_BACKEND, AIRFLOW__CORE__EXECUTION_API_SERVER_URL and GPUSCHED_DB_URL.
set -euo pipefail
cd "$(dirname "$0")/.."
for name in AIRFLOW__DATABASE__SQL_ALCHEMY_CONN AIRFLOW__CELERY__BROKER_URL GPUSCHED_DB_URL; do
    if [ -z "${!name:-}" ]; then
        echo "gpu_host.sh: $name is not set; point it at the control host (README: Run on several GPU hosts)" >&2
        exit 2
    fi
done
export GPUSCHED_HOST="${GPUSCHED_HOST:-$(hostname)}"
if [ -x .venv/bin/python ]; then export PATH="$PWD/.venv/bin:$PATH"; fi
gpusched agent --host-name "$GPUSCHED_HOST" --port "${GPUSCHED_METRICS_PORT:-9400}" &
agent=$!
trap 'kill "$agent" 2>/dev/null || true' EXIT
airflow celery worker --queues "gpusched@$GPUSCHED_HOST,default" "$@"
