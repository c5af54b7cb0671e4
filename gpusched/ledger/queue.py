"""The pending queue: which tasks wait for devices, since when, and why.

A mixin of :class:`gpusched.ledger.Ledger`; the GPU executor writes it each cycle and the UI reads it.
"""

from __future__ import annotations

import sqlalchemy as sa

from gpusched.ledger.engine import read_tx, write_tx
from gpusched.ledger.schema import QUEUE
from gpusched.records import QueueEntry, request_from_json
from gpusched.request import GPURequest

__all__ = ["LedgerQueue"]


class LedgerQueue:
    """Queue methods of :class:`gpusched.ledger.Ledger` (needs ``self.engine``)."""

    engine: sa.Engine

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
