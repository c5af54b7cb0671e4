"""Dynamic MIG providers: carry out :class:`~gpusched.model.MigStep` re-partitions (planned by
:mod:`gpusched.capacity.mig_plan`).

Like the scaler providers (:mod:`gpusched.capacity.scaling`), a provider has a ``name`` and
``apply(steps) -> MigResult``. Chosen by ``GPUSCHED_DYNAMIC_MIG``:

* ``off`` (default) — no provider: MIG layouts are read, never changed;
* ``local`` — :class:`LocalMigProvider`: the simulated fleet. Layouts go to
  ``state_dir()/mig_layouts.json``, which :class:`~gpusched.hardware.simulated.SimulatedBackend`
  applies in ``discover()`` (the GPU switches to MIG mode with the new instances);
* ``nvml`` — :class:`NvmlMigProvider`: on a GPU that is **already in MIG mode** and idle, destroys
  its unused compute and GPU instances (``nvmlGpuInstanceGetComputeInstances`` /
  ``nvmlComputeInstanceDestroy``, ``nvmlDeviceGetGpuInstances`` / ``nvmlGpuInstanceDestroy``) and
  creates the new layout (``nvmlDeviceCreateGpuInstance``, ``nvmlGpuInstanceCreateComputeInstance``).
  A GPU with an instance a task holds (the ``held`` MIG UUIDs the agent reads from the ledger's
  active allocations) is never touched. Turning MIG mode on needs a GPU reset, which gpusched
  never does: such a step is skipped and says so.

* ``amdsmi`` — :class:`AmdPartitionProvider`: sets the compute partition mode of an idle AMD card
  (``amdsmi_set_gpu_compute_partition``; the planner gives it only AMD steps, a step's layout being
  one mode's partitions, e.g. 8 × CPX); never a card one of whose partitions a task holds.

A step that fails is reported in :attr:`MigResult.failed` with a line naming the GPU and the fix;
the other steps still run. ``apply`` raises :class:`HardwareError` only when it cannot start at all.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from gpusched.errors import ConfigurationError, HardwareError
from gpusched.hardware.amd import import_amdsmi
from gpusched.hardware.nvidia_mig import gpu_instance_profiles, mig_devices
from gpusched.model import MigStep
from gpusched.paths import state_dir

__all__ = [
    "DYNAMIC_MIG_KINDS",
    "AmdPartitionProvider",
    "LocalMigProvider",
    "MigProvider",
    "MigResult",
    "NvmlMigProvider",
    "existing_instances",
    "mig_provider_from_spec",
    "mig_uuids",
]

DYNAMIC_MIG_KINDS = ("off", "local", "nvml", "amdsmi")
"""Values of ``GPUSCHED_DYNAMIC_MIG``."""


@dataclass(frozen=True, slots=True)
class MigResult:
    """What a provider did: the GPUs re-partitioned, a line per step, and the GPUs whose step
    failed (their lines say why and what to do)."""

    provider: str
    applied: tuple[str, ...]
    detail: tuple[str, ...]
    failed: tuple[str, ...] = ()


@runtime_checkable
class MigProvider(Protocol):
    """Carries out re-partitioning steps (of GPUs whose model has ``partitioning``: ``mig``, or
    ``compute-partition`` for AMD; the agent plans only those)."""

    name: str
    partitioning: str

    def apply(self, steps: Sequence[MigStep], held: Collection[str] = ()) -> MigResult:
        """Re-partition the steps' GPUs, never one with an instance among ``held`` (MIG UUIDs tasks
        hold); raises :class:`HardwareError` when it cannot start at all."""
        ...


class LocalMigProvider:
    """Re-partitions GPUs of the simulated fleet (a JSON file every process reads)."""

    name = "local"
    partitioning = "mig"

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or state_dir() / "mig_layouts.json"

    def layouts(self) -> dict[str, list[str]]:
        """GPU uuid → MIG profiles (an empty list: MIG mode off)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return {str(k): [str(p) for p in v] for k, v in data.items()} if isinstance(data, dict) else {}

    def apply(self, steps: Sequence[MigStep], held: Collection[str] = ()) -> MigResult:
        """Record each step's layout (replacing the GPU's previous one; the agent leaves out GPUs
        with held instances, so ``held`` is not read here)."""
        layouts = self.layouts()
        for step in steps:
            layouts[step.gpu] = list(step.layout)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(layouts, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, self.path)
        return MigResult(
            self.name,
            tuple(s.gpu for s in steps),
            tuple(f"{s.gpu}: {' + '.join(s.layout)} ({s.reason})" for s in steps),
        )


