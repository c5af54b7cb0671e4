"""Quotas in the simulator: the batch each pass offers the scheduler, and the quota report.

The quota state a pass places with is the executors' (:func:`gpusched.scheduler.quota.quota_at`
over the replay's :class:`~gpusched.scheduler.store.InMemoryStore`). Here: :class:`QuotaWindow`
picks the waiting jobs one pass is offered (the replay's bounded batch, skipping those the budget
gate would refuse anyway), and :func:`report` measures each tenant's and partition's use from the
engine's records (``records`` and ``jobs``: the started
:class:`~gpusched.sim.results.JobRecord` and :class:`~gpusched.sim.simjob.SimJob` by key; a job
stopped and restarted counts only its runs, ``JobRecord.segments``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpusched.model import MILLI, DeviceShare, FleetSnapshot
from gpusched.placement.admission import QuotaGate
from gpusched.placement.types import PendingTask, RunningTask
from gpusched.quota.policy import QuotaPolicy, QuotaState, normalised_rate
from gpusched.quota.usage import UsageSpan, budgets_view, partition_usage, quota_state

__all__ = ["QuotaWindow", "quota_state_at", "report"]


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


class QuotaWindow:
    """The waiting jobs one replay pass offers the scheduler: its bounded batch, less the jobs
    their tenant's budget would hold anyway (see :meth:`offer`)."""

    def __init__(self, policy: QuotaPolicy | None, fleet: FleetSnapshot) -> None:
        # Cheapest normalised rate of one whole device: a lower bound of any placement's cost.
        rates = [normalised_rate([DeviceShare(d.uuid, d.node, d.index, MILLI, 0)], fleet)
                 for d in fleet.devices() if d.takes_work] if policy is not None else []
        self.cheapest = min(rates, default=0)

    def offer(self, pending: Iterable[PendingTask], state: QuotaState, snapshot: FleetSnapshot,
              running: Sequence[RunningTask], now: float, limit: int, *,
              predicted: bool = False) -> list[PendingTask]:
        """The oldest ``limit`` waiting jobs, less those their tenant's budget holds this pass.

        The executor offers every queued task each cycle; the simulator offers at most ``limit``
        (its backfill depth). A job whose cheapest possible cost (:attr:`cheapest` per device),
        on top of its tenant's use and its running tasks' committed cost (the gate's own
        :class:`~gpusched.placement.admission.QuotaGate` bookkeeping), is over the budget would be
        refused by the gate anyway, so it does not take a place in the window: otherwise
        budget-held jobs at the head of the queue hide the other tenants' work from every pass.
        A job that could exceed the whole budget is still offered (the gate rejects it for good).
        With ``predicted`` (durations predicted for the offered jobs afterwards) a job without an
        estimate is costed at 0 s, so only tenants already over budget are skipped.
        """
        out: list[PendingTask] = []
        if not state.enforced:
            for task in pending:
                out.append(task)
                if len(out) >= limit:
                    break
            return out

        committed = QuotaGate(snapshot, state, running, (), now).committed
        for task in pending:
            req = task.request
            budget = state.policy.budget(req.tenant)
            if budget is not None:
                duration = req.expected_duration_s or (0 if predicted else state.policy.default_duration_s)
                # Σ over shares of floored rates ≥ the floored total less one unit per device.
                cost = max(0, req.total_milli * self.cheapest // MILLI - req.count) * duration
                spent = state.used.get(req.tenant, 0) + committed.get(req.tenant, 0)
                if cost <= budget < spent + cost:
                    continue
            out.append(task)
            if len(out) >= limit:
                break
        return out


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
