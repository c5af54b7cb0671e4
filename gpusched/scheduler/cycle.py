"""One scheduling cycle, as a pure decision: ``decide(CycleRequest) -> CycleReply``.

Input, in one :class:`CycleRequest` (as Ray autoscaler v2's ``SchedulingRequest``): the GPU work
waiting (in an executor, its requests already rewritten by the fault chain's overrides), the
fleet snapshot from the store, the tasks already holding devices, the policy, the clock and the
re-planning budget. Output, one :class:`CycleReply`: which work to launch (with its shares and
task environment) and which to hold (with the reason the UI shows). Every driver calls it: the
executors do the I/O around it (:mod:`gpusched.airflow.gpu_scheduling`), the simulator replays a
trace through it (:mod:`gpusched.sim.engine`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from gpusched.errors import PlacementError
from gpusched.gang import GangMember
from gpusched.hardware.envexport import devices_env
from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.placement import (
    Assignment,
    Chooser,
    PendingTask,
    PlacementPlan,
    PlacementRequest,
    Policy,
    Rejection,
    RunningTask,
    place,
)
from gpusched.placement.admission import QuotaGate
from gpusched.placement.genetic import optimise_with_report
from gpusched.placement.patience import hold_for_faster
from gpusched.placement.workload import SteadyWorkload
from gpusched.quota.policy import QuotaState, physical_milli
from gpusched.records import AllocationStatus
from gpusched.request import GPURequest
from gpusched.scheduler.gangs import has_standby, membership, place_gang, standby_note

__all__ = [
    "CycleReply", "CycleRequest", "Hold", "Launch", "PendingWork", "PlacementEngine", "RunningTasks",
    "cycle_policy", "decide", "quota_admitted", "running_tasks",
]


@dataclass(frozen=True, slots=True)
class PendingWork:
    """A GPU workload waiting in the executor.

    ``gang``: this work is one member (one node) of a multi-node gang. ``existing`` holds the
    shares of an allocation the ledger already has under ``key`` (a workload queued again after a
    scheduler restart): it is launched on them, not placed anew. ``rank``: its queue key under
    ``QueueOrder.RANKED`` (``preemption = service``: −log2 of its Gittins index). ``job_type``:
    the row of the policy's throughput table (None: the request's own ``job_type``);
    ``cpu_milli`` / ``host_memory_bytes``: host CPU and RAM it needs besides its GPUs (0: not
    checked; trace replays give them, Airflow tasks do not).
    """

    key: str
    request: GPURequest
    submitted_at: float
    existing: tuple[DeviceShare, ...] = ()
    gang: GangMember | None = None
    rank: float = 0.0
    job_type: str | None = None
    cpu_milli: int = 0
    host_memory_bytes: int = 0
    _task: PendingTask | None = field(default=None, init=False, repr=False, compare=False)

    def with_rank(self, rank: float) -> PendingWork:
        """This work with queue key ``rank`` (itself when it has that rank already)."""
        if rank == self.rank:
            return self
        return PendingWork(self.key, self.request, self.submitted_at, self.existing, self.gang, rank,
                           self.job_type, self.cpu_milli, self.host_memory_bytes)

    def task(self) -> PendingTask:
        """Placement's view of this work (made once per object: a driver that keeps its work
        objects between cycles, as the replay does, asks for the same one every cycle)."""
        made = self._task
        if made is None:
            made = PendingTask(self.key, self.request, self.submitted_at,
                               self.job_type if self.job_type is not None else self.request.job_type,
                               self.cpu_milli, self.host_memory_bytes, self.rank)
            object.__setattr__(self, "_task", made)  # a memo of immutable fields, not a change
        return made


@dataclass(frozen=True, slots=True)
class Launch:
    """Start ``key`` on ``shares`` with ``env`` in its process (``reused``: already allocated;
    ``note``: why these devices when a rule other than the policy's greedy choice picked them,
    for the task's log, e.g. the batch re-planner's gain)."""

    key: str
    request: GPURequest
    shares: tuple[DeviceShare, ...]
    env: Mapping[str, str]
    reused: bool = False
    note: str = ""


@dataclass(frozen=True, slots=True)
class Hold:
    """Keep ``key`` waiting this cycle; ``permanent`` when it can never fit this fleet;
    ``queued_behind`` when it fits but waits behind earlier work (``CycleRequest.strict_fifo``)."""

    key: str
    reason: str
    permanent: bool = False
    queued_behind: bool = False


@dataclass(frozen=True, slots=True)
class CycleReply:
    """Every pending key appears once: in ``launches`` or in ``holds``. ``replanned``: the genetic
    optimiser searched this cycle's batch; ``replan_improved``: it found a better plan than greedy."""

    launches: tuple[Launch, ...]
    holds: tuple[Hold, ...]
    replanned: bool = False
    replan_improved: bool = False


