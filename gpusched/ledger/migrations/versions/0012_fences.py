"""Fenced allocations and the host's Celery worker as its agent sees it.

Revision ID: 0012_fences
Revises: 0011_inventory_revision
Create Date: 2026-12-06

An allocation whose holder's fate is unknown (its GPU host lost) is *quarantined*: it stays
unreleased, so its devices stay out of placement, until the host's agent confirms that the try's
processes are gone. The same try may be placed again meanwhile, so the one-active-row-per-key
index now covers only ``active`` rows. Each host row also records what its agent last saw of the
host's Celery worker (running, stopped, missing), when it last saw it running, and its slots.
An allocation released because its task succeeded now says so in its status (``succeeded``, what
learned durations read); older rows get it from the release reasons the code wrote then.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_fences"
down_revision = "0011_inventory_revision"
branch_labels = None
depends_on = None

_INDEX = "ix_gpusched_allocations_active_key"
_SUCCEEDED_REASONS = ("release_reason LIKE 'task succeeded%' "
                      "OR release_reason LIKE 'task process ended (task success)%'")


def upgrade() -> None:
    """Add the worker columns; narrow the active-key index to ``active`` rows."""
    with op.batch_alter_table("gpusched_hosts") as batch:
        batch.add_column(sa.Column("worker_state", sa.String(16), nullable=True))
        batch.add_column(sa.Column("worker_seen_at", sa.Double, nullable=True))
        batch.add_column(sa.Column("worker_slots", sa.Integer, nullable=True))
    op.drop_index(_INDEX, table_name="gpusched_allocations")
    where = sa.text("released_at IS NULL AND status = 'active'")
    op.create_index(_INDEX, "gpusched_allocations", ["key"], unique=True,
                    sqlite_where=where, postgresql_where=where)
    op.execute(f"UPDATE gpusched_allocations SET status = 'succeeded' WHERE status = 'released' AND "
               f"({_SUCCEEDED_REASONS})")


def downgrade() -> None:
    """Drop the worker columns; the active-key index covers every unreleased row again."""
    op.execute("UPDATE gpusched_allocations SET status = 'released' WHERE status = 'succeeded'")
    op.drop_index(_INDEX, table_name="gpusched_allocations")
    where = sa.text("released_at IS NULL")
    op.create_index(_INDEX, "gpusched_allocations", ["key"], unique=True,
                    sqlite_where=where, postgresql_where=where)
    with op.batch_alter_table("gpusched_hosts") as batch:
        batch.drop_column("worker_slots")
        batch.drop_column("worker_seen_at")
        batch.drop_column("worker_state")
