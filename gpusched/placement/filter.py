"""Hard constraints: which devices a request may use at all, and why others may not.

:func:`eligibility` turns a request's static needs (vendor, model, labels, minimum architecture,
memory, partitioning support, isolation) plus operational state (health, cordons, standby nodes) into a
boolean mask over the fleet's devices, cached per request signature on the fleet index. It also
counts how many devices each rule turned away, so a rejection can say why in plain words
(:meth:`GPURequest.describe`, :func:`shortage_reason`).

Isolation: a MIG-enabled GPU never takes work itself (its MIG instances do); a hard-isolated slice
(MIG instance, AMD compute partition) is only for fractional requests that accept ``hard``
isolation, matches their profile, memory and compute, and is handed out whole
(:func:`fraction_take`); whole-device and ``soft`` requests use unsliced devices only. A slice
whose parent GPU is unhealthy or cordoned is out of service with it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from gpusched.catalog import Vendor, arch_rank
from gpusched.model import MILLI
from gpusched.placement.index import FleetIndex, LruCache, closed_devices
from gpusched.request import GPURequest

__all__ = [
    "Eligibility",
    "eligibility",
    "fraction_fits",
    "fraction_take",
    "milli_need",
    "repartition_candidates",
    "slice_info",
]

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class Eligibility:
    """Devices a request may use, and counts of those turned away, rule by rule.

    ``hardware`` ignores health, cordons and standby (what could ever fit); ``usable`` applies
    them too. ``healthy`` marks usable devices that are not DEGRADED. The devices of a
    snapshot's closed nodes count as cordoned; ``base`` is then the eligibility without them
    (None: this is the inventory's own).
    """

    hardware: np.ndarray
    usable: np.ndarray
    healthy: np.ndarray
    n_kind: int  # devices of an allowed vendor/model/architecture with the labels
    n_memory: int  # ... that also have enough memory
    n_hardware: int  # ... that also allow sharing when the request is fractional
    n_unhealthy: int
    n_cordoned: int
    n_standby: int
    n_usable: int
    largest_slice_milli: int = 0  # the largest hard-isolated slice of a matching device (0: none)
    base: Eligibility | None = None


def milli_need(request: GPURequest, round_up_fractions: bool) -> int:
    """Compute share taken per device (a fraction becomes a whole device when rounding up)."""
    return MILLI if round_up_fractions else request.milli_per_gpu


@dataclass(frozen=True, slots=True)
class SliceInfo:
    """Per device of one fleet index: slice or not, MIG parent or not, compute share, profile."""

    is_slice: np.ndarray  # bool [D]
    mig_parent: np.ndarray  # bool [D]: MIG mode on, takes no work itself
    compute: np.ndarray  # int64 [D] compute_milli
    profile: tuple[str, ...]  # [D] casefolded profile, "" for whole devices
    parent_pos: np.ndarray  # int64 [D] position of the parent device, -1 when none in the fleet
    any_slices: bool


def slice_info(index: FleetIndex) -> SliceInfo:
    """The (cached) slice arrays of ``index``."""
    hit: SliceInfo | None = index.masks.get("slices")
    if hit is not None:
        return hit
    devs = index.devices
    is_slice = np.array([d.parent is not None for d in devs], dtype=bool)
    hit = SliceInfo(
        is_slice=is_slice,
        mig_parent=np.array([not d.takes_work for d in devs], dtype=bool),
        compute=np.array([d.compute_milli for d in devs], dtype=np.int64),
        profile=tuple((d.profile or "").casefold() for d in devs),
        parent_pos=np.array([index.pos.get(d.parent, -1) if d.parent else -1 for d in devs], dtype=np.int64),
        any_slices=bool(is_slice.any()),
    )
    index.masks["slices"] = hit
    return hit


def fraction_fits(
    index: FleetIndex,
    usable: np.ndarray,
    free_milli: np.ndarray,
    free_mem: np.ndarray,
    milli: int,
    memory: int,
) -> np.ndarray:
    """Devices that can take a fraction now: a shared device with room, or an entirely free slice."""
    shared = usable & (free_milli >= milli) & (free_mem >= memory)
    info = slice_info(index)
    if not info.any_slices:
        return shared
    return np.where(info.is_slice, usable & (free_milli >= MILLI), shared)


def fraction_take(index: FleetIndex, device: int, milli: int, memory: int) -> tuple[int, int]:
    """``(milli, memory)`` a fraction takes on ``device``: all of a slice, else what it asked."""
    if index.devices[device].parent is not None:
        return MILLI, int(index.dev_mem[device])
    return milli, memory


def eligibility(
    index: FleetIndex,
    request: GPURequest,
    *,
    fractional: bool,
    fractions_need_partitioning: bool,
    closed: frozenset[str] = frozenset(),
) -> Eligibility:
    """The (cached) eligibility of ``request``'s devices on ``index``'s fleet, the devices of the
    ``closed`` nodes (a snapshot's :attr:`~gpusched.model.FleetSnapshot.closed`) counted as
    cordoned (cached per set object, on top of the inventory's own)."""
    isolation = (request.isolation, request.profile, request.milli_per_gpu) if fractional else None
    key = (
        "elig",
        request.vendors,
        request.models,
        request.labels,
        request.min_arch,
        request.memory_per_gpu,
        fractional and fractions_need_partitioning,
        isolation,
    )
    hit = index.masks.get(key)
    if hit is None:
        hit = _compute(index, request, fractional and fractions_need_partitioning, fractional)
        index.masks[key] = hit
    shut = closed_devices(index, closed)
    if shut is None or not (hit.hardware & shut).any():
        return hit
    derived: dict[tuple[object, ...], Eligibility] | None = _DERIVED.get(index, closed)
    if derived is None:
        derived = {}
        _DERIVED.put(derived, index, closed)
    found = derived.get(key)
    if found is None:
        found = _closing(index, hit, np.flatnonzero(shut))
        derived[key] = found
    return found


def _closing(index: FleetIndex, base: Eligibility, closed: np.ndarray) -> Eligibility:
    """``base`` with the devices at positions ``closed`` cordoned (what :func:`_compute` gives
    with their nodes cordoned, in O(closed devices) but for two copies of the masks)."""
    health, cordoned_dev = _out_of_service(index)
    hardware = base.hardware[closed]
    newly = hardware & (health[closed] < 2) & ~cordoned_dev[closed]  # was usable or on standby
    usable, healthy = base.usable.copy(), base.healthy.copy()
    usable[closed] = False
    healthy[closed] = False
    return replace(
        base,
        usable=usable,
        healthy=healthy,
        n_cordoned=base.n_cordoned + int(newly.sum()),
        n_standby=base.n_standby - int((newly & index.dev_standby[closed]).sum()),
        n_usable=base.n_usable - int(base.usable[closed].sum()),
        base=base,
    )


def _out_of_service(index: FleetIndex) -> tuple[np.ndarray, np.ndarray]:
    """(health, cordoned) per device, a slice as healthy and as cordoned as its parent GPU
    (cached on the index)."""
    hit: tuple[np.ndarray, np.ndarray] | None = index.masks.get("out_of_service")
    if hit is None:
        info = slice_info(index)
        health = index.dev_health
        cordoned_dev = index.dev_cordoned
        if info.any_slices:  # a slice is as healthy and as cordoned as its parent GPU
            parent = np.maximum(info.parent_pos, 0)
            has_parent = info.parent_pos >= 0
            health = np.where(has_parent, np.maximum(health, health[parent]), health)
            cordoned_dev = cordoned_dev | (has_parent & cordoned_dev[parent])
        hit = (health, cordoned_dev)
        index.masks["out_of_service"] = hit
    return hit


_DERIVED = LruCache()


def repartition_candidates(index: FleetIndex, request: GPURequest) -> tuple[np.ndarray, tuple[str, ...]]:
    """Whole GPUs a hard fraction no existing slice holds could get a slice of once re-partitioned
    (MIG / compute partitions), health and cordons aside; and per model position the smallest
    profile that holds the request ("" where none does). Cached per request signature."""
    key = ("repartition", request.vendors, request.models, request.labels, request.min_arch,
           request.memory_per_gpu, request.milli_per_gpu, request.profile)
    hit: tuple[np.ndarray, tuple[str, ...]] | None = index.masks.get(key)
    if hit is not None:
        return hit
    kind_m, _ = _model_ok(index, request, False)
    want = (request.profile or "").casefold()
    profiles = []
    for m, info in enumerate(index.model_info):
        if info is None or not kind_m[m]:
            profiles.append("")
            continue
        mig = "mig" in info.partitioning
        fitting = [
            p for p in info.slice_profiles
            if p.memory_bytes >= request.memory_per_gpu and p.compute_milli >= request.milli_per_gpu
            and (not want or p.name.casefold() == want)
            and (mig or p.max_count > 1)  # SPX does not split an AMD card
        ]
        profiles.append(min(fitting, key=lambda p: (p.compute_milli, p.memory_bytes)).name if fitting else "")
    has_profile = np.array([bool(p) for p in profiles], dtype=bool)
    if not index.n_devices:
        return np.zeros(0, dtype=bool), tuple(profiles)
    mask = has_profile[index.dev_model] & ~slice_info(index).is_slice
    if request.labels:
        mask &= _labels_ok(index, request.labels)[index.dev_node]
    hit = (mask, tuple(profiles))
    index.masks[key] = hit
    return hit


def _isolation_ok(index: FleetIndex, request: GPURequest, fractional: bool) -> np.ndarray:
    """Devices the request's isolation allows: unsliced ones, and for hard/any fractions slices."""
    info = slice_info(index)
    whole = ~info.is_slice & ~info.mig_parent
    if not fractional or not info.any_slices:
        return whole if request.wants_shared or not fractional else np.zeros(index.n_devices, dtype=bool)
    allowed = whole if request.wants_shared else np.zeros(index.n_devices, dtype=bool)
    if request.wants_slice:
        want = (request.profile or "").casefold()
        slices = info.is_slice & (info.compute >= request.milli_per_gpu)
        if want:
            slices &= np.array([p == want for p in info.profile], dtype=bool)
        allowed = allowed | slices
    return allowed


def _model_ok(
    index: FleetIndex, request: GPURequest, need_partitioning: bool
) -> tuple[np.ndarray, np.ndarray]:
    kind = np.zeros(len(index.model_names), dtype=bool)
    share = np.ones(len(index.model_names), dtype=bool)
    models, firsts = np.unique(index.dev_model, return_index=True)
    first_dev = dict(zip(models.tolist(), firsts.tolist(), strict=True))
    min_vendor, min_rank = _arch_floor(request.min_arch)
    for m, name in enumerate(index.model_names):
        dev = index.devices[first_dev[m]]
        info = index.model_info[m]
        vendor = info.vendor if info else dev.vendor
        arch = info.architecture if info else dev.architecture
        ok = (not request.models or name in request.models) and (
            not request.vendors or vendor in request.vendors
        )
        if ok and min_vendor is not None:
            ok = vendor is min_vendor and arch_rank(arch) >= min_rank
        kind[m] = ok
        if need_partitioning:
            share[m] = bool(info and info.supports_fractions)
    return kind, share


def _labels_ok(index: FleetIndex, labels: tuple[tuple[str, str], ...]) -> np.ndarray:
    key = ("labels", labels)
    hit = index.masks.get(key)
    if hit is None:
        hit = np.array([all(nl.get(k) == v for k, v in labels) for nl in index.node_labels], dtype=bool)
        index.masks[key] = hit
    return hit


def _arch_floor(min_arch: str | None) -> tuple[Vendor | None, int]:
    if min_arch is None:
        return None, 0
    if min_arch.startswith("sm_"):
        return Vendor.NVIDIA, arch_rank(min_arch)
    if min_arch.startswith("gfx"):
        return Vendor.AMD, arch_rank(min_arch)
    return Vendor.ASCEND, arch_rank(min_arch)


def _compute(
    index: FleetIndex, request: GPURequest, need_partitioning: bool, fractional: bool
) -> Eligibility:
    if index.n_devices == 0:
        empty = np.zeros(0, dtype=bool)
        return Eligibility(empty, empty, empty, 0, 0, 0, 0, 0, 0, 0)
    kind_m, share_m = _model_ok(index, request, need_partitioning)
    kind = kind_m[index.dev_model]
    if request.labels:
        kind &= _labels_ok(index, request.labels)[index.dev_node]
    memory = kind & (index.dev_mem >= request.memory_per_gpu)
    info = slice_info(index)
    # A slice is isolated hardware: "supports sharing" is about whole devices only.
    hardware = memory & (share_m[index.dev_model] | info.is_slice) & _isolation_ok(index, request, fractional)
    health, cordoned_dev = _out_of_service(index)
    unhealthy = hardware & (health == 2)
    cordoned = hardware & ~unhealthy & cordoned_dev
    standby = hardware & ~unhealthy & ~cordoned_dev & index.dev_standby
    usable = hardware & ~unhealthy & ~cordoned_dev & ~index.dev_standby
    return Eligibility(
        hardware=hardware,
        usable=usable,
        healthy=usable & (health == 0),
        n_kind=int(kind.sum()),
        n_memory=int(memory.sum()),
        n_hardware=int(hardware.sum()),
        n_unhealthy=int(unhealthy.sum()),
        n_cordoned=int(cordoned.sum()),
        n_standby=int(standby.sum()),
        n_usable=int(usable.sum()),
        largest_slice_milli=int(info.compute[kind & info.is_slice].max()) if info.any_slices
        and bool((kind & info.is_slice).any()) else 0,
    )


def _gib(value: int) -> str:
    return f"{value / GIB:.0f} GiB" if value % GIB == 0 else f"{value / GIB:.1f} GiB"


def static_reason(request: GPURequest, elig: Eligibility, *, fractional: bool) -> str | None:
    """Why no device could ever serve ``request`` (None if some could)."""
    what = request.describe(fractional=fractional)
    if elig.n_kind == 0:
        return f"needs {what}: no device in the fleet matches the vendor/model/architecture/labels"
    if elig.n_memory == 0:
        return (
            f"needs {what}: none of the {elig.n_kind} matching devices has "
            f"{_gib(request.memory_per_gpu)} of memory"
        )
    if elig.n_hardware == 0 and fractional and request.isolation == "hard":
        largest = (f" (the largest slice of a matching GPU here is {elig.largest_slice_milli / MILLI:.3g} of "
                   f"a GPU: ask for at most that)" if elig.largest_slice_milli else "")
        return (
            f"needs {what}: none of the {elig.n_memory} matching devices is a MIG instance or compute "
            f"partition that holds it{largest}; partition a GPU (MIG / CPX) or allow isolation='soft'"
        )
    if elig.n_hardware == 0:
        return (
            f"needs {what}: none of the {elig.n_memory} matching devices supports sharing "
            "(MIG/MPS/partitions); ask for a whole GPU"
        )
    return None


def operational_note(elig: Eligibility) -> str:
    """``"3 cordoned, 1 unhealthy"``-style note on matching devices that are out of service."""
    parts = []
    if elig.n_unhealthy:
        parts.append(f"{elig.n_unhealthy} unhealthy")
    if elig.n_cordoned:
        parts.append(f"{elig.n_cordoned} cordoned")
    if elig.n_standby:
        parts.append(f"{elig.n_standby} on standby nodes")
    return ", ".join(parts)
