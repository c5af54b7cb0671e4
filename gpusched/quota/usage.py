"""Budget use: GPU-hours spent per tenant in the current period, and the cycle's quota state.

One implementation for every consumer (executor cycle, over-budget check, fleet page, simulator):
usage is counted from :class:`UsageSpan` records — an allocation's tenant, partition, shares and
``[start, end)`` — in normalised units (A100-equivalent milli-GPU-seconds from the catalog, see
:func:`gpusched.quota.policy.normalised_rate`). Periods are aligned on Monday 00:00 UTC.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.quota.policy import (
    UNITS_PER_A100_HOUR,
    QuotaPolicy,
    QuotaState,
    normalised_rate,
    physical_milli,
)
from gpusched.request import Partition

__all__ = ["UsageSpan", "partition_usage", "period_start", "quota_state", "spans_of", "tenant_usage"]

_MONDAY = 4 * 86400  # 1970-01-05 00:00 UTC, a Monday: periods start on it


@dataclass(frozen=True, slots=True)
class UsageSpan:
    """Devices a tenant held from ``start`` until ``end`` (None = still holding them)."""

    tenant: str
    partition: Partition
    shares: tuple[DeviceShare, ...]
    start: float
    end: float | None


def period_start(now: float, period_s: int) -> float:
    """Start of the budget period holding ``now`` (periods aligned on Monday 00:00 UTC)."""
    return float(math.floor((now - _MONDAY) / period_s) * period_s + _MONDAY)


def spans_of(allocations: Iterable[object]) -> list[UsageSpan]:
    """Usage spans of ledger allocations (released and active)."""
    return [
        UsageSpan(a.request.tenant, a.request.partition, tuple(a.shares),  # type: ignore[attr-defined]
                  float(a.created_at), a.released_at)  # type: ignore[attr-defined]
        for a in allocations
    ]


def _overlap(span: UsageSpan, since: float, now: float) -> float:
    end = now if span.end is None else min(span.end, now)
    return max(0.0, end - max(span.start, since))


def tenant_usage(
    spans: Iterable[UsageSpan], snapshot: FleetSnapshot, since: float, now: float
) -> dict[str, int]:
    """Normalised units used per tenant in ``[since, now]`` (devices gone count as one A100)."""
    used: dict[str, int] = {}
    for span in spans:
        seconds = _overlap(span, since, now)
        if seconds > 0:
            rate = normalised_rate(span.shares, snapshot)
            used[span.tenant] = used.get(span.tenant, 0) + int(rate * seconds)
    return used


def partition_usage(
    spans: Iterable[UsageSpan], snapshot: FleetSnapshot, since: float, now: float
) -> dict[Partition, float]:
    """Physical GPU-hours per partition in ``[since, now]``."""
    used = dict.fromkeys(Partition, 0.0)
    for span in spans:
        used[span.partition] += physical_milli(span.shares, snapshot) * _overlap(span, since, now) / 3_600_000
    return used


def quota_state(
    policy: QuotaPolicy | None, spans: Iterable[UsageSpan], snapshot: FleetSnapshot, now: float | None = None
) -> QuotaState:
    """The quota state of a cycle at ``now``: ``policy`` with each tenant's use this period.

    ``policy`` None (no quota file configured) gives :meth:`QuotaState.unlimited`.
    """
    if policy is None:
        return QuotaState.unlimited()
    at = time.time() if now is None else now
    start = period_start(at, policy.period_s)
    return QuotaState(policy, tenant_usage(spans, snapshot, start, at), start)


def budgets_view(state: QuotaState, tenants: Iterable[str] = ()) -> Mapping[str, Mapping[str, float | None]]:
    """Per tenant: ``budget_gpu_hours`` (None = unlimited) and ``used_gpu_hours`` (normalised)."""

    names = set(tenants) | set(state.used) | set(state.policy.budgets_hours)
    out = {}
    for tenant in sorted(names):
        budget = state.policy.budget(tenant)
        out[tenant] = {
            "budget_gpu_hours": None if budget is None else budget / UNITS_PER_A100_HOUR,
            "used_gpu_hours": round(state.used.get(tenant, 0) / UNITS_PER_A100_HOUR, 3),
        }
    return out
