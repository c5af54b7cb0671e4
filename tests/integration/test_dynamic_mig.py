"""Dynamic MIG (off by default): the pure planner, the local provider on the simulated fleet, the
agent cycle that re-partitions for a waiting hard request, and the NVML provider against
autospecs of the real pynvml functions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pynvml
import pytest
from _placement_support import no_quota

from gpusched.capacity.mig_plan import plan_repartition
from gpusched.errors import ConfigurationError
from gpusched.fleetfile import load_fleet
from gpusched.hardware.mig_provider import LocalMigProvider, NvmlMigProvider, mig_provider_from_spec
from gpusched.hardware.simulated import SimulatedBackend, default_fleet_path
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
    from gpusched.agent.telemetry import TelemetryAgent
    from gpusched.ledger import Ledger

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


# ---- NVML provider -------------------------------------------------------------------------------


@pytest.fixture
def fake_nvml() -> Iterator[dict[str, Any]]:
    """Autospecs of the real pynvml functions the NVML provider calls, over a one-GPU state."""
    state: dict[str, Any] = {"mig": pynvml.NVML_DEVICE_MIG_ENABLE, "created": [], "compute": []}
    profiles = {
        pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: (0, 1, 9728, 14),
        pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: (2, 3, 40192, 42),
        pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: (4, 7, 80896, 98),
    }

    def profile_info(handle: object, profile: int, version: int = 2) -> Any:
        if profile not in profiles:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        pid, slices, mib, sms = profiles[profile]
        return SimpleNamespace(id=pid, sliceCount=slices, memorySizeMB=mib, multiprocessorCount=sms)

    def create_gi(handle: object, profile_id: int) -> Any:
        state["created"].append(profile_id)
        return SimpleNamespace(gi=len(state["created"]))

    def ci_info(gi: object, profile: int, engine: int, version: int = 2) -> Any:
        assert engine == pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        return SimpleNamespace(id=profile)

    impl = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetHandleByUUID": lambda uuid: SimpleNamespace(uuid=uuid),
        "nvmlDeviceGetMigMode": lambda handle: [state["mig"], state["mig"]],
        "nvmlDeviceGetGpuInstanceProfileInfo": profile_info,
        "nvmlDeviceCreateGpuInstance": create_gi,
        "nvmlGpuInstanceGetComputeInstanceProfileInfo": ci_info,
        "nvmlGpuInstanceCreateComputeInstance": lambda gi, pid: state["compute"].append(pid),
    }
    patchers = [mock.patch.object(pynvml, name, autospec=True, side_effect=fn) for name, fn in impl.items()]
    for patcher in patchers:
        patcher.start()
    yield state
    for patcher in patchers:
        patcher.stop()


def test_nvml_provider_creates_gpu_and_compute_instances(fake_nvml: dict[str, Any]) -> None:
    step = MigStep("GPU-1", "h", "A100-SXM-80GB", ("3g.40gb", "3g.40gb"), "test")
    result = NvmlMigProvider().apply([step])
    assert result.applied == ("GPU-1",)
    assert fake_nvml["created"] == [2, 2]  # the 3-slice GPU-instance profile id, twice
    assert fake_nvml["compute"] == [pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE] * 2
    with pytest.raises(TypeError):
        pynvml.nvmlDeviceCreateGpuInstance("GPU-1")  # type: ignore[call-arg]


def test_nvml_provider_never_turns_mig_mode_on(fake_nvml: dict[str, Any]) -> None:
    fake_nvml["mig"] = pynvml.NVML_DEVICE_MIG_DISABLE
    result = NvmlMigProvider().apply([MigStep("GPU-1", "h", "A100-SXM-80GB", ("1g.10gb",), "test")])
    assert result.applied == () and "needs a GPU reset" in result.detail[0]
    assert fake_nvml["created"] == []