class PlacementEngine(Protocol):
    """A placement engine a driver keeps between cycles: plans what :func:`~gpusched.placement.place`
    plans (:class:`~gpusched.placement.warm.WarmPlacement`, or a resident ``Placer``)."""

    def place(self, request: PlacementRequest) -> PlacementPlan: ...


@dataclass(frozen=True, slots=True)
class CycleRequest:
    """Every input of one cycle (no caller can leave one out: all but the tuning knobs are required).

    ``pending``: the waiting work, requests as the fault chain's overrides left them and with
    predicted durations where the author gave none (:mod:`gpusched.scheduler.durations`);
    ``snapshot``: the fleet now (usage counts every active allocation); ``running``: the tasks
    holding devices (for the policy's expected ends); ``now``: the clock; ``replan_budget_ms`` /
    ``replan_weights``: the genetic re-planning budget (0 = greedy only) and its objective weights
    (latency, fragmentation, energy); ``quota``: partition and budget state, required
    (:meth:`QuotaState.unlimited` when no quota is configured);
    ``addresses``: node -> address of its GPU host (rendezvous of multi-node gangs);
    ``attained_gpu_s``: key -> GPU-seconds the earlier tries of its task instance held devices
    (``preemption = service``: a requeued try keeps the service it attained; absent: none);
    ``engine``: the placement engine the driver keeps warm between cycles
    (:class:`~gpusched.placement.warm.WarmPlacement`: the plan ``place`` would make, without
    rebuilding the engine every cycle; None = a fresh engine); ``replan_generations``: the
    optimiser's generation cap (with the budget, whichever binds first; a cap that binds first
    makes a seeded replay deterministic); ``strict_fifo``: of the plan, only the work ahead of the
    first task left waiting (queue order) starts; the rest waits behind it (``Hold.queued_behind``).
    """

    pending: tuple[PendingWork, ...]
    snapshot: FleetSnapshot
    policy: Policy
    running: tuple[RunningTask, ...]
    now: float
    quota: QuotaState
    use_uuids: bool = False
    seed: int = 0
    replan_budget_ms: float = 0.0
    replan_weights: tuple[float, float, float] = (1.0, 1.0, 0.1)
    addresses: Mapping[str, str] = field(default_factory=dict)
    attained_gpu_s: Mapping[str, float] = field(default_factory=dict)
    engine: PlacementEngine | None = field(default=None, compare=False)
    replan_generations: int = 200
    strict_fifo: bool = False


def cycle_policy(policy: Policy, kept: SteadyWorkload, requests: Iterable[GPURequest]) -> Policy:
    """The policy one cycle places with. A policy that names no workload scores by the driver's
    kept estimate of the mix of ``requests`` (every request pending and running this cycle;
    :class:`~gpusched.placement.workload.SteadyWorkload` re-estimates it only once it drifts, so
    a warm engine survives tasks starting and ending). Each driver calls this once per cycle."""
    if policy.workload or policy.chooser != Chooser.SCORE:  # only a score reads the workload
        return policy
    return replace(policy, workload=kept.shapes(requests))


