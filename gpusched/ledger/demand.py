"""Waiting demand: the GPUs that waited for devices, per step (a mixin of the Ledger).

:meth:`LedgerAllocations.demand_history <gpusched.ledger.allocations.LedgerAllocations.demand_history>`
counts what was allocated; :meth:`LedgerDemand.waiting_history` counts what waited — every try from
when it was first queued until it was placed (its allocation's ``queued_at`` to ``created_at``) and
every task still in the queue from its first sighting until ``end``. The capacity forecast adds the
two (:func:`gpusched.capacity.demand.demand_from_history`), so demand the fleet could not serve
is forecast too.
"""

from __future__ import annotations

import json

import sqlalchemy as sa

from gpusched.ledger.capacity import demand_series
from gpusched.ledger.engine import read_tx
from gpusched.ledger.queue import GANG_FIELD
from gpusched.ledger.schema import ALLOCATIONS, QUEUE, SHARES
from gpusched.records import request_from_json

__all__ = ["LedgerDemand"]

_PLACED_AFTER_WAIT = (
    sa.select(ALLOCATIONS.c.queued_at, ALLOCATIONS.c.created_at, sa.func.sum(SHARES.c.milli))
    .join(SHARES, SHARES.c.allocation_id == ALLOCATIONS.c.id)
    .where(
        ALLOCATIONS.c.queued_at.is_not(None),
        ALLOCATIONS.c.queued_at < ALLOCATIONS.c.created_at,
        ALLOCATIONS.c.queued_at < sa.bindparam("end"),
        ALLOCATIONS.c.created_at > sa.bindparam("start"),
    )
    .group_by(ALLOCATIONS.c.id, ALLOCATIONS.c.queued_at, ALLOCATIONS.c.created_at)
)
_QUEUED = sa.select(QUEUE.c.since, QUEUE.c.request).where(QUEUE.c.since < sa.bindparam("end"))


class LedgerDemand:
    """Demand methods of :class:`gpusched.ledger.Ledger` (needs ``self.engine``)."""

    engine: sa.Engine

    def waiting_history(self, start: float, end: float, step_s: int = 3600) -> list[tuple[float, int]]:
        """Average milli-GPU waiting for devices in each step of ``[start, end)``.

        A placed try counts from its ``queued_at`` until its allocation was made, with the
        milli-GPU it was given; a task still queued from its ``since`` until ``end``, with its
        request's milli-GPU (each member of a multi-node gang is one row). Same steps and
        time-weighting as ``demand_history``, so the two add up to the demand.
        """
        with read_tx(self.engine) as conn:
            placed = conn.execute(_PLACED_AFTER_WAIT, {"start": start, "end": end}).all()
            queued = conn.execute(_QUEUED, {"end": end}).all()
        intervals = [(float(r[0]), float(r[1]), int(r[2])) for r in placed]
        for since, request in queued:
            data = json.loads(request) if isinstance(request, str) else dict(request)
            data.pop(GANG_FIELD, None)
            intervals.append((float(since), end, request_from_json(data).total_milli))
        return demand_series(intervals, start, end, step_s)
