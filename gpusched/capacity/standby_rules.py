"""The standby rules: when standby nodes go on, when they go back, how the burst reserve is kept (pure).

One set of rules for every driver: the agent's cycle (:mod:`gpusched.agent.telemetry`, through
:mod:`gpusched.capacity.scaling`) and the pre-scaling simulation (:mod:`gpusched.sim.prescale`)
call these functions and keep only their own bookkeeping around them.

* :func:`reactive_scale_out` — which standby nodes to switch on for the work that waits for
  capacity: tasks (and whole multi-node gangs) that waited at least a threshold, longest waiting
  first. A task that fits the fleet as it is now waits for something else (a budget, a partition
  limit, a task ahead of it in line) and is left alone. The others take their room from the
  capacity in service and being provisioned, then from standby nodes switched on for them, one at
  a time in the order the fleet offers them; a node switched on for one task is offered to the
  next ones too, so its spare room is not requested twice.
* :func:`scale_in` — which switched-on standby nodes go back to standby: idle for a cool-down,
  no work waiting for them, the burst reserve still free afterwards and the capacity a plan
  wants still active.
* :func:`usable_gpus` — the burst reserve: burst work may take every free GPU, other work only
  the free GPUs beyond the reserve (defined in :mod:`gpusched.quota.policy`, the layer below
  placement, because the executors' placement keeps the same reserve: its quota gate,
  :class:`gpusched.placement.admission.QuotaGate`).

A driver describes its fleet through :class:`CapacityView`: the agent's view is a fleet snapshot
judged by placement's feasibility check (:class:`gpusched.capacity.prescale.SnapshotView`), the
simulation's a pool of GPU counts. The rules decide; the views only answer "does this fit".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gpusched.gang import GangMember
from gpusched.quota.policy import usable_gpus
from gpusched.request import GPURequest, Partition

__all__ = [
    "CapacityView",
    "ReactiveScaleOut",
    "ScaleIn",
    "SwitchedOn",
    "WaitingTask",
    "reactive_scale_out",
    "scale_in",
    "usable_gpus",
    "waiting_units",
]


@dataclass(frozen=True, slots=True)
class WaitingTask:
    """A task waiting for devices: its key, its request and since when it waits (epoch seconds);
    ``gang``: its membership when it is one member of a multi-node gang."""

    key: str
    request: GPURequest
    since: float
    gang: GangMember | None = None


@dataclass(frozen=True, slots=True)
class ReactiveScaleOut:
    """Standby nodes to activate for tasks that waited too long, and why (one line per task or gang)."""

    activate: tuple[str, ...]
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SwitchedOn:
    """A standby node that a scaler switched on: its GPUs and since when it is idle (None: busy).

    A driver that cannot tell which node its work sits on gives the time the node came up.
    """

    name: str
    gpus: int
    idle_since: float | None


@dataclass(frozen=True, slots=True)
class ScaleIn:
    """Switched-on standby nodes to send back to standby, and why (one line per node)."""

    release: tuple[str, ...]
    reasons: tuple[str, ...]


class CapacityView(Protocol):
    """A driver's fleet as the standby rules see it (immutable: each change returns a new view)."""

    def holds(self, request: GPURequest) -> bool:
        """Whether ``request`` fits the capacity of this view now."""
        ...

    def take(self, request: GPURequest) -> CapacityView:
        """The view with the room ``request`` would use taken (``request`` holds)."""
        ...

    def switchable(self) -> Sequence[str]:
        """The standby nodes that may be switched on, in the order they are offered."""
        ...

    def switch_on(self, names: Sequence[str]) -> CapacityView:
        """The view with the standby nodes ``names`` switched on."""
        ...

    def gang_standby(self, request: GPURequest, size: int, same_rack: bool) -> tuple[str, ...] | None:
        """The standby nodes a multi-node gang of ``size`` members (each ``request``, each on a
        node of its own) needs: ``()`` when it fits now, None when no standby node makes it fit."""
        ...


