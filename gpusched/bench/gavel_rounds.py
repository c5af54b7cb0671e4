"""Gavel's paper-era FIFO baseline, re-implemented to calibrate the Gavel benchmark (not a gpusched policy).

``gpusched bench gavel --policy gavel-fifo`` replays a continuous-single stream through the
mechanics of Gavel's base-mode FIFO as its simulator ran it for the OSDI'20 paper (commit
1f6f02e: ``scheduler/policies/fifo.py`` and ``scheduler.py`` ``simulate()``), written here from
reading that code. It exists so that the benchmark's published baseline (Gavel FIFO 18.32 h at
2.0 jobs/h, 25.38 h at 4.0) can be checked against a replay of the same mechanics on the same
jobs; nothing in gpusched schedules this way, and the executor never calls it.

Mechanics reproduced (pure function over the job list; no I/O):

* **Rounds.** Work starts at round boundaries; each scheduled job runs ``min(⌊speed·round⌋,
  remaining)`` steps, and the round ends when the last job of it does (at most ``round_s``).
  With nothing running, time jumps to the next arrival; arrivals join at the next boundary.
* **Allocation updates.** The FIFO allocation (job → one GPU type) is recomputed only when a job
  arrived or finished *and* at least ``reset_s`` (1,920 s) have passed since the last one (or
  no update happened after time 0). A job that arrived since has no allocation and waits, and a
  GPU freed mid-interval stays idle until the next update.
* **Type binding.** A job keeps its type until it completes. At an update, each completed job's
  type goes to the head of the queue when that type still counts a free worker *in the scan so
  far* (the scan subtracts running jobs in job-id order). Then jobs are taken in arrival order;
  a random index among the types with a free worker is drawn (``random.Random(seed)``), but the
  job is bound to the type left in the scan's loop variable — the alphabetically last type still
  listed (``v100`` before ``p100`` before ``k80``). When that type's count reaches zero the
  *randomly drawn* entry is removed from the list; if that was not the exhausted type, it stays
  listed at zero and every later job of that update is bound to it (over-subscription).
* **Time sharing.** Each round, the jobs bound to a type run in order of priority = allocation
  ÷ (the job's time on that type ÷ the type's total time since the last update, both starting at
  half a round per job), ties by deficit, then job id; at most as many as the type has workers.
  Over-bound jobs thus take turns (a job out of turn keeps its progress; Gavel charges no
  restart cost) while other types' workers may be idle.

Returns each finished job's completion time; JCT = completion − arrival, as Gavel's
``get_average_jct``. One addition for finite job lists (Gavel's streams never run dry): when
nothing runs and nothing more arrives, time moves to the next allowed allocation update.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from gpusched.errors import ConfigurationError

__all__ = ["RESET_S", "GavelFifoResult", "RoundJob", "gavel_fifo_replay"]

RESET_S = 1920.0
"""Gavel's ``minimum_time_between_allocation_resets`` default (its continuous-job sweeps keep it)."""


@dataclass(frozen=True, slots=True)
class RoundJob:
    """One single-GPU job: ``steps`` to run at ``speed[type]`` steps/s on each GPU type."""

    key: str
    arrival_s: float
    steps: float
    speed: Mapping[str, float]


@dataclass(slots=True)
class GavelFifoResult:
    """Finish time per completed job, and counters that show the mechanics at work."""

    finished: dict[str, float] = field(default_factory=dict)
    bound_type: dict[str, str] = field(default_factory=dict)
    rounds: int = 0
    updates: int = 0
    oversubscribed_updates: int = 0  # updates that left a type bound to more jobs than it has
    idle_worker_rounds: int = 0  # Σ over rounds of workers idle while some job waited
    end_s: float = 0.0


@dataclass(slots=True)
class _Active:
    job: RoundJob
    done: float = 0.0
    time_on: dict[str, float] = field(default_factory=dict)


