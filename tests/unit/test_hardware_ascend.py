"""AscendBackend against a fake ``npu-smi``: the fake answers with text in the layouts Huawei
documents in the npu-smi command reference ("信息查询(info)"), so the parsers are tested against
what the tool prints, not against a format we made up:

* ``npu-smi info`` — "查询基本信息", e.g. https://www.hiascend.com/document/detail/zh/Atlas%20200I%20A2/2520/re/npu/npusmi_007.html
  (two rows per NPU: ``NPU Name | Health | Power(W) Temp(C) Hugepages-Usage(page)`` and
  ``Chip [Device] | Bus-Id | AICore(%) Memory-Usage(MB) [HBM-Usage(MB)]``; training cards such as
  the 910B print the HBM column and no Device column).
* ``npu-smi info -t board -i N`` — "查询NPU的详细信息" (``key : value`` lines, Serial Number …),
  https://hiascend.com/document/detail/zh/Atlas%20200I%20A2/24.1.RC3/re/npu/npusmi_008.html
* ``npu-smi info -t memory -i N`` — "查询所有芯片内存信息" (``key : value`` lines).
* ``npu-smi info -t topo`` — "查询多NPU的拓扑结构" (npusmi_069.html); the legend (X, HCCS, PIX,
  PHB, SYS) and the CPU Affinity column as the Ascend toolbox documents them,
  https://www.hiascend.com/document/detail/en/mindx-dl/300/dluserguide/toolboxug/toolboxug_0023.html
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gpusched.catalog import LinkKind, Vendor
from gpusched.errors import BackendUnavailableError, HardwareError
from gpusched.hardware.ascend import (
    AscendBackend,
    ascend_catalog_model_name,
    parse_info_table,
    parse_topology,
)
from gpusched.hardware.base import HardwareBackend
from gpusched.hardware.topology import HostInfo
from gpusched.model import Health

HOST = HostInfo(name="atlas-1", rack="r3", labels=(), cpu_milli=192_000, memory_bytes=2**40)

INFO_910B = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.3                   Version: 23.0.3                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 96.5        41                0    / 0             |
| 0                         | 0000:C1:00.0  | 37          0    / 0          40213/ 65536         |
+===========================+===============+====================================================+
| 1     910B3               | OK            | 91.2        39                0    / 0             |
| 0                         | 0000:C2:00.0  | 0           0    / 0          3361 / 65536         |
+===========================+===============+====================================================+
| 2     910B3               | Warning       | 90.8        40                0    / 0             |
| 0                         | 0000:81:00.0  | 0           0    / 0          3359 / 65536         |
+===========================+===============+====================================================+
| 3     910B3               | Critical      | 92.0        42                0    / 0             |
| 0                         | 0000:82:00.0  | 0           0    / 0          3359 / 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| 0       0                 | 230149        | python3                  | 36890                   |
+===========================+===============+====================================================+
"""

# The inference layout (Atlas 200I A2 reference page): a Device column and no HBM column.
INFO_310B = """\
+--------------------------------------------------------------------------------------------------------+
| npu-smi 23.0.rc3                                   Version: 23.0.rc3                                   |
+-------------------------------+-----------------+------------------------------------------------------+
| NPU     Name                  | Health          | Power(W)     Temp(C)           Hugepages-Usage(page) |
| Chip    Device                | Bus-Id          | AICore(%)    Memory-Usage(MB)                        |
+===============================+=================+======================================================+
| 0       310B1                 | OK              | 10.4          66                15    / 15           |
| 0       0                     | NA              | 0            957   / 10810                           |
+===============================+=================+======================================================+
"""

BOARD = """\
        NPU ID                         : {npu}
        Product Name                   : IT21PDDA01
        Model                          : NA
        Manufacturer                   : Huawei
        Serial Number                  : 102{npu:07d}
        Software Version               : 23.0.3
        Firmware Version               : 7.1.0.5.220
        Board ID                       : 0x02
        PCB ID                         : A
        BOM ID                         : 1
        Chip Count                     : 1
        Faulty Chip Count              : 0
"""

MEMORY_310B = """\
        NPU ID                         : 0
        Chip Count                     : 1
        DDR Capacity(MB)               : 10810
        DDR Clock Speed(MHz)           : 3200
        Chip ID                        : 0
"""

TOPO_4 = """\
           NPU0       NPU1       NPU2       NPU3       CPU Affinity
NPU0       X          HCCS       SYS        SYS        144-167
NPU1       HCCS       X          SYS        SYS        144-167
NPU2       SYS        SYS        X          HCCS       96-119
NPU3       SYS        SYS        HCCS       X          96-119

Legend:

  X    = Self
  SYS  = Path traversing PCIe and NUMA nodes. Nodes are connected through SMP, such as QPI, UPI.
  PHB  = Path traversing PCIe and the PCIe host bridge of a CPU.
  PIX  = Path traversing a single PCIe switch
  PXB  = Path traversing multipul PCIe switches
  HCCS = Connection traversing HCCS.
  NA   = Unknown relationship.
"""


