"""Pre-scaling policy: turn a demand forecast into a plan (pure; no I/O).

:func:`plan_prescale` says which standby nodes to activate *now* so that they are ready before
the predicted demand arrives, and how many GPUs to hold back for the burst partition.
:func:`standby_for_waiting` is the reactive half: which standby nodes would let tasks (and
multi-node gangs) that have waited too long for capacity start — the shared rule of
:mod:`gpusched.capacity.standby_rules` over a fleet snapshot (:class:`SnapshotView`);
:func:`standby_for_gang` is its rule for one gang, which the scheduler also uses to tell a gang
that waits for standby capacity from one that can never fit.
:func:`activate_in_snapshot` shows a fleet snapshot as it will be once a plan is carried out.
The providers that carry plans out live in :mod:`gpusched.capacity.scaling` (the edge).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from gpusched.capacity.forecast import Forecast
from gpusched.capacity.standby_rules import ReactiveScaleOut, WaitingTask, reactive_scale_out
from gpusched.errors import ScalingError
from gpusched.model import FleetSnapshot, Node
from gpusched.placement.engine import place
from gpusched.placement.feasible import feasible, fitting_nodes
from gpusched.placement.policy import Policy
from gpusched.placement.types import PendingTask, PlacementRequest
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest

__all__ = [
    "ReactiveScaleOut",
    "ScaleStep",
    "ScalingPlan",
    "SnapshotView",
    "WaitingTask",
    "activate_in_snapshot",
    "plan_prescale",
    "standby_for_gang",
    "standby_for_waiting",
]

_TAKE_POLICY = Policy()
"""The policy :meth:`SnapshotView.take` places with (the default one: room accounting, not a decision)."""


@dataclass(frozen=True, slots=True)
class ScaleStep:
    """Capacity wanted for one forecast step: ready by ``at``, so requested by ``request_by``."""

    at: float
    request_by: float
    demand_gpus: float
    target_gpus: int


@dataclass(frozen=True, slots=True)
class ScalingPlan:
    """What to do now so capacity meets the forecast.

    Attributes:
        created_at: when the plan was made (epoch seconds or simulation clock).
        provisioning_delay_s: how long a standby node takes to become usable.
        active_gpus: capacity active (or already being provisioned) when planning.
        target_gpus: capacity wanted by ``created_at + provisioning_delay_s + lookahead``.
        activate: standby node names to activate now (empty = nothing to do).
        surplus_gpus: active capacity the forecast does not need in the window (scale-in hint).
        burst_reserve_gpus: GPUs to keep free for the burst partition.
        steps: the per-step targets the plan was derived from.
        model: the forecasting model behind it.
        reason: one human-readable line.
    """

    created_at: float
    provisioning_delay_s: int
    active_gpus: int
    target_gpus: int
    activate: tuple[str, ...]
    surplus_gpus: int
    burst_reserve_gpus: int
    steps: tuple[ScaleStep, ...]
    model: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (what command and webhook scalers receive)."""
        data = asdict(self)
        data["activate"] = list(self.activate)
        data["steps"] = [asdict(s) for s in self.steps]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScalingPlan:
        """Inverse of :meth:`to_dict`."""
        return cls(
            created_at=float(data["created_at"]),
            provisioning_delay_s=int(data["provisioning_delay_s"]),
            active_gpus=int(data["active_gpus"]), target_gpus=int(data["target_gpus"]),
            activate=tuple(str(n) for n in data["activate"]), surplus_gpus=int(data["surplus_gpus"]),
            burst_reserve_gpus=int(data["burst_reserve_gpus"]),
            steps=tuple(ScaleStep(**s) for s in data["steps"]),
            model=str(data["model"]), reason=str(data["reason"]),
        )


