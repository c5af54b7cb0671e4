"""Alert rules: memory growth, over-temperature per vendor, ECC and Xid (pure, over hand-made windows)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpusched.catalog import Vendor
from gpusched.faults.alerts import ActionKind, AlertConfig, evaluate, memory_growth_rate
from gpusched.faults.xid import XidClass, classify_xid
from gpusched.ledger import Allocation
from gpusched.model import Device, DeviceSample, DeviceShare, FleetSnapshot, Health, Node
from gpusched.request import GPURequest

GIB = 2**30
MB = 10**6


def _device(uuid: str, index: int, vendor: Vendor = Vendor.NVIDIA, **kw: object) -> Device:
    model, arch = ("H100-SXM-80GB", "sm_90") if vendor is Vendor.NVIDIA else ("MI300X", "gfx942")
    return replace(Device(uuid, index, "n1", model, vendor, arch, 80 * GIB), **kw)  # type: ignore[arg-type]


def _snapshot(*devices: Device) -> FleetSnapshot:
    return FleetSnapshot((Node("n1", "r1", tuple(devices)),), source="test")


def _alloc(key: str, uuid: str, created_at: float = 0.0) -> Allocation:
    share = DeviceShare(uuid, "n1", 0, 1000, 80 * GIB)
    return Allocation(key, GPURequest.build(gpus=1), (share,), "test", created_at, created_at + 600)


def _samples(uuid: str, memory: list[int], *, temp_c: int = 50, step_s: float = 10.0,
             ecc: int = 0, xids: tuple[int, ...] = ()) -> list[DeviceSample]:
    return [
        DeviceSample(uuid, 100.0 + i * step_s, 90, m, 80 * GIB, temp_c * 1000, 500_000, ecc, xids)
        for i, m in enumerate(memory)
    ]


def test_linear_memory_growth_stops_the_holding_task() -> None:
    # 200 MB/min: +33.3 MB every 10 s for two minutes.
    memory = [10 * GIB + i * 200 * MB // 6 for i in range(13)]
    window = _samples("g0", memory)
    slope, growing = memory_growth_rate(window)
    assert slope == pytest.approx(200 * MB, rel=0.01)
    assert growing == 1.0
    actions = evaluate(window, _snapshot(_device("g0", 0)), [_alloc("airflow/d/t/-1/1/r", "g0")])
    assert [(a.kind, a.rule, a.target) for a in actions] == [
        (ActionKind.STOP_TASK, "memory_growth", "airflow/d/t/-1/1/r")
    ]
    assert actions[0].allocation_key == "airflow/d/t/-1/1/r"
    assert "200 MB/min" in actions[0].reason


def test_model_loading_step_and_slow_growth_do_not_fire() -> None:
    snapshot = _snapshot(_device("g0", 0))
    allocs = [_alloc("k", "g0")]
    step = [1 * GIB] * 6 + [40 * GIB] * 7  # one big allocation at start-up, then flat
    assert evaluate(_samples("g0", step), snapshot, allocs) == []
    slow = [10 * GIB + i * 50 * MB // 6 for i in range(13)]  # 50 MB/min, under the limit
    assert evaluate(_samples("g0", slow), snapshot, allocs) == []
    fast_but_short = [10 * GIB + i * GIB for i in range(3)]  # too few samples for a fit
    assert evaluate(_samples("g0", fast_but_short), snapshot, allocs) == []


def test_growth_before_the_allocation_started_is_ignored() -> None:
    memory = [10 * GIB + i * 200 * MB // 6 for i in range(13)]
    late = _alloc("k", "g0", created_at=100.0 + 10 * 10)  # only the last 3 samples are its own
    assert evaluate(_samples("g0", memory), _snapshot(_device("g0", 0)), [late]) == []


def test_growth_on_a_shared_device_notifies_instead_of_stopping() -> None:
    memory = [10 * GIB + i * 300 * MB // 6 for i in range(13)]
    actions = evaluate(_samples("g0", memory), _snapshot(_device("g0", 0)),
                       [_alloc("a", "g0"), _alloc("b", "g0")])
    assert [a.kind for a in actions] == [ActionKind.NOTIFY]
    assert "a, b" in actions[0].reason


def test_over_temperature_uses_the_vendor_limit_and_needs_consecutive_samples() -> None:
    nv, amd = _device("g0", 0), _device("m0", 1, Vendor.AMD)
    snapshot = _snapshot(nv, amd)
    hot = _samples("g0", [GIB] * 3, temp_c=90) + _samples("m0", [GIB] * 3, temp_c=90)
    actions = evaluate(hot, snapshot)
    assert [(a.kind, a.target, a.health) for a in actions] == [
        (ActionKind.SET_HEALTH, "g0", Health.DEGRADED),
        (ActionKind.CORDON, "g0", None),
    ]  # 90 °C is over NVIDIA's 85 °C default but under AMD's 100 °C
    spike = _samples("g0", [GIB] * 2, temp_c=50) + _samples("g0", [GIB], temp_c=95)[:1]
    spike[-1] = replace(spike[-1], taken_at=130.0)
    assert evaluate(spike, snapshot) == []  # one hot reading is not enough
    strict = AlertConfig(temperature_limits_mc={Vendor.AMD: 80_000, Vendor.NVIDIA: 95_000})
    assert [a.target for a in evaluate(hot, snapshot, config=strict)] == ["m0", "m0"]


def test_uncorrectable_ecc_marks_unhealthy_and_cordons_once() -> None:
    window = _samples("g0", [GIB] * 3, ecc=2)
    actions = evaluate(window, _snapshot(_device("g0", 0)))
    assert [(a.kind, a.rule, a.health) for a in actions] == [
        (ActionKind.SET_HEALTH, "ecc_uncorrected", Health.UNHEALTHY),
        (ActionKind.CORDON, "ecc_uncorrected", None),
    ]
    done = _device("g0", 0, health=Health.UNHEALTHY, cordoned=True)
    assert evaluate(window, _snapshot(done)) == []  # already in effect: nothing repeated


@pytest.mark.parametrize("code", [48, 63, 64, 74, 79, 92, 94, 95])
def test_hardware_xids_cordon_the_device(code: int) -> None:
    assert classify_xid(code) is XidClass.HARDWARE
    actions = evaluate(_samples("g0", [GIB] * 2, xids=(code,)), _snapshot(_device("g0", 0)))
    assert {(a.kind, a.rule) for a in actions} == {
        (ActionKind.SET_HEALTH, "xid_hardware"), (ActionKind.CORDON, "xid_hardware"),
    }
    assert actions[0].health is Health.UNHEALTHY


@pytest.mark.parametrize("code", [13, 31, 43])
def test_application_xids_only_notify_naming_the_task(code: int) -> None:
    assert classify_xid(code) is XidClass.APPLICATION
    actions = evaluate(_samples("g0", [GIB] * 2, xids=(code,)), _snapshot(_device("g0", 0)),
                       [_alloc("airflow/d/t/-1/1/r", "g0")])
    assert [(a.kind, a.rule, a.allocation_key) for a in actions] == [
        (ActionKind.NOTIFY, "xid_application", "airflow/d/t/-1/1/r")
    ]
    assert classify_xid(999) is XidClass.UNKNOWN


def test_memory_held_with_no_allocation_cordons_the_device() -> None:
    snapshot = _snapshot(_device("g0", 0))
    zombie = _samples("g0", [78 * GIB] * 14)  # 130 s at 98 %, nobody holds the device
    actions = evaluate(zombie, snapshot)
    assert [(a.kind, a.rule, a.health) for a in actions] == [
        (ActionKind.SET_HEALTH, "orphan_memory", Health.DEGRADED),
        (ActionKind.CORDON, "orphan_memory", None),
    ]
    assert "98%" in actions[0].reason
    assert evaluate(zombie, snapshot, [_alloc("k", "g0")]) == []  # a task holds it: its memory
    assert evaluate(zombie[-6:], snapshot) == []  # 50 s: too short to tell
