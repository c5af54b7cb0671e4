"""Dynamic MIG (off by default): the pure planner, the local provider on the simulated fleet, the
agent cycle that re-partitions for a waiting hard request, and the NVML provider against
autospecs of the real pynvml functions."""

from __future__ import annotations

import ctypes
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar
from unittest import mock

import pynvml
import pytest
from _placement_support import no_quota

from gpusched.agent.telemetry import TelemetryAgent
from gpusched.capacity.mig_plan import plan_repartition
from gpusched.errors import ConfigurationError, HardwareError
from gpusched.fleetfile import load_fleet
from gpusched.hardware.mig_provider import (
    LocalMigProvider,
    MigResult,
    NvmlMigProvider,
    mig_provider_from_spec,
)
from gpusched.hardware.simulated import SimulatedBackend, default_fleet_path
from gpusched.ledger import Ledger
from gpusched.model import DeviceShare, FleetSnapshot, MigStep
from gpusched.placement import PendingTask, Policy, place
from gpusched.request import GPURequest

MIG_GPU = "GPU-sim-a-a100mig-1-0"
WHOLE_GPU = "GPU-sim-a-a100mig-1-1"


@pytest.fixture
def busy_slices() -> FleetSnapshot:
    """The default fleet with every MIG instance of the MIG A100 taken."""
    fleet = FleetSnapshot(tuple(load_fleet(default_fleet_path())))
    slices = [d for d in fleet.devices() if d.parent == MIG_GPU]
    return fleet.with_usage([DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes) for d in slices])


def test_off_by_default_and_bad_values_name_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUSCHED_DYNAMIC_MIG", raising=False)
    assert mig_provider_from_spec() is None
    assert isinstance(mig_provider_from_spec("local"), LocalMigProvider)
    with pytest.raises(ConfigurationError, match=r"GPUSCHED_DYNAMIC_MIG 'reset'.*off, local, nvml"):
        mig_provider_from_spec("reset")


def test_planner_repartitions_an_idle_gpu_outside_islands(busy_slices: FleetSnapshot) -> None:
    request = GPURequest.build(gpus=0.3, memory="30GiB", isolation="hard", model="A100")
    (step,) = plan_repartition(busy_slices, [request, request])  # the second fits the new layout too
    assert step.gpu == WHOLE_GPU and step.layout == ("3g.40gb", "3g.40gb")
    assert "waiting hard-isolated" in step.reason


def test_planner_leaves_the_fleet_alone_when_nothing_needs_it(busy_slices: FleetSnapshot) -> None:
    fresh = FleetSnapshot(busy_slices.nodes)
    hard = GPURequest.build(gpus=0.1, memory="8GiB", isolation="hard", model="A100")
    assert plan_repartition(fresh, [hard]) == ()  # a free 1g.10gb instance holds it
    soft = GPURequest.build(gpus=0.1, memory="8GiB", isolation="soft", model="A100")
    assert plan_repartition(busy_slices, [soft]) == ()
    busy = busy_slices.with_usage(
        [
            DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes)
            for d in busy_slices.devices()
            if d.model == "A100-SXM-80GB" and d.takes_work and d.parent is None
        ]
    )
    assert plan_repartition(busy, [hard]) == ()  # busy GPUs are never touched


def test_local_provider_changes_the_simulated_fleet(tmp_path: Path, busy_slices: FleetSnapshot) -> None:
    provider = LocalMigProvider(tmp_path / "mig_layouts.json")
    step = MigStep(WHOLE_GPU, "a-a100mig-1", "A100-SXM-80GB", ("3g.40gb", "3g.40gb"), "test")
    result = provider.apply([step])
    assert result.applied == (WHOLE_GPU,)
    nodes = SimulatedBackend(default_fleet_path(), state_folder=tmp_path).discover()
    devices = {d.uuid: d for n in nodes for d in n.devices}
    assert devices[WHOLE_GPU].mig_enabled
    assert [d.profile for d in devices.values() if d.parent == WHOLE_GPU] == ["3g.40gb", "3g.40gb"]
    provider.apply([MigStep(WHOLE_GPU, "a-a100mig-1", "A100-SXM-80GB", (), "MIG off")])
    nodes = SimulatedBackend(default_fleet_path(), state_folder=tmp_path).discover()
    devices = {d.uuid: d for n in nodes for d in n.devices}
    assert not devices[WHOLE_GPU].mig_enabled and not any(d.parent == WHOLE_GPU for d in devices.values())


