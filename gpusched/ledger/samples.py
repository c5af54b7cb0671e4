"""Telemetry samples: per-device readings (utilisation, memory, temperature, power, errors).

A mixin of :class:`gpusched.ledger.Ledger`; the per-host agent writes them, forecasting and alerts read them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from gpusched.ledger.engine import read_tx, write_tx
from gpusched.ledger.schema import SAMPLES
from gpusched.model import DeviceSample

__all__ = ["LedgerSamples"]


class LedgerSamples:
    """Sample methods of :class:`gpusched.ledger.Ledger` (needs ``self.engine``)."""

    engine: sa.Engine

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
