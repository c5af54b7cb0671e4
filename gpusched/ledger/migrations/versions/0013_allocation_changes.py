"""A change number on every allocation row, so a long-lived reader reads only what changed.

Revision ID: 0013_allocation_changes
Revises: 0012_fences
Create Date: 2026-12-07

Every transaction that writes allocation rows stamps them with the next change number, in the
order the writers commit (gpusched.ledger.allocations.stamp_changes); the executor's cycle then
reads only the rows whose number is above the highest it has seen (gpusched.ledger.active_view).
Existing rows start at 0 (a reader's first read is a full one), as does the one-row counter
PostgreSQL's writers take their numbers from.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_allocation_changes"
down_revision = "0012_fences"
branch_labels = None
depends_on = None

_INDEX = "ix_gpusched_allocations_change"


def upgrade() -> None:
    """Add ``change`` (0 for existing rows) with its index, and the counter row at 0."""
    # A plain ADD COLUMN (no batch copy of the table on SQLite, which keeps its partial index).
    op.add_column("gpusched_allocations",
                  sa.Column("change", sa.BigInteger, nullable=False, server_default="0"))
    op.create_index(_INDEX, "gpusched_allocations", ["change"])
    counter = op.create_table(
        "gpusched_allocation_change",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("change", sa.BigInteger, nullable=False),
    )
    op.bulk_insert(counter, [{"id": 1, "change": 0}])


def downgrade() -> None:
    """Drop the counter, the index and the column."""
    op.drop_table("gpusched_allocation_change")
    op.drop_index(_INDEX, table_name="gpusched_allocations")
    with op.batch_alter_table("gpusched_allocations") as batch:
        batch.drop_column("change")
