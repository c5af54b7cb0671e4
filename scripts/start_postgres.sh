#!/usr/bin/env bash
# Start a throwaway PostgreSQL cluster for tests and print its SQLAlchemy URL on stdout.
#
#   PGDIR=$(mktemp -d)
#   export GPUSCHED_TEST_PG_URL=$(bash scripts/start_postgres.sh "$PGDIR")
#   trap 'bash scripts/start_postgres.sh --stop "$PGDIR"' EXIT
#
# The cluster lives entirely in DIR (data, socket, log), listens on 127.0.0.1 at a free port with
# trust authentication, and holds one database "gpusched_test". `--stop DIR` stops it and removes
# DIR. Needs the PostgreSQL server binaries (Debian: `apt-get install -y postgresql`). When run as
# root the server runs as the "postgres" user (initdb refuses root). Exit status 2 means the
# server binaries are absent, so a caller can skip the PostgreSQL tests.
set -euo pipefail

find_bin() {
    local name=$1
    if command -v "$name" >/dev/null 2>&1; then command -v "$name"; return 0; fi
    local found
    found=$(ls -d /usr/lib/postgresql/*/bin/"$name" 2>/dev/null | sort -V | tail -n 1 || true)
    if [[ -n "$found" ]]; then echo "$found"; return 0; fi
    return 1
}

as_owner() {
    if [[ $(id -u) -eq 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi
}

if [[ "${1:-}" == "--stop" ]]; then
    dir=${2:?usage: start_postgres.sh --stop DIR}
    if [[ -f "$dir/data/postmaster.pid" ]]; then
        pg_ctl=$(find_bin pg_ctl) && as_owner "$pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null || true
    fi
    rm -rf "$dir"
    exit 0
fi

dir=${1:?usage: start_postgres.sh DIR  (or --stop DIR)}
initdb=$(find_bin initdb) || { echo "PostgreSQL server binaries not found; apt-get install -y postgresql" >&2; exit 2; }
pg_ctl=$(find_bin pg_ctl) || { echo "pg_ctl not found; apt-get install -y postgresql" >&2; exit 2; }
mkdir -p "$dir"
if [[ $(id -u) -eq 0 ]]; then
    id postgres >/dev/null 2>&1 || { echo "no 'postgres' user to run the server as root" >&2; exit 2; }
    chown postgres "$dir"
    chmod 700 "$dir"
fi
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
as_owner "$initdb" -D "$dir/data" -U postgres --auth=trust --encoding=UTF8 --no-instructions >"$dir/initdb.log" 2>&1 \
    || { cat "$dir/initdb.log" >&2; exit 1; }
as_owner "$pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=off -c max_connections=100" start >/dev/null \
    || { cat "$dir/server.log" >&2; exit 1; }
psql=$(find_bin psql)
"$psql" -h 127.0.0.1 -p "$port" -U postgres -d postgres -q -c "CREATE DATABASE gpusched_test" >/dev/null
echo "postgresql+psycopg://postgres@127.0.0.1:$port/gpusched_test"
