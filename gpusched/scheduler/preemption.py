"""Preemption in the scheduling cycle: which held work gets victims, and how each victim stops.

Every driver runs it the same way, around :func:`gpusched.scheduler.cycle.decide`:

1. before the cycle, :meth:`Preemptions.hold_nominated` keeps the room a preemption in flight
   was proven on for its beneficiary while the victims stop (Kubernetes' nominated node); work of
   lower priority queued meanwhile would otherwise take it and the beneficiary would need a second
   round of victims;
2. the cycle itself is :meth:`Preemptions.decide`: the beneficiaries whose victims have just
   ended (a gang with all its members) are placed first, the rest on what their launches leave;
3. after the cycle, :meth:`Preemptions.consider` gives the most urgent work still held for
   capacity (a gang as one unit; at most :data:`MAX_SELECTIONS_PER_CYCLE` selections, at most one
   new preemption per cycle: the next cycle sees its effect) a victim selection
   (:func:`gpusched.placement.preemption.select_victims`), proven by placement on the snapshot
   the cycle's launches leave. A started preemption is one statement (:class:`Started`): every
   victim gets a notice at once (:class:`Eviction`: when, why, its deadline after the grace);
4. at every step of the clock, :meth:`Preemptions.due` names the victims to stop now — those that
   reported a checkpoint after their notice, and those whose grace has run out. The driver stops
   them (the executors clear the Airflow try; the simulator requeues the job) and, once a victim
   no longer runs, :meth:`Preemptions.forget_ended` drops its eviction: its beneficiary then has
   the first pick.

Inputs only a driver knows come in explicitly: each running task's last checkpoint, the keys it
must never stop (tasks another executor holds, multi-node gang members), the tries that were
preempted before (:class:`PreemptionFacts`), and for ``service`` the Gittins indices.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.placement import PendingTask, RunningTask
from gpusched.placement.preemption import (
    NoPreemption,
    PartitionUse,
    PreemptionPlan,
    PreemptionRequest,
    Proof,
    Prover,
    check_mode,
    select_victims,
)
from gpusched.placement.warm import WarmPlacement
from gpusched.quota.policy import physical_milli
from gpusched.scheduler.attained import PREEMPTED_REASON
from gpusched.scheduler.cycle import CycleReply, CycleRequest, Hold, PendingWork, decide
from gpusched.scheduler.gangs import place_gang
from gpusched.scheduler.keys import task_of

__all__ = [
    "MAX_SELECTIONS_PER_CYCLE", "Eviction", "PreemptionFacts", "PreemptionRules", "Preemptions", "Started",
    "after_launches",
]

MAX_SELECTIONS_PER_CYCLE = 4
"""Victim selections per cycle (most urgent held work first), bounding the cycle's cost."""


_LIMITS = {  # field -> the [gpusched] setting it comes from, and what it means
    "grace_s": ("preemption_grace_seconds", "how long a victim may take to stop; e.g. 30"),
    "min_runtime_s": ("preemption_min_runtime_seconds", "no victim younger than this; e.g. 300"),
    "max_unsaved_s": ("preemption_max_unsaved_seconds", "0: no limit; e.g. 600"),
    "min_rerun_s": ("preemption_min_rerun_seconds", "0: the checkpoint alone; e.g. 7200"),
}


@dataclass(frozen=True, slots=True)
class PreemptionRules:
    """``[gpusched] preemption`` (``mode``), ``preemption_grace_seconds`` (``grace_s``),
    ``preemption_min_runtime_seconds`` (``min_runtime_s``), ``preemption_max_unsaved_seconds``
    (``max_unsaved_s``: no victim with more run time than this since its last checkpoint; 0: no
    limit), ``preemption_min_rerun_seconds`` (``min_rerun_s``: a task preempted before is no victim
    again before it has run this long since its restart); ``margin``: mode ``service``, the factor
    a waiting task's index must exceed a victim's by. A negative or non-finite limit raises
    ValueError naming its setting."""

    mode: str = "off"
    grace_s: float = 30.0
    min_runtime_s: float = 300.0
    margin: float = 2.0
    max_unsaved_s: float = 0.0
    min_rerun_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", check_mode(self.mode))
        for name, (setting, hint) in _LIMITS.items():
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"[gpusched] {setting} = {value!r} must be seconds >= 0 ({hint})")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


@dataclass(frozen=True, slots=True)
class PreemptionFacts:
    """What a driver knows of its running work for one victim selection: ``checkpoints`` (key →
    time of its last checkpoint), ``protected`` (keys never to stop), ``restarted`` (keys preempted
    before, not victims again until they checkpoint), ``indices`` (mode ``service``: key → Gittins
    index of the waiting and running work)."""

    checkpoints: Mapping[str, float] = field(default_factory=dict)
    protected: frozenset[str] = frozenset()
    restarted: frozenset[str] = frozenset()
    indices: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Eviction:
    """One victim being stopped: for whom (the beneficiary's key), when it was told, its deadline
    and the reason it is given; ``stopping``: its stop has been asked for."""

    victim: str
    beneficiary: str
    notice_at: float
    deadline: float
    reason: str
    lost_gpu_s: float = 0.0
    stopping: bool = False


