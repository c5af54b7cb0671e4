"""Victim selection for preemption (pure): which running tasks to stop so a waiting one fits.

``select_victims(PreemptionRequest) -> PreemptionPlan | NoPreemption``. The executor's cycle
(:mod:`gpusched.airflow.gpu_preemption`) and the simulator (:mod:`gpusched.sim.preempt`) call the
same function.

Who may be a victim (``mode``):

- ``priority``: running tasks of strictly lower priority than the waiting task (for a gang: than
  its highest-priority member);
- ``partitions``: those, and also tasks of a partition that runs beyond its share (on capacity it
  borrowed) while the waiting task's partition reclaims room within its own share (quota
  enforced); only as much as was borrowed is taken back.
- ``service``: those of lower priority, and tasks of the same priority whose expected-remaining-
  service index (``indices``: key → Gittins index, :mod:`gpusched.durations.service`) is lower
  than the waiting task's by more than ``index_margin`` (Tiresias-style preemption by attained
  service; the caller computes the indices, the waiting one aged by its wait).

Never a victim: a key in ``protected`` (multi-node gang members, tasks another executor holds,
tasks already being stopped), a task that has run for less than ``min_runtime_s`` (no
thrashing of fresh work), or a task in ``restarted`` (it was preempted before) that has not yet
checkpointed since its current start: every run of a preempted task keeps some work, so the same
task cannot be stopped again and again with nothing saved. A restarted task has attained much
service (a low index) and has lost little since its restart, so without this rule it is the
first victim again at the next arrival, and a queue can ping-pong without progress.

A victim **by index** (mode ``service``, same priority: stopping it is a bet on the queue's
mean wait, not an order) must also pay for itself: with ``max_unsaved_s`` > 0 it is not a task
that has run longer than that since its last checkpoint (else since its start), so a victim is
chosen soon after it saved and what a preemption throws away stays under that much run time per
GPU (a task that never checkpoints is such a victim only in its first ``max_unsaved_s``); and
a restarted task is not one before it has run ``min_rerun_s`` since its restart: a preempted
job, wide ones above all, waits long to resume (a low index, and room that smaller work keeps
taking), so stopping it again soon after it got back costs more waiting than its beneficiary
gains. Victims of lower priority or on borrowed partition capacity are not held back by either.

Choice: candidates are ordered by the work they would lose — GPU-seconds since their last
checkpoint (``checkpoints``; else since they started) — then by lower priority and later start.
The shortest prefix of that order after which the waiting work fits is found (bisection), then
every victim the fit does not need is dropped again (most work lost first): the least work lost
with the fewest victims this greedy finds. The fit is always PROVEN by running placement on the
snapshot without the victims (``prover``; default: :func:`gpusched.placement.place` of every
waiting task with the remaining running tasks and the quota) before a plan is returned; the plan
carries the placement that justified it.

Cost: a proof is a placement call, so the search asks as few as it can without changing the
outcome for a prover whose fit is monotone (more victims never hurt a fit — true of placement):
a cheap necessary check (:class:`_NodeRoom`: enough devices with the milli-GPU free, on one node
unless the task may span nodes) rules victim sets out without a proof; the shortest prefix that
check lets through is proven first (usually it fits: one proof); and no victim set is proven
twice. ``tests/unit/test_placement_preemption_fast.py`` checks on random fleets that the plans
equal those of the plain search (bisection with a proof at every step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from gpusched.durations.service import outranks
from gpusched.errors import ConfigurationError
from gpusched.model import MILLI, DeviceShare, FleetSnapshot
from gpusched.placement.engine import place
from gpusched.placement.policy import Policy
from gpusched.placement.types import PendingTask, PlacementRequest, RunningTask
from gpusched.placement.warm import WarmPlacement
from gpusched.quota.policy import QuotaState, partition_capacity, physical_milli
from gpusched.request import Partition

__all__ = [
    "MAX_CANDIDATES", "PREEMPTION_MODES", "NoPreemption", "PartitionUse", "PreemptionPlan",
    "PreemptionRequest", "Proof", "Prover", "Victim", "check_mode", "select_victims",
]

PREEMPTION_MODES = ("off", "priority", "partitions", "service")
MAX_CANDIDATES = 64
"""At most this many candidates (least work lost first) are considered for one waiting task."""

Proof = tuple[Mapping[str, tuple[DeviceShare, ...]] | None, str]
"""A prover's answer: the shares of every waiting key (None = does not fit) and why not."""
Prover = Callable[[FleetSnapshot, Sequence[RunningTask]], Proof]
"""Places the waiting work on a snapshot (without victims) beside the remaining running tasks."""


