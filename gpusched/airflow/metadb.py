"""Airflow's own metadata database when it is SQLite (the main job's embedded default).

``airflow standalone`` runs the API server, scheduler, dag-processor and triggerer as separate
processes on one SQLite file. With SQLite's defaults (rollback journal, Python's 5 s lock wait)
a write that waits behind another component's long write fails with ``database is locked`` —
seen as a 500 from the REST API (``PATCH /dags/{id}``) on a loaded machine. The gpusched ledger
already runs SQLite in WAL mode with :data:`gpusched.ledger.engine.BUSY_TIMEOUT_S`; this module
gives Airflow's database the same two settings:

* :data:`SQLITE_CONNECT_ARGS` — the connect arguments whose import path ``scripts/run.sh`` sets as
  ``[database] sql_alchemy_connect_args`` (and ``…_async``), only when the database is SQLite;
* ``python -m gpusched.airflow.metadb`` — switches the configured SQLite file to WAL (a setting
  SQLite keeps in the file) and prints ``sqlite``; for any other database it changes nothing and
  prints nothing.
"""

from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from gpusched.ledger.engine import BUSY_TIMEOUT_S

__all__ = ["SQLITE_CONNECT_ARGS", "enable_wal", "sqlite_path"]

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


def main() -> int:
    """Enable WAL on Airflow's configured metadata database if it is a SQLite file."""
    url = os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "").strip()
    if not url:
        # Importing Airflow's configuration also sets up its ORM: only when the URL is not given.
        from airflow.configuration import conf

        url = conf.get("database", "sql_alchemy_conn")
    path = sqlite_path(url)
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