@dataclass(frozen=True, slots=True)
class Started:
    """A preemption begun in this cycle: the held ``group`` (one task, or every member of one
    gang), the proven ``plan`` and the ``evictions`` of its victims (one per victim)."""

    group: tuple[PendingWork, ...]
    plan: PreemptionPlan
    evictions: tuple[Eviction, ...]

    @property
    def beneficiary(self) -> str:
        first = self.group[0]
        return first.key if first.gang is None else f"gang {first.gang.gang}"


class Preemptions:
    """The preemptions in flight of one scheduler and the rules they follow (see the module
    docstring). Mutable bookkeeping around the pure victim selection; one instance per driver."""

    def __init__(self, rules: PreemptionRules) -> None:
        self.rules = rules
        self.evictions: dict[str, Eviction] = {}  # victim key -> its eviction
        self.nominated: dict[str, tuple[DeviceShare, ...]] = {}  # beneficiary -> its proven placement
        # Task instances (keys without the try: a restart may requeue one as its next try) of the
        # beneficiaries whose victims have just ended.
        self.first_pick: frozenset[str] = frozenset()
        self._use: tuple[CycleRequest, PartitionUse] | None = None  # this cycle's partition use
        self._proofs = WarmPlacement()  # the victim selections' proofs, on one engine kept warm

    # ---- before and during a cycle ---------------------------------------------------------------

    def hold_nominated(self, request: CycleRequest, running: Collection[str]) -> CycleRequest:
        """``request`` with the free devices of each preemption in flight taken in its snapshot
        (``running``: the keys of the driver's running work). The hold ends when its victims have
        ended; in that cycle the beneficiary, if it waits, has the first pick (:meth:`decide`)."""
        stopping = {e.beneficiary for k, e in self.evictions.items() if k in running}
        ended = [task_of(b) for b in self.nominated if b not in stopping]
        waiting = {task_of(w.key) for w in request.pending} if ended else set()
        self.first_pick = frozenset(b for b in ended if b in waiting)
        self.nominated = {b: shares for b, shares in self.nominated.items() if b in stopping}
        snapshot, held = request.snapshot, []
        for share in (s for shares in self.nominated.values() for s in shares):
            if snapshot.has_device(share.uuid):
                milli = min(share.milli, snapshot.free_milli(share.uuid))
                memory = min(share.memory_bytes, snapshot.free_memory(share.uuid))
                if milli > 0:
                    held.append(replace(share, milli=milli, memory_bytes=max(0, memory)))
        return replace(request, snapshot=snapshot.with_usage(held)) if held else request

    def decide(self, request: CycleRequest) -> CycleReply:
        """:func:`~gpusched.scheduler.cycle.decide`, with the beneficiaries whose victims have
        just ended (:attr:`first_pick`, a gang with all its members) placed first and the rest on
        what their launches leave. Without it, a victim requeued meanwhile, aged from its first
        queue time, or any work ahead in the queue order would take the room made for the
        beneficiary and it would need a second round of victims."""
        picks = self.first_pick
        if not picks:
            return decide(request)
        gangs = {w.gang.gang for w in request.pending if task_of(w.key) in picks and w.gang is not None}
        first = {w.key for w in request.pending
                 if task_of(w.key) in picks or (w.gang is not None and w.gang.gang in gangs)}
        if not first:
            return decide(request)
        head = decide(replace(request, pending=tuple(w for w in request.pending if w.key in first)))
        rest = replace(request, pending=tuple(w for w in request.pending if w.key not in first))
        tail = decide(after_launches(rest, head))
        return CycleReply(head.launches + tail.launches, head.holds + tail.holds,
                          head.replanned or tail.replanned, head.replan_improved or tail.replan_improved)

    # ---- after a cycle ---------------------------------------------------------------------------

    def consider(self, request: CycleRequest, reply: CycleReply,
                 facts: PreemptionFacts) -> tuple[CycleReply, Started | None]:
        """Preempt for the most urgent work held for capacity. Returns ``reply`` with the held
        work's reasons (waiting for its victims) and the preemption started, if any; its
        evictions are already in :attr:`evictions`."""
        if not self.rules.enabled or not reply.holds:
            return reply, None
        request = after_launches(request, reply)
        works = {w.key: w for w in request.pending}
        waiting_for = {task_of(e.beneficiary) for e in self.evictions.values()}  # any try of it
        fresh = frozenset(launch.key for launch in reply.launches)
        protected = facts.protected | fresh | frozenset(self.evictions)
        reasons: dict[str, str] = {}
        started: Started | None = None
        tries = 0
        groups = _groups(reply.holds, works, facts.indices)
        lowest = min((r.request.priority for r in request.running if r.key not in protected), default=None)
        room: _Room | None = None
        for group in groups:
            keys = [w.key for w in group]
            if waiting_for and {task_of(k) for k in keys} & waiting_for:
                victims = sorted(v for v, e in self.evictions.items() if task_of(e.beneficiary) in
                                 {task_of(k) for k in keys})
                reasons.update({k: f"waiting for preempted {', '.join(victims)} to stop" for k in keys})
                continue
            if started is not None or tries >= MAX_SELECTIONS_PER_CYCLE or lowest is None:
                continue
            top = max(w.request.priority for w in group)
            # Nothing of lower priority runs; in mode partitions a selection can still succeed for
            # work whose partition reclaims its share. A group that can do neither is skipped
            # without spending a try, or held work that can never preempt would use every try of
            # every cycle and starve the work that could.
            if self.rules.mode in ("priority", "partitions") and top <= lowest and (
                    self.rules.mode == "priority" or not self._reclaims(request, group)):
                continue
            if self.rules.mode == "service" and group[0].gang is None:
                if room is None:
                    room = _Room(request, protected, facts.indices, top, self.rules.min_runtime_s)
                if not room.may_gain(group[0], facts.indices, self.rules.margin):
                    continue
            tries += 1
            asked = self._selection(request, group, facts, protected)
            outcome = select_victims(asked, _prover(request, group))
            if isinstance(outcome, NoPreemption):
                continue
            started = self._begin(outcome, tuple(group), request.now)
            reasons.update({k: f"{outcome.reason}; starts once their devices are free" for k in keys})
        if not reasons:
            return reply, started
        holds = tuple(h if h.key not in reasons else replace(h, reason=reasons[h.key]) for h in reply.holds)
        return CycleReply(reply.launches, holds, reply.replanned, reply.replan_improved), started

    def _reclaims(self, request: CycleRequest, group: list[PendingWork]) -> bool:
        """Mode ``partitions``: whether ``group``'s partition is within its share after the group
        and some other partition runs beyond its own (the partition use is read once a cycle)."""
        if self._use is None or self._use[0] is not request:
            self._use = (request, PartitionUse.of(request.quota, request.snapshot, request.running))
        need = sum(w.request.total_milli for w in group)
        return bool(self._use[1].reclaimable(group[0].request.partition, need))

    def _selection(self, request: CycleRequest, group: list[PendingWork], facts: PreemptionFacts,
                   protected: frozenset[str]) -> PreemptionRequest:
        return PreemptionRequest(
            tuple(PendingTask(w.key, w.request, w.submitted_at) for w in group), request.snapshot,
            request.running, request.policy, request.now, request.quota, mode=self.rules.mode,
            min_runtime_s=self.rules.min_runtime_s, checkpoints=facts.checkpoints, protected=protected,
            indices=facts.indices, index_margin=self.rules.margin, restarted=facts.restarted,
            max_unsaved_s=self.rules.max_unsaved_s, min_rerun_s=self.rules.min_rerun_s, engine=self._proofs,
        )

    def _begin(self, plan: PreemptionPlan, group: tuple[PendingWork, ...], now: float) -> Started:
        beneficiary = group[0].key
        self.nominated[beneficiary] = tuple(s for shares in plan.placement.values() for s in shares)
        who = beneficiary if group[0].gang is None else f"gang {group[0].gang.gang}"
        evictions = []
        for victim in plan.victims:
            reason = (f"{PREEMPTED_REASON} for {who} ({victim.reason}); "
                      f"{victim.lost_gpu_s:.0f} GPU-s since its last checkpoint")
            eviction = Eviction(victim.key, beneficiary, now, now + self.rules.grace_s, reason,
                                victim.lost_gpu_s)
            self.evictions[victim.key] = eviction
            evictions.append(eviction)
        return Started(group, plan, tuple(evictions))

    # ---- as the clock moves ----------------------------------------------------------------------

    def adopt(self, eviction: Eviction) -> None:
        """Take up a victim whose stop began before this scheduler (restored after a restart, or
        a move's old try): its grace counts from its notice, its beneficiary gets the first pick
        once it has ended (the held room itself is not restored)."""
        self.evictions[eviction.victim] = eviction
        if eviction.beneficiary:
            self.nominated.setdefault(eviction.beneficiary, ())

    def due(self, now: float, checkpointed_at: Callable[[str], float | None]) -> list[Eviction]:
        """The victims to stop now, each marked ``stopping``: those that reported a checkpoint
        after their notice (``checkpointed_at``: key → time of its last checkpoint, None: never)
        and those whose grace has run out."""
        out = []
        for key, eviction in list(self.evictions.items()):
            if eviction.stopping:
                continue
            saved = checkpointed_at(key)
            if (saved is not None and saved >= eviction.notice_at) or now >= eviction.deadline:
                self.evictions[key] = replace(eviction, stopping=True)
                out.append(self.evictions[key])
        return out

    def forget_ended(self, running: Collection[str]) -> list[Eviction]:
        """Drop the evictions of victims no longer in ``running`` (ended and released: their
        beneficiaries may start); returns them."""
        gone = [e for k, e in self.evictions.items() if k not in running]
        for eviction in gone:
            del self.evictions[eviction.victim]
        return gone

    def next_deadline(self) -> float:
        """When the earliest victim not yet stopping runs out of grace (inf: none)."""
        return min((e.deadline for e in self.evictions.values() if not e.stopping), default=math.inf)

    def release_reason(self, key: str) -> str | None:
        """The release reason of a victim whose run ended (None: not a victim)."""
        eviction = self.evictions.get(key)
        return None if eviction is None else f"{eviction.reason}; requeued"


