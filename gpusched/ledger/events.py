"""The event log: every change of the ledger and other layers' records, newest first on read.

Allocation, release, health, cordon and host changes are written by :func:`write_event` in the same
transaction as the change they record (the audit replays them in id order); other layers add
their own with :meth:`LedgerEvents.record_event`; :meth:`LedgerEvents.claim_event` records one
only when no other writer recorded the same decision first (the standby scale-out's one call per
decision, whichever agent decides).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from gpusched.ledger.engine import read_tx, write_tx
from gpusched.ledger.schema import EVENTS
from gpusched.records import LedgerEvent

__all__ = ["LedgerEvents", "read_events", "write_event"]

_INSERT_EVENT = sa.insert(EVENTS)
_PG_CLAIM_LOCK = 0x67707363616C65  # advisory lock key of claim_event ("gpscale")


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
        with read_tx(self.engine) as conn:
            return read_events(conn, limit, kinds=kinds, since=since, subject=subject)

    def record_event(self, kind: str, subject: str, *, now: float | None = None, **detail: Any) -> None:
        """Add an event of another layer (for example a fault classification) to the log."""
        with write_tx(self.engine) as conn:
            write_event(conn, time.time() if now is None else now, kind, subject, **detail)


    def claim_event(
        self, kind: str, subject: str, *, among: Sequence[str], since: float | None = None,
        now: float | None = None, **detail: Any,
    ) -> bool:
        """Record event ``kind`` on ``subject`` unless the newest event of ``among`` on ``subject``
        (at or after ``since``, when given) is of ``kind`` already: True when recorded, False when
        another writer claimed the same decision first.

        Claims take turns (a transaction-scoped advisory lock on PostgreSQL, ``BEGIN IMMEDIATE``
        on SQLite), so of several agents deciding the same thing at once exactly one gets it.
        """
        at = time.time() if now is None else now
        with write_tx(self.engine) as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_CLAIM_LOCK})
            query = sa.select(EVENTS.c.kind).where(EVENTS.c.subject == subject,
                                                   EVENTS.c.kind.in_([kind, *among]))
            if since is not None:
                query = query.where(EVENTS.c.at >= since)
            last = conn.execute(query.order_by(EVENTS.c.id.desc()).limit(1)).scalar()
            if last == kind:
                return False
            write_event(conn, at, kind, subject, **detail)
        return True


def read_events(
    conn: sa.Connection, limit: int, *, kinds: Sequence[str] = (), since: float | None = None,
    subject: str | None = None,
) -> list[LedgerEvent]:
    """:meth:`LedgerEvents.events` inside the caller's transaction."""
    query = sa.select(EVENTS)
    if kinds:
        query = query.where(EVENTS.c.kind.in_(list(kinds)))
    if subject is not None:
        query = query.where(EVENTS.c.subject == subject)
    if since is not None:
        query = query.where(EVENTS.c.at >= since)
    rows = conn.execute(query.order_by(EVENTS.c.id.desc()).limit(limit)).all()
    return [LedgerEvent(r.id, r.at, r.kind, r.subject, _as_dict(r.detail)) for r in rows]


def _as_dict(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, dict) else {"value": value}
