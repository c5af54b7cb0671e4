"""Allocations: hand out device shares, renew leases, record holder processes, release, history.

A mixin of :class:`gpusched.ledger.Ledger`. Every method is one database transaction. Writes begin
with ``BEGIN IMMEDIATE`` on SQLite, so concurrent writers from any number of processes are
serialised by SQLite's write lock; on PostgreSQL :meth:`LedgerAllocations.allocate` locks the device
rows it touches with ``SELECT … FOR UPDATE``. Either way the capacity re-check and the insert of
the allocation see the same state, which is why two schedulers can never hand out the same
milli-GPU or byte twice (see ``docs/ledger.md``).

Every write transaction of allocation rows ends by stamping them with the next change number
(:func:`stamp_changes`), which a long-lived reader follows (:mod:`gpusched.ledger.active_view`).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import sqlalchemy as sa

from gpusched.errors import AllocationConflictError, UnknownAllocationError
from gpusched.ledger import capacity
from gpusched.ledger.capacity import demand_series
from gpusched.ledger.engine import read_tx, write_tx
from gpusched.ledger.events import read_events, write_event
from gpusched.ledger.hosts import LAUNCH_EVENT
from gpusched.ledger.queue import dequeue
from gpusched.ledger.schema import ALLOCATION_CHANGE, ALLOCATIONS, SHARES
from gpusched.model import DeviceShare
from gpusched.records import (
    Allocation,
    AllocationStatus,
    HolderProcess,
    LedgerEvent,
    processes_from_json,
    request_from_json,
)
from gpusched.request import GPURequest

__all__ = ["FENCE_HOLDER_PREFIX", "QUARANTINE_EVENT", "UNQUARANTINE_EVENT", "HostStart", "LedgerAllocations",
           "active_allocations", "fence_holder", "last_change", "stamp_changes", "to_allocations"]


@dataclass(frozen=True)
class HostStart:
    """What :meth:`LedgerAllocations.start_on_host` found for a starting try."""

    allocation: Allocation | None
    """The try's active allocation; None when it has none (released, quarantined, never made)."""
    launch: LedgerEvent | None
    """Its newest ``launch`` event (environment and host), None before the executor recorded it."""
    recorded: bool
    """Whether the starting process was attached as a holder (the launch names this host)."""


FENCE_HOLDER_PREFIX = "fence@"
"""Holder of a quarantined allocation: ``fence@<GPU host>``, the host whose agent must confirm."""

QUARANTINE_EVENT = "quarantine"
"""Event of an allocation put in quarantine (written in the same transaction)."""

UNQUARANTINE_EVENT = "unquarantine"
"""Event of a quarantined allocation ended: its host's agent (or an operator) confirmed."""


def fence_holder(host: str) -> str:
    """The holder a quarantined allocation of GPU host ``host`` is given."""
    return FENCE_HOLDER_PREFIX + host


def _now(now: float | None) -> float:
    return time.time() if now is None else float(now)


