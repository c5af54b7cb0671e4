"""Dynamic MIG providers: carry out :class:`~gpusched.model.MigStep` re-partitions (planned by
:mod:`gpusched.capacity.mig_plan`).

Like the scaler providers (:mod:`gpusched.capacity.scaling`), a provider has a ``name`` and
``apply(steps) -> MigResult``. Chosen by ``GPUSCHED_DYNAMIC_MIG``:

* ``off`` (default) — no provider: MIG layouts are read, never changed;
* ``local`` — :class:`LocalMigProvider`: the simulated fleet. Layouts go to
  ``state_dir()/mig_layouts.json``, which :class:`~gpusched.hardware.simulated.SimulatedBackend`
  applies in ``discover()`` (the GPU switches to MIG mode with the new instances);
* ``nvml`` — :class:`NvmlMigProvider`: creates GPU instances and their compute instances with
  NVML (``nvmlDeviceCreateGpuInstance``, ``nvmlGpuInstanceCreateComputeInstance``) on a GPU that
  is **already in MIG mode** and idle. Turning MIG mode on needs a GPU reset, which gpusched never
  does: such a step is skipped and says so.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from gpusched.errors import ConfigurationError, HardwareError
from gpusched.hardware.nvidia_mig import gpu_instance_profiles
from gpusched.model import MigStep
from gpusched.paths import state_dir

__all__ = [
    "DYNAMIC_MIG_KINDS",
    "LocalMigProvider",
    "MigProvider",
    "MigResult",
    "NvmlMigProvider",
    "mig_provider_from_spec",
]

DYNAMIC_MIG_KINDS = ("off", "local", "nvml")
"""Values of ``GPUSCHED_DYNAMIC_MIG``."""


@dataclass(frozen=True, slots=True)
class MigResult:
    """What a provider did: the GPUs re-partitioned and a line per step."""

    provider: str
    applied: tuple[str, ...]
    detail: tuple[str, ...]


@runtime_checkable
class MigProvider(Protocol):
    """Carries out re-partitioning steps."""

    name: str

    def apply(self, steps: Sequence[MigStep]) -> MigResult:
        """Re-partition the steps' GPUs; raises :class:`HardwareError` when it cannot at all."""
        ...


class LocalMigProvider:
    """Re-partitions GPUs of the simulated fleet (a JSON file every process reads)."""

    name = "local"

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or state_dir() / "mig_layouts.json"

    def layouts(self) -> dict[str, list[str]]:
        """GPU uuid → MIG profiles (an empty list: MIG mode off)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return {str(k): [str(p) for p in v] for k, v in data.items()} if isinstance(data, dict) else {}

    def apply(self, steps: Sequence[MigStep]) -> MigResult:
        """Record each step's layout (replacing the GPU's previous one)."""
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
    """Creates MIG instances with NVML on idle GPUs that are already in MIG mode."""

    name = "nvml"

    def __init__(self, nvml: Any = None) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._nvml = nvml

    def apply(self, steps: Sequence[MigStep]) -> MigResult:
        """Create each step's GPU instances (and one full compute instance in each)."""

        nvml = self._nvml
        applied, detail = [], []
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise HardwareError(f"NVML cannot start ({exc}); dynamic MIG needs the NVIDIA driver") from exc
        try:
            for step in steps:
                handle = nvml.nvmlDeviceGetHandleByUUID(step.gpu)
                current = nvml.nvmlDeviceGetMigMode(handle)[0]
                if current != nvml.NVML_DEVICE_MIG_ENABLE:
                    detail.append(
                        f"{step.gpu}: MIG mode is off; enabling it needs a GPU reset, which "
                        "gpusched never does (run nvidia-smi -i <gpu> -mig 1 when it is idle)"
                    )
                    continue
                profiles = gpu_instance_profiles(nvml, handle)
                for name in step.layout:
                    slices = int(name.split("g.", 1)[0])
                    info = next(
                        (
                            i
                            for i in profiles.values()
                            if int(i.sliceCount) == slices
                            and _gib_name(int(i.memorySizeMB)) == name.split(".", 1)[1]
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
                        instance, _ci_constant(nvml, slices), shared
                    )
                    nvml.nvmlGpuInstanceCreateComputeInstance(instance, int(ci.id))
                applied.append(step.gpu)
                detail.append(f"{step.gpu}: created {' + '.join(step.layout)}")
        except nvml.NVMLError as exc:
            raise HardwareError(
                f"NVML could not create MIG instances ({exc}); check them with nvidia-smi mig -lgi"
            ) from exc
        finally:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlShutdown()
        return MigResult(self.name, tuple(applied), tuple(detail))


def _gib_name(memory_mib: int) -> str:
    return f"{-(-memory_mib // 1024)}gb"


def _ci_constant(nvml: Any, slices: int) -> int:
    return int(getattr(nvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{slices}_SLICE"))


def mig_provider_from_spec(spec: str | None = None) -> MigProvider | None:
    """The provider ``GPUSCHED_DYNAMIC_MIG`` names (None for ``off``, the default)."""
    kind = (spec if spec is not None else os.environ.get("GPUSCHED_DYNAMIC_MIG", "off")).strip().lower()
    if kind in ("", "off"):
        return None
    if kind == "local":
        return LocalMigProvider()
    if kind == "nvml":
        return NvmlMigProvider()
    raise ConfigurationError(
        f"unknown GPUSCHED_DYNAMIC_MIG {kind!r}; use one of {', '.join(DYNAMIC_MIG_KINDS)}"
    )
