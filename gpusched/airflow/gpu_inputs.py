"""What one cycle of the GPU executors reads: the waiting workloads as pending work, and the request.

:func:`pending_work` turns the executor's GPU workloads into the cycle's
:class:`~gpusched.scheduler.cycle.PendingWork`: the fault chain's overrides applied (a replaced
request, a refused retry, a moved try's pin), the multi-node gang a task belongs to, and the
allocation a workload already owns (queued again after a restart, or the next try of a move).
:func:`read_cycle_request` reads the rest of the cycle's inputs from the ledger in one
:class:`~gpusched.scheduler.cycle.CycleRequest`: the fleet and the running tasks (one read
transaction), predicted durations (:mod:`gpusched.scheduler.durations`), the policy with the
request mix it scores by (the executor's :class:`~gpusched.placement.workload.SteadyWorkload`
unless the policy names its shapes), the quota (with the last forecast plan's burst reserve,
``capacity.scaling.burst_reserve``) and, with
``preemption = service``, the GPU-time the earlier tries of each task instance attained
(:mod:`gpusched.scheduler.attained`). :func:`prefetch_request` is the same cycle's second look
for the work left waiting only because every worker slot was busy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from gpusched.airflow.authoring import request_from_executor_config
from gpusched.capacity.scaling import burst_reserve
from gpusched.errors import GPURequestError
from gpusched.faults.failures import load_overrides
from gpusched.gang import gang_member
from gpusched.model import FleetSnapshot
from gpusched.placement.types import RunningTask
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import CycleRequest, Launch, PendingWork, RunningTasks, cycle_policy
from gpusched.scheduler.keys import ti_key_of
from gpusched.scheduler.quota import cycle_quota

if TYPE_CHECKING:
    from airflow.executors.workloads import ExecuteTask
    from airflow.models.taskinstancekey import TaskInstanceKey

    from gpusched.airflow.gpu_migration import Migrator
    from gpusched.airflow.gpu_preemption import Preemptor
    from gpusched.durations.predictor import Prediction
    from gpusched.model import DeviceShare
    from gpusched.placement import Policy
    from gpusched.placement.warm import WarmPlacement
    from gpusched.placement.workload import SteadyWorkload
    from gpusched.records import Allocation
    from gpusched.scheduler.attained import AttainedService
    from gpusched.scheduler.durations import DurationHistory
    from gpusched.scheduler.ledger_store import LedgerStore

__all__ = ["InputsCore", "pending_work", "prefetch_request", "read_cycle_request"]


class InputsCore(Protocol):
    """What the cycle's inputs use of :class:`~gpusched.airflow.gpu_scheduling.GPUScheduling`."""

    durations: DurationHistory
    attained: AttainedService
    preemption: Preemptor  # its mode
    migration: Migrator  # moved tries own their held devices
    predicted: dict[str, Prediction]
    gangs: dict[str, set[TaskInstanceKey]]
    use_uuids: bool
    replan_budget_ms: float
    replan_weights: tuple[float, float, float]
    warm: WarmPlacement  # the engine kept between cycles
    steady: SteadyWorkload  # the request mix kept between cycles
    kept_running: RunningTasks  # the ledger's allocations as running tasks, each converted once
    submitted: dict[TaskInstanceKey, float]
    seen: set[TaskInstanceKey]
    cycle_requests: dict[str, GPURequest]

    @property
    def ledger(self) -> LedgerStore: ...

    @property
    def policy(self) -> Policy: ...

    def reject(self, workload: ExecuteTask, key: str, reason: str) -> None: ...

    @property
    def dispatcher(self) -> SlotView: ...

    slot_notes: list[str]  # why some hosts take nothing this cycle (their worker slots)


class SlotView(Protocol):
    """What the cycle's inputs ask the executor's dispatcher."""

    def full_nodes(self, active: Sequence[Allocation]) -> dict[str, str]: ...

    def prefetch_nodes(self, running: Sequence[RunningTask], now: float) -> frozenset[str]: ...


def pending_work(
    core: InputsCore, workloads: Sequence[ExecuteTask], now: float
) -> tuple[list[PendingWork], dict[str, ExecuteTask]]:
    """The cycle's pending work for ``workloads`` and the workload of each ledger key.

    Workloads the fault chain refuses, or whose request is invalid, are failed here
    (``core.reject``); each kept key's author request is noted in ``core.cycle_requests`` (what
    the ledger records: a pin only steers the placement).
    """
    ledger = core.ledger
    pending: list[PendingWork] = []
    by_key: dict[str, ExecuteTask] = {}
    # The fault chain may have replaced a task's request (more memory, another model) or
    # refused its retry (code errors fail the same way on any GPU): both live in the ledger.
    overrides = load_overrides(ledger)
    core.cycle_requests.clear()
    for workload in workloads:
        ti = workload.ti
        key = ti_key_of(ti)
        refusal = overrides.refusal(ti.dag_id, ti.task_id, ti.run_id, ti.try_number)
        if refusal:
            core.reject(workload, key, f"gpusched fault chain refused this retry: {refusal}")
            continue
        try:
            author = (overrides.lookup(ti.dag_id, ti.task_id, ti.run_id)
                      or request_from_executor_config(ti.executor_config))
            member = gang_member(ti.executor_config, dag_id=ti.dag_id, run_id=ti.run_id,
                                 map_index=ti.map_index if ti.map_index is not None else -1)
        except GPURequestError as exc:
            core.reject(workload, key, f"invalid GPU request in executor_config: {exc}")
            continue
        assert author is not None
        core.cycle_requests[key] = author
        request = overrides.pinned(ti.dag_id, ti.task_id, ti.run_id, ti.try_number) or author
        shares: tuple[DeviceShare, ...] = ()
        if workload.key not in core.seen or core.migration.holds(key):
            # Only a workload queued again (restart) or a moved task's next try owns an allocation.
            core.seen.add(workload.key)
            existing = ledger.get(key)
            shares = tuple(existing.shares) if existing and existing.released_at is None else ()
        by_key[key] = workload
        pending.append(PendingWork(key, request, core.submitted.get(workload.key, now), shares,
                                   None if shares else member))
        if member is not None and shares:
            core.gangs.setdefault(member.gang, set()).add(workload.key)
    return pending, by_key


