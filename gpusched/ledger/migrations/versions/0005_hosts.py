"""GPU hosts of a multi-host fleet: name, devices fingerprint, last heartbeat, state.

Revision ID: 0005_hosts
Revises: 0004_slices
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_hosts"
down_revision = "0004_slices"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the hosts table."""
    op.create_table(
        "gpusched_hosts",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("devices", sa.JSON, nullable=False),
        sa.Column("address", sa.String(255), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("registered_at", sa.Double, nullable=False),
        sa.Column("last_heartbeat", sa.Double, nullable=False),
    )


def downgrade() -> None:
    """Drop the hosts table."""
    op.drop_table("gpusched_hosts")
