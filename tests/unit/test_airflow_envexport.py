"""devices_env: the variables each vendor needs, fractions, and the GPUSCHED_ALLOCATION record."""

from __future__ import annotations

import json

import pytest

from gpusched.catalog import Vendor
from gpusched.errors import PlacementError
from gpusched.hardware.envexport import ENV_KEYS, allocation_from_env, devices_env
from gpusched.model import MILLI, Device, DeviceShare, FleetSnapshot, Node

GIB = 1024**3


def _node(name: str, vendor: Vendor, model: str, arch: str, n: int, memory_gib: int) -> Node:
    prefix = {"nvidia": "GPU", "amd": "AMD", "ascend": "NPU"}[vendor.value]
    devices = tuple(
        Device(uuid=f"{prefix}-{name}-{i}", index=i, node=name, model=model, vendor=vendor,
               architecture=arch, memory_bytes=memory_gib * GIB)
        for i in range(n)
    )
    return Node(name=name, rack="r1", devices=devices)


@pytest.fixture
def fleet() -> FleetSnapshot:
    return FleetSnapshot(nodes=(
        _node("nv", Vendor.NVIDIA, "A100-SXM-80GB", "sm_80", 8, 80),
        _node("amd", Vendor.AMD, "MI300X", "gfx942", 8, 192),
        _node("npu", Vendor.ASCEND, "Ascend-910B", "ascend910b", 8, 64),
    ))


def _whole(node: str, prefix: str, *indices: int, memory_gib: int = 80) -> list[DeviceShare]:
    return [DeviceShare(f"{prefix}-{node}-{i}", node, i, MILLI, memory_gib * GIB) for i in indices]


def test_nvidia_whole_devices_by_index_in_pci_order(fleet: FleetSnapshot) -> None:
    env = devices_env(_whole("nv", "GPU", 6, 4, 5, 7), fleet, key="k1")
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
    assert "GPUSCHED_MEMORY_LIMIT_BYTES" not in env
    record = json.loads(env["GPUSCHED_ALLOCATION"])
    assert record["key"] == "k1"
    assert record["node"] == "nv"
    assert record["devices"] == [4, 5, 6, 7]
    assert record["uuids"] == ["GPU-nv-4", "GPU-nv-5", "GPU-nv-6", "GPU-nv-7"]
    assert record["models"] == ["A100-SXM-80GB"] * 4
    assert record["vendor"] == "nvidia"
    assert set(env) <= ENV_KEYS


def test_nvidia_by_uuid(fleet: FleetSnapshot) -> None:
    env = devices_env(_whole("nv", "GPU", 1, 0), fleet, use_uuids=True)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-nv-0,GPU-nv-1"
    assert "CUDA_DEVICE_ORDER" not in env


def test_amd_sets_hip_and_rocr(fleet: FleetSnapshot) -> None:
    env = devices_env(_whole("amd", "AMD", 2, 3, memory_gib=192), fleet)
    assert env["HIP_VISIBLE_DEVICES"] == "2,3"
    assert env["ROCR_VISIBLE_DEVICES"] == "2,3"
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert json.loads(env["GPUSCHED_ALLOCATION"])["models"] == ["MI300X", "MI300X"]


def test_ascend_sets_ascend_rt(fleet: FleetSnapshot) -> None:
    env = devices_env(_whole("npu", "NPU", 0, 1, 2, 3, memory_gib=64), fleet)
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3"
    assert not {"CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"} & set(env)


def test_fraction_on_nvidia_gets_mps_limits(fleet: FleetSnapshot) -> None:
    share = DeviceShare("GPU-nv-3", "nv", 3, 250, 20 * GIB)
    env = devices_env([share], fleet)
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    assert env["GPUSCHED_MEMORY_LIMIT_BYTES"] == str(20 * GIB)
    assert env["GPUSCHED_MEMORY_FRACTION"] == "0.2500"
    assert "expandable_segments" in env["PYTORCH_CUDA_ALLOC_CONF"]
    assert json.loads(env["GPUSCHED_ALLOCATION"])["milli"] == [250]


def test_fraction_on_amd_has_memory_limit_but_no_mps(fleet: FleetSnapshot) -> None:
    env = devices_env([DeviceShare("AMD-amd-0", "amd", 0, 500, 96 * GIB)], fleet)
    assert env["GPUSCHED_MEMORY_LIMIT_BYTES"] == str(96 * GIB)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env


def test_vendor_without_snapshot() -> None:
    env = devices_env(_whole("x", "GPU", 0), vendor="nvidia", models={"GPU-x-0": "T4"})
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert json.loads(env["GPUSCHED_ALLOCATION"])["models"] == ["T4"]


@pytest.mark.parametrize(
    ("shares", "use_fleet", "vendor", "match"),
    [
        ([], True, None, "at least one"),
        (_whole("nv", "GPU", 0), False, None, "vendor"),
        (_whole("nv", "GPU", 0), True, "intel", "unknown vendor"),
        (_whole("nv", "GPU", 0) + _whole("amd", "AMD", 0), True, None, "several vendors"),
        (_whole("gone", "GPU", 0), True, None, "not in the fleet"),
    ],
)
def test_errors_name_problem_and_fix(
    fleet: FleetSnapshot, shares: list[DeviceShare], use_fleet: bool, vendor: str | None, match: str
) -> None:
    with pytest.raises(PlacementError, match=match):
        devices_env(shares, fleet if use_fleet else None, vendor=vendor)


def test_allocation_from_env_round_trip(fleet: FleetSnapshot) -> None:
    env = devices_env(_whole("nv", "GPU", 2), fleet, key="abc")
    assert allocation_from_env(env)["uuids"] == ["GPU-nv-2"]  # type: ignore[index]
    assert allocation_from_env({}) is None
    assert allocation_from_env({"GPUSCHED_ALLOCATION": "not json"}) is None
    assert allocation_from_env({"GPUSCHED_ALLOCATION": "[1]"}) is None