def read_cycle_request(core: InputsCore, pending: Sequence[PendingWork], now: float) -> CycleRequest:
    """Every input of one cycle, read from the ledger now (quota: the quota file and usage;
    requests without ``expected_duration`` carry the predicted one, noted in ``core.predicted``;
    a later try of a task instance counts as submitted when its first try was queued
    (:meth:`~gpusched.scheduler.attained.AttainedService.first_queued`);
    ``attained_gpu_s`` only with ``preemption = service``)."""
    ledger = core.ledger
    first = core.attained.first_queued(ledger, [w.key for w in pending])
    pending = [replace(w, submitted_at=min(w.submitted_at, first[w.key])) if w.key in first else w
               for w in pending]
    snapshot, active = ledger.cycle_view(now)  # one read transaction: both agree
    full = core.dispatcher.full_nodes(active)
    if full:  # hosts whose workers have no free slot take nothing new this cycle
        # Closed, not cordoned: the inventory (and so the warm engine and its index) stays, the
        # placement treats them as cordoned, the partitions still split the whole fleet.
        snapshot = snapshot.with_closed(
            name for name in full if snapshot.has_node(name) and not snapshot.node(name).cordoned)
    core.slot_notes = sorted(set(full.values()))
    work, busy, core.predicted = core.durations.apply(ledger, now, pending, core.kept_running(active))
    attained = {}
    if core.preemption.mode == "service":
        attained = core.attained.earlier_tries(ledger, [w.key for w in work] + [r.key for r in busy], now)
    policy = cycle_policy(core.policy, core.steady, [w.request for w in work] + [r.request for r in busy])
    return CycleRequest(
        work, snapshot, policy, busy, now,
        _quota(core, snapshot, now), use_uuids=core.use_uuids,
        replan_budget_ms=core.replan_budget_ms, replan_weights=core.replan_weights,
        addresses=ledger.node_addresses() if any(w.gang for w in work) else {},
        attained_gpu_s=attained, engine=core.warm,
    )


def prefetch_request(
    core: InputsCore, cycle: CycleRequest, held: Sequence[PendingWork], launched: Sequence[Launch],
) -> tuple[CycleRequest, CycleRequest] | None:
    """The second look of ``cycle`` for ``held``: the work it left waiting that takes no gang and
    owns no devices, for the hosts closed for busy slots (``cycle.snapshot.closed``) whose workers
    may hold a task beyond them (``core.dispatcher.prefetch_nodes`` over the cycle's running
    tries: this cycle's launches have not started, so they make no room). ``launched`` (this
    cycle's launches so far) count as used devices and as running tasks.

    Returns two requests, or None when no host has such room or nothing qualifies: the placement
    on those hosts' nodes alone (a fleet of a few nodes: a fresh engine, no quota, no
    re-planning; cheap whatever the fleet's size), and the whole fleet's view for the quota gate
    its launches then pass (:func:`~gpusched.scheduler.cycle.quota_admitted`; the quota read
    again after the launches, the partitions splitting the whole fleet)."""
    held = [w for w in held if w.gang is None and not w.existing]
    if not held or not cycle.snapshot.closed:
        return None
    now = cycle.now
    room = core.dispatcher.prefetch_nodes(cycle.running, now) & cycle.snapshot.closed
    if not room:
        return None
    fresh = [launch for launch in launched if not launch.reused]
    running = cycle.running + tuple(
        RunningTask(key=launch.key, request=launch.request, shares=launch.shares, started_at=now,
                    expected_end=now + launch.request.expected_duration_s
                    if launch.request.expected_duration_s else None)
        for launch in fresh)
    nodes = tuple(n for n in cycle.snapshot.nodes if n.name in room)  # open here: not closed
    devices = {d.uuid for n in nodes for d in n.devices}
    usage = {uuid: use for uuid, use in cycle.snapshot.usage.items() if uuid in devices}
    small = FleetSnapshot(nodes, usage, cycle.snapshot.source, cycle.snapshot.taken_at).with_usage(
        [s for launch in fresh for s in launch.shares if s.uuid in devices])
    placement = replace(cycle, pending=tuple(held), snapshot=small, running=tuple(
        r for r in running if r.shares and r.shares[0].node in room), quota=QuotaState.unlimited(),
        engine=None, replan_budget_ms=0.0)
    quota = _quota(core, cycle.snapshot, now) if cycle.quota.enforced else cycle.quota
    return placement, replace(cycle, pending=tuple(held), running=running, quota=quota)


def _quota(core: InputsCore, snapshot: FleetSnapshot, now: float) -> QuotaState:
    """The cycle's quota on ``snapshot`` (with the last forecast plan's burst reserve). The
    partitions split the whole fleet: nodes closed for busy worker slots keep their share
    (:func:`~gpusched.quota.policy.partition_capacity` counts them)."""
    quota = cycle_quota(core.ledger, snapshot, now)
    if quota.enforced:  # the last forecast plan's burst reserve, kept by the quota gate
        reserve = burst_reserve(core.ledger, now)
        quota = replace(quota, burst_reserve_gpus=reserve) if reserve else quota
    return quota
