"""Alert rules over a window of device samples: what to do when a device misbehaves (pure).

:func:`evaluate` looks at the recent :class:`~gpusched.model.DeviceSample` readings of every
device, at the fleet snapshot (vendor, health, cordons) and at the active allocations, and returns
:class:`Action` records — plain data. Applying them (ledger writes, stopping a task) is the job of
:mod:`gpusched.faults.remediation`.

Rules:

``memory_growth``
    Device memory in use grows faster than ``AlertConfig.memory_growth_bytes_per_min`` (100 MB/min
    by default) by a least-squares linear fit over the samples taken since the holder's
    allocation started, *and* the growth is sustained (at least ``sustained_fraction`` of the
    sample-to-sample steps grow), so one large allocation at start-up (loading a model) never
    fires. One holder → ``stop_task`` naming its allocation key; several holders (fractional
    sharing) → ``notify`` (device memory cannot be attributed to one of them).
``over_temperature``
    The last ``temperature_samples`` readings are all at or above the vendor's limit →
    device ``degraded`` + cordoned.
``ecc_uncorrected``
    The volatile uncorrectable (double-bit) ECC count is above zero → ``unhealthy`` + cordoned
    (it only clears with a GPU reset, which also resets the counter).
``orphan_memory``
    No allocation holds the device, yet more than ``orphan_memory_fraction`` (half) of its memory
    has been in use for ``orphan_memory_span_s`` (120 s): a leaked or foreign process holds it,
    and any task placed there would run out of memory → device ``degraded`` + cordoned.
``xid_hardware`` / ``xid_application``
    A hardware-class Xid (see :func:`gpusched.faults.xid.classify_xid`) → ``unhealthy`` + cordoned; an
    application-class Xid → ``notify`` naming the holders (the task's own bug, the device is fine).

Actions already in effect (device already that unhealthy and cordoned) are not repeated, so the
agent can evaluate every cycle and stay idempotent.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import pairwise
from types import MappingProxyType
from typing import Protocol

from gpusched.catalog import Vendor
from gpusched.faults.xid import XidClass, classify_xid
from gpusched.model import DeviceSample, DeviceShare, FleetSnapshot, Health

__all__ = [
    "Action",
    "ActionKind",
    "AlertConfig",
    "HasShares",
    "evaluate",
    "memory_growth_rate",
]


class ActionKind(StrEnum):
    """What an alert asks for."""

    STOP_TASK = "stop_task"    # stop the task holding the allocation ``allocation_key``
    SET_HEALTH = "set_health"  # ledger.set_health(target, health, reason)
    CORDON = "cordon"          # ledger.cordon(target, reason)
    NOTIFY = "notify"          # record only; nothing to change


@dataclass(frozen=True, slots=True)
class Action:
    """One thing to do because of one rule.

    Attributes:
        kind: see :class:`ActionKind`.
        rule: the rule that fired (``memory_growth``, ``over_temperature``, ``ecc_uncorrected``,
            ``xid_hardware``, ``xid_application``).
        target: device uuid (set_health, cordon, notify) or allocation key (stop_task).
        uuid: the device the rule looked at.
        reason: one human-readable sentence with the measured figure.
        health: the new health for ``set_health``.
        allocation_key: the allocation a ``stop_task`` (or a ``notify``) is about.
    """

    kind: ActionKind
    rule: str
    target: str
    uuid: str
    reason: str
    health: Health | None = None
    allocation_key: str | None = None


_DEFAULT_TEMPS: Mapping[Vendor, int] = MappingProxyType({
    # NVIDIA data-centre boards slow down near 87–90 °C; AMD SMI reports the hotspot (junction)
    # temperature, whose throttle point on Instinct boards is ~105 °C; Ascend 910 throttles ~95 °C.
    Vendor.NVIDIA: 85_000,
    Vendor.AMD: 100_000,
    Vendor.ASCEND: 90_000,
})


@dataclass(frozen=True, slots=True)
class AlertConfig:
    """Thresholds of the alert rules (all configurable; see ``gpusched agent --help``).

    Attributes:
        memory_growth_bytes_per_min: leak threshold for the linear fit (default 100 MB/min).
        min_growth_samples: fewest samples for a fit.
        min_growth_span_s: shortest time span the fit must cover.
        sustained_fraction: share of sample-to-sample steps that must grow.
        temperature_limits_mc: per-vendor limit in milli-degrees Celsius.
        default_temperature_mc: limit for a device whose vendor is unknown.
        temperature_samples: consecutive readings at/over the limit that fire the rule.
        orphan_memory_fraction / orphan_memory_span_s: the orphan-memory rule's thresholds.
    """

    memory_growth_bytes_per_min: int = 100_000_000
    min_growth_samples: int = 4
    min_growth_span_s: float = 30.0
    sustained_fraction: float = 0.6
    temperature_limits_mc: Mapping[Vendor, int] = field(default_factory=lambda: _DEFAULT_TEMPS)
    default_temperature_mc: int = 85_000
    temperature_samples: int = 2
    orphan_memory_fraction: float = 0.5
    orphan_memory_span_s: float = 120.0

    def temperature_limit(self, vendor: Vendor | None) -> int:
        """The over-temperature limit for ``vendor`` in milli-degrees Celsius."""
        if vendor is None:
            return self.default_temperature_mc
        return int(self.temperature_limits_mc.get(vendor, self.default_temperature_mc))


class HasShares(Protocol):
    """What the rules need of an allocation (``gpusched.ledger.Allocation`` satisfies it)."""

    @property
    def key(self) -> str: ...

    @property
    def shares(self) -> tuple[DeviceShare, ...]: ...

    @property
    def created_at(self) -> float: ...


def memory_growth_rate(samples: Sequence[DeviceSample]) -> tuple[float, float]:
    """Least-squares slope of memory in use (bytes per minute) and the share of growing steps.

    ``samples`` must be of one device; order does not matter. Fewer than two samples or a zero
    time span give ``(0.0, 0.0)``.
    """
    points = sorted((s.taken_at, s.memory_used_bytes) for s in samples)
    n = len(points)
    if n < 2:
        return 0.0, 0.0
    mean_t = sum(t for t, _ in points) / n
    mean_m = sum(m for _, m in points) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in points)
    if var_t == 0:
        return 0.0, 0.0
    cov = sum((t - mean_t) * (m - mean_m) for t, m in points)
    growing = sum(1 for (_, a), (_, b) in pairwise(points) if b > a)
    return cov / var_t * 60.0, growing / (n - 1)


def evaluate(
    samples: Iterable[DeviceSample],
    snapshot: FleetSnapshot,
    allocations: Sequence[HasShares] = (),
    *,
    config: AlertConfig | None = None,
) -> list[Action]:
    """Run every rule over the window ``samples`` and return the actions, device by device.

    ``snapshot`` supplies each device's vendor and its current health/cordon (to skip actions
    already in effect); ``allocations`` are the active ones (to name the task on a device).
    """
    cfg = config or AlertConfig()
    by_device: dict[str, list[DeviceSample]] = defaultdict(list)
    for sample in samples:
        by_device[sample.uuid].append(sample)
    holders: dict[str, list[HasShares]] = defaultdict(list)
    for alloc in allocations:
        for share in alloc.shares:
            holders[share.uuid].append(alloc)
    actions: list[Action] = []
    for uuid in sorted(by_device):
        window = sorted(by_device[uuid], key=lambda s: s.taken_at)
        device = snapshot.device(uuid) if snapshot.has_device(uuid) else None
        health = device.health if device else Health.HEALTHY
        cordoned = bool(device and device.cordoned)
        vendor = device.vendor if device else None
        actions.extend(_memory_rule(uuid, window, holders.get(uuid, []), cfg))
        actions.extend(_device_rules(uuid, window, vendor, health, cordoned, holders.get(uuid, []), cfg))
    return actions


def _memory_rule(
    uuid: str, window: list[DeviceSample], owners: list[HasShares], cfg: AlertConfig
) -> list[Action]:
    if not owners:
        return []
    since = max(a.created_at for a in owners)
    own = [s for s in window if s.taken_at >= since]
    if len(own) < cfg.min_growth_samples or own[-1].taken_at - own[0].taken_at < cfg.min_growth_span_s:
        return []
    slope, growing = memory_growth_rate(own)
    if slope <= cfg.memory_growth_bytes_per_min or growing < cfg.sustained_fraction:
        return []
    reason = (
        f"device memory grows {slope / 1e6:.0f} MB/min over {len(own)} samples "
        f"({own[-1].taken_at - own[0].taken_at:.0f} s; "
        f"limit {cfg.memory_growth_bytes_per_min / 1e6:.0f} MB/min)"
    )
    if len(owners) == 1:
        key = owners[0].key
        return [Action(ActionKind.STOP_TASK, "memory_growth", key, uuid, reason, allocation_key=key)]
    keys = ", ".join(sorted(a.key for a in owners))
    return [Action(ActionKind.NOTIFY, "memory_growth", uuid, uuid,
                   f"{reason}; shared by {keys}, not attributable to one task")]


def _device_rules(
    uuid: str,
    window: list[DeviceSample],
    vendor: Vendor | None,
    health: Health,
    cordoned: bool,
    owners: list[HasShares],
    cfg: AlertConfig,
) -> list[Action]:
    latest = window[-1]
    worst: tuple[Health, str, str] | None = None  # (health, rule, reason)
    hw_xids = sorted({x for s in window for x in s.xid_errors if classify_xid(x) is XidClass.HARDWARE})
    app_xids = sorted({x for s in window for x in s.xid_errors if classify_xid(x) is not XidClass.HARDWARE})
    if hw_xids:
        worst = (Health.UNHEALTHY, "xid_hardware", f"hardware Xid {', '.join(map(str, hw_xids))} reported")
    elif latest.ecc_uncorrected > 0:
        worst = (Health.UNHEALTHY, "ecc_uncorrected",
                 f"{latest.ecc_uncorrected} uncorrectable ECC error(s) since the last GPU reset")
    else:
        limit = cfg.temperature_limit(vendor)
        recent = window[-cfg.temperature_samples:]
        if all(s.temperature_mc >= limit for s in recent):
            worst = (Health.DEGRADED, "over_temperature",
                     f"temperature {latest.temperature_mc / 1000:.0f} °C ≥ limit {limit / 1000:.0f} °C "
                     f"for {len(recent)} sample(s)")
        elif not owners:
            worst = _orphan_memory(window, cfg)
    actions: list[Action] = []
    if worst is not None:
        new_health, rule, reason = worst
        if _rank(new_health) > _rank(health):
            actions.append(Action(ActionKind.SET_HEALTH, rule, uuid, uuid, reason, health=new_health))
        if not cordoned:
            actions.append(Action(ActionKind.CORDON, rule, uuid, uuid, reason))
    if app_xids:
        keys = ", ".join(sorted(a.key for a in owners)) or "no task"
        known = [x for x in app_xids if classify_xid(x) is XidClass.APPLICATION]
        rule = "xid_application" if known else "xid_unknown"
        actions.append(Action(
            ActionKind.NOTIFY, rule, uuid, uuid,
            f"Xid {', '.join(map(str, app_xids))} ({rule.split('_')[1]}) on a device held by {keys}",
            allocation_key=owners[0].key if len(owners) == 1 else None,
        ))
    return actions


def _orphan_memory(window: list[DeviceSample], cfg: AlertConfig) -> tuple[Health, str, str] | None:
    latest = window[-1]
    start = latest.taken_at - cfg.orphan_memory_span_s
    if window[0].taken_at > start:
        return None  # the window does not cover the span yet
    recent = [s for s in window if s.taken_at >= start]
    if all(s.memory_used_bytes > cfg.orphan_memory_fraction * s.memory_total_bytes for s in recent):
        share = latest.memory_used_bytes / max(latest.memory_total_bytes, 1)
        return (Health.DEGRADED, "orphan_memory",
                f"{share:.0%} of device memory in use for {cfg.orphan_memory_span_s:.0f} s with no "
                "allocation holding the device (a leaked or foreign process); free it, then uncordon")
    return None


def _rank(health: Health) -> int:
    return {Health.HEALTHY: 0, Health.DEGRADED: 1, Health.UNHEALTHY: 2}[health]
