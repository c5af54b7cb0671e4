"""Discrete-event replay of a job trace on a fleet, driving the real placement engine.

Events are arrivals, completions and scheduling passes. A scheduling pass calls
:func:`gpusched.placement.place` — the same function the executor calls — with the waiting jobs,
the current :class:`~gpusched.model.FleetSnapshot` and the running jobs; every assignment starts
at once and finishes after the job's run time *on the model it got* (the slowest device's model
for a multi-device job). Scheduling is non-preemptive: a started job keeps its devices until it
ends.

Two timing modes: ``round_s == 0`` schedules after every batch of simultaneous events;
``round_s > 0`` schedules only at round boundaries (Gavel's 360 s rounds) when something changed.
Same-instant order: completions, then arrivals, then the pass.
"""

from __future__ import annotations

import heapq
import math
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpusched.errors import ConfigurationError
from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.placement import Assignment, PendingTask, PlacementPlan, Policy, RunningTask, place
from gpusched.quota.policy import QuotaPolicy, physical_milli
from gpusched.request import GPURequest
from gpusched.sim import quota as sim_quota

__all__ = ["JobRecord", "SimJob", "SimResult", "TimelinePoint", "simulate", "with_expected_durations"]

_INF = float("inf")


@dataclass(frozen=True, slots=True)
class SimJob:
    """One job to replay: its request, arrival and run time (per catalog model if it varies).

    ``job_type`` is handed to the placement engine (``PendingTask.job_type``) so a policy with a
    throughput table can prefer the models where this job runs fastest.
    """

    key: str
    request: GPURequest
    arrival_s: float
    duration_s: float
    durations: Mapping[str, float] = field(default_factory=dict)
    job_type: str | None = None

    def duration_on(self, models: Collection[str]) -> float:
        """Run time on devices of ``models``: the slowest of them (the plain duration if unknown)."""
        return max((self.durations.get(m, self.duration_s) for m in models), default=self.duration_s)


@dataclass(frozen=True, slots=True)
class JobRecord:
    """What happened to one started job."""

    key: str
    arrival_s: float
    start_s: float
    end_s: float
    shares: tuple[DeviceShare, ...]
    models: tuple[str, ...]

    @property
    def queue_delay_s(self) -> float:
        """Time from arrival to start."""
        return self.start_s - self.arrival_s

    @property
    def jct_s(self) -> float:
        """Job completion time: end − arrival."""
        return self.end_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    """Fleet state from ``t`` until the next point: milli-GPU in use and jobs waiting."""

    t: float
    used_milli: int
    waiting: int


@dataclass
class SimResult:
    """Outcome of one replay.

    Attributes:
        records: started jobs (finished ones have ``end_s`` ≤ ``end_time``).
        rejected: key → reason for jobs the engine said can never fit.
        unstarted: keys of arrived jobs still waiting when the run stopped.
        not_arrived: jobs whose arrival lies after the stop (``stop_after`` runs).
        timeline: piecewise-constant usage, one point per change.
        capacity_milli: total milli-GPU of the fleet.
        end_time: simulated time when the run stopped.
        place_calls / place_seconds: how often and how long :func:`place` ran (wall clock,
            including the genetic re-plans).
        replans / replans_improved: genetic re-plans run, and those that beat the greedy plan.
    """

    policy: str
    fleet: FleetSnapshot
    records: list[JobRecord]
    rejected: dict[str, str]
    unstarted: list[str]
    timeline: list[TimelinePoint]
    capacity_milli: int
    end_time: float
    not_arrived: int = 0
    place_calls: int = 0
    place_seconds: float = 0.0
    replans: int = 0
    replans_improved: int = 0
    quota: dict[str, Any] | None = None


