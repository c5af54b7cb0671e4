"""The simulated backend: a fleet file stands in for hardware, with persistent fault injection.

Used when the host has no NVIDIA, AMD or Ascend device, or on request (``GPUSCHED_BACKEND=simulated``);
it always calls itself ``simulated`` and says which fleet file it shows, so nobody mistakes it
for real hardware. Samples are plausible and repeatable: an idle device reads idle, a device
with recorded load (:meth:`SimulatedBackend.set_load`) reads busy, and injected faults show in
both :meth:`~SimulatedBackend.discover` (health) and :meth:`~SimulatedBackend.sample` (Xid, ECC,
temperature, memory; a ``lost`` device stops answering).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpusched.catalog import default_catalog, layout_problem
from gpusched.errors import HardwareError
from gpusched.fleetfile import load_fleet
from gpusched.hardware import standby
from gpusched.hardware.base import BackendFeature
from gpusched.hardware.faults import FAULT_KINDS, Fault, FaultStore, health_for
from gpusched.hardware.mig_provider import LocalMigProvider
from gpusched.model import Device, DeviceSample, Node
from gpusched.paths import include_dir, state_dir
from gpusched.slices import mig_slices

__all__ = ["SimulatedBackend", "default_fleet_path", "display_path"]

_IDLE_TEMP_C = 34
_IDLE_MEMORY_FRACTION = 0.005  # driver/context overhead on an idle device
_BUSY_UTIL_PCT = 85  # a whole device held by a task: a typical training step's utilisation
_BUSY_MEMORY_FRACTION = 0.9  # of the memory the task was given


def default_fleet_path() -> Path:
    """``gpusched/include/fleets/default.yaml`` (the fleet used when nothing else is configured)."""
    return include_dir() / "fleets" / "default.yaml"


def display_path(path: Path) -> str:
    """``path`` relative to the folder holding ``include/`` when it lies there, else as given."""
    try:
        return str(path.resolve().relative_to(include_dir().resolve().parent))
    except ValueError:
        return str(path)


class SimulatedBackend:
    """A :class:`~gpusched.hardware.base.HardwareBackend` over a fleet file.

    Args:
        fleet_path: the fleet YAML (default :func:`default_fleet_path`).
        state_folder: where faults and load are shared (default :func:`gpusched.paths.state_dir`,
            read at construction so every process with the same ``AIRFLOW_HOME`` agrees).
        clock: the time source for samples and fault stamps.
    """

    name = "simulated"
    features: frozenset[BackendFeature] = frozenset(
        {"topology", "nvlink", "xgmi", "hccs", "ecc", "xid", "power", "fault_injection", "simulated"}
    )

    def __init__(self, fleet_path: str | Path | None = None, *, state_folder: Path | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.fleet_path = Path(fleet_path) if fleet_path is not None else default_fleet_path()
        self._nodes = load_fleet(self.fleet_path)
        self._devices = {d.uuid: d for n in self._nodes for d in n.devices}
        self._standby = {d.uuid for n in self._nodes if n.standby for d in n.devices}
        self.store = FaultStore(state_folder or state_dir())
        self._scaling_file = standby.state_file(state_folder)
        self._allocated: dict[str, tuple[int, int]] = {}
        self._mig_file = (state_folder or state_dir()) / "mig_layouts.json"
        self._clock = clock
        self.description = f"simulated fleet ({display_path(self.fleet_path)})"

    # ---- HardwareBackend ------------------------------------------------------------------------

    def discover(self) -> list[Node]:
        """The fleet's nodes; devices with faults carry the health the faults imply.

        Standby nodes that a :class:`~gpusched.capacity.scaling.LocalFleetScaler` switched on (scale-out,
        pre-scaling; :mod:`gpusched.hardware.standby`) are reported as active: that is how the
        simulated fleet "provisions" a node.
        """
        faults = self.store.faults()
        powered = self.powered_standby()
        layouts = self._mig_layouts()
        nodes = []
        for node in self._nodes:
            if node.standby and node.name in powered:
                node = replace(node, standby=False)
            if layouts and any(d.uuid in layouts for d in node.devices):
                node = replace(node, devices=_relayout(node.devices, layouts))
            if faults:
                devices = tuple(self._with_health(d, faults.get(d.uuid, ())) for d in node.devices)
                node = replace(node, devices=devices)
            nodes.append(node)
        return nodes

    def _mig_layouts(self) -> dict[str, list[str]]:
        """MIG layouts set by dynamic MIG (:class:`~gpusched.hardware.mig_provider.LocalMigProvider`)."""
        return LocalMigProvider(self._mig_file).layouts()

    def powered_standby(self) -> frozenset[str]:
        """Names of standby nodes switched on through the local scaler's state file."""
        return standby.powered_standby(self._scaling_file)

    def sample(self) -> list[DeviceSample]:
        """One reading per powered device (standby nodes are off; ``lost`` devices do not answer)."""
        now = self._clock()
        faults = self.store.faults()
        loads = self.store.loads()
        powered = self.powered_standby()
        samples = []
        for uuid, device in self._devices.items():
            device_faults = faults.get(uuid, ())
            if (uuid in self._standby and device.node not in powered) or any(
                f.kind == "lost" for f in device_faults
            ):
                continue
            load = loads.get(uuid) or self._allocated.get(uuid)
            samples.append(self._sample(device, now, load, device_faults))
        return samples

    def observe_allocations(self, allocations: Iterable[Any]) -> None:
        """Make devices held by tasks look busy in later samples (an explicit :meth:`set_load` wins).

        ``allocations`` are the ledger's active ones (anything with ``shares`` of
        :class:`~gpusched.model.DeviceShare`): each share adds ``milli``/1000 of
        85 % utilisation and 90 % of its memory, so the fleet page's bars move like real ones.
        """
        busy: dict[str, tuple[int, int]] = {}
        for allocation in allocations:
            for share in allocation.shares:
                device = self._devices.get(share.uuid)
                if device is None:
                    continue
                util, memory = busy.get(share.uuid, (0, 0))
                given = share.memory_bytes or device.memory_bytes * share.milli // 1000
                busy[share.uuid] = (min(100, util + _BUSY_UTIL_PCT * share.milli // 1000),
                                    min(device.memory_bytes, memory + int(given * _BUSY_MEMORY_FRACTION)))
        self._allocated = busy

    def close(self) -> None:
        """Nothing to release (no vendor library)."""

    # ---- simulation controls ------------------------------------------------------------------

    def inject_fault(self, uuid: str, kind: str, *, code: int | None = None) -> Fault:
        """Make device ``uuid`` fail in the way ``kind`` names (see :data:`FAULT_KINDS`).

        Persisted under the state folder, so other processes (agent, executor) see it too.

        Raises:
            HardwareError: unknown uuid or kind (the message lists what is accepted).
        """
        self._check_uuid(uuid)
        if kind not in FAULT_KINDS:
            raise HardwareError(f"unknown fault kind {kind!r}; use one of: {', '.join(FAULT_KINDS)}")
        return self.store.inject(uuid, kind, code, self._clock())

    def clear_faults(self, uuid: str | None = None) -> int:
        """Remove injected faults of ``uuid`` (every device when None); returns how many."""
        if uuid is not None:
            self._check_uuid(uuid)
        return self.store.clear(uuid)

    def faults(self) -> dict[str, tuple[Fault, ...]]:
        """The injected faults per device uuid."""
        return self.store.faults()

    def set_load(self, uuid: str, utilization_pct: int, memory_used_bytes: int) -> None:
        """Record what a simulated task does on ``uuid`` (shows in later samples); 0, 0 clears."""
        device = self._check_uuid(uuid)
        if not 0 <= utilization_pct <= 100 or not 0 <= memory_used_bytes <= device.memory_bytes:
            raise HardwareError(
                f"load for {uuid} out of range ({utilization_pct}%, {memory_used_bytes} B); use 0–100 % "
                f"and 0–{device.memory_bytes} bytes"
            )
        self.store.set_load(uuid, utilization_pct, memory_used_bytes)

    # ---- internals ----------------------------------------------------------------------------

    def _check_uuid(self, uuid: str) -> Device:
        device = self._devices.get(uuid)
        if device is None:
            raise HardwareError(
                f"no device {uuid!r} in the simulated fleet {display_path(self.fleet_path)}; "
                "list the uuids with 'gpusched inventory'"
            )
        return device

    @staticmethod
    def _with_health(device: Device, faults: tuple[Fault, ...]) -> Device:
        return replace(device, health=health_for(faults)) if faults else device

    def _sample(self, device: Device, now: float, load: tuple[int, int] | None,
                faults: tuple[Fault, ...]) -> DeviceSample:
        jitter = _jitter(device.uuid, now)
        util, memory_used = load or (0, int(device.memory_bytes * _IDLE_MEMORY_FRACTION))
        if load:
            util = max(0, min(100, util + jitter))
        tdp = default_catalog().get(device.model).tdp_milliwatts
        idle_power = tdp // 8
        power = idle_power + (tdp - idle_power) * util // 100 + jitter * 1000
        temperature = (_IDLE_TEMP_C + util * 45 // 100) * 1000 + jitter * 250
        ecc = 0
        xids: list[int] = []
        for fault in faults:
            if fault.kind == "xid":
                xids.append(fault.code)
            elif fault.kind == "ecc":
                ecc += fault.code
            elif fault.kind == "overtemp":
                temperature = max(temperature, fault.code * 1000)
            elif fault.kind == "memory_leak":
                memory_used = max(memory_used, device.memory_bytes * fault.code // 100)
        return DeviceSample(
            uuid=device.uuid, taken_at=now, utilization_pct=util, memory_used_bytes=memory_used,
            memory_total_bytes=device.memory_bytes, temperature_mc=temperature, power_mw=max(power, 0),
            ecc_uncorrected=ecc, xid_errors=tuple(xids),
        )


def _relayout(devices: tuple[Device, ...], layouts: dict[str, list[str]]) -> tuple[Device, ...]:
    """``devices`` with the GPUs named in ``layouts`` re-partitioned (an empty layout: MIG off)."""
    out: list[Device] = []
    for device in devices:
        if device.parent in layouts:
            continue  # the GPU's old instances: replaced below
        layout = layouts.get(device.uuid)
        model = default_catalog().find(device.model)
        if layout is None or model is None or (layout and layout_problem(model, layout, device.memory_bytes)):
            out.append(device)
            continue
        gpu = replace(device, mig_enabled=bool(layout))
        out.append(gpu)
        out.extend(mig_slices(gpu, model, layout))
    return tuple(out)


def _jitter(uuid: str, now: float) -> int:
    """A small repeatable wobble in −2..2 that changes every 10 s (samples look alive, tests stay stable)."""
    digest = hashlib.blake2s(f"{uuid}:{int(now // 10)}".encode(), digest_size=1).digest()
    return digest[0] % 5 - 2