def decide(request: CycleRequest) -> CycleReply:
    """Decide one cycle: place what waits on what is free and build each launch's environment.

    Workloads that already own an allocation are launched on it first, then complete multi-node
    gangs; the rest — a typed job that would finish sooner by waiting for a busy faster GPU type
    limited to those types (:func:`gpusched.placement.patience.hold_for_faster`) — go to
    :func:`gpusched.placement.place` (or the request's warm ``engine``,
    which plans the same) in one ``PlacementRequest`` built from
    this request (the snapshot after the gangs, whose usage already counts every active
    allocation; policy, clock, running tasks, quota, seed). With ``replan_budget_ms > 0`` and at
    least two workloads to place, the genetic optimiser re-plans the batch from the greedy plan
    within that budget (never worse than greedy by its objective, never past the quota;
    ``replan_weights`` = latency, fragmentation, energy); a launch it moved off greedy's devices
    carries the gain in its ``note``.
    """
    pending, snapshot, use_uuids = request.pending, request.snapshot, request.use_uuids
    replan_budget_ms, replan_weights = request.replan_budget_ms, request.replan_weights
    launches: list[Launch] = []
    holds: list[Hold] = []
    to_place: list[PendingTask] = []
    by_key: dict[str, PendingWork] = {}
    gangs: dict[str, list[PendingWork]] = {}
    for work in pending:
        by_key[work.key] = work
        if work.existing:
            _launch_or_hold(work, work.existing, snapshot, use_uuids, True, launches, holds)
        elif work.gang is not None:
            gangs.setdefault(work.gang.gang, []).append(work)
        else:
            to_place.append(work.task())
    snapshot = _place_gangs(request, gangs, snapshot, launches, holds)
    replanned = improved = False
    if to_place:
        # A typed job that would finish sooner on a busy fast type than on a free slow one waits.
        offered, to_place = to_place, list(hold_for_faster(to_place, snapshot, request.running,
                                                            request.policy, request.now))
        faster = {t.key for t, o in zip(to_place, offered, strict=True) if t.request is not o.request}
        placement = PlacementRequest(
            pending=to_place, snapshot=snapshot, policy=request.policy, now=request.now,
            quota=request.quota, running=request.running, seed=request.seed,
        )
        plan = request.engine.place(placement) if request.engine is not None else place(placement)
        greedy_shares = {a.key: a.shares for a in plan.assignments}
        note = ""
        if replan_budget_ms > 0 and len(to_place) >= 2:
            report = optimise_with_report(placement, budget_ms=replan_budget_ms, weights=replan_weights,
                                          greedy=plan, max_generations=request.replan_generations)
            plan, replanned, improved = report.plan, True, report.improved
            note = f"placed by the batch re-planner: {report.describe()}" if improved else ""
        assignments = _fifo_prefix(plan, to_place) if request.strict_fifo else plan.assignments
        for assignment in assignments:
            work = by_key[assignment.key]
            moved = note if greedy_shares.get(assignment.key) != assignment.shares else ""
            _launch_or_hold(work, assignment.shares, snapshot, use_uuids, False, launches, holds, note=moved)
        # A standby node "would make it fit" judged on the fleet after this cycle's starts, as the
        # next cycle sees it (so the reason, and the task's log line, do not change between them).
        noted = {r.key for r in plan.rejections if not (r.permanent or r.by_quota)} \
            if has_standby(snapshot) else set()
        after = snapshot.with_usage(s for a in assignments for s in a.shares) if noted else snapshot
        for rejection in plan.rejections:
            reason = standby_note(rejection.reason, by_key[rejection.key].request, after) \
                if rejection.key in noted else rejection.reason
            if rejection.key in faster:  # its request was narrowed to the faster types above
                reason += ("; held for a faster GPU type: expected to finish sooner there than on a "
                           "free slower one")
            holds.append(Hold(rejection.key, reason, rejection.permanent))
        if len(assignments) < len(plan.assignments):
            kept = {a.key for a in assignments}
            holds.extend(Hold(a.key, "fits, but waits behind earlier work (strict FIFO)", queued_behind=True)
                         for a in plan.assignments if a.key not in kept)
    return CycleReply(tuple(launches), tuple(holds), replanned, improved)


def _fifo_prefix(plan: PlacementPlan, queue: Sequence[PendingTask]) -> tuple[Assignment, ...]:
    """The plan's assignments for the work before the first task it leaves waiting (queue order).

    Dropping the later ones is safe: a subset of a plan that double-books nothing double-books nothing.
    """
    by_key = {a.key: a for a in plan.assignments}
    waiting = {r.key for r in plan.rejections if not r.permanent}
    kept = []
    for task in queue:
        if task.key in waiting:
            break
        if task.key in by_key:
            kept.append(by_key[task.key])
    return tuple(kept)


def _place_gangs(
    request: CycleRequest,
    gangs: Mapping[str, list[PendingWork]],
    snapshot: FleetSnapshot,
    launches: list[Launch],
    holds: list[Hold],
) -> FleetSnapshot:
    """Launch every complete gang that fits (all members or none); return the snapshot after them."""
    for members in gangs.values():
        gang = membership(members[0])
        ranks = {membership(m).rank for m in members}
        if len(ranks) < gang.size:
            reason = (f"multi-node gang {gang.gang.rsplit('/', 1)[-1]}: "
                      f"{len(ranks)} of {gang.size} members queued; waiting for the rest")
            holds.extend(Hold(m.key, reason) for m in members)
            continue
        plan = place_gang(members, snapshot, request.policy, now=request.now, running=request.running,
                          addresses=request.addresses)
        if not plan.shares:
            holds.extend(Hold(m.key, plan.reason, plan.permanent) for m in members)
            continue
        refusal = _gang_quota_refusal(request, members, plan.shares, snapshot)
        if refusal is not None:  # the whole gang waits (or fails) for its tenant's budget or partition
            holds.extend(Hold(m.key, refusal.reason, refusal.permanent) for m in members)
            continue
        gang_launches: list[Launch] = []
        gang_holds: list[Hold] = []
        for member in members:
            _launch_or_hold(member, plan.shares[member.key], snapshot, request.use_uuids, False,
                            gang_launches, gang_holds, extra=plan.rendezvous[member.key])
        if gang_holds:  # all or nothing
            holds.extend(Hold(m.key, gang_holds[0].reason) for m in members)
            continue
        launches.extend(gang_launches)
        snapshot = snapshot.with_usage(s for launch in gang_launches for s in launch.shares)
    return snapshot


