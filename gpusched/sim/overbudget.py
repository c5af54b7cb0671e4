"""Running work over its tenant's hard budget in the simulator: ``[gpusched] over_budget``.

The executors check their running tasks every ``reconcile_seconds`` (5 s by default) and act on
each task of a tenant that :func:`gpusched.quota.policy.over_budget` names — the tenant's use this
period (its ended work plus its running work so far) has reached its budget — as Slurm's
``GrpTRESMins`` does: ``finish`` lets it run, ``stop`` fails it now. :class:`SimOverBudget` is that
check on the simulated clock, with the same rule and the same values:

* checks run at multiples of ``check_s``; :meth:`SimOverBudget.next_check` says when the first
  check after a tenant's crossing falls (from each tenant's use and running cost per second), so
  the engine wakes exactly then and not every ``check_s``;
* ``stop``: at that check every running job of the tenant is stopped — its devices are free at
  once, it keeps the work up to its last checkpoint (``SimPreemption.checkpoint_s``) and goes back
  to the queue, where the budget gate holds it until the next period; ``finish`` stops nothing.

Also here: :meth:`SimOverBudget.next_reset`, the next period start, when budget-held jobs become
eligible (the executor offers its queue every cycle; the simulator passes at that instant).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpusched import settings
from gpusched.quota.policy import QuotaPolicy, QuotaState, over_budget_mode
from gpusched.quota.usage import period_start
from gpusched.scheduler.quota import over_budget_work

__all__ = ["SimOverBudget"]

_INF = float("inf")


@dataclass
class SimOverBudget:
    """``[gpusched] over_budget`` (``mode``) and ``reconcile_seconds`` (``check_s``) of one replay,
    and what it did (``stops``, ``jobs``, ``lost_gpu_s``)."""

    mode: str = field(default_factory=lambda: settings.default("over_budget"))
    check_s: float = field(default_factory=lambda: float(settings.default("reconcile_seconds")))
    stops: int = 0
    jobs: set[str] = field(default_factory=set)
    lost_gpu_s: float = 0.0
    last_check: float = -_INF

    def __post_init__(self) -> None:
        self.mode = over_budget_mode(self.mode)
        if not math.isfinite(self.check_s) or self.check_s <= 0:
            raise ValueError(f"over-budget check interval {self.check_s!r} s must be a number > 0")

    @property
    def stops_work(self) -> bool:
        return self.mode == "stop"

    def next_check(self, state: QuotaState, rates: Mapping[str, int], now: float) -> float:
        """The first check (a multiple of ``check_s``, after the last one) at which a tenant with
        running work, ``rates`` (tenant → cost per second now), is over its budget; inf if none
        crosses in this period or the mode is ``finish``."""
        if not self.stops_work or not state.enforced:
            return _INF
        crossing = _INF
        for tenant, rate in rates.items():
            budget = state.policy.budget(tenant)
            if budget is None or rate <= 0:
                continue
            crossing = min(crossing, now + max(0, budget - state.used.get(tenant, 0)) / rate)
        if crossing >= state.period_start + state.policy.period_s:
            return _INF  # use resets first; recomputed then
        at = math.ceil(crossing / self.check_s) * self.check_s
        # Rounding (use is counted in whole units) may put it at a check already done: the next one.
        return at if at > self.last_check else self.last_check + self.check_s

    def over(self, state: QuotaState, running: Iterable[tuple[str, str]], now: float) -> list[str]:
        """The check at ``now``: the keys of ``running`` (key, tenant) to stop (none with ``finish``)."""
        self.last_check = now
        if not self.stops_work:
            return []
        return list(over_budget_work(state, running))

    def stopped(self, key: str, lost_gpu_s: float) -> None:
        """Record that ``key`` was stopped, losing ``lost_gpu_s`` GPU-seconds of work."""
        self.stops += 1
        self.jobs.add(key)
        self.lost_gpu_s += lost_gpu_s

    @staticmethod
    def next_reset(policy: QuotaPolicy, now: float) -> float:
        """When the budget period holding ``now`` ends (the next one starts)."""
        return period_start(now, policy.period_s) + policy.period_s

    def report(self) -> dict[str, object]:
        """JSON-safe figures: the mode, the check interval and the stops."""
        return {"mode": self.mode, "check_s": self.check_s, "stops": self.stops,
                "jobs_stopped": len(self.jobs), "lost_gpu_hours": round(self.lost_gpu_s / 3600, 3)}
