"""Quotas in the scheduling cycle: the quota state every cycle places with, and ``[gpusched] over_budget``.

:func:`cycle_quota` builds the :class:`~gpusched.quota.policy.QuotaState` every cycle places
with: the quota file's policy (:mod:`gpusched.quota.file`) and each tenant's use this
period from the ledger's allocation history (released and active, normalised by the catalog);
no quota file gives :meth:`QuotaState.unlimited`. What the executors do with running work over its budget is
:mod:`gpusched.airflow.gpu_over_budget`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpusched.quota.policy import OVER_BUDGET_ACTIONS, QuotaState, over_budget_mode

if TYPE_CHECKING:
    from gpusched.model import FleetSnapshot

__all__ = ["OVER_BUDGET_ACTIONS", "cycle_quota", "over_budget_action"]


def over_budget_action(conf: Any) -> str:
    """``[gpusched] over_budget``, checked (``finish`` or ``stop``; the simulator reads the same values)."""
    from gpusched import settings

    return over_budget_mode(settings.get_str("over_budget", conf))


def cycle_quota(ledger: Any, snapshot: FleetSnapshot, now: float) -> QuotaState:
    """The quota state of a cycle at ``now`` (unlimited without a quota file)."""
    from gpusched.quota.file import load_quota_policy, quota_file
    from gpusched.quota.usage import period_start, quota_state, spans_of

    if not quota_file().is_file():
        return QuotaState.unlimited()
    policy = load_quota_policy()
    history = ledger.history(period_start(now, policy.period_s), now)
    return quota_state(policy, spans_of(history), snapshot, now)

