"""One scheduling cycle of the GPU executors, as a pure decision: ``decide(CycleRequest) -> CycleReply``.

Input, in one :class:`CycleRequest` (as Ray autoscaler v2's ``SchedulingRequest``): the GPU
workloads waiting in the executor (their requests already rewritten by the fault chain's
overrides), the fleet snapshot from the ledger, the tasks already holding devices, the policy,
the clock and the re-planning budget. Output, one :class:`CycleReply`: which workloads to launch
(with their shares and task environment) and which to hold (with the reason the UI shows). The
executors do the I/O around it (:mod:`gpusched.airflow.gpu_scheduling`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpusched.errors import PlacementError
from gpusched.hardware.envexport import devices_env
from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.placement import PendingTask, PlacementRequest, Policy, Rejection, RunningTask, place
from gpusched.placement.warm import WarmPlacement
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest
from gpusched.scheduler.gangs import GangMember, membership, place_gang

__all__ = [
    "CycleReply", "CycleRequest", "Hold", "Launch", "PendingWork", "decide", "running_tasks",
]


@dataclass(frozen=True, slots=True)
class PendingWork:
    """A GPU workload waiting in the executor.

    ``gang``: this work is one member (one node) of a multi-node gang. ``existing`` holds the
    shares of an allocation the ledger already has under ``key`` (a workload queued again after a
    scheduler restart): it is launched on them, not placed anew. ``rank``: its queue key under
    ``QueueOrder.RANKED`` (``preemption = service``: −log2 of its Gittins index).
    """

    key: str
    request: GPURequest
    submitted_at: float
    existing: tuple[DeviceShare, ...] = ()
    gang: GangMember | None = None
    rank: float = 0.0


@dataclass(frozen=True, slots=True)
class Launch:
    """Start ``key`` on ``shares`` with ``env`` in its process (``reused``: already allocated)."""

    key: str
    request: GPURequest
    shares: tuple[DeviceShare, ...]
    env: Mapping[str, str]
    reused: bool = False


@dataclass(frozen=True, slots=True)
class Hold:
    """Keep ``key`` waiting this cycle; ``permanent`` when it can never fit this fleet."""

    key: str
    reason: str
    permanent: bool = False


@dataclass(frozen=True, slots=True)
class CycleReply:
    """Every pending key appears once: in ``launches`` or in ``holds``."""

    launches: tuple[Launch, ...]
    holds: tuple[Hold, ...]


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
    ``engine``: the placement engine the executor keeps warm between cycles
    (:class:`~gpusched.placement.warm.WarmPlacement`: the plan ``place`` would make, without
    rebuilding the engine every cycle; None = a fresh engine).
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
    engine: WarmPlacement | None = field(default=None, compare=False)


def decide(request: CycleRequest) -> CycleReply:
    """Decide one cycle: place what waits on what is free and build each launch's environment.

    Workloads that already own an allocation are launched on it first, then complete multi-node
    gangs; the rest go to :func:`gpusched.placement.place` (or the request's warm ``engine``,
    which plans the same) in one ``PlacementRequest`` built from
    this request (the snapshot after the gangs, whose usage already counts every active
    allocation; policy, clock, running tasks, quota, seed). With ``replan_budget_ms > 0`` and at
    least two workloads to place, the genetic optimiser re-plans the batch from the greedy plan
    within that budget (never worse than greedy by its objective; ``replan_weights`` = latency,
    fragmentation, energy).
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
            to_place.append(PendingTask(work.key, work.request, work.submitted_at,
                                        job_type=work.request.job_type, rank=work.rank))
    snapshot = _place_gangs(request, gangs, snapshot, launches, holds)
    if to_place:
        placement = PlacementRequest(
            pending=to_place, snapshot=snapshot, policy=request.policy, now=request.now,
            quota=request.quota, running=request.running, seed=request.seed,
        )
        plan = request.engine.place(placement) if request.engine is not None else place(placement)
        # The optimiser does not check quotas: with quotas in force the greedy plan stands.
        if replan_budget_ms > 0 and len(to_place) >= 2 and not request.quota.enforced:
            from gpusched.placement.genetic import optimise

            plan = optimise(placement, budget_ms=replan_budget_ms, weights=replan_weights, greedy=plan)
        for assignment in plan.assignments:
            work = by_key[assignment.key]
            _launch_or_hold(work, assignment.shares, snapshot, use_uuids, False, launches, holds)
        for rejection in plan.rejections:
            holds.append(Hold(rejection.key, rejection.reason, rejection.permanent))
    return CycleReply(tuple(launches), tuple(holds))


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
    from gpusched.placement.admission import QuotaGate
    from gpusched.quota.policy import physical_milli

    waiting = [PendingTask(w.key, w.request, w.submitted_at) for w in request.pending]
    admission = QuotaGate(snapshot, request.quota, request.running, waiting, request.now)
    for member in members:
        task = PendingTask(member.key, member.request, member.submitted_at)
        member_shares = tuple(shares[member.key])
        refusal = admission.admit(task, member_shares, physical_milli(member_shares, snapshot), request.now)
        if refusal is not None:
            return refusal
    return None


def running_tasks(allocations: Iterable[object]) -> list[RunningTask]:
    """Placement's view of active ledger allocations (``expected_end`` from the request's estimate)."""
    result = []
    for alloc in allocations:
        request: GPURequest = alloc.request  # type: ignore[attr-defined]
        started = float(alloc.created_at)  # type: ignore[attr-defined]
        duration = request.expected_duration_s
        result.append(
            RunningTask(
                key=alloc.key,  # type: ignore[attr-defined]
                request=request,
                shares=tuple(alloc.shares),  # type: ignore[attr-defined]
                started_at=started,
                expected_end=started + duration if duration else None,
            )
        )
    return result


def _launch_or_hold(
    work: PendingWork,
    shares: Sequence[DeviceShare],
    snapshot: FleetSnapshot,
    use_uuids: bool,
    reused: bool,
    launches: list[Launch],
    holds: list[Hold],
    extra: Mapping[str, str] | None = None,
) -> None:
    try:
        env = devices_env(shares, snapshot, key=work.key, use_uuids=use_uuids)
    except PlacementError as exc:
        holds.append(Hold(work.key, f"cannot expose the chosen devices: {exc}"))
        return
    if extra:
        env.update(extra)
    launches.append(Launch(work.key, work.request, tuple(shares), env, reused))
