"""The unreleased allocations and their usage per device, kept between reads by a long-lived reader.

A scheduling cycle reads every unreleased allocation and sums their shares per device. Over a
fleet of thousands of nodes that is most of the cycle's cost, while only a few rows change from
one cycle to the next. :class:`ActiveView` keeps the allocations and the usage of its last read
and brings them up to date from the *change feed*: every transaction that writes allocation rows
stamps them with the next change number (:func:`~gpusched.ledger.allocations.stamp_changes`), so
a read that saw every change up to N reads only the rows with a number above N, in the same
read transaction as the rest of the cycle.

Why no change is ever skipped: the numbers are handed out in the order the writers commit
(SQLite's single write lock; on PostgreSQL the counter row's lock, held until commit), so a read
transaction whose snapshot shows number N shows every write numbered below N as well. The next
read asks for ``change > N`` and sees each later write once it has committed, whatever order
the writers began in. (A plain sequence would not do: on PostgreSQL a writer that took N may
commit after one that took N + 1 was read, and ``change > N + 1`` would then skip it.)

What makes the kept state exact: an allocation's key, request and shares never change once
written and its row is never deleted, so the kept allocation of a row id is replaced by the
row's new values when the row changes, dropped when the row is released, and its shares
subtracted from (released) or added to (new) the usage. The view falls back to a full read on
its first read and whenever the feed cannot be trusted: the highest number went down, or a row
id names another key than the one kept (both mean another database behind the same URL).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

import sqlalchemy as sa

from gpusched.ledger.allocations import last_change, to_allocations
from gpusched.ledger.capacity import usage_of
from gpusched.ledger.schema import ALLOCATIONS
from gpusched.model import DeviceShare, DeviceUsage
from gpusched.records import Allocation

__all__ = ["ActiveView"]

_UNRELEASED = sa.select(ALLOCATIONS).where(ALLOCATIONS.c.released_at.is_(None)).order_by(ALLOCATIONS.c.id)
_CHANGED_SINCE = (
    sa.select(ALLOCATIONS).where(ALLOCATIONS.c.change > sa.bindparam("since")).order_by(ALLOCATIONS.c.id)
)


class ActiveView:
    """The unreleased allocations (quarantined ones included) and their usage, as of the last
    :meth:`read`, brought up to date by reading only the allocation rows changed since.

    One object per reader that reads again and again (the executor's ``Ledger``); it is safe to
    share between threads (reads take turns). ``full_reads`` counts the reads that read every
    unreleased row (the first, and any fallback; see the module docstring).
    """

    def __init__(self) -> None:
        self._turn = threading.Lock()
        self._seen: int | None = None  # the highest change number read; None before the first read
        self._rows: dict[int, Allocation] = {}  # unreleased allocations by row id, in id order
        self._usage: dict[str, DeviceUsage] = {}
        self.usage_version = 0
        """Increases by one with each read that changes :attr:`usage` (so a caller may keep
        what it built from it)."""
        self.usage_changed_on: frozenset[str] | None = None
        """The devices whose usage the read that last changed it changed (``usage_version - 1``
        to ``usage_version``); None when that read was a full one."""
        self.full_reads = 0

    @property
    def usage(self) -> Mapping[str, DeviceUsage]:
        """Per device, the sum of the shares of the allocations of the last read; devices none
        holds have no entry (as :func:`~gpusched.ledger.capacity.usage_of`). Changes with the
        next read: copy what must outlive it."""
        return self._usage

    def read(self, conn: sa.Connection) -> list[Allocation]:
        """Every unreleased allocation, oldest first, as
        :func:`~gpusched.ledger.allocations.active_allocations` reads them
        on ``conn`` (a read transaction: one snapshot); :attr:`usage` is brought up to date too.

        Reads only the rows changed since the last read when it can trust the change feed,
        every unreleased row otherwise. The result is a new list; its allocations may be shared
        with earlier results (they are immutable).
        """
        with self._turn:
            last = last_change(conn)
            if self._seen is None or last < self._seen or not self._follow(conn, last):
                self._read_all(conn, last)
            return list(self._rows.values())

    def _read_all(self, conn: sa.Connection, last: int) -> None:
        rows = conn.execute(_UNRELEASED).all()
        active = to_allocations(conn, rows, self._rows)
        self._rows = dict(zip((r.id for r in rows), active, strict=True))
        self._usage = usage_of(active)
        self._seen = last
        self.usage_version += 1
        self.usage_changed_on = None
        self.full_reads += 1

    def _follow(self, conn: sa.Connection, last: int) -> bool:
        """Apply the rows changed since the last read; False (nothing kept changed) when the
        feed cannot be trusted and a full read must replace the kept state."""
        if last == self._seen:
            return True
        changed = conn.execute(_CHANGED_SINCE, {"since": self._seen}).all()
        kept = self._rows
        if any(r.id in kept and kept[r.id].key != r.key for r in changed):
            return False
        unreleased = [r for r in changed if r.released_at is None]
        built = dict(zip((r.id for r in unreleased), to_allocations(conn, unreleased, kept), strict=True))
        gone: list[DeviceShare] = []
        came: list[DeviceShare] = []
        top = next(reversed(kept), -1)
        in_order = True
        for row in changed:
            before = kept.get(row.id)
            if row.released_at is not None:
                if before is not None:
                    del kept[row.id]
                    gone += before.shares
            else:
                if before is None:
                    came += built[row.id].shares
                    in_order = in_order and row.id > top
                    top = max(top, row.id)
                kept[row.id] = built[row.id]
        if not in_order:  # a writer that began earlier committed later (PostgreSQL)
            self._rows = dict(sorted(kept.items()))
        if gone or came:
            _add(self._usage, gone, -1)
            _add(self._usage, came, 1)
            self.usage_version += 1
            self.usage_changed_on = frozenset(s.uuid for s in gone + came)
        self._seen = last
        return True


def _add(usage: dict[str, DeviceUsage], shares: Iterable[DeviceShare], sign: int) -> None:
    """Add (``sign`` 1) or subtract (-1) ``shares`` to ``usage``; a device left with no share
    (no milli-GPU: every share holds at least 1) loses its entry."""
    for share in shares:
        old = usage.get(share.uuid)
        milli = (old.used_milli if old else 0) + sign * share.milli
        memory = (old.used_memory_bytes if old else 0) + sign * share.memory_bytes
        if milli:
            usage[share.uuid] = DeviceUsage(milli, memory)
        else:
            usage.pop(share.uuid, None)
