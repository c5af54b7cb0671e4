"""Checkpoints and preemption notices: what a running task last saved, and whether it must stop.

A mixin of :class:`gpusched.ledger.Ledger`. The task side writes its checkpoints
(:mod:`gpusched.airflow.checkpoint`) and reads its notice; the executor writes notices and reads
checkpoint times (victim selection prefers the tasks that lose least work). One row per task try,
keyed by the try's allocation key; ``task`` names the task instance across its tries.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import sqlalchemy as sa

from gpusched.ledger.engine import read_tx, write_tx
from gpusched.ledger.schema import CHECKPOINTS

__all__ = ["Checkpoint", "LedgerCheckpoints"]

_T = CHECKPOINTS


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One try's row: its last checkpoint (``at`` None: none yet) and its preemption notice."""

    key: str
    task: str
    step: int | None
    path: str | None
    at: float | None
    notice_at: float | None
    notice_reason: str | None


def _row(r: sa.Row) -> Checkpoint:
    return Checkpoint(r.key, r.task, r.step, r.path, r.checkpoint_at, r.notice_at, r.notice_reason)


class LedgerCheckpoints:
    """Checkpoint methods of :class:`gpusched.ledger.Ledger` (needs ``self.engine``)."""

    engine: sa.Engine

    def _upsert(self, key: str, task: str, values: dict[str, object], now: float) -> None:
        with write_tx(self.engine) as conn:
            updated = conn.execute(sa.update(_T).where(_T.c.key == key).values(updated_at=now, **values))
            if not updated.rowcount:
                conn.execute(sa.insert(_T).values(key=key, task=task, updated_at=now, **values))

    def report_checkpoint(self, key: str, task: str, *, step: int | None = None, path: str | None = None,
                          now: float | None = None) -> float:
        """Record that try ``key`` (of task instance ``task``) saved a checkpoint now; returns the time."""
        at = time.time() if now is None else float(now)
        self._upsert(key, task, {"step": step, "path": path, "checkpoint_at": at}, at)
        return at

    def notify_preemption(self, key: str, task: str, reason: str, *, now: float | None = None) -> None:
        """Tell try ``key`` that it is preempted (it may checkpoint before it is stopped)."""
        at = time.time() if now is None else float(now)
        self._upsert(key, task, {"notice_at": at, "notice_reason": reason}, at)

    def checkpoint(self, key: str) -> Checkpoint | None:
        """The row of try ``key``, or None."""
        with read_tx(self.engine) as conn:
            row = conn.execute(sa.select(_T).where(_T.c.key == key)).first()
        return _row(row) if row is not None else None

    def preemption_notices(self, keys: Iterable[str]) -> dict[str, Checkpoint]:
        """Key → its row, for those of ``keys`` that were told they are preempted."""
        wanted = list(keys)
        if not wanted:
            return {}
        with read_tx(self.engine) as conn:
            rows = conn.execute(sa.select(_T).where(_T.c.key.in_(wanted), _T.c.notice_at.is_not(None))).all()
        return {r.key: _row(r) for r in rows}

    def checkpoint_times(self, keys: Iterable[str]) -> dict[str, float]:
        """Key → time of its last checkpoint, for those of ``keys`` that reported one."""
        wanted = list(keys)
        if not wanted:
            return {}
        with read_tx(self.engine) as conn:
            rows = conn.execute(sa.select(_T.c.key, _T.c.checkpoint_at).where(
                _T.c.key.in_(wanted), _T.c.checkpoint_at.is_not(None))).all()
        return {r.key: float(r.checkpoint_at) for r in rows}

    def last_checkpoint(self, task: str) -> Checkpoint | None:
        """The newest checkpoint any try of task instance ``task`` reported, or None."""
        with read_tx(self.engine) as conn:
            row = conn.execute(sa.select(_T).where(_T.c.task == task, _T.c.checkpoint_at.is_not(None))
                               .order_by(_T.c.checkpoint_at.desc()).limit(1)).first()
        return _row(row) if row is not None else None
