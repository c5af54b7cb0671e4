"""The NVIDIA backend: discovery, topology and telemetry through NVML (``pynvml`` from nvidia-ml-py).

Topology comes from NVML itself: the NUMA node (``nvmlDeviceGetNumaNodeId``, else sysfs), the
PCIe switch grouping (``nvmlDeviceGetTopologyCommonAncestor`` at single/multiple-switch level)
and the NVLink fabric (active links and the PCI address at their far end: another GPU means a
direct NVLink peer, anything else is an NVSwitch shared by every GPU that reaches it). Every
``pynvml.NVMLError`` is translated into :class:`~gpusched.errors.HardwareError` or, when the
library, driver or devices are absent, :class:`~gpusched.errors.BackendUnavailableError`.

MIG: a GPU in MIG mode takes no work itself; its MIG instances are listed after it as isolated
slices (:mod:`gpusched.hardware.nvidia_mig`).

Device models: the NVML name (``"NVIDIA H100 80GB HBM3"``) is looked up among catalog names and
aliases; an unknown name is reported as given, with the architecture from the compute capability.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from gpusched.catalog import LinkKind, Vendor, default_catalog
from gpusched.errors import BackendUnavailableError, HardwareError
from gpusched.hardware.base import BackendFeature
from gpusched.hardware.nvidia_mig import mig_instances
from gpusched.hardware.topology import HostInfo, connected_groups, host_info, island_members, normalise_bus_id
from gpusched.model import Device, DeviceSample, Health, Node

__all__ = ["NvidiaBackend", "catalog_model_name"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_ABSENT_CODES = ("NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED", "NVML_ERROR_NO_PERMISSION")
_MAX_EVENTS_PER_SAMPLE = 1024


def _pynvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:  # the package is a dependency, but a trimmed install may lack it
        raise BackendUnavailableError(
            "pynvml is not importable; install nvidia-ml-py (pip install nvidia-ml-py)"
        ) from exc
    return pynvml


def catalog_model_name(nvml_name: str) -> str:
    """The catalog name for an NVML device name, or the NVML name itself when the catalog lacks it."""
    catalog = default_catalog()
    for candidate in (nvml_name, nvml_name.removeprefix("NVIDIA ").removeprefix("Tesla ")):
        model = catalog.find(candidate)
        if model is not None and model.vendor is Vendor.NVIDIA:
            return model.name
    return nvml_name


class NvidiaBackend:
    """:class:`~gpusched.hardware.base.HardwareBackend` for the NVIDIA GPUs of this host.

    Construction initialises NVML and fails with :class:`BackendUnavailableError` when there is
    no library, no driver or no device. ``sample()`` reports the Xid errors seen since the
    previous ``sample()`` of this instance (NVML Xid events), when the driver lets it listen.
    """

    name = "nvidia"

    def __init__(self, *, host: HostInfo | None = None) -> None:
        nvml = _pynvml()
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise BackendUnavailableError(
                f"NVML cannot start ({exc}); install the NVIDIA driver or use GPUSCHED_BACKEND=simulated"
            ) from exc
        try:
            with self._translate("counting devices"):
                count = nvml.nvmlDeviceGetCount()
            if count == 0:
                raise BackendUnavailableError(
                    "NVML finds no NVIDIA device on this host; use GPUSCHED_BACKEND=simulated"
                )
            with self._translate("opening devices"):
                self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
                self._uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in self._handles]
            self.driver_version = self._optional(lambda: _text(nvml.nvmlSystemGetDriverVersion()), "?")
        except BaseException:
            self._shutdown()
            raise
        self.host = host or host_info()
        self._lost: set[str] = set()
        self._events: Any = None
        self.features: frozenset[BackendFeature] = self._probe_features()
        self._listen_for_xids()
        self.description = (
            f"NVIDIA NVML on {self.host.name} (driver {self.driver_version}, {count} device(s))"
        )

    # ---- HardwareBackend ------------------------------------------------------------------------

    def discover(self) -> list[Node]:
        """This host as one node, its GPUs with NUMA node, PCIe switch, NVLink island and peers."""
        bus_ids = [self._bus_id(h) for h in self._handles]
        switch_of = self._pcie_groups()
        direct, switched = self._nvlink_edges(bus_ids)
        pairs = list(direct)
        first_on_switch: dict[str, int] = {}
        for index, switch in switched:
            pairs.append((first_on_switch.setdefault(switch, index), index))
        groups = connected_groups(len(self._handles), pairs)
        island_of = island_members(groups)
        on_switch = {index for index, _ in switched}
        devices = []
        for i, handle in enumerate(self._handles):
            island = island_of.get(i)
            peers: tuple[str, ...] = ()
            link = LinkKind.PCIE
            if island is not None:
                members = groups[_group_index(groups, i)]
                if i in on_switch:
                    link = LinkKind.NVSWITCH
                    peers = tuple(self._uuids[j] for j in members if j != i)
                else:
                    link = LinkKind.NVLINK
                    peers = tuple(sorted({self._uuids[b if a == i else a] for a, b in direct if i in (a, b)}))
            topology = {
                "numa_node": self._numa_node(handle, bus_ids[i]),
                "pcie_switch": f"{self.host.name}/pcie{switch_of[i]}",
                "island": f"{self.host.name}/{link.value}{island}" if island is not None else None,
                "link": link,
                "peers": peers,
            }
            device = self._device(i, handle, topology)
            devices.append(device)
            if device.mig_enabled:
                devices.extend(self._mig_instances(handle, device))
        return [Node(
            name=self.host.name, rack=self.host.rack, devices=tuple(devices), labels=self.host.labels,
            cpu_milli=self.host.cpu_milli, memory_bytes=self.host.memory_bytes,
        )]

    def _device(self, i: int, handle: Any, topology: dict[str, Any]) -> Device:
        nvml = self._nvml
        uuid = self._uuids[i]
        try:
            name = self._optional(lambda: _text(nvml.nvmlDeviceGetName(handle)), "NVIDIA GPU")
            major, minor = self._optional(lambda: nvml.nvmlDeviceGetCudaComputeCapability(handle), (0, 0))
            memory = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
            mig = self._optional(lambda: nvml.nvmlDeviceGetMigMode(handle)[0], 0)
            health = self._health(handle, uuid)
        except nvml.NVMLError as exc:
            if exc.value != nvml.NVML_ERROR_GPU_IS_LOST:
                raise self._error(f"reading {uuid}", exc) from exc
            log.warning("NVIDIA GPU %s is lost (fell off the bus); reporting it unhealthy", uuid)
            self._lost.add(uuid)
            return Device(uuid=uuid, index=i, node=self.host.name, model="unknown", vendor=Vendor.NVIDIA,
                          architecture="unknown", memory_bytes=0, health=Health.UNHEALTHY)
        return Device(
            uuid=uuid, index=i, node=self.host.name, model=catalog_model_name(name),
            vendor=Vendor.NVIDIA, architecture=f"sm_{major}{minor}", memory_bytes=memory,
            health=health, mig_enabled=mig == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1), **topology,
        )

    def _mig_instances(self, handle: Any, gpu: Device) -> list[Device]:
        """The MIG instances of a MIG-enabled GPU (none when the driver cannot list them)."""

        try:
            return mig_instances(self._nvml, handle, gpu, default_catalog().find(gpu.model))
        except self._nvml.NVMLError as exc:
            log.warning("cannot list the MIG instances of %s (%s); it takes no work", gpu.uuid, exc)
            return []

    def sample(self) -> list[DeviceSample]:
        """One reading per answering GPU; a GPU that is lost is skipped (and unhealthy in discover)."""
        nvml = self._nvml
        xids = self._drain_xids()
        now = time.time()
        samples = []
        for handle, uuid in zip(self._handles, self._uuids, strict=True):
            try:
                samples.append(self._sample(handle, uuid, now, tuple(xids.get(uuid, ()))))
            except nvml.NVMLError as exc:
                if exc.value == nvml.NVML_ERROR_GPU_IS_LOST:
                    log.warning("NVIDIA GPU %s is lost (fell off the bus); skipping it", uuid)
                    self._lost.add(uuid)
                    continue
                raise self._error(f"sampling {uuid}", exc) from exc
        return samples

    def _sample(self, handle: Any, uuid: str, now: float, xids: tuple[int, ...]) -> DeviceSample:
        nvml = self._nvml
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        util = self._optional(lambda: int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu), 0)
        temperature = self._optional(lambda: self._temperature(handle), 0)
        power = self._optional(lambda: int(nvml.nvmlDeviceGetPowerUsage(handle)), 0)
        ecc = self._optional(lambda: int(nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)), 0)
        return DeviceSample(
            uuid=uuid, taken_at=now, utilization_pct=util, memory_used_bytes=int(memory.used),
            memory_total_bytes=int(memory.total), temperature_mc=temperature * 1000, power_mw=power,
            ecc_uncorrected=ecc, xid_errors=xids,
        )

    def close(self) -> None:
        """Free the Xid event set and shut NVML down (safe to call twice)."""
        if self._events is not None:
            self._optional(lambda: self._nvml.nvmlEventSetFree(self._events), None)
            self._events = None
        self._shutdown()

    # ---- topology -----------------------------------------------------------------------------

    def _probe_features(self) -> frozenset[BackendFeature]:
        """What this host's GPUs and driver can report (``xid`` is added once events are set up)."""
        nvml = self._nvml
        features = {"topology", "power"}
        direct, switched = self._nvlink_edges([self._bus_id(h) for h in self._handles])
        if direct or switched:
            features.add("nvlink")
        for handle in self._handles:
            if self._quiet(partial(nvml.nvmlDeviceGetMigMode, handle), None) is not None:
                features.add("mig")
            ecc = partial(nvml.nvmlDeviceGetTotalEccErrors, handle,
                          nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
            if self._quiet(ecc, None) is not None:
                features.add("ecc")
        return frozenset(features)

    def _bus_id(self, handle: Any) -> str:
        """The canonical PCI address, or "" when the GPU cannot say (lost): it then has no links."""
        return str(self._quiet(lambda: normalise_bus_id(self._nvml.nvmlDeviceGetPciInfo(handle).busId), ""))

    def _numa_node(self, handle: Any, bus_id: str) -> int:
        nvml = self._nvml
        node = self._quiet(lambda: int(nvml.nvmlDeviceGetNumaNodeId(handle)), None)
        if node is None:
            try:
                node = int(Path(f"/sys/bus/pci/devices/{bus_id}/numa_node").read_text().strip())
            except (OSError, ValueError):
                node = -1
        return node if node >= 0 else -1

    def _pcie_groups(self) -> list[int]:
        """Group number per device: GPUs under one PCIe switch (or switch tree) share a group."""
        nvml = self._nvml
        handles = self._handles
        pairs = []
        for i in range(len(handles)):
            for j in range(i + 1, len(handles)):
                ancestor = partial(nvml.nvmlDeviceGetTopologyCommonAncestor, handles[i], handles[j])
                level = self._quiet(ancestor, None)
                if level is not None and level <= nvml.NVML_TOPOLOGY_MULTIPLE:
                    pairs.append((i, j))
        group_of = {}
        for number, group in enumerate(connected_groups(len(self._handles), pairs)):
            for member in group:
                group_of[member] = number
        return [group_of[i] for i in range(len(self._handles))]

    def _nvlink_edges(self, bus_ids: list[str]) -> tuple[set[tuple[int, int]], set[tuple[int, str]]]:
        """Direct GPU–GPU NVLink pairs, and (GPU, NVSwitch bus id) pairs, from the active links."""
        nvml = self._nvml
        index_of_bus = {bus: i for i, bus in enumerate(bus_ids) if bus}
        direct: set[tuple[int, int]] = set()
        switched: set[tuple[int, str]] = set()
        for i, handle in enumerate(self._handles):
            for link in range(nvml.NVML_NVLINK_MAX_LINKS):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = normalise_bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
                except nvml.NVMLError as exc:
                    if exc.value in (nvml.NVML_ERROR_INVALID_ARGUMENT, nvml.NVML_ERROR_NOT_FOUND):
                        continue  # no such link on this GPU; later link numbers may exist
                    if exc.value == nvml.NVML_ERROR_GPU_IS_LOST:
                        self._lost.add(self._uuids[i])
                    break  # NOT_SUPPORTED and the like: this GPU has no NVLink to report
                peer = index_of_bus.get(remote)
                if peer is not None and peer != i:
                    direct.add((min(i, peer), max(i, peer)))
                elif peer is None:
                    switched.add((i, remote))
        return direct, switched

    # ---- health and telemetry -----------------------------------------------------------------

    def _health(self, handle: Any, uuid: str) -> Health:
        nvml = self._nvml
        if uuid in self._lost:
            return Health.UNHEALTHY
        try:
            ecc = nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
        except nvml.NVMLError as exc:
            if exc.value == nvml.NVML_ERROR_GPU_IS_LOST:
                self._lost.add(uuid)
                return Health.UNHEALTHY
            return Health.HEALTHY  # ECC off or not supported: nothing to judge by
        return Health.DEGRADED if ecc else Health.HEALTHY

    def _temperature(self, handle: Any) -> int:
        nvml = self._nvml
        try:
            return int(nvml.nvmlDeviceGetTemperatureV(handle, nvml.NVML_TEMPERATURE_GPU))
        except (nvml.NVMLError, AttributeError):
            return int(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))

    def _listen_for_xids(self) -> None:
        nvml = self._nvml
        try:
            events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.info("NVML Xid events unavailable (%s); samples will carry no Xid codes", exc)
            return
        registered = 0
        for handle in self._handles:
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
                registered += 1
            except nvml.NVMLError as exc:
                log.info("cannot listen for Xid events on a GPU (%s)", exc)
        if registered:
            self._events = events
            self.features = self.features | {"xid"}
        else:
            self._optional(lambda: nvml.nvmlEventSetFree(events), None)

    def _drain_xids(self) -> dict[str, list[int]]:
        nvml = self._nvml
        found: dict[str, list[int]] = {}
        if self._events is None:
            return found
        for _ in range(_MAX_EVENTS_PER_SAMPLE):
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError as exc:
                if exc.value != nvml.NVML_ERROR_TIMEOUT:
                    log.warning("reading NVML Xid events failed: %s", exc)
                break
            if data.eventType & nvml.nvmlEventTypeXidCriticalError:
                uuid = _text(self._optional(partial(nvml.nvmlDeviceGetUUID, data.device), ""))
                found.setdefault(uuid, []).append(int(data.eventData))
        return found

    # ---- error translation ----------------------------------------------------------------------

    def _error(self, what: str, exc: Any) -> HardwareError:
        nvml = self._nvml
        absent = {getattr(nvml, code, -1) for code in _ABSENT_CODES}
        cls = BackendUnavailableError if exc.value in absent else HardwareError
        return cls(
            f"NVML failed while {what}: {exc} (NVML error {exc.value}); check the GPU with 'nvidia-smi'"
        )

    @contextmanager
    def _translate(self, what: str) -> Iterator[None]:
        try:
            yield
        except self._nvml.NVMLError as exc:
            raise self._error(what, exc) from exc

    def _optional(self, call: Callable[[], T], default: T) -> T:
        """``call()``, or ``default`` when NVML says the query is unsupported on this GPU/driver."""
        nvml = self._nvml
        try:
            return call()
        except nvml.NVMLError as exc:
            if exc.value == nvml.NVML_ERROR_GPU_IS_LOST:
                raise
            return default
        except AttributeError:  # an older pynvml without this function
            return default

    def _quiet(self, call: Callable[[], T], default: T) -> T:
        """``call()``, or ``default`` on any NVML failure (topology extras must not stop discovery)."""
        try:
            return call()
        except (self._nvml.NVMLError, AttributeError):
            return default

    def _shutdown(self) -> None:
        with suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _group_index(groups: list[list[int]], member: int) -> int:
    return next(n for n, g in enumerate(groups) if member in g)