def _gang_quota_refusal(
    request: CycleRequest,
    members: Sequence[PendingWork],
    shares: Mapping[str, Sequence[DeviceShare]],
    snapshot: FleetSnapshot,
) -> Rejection | None:
    """Why the quota refuses a whole gang on ``shares`` (each member admitted in turn), or None."""
    if not request.quota.enforced:
        return None
    admission = _quota_gate(request, snapshot)
    for member in members:
        task = PendingTask(member.key, member.request, member.submitted_at)
        member_shares = tuple(shares[member.key])
        refusal = admission.admit(task, member_shares, physical_milli(member_shares, snapshot), request.now)
        if refusal is not None:
            return refusal
    return None


def quota_admitted(launches: Sequence[Launch], request: CycleRequest) -> list[Launch]:
    """Of ``launches`` (placed without the quota, in order), those the quota gate of ``request``
    admits one after the other (its snapshot, running tasks, pending work and quota); all of them
    when no quota is enforced. A launch on an already owned allocation is never refused."""
    if not request.quota.enforced:
        return list(launches)
    gate = _quota_gate(request, request.snapshot)
    by_key = {w.key: w for w in request.pending}
    admitted = []
    for launch in launches:
        work = by_key.get(launch.key)
        if work is None or work.existing:
            admitted.append(launch)
            continue
        task = PendingTask(work.key, work.request, work.submitted_at)
        need = physical_milli(launch.shares, request.snapshot)
        if gate.admit(task, launch.shares, need, request.now) is None:
            admitted.append(launch)
    return admitted


def _quota_gate(request: CycleRequest, snapshot: FleetSnapshot) -> QuotaGate:
    """The quota gate of ``request`` (its quota, running tasks and pending work) on ``snapshot``."""
    waiting = [PendingTask(w.key, w.request, w.submitted_at) for w in request.pending]
    return QuotaGate(snapshot, request.quota, request.running, waiting, request.now)


def running_tasks(allocations: Iterable[object]) -> list[RunningTask]:
    """Placement's view of active ledger allocations (``expected_end`` from the request's estimate).

    Quarantined allocations are left out: their devices stay held (the snapshot's usage counts
    them), but no task of this scheduler runs there to preempt, move or wait for.
    """
    return [task for task in map(_running_task, allocations) if task is not None]


class RunningTasks:
    """:func:`running_tasks` for a caller that converts the same allocations cycle after cycle
    (a long-lived ``Ledger``'s ``cycle_view`` returns the same objects for rows that did not
    change): each allocation object is converted once, for as long as it is passed every call.
    Calling it returns what :func:`running_tasks` returns (the tasks may be shared between calls).
    """

    def __init__(self) -> None:
        # id -> (the allocation, its task): the allocation is held, so its id is not reused.
        self._kept: dict[int, tuple[object, RunningTask | None]] = {}

    def __call__(self, allocations: Iterable[object]) -> list[RunningTask]:
        kept: dict[int, tuple[object, RunningTask | None]] = {}
        result = []
        for alloc in allocations:
            pair = self._kept.get(id(alloc))
            if pair is None or pair[0] is not alloc:
                pair = (alloc, _running_task(alloc))
            kept[id(alloc)] = pair
            if pair[1] is not None:
                result.append(pair[1])
        self._kept = kept
        return result


def _running_task(alloc: object) -> RunningTask | None:
    if getattr(alloc, "status", None) == AllocationStatus.QUARANTINED:
        return None
    request: GPURequest = alloc.request  # type: ignore[attr-defined]
    started = float(alloc.created_at)  # type: ignore[attr-defined]
    duration = request.expected_duration_s
    return RunningTask(
        key=alloc.key,  # type: ignore[attr-defined]
        request=request,
        shares=tuple(alloc.shares),  # type: ignore[attr-defined]
        started_at=started,
        expected_end=started + duration if duration else None,
    )


def _launch_or_hold(
    work: PendingWork,
    shares: Sequence[DeviceShare],
    snapshot: FleetSnapshot,
    use_uuids: bool,
    reused: bool,
    launches: list[Launch],
    holds: list[Hold],
    extra: Mapping[str, str] | None = None,
    note: str = "",
) -> None:
    try:
        env = devices_env(shares, snapshot, key=work.key, use_uuids=use_uuids)
    except PlacementError as exc:
        holds.append(Hold(work.key, f"cannot expose the chosen devices: {exc}"))
        return
    if extra:
        env.update(extra)
    launches.append(Launch(work.key, work.request, tuple(shares), env, reused, note))
