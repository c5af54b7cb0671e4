"""Bring a ledger database to the newest schema with Alembic, without an ``alembic.ini``.

Safe to call from several processes at once: the upgrade runs inside one write transaction
(``BEGIN IMMEDIATE`` on SQLite; a transaction-scoped advisory lock on PostgreSQL), so the first
caller migrates and the others wait, then find the schema at head and do nothing. Both SQLite and
PostgreSQL run DDL transactionally, so a failed upgrade leaves the database as it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa

from gpusched.ledger.engine import write_tx
from gpusched.ledger.schema import VERSION_TABLE

if TYPE_CHECKING:
    from alembic.config import Config

__all__ = ["MIGRATIONS_DIR", "alembic_config", "current_revision", "head_revision", "upgrade"]

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
"""The Alembic script location shipped inside the package."""

# Arbitrary constant key for pg_advisory_xact_lock ("gpusched" in ASCII, truncated to 63 bits).
_PG_LOCK_KEY = 0x67707573636865


def alembic_config() -> Config:
    """An :class:`alembic.config.Config` pointing at the packaged migrations (no ini file)."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def head_revision() -> str:
    """The newest revision the packaged migrations know."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "the packaged ledger migrations have no head revision"
    return head


def current_revision(engine: sa.Engine) -> str | None:
    """The revision the database is at (None before the first migration)."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()


def upgrade(engine: sa.Engine, revision: str = "head") -> None:
    """Upgrade the database behind ``engine`` to ``revision`` (idempotent, multi-process safe)."""
    from alembic import command

    config = alembic_config()
    with write_tx(engine) as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK_KEY})
        config.attributes["connection"] = conn
        command.upgrade(config, revision)
