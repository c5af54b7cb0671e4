"""Airflow's own metadata database in the main job (``scripts/run.sh``).

``airflow standalone`` runs the API server, scheduler, dag-processor and triggerer as separate
processes on one database. On SQLite, one write lock serves them all, and the API server deadlocks
itself on it: its audit-log dependency (``action_logging``, on ``POST /dags/{id}/dagRuns`` and
every other write route) inserts its ``log`` row from the event loop, while one of its own request
threads holds the write lock (a task's ``PUT …/rtif`` or ``POST /execution/xcoms``) and needs that
event loop to reach its commit. The loop waits for the lock, the lock waits for the loop, until the
lock wait runs out: with Python's default 5 s a 500 ``database is locked``; with 60 s every
request to the API server and every scheduler, dag-processor and triggerer write stalls for 60 s
and the trigger answers 500 (seen as ``httpx.ReadTimeout`` by a 30 s client). It happens whenever a
trigger lands while a task talks to the execution API, more often the busier the machine.
PostgreSQL locks rows, not the database, so the ``log`` insert never waits there: ``run.sh`` runs
the main job's database on a PostgreSQL of its own (``scripts/start_postgres.sh --keep``) and keeps
SQLite as the fallback where the server binaries are absent (or ``GPUSCHED_METADB=sqlite``).

For SQLite it gives Airflow's database the ledger's two settings (WAL and
:data:`gpusched.ledger.engine.BUSY_TIMEOUT_S`), so a write waiting behind another component's long
write waits instead of failing:

* :data:`SQLITE_CONNECT_ARGS` — the connect arguments whose import path ``scripts/run.sh`` sets as
  ``[database] sql_alchemy_connect_args`` (and ``…_async``), only when the database is SQLite;
* ``python -m gpusched.airflow.metadb`` — switches the configured SQLite file to WAL (a setting
  SQLite keeps in the file) and prints ``sqlite``; for any other database it changes nothing and
  prints nothing;
* ``python -m gpusched.airflow.metadb kind`` — prints ``default`` when Airflow would use its own
  default SQLite file (``$AIRFLOW_HOME/airflow.db``: no database configured, the case where
  ``run.sh`` starts PostgreSQL), ``sqlite`` for another SQLite database, ``other`` for any other.
"""

from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from gpusched.ledger.engine import BUSY_TIMEOUT_S

__all__ = ["SQLITE_CONNECT_ARGS", "database_kind", "enable_wal", "sqlite_path"]

SQLITE_CONNECT_ARGS: dict[str, Any] = {"timeout": BUSY_TIMEOUT_S}


def sqlite_path(url: str) -> Path | None:
    """The database file of a SQLite URL; None for another backend or an in-memory database."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return None
    database = parsed.database or ""
    if not database or ":memory:" in database:
        return None
    return Path(database)


def enable_wal(path: Path) -> str:
    """Put the SQLite file at ``path`` (created if missing) in WAL mode; returns the journal mode
    SQLite reports afterwards (``wal``; another value means SQLite refused, e.g. on a network
    file system, and the database keeps working in that mode)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S)
    try:
        return str(connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
    finally:
        connection.close()


def database_kind(url: str, airflow_home: Path) -> str:
    """``default`` when ``url`` is Airflow's default database for ``airflow_home`` (the SQLite file
    ``airflow.db`` in it), ``sqlite`` for another SQLite database, ``other`` for any other."""
    if make_url(url).get_backend_name() != "sqlite":
        return "other"
    path = sqlite_path(url)
    if path is not None and path.resolve() == (airflow_home / "airflow.db").resolve():
        return "default"
    return "sqlite"


def _configured_url() -> str:
    url = os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "").strip()
    if url:
        return url
    # Importing Airflow's configuration also sets up its ORM: only when the URL is not given.
    from airflow.configuration import conf

    return str(conf.get("database", "sql_alchemy_conn"))


def main(argv: list[str] | None = None) -> int:
    """Enable WAL on Airflow's configured metadata database if it is a SQLite file (no argument),
    or print the kind of database configured (``kind``)."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["kind"]:
        home = Path(os.environ.get("AIRFLOW_HOME", "~/airflow")).expanduser()  # as Airflow finds it
        print(database_kind(_configured_url(), home))
        return 0
    if args:
        print("usage: python -m gpusched.airflow.metadb [kind]", file=sys.stderr)
        return 2
    path = sqlite_path(_configured_url())
    if path is None:
        return 0
    mode = enable_wal(path)
    if mode != "wal":
        print(f"gpusched: SQLite kept journal mode {mode!r} for {path} (WAL not supported there)",
              file=sys.stderr)
    print("sqlite")
    return 0


if __name__ == "__main__":
    sys.exit(main())
