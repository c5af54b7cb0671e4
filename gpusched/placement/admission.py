"""Quota admission inside one placement call: tenant GPU-hour budgets and partition shares.

A :class:`QuotaGate` is built from the running tasks and the pending batch; the engine asks it
to :meth:`~QuotaGate.admit` each task it has found devices for (the policy itself is
:mod:`gpusched.quota.policy`): its tenant's budget, its partition's share, and the burst reserve
(``QuotaState.burst_reserve_gpus``: non-burst work leaves that many GPUs free,
:func:`gpusched.quota.policy.usable_gpus`, the rule the standby scale-in keeps too).
"""

from __future__ import annotations

from collections.abc import Sequence

from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.placement.types import PendingTask, Rejection, RunningTask
from gpusched.quota.policy import (
    QuotaState,
    check_budget,
    check_burst_reserve,
    check_partition,
    normalised_rate,
    partition_capacity,
    physical_milli,
)
from gpusched.request import GPURequest, Partition

__all__ = ["QuotaGate"]


class QuotaGate:
    """Partition and budget bookkeeping for one ``place`` call (and for a multi-node gang in the
    executor's cycle): admit a placed task or say why not."""

    def __init__(
        self,
        snapshot: FleetSnapshot,
        quota: QuotaState,
        running: Sequence[RunningTask],
        pending: Sequence[PendingTask],
        now: float,
    ) -> None:
        self.quota = quota
        self.snapshot = snapshot
        self.capacity = partition_capacity(self.snapshot)
        self.rate = normalised_rate
        self.used = {p: 0 for p in Partition}
        self.committed: dict[str, int] = {}
        for r in running:
            self.used[r.request.partition] += physical_milli(r.shares, self.snapshot)
            # A task without an estimate is charged the default duration, as when it was admitted.
            default_end = r.started_at + quota.policy.default_duration_s
            end = r.expected_end if r.expected_end is not None else default_end
            if end > now:
                cost = normalised_rate(r.shares, self.snapshot) * int(end - now)
                self.committed[r.request.tenant] = self.committed.get(r.request.tenant, 0) + cost
        self.pending = {p: 0 for p in Partition}
        for t in pending:
            self.pending[t.request.partition] += t.request.total_milli

    def done(self, req: GPURequest) -> None:
        """``req`` leaves the pending demand (placed or given up)."""
        self.pending[req.partition] -= req.total_milli

    def admit(
        self, task: PendingTask, shares: tuple[DeviceShare, ...], need: int, now: float
    ) -> Rejection | None:
        """None when ``task`` on ``shares`` (``need`` milli-GPU) passes budget and partition, else why not."""
        req = task.request
        self.done(req)
        duration = req.expected_duration_s or self.quota.policy.default_duration_s
        cost = self.rate(shares, self.snapshot) * duration
        verdict = check_budget(self.quota, req.tenant, cost, committed=self.committed.get(req.tenant, 0))
        if verdict.allowed:
            verdict = check_partition(
                self.quota.policy, req.partition, need, self.used, self.capacity, self.pending
            )
        if verdict.allowed and self.quota.burst_reserve_gpus > 0:
            free = self.capacity - sum(self.used.values())
            verdict = check_burst_reserve(req.partition, need, free, self.quota.burst_reserve_gpus)
        if not verdict.allowed:
            return Rejection(task.key, verdict.reason, verdict.permanent, by_quota=True)
        self.used[req.partition] += need
        self.committed[req.tenant] = self.committed.get(req.tenant, 0) + cost
        return None
