"""Indexes for reading events by kind and by subject (override and failure look-ups).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the two event indexes."""
    op.create_index("ix_gpusched_events_kind_id", "gpusched_events", ["kind", "id"])
    op.create_index("ix_gpusched_events_subject", "gpusched_events", ["subject"])


def downgrade() -> None:
    """Drop the two event indexes."""
    op.drop_index("ix_gpusched_events_subject", table_name="gpusched_events")
    op.drop_index("ix_gpusched_events_kind_id", table_name="gpusched_events")