def check_mode(value: str, where: str = "[gpusched] preemption", extra: tuple[str, ...] = ()) -> str:
    """``value`` normalised to one of :data:`PREEMPTION_MODES` (or ``extra``: modes the caller
    handles itself, e.g. ``migrate``), or a one-line ConfigurationError."""
    mode = str(value).strip().lower()
    modes = (*PREEMPTION_MODES, *extra)
    if mode not in modes:
        raise ConfigurationError(f"{where} = {value!r} is not one of {', '.join(modes)}; "
                                 f"e.g. {where.split()[-1]} = priority")
    return mode


@dataclass(frozen=True, slots=True)
class PreemptionRequest:
    """Every input of one victim selection.

    ``waiting``: the task, or every member of one gang (all must fit); ``running``: every task
    holding devices (their shares counted in ``snapshot``); ``checkpoints``: key → time of its last
    checkpoint; ``protected``: keys never to stop; ``quota``: partitions and budgets the proof
    places with; ``min_runtime_s``: tasks younger than this are never stopped; ``indices`` (mode
    ``service``): key → Gittins index of the waiting and running tasks (a running task without
    one is not a victim by index), ``index_margin``: the factor the waiting index must exceed a
    victim's by; ``restarted``: keys of running tasks that were preempted before (not victims
    until their checkpoint in ``checkpoints`` is later than their current start, nor before
    they have run ``min_rerun_s`` since it, as victims by index); ``max_unsaved_s``: > 0, tasks
    with more run time than this since their last checkpoint are not victims by index (0: no limit);
    ``engine``: a placement engine the caller keeps for its proofs (the plans ``place`` makes, on
    an engine rebased from proof to proof; None: a fresh engine per proof).
    """

    waiting: tuple[PendingTask, ...]
    snapshot: FleetSnapshot
    running: tuple[RunningTask, ...]
    policy: Policy
    now: float
    quota: QuotaState
    mode: str = "priority"
    min_runtime_s: float = 0.0
    checkpoints: Mapping[str, float] = field(default_factory=dict)
    protected: frozenset[str] = frozenset()
    indices: Mapping[str, float] = field(default_factory=dict)
    index_margin: float = 2.0
    restarted: frozenset[str] = frozenset()
    max_unsaved_s: float = 0.0
    min_rerun_s: float = 0.0
    engine: WarmPlacement | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Victim:
    """A task to stop: why it may be, and the work it loses (GPU-seconds since its checkpoint)."""

    key: str
    shares: tuple[DeviceShare, ...]
    reason: str
    lost_gpu_s: float
    since: float


@dataclass(frozen=True, slots=True)
class PreemptionPlan:
    """Stop ``victims``; then ``placement`` (key → shares of every waiting task) is proven to fit."""

    victims: tuple[Victim, ...]
    placement: Mapping[str, tuple[DeviceShare, ...]]
    reason: str

    @property
    def lost_gpu_s(self) -> float:
        """Work lost over all victims, in GPU-seconds."""
        return sum(v.lost_gpu_s for v in self.victims)


@dataclass(frozen=True, slots=True)
class NoPreemption:
    """No victims: why not (e.g. nothing of lower priority, or it would not fit even then)."""

    reason: str


