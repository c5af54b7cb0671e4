"""Hard-isolated slices in the inventory: parent device, slice profile, compute share.

Revision ID: 0004_slices
Revises: 0003_processes
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_slices"
down_revision = "0003_processes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add parent, profile and compute_milli to gpusched_devices (existing rows: whole devices)."""
    with op.batch_alter_table("gpusched_devices") as batch:
        batch.add_column(sa.Column("parent", sa.String(255), nullable=True))
        batch.add_column(sa.Column("profile", sa.String(64), nullable=True))
        batch.add_column(sa.Column("compute_milli", sa.Integer, nullable=False, server_default="1000"))


def downgrade() -> None:
    """Drop the three slice columns."""
    with op.batch_alter_table("gpusched_devices") as batch:
        batch.drop_column("compute_milli")
        batch.drop_column("profile")
        batch.drop_column("parent")
