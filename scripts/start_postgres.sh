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
#
#   URL=$(bash scripts/start_postgres.sh --keep DIR DB)     # scripts/run.sh: the main job's database
#   bash scripts/start_postgres.sh --halt DIR
#
# `--keep` is the kept kind: the cluster in DIR/data is created on first use and started again
# with its data on later calls (or found running), listens on a Unix socket only (in DIR, 0700:
# no TCP port, only its owner and root can connect), and database DB is created if missing; it
# prints `postgresql+psycopg://postgres@/DB?host=SOCKET_DIR`. `--halt DIR` stops it and keeps the
# data. Exit status 3 means that, run as root, the postgres user cannot reach DIR (a parent folder
# is closed to it): the caller picks another DIR.
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

if [[ "${1:-}" == "--halt" ]]; then
    dir=${2:?usage: start_postgres.sh --halt DIR}
    [[ -f "$dir/data/postmaster.pid" ]] || exit 0
    socket=$(sed -n 5p "$dir/data/postmaster.pid" 2>/dev/null || true)
    pg_ctl=$(find_bin pg_ctl) || exit 0
    as_owner "$pg_ctl" -D "$dir/data" -m fast -w -t 60 stop >/dev/null 2>&1 || true
    # A socket folder of its own under /tmp (a DIR path too long for a socket) goes with it.
    if [[ "$socket" == /tmp/gpusched-pg.* ]]; then rm -rf "$socket"; fi
    exit 0
fi

if [[ "${1:-}" == "--keep" ]]; then
    dir=${2:?usage: start_postgres.sh --keep DIR DB}
    db=${3:?usage: start_postgres.sh --keep DIR DB}
    [[ "$db" =~ ^[a-z_][a-z0-9_]*$ ]] || { echo "database name '$db': lower-case letters, digits and _ only" >&2; exit 2; }
    initdb=$(find_bin initdb) || { echo "PostgreSQL server binaries not found; apt-get install -y postgresql" >&2; exit 2; }
    pg_ctl=$(find_bin pg_ctl) || { echo "pg_ctl not found; apt-get install -y postgresql" >&2; exit 2; }
    psql=$(find_bin psql) || { echo "psql not found; apt-get install -y postgresql" >&2; exit 2; }
    mkdir -p "$dir"
    chmod 700 "$dir"
    if [[ $(id -u) -eq 0 ]]; then
        id postgres >/dev/null 2>&1 || { echo "no 'postgres' user to run the server as root" >&2; exit 2; }
        chown postgres "$dir"
        as_owner test -x "$dir" || { echo "the postgres user cannot reach $dir (a parent folder is closed to it)" >&2; exit 3; }
    fi
    if [[ ! -f "$dir/data/PG_VERSION" ]]; then
        rm -rf "$dir/data"
        as_owner "$initdb" -D "$dir/data" -U postgres --auth=trust --encoding=UTF8 --no-instructions \
            >"$dir/initdb.log" 2>&1 || { cat "$dir/initdb.log" >&2; exit 1; }
    fi
    if as_owner "$pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
        socket=$(sed -n 5p "$dir/data/postmaster.pid")  # already running (a run.sh that was killed)
    else
        socket=$dir
        # A Unix socket path is limited to 107 bytes: a deep DIR gets a socket folder in /tmp.
        if (( ${#dir} > 90 )); then
            socket=$(mktemp -d /tmp/gpusched-pg.XXXXXX)
            if [[ $(id -u) -eq 0 ]]; then chown postgres "$socket"; fi
        fi
        as_owner "$pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 120 \
            -o "-c listen_addresses='' -k '$socket' -c max_connections=100" start >/dev/null \
            || { tail -n 20 "$dir/server.log" >&2; exit 1; }
    fi
    if [[ -z "$("$psql" -h "$socket" -U postgres -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$db'")" ]]; then
        "$psql" -h "$socket" -U postgres -d postgres -q -c "CREATE DATABASE $db" >/dev/null
    fi
    echo "postgresql+psycopg://postgres@/$db?host=$socket"
    exit 0
fi

dir=${1:?usage: start_postgres.sh DIR  (or --stop DIR, --keep DIR DB, --halt DIR)}
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
