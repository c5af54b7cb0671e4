"""NvidiaBackend against a fake NVML: every pynvml function it calls is replaced by an autospec of
the REAL pynvml function (so a wrong name or arity fails), modelling real 8-GPU boxes."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pynvml
import pytest
from _placement_support import no_quota

from gpusched.catalog import LinkKind, Vendor
from gpusched.errors import BackendUnavailableError, HardwareError
from gpusched.hardware.base import HardwareBackend
from gpusched.hardware.nvidia import NvidiaBackend, catalog_model_name
from gpusched.hardware.topology import HostInfo
from gpusched.model import Health

SOURCE = Path(__file__).resolve().parents[2] / "gpusched" / "hardware" / "nvidia.py"
MIG_SOURCE = SOURCE.with_name("nvidia_mig.py")
HOST = HostInfo(name="dgx-1", rack="r9", labels=(("pool", "training"),), cpu_milli=224_000,
                memory_bytes=2 * 2**40)
GIB = 2**30
H100_BUSES = ["00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0", "00000000:5D:00.0",
              "00000000:9A:00.0", "00000000:AB:00.0", "00000000:BA:00.0", "00000000:DB:00.0"]
SWITCH_BUSES = ["00000000:05:00.0", "00000000:06:00.0", "00000000:07:00.0", "00000000:08:00.0"]


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


@dataclass
class Handle:
    index: int


@dataclass(frozen=True)
class MigHandle:
    """A MIG device handle: MIG slot ``slot`` of GPU ``parent``."""

    parent: int
    slot: int


@dataclass(frozen=True)
class GpuInstanceHandle:
    parent: int
    gi: int


@dataclass(frozen=True)
class MigSlot:
    """One populated MIG slot: its uuid, GPU-instance id and profile id, and its attributes."""

    uuid: str
    gi: int
    profile_id: int
    gpu_slices: int
    compute_slices: int
    memory_mib: int
    sms: int


# A100-SXM4-80GB GPU-instance profiles as NVML reports them: constant -> (id, slices, MiB, SMs).
A100_PROFILES = {
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: (0, 1, 9728, 14),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: (9, 1, 19968, 14),
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: (1, 2, 19968, 28),
    pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: (2, 3, 40192, 42),
    pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE: (3, 4, 40192, 56),
    pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: (4, 7, 80896, 98),
}


@dataclass
class FakeBox:
    """State of a simulated NVML host; link_far_end(i, link) -> remote bus id or None (inactive)."""

    name: str
    buses: list[str]
    memory: int
    capability: tuple[int, int]
    links: int
    link_far_end: Callable[[int, int], str | None]
    numa: list[int]
    uuids: list[str] = field(default_factory=list)
    mig: set[int] = field(default_factory=set)
    ecc: dict[int, int] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)
    xid_events: list[tuple[int, int]] = field(default_factory=list)
    init_error: int | None = None
    no_numa_api: bool = False
    mig_slots: dict[int, dict[int, MigSlot]] = field(default_factory=dict)
    mig_listing_error: int | None = None

    def __post_init__(self) -> None:
        count = len(self.buses)
        self.uuids = self.uuids or [f"GPU-{i:08x}-1111-2222-3333-44445555666{i}" for i in range(count)]

    def check(self, handle: Handle) -> int:
        assert isinstance(handle, Handle), f"a GPU handle was expected, got {handle!r}"
        if handle.index in self.lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return handle.index

    def impl(self) -> dict[str, Callable[..., Any]]:
        def init() -> None:
            if self.init_error is not None:
                raise nvml_error(self.init_error)

        def ancestor(a: Handle, b: Handle) -> int:
            i, j = self.check(a), self.check(b)
            if i // 2 == j // 2:
                return pynvml.NVML_TOPOLOGY_SINGLE
            if self.numa[i] == self.numa[j]:
                return pynvml.NVML_TOPOLOGY_NODE
            return pynvml.NVML_TOPOLOGY_SYSTEM

        def link_state(h: Handle, link: int) -> int:
            i = self.check(h)
            if link >= self.links:
                raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return pynvml.NVML_FEATURE_ENABLED if self.link_far_end(i, link) else pynvml.NVML_FEATURE_DISABLED

        def remote(h: Handle, link: int) -> Any:
            far = self.link_far_end(self.check(h), link)
            return SimpleNamespace(busId=far.encode())

        def numa(h: Handle) -> int:
            if self.no_numa_api:
                raise nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return self.numa[self.check(h)]

        def event_wait(event_set: object, timeout: int) -> Any:
            if not self.xid_events:
                raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)
            index, xid = self.xid_events.pop(0)
            return SimpleNamespace(device=Handle(index), eventType=pynvml.nvmlEventTypeXidCriticalError,
                                   eventData=xid)

        def ecc(h: Handle, error_type: int, counter: int) -> int:
            assert error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
            assert counter == pynvml.NVML_VOLATILE_ECC
            return self.ecc.get(self.check(h), 0)

        def max_mig(h: Handle) -> int:
            if self.mig_listing_error is not None:
                raise nvml_error(self.mig_listing_error)
            return 7 if self.check(h) in self.mig else 0

        def mig_handle(h: Handle, slot: int) -> MigHandle:
            i = self.check(h)
            if i not in self.mig:
                raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if slot not in self.mig_slots.get(i, {}):
                raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
            return MigHandle(i, slot)

        def mig_slot(h: MigHandle) -> MigSlot:
            assert isinstance(h, MigHandle), f"a MIG device handle was expected, got {h!r}"
            return self.mig_slots[h.parent][h.slot]

        def attributes(h: Handle | MigHandle) -> Any:
            if not isinstance(h, MigHandle):  # NVML: only MIG device handles are supported
                raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            m = mig_slot(h)
            return SimpleNamespace(multiprocessorCount=m.sms, gpuInstanceSliceCount=m.gpu_slices,
                                   computeInstanceSliceCount=m.compute_slices, memorySizeMB=m.memory_mib,
                                   sharedCopyEngineCount=1, sharedDecoderCount=0, sharedEncoderCount=0,
                                   sharedJpegCount=0, sharedOfaCount=0)

        def profile_info(h: Handle, profile: int, version: int = 2) -> Any:
            self.check(h)
            if profile not in A100_PROFILES:
                raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            pid, slices, mib, sms = A100_PROFILES[profile]
            return SimpleNamespace(id=pid, sliceCount=slices, memorySizeMB=mib, multiprocessorCount=sms,
                                   instanceCount=7 // slices)

        def gi_by_id(h: Handle, gi: int) -> GpuInstanceHandle:
            i = self.check(h)
            if not any(m.gi == gi for m in self.mig_slots.get(i, {}).values()):
                raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
            return GpuInstanceHandle(i, gi)

        def gi_info(g: GpuInstanceHandle) -> Any:
            slot = next(m for m in self.mig_slots[g.parent].values() if m.gi == g.gi)
            return SimpleNamespace(id=g.gi, profileId=slot.profile_id)

        def uuid(h: Handle | MigHandle) -> str:
            return mig_slot(h).uuid if isinstance(h, MigHandle) else self.uuids[h.index]

        def memory(h: Handle | MigHandle, version: int | None = None) -> Any:
            if isinstance(h, MigHandle):
                total = mig_slot(h).memory_mib * 2**20
                return SimpleNamespace(total=total, used=0, free=total)
            return SimpleNamespace(total=self.memory, used=(self.check(h) + 1) * GIB, free=self.memory - GIB)

        return {
            "nvmlDeviceGetMaxMigDeviceCount": max_mig,
            "nvmlDeviceGetMigDeviceHandleByIndex": mig_handle,
            "nvmlDeviceGetAttributes": attributes,
            "nvmlDeviceGetGpuInstanceProfileInfo": profile_info,
            "nvmlDeviceGetGpuInstanceId": lambda h: mig_slot(h).gi,
            "nvmlDeviceGetGpuInstanceById": gi_by_id,
            "nvmlGpuInstanceGetInfo": gi_info,
            "nvmlInit": init,
            "nvmlShutdown": lambda: None,
            "nvmlDeviceGetCount": lambda: len(self.buses),
            "nvmlSystemGetDriverVersion": lambda: "550.90.07",
            "nvmlDeviceGetHandleByIndex": lambda i: Handle(i),
            "nvmlDeviceGetUUID": uuid,
            "nvmlDeviceGetName": lambda h: self.name,
            "nvmlDeviceGetCudaComputeCapability": lambda h: self.capability,
            "nvmlDeviceGetMemoryInfo": memory,
            "nvmlDeviceGetMigMode": lambda h: [int(h.index in self.mig), int(h.index in self.mig)],
            "nvmlDeviceGetTotalEccErrors": ecc,
            "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=self.buses[self.check(h)].encode()),
            "nvmlDeviceGetNumaNodeId": numa,
            "nvmlDeviceGetTopologyCommonAncestor": ancestor,
            "nvmlDeviceGetNvLinkState": link_state,
            "nvmlDeviceGetNvLinkRemotePciInfo": remote,
            "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=10 * self.check(h), memory=5),
            "nvmlDeviceGetTemperatureV": lambda h, sensor, version=None: 40 + self.check(h),
            "nvmlDeviceGetTemperature": lambda h, sensor: 40 + self.check(h),
            "nvmlDeviceGetPowerUsage": lambda h: 100_000 + 1000 * self.check(h),
            "nvmlEventSetCreate": lambda: "event-set",
            "nvmlDeviceRegisterEvents": lambda h, types, event_set: None,
            "nvmlEventSetWait_v2": event_wait,
            "nvmlEventSetFree": lambda event_set: None,
        }


def hgx_h100() -> FakeBox:
    """DGX H100: 8 GPUs, 18 NVLinks each, every link to one of 4 NVSwitches; 2 NUMA nodes."""
    return FakeBox("NVIDIA H100 80GB HBM3", H100_BUSES, 80 * GIB, (9, 0), 18,
                   lambda i, link: SWITCH_BUSES[link % 4], [0, 0, 0, 0, 1, 1, 1, 1])


def two_island_a100() -> FakeBox:
    """8 A100s wired as two fully connected NVLink quads (direct GPU-to-GPU links, no switch)."""
    buses = [f"0000:{b:02X}:00.0" for b in (0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD)]

    def far(i: int, link: int) -> str | None:
        quad = [q for q in range(4 * (i // 4), 4 * (i // 4) + 4) if q != i]
        return buses[quad[link % 3]] if link < 6 else None  # 2 links per peer, links 6..11 idle

    return FakeBox("NVIDIA A100-SXM4-80GB", buses, 80 * GIB, (8, 0), 12, far, [0, 0, 0, 0, 1, 1, 1, 1])


@pytest.fixture
def patch_nvml() -> Iterator[Callable[[FakeBox], None]]:
    patchers: list[Any] = []

    def install(box: FakeBox) -> None:
        for name, impl in box.impl().items():
            patcher = mock.patch.object(pynvml, name, autospec=True, side_effect=impl)
            patcher.start()
            patchers.append(patcher)

    yield install
    for patcher in patchers:
        patcher.stop()


def test_every_nvml_function_used_exists_in_real_pynvml_and_is_faked() -> None:
    used = set(re.findall(r"nvml\.(nvml\w+)", SOURCE.read_text() + MIG_SOURCE.read_text()))
    assert used, "the backend calls no NVML function?"
    assert [name for name in used if not hasattr(pynvml, name)] == []
    functions = {name for name in used if callable(getattr(pynvml, name))}
    assert len(functions) > 20
    faked = set(hgx_h100().impl())
    assert functions <= faked, functions - faked


def test_autospec_rejects_wrong_arity(patch_nvml: Callable[[FakeBox], None]) -> None:
    patch_nvml(hgx_h100())
    with pytest.raises(TypeError):
        pynvml.nvmlDeviceGetNvLinkState(Handle(0))  # type: ignore[call-arg]


def test_hgx_h100_discovery(patch_nvml: Callable[[FakeBox], None]) -> None:
    box = hgx_h100()
    box.mig = {7}
    patch_nvml(box)
    backend = NvidiaBackend(host=HOST)
    assert isinstance(backend, HardwareBackend)
    (node,) = backend.discover()
    assert (node.name, node.rack, node.labels) == ("dgx-1", "r9", (("pool", "training"),))
    assert len(node.devices) == 8
    first = node.devices[0]
    assert first.uuid == box.uuids[0] and first.index == 0
    assert (first.model, first.vendor, first.architecture) == ("H100-SXM-80GB", Vendor.NVIDIA, "sm_90")
    assert first.memory_bytes == 80 * GIB
    assert [d.numa_node for d in node.devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    switches = [d.pcie_switch for d in node.devices]
    assert switches[0] == switches[1] != switches[2] == switches[3]
    assert len(set(switches)) == 4
    assert {d.island for d in node.devices} == {"dgx-1/nvswitch0"}
    assert all(d.link is LinkKind.NVSWITCH for d in node.devices)
    assert set(first.peers) == set(box.uuids[1:])
    assert [d.mig_enabled for d in node.devices] == [False] * 7 + [True]
    assert all(d.health is Health.HEALTHY for d in node.devices)
    assert {"nvlink", "xid", "topology", "ecc", "power"} <= backend.features
    assert "550.90.07" in backend.description and "8 device" in backend.description
    backend.close()


def test_two_direct_nvlink_islands(patch_nvml: Callable[[FakeBox], None]) -> None:
    box = two_island_a100()
    box.no_numa_api = True  # older driver: NUMA falls back to sysfs (absent here) → -1
    patch_nvml(box)
    (node,) = NvidiaBackend(host=HOST).discover()
    islands = [d.island for d in node.devices]
    assert islands == ["dgx-1/nvlink0"] * 4 + ["dgx-1/nvlink1"] * 4
    assert all(d.link is LinkKind.NVLINK for d in node.devices)
    assert set(node.devices[5].peers) == {box.uuids[4], box.uuids[6], box.uuids[7]}
    assert node.devices[0].model == "A100-SXM-80GB"
    assert all(d.numa_node == -1 for d in node.devices)


def test_features_follow_what_the_gpus_report(patch_nvml: Callable[[FakeBox], None]) -> None:
    box = FakeBox("Tesla T4", ["0000:3b:00.0", "0000:d8:00.0"], 16 * GIB, (7, 5), 0,
                  lambda i, link: None, [0, 1])
    patch_nvml(box)
    pynvml.nvmlDeviceGetMigMode.side_effect = nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)  # type: ignore[attr-defined]
    backend = NvidiaBackend(host=HOST)
    assert "nvlink" not in backend.features and "mig" not in backend.features
    assert {"topology", "power", "ecc", "xid"} <= backend.features
    (node,) = backend.discover()
    assert all(d.island is None and d.link is LinkKind.PCIE and not d.mig_enabled for d in node.devices)
    assert node.devices[0].model == "T4"


def test_samples_read_every_counter_and_drain_xids(patch_nvml: Callable[[FakeBox], None]) -> None:
    box = hgx_h100()
    box.ecc = {2: 4}
    box.xid_events = [(3, 79), (3, 48), (5, 13)]
    patch_nvml(box)
    backend = NvidiaBackend(host=HOST)
    samples = {s.uuid: s for s in backend.sample()}
    assert len(samples) == 8
    s3 = samples[box.uuids[3]]
    assert (s3.utilization_pct, s3.memory_used_bytes, s3.memory_total_bytes) == (30, 4 * GIB, 80 * GIB)
    assert (s3.temperature_mc, s3.power_mw) == (43_000, 103_000)
    assert s3.xid_errors == (79, 48)
    assert samples[box.uuids[5]].xid_errors == (13,)
    assert samples[box.uuids[2]].ecc_uncorrected == 4
    assert all(s.xid_errors == () for s in backend.sample())  # drained: reported once
    health = {d.uuid: d.health for d in backend.discover()[0].devices}
    assert health[box.uuids[2]] is Health.DEGRADED


def test_lost_gpu_is_skipped_in_samples_and_unhealthy(patch_nvml: Callable[[FakeBox], None]) -> None:
    box = hgx_h100()
    patch_nvml(box)
    backend = NvidiaBackend(host=HOST)
    box.lost = {6}
    assert box.uuids[6] not in {s.uuid for s in backend.sample()}
    devices = {d.uuid: d for d in backend.discover()[0].devices}
    assert devices[box.uuids[6]].health is Health.UNHEALTHY
    assert devices[box.uuids[0]].health is Health.HEALTHY
    assert devices[box.uuids[6]].island is None
    assert len(devices[box.uuids[0]].peers) == 6 and box.uuids[6] not in devices[box.uuids[0]].peers


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED])
def test_missing_library_or_driver_is_unavailable(patch_nvml: Callable[[FakeBox], None], code: int) -> None:
    box = hgx_h100()
    box.init_error = code
    patch_nvml(box)
    with pytest.raises(BackendUnavailableError, match="GPUSCHED_BACKEND=simulated"):
        NvidiaBackend(host=HOST)


def test_no_devices_is_unavailable(patch_nvml: Callable[[FakeBox], None]) -> None:
    patch_nvml(FakeBox("x", [], 0, (0, 0), 0, lambda i, link: None, []))
    with pytest.raises(BackendUnavailableError, match="no NVIDIA device"):
        NvidiaBackend(host=HOST)


def test_other_nvml_failures_become_hardware_errors(patch_nvml: Callable[[FakeBox], None]) -> None:
    patch_nvml(hgx_h100())
    backend = NvidiaBackend(host=HOST)
    pynvml.nvmlDeviceGetMemoryInfo.side_effect = nvml_error(pynvml.NVML_ERROR_UNKNOWN)  # type: ignore[attr-defined]
    with pytest.raises(HardwareError, match="nvidia-smi") as info:
        backend.sample()
    assert not isinstance(info.value, BackendUnavailableError)
    assert isinstance(info.value.__cause__, pynvml.NVMLError)


def test_real_nvml_absent_on_this_host_is_unavailable() -> None:
    try:
        backend = NvidiaBackend(host=HOST)
    except BackendUnavailableError:
        return
    backend.close()
    pytest.skip("this host has a real NVIDIA GPU")


@pytest.mark.parametrize(
    ("nvml_name", "model"),
    [("NVIDIA H100 80GB HBM3", "H100-SXM-80GB"), ("NVIDIA H200", "H200-SXM-141GB"), ("Tesla T4", "T4"),
     ("NVIDIA L40S", "L40S"), ("NVIDIA GH200 480GB", "NVIDIA GH200 480GB"), ("AMD Instinct MI300X",
                                                                             "AMD Instinct MI300X")],
)
def test_nvml_names_map_to_catalog(nvml_name: str, model: str) -> None:
    assert catalog_model_name(nvml_name) == model


# ---- MIG -----------------------------------------------------------------------------------------


def mig_a100_box() -> FakeBox:
    """Eight A100-SXM4-80GB; GPU 0 in MIG mode with 3g.40gb + 2g.20gb + 1g.10gb + 1g.10gb in MIG
    slots 0, 1, 2 and 4 (slot 3 empty); the others whole."""
    box = two_island_a100()
    box.mig = {0}
    box.mig_slots = {0: {
        0: MigSlot("MIG-4d5d8a1e-0000-5000-8000-000000000001", 1, 2, 3, 3, 40192, 42),
        1: MigSlot("MIG-4d5d8a1e-0000-5000-8000-000000000002", 2, 1, 2, 2, 19968, 28),
        2: MigSlot("MIG-4d5d8a1e-0000-5000-8000-000000000003", 9, 0, 1, 1, 9728, 14),
        4: MigSlot("MIG-4d5d8a1e-0000-5000-8000-000000000004", 10, 0, 1, 1, 9728, 14),
    }}
    return box


def test_mig_fake_functions_are_autospecs_of_the_real_ones(patch_nvml: Callable[[FakeBox], None]) -> None:
    names = ("nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetGpuInstanceProfileInfo",
             "nvmlDeviceGetMaxMigDeviceCount", "nvmlGpuInstanceGetInfo", "nvmlDeviceGetAttributes",
             "nvmlDeviceGetGpuInstanceById", "nvmlDeviceGetGpuInstanceId")
    real = {name: inspect.signature(getattr(pynvml, name)) for name in names}
    patch_nvml(mig_a100_box())
    assert {name: inspect.signature(getattr(pynvml, name)) for name in names} == real
    with pytest.raises(TypeError):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(Handle(0))  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        pynvml.nvmlDeviceGetGpuInstanceProfileInfo()  # type: ignore[call-arg]


def test_mig_instances_are_discovered_as_isolated_slices(patch_nvml: Callable[[FakeBox], None]) -> None:
    box = mig_a100_box()
    patch_nvml(box)
    (node,) = NvidiaBackend(host=HOST).discover()
    by_uuid = {d.uuid: d for d in node.devices}
    gpu0 = by_uuid[box.uuids[0]]
    assert gpu0.mig_enabled and not gpu0.takes_work and gpu0.parent is None
    slices = [d for d in node.devices if d.parent == gpu0.uuid]
    assert [s.uuid for s in slices] == [m.uuid for _, m in sorted(box.mig_slots[0].items())]
    assert [s.profile for s in slices] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    assert [s.compute_milli for s in slices] == [42 * 1000 // 98, 28 * 1000 // 98, 142, 142]
    assert [s.memory_bytes for s in slices] == [40192 * 2**20, 19968 * 2**20, 9728 * 2**20, 9728 * 2**20]
    assert all(s.island is None and s.peers == () and s.index == 0 and s.model == "A100-SXM-80GB"
               for s in slices)
    assert not any(d.parent for d in node.devices if d.uuid in box.uuids)
    assert len(node.devices) == 8 + 4


def test_mig_listing_failure_leaves_the_gpu_without_instances(patch_nvml: Callable[[FakeBox], None]) -> None:
    box = mig_a100_box()
    box.mig_listing_error = pynvml.NVML_ERROR_NO_PERMISSION
    patch_nvml(box)
    (node,) = NvidiaBackend(host=HOST).discover()
    assert [d.uuid for d in node.devices if d.parent] == []
    assert node.devices[0].mig_enabled  # still takes no work: no instance to run on


def test_hard_fraction_lands_on_a_discovered_mig_instance(patch_nvml: Callable[[FakeBox], None]) -> None:
    from gpusched.hardware.envexport import devices_env
    from gpusched.model import FleetSnapshot
    from gpusched.placement import PendingTask, Policy, place
    from gpusched.request import GPURequest

    box = mig_a100_box()
    patch_nvml(box)
    snapshot = FleetSnapshot(tuple(NvidiaBackend(host=HOST).discover()))
    request = GPURequest.build(gpus=0.1, memory="8GiB", isolation="hard")
    plan = place(no_quota([PendingTask("t", request, 0.0)], snapshot, Policy(), now=0.0))
    (share,) = plan.assignments[0].shares
    assert share.uuid == box.mig_slots[0][2].uuid  # the smallest free instance that holds it
    env = devices_env([share], snapshot)
    assert env["CUDA_VISIBLE_DEVICES"] == share.uuid and env["GPUSCHED_ISOLATION"] == "hard"
