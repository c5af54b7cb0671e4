"""The Ascend backend: Huawei Ascend NPUs through the vendor's ``npu-smi`` tool.

Reads (formats as Huawei documents them in the *npu-smi command reference*, "信息查询(info)"):

* ``npu-smi info`` — the summary table: per NPU a first row ``NPU  Name | Health | Power(W)
  Temp(C) Hugepages-Usage(page)`` and per chip a second row ``Chip [Device] | Bus-Id | AICore(%)
  Memory-Usage(MB) [HBM-Usage(MB)]`` (training cards add HBM-Usage, inference cards a Device
  column): model name, health (OK / Warning / Alarm / Critical / UNKNOWN), power, temperature,
  PCI bus id, AI Core utilisation and device memory.
* ``npu-smi info -t board -i <id>`` — ``key : value`` lines; the Serial Number makes the uuid.
* ``npu-smi info -t memory -i <id>`` — ``key : value`` lines; ``HBM Capacity(MB)`` when the table
  has no HBM column.
* ``npu-smi info -t topo`` — the NPU × NPU matrix with ``X`` (self), ``HCCS``, ``PIX``, ``PXB``,
  ``PHB``, ``SYS``, ``NA`` and a trailing ``CPU Affinity`` column: HCCS pairs form the islands,
  PIX/PXB pairs the PCIe switch groups.

Every failure (no ``npu-smi``, a non-zero exit, output it cannot read) is translated into
:class:`~gpusched.errors.BackendUnavailableError` (nothing there) or
:class:`~gpusched.errors.HardwareError`. The runner is injectable so tests can stand in the
documented output for the tool.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpusched.catalog import LinkKind, Vendor, default_catalog
from gpusched.errors import BackendUnavailableError, HardwareError
from gpusched.hardware.base import BackendFeature
from gpusched.hardware.topology import HostInfo, connected_groups, host_info, island_members, normalise_bus_id
from gpusched.model import Device, DeviceSample, Health, Node

__all__ = [
    "AscendBackend",
    "NpuRow",
    "ascend_catalog_model_name",
    "parse_info_table",
    "parse_key_values",
    "parse_topology",
]

Runner = Callable[[Sequence[str]], str]
"""Runs ``npu-smi`` with the given arguments and returns its standard output."""

_HEALTH = {
    "OK": Health.HEALTHY,
    "WARNING": Health.DEGRADED,
    "ALARM": Health.DEGRADED,
    "CRITICAL": Health.UNHEALTHY,
    "UNKNOWN": Health.UNHEALTHY,
}
_TIMEOUT_S = 30
MIB = 2**20


@dataclass(frozen=True, slots=True)
class NpuRow:
    """One chip of the ``npu-smi info`` table."""

    npu: int
    chip: int
    name: str
    health: str
    power_w: float
    temperature_c: int
    bus_id: str
    aicore_pct: int
    memory_used_mib: int
    memory_total_mib: int


def _numbers(text: str) -> list[str]:
    return re.findall(r"\d+(?:\.\d+)?", text)


def _pairs(text: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(r"(\d+)\s*/\s*(\d+)", text)]


def parse_info_table(text: str) -> list[NpuRow]:
    """The chips of an ``npu-smi info`` summary (the process table after it is ignored).

    Raises:
        HardwareError: the text has no NPU rows in the documented layout.
    """
    rows = [line for line in text.splitlines() if line.startswith("|") and line.count("|") == 4]
    data = [r for r in rows if not re.search(r"\bNPU\s+Name\b|\bChip\b.*\bBus-Id\b|npu-smi", r)]
    out: list[NpuRow] = []
    head: list[str] | None = None
    for line in data:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "Process" in line or "No running processes" in line:
            break
        first = cells[0].split()
        if head is None:
            if len(first) < 2 or not first[0].isdigit():
                continue
            head = cells
            continue
        npu_cells, (chip_cells, bus, usage) = head, (first, cells[1], cells[2])
        head = None
        npu_first = npu_cells[0].split()
        power = _numbers(npu_cells[2])
        pairs = _pairs(usage)
        memory = pairs[-1] if pairs else (0, 0)  # HBM-Usage when present, else Memory-Usage
        usage_numbers = _numbers(usage)
        out.append(
            NpuRow(
                npu=int(npu_first[0]),
                chip=int(chip_cells[0]) if chip_cells and chip_cells[0].isdigit() else 0,
                name=" ".join(npu_first[1:]),
                health=npu_cells[1].split()[0] if npu_cells[1] else "UNKNOWN",
                power_w=float(power[0]) if power else 0.0,
                temperature_c=int(float(power[1])) if len(power) > 1 else 0,
                bus_id="" if bus.upper() in ("NA", "") else normalise_bus_id(bus),
                aicore_pct=int(float(usage_numbers[0])) if usage_numbers else 0,
                memory_used_mib=memory[0],
                memory_total_mib=memory[1],
            )
        )
    if not out:
        raise HardwareError(
            "npu-smi info printed no NPU rows in the documented table layout; "
            "check the driver with 'npu-smi info'"
        )
    return out


def parse_key_values(text: str) -> dict[str, str]:
    """``key : value`` lines (``npu-smi info -t board|memory|health -i N``); later keys win."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            found[key.strip()] = value.strip()
    return found


