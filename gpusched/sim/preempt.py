"""Preemption in the simulator: the executor's victim selection, with checkpointed progress.

After each scheduling pass, :meth:`SimPreemption.plans` runs the same pure victim selection as
the executors (:func:`gpusched.placement.preemption.select_victims`) for the jobs the pass left
waiting, most urgent first (at most ``max_per_pass`` of them): victims of strictly lower priority
(``priority``) or on capacity borrowed from a reclaiming partition (``partitions``), or of an
expected-remaining-service index lower by the margin (``service``: the engine hands the indices
from :mod:`gpusched.sim.service`; the waiting jobs are then taken highest index first), none
younger than ``min_runtime_s`` and no job preempted before that has not checkpointed since its
restart, least work lost first, the fit proven by placement before anything stops.

Checkpoint model: a running job checkpoints every ``checkpoint_s`` seconds of its run (0 = never).
A preempted job keeps the work up to its last checkpoint and loses the rest; it goes back to
the queue (keeping its arrival time) and later runs only its remaining work, scaled to the model
it lands on. Eviction is instant (the executor's notice and grace are not modelled).

Mode ``migrate`` (the executors' ``[gpusched] preemption = migrate`` calls the same rule,
:mod:`gpusched.airflow.gpu_migration`): instead of victims, after each pass the migration rule
(:func:`gpusched.placement.migration.plan_migrations`) may move running single-device jobs between
GPU types. A moved job checkpoints on notice (it keeps all its work), its old device is free at
once, and it restarts on the new one after ``restart_s`` seconds (the restore; the new device is
held meanwhile), then runs its remaining work at the new model's speed.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpusched.model import MILLI, FleetSnapshot
from gpusched.placement import PendingTask, Policy, RunningTask
from gpusched.placement.migration import DEFAULT_RESTART_S, MIGRATE, MigrationRequest, plan_migrations
from gpusched.placement.preemption import (
    PreemptionPlan,
    PreemptionRequest,
    Victim,
    check_mode,
    select_victims,
)
from gpusched.quota.policy import QuotaState, physical_milli

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
    max_per_pass: int = 4
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

    def __post_init__(self) -> None:
        mode = str(self.mode).strip().lower()
        self.mode = mode if mode == MIGRATE else check_mode(self.mode, "simulate preemption")
        if not math.isfinite(self.restart_s) or self.restart_s < 0:
            raise ValueError(f"restart cost {self.restart_s!r} s must be a number >= 0")
        if not math.isfinite(self.checkpoint_s) or self.checkpoint_s < 0:
            raise ValueError(f"checkpoint interval {self.checkpoint_s!r} s must be a number >= 0")

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

    def plans(
        self,
        waiting: Sequence[PendingTask],
        snapshot: FleetSnapshot,
        running: Mapping[str, RunningTask],
        policy: Policy,
        now: float,
        quota: QuotaState,
        fresh: frozenset[str] = frozenset(),
        job_types: Mapping[str, str | None] | None = None,
        indices: Mapping[str, float] | None = None,
    ) -> list[PreemptionPlan]:
        """Victims for the most urgent of ``waiting``; each plan assumes the earlier ones done.
        ``fresh``: jobs started in this pass (never victims). A plan's ``placement`` holds the
        shares of every job to start; in ``migrate`` mode its victims are the movers themselves
        (``job_types``: key → job type for the throughput table); ``indices`` (mode ``service``):
        key → expected-service index of the waiting and running jobs."""
        if self.migrates and running:
            asked = MigrationRequest(snapshot, tuple(running.values()), policy, now, quota,
                                       job_types=job_types or {}, restart_s=self.restart_s,
                                       horizon_s=self.horizon_s, min_runtime_s=self.min_runtime_s,
                                       by_age=self.by_age, attained=self._attained(running, now))
            moved = plan_migrations(asked)
            victims = tuple(Victim(m.key, m.shares, f"{m.from_model} -> {m.to_model}", 0.0, now)
                            for m in moved.moves)
            return [PreemptionPlan(victims, {m.key: m.placement for m in moved.moves}, moved.reason)] \
                if victims else []
        if not self.enabled or not waiting or not running:
            return []
        rest = dict(running)
        started: set[str] = set(fresh)
        out: list[PreemptionPlan] = []
        lowest = min(r.request.priority for r in rest.values())
        index = indices or {}
        room: _Room | None = None  # service mode's quick check, rebuilt after each plan
        free = None  # milli-GPU free on devices that take work, kept up to date plan by plan
        if self.mode == "service":
            free = sum(snapshot.free_milli(d.uuid) for d in snapshot.devices() if d.takes_work)
        held = {k: physical_milli(r.shares, snapshot) for k, r in rest.items()}
        order = sorted(waiting, key=lambda t: (-t.request.priority, -index.get(t.key, 0.0),
                                               t.submitted_at, t.key))
        for task in order:
            if len(out) >= self.max_per_pass:
                break
            if self.mode == "priority" and task.request.priority <= lowest:
                break  # sorted: nobody after it outranks any running job either
            if self.mode == "service":
                if room is None:
                    assert free is not None
                    room = _Room(rest, index, order[0].request.priority, now - self.min_runtime_s, free, held)
                if not room.may_gain(task, index, self.margin):
                    continue
            checkpoints = {k: self.last_checkpoint(r.started_at, now) for k, r in rest.items()}
            request = PreemptionRequest(
                (task,), snapshot, tuple(rest.values()), policy, now, quota, mode=self.mode,
                min_runtime_s=self.min_runtime_s, checkpoints=checkpoints, protected=frozenset(started),
                indices=index, index_margin=self.margin,
                restarted=frozenset(k for k in rest if k in self.times),
            )
            plan = select_victims(request)
            if not isinstance(plan, PreemptionPlan):
                continue
            out.append(plan)
            for victim in plan.victims:
                del rest[victim.key]
            shares = plan.placement[task.key]
            released = [s for v in plan.victims for s in v.shares]
            if free is not None:
                free += sum(s.milli for s in released if snapshot.device(s.uuid).takes_work)
                free -= sum(s.milli for s in shares if snapshot.device(s.uuid).takes_work)
            snapshot = snapshot.with_usage(released, release=True)
            snapshot = snapshot.with_usage(shares)
            held[task.key] = physical_milli(tuple(shares), snapshot)
            rest[task.key] = RunningTask(task.key, task.request, tuple(shares), now, None)
            started.add(task.key)
            room = None
        return out

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
        return {**out, "preemptions": self.count, "jobs_preempted": len(self.times),
                "lost_gpu_hours": round(self.lost_gpu_s / 3600, 3)}


class _Room:
    """Service mode's quick necessary check before a victim selection: the milli-GPU free now plus
    that of the running jobs a waiting one may preempt (old enough; a lower index by the margin, or
    a lower priority than the most urgent waiting job) could hold it. Over-approximates the
    candidates, so it only skips selections that could not succeed."""

    def __init__(self, running: Mapping[str, RunningTask], index: Mapping[str, float], top_priority: int,
                 started_by: float, free: int, held: Mapping[str, int]) -> None:
        self.free = free  # milli-GPU free on the devices that take work
        ranked = sorted(
            (0.0 if r.request.priority < top_priority else index.get(r.key, math.inf), held[r.key])
            for r in running.values() if r.started_at <= started_by and r.request.priority <= top_priority)
        self.bounds = [v for v, _ in ranked]
        self.prefix = list(itertools.accumulate((m for _, m in ranked), initial=0))

    def may_gain(self, task: PendingTask, index: Mapping[str, float], margin: float) -> bool:
        mine = index.get(task.key)
        if mine is None:
            return False
        candidates = self.prefix[bisect.bisect_left(self.bounds, mine / margin)]
        return candidates > 0 and self.free + candidates >= task.request.count * task.request.milli_per_gpu