class NvmlMigProvider:
    """Re-lays out idle GPUs that are already in MIG mode with NVML: unused instances destroyed,
    the step's instances created."""

    name = "nvml"
    partitioning = "mig"

    def __init__(self, nvml: Any = None) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._nvml = nvml

    def apply(self, steps: Sequence[MigStep], held: Collection[str] = ()) -> MigResult:
        """Carry out each step: destroy the GPU's compute and GPU instances (none held), then
        create the layout's GPU instances with one full compute instance each."""
        nvml = self._nvml
        applied: list[str] = []
        failed: list[str] = []
        detail: list[str] = []
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise HardwareError(f"NVML cannot start ({exc}); dynamic MIG needs the NVIDIA driver") from exc
        try:
            for step in steps:
                try:
                    line = self._apply_one(step, frozenset(held))
                except (nvml.NVMLError, HardwareError) as exc:
                    failed.append(step.gpu)
                    detail.append(
                        f"{step.gpu} on {step.node}: re-partitioning into "
                        f"{' + '.join(step.layout) or 'nothing'} "
                        f"failed ({exc}); check its instances with nvidia-smi mig -lgi / -lci, destroy "
                        "leftovers no task uses (nvidia-smi mig -dci; nvidia-smi mig -dgi) or set "
                        "GPUSCHED_DYNAMIC_MIG=off"
                    )
                    continue
                if line.startswith("skipped"):
                    detail.append(f"{step.gpu}: {line}")
                    continue
                applied.append(step.gpu)
                detail.append(f"{step.gpu}: {line}")
        finally:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlShutdown()
        return MigResult(self.name, tuple(applied), tuple(detail), tuple(failed))

    def _apply_one(self, step: MigStep, held: frozenset[str]) -> str:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByUUID(step.gpu)
        current = nvml.nvmlDeviceGetMigMode(handle)[0]
        if current != nvml.NVML_DEVICE_MIG_ENABLE:
            return (
                "skipped: MIG mode is off; enabling it needs a GPU reset, which gpusched never does "
                "(run nvidia-smi -i <gpu> -mig 1 when it is idle)"
            )
        profiles = gpu_instance_profiles(nvml, handle)
        instances = existing_instances(nvml, handle, profiles)
        in_use = sorted(uuid for uuid in mig_uuids(nvml, handle).values() if uuid in held)
        if in_use:
            return f"skipped: {', '.join(in_use)} is held by a task; a GPU in use is never re-partitioned"
        for gi, cis in instances:
            for ci in cis:
                nvml.nvmlComputeInstanceDestroy(ci)
            nvml.nvmlGpuInstanceDestroy(gi)
        for name in step.layout:
            slices = int(name.split("g.", 1)[0])
            info = next(
                (
                    i
                    for i in profiles.values()
                    if int(i.sliceCount) == slices and _gib_name(int(i.memorySizeMB)) == name.split(".", 1)[1]
                ),
                None,
            )
            if info is None:
                info = next((i for i in profiles.values() if int(i.sliceCount) == slices), None)
            if info is None:
                raise HardwareError(f"{step.gpu} offers no MIG profile {name}")
            instance = nvml.nvmlDeviceCreateGpuInstance(handle, int(info.id))
            shared = nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            ci = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                instance, _ci_constant(nvml, slices), shared)
            nvml.nvmlGpuInstanceCreateComputeInstance(instance, int(ci.id))
        gone = f"destroyed {len(instances)} unused GPU instance(s), " if instances else ""
        return f"{gone}created {' + '.join(step.layout) or 'no instance'}"


def existing_instances(nvml: Any, handle: Any, profiles: dict[int, Any]) -> list[tuple[Any, list[Any]]]:
    """Every GPU instance of ``handle`` (``nvmlDeviceGetGpuInstances`` per GPU-instance profile)
    with its compute instances (``nvmlGpuInstanceGetComputeInstances`` per compute profile)."""
    out: list[tuple[Any, list[Any]]] = []
    for profile_id, info in sorted(profiles.items()):
        capacity = max(int(info.instanceCount), 1)
        count = ctypes.c_uint(0)
        array = (nvml.c_nvmlGpuInstance_t * capacity)()
        nvml.nvmlDeviceGetGpuInstances(handle, profile_id, array, ctypes.byref(count))
        for gi in list(array)[: count.value]:
            out.append((gi, _compute_instances(nvml, gi)))
    return out