def parse_topology(text: str) -> tuple[list[int], dict[tuple[int, int], str]]:
    """NPU ids and the link kind between each pair (``HCCS``, ``PIX``, ``SYS`` …) from ``-t topo``."""
    lines = [line.split() for line in text.splitlines() if line.strip()]
    header = next((cols for cols in lines if cols and all(c.startswith("NPU") for c in cols[:2])), None)
    if header is None:
        return [], {}
    ids = [int(c[3:]) for c in header if re.fullmatch(r"NPU\d+", c)]
    links: dict[tuple[int, int], str] = {}
    for cols in lines:
        if cols is header or not cols or not re.fullmatch(r"NPU\d+", cols[0]):
            continue
        me = int(cols[0][3:])
        for other, kind in zip(ids, cols[1 : 1 + len(ids)], strict=False):
            if other != me:
                links[(me, other)] = kind.upper()
    return ids, links


def ascend_catalog_model_name(name: str) -> str:
    """The catalog name for an npu-smi chip name (``910B3`` → ``Ascend-910B``), else as given."""
    catalog = default_catalog()
    for candidate in (name, re.sub(r"^(910B)\d*$", r"\1", name.strip()), f"Ascend{name.strip()}"):
        model = catalog.find(candidate)
        if model is not None and model.vendor is Vendor.ASCEND:
            return model.name
    return name


