"""Airflow pools that mirror GPU capacity per partition (training / burst / dev).

The Airflow Pools page then shows, per partition, how many whole-GPU equivalents the fleet can
give it right now. Two halves:

* :func:`desired_pool_slots` — pure: a :class:`~gpusched.model.FleetSnapshot` in, the slot count
  of every gpusched pool out. Capacity counts devices that are healthy or degraded, not cordoned
  (device or node) and not on a standby node; it is split 70/20/10, or as the quota policy says
  (largest remainder, so the three pools always add up to the usable whole devices).
* :func:`sync_pools` — I/O: writes those counts with ``airflow.models.pool.Pool`` (scheduler /
  executor side only: task code may not use the ORM in Airflow 3). It only writes pools whose
  slots or description changed. :class:`PoolSyncer` rate-limits it for an executor heartbeat.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpusched.errors import ConfigurationError
from gpusched.model import FleetSnapshot, Health
from gpusched.quota.file import load_quota_policy
from gpusched.request import Partition

__all__ = [
    "DEFAULT_SPLIT_PERMILLE",
    "POOL_NAMES",
    "PoolSlots",
    "PoolSyncer",
    "desired_pool_slots",
    "sync_pools",
    "usable_devices",
]

log = logging.getLogger(__name__)

POOL_NAMES: Mapping[Partition, str] = {
    Partition.TRAINING: "gpu_training",
    Partition.BURST: "gpu_burst",
    Partition.DEV: "gpu_dev",
}
"""The Airflow pool that stands for each capacity partition."""

DEFAULT_SPLIT_PERMILLE: Mapping[Partition, int] = {
    Partition.TRAINING: 700,
    Partition.BURST: 200,
    Partition.DEV: 100,
}
"""The 70/20/10 split of usable capacity, in per-mille (sums to 1000)."""

_DESCRIPTION = "gpusched: {pct}% of {usable} usable GPUs ({partition} partition), synced from the fleet"


@dataclass(frozen=True, slots=True)
class PoolSlots:
    """The wanted state of one gpusched pool."""

    name: str
    partition: Partition
    slots: int
    description: str


def usable_devices(snapshot: FleetSnapshot) -> int:
    """Devices that can take work now: healthy or degraded, not cordoned, not on a standby node."""
    count = 0
    for node in snapshot.nodes:
        if node.standby or node.cordoned:
            continue
        count += sum(1 for d in node.devices if not d.cordoned and d.health is not Health.UNHEALTHY)
    return count


def desired_pool_slots(
    snapshot: FleetSnapshot, split: Mapping[Partition, int] | None = None
) -> dict[str, PoolSlots]:
    """The slot count of every gpusched pool for ``snapshot`` (pure).

    ``split`` maps each partition to its per-mille share (default 700/200/100; must sum to 1000).
    Slots are whole-GPU equivalents, apportioned by largest remainder so they add up to
    :func:`usable_devices` exactly; ties go to the larger partition.

    Raises:
        ConfigurationError: the split does not name every partition or does not sum to 1000.
    """

    shares = dict(split if split is not None else DEFAULT_SPLIT_PERMILLE)
    if set(shares) != set(Partition) or sum(shares.values()) != 1000 or min(shares.values()) < 0:
        raise ConfigurationError(
            f"pool split {shares!r} is invalid; give a non-negative per-mille share for each of "
            f"{[str(p) for p in Partition]} summing to 1000 (e.g. 700/200/100)"
        )
    usable = usable_devices(snapshot)
    exact = {p: usable * shares[p] for p in Partition}  # in thousandths of a device
    slots = {p: exact[p] // 1000 for p in Partition}
    leftover = usable - sum(slots.values())
    order = sorted(Partition, key=lambda p: (-(exact[p] % 1000), -shares[p]))
    for p in order[:leftover]:
        slots[p] += 1
    return {
        POOL_NAMES[p]: PoolSlots(
            name=POOL_NAMES[p],
            partition=p,
            slots=slots[p],
            description=_DESCRIPTION.format(pct=shares[p] / 10, usable=usable, partition=p.value),
        )
        for p in Partition
    }


def sync_pools(
    snapshot: FleetSnapshot,
    session: Any = None,
    *,
    split: Mapping[Partition, int] | None = None,
) -> dict[str, int]:
    """Create or update the gpusched pools in Airflow's metadata DB to match ``snapshot``.

    Runs in the scheduler/executor process (Airflow ORM). With ``session`` the caller owns the
    transaction (this only flushes); without, one is opened and committed here. Only pools whose
    slots or description differ are written; ``include_deferred`` stays False. ``split`` None:
    the partition shares of the configured quota policy (:mod:`gpusched.quota.file`;
    70/20/10 without one).

    Returns:
        pool name → new slot count, for the pools that were created or changed (empty when
        everything was already in sync).
    """
    from airflow.models.pool import Pool
    from airflow.utils.session import create_session

    if split is None:
        split = _configured_split()
    wanted = desired_pool_slots(snapshot, split)

    def _apply(sess: Any) -> dict[str, int]:
        changed: dict[str, int] = {}
        for spec in wanted.values():
            current = Pool.get_pool(spec.name, session=sess)
            unchanged = current is not None and (current.slots, current.description) == (
                spec.slots, spec.description)
            if unchanged:
                continue
            Pool.create_or_update_pool(
                name=spec.name,
                slots=spec.slots,
                description=spec.description,
                include_deferred=False if current is None else bool(current.include_deferred),
                session=sess,
            )
            changed[spec.name] = spec.slots
        sess.flush()
        return changed

    if session is not None:
        changed = _apply(session)
    else:
        with create_session() as own:
            changed = _apply(own)
    if changed:
        log.info("gpusched pools updated: %s", changed)
    return changed


def _configured_split() -> dict[Partition, int]:
    """Per-mille shares of the configured quota policy (:mod:`gpusched.quota.file`)."""

    return {p: pct * 10 for p, pct in load_quota_policy().shares_pct.items()}


class PoolSyncer:
    """Rate-limits :func:`sync_pools` for a heartbeat loop.

    ``maybe_sync(snapshot)`` syncs at most once every ``interval_s`` seconds, and also at once
    when the usable device count changed since the last sync (a fault or a cordon). Errors are
    logged and swallowed: pool display must never stop the executor.
    """

    def __init__(self, interval_s: float = 60.0, *, split: Mapping[Partition, int] | None = None) -> None:
        self.interval_s = interval_s
        self.split = split
        self._last_at: float | None = None
        self._last_usable: int | None = None

    def maybe_sync(self, snapshot: FleetSnapshot, session: Any = None, now: float | None = None) -> bool:
        """Sync if due; True when a sync ran (successfully or not)."""
        now = time.monotonic() if now is None else now
        usable = usable_devices(snapshot)
        due = self._last_at is None or now - self._last_at >= self.interval_s or usable != self._last_usable
        if not due:
            return False
        self._last_at = now
        self._last_usable = usable
        try:
            sync_pools(snapshot, session, split=self.split)
        except Exception:  # the executor must keep running; the next sync retries
            log.exception("gpusched pool sync failed; will retry in %.0f s", self.interval_s)
        return True
