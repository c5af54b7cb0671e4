"""Topology helpers: grouping, PCI address canonical form, PCIe switch from sysfs, host facts."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusched.hardware.topology import (
    connected_groups,
    host_info,
    island_members,
    normalise_bus_id,
    pcie_switch_key,
)


def test_connected_groups_and_islands() -> None:
    groups = connected_groups(6, [(0, 1), (2, 3), (3, 1), (4, 4)])
    assert groups == [[0, 1, 2, 3], [4], [5]]
    assert island_members(groups) == {0: 0, 1: 0, 2: 0, 3: 0}
    assert connected_groups(0, []) == []


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [("00000000:18:00.0", "0000:18:00.0"), (b"00000000:DB:00.0", "0000:db:00.0"),
     ("0000:0c:00.0", "0000:0c:00.0"), ("3b:00.0", "0000:3b:00.0")],
)
def test_bus_ids_compare_in_one_form(raw: str | bytes, canonical: str) -> None:
    assert normalise_bus_id(raw) == canonical


def _device(root: Path, chain: list[str]) -> None:
    real = root / "devices" / "pci0000:00"
    for part in chain:
        real = real / part
    real.mkdir(parents=True)
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    (links / chain[-1]).symlink_to(real)


def test_pcie_switch_from_sysfs(tmp_path: Path) -> None:
    # two GPUs behind one switch (upstream port 0000:01:00.0), one straight on a root port
    _device(tmp_path, ["0000:00:01.1", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0"])
    _device(tmp_path, ["0000:00:01.1", "0000:01:00.0", "0000:02:01.0", "0000:04:00.0"])
    _device(tmp_path, ["0000:00:03.1", "0000:c1:00.0"])
    sysfs = tmp_path / "bus" / "pci" / "devices"
    assert pcie_switch_key("0000:03:00.0", sysfs) == pcie_switch_key("0000:04:00.0", sysfs) == "0000:01:00.0"
    assert pcie_switch_key("0000:c1:00.0", sysfs) == "0000:00:03.1"
    assert pcie_switch_key("0000:99:00.0", sysfs) is None


def test_host_info_reads_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSCHED_NODE_NAME", "gpu-7")
    monkeypatch.setenv("GPUSCHED_RACK", "rack-z")
    monkeypatch.setenv("GPUSCHED_NODE_LABELS", "zone=z, pool=train,broken")
    info = host_info()
    assert (info.name, info.rack, info.labels) == ("gpu-7", "rack-z", (("pool", "train"), ("zone", "z")))
    assert info.cpu_milli >= 1000 and info.memory_bytes > 0