# Statements of the hot paths, built once (see capacity.py for why).
_INSERT_ALLOCATION = sa.insert(ALLOCATIONS).returning(ALLOCATIONS.c.id)
_INSERT_SHARES = sa.insert(SHARES)
_ACTIVE_BY_KEY = sa.select(ALLOCATIONS).where(
    ALLOCATIONS.c.key == sa.bindparam("key"), ALLOCATIONS.c.released_at.is_(None),
    ALLOCATIONS.c.status == AllocationStatus.ACTIVE,
)
_ACTIVE_BY_KEY_LOCKED = _ACTIVE_BY_KEY.with_for_update(of=ALLOCATIONS)
_END_ALLOCATION = (
    sa.update(ALLOCATIONS)
    .where(ALLOCATIONS.c.id == sa.bindparam("row_id"))
    .values(
        released_at=sa.bindparam("at"), release_reason=sa.bindparam("reason"),
        status=sa.bindparam("new_status"),
    )
)
_SHARES_OF = (
    sa.select(SHARES)
    .where(SHARES.c.allocation_id.in_(sa.bindparam("ids", expanding=True)))
    .order_by(SHARES.c.device_uuid)
)
_STAMPED_ROWS = ALLOCATIONS.c.id.in_(sa.bindparam("ids", expanding=True))
_EARLIER = ALLOCATIONS.alias("earlier")
_STAMP_SQLITE = sa.update(ALLOCATIONS).where(_STAMPED_ROWS).values(
    change=sa.select(sa.func.coalesce(sa.func.max(_EARLIER.c.change), 0) + 1).scalar_subquery()
)
_NEXT_CHANGE = (
    sa.update(ALLOCATION_CHANGE).where(ALLOCATION_CHANGE.c.id == 1)
    .values(change=ALLOCATION_CHANGE.c.change + 1).returning(ALLOCATION_CHANGE.c.change)
    .cte("next_change")
)
_STAMP_POSTGRESQL = sa.update(ALLOCATIONS).where(_STAMPED_ROWS).values(
    change=sa.select(_NEXT_CHANGE.c.change).scalar_subquery()
).add_cte(_NEXT_CHANGE)
_LAST_CHANGE = sa.select(sa.func.max(ALLOCATIONS.c.change))


def stamp_changes(conn: sa.Connection, ids: Collection[int]) -> None:
    """Give the allocation rows ``ids``, just written in ``conn``'s write transaction, the next
    change number; call it last, after every other write of allocation rows in the transaction.

    Numbers are handed out in the order the writers commit: on SQLite the writer holds the one
    write lock (``BEGIN IMMEDIATE``) until it commits and takes the highest number plus one; on
    PostgreSQL it increments the counter row, whose lock it then holds until it commits, so a
    second writer waits and reads the first one's number. Hence a reader whose snapshot shows
    number N also shows every write numbered below N. Being last, the counter is the last lock
    the transaction takes: a writer holding it never waits for another writer's lock (which
    might wait for the counter), so the writers cannot deadlock on it.
    """
    if ids:
        statement = _STAMP_POSTGRESQL if conn.dialect.name == "postgresql" else _STAMP_SQLITE
        conn.execute(statement, {"ids": sorted(ids)})


def last_change(conn: sa.Connection) -> int:
    """The highest change number of the allocation rows ``conn`` sees (0 when none was stamped)."""
    return int(conn.execute(_LAST_CHANGE).scalar() or 0)


def _locked(conn: sa.Connection, query: sa.Select[Any]) -> sa.Select[Any]:
    # PostgreSQL: lock the allocation rows a release is about to end. Under READ COMMITTED a
    # second locker re-checks its WHERE clause once the first commits, so the same allocation is
    # never released twice, and a lease renewed meanwhile is not expired.
    if conn.dialect.name == "postgresql":
        return query.with_for_update(of=ALLOCATIONS)
    return query


def _share_key(shares: Sequence[DeviceShare]) -> list[tuple[str, int, int]]:
    return sorted((s.uuid, s.milli, s.memory_bytes) for s in shares)

def active_allocations(conn: sa.Connection, holder: str | None = None) -> list[Allocation]:
    """Every active allocation (optionally only ``holder``'s), oldest first, read on ``conn``."""
    query = sa.select(ALLOCATIONS).where(ALLOCATIONS.c.released_at.is_(None))
    if holder is not None:
        query = query.where(ALLOCATIONS.c.holder == holder)
    return to_allocations(conn, conn.execute(query.order_by(ALLOCATIONS.c.id)).all())


