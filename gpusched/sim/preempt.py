"""Preemption in the simulator: the settings and the work accounting of stopped jobs.

Which victims to stop, their notice, their grace and the beneficiary's held room and first pick
are the scheduler's (:class:`gpusched.scheduler.preemption.Preemptions`, what the executors run):
the engine drives it with the rules of :meth:`SimPreemption.rules` and the facts of
:meth:`SimPreemption.facts`. A victim gets its notice when the selection is made and stops when
its grace (``grace_s``, ``[gpusched] preemption_grace_seconds``) runs out — simulated jobs never
checkpoint on notice, only periodically — then its beneficiary has the first pick.

Checkpoint model: a running job checkpoints every ``checkpoint_s`` seconds of its run (0 = never).
A preempted job keeps the work up to its last checkpoint and loses the rest; it goes back to
the queue (keeping its arrival time) and later runs only its remaining work, scaled to the model
it lands on.

Mode ``migrate`` (the executors' ``[gpusched] preemption = migrate`` calls the same rule,
:mod:`gpusched.airflow.gpu_migration`): after each pass the migration rule
(:func:`gpusched.placement.migration.plan_migrations`) may move running single-device jobs between
GPU types. A moved job checkpoints on notice (it keeps all its work), its old device is free at
once, and it restarts on the new one after ``restart_s`` seconds (the restore; the new device is
held meanwhile), then runs its remaining work at the new model's speed.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from gpusched import settings
from gpusched.model import MILLI, FleetSnapshot
from gpusched.placement import Policy, RunningTask
from gpusched.placement.migration import DEFAULT_RESTART_S, MIGRATE, MigrationRequest, Move, plan_migrations
from gpusched.placement.preemption import check_mode
from gpusched.quota.policy import QuotaState, physical_milli
from gpusched.scheduler.preemption import PreemptionFacts, PreemptionRules

__all__ = ["DEFAULT_CHECKPOINT_S", "SIM_MODES", "SimPreemption"]

DEFAULT_CHECKPOINT_S = 1800.0
"""Default checkpoint interval of simulated jobs: every 30 minutes of run time."""
SIM_MODES = ("off", "priority", "partitions", "service", MIGRATE)
"""The executor's preemption modes and the simulator's ``migrate``."""


@dataclass
class SimPreemption:
    """Preemption settings of one replay, and what it did (``count``, ``lost_gpu_s``, ``done``)."""

    mode: str = "off"
    checkpoint_s: float = DEFAULT_CHECKPOINT_S
    min_runtime_s: float = 300.0
    grace_s: float = field(default_factory=lambda: float(settings.default("preemption_grace_seconds")))
    restart_s: float = DEFAULT_RESTART_S
    horizon_s: float = 360.0
    by_age: bool = False
    count: int = 0
    lost_gpu_s: float = 0.0
    done: dict[str, float] = field(default_factory=dict)  # key -> fraction of its work saved
    times: dict[str, int] = field(default_factory=dict)  # key -> times preempted
    restarting: dict[str, float] = field(default_factory=dict)  # key -> restore time of its next start
    delay: dict[str, float] = field(default_factory=dict)  # key -> restore time of its current run
    ran: dict[str, float] = field(default_factory=dict)  # key -> seconds of work in its earlier runs
    served_s: dict[str, float] = field(default_factory=dict)  # key -> run time of its stopped runs
    margin: float = 2.0  # service mode: a waiting index must exceed a victim's by this factor
    # ``[gpusched] preemption_max_unsaved_seconds``: no victim with more run since its checkpoint
    max_unsaved_s: float = field(
        default_factory=lambda: float(settings.default("preemption_max_unsaved_seconds")))
    # ``[gpusched] preemption_min_rerun_seconds``: a restarted job is no victim before this much run
    min_rerun_s: float = field(
        default_factory=lambda: float(settings.default("preemption_min_rerun_seconds")))

    def __post_init__(self) -> None:
        mode = str(self.mode).strip().lower()
        self.mode = mode if mode == MIGRATE else check_mode(self.mode, "simulate preemption")
        if not math.isfinite(self.restart_s) or self.restart_s < 0:
            raise ValueError(f"restart cost {self.restart_s!r} s must be a number >= 0")
        if not math.isfinite(self.checkpoint_s) or self.checkpoint_s < 0:
            raise ValueError(f"checkpoint interval {self.checkpoint_s!r} s must be a number >= 0")
        if self.mode == MIGRATE and not (math.isfinite(self.horizon_s) and self.horizon_s > 0):
            raise ValueError(f"migration horizon {self.horizon_s!r} s must be a number > 0")
        if not math.isfinite(self.grace_s) or self.grace_s < 0:
            raise ValueError(f"preemption grace {self.grace_s!r} s must be a number >= 0")
        self.rules()  # the scheduler's own check of the limits it shares with the executors

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def migrates(self) -> bool:
        """True in ``migrate`` mode: the rule runs after every pass, even with nobody waiting."""
        return self.mode == MIGRATE

    def restart_delay(self, key: str) -> float:
        """Seconds before ``key``'s run that starts now does work (its restore after a move)."""
        self.delay[key] = self.restarting.pop(key, 0.0)
        return self.delay[key]

    def remaining(self, key: str) -> float:
        """Fraction of ``key``'s work still to run (1.0 = all of it)."""
        return max(0.0, 1.0 - self.done.get(key, 0.0))

    def last_checkpoint(self, started: float, now: float) -> float:
        """When a job that (re)started at ``started`` last checkpointed, at ``now``."""
        if self.checkpoint_s <= 0:
            return started
        return started + math.floor((now - started) / self.checkpoint_s) * self.checkpoint_s

    def rules(self) -> PreemptionRules:
        """The scheduler's preemption rules for this replay (mode ``migrate``: none)."""
        mode = "off" if self.migrates else self.mode
        return PreemptionRules(mode, self.grace_s, self.min_runtime_s, self.margin, self.max_unsaved_s,
                               self.min_rerun_s)

    def facts(self, running: Mapping[str, RunningTask], now: float, protected: Collection[str] = (),
              indices: Mapping[str, float] | None = None) -> PreemptionFacts:
        """What a victim selection at ``now`` knows of the running jobs: their last periodic
        checkpoints, the jobs preempted before, ``protected`` (multi-node gang members) and, in
        mode ``service``, ``indices``."""
        return PreemptionFacts(
            checkpoints={k: self.last_checkpoint(r.started_at, now) for k, r in running.items()},
            protected=frozenset(protected), restarted=frozenset(k for k in running if k in self.times),
            indices=indices or {},
        )

    def migrations(
        self, snapshot: FleetSnapshot, running: Mapping[str, RunningTask], policy: Policy, now: float,
        quota: QuotaState, job_types: Mapping[str, str | None],
    ) -> list[Move]:
        """Mode ``migrate``: the moves the migration rule proves at ``now`` (``job_types``: key →
        job type for the throughput table)."""
        if not self.migrates or not running:
            return []
        asked = MigrationRequest(snapshot, tuple(running.values()), policy, now, quota,
                                 job_types=job_types, restart_s=self.restart_s, horizon_s=self.horizon_s,
                                 min_runtime_s=self.min_runtime_s, by_age=self.by_age,
                                 attained=self._attained(running, now))
        return list(plan_migrations(asked).moves)

    def _attained(self, running: Mapping[str, RunningTask], now: float) -> dict[str, float]:
        if not self.by_age:
            return {}
        return {k: self.ran.get(k, 0.0) + max(0.0, now - r.started_at - self.delay.get(k, 0.0))
                for k, r in running.items()}

    def evict(self, task: RunningTask, full_run_s: float, now: float, fleet: FleetSnapshot, *,
              preempted: bool = True) -> float:
        """Record that ``task`` (a run of ``full_run_s`` for all its work) is stopped at ``now``;
        return the GPU-seconds of work it lost.

        A migrated job saves all its work (checkpoint on notice) and pays ``restart_s`` when it
        starts again; a victim keeps the work up to its last periodic checkpoint. ``preempted``
        False (a job stopped at its tenant's budget): its work is kept the same way, but it is
        not counted as a preemption here."""
        began = task.started_at + self.delay.pop(task.key, 0.0)  # its work began after the restore
        saved = now if self.migrates and preempted else self.last_checkpoint(task.started_at, now)
        self.ran[task.key] = self.ran.get(task.key, 0.0) + max(0.0, saved - began)
        self.served_s[task.key] = self.served_s.get(task.key, 0.0) + (now - task.started_at)
        if full_run_s > 0 and math.isfinite(full_run_s):
            gained = max(0.0, saved - began) / full_run_s
            self.done[task.key] = min(1.0, self.done.get(task.key, 0.0) + gained)
        gpus = physical_milli(task.shares, fleet) / MILLI
        if self.migrates and preempted:
            self.restarting[task.key] = self.restart_s
            lost = self.restart_s * gpus
        else:
            lost = (now - self.last_checkpoint(task.started_at, now)) * gpus
        if preempted:
            self.lost_gpu_s += lost
            self.count += 1
            self.times[task.key] = self.times.get(task.key, 0) + 1
        return lost

    def report(self) -> dict[str, object]:
        """JSON-safe figures of what preemption did in this replay."""
        out: dict[str, object] = {"mode": self.mode, "min_runtime_s": self.min_runtime_s}
        if self.migrates:
            out.update(restart_s=self.restart_s, horizon_s=self.horizon_s,
                       horizon="age" if self.by_age else "round")
        else:
            out.update(checkpoint_s=self.checkpoint_s)
        if self.mode == "service":
            out.update(margin=self.margin)
        if not self.migrates:
            out.update(grace_s=self.grace_s, max_unsaved_s=self.max_unsaved_s, min_rerun_s=self.min_rerun_s)
        return {**out, "preemptions": self.count, "jobs_preempted": len(self.times),
                "lost_gpu_hours": round(self.lost_gpu_s / 3600, 3)}
