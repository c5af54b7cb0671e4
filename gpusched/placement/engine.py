"""The placement engine: ``place(PlacementRequest) -> PlacementPlan``.

Pure over its inputs. Pending tasks are considered in priority order, then by the policy's queue
order (shortest expected GPU-time first with aging, or submission time);
each assignment is applied to a working copy of the free capacity, so a plan never double-books.
For one task: filter (hard constraints) → candidate nodes/devices (topology) → score → choose;
then quota (tenant budget, partition share). A critical task that cannot fit now reserves the
devices that free up earliest; others may use reserved devices only if they end before it starts.

:class:`Placer` is the same engine kept alive between calls (a simulator applies and releases
shares on it instead of rebuilding state from a snapshot every decision).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import fields
from operator import attrgetter
from typing import Any, cast

import numpy as np

from gpusched.catalog import Catalog
from gpusched.errors import PlacementError
from gpusched.model import MILLI, DeviceShare, FleetSnapshot
from gpusched.placement.admission import QuotaGate
from gpusched.placement.choose import Choice, choose
from gpusched.placement.host_only import choose_host_node
from gpusched.placement.incremental import Incremental
from gpusched.placement.index import FleetIndex, FreeState, fleet_index
from gpusched.placement.index import in_service as service_mask
from gpusched.placement.lookahead import ShapeDeltas
from gpusched.placement.policy import Policy, QueueOrder
from gpusched.placement.reasons import reserved_note
from gpusched.placement.score import FragStats, cached_stats
from gpusched.placement.speeds import model_speeds
from gpusched.placement.types import (
    Assignment,
    PendingTask,
    PlacementPlan,
    PlacementRequest,
    Rejection,
    Reservation,
    RunningTask,
)
from gpusched.placement.workload import Workload, workload_for
from gpusched.quota.policy import physical_milli
from gpusched.request import GPURequest

__all__ = ["Placer", "place", "running_host"]

_NOT_FITTING = frozenset({"expected_duration_s", "tenant", "priority", "partition"})
_ALIKE = attrgetter(*(f.name for f in fields(GPURequest) if f.name not in _NOT_FITTING))
"""A request's fields but its duration and owner: what decides whether it fits (without
reservations; the tenant, priority and partition only weigh after devices are found)."""


def place(request: PlacementRequest) -> PlacementPlan:
    """Plan devices for ``request.pending`` on ``request.snapshot`` under ``request.policy``.

    Every pending key appears exactly once in the plan: assigned or rejected with a reason.
    ``request.running`` feeds reservations (their ``expected_end``), partition use, committed
    budget and host CPU/RAM use; their device shares must already be counted in the snapshot's
    usage; ``request.quota`` holds the quota policy and budget use so far.
    """
    policy = request.policy
    requests = [t.request for t in request.pending] + [r.request for r in request.running]
    workload = workload_for(policy.workload, requests)
    # This engine lives for one call: per-node caches pay off only when tasks share a shape.
    shared = len(request.pending) > 1
    placer = Placer(request.snapshot, policy, workload=workload, catalog=request.catalog, incremental=shared)
    if placer.incremental is not None:
        placer.incremental.fill_on_first_use = False
    for node, cpu_milli, memory_bytes in running_host(placer.index, request.running):
        placer.take_host(placer.index.nodes[node].name, cpu_milli, memory_bytes)
    return placer.place(request)


class _LazyRng:
    """``np.random.default_rng(seed)``, made when one of its methods is first asked for."""

    __slots__ = ("_rng", "_seed")

    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._rng: np.random.Generator | None = None

    def __getattr__(self, name: str) -> Any:
        if self._rng is None:
            self._rng = np.random.default_rng(self._seed)
        return getattr(self._rng, name)


def running_host(index: FleetIndex, running: Iterable[RunningTask]) -> Iterator[tuple[int, int, int]]:
    """(node position, host CPU milli, host RAM bytes) each running task holds: on the node of its
    first share, for the tasks that declare host CPU/RAM and run on this inventory."""
    for task in running:
        holds = task.cpu_milli or task.host_memory_bytes
        if holds and task.shares and task.shares[0].node in index.node_pos:
            yield index.node_pos[task.shares[0].node], task.cpu_milli, task.host_memory_bytes


class Placer:
    """The engine with its free-capacity state kept between calls.

    ``place(request, commit=True)`` keeps the plan's assignments in the state; :meth:`apply` and
    :meth:`release` change it directly (when tasks start or end outside the engine). The requests
    it is given carry the snapshot and policy it was built from (checked): its own state, not the
    request's snapshot usage, says what is free.

    With ``incremental`` (the default) the engine also keeps per-node results between decisions
    (:mod:`gpusched.placement.incremental`: fully free devices per node and topology group for
    each eligibility, the fragmentation term of each fractional shape per device) and
    recomputes only the nodes whose capacity changed since, so a decision costs about
    O(nodes) cheap array work instead of O(devices) scoring; the decisions are the same as
    with ``incremental=False``, which recomputes everything per decision.
    """

    def __init__(
        self,
        snapshot: FleetSnapshot,
        policy: Policy,
        *,
        workload: Workload | None = None,
        catalog: Catalog | None = None,
        incremental: bool = True,
    ) -> None:
        self.snapshot = snapshot
        self.policy = policy
        self.index: FleetIndex = fleet_index(snapshot, catalog)
        self.state = FreeState(self.index, snapshot)
        # The snapshot's closed nodes take no new work (as if cordoned): a per-call state, not
        # the inventory's, so a rebase onto another closed set keeps the engine (see rebase).
        self.closed: frozenset[str] = snapshot.closed
        self.in_service: np.ndarray = service_mask(self.index, snapshot.closed)
        self.workload = workload or Workload.of(policy.workload)
        self._stats: FragStats | None = None
        # CPU-only tasks' own expected workload (None: the same as ``workload``).
        self.host_workload = Workload.of(policy.host_task_workload) if policy.host_task_workload else None
        self._host_stats: FragStats | None = None
        self._pristine = True  # state still equals the snapshot's usage (stats may come from cache)
        self._lookahead: ShapeDeltas | None = None
        self._speed_cache: dict[str | None, tuple[np.ndarray, np.ndarray]] = {}
        # Whether the working state's reservation starts (res_start) may hold any: they are all
        # inf between calls, set by _reserve during one.
        self._reserved = False
        # Per-node results kept between decisions; None = recompute everything per decision
        # (the reference path the incremental one is tested against).
        self.incremental: Incremental | None = Incremental(self.index) if incremental else None

    # ---- state -----------------------------------------------------------------------------

    @property
    def stats(self) -> FragStats:
        """Fragmentation aggregates (built on first use)."""
        if self._stats is None:
            if self._pristine:
                self._stats = cached_stats(
                    self.index, self.snapshot.usage, self.state, self.workload, self.in_service)
            else:
                self._stats = FragStats(self.index, self.state, self.workload, self.in_service)
        return self._stats

    @property
    def host_stats(self) -> FragStats:
        """The aggregates CPU-only tasks are scored by: over ``policy.host_task_workload`` when the
        policy sets one, else :attr:`stats`."""
        if self.host_workload is None:
            return self.stats
        if self._host_stats is None:
            self._host_stats = FragStats(self.index, self.state, self.host_workload, self.in_service)
        return self._host_stats

    def _refresh(self, nodes: Iterable[int]) -> None:
        nodes = tuple(nodes)
        for stats in (self._stats, self._host_stats):
            if stats is not None:
                stats.refresh(self.state, nodes)

    @property
    def lookahead(self) -> ShapeDeltas | None:
        """Per-node shape deltas for the look-ahead tie-break (None: the policy has none)."""
        if not (self.policy.lookahead_ties and self.policy.score_levels):
            return None
        if self._lookahead is None:
            self._lookahead = ShapeDeltas(
                self.index, self.workload, self.policy.score_levels, self.policy.fragmentation,
                self.policy.lookahead_ties, self.policy.lookahead_widen,
            )
        return self._lookahead

    def apply(
        self,
        shares: Iterable[DeviceShare],
        *,
        release: bool = False,
        cpu_milli: int = 0,
        host_memory_bytes: int = 0,
    ) -> None:
        """Take (or, with ``release``, give back) ``shares`` in the working state, with the host
        CPU/RAM of the task on the node of its first share."""
        shares = tuple(shares)
        self._pristine = False
        self.state.apply(shares, release=release, cpu_milli=cpu_milli, host_memory_bytes=host_memory_bytes)
        pos = self.index.pos
        self._refresh(int(self.index.dev_node[pos[s.uuid]]) for s in shares if s.uuid in pos)

    def release(
        self, shares: Iterable[DeviceShare], *, cpu_milli: int = 0, host_memory_bytes: int = 0
    ) -> None:
        """Give back ``shares`` (and the host CPU/RAM they held)."""
        self.apply(shares, release=True, cpu_milli=cpu_milli, host_memory_bytes=host_memory_bytes)

    def take_host(self, node: str, cpu_milli: int, host_memory_bytes: int, *, release: bool = False) -> None:
        """Take (or give back) host CPU/RAM on ``node`` without devices (a CPU-only task)."""
        n = self.index.node_pos[node]
        sign = 1 if release else -1
        self._pristine = False
        self.state.host_cpu[n] += sign * cpu_milli
        self.state.host_mem[n] += sign * host_memory_bytes
        self.state.touch(n)
        self._refresh((n,))

    def rebase(self, snapshot: FleetSnapshot, target: FreeState) -> None:
        """Adopt ``snapshot`` (the same inventory as this engine's, other usage or closed nodes)
        whose free capacity is ``target`` (a :class:`FreeState` of this engine's index): only the
        nodes whose devices or host CPU/RAM differ from the working state, or that were closed or
        opened (:attr:`~gpusched.model.FleetSnapshot.closed`), change, and only their per-node
        aggregates are recomputed.

        Raises:
            PlacementError: ``snapshot`` has another inventory (build a new engine for it).
        """
        if fleet_index(snapshot) is not self.index or target.index is not self.index:
            raise PlacementError("Placer.rebase got a snapshot of another inventory; build a new Placer")
        state, idx = self.state, self.index
        changed = np.zeros(len(idx.nodes), dtype=bool)
        moved = (state.free_milli != target.free_milli) | (state.free_mem != target.free_mem)
        changed[idx.dev_node[moved]] = True
        changed |= (state.host_cpu != target.host_cpu) | (state.host_mem != target.host_mem)
        for array in ("free_milli", "free_mem", "host_cpu", "host_mem"):
            getattr(state, array)[...] = getattr(target, array)
        flipped: list[int] = []
        if snapshot.closed != self.closed:
            pos = idx.node_pos
            flipped = sorted({pos[name] for name in snapshot.closed ^ self.closed if name in pos})
            changed[flipped] = True
            self.closed, self.in_service = snapshot.closed, service_mask(idx, snapshot.closed)
        nodes = np.flatnonzero(changed).tolist()
        for n in nodes:  # a new stamp: every per-node cache recomputes them, closed ones too
            state.touch(n)
        self.snapshot, self._pristine = snapshot, False
        if flipped:
            for stats in (self._stats, self._host_stats):
                if stats is not None:
                    stats.set_in_service(self.in_service, state, flipped)
        self._refresh(nodes)

    def host_free(self, node: str) -> tuple[int, int]:
        """Host CPU (milli-cores) and RAM (bytes) still free on ``node``."""
        n = self.index.node_pos[node]
        return int(self.state.host_cpu[n]), int(self.state.host_mem[n])

    def choose_host_node(self, cpu_milli: int, host_memory_bytes: int, *, seed: int = 0) -> str | None:
        """The node this policy would give a CPU-only task (None if none has room); takes nothing
        (see :func:`gpusched.placement.host_only.choose_host_node`)."""
        return choose_host_node(self, cpu_milli, host_memory_bytes, seed=seed)

    def free_milli(self, uuid: str) -> int:
        """Free milli-GPU of one device in the working state."""
        return int(self.state.free_milli[self.index.pos[uuid]])

    # ---- planning --------------------------------------------------------------------------

    def place(
        self, request: PlacementRequest, *, commit: bool = True, keep_order: bool = False
    ) -> PlacementPlan:
        """Plan ``request`` (see :func:`place`); keep the assignments in the state if ``commit``.

        ``request.snapshot`` and ``request.policy`` must be the ones this engine was built from
        (the working state carries every change since). ``keep_order`` considers the tasks in the
        given order instead of by priority (an optimiser searching over orders decodes each
        candidate order this way).

        Raises:
            PlacementError: the request names another snapshot or policy than this engine's.
        """
        foreign_policy = request.policy is not self.policy and request.policy != self.policy
        if request.snapshot is not self.snapshot or foreign_policy:
            raise PlacementError(
                "Placer.place got a request for another fleet snapshot or policy than the engine "
                "was built from; build a new Placer (or call placement.place) for it"
            )
        pending, running, quota, now = request.pending, request.running, request.quota, request.now
        saved = None if commit else (self.state, self._stats, self._host_stats, self._pristine)
        if not commit:
            self.state, self._stats, self._host_stats = self.state.copy(), None, None
        # Most decisions draw nothing: the generator is made on first use.
        rng = cast(np.random.Generator, _LazyRng(request.seed))
        # An unlimited state (no quota configured) applies neither budgets nor partitions.
        ctx = QuotaGate(self.snapshot, quota, running, pending, now) if quota.enforced else None
        ordered = list(pending) if keep_order else sorted(pending, key=self._queue_key(now))
        assignments: list[Assignment] = []
        rejections: list[Rejection] = []
        reservations: list[Reservation] = []
        res_start = self.state.res_start
        if self._reserved:  # (a call that raised may have left its reservations)
            res_start[:] = np.inf
        seen: set[str] = set()
        # A task like one already refused in this call (same request but for its duration and
        # owner, same host needs and job type) is refused the same way: the state only loses
        # room within a call, and without a reservation the duration plays no part in fitting.
        # Kept until a reservation is made. A queue of thousands of alike tasks on a full fleet
        # otherwise costs a full device search per task per call.
        refused: dict[tuple[object, ...], Rejection] | None = {}
        for task in ordered:
            if task.key in seen:
                continue
            seen.add(task.key)
            req = task.request
            end = now + req.expected_duration_s if req.expected_duration_s > 0 else math.inf
            alike = (_ALIKE(req), task.cpu_milli, task.host_memory_bytes, task.job_type)
            known = refused.get(alike) if refused is not None else None
            if known is not None:
                outcome: Choice | Rejection = Rejection(task.key, known.reason, known.permanent)
            else:
                outcome = self._find(task, self.state, end, rng, use_stats=True)
                if refused is not None and isinstance(outcome, Rejection):
                    refused[alike] = outcome
            if isinstance(outcome, Rejection):
                if not outcome.permanent and self._may_reserve(req, running):
                    reservation = self._reserve(task, running, now, rng)
                    if reservation is not None:
                        refused = None
                        reservations.append(reservation)
                        outcome = Rejection(
                            task.key, outcome.reason + reserved_note(reservation, now), False
                        )
                if ctx is not None:
                    ctx.done(req)
                rejections.append(outcome)
                continue
            shares = self._shares(outcome)
            if ctx is not None:
                verdict = ctx.admit(task, shares, physical_milli(shares, self.snapshot), now)
                if verdict is not None:
                    rejections.append(verdict)
                    continue
            self.apply(shares, cpu_milli=task.cpu_milli, host_memory_bytes=task.host_memory_bytes)
            assignments.append(Assignment(task.key, shares, float(outcome.score)))
        if self._reserved:
            res_start[:] = np.inf
            self._reserved = False
        if saved is not None:
            self.state, self._stats, self._host_stats, self._pristine = saved
        return PlacementPlan(tuple(assignments), tuple(rejections), tuple(reservations))

    def _queue_key(self, now: float) -> Callable[[PendingTask], tuple[float, float, float, str]]:
        """The queue order at ``now`` (lowest key first): the effective priority (the task's own,
        plus ``aging_per_hour`` per hour waited) highest first; then the service key within a
        priority — 0 for FIFO; for shortest-first, log2 of the task's expected GPU-time less one
        per ``service_halving_s`` waited (so waiting halves it); for ranked, the task's own
        ``rank`` aged the same way; then submission time and key."""
        policy = self.policy
        order, unknown_s = policy.queue_order, policy.unknown_service_s
        aging, halving = policy.aging_per_hour, max(policy.service_halving_s, 1e-9)

        def key(task: PendingTask) -> tuple[float, float, float, str]:
            req = task.request
            waited = max(0.0, now - task.submitted_at)
            if order is QueueOrder.RANKED:  # the caller's rank (log2 units)
                service = task.rank - waited / halving
            elif order is QueueOrder.SHORTEST_FIRST:
                gpu_s = (req.expected_duration_s * req.count * req.milli_per_gpu / MILLI
                         if req.expected_duration_s > 0 else unknown_s)
                service = math.log2(max(gpu_s, 1.0)) - waited / halving
            else:
                service = 0.0
            return -(req.priority + aging * (waited / 3600.0)), service, task.submitted_at, task.key

        return key

    def _shares(self, choice: Choice) -> tuple[DeviceShare, ...]:
        devices = self.index.devices
        return tuple(
            DeviceShare(devices[d].uuid, devices[d].node, devices[d].index, choice.milli, mem)
            for d, mem in zip(choice.devices, choice.memory, strict=True)
        )

    # ---- one task ----------------------------------------------------------------------------

    def _find(
        self, task: PendingTask, state: FreeState, end: float, rng: np.random.Generator, *, use_stats: bool
    ) -> Choice | Rejection:
        return choose(self, task, state, end, rng, use_stats=use_stats)

    def _may_reserve(self, req: GPURequest, running: Sequence[RunningTask]) -> bool:
        return (
            self.policy.reservations
            and req.priority >= self.policy.critical_priority
            and any(r.expected_end is not None for r in running)
        )

    def _reserve(
        self, task: PendingTask, running: Sequence[RunningTask], now: float, rng: np.random.Generator
    ) -> Reservation | None:
        """Hold the devices that free up earliest for ``task`` (binary search over end times)."""
        ending = sorted(
            (r for r in running if r.expected_end is not None), key=lambda r: (r.expected_end, r.key)
        )

        def future(p: int) -> FreeState:
            state = self.state.copy()
            for r in ending[:p]:
                state.apply(
                    r.shares, release=True, cpu_milli=r.cpu_milli, host_memory_bytes=r.host_memory_bytes
                )
            return state

        lo, hi = 1, len(ending)
        found: tuple[int, Choice] | None = None
        while lo <= hi:
            mid = (lo + hi) // 2
            outcome = self._find(task, future(mid), math.inf, rng, use_stats=False)
            if isinstance(outcome, Choice):
                found = (mid, outcome)
                hi = mid - 1
            else:
                lo = mid + 1
        if found is None:
            return None
        p, choice = found
        start = max(now, float(ending[p - 1].expected_end or now))
        self.state.res_start[choice.devices] = np.minimum(self.state.res_start[choice.devices], start)
        self._reserved = True
        return Reservation(task.key, self._shares(choice), start)

    # ---- speed / energy ----------------------------------------------------------------------

    def model_speed(self, job_type: str | None) -> tuple[np.ndarray, np.ndarray]:
        """Per-model (speed, energy per unit of work) for ``job_type``."""
        hit = self._speed_cache.get(job_type)
        if hit is None:
            speed = model_speeds(self.policy, self.index, job_type)
            tdp = np.array([info.tdp_milliwatts if info else 300_000 for info in self.index.model_info])
            hit = (speed, tdp / speed)
            self._speed_cache[job_type] = hit
        return hit

