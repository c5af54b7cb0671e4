"""Quotas in the GPU executors: each cycle's quota state, and running work over its budget.

:func:`cycle_quota` builds the :class:`~gpusched.quota.policy.QuotaState` every cycle places
with: the quota file's policy (:mod:`gpusched.airflow.quota_file`) and each tenant's use this
period from the ledger's allocation history (released and active, normalised by the catalog);
no quota file gives :meth:`QuotaState.unlimited`. :func:`check_running` handles running work
whose tenant crossed its hard budget the way Slurm's ``GrpTRESMins`` does, as ``[gpusched]
over_budget`` says: ``finish`` lets it run (and says so in its log), ``stop`` fails it now.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from gpusched.quota.policy import OVER_BUDGET_ACTIONS, QuotaState, over_budget_mode

if TYPE_CHECKING:
    from gpusched.model import FleetSnapshot


class QuotaCore(Protocol):
    """What :func:`check_running` uses of the executors' GPU core (``GPUScheduling``)."""

    executor: Any
    gpu_running: dict[Any, str]
    over_budget: str
    over_budget_seen: set[str]

    @property
    def ledger(self) -> Any: ...

    @property
    def log(self) -> Any: ...

    def release(self, key: Any, reason: str) -> None: ...

__all__ = ["OVER_BUDGET_ACTIONS", "QuotaCore", "check_running", "cycle_quota", "over_budget_action"]

def over_budget_action(conf: Any) -> str:
    """``[gpusched] over_budget``, checked (``finish`` or ``stop``; the simulator reads the same values)."""
    from gpusched import settings

    return over_budget_mode(settings.get_str("over_budget", conf))


def cycle_quota(ledger: Any, snapshot: FleetSnapshot, now: float) -> QuotaState:
    """The quota state of a cycle at ``now`` (unlimited without a quota file)."""
    from gpusched.airflow.quota_file import load_quota_policy, quota_file
    from gpusched.quota.usage import period_start, quota_state, spans_of

    if not quota_file().is_file():
        return QuotaState.unlimited()
    policy = load_quota_policy()
    history = ledger.history(period_start(now, policy.period_s), now)
    return quota_state(policy, spans_of(history), snapshot, now)


def check_running(core: QuotaCore, now: float) -> list[Any]:
    """Act once on each running task of a tenant over its hard budget; return the Airflow keys."""
    from gpusched.airflow.executor_compat import save_task_event
    from gpusched.airflow.task_log import append_task_log
    from gpusched.quota.policy import over_budget

    if not core.gpu_running:
        return []
    ledger = core.ledger
    state = cycle_quota(ledger, ledger.snapshot(now), now)
    if not state.enforced:
        return []
    acted = []
    for key, ledger_key in list(core.gpu_running.items()):
        if ledger_key in core.over_budget_seen:
            continue
        alloc = ledger.get(ledger_key)
        reason = over_budget(state, alloc.request.tenant) if alloc is not None else None
        if reason is None:
            continue
        core.over_budget_seen.add(ledger_key)
        acted.append(key)
        if core.over_budget == "stop":
            message = f"{reason}; stopping this task ([gpusched] over_budget = stop)"
            ledger.record_event("over_budget", ledger_key, reason=message, action="stop")
            core.log.warning("gpusched: %s: %s", ledger_key, message)
            append_task_log(key, f"gpusched: {message}", level="error")
            core.release(key, message)
            save_task_event(core.executor, event="gpusched.over_budget", extra=message, ti_key=key)
            core.executor.fail(key, info=message)
        else:
            message = (f"{reason}; this running task is let finish ([gpusched] over_budget = finish); "
                       "the tenant's new tasks wait")
            ledger.record_event("over_budget", ledger_key, reason=message, action="finish")
            core.log.warning("gpusched: %s: %s", ledger_key, message)
            append_task_log(key, f"gpusched: {message}", level="warning")
    return acted
