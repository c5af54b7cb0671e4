"""When each try was first queued, on its allocation.

Revision ID: 0010_allocation_queued_at
Revises: 0009_move_shares
Create Date: 2026-12-03

A task instance requeued by a preemption (a new Airflow try) ages in the queue from when its
first try was queued, as the simulator's requeued job keeps its arrival
(gpusched.scheduler.attained.first_queued); the executor writes the try's first sighting here
when it allocates. Older rows stay NULL (their creation time is used instead).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_allocation_queued_at"
down_revision = "0009_move_shares"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the nullable ``queued_at`` column."""
    with op.batch_alter_table("gpusched_allocations") as batch:
        batch.add_column(sa.Column("queued_at", sa.Double, nullable=True))


def downgrade() -> None:
    """Drop ``queued_at``."""
    with op.batch_alter_table("gpusched_allocations") as batch:
        batch.drop_column("queued_at")