def plan_prescale(
    forecast: Forecast,
    capacity: int,
    provisioning_delay_s: int,
    *,
    now: float,
    standby: Sequence[Node] = (),
    burst_forecast: Forecast | None = None,
    headroom: float = 0.1,
    use_upper: bool = True,
    lookahead_s: int = 3600,
    max_burst_fraction: float = 0.2,
) -> ScalingPlan:
    """Pure: the standby nodes to activate now and the burst reserve, from a forecast.

    Capacity requested now is usable at ``now + provisioning_delay_s``; it must cover the peak
    of the forecast (upper interval bound when ``use_upper``, times ``1 + headroom``) over every
    step that overlaps ``[now, now + provisioning_delay_s + lookahead_s)``. Standby nodes are
    taken largest first, smallest last so the overshoot stays small. The burst reserve is the
    peak of ``burst_forecast`` (upper bound) in the same window, or the forecast's uncertainty
    band (upper − mean) without one, capped at ``max_burst_fraction`` of the target.
    """
    if capacity < 0 or provisioning_delay_s < 0:
        raise ScalingError("capacity and provisioning_delay_s must be ≥ 0; check the scaler settings")
    horizon_end = now + provisioning_delay_s + lookahead_s
    series = forecast.upper if use_upper else forecast.mean
    steps: list[ScaleStep] = []
    band = 0.0
    for i, at in enumerate(forecast.timestamps()):
        if at + forecast.step_s <= now or at >= horizon_end:
            continue
        demand = series[i]
        steps.append(ScaleStep(at, at - provisioning_delay_s, demand,
                               math.ceil(demand * (1 + headroom) - 1e-9)))
        band = max(band, forecast.upper[i] - forecast.mean[i])
    target = max((s.target_gpus for s in steps), default=capacity)
    burst = band
    if burst_forecast is not None:
        burst = max(
            (burst_forecast.upper[i] for i, at in enumerate(burst_forecast.timestamps())
             if at + burst_forecast.step_s > now and at < horizon_end),
            default=0.0,
        )
    burst_reserve = min(math.ceil(burst - 1e-9), math.floor(max_burst_fraction * max(target, capacity)))
    target = max(target, 0)
    activate: list[str] = []
    missing = target - capacity
    if missing > 0:
        pool = sorted(standby, key=lambda n: (-len(n.devices), n.name))
        chosen: list[Node] = []
        for node in pool:
            if missing <= 0:
                break
            chosen.append(node)
            missing -= len(node.devices)
        # Swap the last pick for the smallest node that still covers what it covered.
        if chosen:
            covered_before = missing + len(chosen[-1].devices)
            fits = [n for n in pool if n not in chosen[:-1] and len(n.devices) >= covered_before]
            if fits:
                chosen[-1] = min(fits, key=lambda n: (len(n.devices), n.name))
                missing = covered_before - len(chosen[-1].devices)
        activate = [n.name for n in chosen]
    added = sum(len(n.devices) for n in standby if n.name in activate)
    if activate:
        reason = (f"forecast peak {target} GPUs (with {headroom:.0%} headroom) by "
                  f"+{provisioning_delay_s}s exceeds active {capacity}: activate {len(activate)} "
                  f"standby node(s) (+{added} GPUs)")
        if missing > 0:
            reason += f"; still {missing} GPUs short — no standby capacity left"
    else:
        reason = f"active {capacity} GPUs cover the forecast peak {target}"
    return ScalingPlan(
        created_at=now, provisioning_delay_s=provisioning_delay_s, active_gpus=capacity,
        target_gpus=target, activate=tuple(activate), surplus_gpus=max(0, capacity - target),
        burst_reserve_gpus=max(0, burst_reserve), steps=tuple(steps), model=forecast.model,
        reason=reason,
    )


def activate_in_snapshot(snapshot: FleetSnapshot, names: Sequence[str]) -> FleetSnapshot:
    """Pure: the snapshot with the named standby nodes switched to active."""
    wanted = set(names)
    changed = [replace(n, standby=False) for n in snapshot.nodes if n.name in wanted and n.standby]
    return snapshot.with_nodes(changed) if changed else snapshot


