"""Airflow's metadata database in the main job (``gpusched.airflow.metadb``, used by
``scripts/run.sh``): which kind is configured (run.sh starts PostgreSQL for Airflow's default), and
the SQLite fallback's WAL and lock wait: real SQLite files, the module run as run.sh runs it."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpusched.airflow.metadb import SQLITE_CONNECT_ARGS, database_kind, enable_wal, sqlite_path
from gpusched.ledger.engine import BUSY_TIMEOUT_S


def _run_module(home: Path, url: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env["AIRFLOW_HOME"] = str(home)
    if url is not None:
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = url
    return subprocess.run([sys.executable, "-m", "gpusched.airflow.metadb", *args], env=env, text=True,
                          capture_output=True, timeout=120, check=True)


def test_kind_tells_airflows_default_file_from_a_database_the_user_configured(tmp_path: Path) -> None:
    """run.sh starts its own PostgreSQL only for ``default``: nothing configured."""
    assert database_kind(f"sqlite:///{tmp_path / 'airflow.db'}", tmp_path) == "default"
    assert database_kind(f"sqlite:///{tmp_path / 'elsewhere.db'}", tmp_path) == "sqlite"
    assert database_kind("postgresql+psycopg://postgres@/airflow?host=/run/pg", tmp_path) == "other"
    # As run.sh asks: nothing in the environment (Airflow's own default), then a configured one.
    assert _run_module(tmp_path, None, "kind").stdout.strip().splitlines()[-1] == "default"
    assert _run_module(tmp_path, f"sqlite:///{tmp_path / 'x.db'}", "kind").stdout.strip() == "sqlite"
    assert _run_module(tmp_path, "postgresql+psycopg://a@h/db", "kind").stdout.strip() == "other"


def test_sqlite_path_only_for_sqlite_files(tmp_path: Path) -> None:
    assert sqlite_path(f"sqlite:///{tmp_path / 'airflow.db'}") == tmp_path / "airflow.db"
    assert sqlite_path("sqlite://") is None
    assert sqlite_path("sqlite:///:memory:") is None
    assert sqlite_path("postgresql://airflow:pw@127.0.0.1/airflow") is None


def test_module_switches_the_configured_sqlite_file_to_wal(tmp_path: Path) -> None:
    db = tmp_path / "state" / "airflow.db"
    result = _run_module(tmp_path / "home", f"sqlite:///{db}")
    assert result.stdout.strip() == "sqlite"
    with sqlite3.connect(db) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert enable_wal(db) == "wal"  # idempotent


def test_module_leaves_other_databases_alone(tmp_path: Path) -> None:
    result = _run_module(tmp_path / "home", "postgresql+psycopg://airflow:pw@127.0.0.1:1/airflow")
    assert result.stdout.strip() == ""
    assert not list(tmp_path.rglob("*.db"))


def test_a_writer_waits_past_sqlites_default_five_seconds(tmp_path: Path) -> None:
    """What the setting is for: a second writer waits behind a 6 s write instead of failing.
    Python's default (5 s) fails on the same lock, so the check can fail."""
    assert SQLITE_CONNECT_ARGS["timeout"] == BUSY_TIMEOUT_S
    db = tmp_path / "airflow.db"
    enable_wal(db)
    with sqlite3.connect(db) as setup:
        setup.execute("CREATE TABLE dag (dag_id TEXT PRIMARY KEY, is_paused INTEGER)")
        setup.execute("INSERT INTO dag VALUES ('train', 1)")
    holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("UPDATE dag SET is_paused = 1")
    release = threading.Timer(6.0, holder.execute, args=("COMMIT",))
    outcomes: dict[str, str] = {}

    def unpause(name: str, connect_args: dict[str, float]) -> None:
        connection = sqlite3.connect(db, timeout=connect_args.get("timeout", 5.0))
        try:
            with connection:
                connection.execute("UPDATE dag SET is_paused = 0")
            outcomes[name] = "written"
        except sqlite3.OperationalError as exc:
            outcomes[name] = str(exc)
        finally:
            connection.close()

    started = time.monotonic()
    release.start()
    threads = [threading.Thread(target=unpause, args=("default", {})),
               threading.Thread(target=unpause, args=("gpusched", SQLITE_CONNECT_ARGS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    release.join()
    holder.close()
    assert outcomes["default"] == "database is locked"
    assert outcomes["gpusched"] == "written"
    assert time.monotonic() - started >= 6.0
    with sqlite3.connect(db) as check:
        assert check.execute("SELECT is_paused FROM dag").fetchone()[0] == 0


def test_airflow_imports_the_connect_args(tmp_path: Path) -> None:
    """The import path run.sh sets is one Airflow's ``conf.getimport`` resolves (Airflow adds
    ``check_same_thread`` to the dict itself when it builds its SQLite engine)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update({"AIRFLOW_HOME": str(tmp_path),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS": "gpusched.airflow.metadb.SQLITE_CONNECT_ARGS"})
    code = ("from airflow.configuration import conf; "
            "print(conf.getimport('database', 'sql_alchemy_connect_args')['timeout'])")
    result = subprocess.run([sys.executable, "-c", code], env=env, text=True, capture_output=True,
                            timeout=120, check=True)
    assert result.stdout.strip().splitlines()[-1] == str(BUSY_TIMEOUT_S)
