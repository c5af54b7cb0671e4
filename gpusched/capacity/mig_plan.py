"""Dynamic MIG: which idle MIG-capable GPU to re-partition, and how, for waiting hard requests.

Pure (snapshot + waiting requests in, steps out); a provider carries the steps out
(:mod:`gpusched.hardware.mig_provider`, ``GPUSCHED_DYNAMIC_MIG``, off by default). A request is
served by re-partitioning only when it asks for hard isolation, no free slice holds it now, and
an *idle* GPU of an allowed MIG-capable model exists: a whole GPU with nothing on it, or a GPU in
MIG mode whose instances are all free. The new layout is as many instances of the smallest
profile that holds the request as fit on the GPU (so the next requests like it find a slice
too). Busy GPUs are never touched.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpusched.catalog import AcceleratorModel, SliceProfile, arch_rank, default_catalog, layout_problem
from gpusched.model import Device, FleetSnapshot, Health, MigStep
from gpusched.request import GPURequest

__all__ = ["best_layout", "plan_repartition"]


def best_layout(model: AcceleratorModel, request: GPURequest, memory_bytes: int) -> tuple[str, ...]:
    """As many instances of the smallest profile that holds ``request`` as fit; () if none holds it.

    An AMD compute partition mode splits the whole card evenly: its layout is the mode's
    ``max_count`` partitions (CPX: 8), and a mode that does not split the card (SPX) is no slice.
    """
    mig = "mig" in model.partitioning
    fitting = [
        p
        for p in model.slice_profiles
        if p.memory_bytes >= request.memory_per_gpu
        and p.compute_milli >= request.milli_per_gpu
        and (request.profile is None or p.name.casefold() == request.profile.casefold())
        and (mig or p.max_count > 1)
    ]
    if not fitting:
        return ()
    smallest: SliceProfile = min(fitting, key=lambda p: (p.compute_milli, p.memory_bytes))
    if not mig:
        return (smallest.name,) * smallest.max_count
    layout: tuple[str, ...] = ()
    for count in range(smallest.max_count, 0, -1):
        candidate = (smallest.name,) * count
        if layout_problem(model, candidate, memory_bytes) is None:
            layout = candidate
            break
    return layout


def plan_repartition(
    snapshot: FleetSnapshot, waiting: Sequence[GPURequest], partitioning: str = "mig"
) -> tuple[MigStep, ...]:
    """The re-partitioning steps that let waiting hard requests run (one GPU per step), on GPUs
    whose model has ``partitioning`` (``mig``; ``compute-partition`` for AMD compute partition
    modes): what the provider at hand can carry out."""
    catalog = default_catalog()
    taken: set[str] = set()
    free_slices = [d for d in snapshot.devices() if d.parent is not None and _idle(snapshot, d)]
    steps: list[MigStep] = []
    for request in waiting:
        if request.isolation != "hard" or not request.is_fractional:
            continue
        holder = next((s for s in free_slices if s.uuid not in taken and _slice_holds(s, request)), None)
        if holder is not None:
            taken.add(holder.uuid)  # a free slice serves it already; the placement engine will use it
            continue
        for gpu in _idle_gpus(snapshot, request, taken, partitioning):
            model = catalog.find(gpu.model)
            if model is None:
                continue
            layout = best_layout(model, request, gpu.memory_bytes)
            if not layout:
                continue
            taken.add(gpu.uuid)
            # The rest of the new instances serve the next waiting requests of the same shape.
            free_slices.extend(_placeholder(gpu, name, k) for k, name in enumerate(layout[1:], 1))
            steps.append(
                MigStep(
                    gpu.uuid,
                    gpu.node,
                    gpu.model,
                    layout,
                    f"{len(layout)} × {layout[0]} for a waiting hard-isolated "
                    f"{request.milli_per_gpu / 1000:g} GPU with {request.memory_per_gpu / 2**30:.0f} GiB",
                )
            )
            break
    return tuple(steps)


def _idle(snapshot: FleetSnapshot, device: Device) -> bool:
    used = snapshot.used(device.uuid)
    return used.used_milli == 0 and used.used_memory_bytes == 0


def _slice_holds(device: Device, request: GPURequest) -> bool:
    return (
        device.memory_bytes >= request.memory_per_gpu
        and device.compute_milli >= request.milli_per_gpu
        and (request.profile is None or device.profile == request.profile)
        and (not request.vendors or device.vendor in request.vendors)
        and (not request.models or device.model in request.models)
        and device.health is not Health.UNHEALTHY
        and not device.cordoned
    )


def _idle_gpus(
    snapshot: FleetSnapshot, request: GPURequest, taken: set[str], partitioning: str = "mig"
) -> list[Device]:
    catalog = default_catalog()
    out = []
    for node in snapshot.nodes:
        if node.standby or node.cordoned or any(node.label(k) != v for k, v in request.labels):
            continue
        for gpu in node.devices:
            model = catalog.find(gpu.model)
            if (
                gpu.parent is not None
                or gpu.uuid in taken
                or model is None
                or partitioning not in model.partitioning
                or gpu.cordoned
                or gpu.health is not Health.HEALTHY
                or (request.vendors and gpu.vendor not in request.vendors)
                or (request.models and gpu.model not in request.models)
                or (request.min_arch and arch_rank(gpu.architecture) < arch_rank(request.min_arch))
            ):
                continue
            slices = [d for d in node.devices if d.parent == gpu.uuid]
            if _idle(snapshot, gpu) and all(_idle(snapshot, s) for s in slices):
                out.append(gpu)
    # Prefer a GPU already in MIG mode (re-layout) over switching a whole GPU to MIG, and a GPU
    # outside any NVLink island (islands stay whole for multi-GPU gangs).
    return sorted(out, key=lambda d: (not d.mig_enabled, d.island is not None, d.node, d.index))


def _placeholder(gpu: Device, profile: str, k: int) -> Device:
    from dataclasses import replace

    model = default_catalog().get(gpu.model)
    p = model.slice_profile(profile)
    assert p is not None
    return replace(
        gpu,
        uuid=f"{gpu.uuid}/new{k}",
        parent=gpu.uuid,
        profile=p.name,
        memory_bytes=p.memory_bytes,
        compute_milli=p.compute_milli,
        mig_enabled=False,
    )