def test_agent_cycle_repartitions_for_a_waiting_hard_request(tmp_path: Path) -> None:
    backend = SimulatedBackend(default_fleet_path(), state_folder=tmp_path)
    with Ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        ledger.migrate()
        ledger.sync_inventory(backend.discover(), "simulated")
        snapshot = ledger.snapshot()
        for d in snapshot.devices():  # every existing slice busy
            if d.parent is not None:
                request = GPURequest.build(gpus=0.1, memory="1GiB", isolation="hard")
                share = DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes)
                ledger.allocate(f"busy-{d.uuid}", request, [share], holder="test", lease_s=3600)
        waiting = GPURequest.build(gpus=0.3, memory="30GiB", isolation="hard", model="A100")
        ledger.record_queue("serve", waiting, "no free MIG instance", now=0.0)
        agent = TelemetryAgent(backend, ledger, mig_provider=LocalMigProvider(tmp_path / "mig_layouts.json"))
        agent.cycle()
        after = ledger.snapshot()
        new = [d for d in after.devices() if d.parent == WHOLE_GPU]
        assert [d.profile for d in new] == ["3g.40gb", "3g.40gb"]
        assert [e.subject for e in ledger.events(kinds=["mig_repartition"])] == [WHOLE_GPU]
        plan = place(no_quota([PendingTask("serve", waiting, 0.0)], after, Policy(), now=0.0))
        assert after.device(plan.assignments[0].shares[0].uuid).parent == WHOLE_GPU
        agent.cycle()  # nothing waits for a slice it cannot get now: no second re-partition
        assert len(ledger.events(kinds=["mig_repartition"])) == 1


def _busy_fleet_with_a_waiting_hard_request(ledger: Ledger, backend: SimulatedBackend) -> GPURequest:
    ledger.migrate()
    ledger.sync_inventory(backend.discover(), "simulated")
    for d in ledger.snapshot().devices():  # every existing slice busy
        if d.parent is not None:
            request = GPURequest.build(gpus=0.1, memory="1GiB", isolation="hard")
            share = DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes)
            ledger.allocate(f"busy-{d.uuid}", request, [share], holder="test", lease_s=10**9)
    waiting = GPURequest.build(gpus=0.3, memory="30GiB", isolation="hard", model="A100")
    ledger.record_queue("serve", waiting, "no free MIG instance", now=0.0)
    return waiting


class _BrokenProvider:
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def apply(self, steps: Sequence[MigStep], held: Collection[str] = ()) -> MigResult:
        self.calls += 1
        raise HardwareError("NVML cannot start (driver gone)")


def test_a_failed_repartition_is_reported_and_the_agent_cycle_goes_on(tmp_path: Path) -> None:
    backend = SimulatedBackend(default_fleet_path(), state_folder=tmp_path)
    with Ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        _busy_fleet_with_a_waiting_hard_request(ledger, backend)
        provider = _BrokenProvider()
        agent = TelemetryAgent(backend, ledger, mig_provider=provider)
        result = agent.cycle(now=100.0)  # the first cycle: it used to end the agent
        assert result.samples and agent.metrics_text()  # sampling and metrics went on
        (event,) = ledger.events(kinds=["mig_repartition_failed"])
        assert event.subject == WHOLE_GPU and event.detail["layout"] == ["3g.40gb", "3g.40gb"]
        line = event.detail["detail"]
        assert "driver gone" in line and "GPUSCHED_DYNAMIC_MIG=off" in line
        agent.cycle(now=160.0)  # not tried again at once
        assert provider.calls == 1
        agent.cycle(now=100.0 + agent.MIG_RETRY_S)
        assert provider.calls == 2 and len(ledger.events(kinds=["mig_repartition_failed"])) == 2