class FakeNpuSmi:
    """Answers ``npu-smi`` argument lists with the documented texts above; records the calls."""

    def __init__(self, info: str, topo: str | None = TOPO_4, memory: str = MEMORY_310B) -> None:
        self.info, self.topo, self.memory = info, topo, memory
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, args: Sequence[str]) -> str:
        self.calls.append(tuple(args))
        match list(args):
            case ["info"]:
                return self.info
            case ["info", "-t", "board", "-i", npu]:
                return BOARD.format(npu=int(npu))
            case ["info", "-t", "memory", "-i", _]:
                return self.memory
            case ["info", "-t", "topo"]:
                if self.topo is None:
                    raise HardwareError("npu-smi info -t topo: This device does not support querying topo.")
                return self.topo
        raise AssertionError(f"npu-smi called with undocumented arguments {args}")


def test_summary_table_of_a_910b_server_is_parsed() -> None:
    rows = parse_info_table(INFO_910B)
    assert [r.npu for r in rows] == [0, 1, 2, 3]
    first = rows[0]
    assert (first.name, first.health, first.power_w, first.temperature_c) == ("910B3", "OK", 96.5, 41)
    assert (first.bus_id, first.aicore_pct) == ("0000:c1:00.0", 37)
    assert (first.memory_used_mib, first.memory_total_mib) == (40213, 65536)  # the HBM column


def test_inference_layout_with_device_column_is_parsed() -> None:
    (row,) = parse_info_table(INFO_310B)
    assert (row.npu, row.chip, row.name, row.bus_id) == (0, 0, "310B1", "")
    assert (row.memory_used_mib, row.memory_total_mib) == (957, 10810)


def test_unreadable_output_is_a_hardware_error() -> None:
    with pytest.raises(HardwareError, match="documented table layout"):
        parse_info_table("npu-smi: command output changed")


def test_topology_matrix() -> None:
    ids, links = parse_topology(TOPO_4)
    assert ids == [0, 1, 2, 3]
    assert links[(0, 1)] == "HCCS" and links[(1, 0)] == "HCCS" and links[(0, 2)] == "SYS"
    assert (0, 0) not in links


def test_discovery_of_a_910b_server() -> None:
    fake = FakeNpuSmi(INFO_910B)
    backend = AscendBackend(host=HOST, run=fake)
    assert isinstance(backend, HardwareBackend)
    (node,) = backend.discover()
    devices = node.devices
    assert [d.index for d in devices] == [0, 1, 2, 3]
    first = devices[0]
    assert first.uuid == "NPU-1020000000-0"
    assert (first.model, first.vendor, first.architecture) == ("Ascend-910B", Vendor.ASCEND, "ascend910b")
    assert first.memory_bytes == 65536 * 2**20
    assert first.island == devices[1].island == "atlas-1/hccs0" and devices[2].island == "atlas-1/hccs1"
    assert first.link is LinkKind.HCCS and first.peers == (devices[1].uuid,)
    assert [d.health for d in devices] == [Health.HEALTHY, Health.HEALTHY, Health.DEGRADED, Health.UNHEALTHY]
    assert ("info", "-t", "topo") in fake.calls


def test_samples_come_from_the_summary_table() -> None:
    backend = AscendBackend(host=HOST, run=FakeNpuSmi(INFO_910B))
    first = backend.sample()[0]
    assert (first.utilization_pct, first.memory_used_bytes) == (37, 40213 * 2**20)
    assert (first.temperature_mc, first.power_mw) == (41_000, 96_500)


def test_single_npu_without_topology_or_hbm_column() -> None:
    backend = AscendBackend(host=HOST, run=FakeNpuSmi(INFO_310B, topo=None))
    (node,) = backend.discover()
    (device,) = node.devices
    assert device.island is None and device.link is LinkKind.PCIE
    assert device.memory_bytes == 10810 * 2**20
    assert device.model == "310B1" and device.architecture == "ascend310b1"  # not in the catalog


def test_no_npu_smi_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(BackendUnavailableError, match="npu-smi"):
        AscendBackend(host=HOST)


@pytest.mark.parametrize(
    ("name", "model"), [("910B3", "Ascend-910B"), ("910B", "Ascend-910B"), ("310P3", "310P3")]
)
def test_chip_names_map_to_the_catalog(name: str, model: str) -> None:
    assert ascend_catalog_model_name(name) == model


def test_ascend_quota_units_come_from_the_catalog() -> None:
    from gpusched.catalog import default_catalog
    from gpusched.model import DeviceShare, FleetSnapshot
    from gpusched.quota.policy import normalised_rate

    (node,) = AscendBackend(host=HOST, run=FakeNpuSmi(INFO_910B)).discover()
    share = DeviceShare(node.devices[0].uuid, node.name, 0, 1000, node.devices[0].memory_bytes)
    rate = normalised_rate([share], FleetSnapshot((node,)))
    assert rate == default_catalog().get("Ascend-910B").a100_equiv_milli
