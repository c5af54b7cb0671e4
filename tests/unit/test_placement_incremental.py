"""The resident engine's per-node caches decide exactly what the full computation decides.

``Placer(..., incremental=False)`` recomputes every mask, count and score over the whole fleet
per decision (the reference path); the default engine keeps per-node results between decisions
and recomputes only the nodes that changed (``gpusched/placement/incremental.py``). Both are run
side by side on seeded synthetic fleets and request streams — commits, releases, uncommitted
batches, reservations behind running tasks, host CPU/RAM, degraded / unhealthy / cordoned
devices, a node of mixed models — and every plan must be identical: devices, shares, scores and
rejection reasons.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from _placement_support import no_quota_on

from gpusched.model import Device, DeviceShare, FleetSnapshot, Health
from gpusched.node_builder import make_node
from gpusched.placement import Assignment, PendingTask, PlacementPlan, Placer, Policy, RunningTask
from gpusched.placement import filter as flt
from gpusched.placement.incremental import Incremental
from gpusched.placement.index import FreeState, fleet_index
from gpusched.placement.topology import node_counts
from gpusched.request import GPURequest
from gpusched.testing import synthetic_fleet, synthetic_requests

_CRITICAL = GPURequest.from_dict(
    {"gpus": 8, "interconnect": "island", "priority": "critical", "expected_duration": 3600}
)


def _plan(plan: PlacementPlan) -> tuple[list[Any], list[Any], list[Any]]:
    return (
        [(a.key, a.shares, a.score) for a in plan.assignments],
        [(r.key, r.reason, r.permanent) for r in plan.rejections],
        [(r.key, r.shares, r.start) for r in plan.reservations],
    )


def _with_faults(fleet: FleetSnapshot, rng: random.Random) -> FleetSnapshot:
    """Some devices DEGRADED, UNHEALTHY or cordoned, one node cordoned, and one node whose
    second half is another model (a node of mixed models), usage kept."""
    nodes = []
    for n, node in enumerate(fleet.nodes):
        devices = []
        for dev in node.devices:
            roll = rng.random()
            if roll < 0.05:
                dev = dataclasses.replace(dev, health=Health.DEGRADED)
            elif roll < 0.07:
                dev = dataclasses.replace(dev, health=Health.UNHEALTHY)
            elif roll < 0.09:
                dev = dataclasses.replace(dev, cordoned=True)
            devices.append(dev)
        node = dataclasses.replace(node, devices=tuple(devices), cordoned=n == 3)
        if n == 5:
            other = make_node(node.name, "L40S", len(node.devices), rack=node.rack)
            half = len(node.devices) // 2
            mixed = node.devices[:half] + tuple(
                dataclasses.replace(d, uuid=d.uuid + "-b") for d in other.devices[half:]
            )
            node = dataclasses.replace(node, devices=mixed)
        nodes.append(node)
    known = {d.uuid for node in nodes for d in node.devices}
    usage = {u: v for u, v in fleet.usage.items() if u in known}
    return FleetSnapshot(tuple(nodes), usage, source="synthetic")


def _with_host(tasks: list[PendingTask], rng: random.Random) -> list[PendingTask]:
    out = []
    for t in tasks:
        if rng.random() < 0.3:
            cpu = rng.choice((4_000, 16_000, 48_000))
            t = dataclasses.replace(t, cpu_milli=cpu, host_memory_bytes=64 << 30)
        out.append(t)
    return out


def _run_stream(
    placer: Placer, tasks: list[PendingTask], seed: int
) -> list[tuple[list[Any], list[Any], list[Any]]]:
    """Decide ``tasks`` one by one (committing), releasing random running tasks, with an
    uncommitted batch and a batch behind running tasks (critical tasks reserve) every 40."""
    rng = random.Random(seed)
    out = []
    live: list[tuple[Assignment, PendingTask]] = []
    for i, task in enumerate(tasks):
        plan = placer.place(no_quota_on(placer, [task], now=task.submitted_at, seed=i))
        out.append(_plan(plan))
        live.extend((a, task) for a in plan.assignments)
        if live and rng.random() < 0.45:
            a, t = live.pop(rng.randrange(len(live)))
            placer.release(a.shares, cpu_milli=t.cpu_milli, host_memory_bytes=t.host_memory_bytes)
        if i % 40 == 39:
            batch = synthetic_requests(16, seed=10_000 + seed * 100 + i, start=task.submitted_at)
            request = no_quota_on(placer, batch, now=task.submitted_at, seed=i)
            out.append(_plan(placer.place(request, commit=False)))
            running = [
                RunningTask(a.key, GPURequest(), a.shares, 0.0, task.submitted_at + 60.0 * j)
                for j, (a, _) in enumerate(live[:24])
            ]
            critical = [  # large critical tasks that wait reserve the devices freed first
                PendingTask(f"crit-{i}-{j}", _CRITICAL, task.submitted_at) for j in range(6)
            ]
            behind = no_quota_on(placer, critical + batch[4:], now=task.submitted_at, running=running, seed=i)
            out.append(_plan(placer.place(behind)))
    return out


@pytest.mark.parametrize(
    "policy_name", ["gpusched", "fgd", "fgd-lookahead", "best-fit", "first-fit", "random"]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_engine_decides_like_the_full_computation(policy_name: str, seed: int) -> None:
    rng = random.Random(seed)
    fleet = synthetic_fleet(rng.choice((40, 120)), 8, seed, used_fraction=(0.2, 0.5, 0.7)[seed])
    tasks = synthetic_requests(160, seed=seed)
    policy = Policy.named(policy_name)
    reference = _run_stream(Placer(fleet, policy, incremental=False), tasks, seed)
    assert _run_stream(Placer(fleet, policy), tasks, seed) == reference
    assert sum(len(assigned) for assigned, _, _ in reference) > 100  # the stream does place work
    if policy.reservations and seed == 0:
        assert any(reserved for _, _, reserved in reference)  # and critical tasks do reserve


@pytest.mark.parametrize("seed", [0, 1])
def test_incremental_engine_with_faults_host_resources_and_mixed_nodes(seed: int) -> None:
    rng = random.Random(seed)
    fleet = _with_faults(synthetic_fleet(60, 8, seed, used_fraction=0.35), rng)
    tasks = _with_host(synthetic_requests(160, seed=seed), rng)
    for policy_name in ("gpusched", "best-fit"):
        policy = Policy.named(policy_name)
        reference = _run_stream(Placer(fleet, policy, incremental=False), tasks, seed)
        assert _run_stream(Placer(fleet, policy), tasks, seed) == reference


def test_change_stamps_tell_a_copy_from_its_original() -> None:
    fleet = synthetic_fleet(4, 8, 0, used_fraction=0.0)
    state = FreeState(fleet_index(fleet), fleet)
    share = (fleet.nodes[1].devices[0],)
    copy = state.copy()
    copy.apply([_share(share[0])])
    assert copy.node_stamp[1] != state.node_stamp[1]
    state.apply([_share(share[0])])  # the same change on the original takes another stamp
    assert copy.node_stamp[1] != state.node_stamp[1]
    assert (copy.node_stamp[[0, 2, 3]] == state.node_stamp[[0, 2, 3]]).all()


def _share(device: Device) -> DeviceShare:
    return DeviceShare(device.uuid, device.node, device.index, 1000, device.memory_bytes)


def test_whole_counts_follow_the_state_and_recompute_only_changed_nodes() -> None:
    fleet = synthetic_fleet(50, 8, 3, used_fraction=0.3)
    index = fleet_index(fleet)
    elig = flt.eligibility(index, GPURequest(), fractional=False, fractions_need_partitioning=True)
    state = FreeState(index, fleet)
    inc = Incremental(index)
    inc.whole_counts(elig, state)
    free = [d for d in fleet.nodes[7].devices if state.free_milli[index.pos[d.uuid]] == 1000]
    state.apply([_share(free[0])])
    entry = inc._whole[id(elig)]
    assert list(entry.dirty(state)) == [7]
    got = inc.whole_counts(elig, state)
    fits = elig.usable & (state.free_milli >= 1000) & (state.free_mem >= index.dev_mem)
    want = node_counts(index, fits, 2)
    for name in ("count", "island", "numa", "switch"):
        assert (getattr(got, name) == getattr(want, name)).all(), name
    assert len(entry.dirty(state)) == 0
