"""Quotas in the simulator: the executor's quota state at a simulated instant, and the report.

The jobs started so far are usage spans (:class:`gpusched.quota.usage.UsageSpan`), so the
simulator places with exactly the state the executors build from the ledger. ``records`` and
``jobs`` are the engine's started :class:`~gpusched.sim.engine.JobRecord` and
:class:`~gpusched.sim.engine.SimJob` by key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpusched.model import FleetSnapshot
from gpusched.quota.policy import QuotaPolicy, QuotaState
from gpusched.quota.usage import UsageSpan

__all__ = ["quota_state_at", "report"]


def _spans(records: Mapping[str, Any], jobs: Mapping[str, Any]) -> list[UsageSpan]:
    return [UsageSpan(jobs[r.key].request.tenant, jobs[r.key].request.partition, r.shares,
                      r.start_s, r.end_s) for r in records.values()]


def quota_state_at(
    policy: QuotaPolicy | None, records: Mapping[str, Any], jobs: Mapping[str, Any],
    fleet: FleetSnapshot, now: float,
) -> QuotaState:
    """The executor's quota state (:func:`gpusched.quota.usage.quota_state`) at simulated ``now``."""
    from gpusched.quota.usage import quota_state

    return quota_state(policy, _spans(records, jobs) if policy is not None else (), fleet, now)


def report(
    policy: QuotaPolicy, records: Mapping[str, Any], jobs: Mapping[str, Any],
    fleet: FleetSnapshot, end: float,
) -> dict[str, Any]:
    """Per tenant budget and use in the period holding ``end``; per partition its GPU-hours."""
    from gpusched.quota.usage import budgets_view, partition_usage

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