def gavel_fifo_replay(
    jobs: Sequence[RoundJob],
    workers: Mapping[str, int],
    *,
    stop_after: Collection[str],
    round_s: float = 360.0,
    reset_s: float = RESET_S,
    seed: int = 0,
    oversubscribe: bool = True,
    progress: Callable[[float, int], None] | None = None,
) -> GavelFifoResult:
    """Replay ``jobs`` (in arrival order) on ``workers`` (type → GPUs) until every key in
    ``stop_after`` has finished. Raises ConfigurationError for an empty fleet, a job with no
    positive speed, or a ``stop_after`` key that is not a job.

    For ablations: ``oversubscribe=False`` removes the exhausted type from the list (what the
    random draw's code meant) instead of the drawn entry; ``reset_s=0`` updates the allocation at
    every round where a job arrived or finished."""
    types = sorted(workers)
    if not types or any(workers[t] <= 0 for t in types):
        raise ConfigurationError("gavel-fifo needs at least one GPU of every listed type; "
                                 "fix the worker counts")
    keys = {j.key for j in jobs}
    missing = set(stop_after) - keys
    if missing:
        raise ConfigurationError(f"gavel-fifo: {len(missing)} jobs to measure are not in the trace "
                                 f"(e.g. {sorted(missing)[0]!r}); pick a --measure range inside it")
    for j in jobs:
        if not all(j.speed.get(t, 0.0) > 0 for t in types) or j.steps <= 0:
            raise ConfigurationError(f"gavel-fifo: job {j.key!r} lacks a positive speed on every type "
                                     "or has no steps; use Gavel's throughput table")
    out = GavelFifoResult()
    rng = random.Random(seed)
    half = round_s / 2.0
    active: dict[str, _Active] = {}  # insertion (= arrival) order, as Gavel's priority dicts
    order = {j.key: n for n, j in enumerate(jobs)}
    bound: dict[str, str] = {}  # the policy's persistent binding (completed jobs until the next update)
    allocation: dict[str, str] = {}  # the scheduler's copy: what the rounds obey
    deficit: dict[str, dict[str, float]] = {t: {} for t in types}
    worker_time = dict.fromkeys(types, 0.0)
    need_update, last_reset = False, 0.0
    left = set(stop_after)
    running: list[tuple[float, str, str, float]] = []  # finish, key, type, steps
    round_start, round_end = 0.0, None
    arriving = 0
    now = jobs[0].arrival_s if jobs else 0.0
    while left:
        if running:
            latest = max(r[0] for r in running)
            if round_end is not None:
                round_start = round_end
            round_end = now = latest
        elif arriving < len(jobs):
            now = jobs[arriving].arrival_s
        elif active:  # a finite trace ran dry: the waiting jobs start at the next allowed update
            now = max(now, last_reset + reset_s)
        else:
            break
        for finish, key, t, steps in running:
            state = active[key]
            spent = finish - round_start
            state.done += steps
            state.time_on[t] += spent
            worker_time[t] += spent
            if state.done >= state.job.steps:
                out.finished[key] = finish
                out.bound_type[key] = t
                left.discard(key)
                del active[key]
                for t2 in types:
                    deficit[t2].pop(key, None)
                need_update = True
        running = []
        while arriving < len(jobs) and jobs[arriving].arrival_s <= now:
            job = jobs[arriving]
            active[job.key] = _Active(job, time_on=dict.fromkeys(types, half))
            for t in types:
                deficit[t][job.key] = 0.0
            arriving += 1
            need_update = True
        if need_update and (now - last_reset >= reset_s or last_reset == 0):
            _reset_accounting(active, allocation, deficit, worker_time, types, now - last_reset, half)
            last_reset = now
            allocation = _fifo_allocate(active, bound, workers, order, rng, oversubscribe)
            need_update = False
            out.updates += 1
            counts = {t: sum(1 for b in allocation.values() if b == t) for t in types}
            out.oversubscribed_updates += any(counts[t] > workers[t] for t in types)
        waiting = len(active)
        for t in types:
            mine = [k for k in active if allocation.get(k) == t]
            total = worker_time[t]
            ranked = sorted(
                mine,
                key=lambda k: (1.0 / (active[k].time_on[t] / total) if total > 0 else 1e9, deficit[t][k]),
                reverse=True,
            )
            for key in ranked[: workers[t]]:
                state = active[key]
                speed = state.job.speed[t]
                steps = min(float(int(speed * round_s)), state.job.steps - state.done)
                running.append((now + steps / speed, key, t, steps))
            waiting -= min(len(mine), workers[t])
        idle = sum(workers.values()) - len(running)
        if waiting > 0 and idle > 0:
            out.idle_worker_rounds += idle
        out.rounds += 1
        if progress is not None and out.rounds % 2000 == 0:
            progress(now, len(left))
    out.end_s = now
    return out


def _reset_accounting(
    active: Mapping[str, _Active],
    allocation: Mapping[str, str],
    deficit: dict[str, dict[str, float]],
    worker_time: dict[str, float],
    types: Sequence[str],
    elapsed: float,
    half: float,
) -> None:
    """Gavel's reset of time run so far: the deficit grows by (allocated share · elapsed − time
    received), every job's time restarts at half a round, a type's total at the sum of those."""
    for t in types:
        worker_time[t] = 0.0
        for key, state in active.items():
            should = elapsed if allocation.get(key) == t else 0.0
            deficit[t][key] = deficit[t].get(key, 0.0) + should - (state.time_on[t] - half)
            state.time_on[t] = half
            worker_time[t] += half


def _fifo_allocate(
    active: Mapping[str, _Active],
    bound: dict[str, str],
    workers: Mapping[str, int],
    order: Mapping[str, int],
    rng: random.Random,
    oversubscribe: bool,
) -> dict[str, str]:
    """Base-mode FIFO's allocation update (see the module docstring); mutates ``bound``."""
    free = dict(workers)
    queue = sorted((k for k in active if k not in bound), key=order.__getitem__)
    for key in sorted(bound, key=order.__getitem__):
        t = bound[key]
        if key in active:
            free[t] -= 1
            continue
        if queue and free[t] >= 1:  # the completed job's type goes to the head of the queue
            bound[queue.pop(0)] = t
            free[t] -= 1
        del bound[key]
    listed = sorted(t for t in free if free[t] > 0)
    while queue and listed:
        key = queue.pop(0)
        with_room = [i for i, t in enumerate(listed) if free[t] >= 1]
        if not with_room:
            break
        drawn = rng.randrange(len(with_room))
        t = listed[-1]  # the scan's loop variable, not the drawn type
        bound[key] = t
        free[t] -= 1
        if free[t] == 0:
            listed.pop(with_room[drawn] if oversubscribe else len(listed) - 1)
    return {k: bound[k] for k in active if k in bound}
