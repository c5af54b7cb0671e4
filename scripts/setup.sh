#!/usr/bin/env bash
# One-time set-up of a fresh Debian/Ubuntu machine for gpusched (run as root or with sudo).
# Installs the system packages the tests use (Docker engine, busybox for locally built test
# images, PostgreSQL, Prometheus for the scrape test), then a virtual environment in .venv pinned by
# constraints.txt with the dev and lab extras (the lab: benchmarks and plots).
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

if command -v apt-get >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
        docker.io docker-compose busybox-static postgresql redis-server chromium prometheus >/dev/null
fi

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e ".[dev,lab]"
echo "gpusched: set-up done (.venv ready)."
