"""Moves in flight of the migrate preemption mode, one row per move.

Revision ID: 0008_moves
Revises: 0007_checkpoints
Create Date: 2026-12-03

The executor writes a move's intent (the old try, the next try, the target devices, the pinned
request, the notice) when it starts the move and deletes it when the next try started or the move
was given up; an executor restarted meanwhile reads it back (gpusched.airflow.gpu_migration).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_moves"
down_revision = "0007_checkpoints"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the moves table."""
    op.create_table(
        "gpusched_moves",
        sa.Column("next_key", sa.String(1024), primary_key=True),
        sa.Column("old_key", sa.String(1024), nullable=False),
        sa.Column("holder", sa.String(255), nullable=False),
        sa.Column("from_model", sa.String(255), nullable=False),
        sa.Column("to_model", sa.String(255), nullable=False),
        sa.Column("shares", sa.JSON, nullable=False),
        sa.Column("placement", sa.JSON, nullable=False),
        sa.Column("gain", sa.Double, nullable=False),
        sa.Column("request", sa.JSON, nullable=False),
        sa.Column("author", sa.JSON, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("notice_at", sa.Double, nullable=False),
        sa.Column("deadline", sa.Double, nullable=False),
    )
    op.create_index("ix_gpusched_moves_holder", "gpusched_moves", ["holder"])


def downgrade() -> None:
    """Drop the moves table."""
    op.drop_index("ix_gpusched_moves_holder", table_name="gpusched_moves")
    op.drop_table("gpusched_moves")
