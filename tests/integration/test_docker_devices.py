"""The pure allocation → container mapping (no Docker needed)."""

from __future__ import annotations

import json

import pytest

from gpusched.airflow.docker_devices import container_gpu_spec, shares_from_allocation
from gpusched.catalog import Vendor
from gpusched.errors import ConfigurationError
from gpusched.hardware.envexport import allocation_from_env, devices_env
from gpusched.model import DeviceShare

GIB = 1024**3


def _shares(node: str, *indices: int, milli: int = 1000) -> list[DeviceShare]:
    return [DeviceShare(f"{node}-uuid-{i}", node, i, milli, 16 * GIB) for i in indices]


def test_nvidia_uses_a_device_request_with_the_uuids_and_no_device_nodes() -> None:
    spec = container_gpu_spec(_shares("h1", 5, 2), Vendor.NVIDIA, key="k1")
    assert spec.gpu_device_ids == ("h1-uuid-2", "h1-uuid-5")
    assert spec.devices == ()
    assert spec.environment["CUDA_VISIBLE_DEVICES"] == "h1-uuid-2,h1-uuid-5"
    record = json.loads(spec.environment["GPUSCHED_ALLOCATION"])
    assert record["key"] == "k1" and record["devices"] == [2, 5]
    assert not spec.ipc_host


def test_nvidia_fraction_binds_the_mps_pipe_and_shares_ipc() -> None:
    spec = container_gpu_spec(_shares("h1", 3, milli=250), "nvidia")
    assert spec.ipc_host and spec.bind_mounts == (("/tmp/nvidia-mps", "/tmp/nvidia-mps"),)
    assert spec.environment["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert spec.environment["GPUSCHED_MEMORY_LIMIT_BYTES"] == str(16 * GIB)


def test_amd_maps_kfd_and_render_nodes_and_renumbers_inside() -> None:
    spec = container_gpu_spec(_shares("h1", 1, 3), Vendor.AMD, dev_root="/host/dev")
    assert spec.devices == (
        "/host/dev/kfd:/dev/kfd:rwm",
        "/host/dev/dri/renderD129:/dev/dri/renderD129:rwm",
        "/host/dev/dri/renderD131:/dev/dri/renderD131:rwm",
    )
    assert spec.gpu_device_ids == ()
    assert spec.environment["HIP_VISIBLE_DEVICES"] == "0,1"
    assert spec.environment["ROCR_VISIBLE_DEVICES"] == "0,1"
    assert json.loads(spec.environment["GPUSCHED_ALLOCATION"])["devices"] == [1, 3]  # host view kept


def test_amd_render_node_override() -> None:
    shares = _shares("h1", 0)
    spec = container_gpu_spec(shares, Vendor.AMD, render_nodes={shares[0].uuid: "/dev/dri/renderD140"})
    assert "/dev/dri/renderD140:/dev/dri/renderD140:rwm" in spec.devices


def test_ascend_maps_davinci_and_control_nodes() -> None:
    spec = container_gpu_spec(_shares("h1", 6), Vendor.ASCEND)
    assert spec.devices == (
        "/dev/davinci6:/dev/davinci6:rwm",
        "/dev/davinci_manager:/dev/davinci_manager:rwm",
        "/dev/devmm_svm:/dev/devmm_svm:rwm",
        "/dev/hisi_hdc:/dev/hisi_hdc:rwm",
    )
    assert spec.environment["ASCEND_RT_VISIBLE_DEVICES"] == "0"


def test_dev_root_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSCHED_DEV_ROOT", "/stand-in")
    spec = container_gpu_spec(_shares("h1", 0), Vendor.ASCEND)
    assert spec.devices[0] == "/stand-in/davinci0:/dev/davinci0:rwm"


def test_refuses_multi_host_empty_and_unknown_vendor() -> None:
    with pytest.raises(ConfigurationError, match="one container per host"):
        container_gpu_spec([*_shares("h1", 0), *_shares("h2", 0)], Vendor.NVIDIA)
    with pytest.raises(ConfigurationError, match="no device shares"):
        container_gpu_spec([], Vendor.NVIDIA)
    with pytest.raises(ConfigurationError, match="unknown vendor"):
        container_gpu_spec(_shares("h1", 0), "intel")


def test_round_trip_through_the_exported_allocation() -> None:
    shares = _shares("h7", 4, 0)
    models = {s.uuid: "mi300x" for s in shares}
    env = devices_env(shares, vendor=Vendor.AMD, models=models, key="dag.t.r.1.-1")
    record = allocation_from_env(env)
    assert record is not None
    back, vendor, models = shares_from_allocation(record)
    assert vendor is Vendor.AMD
    assert sorted(back, key=lambda s: s.index) == sorted(shares, key=lambda s: s.index)
    assert set(models.values()) == {"mi300x"}
    with pytest.raises(ConfigurationError, match="not readable"):
        shares_from_allocation({"vendor": "amd"})