def after_launches(request: CycleRequest, reply: CycleReply) -> CycleRequest:
    """``request`` as the cycle's launches leave it: their devices taken in the snapshot and the
    tasks running. A victim selection proven on the snapshot from before the launches could count
    a device a launch of the same cycle takes."""
    new = [launch for launch in reply.launches if not launch.reused]  # reused: already counted
    if not new:
        return request
    snapshot = request.snapshot.with_usage(s for launch in new for s in launch.shares)
    started = tuple(RunningTask(launch.key, launch.request, launch.shares, request.now, None)
                    for launch in new)
    return replace(request, snapshot=snapshot, running=(*request.running, *started))


def _groups(holds: Iterable[Hold], works: Mapping[str, PendingWork],
            indices: Mapping[str, float]) -> list[list[PendingWork]]:
    """Held work that waits for capacity, as units (a complete gang is one), most urgent first
    (highest priority, then highest index, then longest waiting). Work that can never fit,
    work already allocated and work queued behind a strict FIFO head do not preempt."""
    units: dict[str, list[PendingWork]] = {}
    for hold in holds:
        work = works.get(hold.key)
        if hold.permanent or hold.queued_behind or work is None or work.existing:
            continue
        unit = work.gang.gang if work.gang is not None else work.key
        units.setdefault(unit, []).append(work)
    complete = [u for u in units.values()
                if u[0].gang is None or len({w.gang.rank for w in u if w.gang}) == u[0].gang.size]
    return sorted(complete, key=lambda u: (-max(w.request.priority for w in u),
                                           -max(indices.get(w.key, 0.0) for w in u),
                                           min(w.submitted_at for w in u), u[0].key))


