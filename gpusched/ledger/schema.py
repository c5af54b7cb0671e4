"""The ledger's tables, as SQLAlchemy Core metadata (the Alembic migrations create the same).

Every table carries the ``gpusched_`` prefix so the ledger can share a PostgreSQL database with
Airflow's metadata without a name clash; Alembic's version table is ``gpusched_alembic_version``
for the same reason. Times are epoch seconds (or a simulation clock) as floating point numbers;
memory is bytes and compute share milli-GPU, both integers.
"""

from __future__ import annotations

import sqlalchemy as sa

__all__ = [
    "ALLOCATIONS",
    "ALLOCATION_CHANGE",
    "CHECKPOINTS",
    "DEVICES",
    "EVENTS",
    "HOSTS",
    "INVENTORY_REVISION",
    "METADATA",
    "MOVES",
    "NODES",
    "QUEUE",
    "REQUEST_OVERRIDES",
    "SAMPLES",
    "SHARES",
    "VERSION_TABLE",
]

VERSION_TABLE = "gpusched_alembic_version"
"""Alembic's bookkeeping table for the ledger schema."""

METADATA = sa.MetaData()

NODES = sa.Table(
    "gpusched_nodes",
    METADATA,
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

DEVICES = sa.Table(
    "gpusched_devices",
    METADATA,
    sa.Column("uuid", sa.String(255), primary_key=True),
    sa.Column(
        "node",
        sa.String(255),
        sa.ForeignKey("gpusched_nodes.name", ondelete="CASCADE"),
        nullable=False,
        index=True,
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
    # Hard-isolated slices (MIG instance, AMD compute partition): the physical device, the
    # profile and the share of its compute; NULL / 1000 for whole devices (migration 0004_slices).
    sa.Column("parent", sa.String(255), nullable=True),
    sa.Column("profile", sa.String(64), nullable=True),
    sa.Column("compute_milli", sa.Integer, nullable=False, server_default="1000"),
    # Health as the hardware backend last reported it, and the override set by the fault chain;
    # the effective health is the worse of the two.
    sa.Column("reported_health", sa.String(16), nullable=False),
    sa.Column("health_override", sa.String(16), nullable=True),
    sa.Column("health_reason", sa.Text, nullable=True),
    sa.Column("cordoned", sa.Boolean, nullable=False),
    sa.Column("cordon_reason", sa.Text, nullable=True),
    sa.Column("updated_at", sa.Double, nullable=False),
)

INVENTORY_REVISION = sa.Table(
    "gpusched_inventory_revision",
    METADATA,
    # One row (id 1): a number every transaction that changes what a snapshot shows of the
    # inventory (nodes, devices, health overrides, cordons) increases (migration 0011), so a
    # reader may keep the nodes it loaded for as long as the number stays the same.
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("revision", sa.BigInteger, nullable=False),
)

ALLOCATIONS = sa.Table(
    "gpusched_allocations",
    METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(1024), nullable=False, index=True),
    sa.Column("request", sa.JSON, nullable=False),
    sa.Column("holder", sa.String(255), nullable=False, index=True),
    sa.Column("created_at", sa.Double, nullable=False, index=True),
    sa.Column("lease_expires_at", sa.Double, nullable=False),
    sa.Column("released_at", sa.Double, nullable=True),
    sa.Column("release_reason", sa.Text, nullable=True),
    sa.Column("status", sa.String(16), nullable=False),
    # The processes that hold the devices (executor, worker, task: host, pid, start time), so a
    # restart or a worker's death can tell a live holder from a dead one.
    sa.Column("processes", sa.JSON, nullable=True),
    # When the try was first queued (the executor's first sighting; migration 0010): a requeued
    # task instance ages from its first try's queue time (gpusched.scheduler.attained).
    sa.Column("queued_at", sa.Double, nullable=True),
    # The change number of the row's last write (migration 0013): every transaction that inserts
    # or updates allocation rows gives them the next number, in the order the writers commit, so
    # a reader that saw every change up to N reads only ``change > N`` next (the change feed of
    # gpusched.ledger.active_view). Rows written before the migration hold 0.
    sa.Column("change", sa.BigInteger, nullable=False, server_default="0", index=True),
    # At most one active allocation per key: the database itself refuses a second one. A
    # quarantined row (status ``quarantined``, migration 0012) is unreleased but not active: the
    # same try may be placed again while its devices wait for the agent's confirmation.
    sa.Index(
        "ix_gpusched_allocations_active_key",
        "key",
        unique=True,
        sqlite_where=sa.text("released_at IS NULL AND status = 'active'"),
        postgresql_where=sa.text("released_at IS NULL AND status = 'active'"),
    ),
)

ALLOCATION_CHANGE = sa.Table(
    "gpusched_allocation_change",
    METADATA,
    # One row (id 1): the last change number handed out on PostgreSQL (migration 0013). A writer
    # takes the next one by updating this row, which holds the row's lock until it commits, so
    # the numbers commit in order. SQLite's writers hold its single write lock instead and take
    # the highest ``change`` of the allocations plus one; there this row stays at 0.
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("change", sa.BigInteger, nullable=False),
)

SHARES = sa.Table(
    "gpusched_allocation_shares",
    METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column(
        "allocation_id",
        sa.Integer,
        sa.ForeignKey("gpusched_allocations.id", ondelete="CASCADE"),
        nullable=False,
        index=True,
    ),
    # Not a foreign key: history must outlive a device that leaves the inventory.
    sa.Column("device_uuid", sa.String(255), nullable=False, index=True),
    sa.Column("node", sa.String(255), nullable=False),
    sa.Column("idx", sa.Integer, nullable=False),
    sa.Column("milli", sa.Integer, nullable=False),
    sa.Column("memory_bytes", sa.BigInteger, nullable=False),
)

QUEUE = sa.Table(
    "gpusched_queue",
    METADATA,
    sa.Column("key", sa.String(1024), primary_key=True),
    sa.Column("request", sa.JSON, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("since", sa.Double, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
)

SAMPLES = sa.Table(
    "gpusched_samples",
    METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("uuid", sa.String(255), nullable=False),
    sa.Column("taken_at", sa.Double, nullable=False, index=True),
    sa.Column("utilization_pct", sa.Integer, nullable=False),
    sa.Column("memory_used_bytes", sa.BigInteger, nullable=False),
    sa.Column("memory_total_bytes", sa.BigInteger, nullable=False),
    sa.Column("temperature_mc", sa.Integer, nullable=False),
    sa.Column("power_mw", sa.BigInteger, nullable=False),
    sa.Column("ecc_uncorrected", sa.Integer, nullable=False),
    sa.Column("xid_errors", sa.JSON, nullable=False),
    sa.Index("ix_gpusched_samples_uuid_taken_at", "uuid", "taken_at"),
)

EVENTS = sa.Table(
    "gpusched_events",
    METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("at", sa.Double, nullable=False, index=True),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("subject", sa.String(1024), nullable=False, index=True),
    sa.Column("detail", sa.JSON, nullable=False),
    sa.Index("ix_gpusched_events_kind_id", "kind", "id"),
)

HOSTS = sa.Table(
    "gpusched_hosts",
    METADATA,
    # One GPU host of a multi-host fleet: its agent registers the host's nodes under this name
    # (inventory source ``host:<name>``) and heartbeats; a host whose heartbeat stops is ``lost``.
    sa.Column("name", sa.String(255), primary_key=True),
    sa.Column("fingerprint", sa.String(64), nullable=False),
    sa.Column("devices", sa.JSON, nullable=False),
    sa.Column("address", sa.String(255), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("reason", sa.Text, nullable=True),
    sa.Column("registered_at", sa.Double, nullable=False),
    sa.Column("last_heartbeat", sa.Double, nullable=False),
    # What the agent last saw of the host's Celery worker (migration 0012): ``running``,
    # ``stopped`` (SIGSTOP: frozen) or ``missing``; NULL when the agent does not watch one. When
    # it last saw it running, and its slots (Celery concurrency).
    sa.Column("worker_state", sa.String(16), nullable=True),
    sa.Column("worker_seen_at", sa.Double, nullable=True),
    sa.Column("worker_slots", sa.Integer, nullable=True),
)

REQUEST_OVERRIDES = sa.Table(
    "gpusched_request_overrides",
    METADATA,
    # The fault chain's standing instructions to the executor, one row per scope (latest wins):
    # kind "override": tries of (dag_id, task_id) in run_id ("" = every run) use ``request``;
    # kind "refusal": try ``try_number`` of that run fails at once, because of ``reason``.
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("dag_id", sa.String(250), nullable=False),
    sa.Column("task_id", sa.String(250), nullable=False),
    sa.Column("run_id", sa.String(250), nullable=False),
    sa.Column("try_number", sa.Integer, nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("request", sa.JSON, nullable=True),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.UniqueConstraint(
        "dag_id", "task_id", "run_id", "try_number", "kind", name="uq_gpusched_request_overrides_scope"
    ),
)

CHECKPOINTS = sa.Table(
    "gpusched_checkpoints",
    METADATA,
    # One row per task try (``key`` = its allocation key): the last checkpoint the task reported
    # (gpusched.airflow.checkpoint) and the preemption notice the executor gave it. ``task`` names
    # the task instance across tries, so a new try can resume from an earlier try's checkpoint.
    sa.Column("key", sa.String(1024), primary_key=True),
    sa.Column("task", sa.String(1024), nullable=False, index=True),
    sa.Column("step", sa.BigInteger, nullable=True),
    sa.Column("path", sa.Text, nullable=True),
    sa.Column("checkpoint_at", sa.Double, nullable=True),
    sa.Column("notice_at", sa.Double, nullable=True),
    sa.Column("notice_reason", sa.Text, nullable=True),
    sa.Column("updated_at", sa.Double, nullable=False),
)

MOVES = sa.Table(
    "gpusched_moves",
    METADATA,
    # One move in flight of ``preemption = migrate`` (migration 0008): try ``old_key`` stops and
    # its next try ``next_key`` runs on ``placement`` (``to_model``), held by ``holder``. Written
    # when the move starts, deleted when the next try started or the move was given up, so an
    # executor restarted meanwhile completes it (or abandons it cleanly) instead of forgetting it.
    sa.Column("next_key", sa.String(1024), primary_key=True),
    sa.Column("old_key", sa.String(1024), nullable=False),
    sa.Column("holder", sa.String(255), nullable=False, index=True),
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
