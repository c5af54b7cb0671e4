"""The one feasibility check: could a request be placed on this fleet, now or ever?

:func:`feasible` is what placement itself decides, without scoring: the devices
:func:`~gpusched.placement.filter.eligibility` lets the request use (vendor, model, minimum
architecture, labels, memory, partitioning, isolation, health, cordons, standby), optionally
with the room they have free now, then the request's shape (:func:`shape_fits`: enough such
devices in one island / NUMA node / node / rack / fleet). The fault chain and the pre-scaler ask
it before ordering a retry or switching on a standby node, so they never order what placement
would reject as never fitting.

:func:`fitting_nodes` and :func:`gang_fit` are the same check for a multi-node gang, whose members
(one request each) go to distinct nodes: how many of them the fleet holds. The scheduler's gang
placement (:mod:`gpusched.scheduler.gangs`) judges a gang's wait with it and the standby
scale-out (:mod:`gpusched.capacity.prescale`) decides with it which standby nodes a waiting gang needs.
"""

from __future__ import annotations

import numpy as np

from gpusched.catalog import Catalog
from gpusched.model import MILLI, FleetSnapshot
from gpusched.placement.filter import eligibility, fraction_fits, milli_need
from gpusched.placement.index import FleetIndex, FreeState, fleet_index
from gpusched.placement.policy import Policy
from gpusched.placement.topology import node_counts
from gpusched.request import GPURequest, Interconnect

__all__ = ["feasible", "fitting_nodes", "gang_fit", "shape_fits"]

_DEFAULT_POLICY = Policy()


def shape_fits(index: FleetIndex, devices: np.ndarray, request: GPURequest) -> bool:
    """Whether the ``devices`` mask holds ``request.count`` devices in the shape it asks for.

    One island / NUMA node / node for a single-node request; one rack for ``same_rack``; the
    whole fleet for ``any``.
    """
    k = request.count
    if k <= 1:
        return bool(devices.any())
    counts = node_counts(index, devices, k)
    if counts.feasible(k, request.interconnect).any():
        return True
    if not request.may_span_nodes:
        return False
    if request.interconnect is Interconnect.SAME_RACK:
        per_rack = np.bincount(index.node_rack, weights=counts.count, minlength=len(index.racks))
        return bool(per_rack.max(initial=0) >= k)
    return int(counts.count.sum()) >= k


def feasible(
    request: GPURequest,
    snapshot: FleetSnapshot,
    *,
    excluded: frozenset[str] = frozenset(),
    empty: bool = False,
    policy: Policy | None = None,
    catalog: Catalog | None = None,
) -> bool:
    """Whether ``request`` fits the healthy, uncordoned (and not closed), active part of ``snapshot``.

    With ``empty`` current usage is ignored (could it *ever* run here?); otherwise the devices
    must be free now. ``excluded`` device uuids count as gone (about to be cordoned). ``policy``
    (default: the default :class:`Policy`) decides fraction rounding and partitioning, as in
    placement. No scoring, reservations, quotas or host CPU/RAM.
    """
    index = fleet_index(snapshot, catalog)
    return shape_fits(index, _devices(index, request, snapshot, excluded, empty, policy), request)


def fitting_nodes(
    request: GPURequest,
    snapshot: FleetSnapshot,
    *,
    empty: bool = False,
    policy: Policy | None = None,
    catalog: Catalog | None = None,
) -> tuple[str, ...]:
    """The nodes (fleet order) each of which holds ``request`` on its own: the devices
    :func:`feasible` counts (healthy, uncordoned, active; free now unless ``empty``) in the shape
    it asks for within that one node."""
    index = fleet_index(snapshot, catalog)
    k = max(1, request.count)
    devices = _devices(index, request, snapshot, frozenset(), empty, policy)
    holds = node_counts(index, devices, k).feasible(k, request.interconnect)
    return tuple(node.name for node, fits in zip(index.nodes, holds, strict=True) if fits)


def gang_fit(
    request: GPURequest,
    size: int,
    same_rack: bool,
    snapshot: FleetSnapshot,
    *,
    empty: bool = False,
    policy: Policy | None = None,
) -> int:
    """How many of a gang's ``size`` members (each ``request``, each on a node of its own) fit
    ``snapshot``: the most nodes of one rack (``same_rack``) or of the fleet that each hold one
    member (:func:`fitting_nodes`), at most ``size``. ``size`` means the whole gang fits."""
    fits = set(fitting_nodes(request, snapshot, empty=empty, policy=policy))
    per_rack: dict[str, int] = {}
    for node in snapshot.nodes:
        if node.name in fits:
            per_rack[node.rack] = per_rack.get(node.rack, 0) + 1
    most = max(per_rack.values(), default=0) if same_rack else len(fits)
    return min(size, most)


def _devices(
    index: FleetIndex,
    request: GPURequest,
    snapshot: FleetSnapshot,
    excluded: frozenset[str],
    empty: bool,
    policy: Policy | None,
) -> np.ndarray:
    """The devices ``request`` may use (eligible, in service; with room now unless ``empty``)."""
    policy = policy or _DEFAULT_POLICY
    milli = milli_need(request, policy.round_up_fractions)
    fractional = milli < MILLI
    elig = eligibility(
        index, request, fractional=fractional, fractions_need_partitioning=policy.fractions_need_partitioning,
        closed=snapshot.closed,
    )
    devices = elig.usable
    if excluded:
        devices = devices & np.array([d.uuid not in excluded for d in index.devices], dtype=bool)
    if not empty:
        free = FreeState(index, snapshot)
        if fractional:
            devices = fraction_fits(
                index, devices, free.free_milli, free.free_mem, milli, request.memory_per_gpu
            )
        else:
            devices = devices & (free.free_milli >= MILLI) & (free.free_mem >= index.dev_mem)
    return devices