def standby_for_gang(
    request: GPURequest, size: int, same_rack: bool, snapshot: FleetSnapshot, *, empty: bool = False
) -> tuple[str, ...] | None:
    """The standby nodes to switch on so that all ``size`` members of a multi-node gang fit.

    Each member (``request``) needs a node of its own (of one rack when ``same_rack``); a node
    holds one when :func:`gpusched.placement.feasible.fitting_nodes` says so (free now, or idle
    with ``empty``). Returns ``()`` when the gang fits without any, the fewest uncordoned standby
    nodes that make it fit (fleet order; the rack needing fewest first), or None when even every
    standby node would not be enough.
    """
    fits_now = set(fitting_nodes(request, snapshot, empty=empty))
    spare = [n.name for n in snapshot.nodes if n.standby and not snapshot.takes_no_work(n)]
    with_spare = activate_in_snapshot(snapshot, spare)
    helpful = set(fitting_nodes(request, with_spare, empty=empty)) & set(spare)
    racks = dict.fromkeys(n.rack for n in snapshot.nodes) if same_rack else {"": None}
    best: tuple[str, ...] | None = None
    for rack in racks:
        group = [n for n in snapshot.nodes if not same_rack or n.rack == rack]
        missing = size - sum(1 for n in group if n.name in fits_now)
        if missing <= 0:
            return ()
        extra = [n.name for n in group if n.name in helpful]
        if len(extra) >= missing and (best is None or missing < len(best)):
            best = tuple(extra[:missing])
    return best


def standby_for_waiting(
    waiting: Sequence[WaitingTask], snapshot: FleetSnapshot, *, now: float, threshold_s: float,
    coming: Sequence[str] = (),
) -> ReactiveScaleOut:
    """Which standby nodes to switch on so that tasks waiting longer than ``threshold_s`` start.

    The shared rule :func:`gpusched.capacity.standby_rules.reactive_scale_out` over the fleet
    ``snapshot`` (:class:`SnapshotView`): a task that fits the active fleet now waits for
    something else (a budget, a partition limit) and is left alone; one that fits once a standby
    node is on gets the first such node (fleet order) and takes its room there, so the next task
    is offered what is left; tasks no standby node helps are not served here. A multi-node gang
    counts as one unit once all its members wait (since its last member arrived) and gets the
    standby nodes :func:`standby_for_gang` names. ``coming``: standby nodes already switched on
    and still on their way (their host booting): capacity the waiting work counts on, not asked for again.
    """
    on_the_way = SnapshotView(activate_in_snapshot(snapshot, coming)) if coming else None
    return reactive_scale_out(waiting, SnapshotView(snapshot), now=now, threshold_s=threshold_s,
                              coming=on_the_way)


@dataclass(frozen=True, slots=True)
class SnapshotView:
    """A fleet snapshot as the standby rules see it (:class:`~gpusched.capacity.standby_rules.CapacityView`).

    ``holds`` is placement's feasibility check, ``take`` adds the devices placement itself would
    choose for the request (default policy, no quota) to the snapshot's usage, ``switchable`` are
    the uncordoned standby nodes in fleet order and ``gang_standby`` is :func:`standby_for_gang`.
    """

    snapshot: FleetSnapshot

    def holds(self, request: GPURequest) -> bool:
        """Whether ``request`` fits the free devices of the active fleet."""
        return feasible(request, self.snapshot)

    def take(self, request: GPURequest) -> SnapshotView:
        """The snapshot with the devices placement would give ``request`` in use."""
        plan = place(PlacementRequest(
            pending=(PendingTask("gpusched-scale-out", request, 0.0),), snapshot=self.snapshot,
            policy=_TAKE_POLICY, now=0.0, quota=QuotaState.unlimited(),
        ))
        if not plan.assignments:
            return self
        return SnapshotView(self.snapshot.with_usage(plan.assignments[0].shares))

    def switchable(self) -> tuple[str, ...]:
        """The uncordoned standby nodes, fleet order."""
        return tuple(n.name for n in self.snapshot.nodes if n.standby and not self.snapshot.takes_no_work(n))

    def switch_on(self, names: Sequence[str]) -> SnapshotView:
        """The snapshot with those standby nodes active."""
        return SnapshotView(activate_in_snapshot(self.snapshot, names))

    def gang_standby(self, request: GPURequest, size: int, same_rack: bool) -> tuple[str, ...] | None:
        """:func:`standby_for_gang` on this snapshot."""
        return standby_for_gang(request, size, same_rack, self.snapshot)
