"""Quotas in the scheduling cycle: the quota state every cycle places with, and ``[gpusched] over_budget``.

:func:`quota_at` builds the :class:`~gpusched.quota.policy.QuotaState` a cycle places with from a
quota policy and each tenant's use this period, read from the store
(:meth:`~gpusched.scheduler.store.Store.tenant_use`: released and active allocations, normalised
by the catalog); no policy gives :meth:`QuotaState.unlimited`. The executors' :func:`cycle_quota`
takes the policy from the quota file (:mod:`gpusched.quota.file`), the simulator passes its own.
:func:`over_budget_work` names the running work over its tenant's hard budget, for the executors'
periodic check (:mod:`gpusched.airflow.gpu_over_budget`, which carries out ``[gpusched]
over_budget``) and the simulator's (:mod:`gpusched.sim.overbudget`, which says when that check
runs on the replay's clock). :class:`BoundedBatch` is the rule for a cycle that is offered at
most a number of waiting tasks (the simulator's backfill depth): a task whose budget holds it
anyway does not take a place in the batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from gpusched import settings
from gpusched.model import MILLI, DeviceShare
from gpusched.placement.admission import QuotaGate
from gpusched.quota.file import load_quota_policy, quota_file
from gpusched.quota.policy import (
    OVER_BUDGET_ACTIONS,
    QuotaPolicy,
    QuotaState,
    normalised_rate,
    over_budget,
    over_budget_mode,
)
from gpusched.quota.usage import period_start

if TYPE_CHECKING:
    from gpusched.model import FleetSnapshot
    from gpusched.placement.types import PendingTask, RunningTask
    from gpusched.scheduler.store import Store

__all__ = [
    "OVER_BUDGET_ACTIONS", "BoundedBatch", "configured_policy", "cycle_quota", "over_budget_action",
    "over_budget_work", "quota_at",
]


def over_budget_action(conf: Any) -> str:
    """``[gpusched] over_budget``, checked (``finish`` or ``stop``; the simulator reads the same values)."""
    return over_budget_mode(settings.get_str("over_budget", conf))


def configured_policy() -> QuotaPolicy | None:
    """The quota file's policy (:mod:`gpusched.quota.file`), or None when there is no quota file."""
    return load_quota_policy() if quota_file().is_file() else None


def quota_at(policy: QuotaPolicy | None, store: Store, snapshot: FleetSnapshot, now: float) -> QuotaState:
    """The quota state at ``now``: ``policy`` with each tenant's use this period from ``store``
    (:meth:`QuotaState.unlimited` without a policy)."""
    if policy is None:
        return QuotaState.unlimited()
    start = period_start(now, policy.period_s)
    return QuotaState(policy, store.tenant_use(snapshot, start, now), start)


def cycle_quota(store: Store, snapshot: FleetSnapshot, now: float) -> QuotaState:
    """The quota state of an executor's cycle at ``now`` (the quota file's policy; unlimited without)."""
    return quota_at(configured_policy(), store, snapshot, now)


def over_budget_work(state: QuotaState, running: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Key → why, for each of ``running`` (key, tenant) whose tenant has reached its hard budget
    this period (:func:`gpusched.quota.policy.over_budget`); empty when no quota is enforced."""
    if not state.enforced:
        return {}
    reasons: dict[str, str | None] = {}
    out = {}
    for key, tenant in running:
        if tenant not in reasons:
            reasons[tenant] = over_budget(state, tenant)
        reason = reasons[tenant]
        if reason is not None:
            out[key] = reason
    return out


class BoundedBatch:
    """The waiting tasks a cycle offered at most ``limit`` of them places: the oldest, less those
    their tenant's budget holds anyway (:meth:`offer`).

    The executors offer every queued task each cycle (the quota gate then says why a budget holds
    one); the simulator bounds each pass, like a batch scheduler's backfill depth. For an unbounded
    batch this leaves the decisions as they are: every task it skips, the gate would refuse.
    """

    def __init__(self, policy: QuotaPolicy | None, fleet: FleetSnapshot) -> None:
        # Cheapest normalised rate of one whole device: a lower bound of any placement's cost.
        rates = [normalised_rate([DeviceShare(d.uuid, d.node, d.index, MILLI, 0)], fleet)
                 for d in fleet.devices() if d.takes_work] if policy is not None else []
        self.cheapest = min(rates, default=0)

    def offer(self, pending: Iterable[PendingTask], state: QuotaState, snapshot: FleetSnapshot,
              running: Sequence[RunningTask], now: float, limit: int, *,
              predicted: bool = False) -> list[PendingTask]:
        """The oldest ``limit`` of ``pending`` (in its order), less those their tenant's budget holds.

        A task whose cheapest possible cost (:attr:`cheapest` per device), on top of its tenant's
        use and its running tasks' committed cost (the gate's own
        :class:`~gpusched.placement.admission.QuotaGate` bookkeeping), is over the budget would be
        refused by the gate anyway, so it does not take a place: otherwise budget-held tasks at the
        head of the queue hide the other tenants' work from every cycle. A task that could exceed
        the whole budget is still offered (the gate fails it for good). With ``predicted``
        (durations predicted for the offered tasks afterwards) a task without an estimate is costed
        at 0 s, so only tenants already over budget are skipped.
        """
        out: list[PendingTask] = []
        committed = QuotaGate(snapshot, state, running, (), now).committed if state.enforced else {}
        for task in pending:
            req = task.request
            budget = state.policy.budget(req.tenant) if state.enforced else None
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
