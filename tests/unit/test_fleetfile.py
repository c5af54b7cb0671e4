"""The fleet file parser: the shipped fleets, topology defaults, and one test per kind of bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpusched.catalog import LinkKind, Vendor
from gpusched.errors import FleetFileError
from gpusched.fleetfile import load_fleet, parse_fleet
from gpusched.model import FleetSnapshot

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "gpusched" / "include" / "fleets" / "default.yaml"
SMALL = ROOT / "gpusched" / "include" / "fleets" / "small.yaml"
GIB = 2**30


def test_default_fleet_shape() -> None:
    nodes = load_fleet(DEFAULT)
    devices = [d for n in nodes for d in n.devices]
    assert {n.rack for n in nodes} == {"rack-a", "rack-b"}
    assert len({d.model for d in devices}) >= 5
    assert {d.vendor for d in devices} == {Vendor.NVIDIA, Vendor.AMD, Vendor.ASCEND}
    assert [n.name for n in nodes if n.standby] == ["a-h100-2"]
    assert len({d.uuid for d in devices}) == len(devices)
    snapshot = FleetSnapshot(tuple(nodes), source="test")
    assert snapshot.total_devices() == len(devices)


def test_default_fleet_topology() -> None:
    nodes = {n.name: n for n in load_fleet(DEFAULT)}
    h100 = nodes["a-h100-1"].devices
    assert {d.island for d in h100} == {"a-h100-1/nvswitch0"}
    assert all(d.link is LinkKind.NVSWITCH and len(d.peers) == 7 for d in h100)
    assert [d.numa_node for d in h100] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert h100[0].pcie_switch == h100[1].pcie_switch != h100[2].pcie_switch
    a100 = nodes["a-a100-1"].devices
    assert [d.island for d in a100] == ["a-a100-1/nvlink0"] * 4 + ["a-a100-1/nvlink1"] * 4
    assert set(a100[0].peers) == {a100[1].uuid, a100[2].uuid, a100[3].uuid}
    l40s = nodes["a-l40s-1"].devices
    assert all(d.island is None and d.link is LinkKind.PCIE and d.peers == () for d in l40s)
    mi300 = nodes["b-mi300x-1"].devices
    assert mi300[0].uuid.startswith("AMD-sim-") and mi300[0].link is LinkKind.XGMI
    npu = nodes["b-910b-1"].devices
    assert npu[0].uuid == "NPU-sim-b-910b-1-0" and npu[0].link is LinkKind.HCCS
    assert h100[3].uuid == "GPU-sim-a-h100-1-3"
    assert nodes["a-h100-1"].label("zone") == "a" and nodes["a-h100-1"].label("pool") == "training"
    assert nodes["a-h100-1"].cpu_milli == 112_000 and nodes["a-h100-1"].memory_bytes == 2048 * GIB


def test_small_fleet_loads_and_is_deterministic() -> None:
    first = load_fleet(SMALL)
    assert first == load_fleet(SMALL)
    assert sum(len(n.devices) for n in first) == 12


def test_defaults_mixed_groups_and_memory_override() -> None:
    data = {"racks": [{"name": "r", "nodes": [{
        "name": "mix", "numa_nodes": 2,
        "devices": [{"model": "A100", "count": 4}, {"model": "T4", "count": 2, "memory": "15GiB"}],
    }]}]}
    (node,) = parse_fleet(data)
    a100, t4 = node.devices[:4], node.devices[4:]
    assert [d.index for d in node.devices] == list(range(6))
    assert [d.numa_node for d in a100] == [0, 0, 1, 1]
    assert len({d.island for d in a100}) == 1 and a100[0].island is not None
    assert [d.pcie_switch for d in node.devices] == ["mix/pcie0", "mix/pcie0", "mix/pcie1", "mix/pcie1",
                                                     "mix/pcie2", "mix/pcie2"]
    assert t4[0].memory_bytes == 15 * GIB and t4[0].island is None
    assert t4[1].uuid == "GPU-sim-mix-5"


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def _node(**overrides: object) -> dict[str, object]:
    node: dict[str, object] = {"name": "n1", "devices": {"model": "A100", "count": 4}}
    node.update(overrides)
    return node


def _fleet(*nodes: dict[str, object]) -> dict[str, object]:
    return {"racks": [{"name": "r1", "nodes": list(nodes) or [_node()]}]}


BAD = [
    # (document, words the message must contain)
    ("racks: [unclosed", ["not valid YAML", "correct the YAML"]),
    ([1, 2], ["not a mapping", "racks:"]),
    ({"rack": []}, ["'rack'", "did you mean 'racks'"]),
    ({"racks": []}, ["'racks'", "at least one rack"]),
    ({"racks": [{"name": "r1"}]}, ["nodes", "missing or empty"]),
    ({"racks": [{"name": "r1", "nodes": [_node()]}, {"name": "r1", "nodes": [_node(name="n2")]}]},
     ["rack 'r1' appears twice", "unique name"]),
    ({"racks": [{"name": "r1", "nodes": [_node(), _node()]}]}, ["node 'n1'", "appears twice"]),
    (_fleet(_node(name="bad name!")), ["not a valid name", "host name"]),
    (_fleet(_node(devices={"model": "H900", "count": 8})), ["node 'n1'", "devices[0].model", "H900",
                                                            "H100-SXM-80GB"]),
    (_fleet(_node(devices={"model": "A100", "count": 0})), ["devices[0].count", "from 1 to 128"]),
    (_fleet(_node(devices={"model": "A100", "cuont": 2})), ["cuont", "did you mean 'count'"]),
    (_fleet(_node(devices=[])), ["'devices'", "missing or empty"]),
    (_fleet(_node(memory="lots")), ["'memory'", "'80GiB'"]),
    (_fleet(_node(standby="yes")), ["'standby'", "standby: true"]),
    (_fleet(_node(labels=["a"])), ["'labels'", "{key: value}"]),
    (_fleet(_node(numa_nodes=2, devices={"model": "A100", "count": 4, "numa": [0, 1]})),
     ["devices[0].numa", "4 entries"]),
    (_fleet(_node(numa_nodes=2, devices={"model": "A100", "count": 2, "numa": [0, 3]})),
     ["NUMA node 3 does not exist", "raise numa_nodes"]),
    (_fleet(_node(devices={"model": "A100", "count": 2, "islands": [[0, 5]]})),
     ["device index 5 is out of range", "0..1"]),
    (_fleet(_node(devices={"model": "A100", "count": 4, "islands": [[0, 1], [1, 2]]})),
     ["device 1 is listed in two groups", "exactly one group"]),
    (_fleet(_node(devices={"model": "A100", "count": 4, "islands": [[0]]})),
     ["fewer than two devices", "at least two"]),
    (_fleet(_node(devices={"model": "L40S", "count": 2, "islands": [[0, 1]]})),
     ["L40S has no peer links", "remove 'islands'"]),
    (_fleet(_node(devices={"model": "A100", "count": 4, "pcie_switches": [[0, 1]]})),
     ["devices [2, 3] are in no group", "every device index"]),
    (_fleet(_node(devices={"model": "A100", "count": 2, "pcie_switches": "pairs"})),
     ["pcie_switches", "[[0, 1], [2, 3]]"]),
]


@pytest.mark.parametrize(("document", "words"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_names_file_field_and_fix(tmp_path: Path, document: object, words: list[str]) -> None:
    path = _write(tmp_path, document)
    with pytest.raises(FleetFileError) as info:
        load_fleet(path)
    message = str(info.value)
    assert str(path) in message
    assert "fix:" in message
    for word in words:
        assert word in message, (word, message)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FleetFileError, match=r"cannot be read.*fix: pass an existing fleet file"):
        load_fleet(tmp_path / "absent.yaml")
