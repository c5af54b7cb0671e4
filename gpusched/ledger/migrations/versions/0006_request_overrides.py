"""The fault chain's request overrides and refused retries in a table of their own.

Revision ID: 0006_request_overrides
Revises: 0005_hosts
Create Date: 2026-12-03

Until now they lived only as events, rebuilt each cycle from the newest 5,000 of them, so an old
override could silently vanish. The upgrade copies the ones still in force from the event log.
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0006_request_overrides"
down_revision = "0005_hosts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the overrides table and fill it from the event log."""
    table = op.create_table(
        "gpusched_request_overrides",
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
    assert table is not None
    events = sa.table(
        "gpusched_events", sa.column("id"), sa.column("at"), sa.column("kind"), sa.column("detail", sa.JSON)
    )
    bind = op.get_bind()
    rows = bind.execute(
        sa.select(events.c.at, events.c.kind, events.c.detail)
        .where(events.c.kind.in_(["request_override", "override_cleared", "retry_refused"]))
        .order_by(events.c.id)
    ).all()
    kept: dict[tuple[str, str, str, int, str], dict[str, Any]] = {}
    for at, kind, raw in rows:  # oldest first: a later row replaces or clears an earlier one
        detail = json.loads(raw) if isinstance(raw, str) else (raw or {})
        dag_id, task_id = str(detail.get("dag_id", "")), str(detail.get("task_id", ""))
        if kind == "override_cleared":
            kept = {k: v for k, v in kept.items() if not (k[:2] == (dag_id, task_id) and k[4] == "override")}
            continue
        try:
            if kind == "retry_refused":
                scope = (dag_id, task_id, str(detail["run_id"]), int(detail["try_number"]), "refusal")
                request = None
            else:
                scope = (dag_id, task_id, str(detail.get("run_id") or ""), 0, "override")
                request = dict(detail["request"])
        except (KeyError, TypeError, ValueError):
            continue
        kept.pop(scope, None)  # re-insert so dict order follows the newest write
        kept[scope] = {
            "dag_id": scope[0], "task_id": scope[1], "run_id": scope[2], "try_number": scope[3],
            "kind": scope[4], "request": request, "reason": str(detail.get("reason", "")), "created_at": at,
        }
    if kept:
        op.bulk_insert(table, list(kept.values()))


def downgrade() -> None:
    """Drop the overrides table (the events written beside it stay)."""
    op.drop_table("gpusched_request_overrides")
