"""The inventory's revision number, so a reader can keep the nodes it loaded while it holds.

Revision ID: 0011_inventory_revision
Revises: 0010_allocation_queued_at
Create Date: 2026-12-06

Every transaction that changes what a fleet snapshot shows of the inventory (nodes, devices,
health overrides, cordons) increases the one row's ``revision``; the scheduler reloads nodes and
devices only when it differs from the one it loaded them at (gpusched.ledger.inventory).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_inventory_revision"
down_revision = "0010_allocation_queued_at"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the one-row table, at revision 1."""
    table = op.create_table(
        "gpusched_inventory_revision",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("revision", sa.BigInteger, nullable=False),
    )
    op.bulk_insert(table, [{"id": 1, "revision": 1}])


def downgrade() -> None:
    """Drop the table."""
    op.drop_table("gpusched_inventory_revision")