def _compute_instances(nvml: Any, gi: Any) -> list[Any]:
    found: list[Any] = []
    shared = nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    for profile in range(int(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)):
        try:
            info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, profile, shared)
        except nvml.NVMLError:
            continue  # the GPU instance offers no such compute profile
        count = ctypes.c_uint(0)
        array = (nvml.c_nvmlComputeInstance_t * max(int(info.instanceCount), 1))()
        nvml.nvmlGpuInstanceGetComputeInstances(gi, int(info.id), array, ctypes.byref(count))
        found.extend(list(array)[: count.value])
    return found


def mig_uuids(nvml: Any, handle: Any) -> dict[int, str]:
    """GPU-instance id → the ``MIG-…`` UUID of its MIG device, for every populated slot."""
    out: dict[int, str] = {}
    for mig in mig_devices(nvml, handle):
        uuid = nvml.nvmlDeviceGetUUID(mig)
        gi_id = int(nvml.nvmlDeviceGetGpuInstanceId(mig))
        out[gi_id] = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    return out


def _gib_name(memory_mib: int) -> str:
    return f"{-(-memory_mib // 1024)}gb"


def _ci_constant(nvml: Any, slices: int) -> int:
    return int(getattr(nvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{slices}_SLICE"))


class AmdPartitionProvider:
    """Sets the compute partition mode of idle AMD cards with AMD SMI."""

    name = "amdsmi"
    partitioning = "compute-partition"

    def __init__(self, smi: Any = None) -> None:
        self._smi = smi if smi is not None else import_amdsmi()

    def apply(self, steps: Sequence[MigStep], held: Collection[str] = ()) -> MigResult:
        """Set each step's card to the step's mode (an empty layout: SPX, the card whole)."""
        smi = self._smi
        applied: list[str] = []
        failed: list[str] = []
        detail: list[str] = []
        try:
            smi.amdsmi_init()
        except smi.AmdSmiException as exc:
            raise HardwareError(f"AMD SMI cannot start ({exc}); compute partitioning needs the amdgpu "
                                "driver") from exc
        try:
            by_uuid = {str(smi.amdsmi_get_gpu_device_uuid(h)): h for h in smi.amdsmi_get_processor_handles()}
            for step in steps:
                modes = {name.upper() for name in step.layout} or {"SPX"}
                if len(modes) != 1:
                    failed.append(step.gpu)
                    detail.append(f"{step.gpu}: {list(step.layout)} is no compute partition mode (one "
                                  "mode splits a card evenly)")
                    continue
                (mode,) = modes
                if step.gpu in held:
                    detail.append(f"{step.gpu}: skipped: held by a task; a card in use is not re-partitioned")
                    continue
                handle = by_uuid.get(step.gpu)
                try:
                    if handle is None:
                        raise HardwareError(f"AMD SMI lists no GPU {step.gpu}")
                    current = str(smi.amdsmi_get_gpu_compute_partition(handle)).upper()
                    if current != mode:
                        smi.amdsmi_set_gpu_compute_partition(handle, smi.AmdSmiComputePartitionType[mode])
                except (smi.AmdSmiException, HardwareError, KeyError) as exc:
                    failed.append(step.gpu)
                    detail.append(
                        f"{step.gpu} on {step.node}: setting compute partition {mode} failed ({exc}); "
                        "check the card with amd-smi partition, set it when no process uses it "
                        f"(amd-smi set --gpu <gpu> --compute-partition {mode}) or set "
                        "GPUSCHED_DYNAMIC_MIG=off"
                    )
                    continue
                applied.append(step.gpu)
                detail.append(f"{step.gpu}: compute partition {current} → {mode}")
        finally:
            with contextlib.suppress(smi.AmdSmiException):
                smi.amdsmi_shut_down()
        return MigResult(self.name, tuple(applied), tuple(detail), tuple(failed))


def mig_provider_from_spec(spec: str | None = None) -> MigProvider | None:
    """The provider ``GPUSCHED_DYNAMIC_MIG`` names (None for ``off``, the default)."""
    kind = (spec if spec is not None else os.environ.get("GPUSCHED_DYNAMIC_MIG", "off")).strip().lower()
    if kind in ("", "off"):
        return None
    if kind == "local":
        return LocalMigProvider()
    if kind == "nvml":
        return NvmlMigProvider()
    if kind == "amdsmi":
        return AmdPartitionProvider()
    raise ConfigurationError(
        f"unknown GPUSCHED_DYNAMIC_MIG {kind!r}; use one of {', '.join(DYNAMIC_MIG_KINDS)}"
    )