def test_the_agent_hands_the_provider_the_held_instances_and_only_its_own_gpus(tmp_path: Path) -> None:
    backend = SimulatedBackend(default_fleet_path(), state_folder=tmp_path)
    seen: list[tuple[list[str], frozenset[str]]] = []

    class Recording:
        name = "recording"

        def apply(self, steps: Sequence[MigStep], held: Collection[str] = ()) -> MigResult:
            seen.append(([s.gpu for s in steps], frozenset(held)))
            return MigResult(self.name, (), ())

    with Ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        _busy_fleet_with_a_waiting_hard_request(ledger, backend)
        agent = TelemetryAgent(backend, ledger, mig_provider=Recording())
        agent.cycle(now=100.0)
        ((gpus, held),) = seen
        assert gpus == [WHOLE_GPU] and any(uuid.startswith("MIG-") for uuid in held)
        agent._own_nodes = frozenset({"another-host-node"})  # the step's GPU is another agent's
        agent.repartition(200.0)
        assert len(seen) == 1
        agent._own_nodes = None
        agent.repartition(300.0)  # the provider skipped the step (nothing applied): not at once again
        assert len(seen) == 1
        agent.repartition(100.0 + agent.MIG_RETRY_S)
        assert len(seen) == 2


# ---- NVML provider -------------------------------------------------------------------------------


