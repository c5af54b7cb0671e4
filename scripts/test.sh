#!/usr/bin/env bash
# The test command: lint (ruff), type-check (mypy), the layers contract (import-linter, contracts in
# pyproject.toml), then the whole pytest suite.
#
# Starts the services the tests need when they are installed and not already running — a Docker
# engine (scripts/start_dockerd.sh) and a throwaway PostgreSQL (scripts/start_postgres.sh) — and
# stops what it started. Extra arguments go to pytest (e.g. `scripts/test.sh -m "not airflow"`).
# The fault-injection suite (marker `faults`: kills workers, tasks, the scheduler and a private
# PostgreSQL server) is part of the run; `scripts/test.sh -m faults` runs it alone.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"

echo "== ruff"; ruff check .
echo "== mypy"; mypy
echo "== import-linter"; lint-imports

PGDIR=""
STARTED_DOCKERD=""
cleanup() {
    if [[ -n "$PGDIR" ]]; then bash scripts/start_postgres.sh --stop "$PGDIR" >/dev/null 2>&1 || true; fi
    if [[ -n "$STARTED_DOCKERD" && -f "$STARTED_DOCKERD" ]]; then
        kill "$(cat "$STARTED_DOCKERD")" 2>/dev/null || true
    fi
}
trap cleanup EXIT

if command -v dockerd >/dev/null 2>&1 && [[ "$(id -u)" == "0" ]]; then
    if ! docker info >/dev/null 2>&1; then
        export GPUSCHED_DOCKERD_DIR="${GPUSCHED_DOCKERD_DIR:-/tmp/gpusched-dockerd}"
        if bash scripts/start_dockerd.sh; then STARTED_DOCKERD="$GPUSCHED_DOCKERD_DIR/dockerd.pid"; fi
    fi
else
    echo "== no Docker engine available: the docker-marked tests will say so and skip"
fi

if [[ -z "${GPUSCHED_TEST_PG_URL:-}" ]]; then
    PGDIR="$(mktemp -d /tmp/gpusched-pg.XXXXXX)"
    chmod 755 "$PGDIR"
    if URL="$(bash scripts/start_postgres.sh "$PGDIR")"; then
        export GPUSCHED_TEST_PG_URL="$URL"
        echo "== PostgreSQL for the ledger tests at $URL"
    else
        echo "== no PostgreSQL server binaries: the PostgreSQL ledger tests will say so and skip"
        rm -rf "$PGDIR"; PGDIR=""
    fi
fi

echo "== pytest"
pytest "$@"
