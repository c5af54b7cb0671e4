"""The simulated backend: discovery, plausible samples, load, and fault injection that persists."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpusched.errors import HardwareError
from gpusched.hardware.base import HardwareBackend
from gpusched.hardware.simulated import SimulatedBackend, default_fleet_path
from gpusched.model import Health

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "gpusched" / "include" / "fleets" / "small.yaml"
A100 = "GPU-sim-n1-0"
T4 = "GPU-sim-n2-1"


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _backend(clock: Clock | None = None) -> SimulatedBackend:
    return SimulatedBackend(SMALL, clock=clock or Clock())


def test_is_a_hardware_backend_that_says_it_is_simulated() -> None:
    backend = _backend()
    assert isinstance(backend, HardwareBackend)
    assert backend.name == "simulated"
    assert backend.description == "simulated fleet (include/fleets/small.yaml)"
    assert {"fault_injection", "topology", "simulated"} <= backend.features


def test_discover_matches_the_fleet_file_and_is_healthy() -> None:
    nodes = _backend().discover()
    assert [n.name for n in nodes] == ["n1", "n2", "n5", "n3", "n4"]
    assert all(d.health is Health.HEALTHY for n in nodes for d in n.devices)


def test_idle_samples_are_plausible_and_skip_standby_nodes() -> None:
    samples = {s.uuid: s for s in _backend().sample()}
    assert len(samples) == 10  # 12 devices, 2 on the standby node n5
    assert not any(uuid.startswith("GPU-sim-n5-") for uuid in samples)
    a100 = samples[A100]
    assert a100.utilization_pct == 0
    assert a100.memory_total_bytes == 80 * 2**30
    assert 0 < a100.memory_used_bytes < a100.memory_total_bytes // 50
    assert 25_000 <= a100.temperature_mc <= 45_000
    assert 0 < a100.power_mw < 400_000 // 4
    assert a100.ecc_uncorrected == 0 and a100.xid_errors == ()


def test_samples_repeat_within_a_window_and_follow_load() -> None:
    clock = Clock()
    backend = _backend(clock)
    assert backend.sample() == backend.sample()
    backend.set_load(A100, 90, 60 * 2**30)
    busy = {s.uuid: s for s in backend.sample()}[A100]
    assert 88 <= busy.utilization_pct <= 92
    assert busy.memory_used_bytes == 60 * 2**30
    assert busy.temperature_mc > 65_000 and busy.power_mw > 300_000
    backend.set_load(A100, 0, 0)
    assert {s.uuid: s for s in backend.sample()}[A100].utilization_pct == 0
    with pytest.raises(HardwareError, match="0–100"):
        backend.set_load(A100, 150, 0)


@pytest.mark.parametrize(
    ("kind", "code", "health"),
    [
        ("xid", None, Health.UNHEALTHY),  # default 79: fallen off the bus
        ("xid", 13, Health.DEGRADED),  # graphics engine exception: often the program's fault
        ("ecc", 2, Health.UNHEALTHY),
        ("overtemp", None, Health.DEGRADED),
        ("memory_leak", None, Health.DEGRADED),
        ("lost", None, Health.UNHEALTHY),
    ],
)
def test_each_fault_kind_shows_in_health_and_samples(kind: str, code: int | None, health: Health) -> None:
    backend = _backend()
    backend.inject_fault(A100, kind, code=code)
    device = next(d for n in backend.discover() for d in n.devices if d.uuid == A100)
    assert device.health is health
    samples = {s.uuid: s for s in backend.sample()}
    if kind == "lost":
        assert A100 not in samples
        return
    sample = samples[A100]
    if kind == "xid":
        assert sample.xid_errors == ((code or 79),)
    elif kind == "ecc":
        assert sample.ecc_uncorrected == 2
    elif kind == "overtemp":
        assert sample.temperature_mc >= 95_000
    elif kind == "memory_leak":
        assert sample.memory_used_bytes >= sample.memory_total_bytes * 97 // 100
    others = [d for n in backend.discover() for d in n.devices if d.uuid != A100]
    assert all(d.health is Health.HEALTHY for d in others)


def test_faults_persist_across_backend_instances_and_clear() -> None:
    first = _backend()
    second = _backend()
    first.inject_fault(A100, "xid", code=48)
    first.inject_fault(T4, "overtemp")
    assert [f.kind for f in second.faults()[A100]] == ["xid"]
    assert {s.uuid: s for s in second.sample()}[A100].xid_errors == (48,)
    assert second.clear_faults(A100) == 1
    assert A100 not in first.faults() and T4 in first.faults()
    assert first.clear_faults() == 1
    assert second.faults() == {}


def test_faults_are_seen_by_another_process(tmp_path: Path) -> None:
    _backend().inject_fault(T4, "ecc", code=3)
    code = (
        "from gpusched.hardware.simulated import SimulatedBackend;"
        f"b = SimulatedBackend({str(SMALL)!r});"
        f"print({{s.uuid: s.ecc_uncorrected for s in b.sample()}}[{T4!r}]);"
        f"b.inject_fault({A100!r}, 'lost')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ), cwd=ROOT)
    assert out.stdout.strip() == "3"
    assert A100 not in {s.uuid for s in _backend().sample()}


def test_bad_uuid_and_kind_are_explained() -> None:
    backend = _backend()
    with pytest.raises(HardwareError, match=r"no device 'GPU-nope'.*gpusched inventory"):
        backend.inject_fault("GPU-nope", "xid")
    with pytest.raises(HardwareError, match=r"unknown fault kind 'melt'.*xid, ecc, overtemp, memory_leak"):
        backend.inject_fault(A100, "melt")
    with pytest.raises(HardwareError, match="no device"):
        backend.clear_faults("GPU-nope")


def test_corrupt_state_file_is_reported_with_the_fix() -> None:
    backend = _backend()
    backend.store.folder.mkdir(parents=True, exist_ok=True)
    backend.store.faults_path.write_text("{not json")
    with pytest.raises(HardwareError, match="delete the file to reset it"):
        backend.sample()


def test_standby_node_switched_on_by_the_local_scaler_is_discovered_active(tmp_path: Path) -> None:
    from gpusched.capacity.scaling import LocalFleetScaler, ScalingPlan

    backend = SimulatedBackend(default_fleet_path(), state_folder=tmp_path)
    standby = [n.name for n in backend.discover() if n.standby]
    assert standby, "the default fleet has a standby node"
    sampled = {s.uuid for s in backend.sample()}
    assert not any(d.uuid in sampled for n in backend.discover() if n.standby for d in n.devices)

    plan = ScalingPlan(
        created_at=0.0, provisioning_delay_s=900, active_gpus=40, target_gpus=48,
        activate=(standby[0],), surplus_gpus=0, burst_reserve_gpus=0, steps=(), model="test",
        reason="scale out for the test",
    )
    LocalFleetScaler(tmp_path / "scaling.json").apply(plan)

    # a fresh backend in another process would see the same state file
    again = SimulatedBackend(default_fleet_path(), state_folder=tmp_path)
    node = next(n for n in again.discover() if n.name == standby[0])
    assert not node.standby
    sampled = {s.uuid for s in again.sample()}
    assert {d.uuid for d in node.devices} <= sampled
