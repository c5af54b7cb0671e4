"""Discrete-event replay of a job trace on a fleet, driving the executors' scheduling cycle.

Events are arrivals, completions and scheduling passes. A scheduling pass is one cycle of
:func:`gpusched.scheduler.cycle.decide` — the function both executors call — with one
``CycleRequest``: the waiting jobs, the current :class:`~gpusched.model.FleetSnapshot`, the
running jobs and the quota state the executor would have (``scheduler.quota``); every launch starts
at once and finishes after the job's run time *on the model it got* (the slowest device's model
for a multi-device job). Without ``preemption`` a started job keeps its devices until it ends;
with it, the executor's victim selection may stop lower-priority jobs, or the migration rule move
jobs between GPU types (:mod:`gpusched.sim.preempt`). With a quota, the executor's over-budget
check (:mod:`gpusched.sim.overbudget`) is an event too: ``over_budget = stop`` stops a tenant's
running jobs at the first check after its use reaches its budget; held jobs are reconsidered when a
budget period begins. A stopped job (preempted or at its budget) goes back to the queue; its
record's ``segments`` are its runs.

Two timing modes: ``round_s == 0`` schedules after every batch of simultaneous events;
``round_s > 0`` schedules only at round boundaries (Gavel's 360 s rounds) when something changed.
Same-instant order: completions, then arrivals, then the pass.
"""

from __future__ import annotations

import heapq
import itertools
import math
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import TypeVar

from gpusched.durations import DurationModel, FinishedRun
from gpusched.durations.service import gpu_seconds
from gpusched.extras import lab_module
from gpusched.gang import GangMember
from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.placement import PendingTask, Policy, RunningTask
from gpusched.placement.warm import WarmPlacement
from gpusched.placement.workload import SteadyWorkload
from gpusched.quota.policy import QuotaPolicy, physical_milli
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import CycleRequest, PendingWork, cycle_policy
from gpusched.scheduler.durations import less_saved, request_left
from gpusched.scheduler.preemption import Preemptions, after_launches
from gpusched.scheduler.quota import BoundedBatch, quota_at
from gpusched.scheduler.service import service_indices, service_ranked
from gpusched.scheduler.store import InMemoryStore
from gpusched.sim import quota as sim_quota
from gpusched.sim.durations import OnlineDurations
from gpusched.sim.overbudget import SimOverBudget
from gpusched.sim.preempt import SimPreemption
from gpusched.sim.results import JobRecord, SimResult, TimelinePoint
from gpusched.sim.service import OnlineService
from gpusched.sim.simjob import SimJob, check_jobs, with_expected_durations

__all__ = ["JobRecord", "SimJob", "SimResult", "TimelinePoint", "simulate", "with_expected_durations"]

