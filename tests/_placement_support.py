"""Placement requests for tests that do not test quotas (the quota tests build theirs in full)."""

from __future__ import annotations

from collections.abc import Sequence

from gpusched.model import FleetSnapshot
from gpusched.placement import PendingTask, PlacementRequest, Placer, Policy, RunningTask
from gpusched.quota.policy import QuotaState


def no_quota(
    pending: Sequence[PendingTask],
    snapshot: FleetSnapshot,
    policy: Policy,
    *,
    now: float,
    running: Sequence[RunningTask] = (),
    seed: int = 0,
) -> PlacementRequest:
    """A request with :meth:`QuotaState.unlimited` (no partitions, no budgets)."""
    return PlacementRequest(
        pending=pending, snapshot=snapshot, policy=policy, now=now, quota=QuotaState.unlimited(),
        running=running, seed=seed,
    )


def no_quota_on(
    placer: Placer, pending: Sequence[PendingTask], *, now: float, running: Sequence[RunningTask] = (),
    seed: int = 0,
) -> PlacementRequest:
    """:func:`no_quota` for a kept-alive engine (its own snapshot and policy)."""
    return no_quota(pending, placer.snapshot, placer.policy, now=now, running=running, seed=seed)
