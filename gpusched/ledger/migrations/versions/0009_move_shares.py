"""A move's devices stored as DeviceShare dicts, as every other JSON column stores them.

Revision ID: 0009_move_shares
Revises: 0008_moves
Create Date: 2026-12-03

0008 wrote ``gpusched_moves.shares`` and ``placement`` as lists ``[uuid, node, index, milli,
memory_bytes]``; allocations (``Allocation.to_dict``, the API) write ``DeviceShare.to_dict``. One
format now: rows are rewritten in place (moves in flight are few: one row per move).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0009_move_shares"
down_revision = "0008_moves"
branch_labels = None
depends_on = None

_FIELDS = ("uuid", "node", "index", "milli", "memory_bytes")
_MOVES = sa.table("gpusched_moves", sa.column("next_key", sa.String), sa.column("shares", sa.JSON),
                  sa.column("placement", sa.JSON))


def _as_dicts(shares: list[Any]) -> list[dict[str, Any]]:
    return [dict(zip(_FIELDS, item, strict=True)) if isinstance(item, list) else item for item in shares]


def _as_lists(shares: list[Any]) -> list[list[Any]]:
    return [[item[f] for f in _FIELDS] if isinstance(item, dict) else item for item in shares]


def _rewrite(convert: Any) -> None:
    conn = op.get_bind()
    for row in conn.execute(sa.select(_MOVES.c.next_key, _MOVES.c.shares, _MOVES.c.placement)).all():
        conn.execute(sa.update(_MOVES).where(_MOVES.c.next_key == row.next_key).values(
            shares=convert(row.shares), placement=convert(row.placement)))


def upgrade() -> None:
    """Rewrite the stored lists as dicts."""
    _rewrite(_as_dicts)


def downgrade() -> None:
    """Rewrite the dicts as 0008's lists."""
    _rewrite(_as_lists)
