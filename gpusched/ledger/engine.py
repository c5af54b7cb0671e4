"""Database engines for the ledger: where it lives, and how a write transaction begins.

SQLite (the embedded default) runs in WAL mode with a busy timeout; pysqlite's own transaction
handling is switched off so that the ledger emits ``BEGIN`` itself — ``BEGIN IMMEDIATE`` for every
write transaction, which takes SQLite's single write lock up front, so concurrent writers (threads
or processes) queue up instead of interleaving their reads and writes. PostgreSQL uses the
``psycopg`` (3) driver and row locks (``SELECT … FOR UPDATE``) taken by the callers.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event

from gpusched.errors import ConfigurationError, LedgerError, LedgerUnavailableError
from gpusched.paths import state_dir

__all__ = ["BUSY_TIMEOUT_S", "default_url", "make_engine", "read_tx", "write_tx"]

BUSY_TIMEOUT_S = 60.0
"""How long a writer waits for a lock before giving up (default; see ``make_engine``)."""


def default_url() -> str:
    """``$GPUSCHED_DB_URL``, else SQLite at ``state_dir()/ledger.db`` (the folder is created)."""
    url = os.environ.get("GPUSCHED_DB_URL", "").strip()
    if url:
        return url
    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'ledger.db'}"


def make_engine(url: str, *, lock_wait_s: float | None = None) -> sa.Engine:
    """An engine for ``url`` set up for the ledger's transaction discipline.

    ``lock_wait_s`` bounds how long one statement waits for a lock another writer holds (SQLite's
    busy timeout, PostgreSQL's ``lock_timeout``); default :data:`BUSY_TIMEOUT_S`. Past it the
    operation fails with :class:`LedgerUnavailableError` instead of waiting on.
    """
    wait_s = BUSY_TIMEOUT_S if lock_wait_s is None else max(0.001, float(lock_wait_s))
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://"):]
    try:
        parsed = sa.make_url(url)
    except sa.exc.ArgumentError as exc:
        raise ConfigurationError(
            f"ledger database URL {url!r} is not a SQLAlchemy URL ({exc}); "
            "set GPUSCHED_DB_URL to e.g. postgresql://user:pass@host/db or sqlite:////path/ledger.db"
        ) from exc
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        engine = _sqlite_engine(parsed, wait_s)
    elif backend == "postgresql":
        try:
            engine = sa.create_engine(
                parsed, pool_pre_ping=True,
                connect_args={"options": f"-c lock_timeout={int(wait_s * 1000)}",
                              "connect_timeout": max(1, int(wait_s))},
            )
        except ModuleNotFoundError as exc:
            raise ConfigurationError(
                f"the PostgreSQL driver for {parsed.drivername!r} is not installed ({exc}); "
                "install it with `pip install 'psycopg[binary]'`"
            ) from exc
    else:
        raise ConfigurationError(
            f"ledger database {backend!r} is not supported; "
            "use sqlite:///… or postgresql://… in GPUSCHED_DB_URL"
        )
    _forget_pool_after_fork(engine)
    return engine


def _forget_pool_after_fork(engine: sa.Engine) -> None:
    # A forked child (Airflow's LocalExecutor workers, for one) must never reuse the parent's
    # connections: drop the inherited pool without closing the parent's sockets or files.
    ref = weakref.ref(engine)

    def _after_fork() -> None:
        inherited = ref()
        if inherited is not None:
            inherited.dispose(close=False)

    os.register_at_fork(after_in_child=_after_fork)


def _sqlite_engine(url: sa.URL, wait_s: float) -> sa.Engine:
    if url.database and url.database != ":memory:":
        os.makedirs(os.path.dirname(os.path.abspath(url.database)), exist_ok=True)
        engine = sa.create_engine(url, connect_args={"timeout": wait_s})
    else:
        # In-memory (``sqlite://``): one database lives in one connection, so every user of this
        # engine shares that connection — handy for simulations and examples, one process only.
        engine = sa.create_engine(
            url, connect_args={"timeout": wait_s, "check_same_thread": False},
            poolclass=sa.pool.StaticPool,
        )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let the ledger emit BEGIN itself (pysqlite would otherwise begin lazily, in DEFERRED mode).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {int(wait_s * 1000)}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        mode = conn.get_execution_options().get("gpusched_sqlite_begin", "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")

    return engine


@contextmanager
def write_tx(engine: sa.Engine) -> Iterator[sa.Connection]:
    """A transaction that will write: ``BEGIN IMMEDIATE`` on SQLite, plain ``BEGIN`` elsewhere.

    Commits when the block ends normally, rolls back (writing nothing) when it raises.
    """
    with _translated(engine), engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            conn.execution_options(gpusched_sqlite_begin="IMMEDIATE")
        with conn.begin():
            yield conn


@contextmanager
def read_tx(engine: sa.Engine) -> Iterator[sa.Connection]:
    """A read-only transaction: one consistent view of the database for the whole block.

    SQLite gives that to any transaction; PostgreSQL needs REPEATABLE READ for it (its default,
    READ COMMITTED, takes a new snapshot per statement).
    """
    with _translated(engine), engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            yield conn


@contextmanager
def _translated(engine: sa.Engine) -> Iterator[None]:
    # Database failures leave the ledger as gpusched errors that say what to do; constraint
    # violations (IntegrityError) pass through for the callers that expect them.
    try:
        yield
    except (sa.exc.OperationalError, sa.exc.ProgrammingError, sa.exc.InterfaceError) as exc:
        where = engine.url.render_as_string(hide_password=True)
        kind = LedgerError if isinstance(exc, sa.exc.ProgrammingError) else LedgerUnavailableError
        detail = " ".join(str(exc.orig or exc).split())  # one line, whatever the driver says
        raise kind(
            f"the ledger database {where} failed: {detail}. If a table is missing, run "
            "`gpusched ledger migrate`; if it is locked or unreachable, check GPUSCHED_DB_URL and "
            "that no stuck process holds it, then retry"
        ) from exc
