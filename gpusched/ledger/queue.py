"""The pending queue: which tasks wait for devices, since when, and why.

A mixin of :class:`gpusched.ledger.Ledger`; the GPU executor writes it each cycle and the UI reads it.
A multi-node gang member's membership travels in the ``request`` JSON column under
:data:`GANG_FIELD` (beside the request's own fields) and reads back as a :class:`GangQueueEntry`,
so the standby scale-out can tell a waiting gang from single tasks; rows written without it read
back as plain queue entries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import sqlalchemy as sa

from gpusched.gang import GangMember
from gpusched.ledger.engine import read_tx, write_tx
from gpusched.ledger.schema import QUEUE
from gpusched.records import QueueEntry, request_from_json
from gpusched.request import GPURequest

__all__ = ["GANG_FIELD", "GangQueueEntry", "LedgerQueue", "dequeue"]

GANG_FIELD = "gpusched_gang"
"""Key of a gang member's membership (gang, size, rank, scope) in the queue's request JSON."""


@dataclass(frozen=True, slots=True)
class GangQueueEntry(QueueEntry):
    """A waiting member of a multi-node gang: a queue entry with its ``gang`` membership."""

    gang: GangMember


class LedgerQueue:
    """Queue methods of :class:`gpusched.ledger.Ledger` (needs ``self.engine``)."""

    engine: sa.Engine

    def record_queue(
        self, key: str, request: GPURequest, reason: str, now: float, *, gang: GangMember | None = None
    ) -> None:
        """Note that ``key`` waits, and why (the latest reason wins; ``since`` keeps the first
        sighting); ``gang``: the membership of a multi-node gang member."""
        data = request.to_dict()
        if gang is not None:
            data[GANG_FIELD] = {"gang": gang.gang, "size": gang.size, "rank": gang.rank, "scope": gang.scope}
        with write_tx(self.engine) as conn:
            updated = conn.execute(
                sa.update(QUEUE).where(QUEUE.c.key == key)
                .values(request=data, reason=reason, updated_at=now)
            ).rowcount
            if not updated:
                conn.execute(sa.insert(QUEUE).values(
                    key=key, request=data, reason=reason, since=now, updated_at=now
                ))

    def clear_queue(self, key: str) -> None:
        """Forget ``key`` in the queue (it was placed or it went away); no error if absent."""
        with write_tx(self.engine) as conn:
            dequeue(conn, key)

    def queue(self) -> list[QueueEntry]:
        """Waiting tasks, longest waiting first (members of multi-node gangs as :class:`GangQueueEntry`)."""
        with read_tx(self.engine) as conn:
            rows = conn.execute(sa.select(QUEUE).order_by(QUEUE.c.since, QUEUE.c.key)).all()
        entries: list[QueueEntry] = []
        for r in rows:
            data = json.loads(r.request) if isinstance(r.request, str) else dict(r.request)
            spec = data.pop(GANG_FIELD, None)
            request = request_from_json(data)
            if isinstance(spec, dict):
                gang = GangMember(str(spec["gang"]), int(spec["size"]), int(spec["rank"]), str(spec["scope"]))
                entries.append(GangQueueEntry(r.key, request, r.reason, r.since, r.updated_at, gang))
            else:
                entries.append(QueueEntry(r.key, request, r.reason, r.since, r.updated_at))
        return entries


def dequeue(conn: sa.Connection, key: str) -> None:
    """:meth:`LedgerQueue.clear_queue` inside the caller's transaction (an allocation's, for one)."""
    conn.execute(sa.delete(QUEUE).where(QUEUE.c.key == key))