def _span(seconds: float) -> str:
    """A wait or an idle time in words: whole minutes, or seconds under two minutes."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def waiting_units(waiting: Sequence[WaitingTask]) -> list[tuple[float, WaitingTask]]:
    """The units the reactive rule serves, longest waiting first: each single task, and each
    multi-node gang whose members all wait (represented by its lowest rank, waiting since its
    last member arrived)."""
    units: list[tuple[float, str, WaitingTask]] = []
    gangs: dict[str, dict[int, WaitingTask]] = {}  # gang -> rank -> member
    sizes: dict[str, int] = {}
    for task in waiting:
        if task.gang is None:
            units.append((task.since, task.key, task))
        else:
            gangs.setdefault(task.gang.gang, {})[task.gang.rank] = task
            sizes[task.gang.gang] = task.gang.size
    for name, ranks in gangs.items():
        if len(ranks) == sizes[name]:  # every member waits
            units.append((max(m.since for m in ranks.values()), name, ranks[min(ranks)]))
    units.sort(key=lambda u: (u[0], u[1]))
    return [(since, task) for since, _, task in units]


def reactive_scale_out(
    waiting: Sequence[WaitingTask],
    fleet: CapacityView,
    *,
    now: float,
    threshold_s: float,
    coming: CapacityView | None = None,
) -> ReactiveScaleOut:
    """Which standby nodes to switch on so that the work waiting at least ``threshold_s`` starts.

    ``fleet`` is the capacity in service now; ``coming`` (default ``fleet``) the same plus what is
    being provisioned. A unit that fits ``fleet`` waits for something else and is left alone; a
    unit no standby node helps is not served here. A multi-node gang gets the nodes
    :meth:`CapacityView.gang_standby` names. See the module's description for the whole rule.
    """
    current = fleet if coming is None else coming
    chosen: list[str] = []
    reasons: list[str] = []
    for since, task in waiting_units(waiting):
        waited = now - since
        if waited < threshold_s:
            continue
        gang = task.gang
        if gang is not None:
            nodes = current.gang_standby(task.request, gang.size, gang.scope == "same_rack")
            if nodes:
                current = current.switch_on(nodes)
                chosen.extend(nodes)
                which = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {', '.join(nodes)}"
                reasons.append(f"multi-node gang {gang.gang.rsplit('/', 1)[-1]} ({gang.size} members of "
                               f"{task.request.count} GPU(s)) waited {_span(waited)} for standby "
                               f"{which}; activating {'it' if len(nodes) == 1 else 'them'}")
            continue
        if fleet.holds(task.request):
            continue
        if current.holds(task.request):
            current = current.take(task.request)
            continue
        for name in current.switchable():
            trial = current.switch_on((name,))
            if trial.holds(task.request):
                current = trial.take(task.request)
                chosen.append(name)
                reasons.append(f"{task.key} waited {_span(waited)} for {task.request.count} "
                               f"GPU(s) that standby node {name} gives; activating it")
                break
    return ReactiveScaleOut(tuple(chosen), tuple(reasons))


def scale_in(
    nodes: Sequence[SwitchedOn],
    *,
    now: float,
    cool_down_s: float,
    free_gpus: int,
    active_gpus: int,
    reserve_gpus: int = 0,
    keep_gpus: int = 0,
    waiting: bool = False,
) -> ScaleIn:
    """Which switched-on standby nodes go back to standby now.

    Nothing goes back while work waits that these nodes serve or would serve (``waiting``; the
    pool: any job in the queue). Otherwise each node of
    ``nodes`` (in the order given) goes back when it has been idle for ``cool_down_s``, the free
    GPUs left after it still cover the burst reserve (``reserve_gpus``; non-burst room,
    :func:`usable_gpus`) and the GPUs left active still cover ``keep_gpus`` (what a pre-scaling
    plan wants now). ``free_gpus`` / ``active_gpus``: the free and the active GPUs of the fleet,
    the switched-on nodes included.
    """
    if waiting:
        return ScaleIn((), ())
    release: list[str] = []
    reasons: list[str] = []
    free, active = free_gpus, active_gpus
    for node in nodes:
        if node.idle_since is None or now - node.idle_since < cool_down_s:
            continue
        if usable_gpus(free, reserve_gpus, partition=Partition.TRAINING) < node.gpus:
            continue
        if active - node.gpus < keep_gpus:
            continue
        free -= node.gpus
        active -= node.gpus
        release.append(node.name)
        reasons.append(f"standby node {node.name} idle {_span(now - node.idle_since)} "
                       f"(cool-down {_span(cool_down_s)}); back to standby")
    return ScaleIn(tuple(release), tuple(reasons))