def _prover(request: CycleRequest, group: list[PendingWork]) -> Prover | None:
    if group[0].gang is None:
        return None  # placement of the task itself, with the quota

    def prove(snapshot: FleetSnapshot, running: Iterable[RunningTask]) -> Proof:
        plan = place_gang(group, snapshot, request.policy, now=request.now, running=tuple(running),
                          addresses=request.addresses)
        return (dict(plan.shares) or None), plan.reason

    return prove


class _Room:
    """Mode ``service``'s quick necessary check before a victim selection: the milli-GPU free
    now plus that of the running tasks a waiting one may preempt (old enough and not protected;
    a lower index by the margin, or a lower priority than the most urgent held work) could hold
    it. Over-approximates the candidates, so it only skips selections that could not succeed."""

    def __init__(self, request: CycleRequest, protected: frozenset[str], index: Mapping[str, float],
                 top_priority: int, min_runtime_s: float) -> None:
        snapshot = request.snapshot
        self.free = sum(snapshot.free_milli(d.uuid) for d in snapshot.devices() if d.takes_work)
        started_by = request.now - min_runtime_s
        ranked = sorted(
            (0.0 if r.request.priority < top_priority else index.get(r.key, math.inf),
             physical_milli(r.shares, snapshot))
            for r in request.running
            if r.key not in protected and r.started_at <= started_by and r.request.priority <= top_priority)
        self.bounds = [v for v, _ in ranked]
        self.prefix = list(itertools.accumulate((m for _, m in ranked), initial=0))

    def may_gain(self, work: PendingWork, index: Mapping[str, float], margin: float) -> bool:
        mine = index.get(work.key)
        if mine is None:
            return False
        candidates = self.prefix[bisect.bisect_left(self.bounds, mine / margin)]
        return candidates > 0 and self.free + candidates >= work.request.count * work.request.milli_per_gpu
