"""Why a task cannot be placed, in words (the rejection reasons of :mod:`gpusched.placement.choose`).

``never_fits`` explains a request even the empty fleet cannot hold (permanent); the others
explain a wait: busy devices, reservations, topology, host CPU/RAM.
"""

from __future__ import annotations

import numpy as np

from gpusched.model import MILLI
from gpusched.placement import filter as flt
from gpusched.placement.feasible import shape_fits
from gpusched.placement.index import FleetIndex, FreeState
from gpusched.placement.index import in_service as service_mask
from gpusched.placement.topology import NodeCounts, node_counts
from gpusched.placement.types import PendingTask, Reservation
from gpusched.request import GPURequest, Interconnect

__all__ = ["busy_reason", "gang_reason", "host_reason", "is_repartition_wait", "never_fits",
           "repartition_wait", "reserved_note"]


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


_REPARTITION_WAITS = ("waiting for a MIG re-partition", "waiting for a compute re-partition")


def is_repartition_wait(reason: str) -> bool:
    """Whether ``reason`` is :func:`repartition_wait`'s (the task waits for a slice to be made)."""
    return reason.startswith(_REPARTITION_WAITS)


def repartition_wait(
    idx: FleetIndex, req: GPURequest, state: FreeState, static: str, closed: frozenset[str] = frozenset()
) -> str | None:
    """Why a hard fraction that no existing slice holds waits instead of never fitting: a whole
    GPU of an allowed model can be re-partitioned into a slice that holds it (the host's agent does
    it with ``GPUSCHED_DYNAMIC_MIG``, or an operator by hand). None when no GPU could
    (``static``, the never-fits reason, stands). The ``closed`` nodes' GPUs are out of service."""
    if req.isolation != "hard" or not req.is_fractional:
        return None
    mask, profiles = flt.repartition_candidates(idx, req)
    if not mask.any():
        return None
    info = flt.slice_info(idx)
    in_service = mask & service_mask(idx, closed)
    idle = np.zeros(idx.n_devices, dtype=bool)
    for d in np.flatnonzero(in_service):
        slices = info.parent_pos == d
        own_free = info.mig_parent[d] or (
            state.free_milli[d] >= MILLI and state.free_mem[d] >= idx.dev_mem[d])
        idle[d] = bool(own_free and (state.free_milli[slices] >= MILLI).all())
    what = req.describe(fractional=True)
    candidates = idle if idle.any() else in_service if in_service.any() else mask

    def order(d: int) -> tuple[bool, bool, int]:
        dev = idx.devices[d]
        return (not dev.mig_enabled, dev.island is not None, int(d))

    best = min((int(d) for d in np.flatnonzero(candidates)), key=order)
    dev = idx.devices[best]
    profile = profiles[int(idx.dev_model[best])]
    model = idx.model_info[int(idx.dev_model[best])]
    mig = model is not None and "mig" in model.partitioning
    kind = "MIG re-partition" if mig else "compute re-partition"
    if not mig:
        how = f"amd-smi set --gpu <gpu> --compute-partition {profile}"
    elif dev.mig_enabled:
        how = f"nvidia-smi mig -i <gpu> -cgi {profile} -C"
    else:  # MIG mode needs a GPU reset, which gpusched never does
        how = f"nvidia-smi -i <gpu> -mig 1 while it is idle, then nvidia-smi mig -i <gpu> -cgi {profile} -C"
    if not mig:
        by = (f"the host's agent sets compute partition {profile} (GPUSCHED_DYNAMIC_MIG=amdsmi), or an "
              f"operator ({how})")
    else:
        agent = "GPUSCHED_DYNAMIC_MIG" if dev.mig_enabled else (
            "GPUSCHED_DYNAMIC_MIG; with real GPUs only once MIG mode is on")
        by = f"the host's agent makes a {profile} slice ({agent}), or an operator ({how})"
    where = f"{dev.uuid} ({dev.model} on {dev.node})"
    if idle.any():
        return f"waiting for a {kind} of {where}: no existing slice holds {what}; {by}"
    busy = int(in_service.sum())
    if busy:
        return (f"waiting for a {kind} of {where} once it is idle: no existing slice holds {what} and "
                f"all {busy} GPU(s) that could be re-partitioned are busy; {by}")
    return (f"waiting for a {kind}: no existing slice holds {what} and the {int(mask.sum())} GPU(s) "
            f"that could be re-partitioned are out of service ({static})")


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
