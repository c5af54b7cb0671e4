"""Alembic environment for the ledger: always run on a connection that the caller opened.

:func:`gpusched.ledger.migrate.upgrade` opens the transaction (``BEGIN IMMEDIATE`` on SQLite, an
advisory lock on PostgreSQL) so that several processes migrating at once serialise, and hands the
connection over in ``config.attributes["connection"]``.
"""

from __future__ import annotations

from alembic import context

from gpusched.ledger.schema import METADATA, VERSION_TABLE

connection = context.config.attributes.get("connection")
if connection is None:  # pragma: no cover - only reached when someone runs the alembic CLI by hand
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
