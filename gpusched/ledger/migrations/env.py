"""Alembic environment for the ledger: always run on a connection that the caller opened.

:func:`gpusched.ledger.migrate.upgrade` opens the transaction (``BEGIN IMMEDIATE`` on SQLite, an
advisory lock on PostgreSQL) so that several processes migrating at once serialise, and hands the
connection over in ``config.attributes["connection"]``.
"""

from __future__ import annotations

from alembic import context

from gpusched.ledger.schema import METADATA, VERSION_TABLE

__all__ = ["run_migrations"]


def run_migrations() -> None:
    """Run the pending revisions on the connection handed over by ``migrate.upgrade``."""
    connection = context.config.attributes.get("connection")
    if connection is None:
        raise RuntimeError(
            "the ledger migrations run through gpusched.ledger.migrate.upgrade(); "
            "use `Ledger(url).migrate()` or `gpusched ledger migrate` instead of the alembic CLI"
        )
    context.configure(
        connection=connection,
        target_metadata=METADATA,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


# Alembic executes this file as a script; importing it as a module (documentation tools, an
# "import every module" check) must not try to migrate.
if __name__ != "gpusched.ledger.migrations.env":
    run_migrations()
