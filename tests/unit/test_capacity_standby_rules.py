"""The standby rules both drivers run: reactive scale-out, scale-in, the burst reserve — and proof
that the pre-scaling simulation decides with them (the agent's side: tests/integration)."""

from __future__ import annotations

from typing import Any

import pytest

from gpusched.capacity.prescale import SnapshotView, standby_for_waiting
from gpusched.capacity.standby_rules import (
    ScaleIn,
    SwitchedOn,
    WaitingTask,
    reactive_scale_out,
    scale_in,
    usable_gpus,
)
from gpusched.catalog import default_catalog
from gpusched.model import Device, DeviceUsage, FleetSnapshot, Node
from gpusched.request import GPURequest, Partition
from gpusched.sim import prescale as sim_prescale
from gpusched.sim.prescale import PoolView, PrescaleConfig, generate_jobs, simulate_prescale

SMALL = PrescaleConfig(warmup_days=2, measure_days=2, model="seasonal_naive", refit_every_s=24 * 3600)


def _task(key: str, gpus: int, since: float = 0.0) -> WaitingTask:
    return WaitingTask(key, GPURequest(count=gpus), since)


def _pool(free: int, standby: tuple[str, ...] = ("s0", "s1", "s2")) -> PoolView:
    return PoolView(free, standby, 8)


def test_waiting_work_takes_its_room_so_a_burst_gets_enough_nodes() -> None:
    burst = [_task(f"j{i}", 2, since=float(i)) for i in range(5)]  # 10 GPUs, nothing free
    decision = reactive_scale_out(burst, _pool(0), now=60.0, threshold_s=0.0)
    assert decision.activate == ("s0", "s1")
    assert decision.reasons[0] == "j0 waited 60 s for 2 GPU(s) that standby node s0 gives; activating it"
    # 8 GPUs already being provisioned cover 8 of the 10: one more node.
    coming = reactive_scale_out(burst, _pool(0), now=60.0, threshold_s=0.0, coming=_pool(8))
    assert coming.activate == ("s0",)
    # A job that fits the fleet as it is waits for something else: left alone.
    assert reactive_scale_out([_task("small", 2)], _pool(4), now=60.0, threshold_s=0.0).activate == ()
    # Not waited long enough; no standby node left.
    assert reactive_scale_out(burst, _pool(0), now=60.0, threshold_s=120.0).activate == ()
    assert reactive_scale_out(burst, _pool(0, ()), now=60.0, threshold_s=0.0).activate == ()


def _a100_node(name: str, gpus: int, *, standby: bool) -> Node:
    model = default_catalog().get("A100-SXM-80GB")
    devices = tuple(Device(f"{name}-{i}", i, name, model.name, model.vendor, model.architecture,
                           model.memory_bytes) for i in range(gpus))
    return Node(name, "r0", devices, standby=standby)


def test_the_agent_side_switches_on_one_standby_node_per_task_that_needs_one() -> None:
    """Before: the second 8-GPU task was offered the node switched on for the first, so one node
    came on per agent cycle."""
    busy = _a100_node("on", 8, standby=False)
    fleet = FleetSnapshot((busy, _a100_node("s0", 8, standby=True), _a100_node("s1", 8, standby=True)),
                          {d.uuid: DeviceUsage(1000, d.memory_bytes) for d in busy.devices})
    want = GPURequest.build(gpus=8, interconnect="same_node")
    waiting = [WaitingTask("first", want, 0.0), WaitingTask("second", want, 10.0)]
    assert standby_for_waiting(waiting, fleet, now=600.0, threshold_s=300.0).activate == ("s0", "s1")
    view = SnapshotView(fleet).switch_on(["s0"])
    assert view.holds(want) and not view.take(want).holds(want)


def test_scale_in_keeps_waiting_work_the_reserve_and_the_plan() -> None:
    nodes = [SwitchedOn("s0", 8, 0.0), SwitchedOn("s1", 8, 1000.0), SwitchedOn("busy", 8, None)]
    common: dict[str, Any] = {"now": 2000.0, "cool_down_s": 1800.0, "active_gpus": 40}
    released = scale_in(nodes, free_gpus=24, **common)
    assert released.release == ("s0",)  # s1 idle 1000 s only, busy is busy
    assert released.reasons == ("standby node s0 idle 33 min (cool-down 30 min); back to standby",)
    assert scale_in(nodes, free_gpus=24, waiting=True, **common) == ScaleIn((), ())
    assert scale_in(nodes, free_gpus=12, reserve_gpus=8, **common).release == ()  # 4 left < reserve 8
    assert scale_in(nodes, free_gpus=24, keep_gpus=36, **common).release == ()  # 32 active < 36 wanted
    later = scale_in(nodes, free_gpus=24, **(common | {"now": 3000.0}))
    assert later.release == ("s0", "s1")


def test_the_burst_reserve_is_for_burst_work_only() -> None:
    assert usable_gpus(10, 4, partition=Partition.BURST) == 10
    assert usable_gpus(10, 4, partition="training") == 6
    assert usable_gpus(3, 4, partition=Partition.DEV) == 0


def test_the_simulation_scales_out_exactly_as_the_shared_rule_says(monkeypatch: pytest.MonkeyPatch) -> None:
    measure_from = SMALL.start + SMALL.warmup_days * 86400
    chosen: list[str] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        decision = reactive_scale_out(*args, **kwargs)
        if kwargs["now"] >= measure_from:
            chosen.extend(decision.activate)
        return decision

    jobs = generate_jobs(SMALL)
    monkeypatch.setattr(sim_prescale, "reactive_scale_out", recording)
    result = simulate_prescale(SMALL, "reactive", jobs)
    assert result.activations == len(chosen) > 0
    # A rule that never switches anything on leaves the burst waiting for the base fleet.
    monkeypatch.setattr(sim_prescale, "reactive_scale_out",
                        lambda *a, **k: reactive_scale_out([], *a[1:], **k))
    frozen = simulate_prescale(SMALL, "reactive", jobs)
    assert frozen.activations == 0 and frozen.standby_node_hours == 0
    assert frozen.burst_wait_mean_s > result.burst_wait_mean_s


def test_the_simulation_scales_in_as_the_shared_rule_says(monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = generate_jobs(SMALL)
    result = simulate_prescale(SMALL, "reactive", jobs)
    monkeypatch.setattr(sim_prescale, "scale_in", lambda *a, **k: ScaleIn((), ()))
    never = simulate_prescale(SMALL, "reactive", jobs)
    assert never.standby_node_hours > result.standby_node_hours
    assert never.activations <= result.activations
