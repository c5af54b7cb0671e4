"""Capacity arithmetic over the ledger: usage of active allocations, the fit re-check, demand.

:func:`check_fit` is the heart of "no double allocation": it runs inside the allocating
transaction, after the device rows are locked (PostgreSQL) or the write lock is held (SQLite),
so the usage it reads cannot change before the new allocation commits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import sqlalchemy as sa

from gpusched.errors import AllocationConflictError, LedgerError
from gpusched.ledger.inventory import effective_health
from gpusched.ledger.schema import ALLOCATIONS, DEVICES, NODES, SHARES
from gpusched.model import MILLI, DeviceShare, DeviceUsage, Health
from gpusched.records import Allocation

__all__ = ["active_usage", "check_fit", "demand_series", "usage_of", "validate_shares"]

# Built once: executing the same statement object reuses its cache key and compiled form, which
# is most of the cost of a small query in SQLAlchemy.
_USAGE_ALL = (
    sa.select(SHARES.c.device_uuid, sa.func.sum(SHARES.c.milli), sa.func.sum(SHARES.c.memory_bytes))
    .join(ALLOCATIONS, ALLOCATIONS.c.id == SHARES.c.allocation_id)
    .where(ALLOCATIONS.c.released_at.is_(None))
    .group_by(SHARES.c.device_uuid)
)
_USAGE_OF = _USAGE_ALL.where(SHARES.c.device_uuid.in_(sa.bindparam("uuids", expanding=True)))
_DEVICES_OF = (
    sa.select(
        DEVICES.c.uuid, DEVICES.c.node, DEVICES.c.memory_bytes, DEVICES.c.cordoned,
        DEVICES.c.reported_health, DEVICES.c.health_override, DEVICES.c.mig_enabled,
    )
    .where(DEVICES.c.uuid.in_(sa.bindparam("uuids", expanding=True)))
    .order_by(DEVICES.c.uuid)
)
_DEVICES_OF_LOCKED = _DEVICES_OF.with_for_update(of=DEVICES)
_NODES_OF = sa.select(NODES.c.name, NODES.c.cordoned, NODES.c.standby).where(
    NODES.c.name.in_(sa.bindparam("names", expanding=True))
)


def validate_shares(key: str, shares: Sequence[DeviceShare]) -> tuple[DeviceShare, ...]:
    """The shares sorted by uuid, after checking they are well-formed (LedgerError if not)."""
    if not shares:
        raise LedgerError(f"allocation {key!r} has no device shares; pass at least one DeviceShare")
    uuids = [s.uuid for s in shares]
    if len(set(uuids)) != len(uuids):
        raise LedgerError(
            f"allocation {key!r} names a device twice ({sorted(uuids)}); merge the shares per device"
        )
    for share in shares:
        if not 1 <= share.milli <= MILLI or share.memory_bytes < 0:
            raise LedgerError(
                f"allocation {key!r}: share on {share.uuid} has milli={share.milli}, "
                f"memory_bytes={share.memory_bytes}; milli must be 1–{MILLI} and memory ≥ 0"
            )
    return tuple(sorted(shares, key=lambda s: s.uuid))


def active_usage(conn: sa.Connection, uuids: Iterable[str] | None = None) -> dict[str, DeviceUsage]:
    """Milli-GPU and memory held by active allocations, per device (all devices when None)."""
    rows = conn.execute(_USAGE_ALL) if uuids is None else conn.execute(_USAGE_OF, {"uuids": list(uuids)})
    return {row[0]: DeviceUsage(int(row[1]), int(row[2])) for row in rows}


def usage_of(active: Iterable[Allocation]) -> dict[str, DeviceUsage]:
    """Per device, the sum of the shares of ``active`` (allocations read as active in the same
    transaction): what :func:`active_usage` returns for all devices, without reading it again."""
    milli: dict[str, int] = {}
    memory: dict[str, int] = {}
    for allocation in active:
        for share in allocation.shares:
            milli[share.uuid] = milli.get(share.uuid, 0) + share.milli
            memory[share.uuid] = memory.get(share.uuid, 0) + share.memory_bytes
    return {uuid: DeviceUsage(milli[uuid], memory[uuid]) for uuid in milli}


def check_fit(conn: sa.Connection, key: str, shares: Sequence[DeviceShare]) -> None:
    """Raise AllocationConflictError unless every share still fits its device right now.

    Locks the device rows first on PostgreSQL (``FOR UPDATE``, in uuid order so that two
    allocators never deadlock); on SQLite the caller already holds the write lock.
    """
    uuids = sorted(s.uuid for s in shares)
    query = _DEVICES_OF_LOCKED if conn.dialect.name == "postgresql" else _DEVICES_OF
    devices = {row.uuid: row for row in conn.execute(query, {"uuids": uuids})}
    node_names = sorted({row.node for row in devices.values()})
    nodes = {row.name: row for row in conn.execute(_NODES_OF, {"names": node_names})}
    usage = active_usage(conn, uuids)
    problems: list[str] = []
    bad: list[str] = []
    for share in shares:
        row = devices.get(share.uuid)
        if row is None:
            problems.append(f"{share.uuid} is not in the inventory")
        elif row.cordoned or nodes[row.node].cordoned:
            problems.append(f"{share.uuid} (node {row.node}) is cordoned")
        elif nodes[row.node].standby:
            problems.append(f"{share.uuid} is on standby node {row.node}")
        elif effective_health(row.reported_health, row.health_override) is Health.UNHEALTHY:
            problems.append(f"{share.uuid} is unhealthy")
        elif row.mig_enabled:  # its MIG instances hold its capacity: never hand the GPU out too
            problems.append(f"{share.uuid} is in MIG mode; allocate one of its MIG instances")
        else:
            used = usage.get(share.uuid, DeviceUsage())
            too_much_milli = used.used_milli + share.milli > MILLI
            too_much_memory = used.used_memory_bytes + share.memory_bytes > row.memory_bytes
            if too_much_milli or too_much_memory:
                problems.append(
                    f"{share.uuid} has {MILLI - used.used_milli} milli-GPU and "
                    f"{row.memory_bytes - used.used_memory_bytes} bytes free, "
                    f"{share.milli} milli-GPU and {share.memory_bytes} bytes asked"
                )
            else:
                continue
        bad.append(share.uuid)
    if problems:
        raise AllocationConflictError(
            f"cannot allocate {key!r}: " + "; ".join(problems) + ". Nothing was written; re-plan and retry.",
            devices=bad,
        )


def demand_series(
    intervals: Iterable[tuple[float, float, int]], start: float, end: float, step_s: int
) -> list[tuple[float, int]]:
    """Average milli-GPU in use per step of ``[start, end)`` from ``(begin, finish, milli)`` intervals.

    Each step's value is the time-weighted mean over the step (an allocation holding 1000 for half
    a step adds 500), rounded to an integer. Steps start at ``start``; the last may be partial and
    is averaged over its own length.
    """
    if step_s <= 0:
        raise LedgerError(f"demand_history step_s={step_s} must be a positive number of seconds")
    if end <= start:
        return []
    count = int(-(-(end - start) // step_s))
    area = [0.0] * count
    for begin, finish, milli in intervals:
        lo, hi = max(begin, start), min(finish, end)
        if hi <= lo:
            continue
        first, last = int((lo - start) // step_s), min(int((hi - start) // step_s), count - 1)
        for i in range(first, last + 1):
            s0 = start + i * step_s
            overlap = min(hi, s0 + step_s) - max(lo, s0)
            if overlap > 0:
                area[i] += overlap * milli
    result = []
    for i in range(count):
        s0 = start + i * step_s
        length = min(step_s, end - s0)
        result.append((s0, round(area[i] / length)))
    return result
