"""Quotas in the simulator: the executor's quota state at a simulated instant, and the report.

The jobs started so far are usage spans (:class:`gpusched.quota.usage.UsageSpan`), so the
simulator places with exactly the state the executors build from the ledger. ``records`` and
``jobs`` are the engine's started :class:`~gpusched.sim.engine.JobRecord` and
:class:`~gpusched.sim.engine.SimJob` by key; a job stopped and restarted counts only its runs
(``JobRecord.segments``), not the time it waited in between.

:class:`QuotaTracker` gives the same state as :func:`gpusched.quota.usage.quota_state` over every
started job, incrementally: a job that has ended adds a fixed amount to its tenant's use of the
period, so only running jobs are visited per pass (a week of Philly has ~12k jobs and ~25k
passes; recounting every span per pass was quadratic). :meth:`QuotaTracker.offer` picks the
waiting jobs one pass is offered, skipping those the budget gate would refuse anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpusched.model import MILLI, DeviceShare, FleetSnapshot
from gpusched.placement.types import PendingTask, RunningTask
from gpusched.quota.policy import QuotaPolicy, QuotaState, normalised_rate
from gpusched.quota.usage import UsageSpan

__all__ = ["QuotaTracker", "quota_state_at", "report"]


def _spans(records: Mapping[str, Any], jobs: Mapping[str, Any]) -> list[UsageSpan]:
    """One span per run of each record (a restarted job held no devices while it waited)."""
    return [UsageSpan(jobs[r.key].request.tenant, jobs[r.key].request.partition, shares, start, end)
            for r in records.values() for start, end, shares in r.segments]


def quota_state_at(
    policy: QuotaPolicy | None, records: Mapping[str, Any], jobs: Mapping[str, Any],
    fleet: FleetSnapshot, now: float,
) -> QuotaState:
    """The executor's quota state (:func:`gpusched.quota.usage.quota_state`) at simulated ``now``."""
    from gpusched.quota.usage import quota_state

    return quota_state(policy, _spans(records, jobs) if policy is not None else (), fleet, now)


class QuotaTracker:
    """The quota state at non-decreasing simulated instants, equal to :func:`quota_state_at`.

    Call :meth:`started` for every run the engine starts (its record holds its end),
    :meth:`stopped` for a run it ends early, then :meth:`state_at` before each pass. Each span
    is counted as ``tenant_usage`` counts it (``int(rate × overlap)``), so the totals match exactly.
    """

    def __init__(self, policy: QuotaPolicy | None, jobs: Mapping[str, Any], fleet: FleetSnapshot) -> None:
        self.policy = policy
        self.jobs = jobs
        self.fleet = fleet
        # key -> (tenant, rate, start, end); open = spans not ended at the last state
        self.spans: dict[str, tuple[str, int, float, float]] = {}
        self.open: dict[str, tuple[str, int, float, float]] = {}
        self.closed: dict[str, int] = {}  # use of spans ended within the current period
        self.period = float("nan")
        self.runs_stopped = 0
        # Cheapest normalised rate of one whole device: a lower bound of any placement's cost.
        rates = [normalised_rate([DeviceShare(d.uuid, d.node, d.index, MILLI, 0)], fleet)
                 for d in fleet.devices() if d.takes_work] if policy is not None else []
        self.cheapest = min(rates, default=0)

    def started(self, record: Any) -> None:
        """Count the run ``record`` (an engine ``JobRecord``) starts: its last segment."""
        if self.policy is None:
            return
        start, end, shares = record.segments[-1]
        span = (self.jobs[record.key].request.tenant, normalised_rate(shares, self.fleet), start, end)
        self.spans[record.key] = self.open[record.key] = span

    def stopped(self, key: str, now: float) -> None:
        """End the run of ``key`` at ``now`` (preempted, or stopped at its budget): it counts
        until ``now`` and not while the job waits; a restart is counted by :meth:`started`."""
        span = self.spans.pop(key, None)
        self.open.pop(key, None)
        if span is None:
            return
        self.runs_stopped += 1
        done = f"{key}#{self.runs_stopped}"  # a closed run, under a key no job has
        self.spans[done] = self.open[done] = (span[0], span[1], span[2], min(span[3], now))

    def rates(self, keys: Iterable[str]) -> dict[str, int]:
        """Per tenant, the cost per second (normalised units) of the runs of ``keys`` now."""
        out: dict[str, int] = {}
        for key in keys:
            span = self.spans.get(key)
            if span is not None:
                out[span[0]] = out.get(span[0], 0) + span[1]
        return out

    def state_at(self, now: float) -> QuotaState:
        """The quota state at ``now`` (never earlier than the previous call's)."""
        if self.policy is None:
            return QuotaState.unlimited()
        from gpusched.quota.usage import period_start

        start = period_start(now, self.policy.period_s)
        if start != self.period:  # a new period: recount every span once
            self.period = start
            self.closed = {}
            self.open = {k: s for k, s in self.spans.items() if s[3] > start}
        used = dict(self.closed)
        still = {}
        for key, (tenant, rate, begin, end) in self.open.items():
            seconds = max(0.0, min(end, now) - max(begin, start))
            if seconds > 0:
                used[tenant] = used.get(tenant, 0) + int(rate * seconds)
            if end <= now:
                if seconds > 0:
                    self.closed[tenant] = self.closed.get(tenant, 0) + int(rate * seconds)
            else:
                still[key] = (tenant, rate, begin, end)
        self.open = still
        return QuotaState(self.policy, used, start)

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
        from gpusched.placement.admission import QuotaGate

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