_INF = float("inf")
_Job = TypeVar("_Job", PendingWork, PendingTask, RunningTask)


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
    preemption: SimPreemption | None = None,
    predict_durations: DurationModel | None = None,
    duration_history: Sequence[FinishedRun] = (),
    over_budget: SimOverBudget | None = None,
    workload_drift: float = 0.1,
    node_losses: Sequence[tuple[float, str, float | None]] = (),
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
        preemption: the executor's victim selection after each pass
            (:class:`~gpusched.sim.preempt.SimPreemption`); None = non-preemptive. A stopped job
            counts as using devices only while it runs (``JobRecord.segments``) and, restarted,
            is committed only the remaining part of its expected duration.
        over_budget: with ``quota``, what happens to running work whose tenant crosses its hard
            budget (:class:`~gpusched.sim.overbudget.SimOverBudget`, ``[gpusched] over_budget``:
            ``finish``, the default, or ``stop``: stopped and requeued at the executor's next
            check, losing the work since its last checkpoint); reported in ``quota.over_budget``.
        predict_durations: jobs without ``expected_duration_s`` get the executor's prediction
            (:mod:`gpusched.durations`), learnt online from the jobs finished so far after
            ``duration_history``; the result's ``durations`` gives the counts and errors.
            ``SimPreemption("service")`` learns its run-time distributions the same way (from
            ``duration_history`` and the jobs finished so far) and orders the queue by their
            Gittins index (:mod:`gpusched.sim.service`).
        workload_drift: ``[gpusched] workload_drift`` (0.1, the default): a policy that names no
            workload scores by the kept estimate of the waiting and running requests
            (:func:`~gpusched.scheduler.cycle.cycle_policy`, as the executors do).
        node_losses: ``(lost_at, node, back_at)``: at ``lost_at`` the scheduler finds ``node``'s
            GPU host lost (the executors: its heartbeat older than ``host_timeout_seconds``): the
            jobs running there stop (each keeps the work up to its last checkpoint) and go back to
            the queue as their retry, and the node takes no work until ``back_at`` (None: never).
        progress: a tqdm bar on stderr, counting arrivals — or, with ``stop_after``, the
            watched jobs that have finished (so it reaches 100 % when the run stops); every few
            seconds it also shows the replay's day and the jobs waiting and running, so the
            drain after the last arrival shows progress too.

    Returns:
        A :class:`SimResult`; invariants (tested): no device is ever over-committed, a job
        starts at most once and never before it arrives.

    Raises:
        ConfigurationError: two jobs share a key, or a job's arrival or run time is not a
            finite number ≥ 0 (a NaN arrival would otherwise never be reached).
    """
    check_jobs(jobs)
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
    run_seq: dict[str, int] = {}  # key -> seq of its current run (older completions are stale)
    first_start: dict[str, float] = {}
    full_run: dict[str, float] = {}  # key -> run time of all its work on the models it runs on
    preempt = preemption or SimPreemption()
    budget_rule = over_budget or SimOverBudget()
    runs: dict[str, list[tuple[float, float, tuple[DeviceShare, ...]]]] = {}  # key -> its stopped runs
    saved: dict[str, float] = {}  # key -> seconds of work its stopped runs kept (> 0 only)
    # key -> GPU-seconds its stopped runs held, as the executors read it from the ledger for
    # ``CycleRequest.attained_gpu_s`` (mode service only)
    attained: dict[str, float] = {}
    works: dict[str, tuple[PendingTask, PendingWork]] = {}  # key -> its pending work, while its task stands
    lefts: dict[str, tuple[PendingWork, float, PendingWork]] = {}  # key -> (work, saved s, what is left)
    ranks: dict[str, tuple[PendingWork, PendingWork]] = {}  # key -> (work, as ranked last pass)
    views: dict[str, tuple[PendingTask, float, PendingTask]] = {}  # key -> (task, saved s, what is left)
    busy_left: dict[str, tuple[RunningTask, float, RunningTask]] = {}  # the same for running jobs
    check_at = _INF  # next over-budget check or period reset
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
    shown = time.monotonic()
    names = {j.key: j.job_type for j in ordered}  # a job's task name: its trace job type
    online = OnlineDurations(predict_durations, duration_history, names) if predict_durations else None
    # preemption "service": queue order and victims by the Gittins index of attained service
    service = OnlineService(duration_history, names=names) if preempt.mode == "service" else None
    pass_policy = service.policy(policy) if service is not None else policy
    store = InMemoryStore(fleet)  # the allocations, as the executors' ledger holds them
    window = BoundedBatch(quota, fleet)
    warm = WarmPlacement()  # the engine kept between passes, as the executors keep theirs
    kept = SteadyWorkload(workload_drift)
    preemptions = Preemptions(preempt.rules())  # victims' notice, grace, held room, first pick
    in_gangs = frozenset(j.key for j in ordered if j.gang is not None)  # never victims (as in the executors)
    host_events = sorted([(at, node, False) for at, node, _ in node_losses]
                         + [(back, node, True) for _, node, back in node_losses if back is not None])
    down: set[str] = set()  # nodes of lost hosts: no work until they are back
    move_at = 0.0  # mode migrate: the next run of the migration rule (the executor's first tick runs it)

    def requeue(key: str, now: float, *, preempted: bool = True,
                reason: str = "stopped: over budget") -> float:
        """Stop ``key``'s run at ``now`` and put it back in the queue; the GPU-seconds it lost."""
        nonlocal snapshot, used
        stopped = running.pop(key)
        if online is not None:
            online.ended(key)
        lost = preempt.evict(stopped, full_run[key], now, fleet, preempted=preempted)
        if preempt.ran.get(key, 0.0) > 0:
            saved[key] = preempt.ran[key]
        if service is not None:
            attained[key] = gpu_seconds(by_key[key].request, preempt.served_s[key])
        runs.setdefault(key, []).append((stopped.started_at, now, stopped.shares))
        del run_seq[key], records[key]
        store.release(key, reason="preempted" if preempted else reason, now=now)
        job = by_key[key]
        pending[key] = PendingTask(key, job.request, job.arrival_s, job_type=job.job_type)
        snapshot = snapshot.with_usage(stopped.shares, release=True)
        used -= physical_milli(stopped.shares, fleet)
        return lost

    def start(key: str, shares: tuple[DeviceShare, ...], now: float, asked: GPURequest) -> None:
        """Start waiting job ``key`` on ``shares`` at ``now`` (``asked``: its request as the pass
        placed it, with a predicted duration); the caller takes the shares in the snapshot."""
        nonlocal seq, used
        job = by_key[key]
        base = pending.pop(key).request  # what it asks without a prediction (re-predicted each pass)
        for made in (works, lefts, ranks, views):  # a requeued job is a new task
            made.pop(key, None)
        models = tuple(sorted({fleet.device(s.uuid).model for s in shares}))
        full_run[key] = job.duration_on(models)
        end = now + preempt.restart_delay(key) + full_run[key] * preempt.remaining(key)
        earlier = runs.get(key, [])
        records[key] = JobRecord(key, job.arrival_s, first_start.get(key, now), end, shares, models,
                                 preempt.times.get(key, 0),
                                 (*earlier, (now, end, shares)) if earlier else ())
        store.allocate(key, job.request, shares, now=now)
        if online is not None and key not in first_start:
            online.started(key, asked, full_run[key])
        given = base.expected_duration_s
        running[key] = RunningTask(key, base, shares, now, now + given if given else None)
        first_start.setdefault(key, now)
        heapq.heappush(completions, (end, seq, key))
        run_seq[key] = seq
        seq += 1
        used += physical_milli(shares, fleet)

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
        wanted = len(pending) > 0 and (used < capacity or preempt.enabled)
        ns = sched_at if dirty and wanted else _INF
        nd = preemptions.next_deadline()  # a victim's grace runs out
        nm = max(move_at, t) if preempt.migrates and running else _INF  # the migration rule's interval
        nh = host_events[0][0] if host_events else _INF
        t = min(na, nc, ns, check_at, nd, nm, nh)
        if t == _INF:
            break
        if nc <= t:
            freed: list[DeviceShare] = []
            while completions and completions[0][0] <= t:
                _, done_seq, key = heapq.heappop(completions)
                if run_seq.get(key) != done_seq:
                    continue  # a run that was preempted
                task = running.pop(key)
                freed.extend(task.shares)
                if online is not None:
                    online.ended(key)
                store.release(key, reason="task succeeded", now=t, succeeded=True)
                if online is not None:
                    online.finished(by_key[key], full_run[key])
                if service is not None:
                    service.finished(by_key[key], full_run[key])
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
        elif nh <= t:  # a GPU host is found lost (or comes back)
            while host_events and host_events[0][0] <= t:
                _, node, back = host_events.pop(0)
                if back:
                    down.discard(node)
                    continue
                down.add(node)
                for key in [k for k, r in running.items() if any(s.node == node for s in r.shares)]:
                    requeue(key, t, preempted=False, reason=f"GPU host {node} lost; retried")
            snapshot = _without(snapshot, down, fleet)
            dirty = True
        elif nd <= t:  # victims whose grace ran out stop (simulated jobs never checkpoint on notice)
            for eviction in preemptions.due(t, lambda key: None):
                if eviction.victim in running:
                    requeue(eviction.victim, t)
            preemptions.forget_ended(running)
            dirty = True
        elif check_at <= t:  # the executor's over-budget check (or a budget period starts)
            state = quota_at(quota, store, fleet, t)
            for key in budget_rule.over(state, ((k, r.request.tenant) for k, r in running.items()), t):
                lost = requeue(key, t, preempted=False)
                budget_rule.stopped(key, lost)
            dirty = True
        elif ns <= t:
            started = time.perf_counter()
            state = quota_at(quota, store, fleet, t)
            busy = tuple(running.values())
            if online is not None:  # the executors' rewrite: predicted durations where none given
                online.refresh(t)
                busy = online.running(busy)
            view = (p if p.key not in saved else _left_task(views, p, saved[p.key]) for p in pending.values())
            offered = window.offer(view, state, snapshot, busy, t, max_pending, predicted=online is not None)
            as_offered = {o.key: o for o in offered}
            work = tuple(_work(works, pending[o.key], by_key[o.key].gang) for o in offered)
            if online is not None:
                work = online.pending(work)
            # What is left of each job: estimates less the work its earlier runs saved (the executors'
            # rule), so placement expects its end and the budget gate charges only the rest.
            work, busy = _less_saved(lefts, busy_left, work, busy, saved)
            if service is not None:  # each job's work as ranked last pass: re-ranked only if its rank moved
                asked, work = work, tuple(_ranked_before(ranks, w) for w in work)
            # Every waiting request (also those the quota keeps from this pass), as the executors
            # count; read only by a policy that scores by an estimated workload.
            mix = itertools.chain((p.request for p in pending.values()),
                                  (r.request for r in running.values()))
            now_policy = cycle_policy(pass_policy, kept, mix)
            preemptions.forget_ended(running)
            cycle = preemptions.hold_nominated(CycleRequest(
                pending=work, snapshot=snapshot, policy=now_policy, running=busy, now=t, quota=state,
                seed=seed + calls,
                replan_budget_ms=replan_budget_ms, replan_weights=replan_weights,
                replan_generations=replan_generations, strict_fifo=head_of_line, engine=warm,
                attained_gpu_s=MappingProxyType(attained),
            ), running)
            if service is not None:  # mode service: the queue by Gittins index
                cycle = service_ranked(cycle, service)
                ranks.update((w.key, (w, r)) for w, r in zip(asked, cycle.pending, strict=True))
            reply = preemptions.decide(cycle)
            replans += int(reply.replanned)
            improved += int(reply.replan_improved)
            spent += time.perf_counter() - started
            calls += 1
            taken: list[DeviceShare] = []
            again = False

            for launch in reply.launches:
                start(launch.key, launch.shares, t, launch.request)
                taken.extend(launch.shares)
            if preempt.enabled and not preempt.migrates:
                held = [as_offered[h.key] for h in reply.holds if not h.permanent and not h.queued_behind]
                indices = None if service is None or not held else service_indices(
                    after_launches(cycle, reply), service, {w.key for w in held})
                facts = preempt.facts(running, t, in_gangs.intersection(running), indices)
                # The victims stop when their grace ends. An executor runs its next cycle a
                # heartbeat later, where the next held work may get victims: the replay passes again now.
                _, begun = preemptions.consider(cycle, reply, facts)
                again = begun is not None
            for hold in reply.holds:
                if hold.permanent:
                    rejected[hold.key] = hold.reason
                    del pending[hold.key]
                    if watch is not None and hold.key in watch:
                        watch.discard(hold.key)
                        if bar is not None:
                            bar.update(1)
            snapshot = snapshot.with_usage(taken)
            dirty = again
            if bar is not None and time.monotonic() - shown > 5.0:  # alive also after the last arrival
                shown = time.monotonic()
                # running counts jobs; busy is the share of the fleet's GPU capacity they hold
                bar.set_postfix(day=f"{t / 86400:.2f}", waiting=len(pending), running=len(running),
                                busy=f"{100 * used / max(capacity, 1):.0f}%")
        else:  # mode migrate: the executor's migration rule, every horizon_s while anything runs
            types = {k: by_key[k].job_type for k in running}
            state = quota_at(quota, store, fleet, t)
            for move in preempt.migrations(snapshot, running, policy, t, state, types):
                requeue(move.key, t)  # it checkpoints on notice and restarts on the target
                start(move.key, tuple(move.placement), t, pending[move.key].request)
                snapshot = snapshot.with_usage(move.placement)
            move_at = t + preempt.horizon_s
        mark(t)
        sched_at = math.ceil(t / round_s) * round_s if round_s > 0 else t
        if quota is not None:
            check_at = budget_rule.next_reset(quota, t) if pending else _INF
            if budget_rule.stops_work and running:
                crossing = budget_rule.next_check(quota_at(quota, store, fleet, t), store.rates(running), t)
                check_at = min(check_at, crossing)
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
        quota=None if quota is None else {**sim_quota.report(quota, records, by_key, fleet, end_time),
                                          "over_budget": budget_rule.report()},
        preemption=({**preempt.report(), **({"service": service.report()} if service else {})}
                    if preempt.enabled else None),
        durations=None if online is None else online.report(),
    )