def to_allocations(
    conn: sa.Connection, rows: Sequence[Any], known: Mapping[int, Allocation] | None = None
) -> list[Allocation]:
    """The allocations of allocation ``rows`` (read on ``conn``), in their order.

    ``known`` (row id -> an allocation built from that row earlier): its request and shares are
    reused instead of read again when the key is the same (neither ever changes once written,
    and allocation rows are never deleted, so an id with the same key names the same ones).
    """
    cached = known if known is not None else {}
    fresh = [r for r in rows if r.id not in cached or cached[r.id].key != r.key]
    shares: dict[int, list[DeviceShare]] = {r.id: [] for r in fresh}
    ids = list(shares)
    for chunk in range(0, len(ids), 500):
        for s in conn.execute(_SHARES_OF, {"ids": ids[chunk:chunk + 500]}):
            shares[s.allocation_id].append(
                DeviceShare(s.device_uuid, s.node, s.idx, s.milli, s.memory_bytes)
            )
    parts = {
        r.id: (request_from_json(r.request), tuple(shares[r.id])) if r.id in shares
        else (cached[r.id].request, cached[r.id].shares)
        for r in rows
    }
    return [
        Allocation(
            r.key, parts[r.id][0], parts[r.id][1], r.holder, r.created_at,
            r.lease_expires_at, r.released_at, r.release_reason, r.status,
            processes_from_json(r.processes), r.queued_at,
        )
        for r in rows
    ]


