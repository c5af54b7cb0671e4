"""Moves in flight of the ``migrate`` preemption mode: the intent an executor must not forget.

A mixin of :class:`gpusched.ledger.Ledger`. The executor records a move when it starts it (the
old try, the next try, the devices left and the target devices, the pinned and the author's
request, the notice and its deadline) and forgets it when the next try started on the target or
the move was given up. An executor restarted meanwhile reads its moves back
(:class:`gpusched.airflow.gpu_migration.Migrator`): the held target is kept for the next try (or
held again), the pin stays, and a move that cannot complete is abandoned with its hold released
and its pin removed. Whether the target is held, and whether the old try ended, are not stored:
the allocations say it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from gpusched.ledger.engine import read_tx, write_tx
from gpusched.ledger.schema import MOVES
from gpusched.model import DeviceShare
from gpusched.request import GPURequest

__all__ = ["LedgerMoves", "MoveIntent"]

_T = MOVES


@dataclass(frozen=True, slots=True)
class MoveIntent:
    """One move in flight: try ``old_key`` (on ``shares`` of ``from_model``) stops; its next try
    ``next_key`` runs on ``placement`` (``to_model``), pinned to ``request``; ``author`` is the
    task's own request; the old try was told at ``notice_at`` and is stopped by ``deadline``."""

    next_key: str
    old_key: str
    holder: str
    from_model: str
    to_model: str
    shares: tuple[DeviceShare, ...]
    placement: tuple[DeviceShare, ...]
    gain: float
    request: GPURequest
    author: GPURequest
    reason: str
    notice_at: float
    deadline: float


def _shares_json(shares: tuple[DeviceShare, ...]) -> list[dict[str, Any]]:
    return [s.to_dict() for s in shares]


def _shares(raw: list[dict[str, Any]]) -> tuple[DeviceShare, ...]:
    return tuple(DeviceShare.from_dict(item) for item in raw)


class LedgerMoves:
    """Move methods of :class:`gpusched.ledger.Ledger` (needs ``self.engine``)."""

    engine: sa.Engine

    def record_move(self, move: MoveIntent) -> None:
        """Remember ``move`` (replacing a move recorded for the same next try)."""
        with write_tx(self.engine) as conn:
            conn.execute(sa.delete(_T).where(_T.c.next_key == move.next_key))
            conn.execute(sa.insert(_T).values(
                next_key=move.next_key, old_key=move.old_key, holder=move.holder,
                from_model=move.from_model, to_model=move.to_model, shares=_shares_json(move.shares),
                placement=_shares_json(move.placement), gain=float(move.gain), request=move.request.to_dict(),
                author=move.author.to_dict(), reason=move.reason, notice_at=float(move.notice_at),
                deadline=float(move.deadline),
            ))

    def forget_move(self, next_key: str) -> bool:
        """Forget the move whose next try is ``next_key``; returns whether there was one."""
        with write_tx(self.engine) as conn:
            return bool(conn.execute(sa.delete(_T).where(_T.c.next_key == next_key)).rowcount)

    def moves(self, holder: str | None = None) -> list[MoveIntent]:
        """The moves in flight (of ``holder`` only, if given), oldest notice first."""
        query = sa.select(_T)
        if holder is not None:
            query = query.where(_T.c.holder == holder)
        with read_tx(self.engine) as conn:
            rows = conn.execute(query.order_by(_T.c.notice_at, _T.c.next_key)).all()
        return [
            MoveIntent(r.next_key, r.old_key, r.holder, r.from_model, r.to_model, _shares(r.shares),
                       _shares(r.placement), r.gain, GPURequest.from_dict(r.request),
                       GPURequest.from_dict(r.author), r.reason, r.notice_at, r.deadline)
            for r in rows
        ]
