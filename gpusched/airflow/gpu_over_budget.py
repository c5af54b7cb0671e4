"""Running work over its tenant's hard budget in the GPU executors (``[gpusched] over_budget``).

:func:`check_running` acts the way Slurm's ``GrpTRESMins`` does, as ``[gpusched] over_budget``
says: ``finish`` lets the task run (and says so in its log), ``stop`` fails it now. The quota
state is the cycle's (:func:`gpusched.scheduler.quota.cycle_quota`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from gpusched.airflow.executor_compat import save_task_event
from gpusched.airflow.task_log import append_task_log
from gpusched.scheduler.quota import cycle_quota, over_budget_work

__all__ = ["QuotaCore", "check_running"]

if TYPE_CHECKING:  # typing only: the ledger loads its SQL tables, Airflow's executor its models
    from airflow.executors.base_executor import BaseExecutor
    from airflow.models.taskinstancekey import TaskInstanceKey

    from gpusched.scheduler.ledger_store import LedgerStore


class QuotaCore(Protocol):
    """What :func:`check_running` uses of the executors' GPU core (``GPUScheduling``)."""

    executor: BaseExecutor
    gpu_running: dict[TaskInstanceKey, str]
    over_budget: str
    over_budget_seen: set[str]

    @property
    def ledger(self) -> LedgerStore: ...

    @property
    def log(self) -> logging.Logger: ...

    def release(self, key: TaskInstanceKey, reason: str) -> None: ...


def check_running(core: QuotaCore, now: float) -> list[TaskInstanceKey]:
    """Act once on each running task of a tenant over its hard budget; return the Airflow keys."""
    if not core.gpu_running:
        return []
    ledger = core.ledger
    state = cycle_quota(ledger, ledger.snapshot(now), now)
    if not state.enforced:
        return []
    running = {}
    for key, ledger_key in core.gpu_running.items():
        alloc = ledger.get(ledger_key) if ledger_key not in core.over_budget_seen else None
        if alloc is not None:
            running[ledger_key] = (key, alloc.request.tenant)
    over = over_budget_work(state, ((k, tenant) for k, (_, tenant) in running.items()))
    acted = []
    for ledger_key, reason in over.items():
        key = running[ledger_key][0]
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