class FakeMigGpu:
    """One A100 in MIG mode as NVML shows it: GPU instances (each with compute instances) behind
    opaque ctypes handles, the MIG devices CUDA sees, and NVML's rules (a GPU instance with compute
    instances left cannot be destroyed; at most 7 GPU slices; a busy instance is IN_USE)."""

    # GPU-instance profile constant -> (profile id, slices, MiB, SMs)
    PROFILES: ClassVar[dict[int, tuple[int, int, int, int]]] = {
        pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: (19, 1, 9728, 14),
        pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: (14, 2, 19968, 28),
        pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: (9, 3, 40192, 42),
        pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: (0, 7, 80896, 98),
    }
    CI_SLICES: ClassVar[dict[int, int]] = {
        pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE: 1,
        pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE: 2,
        pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE: 3,
        pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE: 7,
    }

    def __init__(self) -> None:
        self.mig = pynvml.NVML_DEVICE_MIG_ENABLE
        self.gis: dict[int, dict[str, Any]] = {}  # handle address -> {id, profile, slices, cis}
        self.next_address = 0x1000
        self.busy: set[int] = set()  # GPU-instance ids a process outside gpusched runs on
        self.calls: list[str] = []

    def _address(self) -> int:
        self.next_address += 0x10
        return self.next_address

    def add(self, profile_id: int, with_ci: bool = True) -> int:
        """A GPU instance of ``profile_id`` (with one full compute instance): its id."""
        slices = next(s for pid, s, _, _ in self.PROFILES.values() if pid == profile_id)
        gi_id = max((g["id"] for g in self.gis.values()), default=0) + 1
        cis = [{"address": self._address(), "slices": slices}] if with_ci else []
        self.gis[self._address()] = {"id": gi_id, "profile": profile_id, "slices": slices, "cis": cis}
        return gi_id

    def layout(self) -> list[tuple[int, int]]:
        """(slices, compute instances) of every GPU instance."""
        return sorted((g["slices"], len(g["cis"])) for g in self.gis.values())

    @staticmethod
    def _key(handle: Any) -> int:
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)

    def _gi(self, handle: Any) -> dict[str, Any]:
        gi = self.gis.get(self._key(handle))
        if gi is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gi

    def _mig_devices(self) -> list[dict[str, Any]]:
        return [g for g in sorted(self.gis.values(), key=lambda g: g["id"]) if g["cis"]]

    def impl(self) -> dict[str, Any]:
        def profile_info(handle: object, profile: int, version: int = 2) -> Any:
            if profile not in self.PROFILES:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            pid, slices, mib, sms = self.PROFILES[profile]
            return SimpleNamespace(id=pid, sliceCount=slices, memorySizeMB=mib, multiprocessorCount=sms,
                                   instanceCount=7 // slices)

        def get_gis(handle: object, profile_id: int, array: Any, count_ref: Any) -> int:
            found = [a for a, g in self.gis.items() if g["profile"] == profile_id]
            for i, address in enumerate(found):
                array[i] = ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlGpuInstance_t)
            count_ref._obj.value = len(found)
            return pynvml.NVML_SUCCESS

        def create_gi(handle: object, profile_id: int) -> Any:
            slices = next(s for pid, s, _, _ in self.PROFILES.values() if pid == profile_id)
            if sum(g["slices"] for g in self.gis.values()) + slices > 7:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            self.calls.append(f"create gi {profile_id}")
            gi_id = max((g["id"] for g in self.gis.values()), default=0) + 1
            address = self._address()
            self.gis[address] = {"id": gi_id, "profile": profile_id, "slices": slices, "cis": []}
            return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlGpuInstance_t)

        def destroy_gi(handle: Any) -> int:
            gi = self._gi(handle)
            if gi["cis"]:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_IN_USE)  # NVML: compute instances first
            self.calls.append(f"destroy gi {gi['id']}")
            del self.gis[self._key(handle)]
            return pynvml.NVML_SUCCESS

        def ci_info(gi_handle: Any, profile: int, engine: int, version: int = 2) -> Any:
            assert engine == pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            gi = self._gi(gi_handle)
            slices = self.CI_SLICES.get(profile)
            if slices is None or slices > gi["slices"]:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return SimpleNamespace(id=profile, sliceCount=slices, instanceCount=gi["slices"] // slices)

        def get_cis(gi_handle: Any, profile_id: int, array: Any, count_ref: Any) -> int:
            gi = self._gi(gi_handle)
            found = [c for c in gi["cis"] if c["slices"] == self.CI_SLICES[profile_id]]
            for i, ci in enumerate(found):
                array[i] = ctypes.cast(ctypes.c_void_p(ci["address"]), pynvml.c_nvmlComputeInstance_t)
            count_ref._obj.value = len(found)
            return pynvml.NVML_SUCCESS

        def create_ci(gi_handle: Any, profile_id: int) -> Any:
            gi = self._gi(gi_handle)
            self.calls.append(f"create ci {profile_id} in gi {gi['id']}")
            address = self._address()
            gi["cis"].append({"address": address, "slices": self.CI_SLICES[profile_id]})
            return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlComputeInstance_t)

        def destroy_ci(ci_handle: Any) -> int:
            key = self._key(ci_handle)
            for gi in self.gis.values():
                for ci in gi["cis"]:
                    if ci["address"] == key:
                        if gi["id"] in self.busy:
                            raise pynvml.NVMLError(pynvml.NVML_ERROR_IN_USE)
                        self.calls.append(f"destroy ci in gi {gi['id']}")
                        gi["cis"].remove(ci)
                        return pynvml.NVML_SUCCESS
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

        def mig_handle(handle: object, index: int) -> Any:
            devices = self._mig_devices()
            if index >= len(devices):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
            return SimpleNamespace(gi=devices[index]["id"])

        return {
            "nvmlInit": lambda: None,
            "nvmlShutdown": lambda: None,
            "nvmlDeviceGetHandleByUUID": lambda uuid: SimpleNamespace(uuid=uuid),
            "nvmlDeviceGetMigMode": lambda handle: [self.mig, self.mig],
            "nvmlDeviceGetGpuInstanceProfileInfo": profile_info,
            "nvmlDeviceGetGpuInstances": get_gis,
            "nvmlDeviceCreateGpuInstance": create_gi,
            "nvmlGpuInstanceDestroy": destroy_gi,
            "nvmlGpuInstanceGetComputeInstanceProfileInfo": ci_info,
            "nvmlGpuInstanceGetComputeInstances": get_cis,
            "nvmlGpuInstanceCreateComputeInstance": create_ci,
            "nvmlComputeInstanceDestroy": destroy_ci,
            "nvmlDeviceGetMaxMigDeviceCount": lambda handle: 7,
            "nvmlDeviceGetMigDeviceHandleByIndex": mig_handle,
            "nvmlDeviceGetUUID": lambda mig: f"MIG-fake-{mig.gi}",
            "nvmlDeviceGetGpuInstanceId": lambda mig: mig.gi,
        }