def select_victims(request: PreemptionRequest, prover: Prover | None = None) -> PreemptionPlan | NoPreemption:
    """Choose victims so every waiting task fits, proven by placement (see the module docstring)."""
    mode = check_mode(request.mode, "preemption mode")
    if mode == "off" or not request.waiting:
        return NoPreemption("preemption is off")
    candidates = _candidates(request, mode)
    if not candidates:
        return NoPreemption(_nobody(request, mode))
    candidates = candidates[:MAX_CANDIDATES]
    room = _NodeRoom(request)
    prove = prover or _default_prover(request)
    proofs: dict[frozenset[str], Proof] = {}

    def proof(victims: Sequence[Victim]) -> Proof:
        """The prover's answer without ``victims``, each victim set asked at most once."""
        gone = frozenset(v.key for v in victims)
        if gone not in proofs:
            proofs[gone] = _proof(request, prove, request.running, victims)
        return proofs[gone]

    def fits(victims: Sequence[Victim]) -> bool:  # the cheap necessary check first
        return room.may_fit(victims) and proof(victims)[0] is not None

    if not room.may_fit(candidates):
        return NoPreemption(f"stopping all {len(candidates)} task(s) it may preempt would still not make "
                            f"room: {room.why()}")
    # The shortest prefix after which the waiting work fits (more victims never hurt a fit):
    # the first prefix the cheap check lets through, proven at once if it fits (the usual case);
    # else the whole list must fit, and the prefix is bisected in between.
    n_all = len(candidates)
    lo = _first(lambda n: room.may_fit(candidates[:n]), 1, n_all)
    if not fits(candidates[:lo]):
        if lo == n_all or proof(candidates)[0] is None:
            return NoPreemption(f"stopping all {n_all} task(s) it may preempt would still not make "
                                f"room: {proof(candidates)[1]}")
        lo = _first(lambda n: fits(candidates[:n]), lo + 1, n_all)
    chosen = list(candidates[:lo])
    for victim in sorted(chosen, key=lambda v: -v.lost_gpu_s):  # drop victims the fit does not need
        rest = [v for v in chosen if v.key != victim.key]
        if rest and fits(rest):
            chosen = rest
    placement, why = proof(chosen)
    if placement is None:  # cannot happen: the chosen set was proven above; never stop anything unproven
        return NoPreemption(f"no proven placement after preemption: {why}")
    names = ", ".join(v.key for v in chosen)
    return PreemptionPlan(tuple(chosen), MappingProxyType(dict(placement)),
                          f"preempting {names} ({sum(v.lost_gpu_s for v in chosen):.0f} GPU-s of work "
                          f"since their checkpoints lost)")


