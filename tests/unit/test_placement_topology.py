"""Topology preference, interconnect constraints and multi-node gangs."""

from __future__ import annotations

from _placement_support import no_quota

from gpusched.model import MILLI, DeviceShare, FleetSnapshot
from gpusched.node_builder import make_node
from gpusched.placement import PendingTask, Policy, place
from gpusched.request import GPURequest


def _task(key: str = "t", **kwargs: object) -> PendingTask:
    return PendingTask(key, GPURequest.from_dict(kwargs), 0.0)


def _busy(snap: FleetSnapshot, node: str, indexes: list[int]) -> FleetSnapshot:
    devs = [d for d in snap.node(node).devices if d.index in indexes]
    return snap.with_usage(DeviceShare(d.uuid, d.node, d.index, MILLI, d.memory_bytes) for d in devs)


def test_two_gpu_job_lands_inside_one_nvlink_island() -> None:
    # Islands {0-3} and {4-7}; 0,1,2 and 7 busy: free are 3 | 4,5,6. A local pair is 4+5/5+6.
    snap = _busy(FleetSnapshot((make_node("n", "A100-SXM-80GB", 8),)), "n", [0, 1, 2, 7])
    plan = place(no_quota([_task(gpus=2)], snap, Policy.named("gpusched"), now=0.0))
    indexes = sorted(s.index for s in plan.assignments[0].shares)
    assert all(4 <= i <= 6 for i in indexes)


def test_two_gpu_pcie_job_stays_on_one_numa_node_and_switch() -> None:
    # PCIe model: switch pairs (0,1) (2,3) (4,5) (6,7); NUMA 0 = 0-3. Busy 0, 2, 5: free pairs on
    # one switch: (6,7). A spread would be e.g. (1,3).
    snap = _busy(FleetSnapshot((make_node("n", "L40S", 8),)), "n", [0, 2, 5])
    plan = place(no_quota([_task(gpus=2)], snap, Policy.named("gpusched"), now=0.0))
    assert sorted(s.index for s in plan.assignments[0].shares) == [6, 7]


def test_island_constraint_is_honoured_even_by_first_fit() -> None:
    snap = _busy(FleetSnapshot((make_node("n", "A100-SXM-80GB", 8),)), "n", [0])
    plan = place(no_quota([_task(gpus=4, interconnect="island")], snap, Policy.named("first-fit"), now=0.0))
    assert sorted(s.index for s in plan.assignments[0].shares) == [4, 5, 6, 7]


def test_same_numa_constraint() -> None:
    snap = _busy(FleetSnapshot((make_node("n", "L40S", 8),)), "n", [0, 4])
    plan = place(no_quota([_task(gpus=3, interconnect="same_numa")], snap, Policy.named("gpusched"), now=0.0))
    numa = {snap.device(s.uuid).numa_node for s in plan.assignments[0].shares}
    assert len(numa) == 1
    plan = place(no_quota([_task(gpus=4, interconnect="same_numa")], snap, Policy.named("gpusched"), now=0.0))
    assert "largest free set in one NUMA node: 3" in plan.rejections[0].reason


def test_prefers_the_node_that_keeps_whole_islands_free() -> None:
    # n1 has a broken island (3 free of 4) + a whole one; n2 is empty. A 2-GPU job should go to
    # the broken island of n1 rather than cut into n2's fresh islands or n1's whole one.
    snap = FleetSnapshot((make_node("n1", "A100-SXM-80GB", 8), make_node("n2", "A100-SXM-80GB", 8)))
    snap = _busy(snap, "n1", [0])
    plan = place(no_quota([_task(gpus=2)], snap, Policy.named("gpusched"), now=0.0))
    shares = plan.assignments[0].shares
    assert {s.node for s in shares} == {"n1"}
    assert all(1 <= s.index <= 3 for s in shares)


def test_multi_node_gang_within_one_rack_all_or_nothing() -> None:
    nodes = tuple(
        make_node(f"r{r}n{i}", "H100-SXM-80GB", 8, rack=f"rack{r}") for r in range(2) for i in range(2)
    )
    snap = FleetSnapshot(nodes)
    snap = _busy(snap, "r0n0", [0])  # rack0 has 15 free, rack1 16
    plan = place(no_quota([_task(gpus=16, interconnect="same_rack")],
        snap, Policy.named("gpusched"), now=0.0))
    shares = plan.assignments[0].shares
    assert len(shares) == 16 and len({s.uuid for s in shares}) == 16
    assert {snap.node(s.node).rack for s in shares} == {"rack1"}
    # 17 devices in one rack never exist: permanent; 24 over racks with interconnect=any: placed.
    plan = place(no_quota([_task(gpus=17, interconnect="same_rack")],
        snap, Policy.named("gpusched"), now=0.0))
    assert plan.rejections[0].permanent and "largest rack has only 16" in plan.rejections[0].reason
    plan = place(no_quota([_task(gpus=24, interconnect="any")], snap, Policy.named("gpusched"), now=0.0))
    assert len(plan.assignments[0].shares) == 24
    # 32 > 31 free: rejected now, nothing half-assigned.
    plan = place(no_quota([_task(gpus=32, interconnect="any")], snap, Policy.named("gpusched"), now=0.0))
    assert not plan.assignments and not plan.rejections[0].permanent
    assert "31 free in the fleet" in plan.rejections[0].reason


def test_same_node_gang_never_spans_nodes() -> None:
    snap = FleetSnapshot((make_node("a", "T4", 2), make_node("b", "T4", 2)))
    plan = place(no_quota([_task(gpus=3)], snap, Policy.named("gpusched"), now=0.0))
    assert not plan.assignments and plan.rejections[0].permanent


def test_node_counts_match_a_direct_count_on_irregular_topologies() -> None:
    import random
    from dataclasses import replace

    import numpy as np

    from gpusched.model import Node
    from gpusched.placement.index import fleet_index
    from gpusched.placement.topology import node_counts

    rng = random.Random(3)
    nodes = []
    for n in range(12):
        base = make_node(f"n{n}", "A100-SXM-80GB", rng.choice((0, 1, 3, 8)))
        devs = tuple(
            replace(
                d,
                island=rng.choice((None, "x", "y")),  # interleaved, sometimes absent
                numa_node=rng.choice((-1, 0, 1)),
                pcie_switch=rng.choice((None, "s0", "s1")),
            )
            for d in base.devices
        )
        nodes.append(Node(base.name, f"rack{n % 3}", devs))
    index = fleet_index(FleetSnapshot(tuple(nodes)))
    for _ in range(20):
        fits = np.array([rng.random() < 0.6 for _ in range(index.n_devices)], dtype=bool)
        got = node_counts(index, fits, 2)
        for n, node in enumerate(nodes):
            on = [d for i, d in zip(index.node_devices(n), node.devices, strict=True) if fits[i]]
            assert got.count[n] == len(on)
            for attr, level in (("island", "island"), ("numa_node", "numa"), ("pcie_switch", "switch")):
                keys = [getattr(d, attr) for d in on if getattr(d, attr) not in (None,)]
                best = max((keys.count(k) for k in set(keys)), default=0)
                assert getattr(got, level)[n] == best, (n, level)
