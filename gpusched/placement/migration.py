"""Migration between GPU types (pure): which running tasks to checkpoint and restart on another model.

``plan_migrations(MigrationRequest) -> MigrationPlan``. The simulator calls it after each pass
(``gpusched simulate --preemption migrate``, :mod:`gpusched.sim.preempt`) and the executors call
it every ``migration_interval_seconds`` with ``[gpusched] preemption = migrate``
(:mod:`gpusched.airflow.gpu_migration`).

The rule is Gavel's heterogeneity-aware objective (OSDI'20: maximise the sum of normalised
throughputs) made incremental and charged for the move. A task's *normalised speed* on a model is
its throughput there over its throughput on the fastest model of the fleet it may use
(``Policy.speed_of``: the throughput table per job type, else the catalog's A100-equivalent
figure). Over the decision horizon ``H`` (the time until the rule runs again: one round), a task
that stays on model ``a`` does ``H·n(a)`` best-GPU-seconds of work; moved to ``b`` it loses the
restart cost ``C`` (checkpoint, release, restore) and does ``(H − C)·n(b)``. The net gain of a move
is therefore ``H·(n(b) − n(a)) − C·n(b)`` (``H`` shortened to the task's expected remaining run
when it has one). ``H`` is one round by default (every move pays for itself before the rule runs
again: safe, but a restart longer than a round never pays); with ``by_age`` a task that has run
longer than a round is credited its age (run time attained, ``attained``) as its horizon — the
age predictor of LAS schedulers for heavy-tailed job sizes, where work that has run long tends to
run long still. Moves are taken only with a positive gain:

1. to a free device of a faster model (greedy, largest gain first; a device a mover frees may
   take the next mover);
2. exchanges of two running tasks between two models, when the sum of both gains is positive:
   the task that gains more from the fast model takes it from the one that loses least by
   leaving it (comparative advantage; Gavel's allocation puts the same jobs there).

Every accepted move strictly raises the sum of normalised throughputs net of restart costs, so a
fleet in a steady state never oscillates (a move back has a negative gain).

Only tasks on one whole device move (multi-device, gang and fractional tasks stay), never one in
``protected`` or younger than ``min_runtime_s``, at most ``max_moves`` per call. The plan is
PROVEN by placement before it is returned: every mover is placed by
:func:`gpusched.placement.place` on the snapshot without the movers' shares, with its request
pinned to its target model, beside the tasks that stay; a mover placement does not take is dropped
(it keeps its devices) and the rest is proven again. A plan never over-commits a device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from gpusched.catalog import Catalog, default_catalog
from gpusched.model import MILLI, DeviceShare, FleetSnapshot
from gpusched.placement.engine import place
from gpusched.placement.policy import Policy
from gpusched.placement.types import PendingTask, PlacementRequest, RunningTask
from gpusched.quota.policy import QuotaState

__all__ = ["DEFAULT_RESTART_S", "MIGRATE", "MigrationPlan", "MigrationRequest", "Move", "plan_migrations"]

MIGRATE = "migrate"
"""The preemption mode that runs this rule."""
DEFAULT_RESTART_S = 60.0
"""Default restart cost of one move: checkpoint on notice, release, restore on the new device."""


@dataclass(frozen=True, slots=True)
class MigrationRequest:
    """Every input of one migration decision.

    ``running``: every task holding devices (their shares counted in ``snapshot``); ``job_types``:
    key → job type for the throughput table (absent = the catalog's speed); ``restart_s``: the
    cost ``C`` of one move; ``horizon_s``: ``H``, the time until the rule runs again (> 0);
    ``by_age``: a task's horizon is at least its attained run time (``attained``: key → seconds
    run over all its runs; absent = since ``started_at``).
    """

    snapshot: FleetSnapshot
    running: tuple[RunningTask, ...]
    policy: Policy
    now: float
    quota: QuotaState
    job_types: Mapping[str, str | None] = field(default_factory=dict)
    restart_s: float = DEFAULT_RESTART_S
    horizon_s: float = 360.0
    min_runtime_s: float = 0.0
    protected: frozenset[str] = frozenset()
    max_moves: int = 16
    by_age: bool = False
    attained: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.restart_s) and self.restart_s >= 0):
            raise ValueError(f"restart cost {self.restart_s!r} s must be a number >= 0")
        if not (math.isfinite(self.horizon_s) and self.horizon_s > 0):
            raise ValueError(f"migration horizon {self.horizon_s!r} s must be a number > 0")


@dataclass(frozen=True, slots=True)
class Move:
    """Restart ``key`` (now on ``shares`` of ``from_model``) on ``placement`` of ``to_model``.

    ``gain``: its net gain over the horizon, in best-GPU-seconds (see the module docstring).
    """

    key: str
    from_model: str
    to_model: str
    shares: tuple[DeviceShare, ...]
    placement: tuple[DeviceShare, ...]
    gain: float


@dataclass(frozen=True, slots=True)
class MigrationPlan:
    """The proven moves (possibly none) and a one-line account."""

    moves: tuple[Move, ...]
    reason: str

    @property
    def gain(self) -> float:
        """Net gain of all moves over the horizon, in best-GPU-seconds."""
        return sum(m.gain for m in self.moves)


@dataclass(frozen=True, slots=True)
class _Mover:
    task: RunningTask
    model: str
    speeds: Mapping[str, float]  # model -> normalised speed (1.0 on its fastest allowed model)
    horizon: float


def plan_migrations(request: MigrationRequest, catalog: Catalog | None = None) -> MigrationPlan:
    """The moves worth their restart cost, proven by placement (see the module docstring)."""
    movers = _movers(request, catalog or default_catalog())
    if not movers:
        return MigrationPlan((), "no running task on one whole device may move")
    groups = _choose(request, movers)
    if not groups:
        return MigrationPlan((), "no move gains more than its restart cost")
    while groups:
        chosen = {key: target for group in groups for key, target in group}
        placed = _prove(request, movers, chosen)
        if len(placed) == len(chosen):
            moves = tuple(
                Move(key, movers[key].model, target, movers[key].task.shares, placed[key],
                     _net_gain(request, movers[key], target))
                for key, target in chosen.items()
            )
            total = sum(m.gain for m in moves)
            return MigrationPlan(moves, f"moving {len(moves)} task(s) between GPU types gains "
                                        f"{total:.0f} best-GPU-s net of {request.restart_s:.0f} s restarts")
        groups = [g for g in groups if all(key in placed for key, _ in g)]  # an exchange moves whole
    return MigrationPlan((), "no move could be placed")


def _net_gain(request: MigrationRequest, mover: _Mover, target: str) -> float:
    if target not in mover.speeds or target == mover.model:
        return -math.inf
    to, here = mover.speeds[target], mover.speeds[mover.model]
    return mover.horizon * (to - here) - min(request.restart_s, mover.horizon) * to


def _movers(request: MigrationRequest, catalog: Catalog) -> dict[str, _Mover]:
    snapshot = request.snapshot
    models = sorted({d.model for d in snapshot.devices() if d.takes_work})
    out: dict[str, _Mover] = {}
    for task in request.running:
        if (task.key in request.protected or len(task.shares) != 1 or task.shares[0].milli != MILLI
                or task.request.count != 1 or request.now - task.started_at < request.min_runtime_s
                or not snapshot.has_device(task.shares[0].uuid)):
            continue
        here = snapshot.device(task.shares[0].uuid).model
        allowed = [m for m in models if not task.request.models or m in task.request.models]
        job_type = request.job_types.get(task.key)
        raw = {m: request.policy.speed_of(job_type, m, _a100(catalog, m)) for m in allowed}
        best = max(raw.values(), default=0.0)
        if here not in raw or best <= 0:
            continue
        horizon = request.horizon_s
        if request.by_age:
            horizon = max(horizon, request.attained.get(task.key, request.now - task.started_at))
        if task.expected_end is not None:
            horizon = min(horizon, max(0.0, task.expected_end - request.now))
        if horizon > 0:
            out[task.key] = _Mover(task, here, {m: s / best for m, s in raw.items()}, horizon)
    return out


def _a100(catalog: Catalog, model: str) -> int:
    known = catalog.find(model)
    return known.a100_equiv_milli if known is not None else MILLI  # unknown model: neutral speed


def _free_by_model(snapshot: FleetSnapshot) -> dict[str, int]:
    free: dict[str, int] = {}
    for device in snapshot.devices():
        if device.takes_work and not device.cordoned and snapshot.free_milli(device.uuid) == MILLI:
            free[device.model] = free.get(device.model, 0) + 1
    return free


def _choose(request: MigrationRequest, movers: Mapping[str, _Mover]) -> list[tuple[tuple[str, str], ...]]:
    """Groups of (key, target model) that move together: moves to free devices, then exchanges
    (pairs), greedy by net gain."""
    free = _free_by_model(request.snapshot)
    chosen: dict[str, str] = {}
    groups: list[tuple[tuple[str, str], ...]] = []
    while len(chosen) < request.max_moves:  # 1. moves to free devices of a faster model
        best: tuple[float, str, str] | None = None
        for key, mover in movers.items():
            if key in chosen:
                continue
            for target, count in free.items():
                gain = _net_gain(request, mover, target)
                if count > 0 and gain > 0 and (best is None or (gain, key) > (best[0], best[1])):
                    best = (gain, key, target)
        if best is None:
            break
        _, key, target = best
        chosen[key] = target
        groups.append(((key, target),))
        free[target] -= 1
        free[movers[key].model] = free.get(movers[key].model, 0) + 1
    while len(chosen) + 2 <= request.max_moves:  # 2. exchanges between two models
        pair = _best_exchange(request, movers, chosen)
        if pair is None:
            break
        (a, b) = pair
        chosen[a] = movers[b].model
        chosen[b] = movers[a].model
        groups.append(((a, chosen[a]), (b, chosen[b])))
    return groups


def _best_exchange(
    request: MigrationRequest, movers: Mapping[str, _Mover], chosen: Mapping[str, str]
) -> tuple[str, str] | None:
    """The two unmoved tasks on different models whose exchange gains most (> 0), or None."""
    by_model: dict[str, list[_Mover]] = {}
    for key, mover in movers.items():
        if key not in chosen:
            by_model.setdefault(mover.model, []).append(mover)
    best: tuple[float, str, str] | None = None
    for a in sorted(by_model):
        for b in sorted(by_model):
            if a >= b:
                continue
            # the two gains are independent: the best pair is the best of each side
            up = max(by_model[a], key=lambda m: (_net_gain(request, m, b), m.task.key))
            down = max(by_model[b], key=lambda m: (_net_gain(request, m, a), m.task.key))
            gain = _net_gain(request, up, b) + _net_gain(request, down, a)
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, up.task.key, down.task.key)
    return None if best is None else (best[1], best[2])


def _prove(
    request: MigrationRequest, movers: Mapping[str, _Mover], chosen: Mapping[str, str]
) -> Mapping[str, tuple[DeviceShare, ...]]:
    """Place every chosen mover, pinned to its target model, on the snapshot without the movers."""
    moving = [movers[k].task for k in chosen]
    snapshot = request.snapshot.with_usage([s for t in moving for s in t.shares], release=True)
    staying = tuple(r for r in request.running if r.key not in chosen)
    ranked = sorted(chosen, key=lambda k: -_net_gain(request, movers[k], chosen[k]))
    pending = tuple(
        PendingTask(key, replace(movers[key].task.request, models=frozenset({chosen[key]})), float(rank))
        for rank, key in enumerate(ranked)
    )
    plan = place(PlacementRequest(pending=pending, snapshot=snapshot, policy=request.policy,
                                  now=request.now, quota=request.quota, running=staying))
    return MappingProxyType({a.key: tuple(a.shares) for a in plan.assignments})
