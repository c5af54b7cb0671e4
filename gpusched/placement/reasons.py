"""Why a task cannot be placed, in words (the rejection reasons of :mod:`gpusched.placement.choose`).

``never_fits`` explains a request even the empty fleet cannot hold (permanent); the others
explain a wait: busy devices, reservations, topology, host CPU/RAM.
"""

from __future__ import annotations

import numpy as np

from gpusched.placement import filter as flt
from gpusched.placement.feasible import shape_fits
from gpusched.placement.index import FleetIndex
from gpusched.placement.topology import NodeCounts, node_counts
from gpusched.placement.types import PendingTask, Reservation
from gpusched.request import GPURequest, Interconnect

__all__ = ["busy_reason", "gang_reason", "host_reason", "never_fits", "reserved_note"]


def never_fits(idx: FleetIndex, req: GPURequest, elig: flt.Eligibility, frac: bool) -> str | None:
    """A reason when even the empty fleet (all devices in service) cannot hold the request."""
    k = req.count
    if frac or k == 1:
        return None
    key = (
        "never",
        req.vendors,
        req.models,
        req.labels,
        req.min_arch,
        req.memory_per_gpu,
        k,
        req.interconnect,
    )
    if key in idx.masks:
        cached: str | None = idx.masks[key]
        return cached
    reason = None
    if not shape_fits(idx, elig.hardware, req):
        nc = node_counts(idx, elig.hardware, k)
        what = req.describe()
        if req.may_span_nodes:
            per_rack = np.bincount(idx.node_rack, weights=nc.count, minlength=len(idx.racks))
            total = int(nc.count.sum())
            if req.interconnect is Interconnect.SAME_RACK and per_rack.max() < k:
                reason = f"needs {what}; the largest rack has only {int(per_rack.max())} matching devices"
            elif total < k:
                reason = f"needs {what}; the whole fleet has only {total} matching devices"
        elif req.interconnect is Interconnect.ISLAND:
            reason = f"needs {what}; the largest matching island in the fleet has {int(nc.island.max())}"
        elif req.interconnect is Interconnect.SAME_NUMA:
            reason = f"needs {what}; the largest matching NUMA node in the fleet has {int(nc.numa.max())}"
        else:
            reason = f"needs {what}; the largest matching node in the fleet has {int(nc.count.max())}"
    idx.masks[key] = reason
    return reason


def _held(fits: np.ndarray, fits_now: np.ndarray) -> str:
    held = int((fits_now & ~fits).sum())
    return f", {held} held for a reservation" if held else ""


def busy_reason(
    req: GPURequest, elig: flt.Eligibility, fits: np.ndarray, fits_now: np.ndarray, frac: bool
) -> str:
    what = req.describe(fractional=frac)
    busy = elig.n_usable - int(fits_now.sum())
    note = flt.operational_note(elig)
    extra = f"; {note}" if note else ""
    held = _held(fits, fits_now)
    return f"waiting for {what}: {elig.n_usable} matching devices in service, {busy} busy{held}{extra}"


def gang_reason(
    idx: FleetIndex,
    req: GPURequest,
    elig: flt.Eligibility,
    nc: NodeCounts,
    fits: np.ndarray,
    fits_now: np.ndarray,
) -> str:
    k = req.count
    if k == 1:
        return busy_reason(req, elig, fits, fits_now, False)
    what = req.describe()
    note = flt.operational_note(elig)
    extra = f"; {note}" if note else ""
    free = int(nc.count.sum())
    if req.interconnect is Interconnect.ISLAND:
        head = f"largest free island: {int(nc.island.max(initial=0))}"
    elif req.interconnect is Interconnect.SAME_NUMA:
        head = f"largest free set in one NUMA node: {int(nc.numa.max(initial=0))}"
    elif req.may_span_nodes:
        per_rack = np.bincount(idx.node_rack, weights=nc.count, minlength=len(idx.racks))
        head = f"{free} free in the fleet, at most {int(per_rack.max(initial=0))} in one rack"
    else:
        best = int(np.argmax(nc.count)) if len(nc.count) else 0
        most = int(nc.count.max(initial=0))
        head = f"largest free set on one node: {most}" + (f" ({idx.nodes[best].name})" if most else "")
    return f"needs {what}; {head} ({free} matching free{_held(fits, fits_now)}){extra}"


def host_reason(req: GPURequest, task: PendingTask, frac: bool) -> str:
    what = req.describe(fractional=frac)
    return (
        f"{what}: devices are free, but no node holding them has {task.cpu_milli / 1000:g} CPU cores and "
        f"{task.host_memory_bytes / 2**30:.1f} GiB of host memory free"
    )


def reserved_note(reservation: Reservation, now: float) -> str:
    """What a rejection adds when the task holds ``reservation``: the devices and when."""
    nodes = sorted({s.node for s in reservation.shares})
    wait = reservation.start - now
    return (
        f"; reserved {len(reservation.shares)} device(s) on {', '.join(nodes)} "
        f"from t={reservation.start:.0f} (in {wait / 60:.0f} min, when running tasks end)"
    )