class LedgerAllocations:
    """Allocation methods of :class:`gpusched.ledger.Ledger` (needs ``self.engine``)."""

    engine: sa.Engine

    def allocate(
        self,
        key: str,
        request: GPURequest,
        shares: Sequence[DeviceShare],
        *,
        holder: str,
        lease_s: int = 600,
        now: float | None = None,
        process: HolderProcess | None = None,
        queued_at: float | None = None,
    ) -> Allocation:
        """Hand ``shares`` to task ``key`` in one transaction that re-checks capacity.

        ``process`` (optional) is recorded as the first holder process (see :meth:`attach_process`);
        ``queued_at`` (optional): when the try was first queued. ``key`` leaves the waiting queue
        (:meth:`clear_queue`) in the same transaction.
        Idempotent: if ``key`` already holds exactly these shares, that allocation is returned.
        Raises AllocationConflictError (nothing written) when ``key`` holds other shares, when
        another caller allocated or released ``key`` concurrently, or when a device is gone,
        cordoned, unhealthy, on a standby node, or lacks the free milli-GPU or memory; LedgerError
        for malformed shares.
        """
        ordered = capacity.validate_shares(key, shares)
        at = _now(now)
        processes = [process.to_dict()] if process is not None else None
        try:
            with write_tx(self.engine) as conn:
                dequeue(conn, key)
                existing = self._active_row(conn, key)
                if existing is not None:
                    return self._same_or_conflict(conn, existing, key, ordered)
                capacity.check_fit(conn, key, ordered)
                allocation_id = conn.execute(_INSERT_ALLOCATION, {
                    "key": key, "request": request.to_dict(), "holder": holder, "created_at": at,
                    "lease_expires_at": at + lease_s, "released_at": None, "release_reason": None,
                    "status": AllocationStatus.ACTIVE, "processes": processes, "queued_at": queued_at,
                }).scalar_one()
                conn.execute(_INSERT_SHARES, [
                    {"allocation_id": allocation_id, "device_uuid": s.uuid, "node": s.node, "idx": s.index,
                     "milli": s.milli, "memory_bytes": s.memory_bytes}
                    for s in ordered
                ])
                write_event(conn, at, "allocate", key, holder=holder, devices=[s.uuid for s in ordered],
                       milli=sum(s.milli for s in ordered))
                stamp_changes(conn, [allocation_id])
        except sa.exc.IntegrityError:
            # PostgreSQL only: another transaction committed the same key meanwhile (the partial
            # unique index refused ours). Decide as if we had come second.
            with read_tx(self.engine) as conn:
                existing = self._active_row(conn, key)
                if existing is None:  # ... and released it again already
                    raise AllocationConflictError(
                        f"task {key!r} was allocated and released by another caller at the same "
                        "time; re-plan and retry", devices=[s.uuid for s in ordered],
                    ) from None
                return self._same_or_conflict(conn, existing, key, ordered)
        return Allocation(
            key, request, ordered, holder, at, at + lease_s,
            processes=(process,) if process is not None else (), queued_at=queued_at,
        )

    def _same_or_conflict(
        self, conn: sa.Connection, row: Any, key: str, shares: Sequence[DeviceShare]
    ) -> Allocation:
        allocation = self._to_allocation(conn, row)
        if _share_key(allocation.shares) != _share_key(shares):
            raise AllocationConflictError(
                f"task {key!r} already holds {list(allocation.devices)}, not {[s.uuid for s in shares]}; "
                "release it first, or re-plan and retry",
                devices=[s.uuid for s in shares],
            )
        return allocation

    def release(
        self, key: str, *, reason: str, now: float | None = None, succeeded: bool = False,
    ) -> Allocation | None:
        """Release the active allocation of ``key`` (None if it has none: releasing is idempotent);
        ``succeeded``: its task succeeded (status ``succeeded``, else ``released``)."""
        at = _now(now)
        status = AllocationStatus.SUCCEEDED if succeeded else AllocationStatus.RELEASED
        with write_tx(self.engine) as conn:
            row = self._active_row(conn, key, lock=True)
            if row is None:
                return None
            released = self._release_row(conn, row, reason, status, at)
            stamp_changes(conn, [row.id])
            return released

    def renew(self, key: str, lease_s: int = 600, *, now: float | None = None) -> None:
        """Extend the lease of ``key`` to ``now + lease_s`` (UnknownAllocationError if not active)."""
        at = _now(now)
        with write_tx(self.engine) as conn:
            renewed = conn.execute(
                sa.update(ALLOCATIONS)
                .where(ALLOCATIONS.c.key == key, ALLOCATIONS.c.released_at.is_(None),
                       ALLOCATIONS.c.status == AllocationStatus.ACTIVE)
                .values(lease_expires_at=at + lease_s)
                .returning(ALLOCATIONS.c.id)
            ).scalars().all()
            if not renewed:
                raise UnknownAllocationError(
                    f"task {key!r} holds no active allocation to renew (released or expired); "
                    "stop the task or allocate again"
                )
            stamp_changes(conn, renewed)

    def attach_process(self, key: str, process: HolderProcess) -> bool:
        """Record ``process`` as holding the active allocation of ``key``; False if none is active.

        A record for the same role, host and pid is replaced, not repeated.
        """
        with write_tx(self.engine) as conn:
            row = self._active_row(conn, key, lock=True)
            if row is None:
                return False
            self._attach(conn, row, process)
            return True

    def start_on_host(self, key: str, host: str, process: HolderProcess) -> HostStart:
        """What try ``key`` starting on GPU host ``host`` reads and records, in one transaction:
        its active allocation (None: released, quarantined or never made), its newest ``launch``
        event, and — only when that launch sent it to ``host`` — ``process`` attached as a holder
        (:meth:`attach_process`). A try the launch does not place on ``host`` (or with no launch
        yet) records nothing: the caller checks it, then attaches."""
        with write_tx(self.engine) as conn:
            row = self._active_row(conn, key, lock=True)
            if row is None:
                return HostStart(None, None, False)
            launched = read_events(conn, 1, kinds=[LAUNCH_EVENT], subject=key)
            launch = launched[0] if launched else None
            here = launch is not None and launch.detail.get("host") == host
            if here:
                self._attach(conn, row, process)
            return HostStart(self._to_allocation(conn, row), launch, here)

    def _attach(self, conn: sa.Connection, row: Any, process: HolderProcess) -> None:
        kept = [
            p.to_dict() for p in processes_from_json(row.processes)
            if (p.role, p.host, p.pid) != (process.role, process.host, process.pid)
        ]
        conn.execute(
            sa.update(ALLOCATIONS).where(ALLOCATIONS.c.id == row.id)
            .values(processes=[*kept, process.to_dict()])
        )
        stamp_changes(conn, [row.id])

    def get(self, key: str) -> Allocation | None:
        """The active allocation of ``key``, else its most recent one (a quarantined one
        included: check ``status``), else None."""
        with read_tx(self.engine) as conn:
            row = conn.execute(
                sa.select(ALLOCATIONS).where(ALLOCATIONS.c.key == key)
                .order_by((ALLOCATIONS.c.status == AllocationStatus.ACTIVE).desc(),
                          ALLOCATIONS.c.released_at.is_(None).desc(), ALLOCATIONS.c.id.desc()).limit(1)
            ).first()
            return None if row is None else self._to_allocation(conn, row)

    def active(self, holder: str | None = None) -> list[Allocation]:
        """Every unreleased allocation (optionally only ``holder``'s), oldest first: quarantined
        ones included (their devices are held; ``status`` tells them apart)."""
        with read_tx(self.engine) as conn:
            return active_allocations(conn, holder)

    def history(self, since: float, until: float | None = None) -> list[Allocation]:
        """Allocations alive at some point in ``[since, until)``, released ones included."""
        query = sa.select(ALLOCATIONS).where(
            sa.or_(ALLOCATIONS.c.released_at.is_(None), ALLOCATIONS.c.released_at > since)
        )
        if until is not None:
            query = query.where(ALLOCATIONS.c.created_at < until)
        with read_tx(self.engine) as conn:
            return self._to_allocations(conn, conn.execute(query.order_by(ALLOCATIONS.c.id)).all())

    def history_of(self, patterns: Collection[tuple[str, str]]) -> list[Allocation]:
        """Every allocation (released ones included) whose key starts with ``prefix`` and ends
        with ``suffix`` for one ``(prefix, suffix)`` of ``patterns``, oldest first (e.g. every try
        of one task instance)."""
        wanted = sorted(set(patterns))
        rows: list[Any] = []
        with read_tx(self.engine) as conn:
            for start in range(0, len(wanted), 100):
                match = sa.or_(*(sa.and_(ALLOCATIONS.c.key.startswith(p, autoescape=True),
                                         ALLOCATIONS.c.key.endswith(s, autoescape=True))
                                 for p, s in wanted[start:start + 100]))
                rows += conn.execute(sa.select(ALLOCATIONS).where(match)).all()
            rows.sort(key=lambda r: r.id)
            return self._to_allocations(conn, rows)

    def expire_leases(self, now: float | None = None) -> list[Allocation]:
        """Release every active allocation whose lease ended before ``now``; return them."""
        at = _now(now)
        with write_tx(self.engine) as conn:
            due = sa.select(ALLOCATIONS).where(  # a quarantine ends by confirmation, never by lease
                ALLOCATIONS.c.released_at.is_(None), ALLOCATIONS.c.lease_expires_at < at,
                ALLOCATIONS.c.status == AllocationStatus.ACTIVE,
            )
            rows = conn.execute(_locked(conn, due.order_by(ALLOCATIONS.c.id))).all()
            expired = [self._release_row(conn, r, "lease expired", AllocationStatus.EXPIRED, at)
                       for r in rows]
            stamp_changes(conn, [r.id for r in rows])
            return expired

    def reconcile(
        self, live_keys: Collection[str], *, holder: str, now: float | None = None
    ) -> list[Allocation]:
        """Release ``holder``'s active allocations whose key is not in ``live_keys`` (after a restart)."""
        at = _now(now)
        live = set(live_keys)
        with write_tx(self.engine) as conn:
            held = sa.select(ALLOCATIONS).where(
                ALLOCATIONS.c.released_at.is_(None), ALLOCATIONS.c.holder == holder
            )
            ended = [r for r in conn.execute(_locked(conn, held.order_by(ALLOCATIONS.c.id))).all()
                     if r.key not in live]
            released = [
                self._release_row(conn, r, "reconciled: task no longer live", AllocationStatus.RELEASED, at)
                for r in ended
            ]
            stamp_changes(conn, [r.id for r in ended])
            return released

    def quarantine(self, key: str, *, host: str, reason: str, now: float | None = None) -> Allocation | None:
        """Put ``key``'s active allocation in quarantine: its devices stay held, under holder
        :func:`fence_holder` ``(host)``, until :meth:`end_quarantine`; ``reason`` says why its
        holder's fate is unknown. None when ``key`` holds no active allocation.

        The same try may be allocated again meanwhile (on other devices): a quarantined row is
        not its active allocation any more.
        """
        at = _now(now)
        with write_tx(self.engine) as conn:
            row = self._active_row(conn, key, lock=True)
            if row is None:
                return None
            conn.execute(sa.update(ALLOCATIONS).where(ALLOCATIONS.c.id == row.id).values(
                status=AllocationStatus.QUARANTINED, holder=fence_holder(host), release_reason=reason))
            allocation = self._to_allocation(conn, row)
            write_event(conn, at, QUARANTINE_EVENT, key, holder=row.holder, host=host, reason=reason,
                        devices=list(allocation.devices))
            stamp_changes(conn, [row.id])
            return replace(allocation, holder=fence_holder(host), status=AllocationStatus.QUARANTINED,
                           release_reason=reason)

    def quarantined(self, host: str | None = None) -> list[Allocation]:
        """Quarantined allocations (of GPU host ``host``, or every host's), oldest first."""
        query = sa.select(ALLOCATIONS).where(ALLOCATIONS.c.released_at.is_(None),
                                             ALLOCATIONS.c.status == AllocationStatus.QUARANTINED)
        if host is not None:
            query = query.where(ALLOCATIONS.c.holder == fence_holder(host))
        with read_tx(self.engine) as conn:
            return self._to_allocations(conn, conn.execute(query.order_by(ALLOCATIONS.c.id)).all())

    def end_quarantine(self, key: str, *, host: str, reason: str, now: float | None = None) -> int:
        """Release ``key``'s quarantined allocations of GPU host ``host`` (the try's processes are
        confirmed gone, by ``reason``); returns how many ended."""
        at = _now(now)
        with write_tx(self.engine) as conn:
            rows = conn.execute(_locked(conn, sa.select(ALLOCATIONS).where(
                ALLOCATIONS.c.key == key, ALLOCATIONS.c.released_at.is_(None),
                ALLOCATIONS.c.status == AllocationStatus.QUARANTINED,
                ALLOCATIONS.c.holder == fence_holder(host)).order_by(ALLOCATIONS.c.id))).all()
            for row in rows:
                conn.execute(_END_ALLOCATION, {"row_id": row.id, "at": at, "reason": reason,
                                               "new_status": AllocationStatus.RELEASED})
                write_event(conn, at, UNQUARANTINE_EVENT, key, holder=row.holder, reason=reason,
                            devices=list(self._to_allocation(conn, row).devices))
            stamp_changes(conn, [r.id for r in rows])
            return len(rows)

    def _active_row(self, conn: sa.Connection, key: str, *, lock: bool = False) -> Any:
        locked = lock and conn.dialect.name == "postgresql"
        return conn.execute(_ACTIVE_BY_KEY_LOCKED if locked else _ACTIVE_BY_KEY, {"key": key}).first()

    def _release_row(self, conn: sa.Connection, row: Any, reason: str, status: str, at: float) -> Allocation:
        conn.execute(_END_ALLOCATION, {"row_id": row.id, "at": at, "reason": reason, "new_status": status})
        allocation = self._to_allocation(conn, row)
        write_event(conn, at, "expire" if status == AllocationStatus.EXPIRED else "release", row.key,
               holder=row.holder, reason=reason, devices=list(allocation.devices))
        return replace(allocation, released_at=at, release_reason=reason, status=status)

    def _to_allocation(self, conn: sa.Connection, row: Any) -> Allocation:
        return to_allocations(conn, [row])[0]

    def _to_allocations(self, conn: sa.Connection, rows: Sequence[Any]) -> list[Allocation]:
        return to_allocations(conn, rows)

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
