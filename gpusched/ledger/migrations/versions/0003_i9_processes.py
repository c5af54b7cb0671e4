"""Allocations record the processes that hold them (host, pid, start time).

Revision ID: 0003_i9_processes
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_i9_processes"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add ``gpusched_allocations.processes`` (JSON, nullable: older rows record none)."""
    with op.batch_alter_table("gpusched_allocations") as batch:
        batch.add_column(sa.Column("processes", sa.JSON, nullable=True))


def downgrade() -> None:
    """Drop ``gpusched_allocations.processes``."""
    with op.batch_alter_table("gpusched_allocations") as batch:
        batch.drop_column("processes")
