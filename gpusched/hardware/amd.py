"""The AMD backend: Instinct GPUs through AMD SMI (the ``amdsmi`` Python package of ROCm).

Discovery reads the uuid, ASIC info (market name → catalog model, ``gfx…`` architecture), VRAM
size, NUMA node (``amdsmi_topo_get_numa_node_number``), PCIe placement (sysfs) and the xGMI
fabric (``amdsmi_topo_get_link_type`` between every pair), and the card's compute and memory
partition modes (``amdsmi_get_gpu_compute_partition``: SPX/DPX/QPX/CPX,
``amdsmi_get_gpu_memory_partition``: NPS1/NPS4). In a splitting mode (CPX: 8 logical devices per
MI300X) AMD SMI lists each partition as its own processor; each becomes an isolated slice whose
``parent`` is the physical card (``<host>/<PCI bus:device>``, the partitions differing only in the
PCI function). Sampling reads activity, VRAM in
use, temperature (hotspot, else edge), socket power and the uncorrectable ECC total.

``import amdsmi`` itself needs ``libamd_smi.so`` (it prints to stdout and fails without it), so
the import happens inside the backend, with stdout silenced, and every failure — missing
library, no driver, no device, any ``AmdSmiException`` — is translated into
:class:`~gpusched.errors.BackendUnavailableError` or :class:`~gpusched.errors.HardwareError`.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TypeVar

from gpusched.catalog import LinkKind, Vendor, default_catalog
from gpusched.errors import BackendUnavailableError, HardwareError
from gpusched.hardware.base import BackendFeature
from gpusched.hardware.topology import (
    HostInfo,
    connected_groups,
    host_info,
    island_members,
    normalise_bus_id,
    pcie_switch_key,
)
from gpusched.model import Device, DeviceSample, Health, Node
from gpusched.slices import amd_partition_of

__all__ = ["AmdBackend", "amd_catalog_model_name", "import_amdsmi"]

T = TypeVar("T")


def import_amdsmi() -> Any:
    """The ``amdsmi`` module, or :class:`BackendUnavailableError` when it or its library is absent."""
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet):
            import amdsmi
    except (ImportError, KeyError, OSError, AttributeError) as exc:
        said = " ".join(quiet.getvalue().split())
        raise BackendUnavailableError(
            f"AMD SMI is unavailable ({said or exc!r}); install ROCm's amd-smi-lib (libamd_smi.so) "
            "or use GPUSCHED_BACKEND=simulated"
        ) from exc
    return amdsmi


def amd_catalog_model_name(market_name: str) -> str:
    """The catalog name for an AMD market name (``"AMD Instinct MI300X"`` → ``"MI300X"``), else as given."""
    catalog = default_catalog()
    for candidate in (market_name, market_name.removeprefix("AMD ").removeprefix("Instinct ")):
        model = catalog.find(candidate.strip())
        if model is not None and model.vendor is Vendor.AMD:
            return model.name
    return market_name


class AmdBackend:
    """:class:`~gpusched.hardware.base.HardwareBackend` for the AMD GPUs of this host."""

    name = "amd"
    features: frozenset[BackendFeature] = frozenset({"topology", "xgmi", "power", "ecc", "partitions"})
    partition_modes: dict[str, tuple[str, str]]
    """Physical card → (compute, memory) partition mode, e.g. ``("CPX", "NPS4")``, from discover()."""

    def __init__(self, *, host: HostInfo | None = None) -> None:
        smi = import_amdsmi()
        self._smi = smi
        try:
            smi.amdsmi_init()
        except smi.AmdSmiException as exc:
            raise BackendUnavailableError(
                f"AMD SMI cannot start ({exc}); load the amdgpu driver or use GPUSCHED_BACKEND=simulated"
            ) from exc
        try:
            with self._translate("listing devices"):
                self._handles = list(smi.amdsmi_get_processor_handles())
                if not self._handles:
                    raise BackendUnavailableError(
                        "AMD SMI finds no AMD GPU on this host; use GPUSCHED_BACKEND=simulated"
                    )
                self._uuids = [str(smi.amdsmi_get_gpu_device_uuid(h)) for h in self._handles]
        except BaseException:
            self._shutdown()
            raise
        self.host = host or host_info()
        self.partition_modes = {}
        self.description = f"AMD SMI on {self.host.name} ({len(self._handles)} device(s))"

    # ---- HardwareBackend ------------------------------------------------------------------------

    def discover(self) -> list[Node]:
        """This host as one node, its GPUs with NUMA node, PCIe switch, xGMI island and peers."""
        smi = self._smi
        count = len(self._handles)
        xgmi_type = int(getattr(smi.AmdSmiLinkType, "AMDSMI_LINK_TYPE_XGMI", 2))
        pairs = []
        for i in range(count):
            for j in range(i + 1, count):
                link = self._optional(
                    partial(smi.amdsmi_topo_get_link_type, self._handles[i], self._handles[j]), None
                )
                if link is not None and int(link["type"]) == xgmi_type:
                    pairs.append((i, j))
        groups = connected_groups(count, pairs)
        island_of = island_members(groups)
        bdfs = [normalise_bus_id(str(self._optional(partial(smi.amdsmi_get_gpu_device_bdf, h), "")))
                for h in self._handles]
        switches: dict[str, int] = {}
        devices = []
        self.partition_modes: dict[str, tuple[str, str]] = {}
        for i, handle in enumerate(self._handles):
            with self._translate(f"reading {self._uuids[i]}"):
                asic = smi.amdsmi_get_gpu_asic_info(handle)
                memory = self._memory_total(handle)
            switch = pcie_switch_key(bdfs[i]) if bdfs[i] else None
            switch_number = switches.setdefault(switch or f"device{i}", len(switches))
            island = island_of.get(i)
            peers = tuple(sorted({self._uuids[b if a == i else a] for a, b in pairs if i in (a, b)}))
            model_name = amd_catalog_model_name(str(asic.get("market_name", "AMD GPU")))
            card = f"{self.host.name}/{bdfs[i].rsplit('.', 1)[0] if bdfs[i] else self._uuids[i]}"
            compute_mode = str(self._optional(partial(smi.amdsmi_get_gpu_compute_partition, handle), ""))
            memory_mode = str(self._optional(partial(smi.amdsmi_get_gpu_memory_partition, handle), ""))
            compute_mode, memory_mode = compute_mode.upper(), memory_mode.upper()
            self.partition_modes[card] = (compute_mode or "N/A", memory_mode or "N/A")
            devices.append(amd_partition_of(Device(
                uuid=self._uuids[i], index=i, node=self.host.name,
                model=model_name,
                vendor=Vendor.AMD, architecture=str(asic.get("target_graphics_version", "unknown")),
                memory_bytes=memory,
                numa_node=int(self._optional(partial(smi.amdsmi_topo_get_numa_node_number, handle), -1)),
                pcie_switch=f"{self.host.name}/pcie{switch_number}",
                island=f"{self.host.name}/xgmi{island}" if island is not None else None,
                link=LinkKind.XGMI if island is not None else LinkKind.PCIE,
                peers=peers if island is not None else (),
                health=self._health(handle),
            ), default_catalog().find(model_name), compute_mode, card))
        return [Node(
            name=self.host.name, rack=self.host.rack, devices=tuple(devices), labels=self.host.labels,
            cpu_milli=self.host.cpu_milli, memory_bytes=self.host.memory_bytes,
        )]

    def sample(self) -> list[DeviceSample]:
        """One reading per GPU (AMD SMI has no Xid; ``xid_errors`` stays empty)."""
        now = time.time()
        samples = []
        for handle, uuid in zip(self._handles, self._uuids, strict=True):
            with self._translate(f"sampling {uuid}"):
                samples.append(self._sample(handle, uuid, now))
        return samples

    def close(self) -> None:
        """Shut AMD SMI down (safe to call twice)."""
        self._shutdown()

    # ---- internals ----------------------------------------------------------------------------

    def _sample(self, handle: Any, uuid: str, now: float) -> DeviceSample:
        smi = self._smi
        vram = smi.AmdSmiMemoryType.VRAM
        activity: dict[str, Any] = self._optional(lambda: smi.amdsmi_get_gpu_activity(handle), {})
        power: dict[str, Any] = self._optional(lambda: smi.amdsmi_get_power_info(handle), {})
        watts = _number(power.get("current_socket_power"), _number(power.get("average_socket_power"), 0))
        return DeviceSample(
            uuid=uuid, taken_at=now,
            utilization_pct=_number(activity.get("gfx_activity"), 0),
            memory_used_bytes=int(smi.amdsmi_get_gpu_memory_usage(handle, vram)),
            memory_total_bytes=self._memory_total(handle),
            temperature_mc=self._temperature(handle) * 1000,
            power_mw=watts * 1000,
            ecc_uncorrected=self._uncorrectable(handle),
        )

    def _memory_total(self, handle: Any) -> int:
        smi = self._smi
        try:
            return int(smi.amdsmi_get_gpu_memory_total(handle, smi.AmdSmiMemoryType.VRAM))
        except smi.AmdSmiException:
            # vram_size is in MiB in amdsmi's vram info
            return int(smi.amdsmi_get_gpu_vram_info(handle)["vram_size"]) * 2**20

    def _temperature(self, handle: Any) -> int:
        smi = self._smi
        kinds = smi.AmdSmiTemperatureType
        for sensor in (kinds.HOTSPOT, kinds.EDGE):  # MI300 has no edge sensor
            read = partial(smi.amdsmi_get_temp_metric, handle, sensor, smi.AmdSmiTemperatureMetric.CURRENT)
            value = self._optional(read, None)
            if value is not None:
                return int(value)
        return 0

    def _uncorrectable(self, handle: Any) -> int:
        counts: dict[str, Any] = self._optional(lambda: self._smi.amdsmi_get_gpu_total_ecc_count(handle), {})
        return _number(counts.get("uncorrectable_count"), 0)

    def _health(self, handle: Any) -> Health:
        return Health.DEGRADED if self._uncorrectable(handle) else Health.HEALTHY

    @contextlib.contextmanager
    def _translate(self, what: str) -> Iterator[None]:
        try:
            yield
        except self._smi.AmdSmiException as exc:
            code = getattr(exc, "get_error_code", lambda: None)()
            raise HardwareError(
                f"AMD SMI failed while {what}: {exc} (code {code}); check the GPU with 'amd-smi list'"
            ) from exc

    def _optional(self, call: Callable[[], T], default: T) -> T:
        """``call()``, or ``default`` when AMD SMI cannot answer that query on this device."""
        try:
            return call()
        except self._smi.AmdSmiException:
            return default

    def _shutdown(self) -> None:
        with contextlib.suppress(self._smi.AmdSmiException):
            self._smi.amdsmi_shut_down()


def _number(value: object, default: int) -> int:
    """An int from an AMD SMI field, which reads "N/A" when the device does not report it."""
    if isinstance(value, bool):
        return default
    if isinstance(value, int | float):
        return int(value)
    return default
