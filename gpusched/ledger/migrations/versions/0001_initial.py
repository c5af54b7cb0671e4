"""Initial ledger schema: inventory, allocations with shares, queue, samples, events.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create every ledger table."""
    op.create_table(
        "gpusched_nodes",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("rack", sa.String(255), nullable=False),
        sa.Column("labels", sa.JSON, nullable=False),
        sa.Column("cpu_milli", sa.BigInteger, nullable=False),
        sa.Column("memory_bytes", sa.BigInteger, nullable=False),
        sa.Column("standby", sa.Boolean, nullable=False),
        sa.Column("cordoned", sa.Boolean, nullable=False),
        sa.Column("cordon_reason", sa.Text, nullable=True),
        sa.Column("source", sa.String(255), nullable=False),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
    )
    op.create_table(
        "gpusched_devices",
        sa.Column("uuid", sa.String(255), primary_key=True),
        sa.Column(
            "node",
            sa.String(255),
            sa.ForeignKey("gpusched_nodes.name", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("idx", sa.Integer, nullable=False),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("vendor", sa.String(32), nullable=False),
        sa.Column("architecture", sa.String(64), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger, nullable=False),
        sa.Column("numa_node", sa.Integer, nullable=False),
        sa.Column("pcie_switch", sa.String(255), nullable=True),
        sa.Column("island", sa.String(255), nullable=True),
        sa.Column("link", sa.String(32), nullable=False),
        sa.Column("peers", sa.JSON, nullable=False),
        sa.Column("mig_enabled", sa.Boolean, nullable=False),
        sa.Column("reported_health", sa.String(16), nullable=False),
        sa.Column("health_override", sa.String(16), nullable=True),
        sa.Column("health_reason", sa.Text, nullable=True),
        sa.Column("cordoned", sa.Boolean, nullable=False),
        sa.Column("cordon_reason", sa.Text, nullable=True),
        sa.Column("updated_at", sa.Double, nullable=False),
    )
    op.create_index("ix_gpusched_devices_node", "gpusched_devices", ["node"])
    op.create_table(
        "gpusched_allocations",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("key", sa.String(1024), nullable=False),
        sa.Column("request", sa.JSON, nullable=False),
        sa.Column("holder", sa.String(255), nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("lease_expires_at", sa.Double, nullable=False),
        sa.Column("released_at", sa.Double, nullable=True),
        sa.Column("release_reason", sa.Text, nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
    )
    op.create_index("ix_gpusched_allocations_key", "gpusched_allocations", ["key"])
    op.create_index("ix_gpusched_allocations_holder", "gpusched_allocations", ["holder"])
    op.create_index("ix_gpusched_allocations_created_at", "gpusched_allocations", ["created_at"])
    op.create_index(
        "ix_gpusched_allocations_active_key",
        "gpusched_allocations",
        ["key"],
        unique=True,
        sqlite_where=sa.text("released_at IS NULL"),
        postgresql_where=sa.text("released_at IS NULL"),
    )
    op.create_table(
        "gpusched_allocation_shares",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column(
            "allocation_id",
            sa.Integer,
            sa.ForeignKey("gpusched_allocations.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("device_uuid", sa.String(255), nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("idx", sa.Integer, nullable=False),
        sa.Column("milli", sa.Integer, nullable=False),
        sa.Column("memory_bytes", sa.BigInteger, nullable=False),
    )
    op.create_index(
        "ix_gpusched_allocation_shares_allocation_id", "gpusched_allocation_shares", ["allocation_id"]
    )
    op.create_index(
        "ix_gpusched_allocation_shares_device_uuid", "gpusched_allocation_shares", ["device_uuid"]
    )
    op.create_table(
        "gpusched_queue",
        sa.Column("key", sa.String(1024), primary_key=True),
        sa.Column("request", sa.JSON, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("since", sa.Double, nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
    )
    op.create_table(
        "gpusched_samples",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("uuid", sa.String(255), nullable=False),
        sa.Column("taken_at", sa.Double, nullable=False),
        sa.Column("utilization_pct", sa.Integer, nullable=False),
        sa.Column("memory_used_bytes", sa.BigInteger, nullable=False),
        sa.Column("memory_total_bytes", sa.BigInteger, nullable=False),
        sa.Column("temperature_mc", sa.Integer, nullable=False),
        sa.Column("power_mw", sa.BigInteger, nullable=False),
        sa.Column("ecc_uncorrected", sa.Integer, nullable=False),
        sa.Column("xid_errors", sa.JSON, nullable=False),
    )
    op.create_index("ix_gpusched_samples_taken_at", "gpusched_samples", ["taken_at"])
    op.create_index("ix_gpusched_samples_uuid_taken_at", "gpusched_samples", ["uuid", "taken_at"])
    op.create_table(
        "gpusched_events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Double, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("subject", sa.String(1024), nullable=False),
        sa.Column("detail", sa.JSON, nullable=False),
    )
    op.create_index("ix_gpusched_events_at", "gpusched_events", ["at"])


def downgrade() -> None:
    """Drop every ledger table."""
    for table in (
        "gpusched_events",
        "gpusched_samples",
        "gpusched_queue",
        "gpusched_allocation_shares",
        "gpusched_allocations",
        "gpusched_devices",
        "gpusched_nodes",
    ):
        op.drop_table(table)