def _without(snapshot: FleetSnapshot, down: Collection[str], fleet: FleetSnapshot) -> FleetSnapshot:
    """``snapshot`` showing the nodes of ``fleet`` except those in ``down`` (lost hosts), as the
    ledger's snapshot leaves out the nodes of lost hosts; the usage is kept."""
    nodes = tuple(n for n in fleet.nodes if n.name not in down)
    if len(nodes) == len(snapshot.nodes) and all(a is b for a, b in zip(nodes, snapshot.nodes, strict=True)):
        return snapshot
    return FleetSnapshot(nodes, snapshot.usage, snapshot.source, snapshot.taken_at)


def _work(works: dict[str, tuple[PendingTask, PendingWork]], task: PendingTask,
          gang: GangMember | None) -> PendingWork:
    """The scheduling cycle's pending work for a replay's waiting job (``gang``: its gang
    membership); the same object every pass while the job's task is the same (``works``: the
    ones made so far), so the rewrites cached per job recognise it."""
    made = works.get(task.key)
    if made is not None and made[0] is task:
        return made[1]
    work = PendingWork(task.key, task.request, task.submitted_at, gang=gang, rank=task.rank,
                       job_type=task.job_type, cpu_milli=task.cpu_milli,
                       host_memory_bytes=task.host_memory_bytes)
    works[task.key] = (task, work)
    return work