def simulate(
    jobs: Sequence[SimJob],
    fleet: FleetSnapshot,
    policy: Policy,
    *,
    policy_name: str = "",
    round_s: float = 0.0,
    seed: int = 0,
    max_pending: int = 256,
    head_of_line: bool = False,
    stop_after: Collection[str] | None = None,
    replan_budget_ms: float = 0.0,
    replan_weights: tuple[float, float, float] = (1.0, 1.0, 0.1),
    replan_generations: int = 200,
    progress: bool = False,
    quota: QuotaPolicy | None = None,
) -> SimResult:
    """Replay ``jobs`` (any order; sorted by arrival here) on ``fleet`` under ``policy``.

    Args:
        round_s: 0 = schedule after every event batch; > 0 = only at multiples of ``round_s``.
        seed: base seed; pass ``k`` uses ``seed + k`` (for the random policy).
        max_pending: at most this many waiting jobs (oldest first) go to one :func:`place`
            call, like a batch scheduler's backfill depth; keeps passes bounded under overload.
        head_of_line: a strict FIFO queue: of one pass's plan, only the assignments of jobs
            ahead of the first job left waiting (in arrival order) start; the rest wait behind it.
        stop_after: stop as soon as every job with one of these keys has finished (arrivals
            keep coming until then, like Gavel's measurement window).
        replan_budget_ms: > 0 = after each greedy pass with at least two jobs offered, the
            genetic optimiser re-plans that batch from the greedy plan (as the executor does
            with ``[gpusched] replan_budget_ms``), never worse than greedy by its objective.
        replan_weights: the optimiser's (latency, fragmentation, energy) weights.
        replan_generations: the optimiser's generation cap (with the budget, whichever binds
            first; a cap that binds first makes a seeded replay deterministic).
        quota: tenant budgets and partitions to place with (the executor's quota state, built
            from the jobs started so far; None = unlimited). Genetic re-planning is skipped
            while a quota applies (the optimiser does not check quotas). The result's ``quota``
            reports each tenant's budget and use and each partition's share of GPU-hours.
        progress: a tqdm bar on stderr, counting arrivals — or, with ``stop_after``, the
            watched jobs that have finished (so it reaches 100 % when the run stops).

    Returns:
        A :class:`SimResult`; invariants (tested): no device is ever over-committed, a job
        starts at most once and never before it arrives.

    Raises:
        ConfigurationError: two jobs share a key, or a job's arrival or run time is not a
            finite number ≥ 0 (a NaN arrival would otherwise never be reached).
    """
    _check_jobs(jobs)
    ordered = sorted(jobs, key=lambda j: j.arrival_s)
    by_key = {j.key: j for j in ordered}
    # Physical milli-GPU: a MIG-enabled GPU counts through its slices, a slice by its share.
    capacity = sum(d.compute_milli for d in fleet.devices() if d.takes_work)
    watch = set(stop_after) if stop_after is not None else None
    snapshot = fleet
    pending: dict[str, PendingTask] = {}
    running: dict[str, RunningTask] = {}
    records: dict[str, JobRecord] = {}
    rejected: dict[str, str] = {}
    completions: list[tuple[float, int, str]] = []
    timeline: list[TimelinePoint] = [TimelinePoint(0.0, 0, 0)]
    used = 0
    nxt = 0
    seq = 0
    calls = 0
    replans = improved = 0
    spent = 0.0
    dirty = False
    sched_at = _INF
    t = ordered[0].arrival_s if ordered else 0.0
    bar = _bar(len(watch) if watch is not None else len(ordered), progress)
    tracker = sim_quota.QuotaTracker(quota, by_key, fleet)

    def mark(now: float) -> None:
        point = TimelinePoint(now, used, len(pending))
        if timeline[-1].t == now:
            timeline[-1] = point
        else:
            timeline.append(point)

    while True:
        if watch is not None and not watch:
            break
        na = ordered[nxt].arrival_s if nxt < len(ordered) else _INF
        nc = completions[0][0] if completions else _INF
        ns = sched_at if dirty and pending and used < capacity else _INF
        t = min(na, nc, ns)
        if t == _INF:
            break
        if nc <= t:
            freed: list[DeviceShare] = []
            while completions and completions[0][0] <= t:
                _, _, key = heapq.heappop(completions)
                task = running.pop(key)
                freed.extend(task.shares)
                used -= physical_milli(task.shares, fleet)
                if watch is not None and key in watch:
                    watch.discard(key)
                    if bar is not None:
                        bar.update(1)
            snapshot = snapshot.with_usage(freed, release=True)
            dirty = True
        elif na <= t:
            while nxt < len(ordered) and ordered[nxt].arrival_s <= t:
                job = ordered[nxt]
                pending[job.key] = PendingTask(job.key, job.request, job.arrival_s, job_type=job.job_type)
                nxt += 1
                if bar is not None and watch is None:
                    bar.update(1)
            dirty = True
        else:
            started = time.perf_counter()
            state = tracker.state_at(t)
            active = tuple(running.values())
            offered = tracker.offer(pending.values(), state, snapshot, active, t, max_pending)
            plan = place(
                offered,
                snapshot,
                policy,
                now=t,
                running=tuple(running.values()),
                seed=seed + calls,
                quota=state,
            )
            if replan_budget_ms > 0 and len(offered) >= 2 and not state.enforced:
                from gpusched.placement.genetic import optimise_with_report

                report = optimise_with_report(
                    offered,
                    snapshot,
                    policy,
                    now=t,
                    running=tuple(running.values()),
                    budget_ms=replan_budget_ms,
                    weights=replan_weights,
                    seed=seed + calls,
                    greedy=plan,
                    max_generations=replan_generations,
                )
                plan = report.plan
                replans += 1
                improved += int(report.improved)
            spent += time.perf_counter() - started
            calls += 1
            taken: list[DeviceShare] = []
            assignments = _blocking_prefix(plan, offered) if head_of_line else plan.assignments
            for a in assignments:
                job = by_key[a.key]
                del pending[a.key]
                models = tuple(sorted({snapshot.device(s.uuid).model for s in a.shares}))
                end = t + job.duration_on(models)
                records[a.key] = JobRecord(a.key, job.arrival_s, t, end, a.shares, models)
                tracker.started(records[a.key])
                hint = job.request.expected_duration_s
                running[a.key] = RunningTask(a.key, job.request, a.shares, t, t + hint if hint else None)
                heapq.heappush(completions, (end, seq, a.key))
                seq += 1
                taken.extend(a.shares)
                used += physical_milli(a.shares, fleet)
            for r in plan.rejections:
                if r.permanent:
                    rejected[r.key] = r.reason
                    del pending[r.key]
                    if watch is not None and r.key in watch:
                        watch.discard(r.key)
                        if bar is not None:
                            bar.update(1)
            snapshot = snapshot.with_usage(taken)
            dirty = False
        mark(t)
        sched_at = math.ceil(t / round_s) * round_s if round_s > 0 else t
    if bar is not None:
        bar.close()
    end_time = t if t != _INF else timeline[-1].t
    return SimResult(
        policy=policy_name or str(getattr(policy, "name", policy)),
        fleet=fleet,
        records=sorted(records.values(), key=lambda r: (r.start_s, r.key)),
        rejected=rejected,
        unstarted=list(pending),
        not_arrived=len(ordered) - nxt,
        timeline=timeline,
        capacity_milli=capacity,
        end_time=end_time,
        place_calls=calls,
        place_seconds=spent,
        replans=replans,
        replans_improved=improved,
        quota=None if quota is None else sim_quota.report(quota, records, by_key, fleet, end_time),
    )