@pytest.fixture
def fake_nvml() -> Iterator[FakeMigGpu]:
    """Autospecs of the real pynvml functions the NVML provider calls, over one fake MIG GPU."""
    gpu = FakeMigGpu()
    patchers = [
        mock.patch.object(pynvml, name, autospec=True, side_effect=fn) for name, fn in gpu.impl().items()
    ]
    for patcher in patchers:
        patcher.start()
    yield gpu
    for patcher in patchers:
        patcher.stop()


def test_nvml_provider_creates_gpu_and_compute_instances(fake_nvml: FakeMigGpu) -> None:
    step = MigStep("GPU-1", "h", "A100-SXM-80GB", ("3g.40gb", "3g.40gb"), "test")
    result = NvmlMigProvider().apply([step])
    assert result.applied == ("GPU-1",) and result.failed == ()
    assert fake_nvml.layout() == [(3, 1), (3, 1)]  # two 3-slice GPU instances, one compute instance each
    assert fake_nvml.calls.count("create gi 9") == 2
    with pytest.raises(TypeError):
        pynvml.nvmlDeviceCreateGpuInstance("GPU-1")


def test_nvml_provider_destroys_the_unused_instances_first(fake_nvml: FakeMigGpu) -> None:
    for _ in range(6):
        fake_nvml.add(19)  # six 1g.10gb instances, all free
    fake_nvml.add(19, with_ci=False)  # a leftover GPU instance without a compute instance
    step = MigStep("GPU-1", "h", "A100-SXM-80GB", ("3g.40gb", "3g.40gb"), "test")
    result = NvmlMigProvider().apply([step], held={"MIG-elsewhere"})
    assert result.applied == ("GPU-1",), result.detail
    assert "destroyed 7 unused GPU instance(s), created 3g.40gb + 3g.40gb" in result.detail[0]
    assert fake_nvml.layout() == [(3, 1), (3, 1)]
    first_create = fake_nvml.calls.index("create gi 9")
    assert all(c.startswith("destroy") for c in fake_nvml.calls[:first_create])
    assert len([c for c in fake_nvml.calls if c.startswith("destroy gi")]) == 7


def test_nvml_provider_never_touches_a_gpu_with_a_held_instance(fake_nvml: FakeMigGpu) -> None:
    fake_nvml.add(19)
    held = fake_nvml.add(19)
    step = MigStep("GPU-1", "h", "A100-SXM-80GB", ("3g.40gb",), "test")
    result = NvmlMigProvider().apply([step], held={f"MIG-fake-{held}"})
    assert result.applied == () and result.failed == ()
    assert f"MIG-fake-{held} is held by a task" in result.detail[0]
    assert fake_nvml.calls == [] and fake_nvml.layout() == [(1, 1), (1, 1)]


def test_nvml_provider_reports_a_failed_step_with_the_fix_and_goes_on(fake_nvml: FakeMigGpu) -> None:
    fake_nvml.busy.add(fake_nvml.add(19))  # a process gpusched does not know runs there
    steps = [MigStep("GPU-1", "h", "A100-SXM-80GB", ("3g.40gb",), "test"),
             MigStep("GPU-2", "h", "A100-SXM-80GB", ("3g.40gb",), "test")]
    result = NvmlMigProvider().apply(steps)
    assert result.failed == ("GPU-1", "GPU-2")  # the fake's two GPUs are one: the same busy instance
    assert "GPU-1 on h: re-partitioning into 3g.40gb failed" in result.detail[0]
    assert "nvidia-smi mig -lgi" in result.detail[0] and "GPUSCHED_DYNAMIC_MIG=off" in result.detail[0]


def test_nvml_provider_never_turns_mig_mode_on(fake_nvml: FakeMigGpu) -> None:
    fake_nvml.mig = pynvml.NVML_DEVICE_MIG_DISABLE
    result = NvmlMigProvider().apply([MigStep("GPU-1", "h", "A100-SXM-80GB", ("1g.10gb",), "test")])
    assert result.applied == () and "needs a GPU reset" in result.detail[0]
    assert fake_nvml.calls == []