def _ranked_before(ranks: Mapping[str, tuple[PendingWork, PendingWork]], work: PendingWork) -> PendingWork:
    """``work`` as the last pass ranked it, if it is the same work (ranking gives it this pass's
    rank either way; an unchanged rank then keeps the object)."""
    hit = ranks.get(work.key)
    return hit[1] if hit is not None and hit[0] is work else work


def _less_saved(
    lefts: dict[str, tuple[PendingWork, float, PendingWork]],
    busy_left: dict[str, tuple[RunningTask, float, RunningTask]],
    work: Sequence[PendingWork], busy: Sequence[RunningTask], saved: Mapping[str, float],
) -> tuple[tuple[PendingWork, ...], tuple[RunningTask, ...]]:
    """The executors' :func:`~gpusched.scheduler.durations.less_saved`, its result for each job
    kept while the job's work (or running task) and saved seconds stand (``lefts``,
    ``busy_left``), so a job's work is the same object from pass to pass."""
    out = tuple(_kept(lefts, w, saved.get(w.key, 0.0), lambda w, s: less_saved((w,), (), {w.key: s})[0][0])
                for w in work)
    running = tuple(_kept(busy_left, r, saved.get(r.key, 0.0),
                          lambda r, s: less_saved((), (r,), {r.key: s})[1][0]) for r in busy)
    return out, running


def _left_task(views: dict[str, tuple[PendingTask, float, PendingTask]], task: PendingTask,
               kept: float) -> PendingTask:
    """``task`` as what is left after ``kept`` seconds of saved work, for the offer's budget
    check (kept while the task and its saved seconds stand, ``views``)."""
    return _kept(views, task, kept, lambda t, s: replace(t, request=request_left(t.request, s)))


def _kept(made: dict[str, tuple[_Job, float, _Job]], job: _Job, saved_s: float,
          less: Callable[[_Job, float], _Job]) -> _Job:
    """``less(job, saved_s)``: ``job`` less ``saved_s`` seconds of saved work (itself when none),
    the same object while ``job`` and ``saved_s`` stand (``made``: the ones made so far)."""
    if saved_s <= 0:
        return job
    hit = made.get(job.key)
    if hit is None or hit[0] is not job or hit[1] != saved_s:
        hit = made[job.key] = (job, saved_s, less(job, saved_s))
    return hit[2]


def _bar(total: int, enabled: bool):  # type: ignore[no-untyped-def]
    if not enabled:
        return None
    return lab_module("tqdm").tqdm(total=total, unit="job", file=sys.stderr, desc="simulate", mininterval=1.0)
