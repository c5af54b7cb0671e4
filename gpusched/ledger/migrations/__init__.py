"""Alembic migrations of the ledger schema (run through :func:`gpusched.ledger.migrate.upgrade`)."""

__all__: list[str] = []
