"""Checkpoints and preemption notices, one row per task try.

Revision ID: 0007_checkpoints
Revises: 0006_request_overrides
Create Date: 2026-12-03

A task reports its last checkpoint (gpusched.airflow.checkpoint.report) and learns here that the
executor preempts it; victim selection prefers the tasks that lose least work since theirs.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_checkpoints"
down_revision = "0006_request_overrides"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the checkpoints table."""
    op.create_table(
        "gpusched_checkpoints",
        sa.Column("key", sa.String(1024), primary_key=True),
        sa.Column("task", sa.String(1024), nullable=False),
        sa.Column("step", sa.BigInteger, nullable=True),
        sa.Column("path", sa.Text, nullable=True),
        sa.Column("checkpoint_at", sa.Double, nullable=True),
        sa.Column("notice_at", sa.Double, nullable=True),
        sa.Column("notice_reason", sa.Text, nullable=True),
        sa.Column("updated_at", sa.Double, nullable=False),
    )
    op.create_index("ix_gpusched_checkpoints_task", "gpusched_checkpoints", ["task"])


def downgrade() -> None:
    """Drop the checkpoints table."""
    op.drop_index("ix_gpusched_checkpoints_task", table_name="gpusched_checkpoints")
    op.drop_table("gpusched_checkpoints")
