"""Preemption in the simulator: the executor's victim selection, with checkpointed progress.

After each scheduling pass, :meth:`SimPreemption.plans` runs the same pure victim selection as
the executors (:func:`gpusched.placement.preemption.select_victims`) for the jobs the pass left
waiting, most urgent first (at most ``max_per_pass`` of them): victims of strictly lower priority
(``priority``) or on capacity borrowed from a reclaiming partition (``partitions``), none younger
than ``min_runtime_s``, least work lost first, the fit proven by placement before anything stops.

Checkpoint model: a running job checkpoints every ``checkpoint_s`` seconds of its run (0 = never).
A preempted job keeps the work up to its last checkpoint and loses the rest; it goes back to
the queue (keeping its arrival time) and later runs only its remaining work, scaled to the model
it lands on. Eviction is instant (the executor's notice and grace are not modelled).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpusched.model import MILLI, FleetSnapshot
from gpusched.placement import PendingTask, Policy, RunningTask
from gpusched.placement.preemption import PreemptionPlan, PreemptionRequest, check_mode, select_victims
from gpusched.quota.policy import QuotaState, physical_milli

__all__ = ["DEFAULT_CHECKPOINT_S", "SimPreemption"]

DEFAULT_CHECKPOINT_S = 1800.0
"""Default checkpoint interval of simulated jobs: every 30 minutes of run time."""


@dataclass
class SimPreemption:
    """Preemption settings of one replay, and what it did (``count``, ``lost_gpu_s``, ``done``)."""

    mode: str = "off"
    checkpoint_s: float = DEFAULT_CHECKPOINT_S
    min_runtime_s: float = 300.0
    max_per_pass: int = 4
    count: int = 0
    lost_gpu_s: float = 0.0
    done: dict[str, float] = field(default_factory=dict)  # key -> fraction of its work saved
    times: dict[str, int] = field(default_factory=dict)  # key -> times preempted

    def __post_init__(self) -> None:
        self.mode = check_mode(self.mode, "simulate preemption")
        if not math.isfinite(self.checkpoint_s) or self.checkpoint_s < 0:
            raise ValueError(f"checkpoint interval {self.checkpoint_s!r} s must be a number >= 0")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def remaining(self, key: str) -> float:
        """Fraction of ``key``'s work still to run (1.0 = all of it)."""
        return max(0.0, 1.0 - self.done.get(key, 0.0))

    def last_checkpoint(self, started: float, now: float) -> float:
        """When a job that (re)started at ``started`` last checkpointed, at ``now``."""
        if self.checkpoint_s <= 0:
            return started
        return started + math.floor((now - started) / self.checkpoint_s) * self.checkpoint_s

    def plans(
        self,
        waiting: Sequence[PendingTask],
        snapshot: FleetSnapshot,
        running: Mapping[str, RunningTask],
        policy: Policy,
        now: float,
        quota: QuotaState,
        fresh: frozenset[str] = frozenset(),
    ) -> list[tuple[PendingTask, PreemptionPlan]]:
        """Victims for the most urgent of ``waiting``; each plan assumes the earlier ones done.
        ``fresh``: jobs started in this pass (never victims)."""
        if not self.enabled or not waiting or not running:
            return []
        rest = dict(running)
        started: set[str] = set(fresh)
        out: list[tuple[PendingTask, PreemptionPlan]] = []
        lowest = min(r.request.priority for r in rest.values())
        order = sorted(waiting, key=lambda t: (-t.request.priority, t.submitted_at, t.key))
        for task in order:
            if len(out) >= self.max_per_pass:
                break
            if self.mode == "priority" and task.request.priority <= lowest:
                break  # sorted: nobody after it outranks any running job either
            checkpoints = {k: self.last_checkpoint(r.started_at, now) for k, r in rest.items()}
            request = PreemptionRequest(
                (task,), snapshot, tuple(rest.values()), policy, now, quota, mode=self.mode,
                min_runtime_s=self.min_runtime_s, checkpoints=checkpoints, protected=frozenset(started),
            )
            plan = select_victims(request)
            if not isinstance(plan, PreemptionPlan):
                continue
            out.append((task, plan))
            for victim in plan.victims:
                del rest[victim.key]
            shares = plan.placement[task.key]
            snapshot = snapshot.with_usage([s for v in plan.victims for s in v.shares], release=True)
            snapshot = snapshot.with_usage(shares)
            rest[task.key] = RunningTask(task.key, task.request, tuple(shares), now, None)
            started.add(task.key)
        return out

    def evict(self, task: RunningTask, full_run_s: float, now: float, fleet: FleetSnapshot) -> None:
        """Record that ``task`` (a run of ``full_run_s`` for all its work) is stopped at ``now``."""
        saved = self.last_checkpoint(task.started_at, now)
        if full_run_s > 0 and math.isfinite(full_run_s):
            gained = (saved - task.started_at) / full_run_s
            self.done[task.key] = min(1.0, self.done.get(task.key, 0.0) + gained)
        self.lost_gpu_s += (now - saved) * physical_milli(task.shares, fleet) / MILLI
        self.count += 1
        self.times[task.key] = self.times.get(task.key, 0) + 1

    def report(self) -> dict[str, object]:
        """JSON-safe figures of what preemption did in this replay."""
        return {"mode": self.mode, "checkpoint_s": self.checkpoint_s, "min_runtime_s": self.min_runtime_s,
                "preemptions": self.count, "jobs_preempted": len(self.times),
                "lost_gpu_hours": round(self.lost_gpu_s / 3600, 3)}