def _run_npu_smi(args: Sequence[str]) -> str:
    binary = shutil.which("npu-smi")
    if binary is None:
        raise BackendUnavailableError(
            "npu-smi is not installed; install the Ascend driver (npu-smi) or use GPUSCHED_BACKEND=simulated"
        )
    try:
        done = subprocess.run(
            [binary, *args], capture_output=True, text=True, timeout=_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HardwareError(f"npu-smi {' '.join(args)} failed ({exc}); check the Ascend driver") from exc
    if done.returncode != 0:
        said = " ".join((done.stderr or done.stdout).split())[:200]
        raise HardwareError(f"npu-smi {' '.join(args)} exited with {done.returncode}: {said}")
    return done.stdout


class AscendBackend:
    """:class:`~gpusched.hardware.base.HardwareBackend` for the Ascend NPUs of this host."""

    name = "ascend"
    features: frozenset[BackendFeature] = frozenset({"topology", "hccs", "power"})

    def __init__(self, *, host: HostInfo | None = None, run: Runner | None = None) -> None:
        self._run = run or _run_npu_smi
        self.host = host or host_info()
        try:
            rows = parse_info_table(self._run(["info"]))
        except HardwareError as exc:
            raise BackendUnavailableError(
                f"no Ascend NPU answers ({exc}); use GPUSCHED_BACKEND=simulated"
            ) from exc
        self._uuids = {(r.npu, r.chip): self._uuid(r) for r in rows}
        self.description = f"Ascend npu-smi on {self.host.name} ({len(rows)} device(s))"

    def discover(self) -> list[Node]:
        """This host as one node: NPUs with memory, health, NUMA node, PCIe switch and HCCS islands."""
        rows = parse_info_table(self._run(["info"]))
        _, links = parse_topology(self._topology_text())
        position = {npu: i for i, npu in enumerate(sorted({r.npu for r in rows}))}
        hccs = [
            (position[a], position[b])
            for (a, b), kind in links.items()
            if kind == "HCCS" and a < b and a in position and b in position
        ]
        pcie = [
            (position[a], position[b])
            for (a, b), kind in links.items()
            if kind in ("PIX", "PXB") and a < b and a in position and b in position
        ]
        groups = connected_groups(len(position), hccs)
        island_of = island_members(groups)
        switch_of = {m: n for n, g in enumerate(connected_groups(len(position), pcie)) for m in g}
        devices = []
        for index, row in enumerate(rows):
            p = position[row.npu]
            island = island_of.get(p)
            peers = tuple(
                sorted(
                    self._uuids[(r.npu, r.chip)]
                    for r in rows
                    if island is not None and island_of.get(position[r.npu]) == island and r.npu != row.npu
                )
            )
            memory_mib = row.memory_total_mib or self._hbm_capacity(row.npu)
            devices.append(
                Device(
                    uuid=self._uuids[(row.npu, row.chip)],
                    index=index,
                    node=self.host.name,
                    model=ascend_catalog_model_name(row.name),
                    vendor=Vendor.ASCEND,
                    architecture=self._architecture(row.name),
                    memory_bytes=memory_mib * MIB,
                    numa_node=_numa_node(row.bus_id),
                    pcie_switch=f"{self.host.name}/pcie{switch_of.get(p, p)}",
                    island=f"{self.host.name}/hccs{island}" if island is not None else None,
                    link=LinkKind.HCCS if island is not None else LinkKind.PCIE,
                    peers=peers,
                    health=_HEALTH.get(row.health.upper(), Health.UNHEALTHY),
                )
            )
        return [
            Node(
                name=self.host.name,
                rack=self.host.rack,
                devices=tuple(devices),
                labels=self.host.labels,
                cpu_milli=self.host.cpu_milli,
                memory_bytes=self.host.memory_bytes,
            )
        ]

    def sample(self) -> list[DeviceSample]:
        """One reading per chip from the summary table (npu-smi reports no ECC total or Xid here)."""
        now = time.time()
        return [
            DeviceSample(
                uuid=self._uuids.get((r.npu, r.chip), self._uuid(r)),
                taken_at=now,
                utilization_pct=max(0, min(100, r.aicore_pct)),
                memory_used_bytes=r.memory_used_mib * MIB,
                memory_total_bytes=(r.memory_total_mib or self._hbm_capacity(r.npu)) * MIB,
                temperature_mc=r.temperature_c * 1000,
                power_mw=int(r.power_w * 1000),
            )
            for r in parse_info_table(self._run(["info"]))
        ]

    def close(self) -> None:
        """Nothing to release (npu-smi is run per query)."""

    # ---- internals ----------------------------------------------------------------------------

    def _uuid(self, row: NpuRow) -> str:
        try:
            serial = parse_key_values(self._run(["info", "-t", "board", "-i", str(row.npu)])).get(
                "Serial Number", ""
            )
        except HardwareError:
            serial = ""
        if not serial or serial.upper() == "NA":
            serial = f"{self.host.name}-{row.npu}"
        return f"NPU-{serial}-{row.chip}"

    def _hbm_capacity(self, npu: int) -> int:
        try:
            values = parse_key_values(self._run(["info", "-t", "memory", "-i", str(npu)]))
        except HardwareError:
            return 0
        for key in ("HBM Capacity(MB)", "DDR Capacity(MB)"):
            digits = _numbers(values.get(key, ""))
            if digits:
                return int(float(digits[0]))
        return 0

    def _topology_text(self) -> str:
        try:
            return self._run(["info", "-t", "topo"])
        except HardwareError:
            return ""  # single-NPU hosts answer "does not support querying topo"

    @staticmethod
    def _architecture(name: str) -> str:
        model = default_catalog().find(ascend_catalog_model_name(name))
        return model.architecture if model is not None else f"ascend{name.lower()}"


def _numa_node(bus_id: str) -> int:
    if not bus_id:
        return -1
    try:
        node = int(Path(f"/sys/bus/pci/devices/{bus_id}/numa_node").read_text().strip())
    except (OSError, ValueError):
        return -1
    return node if node >= 0 else -1
