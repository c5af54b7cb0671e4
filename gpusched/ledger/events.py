"""The event log: every change of the ledger and other layers' records, newest first on read.

Allocation, release, health, cordon and host changes are written by :func:`write_event` in the same
transaction as the change they record (the audit replays them in id order); other layers add
their own with :meth:`LedgerEvents.record_event`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from gpusched.ledger.engine import read_tx, write_tx
from gpusched.ledger.schema import EVENTS
from gpusched.records import LedgerEvent

__all__ = ["LedgerEvents", "write_event"]

_INSERT_EVENT = sa.insert(EVENTS)


def write_event(conn: sa.Connection, at: float, kind: str, subject: str, /, **detail: Any) -> None:
    """Append one event inside the caller's transaction (``detail`` may hold any key, even ``at``)."""
    conn.execute(_INSERT_EVENT, {"at": at, "kind": kind, "subject": subject, "detail": detail})


class LedgerEvents:
    """Event methods of :class:`gpusched.ledger.Ledger` (needs ``self.engine``)."""

    engine: sa.Engine

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
        with write_tx(self.engine) as conn:
            write_event(conn, time.time() if now is None else now, kind, subject, **detail)


def _as_dict(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, dict) else {"value": value}