def _check_jobs(jobs: Sequence[SimJob]) -> None:
    seen: set[str] = set()
    for job in jobs:
        if job.key in seen:
            raise ConfigurationError(f"simulate: job key {job.key!r} appears twice; make the ids unique")
        seen.add(job.key)
        times = (job.arrival_s, job.duration_s, *job.durations.values())
        # Run times may be inf (a model the job cannot run on), never NaN or negative.
        if not math.isfinite(job.arrival_s) or any(math.isnan(t) or t < 0 for t in times):
            raise ConfigurationError(
                f"simulate: job {job.key!r} has arrival {job.arrival_s!r} s and run time "
                f"{job.duration_s!r} s; both must be numbers ≥ 0 (the arrival finite)"
            )


def _blocking_prefix(plan: PlacementPlan, offered: Sequence[PendingTask]) -> tuple[Assignment, ...]:
    """The plan's assignments for the jobs before the first one it leaves waiting (queue order).

    Dropping the later ones is safe: a subset of a non-double-booking plan does not double-book.
    """
    by_key = {a.key: a for a in plan.assignments}
    waiting = {r.key for r in plan.rejections if not r.permanent}
    kept = []
    for task in offered:
        if task.key in waiting:
            break
        if task.key in by_key:
            kept.append(by_key[task.key])
    return tuple(kept)


def _bar(total: int, enabled: bool):  # type: ignore[no-untyped-def]
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="job", file=sys.stderr, desc="simulate", mininterval=1.0)


def with_expected_durations(jobs: Sequence[SimJob]) -> list[SimJob]:
    """The jobs with ``request.expected_duration_s`` set to their true run time (oracle estimates)."""
    return [
        replace(j, request=replace(j.request, expected_duration_s=max(1, math.ceil(j.duration_s))))
        for j in jobs
    ]
