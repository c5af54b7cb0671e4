"""The ledger's side tables: pending queue, telemetry samples, demand history and events.

A mixin of :class:`gpusched.ledger.Ledger`; kept apart so that the allocation core stays short.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from gpusched.ledger.capacity import demand_series
from gpusched.ledger.engine import read_tx, write_tx
from gpusched.ledger.records import LedgerEvent, QueueEntry, request_from_json
from gpusched.ledger.schema import ALLOCATIONS, EVENTS, QUEUE, SAMPLES, SHARES
from gpusched.model import DeviceSample
from gpusched.request import GPURequest

__all__ = ["LedgerExtras"]


class LedgerExtras:
    """Queue, samples, demand history and events (needs ``self.engine``)."""

    engine: sa.Engine

    # ---- queue -------------------------------------------------------------------------------------

    def record_queue(self, key: str, request: GPURequest, reason: str, now: float) -> None:
        """Note that ``key`` waits, and why (the latest reason wins; ``since`` keeps the first sighting)."""
        with write_tx(self.engine) as conn:
            updated = conn.execute(
                sa.update(QUEUE).where(QUEUE.c.key == key)
                .values(request=request.to_dict(), reason=reason, updated_at=now)
            ).rowcount
            if not updated:
                conn.execute(sa.insert(QUEUE).values(
                    key=key, request=request.to_dict(), reason=reason, since=now, updated_at=now
                ))

    def clear_queue(self, key: str) -> None:
        """Forget ``key`` in the queue (it was placed or it went away); no error if absent."""
        with write_tx(self.engine) as conn:
            conn.execute(sa.delete(QUEUE).where(QUEUE.c.key == key))

    def queue(self) -> list[QueueEntry]:
        """Waiting tasks, longest waiting first."""
        with read_tx(self.engine) as conn:
            rows = conn.execute(sa.select(QUEUE).order_by(QUEUE.c.since, QUEUE.c.key)).all()
        return [
            QueueEntry(r.key, request_from_json(r.request), r.reason, r.since, r.updated_at) for r in rows
        ]

    # ---- telemetry ---------------------------------------------------------------------------------

    def record_samples(self, samples: Sequence[DeviceSample]) -> None:
        """Store telemetry readings (one insert for the batch)."""
        if not samples:
            return
        with write_tx(self.engine) as conn:
            conn.execute(sa.insert(SAMPLES), [
                {
                    "uuid": s.uuid, "taken_at": s.taken_at, "utilization_pct": s.utilization_pct,
                    "memory_used_bytes": s.memory_used_bytes, "memory_total_bytes": s.memory_total_bytes,
                    "temperature_mc": s.temperature_mc, "power_mw": s.power_mw,
                    "ecc_uncorrected": s.ecc_uncorrected, "xid_errors": list(s.xid_errors),
                }
                for s in samples
            ])

    def samples(self, uuid: str | None, since: float) -> list[DeviceSample]:
        """Readings taken at or after ``since``, of one device (all when ``uuid`` is None), oldest first."""
        query = sa.select(SAMPLES).where(SAMPLES.c.taken_at >= since)
        if uuid is not None:
            query = query.where(SAMPLES.c.uuid == uuid)
        with read_tx(self.engine) as conn:
            rows = conn.execute(query.order_by(SAMPLES.c.taken_at, SAMPLES.c.id)).all()
        return [
            DeviceSample(
                r.uuid, r.taken_at, r.utilization_pct, r.memory_used_bytes, r.memory_total_bytes,
                r.temperature_mc, r.power_mw, r.ecc_uncorrected, tuple(r.xid_errors),
            )
            for r in rows
        ]

    def prune_samples(self, before: float) -> int:
        """Delete readings taken before ``before``; returns how many."""
        with write_tx(self.engine) as conn:
            return int(conn.execute(sa.delete(SAMPLES).where(SAMPLES.c.taken_at < before)).rowcount)

    # ---- history and events ------------------------------------------------------------------------

    def demand_history(self, start: float, end: float, step_s: int = 3600) -> list[tuple[float, int]]:
        """Average milli-GPU allocated in each step of ``[start, end)``, from allocation history.

        An allocation counts from ``created_at`` until ``released_at`` (still-active ones until
        ``end``); each step holds the time-weighted mean, so a step with one whole device held
        for half of it reads 500.
        """
        per_allocation = (
            sa.select(
                ALLOCATIONS.c.created_at,
                ALLOCATIONS.c.released_at,
                sa.func.sum(SHARES.c.milli),
            )
            .join(SHARES, SHARES.c.allocation_id == ALLOCATIONS.c.id)
            .where(
                ALLOCATIONS.c.created_at < end,
                sa.or_(ALLOCATIONS.c.released_at.is_(None), ALLOCATIONS.c.released_at > start),
            )
            .group_by(ALLOCATIONS.c.id, ALLOCATIONS.c.created_at, ALLOCATIONS.c.released_at)
        )
        with read_tx(self.engine) as conn:
            rows = conn.execute(per_allocation).all()
        intervals = [(r[0], end if r[1] is None else r[1], int(r[2])) for r in rows]
        return demand_series(intervals, start, end, step_s)

    def events(
        self,
        limit: int = 100,
        *,
        kinds: Sequence[str] = (),
        since: float | None = None,
        subject: str | None = None,
    ) -> list[LedgerEvent]:
        """The most recent events, newest first; optionally of some kinds, one subject, after ``since``."""
        query = sa.select(EVENTS)
        if kinds:
            query = query.where(EVENTS.c.kind.in_(list(kinds)))
        if subject is not None:
            query = query.where(EVENTS.c.subject == subject)
        if since is not None:
            query = query.where(EVENTS.c.at >= since)
        with read_tx(self.engine) as conn:
            rows = conn.execute(query.order_by(EVENTS.c.id.desc()).limit(limit)).all()
        return [LedgerEvent(r.id, r.at, r.kind, r.subject, _as_dict(r.detail)) for r in rows]

    def record_event(self, kind: str, subject: str, *, now: float | None = None, **detail: Any) -> None:
        """Add an event of another layer (for example a fault classification) to the log."""
        at = time.time() if now is None else now
        with write_tx(self.engine) as conn:
            conn.execute(sa.insert(EVENTS).values(at=at, kind=kind, subject=subject, detail=detail))


def _as_dict(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, dict) else {"value": value}
