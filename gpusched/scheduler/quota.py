"""Quotas in the scheduling cycle: the quota state every cycle places with, and ``[gpusched] over_budget``.

:func:`quota_at` builds the :class:`~gpusched.quota.policy.QuotaState` a cycle places with from a
quota policy and each tenant's use this period, read from the store
(:meth:`~gpusched.scheduler.store.Store.tenant_use`: released and active allocations, normalised
by the catalog); no policy gives :meth:`QuotaState.unlimited`. The executors' :func:`cycle_quota`
takes the policy from the quota file (:mod:`gpusched.quota.file`), the simulator passes its own.
:func:`over_budget_work` names the running work over its tenant's hard budget, for the executors'
periodic check (:mod:`gpusched.airflow.gpu_over_budget`, which carries out ``[gpusched]
over_budget``) and the simulator's (:mod:`gpusched.sim.overbudget`, which says when that check
runs on the replay's clock).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from gpusched import settings
from gpusched.quota.file import load_quota_policy, quota_file
from gpusched.quota.policy import OVER_BUDGET_ACTIONS, QuotaPolicy, QuotaState, over_budget, over_budget_mode
from gpusched.quota.usage import period_start

if TYPE_CHECKING:
    from gpusched.model import FleetSnapshot
    from gpusched.scheduler.store import Store

__all__ = [
    "OVER_BUDGET_ACTIONS", "configured_policy", "cycle_quota", "over_budget_action", "over_budget_work",
    "quota_at",
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
