"""Quotas in the simulator: the quota report.

The quota state a pass places with is the executors' (:func:`gpusched.scheduler.quota.quota_at`
over the replay's :class:`~gpusched.scheduler.store.InMemoryStore`), and the batch a pass is
offered is the scheduler's :class:`~gpusched.scheduler.quota.BoundedBatch`. Here:
:func:`report` measures each tenant's and partition's use from the engine's records (``records``
and ``jobs``: the started :class:`~gpusched.sim.results.JobRecord` and
:class:`~gpusched.sim.simjob.SimJob` by key; a job stopped and restarted counts only its runs,
``JobRecord.segments``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpusched.model import FleetSnapshot
from gpusched.quota.policy import QuotaPolicy, QuotaState
from gpusched.quota.usage import UsageSpan, budgets_view, partition_usage, quota_state

__all__ = ["quota_state_at", "report"]


def _spans(records: Mapping[str, Any], jobs: Mapping[str, Any]) -> list[UsageSpan]:
    """One span per run of each record (a restarted job held no devices while it waited)."""
    return [UsageSpan(jobs[r.key].request.tenant, jobs[r.key].request.partition, shares, start, end)
            for r in records.values() for start, end, shares in r.segments]


def quota_state_at(
    policy: QuotaPolicy | None, records: Mapping[str, Any], jobs: Mapping[str, Any],
    fleet: FleetSnapshot, now: float,
) -> QuotaState:
    """The executor's quota state (:func:`gpusched.quota.usage.quota_state`) at simulated ``now``."""
    return quota_state(policy, _spans(records, jobs) if policy is not None else (), fleet, now)


def report(
    policy: QuotaPolicy, records: Mapping[str, Any], jobs: Mapping[str, Any],
    fleet: FleetSnapshot, end: float,
) -> dict[str, Any]:
    """Per tenant budget and use in the period holding ``end``; per partition its GPU-hours."""
    spans = _spans(records, jobs)
    state = quota_state_at(policy, records, jobs, fleet, end)
    gpu_hours = partition_usage(spans, fleet, min((s.start for s in spans), default=0.0), end)
    total = sum(gpu_hours.values())
    tenants = {j.request.tenant for j in jobs.values()}
    return {
        "period_start": state.period_start,
        "tenants": {k: dict(v) for k, v in budgets_view(state, tenants).items()},
        "partitions": {
            p.value: {"share_pct": policy.shares_pct[p], "gpu_hours": round(h, 3),
                      "gpu_hours_pct": round(100 * h / total, 2) if total else 0.0}
            for p, h in gpu_hours.items()
        },
    }