def _first(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """The least n in [lo, hi] with ``ok(n)``, by bisection (``ok`` monotone, ``ok(hi)`` true)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


class _NodeRoom:
    """A necessary condition for the waiting work to fit without some victims, checked before any
    placement proof: every waiting task needs ``count`` devices that each have at least its
    milli-GPU free (counting all devices, eligible or not) — on one node unless it may span nodes.
    It over-approximates placement (no memory, model, host or quota conditions), so it only ever
    rules out victim sets that the proof would reject too; decisions are the proof's."""

    def __init__(self, request: PreemptionRequest) -> None:
        self.tasks = [(t.request.count, t.request.milli_per_gpu, t.request.may_span_nodes)
                      for t in request.waiting]
        self.free, self.node, self.base = _free_devices(request.snapshot, {m for _, m, _ in self.tasks})
        self.short = ""

    def may_fit(self, victims: Sequence[Victim]) -> bool:
        """False when the waiting work cannot fit even after stopping ``victims``."""
        released: dict[str, int] = {}
        for victim in victims:
            for share in victim.shares:
                released[share.uuid] = released.get(share.uuid, 0) + share.milli
        for count, milli, span in self.tasks:
            per_node, total = self.base[milli]
            gained: dict[str, int] = {}
            for uuid, milli_back in released.items():
                free = self.free.get(uuid)
                if free is not None and free < milli <= free + milli_back:
                    gained[self.node[uuid]] = gained.get(self.node[uuid], 0) + 1
            if span:
                ok = total + sum(gained.values()) >= count
            else:
                ok = any(n + gained.get(node, 0) >= count for node, n in per_node.items()) or any(
                    per_node.get(node, 0) + n >= count for node, n in gained.items())
            if not ok:
                where = "in the fleet" if span else "on any one node"
                self.short = f"fewer than {count} device(s) with {milli} milli-GPU free {where}"
                return False
        return True

    def why(self) -> str:
        """Why the last check failed."""
        return self.short


_FreeDevices = tuple[dict[str, int], dict[str, str], dict[int, tuple[dict[str, int], int]]]
_LAST_FREE: list[tuple[object, object, _FreeDevices]] = []  # the last snapshot's (a cache by identity)


def _free_devices(snapshot: FleetSnapshot, millis: set[int]) -> _FreeDevices:
    """Free milli-GPU and node of every device, and per milli-GPU asked: how many devices per node
    (and in all) have that much free. Kept for the last snapshot asked (selections of one cycle
    share it); the cache holds the snapshot's usage and nodes, so their identity cannot be reused."""
    hit = _LAST_FREE[0] if _LAST_FREE else None
    if hit is not None and hit[0] is snapshot.usage and hit[1] is snapshot.nodes:
        free, node, base = hit[2]
    else:
        free = {d.uuid: snapshot.free_milli(d.uuid) for d in snapshot.devices()}
        node = {d.uuid: d.node for d in snapshot.devices()}
        base = {}
        _LAST_FREE[:] = [(snapshot.usage, snapshot.nodes, (free, node, base))]
    for milli in millis - base.keys():
        per_node: dict[str, int] = {}
        for uuid, left in free.items():
            if left >= milli:
                per_node[node[uuid]] = per_node.get(node[uuid], 0) + 1
        base[milli] = (per_node, sum(per_node.values()))
    return free, node, base


def _proof(
    request: PreemptionRequest, prove: Prover, running: Sequence[RunningTask], victims: Sequence[Victim]
) -> Proof:
    gone = {v.key for v in victims}
    freed = [s for v in victims for s in v.shares]
    snapshot = request.snapshot.with_usage(freed, release=True)
    return prove(snapshot, tuple(r for r in running if r.key not in gone))


def _default_prover(request: PreemptionRequest) -> Prover:
    waiting = request.waiting

    def prove(snapshot: FleetSnapshot, running: Sequence[RunningTask]) -> Proof:
        asked = PlacementRequest(pending=waiting, snapshot=snapshot, policy=request.policy,
                                 now=request.now, quota=request.quota, running=running)
        plan = request.engine.place(asked) if request.engine is not None else place(asked)
        if len(plan.assignments) != len(waiting):
            return None, plan.rejections[0].reason if plan.rejections else "does not fit"
        return {a.key: a.shares for a in plan.assignments}, ""

    return prove


def _candidates(request: PreemptionRequest, mode: str) -> list[Victim]:
    """Who may be stopped for ``request.waiting``, least work lost first."""
    priority = max(t.request.priority for t in request.waiting)
    waiting_keys = {t.key for t in request.waiting}
    reclaim = _reclaimable(request) if mode == "partitions" else {}
    out: list[tuple[tuple[float, int, float, str], Victim]] = []
    for task in request.running:
        if task.key in request.protected or task.key in waiting_keys or not task.shares:
            continue
        if request.now - task.started_at < request.min_runtime_s or _unsaved_restart(request, task):
            continue
        if task.request.priority < priority:
            reason = f"priority {task.request.priority} < {priority}"
        elif (mode == "service" and task.request.priority == priority and not _held_back(request, task)
              and (why := _lower_index(request, task))):
            reason = why
        elif task.request.partition in reclaim:
            reason = (f"partition {task.request.partition.value!r} runs on capacity borrowed beyond its "
                      f"share; {request.waiting[0].request.partition.value!r} reclaims it")
        else:
            continue
        since = _saved_at(request, task)
        gpus = physical_milli(task.shares, request.snapshot) / MILLI
        lost = max(0.0, request.now - since) * gpus
        order = (lost, task.request.priority, -task.started_at, task.key)
        out.append((order, Victim(task.key, tuple(task.shares), reason, lost, since)))
    out.sort(key=lambda item: item[0])
    victims = [v for _, v in out]
    if reclaim:  # take back at most what each partition borrowed (priority victims are not capped)
        victims = _cap_borrowed(victims, request, reclaim, priority)
    return victims


def _saved_at(request: PreemptionRequest, task: RunningTask) -> float:
    """When ``task``'s current run last saved its work: its last checkpoint, else its start."""
    return max(task.started_at, request.checkpoints.get(task.key, task.started_at))


def _unsaved_too_long(request: PreemptionRequest, task: RunningTask) -> bool:
    """True when ``task`` has run longer than ``max_unsaved_s`` since it last saved its work."""
    limit = request.max_unsaved_s
    return limit > 0 and request.now - _saved_at(request, task) > limit


def _rerun_too_short(request: PreemptionRequest, task: RunningTask) -> bool:
    """True when ``task`` was preempted before and has run less than ``min_rerun_s`` since."""
    return task.key in request.restarted and request.now - task.started_at < request.min_rerun_s


def _held_back(request: PreemptionRequest, task: RunningTask) -> bool:
    """True when ``task`` may not be a victim by index: too much unsaved work, or too soon rerun."""
    return _unsaved_too_long(request, task) or _rerun_too_short(request, task)


def _unsaved_restart(request: PreemptionRequest, task: RunningTask) -> bool:
    """True when ``task`` was preempted before and has not checkpointed since its current start."""
    return task.key in request.restarted and request.checkpoints.get(task.key, -1.0) <= task.started_at


def _lower_index(request: PreemptionRequest, task: RunningTask) -> str:
    """Why ``task`` may be stopped by index for the waiting work ("" = it may not)."""

    mine = [request.indices[t.key] for t in request.waiting if t.key in request.indices]
    theirs = request.indices.get(task.key)
    if not mine or theirs is None or not outranks(max(mine), theirs, request.index_margin):
        return ""
    return (f"expected-service index {theirs:.3g} /GPU-s < {max(mine):.3g} / {request.index_margin:g} "
            "(expected to need more service)")


@dataclass(frozen=True, slots=True)
class PartitionUse:
    """Milli-GPU each partition's running work holds, and each partition's share of the fleet:
    the one reckoning of mode ``partitions`` (who runs on borrowed capacity, who may reclaim)."""

    used: Mapping[Partition, int]
    share: Mapping[Partition, int]
    enforced: bool

    @classmethod
    def of(cls, quota: QuotaState, snapshot: FleetSnapshot, running: Sequence[RunningTask]) -> PartitionUse:
        used = dict.fromkeys(Partition, 0)
        if not quota.enforced:
            return cls(used, dict.fromkeys(Partition, 0), False)
        capacity = partition_capacity(snapshot)
        for task in running:
            used[task.request.partition] += physical_milli(task.shares, snapshot)
        return cls(used, {p: quota.policy.share_milli(p, capacity) for p in Partition}, True)

    def reclaimable(self, mine: Partition, need: int) -> dict[Partition, int]:
        """Partitions running beyond their share → milli-GPU borrowed, when partition ``mine`` is
        within its own share after ``need`` more (empty when no quota is enforced)."""
        if not self.enforced or self.used[mine] + need > self.share[mine]:
            return {}
        return {p: self.used[p] - self.share[p] for p in Partition
                if p is not mine and self.used[p] > self.share[p]}


def _reclaimable(request: PreemptionRequest) -> dict[Partition, int]:
    """:meth:`PartitionUse.reclaimable` for the waiting work of ``request``."""
    use = PartitionUse.of(request.quota, request.snapshot, request.running)
    need = sum(t.request.total_milli for t in request.waiting)
    return use.reclaimable(request.waiting[0].request.partition, need)


def _cap_borrowed(
    victims: list[Victim], request: PreemptionRequest, reclaim: Mapping[Partition, int], priority: int
) -> list[Victim]:
    partition = {t.key: t.request.partition for t in request.running}
    low = {t.key for t in request.running if t.request.priority < priority}
    left = dict(reclaim)
    kept = []
    for victim in victims:
        part = partition[victim.key]
        if victim.key in low:
            kept.append(victim)
        elif left.get(part, 0) > 0:
            left[part] -= physical_milli(victim.shares, request.snapshot)
            kept.append(victim)
    return kept


def _nobody(request: PreemptionRequest, mode: str) -> str:
    priority = max(t.request.priority for t in request.waiting)
    young = sum(1 for t in request.running if request.now - t.started_at < request.min_runtime_s)
    unsaved = sum(1 for t in request.running if _unsaved_restart(request, t))
    what = "of lower priority" + (" or on borrowed partition capacity" if mode == "partitions" else "")
    what += " or of a lower expected-service index" if mode == "service" else ""
    why = [f"{young} ran for less than the {request.min_runtime_s:.0f} s minimum"] if young else []
    why += [f"{unsaved} preempted before and not checkpointed since restarting"] if unsaved else []
    if mode == "service":
        stale = sum(1 for t in request.running if _unsaved_too_long(request, t))
        rerun = sum(1 for t in request.running if _rerun_too_short(request, t))
        if stale:
            why.append(f"{stale} ran more than {request.max_unsaved_s:.0f} s since their last checkpoint")
        if rerun:
            why.append(f"{rerun} restarted after a preemption less than {request.min_rerun_s:.0f} s ago")
    tail = f" ({'; '.join(why)})" if why else ""
    return f"no running task {what} than {priority} may be preempted{tail}"
