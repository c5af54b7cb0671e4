"""MIG discovery through NVML: the MIG instances of a MIG-enabled GPU as isolated slices.

For a GPU in MIG mode (``nvmlDeviceGetMigMode`` current = enabled), each populated MIG device
slot (``nvmlDeviceGetMaxMigDeviceCount`` slots, ``nvmlDeviceGetMigDeviceHandleByIndex``) is one
GPU instance + compute instance that CUDA sees as its own device, named by a ``MIG-…`` UUID. We
read its UUID, memory (``nvmlDeviceGetMemoryInfo``), its GPU-instance id and attributes
(``nvmlDeviceGetAttributes``: GPU slices, compute slices, SMs, memory) and the GPU
instance's profile (``nvmlDeviceGetGpuInstanceById`` → ``nvmlGpuInstanceGetInfo`` → the profile
id, matched against ``nvmlDeviceGetGpuInstanceProfileInfo`` of every profile the GPU offers).

The slice's profile name is the catalog's (``3g.40gb``) when the catalog knows the model and a
profile with that many GPU slices and about that much memory, else NVIDIA's naming built from
the attributes; a compute instance smaller than its GPU instance reads ``<c>c.<g>g.<mem>gb``
as ``nvidia-smi`` prints it. The SM share (``compute_milli``) is the instance's SMs over those
of the GPU's largest GPU-instance profile, or GPU slices / 7 when SM counts are not reported.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from gpusched.catalog import AcceleratorModel
from gpusched.model import MILLI, Device
from gpusched.slices import mig_instance

__all__ = ["MIG_GPU_SLICES", "gpu_instance_profiles", "mig_devices", "mig_instances"]

MIG_GPU_SLICES = 7
"""GPU slices of a whole A100/H100/H200 (a ``7g`` instance is the whole GPU)."""

_PROFILE_CONSTANTS = (
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1",
    "NVML_GPU_INSTANCE_PROFILE_3_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_4_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_6_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_7_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_8_SLICE",
)


def gpu_instance_profiles(nvml: Any, handle: Any) -> dict[int, Any]:
    """Profile id → NVML profile info (sliceCount, memorySizeMB, multiprocessorCount, instanceCount)
    for every GPU-instance profile this GPU supports (unsupported ones are skipped)."""
    found: dict[int, Any] = {}
    for name in _PROFILE_CONSTANTS:
        constant = getattr(nvml, name, None)
        if constant is None:
            continue
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, constant)
        except nvml.NVMLError:
            continue  # NOT_SUPPORTED / INVALID_ARGUMENT: the GPU has no such profile
        found[int(info.id)] = info
    return found


def mig_devices(nvml: Any, handle: Any) -> Iterator[Any]:
    """The NVML handles of the MIG devices in the populated slots of GPU ``handle``; an empty slot
    (``NVML_ERROR_NOT_FOUND`` / ``INVALID_ARGUMENT``) is skipped, other NVML failures propagate."""
    for slot in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except nvml.NVMLError as exc:
            if exc.value in (nvml.NVML_ERROR_NOT_FOUND, nvml.NVML_ERROR_INVALID_ARGUMENT):
                continue
            raise
        yield mig


def mig_instances(nvml: Any, handle: Any, parent: Device, model: AcceleratorModel | None) -> list[Device]:
    """The MIG instances of the MIG-enabled GPU ``handle`` (``parent``), as slice devices.

    NVML failures other than an empty slot propagate (the caller translates them); an empty slot
    (``NVML_ERROR_NOT_FOUND`` / ``INVALID_ARGUMENT``) is skipped.
    """
    profiles = gpu_instance_profiles(nvml, handle)
    # nvmlDeviceGetAttributes answers for MIG devices only: the GPU's SMs in MIG mode are those
    # of its largest GPU-instance profile (7g holds every SM MIG can use).
    gpu_sms = max((int(info.multiprocessorCount) for info in profiles.values()), default=0)
    out: list[Device] = []
    for mig in mig_devices(nvml, handle):
        attrs = nvml.nvmlDeviceGetAttributes(mig)
        memory = int(nvml.nvmlDeviceGetMemoryInfo(mig).total)
        gpu_slices = int(attrs.gpuInstanceSliceCount)
        info = profiles.get(_profile_id(nvml, handle, int(nvml.nvmlDeviceGetGpuInstanceId(mig))))
        if info is not None:
            gpu_slices = int(info.sliceCount)
        name = _profile_name(gpu_slices, int(attrs.memorySizeMB) or memory // 2**20, model)
        compute_slices = int(attrs.computeInstanceSliceCount)
        if 0 < compute_slices < gpu_slices:
            name = f"{compute_slices}c.{name}"
        sms = int(attrs.multiprocessorCount)
        if gpu_sms and sms:
            compute = sms * MILLI // gpu_sms
        else:
            compute = (compute_slices or gpu_slices) * MILLI // MIG_GPU_SLICES
        out.append(mig_instance(parent, _text(nvml.nvmlDeviceGetUUID(mig)), name, memory, compute))
    return out


def _profile_id(nvml: Any, handle: Any, gi_id: int) -> int:
    try:
        instance = nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
        return int(nvml.nvmlGpuInstanceGetInfo(instance).profileId)
    except nvml.NVMLError:
        return -1


def _profile_name(gpu_slices: int, memory_mib: int, model: AcceleratorModel | None) -> str:
    """The catalog profile with these GPU slices and the nearest memory, else NVIDIA's naming."""
    gib = memory_mib / 1024
    if model is not None:
        same = [p for p in model.slice_profiles if p.name.startswith(f"{gpu_slices}g.")]
        if same:
            best = min(same, key=lambda p: abs(p.memory_bytes / 2**30 - gib))
            if abs(best.memory_bytes / 2**30 - gib) <= max(2.0, 0.1 * gib):
                return best.name
    return f"{gpu_slices}g.{math.ceil(gib)}gb"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
